"""Hugging Face checkpoints: read MoE layers into the loader layout (writers: :mod:`wna16_jax.writers`).

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
import os
import re
from collections import defaultdict
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import numpy as np

from . import formats, packing
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
from .fields import check_expert_ids
from .model_config import MoEModelConfig
from .safetensors_io import SafetensorsFile, confined_path, load_json
from .schemes import QuantConfig, QuantMethod, QuantScheme
from .weights import CheckpointForm, CheckpointWeights, ExpertsMixin, QuantMatrix, pytree_dataclass

# --------------------------------------------------------------------------- naming

NAMINGS = {
    "mixtral": {"block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"},
    "qwen": {"block": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}
EXPERT_TENSOR_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>block_sparse_moe|mlp))"
    r"\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z_]+)$"
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


def index_by_module(names) -> dict[str, dict[str, str]]:
    """Tensor names by module and suffix: ``a.b.c.suffix`` → ``{"a.b.c": {"suffix": name}}``."""
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        modules.setdefault(module, {})[suffix] = name
    return modules


class Checkpoint:
    """A Hugging Face checkpoint folder with quantized MoE experts, read lazily.

    Opening reads ``config.json``, the index (or the one safetensors file's header) and indexes
    every tensor name by layer, expert and projection once; :meth:`load_layer` then reads just
    that layer's tensors. Every file name taken from the index must stay inside the folder
    (symbolic links inside it are followed); pickled ``*.bin`` weights are never read.
    """

    def __init__(self, path: str | os.PathLike, model_config: MoEModelConfig | None = None):
        """``model_config``: the MoE facts of ``config.json`` where the caller has parsed them
        already (:func:`~wna16_jax.models.load_model` passes its config's); else parsed here."""
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
        if model_config is not None and not isinstance(model_config, MoEModelConfig):
            raise ConfigError(f"model_config: expected a MoEModelConfig or None, got {type(model_config).__name__}")
        self._model_config = model_config or MoEModelConfig.from_hf_config(self.config)
        self._files: dict[str, SafetensorsFile] = {}
        self._modules: dict[str, dict[str, str]] | None = None
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

    @property
    def model_config(self) -> MoEModelConfig:
        """The MoE facts of ``config.json`` (parsed on opening, unless given)."""
        return self._model_config

    def module_tensors(self, module: str) -> dict[str, str]:
        """The tensors of ``module`` by suffix (``{"qweight": "<module>.qweight", ...}``; empty
        when it has none), indexed once."""
        if self._modules is None:
            self._modules = index_by_module(self._weight_map)
        return self._modules.get(module, {})

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
        return self.read_many((), names)

    def locate(self, name: str) -> str:
        """``name (in <shard file>)``, for messages."""
        return f"{name} (in {self._weight_map.get(name, '?')})"

    def read_many(self, into: Sequence[tuple[str, np.ndarray]], names: Sequence[str],
                  slices: Mapping[str, tuple[int, slice]] | None = None) -> dict[str, np.ndarray]:
        """Read each ``(name, destination)`` of ``into`` straight into its destination and each
        of ``names`` into a new array (returned by name), per shard in file order; a name of
        ``slices`` (``name: (axis, slice)``) is read as that slice only (its bytes alone)."""
        slices = slices or {}
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
                        out[n] = f.read(n, fd) if n not in slices else f.read_slice(n, *slices[n], fd)
                    else:
                        f.read_into(n, dst, fd)
            finally:
                if own:
                    os.close(fd)
        return out

    @contextlib.contextmanager
    def _reading(self, names: Sequence[str], advise: bool = True):
        """Hold one descriptor per shard while ``names`` are read (one sequential stream per
        shard rather than one per expert, so the kernel's read-ahead carries over), and (with
        ``advise``) ask the kernel to start reading their byte span now (``POSIX_FADV_WILLNEED``)."""
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
                if advise and hasattr(os, "posix_fadvise") and hi > lo:
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
            want = {NAMINGS[naming][r] for r in ("gate", "up", "down")}
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
    def load_layer(self, layer_index: int, *, tp_size: int = 1, tp_rank: int = 0,
                   experts: Sequence[int] | None = None, slice_shared: bool = True) -> MoELayer:
        """Load one MoE layer (routed experts, router, shared experts) into the loader layout.

        Every tensor is checked against the scheme (dtype and shape from the file header, before
        any data is read), the sizes against ``config.json``, the scales for NaN / Inf and the
        group indices for range; errors name the tensor as the file names it. ``experts``: the
        routed experts to read (increasing indices; None: all), for a process that holds only
        some of them on a mesh; the router and shared experts are read whole.
        ``slice_shared=False``: the shared experts are read whole under ``tp_size`` > 1 too.
        """
        info = self._chosen(layer_index, tp_size, tp_rank, experts)
        with self._reading(info.tensor_names(), advise=tp_size == 1):    # a TP slice: its bytes alone
            return self._load_layer(layer_index, info, tp_size, tp_rank, len(self._layers[layer_index].experts),
                                    bool(slice_shared))

    def _chosen(self, layer_index: int, tp_size: Any, tp_rank: Any, experts: Any):
        """The arguments of :meth:`load_layer` checked; the layer's names, of the routed experts
        only the chosen ones' (renumbered from 0)."""
        if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
            raise ConfigError(f"tp_size: expected a positive integer, got {tp_size!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, (int, np.integer)) or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank!r}")
        info = self._layer_info(layer_index)
        chosen = check_expert_ids(experts, len(info.experts))
        if chosen is not None:
            info = dataclasses.replace(info, experts={j: info.experts[e] for j, e in enumerate(chosen)})
        return info

    def load_routed_experts(self, layer_index: int, *, tp_size: int = 1, tp_rank: int = 0,
                            experts: Sequence[int] | None = None) -> CheckpointWeights:
        """The routed experts of :meth:`load_layer` alone (nothing else of the layer is read)."""
        info = self._chosen(layer_index, tp_size, tp_rank, experts)
        names = [n for projs in info.experts.values() for sfx in projs.values() for n in sfx.values()]
        with self._reading(names, advise=tp_size == 1):
            return self._routed(layer_index, info, tp_size, tp_rank)

    def _routed(self, layer_index: int, info: _LayerNames, tp_size: int, tp_rank: int) -> CheckpointWeights:
        return read_experts(self, self.scheme, info.experts, NAMINGS[info.naming], info.prefix + ".experts.{e}",
                            f"layer {layer_index}", tp_size, tp_rank)

    def _load_layer(self, layer_index: int, info: _LayerNames, tp_size: int, tp_rank: int,
                    num_experts: int, slice_shared: bool) -> MoELayer:
        layer = f"layer {layer_index}"
        experts = self._routed(layer_index, info, tp_size, tp_rank)
        cfg = self.model_config
        for field, want, got in ((cfg.hidden_size_field, experts.hidden_size, cfg.hidden_size),
                                 (cfg.intermediate_size_field, experts.intermediate_size * tp_size,
                                  cfg.moe_intermediate_size)):
            if want != got:
                raise ConfigError(f"config.json: {field} is {got}, but the expert tensors of {layer} "
                                  f"have {want} ({info.prefix}.experts.0)")
        e = num_experts
        if info.router is None:
            raise MissingTensorError(f"{info.prefix}.gate.weight: router weight not found")
        router = self._checked_float(info.router, (e, experts.hidden_size))
        e_bias = None if info.score_bias is None else self._checked_float(info.score_bias, (e,))
        shared = None
        if info.shared:
            shared = _load_shared(self, info, *((tp_size, tp_rank) if slice_shared else (1, 0)), layer=layer,
                                  hidden=experts.hidden_size)
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


def _st_names(names) -> list[str]:
    """safetensors dtype names with numpy's beside them: ``I32 (int32)``."""
    from .safetensors_io import DTYPES

    return [f"{n} ({DTYPES[n].name})" if n in DTYPES else n for n in names]


@dataclasses.dataclass(frozen=True)
class MatrixPart:
    """Rows of a matrix to read: ``tensors[e]`` maps each suffix to the tensor name of expert ``e``'s
    stored ``[n, K]`` matrix (one expert for a dense linear); ``label`` names it in messages
    (``model.layers.0.mlp.experts.{e}.gate_proj``-like, ``{e}`` filled with the expert)."""

    tensors: Sequence[Mapping[str, str]]
    n: int
    label: str


def read_matrix(ckpt: "Checkpoint", scheme: QuantScheme, parts: Sequence[MatrixPart], *, k: int,
                tp: tuple[int, int] = (1, 0), tp_axis: str | None = None, what: str = "") -> tuple[QuantMatrix, Any]:
    """One quantized matrix of ``E`` experts, ``[sum of the parts' n, k]``, stacked ``[E, ...]`` as the
    checkpoint stores it (:class:`~wna16_jax.weights.CheckpointForm`), and its bias ``[E, N]`` (or None).

    ``parts`` are concatenated along N (gate and up into ``w13``; q, k and v into one projection);
    ``tp = (size, rank)`` with ``tp_axis`` ``"n"`` (each part's outputs) or ``"k"`` (the inputs)
    reads rank ``rank``'s slice. The format table (:func:`wna16_jax.formats.tensors`) decides
    everything per tensor: from the file headers alone (:func:`_check_headers`), every suffix is
    known, its dtype allowed and one per role, its shape the table's, the required ones present,
    biases on every part or none; then each tensor is read once into its place in a preallocated
    stack (peak memory: the matrix plus one tensor); then the value rules
    (:func:`wna16_jax.formats.check_values`), and the parts share one ``g_idx``."""
    tables = [formats.tensors(scheme, p.n, k) for p in parts]
    has_bias = _check_headers(ckpt, scheme, parts, tables, k)
    plans = [_part_plan(scheme, p, table, tp, tp_axis, what) for p, table in zip(parts, tables)]
    stacks, slots = _allocate(ckpt, scheme, parts, plans, has_bias)
    checked = [_checked_stacks(ckpt, scheme, p, plan, slot, k) for p, plan, slot in zip(parts, plans, slots)]
    for ei in range(len(parts[0].tensors)):
        direct, via = [], {}
        for p, plan, slot, extra in zip(parts, plans, slots, checked):
            got = p.tensors[ei]
            for role, idx in slot.items():
                name, dst = got[plan[role].spec.suffix], stacks[role][ei][idx]
                same = ckpt.tensor_info(name).dtype.newbyteorder("=") == dst.dtype
                if plan[role].whole and same and dst.flags.c_contiguous:
                    direct.append((name, dst))
                else:
                    via[name] = (dst, plan[role])
            direct += [(got[plan[role].spec.suffix], stack[ei]) for role, stack in extra.items()
                       if plan[role].spec.suffix in got]
        read = ckpt.read_many(direct, list(via), {n: pl.sl for n, (_, pl) in via.items() if pl.sl is not None})
        for name, (dst, pl) in via.items():
            _place(ckpt, name, read[name], dst)             # read as its slice (pl.sl) alone
    for pi, (p, plan, slot) in enumerate(zip(parts, plans, slots)):
        _check_part_values(ckpt, scheme, p, plan, {**{r: stacks[r][(slice(None),) + i] for r, i in slot.items()},
                                                   **checked[pi]}, k, stacks.get("g_idx") if pi else None, parts[0])
    tp_size = tp[0]
    n_local = sum(p.n // (tp_size if tp_axis == "n" else 1) for p in parts)
    m = QuantMatrix(stacks["qweight"], stacks["scales"], stacks.get("qzeros") if scheme.zero_point else None,
                    stacks.get("g_idx"), bits=scheme.bits, group_size=scheme.group_size,
                    form=CheckpointForm(n_local, k // tp_size if tp_axis == "k" else k, scheme))
    return m, stacks.get("bias")


def _check_headers(ckpt: "Checkpoint", scheme: QuantScheme, parts: Sequence[MatrixPart], tables: list, k: int
                   ) -> bool:
    """Phase 1 of :func:`read_matrix`, file headers only. Returns whether the matrix has a bias."""
    dtypes: dict[str, tuple[str, str]] = {}                 # role → (dtype, first tensor)
    has_bias = None
    for p, table in zip(parts, tables):
        known = {t.suffix: t for t in table.values()}
        for ei, got in enumerate(p.tensors):
            for suffix, name in got.items():
                spec = known.get(suffix)
                if spec is None:
                    raise UnexpectedTensorError(f"{ckpt.locate(name)}: unexpected tensor for a {scheme.describe()} "
                                                f"matrix (known suffixes: {sorted(known)})")
                t = ckpt.tensor_info(name)
                if t.dtype_name not in spec.dtypes:
                    raise DTypeError(f"{ckpt.locate(name)}: expected dtype {' or '.join(_st_names(spec.dtypes))}, "
                                     f"got {_st_names([t.dtype_name])[0]}")
                if tuple(t.shape) != spec.shape:
                    raise ShapeError(f"{ckpt.locate(name)}: expected shape {spec.shape} (N={p.n}, K={k}, "
                                     f"{scheme.describe()}), got {tuple(t.shape)}")
                dt0, name0 = dtypes.setdefault(spec.role, (t.dtype_name, name))
                if t.dtype_name != dt0 and spec.role in ("qweight", "scales", "qzeros", "bias"):
                    raise DTypeError(f"{ckpt.locate(name)}: expected dtype {_st_names([dt0])[0]} like {name0} (one "
                                     f"dtype per tensor kind in a matrix), got {_st_names([t.dtype_name])[0]}")
            base = p.label.format(e=ei)
            for spec in table.values():
                if spec.need == formats.REQUIRED and spec.suffix not in got:
                    raise MissingTensorError(f"{base}.{spec.suffix}: required by {scheme.describe()}, not found")
            bias = "bias" in got
            has_bias = bias if has_bias is None else has_bias
            if bias != has_bias:
                raise MissingTensorError(f"{base}.bias: {'present' if bias else 'missing'}, but "
                                         f"{'absent' if has_bias else 'present'} in {parts[0].label.format(e=0)}; "
                                         "every part of a matrix carries a bias or none does")
    return bool(has_bias)


def _allocate(ckpt: "Checkpoint", scheme: QuantScheme, parts: Sequence[MatrixPart], plans: list, has_bias: bool
              ) -> tuple[dict[str, np.ndarray], list[dict[str, tuple]]]:
    """The matrix's stacks (role → ``[E, ...]``, the parts side by side along N; ``g_idx`` shared)
    and, per part, role → the index of its slot in the stack."""
    e = len(parts[0].tensors)
    stacks: dict[str, np.ndarray] = {}
    for role in formats.KEPT_ROLES + ("bias",):
        present = [pl[role] for pl in plans if role in pl and pl[role].spec.kept]
        if not present or (role == "bias" and not has_bias):
            continue
        t0 = ckpt.tensor_info(parts[0].tensors[0][present[0].spec.suffix])
        shape = list(present[0].local)
        if role != "g_idx":
            shape[present[0].spec.n_axis] = sum(pl.local[pl.spec.n_axis] for pl in present)
        stacks[role] = np.empty([e] + shape, np.int32 if role == "g_idx" else t0.dtype.newbyteorder("="))
    offsets = {role: 0 for role in stacks}
    slots = []
    for plan in plans:
        slot = {}
        for role, pl in plan.items():
            if role not in stacks or (role == "g_idx" and slots):      # later parts' g_idx: checked
                continue
            idx = [slice(None)] * len(pl.local)
            if role != "g_idx":
                ax = pl.spec.n_axis
                idx[ax] = slice(offsets[role], offsets[role] + pl.local[ax])
                offsets[role] += pl.local[ax]
            slot[role] = tuple(idx)
        slots.append(slot)
    return stacks, slots


def _checked_stacks(ckpt: "Checkpoint", scheme: QuantScheme, p: MatrixPart, plan: dict, slot: dict, k: int
                    ) -> dict[str, np.ndarray]:
    """Stacks for a part's tensors read only to be checked (whole, as stored); experts without
    the optional tensor hold the value it would need to have."""
    out = {}
    for role, pl in plan.items():
        name0 = next((got[pl.spec.suffix] for got in p.tensors if pl.spec.suffix in got), None)
        if name0 is None or role in slot or role == "bias":
            continue
        t0 = ckpt.tensor_info(name0)
        fill = {"g_idx": formats.natural_g_idx(scheme, k) if not scheme.act_order else 0,
                "qzeros": formats.symmetric_zero_word(scheme), "shape": np.asarray([p.n, k])}.get(role, 0)
        out[role] = np.empty((len(p.tensors),) + t0.shape, t0.dtype.newbyteorder("="))
        out[role][...] = fill
    return out


def _check_part_values(ckpt: "Checkpoint", scheme: QuantScheme, p: MatrixPart, plan: dict, arrays: dict, k: int,
                       shared_g_idx, first: MatrixPart) -> None:
    """The value rules of one part's arrays; a later part's ``g_idx`` must equal the first's."""
    if shared_g_idx is not None and "g_idx" in arrays:
        bad = ~(arrays.pop("g_idx") == shared_g_idx).all(axis=1)
        if bad.any():
            ei = int(np.argmax(bad))
            raise ValueRangeError(f"{ckpt.locate(p.tensors[ei][plan['g_idx'].spec.suffix])}: g_idx differs "
                                  f"from {first.label.format(e=ei)}'s; the fused matrix holds one g_idx")

    def name_of(role, ei):
        return ckpt.locate(p.tensors[ei][plan[role].spec.suffix])

    formats.check_values(scheme, arrays, n=p.n, k=k, name_of=name_of)


@dataclasses.dataclass(frozen=True)
class _RolePlan:
    """Where one role's tensor of a part goes: the tensor's ``spec``, the ``local`` shape of its
    slice, ``sl`` (``(axis, slice)`` of the stored tensor, or None: whole) and ``whole``."""

    spec: formats.StoredTensor
    local: tuple[int, ...]
    sl: tuple[int, slice] | None

    @property
    def whole(self) -> bool:
        return self.sl is None


def _part_plan(scheme: QuantScheme, p: MatrixPart, table: dict, tp: tuple[int, int], tp_axis: str | None,
               what: str) -> dict[str, _RolePlan]:
    """role → :class:`_RolePlan` of one part: its tensor-parallel slice along N (each output
    entry's unit) or K (packed words, groups — an act-order or channelwise matrix keeps its whole
    scales, indexed through ``g_idx``)."""
    tp_size, tp_rank = tp
    out = {}
    for role, spec in table.items():
        axis = spec.n_axis if tp_axis == "n" else spec.k_axis if tp_axis == "k" else None
        if tp_size == 1 or axis is None or (tp_axis == "k" and role in ("scales", "qzeros")
                                            and (scheme.act_order or scheme.group_size == -1)):
            out[role] = _RolePlan(spec, spec.shape, None)
            continue
        unit = spec.n_unit if tp_axis == "n" else spec.k_unit
        full = p.n if tp_axis == "n" else spec.shape[axis] * spec.k_unit
        sl = _tp_slice(full, tp_size, tp_rank, unit, what or p.label.format(e=0))
        local = list(spec.shape)
        local[axis] = sl.stop - sl.start
        out[role] = _RolePlan(spec, tuple(local), (axis, sl))
    return out


def _place(ckpt: "Checkpoint", name: str, a: np.ndarray, dst: np.ndarray) -> None:
    """Copy tensor ``a`` (read as ``name``, its slice where the plan cuts it) into its place in a
    stack; a wider integer type is narrowed only when every value fits."""
    if a.dtype != dst.dtype and a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueRangeError(f"{ckpt.locate(name)}: group indices must fit int32, got [{a.min()}, {a.max()}]")
    dst[...] = a


def _expert_sizes(ckpt: "Checkpoint", scheme: QuantScheme, gate: Mapping[str, str], down: Mapping[str, str],
                  base: str, names: Mapping[str, str]) -> tuple[int, int]:
    """``(H, I)`` from expert 0's gate and down packed weights (header shapes only; for
    compressed-tensors the gate's ``weight_shape`` gives K where it is stored)."""
    m, pf = scheme.method, scheme.pack_factor
    q = formats.SUFFIXES[m]["qweight"]
    for role, got in (("gate", gate), ("down", down)):
        if q not in got:
            raise MissingTensorError(f"{base}.{names[role]}.{q}: required by {scheme.describe()}, not found")
    gi, di = ckpt.tensor_info(gate[q]), ckpt.tensor_info(down[q])
    for nm, t in ((gate[q], gi), (down[q], di)):
        if len(t.shape) != 2:
            raise ShapeError(f"{ckpt.locate(nm)}: expected a rank-2 packed tensor, got shape {t.shape}")
    if m is QuantMethod.AWQ:
        return gi.shape[0], gi.shape[1] * pf
    if m is QuantMethod.GPTQ:
        return gi.shape[0] * pf, gi.shape[1]
    shape_name = gate.get("weight_shape")
    h = gi.shape[1] * pf
    if shape_name is not None:
        st = ckpt.read_tensor(shape_name)
        if st.shape != (2,) or st.dtype.kind not in "iu" or int(st[0]) != gi.shape[0] or \
                not 0 < int(st[1]) <= h or -(-int(st[1]) // pf) != gi.shape[1]:
            raise ShapeError(f"{ckpt.locate(shape_name)}: expected [{gi.shape[0]}, K] with "
                             f"ceil(K / {pf}) == {gi.shape[1]}, got {st.tolist()}")
        h = int(st[1])
    return h, gi.shape[0]


def read_experts(ckpt: "Checkpoint", scheme: QuantScheme, experts: Mapping[int, Mapping[str, Mapping[str, str]]],
                 names: Mapping[str, str], module: str, what: str, tp_size: int = 1, tp_rank: int = 0
                 ) -> CheckpointWeights:
    """``E`` experts (``experts[e][projection][suffix]`` = tensor name; ``names``: the gate / up /
    down projection names) as one :class:`CheckpointWeights`: ``w13 = [gate; up]`` read as one
    matrix of two parts, ``w2`` the down projection; rank ``tp_rank`` of ``tp_size`` reads its
    slice of the intermediate size. ``module``: expert ``e``'s module name with ``{e}`` in it
    (``model.layers.0.mlp.experts.{e}``), for messages."""
    e = len(experts)
    proj = [[experts[ei][names[r]] for ei in range(e)] for r in ("gate", "up", "down")]
    h, i_full = _expert_sizes(ckpt, scheme, proj[0][0], proj[2][0], module.format(e=0), names)
    if scheme.group_size != -1:
        check_divisible(f"{what}: hidden size", h, scheme.group_size, "group_size must divide H")
        check_divisible(f"{what}: intermediate size", i_full, scheme.group_size, "group_size must divide I")
    if scheme.zero_point and scheme.method is QuantMethod.COMPRESSED_TENSORS:
        check_divisible(f"{what}: intermediate size for packed zero points", i_full // tp_size, scheme.pack_factor)
    parts = [MatrixPart(proj[j], i_full, f"{module}.{names[r]}") for j, r in enumerate(("gate", "up"))]
    w13, b13 = read_matrix(ckpt, scheme, parts, k=h, tp=(tp_size, tp_rank), tp_axis="n", what=f"{what} gate/up")
    w2, b2 = read_matrix(ckpt, scheme, [MatrixPart(proj[2], h, f"{module}.{names['down']}")], k=i_full,
                         tp=(tp_size, tp_rank), tp_axis="k", what=f"{what} down")
    if (b13 is None) != (b2 is None):
        raise MissingTensorError(f"{module.format(e=0)}.{names['down']}.bias: "
                                 f"{'missing' if b2 is None else 'present'}, but the gate / up biases are "
                                 f"{'present' if b2 is None else 'absent'}; all projections or none carry biases")
    return CheckpointWeights(w13, w2, b13, b2, scheme=scheme, hidden_size=h,
                             intermediate_size=i_full // tp_size).validate()


def _load_shared(ckpt: Checkpoint, info: _LayerNames, tp_size: int, tp_rank: int, *, layer: str,
                 hidden: int):
    """Shared expert(s) as one expert: quantized (same scheme) or float (``ignore``d)."""
    names = NAMINGS["qwen"]
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
    return read_experts(ckpt, ckpt.scheme, {0: info.shared}, names, info.shared_prefix, f"{layer} shared expert",
                        tp_size, tp_rank)


__all__ = ["Checkpoint", "NAMINGS", "MoELayer", "MoEModelConfig", "DenseWeights", "MatrixPart", "read_matrix", "read_experts"]
