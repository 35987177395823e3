/* symmalloc._fastcall: the eager all-reduce's call into libsymmalloc without ctypes or a Python
 * frame.
 *
 * Two levels:
 *   all_reduce(comm, algo, send, recv, count, dtype, op, stream): symm_all_reduce_algo with its
 *     arguments as ints (a METH_FASTCALL function: a few tens of ns against ctypes' ~1.2 us).
 *   eager(...) -> caller: what Communicator.all_reduce(tensor, op="sum", algo="auto", out=None)
 *     does, in C: the tensor's dtype, contiguity, pointer, size, device and current stream are
 *     read through torch.Tensor's own method descriptors (no bound-method objects, no bytecode),
 *     then the library is called. Anything but an exact torch.Tensor with a supported dtype, on
 *     the communicator's device, and known op/algo names, or a closed communicator, goes to the
 *     Python fallback, which raises
 *     the same errors as before; so the fast path never decides an error itself.
 *
 * Both hold the GIL across the call, as a PyTorch op does: symm_all_reduce_algo only enqueues
 * work (its one blocking step, a first-use segment exchange, is bounded by SYMMALLOC_TIMEOUT_S).
 *
 * It links nothing: the package hands it the address of symm_all_reduce_algo from the library
 * it loaded with ctypes (bind), so both paths call the same library. Limited API (3.10+), so one
 * build serves every CPython the wheel supports.
 *
 * Invariants: a caller's state owns a reference to every object it holds and is freed with its
 * capsule; `comm` is NULL once invalidate() ran (Communicator.close calls it before destroying
 * the communicator), and a NULL comm always takes the fallback.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*all_reduce_fn)(void *comm, uint32_t algo, const void *send, void *recv, size_t count,
                             uint32_t dtype, uint32_t op, void *stream);

static all_reduce_fn g_all_reduce = NULL;

/* bind(address: int) -> None: the symm_all_reduce_algo to call. */
static PyObject *bind(PyObject *self, PyObject *address) {
  (void)self;
  void *p = PyLong_AsVoidPtr(address);
  if (p == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "bind: the address of symm_all_reduce_algo must not be 0");
    return NULL;
  }
  g_all_reduce = (all_reduce_fn)p;
  Py_RETURN_NONE;
}

static uint32_t small(PyObject *o, const char *what) {
  unsigned long v = PyLong_AsUnsignedLong(o);
  if (v == (unsigned long)-1 && PyErr_Occurred()) return 0;
  if (v > UINT32_MAX) {
    PyErr_Format(PyExc_OverflowError, "all_reduce: %s = %lu does not fit in 32 bits", what, v);
    return 0;
  }
  return (uint32_t)v;
}

/* all_reduce(comm, algo, send, recv, count, dtype, op, stream) -> status: the arguments of
 * symm_all_reduce_algo as Python ints (pointers as addresses). */
static PyObject *all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 8) {
    PyErr_Format(PyExc_TypeError, "all_reduce takes 8 arguments (comm, algo, send, recv, count, dtype, op, stream), got %zd", nargs);
    return NULL;
  }
  if (g_all_reduce == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "all_reduce: bind() was not called");
    return NULL;
  }
  void *comm = PyLong_AsVoidPtr(args[0]);
  uint32_t algo = small(args[1], "algo");
  void *send = PyLong_AsVoidPtr(args[2]);
  void *recv = PyLong_AsVoidPtr(args[3]);
  size_t count = PyLong_AsSize_t(args[4]);
  uint32_t dtype = small(args[5], "dtype");
  uint32_t op = small(args[6], "op");
  void *stream = PyLong_AsVoidPtr(args[7]);
  if (PyErr_Occurred()) return NULL;
  return PyLong_FromLong(g_all_reduce(comm, algo, send, recv, count, dtype, op, stream));
}

/* ------------------------------------------------------------------ the tensor-level caller */

typedef struct {
  void *comm;          /* symm_comm_t *, NULL once invalidated */
  PyObject *handle;    /* Communicator.handle, the fallback's first argument */
  PyObject *fallback;  /* fallback(handle, *args, **kwargs): the Python wrapper */
  PyObject *check;     /* check(status): raises the status' SymmallocError */
  PyObject *tensor_type;
  PyObject *dtypes[3]; /* torch dtype objects, compared by identity */
  uint32_t dtype_codes[3];
  PyObject *ops, *algos; /* name -> code dicts */
  PyObject *raw_stream;  /* device -> current stream address */
  long device;           /* the get_device() every tensor must have (-1: CPU, the host backend) */
  PyObject *is_contiguous, *data_ptr, *numel, *get_device; /* method descriptors of torch.Tensor */
} eager_state;

