"""How each quantization method stores one quantized matrix: the one table every reader and
writer of the library uses.

A quantized linear ``y = x Wᵀ (+ b)`` with ``W [N, K]`` (output × input) — a dense projection, or
one expert's gate, up or down — is stored by AWQ, GPTQ and compressed-tensors as a few tensors
named ``<module>.<suffix>`` (``docs/formats.md`` §1.3–§1.5). Per method, with ``pf = 32 // bits``
values per int32 word and ``G`` scale groups along K (``ceil(K / group_size)``; 1 when
channelwise; a partial last group is allowed):

==================  ===============================  =======================================
method              tensors (suffix: shape, dtype)   decode
==================  ===============================  =======================================
AWQ (GEMM)          qweight [K, N/pf] I32            codes packed along N in AutoAWQ's
                    scales [G, N] F16/BF16/F32       nibble order, zero points likewise
                    qzeros [G, N/pf] I32
GPTQ (v1 / v2)      qweight [K/pf, N] I32            codes packed along K; v1 stores
                    scales [G, N]                    ``z - 1``; ``g_idx`` names the group of
                    qzeros [G, N/pf] I32             each input row (act-order); a symmetric
                    g_idx [K] I32/I64                layer's qzeros hold the implicit zero
compressed-tensors  weight_packed [N, ⌈K/pf⌉] I32    codes packed along K, zero points
                    weight_scale [N, G]              along N; ``weight_shape = [N, K]``
                    weight_zero_point [⌈N/pf⌉, G]
                    weight_g_idx [K], weight_shape [2]
==================  ===============================  =======================================

Every method may carry a ``bias [N]``. Each tensor has a *role* — ``qweight``, ``scales``,
``qzeros``, ``g_idx``, ``shape``, ``bias`` (the loader layout's field names,
:class:`~wna16_jax.weights.CheckpointWeights`) — and a *need*: ``required``, ``optional`` (kept
when present), or ``checked`` (read only to check a value rule, then dropped: GPTQ's trivial
``g_idx`` and symmetric ``qzeros``, compressed-tensors' ``weight_shape``). A suffix the table does
not list for the scheme is an unexpected tensor. Each entry also says which axis spans N and which
spans K, and in what units, so that readers can concatenate matrices along N (gate and up into
``w13``; q, k and v) and slice them for tensor parallelism without knowing the method.

:func:`tensors` is the table, :func:`decode` turns stored arrays (an expert axis first) into their
:class:`~wna16_jax.weights.LogicalQuant`, :func:`pack` writes a matrix as the tools store it, and
:func:`check_values` holds the value rules every reader applies.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from . import packing
from .errors import ConfigError, ShapeError, ValueRangeError
from .schemes import QuantMethod, QuantScheme

#: the roles of a matrix's stored tensors (the loader layout's field names)
ROLES = ("qweight", "scales", "qzeros", "g_idx", "shape", "bias")
#: roles whose arrays a loaded matrix keeps (``shape`` and ``checked`` tensors are dropped)
KEPT_ROLES = ("qweight", "scales", "qzeros", "g_idx")
REQUIRED, OPTIONAL, CHECKED = "required", "optional", "checked"

INT_DTYPES = ("I32",)
INDEX_DTYPES = ("I32", "I64")
FLOAT_DTYPES = ("F16", "BF16", "F32")

#: the checkpoint suffix of each role, per method
SUFFIXES = {
    QuantMethod.AWQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros", "bias": "bias"},
    QuantMethod.GPTQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros", "g_idx": "g_idx",
                       "bias": "bias"},
    QuantMethod.COMPRESSED_TENSORS: {"qweight": "weight_packed", "scales": "weight_scale",
                                     "qzeros": "weight_zero_point", "g_idx": "weight_g_idx",
                                     "shape": "weight_shape", "bias": "bias"},
}
#: suffixes that mark a module's tensors as a quantized matrix
QUANTIZED_MARKERS = tuple(sorted({s["qweight"] for s in SUFFIXES.values()}))


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a stored ``[N, K]`` matrix: its ``role`` and ``suffix``, the ``shape`` and the
    safetensors ``dtypes`` it may have, its ``need``, and its geometry: ``n_axis`` spans the
    outputs with ``n_unit`` outputs per entry (``pf`` where N is packed), ``k_axis`` the inputs
    with ``k_unit`` inputs per entry (``pf`` packed, the group size per group); None: no such axis."""

    role: str
    suffix: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    need: str
    n_axis: int | None = None
    n_unit: int = 1
    k_axis: int | None = None
    k_unit: int = 1

    @property
    def kept(self) -> bool:
        return self.role in KEPT_ROLES and self.need != CHECKED or self.role == "bias"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_groups(scheme: QuantScheme, k: int) -> int:
    """Scale groups along an input size ``k``: ``ceil(k / group_size)`` (1 when channelwise)."""
    return 1 if scheme.group_size == -1 else _cdiv(int(k), scheme.group_size)


