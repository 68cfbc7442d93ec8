"""Engine v4 seed: a Mosaic GPU (Hopper wgmma) grouped W4A16 GEMM with the weights dequantized
into the register A operand — NOT YET RUN ON A GPU (written and lowering-checked on the CPU;
its GPU test is ``tests/test_pallas_engine.py::test_wgmma_grouped_gemm_gpu``).

Operands are swapped as in Marlin's small-M schedule: per program, ``accᵀ[BN, BM] += Wᵀ · Aᵀ``
where ``Wᵀ`` (64 output columns × 16 of K) is the wgmma's register operand and the ``BM``
activation rows are its shared-memory operand, so a block of 8–64 tokens fills the wgmma's N
side instead of wasting a 64-row M side.

Weight layout (:func:`to_wgmma_layout`, from the engine's tile layout): words ``[E, N, K/8]``
int32 — the tile layout transposed, so slot ``s`` of the 16 words ``[n, 16·kb : 16·kb + 16]`` holds
rows ``128·kb + 16·s + w`` (``w`` = word index) of column ``n``: each slot is exactly one 16-deep
wgmma step. Scales and zero points ``[E, G, N]`` in the activation dtype (TMA moves whole
128-byte rows; integer zero points up to 255 are exact in bf16/fp16).

Per program (block ``i`` of ``BM`` rows, column tile ``j``, split ``s``): ``plgpu.emit_pipeline``
streams its K-blocks through a ring of ``stages`` shared-memory buffers (TMA copies of the
``[64, 16]`` word tile, the ``[BM, 128]`` activation tile and the group's scale and zero rows);
for each K-block the words are loaded in the wgmma register layout and each slot becomes
``(code − zero) · scale`` → activation dtype → one ``wgmma``. A persistent grid and the fused
epilogues of :mod:`pallas_kernels.wna16_grouped_gemm` are the next steps once this runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK_N = 64          # wgmma M side: output columns per program
BLOCK_K = 128         # one K-block: 16 words × 8 slots
IDS_PAD = 32          # TMA copies whole multiples of 128 bytes: the block → expert ids are padded


def to_wgmma_layout(words, scales, zeros=None, dtype=jnp.bfloat16):
    """Engine tile layout (``words [E, K/8, N]``, ``scales [E, G, N]``, ``zeros`` uint8 or None)
    → this kernel's ``(words [E, N, K/8], scales [E, G, N] dtype, zeros [E, G, N] dtype or None)``."""
    w = jnp.swapaxes(words, 1, 2)
    s = scales.astype(dtype)
    z = None if zeros is None else zeros.astype(dtype)
    return w, s, z


def _check(a, expert_ids, words, scales, zeros, block_m, split_k, group_size):
    m, k = a.shape
    e, n, kw = words.shape
    if a.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"a: expected bfloat16 or float16, got {a.dtype}")
    if kw * 8 != k or k % BLOCK_K or n % BLOCK_N:
        raise ValueError(f"wgmma_grouped_gemm: a={a.shape} and words={words.shape} need K = 8·K/8 and "
                         f"K % {BLOCK_K} == 0, N % {BLOCK_N} == 0")
    if block_m % 8 or not 8 <= block_m <= 256 or m != expert_ids.shape[0] * block_m:
        raise ValueError(f"wgmma_grouped_gemm: block_m={block_m} must be a multiple of 8 in [8, 256] and "
                         f"a must hold {expert_ids.shape[0]} blocks of it, got {m} rows")
    if group_size not in (-1, BLOCK_K):
        raise ValueError(f"wgmma_grouped_gemm: group_size must be {BLOCK_K} or -1 (channelwise), got {group_size}")
    g = 1 if group_size == -1 else k // BLOCK_K
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and (t.shape != (e, g, n) or t.dtype != a.dtype):
            raise ValueError(f"{name}: expected {a.dtype} {(e, g, n)}, got {t.dtype} {t.shape}")
    n_kb = k // BLOCK_K
    if split_k < 1 or n_kb % split_k:
        raise ValueError(f"wgmma_grouped_gemm: split_k={split_k} must divide the {n_kb} K-blocks")


