"""Whole decoders on a ``jax.sharding.Mesh``: :class:`MeshRules`, :func:`check_mesh`, :func:`place_model`.

``load_model(DIR, mesh=mesh, sharding=rules)`` checks the mesh against the parsed config before
any weight is read (:func:`check_mesh`), loads the decoder, lays each MoE layer out for
:func:`wna16_jax.sharding.sharded_fused_moe` and puts every array on the mesh
(:func:`place_model`). What goes where is one small rule set, :class:`MeshRules`: each kind of
dimension names the mesh axis it is split over (None: not split):

===========================  ============  ===============================================================
field                        default       what is split over it
===========================  ============  ===============================================================
``experts``                  ``"ep"``      the routed experts (expert parallel; tokens too, inside the layer)
``expert_intermediate``      ``"tp"``      the experts' intermediate size (tensor parallel: one
                                           ``[tp, E, ...]`` stack of per-rank slices, each converted alone)
``heads``                    ``"tp"``      attention heads and KV heads: the q / k / v (DeepSeek: q, q_b,
                                           kv_b) rows, the o_proj columns, the KV cache's head axis
``mlp``                      ``"tp"``      the dense MLPs' intermediate size (gate / up rows, down columns)
``vocab``                    ``"tp"``      the embedding rows and ``lm_head``'s rows
===========================  ============  ===============================================================

Norms, routers, score-correction biases, shared experts and shared-expert gates are replicated
(:data:`LINEAR_RULES` and :func:`leaf_specs` are the whole table). A quantized linear as the
checkpoint stores it is split on its packed arrays' N (rows) or K (columns) axis, each array where
the axis size divides it (else that array is replicated); a linear laid out for a GPU engine is
replicated. With ``sharding=None`` the defaults apply to the axes the mesh has (a mesh of one
``"ep"`` axis is expert parallel only); a mapping changes some of those; an axis a rule names must
exist.

The MoE layers run :func:`~wna16_jax.sharding.sharded_fused_moe` (a ``shard_map``: each device
runs its experts' shard on the executor the registry picks for it; where the GPU engine refuses a
shard, the XLA executor runs it, with the warning the layer gives). Everything else is left to
XLA's sharding propagation (GSPMD): the programs are ``jax.jit``-compiled with the sharded
parameters as inputs, and the KV cache is constrained to its sharding where
:meth:`MoEDecoder.init_cache <wna16_jax.models.MoEDecoder.init_cache>` makes it. Sums are taken in
another order than on one device (the psums over the mesh, row-parallel linears), so float32
logits agree to rounding (about 1e-6 of their scale), not bit for bit.

Several processes (``jax.distributed.initialize``, one mesh over every process's devices, the same
in each): :func:`put_global` builds each global array with ``jax.make_array_from_callback``, each
process supplying only its own devices' shards (in one process: ``jax.device_put``, as before).
Before any weight is read, :func:`check_processes` refuses a mesh of devices outside the run, one
without this process's devices, and one over some of the processes but not all;
:func:`check_same_in_every_process` compares a digest of the mesh and the rules across the
processes (:class:`ConfigError` where they differ).

What a process reads: the routed experts (and expert-TP slices) its devices hold
(:meth:`MeshPlan.local_experts`), and of each matrix a rule splits over an axis spanning the
processes only its slice (:meth:`MeshPlan.local_range`: the embedding rows, the 16-bit linears'
rows or columns, the checkpoint-form quantized linears' packed slices), marked for
:func:`place_model`, which builds the global arrays from them; everything else whole.

DeepSeek's latent cache is replicated (one latent per token, shared by every head: each head's
shard reads all of it). Not yet: a linear laid out for a GPU engine is read whole and replicated;
the quantized dense linears' dequantization and the GPU kernels (engine linears, decode
attention) are partitioned by XLA, not by hand; the sharded MoE layers have no gradient
(generation, not training); ``dequantized=True``, and expert TP on a folder ``wna16-jax
convert`` wrote, are refused.

:func:`local_mesh` makes a mesh of this process's first devices from a short spec (``tp2``,
``ep4xtp2``), as the command line's ``--mesh`` takes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from ..errors import ConfigError, ShapeError, UnsupportedError
from ..fields import show_value
from ..nn import SHARDING_KEY, QuantizedExperts, QuantizedMoE, convert_experts
from ..sharding import EP_METHODS, sharded_fused_moe, stack_tp_shards
from ..weights import at_layer
from .. import formats
from .linear import engine_for
from .config import DecoderConfig

#: the :class:`MeshRules` fields that name a mesh axis
AXIS_FIELDS = ("experts", "expert_intermediate", "heads", "mlp", "vocab")


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """Which mesh axis each kind of dimension is split over (see the module doc; None: not split).
    ``ep_method``: the expert-parallel design of :func:`~wna16_jax.sharding.sharded_fused_moe`
    (``"allgather"`` or ``"all_to_all"``)."""

    experts: str | None = "ep"
    expert_intermediate: str | None = "tp"
    heads: str | None = "tp"
    mlp: str | None = "tp"
    vocab: str | None = "tp"
    ep_method: str = "allgather"

    def __post_init__(self):
        for f in AXIS_FIELDS:
            v = getattr(self, f)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"sharding.{f}: expected a mesh axis name (str) or None, got {show_value(v)}")
        if not isinstance(self.ep_method, str) or self.ep_method not in EP_METHODS:
            raise ConfigError(f"sharding.ep_method: expected one of {EP_METHODS}, got {show_value(self.ep_method)}")
        if self.experts is not None and self.experts == self.expert_intermediate:
            raise ConfigError(f"sharding: experts and expert_intermediate must name different mesh axes, "
                              f"both are {self.experts!r}")

    def replace(self, **changes) -> "MeshRules":
        """The same rules with some fields changed (checked again)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"MeshRules.replace: {unknown} are not fields; expected some of "
                              f"{list(AXIS_FIELDS) + ['ep_method']}")
        return dataclasses.replace(self, **changes)


