"""Expert- and tensor-parallel fused MoE with ``jax.sharding.Mesh`` + ``jax.shard_map``.

Weights are any experts pytree (loader, backend or engine layout: every leaf has the expert
axis first). Tensor parallelism adds a leading ``tp`` axis: :func:`stack_tp_shards` stacks one
layout pytree per TP rank (from ``Checkpoint.load_layer(i, tp_size=, tp_rank=)`` or
:func:`slice_tp`, each rank converted on its own), so the same code shards every layout.

Inside the ``shard_map`` each device calls :func:`~wna16_jax.moe.fused_moe` on its own shard
with the executor the registry picks for that shard (:func:`sharded_executor`; the same on
every device). On an NVIDIA GPU an engine layout (``WgmmaWeights``, ``TileWeights``) runs the
engine per device on 16-bit activations, their dtype kept: each device aligns the rows routed to
its local experts into blocks and gathers them itself. A layer the engine refuses runs the XLA
executor per device in float32, with one ``EngineFallbackWarning`` naming the reasons (as
:func:`fused_moe` does on one device).

* **EP, all-gather design** (``ep_method="allgather"``): tokens are sharded over the EP
  axis; each shard all-gathers the tokens and their routing, runs :func:`fused_moe` on its
  ``E / ep`` local experts (the others masked out by an ``expert_map``), and a
  ``psum_scatter`` (reduce-scatter) returns every token's sum to its owner.
* **EP, all-to-all design** (``ep_method="all_to_all"``): each shard sorts its (token, slot)
  rows by owning shard and sends exactly those rows there with ``jax.lax.ragged_all_to_all``
  (dispatch), the owners run their experts on the received rows (top-1 each; the unused
  receive capacity is routed to a masked expert ``E / ep``), and a second ``ragged_all_to_all``
  sends the results back (combine), where each token's ``k`` rows are summed in float32.
  XLA:CPU does not implement the ``ragged-all-to-all`` HLO (jax 0.10.2: ``UNIMPLEMENTED: HLO
  opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter``), so ``ragged="auto"``
  uses an exact emulation on CPU: the same offsets / sizes protocol carried by a fixed-capacity
  ``lax.all_to_all``.
* **TP**: the intermediate dimension is split (an engine layout pads and permutes each rank's
  slice on its own); each shard computes a partial down-projection and a ``psum`` over the TP
  axis adds them. The w2 bias is kept on TP rank 0 only (zeroed on the other ranks by
  :func:`stack_tp_shards`), so it is added once.
* **EP × TP** on a 2-D mesh: both at once (weights ``[tp, E, ...]`` sharded ``P(tp, ep)``).

The reductions carry the executor's output dtype: float32 on the XLA executor, the activations'
16-bit dtype on an engine (each device's partial output is rounded to it once before it is
reduced, as vLLM's all-reduce does).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import executors
from .device import Device
from .errors import ConfigError, DTypeError, ShapeError, UnsupportedError
from .fields import check_int
from .moe import FLOAT_DTYPES, FORMULATIONS, check_activation, fused_moe, validate_moe_inputs, warn_fallback
from .schemes import QuantMethod
from .weights import CheckpointWeights, LayerStack

EP_METHODS = ("allgather", "all_to_all")
#: ``ragged=``: how the all-to-all design exchanges rows (see the module docstring)
RAGGED_IMPLS = ("auto", "native", "emulated")


# --------------------------------------------------------------------------- TP weights


def _tp_fields(method: QuantMethod) -> dict[str, tuple[int, str]]:
    """field → (axis, "n" = split gate and up halves | "k" = split the whole axis)."""
    if method is QuantMethod.AWQ or method is QuantMethod.GPTQ:
        return {"w13_qweight": (2, "n"), "w13_scales": (2, "n"), "w13_qzeros": (2, "n"),
                "w2_qweight": (1, "k"), "w2_scales": (1, "k"), "w2_qzeros": (1, "k"), "w13_bias": (1, "n")}
    return {"w13_qweight": (1, "n"), "w13_scales": (1, "n"), "w13_qzeros": (1, "n"),
            "w2_qweight": (2, "k"), "w2_scales": (2, "k"), "w2_qzeros": (2, "k"), "w13_bias": (1, "n")}


def slice_tp(weights: CheckpointWeights, tp_size: int, tp_rank: int) -> CheckpointWeights:
    """Rank ``tp_rank``'s intermediate-dimension slice of a loader-layout layer in memory (the
    same slice ``Checkpoint.load_layer(i, tp_size=, tp_rank=)`` reads; act-order layers must be
    loaded that way). The w2 bias is returned whole; :func:`stack_tp_shards` keeps it once."""
    if not isinstance(weights, CheckpointWeights):
        raise UnsupportedError(f"slice_tp: weights: expected loader-layout CheckpointWeights, got "
                               f"{type(weights).__name__}; slice before converting to a backend layout")
    weights.validate()
    s, i = weights.scheme, weights.intermediate_size
    tp_size = check_int("tp_size", tp_size, low=1)
    tp_rank = check_int("tp_rank", tp_rank, low=0, high=tp_size - 1)
    if s.act_order:
        raise UnsupportedError("slice_tp: act-order (g_idx) layers keep whole w2 scales; load them with "
                               "Checkpoint.load_layer(i, tp_size=..., tp_rank=...)")
    check_tp(i, tp_size, s.pack_factor, s.group_size)
    if tp_size == 1:
        return weights
    out = {}
    for name, (axis, kind) in _tp_fields(s.method).items():
        a = getattr(weights, name)
        if a is None:
            continue
        xp = jnp if isinstance(a, jax.Array) else np
        if s.group_size == -1 and name in ("w2_scales", "w2_qzeros"):
            out[name] = a                               # channelwise: one group, not split
            continue
        size = a.shape[axis]
        if kind == "n":
            half = size // 2
            loc = half // tp_size
            idx = np.concatenate([np.arange(tp_rank * loc, (tp_rank + 1) * loc),
                                  half + np.arange(tp_rank * loc, (tp_rank + 1) * loc)])
        else:
            loc = size // tp_size
            idx = np.arange(tp_rank * loc, (tp_rank + 1) * loc)
        out[name] = xp.take(a, idx, axis=axis)
    return weights.replace(**out, intermediate_size=i // tp_size)


def check_tp(intermediate_size: int, tp_size: int, pack_factor: int = 1, group_size: int = -1) -> None:
    """Typed errors unless ``tp_size`` splits the intermediate size into whole words / groups
    (``group_size`` -1: channelwise, one group)."""
    intermediate_size = check_int("intermediate_size", intermediate_size, low=1)
    tp_size = check_int("tp_size", tp_size, low=1)
    pack_factor = check_int("pack_factor", pack_factor, low=1)
    group_size = check_int("group_size", group_size, low=-1)
    if group_size == 0:
        raise ConfigError("group_size must be -1 (channelwise) or a positive integer, got 0")
    if intermediate_size % tp_size:
        raise ShapeError(f"tp_size: the intermediate size {intermediate_size} is not a multiple of the TP "
                         f"size {tp_size}")
    loc = intermediate_size // tp_size
    if loc % pack_factor or (group_size != -1 and loc % group_size):
        raise ShapeError(f"tp_size: the local intermediate size {loc} (= {intermediate_size} / {tp_size}) "
                         f"must be a multiple of the pack factor {pack_factor}"
                         + (f" and the group size {group_size}" if group_size != -1 else ""))


def _without_w2_bias(w):
    """``w`` with its w2 bias leaf zeroed, whatever the layout (a zero bias stays zero under the
    permutation or padding a layout applies to its bias)."""
    b2 = getattr(w, "w2_bias", None)
    if b2 is None:
        return w
    leaves, treedef = jax.tree.flatten(w)
    hits = [j for j, a in enumerate(leaves) if a is b2]
    if len(hits) != 1:
        raise UnsupportedError(f"stack_tp_shards: {type(w).__name__}.w2_bias is not one array leaf of the "
                               f"layout ({len(hits)} leaves are it), so it cannot be kept on TP rank 0 only")
    leaves[hits[0]] = jnp.zeros_like(jnp.asarray(b2))
    return jax.tree.unflatten(treedef, leaves)


def stack_tp_shards(shards: Sequence[Any], ranks: Sequence[int] | None = None):
    """Stack one experts pytree per TP rank (any layout, each rank converted on its own) along a
    new leading axis (``[tp, E, ...]``). The w2 bias is zeroed on ranks > 0 so the psum over TP
    adds it exactly once. Every shard must have shard 0's structure, shapes and dtypes.
    ``ranks``: the TP rank of each shard (default ``0, 1, ...``), where a process stacks only
    the ranks its devices hold."""
    if isinstance(shards, (str, bytes, Mapping)) or not isinstance(shards, Iterable):
        raise ConfigError(f"stack_tp_shards: shards: expected a sequence of experts pytrees (one per TP rank), "
                          f"got {type(shards).__name__}")
    shards = list(shards)
    if not shards:
        raise ConfigError("stack_tp_shards: no shards given")
    for r, w in enumerate(shards):
        leaves = jax.tree.leaves(w)
        if not leaves or not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in leaves):
            raise ConfigError(f"stack_tp_shards: shard {r}: expected an experts pytree of arrays, "
                              f"got {type(w).__name__}")
    s0 = jax.tree.structure(shards[0])
    first = jax.tree_util.tree_flatten_with_path(shards[0])[0]
    for r, w in enumerate(shards[1:], 1):
        if jax.tree.structure(w) != s0:
            raise ShapeError(f"stack_tp_shards: shard {r} differs in structure from shard 0 "
                             f"({type(w).__name__} vs {type(shards[0]).__name__}, or their static metadata)")
        for (path, b), a in zip(first, jax.tree.leaves(w)):
            if tuple(a.shape) != tuple(b.shape):
                raise ShapeError(f"stack_tp_shards: shard {r}{jax.tree_util.keystr(path)}: expected shard 0's "
                                 f"shape {tuple(b.shape)}, got {tuple(a.shape)}")
            if np.dtype(a.dtype) != np.dtype(b.dtype):
                raise DTypeError(f"stack_tp_shards: shard {r}{jax.tree_util.keystr(path)}: expected shard 0's "
                                 f"dtype {np.dtype(b.dtype)}, got {np.dtype(a.dtype)}")
    ranks = list(range(len(shards))) if ranks is None else [int(r) for r in ranks]
    if len(ranks) != len(shards) or any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise ConfigError(f"stack_tp_shards: ranks: expected {len(shards)} distinct ranks >= 0 (one per shard), "
                          f"got {ranks}")
    fixed = [jax.tree.map(jnp.asarray, w if r == 0 else _without_w2_bias(w)) for r, w in zip(ranks, shards)]
    return jax.tree.map(lambda *a: jnp.stack(a), *fixed)


def tp_shards_from_checkpoint(ckpt, layer_index: int, tp_size: int, backend: Any = None,
                              activation: str = "silu", input_dtype: Any = None):
    """Load ``tp_size`` TP slices of one layer (``Checkpoint.load_layer``), convert each to the
    backend layout (``None`` → dispatch table, ``"loader"`` → unchanged; on an NVIDIA GPU the
    MARLIN row prepares the engine's layout, for ``input_dtype`` activations) and stack them."""
    from .checkpoint import Checkpoint
    from .nn import convert_experts

    if not isinstance(ckpt, Checkpoint):
        raise ConfigError(f"tp_shards_from_checkpoint: ckpt: expected a wna16_jax.checkpoint.Checkpoint, "
                          f"got {type(ckpt).__name__}")
    layer_index = check_int("layer_index", layer_index, low=0)
    tp_size = check_int("tp_size", tp_size, low=1)
    check_activation(activation)
    return stack_tp_shards([convert_experts(ckpt.load_layer(layer_index, tp_size=tp_size, tp_rank=r).experts,
                                            backend, activation=activation, input_dtype=input_dtype)[0]
                            for r in range(tp_size)])


# --------------------------------------------------------------------------- ragged all-to-all


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name: str, axis_size: int):
    """``jax.lax.ragged_all_to_all`` semantics on a fixed-capacity ``lax.all_to_all`` (for
    backends without the ragged collective, e.g. XLA:CPU). Capacity = ``operand.shape[0]``."""
    cap = operand.shape[0]
    n = axis_size
    rows = jnp.arange(cap)
    idx = jnp.clip(input_offsets[:, None] + rows[None], 0, cap - 1)           # [n, cap]
    live = rows[None] < send_sizes[:, None]
    buf = jnp.where(live.reshape(n, cap, *([1] * (operand.ndim - 1))), operand[idx], 0)
    got = jax.lax.all_to_all(buf, axis_name, 0, 0)                           # [n, cap, ...] from peer j
    off = jax.lax.all_to_all(output_offsets.reshape(n, 1), axis_name, 0, 0)[:, 0]
    ok = rows[None] < recv_sizes[:, None]
    pos = jnp.where(ok, off[:, None] + rows[None], output.shape[0])          # out of range → dropped
    return output.at[pos.reshape(-1)].set(got.reshape(n * cap, *operand.shape[1:]), mode="drop")


