"""One expert-grouped W4A16 GEMM, kernel against kernel: the Triton-lowered engine kernel
(`pallas_kernels.wna16_grouped_gemm.grouped_gemm`, mma and swapped operands) against the Mosaic
GPU wgmma kernel (`pallas_kernels.wgmma_gemm`) in its configurations (`GemmConfig`), same data,
one run.

    PYTHONPATH=$PWD python3 benchmarks/gemm_kernels.py [--gemms mixtral1 qwen3_1] [--block-m 8 16 64]
        [--reps 20] [--append benchmarks/RESULTS.md]
    PYTHONPATH=$PWD python3 benchmarks/gemm_kernels.py --interpret --gemms tiny   # CPU smoke test

Each row: E experts, one block of ``block_m`` rows per expert (the decode case: every expert
touched once), AWQ-style weights (4-bit, group 128, zero points), bf16 activations. Time is µs
per GEMM (jitted fori_loops of ``2·reps`` and ``reps`` dependent calls, the difference / ``reps``,
median of 5: :mod:`benchmarks.timing`), floor = int4 weights +
scales + zero points of all experts / 4.3 TB/s (or FLOPs / 640 TFLOP/s when larger), GB/s = those
bytes / time. Every variant is checked against a float32 evaluation first (rel err > 2e-2 is
reported as WRONG and not timed). The wgmma variants need a Hopper GPU and are skipped in
interpret mode.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.wna16_grouped_gemm import choose_split, dequantize_tiles, grouped_gemm

# name → (E, N, K): the first (gate+up, N = 2I) and second (down) GEMM of each model's MoE layer
GEMMS = {"mixtral1": (8, 28672, 4096), "mixtral2": (8, 4096, 14336),
         "qwen3_1": (128, 1536, 2048), "qwen3_2": (128, 2048, 768),
         "tiny": (4, 256, 512)}
BW, FLOPS = 4.3e12, 640e12


# WGMMA_VARIANTS: (name, GemmConfig fields besides block_m / split_k), the name derived from the
# fields: "wide": 128-byte swizzled [block_n, 64] word copies; "sfold": c − z into the wgmma, the
# scale per K-block partial; "ws": warp-specialized (two compute warpgroups of block_n columns each,
# one copy warpgroup); "o16": bf16 output (no K split); "tout": the output written [M, N] through a
# transposed shared-memory store. The forms measured and removed are listed in docs/history.md.
def _variant_name(opts):
    """``dict(block_n=128, stages=4, kpb=2, wide=True)`` → ``"bn128 st4 kpb2 wide"`` (the names
    ``--only`` filters on)."""
    flags = (("wide", "wide"), ("sfold", "sfold"), ("ws", "ws"), ("out16", "o16"), ("tout", "tout"))
    parts = [f"bn{opts['block_n']}"] if "block_n" in opts else []
    parts += [f"st{opts['stages']}"] + ([f"kpb{opts['kpb']}"] if "kpb" in opts else [])
    return " ".join(parts + [label for key, label in flags if opts.get(key)])


WGMMA_VARIANTS = [(_variant_name(opts), opts) for opts in [
    dict(stages=4),
    dict(block_n=128, stages=4),
    dict(block_n=128, stages=4, kpb=2, wide=True),
    dict(block_n=128, stages=2, kpb=2, wide=True),
    dict(stages=4, kpb=2, wide=True),
    dict(block_n=128, stages=2),
    dict(block_n=128, stages=2, kpb=2, wide=True, sfold=True),
    dict(block_n=128, stages=4, kpb=2, wide=True, sfold=True),
    dict(block_n=128, stages=4, sfold=True),
    dict(block_n=64, stages=2, kpb=2, wide=True, sfold=True),
    dict(block_n=64, stages=2, kpb=2, wide=True, sfold=True, ws=True),
    dict(block_n=128, stages=2, kpb=2, wide=True, sfold=True, ws=True),
    dict(block_n=128, stages=4, ws=True),
    dict(block_n=128, stages=3, kpb=2, wide=True, ws=True),
    dict(block_n=128, stages=4, ws=True, out16=True),
    dict(block_n=128, stages=3, kpb=2, wide=True, ws=True, out16=True, tout=True),
    dict(block_n=128, stages=2, kpb=2, wide=True, sfold=True, out16=True, tout=True),
]]


def timed(fn, args, reps):
    """µs per GEMM: a jitted ``fori_loop`` of ``2·reps`` dependent calls less one of ``reps``,
    / ``reps``, median of 5 (:mod:`benchmarks.timing`; before v11 one loop's time / reps)."""
    from benchmarks.timing import differential_us

    def build(n):
        @jax.jit
        def run(args):
            def body(_, a):                 # each call reads the previous one's output: nothing to hoist
                out = fn(a, *args[1:])
                return a + (out[:, :1] * 1e-6).astype(a.dtype)
            return jax.lax.fori_loop(0, n, body, args[0])
        return run

    return differential_us(build, (args,), reps)


def variants(bm, n_kb, e, n, interpret):
    """name → callable(a, ids, tile operands, wgmma operands) returning [M, N] float32."""
    split = choose_split(e * (n // 64), n_kb, waves=8) if not interpret else 1
    v = {}
    for dot in ("mma", "swap") if bm >= 16 else ():       # Triton's MMA needs 16-row blocks
        v[f"triton {dot} s{split}"] = lambda a, ids, t, g, dot=dot: grouped_gemm(
            a, ids, *t, bits=4, group_size=128, block_m=bm, split_k=split, dot=dot, interpret=interpret).sum(0)
    if interpret:
        return v
    from pallas_kernels.errors import KernelConfigError
    from pallas_kernels.wgmma_config import TRANSPOSED_STORE, GemmConfig
    from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm

    for vname, opts in WGMMA_VARIANTS:
        if opts.get("tout") and not TRANSPOSED_STORE:
            continue
        for sk in sorted({1, split}):
            cols = opts.get("block_n", 64) * (2 if opts.get("ws") else 1)       # ws: two warpgroups' columns
            if n_kb % (sk * opts.get("kpb", 1)) or n % cols or (sk != 1 and opts.get("out16")):
                continue
            try:
                cfg = GemmConfig(block_m=bm, split_k=sk, **opts)
            except KernelConfigError:
                continue
            v[f"wgmma {vname} s{sk}"] = lambda a, ids, t, g, cfg=cfg: wgmma_grouped_gemm(a, ids, *g, config=cfg).sum(0)
    return v


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemms", nargs="*", default=["mixtral1", "mixtral2", "qwen3_1", "qwen3_2"])
    ap.add_argument("--block-m", nargs="*", type=int, default=[8, 16, 64, 128])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke test)")
    ap.add_argument("--only", nargs="*", default=None, help="time only variants whose name contains one of these")
    ap.add_argument("--exact", action="store_true",
                    help="--only gives whole names as the table prints them (\"wgmma i16 bn128 ... sfold s1\")")
    ap.add_argument("--append", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    lines = ["| GEMM (E, N, K) | block_m | variant | µs | floor µs | time / floor | GB/s | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for name in args.gemms:
        e, n, k = GEMMS[name]
        words = jnp.asarray(rng.integers(-2 ** 31, 2 ** 31, (e, k // 8, n), dtype=np.int64).astype(np.int32))
        scales = jnp.asarray(rng.random((e, k // 128, n)) * 0.01 + 0.001, jnp.bfloat16)
        zeros = jnp.asarray(rng.integers(0, 16, (e, k // 128, n)), jnp.uint8)
        tile_ops = (words, scales, zeros)
        wg_ops = None
        if not args.interpret:
            from pallas_kernels.wgmma_layout import to_wgmma_layout

            wg_ops = jax.jit(to_wgmma_layout)(words, scales, zeros)
        w64 = None
        nbytes = e * (n * k / 2 + (k // 128) * n * 2 * 2)        # int4 codes + scales + zeros (2 B each)
        for bm in args.block_m:
            a = jnp.asarray(rng.standard_normal((e * bm, k)), jnp.bfloat16)
            ids = jnp.arange(e, dtype=jnp.int32)
            if w64 is None:
                w64 = jax.jit(lambda w, s, z: dequantize_tiles(w, s, z, bits=4, group_size=128,
                                                               dtype=jnp.bfloat16))(*tile_ops)
            ref = jnp.einsum("bmk,bkn->bmn", a.reshape(e, bm, k).astype(jnp.float32), w64.astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST).reshape(e * bm, n)
            scale = float(jnp.abs(ref).max())
            fl = max(nbytes / BW, 2 * e * bm * n * k / FLOPS) * 1e6
            for vname, fn in variants(bm, k // 128, e, n, args.interpret).items():
                if args.only and not any((o == vname) if args.exact else (o in vname) for o in args.only):
                    continue
                try:
                    got = jax.jit(fn)(a, ids, tile_ops, wg_ops)
                    err = float(jnp.abs(got - ref).max()) / scale
                    if not np.isfinite(err) or err > 2e-2:
                        print(f"  {name} bm={bm} {vname}: WRONG (rel err {err:.1e})", flush=True)
                        lines.append(f"| {name} {(e, n, k)} | {bm} | {vname} | — | {fl:.1f} | — | — | {err:.1e} WRONG |")
                        continue
                    us = timed(fn, (a, ids, tile_ops, wg_ops), args.reps)
                except Exception as ex:  # noqa: BLE001 - report and continue
                    print(f"  {name} bm={bm} {vname}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    continue
                row = (f"| {name} {(e, n, k)} | {bm} | {vname} | {us:.1f} | {fl:.1f} | {us / fl:.2f} | "
                       f"{nbytes / us / 1e3:.0f} | {err:.1e} |")
                print(row, flush=True)
                lines.append(row)
    print("\n".join(lines))
    if args.append:
        from benchmarks.results_io import append_markdown

        append_markdown(args.append, "Grouped GEMM kernels", "gemm_kernels.py", argv or sys.argv[1:],
                        "One block per expert, AWQ 4-bit g128, bf16 activations; µs per GEMM (jitted loop of "
                        "dependent calls, median of 5).", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
