"""Hugging Face checkpoints: read MoE layers into the loader layout, and write tiny quantized MoEs.

Reading (``Checkpoint``) is lazy: ``safetensors.safe_open`` opens only the files a layer needs and
reads only its tensors; nothing is unpickled and torch is never imported. Each MoE layer becomes a
:class:`MoELayer` whose routed experts are a :class:`~wna16_jax.weights.CheckpointWeights` in the
layout vLLM's FusedMoE loader holds (``docs/formats.md`` §1.3–§1.6): experts stacked,
gate and up fused into ``w13`` gate first, optional tensor-parallel slicing of the intermediate
dimension.

Writing (``write_checkpoint``) quantizes float weights round-to-nearest
(:mod:`wna16_jax.quantize`) and packs them exactly as AutoAWQ, AutoGPTQ (v1) and
compressed-tensors ``pack-quantized`` store them.

Recognised tensor naming:

* Mixtral: ``model.layers.{L}.block_sparse_moe.experts.{e}.w1|w2|w3.*``, router
  ``block_sparse_moe.gate.weight``;
* Qwen2-MoE / Qwen3-MoE / DeepSeek-V2/V3: ``model.layers.{L}.mlp.experts.{e}.gate_proj|up_proj|
  down_proj.*``, router ``mlp.gate.weight`` (+ DeepSeek-V3 ``mlp.gate.e_score_correction_bias``),
  shared experts ``mlp.shared_experts.*`` (DeepSeek) or ``mlp.shared_expert.*`` with
  ``mlp.shared_expert_gate.weight`` (Qwen2-MoE), kept apart from the routed experts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import defaultdict
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from . import packing
from .errors import (
    ConfigError,
    MissingTensorError,
    ShapeError,
    UnexpectedTensorError,
    ValueRangeError,
    check_divisible,
)
from .quantize import quantize_rtn
from .schemes import QuantMethod, QuantScheme
from .weights import CheckpointWeights, ExpertsMixin, LogicalQuant, pytree_dataclass

# --------------------------------------------------------------------------- naming

#: projection name → role; w1/gate_proj = gate, w3/up_proj = up, w2/down_proj = down.
_PROJ_ROLE = {"w1": "gate", "w3": "up", "w2": "down",
              "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_NAMINGS = {
    "mixtral": {"block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"},
    "qwen": {"block": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}
_EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>block_sparse_moe|mlp))"
    r"\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z_]+)$"
)

#: tensor suffixes per method: role in CheckpointWeights → checkpoint suffix.
_SUFFIXES = {
    QuantMethod.AWQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros"},
    QuantMethod.GPTQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros", "g_idx": "g_idx"},
    QuantMethod.COMPRESSED_TENSORS: {"qweight": "weight_packed", "scales": "weight_scale",
                                     "qzeros": "weight_zero_point", "g_idx": "weight_g_idx",
                                     "shape": "weight_shape"},
}


@dataclasses.dataclass(frozen=True)
class MoEModelConfig:
    """The MoE-relevant facts of a model's ``config.json``."""

    model_type: str
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    renormalize: bool = True
    scoring_func: str = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    activation: str = "silu"
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None

    @property
    def grouped(self) -> bool:
        return bool(self.num_expert_group) and self.num_expert_group > 1

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "MoEModelConfig":
        mt = str(config.get("model_type", "unknown"))

        def first(*keys, default=None):
            for k in keys:
                if config.get(k) is not None:
                    return config[k]
            if default is None:
                raise ConfigError(f"config.json: none of the fields {keys} is present (model_type {mt!r})")
            return default

        e = int(first("num_local_experts", "num_experts", "n_routed_experts"))
        topk_method = config.get("topk_method")
        grouped = topk_method in ("group_limited_greedy", "noaux_tc")
        act = str(config.get("hidden_act", "silu"))
        act = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu",
               "gelu_pytorch_tanh": "gelu"}.get(act, act)
        default_renorm = mt == "mixtral" or mt.startswith("qwen3")
        return cls(
            model_type=mt,
            num_experts=e,
            top_k=int(first("num_experts_per_tok")),
            hidden_size=int(first("hidden_size")),
            moe_intermediate_size=int(first("moe_intermediate_size", "intermediate_size")),
            renormalize=bool(config.get("norm_topk_prob", default_renorm)),
            scoring_func=str(config.get("scoring_func", "softmax")),
            num_expert_group=int(config["n_group"]) if grouped and config.get("n_group") else None,
            topk_group=int(config["topk_group"]) if grouped and config.get("topk_group") else None,
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            activation=act,
            num_shared_experts=int(config.get("n_shared_experts") or
                                   (1 if config.get("shared_expert_intermediate_size") else 0)),
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size"),
        )