def _check_ragged(impl: Any) -> str:
    if not isinstance(impl, str) or impl not in RAGGED_IMPLS:
        raise ConfigError(f"ragged: expected one of {RAGGED_IMPLS}, got {impl!r}")
    return impl


def _ragged(impl: str):
    if impl == "native" or (impl == "auto" and jax.default_backend() != "cpu"):
        return lambda *a, axis_name, axis_size: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)
    return ragged_all_to_all_emulated


# --------------------------------------------------------------------------- the sharded layer


def _axis_size(mesh: Mesh, arg: str, name: Any) -> int:
    """The size of mesh axis ``name``, given as argument ``arg`` (``None``: not parallel, 1)."""
    if name is None:
        return 1
    if not isinstance(name, str) or name not in mesh.shape:
        raise ConfigError(f"{arg}: expected None or one of the mesh axes {tuple(mesh.axis_names)}, got {name!r}")
    return int(mesh.shape[name])


def _layout(weights, mesh: Mesh, ep_axis: str | None, tp_axis: str | None) -> tuple[int, int, int]:
    """``(E, ep, tp)`` of a weights pytree on the mesh, checked: ``mesh`` is a ``Mesh``, the axes
    are distinct axes of it, every array is ``[E, ...]`` (``[tp, E, ...]`` with ``tp_axis``: the
    arrays are sharded on those leading axes) and the EP axis divides ``E``."""
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    ep, tp = _axis_size(mesh, "ep_axis", ep_axis), _axis_size(mesh, "tp_axis", tp_axis)
    if ep_axis is not None and ep_axis == tp_axis:
        raise ConfigError(f"ep_axis and tp_axis must differ, both are {ep_axis!r}")
    if isinstance(weights, LayerStack):
        raise UnsupportedError("weights: a LayerStack (stacked layers) is not sharded; pass one layer's experts")
    leaves = jax.tree_util.tree_flatten_with_path(weights)[0]
    if not leaves or not all(hasattr(a, "shape") and hasattr(a, "dtype") for _, a in leaves):
        raise ConfigError(f"weights: expected an experts pytree of arrays, got {type(weights).__name__}")
    axis = 1 if tp_axis is not None else 0                     # the expert axis of every array
    e = None
    for path, a in leaves:
        where, shape = f"weights{jax.tree_util.keystr(path)}", tuple(a.shape)
        if tp_axis is not None and (len(shape) < 2 or shape[0] != tp):
            raise ShapeError(f"{where}: expected a leading TP axis of size {tp} (mesh axis {tp_axis!r}) before "
                             f"the expert axis, got shape {shape}; build it with stack_tp_shards")
        if len(shape) <= axis:
            raise ShapeError(f"{where}: expected the expert axis first (every array is sharded over the "
                             f"experts; per-tensor arrays are not), got shape {shape}")
        e = shape[axis] if e is None else e
        if shape[axis] != e:
            raise ShapeError(f"{where}: expected {e} experts on axis {axis} (as the first array), got shape {shape}")
    if e % ep:
        raise ShapeError(f"ep_axis: the {e} experts are not a multiple of the EP mesh axis {ep_axis!r} of size {ep}")
    return e, ep, tp


