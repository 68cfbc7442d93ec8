"""The wgmma grouped W4A16 GEMM (Hopper, Mosaic GPU): weights dequantized in registers into the
wgmma's register operand, one call per :class:`~pallas_kernels.wgmma_config.GemmConfig`.

``out[s, r] = a[r] @ W[expert_ids[r // block_m]]ᵀ`` over split ``s``'s share of K, for ``a [M, K]``
bf16/fp16 (rows sorted into ``block_m``-row expert blocks; an expert id of ``-1`` gives zero rows)
and weights in the wgmma layout (:mod:`pallas_kernels.wgmma_layout`). The configuration picks the
kernel form — plain (:mod:`~pallas_kernels.wgmma_plain`), warp-specialized
(:mod:`~pallas_kernels.wgmma_ws`) or the chained warp-specialized stream
(:mod:`~pallas_kernels.wgmma_ws_stream`) — and its epilogue. :func:`wgmma_grouped_gemm_reference`
is the same contract in plain ``jnp``, which the tests compare the kernels against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import device
from .activations import act_pair
from .errors import KernelConfigError, KernelDTypeError, KernelShapeError
from .wgmma_common import GemmBuild, named
from .wgmma_config import IDS_PAD, SMEM_LIMIT, GemmConfig, wgmma_smem_bytes
from .wgmma_layout import BLOCK_K, BLOCK_N, from_wgmma_layout, magic_value
from .wgmma_plain import plain_kernel
from .wgmma_ws import ws_kernel
from .wgmma_ws_stream import ws_stream_kernel
from .wna16_grouped_gemm import dequantize_tiles

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_gemm(a, expert_ids, words, scales, zeros, row_scale, cfg: GemmConfig) -> None:
    """The rules between the arrays and the configuration; :class:`KernelError` naming the first broken."""
    if not isinstance(cfg, GemmConfig):
        raise KernelConfigError(f"config: expected a GemmConfig, got {type(cfg).__name__}")
    k = a.shape[1]
    bm = cfg.block_m
    m = expert_ids.shape[0] * bm              # output rows: one block_m-row block per expert id
    if row_scale is not None and (row_scale.shape != (m,) or row_scale.dtype != jnp.float32):
        raise (KernelShapeError if row_scale.shape != (m,) else KernelDTypeError)(
            f"row_scale: expected float32 of shape ({m},) (one scale per output row), got "
            f"{jnp.dtype(row_scale.dtype).name}{tuple(row_scale.shape)}")
    if a.dtype not in _DTYPES:
        raise KernelDTypeError(f"a: expected bfloat16 or float16, got {a.dtype}")
    if words.ndim != 3 or jnp.dtype(words.dtype) != jnp.dtype(jnp.int16):
        raise KernelDTypeError(f"words: expected int16 [E, N, K/4] (to_wgmma_layout), got {words.dtype}{words.shape}")
    e, n, kw = words.shape
    if kw * 4 != k or k % BLOCK_K or n % BLOCK_N:
        raise KernelShapeError(f"wgmma_grouped_gemm: a={a.shape} and words={words.shape} need K = 4·words.shape[2], "
                               f"K % {BLOCK_K} == 0, N % {BLOCK_N} == 0")
    if a.shape[0] != m:
        raise KernelShapeError(f"wgmma_grouped_gemm: a must hold {expert_ids.shape[0]} blocks of block_m={bm} rows, "
                               f"got {a.shape[0]} rows")
    g = 1 if cfg.group_size == -1 else k // BLOCK_K
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and t.shape != (e, g, n):
            raise KernelShapeError(f"{name}: expected shape {(e, g, n)}, got {t.shape}")
        if t is not None and t.dtype != a.dtype:
            raise KernelDTypeError(f"{name}: expected {a.dtype} (the activation dtype, to_wgmma_layout), got {t.dtype}")
    n_kb = k // BLOCK_K
    if n_kb % cfg.split_k:
        raise KernelConfigError(f"wgmma_grouped_gemm: split_k={cfg.split_k} must divide the {n_kb} K-blocks")
    if n % cfg.block_n or (n_kb // cfg.split_k) % cfg.kpb:
        raise KernelConfigError(f"wgmma_grouped_gemm: block_n={cfg.block_n} must divide N={n} and kpb={cfg.kpb} "
                                f"the {n_kb // cfg.split_k} K-blocks per split")
    if cfg.ws and n % (2 * cfg.block_n):
        raise KernelConfigError(f"wgmma_grouped_gemm: ws=True needs N={n} a multiple of 2·block_n={2 * cfg.block_n}")
    chunk = n_kb // cfg.split_k // cfg.kpb
    if cfg.stream and (row_scale is not None or chunk % min(cfg.stages, chunk)):
        raise KernelConfigError(f"wgmma_grouped_gemm: stream=True (one chained warp-specialized pipeline per item) "
                                f"takes no row_scale, and stages dividing the {chunk} steps of an item; got row_scale "
                                f"{'given' if row_scale is not None else None}, stages={cfg.stages}")
    rows_ids = -(-(expert_ids.shape[0] + cfg.stream) // IDS_PAD)
    if rows_ids > 256:
        raise KernelShapeError(f"wgmma_grouped_gemm: {expert_ids.shape[0]} blocks > {256 * IDS_PAD - cfg.stream}")
    need = wgmma_smem_bytes(block_m=bm, block_n=cfg.block_n, kpb=cfg.kpb,
                            stages=cfg.stages if cfg.stream else min(cfg.stages, chunk), n_blocks=expert_ids.shape[0],
                            ws=cfg.ws, tout=cfg.tout, gated=cfg.gated is not None, has_zp=zeros is not None,
                            channelwise=cfg.group_size == -1, row_scale=row_scale is not None, stream=cfg.stream)
    if need > SMEM_LIMIT:
        raise KernelConfigError(f"wgmma_grouped_gemm: {cfg} needs {need} bytes of shared memory per program, more "
                                f"than the {SMEM_LIMIT} an H100/H200 thread block may use: fewer stages, a smaller "
                                f"kpb or block_m, or tout=False")


@functools.partial(jax.jit, static_argnames=("config",))
def wgmma_grouped_gemm(a, expert_ids, words, scales, zeros=None, row_scale=None, *, config: GemmConfig):
    """``out[s, r] = a[r] @ W[expert_ids[r // block_m]]ᵀ`` over split ``s``'s share of K.

    ``a [M, K]`` bf16/fp16, ``expert_ids [M / block_m]`` (``-1``: zero rows), ``words [E, N, K/4]``
    int16, ``scales`` / ``zeros`` ``[E, G, N]`` in ``a``'s dtype (:func:`to_wgmma_layout`;
    ``zeros=None``: the symmetric zero point 8), ``row_scale [M]`` float32 (each output row times
    its scale in the epilogue, before the output's rounding). Returns ``[split_k, M, N]`` (``N/2``
    with ``gated``) in float32, or in ``a``'s dtype with ``out16``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = config
    check_gemm(a, expert_ids, words, scales, zeros, row_scale, cfg)
    k = a.shape[1]
    e, n, _ = words.shape
    nb = expert_ids.shape[0]
    bm = cfg.block_m
    m = nb * bm
    rows_ids = -(-(nb + cfg.stream) // IDS_PAD)
    # block → expert ids as [R, 32] int32 rows: TMA moves multiples of 128 bytes and at most
    # 256 elements per dimension, so one copy covers up to 8192 blocks
    # (stream: one slot more, the last, for the number of blocks up to the last live one)
    ids = jnp.full((rows_ids * IDS_PAD,), -1, jnp.int32).at[:nb].set(expert_ids.astype(jnp.int32))
    programs = None
    if cfg.stream:
        live_blocks = jnp.max(jnp.where(expert_ids >= 0, jnp.arange(1, nb + 1, dtype=jnp.int32), 0))
        ids = ids.at[-1].set(live_blocks)
        programs = cfg.programs or device.num_sms()            # one ws program per SM (384 threads × 168 registers)
        programs = max(1, min(programs, nb * (n // (2 * cfg.block_n)) * cfg.split_k))
    ids = ids.reshape(rows_ids, IDS_PAD)
    has_zp, has_rs = zeros is not None, row_scale is not None
    b = GemmBuild(cfg, dtype=a.dtype, m=m, n=n, k=k, nb=nb, has_zp=has_zp, has_rs=has_rs, programs=programs)
    operands = (ids, a, words, scales, *([zeros] if has_zp else []))
    if has_rs:                                # [blocks, rw]: one 128-byte-aligned TMA row per block
        operands += (jnp.pad(row_scale.reshape(nb, bm), ((0, 0), (0, b.rw - bm))),)
    body, mesh = (ws_stream_kernel if cfg.stream else ws_kernel if cfg.ws else plain_kernel)(b)
    # named after its shape, so that profiles tell a layer's GEMMs apart (Mosaic GPU names the
    # kernel after its body: "wgmma_n28672_k4096_m8_s2_mosaic_gpu_kernel")
    body = named(body, f"wgmma_n{n}_k{k}_m{bm}" + (f"_s{cfg.split_k}" if cfg.split_k > 1 else ""))
    out_t = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((cfg.split_k, m, b.n_out) if cfg.tout
                                                             else (cfg.split_k, b.n_out, m), b.odt), **mesh)(*operands)
    return out_t if cfg.tout else jnp.swapaxes(out_t, 1, 2)


def _gated64(out, activation):
    """``act(gate)·up`` of each 128-column tile's 64-column halves (the gated epilogue's order)."""
    s, m, n = out.shape
    t = out.reshape(s, m, n // 128, 2, 64)
    return act_pair(activation, t[..., 0, :], t[..., 1, :]).reshape(s, m, n // 2)


def wgmma_grouped_gemm_reference(a, expert_ids, words, scales, zeros=None, row_scale=None, *, config: GemmConfig):
    """:func:`wgmma_grouped_gemm`'s contract in ``jnp`` (float32, the kernel's K splits), on any
    device: the weights decoded through the tile layout, each split's K range multiplied in
    float32 at the highest precision, zero rows for id -1, the gated epilogue's column halves, the
    row scales, then the output dtype."""
    cfg = config
    check_gemm(a, expert_ids, words, scales, zeros, row_scale, cfg)
    split_k = cfg.split_k
    z = None if zeros is None else (zeros.astype(jnp.float32) - magic_value(a.dtype)).astype(jnp.uint8)
    w = dequantize_tiles(from_wgmma_layout(words), scales, z, bits=4, group_size=cfg.group_size, dtype=a.dtype)
    blocks = a.reshape(-1, cfg.block_m, a.shape[1]).astype(jnp.float32)
    wb = w[jnp.maximum(expert_ids, 0)].astype(jnp.float32)
    kc = a.shape[1] // split_k                 # each split's share of K, as the kernel splits it
    out = jnp.stack([jnp.einsum("bmk,bkn->bmn", blocks[:, :, i * kc:(i + 1) * kc], wb[:, i * kc:(i + 1) * kc],
                                precision=jax.lax.Precision.HIGHEST) for i in range(split_k)])
    out = jnp.where((expert_ids >= 0)[None, :, None, None], out, 0.0).reshape(split_k, a.shape[0], -1)
    if cfg.gated is not None:
        out = _gated64(out, cfg.gated)
    if row_scale is not None:
        out = out * row_scale[:, None]
    return out.astype(a.dtype if cfg.out16 else jnp.float32)


__all__ = ["check_gemm", "wgmma_grouped_gemm", "wgmma_grouped_gemm_reference"]
