"""The package's tables of the C ABI (symmalloc._lib: STATUS, _DTYPES, _OPS, _ALGOS, _QUANTS, _STATS)
against include/symmalloc.h of the checkout. The wheel's test venv has no header (only the
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
