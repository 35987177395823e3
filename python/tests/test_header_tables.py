"""The package's mirrors of the C ABI against include/symmalloc.h: symmalloc._lib's tables (STATUS,
_DTYPES, _OPS, _ALGOS, _QUANTS, _STATS, expert parallelism's constants, structs and prototypes),
every ctypes struct of the package field by field (name, type, order, offset, size: the offsets
and sizes from a C compiler given the header), every constant, and the argument types of every
symm_* function the package binds. The header is the package's copy (the wheel carries it in
symmalloc/include/) or, in a checkout, include/symmalloc.h."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

import symmalloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGED = os.path.join(os.path.dirname(os.path.abspath(symmalloc.__file__)), "include", "symmalloc.h")
HEADER = _PACKAGED if os.path.isfile(_PACKAGED) else os.path.join(ROOT, "include", "symmalloc.h")


def test_the_header_is_there():
    """The wheel carries the header (setup.py); a checkout has include/symmalloc.h."""
    assert os.path.isfile(HEADER), f"neither {_PACKAGED} nor a checkout's include/symmalloc.h"


@pytest.fixture(scope="module")
def header():
    with open(HEADER) as f:
        return f.read()


def _defines(text, prefix):
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"^#define {prefix}(\w+) (-?\d+)\s*$", text, re.M)}


def test_status_codes(header):
    body = re.search(r"typedef enum \{(.*?)\} symm_status_t;", header, re.S).group(1)
    values = {name: int(v) for name, v in re.findall(r"(SYMM_\w+) = (\d+)", body)}
    assert sorted(values.values()) == list(range(len(values)))
    assert symmalloc.STATUS == sorted(values, key=values.get)


def test_dtypes_ops_and_algorithms(header):
    dtypes = _defines(header, "SYMM_")
    torch_names = {"BF16": "bfloat16", "FP16": "float16", "FP32": "float32"}
    assert symmalloc._DTYPES == {torch_names[k]: v for k, v in dtypes.items() if k in torch_names}
    assert set(torch_names) <= set(dtypes)
    assert symmalloc._OPS == {k.lower(): v for k, v in dtypes.items() if k in ("SUM", "MAX", "MIN")}
    assert {"SUM", "MAX", "MIN"} <= set(dtypes)
    algos = _defines(header, "SYMM_ALGO_")
    assert symmalloc._ALGOS == {k.lower(): v for k, v in algos.items()}
    quants = _defines(header, "SYMM_QUANT_FP8_")
    assert symmalloc._QUANTS == {k.lower(): v for k, v in quants.items()}
    assert len(quants) == 3


def test_stats_fields_in_order(header):
    body = re.search(r"typedef struct \{(.*?)\} symm_memory_stats_t;", header, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = re.findall(r"uint64_t (\w+);", body)
    assert symmalloc._STATS == fields
    assert len(re.findall(r";", body)) == len(fields), "a field that is not uint64_t"


def test_device_comm_struct_and_signal_constants(header):
    """symmalloc.p2p.DeviceComm against symm_device_comm_t, and its constants."""
    import ctypes

    from symmalloc import p2p

    defs = _defines(header, "SYMM_")
    assert p2p.SIGNAL_SLOTS == defs["SIGNAL_SLOTS"] and p2p.MAX_RANKS == defs["MAX_RANKS"]
    assert ctypes.sizeof(p2p.DeviceComm) == defs["DEVICE_COMM_V1_SIZE"]
    body = re.search(r"typedef struct \{([^{}]*?)\} symm_device_comm_t;", header, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = re.findall(r"(u?int\d+_t) (\w+)(\[SYMM_MAX_RANKS\])?;", body)
    ctypes_of = {"uint64_t": ctypes.c_uint64, "uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32}
    want = [(name, ctypes_of[t] * p2p.MAX_RANKS if arr else ctypes_of[t]) for t, name, arr in fields]
    assert [(n, t) for n, t in p2p.DeviceComm._fields_] == want


def _c_fields(header, name):
    """(field, ctypes type) of ``typedef struct { ... } name;``: pointers are c_void_p."""
    import ctypes

    body = re.search(r"typedef struct \{([^{}]*?)\} " + name + ";", header, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    scalars = {"uint64_t": ctypes.c_uint64, "uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32}
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)", decl)
        assert m, f"{name}: cannot read the field {decl!r}"
        typ, ptr, field = m.groups()
        fields.append((field, ctypes.c_void_p if ptr else scalars[typ]))
    return fields


def test_moe_constants_structs_and_prototypes(header):
    """Expert parallelism (symmalloc.moe over symm_moe_*): the payload and index codes, the
    struct versions and limits, symm_moe_config_t and symm_moe_layout_t field by field (name,
    type, order, size), and every symm_moe_* prototype's argument types."""
    import ctypes

    from symmalloc import _lib

    d = _defines(header, "SYMM_")
    assert {k: v for k, v in _lib._MOE_DTYPES.items() if k in ("bf16", "fp8")} == {
        "bf16": d["MOE_BF16"], "fp8": d["MOE_FP8_E4M3"]}
    assert _lib._MOE_DTYPES["bfloat16"] == d["MOE_BF16"] and _lib._MOE_DTYPES["float8_e4m3fn"] == d["MOE_FP8_E4M3"]
    assert _lib._INDEX_DTYPES == {"int32": d["INDEX_INT32"], "int64": d["INDEX_INT64"]}
    assert (_lib._MOE_CONFIG_VERSION, _lib._MOE_LAYOUT_VERSION) == (d["MOE_CONFIG_VERSION"], d["MOE_LAYOUT_VERSION"])
    assert _lib._MOE_TP_LAYOUT_VERSION == d["MOE_TP_LAYOUT_VERSION"]
    assert _lib._MOE_MODES == {"low_latency": d["MOE_LOW_LATENCY"], "throughput": d["MOE_THROUGHPUT"]}
    assert (_lib._MOE_MAX_TOPK, _lib._MOE_MAX_EXPERTS) == (d["MOE_MAX_TOPK"], d["MOE_MAX_EXPERTS"])
    structs = {"symm_moe_config_t": _lib._MoeConfig, "symm_moe_layout_t": _lib._MoeLayout,
               "symm_moe_tp_layout_t": _lib._MoeTpLayout}
    for name, struct in structs.items():
        assert [(n, t) for n, t in struct._fields_] == _c_fields(header, name), name
    # On x86-64 / aarch64 (LP64): 80 (config version 3), 152 (layout version 2) and 184 bytes (the
    # throughput layout, version 2), no padding (the library refuses another size).
    sizes = [ctypes.sizeof(s) for s in structs.values()]
    assert sizes == [80, 152, 184], sizes

    scalars = {"size_t": ctypes.c_size_t, "uint32_t": ctypes.c_uint32}
    protos = {}
    for ret, name, args in re.findall(r"^(\w+) (symm_moe_\w+)\((.*?)\);", header, re.M | re.S):
        assert ret == "symm_status_t", name
        types = []
        for arg in args.split(","):
            m = re.fullmatch(r"\s*(?:const\s+)?(?:struct\s+)?(\w+)\s*(\**)\s*\w+\s*", arg)
            assert m, f"{name}: cannot read the argument {arg!r}"
            typ, stars = m.groups()
            if stars == "**":
                types.append(ctypes.POINTER(ctypes.c_void_p))
            elif stars and typ in structs:
                types.append(ctypes.POINTER(structs[typ]))
            elif stars:
                types.append(ctypes.c_void_p)
            else:
                types.append(scalars[typ])
        assert protos.setdefault(name, types) == types, f"{name} is declared twice, differently"
    assert set(protos) == set(_lib._MOE_PROTOTYPES), (sorted(protos), sorted(_lib._MOE_PROTOTYPES))
    for name, types in protos.items():
        assert _lib._MOE_PROTOTYPES[name] == types, name


