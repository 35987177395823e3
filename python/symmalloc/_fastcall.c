/* symmalloc._fastcall: the eager all-reduce's call into libsymmalloc without ctypes.
 *
 * A ctypes call costs about 1.2 us of host time (argument conversion, a libffi call frame, the
 * GIL released and taken back); this METH_FASTCALL function costs a few tens of ns. It holds
 * the GIL across the call, as a PyTorch op does: symm_all_reduce_algo only enqueues work (its
 * one blocking step, a first-use segment exchange, is bounded by SYMMALLOC_TIMEOUT_S).
 *
 * It links nothing: the package hands it the address of symm_all_reduce_algo from the library
 * it loaded with ctypes (bind), so both paths call the same library. Limited API (3.10+), so one
 * build serves every CPython the wheel supports.
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

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "bind(address): the symm_all_reduce_algo to call."},
    {"all_reduce", (PyCFunction)(void (*)(void))all_reduce, METH_FASTCALL,
     "all_reduce(comm, algo, send, recv, count, dtype, op, stream) -> status"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcall",
                                    "symm_all_reduce_algo without ctypes (see _fastcall.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastcall(void) { return PyModule_Create(&module); }
