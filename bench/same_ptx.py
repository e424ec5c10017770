"""Whether a kernel source compiles to the same PTX in the working tree as at a git revision: the check that a
refactor of a kernel (a helper moved into a header, a loop folded into a function) changed no instruction, made
on this machine without a GPU (NVRTC only). Compiles each source for every combination of the defines' values
and each virtual architecture, drops the debug lines (.loc, .file, comments, debug sections) and compares.

    python3 bench/same_ptx.py --base HEAD kernels/paged_attention/paged_decode.cu \\
        --defines '{"HEAD_DIM": [128, 256], "GROUP": [2, 4], "SPLIT": [0, 1]}' --arch compute_80 compute_90a

Exit status 1 where any combination differs (its name and the first differing lines are printed).
"""
import argparse
import difflib
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels import cuda_build

REPO = Path(__file__).resolve().parent.parent
DEBUG = re.compile(r"\s*(\.loc|\.file|//)")


def ptx(src: Path, kernels_dir: Path, arch: str, defines: dict) -> list[str]:
    """The PTX of src for arch with its includes from kernels_dir, without debug lines."""
    saved = cuda_build.KERNELS_DIR
    cuda_build.KERNELS_DIR = kernels_dir
    try:
        text = cuda_build.compile_cubin(src, arch, defines).decode()
    finally:
        cuda_build.KERNELS_DIR = saved
    lines = [line for line in text.splitlines() if not DEBUG.match(line)]
    end = next((i for i, line in enumerate(lines) if line.startswith("\t.section\t.debug")), len(lines))
    return lines[:end]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="+", help="kernel sources, relative to the repository")
    ap.add_argument("--base", default="HEAD", help="the revision to compare with")
    ap.add_argument("--defines", default="{}", help='JSON: each define\'s values, {"NAME": [v, ...]}')
    ap.add_argument("--arch", nargs="+", default=["compute_80", "compute_90a"])
    a = ap.parse_args()
    values = json.loads(a.defines)
    combos = [dict(zip(values, c)) for c in itertools.product(*values.values())]
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", a.base, "kernels"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", tmp], input=archive, check=True)
        base_kernels = Path(tmp) / "kernels"
        for rel in a.sources:
            if not (base_kernels / Path(rel).relative_to("kernels")).is_file():
                print(f"NEW   {rel}: not at {a.base}")
                differ += len(a.arch) * len(combos)
                continue
            for arch, defines in itertools.product(a.arch, combos):
                name = f"{rel} {arch} {defines}"
                new = ptx(REPO / rel, cuda_build.KERNELS_DIR, arch, defines)
                old = ptx(base_kernels / Path(rel).relative_to("kernels"), base_kernels, arch, defines)
                if new == old:
                    print(f"same  {name}")
                    continue
                differ += 1
                print(f"DIFF  {name}")
                print("\n".join(list(difflib.unified_diff(old, new, a.base, "tree", n=1, lineterm=""))[:20]))
    print(f"{differ} of {len(a.sources) * len(a.arch) * len(combos)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
