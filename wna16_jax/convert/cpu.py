"""CPU backend (``docs/formats.md`` §5): the blocked int4 layout of vLLM's x86/AMX
kernel (``prepare_int4_moe_layer_for_cpu`` → ``convert_weight_packed_scale_zp``).

Per expert, from K-first input (AWQ: ``w [K, N/8]`` N-packed in AWQ order, zeros
``[G, N/8]`` AWQ order; GPTQ: ``w [K/8, N]`` K-packed, zeros ``[G, N/8]`` v1 ``z - 1``;
scales ``[G, N]``):

1. codes ``Wu [N, K]`` (0..15); zeros ``Z [N, G]`` — AWQ: the nibble; GPTQ: nibble + 1;
   scales → float32 ``[N, G]``;
2. ``bn = 32``, ``bk = min(gs, 128)`` with ``gs = K / G``; ``Nc = N / 32``, ``Kc = K / bk``;
3. blocked scales / zeros ``[Nc, G, 32]``: ``[nc, g, j] = S[32nc + j, g]`` (float32 / int8);
4. compensation ``C[nc, kc, j] = Σ_{k in block kc} (Wu[32nc+j, k] − Z[32nc+j, k//gs])`` (int32);
5. blocked bytes ``[Nc, Kc, 16·bk + 128]``: for local ``n < 32``, ``k < bk`` with
   ``kq = k//4, ki = k%4, p = n//16, ni = n%8, hi = (n%16)//8``, byte
   ``kq·64 + p·32 + ni·4 + ki`` holds ``Wu[32nc+n, kc·bk+k]`` in its low (``hi = 0``) or high
   (``hi = 1``) nibble; the last 128 bytes are ``C[nc, kc, 0..31]`` as little-endian int32.

That byte map is a pure axis permutation (``n = 16p + 8hi + ni``, ``k = 4kq + ki``; bytes in
``(kq, p, ni, ki)`` order, ``hi`` selecting the nibble), so the hot path is a reshape +
transpose + two-nibble pack; the little-endian compensation bytes are built with shifts.

Front end (``_process_weights_cpu``): AWQ → AWQ algorithm on the native layout; GPTQ and
compressed-tensors → GPTQ algorithm on K-first tensors (compressed-tensors is transposed back
from its N-first layout). Symmetric checkpoints have no zeros; vLLM synthesizes ``0x77777777``
(GPTQ's ``+1`` turns it into 8). Biases are cast to float32. Act-order is refused, 8-bit too.

Conscious deviations from vLLM (each only reachable where vLLM would compute wrong zeros):

* GPTQ zero = ``(nibble + 1) mod 16``. vLLM's unpacker gives 16 for nibble 15, which is how
  AutoGPTQ v1 stores a true zero of 0 (``0 - 1`` wrapped); we wrap to 0, as the checkpoint means
  (and as ``CheckpointWeights.decode`` reads it). vLLM 0.33.0 refuses asymmetric GPTQ anyway.
* compressed-tensors (and ``gptq_v2``) zero points are *true* zeros; feeding them to the GPTQ
  algorithm (``+1``) would be off by one, so :func:`convert_cpu` turns them into v1 ``z - 1``
  first. (vLLM never selects CPU for compressed-tensors asym: its key is not ``kInt4Static``.)
* AWQ without zero points (``zero_point=False``): the AWQ algorithm adds nothing, so the
  synthesized zeros are ``0x88888888`` (effective zero 8), not GPTQ's ``0x77777777``.

The layout is what the kernel reads; the kernel itself quantizes activations to uint8 and is
numerically W4A8 (docs/formats.md §5), which does not concern the conversion.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import packing
from ..errors import (
    ConfigError, ShapeError, UnsupportedError, check_divisible, check_dtype, check_rank, check_shape,
)
from ..schemes import QuantMethod, QuantScheme
from ..weights import CheckpointWeights, Form, LogicalQuant, QuantMatrix, SchemeLayout, layout_names, pytree_dataclass
from .common import check_input_dtype, check_same_scheme

BLOCK_N = 32  # block_size_n() = 2 · TILE_N
MAX_BLOCK_K = 128
COMPENSATION_BYTES = 4 * BLOCK_N  # 32 little-endian int32 per block

#: symmetric zeros vLLM synthesizes for the GPTQ algorithm (7 per nibble, +1 → 8)
GPTQ_SYM_ZEROS_WORD = 0x77777777
#: symmetric zeros for the AWQ algorithm (no +1): 8 per nibble
AWQ_SYM_ZEROS_WORD = 0x88888888


class CPUQuantAlgo(str, enum.Enum):
    AWQ = "awq"
    GPTQ = "gptq"


def cpu_block_k(k: int, num_groups: int) -> int:
    """``bk = min(K / G, 128)``."""
    return min(k // num_groups, MAX_BLOCK_K)


class CPUInt4Tensors(NamedTuple):
    """``prepare_int4_moe_layer_for_cpu``'s six outputs, in the order of vLLM's WNA16 oracle (``vllm/model_executor/layers/fused_moe/oracle/int_wna16.py``)."""

    w13: Any
    w2: Any
    w13_scales: Any
    w2_scales: Any
    w13_zeros: Any
    w2_zeros: Any


# ---------------------------------------------------------------------- step 1: unpack
def _sym_zeros(e: int, g: int, n: int, algo: CPUQuantAlgo) -> Any:
    word = GPTQ_SYM_ZEROS_WORD if algo is CPUQuantAlgo.GPTQ else AWQ_SYM_ZEROS_WORD
    return packing.to_int32(jnp.full((e, g, n // 8), word, jnp.uint32))


def _checked_sublayer(name: str, w: Any, scales: Any, zeros: Any, algo: CPUQuantAlgo
                      ) -> tuple[Any, Any, Any]:
    """Validate one sublayer's K-first tensors (shapes, dtypes, block divisibility) before any
    arithmetic; synthesize symmetric zeros. Returns ``(w, scales, zeros)`` as jax arrays."""
    w, scales = jnp.asarray(w), jnp.asarray(scales)
    check_rank(f"{name}_qweight", w, 3)
    check_rank(f"{name}_scales", scales, 3)
    check_dtype(f"{name}_qweight", w, np.int32)
    e, g = w.shape[0], scales.shape[1]
    k, n = (w.shape[1], 8 * w.shape[2]) if algo is CPUQuantAlgo.AWQ else (8 * w.shape[1], w.shape[2])
    check_shape(f"{name}_scales", scales, (e, g, n))
    if zeros is None:
        zeros = _sym_zeros(e, g, n, algo)
    zeros = jnp.asarray(zeros)
    check_dtype(f"{name}_zeros", zeros, np.int32)
    check_shape(f"{name}_zeros", zeros, (e, g, n // 8))
    check_divisible(f"{name} N (output channels)", n, BLOCK_N, "CPU block_n is 32")
    check_divisible(f"{name} K (input channels)", k, g, "groups must tile K")
    bk = cpu_block_k(k, g)
    check_divisible(f"{name} K (input channels)", k, bk,
                    "K must be a multiple of block_k = min(K/G, 128)")
    check_divisible(f"{name} block_k", bk, 4, "VNNI-4 packs 4 consecutive k per byte column")
    return w, scales, zeros


def _unpack_sublayer(w: Any, scales: Any, zeros: Any, algo: CPUQuantAlgo) -> tuple[Any, Any, Any]:
    """Step 1: ``Wu [E, N, K]``, ``Z [E, N, G]`` (int32), ``S [E, N, G]`` float32."""
    if algo is CPUQuantAlgo.AWQ:
        order = packing.AWQ_ORDER_4BIT
        codes = packing.unpack(w, 4, axis=2, order=order)  # [E, K, N]
        z = packing.unpack(zeros, 4, axis=2, order=order)
    else:
        codes = packing.unpack(w, 4, axis=1)  # [E, K, N]
        z = (packing.unpack(zeros, 4, axis=2) + 1) & 0xF  # v1 "z - 1" → z (see module doc)
    return (jnp.swapaxes(codes, 1, 2), jnp.swapaxes(z, 1, 2),
            jnp.swapaxes(scales, 1, 2).astype(jnp.float32))


# ---------------------------------------------------------------------- steps 2-5: block
def _block_sublayer(codes: Any, z: Any, s: Any) -> tuple[Any, Any, Any]:
    e, n, k = codes.shape
    g = s.shape[2]
    bk = cpu_block_k(k, g)
    nc, kc = n // BLOCK_N, k // bk
    gs = k // g

    # step 4: compensation Σ (Wu − Z) over each (32 × bk) block → [E, Nc, Kc, 32] int32
    zk = jnp.repeat(z, gs, axis=2, total_repeat_length=k)
    comp = (codes - zk).reshape(e, nc, BLOCK_N, kc, bk).sum(axis=-1, dtype=jnp.int32)
    comp = packing.to_uint32(comp.transpose(0, 1, 3, 2))
    shifts = jnp.arange(4, dtype=jnp.uint32) * jnp.uint32(8)
    comp_bytes = ((comp[..., None] >> shifts) & jnp.uint32(0xFF)).astype(jnp.uint8)
    comp_bytes = comp_bytes.reshape(e, nc, kc, COMPENSATION_BYTES)

    # step 5: n = 16p + 8hi + ni, k = 4kq + ki; bytes ordered (kq, p, ni, ki), hi = nibble
    c = codes.astype(jnp.uint8).reshape(e, nc, 2, 2, 8, kc, bk // 4, 4)
    c = c.transpose(0, 1, 5, 6, 2, 4, 7, 3)  # [E, Nc, Kc, kq, p, ni, ki, hi]
    data = (c[..., 0] | (c[..., 1] << 4)).reshape(e, nc, kc, 16 * bk)
    blocked_w = jnp.concatenate([data, comp_bytes], axis=-1)

    # step 3: [nc, g, j] = S[32nc + j, g]
    def blocked(x):
        return x.reshape(e, nc, BLOCK_N, g).transpose(0, 1, 3, 2)

    return blocked_w, blocked(s), blocked(z).astype(jnp.int8)


def prepare_int4_moe_layer_for_cpu(w13: Any, w2: Any, w13_scale: Any, w2_scale: Any,
                                   quant_algo: CPUQuantAlgo | str,
                                   w13_zeros: Any = None, w2_zeros: Any = None
                                   ) -> CPUInt4Tensors:
    """K-first int4 MoE tensors → the CPU blocked layout (docs/formats.md §5), per expert, stacked.

    ``quant_algo="awq"``: ``w13 [E, H, 2I/8]``, ``w2 [E, I, H/8]`` (N-packed, AWQ order),
    zeros ``[E, G, N/8]`` (AWQ order). ``quant_algo="gptq"``: ``w13 [E, H/8, 2I]``,
    ``w2 [E, I/8, H]`` (K-packed), zeros ``[E, G, N/8]`` (v1 ``z - 1``). Scales ``[E, G, N]``.
    Missing zeros are synthesized (symmetric). Returns blocked weights
    ``[E, N/32, K/bk, 16·bk + 128] uint8``, scales ``[E, N/32, G, 32] float32`` and zeros
    ``[E, N/32, G, 32] int8``. Pure and jit-able (``quant_algo`` static).
    """
    try:
        algo = CPUQuantAlgo(quant_algo)
    except ValueError:
        raise ConfigError(
            f"quant_algo: expected one of {[a.value for a in CPUQuantAlgo]}, got {quant_algo!r}"
        ) from None
    t13 = _checked_sublayer("w13", w13, w13_scale, w13_zeros, algo)
    t2 = _checked_sublayer("w2", w2, w2_scale, w2_zeros, algo)
    c13 = _block_sublayer(*_unpack_sublayer(*t13, algo))
    c2 = _block_sublayer(*_unpack_sublayer(*t2, algo))
    return CPUInt4Tensors(c13[0], c2[0], c13[1], c2[1], c13[2], c2[2])


# ---------------------------------------------------------------------- pytree
@dataclasses.dataclass(frozen=True)
class CPUForm(Form):
    """The CPU kernel's blocked int4 bytes (see :class:`CPUWeights`); ``zero_point``: whether the
    stored zero points are the scheme's (else the implicit 8, decoded as implicit)."""

    zero_point: bool = True

    def decode(self, m: QuantMatrix) -> LogicalQuant:
        """Invert the blocked layout (the compensation bytes are derived data and skipped)."""
        w, s, z = m.qvalue, m.scale, m.zero_point
        e, nc, kc, nbytes = w.shape
        bk = (nbytes - COMPENSATION_BYTES) // 16
        g = s.shape[2]
        data = w[..., : 16 * bk].reshape(e, nc, kc, bk // 4, 2, 8, 4)  # (kq, p, ni, ki)
        # the 4 bytes of consecutive k (ki) as one 32-bit word (byte ki at bits 8·ki), so that
        # the transpose that separates n from k moves 8 codes per element: on a CPU 4-5x faster
        # than moving codes, and than composing the word from its bytes with shifts
        if sys.byteorder == "little":
            word = jax.lax.bitcast_convert_type(data, jnp.uint32)
        else:  # pragma: no cover - big-endian hosts
            b = data.astype(jnp.uint32)
            word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
        word = word.transpose(0, 1, 4, 5, 2, 3)                # [E, Nc, p, ni, Kc, kq]
        # code (hi, ki) of a word: byte ki, low nibble for hi = 0, high nibble for hi = 1
        shifts = (4 * jnp.arange(2, dtype=jnp.uint32)[:, None] + 8 * jnp.arange(4, dtype=jnp.uint32))
        c = (word[:, :, :, None, :, :, :, None] >> shifts.reshape(2, 1, 1, 1, 4)) & 0xF
        codes = c.reshape(e, nc * BLOCK_N, kc * bk).astype(jnp.int32)  # [E, Nc, p, hi, ni, Kc, kq, ki]

        def unblocked(x):
            return x.transpose(0, 1, 3, 2).reshape(e, nc * BLOCK_N, g)

        # symmetric schemes store the implicit zero point 8 everywhere: decode it as implicit
        zeros = unblocked(z).astype(jnp.int32) if self.zero_point else None
        return LogicalQuant(codes, unblocked(s), zeros, None, bits=4, group_size=m.group_size)


@pytree_dataclass(meta=("scheme", "hidden_size", "intermediate_size"))
class CPUWeights(SchemeLayout):
    """CPU blocked int4 layout of one MoE layer.

    ``w13_weight [E, 2I/32, H/bk13, 16·bk13 + 128] uint8``, ``w2_weight [E, H/32, I/bk2, 16·bk2 + 128]``
    (bk = min(group size, 128); last 128 bytes per block = int32 compensation sums),
    ``w13_scales [E, 2I/32, G13, 32] float32``, ``w2_scales [E, H/32, G2, 32] float32``,
    ``w13_zeros`` / ``w2_zeros`` of the same shapes, int8 (true zero points, 8 when symmetric),
    biases ``[E, 2I]`` / ``[E, H]`` float32 or None.
    """

    LAYOUT: ClassVar[str] = "cpu"
    NAMES: ClassVar[dict] = layout_names("{}_weight", "{}_scales", "{}_zeros")


    @classmethod
    def forms(cls, *, scheme, hidden_size, intermediate_size):
        zp = scheme.zero_point
        return CPUForm(2 * intermediate_size, hidden_size, zp), CPUForm(hidden_size, intermediate_size, zp)


# ---------------------------------------------------------------------- front end
def _true_zeros_to_v1(zeros: Any, axis: int) -> Any:
    """True 4-bit zero points → AutoGPTQ v1 ``(z - 1) mod 16`` (same packing)."""
    return packing.pack((packing.unpack(zeros, 4, axis=axis) - 1) & 0xF, 4, axis=axis)


def _bias_f32(b: Any) -> Any:
    return None if b is None else jnp.asarray(b).astype(jnp.float32)


def convert_cpu(scheme: QuantScheme, weights: CheckpointWeights, input_dtype: Any = None
                ) -> CPUWeights:
    """Loader layout → :class:`CPUWeights` (``_process_weights_cpu`` semantics). 4-bit only,
    no act-order; ``2I`` and ``H`` multiples of 32. Pure and jit-able (``scheme`` and
    ``input_dtype`` static)."""
    check_same_scheme(scheme, weights)
    check_input_dtype("CPU", input_dtype)
    if scheme.bits != 4:
        raise UnsupportedError(
            f"scheme.bits: the CPU MoE kernel supports only int4 weights (kInt4Static), got {scheme.bits}")
    if scheme.act_order or scheme.desc_act:
        raise UnsupportedError(
            "scheme.act_order: the CPU MoE kernel has no g_idx reordering support "
            f"(GPTQ desc_act / act-order), got {scheme.describe()}")
    for name, size in (("hidden_size", weights.hidden_size),
                       ("intermediate_size", weights.intermediate_size)):
        if size % 8:
            raise ShapeError(f"{name}: {size} is not a multiple of 8 (whole int32 words along K)")
    m = scheme.method
    algo = CPUQuantAlgo.AWQ if m is QuantMethod.AWQ else CPUQuantAlgo.GPTQ
    tensors = (weights.w13_qweight, weights.w2_qweight, weights.w13_scales, weights.w2_scales,
               weights.w13_qzeros, weights.w2_qzeros)
    if m is QuantMethod.COMPRESSED_TENSORS:  # canonical N-first → GPTQ K-first
        tensors = tuple(None if a is None else jnp.swapaxes(jnp.asarray(a), 1, 2) for a in tensors)
    w13, w2, s13, s2, z13, z2 = tensors
    true_zeros = m is QuantMethod.COMPRESSED_TENSORS or (
        m is QuantMethod.GPTQ and not scheme.gptq_zeros_minus_one)
    if z13 is not None and true_zeros:  # the GPTQ algorithm adds 1: hand it v1 zeros
        z13, z2 = _true_zeros_to_v1(z13, 2), _true_zeros_to_v1(z2, 2)
    out = prepare_int4_moe_layer_for_cpu(w13, w2, s13, s2, algo, z13, z2)
    return CPUWeights.of(
        w13_weight=out.w13, w2_weight=out.w2, w13_scales=out.w13_scales,
        w2_scales=out.w2_scales, w13_zeros=out.w13_zeros, w2_zeros=out.w2_zeros,
        w13_bias=_bias_f32(weights.w13_bias), w2_bias=_bias_f32(weights.w2_bias),
        scheme=scheme, hidden_size=weights.hidden_size,
        intermediate_size=weights.intermediate_size)


__all__ = [
    "AWQ_SYM_ZEROS_WORD", "CPUInt4Tensors", "CPUQuantAlgo", "CPUWeights", "GPTQ_SYM_ZEROS_WORD",
    "convert_cpu", "cpu_block_k", "prepare_int4_moe_layer_for_cpu",
]