def size_reason(scheme: QuantScheme, n: int, k: int) -> str | None:
    """Why ``[n, k]`` cannot be stored in ``scheme`` (whole int32 words along the packed axes),
    or None."""
    pf, m = scheme.pack_factor, scheme.method
    if m is QuantMethod.AWQ and n % pf:
        return f"N={n} is not a multiple of {pf} ({scheme.describe()} packs {pf} outputs per int32 word)"
    if m is QuantMethod.GPTQ and (k % pf or n % pf):
        return (f"N={n}, K={k} are not multiples of {pf} ({scheme.describe()} packs {pf} values per int32 "
                "word along K, and its zero points along N)")
    return None


def tensors(scheme: QuantScheme, n: int, k: int, *, groups: int | None = None) -> dict[str, StoredTensor]:
    """The table: role → :class:`StoredTensor` of the tensors ``scheme`` may store for ``W [n, k]``
    (any other suffix is unexpected). ``groups`` overrides ``G`` (an act-order matrix sliced along
    K for tensor parallelism keeps its whole scales, indexed through ``g_idx``)."""
    s, pf, g, m = scheme, scheme.pack_factor, scheme.group_size, scheme.method
    gs = num_groups(s, k) if groups is None else int(groups)
    gu = k if g == -1 else g                                  # inputs per scale entry
    sfx = SUFFIXES[m]

    def t(role, shape, dtypes, need, n_axis=None, n_unit=1, k_axis=None, k_unit=1):
        return StoredTensor(role, sfx[role], tuple(int(d) for d in shape), dtypes, need, n_axis, n_unit,
                            k_axis, k_unit)

    if m is QuantMethod.AWQ:
        out = [t("qweight", (k, n // pf), INT_DTYPES, REQUIRED, 1, pf, 0, 1),
               t("scales", (gs, n), FLOAT_DTYPES, REQUIRED, 1, 1, 0, gu)]
        if s.zero_point:
            out.append(t("qzeros", (gs, n // pf), INT_DTYPES, REQUIRED, 1, pf, 0, gu))
    elif m is QuantMethod.GPTQ:
        out = [t("qweight", (k // pf, n), INT_DTYPES, REQUIRED, 1, 1, 0, pf),
               t("scales", (gs, n), FLOAT_DTYPES, REQUIRED, 1, 1, 0, gu),
               t("qzeros", (gs, n // pf), INT_DTYPES, REQUIRED if s.zero_point else CHECKED, 1, pf, 0, gu),
               t("g_idx", (k,), INDEX_DTYPES, REQUIRED if s.act_order else CHECKED, None, 1, 0, 1)]
    else:
        out = [t("qweight", (n, _cdiv(k, pf)), INT_DTYPES, REQUIRED, 0, 1, 1, pf),
               t("scales", (n, gs), FLOAT_DTYPES, REQUIRED, 0, 1, 1, gu),
               t("shape", (2,), INDEX_DTYPES, CHECKED)]
        if s.zero_point:
            out.append(t("qzeros", (_cdiv(n, pf), gs), INT_DTYPES, REQUIRED, 0, pf, 1, gu))
        if s.act_order:
            out.append(t("g_idx", (k,), INDEX_DTYPES, REQUIRED, None, 1, 0, 1))
    out.append(t("bias", (n,), FLOAT_DTYPES, OPTIONAL, 0, 1))
    return {x.role: x for x in out}


def expert_shapes(scheme: QuantScheme, e: int, n: int, k: int, *, groups: int | None = None
                  ) -> dict[str, tuple[int, ...]]:
    """role → shape of the kept arrays of ``e`` stacked ``[n, k]`` matrices (the expert axis first)."""
    return {r: (e,) + x.shape for r, x in tensors(scheme, n, k, groups=groups).items() if x.kept}


# --------------------------------------------------------------------------- decode / pack


def decode(scheme: QuantScheme, qweight, scales, qzeros=None, g_idx=None, *, n: int, k: int):
    """Stored arrays of ``E`` matrices (an expert axis first: ``qweight [E, ...]`` as the table
    says) → their :class:`~wna16_jax.weights.LogicalQuant` (``codes [E, N, K]``). Works on numpy
    and jax arrays alike (jit-able)."""
    from .weights import LogicalQuant

    s, b = scheme, scheme.bits
    xp = packing.xp_of(qweight)
    if s.method is QuantMethod.AWQ:
        codes = xp.swapaxes(packing.unpack(qweight, b, axis=2, order=packing.awq_order(b)), 1, 2)
        sc = xp.swapaxes(scales, 1, 2)
        zeros = None if qzeros is None else xp.swapaxes(
            packing.unpack(qzeros, b, axis=2, order=packing.awq_order(b)), 1, 2)
    elif s.method is QuantMethod.GPTQ:
        codes = xp.swapaxes(packing.unpack(qweight, b, axis=1), 1, 2)
        sc = xp.swapaxes(scales, 1, 2)
        zeros = None
        if qzeros is not None:
            zeros = xp.swapaxes(packing.unpack(qzeros, b, axis=2), 1, 2)
            if s.gptq_zeros_minus_one:
                zeros = (zeros + 1) & ((1 << b) - 1)
    else:
        codes = packing.unpack(qweight, b, axis=2, size=k)
        sc = scales
        zeros = None if qzeros is None else packing.unpack(qzeros, b, axis=1, size=n)
    return LogicalQuant(codes, sc, zeros, g_idx, bits=b, group_size=s.group_size)


def symmetric_zero_word(scheme: QuantScheme) -> np.int32:
    """The int32 word a symmetric GPTQ checkpoint stores in every ``qzeros`` entry: the implicit
    zero (minus one for the v1 format) in each of the ``pf`` slots."""
    z = scheme.implicit_zero - 1 if scheme.gptq_zeros_minus_one else scheme.implicit_zero
    return np.uint32(sum(z << (scheme.bits * j) for j in range(scheme.pack_factor))).view(np.int32)


def natural_g_idx(scheme: QuantScheme, k: int) -> np.ndarray:
    """The group of each input row in natural order (``row // group_size``; 0 when channelwise)."""
    return np.zeros(k, np.int64) if scheme.group_size == -1 else np.arange(k) // scheme.group_size


def pack(scheme: QuantScheme, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None = None,
         g_idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One matrix's ``codes [N, K]`` and ``scales`` / ``zeros [N, G]`` as the tools store it:
    suffix → array (the table's tensors; GPTQ writes its trivial ``g_idx`` and, when symmetric, the
    implicit zero points, as AutoGPTQ does)."""
    b, m = scheme.bits, scheme.method
    n, k = codes.shape
    if m is QuantMethod.AWQ:
        out = {"qweight": packing.pack(codes.T, b, axis=1, order=packing.awq_order(b)),
               "scales": np.ascontiguousarray(scales.T)}
        if zeros is not None:
            out["qzeros"] = packing.pack(zeros.T, b, axis=1, order=packing.awq_order(b))
    elif m is QuantMethod.GPTQ:
        stored_z = zeros if zeros is not None else np.full(scales.shape, scheme.implicit_zero)
        if scheme.gptq_zeros_minus_one:
            stored_z = (stored_z - 1) & ((1 << b) - 1)
        out = {"qweight": packing.pack(codes.T, b, axis=0), "scales": np.ascontiguousarray(scales.T),
               "qzeros": packing.pack(stored_z.T, b, axis=1),
               "g_idx": np.asarray(natural_g_idx(scheme, k) if g_idx is None else g_idx, np.int32)}
    else:
        out = {"weight_packed": packing.pack(codes, b, axis=1), "weight_scale": np.ascontiguousarray(scales),
               "weight_shape": np.array([n, k], np.int64)}
        if zeros is not None:
            out["weight_zero_point"] = packing.pack(zeros, b, axis=0)
        if g_idx is not None:
            out["weight_g_idx"] = np.asarray(g_idx, np.int32)
    return {key: np.ascontiguousarray(v) for key, v in out.items()}


# --------------------------------------------------------------------------- value checks

_NONFINITE_BITS = {np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(np.float32): (np.uint32, 0x7F800000),
                   np.dtype(np.float64): (np.uint64, 0x7FF0000000000000)}


def nonfinite(a: np.ndarray) -> np.ndarray:
    """``~isfinite(a)`` from the exponent bits (all ones: Inf or NaN), without a float copy."""
    if a.dtype.name == "bfloat16":
        return (a.view(np.uint16) & 0x7F80) == 0x7F80
    kind, mask = _NONFINITE_BITS[a.dtype]
    return (a.view(kind) & kind(mask)) == kind(mask)


def check_values(scheme: QuantScheme, arrays: Mapping[str, np.ndarray], *, n: int, k: int,
                 name_of: Callable[[str, int], str]) -> None:
    """The value rules of stored matrices, vectorized over an expert axis: ``arrays`` maps roles
    to stacks ``[E, ...]`` of the table's shapes (checked tensors included); ``name_of(role, e)``
    names expert ``e``'s tensor in messages. Scales and biases finite; ``weight_shape == [N, K]``;
    act-order ``g_idx`` in ``[0, G)``, else (a stored trivial one) in natural order; a symmetric
    GPTQ layer's zero points equal to the implicit zero."""
    s = scheme

    def first(bad: np.ndarray) -> int:
        return int(np.argmax(bad.reshape(len(bad), -1).any(axis=1)))

    for role in ("scales", "bias"):
        a = arrays.get(role)
        if a is None:
            continue
        bad = nonfinite(a)
        if bad.any():
            pos = np.argwhere(bad)[0].tolist()
            raise ValueRangeError(f"{name_of(role, pos[0])}: {role} must be finite, found {a[tuple(pos)]} at "
                                  f"{pos[1:]}")
    shape = arrays.get("shape")
    if shape is not None:
        bad = ~(shape.reshape(len(shape), -1) == np.asarray([n, k])).all(axis=1)
        if bad.any():
            e = int(np.argmax(bad))
            raise ShapeError(f"{name_of('shape', e)}: expected [{n}, {k}], got {shape[e].tolist()}")
    gi = arrays.get("g_idx")
    if gi is not None:
        if s.act_order:
            ng = num_groups(s, k)
            bad = (gi < 0) | (gi >= ng)
            if bad.any():
                e = first(bad)
                raise ValueRangeError(f"{name_of('g_idx', e)}: group indices must lie in [0, {ng}), got "
                                      f"[{gi[e].min()}, {gi[e].max()}]")
        else:
            bad = gi != natural_g_idx(s, k)[None]
            if bad.any():
                raise ConfigError(f"{name_of('g_idx', first(bad))}: rows are not in natural group order, but "
                                  "the config has no act-order (desc_act=false)")
    qz = arrays.get("qzeros")
    if qz is not None and s.method is QuantMethod.GPTQ and not s.zero_point:
        word = symmetric_zero_word(s)
        bad = qz != word
        if bad.any():
            raise ValueRangeError(
                f"{name_of('qzeros', first(bad))}: the config says sym=true, so every zero point must be the "
                f"implicit {s.implicit_zero} (word {np.uint32(word.view(np.uint32)):#010x}), found other values")


__all__ = ["ROLES", "KEPT_ROLES", "SUFFIXES", "QUANTIZED_MARKERS", "REQUIRED", "OPTIONAL", "CHECKED",
           "StoredTensor", "tensors", "expert_shapes", "num_groups", "size_reason", "decode", "pack",
           "check_values", "nonfinite", "natural_g_idx", "symmetric_zero_word"]