# ---- every struct, constant and bound prototype, generally ----

def _mirrors():
    """Header struct -> its Python mirror (None: no Python mirror; the C++ allocator includes the
    header itself). A struct added to the header must be named here."""
    from symmalloc import _lib, groups, p2p

    return {
        "symm_memory_stats_t": _lib._Stats, "symm_comm_info_t": groups.CommInfo,
        "symm_device_comm_t": p2p.DeviceComm, "symm_moe_config_t": _lib._MoeConfig,
        "symm_moe_layout_t": _lib._MoeLayout, "symm_moe_tp_layout_t": _lib._MoeTpLayout,
        "symm_unique_id_t": None,  # passed as a 128-byte buffer (c_char_p)
        "symm_stat_t": None, "symm_device_stats_t": None, "symm_block_info_t": None,
        "symm_segment_event_t": None,  # csrc/api.h
        "symm_export_chunk_t": None,  # csrc/ipc.h
    }


def _structs(header):
    return re.findall(r"typedef struct \{([^{}]*?)\} (\w+);", header, re.S)


def _struct_fields(body, defs):
    """(name, ctypes type) of a struct body: scalars, arrays of them, pointers as c_void_p."""
    scalars = {"uint64_t": ctypes.c_uint64, "uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32,
               "int64_t": ctypes.c_int64, "char": ctypes.c_char}
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    out = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)(?:\[(\w+)\])?", decl)
        assert m, f"cannot read the field {decl!r}"
        typ, ptr, name, n = m.groups()
        t = ctypes.c_void_p if ptr else scalars[typ]
        if n:
            t = t * (int(n) if n.isdigit() else defs[n])
        out.append((name, t))
    return out


