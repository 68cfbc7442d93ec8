"""Round-to-nearest quantization of float weights into unsigned codes, scales and zero points.

Used by the checkpoint writer (tiny models for the demo and tests) and by tests. All numpy.
The rules follow vLLM's reference quantizer (``docs/formats.md`` §10):

* symmetric: ``s = max(max(w) / q_max, min(w) / q_min)`` with ``q ∈ [-2**(b-1), 2**(b-1) - 1]``,
  ``u = clip(round(w / s), q_min, q_max) + 2**(b-1)``;
* asymmetric: ``s = (max(w) - min(w)) / (2**b - 1)``, ``z = clip(round(-min(w) / s), 0, 2**b - 1)``,
  ``u = clip(round(w / s) + z, 0, 2**b - 1)``.

Scales are rounded to their storage dtype *before* the codes are computed, so dequantizing the
stored tensors reproduces exactly what the codes were chosen against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .errors import ShapeError, check_divisible
from .schemes import QuantScheme


@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
    """``codes [..., N, K]`` uint8/int32, ``scales [..., N, G]``, ``zeros [..., N, G]`` or None,
    ``g_idx [..., K]`` or None (act-order)."""

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    g_idx: np.ndarray | None

    def dequantize(self, bits: int, group_size: int) -> np.ndarray:
        """float64 ``(codes - zero) * scale``."""
        k = self.codes.shape[-1]
        if self.g_idx is not None:
            gi = self.g_idx
        elif group_size == -1:
            gi = np.zeros((k,), np.int64)
        else:
            gi = np.arange(k) // group_size
        gi = np.broadcast_to(gi[..., None, :], self.codes.shape)
        s = np.take_along_axis(self.scales.astype(np.float64), gi, axis=-1)
        z = (np.take_along_axis(self.zeros.astype(np.int64), gi, axis=-1)
             if self.zeros is not None else (1 << (bits - 1)))
        return (self.codes.astype(np.int64) - z) * s


def act_order_g_idx(w: np.ndarray, group_size: int) -> np.ndarray:
    """GPTQ desc_act-style ``g_idx [..., K]``: input rows ranked by descending column norm
    (a stand-in for the Hessian diagonal) are cut into consecutive groups of ``group_size``."""
    k = w.shape[-1]
    importance = np.sqrt((w.astype(np.float64) ** 2).sum(axis=-2))  # [..., K]
    order = np.argsort(-importance, axis=-1, kind="stable")
    rank = np.argsort(order, axis=-1, kind="stable")
    del k
    return (rank // group_size).astype(np.int32)


def quantize_rtn(
    w: np.ndarray,
    scheme: QuantScheme,
    *,
    scale_dtype: Any = np.float16,
    g_idx: np.ndarray | None = None,
) -> QuantizedMatrix:
    """Quantize ``w [..., N, K]`` (output × input) round-to-nearest in ``scheme``.

    With ``scheme.act_order``, ``g_idx`` defaults to :func:`act_order_g_idx`.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim < 2:
        raise ShapeError(f"w: expected [..., N, K], got shape {w.shape}")
    *lead, n, k = w.shape
    b, g = scheme.bits, scheme.group_size
    if g != -1:
        check_divisible("input size K", k, g, f"group_size {g} must divide K")
    num_groups = 1 if g == -1 else k // g
    if scheme.act_order and g_idx is None:
        g_idx = act_order_g_idx(w, g)
    if g_idx is not None:
        gi = np.broadcast_to(np.asarray(g_idx)[..., None, :], w.shape)
    else:
        gi = np.broadcast_to((np.arange(k) // g if g != -1 else np.zeros(k, np.int64)), w.shape)
    onehot = gi[..., None] == np.arange(num_groups)  # [..., N, K, G]
    big = np.finfo(np.float64).max
    wmax = np.where(onehot, w[..., None], -big).max(axis=-2)  # [..., N, G]
    wmin = np.where(onehot, w[..., None], big).min(axis=-2)
    tiny = float(np.finfo(np.float16).tiny) * 16
    if scheme.zero_point:
        qmax = (1 << b) - 1
        wmax, wmin = np.maximum(wmax, 0.0), np.minimum(wmin, 0.0)
        s = np.maximum((wmax - wmin) / qmax, tiny).astype(scale_dtype)
        s64 = s.astype(np.float64)
        z = np.clip(np.round(-wmin / s64), 0, qmax).astype(np.int64)
        s_full = np.take_along_axis(s64, gi, axis=-1)
        z_full = np.take_along_axis(z, gi, axis=-1)
        u = np.clip(np.round(w / s_full) + z_full, 0, qmax)
        zeros = z.astype(np.int32)
    else:
        qmax, qmin = (1 << (b - 1)) - 1, -(1 << (b - 1))
        s = np.maximum(np.maximum(wmax / qmax, wmin / qmin), tiny).astype(scale_dtype)
        s_full = np.take_along_axis(s.astype(np.float64), gi, axis=-1)
        u = np.clip(np.round(w / s_full), qmin, qmax) - qmin
        zeros = None
    return QuantizedMatrix(u.astype(np.int32), s, zeros,
                           None if g_idx is None else np.ascontiguousarray(g_idx, dtype=np.int32))
