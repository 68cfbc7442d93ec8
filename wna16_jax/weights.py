"""Weight pytrees: the loader layout (``CheckpointWeights``) and the logical form every layout
decodes to (``LogicalQuant``).

All classes are frozen dataclasses registered as JAX pytrees: arrays are children, sizes and
the scheme are static metadata. Every array field of an experts pytree has the expert axis
first, so selecting experts (``take_experts``) is a gather on axis 0 of every leaf.

Shapes of ``CheckpointWeights`` per method (``docs/formats.md`` §1.3–§1.6), with
``E`` experts, ``H`` hidden size, ``I`` intermediate size, ``pf = 32 // bits``, ``G13 = H/g``,
``G2 = I/g`` (1 when channelwise):

=============  =========================  =========================  ==========================
field          AWQ (K-first, N-packed)     GPTQ (K-first, K-packed)    compressed-tensors (N-first)
=============  =========================  =========================  ==========================
w13_qweight    [E, H, 2I/8]                [E, H/pf, 2I]               [E, 2I, H/pf]
w2_qweight     [E, I, H/8]                 [E, I/pf, H]                [E, H, I/pf]
w13_scales     [E, G13, 2I]                [E, G13, 2I]                [E, 2I, G13]
w2_scales      [E, G2, H]                  [E, G2, H]                  [E, H, G2]
w13_qzeros     [E, G13, 2I/8] (AWQ order)  [E, G13, 2I/pf] (v1: z-1)   [E, 2I/pf, G13]
w2_qzeros      [E, G2, H/8]                [E, G2, H/pf]               [E, H/pf, G2]
w13_g_idx      —                           [E, H] (act-order)          [E, H] (act-order)
w2_g_idx       —                           [E, I] (act-order)          [E, I] (act-order)
w13_bias       [E, 2I]                     [E, 2I]                     [E, 2I]
w2_bias        [E, H]                      [E, H]                      [E, H]
=============  =========================  =========================  ==========================

``w13`` is ``[gate; up]`` along its output axis, gate first. Zero points exist only when the
scheme has them (symmetric GPTQ's constant ``0x77777777`` qzeros are dropped at load).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from . import packing
from .errors import ConfigError, ShapeError, ValueRangeError, WNA16Error, check_dtype, check_shape
from .schemes import QuantMethod, QuantScheme


def pytree_dataclass(cls=None, *, meta: tuple[str, ...] = ()):
    """Make ``cls`` a frozen dataclass and register it as a pytree; ``meta`` fields are static.

    A class with a ``NAMES`` mapping (flat name → ``(gemm, field)``, e.g. vLLM's ``"w13_qweight"``
    → ``("w13", "qvalue")``) also gets one read-only property per flat name, reading that field of
    that :class:`QuantMatrix`."""

    def wrap(c):
        c.META = tuple(meta)  # the static field names, for ExpertsMixin and serialization
        for flat, (gemm, field) in getattr(c, "NAMES", {}).items():
            setattr(c, flat, property(lambda self, g=gemm, f=field: getattr(getattr(self, g), f),
                                      doc=f"``{gemm}.{field}`` (the flat name the converters use)"))
        c = dataclasses.dataclass(frozen=True)(c)
        names = [f.name for f in dataclasses.fields(c)]
        data = [n for n in names if n not in meta]
        return jax.tree_util.register_dataclass(c, data_fields=data, meta_fields=list(meta))

    return wrap if cls is None else wrap(cls)


def _take(x: Any, idx: Any) -> Any:
    if x is None:
        return None
    xp = packing.xp_of(x) if not packing.is_jax(idx) else jnp
    return xp.take(x, idx, axis=0)


# --------------------------------------------------------------------------- one quantized matrix


@dataclasses.dataclass(frozen=True)
class Form:
    """How one layout packs a :class:`QuantMatrix` (static, hashable): the facts its decode needs
    beyond the arrays. ``n``, ``k``: the logical output and input sizes."""

    n: int
    k: int

    def decode(self, m: "QuantMatrix") -> "LogicalQuant":  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.decode")


@pytree_dataclass(meta=("bits", "group_size", "form"))
class QuantMatrix:
    """One GEMM's quantized weights for every expert, in one layout's packed form.

    ``qvalue``: the packed codes; ``scale``: the group scales; ``zero_point``: the packed zero
    points or None (symmetric); ``g_idx``: the group of each input row or None; ``perm``: the
    layout's row order or None; ``global_scale``: a per-tensor float32 scalar or None (the only
    leaf without the expert axis first). ``bits`` and ``group_size`` (-1: channelwise) are the
    code width and the group; ``form`` (a :class:`Form`) says how the arrays are laid out, so
    :meth:`decode` needs nothing else. The arrays' shapes are the layout's (its class says).
    """

    qvalue: Any
    scale: Any
    zero_point: Any = None
    g_idx: Any = None
    perm: Any = None
    global_scale: Any = None
    bits: int = 4
    group_size: int = 128
    form: Form = None  # type: ignore[assignment]

    EXPERT_FIELDS = ("qvalue", "scale", "zero_point", "g_idx", "perm")

    def decode(self) -> "LogicalQuant":
        """The logical codes / scales / zeros / groups (``codes [E, N, K]``)."""
        return self.form.decode(self)

    def dequantize(self, dtype: Any = jnp.float32) -> Any:
        """Dense ``[E, N, K]`` in ``dtype``."""
        return self.decode().dequantize(dtype)

    def take_experts(self, idx: Any) -> "QuantMatrix":
        return dataclasses.replace(self, **{f: _take(getattr(self, f), idx) for f in self.EXPERT_FIELDS})

    @classmethod
    def from_stored(cls, scheme: QuantScheme, stored: Any, *, n: int, k: int) -> "QuantMatrix":
        """One matrix ``[n, k]`` as a checkpoint stores it (``stored``: suffix → array, the format
        table's tensors) as a one-expert matrix in the checkpoint's form; the tensors the table
        only checks (GPTQ's trivial ``g_idx`` and symmetric ``qzeros``, compressed-tensors'
        ``weight_shape``) and the bias are left out. No values are checked here (the reader,
        :func:`wna16_jax.checkpoint.read_matrix`, checks files)."""
        from . import formats

        kept = {t.suffix: t.role for t in formats.tensors(scheme, n, k).values() if t.kept and t.role != "bias"}
        arrays = {kept[sfx]: a[None] for sfx, a in stored.items() if sfx in kept}
        missing = sorted(set(kept.values()) - set(arrays))
        if missing:
            raise ShapeError(f"stored: {scheme.describe()} needs {[s for s, r in kept.items() if r in missing]}")
        return cls(arrays["qweight"], arrays["scales"], arrays.get("qzeros"), arrays.get("g_idx"), bits=scheme.bits,
                   group_size=scheme.group_size, form=CheckpointForm(n, k, scheme))

    @property
    def num_experts(self) -> int:
        return 0 if self.qvalue is None else int(self.qvalue.shape[0])


# --------------------------------------------------------------------------- experts layouts


class ExpertsMixin:
    """Shared behaviour of all experts pytrees (loader layout and every backend layout).

    A layout holds ``w13`` and ``w2`` (each a :class:`QuantMatrix`), the biases ``w13_bias
    [E, 2I]`` / ``w2_bias [E, H]`` (or None) and static metadata; ``LAYOUT`` is its static tag.
    ``NAMES`` maps the flat field names the converters (and vLLM) use to ``(gemm, field)``; they
    read as properties, build a layout with :meth:`of` and change one with :meth:`replace`.
    ``forms(**meta)`` gives the two matrices' :class:`Form` for the static metadata, so a layout
    built or changed through these is consistent by construction.
    """

    LAYOUT: str = ""
    NAMES: dict[str, tuple[str, str]] = {}
    GEMMS = ("w13", "w2")

    @classmethod
    def flat_names(cls) -> tuple[str, ...]:
        """Every flat data name: the ``NAMES`` (matrix fields), then the layout's other fields."""
        own = [f.name for f in dataclasses.fields(cls) if f.name not in cls.META and f.name not in cls.GEMMS]
        return tuple(cls.NAMES) + tuple(own)

    def array_fields(self) -> list[str]:
        """The flat names of the arrays with the expert axis first (every data field but the
        per-tensor global scales)."""
        return [n for n in self.flat_names()
                if n not in self.NAMES or self.NAMES[n][1] != "global_scale"]

    @classmethod
    def forms(cls, **meta) -> tuple[Form, Form]:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def quant_params(cls, meta: dict) -> tuple[int, int]:
        """``(bits, group_size)`` of the layout's matrices, from its static metadata."""
        s = meta["scheme"]
        return s.bits, s.group_size

    @classmethod
    def of(cls, **kw):
        """Build the layout from flat names (``NAMES``, biases) and its static metadata."""
        meta = {m: kw.pop(m) for m in cls.META if m in kw}
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in cls.META}
        meta = {**defaults, **meta}
        mats: dict[str, dict[str, Any]] = {g: {} for g in cls.GEMMS}
        own = {}
        for name, v in kw.items():
            if name in cls.NAMES:
                g, f = cls.NAMES[name]
                mats[g][f] = v
            elif name in cls.flat_names():
                own[name] = v
            else:
                raise ConfigError(f"{cls.__name__}.of: {name!r} is not a field; expected one of "
                                  f"{list(cls.flat_names()) + list(cls.META)}")
        bits, group = cls.quant_params(meta) if cls.GEMMS else (0, 0)
        forms = cls.forms(**meta) if cls.GEMMS else ()
        for g, form in zip(cls.GEMMS, forms):
            mats[g].setdefault("qvalue", None)
            mats[g].setdefault("scale", None)
            own[g] = QuantMatrix(**mats[g], bits=bits, group_size=group, form=form)
        return cls(**own, **meta)

    def replace(self, **kw):
        """The same layout with some flat fields or static metadata changed (the matrices' forms
        follow the metadata)."""
        flat = {n: getattr(self, n) for n in self.flat_names()}
        meta = {m: getattr(self, m) for m in self.META}
        for k, v in kw.items():
            if k in meta:
                meta[k] = v
            elif k in flat:
                flat[k] = v
            else:
                raise ConfigError(f"{type(self).__name__}.replace: {k!r} is not a field; expected one of "
                                  f"{list(self.flat_names()) + list(self.META)}")
        return type(self).of(**flat, **meta)

    #: flat name → the axis that spans the intermediate size (gate and up halves for w13), for
    #: partition metadata; layouts whose axes depend on the scheme override :meth:`intermediate_axes`
    INTERMEDIATE_AXES: dict[str, int] = {}

    def intermediate_axes(self) -> dict[str, int]:
        return dict(self.INTERMEDIATE_AXES)

    def partition_names(self) -> dict[str, tuple]:
        """Logical axis names of every array (flat name → one name or None per axis): ``"experts"``
        on the expert axis, ``"intermediate"`` on the axis that spans the intermediate size where
        the layout says which; the per-tensor global scales have none."""
        inter = self.intermediate_axes()
        out = {}
        for name, a in self.named_arrays().items():
            if name in self.NAMES and self.NAMES[name][1] == "global_scale":
                out[name] = (None,) * a.ndim
                continue
            axes = ["experts"] + [None] * (a.ndim - 1)
            if name in inter and inter[name] < a.ndim:
                axes[inter[name]] = "intermediate"
            out[name] = tuple(axes)
        return out

    def flat_name_of(self, path) -> str:
        """The flat name of a leaf at ``path`` (a ``jax.tree_util`` key path into this layout)."""
        keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        if len(keys) >= 2 and keys[0] in self.GEMMS:
            for flat, (g, f) in self.NAMES.items():
                if (g, f) == (keys[0], keys[1]):
                    return flat
        return str(keys[0])

    def named_arrays(self) -> dict[str, Any]:
        """``{flat name: array}`` of every data field that is not None."""
        return {n: v for n in self.flat_names() if (v := getattr(self, n)) is not None}

    def take_experts(self, idx: Any):
        """The same pytree restricted to experts ``idx`` (a gather along axis 0 of every array)."""
        own = {f.name: _take(getattr(self, f.name), idx) for f in dataclasses.fields(self)
               if f.name not in self.META and f.name not in self.GEMMS}
        return dataclasses.replace(self, **own, **{g: getattr(self, g).take_experts(idx) for g in self.GEMMS})

    def decode(self) -> tuple["LogicalQuant", "LogicalQuant"]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` logical codes / scales / zeros / groups."""
        return self.w13.decode(), self.w2.decode()

    @property
    def num_experts(self) -> int:
        return self.w13.num_experts

    def validate(self):
        """Check that the arrays agree with the metadata: the layout decodes (shapes only, nothing
        is computed) to ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``. Returns self; raises
        :class:`~wna16_jax.errors.ShapeError` naming the layout. Layouts with per-field rules
        (the loader layout) check each field instead."""
        _check_decodes(self)
        return self

    def decode_bias(self) -> tuple[Any, Any] | None:
        """``(w13_bias [E, 2I], w2_bias [E, H])`` in logical order; layouts that permute or pad
        their biases override this. Either entry may be None."""
        return getattr(self, "w13_bias", None), getattr(self, "w2_bias", None)

    def has_bias(self) -> bool:
        return getattr(self, "w13_bias", None) is not None

    def dequantize(self, dtype: Any = jnp.float32) -> tuple[Any, Any]:
        """Dense ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in ``dtype`` (output x input)."""
        l13, l2 = self.decode()
        return l13.dequantize(dtype), l2.dequantize(dtype)

    def to_jax(self):
        """The same pytree with every array as a jax array (host numpy arrays are uploaded)."""
        return jax.tree_util.tree_map(jnp.asarray, self)

    def to_numpy(self):
        return jax.tree_util.tree_map(np.asarray, self)


@dataclasses.dataclass(frozen=True)
class ExpertsLayout(ExpertsMixin):
    """The fields every quantized experts layout has, first in its field order: the two matrices,
    the biases (or None) and the static sizes. A layout subclasses this (or :class:`SchemeLayout`),
    adds its own static fields after these and is made a pytree by :func:`pytree_dataclass`, whose
    ``meta=`` lists every static field (these sizes included)."""

    w13: QuantMatrix
    w2: QuantMatrix
    w13_bias: Any = None
    w2_bias: Any = None
    hidden_size: int = 0
    intermediate_size: int = 0


@dataclasses.dataclass(frozen=True)
class SchemeLayout(ExpertsLayout):
    """:class:`ExpertsLayout` with the checkpoint's :class:`~wna16_jax.schemes.QuantScheme` as a
    static field (the layouts whose decode depends on it)."""

    scheme: QuantScheme = None  # type: ignore[assignment]


def _structure_key(w: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(w)
    return (treedef, tuple((tuple(x.shape), str(np.dtype(x.dtype))) for x in leaves))


_DECODE_CHECKED: dict = {}


def _check_decodes(w: Any) -> None:
    """``w.dequantize`` traced with abstract shapes, once per structure (cached)."""
    key = _structure_key(w)
    if key in _DECODE_CHECKED:
        if _DECODE_CHECKED[key] is not None:
            raise ShapeError(_DECODE_CHECKED[key])
        return
    e, h, i = w.num_experts, getattr(w, "hidden_size", None), getattr(w, "intermediate_size", None)
    msg = None
    try:
        w13, w2 = jax.eval_shape(lambda x: x.dequantize(jnp.float32), w)
        if h is not None and i is not None and (tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i)):
            msg = (f"{type(w).__name__}: decodes to w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}, "
                   f"expected {(e, 2 * i, h)} and {(e, h, i)} (E={e}, H={h}, I={i})")
    except WNA16Error as ex:
        msg = f"{type(w).__name__}: {ex}"
    except Exception as ex:  # noqa: BLE001 - arrays that cannot decode are the caller's input error
        msg = (f"{type(w).__name__}: the arrays do not decode with E={e}, H={h}, I={i} "
               f"({type(ex).__name__}: {str(ex).splitlines()[0][:200] if str(ex) else ''})")
    if len(_DECODE_CHECKED) > 4096:
        _DECODE_CHECKED.clear()
    _DECODE_CHECKED[key] = msg
    if msg is not None:
        raise ShapeError(msg)


@pytree_dataclass(meta=("bits", "group_size"))
class LogicalQuant:
    """The logical content of one quantized expert stack, independent of any kernel layout.

    ``codes [E, N, K]`` unsigned integer codes (int32); ``scales [E, N, G]``;
    ``zeros [E, N, G]`` unsigned zero points or ``None`` (then the implicit ``2**(bits-1)``);
    ``g_idx [E, K]`` the group of each input row or ``None`` (then ``k // group_size``, or 0
    when channelwise). ``W[e, n, k] = (codes - zero) * scale`` at group ``g_idx[e, k]``.
    """

    codes: Any
    scales: Any
    zeros: Any = None
    g_idx: Any = None
    bits: int = 4
    group_size: int = 128

    def group_index(self) -> Any:
        """``[E, K]`` (or ``[K]``) group index of every input row."""
        if self.g_idx is not None:
            return self.g_idx
        k = self.codes.shape[-1]
        xp = packing.xp_of(self.codes)
        if self.group_size == -1:
            return xp.zeros((k,), xp.int32)
        return xp.arange(k, dtype=xp.int32) // self.group_size

    def expanded(self) -> tuple[Any, Any]:
        """Per-element ``(zero, scale)`` arrays of shape ``[E, N, K]``."""
        xp = packing.xp_of(self.codes)
        k, g = self.codes.shape[-1], self.scales.shape[-1]
        if self.g_idx is None and (g == 1 if self.group_size == -1 else g * self.group_size == k):
            # natural order: each group's entry repeated over its K / G rows (a broadcast, which
            # XLA fuses into the dequantization, where a gather would be materialized)
            def rep(a):
                return xp.broadcast_to(a[..., None], a.shape + (k // g,)).reshape(a.shape[:-1] + (k,))

            z = 1 << (self.bits - 1) if self.zeros is None else rep(self.zeros)
            return z, rep(self.scales)
        gi = self.group_index()
        if gi.ndim == 1:
            s = xp.take(self.scales, gi, axis=-1)
            z = None if self.zeros is None else xp.take(self.zeros, gi, axis=-1)
        else:
            s = xp.take_along_axis(self.scales, xp.broadcast_to(gi[:, None, :], self.codes.shape), axis=-1)
            z = None if self.zeros is None else xp.take_along_axis(
                self.zeros, xp.broadcast_to(gi[:, None, :], self.codes.shape), axis=-1)
        if z is None:
            z = 1 << (self.bits - 1)
        return z, s

    def dequantize(self, dtype: Any = jnp.float32) -> Any:
        """``(codes - zero) * scale`` computed in float32 (exact), cast to ``dtype``."""
        xp = packing.xp_of(self.codes)
        z, s = self.expanded()
        diff = (self.codes - z).astype(xp.float32)
        return (diff * s.astype(xp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class CheckpointForm(Form):
    """A matrix as the checkpoint stores it (the module docstring's table), for ``scheme``."""

    scheme: QuantScheme = None  # type: ignore[assignment]

    def decode(self, m: QuantMatrix) -> "LogicalQuant":
        from . import formats

        return formats.decode(self.scheme, m.qvalue, m.scale, m.zero_point, m.g_idx, n=self.n, k=self.k)


def layout_names(qvalue: str, scale: str, zero: str | None = None, *, g_idx: str | None = None,
           perm: str | None = None, global_scale: str | None = None) -> dict[str, tuple[str, str]]:
    """A layout's ``NAMES``: the flat name of each matrix field (``{}`` fills in ``w13`` / ``w2``)."""
    out = {}
    for field, pattern in (("qvalue", qvalue), ("scale", scale), ("zero_point", zero), ("g_idx", g_idx),
                           ("perm", perm), ("global_scale", global_scale)):
        if pattern is not None:
            for gemm in ("w13", "w2"):
                out[pattern.format(gemm)] = (gemm, field)
    return out


@pytree_dataclass(meta=("scheme", "hidden_size", "intermediate_size"))
class CheckpointWeights(SchemeLayout):
    """One MoE layer's routed experts in the layout vLLM's FusedMoE loader holds (see module doc)."""

    LAYOUT: ClassVar[str] = "checkpoint"
    NAMES: ClassVar[dict] = layout_names("{}_qweight", "{}_scales", "{}_qzeros", g_idx="{}_g_idx")

    @classmethod
    def forms(cls, *, scheme, hidden_size, intermediate_size):
        h, i = hidden_size, intermediate_size
        return CheckpointForm(2 * i, h, scheme), CheckpointForm(h, i, scheme)

    @classmethod
    def quant_params(cls, meta):
        s = meta["scheme"]
        return (4, 128) if s is None else (s.bits, s.group_size)

    def intermediate_axes(self) -> dict[str, int]:
        n_first = self.scheme is not None and self.scheme.method is QuantMethod.COMPRESSED_TENSORS
        w13, w2 = (1, 2) if n_first else (2, 1)
        out = {f"w13_{n}": w13 for n in ("qweight", "scales", "qzeros")}
        out.update({f"w2_{n}": w2 for n in ("qweight", "scales", "qzeros")})
        out.update(w2_g_idx=1, w13_bias=1)
        return out

    # ------------------------------------------------------------------ shapes
    @staticmethod
    def expected_shapes(scheme: QuantScheme, e: int, h: int, i: int, w2_groups: int | None = None
                        ) -> dict[str, tuple[int, ...]]:
        """Expected shape of every field for ``scheme`` (absent optional fields are omitted): the
        format table's kept tensors (:func:`wna16_jax.formats.expert_shapes`) of ``w13 [2I, H]``
        and ``w2 [H, I]``, stacked over ``e`` experts.

        ``w2_groups`` overrides ``I / g`` for act-order layers sliced for tensor parallelism,
        whose w2 scales stay whole (docs/formats.md §1.4) and are indexed through ``w2_g_idx``.
        """
        from . import formats

        out = {f"w13_{r}": sh for r, sh in formats.expert_shapes(scheme, e, 2 * i, h).items()}
        out.update({f"w2_{r}": sh for r, sh in formats.expert_shapes(scheme, e, h, i, groups=w2_groups).items()})
        return out

    def validate(self) -> "CheckpointWeights":
        """Check every field's presence, shape and dtype; return self. Raises typed errors."""
        from .errors import MissingTensorError, UnexpectedTensorError

        s, h, i = self.scheme, self.hidden_size, self.intermediate_size
        if s is None:
            raise ShapeError("CheckpointWeights.scheme: missing")
        e = self.num_experts
        w2_groups = None
        if s.act_order and self.w2_scales is not None and self.w2_scales.ndim == 3:
            w2_groups = int(self.w2_scales.shape[2 if s.method is QuantMethod.COMPRESSED_TENSORS else 1])
        expected = self.expected_shapes(s, e, h, i, w2_groups)
        for name in self.array_fields():
            arr = getattr(self, name)
            optional = name.endswith("_bias")
            if name not in expected:
                if arr is not None:
                    raise UnexpectedTensorError(
                        f"{name}: not part of a {s.describe()} layer, but a tensor of shape "
                        f"{tuple(arr.shape)} was given")
                continue
            if arr is None:
                if optional:
                    continue
                raise MissingTensorError(f"{name}: required by {s.describe()}, but missing")
            check_shape(name, arr, expected[name])
            if "qweight" in name or "qzeros" in name or "g_idx" in name:
                check_dtype(name, arr, np.int32)
            else:
                check_dtype(name, arr, (np.float16, jnp.bfloat16, np.float32))
        if (self.w13_bias is None) != (self.w2_bias is None):
            raise MissingTensorError("w13_bias / w2_bias: either both biases or neither must be given")
        return self


# --------------------------------------------------------------------------- stacked layers


@pytree_dataclass
class LayerStack:
    """The weights of ``L`` identical layers, stacked, read at layer ``index``.

    ``stacked``: a weights pytree (any layout, a dense linear's included) whose every array has a
    leading layer axis ``[L, ...]``; ``index``: an int32 scalar (traced in a ``lax.scan`` over
    the layers). :meth:`at_layer` is the one layer's weights. The wgmma engine reads the stack
    itself (layer ``l``'s expert ``e`` is expert ``l·E + e`` of the stack seen as ``L·E``
    experts), so a scanned decoder's kernels read the weights where they lie instead of a copy
    of the layer's slice, and so do the XLA executor's gather and blocked formulations
    (:meth:`as_experts`); the rest take :meth:`at_layer`, which XLA fuses into the
    dequantization that reads it."""

    stacked: Any
    index: Any

    def at_layer(self) -> Any:
        """The weights of layer ``index`` (a dynamic index of every array)."""
        i = jnp.asarray(self.index, jnp.int32)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), self.stacked)

    def has_expert_axis(self) -> bool:
        """Whether every array is ``[L, E, ...]`` with one ``E`` (an experts pytree without
        per-tensor leaves such as a global scale), so that :meth:`as_experts` applies."""
        leaves = jax.tree.leaves(self.stacked)
        return all(a.ndim >= 2 for a in leaves) and len({int(a.shape[1]) for a in leaves}) == 1

    def as_experts(self) -> tuple[Any, int, Any]:
        """``(weights, E, offset)``: an experts pytree ``[L, E, ...]`` seen as one layer of ``L·E``
        experts (a reshape, no copy), the layer's ``E``, and the stack index of its expert 0."""
        if not self.has_expert_axis():
            raise ShapeError("stacked: as_experts needs every array to be [L, E, ...] with one E; got shapes "
                             f"{[tuple(a.shape) for a in jax.tree.leaves(self.stacked)]}")
        e = int(jax.tree.leaves(self.stacked)[0].shape[1])
        flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), self.stacked)
        return flat, e, jnp.asarray(self.index, jnp.int32) * e


def layer_stack(stacked: Any, index: Any) -> LayerStack:
    """:class:`LayerStack` of ``stacked`` at ``index``, the index checked where it is concrete (a
    traced one, as in a ``lax.scan`` over ``arange(L)``, cannot be: an index outside ``[0, L)``
    would read a clamped or foreign layer)."""
    leaves = jax.tree.leaves(stacked)
    if not leaves:
        raise ShapeError("stacked: expected a weights pytree with arrays, got none")
    n = int(leaves[0].shape[0]) if getattr(leaves[0], "ndim", 0) else 0
    if any(getattr(a, "ndim", 0) < 1 or int(a.shape[0]) != n for a in leaves):
        raise ShapeError(f"stacked: every array needs the same leading layer axis; got leading sizes "
                         f"{sorted({int(a.shape[0]) if getattr(a, 'ndim', 0) else None for a in leaves}, key=str)}")
    try:
        i = np.asarray(index)
    except jax.errors.TracerArrayConversionError:
        return LayerStack(stacked, index)
    if i.shape != () or not np.issubdtype(i.dtype, np.integer) or not 0 <= int(i) < n:
        raise ValueRangeError(f"layer: expected an integer index in [0, {n}) (the stacked layers), got {index!r}")
    return LayerStack(stacked, index)


def at_layer(weights: Any) -> Any:
    """``weights.at_layer()`` for a :class:`LayerStack`, ``weights`` otherwise."""
    return weights.at_layer() if isinstance(weights, LayerStack) else weights