static const char *const CAPSULE = "symmalloc._fastcall.eager_state";
static PyObject *s_dtype = NULL; /* interned "dtype" */

static void eager_state_free(PyObject *capsule) {
  eager_state *st = (eager_state *)PyCapsule_GetPointer(capsule, CAPSULE);
  if (st == NULL) return;
  Py_XDECREF(st->handle);
  Py_XDECREF(st->fallback);
  Py_XDECREF(st->check);
  Py_XDECREF(st->tensor_type);
  for (int i = 0; i < 3; i++) Py_XDECREF(st->dtypes[i]);
  Py_XDECREF(st->ops);
  Py_XDECREF(st->algos);
  Py_XDECREF(st->raw_stream);
  Py_XDECREF(st->is_contiguous);
  Py_XDECREF(st->data_ptr);
  Py_XDECREF(st->numel);
  Py_XDECREF(st->get_device);
  PyMem_Free(st);
}

/* The Python wrapper with the caller's own arguments: fallback(handle, *args, **kwargs). */
static PyObject *fall_back(eager_state *st, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *tuple = PyTuple_New(nargs + 1), *kwargs = NULL, *res = NULL;
  if (tuple == NULL) return NULL;
  Py_INCREF(st->handle);
  PyTuple_SetItem(tuple, 0, st->handle);
  for (Py_ssize_t i = 0; i < nargs; i++) {
    Py_INCREF(args[i]);
    PyTuple_SetItem(tuple, i + 1, args[i]);
  }
  Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
  if (nkw > 0) {
    kwargs = PyDict_New();
    if (kwargs == NULL) goto done;
    for (Py_ssize_t i = 0; i < nkw; i++)
      if (PyDict_SetItem(kwargs, PyTuple_GetItem(kwnames, i), args[nargs + i]) < 0) goto done;
  }
  res = PyObject_Call(st->fallback, tuple, kwargs);
done:
  Py_DECREF(tuple);
  Py_XDECREF(kwargs);
  return res;
}

/* method(tensor) through a method descriptor: NULL with an exception on error. */
static PyObject *call1(PyObject *method, PyObject *tensor) {
  return PyObject_CallFunctionObjArgs(method, tensor, NULL);
}

/* The dtype index of t (0..2), -1 when unsupported, -2 with an exception set. */
static int dtype_index(eager_state *st, PyObject *t) {
  PyObject *dt = PyObject_GetAttr(t, s_dtype);
  if (dt == NULL) return -2;
  int found = -1;
  for (int i = 0; i < 3; i++)
    if (dt == st->dtypes[i]) found = i;
  Py_DECREF(dt);
  return found;
}

/* 1 when t is contiguous, 0 when not, -1 with an exception set. */
static int contiguous(eager_state *st, PyObject *t) {
  PyObject *r = call1(st->is_contiguous, t);
  if (r == NULL) return -1;
  int yes = r == Py_True;
  Py_DECREF(r);
  return yes;
}

/* A code from a name dict; 1 on success, 0 when the name is unknown (the fallback names it). */
static int code_of(PyObject *dict, PyObject *name, uint32_t *code) {
  if (name == NULL || name == Py_None) return 1; /* the default, code 0 */
  PyObject *v = PyDict_GetItem(dict, name);      /* borrowed; swallows unhashable names */
  if (v == NULL) return 0;
  *code = (uint32_t)PyLong_AsUnsignedLong(v);
  return !PyErr_Occurred();
}

