"""Whether a CUDA source edit left the existing kernels' code as it was, without a GPU: compile a .cu file at two
git revisions to PTX (sm_90a, the build's flags) and check that every kernel body of the old build occurs in the
new one, names and branch labels aside (a template parameter added with a default renames kernels, and labels are
numbered per file). PTX is what ptxas turns into machine code, so an unchanged body is unchanged code.

    python scripts/ptx_unchanged.py BASE_REV fp_recipes/csrc/fp8_cast.cu [more .cu files]
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-ptx", "-O3", "-std=c++17", "-fmad=false", "--expt-relaxed-constexpr", "-arch=compute_90a"]


def kernel_bodies(ptx: str) -> dict:
    """{kernel name: hash of its body with every mangled name and branch label made anonymous}."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\S+)\((.*?)\n\}\n", ptx, re.S):
        body = re.sub(r"_Z\w+", "SYM", m.group(0).replace(m.group(1), "K"))
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        out[m.group(1)] = hashlib.sha1(body.encode()).hexdigest()
    return out


def ptx_at(rev: str, source: str, work: Path) -> str:
    tree = work / rev.replace("/", "_")
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(tree), rev], check=True,
                       capture_output=True)
    out = work / (Path(source).stem + "_" + rev.replace("/", "_") + ".ptx")
    subprocess.run(["nvcc", *FLAGS, f"-I{tree / 'fp_recipes/csrc'}", str(tree / source), "-o", str(out)], check=True)
    return out.read_text()


def main(argv: list) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    base, sources = argv[0], argv[1:]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    changed = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for source in sources:
                old, new = kernel_bodies(ptx_at(base, source, work)), kernel_bodies(ptx_at(head, source, work))
                missing = [name for name, h in old.items() if h not in set(new.values())]
                changed += len(missing)
                print(f"{source}: {len(old)} kernels at {base}, {len(new)} at HEAD; "
                      f"{len(old) - len(missing)} unchanged, {len(missing)} changed")
                for name in missing:
                    print(f"  changed: {name}")
    finally:  # (the temporary worktrees are gone: drop git's records of them)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
