#!/usr/bin/env python3
"""Compares the SASS of two kernel fatbins function by function (per architecture), so a
refactor of kernels/ can show it changed no instruction.

    python3 scripts/sass-compare.py OLD.fatbin NEW.fatbin

Needs cuobjdump and nvdisasm on PATH (CUDA toolkit, or the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm). Prints one line per function whose SASS
differs (or that exists on one side only) and a summary; exits 1 when any differs. Addresses
and the order of functions in the file are ignored; instructions and operands are compared.
"""
import re
import subprocess
import sys


def functions(fatbin):
    out = subprocess.run(["cuobjdump", "-sass", fatbin], check=True, capture_output=True, text=True).stdout
    arch, name, body, funcs = None, None, [], {}
    for line in out.splitlines():
        m = re.match(r"\s*arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                funcs[(arch, name)] = body
            name, body = m.group(1), []
            continue
        if name:
            # "/*0040*/   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;  /* 0x... */": keep the instruction.
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?);", line)
            if m:
                body.append(m.group(1).strip())
    if name:
        funcs[(arch, name)] = body
    return funcs


def main():
    old, new = functions(sys.argv[1]), functions(sys.argv[2])
    differ = 0
    for key in sorted(set(old) | set(new), key=lambda k: (k[1], k[0] or "")):
        a, b = old.get(key), new.get(key)
        if a != b:
            differ += 1
            what = "only in new" if a is None else "only in old" if b is None else f"{len(a)} -> {len(b)} instructions"
            print(f"differs: {key[0]} {key[1]} ({what})")
    same = len(set(old) & set(new)) - sum(1 for k in set(old) & set(new) if old[k] != new[k])
    print(f"{same} functions identical, {differ} differ ({len(old)} old, {len(new)} new)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
