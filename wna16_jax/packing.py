"""Pack and unpack 4-bit and 8-bit integer codes into int32 words, along any axis.

One implementation serves numpy (eager, used by the loader and the writer) and jax.numpy
(jit-able, used by converters and executors): every function dispatches on its input.

Conventions (``docs/formats.md`` §1.1, §1.3):

* value index ``x`` along the packed axis lives in word ``x // pf`` at bit offset
  ``bits * slot`` with ``pf = 32 // bits`` values per word, LSB first;
* ``order`` maps word slot ``s`` to the logical index (within its group of ``pf``) it holds.
  The standard order is the identity; AutoAWQ's is :data:`AWQ_ORDER_4BIT`
  (slot ``s`` holds column ``[0, 2, 4, 6, 1, 3, 5, 7][s]``).

Packed words are int32 (as checkpoints store them); bit arithmetic is done on uint32 views,
and the int32 result is a bit reinterpretation, never a value conversion.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .errors import ConfigError, DTypeError, ShapeError, ValueRangeError

#: AutoAWQ nibble order: word slot ``s`` holds logical column ``AWQ_ORDER_4BIT[s]``.
AWQ_ORDER_4BIT = (0, 2, 4, 6, 1, 3, 5, 7)
#: The inverse ("reverse AWQ order"): logical column ``j`` lives in slot ``AWQ_REVERSE_ORDER_4BIT[j]``.
AWQ_REVERSE_ORDER_4BIT = (0, 4, 1, 5, 2, 6, 3, 7)
#: The 8-bit AWQ order (self-inverse).
AWQ_ORDER_8BIT = (0, 2, 1, 3)

SUPPORTED_BITS = (4, 8)


def is_jax(x: Any) -> bool:
    """True for jax arrays and tracers, False for numpy arrays."""
    return not isinstance(x, np.ndarray) and type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def xp_of(x: Any):
    """The array namespace (``numpy`` or ``jax.numpy``) of ``x``."""
    if is_jax(x):
        import jax.numpy as jnp

        return jnp
    return np


def check_bits(bits: int, name: str = "bits") -> int:
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"{name}: expected one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def pack_factor(bits: int) -> int:
    """Values per int32 word: 8 for 4-bit, 4 for 8-bit."""
    return 32 // check_bits(bits)


def awq_order(bits: int) -> tuple[int, ...]:
    return AWQ_ORDER_4BIT if check_bits(bits) == 4 else AWQ_ORDER_8BIT


def awq_reverse_order(bits: int) -> tuple[int, ...]:
    return AWQ_REVERSE_ORDER_4BIT if check_bits(bits) == 4 else AWQ_ORDER_8BIT


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for slot, logical in enumerate(order):
        inv[logical] = slot
    return tuple(inv)


def to_uint32(words: Any):
    """Bit-reinterpret an int32 (or uint32) array as uint32."""
    xp = xp_of(words)
    if np.dtype(words.dtype) == np.uint32:
        return words
    if np.dtype(words.dtype) != np.int32:
        raise DTypeError(f"packed words: expected dtype int32, got {np.dtype(words.dtype)}")
    if xp is np:
        return words.view(np.uint32)
    from jax import lax

    return lax.bitcast_convert_type(words, xp.uint32)


def to_int32(words: Any):
    """Bit-reinterpret a uint32 array as int32."""
    xp = xp_of(words)
    if xp is np:
        return np.ascontiguousarray(words, dtype=np.uint32).view(np.int32)
    from jax import lax

    return lax.bitcast_convert_type(words.astype(xp.uint32), xp.int32)


def pack(
    values: Any,
    bits: int,
    axis: int = -1,
    order: Sequence[int] | None = None,
) -> Any:
    """Pack unsigned codes ``values`` (each in ``[0, 2**bits)``) along ``axis`` into int32 words.

    The packed axis shrinks by ``pf = 32 // bits``; a length that is not a multiple of ``pf``
    is zero-padded first (compressed-tensors' ``ceil(K·b/32)`` rule). ``order[s]`` is the
    logical index (within a group of ``pf``) stored in slot ``s``.
    """
    xp = xp_of(values)
    pf = pack_factor(bits)
    axis = axis % values.ndim
    v = xp.moveaxis(values, axis, -1).astype(xp.uint32)
    n = v.shape[-1]
    if n % pf:
        pad = [(0, 0)] * (v.ndim - 1) + [(0, pf - n % pf)]
        v = xp.pad(v, pad)
    v = v.reshape(v.shape[:-1] + (v.shape[-1] // pf, pf))
    if order is not None:
        if sorted(order) != list(range(pf)):
            raise ConfigError(f"order: expected a permutation of range({pf}), got {tuple(order)}")
        v = v[..., list(order)]
    shifts = (xp.arange(pf, dtype=xp.uint32) * bits).astype(xp.uint32)
    words = xp.sum(v << shifts, axis=-1, dtype=xp.uint32)
    return xp.moveaxis(to_int32(words), -1, axis)


def unpack(
    words: Any,
    bits: int,
    axis: int = -1,
    order: Sequence[int] | None = None,
    size: int | None = None,
    dtype: Any = None,
) -> Any:
    """Inverse of :func:`pack`: int32 words → unsigned codes along ``axis``.

    ``size`` truncates the unpacked axis (for padded packing); ``dtype`` defaults to int32.
    """
    xp = xp_of(words)
    pf = pack_factor(bits)
    axis = axis % words.ndim
    w = xp.moveaxis(to_uint32(words), axis, -1)
    shifts = (xp.arange(pf, dtype=xp.uint32) * bits).astype(xp.uint32)
    mask = xp.uint32((1 << bits) - 1)
    v = (w[..., None] >> shifts) & mask
    if order is not None:
        v = v[..., list(_inverse(order))]
    v = v.reshape(v.shape[:-2] + (v.shape[-2] * pf,))
    if size is not None:
        if size > v.shape[-1] or size <= v.shape[-1] - pf:
            raise ShapeError(
                f"unpack: size {size} does not fit {words.shape[axis]} packed words of {pf} values"
            )
        v = v[..., :size]
    v = v.astype(dtype if dtype is not None else xp.int32)
    return xp.moveaxis(v, -1, axis)


def check_codes(name: str, codes: Any, bits: int) -> None:
    """Eagerly check that unsigned ``codes`` lie in ``[0, 2**bits)`` (numpy inputs only)."""
    if is_jax(codes):
        return
    if codes.size and (codes.min() < 0 or codes.max() >= (1 << bits)):
        raise ValueRangeError(
            f"{name}: {bits}-bit codes must lie in [0, {1 << bits}), "
            f"got values in [{codes.min()}, {codes.max()}]"
        )
