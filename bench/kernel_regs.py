"""Registers, stack and spills of every kernel in one .cu source as NVRTC compiles it here (ptxas -v), e.g.
    python3 bench/kernel_regs.py kernels/gdn_prefill/gdn_prefill.cu sm_90a DVS=32,IN_T=2,AB_T=0
Development only: NVRTC versions differ in what they spill, so run it where the kernels run."""
import sys
from pathlib import Path

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels import cuda_build as cb


def main():
    src, arch = Path(sys.argv[1]), sys.argv[2]
    defs = {k: int(v) for k, v in (kv.split("=") for kv in sys.argv[3].split(","))} if len(sys.argv) > 3 else {}
    nv = cb._nvrtc()
    print("NVRTC", cb.nvrtc_version())
    prog = nv.createProgram(src.read_text(), src.name, [], [])
    try:
        nv.compileProgram(prog, cb._options(src, arch, defs) + ["--ptxas-options=-v"])
        log = nv.getProgramLog(prog)
    finally:
        nv.destroyProgram(prog)
    for ln in log.splitlines():
        if "Compiling entry" in ln or "registers" in ln or "spill" in ln or "arning" in ln:
            print(ln.strip())


if __name__ == "__main__":
    main()
