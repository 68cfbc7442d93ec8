"""The decode-attention table: which kernel attends one decode step over a KV cache, and why not.

A decode step (one new token per sequence) reads every earlier position of its row from the
cache. On an NVIDIA GPU a Triton kernel (:mod:`pallas_kernels.decode_attention`) streams the
cache in blocks with an online softmax and folds the step's own key / value in from registers;
elsewhere, and for shapes a kernel refuses, the decoder attends on XLA. One row per cache form
of :class:`~wna16_jax.models.kv_cache.KVCache`:

* ``"contiguous"`` — a row's positions are one block of the pool (``decode_attention``);
* ``"paged"`` — a row's positions are the blocks its block table names (``paged_decode_attention``);
* ``"latent"`` — DeepSeek's latent attention over either form (``latent_decode_attention``): every
  head scores the shared latent and rotated key, and takes the latent back.

The decoder asks :func:`kernel_reason` (None: the kernel takes the step) and calls
:func:`kernel_decode`; nothing under :mod:`wna16_jax.models` imports a kernel module itself.
"""

from __future__ import annotations

from pallas_kernels import decode_attention as _kernels

#: the table's rows (the cache form → what the row's kernel is called); latent attention's
#: (DeepSeek's MLA, absorbed: one shared latent key / value) takes both forms in one kernel
FORMS = {"contiguous": "decode_attention", "paged": "paged_decode_attention",
         "latent": "latent_decode_attention"}


def kernel_reason(paged: bool, q_shape, pool_shape, dtype) -> str | None:
    """Why no kernel attends a decode step whose queries have shape ``q_shape`` (last axis the
    head dim) over a pool ``[L, P, n, block, d]`` of ``dtype`` (None: the row's kernel takes it)."""
    if paged:
        return _kernels.paged_unsupported_reason(q_shape, pool_shape, dtype)
    return _kernels.unsupported_reason(q_shape, pool_shape[1:], dtype)


def kernel_decode(q, k_new, v_new, k_pool, v_pool, layer, block_table, lengths, *, scale: float,
                  window: int | None = None, interpret: bool = False):
    """``[B, n_kv, G, D]``: the step's queries ``q [B, n_kv, G, D]`` attending to slots
    ``0 … lengths[b] - 1`` of layer ``layer`` of the pools and to the step's own ``k_new`` /
    ``v_new`` ``[B, n_kv, D]`` (not written); ``block_table`` ``[B, M]`` for a paged pool, None for
    a contiguous one. ``interpret``: run the kernel in Pallas's interpreter (tests on a CPU)."""
    if block_table is None:
        return _kernels.decode_attention(q, k_new, v_new, k_pool, v_pool, layer, lengths, scale=scale,
                                         window=window, interpret=interpret)
    return _kernels.paged_decode_attention(q, k_new, v_new, k_pool, v_pool, layer, block_table, lengths,
                                           scale=scale, window=window, interpret=interpret)


def latent_kernel_reason(paged: bool, q_shape, rope_dim: int, pool_shape, dtype) -> str | None:
    """Why no kernel attends a latent-attention decode step with latent queries of ``q_shape``
    ``[B, H, R]`` and ``rope_dim`` rotated dimensions over a latent pool ``[L, P, 1, S, R]`` of
    ``dtype`` (None: the kernel takes it)."""
    return _kernels.latent_unsupported_reason(q_shape, rope_dim, pool_shape, dtype, paged=paged)


def latent_kernel_decode(q, q_rope, c_new, r_new, c_pool, r_pool, layer, block_table, lengths, *, scale: float,
                         interpret: bool = False):
    """``[B, H, R]``: the attended latent of the step's latent queries ``q [B, H, R]`` and rotated
    ``q_rope [B, H, Dr]`` over slots ``0 … lengths[b] - 1`` of layer ``layer`` of the pools and
    the step's own ``c_new [B, R]`` / ``r_new [B, Dr]`` (not written); ``block_table`` as in
    :func:`kernel_decode`."""
    return _kernels.latent_decode_attention(q, q_rope, c_new, r_new, c_pool, r_pool, layer, block_table, lengths,
                                            scale=scale, interpret=interpret)


__all__ = ["FORMS", "kernel_decode", "kernel_reason", "latent_kernel_decode", "latent_kernel_reason"]
