"""The package's tables of the C ABI (symmalloc._lib: STATUS, _DTYPES, _OPS, _ALGOS, _QUANTS, _STATS,
and expert parallelism's constants, structs and prototypes) against include/symmalloc.h of the checkout. The wheel's test venv has no header (only the
package is installed there): the test skips with that reason; the checkout's run (make
test-python) is the one that guards the tables."""
import os
import re

import pytest

import symmalloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(ROOT, "include", "symmalloc.h")

pytestmark = pytest.mark.skipif(
    not os.path.isfile(HEADER),
    reason="include/symmalloc.h is not beside the tests (the wheel's venv): the checkout's run compares the tables",
)


@pytest.fixture(scope="module")
def header():
    with open(HEADER) as f:
        return f.read()


def _defines(text, prefix):
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"^#define {prefix}(\w+) (\d+)\s*$", text, re.M)}


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
    assert (_lib._MOE_MAX_TOPK, _lib._MOE_MAX_EXPERTS) == (d["MOE_MAX_TOPK"], d["MOE_MAX_EXPERTS"])
    for name, struct in (("symm_moe_config_t", _lib._MoeConfig), ("symm_moe_layout_t", _lib._MoeLayout)):
        assert [(n, t) for n, t in struct._fields_] == _c_fields(header, name), name
    # On x86-64 / aarch64 (LP64): 48 and 112 bytes, no padding (the library refuses another size).
    assert ctypes.sizeof(_lib._MoeConfig) == 48 and ctypes.sizeof(_lib._MoeLayout) == 112

    structs = {"symm_moe_config_t": _lib._MoeConfig, "symm_moe_layout_t": _lib._MoeLayout}
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