def _mesh_axes(mesh) -> dict[str, int]:
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ConfigError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__} {show_value(mesh)}")
    return {str(k): int(v) for k, v in mesh.shape.items()}


def resolve_rules(mesh, sharding: Any = None) -> MeshRules:
    """``sharding`` checked against the mesh's axes: None gives the defaults with the axes the mesh
    lacks set to None (a mesh with neither ``"ep"`` nor ``"tp"`` then needs explicit rules); a
    mapping of :class:`MeshRules` fields changes those of that; a :class:`MeshRules` is taken as it
    is. Every axis the result names must exist (a :class:`ConfigError` naming the field, the axis
    and the mesh's axes)."""
    axes = _mesh_axes(mesh)
    if sharding is None or isinstance(sharding, Mapping):
        rules = MeshRules()
        rules = rules.replace(**{f: None for f in AXIS_FIELDS if getattr(rules, f) not in axes})
        if sharding is None and all(getattr(rules, f) is None for f in AXIS_FIELDS):
            raise ConfigError(f"mesh: has axes {tuple(axes)}, none of which the default rules use ('ep', 'tp'); "
                              "name them in sharding=MeshRules(experts=..., heads=..., ...)")
        if sharding is None:
            return rules
        unknown = sorted(set(sharding) - set(AXIS_FIELDS) - {"ep_method"})
        if unknown:
            raise ConfigError(f"sharding: {unknown} are not MeshRules fields; expected some of "
                              f"{list(AXIS_FIELDS) + ['ep_method']}")
        sharding = rules.replace(**sharding)
    if not isinstance(sharding, MeshRules):
        raise ConfigError(f"sharding: expected None, a MeshRules or a mapping of its fields, got "
                          f"{type(sharding).__name__} {show_value(sharding)}")
    for f in AXIS_FIELDS:
        a = getattr(sharding, f)
        if a is not None and a not in axes:
            raise ConfigError(f"sharding.{f}: mesh axis {a!r} does not exist; the mesh's axes are {tuple(axes)}")
    return sharding


@dataclasses.dataclass(frozen=True)
class MoEPlacement:
    """How a :class:`~wna16_jax.nn.QuantizedMoE` runs its routed experts on a mesh: through
    :func:`~wna16_jax.sharding.sharded_fused_moe` with these axes (``tp_axis`` set: the layer's
    experts are a ``[tp, E, ...]`` stack). A static (hashable) attribute of the layer."""

    mesh: Mesh
    ep_axis: str | None
    tp_axis: str | None
    ep_method: str = "allgather"

    def __call__(self, x2d, topk_weights, topk_ids, experts, *, activation: str, formulation: str | None):
        """The routed experts' output ``[T, H]`` (a scanned decoder's bound layer read first)."""
        return sharded_fused_moe(x2d, topk_weights, topk_ids, at_layer(experts), self.mesh, ep_axis=self.ep_axis,
                                 tp_axis=self.tp_axis, ep_method=self.ep_method, activation=activation,
                                 formulation=formulation)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh and the rules checked against one decoder config (:func:`check_mesh`)."""

    mesh: Any
    rules: MeshRules
    latent_cache: bool = False

    def size(self, field: str) -> int:
        """The size of the mesh axis rule ``field`` names (1: not split)."""
        a = getattr(self.rules, field)
        return 1 if a is None else int(self.mesh.shape[a])

    def axis(self, field: str) -> str | None:
        """The mesh axis rule ``field`` names, where it splits anything (size above 1), else None."""
        return getattr(self.rules, field) if self.size(field) > 1 else None

    def moe_placement(self) -> MoEPlacement | None:
        ep, tp = self.axis("experts"), self.axis("expert_intermediate")
        if ep is None and tp is None:
            return None                       # replicated experts: the one-device layer, under jit
        return MoEPlacement(self.mesh, ep, tp, self.rules.ep_method)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def local_experts(self, num_experts: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """``(ranks, experts)``: the expert-TP ranks and the routed experts (increasing; None:
        all) whose shards this process's devices hold, all that its load reads of the experts.
        One process holding every device: every rank and None."""
        tp = self.size("expert_intermediate")
        s = self.sharding(_spec(self.axis("expert_intermediate"), self.axis("experts")))
        ranks, experts = set(), set()
        for r, e in s.addressable_devices_indices_map((tp, num_experts)).values():
            ranks.update(range(tp)[r])
            experts.update(range(num_experts)[e])
        return tuple(sorted(ranks)), (None if len(experts) == num_experts else tuple(sorted(experts)))

    def local_range(self, field: str, n: int) -> tuple[int, int] | None:
        """The rows ``[start, stop)`` of a dimension of size ``n`` split over ``field``'s axis
        that this process's devices hold (the hull of their shards), all that its load reads of
        a matrix split there; None where it holds all of them (one process, or a dimension the
        axis does not split: none, or one it does not divide, which stays replicated)."""
        name, size = self.axis(field), self.size(field)
        if name is None or size == 1 or n % size:
            return None
        held = [range(n)[i[0]] for i in self.sharding(P(name)).addressable_devices_indices_map((n,)).values()]
        lo, hi = min(r.start for r in held), max(r.stop for r in held)
        return None if (lo, hi) == (0, n) else (lo, hi)

    def cache_spec(self) -> P:
        """The KV cache pools' spec (``[L, rows, n, positions, d]``): the KV heads over ``heads``;
        DeepSeek's latent cache (``n = 1``) replicated."""
        return P() if self.latent_cache else _spec(None, None, self.axis("heads"))

    def constrain_cache(self, cache):
        """``cache`` with its pools constrained to :meth:`cache_spec` (inside or outside ``jit``)."""
        s = self.sharding(self.cache_spec())
        return dataclasses.replace(cache, k=jax.lax.with_sharding_constraint(cache.k, s),
                                   v=jax.lax.with_sharding_constraint(cache.v, s))


