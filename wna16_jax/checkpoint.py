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

import contextlib
import dataclasses
import json
import math
import os
import re
from collections import defaultdict
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import numpy as np

from . import packing
from .errors import (
    ConfigError,
    CorruptFileError,
    DTypeError,
    MissingTensorError,
    ShapeError,
    UnexpectedTensorError,
    UnsafePathError,
    UnsupportedError,
    ValueRangeError,
    check_divisible,
)
from .quantize import quantize_rtn
from .safetensors_io import SafetensorsFile, confined_path, load_json
from .schemes import QuantConfig, QuantMethod, QuantScheme
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

    #: the config.json keys the sizes came from (for messages)
    num_experts_field: str = "num_experts"
    hidden_size_field: str = "hidden_size"
    intermediate_size_field: str = "moe_intermediate_size"

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "MoEModelConfig":
        if not isinstance(config, Mapping):
            raise ConfigError(f"config.json: expected a JSON object, got {type(config).__name__}")
        mt = config.get("model_type", "unknown")
        if not isinstance(mt, str):
            raise ConfigError(f"config.json: field 'model_type' must be a string, got {mt!r}")

        def first(*keys) -> tuple[str, int]:
            for k in keys:
                if config.get(k) is not None:
                    return k, _positive_int(config, k)
            raise ConfigError(f"config.json: none of the fields {keys} is present (model_type {mt!r})")

        def opt_int(key):
            return None if config.get(key) is None else _positive_int(config, key)

        def opt(key, kinds, default):
            v = config.get(key)
            if v is None:
                return default
            if not isinstance(v, kinds) or (bool not in kinds and isinstance(v, bool)):
                raise ConfigError(f"config.json: field {key!r} must be {kinds[0].__name__}, got {v!r}")
            return v

        e_key, e = first("num_local_experts", "num_experts", "n_routed_experts")
        _, top_k = first("num_experts_per_tok")
        h_key, h = first("hidden_size")
        i_key, i = first("moe_intermediate_size", "intermediate_size")
        if top_k > e:
            raise ConfigError(f"config.json: num_experts_per_tok ({top_k}) exceeds {e_key} ({e})")
        topk_method = config.get("topk_method")
        grouped = topk_method in ("group_limited_greedy", "noaux_tc")
        act = opt("hidden_act", (str,), "silu")
        act = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu",
               "gelu_pytorch_tanh": "gelu"}.get(act, act)
        default_renorm = mt == "mixtral" or mt.startswith("qwen3")
        scoring = opt("scoring_func", (str,), "softmax")
        if scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"config.json: field 'scoring_func' must be 'softmax' or 'sigmoid', got {scoring!r}")
        n_group = opt_int("n_group") if grouped else None
        topk_group = opt_int("topk_group") if grouped else None
        if n_group and e % n_group:
            raise ConfigError(f"config.json: n_group ({n_group}) does not divide {e_key} ({e})")
        if n_group and topk_group and topk_group > n_group:
            raise ConfigError(f"config.json: topk_group ({topk_group}) exceeds n_group ({n_group})")
        scale = opt("routed_scaling_factor", (int, float), 1.0) or 1.0
        if not math.isfinite(scale):
            raise ConfigError(f"config.json: field 'routed_scaling_factor' must be finite, got {scale!r}")
        shared_i = opt_int("shared_expert_intermediate_size")
        n_shared = config.get("n_shared_experts")
        n_shared = (1 if shared_i else 0) if n_shared in (None, 0) else _positive_int(config, "n_shared_experts")
        return cls(
            model_type=mt,
            num_experts=e,
            top_k=top_k,
            hidden_size=h,
            moe_intermediate_size=i,
            renormalize=opt("norm_topk_prob", (bool,), default_renorm),
            scoring_func=scoring,
            num_expert_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(scale),
            activation=act,
            num_shared_experts=n_shared,
            shared_expert_intermediate_size=shared_i,
            num_experts_field=e_key,
            hidden_size_field=h_key,
            intermediate_size_field=i_key,
        )


@pytree_dataclass(meta=("hidden_size", "intermediate_size"))
class DenseWeights(ExpertsMixin):
    """Unquantized experts (e.g. shared experts listed in a checkpoint's ``ignore``):
    ``w13 [E, 2I, H]`` (gate first), ``w2 [E, H, I]``, optional biases (plain arrays, no
    quantized matrices)."""

    GEMMS: ClassVar[tuple[str, ...]] = ()

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

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])


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