@functools.partial(jax.jit, static_argnames=("block_m", "split_k", "group_size", "stages"))
def wgmma_grouped_gemm(a, expert_ids, words, scales, zeros=None, *, block_m: int, group_size: int = 128,
                       split_k: int = 1, stages: int = 3):
    """``out[s, r] = a[r] @ W[expert_ids[r // block_m]]ᵀ`` over split ``s``'s share of K.

    ``a [M, K]`` bf16/fp16 (rows sorted into blocks), ``expert_ids [M / block_m]`` (``-1``: zero
    rows), weights from :func:`to_wgmma_layout`. Returns float32 partials ``[split_k, M, N]``.
    4-bit codes; ``zeros=None`` means the symmetric zero point 8. ``stages``: K-blocks in flight
    (``plgpu.emit_pipeline``'s ring of shared-memory buffers, TMA-fed).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _check(a, expert_ids, words, scales, zeros, block_m, split_k, group_size)
    m, k = a.shape
    e, n, _ = words.shape
    nb = expert_ids.shape[0]
    n_kb = k // BLOCK_K
    chunk = n_kb // split_k
    dtype = a.dtype
    bm = block_m
    nbp = -(-nb // IDS_PAD) * IDS_PAD
    ids = jnp.full((nbp,), -1, jnp.int32).at[:nb].set(expert_ids.astype(jnp.int32))
    has_zp = zeros is not None
    row = plgpu.Layout.WGMMA.reduce(1)

    def kernel(ids_gmem, a_gmem, w_gmem, s_gmem, *rest):
        z_gmem, o_gmem = rest if has_zp else (None, rest[0])
        i, j, sp = jax.lax.axis_index("b"), jax.lax.axis_index("n"), jax.lax.axis_index("s")

        def step(_, w_smem, x_smem, s_smem, *rest):
            """One K-block: words ``[64, 16]``, activations ``[BM, 128]``, scale (and zero) rows
            ``[1, 64]``; the carry is the accumulator."""
            z_smem, acc = rest if has_zp else (None, rest[0])
            words_r = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA)                  # [64, 16] int32
            sc = jax.lax.broadcast_in_dim(plgpu.load(s_smem.at[0], (), layout=row).astype(jnp.float32),
                                          (BLOCK_N, 16), (0,))
            if has_zp:
                zc = jax.lax.broadcast_in_dim(plgpu.load(z_smem.at[0], (), layout=row).astype(jnp.float32),
                                              (BLOCK_N, 16), (0,))
            else:
                zc = 8.0                                    # symmetric 4-bit
            xt = plgpu.transpose_ref(x_smem, (1, 0))                                        # [128, BM]

            def mma(acc_ref):
                acc_ref[...] = acc
                for slot in range(8):
                    codes = jax.lax.shift_right_logical(words_r, jnp.int32(4 * slot)) & 15
                    w = ((codes.astype(jnp.float32) - zc) * sc).astype(dtype)
                    plgpu.wgmma(acc_ref, w, xt.at[pl.ds(16 * slot, 16)])
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            return pl.run_scoped(mma, plgpu.ACC((BLOCK_N, bm), jnp.float32))

        pipe = plgpu.emit_pipeline(
            step, grid=(chunk,), max_concurrent_steps=min(stages, chunk),
            in_specs=[
                plgpu.BlockSpec((BLOCK_N, 16), lambda kb: (0, kb),
                                transforms=(plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(64))),
                plgpu.BlockSpec((bm, BLOCK_K), lambda kb: (0, kb),
                                transforms=(plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))),
                *[plgpu.BlockSpec((1, BLOCK_N), lambda kb: (0 if group_size == -1 else kb, 0))] * (2 if has_zp else 1)],
            init_carry=plgpu.layout_cast(jnp.zeros((BLOCK_N, bm), jnp.float32), plgpu.Layout.WGMMA))

        def body(ids_smem, ids_bar):
            plgpu.copy_gmem_to_smem(ids_gmem, ids_smem, ids_bar)
            plgpu.barrier_wait(ids_bar)
            ex = ids_smem[i]
            cols = pl.ds(j * BLOCK_N, BLOCK_N)
            k0 = sp * chunk
            groups = pl.ds(0, 1) if group_size == -1 else pl.ds(k0, chunk)
            dst = o_gmem.at[sp, cols, pl.ds(i * bm, bm)]

            @pl.when(ex >= 0)
            def _():
                dst[...] = pipe(w_gmem.at[ex, cols, pl.ds(k0 * 16, chunk * 16)],
                                a_gmem.at[pl.ds(i * bm, bm), pl.ds(k0 * BLOCK_K, chunk * BLOCK_K)],
                                s_gmem.at[ex, groups, cols], *([z_gmem.at[ex, groups, cols]] if has_zp else []))

            @pl.when(ex < 0)
            def _():
                dst[...] = plgpu.layout_cast(jnp.zeros((BLOCK_N, bm), jnp.float32), plgpu.Layout.WGMMA)

        pl.run_scoped(body, plgpu.SMEM((nbp,), jnp.int32), plgpu.Barrier(num_arrivals=1))

    out_t = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((split_k, n, m), jnp.float32),
                         grid=(nb, n // BLOCK_N, split_k), grid_names=("b", "n", "s"))(
        ids, a, words, scales, *([zeros] if has_zp else []))
    return jnp.swapaxes(out_t, 1, 2)