@pytree_dataclass(meta=("hidden_size", "intermediate_size"))
class DenseWeights(ExpertsMixin):
    """Unquantized experts (e.g. shared experts listed in a checkpoint's ``ignore``):
    ``w13 [E, 2I, H]`` (gate first), ``w2 [E, H, I]``, optional biases."""


    w13: Any
    w2: Any
    w13_bias: Any = None
    w2_bias: Any = None
    hidden_size: int = 0
    intermediate_size: int = 0

    def dequantize(self, dtype: Any = np.float32):
        xp = packing.xp_of(self.w13)
        return xp.asarray(self.w13).astype(dtype), xp.asarray(self.w2).astype(dtype)

    def decode(self):
        raise NotImplementedError("DenseWeights hold float weights; use dequantize()")


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """Everything one MoE layer of a checkpoint holds.

    ``experts``: routed experts in the loader layout (:class:`Checkpoint`) or in a backend layout
    (:class:`wna16_jax.serialize.ConvertedCheckpoint`). ``router [E, H]``: the float gate weight.
    ``e_score_correction_bias [E]`` (DeepSeek-V3) or None. ``shared_experts``: the shared
    expert(s) fused into one expert (``E = 1``; quantized ``CheckpointWeights`` or float
    ``DenseWeights``), or None. ``shared_expert_gate [1, H]`` (Qwen2-MoE sigmoid gate) or None.
    """

    layer_index: int
    experts: Any
    router: np.ndarray
    e_score_correction_bias: np.ndarray | None = None
    shared_experts: Any = None
    shared_expert_gate: np.ndarray | None = None


# --------------------------------------------------------------------------- reading


