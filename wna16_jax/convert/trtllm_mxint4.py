"""FLASHINFER_TRTLLM backend: FlashInfer's TRT-LLM "MXINT4" MoE layout
(``docs/formats.md`` §4).

"MXINT4" here is signed (two's-complement) int4 with **bfloat16** per-32 block scales. From the
canonical N-first tensors (``gemm1 [E, 2I, H/8] int32`` uint4b8, scales ``[E, 2I, H/32] bf16``;
``gemm2 [E, H, I/8]``, ``[E, H, I/32]``), ``prepare_static_weights_for_trtllm_mxint4_moe``:

1. int32 input: every nibble ``u → (u - 8) & 0xF`` (uint8 input is taken as already signed);
2. w13 rows (and its scales) reordered from ``[gate (w1); up (w3)]`` to ``[up; gate]``;
3. words viewed as bytes ``[E, M, K/2]`` (byte ``j`` = ``k = 2j`` low nibble, ``2j+1`` high);
4. w13 bytes and scales: row ``p`` of the result = input row ``P0[P1[p]]`` with ``M = 2I``,
   ``P1[32q + s] = 32q + 4(s % 8) + s // 8`` and ``P0[2i] = i``, ``P0[2i+1] = M/2 + i``;
5. w2 bytes and scales: row permutation ``P1`` only (``M = H``);
6. scales: zero-padded to ``[round_up(M, 128), round_up(K/32, 4)]`` and flattened with the
   128×4 swizzle ``(m, k) → (m//128)·128·Kp + (k//4)·512 + (m%32)·16 + ((m%128)//32)·4 + k%4``;
7. weights: block layout ``[K/256, M, 128]`` with ``out[b, m, j] = bytes[m, 128b + j]``.

Bytes are built with explicit shifts (little-endian by construction), so unlike vLLM's
``view(uint8)`` this does not depend on the host byte order. Each index map is built once in
numpy (cached by size); the hot path is gather / reshape / transpose on uint8.

The FlashInfer kernel takes only 4-bit symmetric group-32 weights with bf16 scales (vLLM
selects it for compressed-tensors ``kInt4Static32``); :func:`convert_trtllm_mxint4` accepts any
checkpoint method in that scheme (GPTQ and symmetric AWQ go through their canonical layout).
Bias and zero points are not part of the layout (biases are passed through as vLLM's WNA16 oracle (``vllm/model_executor/layers/fused_moe/oracle/int_wna16.py``) does).
The block layout needs ``H % 256 == 0`` and ``I % 256 == 0`` (K/2 bytes in blocks of 128), which
also makes every row count a multiple of 128, so the swizzle padding never triggers from
:func:`convert_trtllm_mxint4`; :func:`block_scale_interleave` pads for general shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
import numpy as np

from .. import packing
from ..errors import DTypeError, UnsupportedError, check_divisible, check_rank, check_shape
from ..schemes import QuantScheme
from ..weights import CheckpointWeights, Form, LogicalQuant, QuantMatrix, SchemeLayout, pytree_dataclass
from .common import check_input_dtype, check_same_scheme
from .humming import canonical_n_first

MXINT4_GROUP_SIZE = 32
BLOCK_BYTES = 128  # convert_to_block_layout block size (256 int4 values)
SHUFFLE_ROWS = 32  # P1 row-block (epilogue tile 128 ⇒ 32-row blocks)
SF_ROWS, SF_COLS = 128, 4  # block_scale_interleave tile


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------------- index maps
def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@functools.lru_cache(maxsize=None)
def shuffle_row_indices(m: int) -> np.ndarray:
    """``P1``: the row shuffle for the transposed MMA output, ``P1[32q + s] = 32q + 4(s%8) + s//8``."""
    p = np.arange(m)
    q, s = p // SHUFFLE_ROWS, p % SHUFFLE_ROWS
    return _frozen((SHUFFLE_ROWS * q + 4 * (s % 8) + s // 8).astype(np.int32))


@functools.lru_cache(maxsize=None)
def gated_interleave_row_indices(m: int) -> np.ndarray:
    """``P0``: ``P0[2i] = i``, ``P0[2i+1] = m/2 + i`` (row pairs of the gated activation)."""
    i = np.arange(m // 2)
    return _frozen(np.stack([i, m // 2 + i], axis=1).reshape(m).astype(np.int32))


@functools.lru_cache(maxsize=None)
def w13_row_indices(m: int) -> np.ndarray:
    """Source row (in ``[gate; up]`` order) of every output row of w13: steps 2 and 4 composed."""
    w3w1 = (np.arange(m) + m // 2) % m  # [up; gate] row r reads [gate; up] row w3w1[r]
    return _frozen(w3w1[gated_interleave_row_indices(m)[shuffle_row_indices(m)]])


@functools.lru_cache(maxsize=None)
def _inverse(kind: str, m: int) -> np.ndarray:
    idx = w13_row_indices(m) if kind == "w13" else shuffle_row_indices(m)
    return _frozen(np.argsort(idx).astype(np.int32))


# ---------------------------------------------------------------------- array steps
def uint4b8_words_to_signed_int4_bytes(words: Any) -> Any:
    """Steps 1 + 3: ``[E, M, K/8] int32`` uint4b8 → ``[E, M, K/2] uint8`` two's-complement int4.

    ``(u - 8) & 0xF == u ^ 8`` for ``u ∈ [0, 16)``, so step 1 flips bit 3 of every nibble.
    Byte ``t`` of a word is ``(word >> 8t) & 0xFF`` (little-endian byte order).
    """
    w = packing.to_uint32(words) ^ jnp.uint32(0x88888888)
    shifts = jnp.arange(4, dtype=jnp.uint32) * jnp.uint32(8)
    b = ((w[..., None] >> shifts) & jnp.uint32(0xFF)).astype(jnp.uint8)
    return b.reshape(w.shape[:-1] + (4 * w.shape[-1],))


def block_scale_interleave(scales: Any) -> Any:
    """Step 6: ``[E, M, Kg]`` → ``[E, round_up(M,128) · round_up(Kg,4)]`` with the 128×4 swizzle
    (zero padding). Element ``(m, k)`` lands at
    ``(m//128)·128·Kp + (k//4)·512 + (m%32)·16 + ((m%128)//32)·4 + k%4``."""
    e, m, kg = scales.shape
    mp, kp = _round_up(m, SF_ROWS), _round_up(kg, SF_COLS)
    x = jnp.pad(scales, ((0, 0), (0, mp - m), (0, kp - kg)))
    # m = 128·mb + 32·mq + mr, k = 4·kb + ki  →  flat order (mb, kb, mr, mq, ki)
    x = x.reshape(e, mp // 128, 4, 32, kp // 4, 4).transpose(0, 1, 4, 3, 2, 5)
    return x.reshape(e, mp * kp)


def block_scale_deinterleave(flat: Any, m: int, kg: int) -> Any:
    """Inverse of :func:`block_scale_interleave` (drops the padding)."""
    e = flat.shape[0]
    mp, kp = _round_up(m, SF_ROWS), _round_up(kg, SF_COLS)
    check_shape("scales", flat, (e, mp * kp))
    x = flat.reshape(e, mp // 128, kp // 4, 32, 4, 4).transpose(0, 1, 4, 3, 2, 5)
    return x.reshape(e, mp, kp)[:, :m, :kg]


def convert_to_block_layout(x: Any, block_k: int = BLOCK_BYTES) -> Any:
    """Step 7: ``[E, M, Kb]`` → ``[E, Kb/block_k, M, block_k]``, ``out[b, m, j] = x[m, block_k·b + j]``."""
    e, m, kb = x.shape
    return x.reshape(e, m, kb // block_k, block_k).transpose(0, 2, 1, 3)


def _from_block_layout(x: Any) -> Any:
    e, nb, m, bk = x.shape
    return x.transpose(0, 2, 1, 3).reshape(e, m, nb * bk)


class Mxint4Tensors(NamedTuple):
    """The four tensors ``prepare_static_weights_for_trtllm_mxint4_moe`` returns (its dict keys)."""

    gemm1_weights: Any
    gemm1_scales: Any
    gemm2_weights: Any
    gemm2_scales: Any


def _prepare_one(name: str, weights: Any, scales: Any, gated: bool) -> tuple[Any, Any]:
    weights, scales = jnp.asarray(weights), jnp.asarray(scales)
    check_rank(f"{name}_weights", weights, 3)
    check_rank(f"{name}_scales", scales, 3)
    dt = np.dtype(weights.dtype)
    if dt == np.int32:
        b = uint4b8_words_to_signed_int4_bytes(weights)
    elif dt == np.uint8:
        b = weights  # already two's-complement int4 bytes (step 1 skipped, as in FlashInfer)
    else:
        raise DTypeError(f"{name}_weights: expected int32 (uint4b8 words) or uint8 (signed int4 "
                         f"bytes), got {dt}")
    if np.dtype(scales.dtype) != np.dtype(jnp.bfloat16):
        raise DTypeError(f"{name}_scales: MXINT4 block scales must be bfloat16, got "
                         f"{np.dtype(scales.dtype)}")
    e, m, kb = b.shape
    check_divisible(f"{name}_weights rows (M)", m, SHUFFLE_ROWS,
                    "row shuffle works on 32-row blocks")
    check_divisible(f"{name}_weights bytes per row (K/2)", kb, BLOCK_BYTES,
                    "block layout needs K % 256 == 0")
    check_shape(f"{name}_scales", scales, (e, m, 2 * kb // MXINT4_GROUP_SIZE))
    idx = w13_row_indices(m) if gated else shuffle_row_indices(m)
    b = jnp.take(b, idx, axis=1)
    s = jnp.take(scales, idx, axis=1)
    return convert_to_block_layout(b), block_scale_interleave(s)


def prepare_static_weights_for_trtllm_mxint4_moe(gemm1_weights: Any, gemm1_scales: Any,
                                                  gemm2_weights: Any, gemm2_scales: Any
                                                  ) -> Mxint4Tensors:
    """Canonical N-first int4 MoE tensors → FlashInfer TRT-LLM MXINT4 layout (steps 1–7).

    ``gemm1_weights [E, 2I, H/8] int32`` (uint4b8, ``[gate; up]``) or ``[E, 2I, H/2] uint8``
    (already signed), ``gemm1_scales [E, 2I, H/32] bf16``, ``gemm2_weights [E, H, I/8]`` /
    ``[E, H, I/2]``, ``gemm2_scales [E, H, I/32] bf16`` → ``gemm1_weights [E, H/256, 2I, 128] u8``,
    ``gemm1_scales [E, pad128(2I)·pad4(H/32)] bf16``, ``gemm2_weights [E, I/256, H, 128] u8``,
    ``gemm2_scales [E, pad128(H)·pad4(I/32)] bf16``. Pure and jit-able.
    """
    w1, s1 = _prepare_one("gemm1", gemm1_weights, gemm1_scales, gated=True)
    w2, s2 = _prepare_one("gemm2", gemm2_weights, gemm2_scales, gated=False)
    return Mxint4Tensors(w1, s1, w2, s2)


# ---------------------------------------------------------------------- pytree
@dataclasses.dataclass(frozen=True)
class Mxint4Form(Form):
    """The MXINT4 block layout of one GEMM (``kind``: ``"w13"``, gated and interleaved, or ``"w2"``)."""

    kind: str = "w2"

    def decode(self, m: QuantMatrix) -> LogicalQuant:
        inv = _inverse(self.kind, self.n)
        b = jnp.take(_from_block_layout(m.qvalue), inv, axis=1)  # [E, N, K/2] signed int4 bytes
        nib = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))
        codes = (nib ^ 8).astype(jnp.int32)  # signed int4 s → uint4b8 code (s + 8) & 0xF
        scales = jnp.take(block_scale_deinterleave(m.scale, self.n, self.k // MXINT4_GROUP_SIZE), inv, axis=1)
        return LogicalQuant(codes, scales, None, None, bits=4, group_size=MXINT4_GROUP_SIZE)


@pytree_dataclass(meta=("scheme", "hidden_size", "intermediate_size"))
class TrtllmMxint4Weights(SchemeLayout):
    """FlashInfer TRT-LLM MXINT4 layout of one MoE layer (flat names as vLLM's dict keys).

    ``gemm1_weights [E, H/256, 2I, 128] uint8``, ``gemm1_scales [E, pad128(2I)·pad4(H/32)] bf16``,
    ``gemm2_weights [E, I/256, H, 128] uint8``, ``gemm2_scales [E, pad128(H)·pad4(I/32)] bf16``,
    biases ``[E, 2I]`` / ``[E, H]`` passed through (the kernel takes none).
    """

    LAYOUT: ClassVar[str] = "trtllm_mxint4"
    NAMES: ClassVar[dict] = {"gemm1_weights": ("w13", "qvalue"), "gemm1_scales": ("w13", "scale"),
                             "gemm2_weights": ("w2", "qvalue"), "gemm2_scales": ("w2", "scale")}


    @classmethod
    def forms(cls, *, scheme, hidden_size, intermediate_size):
        h, i = hidden_size, intermediate_size
        return Mxint4Form(2 * i, h, "w13"), Mxint4Form(h, i, "w2")

    @classmethod
    def quant_params(cls, meta):
        return 4, MXINT4_GROUP_SIZE


def convert_trtllm_mxint4(scheme: QuantScheme, weights: CheckpointWeights, input_dtype: Any = None
                          ) -> TrtllmMxint4Weights:
    """Loader layout → :class:`TrtllmMxint4Weights`. Needs 4-bit symmetric group-32 weights with
    bfloat16 scales, no act-order, ``H % 256 == 0`` and ``I % 256 == 0``; bf16 activations.
    Pure and jit-able (``scheme`` and ``input_dtype`` static)."""
    check_same_scheme(scheme, weights)
    check_input_dtype("FLASHINFER_TRTLLM", input_dtype, allowed=(jnp.bfloat16,))
    if scheme.bits != 4:
        raise UnsupportedError(f"scheme.bits: MXINT4 needs 4-bit weights, got {scheme.bits}")
    if scheme.zero_point:
        raise UnsupportedError(
            f"scheme.zero_point: MXINT4 is symmetric (no zero points), got {scheme.describe()}")
    if scheme.group_size != MXINT4_GROUP_SIZE:
        raise UnsupportedError(
            f"scheme.group_size: MXINT4 needs group size {MXINT4_GROUP_SIZE}, got {scheme.group_size}")
    if scheme.act_order:
        raise UnsupportedError(f"scheme.act_order: MXINT4 has no g_idx, got {scheme.describe()}")
    for name, size in (("hidden_size", weights.hidden_size),
                       ("intermediate_size", weights.intermediate_size)):
        check_divisible(name, size, 2 * BLOCK_BYTES, "MXINT4 block layout: K/2 bytes in blocks of 128")
    for name in ("w13_scales", "w2_scales"):
        dt = np.dtype(getattr(weights, name).dtype)
        if dt != np.dtype(jnp.bfloat16):
            raise DTypeError(f"{name}: MXINT4 block scales must be bfloat16, got {dt}")
    t = canonical_n_first(weights)
    out = prepare_static_weights_for_trtllm_mxint4_moe(
        t.w13_weight, t.w13_weight_scale, t.w2_weight, t.w2_weight_scale)
    return TrtllmMxint4Weights.of(
        gemm1_weights=out.gemm1_weights, gemm1_scales=out.gemm1_scales,
        gemm2_weights=out.gemm2_weights, gemm2_scales=out.gemm2_scales,
        w13_bias=weights.w13_bias, w2_bias=weights.w2_bias,
        scheme=scheme, hidden_size=weights.hidden_size,
        intermediate_size=weights.intermediate_size)


__all__ = [
    "Mxint4Tensors", "TrtllmMxint4Weights", "block_scale_deinterleave", "block_scale_interleave",
    "convert_to_block_layout", "convert_trtllm_mxint4", "gated_interleave_row_indices",
    "prepare_static_weights_for_trtllm_mxint4_moe", "shuffle_row_indices",
    "uint4b8_words_to_signed_int4_bytes", "w13_row_indices",
]
