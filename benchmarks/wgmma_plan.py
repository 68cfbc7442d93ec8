"""What the wgmma layer runs at each table row, per GEMM, without a GPU.

    PYTHONPATH=$PWD python3 benchmarks/wgmma_plan.py [--rows qwen3:512 mixtral] [--sms 132] \\
        [--set "persistent:1,ws:0"]

The layer (:func:`pallas_kernels.wgmma_layer.fused_moe_wgmma`) is traced with
:func:`jax.eval_shape` on abstract weights (AWQ, group 128), with the GPU's SM count patched in, and
the :class:`~pallas_kernels.wgmma_config.GemmConfig` of every
:func:`~pallas_kernels.wgmma_gemm.wgmma_grouped_gemm` call it makes is recorded. So the
configurations shown are the ones the layer's own rules pick, not a copy of them. From those options
follow the numbers a prediction starts from (``docs/journal/notes.md``, the device's METHOD.md):

* ``programs``: the kernel's grid (blocks × column tiles × K splits; ``ws`` programs cover two
  column tiles; ``stream``: the programs it launches), and ``live``: those of blocks with an
  expert (the rest end at once).
* ``steps``: pipeline steps per program (per item with ``stream``), each ``kpb`` K-blocks.
* ``smem``: shared memory per program (:func:`~pallas_kernels.wgmma_config.wgmma_smem_bytes`), and
  ``/SM``: how many such programs fit on one SM by shared memory, and one for ``ws`` (its 384
  threads × 168 registers fill the register file; plain programs' registers can allow fewer
  than shared memory does).
* ``waves``: live programs / (SMs × that count).
* ``weights MB``: the weight words, scales and zero points the live blocks stream (an expert with
  two blocks streams its weights twice).

Blocks: the layer sizes its grid for the most blocks a routing can need (the alignment step's
static bound). The live blocks are the expected number with an expert under uniform random
routing (:func:`~pallas_kernels.wgmma_config.expected_blocks`), or every routed pair in the pair
schedule.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.moe_engine import SHAPES, parse_rows, parse_variants

def abstract_weights(e, h, i, *, group=128, zeros=True, dtype=jnp.bfloat16):
    """A :class:`~wna16_jax.convert.wgmma.WgmmaWeights` of shapes only, as :func:`convert_wgmma`
    lays out ``e`` experts of hidden size ``h`` and intermediate size ``i``."""
    from pallas_kernels.wgmma_layout import BLOCK_K
    from wna16_jax.convert.wgmma import WgmmaWeights

    s = jax.ShapeDtypeStruct
    g1, g2 = (h // BLOCK_K, i // BLOCK_K) if group == BLOCK_K else (1, 1)
    return WgmmaWeights.of(w13_words=s((e, 2 * i, h // 4), jnp.int16), w2_words=s((e, h, i // 4), jnp.int16),
                           w13_scales=s((e, g1, 2 * i), dtype), w2_scales=s((e, g2, h), dtype),
                           w13_zeros=s((e, g1, 2 * i), dtype) if zeros else None,
                           w2_zeros=s((e, g2, h), dtype) if zeros else None,
                           hidden_size=h, intermediate_size=i, w13_interleaved=i % 64 == 0)


def wgmma_layer(x, tw, ids, weights, **opts):
    """The wgmma layer on a :class:`~wna16_jax.convert.wgmma.WgmmaWeights` (its two GEMMs' arrays)."""
    from pallas_kernels.wgmma_layer import fused_moe_wgmma

    w13, w2 = weights.gemms()
    return fused_moe_wgmma(x, tw, ids, w13, w2, interleaved=weights.w13_interleaved, **opts)


def layer_gemms(t, k, weights, sms=132, **opts):
    """The ``(args, config)`` of each GEMM the layer runs for ``t`` tokens, top-``k`` (abstract:
    nothing is computed), with ``sms`` streaming multiprocessors."""
    import pallas_kernels.device as dev
    import pallas_kernels.wgmma_layer as wgl

    calls = []
    real = wgl.wgmma_grouped_gemm

    def record(*args, config, **kw):
        calls.append((args + (kw.get("row_scale"),), config))
        return real(*args, config=config, **kw)

    saved = wgl.wgmma_grouped_gemm, dev.num_sms
    wgl.wgmma_grouped_gemm, dev.num_sms = record, lambda: sms
    try:
        s = jax.ShapeDtypeStruct
        jax.eval_shape(functools.partial(wgmma_layer, **opts), s((t, weights.hidden_size), jnp.bfloat16),
                       s((t, k), jnp.float32), s((t, k), jnp.int32), weights)
    finally:
        wgl.wgmma_grouped_gemm, dev.num_sms = saved
    return calls


def describe(args, cfg, live, sms=132):
    """One GEMM call, ``live`` of whose blocks have an expert → a dict of what it runs (see the
    module docstring)."""
    from pallas_kernels.wgmma_config import _SMEM_ALIGN, SM_SMEM, wgmma_smem_bytes
    from pallas_kernels.wgmma_layout import BLOCK_K

    a, ids, words, scales, zeros, rs = args[:6]
    m, kdim = a.shape
    n = words.shape[1]
    nb = ids.shape[0]
    bm, bn, kpb, split, ws, stream = cfg.block_m, cfg.block_n, cfg.kpb, cfg.split_k, cfg.ws, cfg.stream
    steps = kdim // BLOCK_K // split // kpb
    need = wgmma_smem_bytes(block_m=bm, block_n=bn, kpb=kpb, stages=cfg.stages if stream else min(cfg.stages, steps),
                            n_blocks=nb, ws=ws, tout=cfg.tout, gated=cfg.gated is not None, has_zp=zeros is not None,
                            channelwise=cfg.group_size == -1, row_scale=rs is not None, stream=stream)
    # registers: one ws program per SM (384 threads × 168 registers), as the kernel's own default
    per_sm = 1 if ws else max(1, SM_SMEM // (need + _SMEM_ALIGN))
    items = nb * (n // ((2 if ws else 1) * bn)) * split       # a ws program covers 2·block_n columns
    programs = min(cfg.programs or sms, items) if stream else items
    live_programs = programs if stream else programs * live / nb
    words_bytes = live * n * kdim / 2
    meta = live * n * scales.shape[1] * 2 * (2 if zeros is not None else 1)
    flags = [f for f in ("ws", "sfold", "tout", "stream") if getattr(cfg, f)]
    flags += ["o16"] if cfg.out16 else []
    flags += [f"gated {cfg.gated}"] if cfg.gated else []
    flags += ["row_scale"] * (rs is not None)
    return dict(bm=bm, blocks=nb, n=n, k=kdim, bn=bn, kpb=kpb, stages=min(cfg.stages, steps) if not stream else cfg.stages,
                split=split, steps=steps, programs=programs, live_programs=live_programs, smem_kb=need / 1024,
                per_sm=per_sm, waves=live_programs / (sms * per_sm), weights_mb=(words_bytes + meta) / 1e6,
                flags=" ".join(flags))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=["mixtral", "qwen3", "dsv2lite"],
                    help="shape[:tokens,...] as in moe_engine.py")
    ap.add_argument("--sms", type=int, default=132, help="streaming multiprocessors (H200: 132)")
    ap.add_argument("--set", default="", help="layer options 'key:value,...' (LayerConfig's fields)")
    args = ap.parse_args(argv)
    from pallas_kernels.wgmma_config import expected_blocks
    from wna16_jax.routing import align_method

    opts = parse_variants(f"x={args.set}")["x"] if args.set else {}
    for key, tokens in parse_rows(args.rows):
        title, (e, k, h, i), _ = SHAPES[key]
        weights = abstract_weights(e, h, i)
        for t in tokens:
            calls = layer_gemms(t, k, weights, sms=args.sms, **opts)
            bm, nb = calls[0][1].block_m, calls[0][0][1].shape[0]
            pair = bm == 8 and nb == t * k and "pair" == opts.get("schedule", "pair" if t * k <= e else "")
            live = float(t * k) if pair else min(nb, expected_blocks(t * k, e, bm))
            print(f"## {title} T={t}: " + (f"pair schedule, {t * k} pair blocks" if pair else
                                           f"blocked, {live:.1f} of {nb} blocks live (expected), aligned by "
                                           f"{align_method(t * k, bm, e, opts.get('align', 'auto'))}"))
            print("  GEMM   bm blocks     N     K   bn kpb st split steps programs     live  smem KB /SM waves"
                  " weights MB  flags")
            for name, (a, cfg) in zip(("GEMM1", "GEMM2"), calls):
                d = describe(a, cfg, live, args.sms)
                print(f"  {name} {d['bm']:4d} {d['blocks']:6d} {d['n']:5d} {d['k']:5d} {d['bn']:4d} {d['kpb']:3d} "
                      f"{d['stages']:2d} {d['split']:5d} {d['steps']:5d} {d['programs']:8d} {d['live_programs']:8.0f} "
                      f"{d['smem_kb']:8.1f} {d['per_sm']:3d} {d['waves']:5.1f} {d['weights_mb']:10.1f}  {d['flags']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
