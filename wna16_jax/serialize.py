"""Converted checkpoints on disk: one safetensors file per MoE layer plus a JSON manifest.

``convert_checkpoint(src, backend, out)`` streams a checkpoint layer by layer (one source layer
and its converted form resident at a time, experts converted in chunks), writes
``layer-XXXXX.safetensors`` files and ``manifest.json`` (format version, backend, scheme, model
config, the layout's name, every tensor's shape and dtype, the source checkpoint) into a
temporary folder beside ``out`` and renames it into place at the end, so an interrupted run
leaves no half-written output. ``ConvertedCheckpoint`` reads the result back into the backend
pytrees that :func:`wna16_jax.moe.fused_moe` runs.

A manifest is data, never code: the layout it names is looked up in :data:`LAYOUTS` (a fixed
table of this library's layout classes), every file it names must stay inside its folder, and
every field is checked before anything is built from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import numpy as np

from .backends import TABLE, Backend
from .checkpoint import Checkpoint, DenseWeights, MoELayer, MoEModelConfig
from .errors import (ConfigError, CorruptFileError, MissingTensorError, OutputPathError, ShapeError,
                     UnexpectedTensorError, ValueRangeError, WNA16Error)
from .safetensors_io import SafetensorsFile, confined_path, load_json
from .schemes import QuantScheme
from .weights import CheckpointWeights

MANIFEST = "manifest.json"
FORMAT = "wna16-jax-converted-moe"
VERSION = 2
READ_VERSIONS = (1, 2)


def _layouts() -> dict[str, type]:
    from .convert.cpu import CPUWeights
    from .convert.humming import HummingWeights
    from .convert.marlin import MarlinWeights
    from .convert.trtllm_mxint4 import TrtllmMxint4Weights
    from .convert.xpu import XPUWeights

    classes = (CheckpointWeights, DenseWeights, CPUWeights, XPUWeights, MarlinWeights,
               TrtllmMxint4Weights, HummingWeights)
    return {c.__name__: c for c in classes}


#: layout name → class: the only classes a manifest can name.
LAYOUTS: dict[str, type] = _layouts()


def _layout_class(entry_class: Any, where: str) -> type:
    """The class a manifest entry names: ``"MarlinWeights"`` (version 2) or, from version-1
    manifests, ``"wna16_jax.convert.marlin:MarlinWeights"`` — looked up, never imported."""
    if not isinstance(entry_class, str):
        raise ConfigError(f"{where}: expected a layout name, got {entry_class!r}")
    name = entry_class
    if ":" in entry_class:
        module, _, name = entry_class.partition(":")
        cls = LAYOUTS.get(name)
        if cls is None or cls.__module__ != module:
            raise ConfigError(f"{where}: {entry_class!r} is not one of this library's layouts "
                              f"({sorted(LAYOUTS)})")
        return cls
    cls = LAYOUTS.get(name)
    if cls is None:
        raise ConfigError(f"{where}: layout {name!r} is not one of {sorted(LAYOUTS)}")
    return cls


# --------------------------------------------------------------------------- pytree <-> files


def _meta_to_json(v: Any) -> Any:
    if isinstance(v, QuantScheme):
        d = dataclasses.asdict(v)
        d["method"] = v.method.value
        d["ignore"] = list(v.ignore)
        return {"__scheme__": d}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ConfigError(f"manifest: cannot record metadata value {v!r} of type {type(v).__name__}")


def scheme_from_json(d: Any, where: str) -> QuantScheme:
    """A :class:`QuantScheme` from its manifest record, every key and value checked."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object, got {d!r}")
    fields = {f.name: f for f in dataclasses.fields(QuantScheme)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown scheme fields {unknown}")
    kinds = {"method": str, "bits": int, "group_size": int, "zero_point": bool, "act_order": bool,
             "desc_act": bool, "static_groups": bool, "true_sequential": bool}
    for k, v in d.items():
        want = kinds.get(k)
        if k == "ignore":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ConfigError(f"{where}.ignore: expected a list of strings, got {v!r}")
        elif want is not None and (not isinstance(v, want) or want is int and isinstance(v, bool)):
            raise ConfigError(f"{where}.{k}: expected {want.__name__}, got {v!r}")
        elif want is None and v is not None and not isinstance(v, str):
            raise ConfigError(f"{where}.{k}: expected a string or null, got {v!r}")
    try:
        return QuantScheme(**d)
    except WNA16Error as e:
        raise ConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: not a valid scheme ({e})") from None


def _meta_from_json(v: Any, where: str) -> Any:
    if isinstance(v, dict):
        if set(v) != {"__scheme__"}:
            raise ConfigError(f"{where}: expected a scalar or a scheme record, got {v!r}")
        return scheme_from_json(v["__scheme__"], where)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ConfigError(f"{where}: expected a scalar or a scheme record, got {v!r}")


def pytree_entry(prefix: str, obj: Any, tensors: dict[str, np.ndarray]) -> dict:
    """Record ``obj`` (a frozen dataclass pytree) into ``tensors`` and return its manifest entry."""
    cls = type(obj)
    if LAYOUTS.get(cls.__name__) is not cls:
        raise ConfigError(f"manifest: {cls.__name__} is not a layout that can be written ({sorted(LAYOUTS)})")
    meta = {m: _meta_to_json(getattr(obj, m)) for m in cls.META}
    shapes = {}
    for name, v in obj.named_arrays().items():
        arr = np.asarray(v)
        tensors[f"{prefix}{name}"] = np.ascontiguousarray(arr)
        shapes[name] = {"shape": list(arr.shape), "dtype": arr.dtype.name}
    return {"class": cls.__name__, "meta": meta, "tensors": shapes}


def pytree_from_entry(prefix: str, entry: Any, read, *, where: str) -> Any:
    """Build the layout pytree an entry describes; ``read(name)`` returns a tensor of the layer
    file. Every name, shape and dtype is checked against the layout class first."""
    if not isinstance(entry, dict) or not {"class", "meta", "tensors"} <= set(entry):
        raise ConfigError(f"{where}: expected an object with 'class', 'meta' and 'tensors', got "
                          f"{sorted(entry) if isinstance(entry, dict) else entry!r}")
    cls = _layout_class(entry["class"], f"{where}.class")
    meta_names = set(cls.META)
    field_names = set(cls.flat_names()) | meta_names
    meta, tensors = entry["meta"], entry["tensors"]
    if not isinstance(meta, dict) or set(meta) != meta_names:
        raise ConfigError(f"{where}.meta: expected the keys {sorted(meta_names)} of {cls.__name__}, got "
                          f"{sorted(meta) if isinstance(meta, dict) else meta!r}")
    if not isinstance(tensors, dict) or not set(tensors) <= field_names - meta_names:
        extra = sorted(set(tensors) - (field_names - meta_names)) if isinstance(tensors, dict) else tensors
        raise ConfigError(f"{where}.tensors: {extra!r} are not array fields of {cls.__name__}")
    kwargs = {k: _meta_from_json(v, f"{where}.meta.{k}") for k, v in meta.items()}
    for field, info in tensors.items():
        key = f"{prefix}{field}"
        if not (isinstance(info, dict) and isinstance(info.get("shape"), list)
                and isinstance(info.get("dtype"), str)):
            raise ConfigError(f"{where}.tensors.{field}: expected {{'shape': [...], 'dtype': '...'}}, got {info!r}")
        arr = read(key)
        if list(arr.shape) != info["shape"] or arr.dtype.name != info["dtype"]:
            raise ShapeError(f"{key}: manifest says {info['dtype']}{info['shape']}, "
                             f"file holds {arr.dtype.name}{list(arr.shape)}")
        kwargs[field] = arr
    try:
        return cls.of(**kwargs)
    except WNA16Error:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot build {cls.__name__} ({e})") from None


# --------------------------------------------------------------------------- conversion


def _check_chunk(expert_chunk: Any) -> None:
    if expert_chunk is not None and (isinstance(expert_chunk, bool) or not isinstance(expert_chunk, (int, np.integer))
                                     or expert_chunk < 1):
        raise ConfigError(f"expert_chunk: expected a positive integer or None, got {expert_chunk!r}")


def convert_layer(backend: Backend, scheme: QuantScheme, experts: Any, *, input_dtype: Any = None,
                  expert_chunk: int | None = None) -> Any:
    """Convert one layer's experts, ``expert_chunk`` experts at a time (bounded peak memory).

    int8 activations need the layer-wide scale maximum, so they always convert in one piece.
    """
    import jax

    _check_chunk(expert_chunk)
    backend = Backend.parse(backend)
    spec = TABLE[backend]
    if isinstance(experts, CheckpointWeights):
        experts.validate()
    e = experts.num_experts
    step = e if (expert_chunk is None or input_dtype is not None and "int8" in str(input_dtype)) else expert_chunk
    parts = []
    for start in range(0, e, step):
        chunk = experts.take_experts(np.arange(start, min(e, start + step)))
        out = spec.convert(scheme, chunk.to_jax(), input_dtype=input_dtype)
        parts.append(jax.tree_util.tree_map(np.asarray, out))
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    expert = set(first.array_fields())
    merged = {n: np.concatenate([getattr(p, n) for p in parts], axis=0)
              for n in first.flat_names() if n in expert and getattr(first, n) is not None}
    return first.replace(**merged)


def _inside(child: str, parent: str) -> bool:
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_output_folder(src: str, out: str, *, overwrite: bool = False) -> None:
    """Refuse an output folder that is the source, lies inside it, contains it, is a file, or is
    not empty (unless ``overwrite``)."""
    if _inside(out, src):
        raise OutputPathError(f"--out {out!r}: is the source checkpoint {src!r} or inside it; "
                              "the input is never written to")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutputPathError(f"--out {out!r}: exists and is not a folder")
    if os.path.isdir(out):
        if _inside(src, out):
            raise OutputPathError(f"--out {out!r}: contains the source checkpoint {src!r}")
        if os.listdir(out) and not overwrite:
            raise OutputPathError(f"--out {out!r}: folder is not empty ({len(os.listdir(out))} entries); "
                                  "pass overwrite=True (--overwrite) to replace it")


def convert_checkpoint(src: str | os.PathLike, backend: Backend | str, out: str | os.PathLike, *,
                       input_dtype: Any = None, expert_chunk: int | None = 1, progress: bool = True,
                       tp_size: int = 1, tp_rank: int = 0, overwrite: bool = False) -> str:
    """Convert every MoE layer of ``src`` into ``backend``'s layout under ``out`` (streaming).

    ``out`` must not be ``src`` (or inside it), a file, or a non-empty folder unless
    ``overwrite``. The files are written to a temporary folder beside ``out`` and renamed into
    place when every layer is written.
    """
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    _check_chunk(expert_chunk)
    for name, v, lo in (("tp_size", tp_size, 1), ("tp_rank", tp_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ConfigError(f"{name}: expected an integer >= {lo}, got {v!r}")
    if tp_rank >= tp_size:
        raise ConfigError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank}")
    backend = Backend.parse(backend)
    src, out = os.fspath(src), os.fspath(out)
    ckpt = Checkpoint(src)
    check_output_folder(src, out, overwrite=overwrite)
    reason = TABLE[backend].layout_supports(ckpt.scheme, input_dtype=input_dtype)
    if reason:
        raise ConfigError(f"backend {backend} cannot represent {ckpt.scheme.describe()}: {reason}")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.partial-", dir=parent)
    try:
        layers = {}
        for li in tqdm(ckpt.moe_layer_indices, desc=f"convert → {backend}", unit="layer",
                       disable=not progress):
            layer = ckpt.load_layer(li, tp_size=tp_size, tp_rank=tp_rank)
            converted = convert_layer(backend, ckpt.scheme, layer.experts, input_dtype=input_dtype,
                                      expert_chunk=expert_chunk)
            tensors: dict[str, np.ndarray] = {"router": np.ascontiguousarray(layer.router)}
            entry = {"experts": pytree_entry("experts.", converted, tensors)}
            if layer.e_score_correction_bias is not None:
                tensors["e_score_correction_bias"] = np.ascontiguousarray(layer.e_score_correction_bias)
            if layer.shared_experts is not None:
                entry["shared_experts"] = pytree_entry("shared_experts.", layer.shared_experts, tensors)
            if layer.shared_expert_gate is not None:
                tensors["shared_expert_gate"] = np.ascontiguousarray(layer.shared_expert_gate)
            fname = f"layer-{li:05d}.safetensors"
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": FORMAT})
            entry["file"] = fname
            layers[str(li)] = entry
            del layer, converted, tensors
        manifest = {
            "format": FORMAT, "version": VERSION, "backend": backend.name,
            "scheme": _meta_to_json(ckpt.scheme)["__scheme__"],
            "input_dtype": None if input_dtype is None else np.dtype(input_dtype).name,
            "model_config": dataclasses.asdict(ckpt.model_config),
            "tensor_parallel": {"tp_size": tp_size, "tp_rank": tp_rank},
            "source": {"path": os.path.abspath(src), "quantization_config":
                       ckpt.config.get("quantization_config", ckpt.config.get("compression_config"))},
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "layers": layers,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.isdir(out):
            check_output_folder(src, out, overwrite=overwrite)     # nothing appeared meanwhile
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.old-", dir=parent)
            os.rename(out, os.path.join(old, "out"))
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class ConvertedCheckpoint:
    """Read a folder written by :func:`convert_checkpoint`.

    Attributes: ``backend``, ``scheme``, ``model_config`` (the source's
    :class:`~wna16_jax.checkpoint.MoEModelConfig`), ``manifest`` (the parsed JSON).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        mpath = os.path.join(self.path, MANIFEST)
        if not os.path.isfile(mpath):
            raise ConfigError(f"{MANIFEST}: not found in {self.path!r} (not a converted checkpoint)")
        self._mpath = mpath
        m = load_json(mpath, what="the manifest")
        if not isinstance(m, dict):
            raise CorruptFileError(f"{mpath}: expected a JSON object, got {type(m).__name__}")
        if m.get("format") != FORMAT or m.get("version") not in READ_VERSIONS:
            raise ConfigError(f"{mpath}: expected format {FORMAT!r} version {VERSION}, got "
                              f"{m.get('format')!r} version {m.get('version')!r}")
        for key in ("backend", "scheme", "layers"):
            if key not in m:
                raise ConfigError(f"{mpath}: required field {key!r} is missing")
        self.manifest = m
        b = m["backend"]
        if not isinstance(b, str) or b not in Backend.__members__:
            raise ConfigError(f"{mpath}: field 'backend' must be one of {list(Backend.__members__)}, got {b!r}")
        self.backend = Backend[b]
        self.scheme = scheme_from_json(m["scheme"], f"{mpath}: field 'scheme'")
        self.model_config = _model_config(m.get("model_config"), mpath)
        layers = m["layers"]
        if not isinstance(layers, dict) or not all(isinstance(k, str) and k.isdigit() for k in layers):
            raise ConfigError(f"{mpath}: field 'layers' must map layer numbers to entries, got "
                              f"{list(layers)[:5] if isinstance(layers, dict) else layers!r}")
        for k, entry in layers.items():
            if not isinstance(entry, dict) or "experts" not in entry or "file" not in entry:
                raise ConfigError(f"{mpath}: layers[{k!r}] must be an object with 'file' and 'experts'")
            confined_path(self.path, entry["file"], source=f"{mpath}: layers[{k!r}].file")

    @property
    def moe_layer_indices(self) -> list[int]:
        return sorted(int(k) for k in self.manifest["layers"])

    def load_layer(self, layer_index: int) -> MoELayer:
        """The layer as a :class:`~wna16_jax.checkpoint.MoELayer` whose experts are in the backend layout."""
        entry = self.manifest["layers"].get(str(layer_index)) if isinstance(layer_index, (int, np.integer)) \
            and not isinstance(layer_index, bool) else None
        if entry is None:
            raise ValueRangeError(f"layer_index: {layer_index!r} is not in {self.path!r}; "
                                  f"layers are {self.moe_layer_indices}")
        where = f"{self._mpath}: layers['{layer_index}']"
        fpath = confined_path(self.path, entry["file"], source=f"{where}.file")
        if not os.path.isfile(fpath):
            raise MissingTensorError(f"{where}.file: {entry['file']!r} not found in {self.path!r}")
        f = SafetensorsFile(fpath)
        known = {"router", "e_score_correction_bias", "shared_expert_gate"}
        for name in f.keys():
            if name not in known and not name.startswith(("experts.", "shared_experts.")):
                raise UnexpectedTensorError(f"{fpath}: tensor {name!r} is not part of a converted layer")

        def read(name):
            if name not in f.tensors:
                raise MissingTensorError(f"{name}: listed in the manifest but missing from {fpath}")
            return f.read(name)

        experts = pytree_from_entry("experts.", entry["experts"], read, where=f"{where}.experts")
        shared = (pytree_from_entry("shared_experts.", entry["shared_experts"], read,
                                    where=f"{where}.shared_experts")
                  if "shared_experts" in entry else None)
        cfg = self.model_config
        if cfg is not None:
            tp = self.manifest.get("tensor_parallel", {}).get("tp_size", 1) if isinstance(
                self.manifest.get("tensor_parallel"), dict) else 1
            for what, want, got in (("experts", cfg.num_experts, experts.num_experts),
                                    ("hidden size", cfg.hidden_size, experts.hidden_size),
                                    ("intermediate size", cfg.moe_intermediate_size,
                                     experts.intermediate_size * (tp if isinstance(tp, int) else 1))):
                if want != got:
                    raise ShapeError(f"{where}: {what} {got} disagrees with the manifest's model_config ({want})")
        _check_decodes(experts, f"{where}.experts")
        if shared is not None:
            _check_decodes(shared, f"{where}.shared_experts")
        router = read("router")
        if router.shape != (experts.num_experts, experts.hidden_size):
            raise ShapeError(f"{fpath}: router: expected shape {(experts.num_experts, experts.hidden_size)}, "
                             f"got {router.shape}")
        bias = read("e_score_correction_bias") if "e_score_correction_bias" in f.tensors else None
        gate = read("shared_expert_gate") if "shared_expert_gate" in f.tensors else None
        return MoELayer(layer_index, experts, router, bias, shared, gate)

    def iter_layers(self) -> Iterator[MoELayer]:
        for li in self.moe_layer_indices:
            yield self.load_layer(li)


def _model_config(d: Any, where: str) -> MoEModelConfig | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: field 'model_config' must be an object, got {d!r}")
    fields = {f.name for f in dataclasses.fields(MoEModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ConfigError(f"{where}: field 'model_config' has unknown keys {unknown}")
    try:
        cfg = MoEModelConfig(**d)
    except TypeError as e:
        raise ConfigError(f"{where}: field 'model_config' is incomplete ({e})") from None
    for k in ("num_experts", "top_k", "hidden_size", "moe_intermediate_size"):
        v = getattr(cfg, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where}: model_config.{k} must be a positive integer, got {v!r}")
    return cfg


def _check_decodes(weights: Any, where: str) -> None:
    """Trace the layout's decode (shapes only, nothing computed): a layout whose arrays disagree
    with its metadata fails here with a typed error, not deep inside a later call."""
    import jax

    e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
    try:
        w13, w2 = jax.eval_shape(lambda w: w.dequantize(np.float32), weights)
    except WNA16Error:
        raise
    except Exception as ex:  # noqa: BLE001 - any failure to decode is the file's fault
        raise ShapeError(f"{where}: the arrays do not decode as a {type(weights).__name__} with "
                         f"E={e}, H={h}, I={i} ({type(ex).__name__}: {str(ex)[:200]})") from None
    if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
        raise ShapeError(f"{where}: decodes to w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}, "
                         f"expected {(e, 2 * i, h)} and {(e, h, i)}")


__all__ = ["convert_checkpoint", "convert_layer", "ConvertedCheckpoint", "LAYOUTS", "MANIFEST",
           "check_output_folder"]
