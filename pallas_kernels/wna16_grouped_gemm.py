"""Grouped int4/int8 GEMM over expert blocks with in-kernel dequantization (Pallas, Triton lowering).

Version 1 of the GPU engine (see ``benchmarks/NOTES.md``): the structure of vLLM's Triton
``fused_moe_kernel_gptq_awq`` (spec ``vllm_moe_compute.md`` §3.1), written in Pallas.

* Rows arrive sorted by expert in blocks of ``block_m`` (``routing.moe_align_block_size``);
  ``expert_ids[b]`` names block ``b``'s expert (``-1``: unused block, written as zeros).
* Weights are in a kernel-native tile layout (:func:`pack_tiles`): ``[E, K / pf, N]`` int32
  where, inside each K-block of ``bk = 16 · pf`` rows, slot ``s`` of word ``w`` holds row
  ``s · 16 + w``. Unpacking slot ``s`` of a ``[bk / pf, BN]`` word tile therefore yields 16
  *contiguous* K rows, which feed one ``16``-deep MMA step without any in-register shuffle.
* Per slot: codes → ``(code - zero) · scale`` in float32 → activation dtype → ``dot`` into a
  float32 accumulator. Scales ``[E, G, N]`` and (optional) zero points ``[E, G, N]`` (uint8,
  unpacked) are looked up per slot, so any group size that is a multiple of 16 works.

:func:`grouped_gemm_reference` is the plain-jnp twin the tests compare against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS_PER_SLOT = 16  # one MMA k-step for 16-bit operands


def tile_bk(bits: int) -> int:
    """K rows per weight tile: 16 rows per slot × (32 / bits) slots."""
    return ROWS_PER_SLOT * (32 // bits)


def pack_tiles(codes, bits: int):
    """``codes [E, N, K]`` (unsigned) → kernel tile layout ``[E, K / pf, N]`` int32."""
    pf = 32 // bits
    bk = tile_bk(bits)
    e, n, k = codes.shape
    if k % bk:
        raise ValueError(f"codes: K={k} is not a multiple of the tile depth {bk}")
    c = jnp.swapaxes(codes, 1, 2).astype(jnp.uint32)               # [E, K, N]
    c = c.reshape(e, k // bk, pf, ROWS_PER_SLOT, n)                 # [E, kb, slot, w, N]
    shifts = (jnp.arange(pf, dtype=jnp.uint32) * bits)[None, None, :, None, None]
    words = jnp.sum(c << shifts, axis=2, dtype=jnp.uint32)          # [E, kb, w, N]
    return jax.lax.bitcast_convert_type(words.reshape(e, k // pf, n), jnp.int32)


def unpack_tiles(words, bits: int):
    """Inverse of :func:`pack_tiles`: ``[E, K / pf, N]`` → ``codes [E, N, K]`` int32."""
    pf = 32 // bits
    e, kw, n = words.shape
    u = jax.lax.bitcast_convert_type(words, jnp.uint32).reshape(e, kw // ROWS_PER_SLOT, 1, ROWS_PER_SLOT, n)
    shifts = (jnp.arange(pf, dtype=jnp.uint32) * bits)[None, None, :, None, None]
    c = (u >> shifts) & jnp.uint32((1 << bits) - 1)                 # [E, kb, slot, w, N]
    return jnp.swapaxes(c.reshape(e, kw * pf, n), 1, 2).astype(jnp.int32)


def _kernel(expert_ids_ref, a_ref, w_ref, s_ref, z_ref, o_ref, *, bits, group, n_kb, has_zp):
    pf = 32 // bits
    bm, bn = o_ref.shape
    pid_m = pl.program_id(0)
    pid_n = pl.program_id(1)
    e = expert_ids_ref[pid_m]
    n_sl = pl.ds(pid_n * bn, bn)
    mask = (1 << bits) - 1
    offset = 1 << (bits - 1)

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros((bm, bn), o_ref.dtype)

    @pl.when(e >= 0)
    def _():
        def body(kb, acc):
            words = w_ref[e, pl.ds(kb * ROWS_PER_SLOT, ROWS_PER_SLOT), n_sl]     # [16, BN]
            for slot in range(pf):
                k0 = kb * (ROWS_PER_SLOT * pf) + slot * ROWS_PER_SLOT
                grp = 0 if group <= 0 else k0 // group
                scale = s_ref[e, grp, n_sl].astype(jnp.float32)                 # [BN]
                if has_zp:
                    zero = z_ref[e, grp, n_sl].astype(jnp.int32)
                else:
                    zero = offset
                codes = jax.lax.shift_right_logical(words, bits * slot) & mask
                w = ((codes - zero).astype(jnp.float32) * scale[None, :]).astype(a_ref.dtype)
                a = a_ref[:, pl.ds(k0, ROWS_PER_SLOT)]                             # [BM, 16]
                acc = acc + jnp.dot(a, w, preferred_element_type=jnp.float32)
            return acc

        acc = jax.lax.fori_loop(0, n_kb, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_m", "block_n", "interpret",
                                             "num_warps", "num_stages"))
def grouped_gemm(a, expert_ids, words, scales, zeros=None, out=None, *, bits: int, group_size: int,
                 block_m: int, block_n: int = 64, interpret: bool = False, num_warps: int = 4,
                 num_stages: int = 3):
    """``out[r] = a[r] @ W[expert_ids[r // block_m]]ᵀ`` for every row block; float32 ``[M, N]``.

    ``a [M, K]`` (rows already gathered and sorted, ``M = len(expert_ids) · block_m``),
    ``words [E, K / pf, N]`` (:func:`pack_tiles`), ``scales [E, G, N]``, ``zeros [E, G, N]`` uint8
    or None (then the implicit ``2**(bits-1)``). ``out [M, N]`` float32, if given, is the buffer
    the kernel writes into (aliased): tests pass a NaN-poisoned one to prove every element is
    written.
    """
    m, k = a.shape
    e, kw, n = words.shape
    nb = expert_ids.shape[0]
    bk = tile_bk(bits)
    if m != nb * block_m or kw * (32 // bits) != k or k % bk or n % block_n:
        raise ValueError(f"grouped_gemm: inconsistent shapes a={a.shape}, words={words.shape}, "
                         f"blocks={nb}x{block_m}, block_n={block_n}, tile depth {bk}")
    has_zp = zeros is not None
    if not has_zp:
        zeros = jnp.zeros((1, 1, 1), jnp.uint8)
    kernel = functools.partial(_kernel, bits=bits, group=group_size, n_kb=k // bk, has_zp=has_zp)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    in_specs = [full(expert_ids.shape), pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                full(words.shape), full(scales.shape), full(zeros.shape)]
    args = [expert_ids.astype(jnp.int32), a, words, scales, zeros]
    if out is not None:
        if out.shape != (m, n) or out.dtype != jnp.float32:
            raise ValueError(f"out: expected float32 {(m, n)}, got {out.dtype} {out.shape}")
        kernel = functools.partial(_aliased, kernel)
        in_specs.append(pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)))
        args.append(out)
        kwargs["input_output_aliases"] = {5: 0}
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(nb, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        interpret=interpret,
        **kwargs,
    )(*args)


def _aliased(kernel, e_ref, a_ref, w_ref, s_ref, z_ref, _out_in_ref, o_ref):
    kernel(e_ref, a_ref, w_ref, s_ref, z_ref, o_ref)


def grouped_gemm_reference(a, expert_ids, words, scales, zeros=None, *, bits: int, group_size: int,
                           block_m: int):
    """Plain-jnp twin of :func:`grouped_gemm` (float32, HIGHEST precision)."""
    codes = unpack_tiles(words, bits)                                   # [E, N, K]
    k = codes.shape[-1]
    gi = jnp.zeros((k,), jnp.int32) if group_size <= 0 else jnp.arange(k) // group_size
    s = jnp.take(scales, gi, axis=1)                                    # [E, K, N]
    z = (1 << (bits - 1)) if zeros is None else jnp.take(zeros, gi, axis=1).astype(jnp.int32)
    w = (jnp.swapaxes(codes, 1, 2) - z).astype(jnp.float32) * s.astype(jnp.float32)   # [E, K, N]
    w = w.astype(a.dtype).astype(jnp.float32)
    eb = jnp.repeat(jnp.maximum(expert_ids, 0), block_m)
    out = jnp.einsum("mk,mkn->mn", a.astype(jnp.float32), w[eb], precision=jax.lax.Precision.HIGHEST)
    return jnp.where(jnp.repeat(expert_ids >= 0, block_m)[:, None], out, 0.0)


__all__ = ["grouped_gemm", "grouped_gemm_reference", "pack_tiles", "unpack_tiles", "tile_bk"]