def _local_shard(weights, tp_axis: str | None, el: int):
    """One TP rank's ``weights`` restricted to ``el`` experts, as shapes: with ``el = E / ep`` the
    pytree ``fused_moe`` sees on one device inside the body; with ``el = E``, the layer that device
    would hold if one device held every expert (what the inputs are validated against)."""
    def one(a):
        shape = tuple(a.shape[1:]) if tp_axis is not None else tuple(a.shape)
        return jax.ShapeDtypeStruct((el, *shape[1:]), a.dtype)
    return jax.tree.map(one, weights)


def _activation_dtype(hidden_dtype: Any) -> np.dtype:
    """``hidden_dtype`` as a dtype the executors take (float16, bfloat16, float32), or a DTypeError."""
    try:
        dt = None if hidden_dtype is None else jnp.dtype(hidden_dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise DTypeError(f"hidden_dtype: expected float16, bfloat16 or float32, got {hidden_dtype!r}")
    return dt


def sharded_executor(weights, mesh: Mesh, *, ep_axis: str | None = "ep", tp_axis: str | None = None,
                     hidden_dtype: Any = jnp.bfloat16, executor: str = "auto", formulation: str | None = None,
                     device: Device | None = None) -> executors.Choice:
    """The registry's :class:`~wna16_jax.executors.Choice` for one device's shard of ``weights``
    under :func:`sharded_fused_moe` (the executor that runs it, and why the executors before it
    refused). Every device of the mesh runs the same program, so this one choice holds for each;
    ``device`` defaults to the mesh's first device."""
    e, ep, _ = _layout(weights, mesh, ep_axis, tp_axis)
    dtype = _activation_dtype(hidden_dtype)
    if device is not None and not isinstance(device, Device):
        raise ConfigError(f"device: expected a wna16_jax.device.Device or None, got {type(device).__name__}")
    dev = device or Device.current(mesh.devices.flat[0])
    return executors.select(_local_shard(weights, tp_axis, e // ep), dtype, executor=executor,
                            device=dev, formulation=formulation)


def sharded_fused_moe(hidden_states, topk_weights, topk_ids, weights, mesh: Mesh, *, ep_axis: str | None = "ep",
                      tp_axis: str | None = None, ep_method: str = "allgather", activation: str = "silu",
                      apply_router_weight_on_input: bool = False, formulation: str | None = None,
                      ragged: str = "auto", executor: str = "auto"):
    """:func:`wna16_jax.moe.fused_moe` over a mesh. ``weights``: experts pytree ``[E, ...]``
    (``[tp, E, ...]`` from :func:`stack_tp_shards` when ``tp_axis`` is set); ``topk_ids`` are
    global expert ids. EP shards the experts (linear: shard ``r`` owns ``r·E/ep ...``) and the
    tokens over ``ep_axis``; TP splits the intermediate size over ``tp_axis``; with neither, every
    device computes the whole layer. Returns ``[T, H]`` in ``hidden_states.dtype``.

    The inputs are validated as :func:`fused_moe` validates them, before anything is compiled
    (out-of-range ``topk_ids`` are a :class:`ValueRangeError` when concrete; under an enclosing
    ``jax.jit`` the affected tokens' outputs are NaN, in both EP designs). No token, or no slot
    (``k = 0``), gives zeros ``[T, H]`` as on one device, without a program.

    ``executor`` as in :func:`fused_moe`, for each device's shard (:func:`sharded_executor` says
    which runs): an engine keeps the activations' 16-bit dtype; the XLA executor computes in float32.
    """
    check_activation(activation)
    if not isinstance(ep_method, str) or ep_method not in EP_METHODS:
        raise ConfigError(f"ep_method: expected one of {EP_METHODS}, got {ep_method!r}")
    ragged = _check_ragged(ragged)
    if not isinstance(apply_router_weight_on_input, (bool, np.bool_)):
        raise ConfigError(f"apply_router_weight_on_input: expected True or False, got "
                          f"{apply_router_weight_on_input!r}")
    e, ep, _ = _layout(weights, mesh, ep_axis, tp_axis)
    validate_moe_inputs(hidden_states, topk_weights, topk_ids, _local_shard(weights, tp_axis, e), None, None)
    t, k = topk_ids.shape
    el = e // ep
    dtype = hidden_states.dtype
    choice = sharded_executor(weights, mesh, ep_axis=ep_axis, tp_axis=tp_axis, hidden_dtype=dtype,
                              executor=executor, formulation=formulation)
    name = choice.executor.name
    if name == "xla" and formulation is not None and formulation not in FORMULATIONS:
        raise ConfigError(f"formulation: expected one of {FORMULATIONS}, got {formulation!r}")
    if choice.refused:
        warn_fallback(_local_shard(weights, tp_axis, el), choice)
    if t == 0 or k == 0:                 # nothing routed (and the collectives take no empty shards)
        return jnp.zeros((t, hidden_states.shape[1]), dtype)
    cdt = jnp.float32 if name == "xla" else dtype       # the engines take 16-bit activations as they are
    pad = (-t) % ep
    xp = jnp.pad(jnp.asarray(hidden_states).astype(cdt), ((0, pad), (0, 0)))
    twp = jnp.pad(jnp.asarray(topk_weights).astype(jnp.float32), ((0, pad), (0, 0)))
    idp = jnp.pad(jnp.asarray(topk_ids).astype(jnp.int32), ((0, pad), (0, 0)))
    f = _build(mesh, ep_axis, tp_axis, ep_method, activation, bool(apply_router_weight_on_input),
               formulation, ragged, name, e, el, ep)
    out = f(xp, twp, idp, weights)
    return out[:t].astype(dtype)


@functools.lru_cache(maxsize=64)
def _build(mesh, ep_axis, tp_axis, ep_method, activation, on_input, formulation, ragged, executor, e, el, ep):
    """The jitted shard_map program for one static configuration (cached: no recompiles)."""
    kw = dict(activation=activation, apply_router_weight_on_input=on_input, formulation=formulation,
              executor=executor)
    tok = P(ep_axis) if ep_axis else P()
    w_spec = P(*(a for a in (tp_axis, ep_axis) if a is not None))     # a prefix of every leaf
    exchange = _ragged(ragged)

    def body(xl, twl, idl, wl):
        if tp_axis is not None:
            wl = jax.tree.map(lambda a: a[0], wl)
        rank = jax.lax.axis_index(ep_axis) if ep_axis else 0
        if ep_axis is not None and ep_method == "all_to_all":
            return _all_to_all_body(xl, twl, idl, wl, rank, ep_axis, tp_axis, ep, el, exchange, kw)
        if ep_axis is None:
            y = fused_moe(xl, twl, idl, wl, **kw)
        else:
            xa = jax.lax.all_gather(xl, ep_axis, tiled=True)
            twa = jax.lax.all_gather(twl, ep_axis, tiled=True)
            ida = jax.lax.all_gather(idl, ep_axis, tiled=True)
            g = jnp.arange(e)
            emap = jnp.where(g // el == rank, g % el, -1).astype(jnp.int32)
            y = fused_moe(xa, twa, ida, wl, expert_map=emap, global_num_experts=e, **kw)
        if tp_axis is not None:
            y = jax.lax.psum(y, tp_axis)
        if ep_axis is not None:
            y = jax.lax.psum_scatter(y, ep_axis, scatter_dimension=0, tiled=True)
        return y

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, w_spec), out_specs=tok,
                                 check_vma=False))


