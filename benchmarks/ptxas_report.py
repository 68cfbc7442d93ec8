"""Registers, spills and shared memory of the wgmma kernel variants, from ptxas (GPU machine).

    PYTHONPATH=$PWD python3 benchmarks/ptxas_report.py [--gemm mixtral1] [--block-m 8 64] [--only NAME ...]

Sets ``MOSAIC_GPU_DUMP_PTXAS=1``, ``MOSAIC_GPU_DUMP_PTX=1`` and ``MOSAIC_GPU_DUMP_TO`` (a temporary directory) before the
first kernel compiles, runs each variant of ``benchmarks/gemm_kernels.py``'s ``WGMMA_VARIANTS``
once (no timing), and prints only the ptxas summary lines and an opcode histogram of the PTX
(and of the SASS where the CUDA toolkit has ``nvdisasm``; the device image does not) of the
kernels each variant compiled — the dump itself is ~10 files per kernel, too many to bring back
from the device. ``--keep DIR`` copies each variant's PTX (and SASS) dumps there (``<gemm>_bm<rows>_<variant>__<file>``),
to be assembled and disassembled where ``ptxas`` and ``nvdisasm`` are (``ptxas -arch=sm_90a``).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import shutil
import sys
import tempfile

SASS_OP = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)
PTX_OP = re.compile(r"^\s+(?:@!?%p\w+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\s", re.M)
KEYS = ("registers", "spill", "smem", "bytes stack", "Compiling entry", "serializ", "arning")


def summarize(files):
    """ptxas resource lines of the dumped files, and an opcode histogram of each SASS dump."""
    lines = []
    for f in sorted(files):
        if "ptxas" in f.name:
            lines += [f"    {f.name}: {ln.strip()}" for ln in f.read_text(errors="replace").splitlines()
                      if any(k in ln for k in KEYS)]
        elif f.suffix == ".ptx":
            ops = collections.Counter(PTX_OP.findall(f.read_text(errors="replace")))
            top = ", ".join(f"{op} {c}" for op, c in ops.most_common(24))
            lines.append(f"    {f.name}: {sum(ops.values())} PTX instructions; {top}")
        elif f.suffix == ".sass":
            ops = collections.Counter(m.group(1) for m in
                                      SASS_OP.finditer(f.read_text(errors="replace")))
            top = ", ".join(f"{op} {c}" for op, c in ops.most_common(14))
            lines.append(f"    {f.name}: {sum(ops.values())} instructions; {top}")
    if not lines:
        lines = [f"    (no ptxas/SASS summary; dumped files: {', '.join(sorted(f.name for f in files)[:12])})"]
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemm", default="mixtral1")
    ap.add_argument("--block-m", nargs="*", type=int, default=[8, 64])
    ap.add_argument("--only", nargs="*", default=None, help="only variants whose name contains one of these")
    ap.add_argument("--exact", action="store_true", help="--only names whole variant names")
    ap.add_argument("--keep", default=None, help="copy each variant's PTX into this directory")
    args = ap.parse_args(argv)
    dump = pathlib.Path(tempfile.mkdtemp(prefix="mosaic_dump_"))
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.gemm_kernels import GEMMS, WGMMA_VARIANTS
    from pallas_kernels.wgmma_config import GemmConfig
    from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm
    from pallas_kernels.wgmma_layout import to_wgmma_layout

    e, n, k = GEMMS[args.gemm]
    rng = np.random.default_rng(0)
    words = jnp.asarray(rng.integers(-2 ** 31, 2 ** 31, (e, k // 8, n), dtype=np.int64).astype(np.int32))
    scales = jnp.asarray(rng.random((e, k // 128, n)) * 0.01, jnp.bfloat16)
    zeros = jnp.asarray(rng.integers(0, 16, (e, k // 128, n)), jnp.uint8)
    ops = to_wgmma_layout(words, scales, zeros)
    lay = "i16"
    for bm in args.block_m:
        a = jnp.zeros((e * bm, k), jnp.bfloat16)
        ids = jnp.arange(e, dtype=jnp.int32)
        for name, opts in WGMMA_VARIANTS:
            if args.only and not any((o == name) if args.exact else (o in name) for o in args.only):
                continue
            before = set(dump.iterdir())
            try:
                jax.block_until_ready(wgmma_grouped_gemm(a, ids, *ops, config=GemmConfig(block_m=bm, **opts)))
            except Exception as ex:  # noqa: BLE001 - report and continue
                print(f"{args.gemm} bm={bm} {lay} {name}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
                continue
            print(f"{args.gemm} bm={bm} {lay} {name}:")
            new = set(dump.iterdir()) - before
            print("\n".join(summarize(new)), flush=True)
            if args.keep:
                keep = pathlib.Path(args.keep)
                keep.mkdir(parents=True, exist_ok=True)
                stem = f"{args.gemm}_bm{bm}_{lay}_{name.replace(' ', '_')}"
                for f in sorted(p for p in new if p.suffix in (".ptx", ".sass")):
                    shutil.copy(f, keep / f"{stem}__{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