def test_every_struct_is_mirrored_field_by_field(header):
    defs = {"SYMM_" + k: v for k, v in _defines(header, "SYMM_").items()}
    mirrors = _mirrors()
    names = [n for _, n in _structs(header)]
    assert set(names) == set(mirrors), f"structs of the header not classified here: {set(names) ^ set(mirrors)}"
    checked = 0
    for body, name in _structs(header):
        py = mirrors[name]
        if py is None:
            continue
        want = _struct_fields(body, defs)
        got = list(py._fields_)
        assert [n for n, _ in got] == [n for n, _ in want], f"{name}: field names or order"
        for (n, t), (_, w) in zip(got, want):
            assert ctypes.sizeof(t) == ctypes.sizeof(w) and getattr(t, "_type_", t) == getattr(w, "_type_", w), \
                f"{name}.{n}: {t} in Python, {w} in the header"
        checked += 1
    assert checked == 6


def _cc():
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.fixture(scope="module")
def compiled(header, tmp_path_factory):
    """What a C compiler says of the header: sizeof and offsetof of every field of every struct,
    and the value of every integer SYMM_* macro."""
    cc = _cc()
    if not cc:
        pytest.skip("no C compiler (cc) on PATH: the layout from the compiler is not checked here")
    lines = ['#include <stdio.h>', '#include <stddef.h>', f'#include "{HEADER}"', "int main(void) {"]
    for body, name in _structs(header):
        lines.append(f'  printf("{name} %zu\\n", sizeof({name}));')
        for field in re.findall(r"(\w+)(?:\[\w+\])?;", re.sub(r"/\*.*?\*/", "", body, flags=re.S)):
            lines.append(f'  printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    for macro in re.findall(r"^#define (SYMM\w+) ", header, re.M):
        lines.append(f'  printf("{macro} %lld\\n", (long long)({macro}));')
    lines.append("  return 0;\n}")
    d = tmp_path_factory.mktemp("abi")
    src, exe = d / "probe.c", d / "probe"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return dict((k, int(v)) for k, v in (line.split() for line in out.splitlines()))


def test_struct_offsets_and_sizes_are_the_compilers(compiled):
    for name, py in _mirrors().items():
        if py is None:
            continue
        assert ctypes.sizeof(py) == compiled[name], f"sizeof({name})"
        for field, _ in py._fields_:
            assert getattr(py, field).offset == compiled[f"{name}.{field}"], f"offsetof({name}, {field})"


def test_python_constants_are_the_headers(compiled):
    """Every constant the package keeps, against the compiler's value of its macro."""
    from symmalloc import _lib, groups, p2p

    pairs = {
        "SYMM_SPLIT_NOCOLOR": groups.SPLIT_NOCOLOR, "SYMM_SIGNAL_SLOTS": p2p.SIGNAL_SLOTS,
        "SYMM_MAX_RANKS": p2p.MAX_RANKS, "SYMM_SIGNAL_PAD_BYTES": p2p.SIGNAL_PAD_BYTES,
        "SYMM_DEVICE_COMM_V1_SIZE": ctypes.sizeof(p2p.DeviceComm),
        "SYMM_MEMORY_STATS_V1_SIZE": _lib._Stats.requested_bytes.offset,
        "SYMM_MOE_CONFIG_VERSION": _lib._MOE_CONFIG_VERSION, "SYMM_MOE_LAYOUT_VERSION": _lib._MOE_LAYOUT_VERSION,
        "SYMM_MOE_MAX_TOPK": _lib._MOE_MAX_TOPK, "SYMM_MOE_MAX_EXPERTS": _lib._MOE_MAX_EXPERTS,
        "SYMM_MOE_FLAG_PROBE": _lib._MOE_FLAG_PROBE, "SYMM_MOE_PROBE_WORDS": _lib._MOE_PROBE_WORDS,
        "SYMM_MOE_BF16": _lib._MOE_DTYPES["bf16"], "SYMM_MOE_FP8_E4M3": _lib._MOE_DTYPES["fp8"],
        "SYMM_INDEX_INT32": _lib._INDEX_DTYPES["int32"], "SYMM_INDEX_INT64": _lib._INDEX_DTYPES["int64"],
        "SYMM_MOE_INPUT_PAYLOAD": _lib._MOE_INPUTS["payload"], "SYMM_MOE_INPUT_BF16": _lib._MOE_INPUTS["bfloat16"],
        "SYMM_MOE_SCALES_ROW_MAJOR": _lib._MOE_SCALE_LAYOUTS["row"],
        "SYMM_MOE_SCALES_COL_TMA": _lib._MOE_SCALE_LAYOUTS["col_tma"],
        "SYMM_BF16": _lib._DTYPES["bfloat16"], "SYMM_FP16": _lib._DTYPES["float16"], "SYMM_FP32": _lib._DTYPES["float32"],
    }
    pairs.update({f"SYMM_{k.upper()}": v for k, v in _lib._OPS.items()})
    pairs.update({f"SYMM_ALGO_{k.upper()}": v for k, v in _lib._ALGOS.items()})
    pairs.update({f"SYMM_QUANT_FP8_{k.upper()}": v for k, v in _lib._QUANTS.items()})
    for macro, value in pairs.items():
        assert compiled[macro] == value, f"{macro} is {compiled[macro]} in the header, {value} in the package"


_SCALARS = {"int": ctypes.c_int, "size_t": ctypes.c_size_t, "uint64_t": ctypes.c_uint64,
            "uint32_t": ctypes.c_uint32, "float": ctypes.c_float, "symm_dtype_t": ctypes.c_uint32,
            "symm_op_t": ctypes.c_uint32, "symm_algo_t": ctypes.c_uint32, "symm_quant_t": ctypes.c_uint32,
            "symm_status_t": ctypes.c_int}


def _c_arg(t, structs):
    """The ctypes types the package may pass for header argument type ``t``."""
    t = t.strip()
    if t.endswith("**"):
        return (ctypes.POINTER(ctypes.c_void_p),)
    if t.endswith("*"):
        base = re.sub(r"\b(const|struct)\b", "", t[:-1]).strip()
        if base in ("char", "symm_unique_id_t"):  # a string; the id's 128 bytes as a buffer
            return (ctypes.c_char_p,)
        if structs.get(base) is not None:
            return (ctypes.POINTER(structs[base]),)
        if base in _SCALARS:  # an out integer, or an array passed by address
            return (ctypes.POINTER(_SCALARS[base]), ctypes.c_void_p)
        return (ctypes.c_void_p,)
    return (_SCALARS[t],)


def test_every_bound_prototype_is_the_headers(header):
    """The argtypes and restype the package sets on every symm_* function (symmalloc._lib, groups,
    p2p, moe) against the header's prototypes."""
    from symmalloc import _lib, groups, p2p

    lib = _lib._moe_library()
    groups._lib()
    p2p._lib()
    structs = _mirrors()
    flat = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    protos = {name: (ret, args) for ret, name, args in
              re.findall(r"^([\w ]+?\s*\**)\s*(symm_\w+)\((.*?)\);", flat, re.M | re.S)}
    checked = []
    for name, (ret, args) in protos.items():
        fn = getattr(lib, name, None)
        if fn is None or fn.argtypes is None:
            continue
        types = [] if args.strip() == "void" else [
            _c_arg(re.sub(r"\w+\s*$", "", a), structs) for a in args.split(",")]
        assert len(fn.argtypes) == len(types) and all(a in ok for a, ok in zip(fn.argtypes, types)), \
            f"{name}: {fn.argtypes} in the package, {types} in the header"
        ret = ret.strip()
        if ret.endswith("*"):
            assert fn.restype in (ctypes.c_void_p, ctypes.c_char_p), f"{name} returns a pointer"
        elif ret == "void":
            assert fn.restype in (None, ctypes.c_int), name
        else:
            assert fn.restype == ctypes.c_int, name
        checked.append(name)
    for want in ("symm_malloc", "symm_all_reduce_algo", "symm_comm_info", "symm_signal", "symm_moe_dispatch"):
        assert want in checked, f"{want} not bound: {checked}"


def test_the_compiled_callers_prototype_is_the_headers(header):
    """symmalloc/_fastcall.c calls symm_all_reduce_algo through its own typedef (it links
    nothing and includes only Python.h): the same argument types, by ctypes equivalence."""
    src = os.path.join(os.path.dirname(os.path.abspath(symmalloc.__file__)), "_fastcall.c")
    if not os.path.isfile(src):
        pytest.skip("symmalloc/_fastcall.c is not installed (the wheel carries only its build)")
    with open(src) as f:
        m = re.search(r"typedef int \(\*all_reduce_fn\)\((.*?)\);", f.read(), re.S)
    assert m, "_fastcall.c has no all_reduce_fn typedef"
    ours = [_c_arg(re.sub(r"\w+\s*$", "", a), {}) for a in m.group(1).split(",")]
    flat = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    theirs = re.search(r"^symm_status_t symm_all_reduce_algo\((.*?)\);", flat, re.M | re.S).group(1)
    want = [_c_arg(re.sub(r"\w+\s*$", "", a), {}) for a in theirs.split(",")]
    assert ours == want, f"_fastcall.c: {ours}, header: {want}"