def _all_to_all_body(xl, twl, idl, wl, rank, ep_axis, tp_axis, n, el, exchange, kw):
    tl, k = idl.shape
    r = tl * k
    bad = ((idl < 0) | (idl >= n * el)).any(axis=1)                    # traced ids out of range → NaN rows
    flat = jnp.clip(idl, 0, n * el - 1).reshape(-1)
    dest = flat // el
    order = jnp.argsort(dest, stable=True)
    send = jnp.bincount(dest, length=n).astype(jnp.int32)                  # rows to each shard
    in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
    sizes = jax.lax.all_gather(send, ep_axis)                              # [src, dst]
    before = (jnp.cumsum(sizes, axis=0) - sizes).astype(jnp.int32)         # rows of lower sources
    out_off = before[rank]                                                 # where mine land at each dst
    recv = sizes[:, rank]
    recv_off = before[:, rank]                                             # where each src's rows land here
    cap = n * r
    xs = xl[order // k]
    meta = jnp.stack([flat[order].astype(jnp.float32), twl.reshape(-1)[order]], axis=1)   # id, weight
    rx = exchange(xs, jnp.zeros((cap, xl.shape[1]), xl.dtype), in_off, send, out_off, recv,
                  axis_name=ep_axis, axis_size=n)
    rm = exchange(meta, jnp.full((cap, 2), -1.0, jnp.float32), in_off, send, out_off, recv,
                  axis_name=ep_axis, axis_size=n)
    local = rm[:, 0].astype(jnp.int32) - rank * el
    local = jnp.where((local >= 0) & (local < el), local, el)             # padding → masked slot
    emap = jnp.concatenate([jnp.arange(el, dtype=jnp.int32), jnp.full((1,), -1, jnp.int32)])
    y = fused_moe(rx, jnp.where(local < el, rm[:, 1], 0.0)[:, None], local[:, None], wl,
                  expert_map=emap, global_num_experts=el + 1, **kw)
    if tp_axis is not None:
        y = jax.lax.psum(y, tp_axis)
    # each source's rows go back to where that source keeps them: its own input offset for us
    home = (jnp.cumsum(sizes, axis=1) - sizes).astype(jnp.int32)[:, rank]
    back = exchange(y, jnp.zeros((r, y.shape[1]), y.dtype), recv_off, recv, home, send,
                    axis_name=ep_axis, axis_size=n)                        # in my sorted order
    rows = jnp.zeros_like(back).at[order].set(back)
    out = rows.reshape(tl, k, -1).astype(jnp.float32).sum(axis=1)
    return jnp.where(bad[:, None], jnp.nan, out).astype(xl.dtype)


def shard_weights(weights, mesh: Mesh, *, ep_axis: str | None = "ep", tp_axis: str | None = None):
    """``device_put`` an experts pytree with the sharding :func:`sharded_fused_moe` expects
    (checked as it checks the weights and the mesh)."""
    _layout(weights, mesh, ep_axis, tp_axis)
    spec = P(*(a for a in (tp_axis, ep_axis) if a is not None))
    return jax.device_put(weights, jax.tree.map(lambda _: NamedSharding(mesh, spec), weights))


__all__ = ["sharded_fused_moe", "sharded_executor", "slice_tp", "stack_tp_shards", "tp_shards_from_checkpoint",
           "check_tp", "shard_weights", "ragged_all_to_all_emulated", "EP_METHODS", "RAGGED_IMPLS"]