class Checkpoint:
    """A Hugging Face checkpoint directory with quantized MoE experts, read lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"config.json: not found in {self.path!r}")
        with open(cfg_path) as f:
            try:
                self.config = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config.json in {self.path!r}: not valid JSON ({e})") from None
        self.scheme = QuantScheme.from_hf_config(self.config)
        self.model_config = MoEModelConfig.from_hf_config(self.config)
        self._weight_map = self._read_weight_map()
        self._index_experts()

    # ------------------------------------------------------------------ files
    def _read_weight_map(self) -> dict[str, str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                wm = json.load(f).get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise ConfigError(f"{index}: no 'weight_map'")
            missing = sorted({v for v in wm.values() if not os.path.isfile(os.path.join(self.path, v))})
            if missing:
                raise MissingTensorError(f"{index}: shard files not found: {missing}")
            return dict(wm)
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise MissingTensorError(f"{self.path!r}: no *.safetensors file and no model.safetensors.index.json")
        if len(files) > 1:
            raise ConfigError(
                f"{self.path!r}: {len(files)} safetensors files but no model.safetensors.index.json: {files}")
        from safetensors import safe_open

        with safe_open(os.path.join(self.path, files[0]), framework="numpy") as f:
            return {k: files[0] for k in f.keys()}

    def tensor_names(self) -> list[str]:
        return sorted(self._weight_map)

    def _read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Read the named tensors, opening each shard file once."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = defaultdict(list)
        for n in names:
            if n not in self._weight_map:
                raise MissingTensorError(f"{n}: tensor not found in {self.path!r}")
            by_file[self._weight_map[n]].append(n)
        out = {}
        for fname, ns in by_file.items():
            with safe_open(os.path.join(self.path, fname), framework="numpy") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        return out

    # ------------------------------------------------------------------ naming
    def _index_experts(self) -> None:
        layers: dict[int, dict] = {}
        for name in self._weight_map:
            m = _EXPERT_RE.match(name)
            if not m:
                continue
            li = int(m["layer"])
            info = layers.setdefault(li, {"prefix": m["prefix"], "block": m["block"],
                                          "experts": set(), "projs": set()})
            info["experts"].add(int(m["expert"]))
            info["projs"].add(m["proj"])
        if not layers:
            sample = sorted({re.sub(r"\.\d+\.", ".N.", n).rsplit(".", 1)[0] for n in self._weight_map})[:12]
            raise ConfigError(
                f"{self.path!r}: no MoE expert tensors recognised (expected names like "
                "'model.layers.L.block_sparse_moe.experts.E.w1.qweight' or "
                f"'model.layers.L.mlp.experts.E.gate_proj.qweight'); found e.g. {sample}")
        for li, info in layers.items():
            projs = info["projs"]
            naming = "mixtral" if projs & {"w1", "w2", "w3"} else "qwen"
            want = {_NAMINGS[naming][r] for r in ("gate", "up", "down")}
            if projs != want:
                raise ConfigError(
                    f"layer {li}: expert projections {sorted(projs)} do not match a known naming "
                    f"(expected {sorted(want)})")
            info["naming"] = naming
            n = len(info["experts"])
            if info["experts"] != set(range(n)):
                raise MissingTensorError(
                    f"layer {li}: experts must be numbered 0..{n - 1}, found {sorted(info['experts'])}")
        self._layers = dict(sorted(layers.items()))

    @property
    def moe_layer_indices(self) -> list[int]:
        return list(self._layers)

    def num_experts(self, layer_index: int) -> int:
        return len(self._layer_info(layer_index)["experts"])

    def _layer_info(self, layer_index: int) -> dict:
        if layer_index not in self._layers:
            raise ValueRangeError(
                f"layer_index: {layer_index} is not a MoE layer of {self.path!r}; "
                f"MoE layers are {self.moe_layer_indices}")
        return self._layers[layer_index]

    # ------------------------------------------------------------------ loading
    def load_layer(self, layer_index: int, *, tp_size: int = 1, tp_rank: int = 0) -> MoELayer:
        """Load one MoE layer (routed experts, router, shared experts) into the loader layout."""
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank}")
        info = self._layer_info(layer_index)
        prefix, names = info["prefix"], _NAMINGS[info["naming"]]
        e = len(info["experts"])
        experts = _load_experts(self, f"{prefix}.experts.{{e}}", names, e, tp_size, tp_rank,
                                layer=f"layer {layer_index}")
        router_name = f"{prefix}.gate.weight"
        t = self._read([router_name])[router_name] if router_name in self._weight_map else None
        if t is None:
            raise MissingTensorError(f"{router_name}: router weight not found")
        if t.shape != (e, experts.hidden_size):
            raise ShapeError(f"{router_name}: expected shape {(e, experts.hidden_size)}, got {t.shape}")
        bias_name = f"{prefix}.gate.e_score_correction_bias"
        e_bias = self._read([bias_name])[bias_name] if bias_name in self._weight_map else None
        shared, shared_gate = None, None
        for sp in (f"{prefix}.shared_experts", f"{prefix}.shared_expert"):
            if any(k.startswith(sp + ".") for k in self._weight_map):
                shared = _load_shared(self, sp, tp_size, tp_rank, layer=f"layer {layer_index}")
        sg = f"{prefix}.shared_expert_gate.weight"
        if sg in self._weight_map:
            shared_gate = self._read([sg])[sg]
        return MoELayer(layer_index, experts, t, e_bias, shared, shared_gate)

    def iter_layers(self, *, tp_size: int = 1, tp_rank: int = 0, progress: bool = True
                    ) -> Iterator[MoELayer]:
        """Yield every MoE layer in order (one resident at a time), with a tqdm progress bar."""
        from tqdm.auto import tqdm

        for li in tqdm(self.moe_layer_indices, desc="MoE layers", unit="layer", disable=not progress):
            yield self.load_layer(li, tp_size=tp_size, tp_rank=tp_rank)


def _tp_slice(n: int, tp_size: int, tp_rank: int, unit: int, what: str) -> slice:
    """Rank ``tp_rank``'s slice of an axis of ``n`` logical entries stored in units of ``unit``."""
    check_divisible(f"{what} (intermediate size {n}) / tp_size {tp_size}", n, tp_size)
    local = n // tp_size
    check_divisible(f"{what}: local intermediate size {local}", local, unit,
                    "tensor-parallel slices must cover whole packed words / groups")
    return slice(tp_rank * local // unit, (tp_rank + 1) * local // unit)


def _load_experts(ckpt: Checkpoint, fmt: str, names: dict, e: int, tp_size: int, tp_rank: int,
                  *, layer: str) -> CheckpointWeights:
    """Stack experts ``fmt.format(e=...)`` and fuse gate/up into w13 (gate first)."""
    scheme = ckpt.scheme
    m, g, pf = scheme.method, scheme.group_size, scheme.pack_factor
    suff = _SUFFIXES[m]
    prefixes = [fmt.format(e=i) for i in range(e)]
    roles = ("gate", "up", "down")
    wanted = ["qweight", "scales"]
    if scheme.zero_point:
        wanted.append("qzeros")
    if scheme.act_order:
        wanted.append("g_idx")
    optional = ["bias"] + (["qzeros"] if not scheme.zero_point else []) + \
        (["g_idx"] if m is QuantMethod.GPTQ and not scheme.act_order else []) + \
        (["shape"] if m is QuantMethod.COMPRESSED_TENSORS else [])
    known = {suff.get(k, k) for k in wanted + optional}
    names_needed = []
    for p in prefixes:
        for r in roles:
            base = f"{p}.{names[r]}"
            for k in wanted:
                names_needed.append(f"{base}.{suff[k]}")
            for k in optional:
                n = f"{base}.{suff.get(k, k)}"
                if n in ckpt._weight_map:
                    names_needed.append(n)
            for n in ckpt._weight_map:
                if n.startswith(base + ".") and n[len(base) + 1:] not in known:
                    raise UnexpectedTensorError(
                        f"{n}: unexpected tensor for a {scheme.describe()} expert "
                        f"(known suffixes: {sorted(known)})")
    t = ckpt._read(names_needed)

    def get(i: int, role: str, key: str):
        return t.get(f"{prefixes[i]}.{names[role]}.{suff.get(key, key)}")

    # Sizes from expert 0's gate and down projections.
    q_gate, q_down = get(0, "gate", "qweight"), get(0, "down", "qweight")
    for nm, arr in ((f"{prefixes[0]}.{names['gate']}.{suff['qweight']}", q_gate),
                    (f"{prefixes[0]}.{names['down']}.{suff['qweight']}", q_down)):
        if arr.ndim != 2:
            raise ShapeError(f"{nm}: expected a rank-2 packed tensor, got shape {arr.shape}")
    if m is QuantMethod.AWQ:
        h, i_full = q_gate.shape[0], q_gate.shape[1] * pf
    elif m is QuantMethod.GPTQ:
        h, i_full = q_gate.shape[0] * pf, q_gate.shape[1]
    else:
        i_full = q_gate.shape[0]
        shape_t = get(0, "gate", "shape")
        h = int(shape_t[1]) if shape_t is not None else q_gate.shape[1] * pf
    if g != -1:
        check_divisible(f"{layer}: hidden size", h, g, "group_size must divide H")
        check_divisible(f"{layer}: intermediate size", i_full, g, "group_size must divide I")

    # The slice of the TP-sharded axis (N of gate/up, K of down), in packed or group units.
    i_local = i_full // tp_size

    def sl_n(unit):  # slice of the gate/up output axis (N) in units of `unit`
        return _tp_slice(i_full, tp_size, tp_rank, unit, f"{layer} gate/up")

    def sl_k(unit):  # slice of the down input axis (K) in units of `unit`
        return _tp_slice(i_full, tp_size, tp_rank, unit, f"{layer} down")

    stacks: dict[str, list] = defaultdict(list)
    full_w2_groups = scheme.act_order and tp_size > 1
    for ei in range(e):
        parts: dict[str, list] = defaultdict(list)
        for role in ("gate", "up"):
            qw, sc, qz = get(ei, role, "qweight"), get(ei, role, "scales"), get(ei, role, "qzeros")
            if m is QuantMethod.AWQ:  # [H, I/8], [G, I], [G, I/8]: N is the last axis
                parts["qweight"].append(qw[:, sl_n(pf)])
                parts["scales"].append(sc[:, sl_n(1)])
                if scheme.zero_point:
                    parts["qzeros"].append(qz[:, sl_n(pf)])
            elif m is QuantMethod.GPTQ:  # [H/pf, I], [G, I], [G, I/pf]
                parts["qweight"].append(qw[:, sl_n(1)])
                parts["scales"].append(sc[:, sl_n(1)])
                if scheme.zero_point:
                    parts["qzeros"].append(qz[:, sl_n(pf)])
            else:  # [I, H/pf], [I, G], [I/pf, G]: N is the first axis
                parts["qweight"].append(qw[sl_n(1)])
                parts["scales"].append(sc[sl_n(1)])
                if scheme.zero_point:
                    check_divisible(f"{layer}: intermediate size for packed zero points", i_local, pf)
                    parts["qzeros"].append(qz[sl_n(pf)])
            bias = get(ei, role, "bias")
            if bias is not None:
                parts["bias"].append(bias[sl_n(1)])
        axis = 0 if m is QuantMethod.COMPRESSED_TENSORS else 1
        for k in ("qweight", "scales", "qzeros"):
            if parts[k]:
                stacks["w13_" + k].append(np.concatenate(parts[k], axis=axis))
        if parts["bias"]:
            if len(parts["bias"]) != 2:
                raise MissingTensorError(f"{prefixes[ei]}: gate and up biases must both be present")
            stacks["w13_bias"].append(np.concatenate(parts["bias"]))
        if scheme.act_order:
            gi_gate, gi_up = get(ei, "gate", "g_idx"), get(ei, "up", "g_idx")
            if not np.array_equal(gi_gate, gi_up):
                raise ValueRangeError(
                    f"{prefixes[ei]}: gate and up g_idx differ; the fused w13 holds one g_idx per expert")
            stacks["w13_g_idx"].append(gi_gate)
        qw, sc, qz = get(ei, "down", "qweight"), get(ei, "down", "scales"), get(ei, "down", "qzeros")
        if m is QuantMethod.AWQ:  # [I, H/8], [I/g, H], [I/g, H/8]
            stacks["w2_qweight"].append(qw[sl_k(1)])
            stacks["w2_scales"].append(sc[sl_k(g)])
            if scheme.zero_point:
                stacks["w2_qzeros"].append(qz[sl_k(g)])
        elif m is QuantMethod.GPTQ:  # [I/pf, H], [G2, H], [G2, H/pf]
            stacks["w2_qweight"].append(qw[sl_k(pf)])
            gsl = slice(None) if (g == -1 or full_w2_groups) else sl_k(g)
            stacks["w2_scales"].append(sc[gsl])
            if scheme.zero_point:
                stacks["w2_qzeros"].append(qz[gsl])
        else:  # [H, I/pf], [H, G2], [H/pf, G2]
            stacks["w2_qweight"].append(qw[:, sl_k(pf)])
            gsl = slice(None) if (g == -1 or full_w2_groups) else sl_k(g)
            stacks["w2_scales"].append(sc[:, gsl])
            if scheme.zero_point:
                stacks["w2_qzeros"].append(qz[:, gsl])
        if scheme.act_order:
            stacks["w2_g_idx"].append(get(ei, "down", "g_idx")[sl_k(1)])
        bias = get(ei, "down", "bias")
        if bias is not None:
            stacks["w2_bias"].append(bias)
        elif stacks.get("w13_bias"):
            raise MissingTensorError(f"{prefixes[ei]}.{names['down']}.bias: missing (gate/up have biases)")
        # GPTQ without act-order: g_idx, if present, must be the trivial k // g.
        if m is QuantMethod.GPTQ and not scheme.act_order:
            for role, k in (("gate", h), ("down", i_full)):
                gi = get(ei, role, "g_idx")
                triv = np.zeros(k, np.int64) if g == -1 else np.arange(k) // g
                if gi is not None and not np.array_equal(gi, triv):
                    raise ConfigError(
                        f"{prefixes[ei]}.{names[role]}.g_idx: rows are not in natural group order, "
                        "but the config has desc_act=false")
    arrays = {}
    for k, v in stacks.items():
        if not v:
            continue
        if len(v) != e:
            raise MissingTensorError(f"{layer}: {k} present for {len(v)} of {e} experts")
        try:
            arrays[k] = np.stack(v)
        except ValueError:
            raise ShapeError(f"{layer}: {k} shapes differ between experts: "
                             f"{sorted({tuple(x.shape) for x in v})}") from None
    for k in ("w13_g_idx", "w2_g_idx"):
        if k in arrays:
            arrays[k] = arrays[k].astype(np.int32)
    weights = CheckpointWeights(**arrays, scheme=scheme, hidden_size=h, intermediate_size=i_local)
    weights = weights.validate()
    _check_g_idx(weights, layer)
    return weights


def _check_g_idx(w: CheckpointWeights, layer: str) -> None:
    for name, gi, scales_axis in (("w13_g_idx", w.w13_g_idx, None), ("w2_g_idx", w.w2_g_idx, None)):
        if gi is None:
            continue
        sc = w.w13_scales if name == "w13_g_idx" else w.w2_scales
        ng = sc.shape[2] if w.scheme.method is QuantMethod.COMPRESSED_TENSORS else sc.shape[1]
        if gi.size and (gi.min() < 0 or gi.max() >= ng):
            raise ValueRangeError(
                f"{layer} {name}: group indices must lie in [0, {ng}), got [{gi.min()}, {gi.max()}]")
        del scales_axis


def _load_shared(ckpt: Checkpoint, prefix: str, tp_size: int, tp_rank: int, *, layer: str):
    """Shared expert(s) as one expert: quantized (same scheme) or float (``ignore``d)."""
    names = _NAMINGS["qwen"]
    if f"{prefix}.gate_proj.weight" in ckpt._weight_map:
        t = ckpt._read([f"{prefix}.{names[r]}.weight" for r in ("gate", "up", "down")])
        gate, up, down = (t[f"{prefix}.{names[r]}.weight"] for r in ("gate", "up", "down"))
        i_full = gate.shape[0]
        sl = _tp_slice(i_full, tp_size, tp_rank, 1, f"{layer} shared expert")
        return DenseWeights(np.concatenate([gate[sl], up[sl]])[None], down[:, sl][None],
                            hidden_size=gate.shape[1], intermediate_size=i_full // tp_size)
    return _load_experts(ckpt, prefix, names, 1, tp_size, tp_rank, layer=f"{layer} shared expert")


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class FloatMoELayer:
    """Float weights of one MoE layer (output × input orientation, like ``nn.Linear``).

    ``w1``/``w3`` (gate/up) ``[E, I, H]``, ``w2`` (down) ``[E, H, I]``, ``router [E, H]``,
    optional biases ``b1``/``b3 [E, I]``, ``b2 [E, H]``, optional ``e_score_correction_bias [E]``,
    optional shared expert ``shared = (w1 [Is, H], w3 [Is, H], w2 [H, Is])`` and Qwen2-MoE style
    ``shared_gate [1, H]``.
    """

    w1: np.ndarray
    w3: np.ndarray
    w2: np.ndarray
    router: np.ndarray
    b1: np.ndarray | None = None
    b3: np.ndarray | None = None
    b2: np.ndarray | None = None
    e_score_correction_bias: np.ndarray | None = None
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    shared_gate: np.ndarray | None = None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]


def random_moe_layer(rng: np.random.Generator, num_experts: int, hidden: int, intermediate: int, *,
                     bias: bool = False, shared_intermediate: int | None = None,
                     shared_gate: bool = False, score_bias: bool = False) -> FloatMoELayer:
    """Random float MoE layer with realistic magnitudes (weights ~ N(0, 1/fan_in))."""
    e, h, i = num_experts, hidden, intermediate

    def lin(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    shared = None
    if shared_intermediate:
        shared = (lin(shared_intermediate, h), lin(shared_intermediate, h), lin(h, shared_intermediate))
    return FloatMoELayer(
        w1=lin(e, i, h), w3=lin(e, i, h), w2=lin(e, h, i), router=lin(e, h),
        b1=(0.1 * rng.standard_normal((e, i))).astype(np.float32) if bias else None,
        b3=(0.1 * rng.standard_normal((e, i))).astype(np.float32) if bias else None,
        b2=(0.1 * rng.standard_normal((e, h))).astype(np.float32) if bias else None,
        e_score_correction_bias=(0.1 * rng.standard_normal(e)).astype(np.float32) if score_bias else None,
        shared=shared,
        shared_gate=lin(1, h) if shared_gate else None,
    )


def random_checkpoint_weights(rng: np.random.Generator, scheme: QuantScheme, num_experts: int,
                              hidden: int, intermediate: int, *, scale: float = 0.01) -> CheckpointWeights:
    """A random loader-layout layer straight from random packed words (no quantization step):
    fast enough for model-sized benchmarks. Scales are positive, ~``scale``; act-order g_idx
    is a random balanced assignment; zero points random."""
    e, h, i = num_experts, hidden, intermediate
    shapes = CheckpointWeights.expected_shapes(scheme, e, h, i)
    f16 = default_scale_dtype(scheme)
    arrays = {}
    for name, shape in shapes.items():
        if name.endswith("bias"):
            continue
        if "g_idx" in name:
            k = shape[1]
            arrays[name] = np.stack([rng.permutation(np.arange(k) // scheme.group_size)
                                     for _ in range(e)]).astype(np.int32)
        elif "scales" in name:
            arrays[name] = (scale * (0.5 + rng.random(shape, dtype=np.float32))).astype(f16)
        else:
            arrays[name] = rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
    return CheckpointWeights(**arrays, scheme=scheme, hidden_size=h, intermediate_size=i).validate()


def default_scale_dtype(scheme: QuantScheme):
    """fp16 for AutoAWQ / AutoGPTQ files, bf16 for compressed-tensors (as those tools write)."""
    import ml_dtypes

    return ml_dtypes.bfloat16 if scheme.method is QuantMethod.COMPRESSED_TENSORS else np.float16


def quantized_linear_tensors(w: np.ndarray, scheme: QuantScheme, *, scale_dtype=None,
                             g_idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Quantize one linear weight ``w [N, K]`` and return its checkpoint tensors by suffix."""
    scale_dtype = scale_dtype or default_scale_dtype(scheme)
    q = quantize_rtn(w, scheme, scale_dtype=scale_dtype, g_idx=g_idx)
    return pack_linear(q.codes, q.scales, q.zeros, q.g_idx, scheme)


def pack_linear(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                g_idx: np.ndarray | None, scheme: QuantScheme) -> dict[str, np.ndarray]:
    """Pack one linear layer's ``codes [N, K]``, ``scales/zeros [N, G]`` into checkpoint tensors."""
    b = scheme.bits
    n, k = codes.shape
    m = scheme.method
    if m is QuantMethod.AWQ:
        out = {"qweight": packing.pack(codes.T, b, axis=1, order=packing.awq_order(b)),
               "scales": np.ascontiguousarray(scales.T),
               "qzeros": packing.pack(zeros.T, b, axis=1, order=packing.awq_order(b))}
    elif m is QuantMethod.GPTQ:
        stored_z = (zeros if zeros is not None else np.full(scales.shape, scheme.implicit_zero))
        if scheme.gptq_zeros_minus_one:
            stored_z = (stored_z - 1) & ((1 << b) - 1)
        if g_idx is None:
            g_idx = (np.arange(k) // scheme.group_size if scheme.group_size != -1
                     else np.zeros(k, np.int64))
        out = {"qweight": packing.pack(codes.T, b, axis=0),
               "scales": np.ascontiguousarray(scales.T),
               "qzeros": packing.pack(stored_z.T, b, axis=1),
               "g_idx": np.asarray(g_idx, np.int32)}
    else:
        out = {"weight_packed": packing.pack(codes, b, axis=1),
               "weight_scale": np.ascontiguousarray(scales),
               "weight_shape": np.array([n, k], np.int64)}
        if zeros is not None:
            out["weight_zero_point"] = packing.pack(zeros, b, axis=0)
        if g_idx is not None:
            out["weight_g_idx"] = np.asarray(g_idx, np.int32)
    return {key: np.ascontiguousarray(v) for key, v in out.items()}


_MODEL_TEMPLATES = {
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
}


def _write_mlp(tensors: dict, prefix: str, naming: dict, scheme: QuantScheme, scale_dtype, bias_dtype,
               weights: tuple, biases: tuple = (None, None, None)) -> None:
    """Quantize one gated MLP (gate, up, down) into ``tensors`` under ``prefix``."""
    from .quantize import act_order_g_idx

    gate, up, down = weights
    # gate and up share one act-order: the same inputs feed both projections.
    g_idx = act_order_g_idx(np.concatenate([gate, up]), scheme.group_size) if scheme.act_order else None
    for role, w, bias in zip(("gate", "up", "down"), weights, biases):
        gi = g_idx if role != "down" else None
        for suffix, t in quantized_linear_tensors(w, scheme, scale_dtype=scale_dtype, g_idx=gi).items():
            tensors[f"{prefix}.{naming[role]}.{suffix}"] = t
        if bias is not None:
            tensors[f"{prefix}.{naming[role]}.bias"] = np.asarray(bias).astype(bias_dtype)


def write_checkpoint(
    path: str | os.PathLike,
    scheme: QuantScheme,
    layers: Sequence[FloatMoELayer],
    *,
    model_type: str = "mixtral",
    top_k: int = 2,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    hidden_act: str = "silu",
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    extra_config: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
    scale_dtype=None,
    quantize_shared: bool = True,
) -> str:
    """Quantize ``layers`` into ``scheme`` and write a Hugging Face style checkpoint directory.

    Layer ``j`` of ``layers`` becomes ``model.layers.{j}``. ``max_shard_bytes`` splits the
    tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards with an index file.
    Returns the directory path.
    """
    from safetensors.numpy import save_file

    if model_type not in _MODEL_TEMPLATES:
        raise ConfigError(f"model_type: expected one of {sorted(_MODEL_TEMPLATES)}, got {model_type!r}")
    if not layers:
        raise ConfigError("layers: at least one MoE layer is required")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    naming = _NAMINGS["mixtral" if model_type == "mixtral" else "qwen"]
    block = naming["block"]
    sd = scale_dtype or default_scale_dtype(scheme)
    tensors: dict[str, np.ndarray] = {}
    import ml_dtypes

    f16 = ml_dtypes.bfloat16 if sd == ml_dtypes.bfloat16 else np.float16
    ref = layers[0]
    e, i, h = ref.w1.shape
    for li, layer in enumerate(layers):
        base = f"model.layers.{li}.{block}"
        for ei in range(layer.num_experts):
            biases = tuple(None if b_ is None else b_[ei] for b_ in (layer.b1, layer.b3, layer.b2))
            _write_mlp(tensors, f"{base}.experts.{ei}", naming, scheme, sd, f16,
                       (layer.w1[ei], layer.w3[ei], layer.w2[ei]), biases)
        tensors[f"{base}.gate.weight"] = layer.router.astype(f16)
        if layer.e_score_correction_bias is not None:
            tensors[f"{base}.gate.e_score_correction_bias"] = layer.e_score_correction_bias.astype(np.float32)
        if layer.shared is not None:
            sp = f"{base}.shared_expert" if model_type == "qwen2_moe" else f"{base}.shared_experts"
            if quantize_shared:
                _write_mlp(tensors, sp, _NAMINGS["qwen"], scheme, sd, f16, layer.shared)
            else:
                for role, w in zip(("gate", "up", "down"), layer.shared):
                    tensors[f"{sp}.{_NAMINGS['qwen'][role]}.weight"] = w.astype(f16)
        if layer.shared_gate is not None:
            tensors[f"{base}.shared_expert_gate.weight"] = layer.shared_gate.astype(f16)
    for k, v in (extra_tensors or {}).items():
        tensors[k] = np.ascontiguousarray(v)

    qc = scheme.to_quant_config()
    if not quantize_shared and scheme.method is QuantMethod.COMPRESSED_TENSORS:
        qc["ignore"] = sorted(set(qc["ignore"]) | {"re:.*shared_expert.*"})
    config: dict[str, Any] = dict(_MODEL_TEMPLATES[model_type])
    config.update({
        "hidden_size": h,
        "num_hidden_layers": len(layers),
        "num_experts_per_tok": top_k,
        "norm_topk_prob": renormalize,
        "scoring_func": scoring_func,
        "routed_scaling_factor": routed_scaling_factor,
        "hidden_act": hidden_act,
        "torch_dtype": "bfloat16" if f16 == ml_dtypes.bfloat16 else "float16",
        "quantization_config": qc,
    })
    if model_type == "mixtral":
        config.update({"num_local_experts": e, "intermediate_size": i})
    elif model_type.startswith("qwen"):
        config.update({"num_experts": e, "moe_intermediate_size": i, "decoder_sparse_step": 1})
        if ref.shared is not None:
            config["shared_expert_intermediate_size"] = ref.shared[0].shape[0]
    else:
        config.update({"n_routed_experts": e, "moe_intermediate_size": i, "first_k_dense_replace": 0,
                       "n_shared_experts": 1 if ref.shared is not None else 0,
                       "topk_method": "noaux_tc" if num_expert_group else "greedy"})
        if num_expert_group:
            config.update({"n_group": num_expert_group, "topk_group": topk_group})
    config.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    meta = {"format": "pt"}
    if not max_shard_bytes:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata=meta)
        return path
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k in sorted(tensors):
        nbytes = tensors[k].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += nbytes
    weight_map = {}
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                   "weight_map": weight_map}, f, indent=2)
    return path


def float_reference_weights(layer: FloatMoELayer) -> tuple[np.ndarray, np.ndarray]:
    """``w13 [E, 2I, H]`` (gate first) and ``w2 [E, H, I]`` float64 from a float layer."""
    return (np.concatenate([layer.w1, layer.w3], axis=1).astype(np.float64),
            layer.w2.astype(np.float64))


__all__ = [
    "Checkpoint", "MoELayer", "MoEModelConfig", "DenseWeights", "FloatMoELayer", "random_moe_layer",
    "write_checkpoint", "quantized_linear_tensors", "pack_linear", "float_reference_weights",
    "LogicalQuant",
]
