"""Flax NNX modules: :class:`QuantizedMoE`, a mixture-of-experts layer on frozen WNA16 experts.

State layout of a :class:`QuantizedMoE` (what ``nnx.state(module, T)`` picks out):

===========================  ==============================  ==========================================
attribute                    Variable type                   content
===========================  ==============================  ==========================================
``experts``                  :class:`QuantizedExperts`       routed experts in the backend layout
``shared_experts``           :class:`QuantizedExperts`       shared expert(s) as one expert, or absent
``router``                   ``nnx.Param``                   ``[E, H]`` float gate weight (trainable)
``shared_expert_gate``       ``nnx.Param``                   ``[1, H]`` Qwen2-MoE sigmoid gate (trainable)
``e_score_correction_bias``  :class:`RouterBias`             ``[E]`` DeepSeek-V3 selection bias (frozen)
===========================  ==============================  ==========================================

Why one variable per expert stack rather than one per packed array: the six backend layouts
(loader, CPU, XPU, Marlin, TRT-LLM MXINT4, Humming) have different field sets and carry static
metadata (scheme, sizes, permutations) that their ``decode()`` needs. Holding the whole frozen
layout pytree in one typed, non-trainable :class:`QuantizedExperts` keeps ``decode()``,
``take_experts`` and sharding specs working unchanged for every layout, while
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` skips it. The qwix-style leaf names
(``qvalue`` / ``scale`` / ``zero_point``) are exposed as a read-only view by
:meth:`QuantizedMoE.quantized_arrays`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from . import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from .backends import TABLE, Backend, select_backend
from .checkpoint import Checkpoint, DenseWeights, MoELayer
from .errors import ConfigError, DTypeError, ShapeError, UnsupportedError, ValueRangeError
from .fields import check_expert_ids, show_value
from .routing import MoERouting
from .weights import CheckpointWeights, LayerStack

_FLOATS = (np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float64))

#: ``backend=`` value that keeps the loader layout (runs anywhere through the XLA decode).
LOADER_LAYOUT = Backend.LOADER.value


class QuantizedExperts(nnx.Variable):
    """One frozen array of quantized experts (expert axis first), with its logical axis names
    (``"experts"``, ``"intermediate"`` or None per axis) as partition metadata."""


#: the variable metadata key NNX reads logical axis names from (``out_sharding`` since flax 0.12,
#: ``sharding_names`` before)
SHARDING_KEY = "out_sharding" if hasattr(nnx.variablelib, "_remap_sharding_metadata") else "sharding_names"


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def as_variables(weights: Any):
    """The experts pytree with every array a :class:`QuantizedExperts` carrying its logical axis
    names (:meth:`~wna16_jax.weights.ExpertsMixin.partition_names`), so ``nnx.get_partition_spec``
    and a mesh's rules place them; not sharded eagerly (no mesh is needed to build the layer)."""
    names = weights.partition_names() if hasattr(weights, "partition_names") else {}

    def wrap(path, a):
        axes = names.get(weights.flat_name_of(path)) if names else None
        if axes is None:
            axes = ("experts",) + (None,) * (a.ndim - 1) if a.ndim else ()
        return QuantizedExperts(a, **{SHARDING_KEY: axes}, eager_sharding=False)

    return jax.tree_util.tree_map_with_path(wrap, weights)


def plain_arrays(tree: Any):
    """The same pytree with every :class:`~flax.nnx.Variable` replaced by its value."""
    return jax.tree.map(lambda v: v.get_value() if _is_variable(v) else v, tree, is_leaf=_is_variable)


def _is_stack(x) -> bool:
    return isinstance(x, LayerStack)


def bound_weights(variables: Any):
    """The layout pytree of a tree of :class:`QuantizedExperts`: their arrays; or, where a scanned
    decoder bound them to its layer (every value a :class:`~wna16_jax.weights.LayerStack` of the
    stacked array at the one traced index), ``LayerStack(<the pytree of the stacked arrays>,
    index)``, which :func:`~wna16_jax.autodiff.fused_moe_trainable` reads in place."""
    values = plain_arrays(variables)
    leaves = jax.tree.leaves(values, is_leaf=_is_stack)
    bound = sum(map(_is_stack, leaves))
    if not bound:
        return values
    if bound != len(leaves):
        raise ShapeError(f"experts: {bound} of {len(leaves)} variables hold a LayerStack; a scanned decoder binds "
                         "every variable of a layer to its index, or none")
    return LayerStack(jax.tree.map(lambda v: v.stacked, values, is_leaf=_is_stack), leaves[0].index)


