"""Marlin MoE layout (``docs/formats.md`` §3): repacked weights, permuted scales,
zero points and bias, intermediate size padded to the Marlin thread tile.

Ports the behaviour of vLLM's ``_process_weights_marlin`` (GPTQ / compressed-tensors) and
``_process_awq_weights_marlin`` (AWQ) plus the ``marlin_utils`` helpers they call. Every helper
keeps its vLLM name and argument order so the two can be read side by side; all are pure
``jax.numpy`` functions that return new arrays, themselves wrapped in ``jax.jit`` with the size
arguments (``size_k``, ``size_n``, ``num_bits``, ``group_size``, ``is_a_8bit``) static, so an
eager call compiles once per shape and a call inside a user's jit just inlines.

How the layout is computed (the original Marlin style): each permutation is built ONCE in numpy
as an index array from the closed forms of §3.3–§3.6 (cached with :func:`functools.lru_cache`),
and the hot path is only ``unpack → jnp.take → pack``. Packed words are produced by bit
reinterpretation (:func:`wna16_jax.packing.to_int32`), never by value conversion.

Weight repack. A Marlin weight tile is 16×64 codes (16-bit activations) or 32×32 codes (8-bit
activations, ``is_a_8bit``); each tile is 1024 codes = 128 (4-bit) or 256 (8-bit) int32 words.
Tiles are laid out row-major over ``(k-tile, n-tile)``; inside a tile the 1024 codes are a fixed
permutation (:func:`_tile_source_index`) of the tile's row-major codes. Unrepacking applies the
inverse permutation.

Every converter has an inverse (``*_unrepack``, ``marlin_unpermute_scales``,
``marlin_zero_points_decode``, ``marlin_unpermute_bias`` ...) so that :class:`MarlinWeights` can
:meth:`~MarlinWeights.decode` back to the logical codes / scales / zeros of the checkpoint, which
is how the XLA executor runs this layout anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import packing
from ..errors import (
    DTypeError,
    MissingTensorError,
    ShapeError,
    UnsupportedError,
    check_shape,
)
from ..schemes import QuantMethod, QuantScheme
from ..weights import CheckpointWeights, Form, LogicalQuant, QuantMatrix, SchemeLayout, layout_names, pytree_dataclass
from .common import check_same_scheme

__all__ = [
    "MarlinWeights",
    "convert_marlin",
    "marlin_moe_padded_intermediate",
    "gptq_marlin_repack",
    "gptq_marlin_moe_repack",
    "awq_marlin_repack",
    "awq_marlin_moe_repack",
    "marlin_unrepack",
    "marlin_moe_unrepack",
    "marlin_permute_scales",
    "marlin_moe_permute_scales",
    "marlin_unpermute_scales",
    "marlin_moe_unpermute_scales",
    "marlin_permute_bias",
    "marlin_unpermute_bias",
    "marlin_zero_points",
    "awq_to_marlin_zero_points",
    "moe_awq_to_marlin_zero_points",
    "moe_packed_to_marlin_zero_points",
    "marlin_zero_points_decode",
    "moe_marlin_zero_points_decode",
    "marlin_int4_fp8_preprocess",
    "marlin_int4_fp8_unpreprocess_codes",
    "marlin_act_int8_process_scales",
    "marlin_act_int8_unprocess_scales",
    "get_scale_perms",
]

#: Marlin repack tile (rows = k, cols = n) for 16-bit and for 8-bit activations.
TILE_16BIT_ACT = (16, 64)
TILE_8BIT_ACT = (32, 32)
#: Multiplier applied to scales for fp8 activations (§3.7: nibble v becomes the e4m3 value v·2⁻⁹).
FP8_SCALE_FACTOR = 512
#: Fixed-point range of int8-activation scales (§3.8).
INT8_SCALE_RANGE = 4096

# Nibble / byte source offsets inside a tile, per word slot s (§3.3).
_DK_4BIT = (0, 8, 0, 8, 1, 9, 1, 9)
_DN_4BIT = (0, 0, 8, 8, 0, 0, 8, 8)
_DK_8BIT = (0, 8, 1, 9)
_DK_4BIT_A8 = (0, 16, 1, 17, 2, 18, 3, 19)
# Interleave applied to zero points inside each group of pf (16-bit activations only, §3.5).
_ZP_INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


# Public converters are jitted with their size arguments static, so an eager call compiles
# once per shape (not once per primitive) and a call inside a user's jit simply inlines.
# Argument checks run at trace time on static shapes and raise the typed errors unchanged.
_jit_bits_sizes = functools.partial(
    jax.jit, static_argnames=("size_k", "size_n", "num_bits", "is_a_8bit"))
_jit_group_sizes = functools.partial(
    jax.jit, static_argnames=("size_k", "size_n", "group_size", "is_a_8bit"))


# ============================================================================ index maps
@functools.lru_cache(maxsize=None)
def _tile_source_index(num_bits: int, is_a_8bit: bool) -> np.ndarray:
    """Within one repack tile: ``src[p]`` = row-major index (``k * tile_n + n``) of the tile code
    stored at tile position ``p = pf * word + slot`` (1024 entries, a permutation)."""
    pf = 32 // num_bits
    words = 1024 // pf
    idx = np.arange(words)[:, None]
    s = np.arange(pf)[None, :]
    if not is_a_8bit:
        tile_n = TILE_16BIT_ACT[1]
        if num_bits == 4:
            t, w = idx // 4, idx % 4
            r0, c = 2 * (t % 4), 16 * w + t // 4
            k = r0 + np.asarray(_DK_4BIT)[s]
            n = c + np.asarray(_DN_4BIT)[s]
        else:
            t, w, h = idx // 8, (idx % 8) // 2, idx % 2
            r0, c = 2 * (t % 4), 16 * w + t // 4 + 8 * h
            k = r0 + np.asarray(_DK_8BIT)[s]
            n = c + 0 * s
    else:
        tile_n = TILE_8BIT_ACT[1]
        if num_bits == 4:
            t, w = idx // 4, idx % 4
            k = 4 * (t % 4) + np.asarray(_DK_4BIT_A8)[s]
        else:
            t, w, h = idx // 8, (idx % 8) // 2, idx % 2
            k = 4 * (t % 4) + 16 * h + s
        n = 16 * (w // 2) + 8 * (w % 2) + t // 4 + 0 * s
    src = (k * tile_n + n).reshape(-1).astype(np.int32)
    assert sorted(src.tolist()) == list(range(1024))
    src.setflags(write=False)
    return src


@functools.lru_cache(maxsize=None)
def _tile_inverse_index(num_bits: int, is_a_8bit: bool) -> np.ndarray:
    src = _tile_source_index(num_bits, is_a_8bit)
    inv = np.empty_like(src)
    inv[src] = np.arange(src.size, dtype=np.int32)
    inv.setflags(write=False)
    return inv


@functools.lru_cache(maxsize=None)
def get_scale_perms() -> tuple[np.ndarray, np.ndarray]:
    """``(scale_perm, scale_perm_single)`` of §3.4, as ``new[p] = old[perm[p]]``.

    grouped (64): ``new[8i + j] = old[8j + i]``; single (32): ``new[8i + 2a + b] = old[8a + 2i + b]``.
    """
    grouped = np.array([8 * j + i for i in range(8) for j in range(8)], np.int32)
    single = np.array([8 * a + 2 * i + b for i in range(4) for a in range(4) for b in range(2)],
                      np.int32)
    grouped.setflags(write=False)
    single.setflags(write=False)
    return grouped, single


@functools.lru_cache(maxsize=None)
def _zero_point_chunk_perm(num_bits: int, is_a_8bit: bool) -> np.ndarray:
    """64-entry permutation of one chunk of zero points: the grouped transpose, then (16-bit
    activations) the interleave within groups of pf (§3.5 steps 1–2, composed)."""
    grouped, _ = get_scale_perms()
    if is_a_8bit:
        return grouped
    pf = 32 // num_bits
    il = _ZP_INTERLEAVE[num_bits]
    p = np.arange(64)
    perm = grouped[pf * (p // pf) + np.asarray(il)[p % pf]].astype(np.int32)
    perm.setflags(write=False)
    return perm


def _inverse_perm(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


# ============================================================================ checks
def _check_bits(num_bits: int) -> int:
    return packing.check_bits(num_bits, "num_bits")


def _repack_tile(is_a_8bit: bool) -> tuple[int, int]:
    return TILE_8BIT_ACT if is_a_8bit else TILE_16BIT_ACT


def _check_repack_sizes(name: str, size_k: int, size_n: int, is_a_8bit: bool) -> None:
    tk, tn = _repack_tile(is_a_8bit)
    act = "8-bit" if is_a_8bit else "16-bit"
    if size_k <= 0 or size_k % tk:
        raise ShapeError(
            f"{name}: size_k={size_k} is not a positive multiple of {tk} "
            f"(Marlin repack tile {tk}x{tn} for {act} activations)")
    if size_n <= 0 or size_n % tn:
        raise ShapeError(
            f"{name}: size_n={size_n} is not a positive multiple of {tn} "
            f"(Marlin repack tile {tk}x{tn} for {act} activations)")


def _check_perm(name: str, perm: Any, lead: tuple[int, ...], size_k: int) -> Any:
    """Normalise an act-order permutation: ``None`` or an empty last axis mean "no act-order"."""
    if perm is None:
        return None
    perm = jnp.asarray(perm)
    if perm.shape[-1:] == (0,):
        return None
    check_shape(name, perm, lead + (size_k,))
    return perm.astype(jnp.int32)


# ============================================================================ weight repack
def _repack_codes(q: Any, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool) -> Any:
    """Unpacked codes ``[..., size_k, size_n]`` → Marlin words ``[..., size_k/16, size_n*16/pf]``."""
    tk, tn = _repack_tile(is_a_8bit)
    lead = q.shape[:-2]
    tiles = q.reshape(lead + (size_k // tk, tk, size_n // tn, tn))
    nd = len(lead)
    tiles = jnp.moveaxis(tiles, nd + 2, nd + 1)  # [..., K/tk, N/tn, tk, tn]
    tiles = tiles.reshape(lead + (size_k // tk, size_n // tn, tk * tn))
    tiles = jnp.take(tiles, _tile_source_index(num_bits, is_a_8bit), axis=-1, mode="clip")
    flat = tiles.reshape(lead + (size_k // 16, 16 * size_n))
    return packing.pack(flat, num_bits, axis=-1)


def _unrepack_codes(m: Any, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool) -> Any:
    """Inverse of :func:`_repack_codes`: Marlin words → codes ``[..., size_k, size_n]`` int32."""
    tk, tn = _repack_tile(is_a_8bit)
    lead = m.shape[:-2]
    nd = len(lead)
    flat = packing.unpack(m, num_bits, axis=-1)
    tiles = flat.reshape(lead + (size_k // tk, size_n // tn, tk * tn))
    tiles = jnp.take(tiles, _tile_inverse_index(num_bits, is_a_8bit), axis=-1, mode="clip")
    tiles = tiles.reshape(lead + (size_k // tk, size_n // tn, tk, tn))
    tiles = jnp.moveaxis(tiles, nd + 1, nd + 2)  # [..., K/tk, tk, N/tn, tn]
    return tiles.reshape(lead + (size_k, size_n))


def _sort_rows(q: Any, perm: Any) -> Any:
    """``q_sorted[..., k, :] = q[..., perm[..., k], :]``."""
    if perm is None:
        return q
    if q.ndim == 2:
        return jnp.take(q, perm, axis=0, mode="clip")
    return jnp.take_along_axis(q, perm[..., :, None], axis=-2, mode="clip")


def _unsort_rows(q: Any, perm: Any) -> Any:
    if perm is None:
        return q
    return _sort_rows(q, jnp.argsort(perm, axis=-1).astype(jnp.int32))


def _repack_checked(name: str, words: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                    is_a_8bit: bool, *, awq: bool, moe: bool) -> Any:
    _check_bits(num_bits)
    pf = 32 // num_bits
    _check_repack_sizes(name, size_k, size_n, is_a_8bit)
    words = jnp.asarray(words)
    lead = words.shape[:1] if moe else ()
    if moe and words.ndim != 3:
        raise ShapeError(f"{name}: expected a rank-3 [E, ...] tensor, got shape {tuple(words.shape)}")
    if awq:
        check_shape(name, words, lead + (size_k, size_n // pf))
        q = packing.unpack(words, num_bits, axis=-1, order=packing.awq_order(num_bits))
    else:
        check_shape(name, words, lead + (size_k // pf, size_n))
        q = packing.unpack(words, num_bits, axis=-2)
    perm = _check_perm("perm", perm, lead, size_k)
    return _repack_codes(_sort_rows(q, perm), size_k, size_n, num_bits, is_a_8bit)


@_jit_bits_sizes
def gptq_marlin_repack(b_q_weight: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                       is_a_8bit: bool = False) -> Any:
    """GPTQ K-packed ``[size_k/pf, size_n]`` int32 → Marlin ``[size_k/16, size_n*16/pf]`` int32.

    ``perm`` (``[size_k]``; ``None`` or empty = no act-order) repacks ``Q[perm[k], n]`` (§3.3).
    """
    return _repack_checked("b_q_weight", b_q_weight, perm, size_k, size_n, num_bits, is_a_8bit,
                           awq=False, moe=False)


@_jit_bits_sizes
def gptq_marlin_moe_repack(b_q_weight: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                           is_a_8bit: bool = False) -> Any:
    """Per-expert :func:`gptq_marlin_repack`: ``[E, size_k/pf, size_n]`` → ``[E, size_k/16, size_n*16/pf]``;
    ``perm`` is ``[E, size_k]``, ``[E, 0]`` or ``None``."""
    return _repack_checked("b_q_weight", b_q_weight, perm, size_k, size_n, num_bits, is_a_8bit,
                           awq=False, moe=True)


@_jit_bits_sizes
def awq_marlin_repack(b_q_weight: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                      is_a_8bit: bool = False) -> Any:
    """AWQ N-packed (AWQ nibble order) ``[size_k, size_n/pf]`` → Marlin ``[size_k/16, size_n*16/pf]``.

    Equal to ``gptq_marlin_repack`` of the same codes packed along K (§3.3). vLLM's AWQ path
    never passes a permutation; one is accepted here with the same meaning as for GPTQ.
    """
    return _repack_checked("b_q_weight", b_q_weight, perm, size_k, size_n, num_bits, is_a_8bit,
                           awq=True, moe=False)


@_jit_bits_sizes
def awq_marlin_moe_repack(b_q_weight: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                          is_a_8bit: bool = False) -> Any:
    """Per-expert :func:`awq_marlin_repack`: ``[E, size_k, size_n/pf]`` → ``[E, size_k/16, size_n*16/pf]``."""
    return _repack_checked("b_q_weight", b_q_weight, perm, size_k, size_n, num_bits, is_a_8bit,
                           awq=True, moe=True)


def _unrepack_checked(name: str, m: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                      is_a_8bit: bool, moe: bool) -> Any:
    _check_bits(num_bits)
    pf = 32 // num_bits
    _check_repack_sizes(name, size_k, size_n, is_a_8bit)
    m = jnp.asarray(m)
    lead = m.shape[:1] if moe else ()
    check_shape(name, m, lead + (size_k // 16, size_n * 16 // pf))
    perm = _check_perm("perm", perm, lead, size_k)
    return _unsort_rows(_unrepack_codes(m, size_k, size_n, num_bits, is_a_8bit), perm)


@_jit_bits_sizes
def marlin_unrepack(marlin_q: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                    is_a_8bit: bool = False) -> Any:
    """Inverse of :func:`gptq_marlin_repack`: Marlin words → codes ``[size_k, size_n]`` (int32),
    in the original (unsorted) row order when ``perm`` is given."""
    return _unrepack_checked("marlin_q", marlin_q, perm, size_k, size_n, num_bits, is_a_8bit, False)


@_jit_bits_sizes
def marlin_moe_unrepack(marlin_q: Any, perm: Any, size_k: int, size_n: int, num_bits: int,
                        is_a_8bit: bool = False) -> Any:
    """Per-expert :func:`marlin_unrepack`: ``[E, size_k/16, size_n*16/pf]`` → ``[E, size_k, size_n]``."""
    return _unrepack_checked("marlin_q", marlin_q, perm, size_k, size_n, num_bits, is_a_8bit, True)


# ============================================================================ scales / bias
def _uses_grouped_scale_perm(size_k: int, group_size: int, is_a_8bit: bool) -> bool:
    """§3.4: the grouped (8×8 transpose) permutation iff ``g != -1 and g < size_k`` and 16-bit act."""
    return group_size != -1 and group_size < size_k and not is_a_8bit


def _apply_chunk_perm(name: str, x: Any, perm: np.ndarray, lead: int) -> Any:
    """Apply ``new[p] = old[perm[p]]`` to consecutive chunks of the row-major flattening of
    ``x`` (per leading index for the first ``lead`` axes)."""
    c = perm.size
    x = jnp.asarray(x)
    per = math.prod(x.shape[lead:])
    if per % c:
        raise ShapeError(f"{name}: {per} elements per {'expert' if lead else 'tensor'} "
                         f"(shape {tuple(x.shape)}) is not a multiple of the {c}-element "
                         f"Marlin permutation chunk")
    chunks = x.reshape(x.shape[:lead] + (per // c, c))
    return jnp.take(chunks, perm, axis=-1, mode="clip").reshape(x.shape)


def _scale_perm_for(size_k: int, group_size: int, is_a_8bit: bool) -> np.ndarray:
    grouped, single = get_scale_perms()
    return grouped if _uses_grouped_scale_perm(size_k, group_size, is_a_8bit) else single


def _check_scales(name: str, s: Any, size_n: int, rank: int) -> Any:
    s = jnp.asarray(s)
    if s.ndim != rank or s.shape[-1] != size_n:
        want = "[E, G, size_n]" if rank == 3 else "[G, size_n]"
        raise ShapeError(f"{name}: expected {want} with size_n={size_n}, got shape {tuple(s.shape)}")
    return s


@_jit_group_sizes
def marlin_permute_scales(s: Any, size_k: int, size_n: int, group_size: int,
                          is_a_8bit: bool = False) -> Any:
    """Permute ``s [G, size_n]`` into Marlin order (§3.4); shape and dtype unchanged."""
    s = _check_scales("s", s, size_n, 2)
    return _apply_chunk_perm("s", s, _scale_perm_for(size_k, group_size, is_a_8bit), 0)


@_jit_group_sizes
def marlin_moe_permute_scales(s: Any, size_k: int, size_n: int, group_size: int,
                              is_a_8bit: bool = False) -> Any:
    """Per-expert :func:`marlin_permute_scales` on ``s [E, G, size_n]``.

    ``size_k`` only decides grouped vs single; vLLM passes ``intermediate_size`` for w13 (quirk Q1).
    """
    s = _check_scales("s", s, size_n, 3)
    return _apply_chunk_perm("s", s, _scale_perm_for(size_k, group_size, is_a_8bit), 1)


@_jit_group_sizes
def marlin_unpermute_scales(s: Any, size_k: int, size_n: int, group_size: int,
                            is_a_8bit: bool = False) -> Any:
    """Inverse of :func:`marlin_permute_scales` (same size arguments)."""
    s = _check_scales("s", s, size_n, 2)
    perm = _inverse_perm(_scale_perm_for(size_k, group_size, is_a_8bit))
    return _apply_chunk_perm("s", s, perm, 0)


@_jit_group_sizes
def marlin_moe_unpermute_scales(s: Any, size_k: int, size_n: int, group_size: int,
                                is_a_8bit: bool = False) -> Any:
    """Inverse of :func:`marlin_moe_permute_scales` (same size arguments)."""
    s = _check_scales("s", s, size_n, 3)
    perm = _inverse_perm(_scale_perm_for(size_k, group_size, is_a_8bit))
    return _apply_chunk_perm("s", s, perm, 1)


@jax.jit
def marlin_permute_bias(s: Any) -> Any:
    """Apply the single (32-chunk) permutation to the flattened bias; shape restored (§3.6)."""
    return _apply_chunk_perm("bias", s, get_scale_perms()[1], 0)


@jax.jit
def marlin_unpermute_bias(s: Any) -> Any:
    """Inverse of :func:`marlin_permute_bias`."""
    return _apply_chunk_perm("bias", s, _inverse_perm(get_scale_perms()[1]), 0)


# ============================================================================ zero points
def _marlin_zp_from_codes(name: str, z: Any, size_k: int, size_n: int, num_bits: int,
                          is_a_8bit: bool, lead: int) -> Any:
    """Unpacked natural-order zeros ``[..., size_k, size_n]`` → Marlin ``[..., size_k, size_n/pf]``."""
    check_shape(name, z, z.shape[:lead] + (size_k, size_n))
    if size_n % 64:
        raise ShapeError(f"{name}: size_n={size_n} is not a multiple of 64 "
                         f"(Marlin zero-point permutation chunk)")
    z = _apply_chunk_perm(name, z, _zero_point_chunk_perm(num_bits, is_a_8bit), lead)
    return packing.pack(z, num_bits, axis=-1)


@_jit_bits_sizes
def marlin_zero_points(zp: Any, size_k: int, size_n: int, num_bits: int,
                       is_a_8bit: bool = False) -> Any:
    """Unpacked zero points ``zp [size_k, size_n]`` (``size_k`` = number of groups) → Marlin
    int32 ``[size_k, size_n/pf]`` (§3.5)."""
    _check_bits(num_bits)
    return _marlin_zp_from_codes("zp", jnp.asarray(zp), size_k, size_n, num_bits, is_a_8bit, 0)


def _zp_packed_to_codes(name: str, q_zp: Any, size_k: int, size_n: int, num_bits: int,
                        lead: tuple[int, ...], awq: bool) -> Any:
    _check_bits(num_bits)
    pf = 32 // num_bits
    q_zp = jnp.asarray(q_zp)
    if size_n % pf:
        raise ShapeError(f"{name}: size_n={size_n} is not a multiple of the pack factor {pf}")
    check_shape(name, q_zp, lead + (size_k, size_n // pf))
    order = packing.awq_order(num_bits) if awq else None
    return packing.unpack(q_zp, num_bits, axis=-1, order=order)


@_jit_bits_sizes
def awq_to_marlin_zero_points(q_zp_packed: Any, size_k: int, size_n: int, num_bits: int,
                              is_a_8bit: bool = False) -> Any:
    """AWQ-ordered packed zeros ``[size_k, size_n/pf]`` → Marlin ``[size_k, size_n/pf]``."""
    z = _zp_packed_to_codes("q_zp_packed", q_zp_packed, size_k, size_n, num_bits, (), True)
    return _marlin_zp_from_codes("q_zp_packed", z, size_k, size_n, num_bits, is_a_8bit, 0)


@_jit_bits_sizes
def moe_awq_to_marlin_zero_points(q_zp_packed: Any, size_k: int, size_n: int, num_bits: int,
                                  is_a_8bit: bool = False) -> Any:
    """Per-expert :func:`awq_to_marlin_zero_points` on ``[E, size_k, size_n/pf]``."""
    q_zp_packed = jnp.asarray(q_zp_packed)
    lead = q_zp_packed.shape[:1]
    z = _zp_packed_to_codes("q_zp_packed", q_zp_packed, size_k, size_n, num_bits, lead, True)
    return _marlin_zp_from_codes("q_zp_packed", z, size_k, size_n, num_bits, is_a_8bit, 1)


@_jit_bits_sizes
def moe_packed_to_marlin_zero_points(q_zp_packed: Any, size_k: int, size_n: int, num_bits: int,
                                     is_a_8bit: bool = False) -> Any:
    """Standard-order packed zeros ``[E, size_k, size_n/pf]`` → Marlin (no ``-1`` correction)."""
    q_zp_packed = jnp.asarray(q_zp_packed)
    lead = q_zp_packed.shape[:1]
    z = _zp_packed_to_codes("q_zp_packed", q_zp_packed, size_k, size_n, num_bits, lead, False)
    return _marlin_zp_from_codes("q_zp_packed", z, size_k, size_n, num_bits, is_a_8bit, 1)


def _zp_decode(q_zp: Any, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool,
               lead: tuple[int, ...]) -> Any:
    z = _zp_packed_to_codes("q_zp", q_zp, size_k, size_n, num_bits, lead, False)
    if size_n % 64:
        raise ShapeError(f"q_zp: size_n={size_n} is not a multiple of 64 "
                         f"(Marlin zero-point permutation chunk)")
    perm = _inverse_perm(_zero_point_chunk_perm(num_bits, is_a_8bit))
    return _apply_chunk_perm("q_zp", z, perm, len(lead))


@_jit_bits_sizes
def marlin_zero_points_decode(q_zp: Any, size_k: int, size_n: int, num_bits: int,
                              is_a_8bit: bool = False) -> Any:
    """Inverse of :func:`marlin_zero_points`: Marlin ``[size_k, size_n/pf]`` → unpacked
    natural-order zeros ``[size_k, size_n]`` int32."""
    return _zp_decode(q_zp, size_k, size_n, num_bits, is_a_8bit, ())


@_jit_bits_sizes
def moe_marlin_zero_points_decode(q_zp: Any, size_k: int, size_n: int, num_bits: int,
                                  is_a_8bit: bool = False) -> Any:
    """Per-expert :func:`marlin_zero_points_decode` on ``[E, size_k, size_n/pf]``."""
    q_zp = jnp.asarray(q_zp)
    return _zp_decode(q_zp, size_k, size_n, num_bits, is_a_8bit, q_zp.shape[:1])


# ============================================================================ padding
def marlin_moe_padded_intermediate(size_n: int, group_size: int) -> int:
    """§3.2: ``round_up(size_n, lcm(64, g if g > 0 else 1))``."""
    unit = math.lcm(64, group_size if group_size > 0 else 1)
    return -(-size_n // unit) * unit


def _pad_axis(x: Any, axis: int, new: int) -> Any:
    if x is None or x.shape[axis] == new:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, new - x.shape[axis])
    return jnp.pad(x, pad)


def _pad_w13_halves(x: Any, unit: int, padded_unit: int) -> Any:
    """Zero-pad each gate/up half of the last axis ``[..., 2*unit]`` to ``padded_unit``."""
    if x is None or unit == padded_unit:
        return x
    halves = x.reshape(x.shape[:-1] + (2, unit))
    return _pad_axis(halves, -1, padded_unit).reshape(x.shape[:-1] + (2 * padded_unit,))


def _unpad_w13_halves(x: Any, unit: int, padded_unit: int) -> Any:
    if x is None or unit == padded_unit:
        return x
    halves = x.reshape(x.shape[:-1] + (2, padded_unit))[..., :unit]
    return halves.reshape(x.shape[:-1] + (2 * unit,))


# ============================================================================ fp8 / int8 activations
def _nibbles(words: Any) -> Any:
    u = packing.to_uint32(words)
    shifts = jnp.arange(8, dtype=jnp.uint32) * jnp.uint32(4)
    return (u[..., None] >> shifts) & jnp.uint32(0xF)


def _from_nibbles(v: Any) -> Any:
    shifts = jnp.arange(8, dtype=jnp.uint32) * jnp.uint32(4)
    words = jnp.sum(v.astype(jnp.uint32) << shifts, axis=-1, dtype=jnp.uint32)
    return packing.to_int32(words)


def marlin_int4_fp8_preprocess(qweight: Any, qzeros: Any = None) -> Any:
    """Recode every 4-bit code for the fp8-activation Marlin path (§3.7); returns a new tensor.

    Without zeros (uint4b8): ``u >= 8 → u - 8`` else ``15 - u``. With AWQ ``qzeros`` (same nibble
    packing as ``qweight``; both viewed as ``[-1, last]``, row ``k`` uses zero row
    ``k // (rows / zero_rows)``): ``u >= z → u - z`` else ``15 - u``. Zeros are not changed.
    """
    if np.dtype(qweight.dtype) != np.int32:
        raise DTypeError(f"qweight: expected dtype int32, got {np.dtype(qweight.dtype)}")
    if qzeros is None:
        return _fp8_preprocess_no_zp(qweight)
    if np.dtype(qzeros.dtype) != np.int32:
        raise DTypeError(f"qzeros: expected dtype int32, got {np.dtype(qzeros.dtype)}")
    cols = qweight.shape[-1]
    if qzeros.ndim < 1 or qzeros.shape[-1] != cols:
        raise ShapeError(f"qzeros: expected last dim {cols} (as qweight), got shape "
                         f"{tuple(qzeros.shape)}")
    rows, zrows = math.prod(qweight.shape[:-1]), math.prod(qzeros.shape[:-1])
    if zrows == 0 or rows % zrows:
        raise ShapeError(f"qzeros: {zrows} rows do not divide the {rows} rows of qweight")
    return _fp8_preprocess_awq(qweight, qzeros)


@jax.jit
def _fp8_preprocess_no_zp(qweight: Any) -> Any:
    u = _nibbles(qweight)
    return _from_nibbles(jnp.where(u >= 8, u - 8, 15 - u))


@jax.jit
def _fp8_preprocess_awq(qweight: Any, qzeros: Any) -> Any:
    cols = qweight.shape[-1]
    w2d, z2d = qweight.reshape(-1, cols), qzeros.reshape(-1, cols)
    rows, zrows = w2d.shape[0], z2d.shape[0]
    u = _nibbles(w2d)
    z = _nibbles(jnp.take(z2d, np.arange(rows) // (rows // zrows), axis=0, mode="clip"))
    return _from_nibbles(jnp.where(u >= z, u - z, 15 - u)).reshape(qweight.shape)


@jax.jit
def marlin_int4_fp8_unpreprocess_codes(codes: Any, zeros: Any = None) -> Any:
    """Inverse of the §3.7 recode on unpacked codes (elementwise; ``zeros`` broadcast to ``codes``).

    Without zeros: ``v < 8 → v + 8`` else ``15 - v``. With zeros ``z``: the recoded ranges
    ``[0, 15 - z]`` (``u >= z``) and ``[16 - z, 15]`` (``u < z``) are disjoint, so
    ``v <= 15 - z → v + z`` else ``15 - v``.
    """
    codes = jnp.asarray(codes)
    if zeros is None:
        return jnp.where(codes < 8, codes + 8, 15 - codes)
    return jnp.where(codes <= 15 - zeros, codes + zeros, 15 - codes)


def marlin_act_int8_process_scales(s: Any) -> tuple[Any, Any]:
    """§3.8: ``(new_scales, global_scale)`` for int8 activations.

    ``m = max(s)``; ``global_scale = float32(m) / 4096``; ``new = round(s / m * 4096)`` computed in
    the scale dtype, value-cast to int16, then bit-reinterpreted as the scale dtype (quirk Q6).
    """
    if np.dtype(s.dtype) not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise DTypeError(f"s: int8-activation scales must be float16 or bfloat16 (the int16 bits "
                         f"are stored in place), got {np.dtype(s.dtype)}")
    return _int8_process_scales(s)


@jax.jit
def _int8_process_scales(s: Any) -> tuple[Any, Any]:
    m = jnp.max(s)
    global_scale = m.astype(jnp.float32) * jnp.float32(1.0 / INT8_SCALE_RANGE)
    # ``s / m`` must be the correctly rounded quotient in the scale dtype (torch: float opmath
    # division, rounded to half). XLA rewrites division by a broadcast scalar into a multiply by
    # its reciprocal, and may keep excess precision across f16/bf16 roundings; the optimization
    # barriers pin both the true division and the rounding. ``* 4096`` is then exact.
    m_full = lax.optimization_barrier(jnp.broadcast_to(m, s.shape).astype(jnp.float32))
    ratio = lax.optimization_barrier((s.astype(jnp.float32) / m_full).astype(s.dtype))
    q = jnp.round(ratio.astype(jnp.float32) * INT8_SCALE_RANGE).astype(jnp.int16)
    return lax.bitcast_convert_type(q, s.dtype), global_scale


@jax.jit
def marlin_act_int8_unprocess_scales(s: Any, global_scale: Any) -> Any:
    """The scales the int8 path effectively applies: ``int16_bits(s) * global_scale`` (float32).

    Lossy with respect to the original scales (the 4096-step fixed point), exact as float32.
    """
    s = jnp.asarray(s)
    q = lax.bitcast_convert_type(s, jnp.int16).astype(jnp.float32)
    return q * jnp.asarray(global_scale, jnp.float32).reshape(())


# ============================================================================ pytree
#: Accepted activation dtypes -> is_a_8bit.
_INPUT_DTYPES = {"float16": False, "bfloat16": False, "float8_e4m3fn": True, "int8": True}


def _input_dtype_name(input_dtype: Any) -> str | None:
    if input_dtype is None:
        return None
    try:
        name = np.dtype(input_dtype).name
    except TypeError:
        name = None
    if name not in _INPUT_DTYPES:
        raise UnsupportedError(
            f"input_dtype: Marlin activations must be None, float16, bfloat16, float8_e4m3fn or "
            f"int8, got {input_dtype!r}")
    return name


def _scale_size_ks(scheme: QuantScheme, i: int, i_pad: int) -> tuple[int, int]:
    """The ``size_k`` vLLM passes to ``marlin_moe_permute_scales`` for w13 and w2 (quirk Q1):
    the unpadded intermediate size for w13; for w2 ``I`` (AWQ) or ``G2_pad * (g or pf)`` (GPTQ/CT)."""
    g = scheme.group_size
    if scheme.method is QuantMethod.AWQ:
        return i, i
    g2_pad = i_pad // g if g > 0 else 1
    return i, g2_pad * (g if g != -1 else scheme.pack_factor)


@dataclasses.dataclass(frozen=True)
class MarlinForm(Form):
    """One GEMM in the Marlin layout. ``kind``: ``"w13"`` (gate and up halves, each padded from
    ``inter`` to ``padded`` columns) or ``"w2"`` (``padded`` input rows, the first ``inter`` real);
    ``scale_k``: the ``size_k`` the scale permutation used (quirk Q1); ``a8``: 8-bit activations;
    ``input_dtype``: the activations the layout was prepared for."""

    kind: str = "w2"
    hidden: int = 0
    inter: int = 0
    padded: int = 0
    scale_k: int = 0
    a8: bool = False
    input_dtype: str | None = None

    def decode(self, m: QuantMatrix) -> LogicalQuant:
        return _decode_matrix_jit(m)

    def _decode(self, m: QuantMatrix) -> LogicalQuant:
        b, g, a8 = m.bits, m.group_size, self.a8
        h, i, ip = self.hidden, self.inter, self.padded
        w13 = self.kind == "w13"
        rows, cols = (h, 2 * ip) if w13 else (ip, h)

        def unpad(x, groups: int | None = None):       # [E, K or G, N] → the true size
            if w13:
                return _unpad_w13_halves(x, i, ip)
            return x[:, :i] if groups is None else x[:, :groups]

        g2 = None if w13 else (i // g if g > 0 else 1)
        q = unpad(marlin_moe_unrepack(m.qvalue, m.perm, rows, cols, b, a8))        # [E, K, N]
        sc = marlin_moe_unpermute_scales(m.scale, self.scale_k, cols, g, a8)
        if m.global_scale is not None:
            sc = marlin_act_int8_unprocess_scales(sc, m.global_scale)
        if self.input_dtype == "float8_e4m3fn":
            sc = sc / FP8_SCALE_FACTOR
        sc = unpad(sc, g2)
        z = None
        if m.zero_point is not None:
            z = unpad(moe_marlin_zero_points_decode(m.zero_point, m.zero_point.shape[1], cols, b, a8), g2)
        t = lambda x: None if x is None else jnp.swapaxes(x, 1, 2)  # noqa: E731
        codes, sc, z = t(q), t(sc), t(z)                                           # [E, N, K] / [E, N, G]
        if self.input_dtype == "float8_e4m3fn":
            codes = marlin_int4_fp8_unpreprocess_codes(codes, _expand_zeros(z, self.k, g))
        return LogicalQuant(codes, sc, z, _unsort_g_idx(m.g_idx, m.perm), bits=b, group_size=g)


_decode_matrix_jit = jax.jit(lambda m: m.form._decode(m))


@pytree_dataclass(meta=("scheme", "hidden_size", "intermediate_size", "padded_intermediate_size",
                        "is_a_8bit", "input_dtype"))
class MarlinWeights(SchemeLayout):
    """One MoE layer's experts in the Marlin layout (docs/formats.md §3.10); ``Ip`` = padded intermediate,
    ``G13 = H/g``, ``G2p = Ip/g`` (1 when channelwise). Flat names (vLLM's):

    =========================  =================================  =========================
    field                      shape                              content
    =========================  =================================  =========================
    w13_qweight                ``[E, H/16, 2·Ip·16/pf]`` int32    repacked (§3.3)
    w2_qweight                 ``[E, Ip/16, H·16/pf]`` int32      repacked (§3.3)
    w13_scales                 ``[E, G13, 2·Ip]`` scale dtype     permuted (§3.4); ×512 for
                                                                  fp8; int16 bits for int8
    w2_scales                  ``[E, G2p, H]`` scale dtype        as w13_scales
    w13_qzeros / w2_qzeros     ``[E, G13, 2·Ip/pf]`` /            Marlin zero points (§3.5)
                               ``[E, G2p, H/pf]`` int32 or None
    w13_g_idx / w2_g_idx       ``[E, H]`` / ``[E, I]`` int32      sorted group ids (act-order)
    w13/w2_g_idx_sort_indices  ``[E, H]`` / ``[E, I]`` int32      stable argsort of g_idx
    w13/w2_input_global_scale  scalar float32 or None             int8 activations, > 1 group
    w13_bias / w2_bias         ``[E, 2·Ip]`` / ``[E, H]`` or None  single-permuted (§3.6)
    =========================  =================================  =========================

    Where vLLM holds empty ``[E, 0]`` tensors (no act-order) this holds ``None``. The sort
    indices are each matrix's ``perm``, the global scales its ``global_scale`` (scalars: leaves
    but not expert arrays, so :meth:`array_fields` and :meth:`take_experts` skip them).
    ``intermediate_size`` is the true ``I``.
    """

    LAYOUT: ClassVar[str] = "marlin"
    NAMES: ClassVar[dict] = layout_names("{}_qweight", "{}_scales", "{}_qzeros", g_idx="{}_g_idx",
                                         perm="{}_g_idx_sort_indices", global_scale="{}_input_global_scale")

    padded_intermediate_size: int = 0
    is_a_8bit: bool = False
    input_dtype: str | None = None

    @classmethod
    def forms(cls, *, scheme, hidden_size, intermediate_size, padded_intermediate_size,
              is_a_8bit, input_dtype):
        h, i, ip = hidden_size, intermediate_size, padded_intermediate_size
        k13, k2 = _scale_size_ks(scheme, i, ip)
        common = dict(hidden=h, inter=i, padded=ip, a8=bool(is_a_8bit), input_dtype=input_dtype)
        return (MarlinForm(2 * i, h, "w13", scale_k=k13, **common),
                MarlinForm(h, i, "w2", scale_k=k2, **common))

    @property
    def num_bits(self) -> int:
        return self.scheme.bits

    def decode(self) -> tuple[LogicalQuant, LogicalQuant]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` logical codes/scales/zeros/g_idx with the TRUE
        intermediate size, original row order and original g_idx (jitted per shape).

        Codes, zeros and g_idx equal the checkpoint's; scales too (fp8: the ×512 is undone
        exactly), except with int8 activations, where the scales of a tensor with more than one
        group come back as the float32 values the kernel applies (int16 fixed point × global
        scale) — the conversion is lossy there by design (§3.8).
        """
        return self.w13.decode(), self.w2.decode()

    def decode_bias(self) -> tuple[Any, Any]:
        """``(w13_bias [E, 2I], w2_bias [E, H])`` in checkpoint order (padding removed, single
        permutation undone); ``(None, None)`` without bias."""
        if self.w13_bias is None and self.w2_bias is None:
            return None, None
        return _decode_bias_jit(self)

    def _decode_bias_impl(self) -> tuple[Any, Any]:
        i, ip = self.intermediate_size, self.padded_intermediate_size
        b13 = b2 = None
        if self.w13_bias is not None:
            b13 = _unpad_w13_halves(marlin_unpermute_bias(self.w13_bias), i, ip)
        if self.w2_bias is not None:
            b2 = marlin_unpermute_bias(self.w2_bias)
        return b13, b2

_decode_bias_jit = jax.jit(lambda mw: mw._decode_bias_impl())


def _expand_zeros(z: Any, k: int, g: int) -> Any:
    """``[E, N, G]`` zeros → per-element ``[E, N, K]`` (``None`` stays ``None``)."""
    if z is None:
        return None
    grp = np.arange(k) // g if g > 0 else np.zeros(k, np.int64)
    return jnp.take(z, grp, axis=-1, mode="clip")


def _unsort_g_idx(sorted_g_idx: Any, sort_indices: Any) -> Any:
    if sorted_g_idx is None:
        return None
    if sort_indices is None:
        return sorted_g_idx
    inv = jnp.argsort(sort_indices, axis=-1)
    return jnp.take_along_axis(sorted_g_idx, inv, axis=-1, mode="clip")


# ============================================================================ conversion
def _add_one_per_code(q_zp: Any, bits: int) -> Any:
    """GPTQ v1 zeros: ``z_true = z_stored + 1`` per code (wrapping, as the checkpoint decode does)."""
    z = packing.unpack(q_zp, bits, axis=-1)
    return packing.pack((z + 1) & ((1 << bits) - 1), bits, axis=-1)


def convert_marlin(scheme: QuantScheme, weights: CheckpointWeights,
                   input_dtype: Any = None) -> MarlinWeights:
    """The whole Marlin post-processing of one MoE layer (docs/formats.md §3.1 / §3.1b).

    ``input_dtype``: ``None`` / float16 / bfloat16 (16-bit activations), ``jnp.float8_e4m3fn``
    (4-bit weights only; nibble recode + scales ×512) or ``jnp.int8`` (scales of tensors with more
    than one group become int16 fixed point with a float32 global scale). The work is jitted per
    (scheme, shapes, input dtype); under an outer jit pass ``scheme`` and ``input_dtype`` static.

    Refused (typed errors): AWQ without zero points, act-order with tile padding, fp8 with 8-bit
    weights or with GPTQ/CT zero points (vLLM's recode is "for non-zp formats only"), 8-bit
    weights with zero points (Marlin has no uint8 zero-point type), unsupported activation dtypes,
    sizes off the Marlin tile.
    """
    return _convert_marlin_jit(scheme, weights, _input_dtype_name(input_dtype))


def _convert_marlin_impl(scheme: QuantScheme, weights: CheckpointWeights,
                         dname: str | None) -> MarlinWeights:
    check_same_scheme(scheme, weights)
    is_a_8bit = _INPUT_DTYPES.get(dname, False)
    b, pf, g = scheme.bits, scheme.pack_factor, scheme.group_size
    h, i = weights.hidden_size, weights.intermediate_size
    awq = scheme.method is QuantMethod.AWQ

    # ---------------------------------------------------------------- refusals
    if dname == "float8_e4m3fn" and b != 4:
        raise UnsupportedError(f"input_dtype float8_e4m3fn: marlin_int4_fp8_preprocess needs 4-bit "
                               f"weights, got {b}-bit")
    has_zp = weights.w13_qzeros is not None or weights.w2_qzeros is not None
    if awq and (weights.w13_qzeros is None or weights.w2_qzeros is None):
        raise UnsupportedError("AWQ Marlin MoE requires zero-point tensors "
                               f"(w13_qzeros is {'absent' if weights.w13_qzeros is None else 'present'}, "
                               f"w2_qzeros is {'absent' if weights.w2_qzeros is None else 'present'})")
    if has_zp and (weights.w13_qzeros is None or weights.w2_qzeros is None):
        raise MissingTensorError("w13_qzeros / w2_qzeros: either both zero-point tensors or neither")
    if has_zp and b == 8:
        raise UnsupportedError("w13_qzeros: Marlin has no zero-point variant for 8-bit weights "
                               "(uint8b128 only), got 8-bit weights with zero points")
    if has_zp and not awq and dname == "float8_e4m3fn":
        raise UnsupportedError(f"input_dtype float8_e4m3fn: the {scheme.method.value} fp8 "
                               "preprocess is for formats without zero points, but w13_qzeros "
                               "is present")
    if h <= 0 or h % 64:
        raise ShapeError(f"hidden_size: {h} is not a positive multiple of 64 (w2_qweight size_n "
                         "and w13_qweight size_k must fit the Marlin tile)")
    if i <= 0:
        raise ShapeError(f"intermediate_size: expected a positive size, got {i}")
    if g > 0 and (h % g or i % g):
        bad, val = ("hidden_size", h) if h % g else ("intermediate_size", i)
        raise ShapeError(f"{bad}: {val} is not a multiple of group_size {g}")
    if (awq or has_zp) and i % pf:
        raise ShapeError(f"intermediate_size: {i} is not a multiple of the pack factor {pf} "
                         "(gate/up halves of packed-N tensors must split on word boundaries)")

    ip = marlin_moe_padded_intermediate(i, g)
    act_order = weights.w13_g_idx is not None
    if act_order and ip != i:
        raise UnsupportedError(f"intermediate_size: Marlin MoE thread-tile padding ({i} -> {ip}) "
                               "is unsupported with act-order (g_idx)")
    if act_order and weights.w2_g_idx is None:
        raise MissingTensorError("w2_g_idx: act-order needs both w13_g_idx and w2_g_idx")

    w13, w2 = jnp.asarray(weights.w13_qweight), jnp.asarray(weights.w2_qweight)
    s13, s2 = jnp.asarray(weights.w13_scales), jnp.asarray(weights.w2_scales)
    z13 = None if weights.w13_qzeros is None else jnp.asarray(weights.w13_qzeros)
    z2 = None if weights.w2_qzeros is None else jnp.asarray(weights.w2_qzeros)
    bias13 = None if weights.w13_bias is None else jnp.asarray(weights.w13_bias)
    bias2 = None if weights.w2_bias is None else jnp.asarray(weights.w2_bias)

    # ---------------------------------------------------------------- to K-first (§3.1 step 1)
    if scheme.method is QuantMethod.COMPRESSED_TENSORS:
        # N-first -> K-first. CT packs K with ceil(K·b/32); H % 64 == 0 makes w13 exact, and a
        # partial last word of w2 (I % pf != 0) only holds zero codes that padding/decode drop.
        w13, w2, s13, s2 = (jnp.swapaxes(x, 1, 2) for x in (w13, w2, s13, s2))
        if z13 is not None:
            z13, z2 = jnp.swapaxes(z13, 1, 2), jnp.swapaxes(z2, 1, 2)
    elif scheme.method is QuantMethod.GPTQ and z13 is not None and scheme.gptq_zeros_minus_one:
        z13, z2 = _add_one_per_code(z13, b), _add_one_per_code(z2, b)

    # ---------------------------------------------------------------- fp8 activations (§3.7)
    if dname == "float8_e4m3fn":
        if awq:
            w13 = marlin_int4_fp8_preprocess(w13, z13)
            w2 = marlin_int4_fp8_preprocess(w2, z2)
        else:
            w13 = marlin_int4_fp8_preprocess(w13)
            w2 = marlin_int4_fp8_preprocess(w2)
        s13 = s13 * FP8_SCALE_FACTOR
        s2 = s2 * FP8_SCALE_FACTOR

    # ---------------------------------------------------------------- padding (§3.2)
    if ip != i:
        if awq:
            w13 = _pad_w13_halves(w13, i // pf, ip // pf)
            w2 = _pad_axis(w2, 1, ip)
        else:
            w13 = _pad_w13_halves(w13, i, ip)
            w2 = _pad_axis(w2, 1, ip // pf)
        s13 = _pad_w13_halves(s13, i, ip)
        z13 = _pad_w13_halves(z13, i // pf, ip // pf)
        if g > 0:
            s2 = _pad_axis(s2, 1, ip // g)
            z2 = _pad_axis(z2, 1, ip // g)
        bias13 = _pad_w13_halves(bias13, i, ip)

    # ---------------------------------------------------------------- act-order (§3.9)
    gi13 = gi2 = perm13 = perm2 = None
    if act_order:
        g13_in, g2_in = jnp.asarray(weights.w13_g_idx), jnp.asarray(weights.w2_g_idx)
        check_shape("w13_g_idx", g13_in, (w13.shape[0], h))
        check_shape("w2_g_idx", g2_in, (w2.shape[0], i))
        perm13 = jnp.argsort(g13_in, axis=-1, stable=True).astype(jnp.int32)
        perm2 = jnp.argsort(g2_in, axis=-1, stable=True).astype(jnp.int32)
        gi13 = jnp.take_along_axis(g13_in, perm13, axis=-1).astype(jnp.int32)
        gi2 = jnp.take_along_axis(g2_in, perm2, axis=-1).astype(jnp.int32)

    # ---------------------------------------------------------------- repack (§3.3)
    _check_repack_sizes("w13_qweight", h, 2 * ip, is_a_8bit)
    _check_repack_sizes("w2_qweight", ip, h, is_a_8bit)
    # (awq|gptq)_marlin_moe_repack, with the layer's tensor names in any error message.
    m13 = _repack_checked("w13_qweight", w13, perm13, h, 2 * ip, b, is_a_8bit, awq=awq, moe=True)
    m2 = _repack_checked("w2_qweight", w2, perm2, ip, h, b, is_a_8bit, awq=awq, moe=True)

    # ---------------------------------------------------------------- scales (§3.4, §3.8)
    k13, k2 = _scale_size_ks(scheme, i, ip)
    ms13 = marlin_moe_permute_scales(s13, k13, 2 * ip, g, is_a_8bit)
    ms2 = marlin_moe_permute_scales(s2, k2, h, g, is_a_8bit)
    gs13 = gs2 = None
    if dname == "int8":
        if scheme.num_groups(h) > 1:
            ms13, gs13 = marlin_act_int8_process_scales(ms13)
        if scheme.num_groups(i) > 1:
            ms2, gs2 = marlin_act_int8_process_scales(ms2)

    # ---------------------------------------------------------------- zeros (§3.5)
    mz13 = mz2 = None
    if z13 is not None:
        conv = moe_awq_to_marlin_zero_points if awq else moe_packed_to_marlin_zero_points
        mz13 = conv(z13, z13.shape[1], z13.shape[2] * pf, b, is_a_8bit)
        mz2 = conv(z2, z2.shape[1], z2.shape[2] * pf, b, is_a_8bit)

    # ---------------------------------------------------------------- bias (§3.6)
    mb13 = None if bias13 is None else marlin_permute_bias(bias13)
    mb2 = None if bias2 is None else marlin_permute_bias(bias2)

    return MarlinWeights.of(
        w13_qweight=m13, w2_qweight=m2, w13_scales=ms13, w2_scales=ms2,
        w13_qzeros=mz13, w2_qzeros=mz2, w13_g_idx=gi13, w2_g_idx=gi2,
        w13_g_idx_sort_indices=perm13, w2_g_idx_sort_indices=perm2,
        w13_input_global_scale=gs13, w2_input_global_scale=gs2,
        w13_bias=mb13, w2_bias=mb2,
        scheme=scheme, hidden_size=h, intermediate_size=i, padded_intermediate_size=ip,
        is_a_8bit=is_a_8bit, input_dtype=dname,
    )


_convert_marlin_jit = jax.jit(_convert_marlin_impl, static_argnums=(0, 2))