static PyObject *eager_call(PyObject *capsule, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  eager_state *st = (eager_state *)PyCapsule_GetPointer(capsule, CAPSULE);
  if (st == NULL) return NULL;
  /* (tensor, op="sum", algo="auto", out=None), positional or by name. */
  PyObject *slot[4] = {NULL, NULL, NULL, NULL};
  static const char *const names[4] = {"tensor", "op", "algo", "out"};
  if (nargs < 1 || nargs > 4 || st->comm == NULL) return fall_back(st, args, nargs, kwnames);
  for (Py_ssize_t i = 0; i < nargs; i++) slot[i] = args[i];
  Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
  for (Py_ssize_t i = 0; i < nkw; i++) {
    PyObject *key = PyTuple_GetItem(kwnames, i);
    int at = -1;
    for (int k = 1; k < 4; k++)
      if (PyUnicode_CompareWithASCIIString(key, names[k]) == 0) at = k;
    if (at < 0 || slot[at] != NULL) return fall_back(st, args, nargs, kwnames);
    slot[at] = args[nargs + i];
  }
  PyObject *t = slot[0], *out = slot[3] == Py_None ? NULL : slot[3];
  uint32_t op = 0, algo = 0;
  if (Py_TYPE(t) != (PyTypeObject *)st->tensor_type || !code_of(st->ops, slot[1], &op) ||
      !code_of(st->algos, slot[2], &algo))
    goto slow;
  int di = dtype_index(st, t);
  if (di == -2) return NULL;
  if (di < 0) goto slow;
  int c = contiguous(st, t);
  if (c < 0) return NULL;
  if (!c) goto slow;
  PyObject *dst = t;
  if (out != NULL) {
    if (Py_TYPE(out) != (PyTypeObject *)st->tensor_type) goto slow;
    int odi = dtype_index(st, out);
    if (odi == -2) return NULL;
    if (odi != di) goto slow;
    int oc = contiguous(st, out);
    if (oc < 0) return NULL;
    if (!oc) goto slow;
    dst = out;
  }
  PyObject *n = call1(st->numel, t);
  if (n == NULL) return NULL;
  size_t count = PyLong_AsSize_t(n);
  Py_DECREF(n);
  if (out != NULL) {
    PyObject *on = call1(st->numel, out);
    if (on == NULL) return NULL;
    size_t ocount = PyLong_AsSize_t(on);
    Py_DECREF(on);
    if (ocount != count) goto slow;
  }
  PyObject *p = call1(st->data_ptr, t);
  if (p == NULL) return NULL;
  void *send = PyLong_AsVoidPtr(p);
  Py_DECREF(p);
  void *recv = send;
  if (out != NULL) {
    PyObject *q = call1(st->data_ptr, out);
    if (q == NULL) return NULL;
    recv = PyLong_AsVoidPtr(q);
    Py_DECREF(q);
  }
  if (out != NULL) { /* the input's device too (dst's is read below) */
    PyObject *td = call1(st->get_device, t);
    if (td == NULL) return NULL;
    long tdev = PyLong_AsLong(td);
    Py_DECREF(td);
    if (tdev != st->device) goto slow;
  }
  PyObject *d = call1(st->get_device, dst);
  if (d == NULL) return NULL;
  long dev = PyLong_AsLong(d);
  if (dev != st->device) {
    Py_DECREF(d);
    goto slow;
  }
  void *stream = NULL;
  if (dev >= 0) {
    PyObject *s = PyObject_CallFunctionObjArgs(st->raw_stream, d, NULL);
    Py_DECREF(d);
    if (s == NULL) return NULL;
    stream = PyLong_AsVoidPtr(s);
    Py_DECREF(s);
  } else {
    Py_DECREF(d);
  }
  if (PyErr_Occurred()) return NULL;
  int status = g_all_reduce(st->comm, algo, send, recv, count, st->dtype_codes[di], op, stream);
  if (status != 0) {
    PyObject *r = PyObject_CallFunction(st->check, "i", status);
    if (r == NULL) return NULL;
    Py_DECREF(r);
  }
  Py_RETURN_NONE;
slow:
  if (PyErr_Occurred()) return NULL;
  return fall_back(st, args, nargs, kwnames);
}

static PyMethodDef eager_def = {
    "all_reduce", (PyCFunction)(void (*)(void))eager_call, METH_FASTCALL | METH_KEYWORDS,
    "all_reduce(tensor, op='sum', algo='auto', out=None) -> None\n\n"
    "All-reduce of a contiguous CUDA tensor on the current stream, in place or into out\n"
    "(Communicator.all_reduce, with its checks and its errors; compiled: see symmalloc/_fastcall.c)."};