def _check_finite(name: str, value: Any) -> None:
    """A :class:`ValueRangeError` naming ``name`` where concrete ``value`` holds NaN or Inf
    (traced values cannot be checked)."""
    if isinstance(value, jax.core.Tracer):
        return
    bad = ~np.isfinite(np.asarray(value, np.float32))
    if bad.any():
        pos = tuple(int(p) for p in np.unravel_index(int(np.argmax(bad)), bad.shape))
        raise ValueRangeError(f"{name}: expected finite values, got {int(bad.sum())} NaN or Inf of {bad.size} "
                              f"(the first at index {pos}) in shape {bad.shape}")


class RouterBias(nnx.Variable):
    """Non-trainable routing buffer (DeepSeek-V3 ``e_score_correction_bias``, updated by load
    balancing, not by gradients)."""


def _is_float(dtype) -> bool:
    try:
        return np.dtype(dtype) in _FLOATS
    except TypeError:
        return False


def float_compute_dtype(weights: Any, x_dtype: Any):
    """The GEMMs' dtype for 16-bit float experts (:class:`DenseWeights`, e.g. a checkpoint's
    16-bit shared experts or a dequantized model's experts) under activations of the same dtype:
    that dtype, with float32 accumulation (a 16-bit product is exact in float32), as any 16-bit
    model runs them. None otherwise: the executor's default (quantized experts dequantize to
    float32 on the XLA executor)."""
    if isinstance(weights, LayerStack):
        weights = weights.stacked
    if not isinstance(weights, DenseWeights):
        return None
    dt = np.dtype(weights.w13.dtype)
    return dt if dt in (np.dtype(np.float16), np.dtype(jnp.bfloat16)) and dt == np.dtype(x_dtype) else None


def convert_experts(experts: Any, backend: Any, *, activation: str = "silu", input_dtype=None,
                    activation_dtype=None):
    """Convert loader-layout experts into the layout ``backend``'s executor reads (``None`` →
    backend selected by the table, falling back to ``"loader"`` with a warning where no row
    converts the scheme; ``"loader"`` → unchanged): the backend's own layout, or on an NVIDIA GPU
    for the MARLIN rows the engine's layout. ``activation_dtype`` float32 (or float64): the layer
    will see 32-bit hidden states, which only the XLA executor takes; the engines' layouts hold
    the scales in the 16-bit activation dtype, so the backend's own layout is kept instead (its
    scales as stored); float16: the engine layout for float16 (bfloat16 is the default). Returns
    ``(weights, backend_name)``."""
    adt = None
    if activation_dtype is not None:
        try:
            adt = np.dtype(activation_dtype)
        except TypeError:
            pass
        if adt is None or not _is_float(adt):
            raise DTypeError(f"activation_dtype: expected None or a float dtype (float16, bfloat16, float32, "
                             f"float64), got {activation_dtype!r}")
    if isinstance(experts, DenseWeights):
        return experts, str(Backend.LOADER)
    if not isinstance(experts, CheckpointWeights):
        return experts, type(experts).__name__        # already converted
    b = select_backend(experts.scheme, backend=backend, has_bias=experts.has_bias(),
                       activation=activation, hidden_size=experts.hidden_size,
                       intermediate_size=experts.intermediate_size)
    if adt is not None:
        if adt not in (np.dtype(np.float16), np.dtype(jnp.bfloat16)):
            return TABLE[b].convert(experts.scheme, experts.to_jax(), input_dtype), str(b)
        if input_dtype is None and adt == np.dtype(np.float16):
            input_dtype = adt            # the engine layout for float16 (bfloat16 is the default)
    # ``prepare``: the layout the row's executor reads here (the engine's tiles on NVIDIA GPUs).
    return TABLE[b].prepare(experts.scheme, experts.to_jax(), input_dtype), str(b)