def _divides(plan: MeshPlan, field: str, dimension: str, value: int) -> None:
    n = plan.size(field)
    if value % n:
        raise ShapeError(f"mesh axis {getattr(plan.rules, field)!r} has size {n}, which does not divide "
                         f"{dimension} = {value} (sharding.{field})")


def _check_expert_slices(plan: MeshPlan, config: DecoderConfig, scheme) -> None:
    """Each TP rank's slice of the experts' intermediate size holds whole packed words and groups."""
    tp, i = plan.size("expert_intermediate"), config.moe.moe_intermediate_size
    if tp == 1 or scheme is None:
        return
    loc, rules = i // tp, [(scheme.pack_factor, "pack factor")]
    if scheme.group_size not in (-1, None):
        rules.append((scheme.group_size, "group size"))
    for unit, what in rules:
        if loc % unit:
            raise ShapeError(f"mesh axis {plan.rules.expert_intermediate!r} has size {tp}: "
                             f"{config.moe.intermediate_size_field} = {i} splits into slices of {loc}, "
                             f"not a multiple of the {what} {unit} (sharding.expert_intermediate)")


_MESH_SPEC = re.compile(r"^(?:ep(?P<ep>\d{1,6})(?:xtp(?P<tp>\d{1,6}))?|tp(?P<tp_only>\d{1,6}))$")


def parse_mesh_spec(text: Any, name: str = "mesh") -> tuple[int, int]:
    """``(ep, tp)`` of a mesh spec: ``epN``, ``tpN`` or ``epNxtpM`` (sizes of at least 1), or a
    :class:`ConfigError` naming ``name``, the expected form and the value."""
    m = _MESH_SPEC.match(text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"{name}: expected epN, tpN or epNxtpM (e.g. tp2, ep4xtp2), got {show_value(text)}")
    ep, tp = int(m["ep"] or 1), int(m["tp"] or m["tp_only"] or 1)
    if ep < 1 or tp < 1:
        raise ConfigError(f"{name}: axis sizes must be at least 1, got {show_value(text)}")
    return ep, tp


def local_mesh(text: Any, devices=None, name: str = "mesh") -> Mesh:
    """The mesh of spec ``text`` (:func:`parse_mesh_spec`) over the first ``ep x tp`` of
    ``devices`` (default this process's, ``jax.local_devices()``): axes ``"ep"`` then ``"tp"``,
    the ones of size 1 left out (a mesh of one device has one ``"ep"`` axis of size 1)."""
    ep, tp = parse_mesh_spec(text, name)
    devices = list(jax.local_devices() if devices is None else devices)
    if ep * tp > len(devices):
        raise ConfigError(f"{name}: {text} needs {ep * tp} devices, this process has {len(devices)} "
                          f"({devices[0].platform if devices else 'none'})")
    axes = [(a, n) for a, n in (("ep", ep), ("tp", tp)) if n > 1] or [("ep", 1)]
    return Mesh(np.array(devices[:ep * tp]).reshape([n for _, n in axes]), tuple(a for a, _ in axes))


