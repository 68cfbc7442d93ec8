"""Where does the wgmma kernel's ~1.9 TB/s decode ceiling come from? (GPU machine, diagnostic.)

    PYTHONPATH=$PWD python3 benchmarks/stream_ceiling.py [--gemms mixtral1 qwen3_2] [--stages 2 4]

Streams the same 16-bit word layout (``to_wgmma_layout``) through the same
``plgpu.emit_pipeline`` ring as ``wgmma_grouped_gemm`` (one program per expert × 128 columns),
with the step body cut down, and prints each variant's bandwidth beside XLA's own reduction
over the same bytes (the practical read ceiling) and the real kernel at 8-row blocks:

* ``copy``: the TMA ring only — each step waits for its buffer and does nothing with it;
* ``load``: plus the shared-memory → register loads of the word tiles (xor-folded);
* ``dequant``: plus the magic-number dequantization of every nibble (summed, no wgmma);
  ``dequant32`` the same with the nibbles extracted by 32-bit register ops (``shift32``);
* ``kernel``: ``wgmma_grouped_gemm`` (8-row blocks, ``block_n`` 128), the whole step;

each for the kernel's swizzled ``(8, 16)``-tiled word copies (32-byte TMA rows) and its
``wide`` ones (128-byte swizzle, ``[128, 64]`` per step); ``flat copy`` moves the same bytes as
one unswizzled ``[16, 256]`` box per step (the tile-major layout viewed flat, 512-byte rows).

If ``copy`` already stops near 2 TB/s the pipeline structure is the limit (one warpgroup both
issuing the copies and computing); if ``copy`` runs near the XLA ceiling and ``dequant`` does
not, the per-step register work is.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gemm_kernels import GEMMS
from pallas_kernels.wgmma_w4a16 import _nibble_planes

BN = 128


def stream(words, mode: str, stages: int, wide: bool = False):
    """``words`` int16, ``[E, N, K/4]`` (swizzled ``(8, 16)``-tiled TMA copies of ``[128, 32]``,
    as the kernel's default; ``wide``: 128-byte swizzled ``[128, 64]`` copies, two K-blocks per
    step, as ``wgmma_grouped_gemm(..., kpb=2, wide=True)``) or flat tile-major ``[E, N/128,
    (K/128)·16, 256]`` (one unswizzled ``[16, 256]`` box per step, copy mode only) →
    ``[E, N/128, 64, 16]`` bf16 folded per program (mode as above)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    flat = words.ndim == 4
    if flat and mode != "copy":
        raise ValueError("flat words: copy mode only (registers cannot be loaded from the unswizzled buffer on "
                         "jax 0.11: its layout inference rejects the reshaped view)")
    e = words.shape[0]
    n = words.shape[1] * BN if flat else words.shape[1]
    n_kb = words.shape[2] // 16 if flat else words.shape[2] // 32
    steps = n_kb // 2 if wide else n_kb
    layout = plgpu.Layout.WGMMA
    planes = _nibble_planes(64, jnp.bfloat16) if mode == "dequant32" else None

    def kernel(w_gmem, o_gmem):
        i, j = jax.lax.axis_index("e"), jax.lax.axis_index("n")
        if flat:
            spec = plgpu.BlockSpec((16, 256), lambda kb: (kb, 0))
        elif wide:
            spec = plgpu.BlockSpec((BN, 64), lambda kb: (0, kb),
                                   transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
        else:
            spec = plgpu.BlockSpec((BN, 32), lambda kb: (0, kb),
                                   transforms=(plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)))

        def step(_, w_smem, carry):
            if mode == "copy":
                return carry
            acc = carry
            if wide:
                whole = plgpu.load(w_smem, (), layout=layout)
                tiles = [whole[64 * h: 64 * h + 64, 16 * v: 16 * v + 16] for h in range(BN // 64) for v in range(4)]
            else:
                tiles = [plgpu.load(w_smem.at[pl.ds(64 * h, 64), pl.ds(16 * u, 16)], (), layout=layout)
                         for h in range(BN // 64) for u in range(2)]
            for tile in tiles:
                if mode == "load":
                    acc = acc + jax.lax.bitcast_convert_type(tile, jnp.bfloat16)
                    continue
                if mode == "dequant32":
                    vs = planes(tile)
                else:
                    vs = [jax.lax.bitcast_convert_type(
                        ((jax.lax.shift_right_logical(tile, jnp.int16(4 * t)) if t else tile) & jnp.int16(15))
                        | jnp.int16(0x4300), jnp.bfloat16) for t in range(4)]
                for v in vs:
                    acc = acc + (v - jnp.bfloat16(136.0)) * jnp.bfloat16(0.01)
            return acc

        init = plgpu.layout_cast(jnp.zeros((64, 16), jnp.bfloat16), layout)
        out = plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=min(stages, steps), in_specs=[spec],
                                  init_carry=init)(w_gmem.at[i, j] if flat else w_gmem.at[i, pl.ds(j * BN, BN)])
        o_gmem.at[i, j][...] = out

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((e, n // BN, 64, 16), jnp.bfloat16),
                        grid=(e, n // BN), grid_names=("e", "n"))(words)


def timed(fn, *args, reps=20):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(reps)]
        jax.block_until_ready(outs)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / reps * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemms", nargs="*", default=["mixtral1", "qwen3_2"])
    ap.add_argument("--stages", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    from pallas_kernels.wgmma_w4a16 import to_wgmma_layout, wgmma_grouped_gemm

    rng = np.random.default_rng(0)
    print("| GEMM (E, N, K) | variant | stages | µs | GB/s |")
    print("|---|---|---|---|---|")
    for name in args.gemms:
        e, n, k = GEMMS[name]
        words = jnp.asarray(rng.integers(-2 ** 31, 2 ** 31, (e, k // 8, n), dtype=np.int64).astype(np.int32))
        scales = jnp.asarray(rng.random((e, k // 128, n)) * 0.01 + 0.001, jnp.bfloat16)
        zeros = jnp.asarray(rng.integers(0, 16, (e, k // 128, n)), jnp.uint8)
        conv = jax.jit(to_wgmma_layout, static_argnames=("word_bits", "tile_n"))
        w16, s16, z16 = conv(words, scales, zeros, word_bits=16)
        wflat = conv(words, scales, zeros, tile_n=BN)[0].reshape(e, n // BN, -1, 256)    # same bytes, 512-byte rows
        nbytes = w16.size * 2

        def row(variant, stages, us, extra_bytes=0):
            print(f"| {name} {(e, n, k)} | {variant} | {stages} | {us:.1f} | {(nbytes + extra_bytes) / us / 1e3:.0f} |",
                  flush=True)

        row("XLA sum (read ceiling)", "—", timed(jax.jit(lambda w: jnp.sum(w, dtype=jnp.int32)), w16, reps=args.reps))
        for st in args.stages:
            for lay, w, wide, modes in (("", w16, False, ("copy", "load", "dequant")),
                                        ("wide ", w16, True, ("copy", "load", "dequant", "dequant32")),
                                        ("flat ", wflat, False, ("copy",))):
                for mode in modes:
                    try:
                        row(lay + mode, st, timed(jax.jit(lambda w, mode=mode, st=st, wide=wide: stream(w, mode, st, wide)),
                                                  w, reps=args.reps))
                    except Exception as ex:  # noqa: BLE001 - report and continue
                        print(f"  {name} {lay}{mode} st{st}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            a = jnp.asarray(rng.standard_normal((8 * e, k)), jnp.bfloat16)
            ids = jnp.arange(e, dtype=jnp.int32)
            fn = jax.jit(lambda a, ids, w, s, z, st=st: wgmma_grouped_gemm(a, ids, w, s, z, block_m=8,
                                                                          block_n=128, stages=st))
            row("kernel (8-row blocks)", st, timed(fn, a, ids, w16, s16, z16, reps=args.reps), s16.size * 4)
            fnw = jax.jit(lambda a, ids, w, s, z, st=st: wgmma_grouped_gemm(a, ids, w, s, z, block_m=8, block_n=128,
                                                                           stages=st, kpb=2, wide=True))
            row("wide kernel (8-row blocks)", st, timed(fnw, a, ids, w16, s16, z16, reps=args.reps), s16.size * 4)
            fn32 = jax.jit(lambda a, ids, w, s, z, st=st: wgmma_grouped_gemm(a, ids, w, s, z, block_m=8, block_n=128,
                                                                            stages=st, kpb=2, wide=True, shift32=True))
            row("wide shift32 kernel (8-row blocks)", st, timed(fn32, a, ids, w16, s16, z16, reps=args.reps),
                s16.size * 4)
            for label, extra in (("zfold", dict(zfold=True)), ("overlap", dict(overlap=True))):
                fnx = jax.jit(lambda a, ids, w, s, z, st=st, extra=extra: wgmma_grouped_gemm(
                    a, ids, w, s, z, block_m=8, block_n=128, stages=st, kpb=2, wide=True, shift32=True, **extra))
                row(f"wide shift32 {label} kernel (8-row blocks)", st,
                    timed(fnx, a, ids, w16, s16, z16, reps=args.reps), s16.size * 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
