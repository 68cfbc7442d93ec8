"""The instruction mix of a wgmma kernel's K loop, from the PTX that ``ptxas_report.py --keep``
brings back from the GPU machine (its image has no ``nvdisasm``):

    python3 benchmarks/sass_loops.py DIR_OR_FILE.ptx ... [--arch sm_90a] [--top 12]

Each PTX file is assembled with ``ptxas -arch=<arch> -v`` and disassembled with ``nvdisasm -c``
(found on ``PATH``, under ``$CUDA_HOME/bin``, or in the ``nvidia-cuda-nvdisasm`` wheel's
``nvidia/cu*/bin``). A loop is a predicated branch back to a label above it; the largest is the
kernel's K loop (the pipeline's step; see :func:`loops`). Printed per file: ptxas's register line, the loop's
instruction count and its opcode histogram. The counts are static: every instruction of the
span once, including rarely taken paths inside it (a barrier's retry, say), so they measure
what one step issues only approximately — but exactly enough to compare two forms of a kernel
(docs/journal/notes.md v14: 806 against 679 instructions per step for the two nibble-plane forms).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

LABEL = re.compile(r"^(\.L_x_\d+|\.L_\w+):")
INSN = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)$")
TARGET = re.compile(r"`\((\.L\w+)\)")


def parse_sass(text: str):
    """``nvdisasm -c`` text → ``(labels, insns)``: label → index of the next instruction, and the
    instructions as ``(opcode, branch target or None, predicated)`` in program order."""
    labels, insns = {}, []
    for line in text.splitlines():
        m = LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = INSN.match(line)
        if m:
            t = TARGET.search(m.group(3)) if m.group(2) in ("BRA", "JMP", "BRX") else None
            insns.append((m.group(2), t.group(1) if t else None, m.group(1) is not None))
    return labels, insns


def loops(text: str):
    """Every loop, largest first: ``(label, instructions, Counter of opcodes)``. A loop is a
    predicated branch back to a label above it. Unpredicated backward branches are left out:
    ptxas puts the slow path of a barrier wait after the kernel's exit and jumps back from it
    into the code, which is not a loop."""
    labels, insns = parse_sass(text)
    out = []
    for j, (_, target, predicated) in enumerate(insns):
        i = labels.get(target)
        if predicated and target is not None and i is not None and i <= j:
            body = insns[i:j + 1]
            out.append((target, len(body), collections.Counter(op for op, _, _ in body)))
    return sorted(out, key=lambda x: -x[1])


def _nvdisasm():
    cands = [shutil.which("nvdisasm")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvdisasm"))
    for p in sys.path:
        cands += glob.glob(os.path.join(p, "nvidia", "cu*", "bin", "nvdisasm"))
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def sass_of(ptx: pathlib.Path, arch: str, ptxas: str, nvdisasm: str):
    """``(ptxas's register line, nvdisasm text)`` of one PTX file."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "k.cubin"
        r = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx), "-o", str(cubin)],
                           capture_output=True, text=True, check=True)
        regs = next((ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "registers" in ln), "")
        d = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True)
        return regs, d.stdout


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+", help="PTX files, or directories holding them")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    ptxas, nvdisasm = shutil.which("ptxas"), _nvdisasm()
    if not ptxas or not nvdisasm:
        print(f"sass_loops.py needs ptxas and nvdisasm (found ptxas={ptxas}, nvdisasm={nvdisasm}); "
              "nvdisasm: pip install nvidia-cuda-nvdisasm", file=sys.stderr)
        return 2
    files = []
    for p in map(pathlib.Path, args.paths):
        files += sorted(p.glob("*.ptx")) if p.is_dir() else [p]
    for f in files:
        regs, text = sass_of(f, args.arch, ptxas, nvdisasm)
        found = loops(text)
        print(f"{f.name}: {regs}")
        if not found:
            print("    no loop")
            continue
        label, n, ops = found[0]
        print(f"    K loop ({label}): {n} instructions; "
              + ", ".join(f"{op} {c}" for op, c in ops.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