def check_mesh(config: DecoderConfig, mesh, sharding: Any = None, *, scheme=None) -> MeshPlan:
    """The :class:`MeshPlan` of ``config`` on ``mesh`` (a ``Mesh`` or an ``AbstractMesh``) under
    ``sharding`` (:func:`resolve_rules`), or a typed error naming the mesh axis, its size and the
    dimension it does not divide: the experts count, the attention heads and KV heads, the dense
    MLPs' intermediate size, the vocabulary; with ``scheme`` (the experts' quantization), each TP
    slice of the experts' intermediate size must also hold whole packed words and groups. Reads no
    weight."""
    if not isinstance(config, DecoderConfig):
        raise ConfigError(f"config: expected a DecoderConfig, got {type(config).__name__}")
    rules = resolve_rules(mesh, sharding)
    plan = MeshPlan(mesh, rules, latent_cache=config.mla is not None)
    moe = config.moe
    if moe is not None:
        _divides(plan, "experts", moe.num_experts_field, moe.num_experts)
        _divides(plan, "expert_intermediate", moe.intermediate_size_field, moe.moe_intermediate_size)
        _check_expert_slices(plan, config, scheme)
    _divides(plan, "heads", "num_attention_heads", config.num_heads)
    if config.mla is None:
        _divides(plan, "heads", "num_key_value_heads", config.num_kv_heads)
    if config.intermediate_size is not None and not all(config.sparse_layers):
        _divides(plan, "mlp", "intermediate_size", config.intermediate_size)
    _divides(plan, "vocab", "vocab_size", config.vocab_size)
    return plan


def check_processes(mesh: Mesh) -> None:
    """``mesh``'s devices against the processes of this run (``jax.distributed.initialize``): each
    one of this backend's devices (``jax.devices()``), this process holding some of them, and a
    mesh that spans other processes spanning every one (each process of the run loads and runs
    the same model; a mesh of this process's devices alone is a model of this process alone).
    A :class:`ConfigError` naming the devices or processes otherwise; reads no weight."""
    devices = list(mesh.devices.flat)
    platforms = sorted({d.platform for d in devices})
    if len(platforms) > 1:
        raise ConfigError(f"mesh: mixes devices of several platforms {platforms}; expected one")
    try:
        known = set(jax.devices(platforms[0]))
    except RuntimeError as e:
        raise ConfigError(f"mesh: its devices are {platforms[0]} devices, which this process has no backend "
                          f"for ({e})") from None
    unknown = [d for d in devices if d not in known]
    if unknown:
        raise ConfigError(f"mesh: devices {[str(d) for d in unknown[:4]]} are not among this run's "
                          f"{len(known)} {platforms[0]} devices (jax.devices())")
    here, count = jax.process_index(), jax.process_count(platforms[0])
    held = sorted({d.process_index for d in devices})
    if here not in held:
        raise ConfigError(f"mesh: holds no device of this process (process {here} of {count}), only of "
                          f"process{'es' if len(held) > 1 else ''} {held}; every process of the run must place "
                          "part of the model (build the mesh from jax.devices(), the same in every process)")
    if held != [here] and held != list(range(count)):
        missing = sorted(set(range(count)) - set(held))
        raise ConfigError(f"mesh: spans processes {held}, but jax.process_count() is {count}: processes {missing} "
                          "hold no device of it; a mesh over several processes must span all of them "
                          "(build it from jax.devices(), the same in every process)")


def check_same_in_every_process(plan: MeshPlan) -> None:
    """Where ``plan.mesh`` spans several processes, each of them must have been given the same
    mesh (devices in the same order, the same axes) and the same rules, or their programs would
    not match: a digest of both is compared across the processes (one small collective, which
    every process reaches at the same point of its load; a :class:`ConfigError` in all of them
    when they differ). Reads no weight."""
    mesh = plan.mesh
    if len({d.process_index for d in mesh.devices.flat}) < 2:
        return
    from jax.experimental import multihost_utils

    what = repr(([d.id for d in mesh.devices.flat], dict(mesh.shape), plan.rules))
    digest = np.frombuffer(hashlib.sha256(what.encode()).digest()[:16], np.int32)   # 32-bit: no x64 needed
    try:
        multihost_utils.assert_equal(digest)
    except AssertionError:
        raise ConfigError(f"mesh: process {jax.process_index()} of {jax.process_count()} was given a mesh "
                          f"({dict(mesh.shape)}, devices {[d.id for d in mesh.devices.flat][:8]}...) or sharding "
                          "rules other than another process's; every process must pass the same mesh "
                          "(its devices in the same order) and the same sharding=") from None


def plan_for_load(config: DecoderConfig, ckpt, mesh, sharding: Any, opts) -> MeshPlan:
    """:func:`check_mesh` for :func:`~wna16_jax.models.load_model` (the experts' scheme from the
    checkpoint's headers), and what the load cannot place yet refused; reads no weight."""
    from ..serialize import ConvertedCheckpoint

    if mesh is None:
        raise ConfigError(f"sharding: given ({show_value(sharding)}) without a mesh; pass mesh=")
    plan = check_mesh(config, mesh, sharding, scheme=getattr(ckpt, "scheme", None))
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"mesh: expected a jax.sharding.Mesh of devices to place the model on, got "
                          f"{type(mesh).__name__}")
    check_processes(mesh)
    check_same_in_every_process(plan)
    if opts.dequantized:
        raise UnsupportedError("dequantized: a dequantized model is not placed on a mesh (mesh= with "
                               "dequantized=True); load it on one device")
    if plan.size("expert_intermediate") > 1 and isinstance(ckpt, ConvertedCheckpoint):
        raise UnsupportedError(f"sharding.expert_intermediate: {ckpt.path!r} holds experts converted to "
                               f"{ckpt.backend.value}, which cannot be sliced for tensor parallelism; set "
                               "expert_intermediate=None (expert parallel only) or load the source checkpoint")
    return plan