#: one regex per tensor name, run once per checkpoint: ``<prefix>.layers.L.<block>.<rest>``.
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>block_sparse_moe|mlp))\.(?P<rest>.+)$")
_EXPERT_REST = re.compile(r"^experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z0-9_]+)$")
_SHARED_REST = re.compile(r"^(?P<which>shared_experts|shared_expert)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z0-9_]+)$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclasses.dataclass
class _LayerNames:
    """The tensor names of one MoE layer, indexed once when the checkpoint is opened."""

    prefix: str
    experts: dict = dataclasses.field(default_factory=dict)     # e -> proj -> suffix -> name
    shared: dict = dataclasses.field(default_factory=dict)      # proj -> suffix -> name
    shared_prefix: str | None = None
    router: str | None = None
    score_bias: str | None = None
    shared_gate: str | None = None
    naming: str = ""

    def tensor_names(self) -> list[str]:
        """Every tensor name of the layer (experts, shared experts, router, gates)."""
        out = [n for projs in self.experts.values() for sfx in projs.values() for n in sfx.values()]
        out += [n for sfx in self.shared.values() for n in sfx.values()]
        return out + [n for n in (self.router, self.score_bias, self.shared_gate) if n is not None]


def _index_names(names) -> dict[int, _LayerNames]:
    layers: dict[int, _LayerNames] = {}
    for name in names:
        m = _LAYER_RE.match(name)
        if m is None:
            continue
        rest = m["rest"]
        if rest.startswith("experts."):
            x = _EXPERT_REST.match(rest)
            if x is None:
                continue
            info = layers.setdefault(int(m["layer"]), _LayerNames(m["prefix"]))
            info.experts.setdefault(int(x["expert"]), {}).setdefault(x["proj"], {})[x["suffix"]] = name
        elif rest.startswith("shared_expert"):
            x = _SHARED_REST.match(rest)
            info = layers.setdefault(int(m["layer"]), _LayerNames(m["prefix"]))
            if x is not None:
                info.shared_prefix = f"{m['prefix']}.{x['which']}"
                info.shared.setdefault(x["proj"], {})[x["suffix"]] = name
            elif rest == "shared_expert_gate.weight":
                info.shared_gate = name
        elif rest in ("gate.weight", "gate.e_score_correction_bias"):
            info = layers.setdefault(int(m["layer"]), _LayerNames(m["prefix"]))
            if rest == "gate.weight":
                info.router = name
            else:
                info.score_bias = name
    # Keep layers with routed experts only (a dense layer's mlp.gate_proj is not indexed above).
    return {li: info for li, info in sorted(layers.items()) if info.experts}


def _positive_int(config: Mapping[str, Any], key: str, where: str = "config.json") -> int:
    v = config[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, float) and not v.is_integer() \
            or v < 1:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return int(v)


class Checkpoint:
    """A Hugging Face checkpoint folder with quantized MoE experts, read lazily.

    Opening reads ``config.json``, the index (or the one safetensors file's header) and indexes
    every tensor name by layer, expert and projection once; :meth:`load_layer` then reads just
    that layer's tensors. Every file name taken from the index must stay inside the folder
    (symbolic links inside it are followed); pickled ``*.bin`` weights are never read.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ConfigError(f"{self.path!r}: not a folder (expected a checkpoint folder with "
                              "config.json and safetensors files)")
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"config.json: not found in {self.path!r}")
        self.config = load_json(cfg_path, what="config.json")
        if not isinstance(self.config, dict):
            raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(self.config).__name__}")
        self.quant_config = QuantConfig.from_hf_config(self.config)
        self.model_config = MoEModelConfig.from_hf_config(self.config)
        self._files: dict[str, SafetensorsFile] = {}
        self._held_fds: dict[str, int] | None = None
        self._weight_map = self._read_weight_map()
        self._layers = _index_names(self._weight_map)
        self._check_names()
        self.scheme = self.quant_config.experts_scheme(
            (f"{info.prefix}.experts.{e}.{proj}" for info in self._layers.values()
             for e, projs in info.experts.items() for proj in projs),
            where=cfg_path)

    # ------------------------------------------------------------------ files
    def _read_weight_map(self) -> dict[str, str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            doc = load_json(index, what="the safetensors index")
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict) or not wm:
                raise CorruptFileError(f"{index}: expected an object with a non-empty 'weight_map' "
                                       f"object, got {type(wm).__name__ if wm is not None else 'none'}")
            for tensor, fname in wm.items():
                confined_path(self.path, fname, source=f"{index}: weight_map[{tensor!r}]")
                if not fname.endswith(".safetensors"):
                    raise UnsafePathError(f"{index}: weight_map[{tensor!r}] names {fname!r}; only "
                                          "*.safetensors files are read (never pickled weights)")
            missing = sorted({v for v in wm.values() if not os.path.isfile(os.path.join(self.path, v))})
            if missing:
                raise MissingTensorError(f"{index}: shard files not found: {missing}")
            return dict(wm)
        listing = os.listdir(self.path)
        files = sorted(f for f in listing if f.endswith(".safetensors"))
        if not files:
            pickles = sorted(f for f in listing if f.endswith(_PICKLE_SUFFIXES))
            if pickles:
                raise UnsupportedError(
                    f"{self.path!r}: only pickled weights ({pickles[:4]}); this library never "
                    "unpickles files (loading a pickle can run code): save the model as safetensors")
            raise MissingTensorError(f"{self.path!r}: no *.safetensors file and no "
                                     "model.safetensors.index.json")
        if len(files) > 1:
            raise ConfigError(
                f"{self.path!r}: {len(files)} safetensors files but no model.safetensors.index.json: {files}")
        return {k: files[0] for k in self._file(files[0]).keys()}

    def _file(self, fname: str) -> SafetensorsFile:
        f = self._files.get(fname)
        if f is None:
            f = self._files[fname] = SafetensorsFile(os.path.join(self.path, fname))
        return f

    def tensor_names(self) -> list[str]:
        return sorted(self._weight_map)

    def tensor_info(self, name: str):
        """Header entry (dtype, shape, offsets) of tensor ``name``, without reading its data."""
        if name not in self._weight_map:
            raise MissingTensorError(f"{name}: tensor not found in {self.path!r}")
        return self._file(self._weight_map[name]).info(name)

    def read_tensor(self, name: str) -> np.ndarray:
        """Read one tensor (any tensor of the checkpoint) as a numpy array."""
        return self._read([name])[name]

    def _read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Read the named tensors, one descriptor per shard file, in file order."""
        return self._read_many((), names)

    def _read_many(self, into: Sequence[tuple[str, np.ndarray]], names: Sequence[str]) -> dict[str, np.ndarray]:
        """Read each ``(name, destination)`` of ``into`` straight into its destination and each
        of ``names`` into a new array (returned by name), per shard in file order."""
        jobs: dict[str, list[tuple[int, str, np.ndarray | None]]] = defaultdict(list)
        for n, dst in [*into, *((n, None) for n in names)]:
            if n not in self._weight_map:
                raise MissingTensorError(f"{n}: tensor not found in {self.path!r}")
            fname = self._weight_map[n]
            jobs[fname].append((self._file(fname).info(n).begin, n, dst))
        out = {}
        held = self._held_fds or {}
        for fname, todo in jobs.items():
            f = self._file(fname)
            fd = held.get(fname)
            own = fd is None
            if own:
                fd = f.open_fd()
            try:
                for _, n, dst in sorted(todo, key=lambda j: j[0]):
                    if dst is None:
                        out[n] = f.read(n, fd)
                    else:
                        f.read_into(n, dst, fd)
            finally:
                if own:
                    os.close(fd)
        return out

    @contextlib.contextmanager
    def _reading(self, names: Sequence[str]):
        """Hold one descriptor per shard while ``names`` are read (one sequential stream per
        shard rather than one per expert, so the kernel's read-ahead carries over), and ask the
        kernel to start reading their byte span now (``POSIX_FADV_WILLNEED``)."""
        spans: dict[str, tuple[int, int]] = {}
        for n in names:
            if n not in self._weight_map:
                raise MissingTensorError(f"{n}: tensor not found in {self.path!r}")
            fname = self._weight_map[n]
            t = self._file(fname).info(n)
            lo, hi = spans.get(fname, (t.begin, t.end))
            spans[fname] = (min(lo, t.begin), max(hi, t.end))
        fds: dict[str, int] = {}
        try:
            for fname, (lo, hi) in spans.items():
                f = self._file(fname)
                fds[fname] = fd = f.open_fd()
                if hasattr(os, "posix_fadvise") and hi > lo:
                    os.posix_fadvise(fd, f.data_start + lo, hi - lo, os.POSIX_FADV_WILLNEED)
            self._held_fds = fds
            yield
        finally:
            self._held_fds = None
            for fd in fds.values():
                os.close(fd)

    # ------------------------------------------------------------------ naming
    def _check_names(self) -> None:
        if not self._layers:
            sample = sorted({re.sub(r"\.\d+\.", ".N.", n).rsplit(".", 1)[0] for n in self._weight_map})[:12]
            raise ConfigError(
                f"{self.path!r}: no MoE expert tensors recognised (expected names like "
                "'model.layers.L.block_sparse_moe.experts.E.w1.qweight' or "
                f"'model.layers.L.mlp.experts.E.gate_proj.qweight'); found e.g. {sample}")
        cfg = self.model_config
        for li, info in self._layers.items():
            projs = set().union(*(set(p) for p in info.experts.values()))
            naming = "mixtral" if projs & {"w1", "w2", "w3"} else "qwen"
            want = {_NAMINGS[naming][r] for r in ("gate", "up", "down")}
            if projs != want:
                raise ConfigError(
                    f"layer {li}: expert projections {sorted(projs)} do not match a known naming "
                    f"(expected {sorted(want)})")
            info.naming = naming
            n = len(info.experts)
            if set(info.experts) != set(range(n)):
                raise MissingTensorError(
                    f"layer {li}: experts must be numbered 0..{n - 1}, found {sorted(info.experts)}")
            for e, p in info.experts.items():
                if set(p) != want:
                    raise MissingTensorError(
                        f"{info.prefix}.experts.{e}: projections {sorted(want - set(p))} missing")
            if n != cfg.num_experts:
                raise ConfigError(
                    f"config.json: {cfg.num_experts_field} says {cfg.num_experts} experts, but layer "
                    f"{li} has tensors for {n} ({info.prefix}.experts.0..{n - 1})")

    @property
    def moe_layer_indices(self) -> list[int]:
        return list(self._layers)

    def num_experts(self, layer_index: int) -> int:
        return len(self._layer_info(layer_index).experts)

    def _layer_info(self, layer_index: int) -> _LayerNames:
        if layer_index not in self._layers:
            raise ValueRangeError(
                f"layer_index: {layer_index} is not a MoE layer of {self.path!r}; "
                f"MoE layers are {self.moe_layer_indices}")
        return self._layers[layer_index]

    # ------------------------------------------------------------------ loading
    def load_layer(self, layer_index: int, *, tp_size: int = 1, tp_rank: int = 0) -> MoELayer:
        """Load one MoE layer (routed experts, router, shared experts) into the loader layout.

        Every tensor is checked against the scheme (dtype and shape from the file header, before
        any data is read), the sizes against ``config.json``, the scales for NaN / Inf and the
        group indices for range; errors name the tensor as the file names it.
        """
        if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
            raise ConfigError(f"tp_size: expected a positive integer, got {tp_size!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, (int, np.integer)) or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank!r}")
        info = self._layer_info(layer_index)
        with self._reading(info.tensor_names()):
            return self._load_layer(layer_index, info, tp_size, tp_rank)

    def _load_layer(self, layer_index: int, info: _LayerNames, tp_size: int, tp_rank: int) -> MoELayer:
        names = _NAMINGS[info.naming]
        layer = f"layer {layer_index}"
        experts = _ExpertLoader(self, self.scheme, names, layer).load(info.experts, tp_size, tp_rank)
        cfg = self.model_config
        for field, want, got in ((cfg.hidden_size_field, experts.hidden_size, cfg.hidden_size),
                                 (cfg.intermediate_size_field, experts.intermediate_size * tp_size,
                                  cfg.moe_intermediate_size)):
            if want != got:
                raise ConfigError(f"config.json: {field} is {got}, but the expert tensors of {layer} "
                                  f"have {want} ({info.prefix}.experts.0)")
        e = len(info.experts)
        if info.router is None:
            raise MissingTensorError(f"{info.prefix}.gate.weight: router weight not found")
        router = self._checked_float(info.router, (e, experts.hidden_size))
        e_bias = None if info.score_bias is None else self._checked_float(info.score_bias, (e,))
        shared = None
        if info.shared:
            shared = _load_shared(self, info, tp_size, tp_rank, layer=layer, hidden=experts.hidden_size)
        shared_gate = None
        if info.shared_gate is not None:
            if shared is None:
                raise MissingTensorError(f"{info.shared_gate}: a shared-expert gate without shared "
                                         f"expert tensors ({info.prefix}.shared_expert.*)")
            shared_gate = self._checked_float(info.shared_gate, (1, experts.hidden_size))
        return MoELayer(layer_index, experts, router, e_bias, shared, shared_gate)

    def _checked_float(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        t = self.tensor_info(name)
        where = f"{name} in {self._weight_map[name]}"
        if t.dtype.kind != "f" and t.dtype_name not in ("BF16",):
            raise DTypeError(f"{where}: expected a float tensor, got {t.dtype_name}")
        if tuple(t.shape) != tuple(shape):
            raise ShapeError(f"{where}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        a = self.read_tensor(name)
        if not np.isfinite(a.astype(np.float32)).all():
            raise ValueRangeError(f"{where}: holds NaN or Inf")
        return a

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


_INT_DTYPES = ("I32",)
_INDEX_DTYPES = ("I32", "I64")
_SCALE_DTYPES = ("F16", "BF16", "F32")


def _st_names(names) -> list[str]:
    """safetensors dtype names with numpy's beside them: ``I32 (int32)``."""
    from .safetensors_io import DTYPES

    return [f"{n} ({DTYPES[n].name})" if n in DTYPES else n for n in names]


class _ExpertLoader:
    """Reads one layer's experts (``E`` × gate / up / down) into a :class:`CheckpointWeights`.

    1. From the file headers alone: every tensor's suffix is known, its dtype is the scheme's,
       its shape is what expert 0's sizes imply (``H``, ``I``, groups, packing) — errors name the
       tensor and its file.
    2. One read per tensor into a preallocated stack (peak memory: the layer plus one tensor).
    3. Values: scales finite, ``g_idx`` in range (and trivial without act-order), gate and up
       sharing one ``g_idx``, symmetric GPTQ zero points equal to the implicit offset.
    """

    def __init__(self, ckpt: Checkpoint, scheme: QuantScheme, names: dict, layer: str):
        self.ckpt, self.scheme, self.names, self.layer = ckpt, scheme, names, layer
        self.suff = _SUFFIXES[scheme.method]

    def _where(self, name: str) -> str:
        return f"{name} (in {self.ckpt._weight_map[name]})"

    def _expected(self, h: int, i: int) -> dict[str, dict[str, tuple[tuple[int, ...], tuple[str, ...]]]]:
        """role → file suffix → (per-expert shape, allowed dtypes) for sizes ``h``, ``i``."""
        s, pf, g = self.scheme, self.scheme.pack_factor, self.scheme.group_size
        m = s.method
        cdiv = lambda a, b: -(-a // b)  # noqa: E731
        out = {}
        for role, (n, k) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            groups = s.num_groups(k)
            if m is QuantMethod.AWQ:
                d = {"qweight": ((k, n // pf), _INT_DTYPES), "scales": ((groups, n), _SCALE_DTYPES),
                     "qzeros": ((groups, n // pf), _INT_DTYPES)}
            elif m is QuantMethod.GPTQ:
                d = {"qweight": ((k // pf, n), _INT_DTYPES), "scales": ((groups, n), _SCALE_DTYPES),
                     "qzeros": ((groups, n // pf), _INT_DTYPES), "g_idx": ((k,), _INDEX_DTYPES)}
            else:
                d = {"weight_packed": ((n, cdiv(k, pf)), _INT_DTYPES),
                     "weight_scale": ((n, groups), _SCALE_DTYPES),
                     "weight_zero_point": ((cdiv(n, pf), groups), _INT_DTYPES),
                     "weight_g_idx": ((k,), _INDEX_DTYPES), "weight_shape": ((2,), _INDEX_DTYPES)}
            if not s.act_order and m is not QuantMethod.GPTQ:
                d.pop("weight_g_idx", None)    # GPTQ writes a trivial g_idx; the others only with act-order
            d["bias"] = ((n,), _SCALE_DTYPES)
            out[role] = d
        del g
        return out

    def _sizes(self, e0: dict) -> tuple[int, int]:
        """``(H, I)`` from expert 0's gate and down packed weights (header shapes only)."""
        m, pf = self.scheme.method, self.scheme.pack_factor
        q = self.suff["qweight"]
        for role in ("gate", "down"):
            if q not in e0[self.names[role]]:
                raise MissingTensorError(f"{self._prefix0(e0)}.{self.names[role]}.{q}: required by "
                                         f"{self.scheme.describe()}, not found")
        gate_name, down_name = e0[self.names["gate"]][q], e0[self.names["down"]][q]
        gi, di = self.ckpt.tensor_info(gate_name), self.ckpt.tensor_info(down_name)
        for nm, t in ((gate_name, gi), (down_name, di)):
            if len(t.shape) != 2:
                raise ShapeError(f"{self._where(nm)}: expected a rank-2 packed tensor, got shape {t.shape}")
        if m is QuantMethod.AWQ:
            return gi.shape[0], gi.shape[1] * pf
        if m is QuantMethod.GPTQ:
            return gi.shape[0] * pf, gi.shape[1]
        shape_name = e0[self.names["gate"]].get("weight_shape")
        h = gi.shape[1] * pf
        if shape_name is not None:
            st = self.ckpt.read_tensor(shape_name)
            if st.shape != (2,) or st.dtype.kind not in "iu" or int(st[0]) != gi.shape[0] or \
                    not 0 < int(st[1]) <= h or -(-int(st[1]) // pf) != gi.shape[1]:
                raise ShapeError(f"{self._where(shape_name)}: expected [{gi.shape[0]}, K] with "
                                 f"ceil(K / {pf}) == {gi.shape[1]}, got {st.tolist()}")
            h = int(st[1])
        return h, gi.shape[0]

    def _prefix0(self, e0: dict) -> str:
        name = next(iter(next(iter(e0.values())).values()))
        return name.rsplit(".", 2)[0]

    def _check_headers(self, experts: dict, expected: dict, required: set, h: int, i_full: int) -> bool:
        """Phase 1, file headers only: every tensor of every expert has a known suffix, the
        scheme's dtype and the shape the sizes imply; the required ones are present; biases on
        all projections or none. Returns whether the experts carry biases."""
        s, e = self.scheme, len(experts)
        has_bias = None
        first: dict[str, tuple[str, str]] = {}      # suffix → (dtype, tensor) of its first tensor
        for ei in range(e):
            for role in ("gate", "up", "down"):
                tensors = experts[ei][self.names[role]]
                for suffix, name in tensors.items():
                    if suffix not in expected[role]:
                        raise UnexpectedTensorError(
                            f"{self._where(name)}: unexpected tensor for a {s.describe()} expert "
                            f"(known suffixes: {sorted(expected[role])})")
                    shape, dtypes = expected[role][suffix]
                    t = self.ckpt.tensor_info(name)
                    if t.dtype_name not in dtypes:
                        raise DTypeError(f"{self._where(name)}: expected dtype "
                                         f"{' or '.join(_st_names(dtypes))}, got {_st_names([t.dtype_name])[0]}")
                    if tuple(t.shape) != shape:
                        raise ShapeError(f"{self._where(name)}: expected shape {shape} (H={h}, I={i_full}, "
                                         f"{s.describe()}), got {tuple(t.shape)}")
                    dt0, name0 = first.setdefault(suffix, (t.dtype_name, name))
                    if t.dtype_name != dt0:
                        raise DTypeError(f"{self._where(name)}: expected dtype {_st_names([dt0])[0]} like "
                                         f"{name0} (one dtype per tensor kind in a layer), got "
                                         f"{_st_names([t.dtype_name])[0]}")
                base = next(iter(tensors.values())).rsplit(".", 1)[0]
                for suffix in sorted(required - set(tensors)):
                    raise MissingTensorError(f"{base}.{suffix}: required by {s.describe()}, not found")
                bias = "bias" in tensors
                if has_bias is None:
                    has_bias = bias
                if bias != has_bias:
                    raise MissingTensorError(f"{base}.bias: {'present' if bias else 'missing'}, but "
                                             f"{'absent' if has_bias else 'present'} in "
                                             f"{self._prefix0(experts[0])}; all projections or none carry biases")
        return bool(has_bias)

    def _field_specs(self, has_bias: bool, sl_n, sl_k, tp_size: int) -> dict[str, list[tuple[str, str, int, slice]]]:
        """Stacked field → its parts: ``(role, suffix key, axis, slice of that axis)``; two parts
        (gate, up) are concatenated along ``axis``."""
        s = self.scheme
        m, g, pf = s.method, s.group_size, s.pack_factor
        n_axis = 0 if m is QuantMethod.COMPRESSED_TENSORS else 1     # gate/up output axis
        k_axis = 1 if m is QuantMethod.COMPRESSED_TENSORS else 0     # down's input axis
        gsl = slice(None) if (g == -1 or (s.act_order and tp_size > 1)) else sl_k(g)
        specs = {}
        for key in ["qweight", "scales"] + (["qzeros"] if s.zero_point else []):
            # the unit of the output (N) axis: packed words where N is packed (AWQ weights,
            # every zero-point tensor), one entry otherwise
            packed_n = key == "qzeros" or (key == "qweight" and m is QuantMethod.AWQ)
            sl = sl_n(pf if packed_n else 1)
            specs["w13_" + key] = [("gate", key, n_axis, sl), ("up", key, n_axis, sl)]
            if key == "qweight":          # K packed (GPTQ, compressed-tensors) or not (AWQ)
                w2_sl = sl_k(1 if m is QuantMethod.AWQ else pf)
            else:                         # per group of K
                w2_sl = sl_k(g) if m is QuantMethod.AWQ else gsl
            specs["w2_" + key] = [("down", key, k_axis, w2_sl)]
        if has_bias:
            specs["w13_bias"] = [("gate", "bias", 0, sl_n(1)), ("up", "bias", 0, sl_n(1))]
            specs["w2_bias"] = [("down", "bias", 0, slice(None))]
        if s.act_order:
            specs["w13_g_idx"] = [("gate", "g_idx", 0, slice(None))]
            specs["w2_g_idx"] = [("down", "g_idx", 0, sl_k(1))]
        return specs

    def _place(self, name: str, a: np.ndarray, dst: np.ndarray, axis: int, sl: slice) -> None:
        """Copy the slice ``sl`` along ``axis`` of the tensor ``a`` (read as ``name``) into its
        place in a stack; a wider integer type is narrowed only when every value fits."""
        if a.dtype != dst.dtype and a.size and (a.min() < np.iinfo(np.int32).min
                                                or a.max() > np.iinfo(np.int32).max):
            raise ValueRangeError(f"{self._where(name)}: group indices must fit int32, got "
                                  f"[{a.min()}, {a.max()}]")
        idx = [slice(None)] * a.ndim
        idx[axis] = sl
        dst[...] = a[tuple(idx)]

    def load(self, experts: dict, tp_size: int, tp_rank: int) -> CheckpointWeights:
        s, layer = self.scheme, self.layer
        m, g, pf = s.method, s.group_size, s.pack_factor
        e = len(experts)
        h, i_full = self._sizes(experts[0])
        if g != -1:
            check_divisible(f"{layer}: hidden size", h, g, "group_size must divide H")
            check_divisible(f"{layer}: intermediate size", i_full, g, "group_size must divide I")
        expected = self._expected(h, i_full)
        required = {self.suff["qweight"], self.suff["scales"]}
        if s.zero_point:
            required.add(self.suff["qzeros"])
        if s.act_order:
            required.add(self.suff["g_idx"])
        # 1. headers: names, dtypes, shapes of every tensor of every expert.
        has_bias = self._check_headers(experts, expected, required, h, i_full)
        i_local = i_full // tp_size

        def sl_n(unit):
            return _tp_slice(i_full, tp_size, tp_rank, unit, f"{layer} gate/up")

        def sl_k(unit):
            return _tp_slice(i_full, tp_size, tp_rank, unit, f"{layer} down")

        if s.zero_point and m is QuantMethod.COMPRESSED_TENSORS:
            check_divisible(f"{layer}: intermediate size for packed zero points", i_local, pf)
        specs = self._field_specs(has_bias, sl_n, sl_k, tp_size)

        # 2. one stack per field, allocated from the header shapes; each tensor read straight
        # into its place where that place is contiguous (down, compressed-tensors' gate / up),
        # the others (K-first gate / up halves, TP slices, int64 g_idx) through a temporary.
        def file_name(ei, role, key):
            return experts[ei][self.names[role]].get(self.suff.get(key, key))

        stacks: dict[str, np.ndarray] = {}
        plan = []      # per stacked part: (key, role, file suffix, axis, slice, index in the stack, direct?)
        for key, parts in specs.items():
            shape, off, part_plans = None, 0, []
            for role, k, axis, sl in parts:
                full = expected[role][self.suff.get(k, k)][0]
                sub = list(full)
                sub[axis] = len(range(*sl.indices(full[axis])))
                idx = [slice(None)] * len(full)
                idx[axis] = slice(off, off + sub[axis])
                off += sub[axis]
                part_plans.append([key, role, self.suff.get(k, k), axis, sl, tuple(idx), sub[axis] == full[axis]])
                if shape is None:
                    shape = sub
                else:
                    shape[axis] += sub[axis]
            t0 = self.ckpt.tensor_info(file_name(0, parts[0][0], parts[0][1]))
            dtype = np.dtype(np.int32) if key.endswith("g_idx") else t0.dtype.newbyteorder("=")
            stacks[key] = np.empty([e] + shape, dtype)
            for pp in part_plans:       # one dtype per suffix (checked above): decided on expert 0
                pp[6] = (pp[6] and t0.dtype.newbyteorder("=") == dtype
                         and stacks[key][0][pp[5]].flags.c_contiguous)
            plan += part_plans
        # tensors read only to be checked, into stacks of their own: (role, key) → stack, present
        extra: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        wanted = []
        if m is QuantMethod.GPTQ and not s.zero_point:
            wanted += [(r, "qzeros") for r in ("gate", "up", "down")]
        if m is QuantMethod.GPTQ and not s.act_order:
            wanted += [(r, "g_idx") for r in ("gate", "up", "down")]
        if s.act_order:
            wanted.append(("up", "g_idx"))
        for role, k in wanted:
            n0 = next((file_name(ei, role, k) for ei in range(e) if file_name(ei, role, k)), None)
            if n0 is not None:
                t0 = self.ckpt.tensor_info(n0)
                extra[role, k] = (np.empty((e,) + t0.shape, t0.dtype.newbyteorder("=")), np.zeros(e, bool))
        for ei in range(e):
            names = {role: experts[ei][self.names[role]] for role in ("gate", "up", "down")}
            direct: list[tuple[str, np.ndarray]] = []     # read straight into the stack
            via: dict[str, tuple[np.ndarray, int, slice]] = {}   # read, then copied (sliced, cast) into it
            for key, role, suffix, axis, sl, idx, whole in plan:
                name = names[role][suffix]
                if whole:
                    direct.append((name, stacks[key][ei][idx]))
                else:
                    via[name] = (stacks[key][ei][idx], axis, sl)
            for (role, k), (stack, present) in extra.items():
                name = names[role].get(self.suff.get(k, k))
                if name is not None:
                    direct.append((name, stack[ei]))
                    present[ei] = True
            got = self.ckpt._read_many(direct, list(via))
            for name, (dst, axis, sl) in via.items():
                self._place(name, got[name], dst, axis, sl)
        # 3. values, once per layer, in numpy, before anything is converted
        _ValueChecks(self, h, i_full).check(stacks, extra, specs, file_name)
        weights = CheckpointWeights.of(**stacks, scheme=s, hidden_size=h, intermediate_size=i_local)
        return weights.validate()


_NONFINITE_BITS = {np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(np.float32): (np.uint32, 0x7F800000),
                   np.dtype(np.float64): (np.uint64, 0x7FF0000000000000)}


def _nonfinite(a: np.ndarray) -> np.ndarray:
    """``~isfinite(a)`` from the exponent bits (all ones: Inf or NaN), without a float copy."""
    if a.dtype.name == "bfloat16":
        return (a.view(np.uint16) & 0x7F80) == 0x7F80
    kind, mask = _NONFINITE_BITS[a.dtype]
    return (a.view(kind) & kind(mask)) == kind(mask)


class _ValueChecks:
    """The value checks of one layer's experts: scales finite, group indices in range (natural
    without act-order, gate and up sharing one), symmetric GPTQ zero points equal to the
    implicit offset. Vectorized over the stacks; errors name the tensor as the file names it."""

    def __init__(self, loader: "_ExpertLoader", h: int, i_full: int):
        self.loader, self.h, self.i_full = loader, h, i_full
        s = loader.scheme
        self.natural = {k: (np.zeros(k, np.int64) if s.group_size == -1 else np.arange(k) // s.group_size)
                        for k in {h, i_full}}
        if s.method is QuantMethod.GPTQ and not s.zero_point:
            want = s.implicit_zero - 1 if s.gptq_zeros_minus_one else s.implicit_zero
            self.sym_word = np.int32(np.uint32(sum(want << (s.bits * j) for j in range(s.pack_factor))).view(np.int32))

    def check(self, stacks: dict, extra: dict, specs: dict, file_name) -> None:
        self.extra(stacks, extra, file_name)
        self.stacks(stacks, specs, file_name)

    def extra(self, stacks: dict, extra: dict, file_name) -> None:
        """The tensors read only to be checked: symmetric zero points, natural (or shared) g_idx."""
        ld, s = self.loader, self.loader.scheme
        for (role, key), (stack, present) in extra.items():
            if key == "qzeros":
                bad = present & ~(stack == self.sym_word).reshape(len(stack), -1).all(axis=1)
                if bad.any():
                    ei = int(np.argmax(bad))
                    raise ValueRangeError(
                        f"{ld._where(file_name(ei, role, key))}: the config says sym=true, so every zero "
                        f"point must be the implicit {s.implicit_zero} (word "
                        f"{np.uint32(self.sym_word.view(np.uint32)):#010x}), found other values")
            elif s.act_order:                                    # up's g_idx against gate's
                bad = present & ~(stack == stacks["w13_g_idx"]).all(axis=1)
                if bad.any():
                    ei = int(np.argmax(bad))
                    raise ValueRangeError(f"{ld._where(file_name(ei, role, key))}: gate and up g_idx differ; "
                                          "the fused w13 holds one g_idx per expert")
            else:
                natural = self.natural[self.h if role != "down" else self.i_full]
                bad = present & ~(stack == natural).all(axis=1)
                if bad.any():
                    ei = int(np.argmax(bad))
                    raise ConfigError(f"{ld._where(file_name(ei, role, key))}: rows are not in natural group "
                                      "order, but the config has desc_act=false")

    def stacks(self, stacks: dict, specs: dict, file_name) -> None:
        ld, s = self.loader, self.loader.scheme
        for key in ("w13_scales", "w2_scales"):
            bad = _nonfinite(stacks[key])
            if bad.any():
                pos = np.argwhere(bad)[0].tolist()
                ei, parts = pos[0], specs[key]
                role, axis = parts[0][0], parts[0][2]
                if len(parts) == 2 and pos[1 + axis] >= stacks[key].shape[1 + axis] // 2:
                    role = parts[1][0]
                raise ValueRangeError(
                    f"{ld._where(file_name(ei, role, 'scales'))}: scales must be finite, found "
                    f"{stacks[key][tuple(pos)]} (expert {ei}, {key} at {pos[1:]})")
        if s.act_order:
            for key, k, role in (("w13_g_idx", self.h, "gate"), ("w2_g_idx", self.i_full, "down")):
                gi, ng = stacks[key], s.num_groups(k)
                bad = (gi < 0) | (gi >= ng)
                if bad.any():
                    ei = int(np.argwhere(bad)[0][0])
                    raise ValueRangeError(
                        f"{ld._where(file_name(ei, role, 'g_idx'))}: group indices must lie in [0, {ng}), "
                        f"got [{gi[ei].min()}, {gi[ei].max()}] ({ld.layer} {key}, expert {ei})")


def _load_shared(ckpt: Checkpoint, info: _LayerNames, tp_size: int, tp_rank: int, *, layer: str,
                 hidden: int):
    """Shared expert(s) as one expert: quantized (same scheme) or float (``ignore``d)."""
    names = _NAMINGS["qwen"]
    missing = [names[r] for r in ("gate", "up", "down") if names[r] not in info.shared]
    if missing:
        raise MissingTensorError(f"{info.shared_prefix}: shared-expert projections {missing} not found")
    if all(set(info.shared[names[r]]) <= {"weight", "bias"} for r in ("gate", "up", "down")):
        t = ckpt._read([info.shared[names[r]]["weight"] for r in ("gate", "up", "down")
                        if "weight" in info.shared[names[r]]])
        gate, up, down = (t.get(info.shared[names[r]].get("weight")) for r in ("gate", "up", "down"))
        for r, a in zip(("gate", "up", "down"), (gate, up, down)):
            if a is None or a.ndim != 2:
                raise ShapeError(f"{info.shared_prefix}.{names[r]}.weight: expected a rank-2 float weight")
        i_full = gate.shape[0]
        if gate.shape != (i_full, hidden) or up.shape != gate.shape or down.shape != (hidden, i_full):
            raise ShapeError(f"{info.shared_prefix}: expected gate/up [{i_full}, {hidden}] and down "
                             f"[{hidden}, {i_full}], got {gate.shape}, {up.shape}, {down.shape}")
        sl = _tp_slice(i_full, tp_size, tp_rank, 1, f"{layer} shared expert")
        return DenseWeights(np.concatenate([gate[sl], up[sl]])[None], down[:, sl][None],
                            hidden_size=gate.shape[1], intermediate_size=i_full // tp_size)
    return _ExpertLoader(ckpt, ckpt.scheme, names, f"{layer} shared expert").load(
        {0: info.shared}, tp_size, tp_rank)


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
    return CheckpointWeights.of(**arrays, scheme=scheme, hidden_size=h, intermediate_size=i).validate()


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