/* eager(handle, comm, fallback, check, tensor_type, dtypes, ops, algos, raw_stream, device)
 * -> caller. dtypes: ((dtype, code), ...) for exactly three dtypes; device: the get_device()
 * of the tensors it takes (the communicator's GPU, or -1 for CPU tensors on the host backend). */
static PyObject *eager(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 10) {
    PyErr_Format(PyExc_TypeError, "eager takes 10 arguments, got %zd", nargs);
    return NULL;
  }
  if (g_all_reduce == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "eager: bind() was not called");
    return NULL;
  }
  if (!PyTuple_Check(args[5]) || PyTuple_Size(args[5]) != 3 || !PyDict_Check(args[6]) || !PyDict_Check(args[7]) ||
      !PyType_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "eager: expected a type, a 3-tuple of (dtype, code) and two dicts");
    return NULL;
  }
  if (s_dtype == NULL && (s_dtype = PyUnicode_InternFromString("dtype")) == NULL) return NULL;
  eager_state *st = (eager_state *)PyMem_Calloc(1, sizeof(eager_state));
  if (st == NULL) return PyErr_NoMemory();
  PyObject *capsule = PyCapsule_New(st, CAPSULE, eager_state_free);
  if (capsule == NULL) {
    PyMem_Free(st);
    return NULL;
  }
  st->comm = PyLong_AsVoidPtr(args[1]);
  if (st->comm == NULL && PyErr_Occurred()) goto fail;
  PyObject **own[] = {&st->handle, &st->fallback, &st->check, &st->tensor_type};
  for (int i = 0; i < 4; i++) {
    *own[i] = args[i == 0 ? 0 : i + 1];
    Py_INCREF(*own[i]);
  }
  for (int i = 0; i < 3; i++) {
    PyObject *pair = PyTuple_GetItem(args[5], i);
    if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2) {
      PyErr_SetString(PyExc_TypeError, "eager: dtypes must be (dtype, code) pairs");
      goto fail;
    }
    st->dtypes[i] = PyTuple_GetItem(pair, 0);
    Py_INCREF(st->dtypes[i]);
    st->dtype_codes[i] = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GetItem(pair, 1));
    if (PyErr_Occurred()) goto fail;
  }
  st->ops = args[6];
  Py_INCREF(st->ops);
  st->algos = args[7];
  Py_INCREF(st->algos);
  st->raw_stream = args[8];
  Py_INCREF(st->raw_stream);
  st->device = PyLong_AsLong(args[9]);
  if (st->device == -1 && PyErr_Occurred()) goto fail;
  const char *methods[4] = {"is_contiguous", "data_ptr", "numel", "get_device"};
  PyObject **slots[4] = {&st->is_contiguous, &st->data_ptr, &st->numel, &st->get_device};
  for (int i = 0; i < 4; i++)
    if ((*slots[i] = PyObject_GetAttrString(st->tensor_type, methods[i])) == NULL) goto fail;
  PyObject *fn = PyCFunction_New(&eager_def, capsule);
  Py_DECREF(capsule);
  return fn;
fail:
  Py_DECREF(capsule);
  return NULL;
}

/* invalidate(caller) -> None: the communicator is closing; every later call takes the fallback. */
static PyObject *invalidate(PyObject *self, PyObject *caller) {
  (void)self;
  PyObject *capsule = PyCFunction_GetSelf(caller);
  if (capsule == NULL || !PyCapsule_IsValid(capsule, CAPSULE)) {
    PyErr_SetString(PyExc_TypeError, "invalidate: expected a caller made by eager()");
    return NULL;
  }
  ((eager_state *)PyCapsule_GetPointer(capsule, CAPSULE))->comm = NULL;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "bind(address): the symm_all_reduce_algo to call."},
    {"all_reduce", (PyCFunction)(void (*)(void))all_reduce, METH_FASTCALL,
     "all_reduce(comm, algo, send, recv, count, dtype, op, stream) -> status"},
    {"eager", (PyCFunction)(void (*)(void))eager, METH_FASTCALL,
     "eager(handle, comm, fallback, check, tensor_type, dtypes, ops, algos, raw_stream, device) -> caller"},
    {"invalidate", invalidate, METH_O, "invalidate(caller): every later call takes the fallback."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcall",
                                    "symm_all_reduce_algo without ctypes (see _fastcall.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastcall(void) { return PyModule_Create(&module); }