# --------------------------------------------------------------------------- the MoE layers


def _tp_variables(stack):
    """A ``[tp, E, ...]`` experts stack as :class:`QuantizedExperts` (logical axes
    ``("tp_ranks", "experts", None, ...)``)."""
    def wrap(a):
        return QuantizedExperts(a, **{SHARDING_KEY: ("tp_ranks", "experts") + (None,) * (a.ndim - 2)},
                                eager_sharding=False)

    return jax.tree.map(wrap, stack)


def place_moe(mlp: QuantizedMoE, plan: MeshPlan, tp_shards=None) -> QuantizedMoE:
    """``mlp`` set to run its routed experts on the mesh (:class:`MoEPlacement`); with expert TP,
    its experts replaced by ``tp_shards()``, the ``[tp, E, ...]`` stack of its per-rank layouts."""
    placement = plan.moe_placement()
    if placement is None:
        return mlp
    if placement.tp_axis is not None:
        if tp_shards is None:
            raise UnsupportedError("expert tensor parallelism needs the experts sliced before they are converted; "
                                   "load the model with load_model(DIR, mesh=...)")
        mlp.experts = nnx.data(_tp_variables(tp_shards()))
    mlp.mesh_placement = placement
    return mlp


def mesh_loader(base, plan: MeshPlan):
    """A loader (a subclass of ``base``, :class:`wna16_jax.models.decoder._Loader`) whose MoE layers
    are placed by :func:`place_moe`, each process reading only the routed experts (and expert-TP
    ranks) its devices hold (:meth:`MeshPlan.local_experts`): with expert TP, each such rank's
    slice is read (``Checkpoint.load_layer(i, tp_size=, tp_rank=)``) and converted on its own,
    all in the layout the first one's took, then stacked."""

    class MeshLoader(base):
        def embeddings(self):
            self.embed_rows = plan.local_range("vocab", self.c.vocab_size)
            return super().embeddings(self.embed_rows)

        def place(self, model):
            """:func:`place_model` of the decoder this loader built (its embedding matrix marked
            where only its rows were read)."""
            if getattr(self, "embed_rows", None) is not None:
                model.embed_tokens.set_metadata(**{PARTIAL_KEY: ("vocab", 0, self.c.vocab_size, self.embed_rows)})
            return place_model(model, plan)

        def linear(self, module: str, n: int, k: int, bias: bool = False, part=None):
            """A linear that a rule splits over an axis spanning the processes: only this
            process's slice of it is read (a 16-bit one's rows or columns; a quantized one's
            packed slice, :meth:`quantized_slice`), marked for :func:`place_model`; otherwise
            (no such axis, or a quantized one an engine lays out) the whole linear."""
            rule = _module_rule(module) if part is None and not self.o.dequantized else None
            r = None if rule is None else plan.local_range(rule[0], n if rule[1] == "n" else k)
            if r is None:
                return super().linear(module, n, k, bias, part)
            field, side = rule
            scheme = self.scheme(module, bias)
            if scheme is not None:
                return self.quantized_slice(module, n, k, scheme, field, side, r) or super().linear(module, n, k, bias)
            axis = 0 if side == "n" else 1
            lin = super().linear(module, n, k, bias, (axis, r))
            lin.out_features, lin.in_features = n, k              # the global matrix's, as placed
            lin.weight.set_metadata(**{PARTIAL_KEY: (field, axis, n if axis == 0 else k, r)})
            if lin.bias is not None and axis == 0:
                lin.bias.set_metadata(**{PARTIAL_KEY: (field, 0, n, r)})
            return lin

        def quantized_slice(self, module: str, n: int, k: int, scheme, field: str, side: str, r):
            """The quantized linear ``module`` with only its slice ``r`` of N (``side`` "n") or K
            read, in the checkpoint's form, marked for :func:`place_model`; None where it would
            not stay in that form (an engine lays it out: placed whole, replicated) or where a
            slice of it is not the shards the rules give its arrays (read whole instead)."""
            from ..weights import CheckpointForm

            if engine_for(CheckpointForm(n, k, scheme), self.o.dtype)[0] is not None:
                return None
            size, tp = (n if side == "n" else k), plan.size(field)
            pieces = size // (r[1] - r[0])
            try:
                lin = self.quantized([module], [n], k, scheme, tp=(pieces, r[0] // (r[1] - r[0])), tp_axis=side,
                                     engine=False)
            except ShapeError:                  # a slice would cut packed words or groups: read whole
                return None
            found = self.tensors(module)
            m, fields = lin.weight.get_value(), []
            for f, role in (("qvalue", "qweight"), ("scale", "scales"), ("zero_point", "qzeros"), ("g_idx", "g_idx")):
                a = getattr(m, f)
                suffix = formats.SUFFIXES[scheme.method].get(role)
                if a is None:
                    continue
                whole = (1,) + tuple(self.ckpt.tensor_info(found[suffix]).shape)
                if tuple(a.shape) == whole:
                    continue
                ax = _matrix_axis(scheme.method, f, side)
                differ = [i for i, (x, y) in enumerate(zip(a.shape, whole)) if x != y]
                if differ != [ax] or whole[ax] != a.shape[ax] * pieces or whole[ax] % tp:
                    return None                 # not the shards the rules give this array
                lo = a.shape[ax] * (r[0] // (r[1] - r[0]))
                fields.append((f, ax, whole[ax], (lo, lo + a.shape[ax])))
            lin.weight.set_metadata(**{PARTIAL_KEY: ("matrix", field, CheckpointForm(n, k, scheme), tuple(fields))})
            if lin.bias is not None and side == "n":
                lin.bias.set_metadata(**{PARTIAL_KEY: (field, 0, n, r)})
            lin.out_features, lin.in_features, lin.splits = n, k, (n,)
            return lin

        def moe(self, i: int) -> QuantizedMoE:
            ranks, experts = plan.local_experts(self.c.moe.num_experts)
            tp = plan.size("expert_intermediate")
            if tp == 1:
                return place_moe(super().moe(i, experts=experts), plan)
            mlp = super().moe(i, experts=experts, tp_size=tp, tp_rank=ranks[0])
            return place_moe(mlp, plan, lambda: self.tp_experts(i, mlp, ranks, experts))

        def tp_experts(self, i: int, mlp: QuantizedMoE, ranks, experts):
            tp = plan.size("expert_intermediate")
            return stack_tp_shards([mlp.expert_weights()] + [
                convert_experts(self.ckpt.load_routed_experts(i, tp_size=tp, tp_rank=r, experts=experts), mlp.backend,
                    activation=mlp.routing.activation, activation_dtype=self.o.dtype)[0]
                for r in ranks[1:]], ranks)

    return MeshLoader


# --------------------------------------------------------------------------- the state

#: linear weights split over a rule's axis: (path pattern inside a decoder layer or at the top,
#: rule field, "n" = the output rows are split (column parallel) | "k" = the input columns are)
LINEAR_RULES = (
    (r"self_attn/(q_proj|k_proj|v_proj|q_b_proj)/(weight|bias)", "heads", "n"),
    (r"self_attn/kv_b_proj/(w_uk|w_uv)", "heads", "n"),
    (r"self_attn/o_proj/weight", "heads", "k"),
    (r"mlp/(gate_proj|up_proj)/(weight|bias)", "mlp", "n"),
    (r"mlp/down_proj/weight", "mlp", "k"),
    (r"embed_tokens", "vocab", "n"),
    (r"lm_head/(weight|bias)", "vocab", "n"),
)


def _matrix_axis(method, field: str, side: str) -> int | None:
    """The axis of a checkpoint-form one-expert :class:`~wna16_jax.weights.QuantMatrix` field
    ``[1, ...]`` that spans N (``side`` "n") or K ("k"): AWQ and GPTQ store ``[K-ish, N-ish]``,
    compressed-tensors ``[N-ish, K-ish]``; ``g_idx [1, K]`` has no N axis."""
    from ..schemes import QuantMethod

    if field == "g_idx":
        return 1 if side == "k" else None
    if field not in ("qvalue", "scale", "zero_point"):
        return None
    k_first = method in (QuantMethod.AWQ, QuantMethod.GPTQ)
    return (2 if side == "n" else 1) if k_first else (1 if side == "n" else 2)


def _spec(*axes) -> P:
    """``P(*axes)`` without trailing Nones (``P()``: replicated)."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


def _split_spec(a, lead: tuple, axis: int | None, name: str | None) -> P:
    """``P`` splitting ``a``'s ``axis`` (after ``lead``) over mesh axis ``name``."""
    if axis is None or name is None:
        return P()
    return _spec(*lead, *([None] * axis), name)


def _linear_specs(plan: MeshPlan, value, lead: tuple, field: str, side: str):
    """The specs of a linear's weight or bias value (an array, or a checkpoint-form QuantMatrix,
    each of whose packed arrays is split on its N or K axis where the mesh axis size divides it;
    another layout, such as an engine's, is replicated)."""
    from ..weights import CheckpointForm, QuantMatrix

    name, n = plan.axis(field), plan.size(field)

    def fits(a, axis):
        return axis is not None and a.ndim > len(lead) + axis and a.shape[len(lead) + axis] % n == 0

    if isinstance(value, QuantMatrix):
        if not isinstance(value.form, CheckpointForm):
            return jax.tree.map(lambda _: P(), value)
        method = value.form.scheme.method
        out = {}
        for f in QuantMatrix.EXPERT_FIELDS + ("global_scale",):
            a = getattr(value, f)
            if a is not None:
                axis = _matrix_axis(method, f, side)
                out[f] = _split_spec(a, lead, axis, name) if fits(a, axis) else P()
        return dataclasses.replace(value, **out)
    axis = 0 if side == "n" else 1
    return _split_spec(value, lead, axis, name) if fits(value, axis) else P()


def _leaf_where(path: tuple) -> tuple[str, tuple]:
    """``(path inside a decoder layer or at the top, lead)``: ``lead`` ``(None,)`` for a scanned
    decoder's stacked leaves (their leading layer axis), else ``()``."""
    keys = [str(k) for k in path]
    lead: tuple = ()
    if keys and keys[0] == "stacked_layers":
        keys, lead = keys[1:], (None,)
    elif keys and keys[0] == "layers":
        keys = keys[2:]
    return "/".join(keys), lead


def routed_expert_axes(path: tuple, variable) -> tuple[int, int | None] | None:
    """``(experts axis, TP rank axis or None)`` of the arrays of a routed-experts state leaf
    (``[..., tp, E, ...]`` for an expert-TP stack); None for any other leaf."""
    where, lead = _leaf_where(path)
    if not (isinstance(variable, QuantizedExperts) and where.startswith("mlp/experts/")):
        return None
    ax = tuple(variable.get_metadata().get(SHARDING_KEY) or ())
    if ax[len(lead):len(lead) + 1] == ("tp_ranks",):
        return len(lead) + 1, len(lead)
    return len(lead), None


def leaf_specs(plan: MeshPlan, path: tuple, variable):
    """The ``PartitionSpec`` of every array of the state leaf at ``path`` (``nnx`` state keys),
    as a pytree like its value: a scanned decoder's stacked leaves keep their leading layer axis
    unsplit; routed experts over ``experts`` (and a TP stack's rank axis over
    ``expert_intermediate``); linears as :data:`LINEAR_RULES` say; the rest replicated."""
    where, lead = _leaf_where(path)
    value = variable.get_value()
    if isinstance(variable, QuantizedExperts):
        spec = P()                                               # shared experts: replicated
        axes = routed_expert_axes(path, variable)
        if axes is not None:
            tp_stack = axes[1] is not None
            spec = _spec(*lead, *((plan.axis("expert_intermediate"),) if tp_stack else ()), plan.axis("experts"))
        return jax.tree.map(lambda _: spec, value)
    for pattern, field, side in LINEAR_RULES:
        if re.fullmatch(pattern, where):
            return _linear_specs(plan, value, lead, field, side)
    return jax.tree.map(lambda _: P(), value)


def _from_host(a, sharding: NamedSharding) -> jax.Array:
    """The global array of ``a`` (this process's copy of the whole value) laid out as
    ``sharding``: this process supplies only the shards its own devices hold, with no exchange
    between processes."""
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put_global(value, shardings):
    """``value`` (a pytree of arrays) on the mesh as ``shardings`` (a tree prefix of it) say. Where
    every device of a sharding is this process's, ``jax.device_put`` (bit for bit the one-process
    placement); else each global array is built by ``jax.make_array_from_callback`` from this
    process's copy: ``device_put`` would also accept that copy, but first checks that every
    process holds the same value by gathering it from all of them (a collective per array)."""
    def put(sharding, sub):
        if sharding.is_fully_addressable:
            return jax.device_put(sub, sharding)
        return jax.tree.map(lambda a: _from_host(a, sharding), sub)

    return jax.tree.map(put, shardings, value, is_leaf=lambda x: isinstance(x, NamedSharding))


def _from_rows(a, sharding: NamedSharding, rows: dict[int, tuple[int, np.ndarray]]) -> jax.Array:
    """The global array of ``a``, this process's rows of it: ``rows`` maps an axis to ``(global
    size, position in a of each global index or -1)``; each shard of this process's devices is
    cut from ``a`` (a shard outside what the process read is an internal error)."""
    host = np.asarray(a)
    shape = list(host.shape)
    for ax, (n, _) in rows.items():
        shape[ax] = n

    def shard(index):
        out, rest = host, list(index)
        for ax, (n, pos) in rows.items():
            want = pos[np.arange(n)[index[ax]]]
            if (want < 0).any():
                raise ShapeError(f"mesh placement: a shard of this process's devices needs rows "
                                 f"{np.arange(n)[index[ax]][want < 0].tolist()} of axis {ax}, which its load "
                                 "did not read (an internal error: please report it)")
            out, rest[ax] = np.take(out, want, axis=ax), slice(None)
        return out[tuple(rest)]

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def _put_rows(value, shardings, axes: tuple[int, int | None], ranks, experts, tp: int, num_experts: int):
    """A routed-experts leaf holding only this process's ``experts`` (and TP ``ranks``) put on
    the mesh as the global arrays of every expert (:func:`_from_rows`)."""
    def positions(held, n):
        pos = np.full(n, -1)
        pos[list(held)] = np.arange(len(held))
        return pos

    rows = {axes[0]: (num_experts, positions(experts or range(num_experts), num_experts))}
    if axes[1] is not None:
        rows[axes[1]] = (tp, positions(ranks, tp))
    return jax.tree.map(lambda sh, a: _from_rows(a, sh, rows), shardings, value,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


#: the metadata key of an array read in part: ``(rule field, axis, global size, (start, stop))``
#: of a 16-bit array, ``("matrix", rule field, global form, ((array field, axis, global size,
#: (start, stop)), ...))`` of a checkpoint-form quantized matrix; the mesh loader sets it,
#: :func:`place_model` builds the global array and drops it
PARTIAL_KEY = "wna16_partial"


def _module_rule(module: str) -> tuple[str, str] | None:
    """``(rule field, side)`` of :data:`LINEAR_RULES` for the weight of checkpoint module
    ``module`` (``model.layers.3.self_attn.o_proj``, ``lm_head``), None where no rule splits it."""
    where = re.sub(r"^model\.layers\.\d+\.", "", module).replace(".", "/") + "/weight"
    return next(((field, side) for pattern, field, side in LINEAR_RULES if re.fullmatch(pattern, where)), None)


def _from_slice(plan: MeshPlan, a, lead: tuple, field: str, axis: int, n: int, rows: tuple[int, int]) -> jax.Array:
    """The global array of which ``a`` holds the slice ``rows = [start, stop)`` of ``axis`` (of
    ``n``; after ``lead``), split there over ``field``'s mesh axis (:func:`_from_rows`)."""
    pos = np.full(n, -1)
    pos[rows[0]:rows[1]] = np.arange(rows[1] - rows[0])
    spec = _spec(*lead, *([None] * axis), plan.axis(field))
    return _from_rows(a, plan.sharding(spec), {len(lead) + axis: (n, pos)})


def _put_matrix_slice(plan: MeshPlan, m, shardings, lead: tuple, field: str, form, fields):
    """A checkpoint-form matrix read as a slice (``fields``: ``(array field, axis, global size,
    (start, stop))`` of each array cut) put on the mesh as the global matrix of ``form``: each cut
    array split over ``field``'s axis there, built from this process's slice; the rest as
    ``shardings`` say (their values are whole)."""
    out = {f: _from_slice(plan, getattr(m, f), lead, field, ax, n, rows) for f, ax, n, rows in fields}
    cut = {f for f, *_ in fields}
    for f in type(m).EXPERT_FIELDS + ("global_scale",):
        if f not in cut and getattr(m, f, None) is not None:
            out[f] = put_global(getattr(m, f), getattr(shardings, f))
    return dataclasses.replace(m, form=form, **out)


def place_model(model, plan: MeshPlan):
    """Put every array of ``model`` (a :class:`~wna16_jax.models.MoEDecoder` whose MoE layers
    :func:`place_moe` set) on ``plan.mesh`` as :func:`leaf_specs` says, and record the plan
    (``model.mesh_plan``: :meth:`~wna16_jax.models.MoEDecoder.init_cache` shards the cache by it).
    Leaves read in part by the mesh loader (their :data:`PARTIAL_KEY` metadata) hold only that
    slice of their global array, which is built from it. Returns the model."""
    if not isinstance(plan.mesh, Mesh):
        raise ConfigError(f"mesh: expected a jax.sharding.Mesh of devices to place the model on, got "
                          f"{type(plan.mesh).__name__}")
    moe = model.config.moe
    ranks, experts = plan.local_experts(moe.num_experts) if moe is not None else ((0,), None)
    tp = plan.size("expert_intermediate")
    partial = experts is not None or len(ranks) < tp          # this process read some of the experts
    state = nnx.state(model)
    for path, v in nnx.to_flat_state(state):
        shardings = jax.tree.map(plan.sharding, leaf_specs(plan, path, v), is_leaf=lambda x: isinstance(x, P))
        axes = routed_expert_axes(path, v) if partial else None
        part = v.get_metadata().get(PARTIAL_KEY)
        if part is not None:                  # read in part: a quantized matrix's slice, or one array's
            lead = _leaf_where(path)[1]
            v.set_value(_put_matrix_slice(plan, v.get_value(), shardings, lead, *part[1:]) if part[0] == "matrix"
                        else _from_slice(plan, v.get_value(), lead, *part))
            v.del_metadata(PARTIAL_KEY)
        elif axes is None:
            v.set_value(put_global(v.get_value(), shardings))
        else:
            v.set_value(_put_rows(v.get_value(), shardings, axes, ranks, experts, tp, moe.num_experts))
    nnx.update(model, state)
    model.mesh_plan = plan
    return model


def describe(model) -> dict[str, str]:
    """``{state path: PartitionSpec}`` of every array leaf of ``model`` as it lies now (for
    inspection)."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model)):
        for sub, a in jax.tree_util.tree_flatten_with_path(v.get_value())[0]:
            sh = getattr(a, "sharding", None)
            out["/".join(map(str, path)) + jax.tree_util.keystr(sub)] = str(getattr(sh, "spec", None))
    return out


__all__ = ["local_mesh", "parse_mesh_spec", "MeshRules", "MeshPlan", "MoEPlacement", "check_mesh", "check_processes", "check_same_in_every_process",
           "put_global", "resolve_rules", "place_model", "place_moe", "leaf_specs", "describe", "AXIS_FIELDS", "LINEAR_RULES"]