class QuantizedMoE(nnx.Module):
    """A routed MoE layer on frozen WNA16 experts, with a trainable float router.

    ``__call__(x)`` takes ``[T, H]`` or ``[B, S, H]``, routes every token (softmax or sigmoid
    scores, optional renormalisation, optional DeepSeek grouped top-k with score-correction
    bias, routed scaling factor) and runs :func:`wna16_jax.autodiff.fused_moe_trainable`
    (forward = :func:`wna16_jax.moe.fused_moe`; backward multiplies by the transposed quantized
    weights one expert at a time), plus the shared experts (and their sigmoid gate) if any.
    ``routing`` (a :class:`~wna16_jax.routing.MoERouting`) holds how: top-k, scores, groups,
    scaling factor and the experts' activation; :meth:`from_layer` reads it from the
    checkpoint's config (:meth:`MoERouting.of <wna16_jax.routing.MoERouting.of>`).

    ``activation_dtype``: the dtype of the hidden states the layer will see, if known. On an
    NVIDIA GPU the experts are laid out for the GPU engine, whose layouts hold the scales in the
    16-bit activation dtype (bfloat16 unless ``float16`` is named here); ``float32`` keeps a
    layout with the scales as stored instead, so that float32 inputs, which run on the XLA
    executor, see the checkpoint's scales and not their bfloat16 rounding. ``load_model`` passes
    its ``dtype``.

    ``expert_ids``: which of the router's experts ``experts`` holds (increasing indices; None:
    all). A process of a mesh spread over several processes reads only the experts its devices
    hold (``load_model(DIR, mesh=...)``); such a layer runs only once it is placed on the mesh,
    where its experts become global arrays of every expert.
    """

    def __init__(self, experts: Any, router: Any, routing: MoERouting, *, e_score_correction_bias: Any = None,
                 shared_experts: Any = None, shared_expert_gate: Any = None, backend: Any = None,
                 param_dtype: Any = jnp.float32, formulation: str | None = None, activation_dtype: Any = None,
                 expert_ids: Any = None, rngs: nnx.Rngs | None = None):
        del rngs          # nothing is random: the router and experts come from the arguments
        if not isinstance(routing, MoERouting):
            raise ConfigError(f"routing: expected a MoERouting, got {type(routing).__name__} {show_value(routing)}")
        if not _is_float(param_dtype):
            raise DTypeError(f"param_dtype: expected a float dtype, got {show_value(param_dtype)}")
        weights, self.backend = convert_experts(experts, backend, activation=routing.activation,
                                                activation_dtype=activation_dtype)
        e, h = weights.num_experts, weights.hidden_size
        if expert_ids is not None:
            # this process's share of the layer's routed experts (a mesh spread over processes,
            # wna16_jax.models.mesh): the router holds them all
            e = int(np.shape(router)[0]) if np.ndim(router) == 2 else e
            ids = check_expert_ids(expert_ids, e, "expert_ids")
            if len(ids or range(e)) != weights.num_experts:
                raise ShapeError(f"expert_ids: names {len(ids or range(e))} of the router's {e} experts, but "
                                 f"experts holds {weights.num_experts}")
        routing.check_experts(e)
        router = self._checked_float("router", router, (e, h))
        self.routing, self.formulation = routing, formulation
        self.param_dtype = np.dtype(param_dtype)
        self.num_experts, self.hidden_size = e, h
        self.experts = nnx.data(as_variables(weights))
        self.router = nnx.Param(jnp.asarray(router, self.param_dtype))
        self.e_score_correction_bias = self._score_bias(e_score_correction_bias)
        self.shared_experts = self._shared(shared_experts, backend, activation_dtype)
        if shared_expert_gate is not None:
            if shared_experts is None:
                raise ConfigError("shared_expert_gate: given without shared_experts")
            g = self._checked_float("shared_expert_gate", shared_expert_gate, (1, h))
            self.shared_expert_gate = nnx.Param(jnp.asarray(g, self.param_dtype))
        else:
            self.shared_expert_gate = None
        # None: one device. Set by wna16_jax.models.mesh.place_moe: a MoEPlacement (static), which
        # runs the routed experts through sharded_fused_moe (``experts`` then lie on its mesh)
        self.mesh_placement = None

    # ------------------------------------------------------------------ construction
    def _score_bias(self, bias: Any):
        if bias is None:
            return None
        bias = self._checked_float("e_score_correction_bias", bias, (self.num_experts,))
        return RouterBias(jnp.asarray(bias, jnp.float32))

    def _shared(self, shared_experts: Any, backend: Any, activation_dtype: Any):
        if shared_experts is None:
            return None
        sw, _ = convert_experts(shared_experts, backend, activation=self.routing.activation,
                                activation_dtype=activation_dtype)
        if sw.num_experts != 1 or sw.hidden_size != self.hidden_size:
            raise ShapeError(f"shared_experts: expected one expert of hidden size {self.hidden_size}, got "
                             f"{sw.num_experts} expert(s) of hidden size {sw.hidden_size}")
        return nnx.data(as_variables(jax.tree.map(jnp.asarray, sw)))

    @staticmethod
    def _checked_float(name: str, a: Any, shape: tuple[int, ...]):
        if tuple(np.shape(a)) != tuple(shape):
            raise ShapeError(f"{name}: expected shape {tuple(shape)}, got {tuple(np.shape(a))}")
        dt = np.dtype(getattr(a, "dtype", np.asarray(a).dtype))
        if not _is_float(dt):
            raise DTypeError(f"{name}: expected a float dtype (float16, bfloat16, float32), got {dt}")
        return a

    @classmethod
    def from_layer(cls, layer: MoELayer, config, backend: Any = None, **kw) -> "QuantizedMoE":
        """From a loaded :class:`~wna16_jax.checkpoint.MoELayer` and its ``MoEModelConfig``."""
        return cls(layer.experts, layer.router, MoERouting.of(config),
                   e_score_correction_bias=layer.e_score_correction_bias, shared_experts=layer.shared_experts,
                   shared_expert_gate=layer.shared_expert_gate, backend=backend, **kw)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike | Checkpoint, layer_index: int, backend: Any = None,
                        *, rngs: nnx.Rngs | None = None, **kw) -> "QuantizedMoE":
        """Load MoE layer ``layer_index`` of a checkpoint: a folder, a :class:`Checkpoint`, a folder
        written by ``wna16-jax convert`` or its :class:`~wna16_jax.serialize.ConvertedCheckpoint`
        (opened by :func:`~wna16_jax.serialize.open_checkpoint`). A converted layer's experts are
        already in its backend's layout: ``backend`` must then be None or that backend; its shared
        experts (stored in the loader layout) are laid out as ``backend`` says, as a source
        checkpoint's would be. ``rngs`` is accepted for the usual NNX constructor signature;
        nothing is randomly initialised."""
        from .serialize import ConvertedCheckpoint, open_checkpoint

        del rngs
        ckpt = open_checkpoint(path)
        if isinstance(layer_index, bool) or not isinstance(layer_index, (int, np.integer)) \
                or layer_index not in ckpt.moe_layer_indices:
            raise ValueRangeError(f"layer_index: {layer_index!r} is not a MoE layer of {ckpt.path!r}; "
                                  f"MoE layers are {ckpt.moe_layer_indices}")
        if isinstance(ckpt, ConvertedCheckpoint) and backend is not None \
                and Backend.parse(backend) is not ckpt.backend:
            raise ConfigError(f"backend: {ckpt.path!r} holds experts converted to {ckpt.backend.value}; "
                              f"expected None or {ckpt.backend.value!r}, got {backend!r}")
        return cls.from_layer(ckpt.load_layer(int(layer_index)), ckpt.model_config, backend, **kw)

    # ------------------------------------------------------------------ views
    def expert_weights(self):
        """The routed experts as a plain layout pytree (the arrays of the frozen variables); in a
        scanned decoder, a :class:`~wna16_jax.weights.LayerStack` of the stacked layout at the
        bound layer (:func:`bound_weights`)."""
        return bound_weights(self.experts)

    def shared_expert_weights(self):
        """The shared experts as :meth:`expert_weights` gives the routed ones, or None."""
        return None if self.shared_experts is None else bound_weights(self.shared_experts)

    def quantized_arrays(self) -> dict[str, dict[str, Any]]:
        """qwix-style read-only view: ``{"w13": {"qvalue", "scale", "zero_point", ...}, "w2": ...}``
        of the routed experts' two :class:`~wna16_jax.weights.QuantMatrix` (absent fields omitted),
        each with its ``"bias"`` where the layer has one."""
        w = self.expert_weights()
        out: dict[str, dict[str, Any]] = {}
        for gemm in w.GEMMS:
            m = getattr(w, gemm)
            view = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
                    if f.name not in m.META and getattr(m, f.name) is not None}
            bias = getattr(w, f"{gemm}_bias", None)
            if bias is not None:
                view["bias"] = bias
            out[gemm] = view
        return out

    # ------------------------------------------------------------------ forward
    def _check_finite_state(self):
        """Concrete (eager) state only: the router, score-correction bias and shared-expert gate
        hold no NaN or Inf (:class:`~wna16_jax.errors.ValueRangeError` naming the first that does)."""
        for name in ("router", "e_score_correction_bias", "shared_expert_gate"):
            v = getattr(self, name)
            if v is not None:
                _check_finite(name, v[...])

    def route(self, x2d):
        """``(topk_weights [T, k] float32, topk_ids [T, k] int32)`` for ``x2d [T, H]`` (the state
        checked as :meth:`__call__` says)."""
        router = self.router[...]
        if np.dtype(router.dtype) != self.param_dtype:
            raise DTypeError(f"router: expected dtype {self.param_dtype} (param_dtype), got "
                             f"{np.dtype(router.dtype)} with shape {tuple(router.shape)}")
        self._check_finite_state()
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        logits = jnp.einsum("th,eh->te", x2d.astype(jnp.float32), router.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        return self.routing.route(logits, bias)

    def __call__(self, x):
        """``x [T, H]`` or ``[B, S, H]`` through the layer. Called on concrete (not traced) state,
        a router, score-correction bias or shared-expert gate holding NaN or Inf is a
        :class:`~wna16_jax.errors.ValueRangeError` naming it; under ``jit`` the values are not
        known and cannot be checked. In a scanned decoder the experts' variables hold
        :class:`~wna16_jax.weights.LayerStack` values bound to the layer (see :func:`bound_weights`).
        With ``mesh_placement`` set (:func:`wna16_jax.models.mesh.place_moe`), the routed experts
        run :func:`~wna16_jax.sharding.sharded_fused_moe` on its mesh instead (no gradient)."""
        from .autodiff import fused_moe_trainable

        if getattr(x, "ndim", None) not in (2, 3) or x.shape[-1] != self.hidden_size:
            raise ShapeError(f"x: expected shape (T, {self.hidden_size}) or (B, S, {self.hidden_size}), "
                             f"got {tuple(getattr(x, 'shape', ()))}")
        if not _is_float(x.dtype):
            raise DTypeError(f"x: expected a float dtype (float16, bfloat16, float32), got {np.dtype(x.dtype)}")
        experts = self.expert_weights()
        held = getattr(experts, "num_experts", self.num_experts)
        if self.mesh_placement is None and held != self.num_experts:
            raise UnsupportedError(f"this layer holds {held} of its router's {self.num_experts} experts (one "
                                   "process's share of a mesh, expert_ids=); it runs once placed on the mesh "
                                   "(wna16_jax.models.mesh.place_model, as load_model(DIR, mesh=...) does)")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.hidden_size)
        tw, ids = self.route(x2d)
        act = self.routing.activation
        if self.mesh_placement is not None:          # on a mesh (forward only: no gradient)
            out = self.mesh_placement(x2d, tw, ids, experts, activation=act, formulation=self.formulation)
        else:
            out = fused_moe_trainable(x2d, tw, ids, experts, activation=act, formulation=self.formulation,
                                      compute_dtype=float_compute_dtype(experts, x.dtype))
        if self.shared_experts is not None:
            out = (out.astype(jnp.float32) + self._shared_output(x2d)).astype(x.dtype)
        return out.reshape(*lead, self.hidden_size)

    def _shared_output(self, x2d):
        """The shared experts' float32 output for ``x2d``, times their sigmoid gate if any."""
        from .autodiff import fused_moe_trainable

        t = x2d.shape[0]
        shared = self.shared_expert_weights()
        s = fused_moe_trainable(x2d, jnp.ones((t, 1), jnp.float32), jnp.zeros((t, 1), jnp.int32), shared,
                                activation=self.routing.activation, formulation=self.formulation,
                                compute_dtype=float_compute_dtype(shared, x2d.dtype)).astype(jnp.float32)
        if self.shared_expert_gate is None:
            return s
        gate = self.shared_expert_gate[...].astype(jnp.float32)
        return s * jax.nn.sigmoid(jnp.einsum("th,oh->to", x2d.astype(jnp.float32), gate,
                                             precision=jax.lax.Precision.HIGHEST))


def linen_quantized_moe(experts: Any, router: Any, routing: MoERouting, **kw):
    """:class:`QuantizedMoE` as a Flax Linen module, through Flax's own NNX→Linen bridge
    (``flax.nnx.bridge.to_linen``). ``init`` puts the router in the ``"params"`` collection (the
    one to train) and the frozen experts in ``"QuantizedExperts"``; arguments as for
    :class:`QuantizedMoE`."""
    return nnx.bridge.to_linen(QuantizedMoE, experts, router, routing, **kw)


__all__ = ["QuantizedMoE", "QuantizedExperts", "RouterBias", "as_variables", "bound_weights", "convert_experts",
           "float_compute_dtype", "linen_quantized_moe", "plain_arrays", "LOADER_LAYOUT"]
