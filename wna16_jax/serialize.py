"""Converted checkpoints on disk: one safetensors file per MoE layer plus a JSON manifest.

``convert_checkpoint(src, backend, out)`` streams a checkpoint layer by layer (one source layer
and its converted form resident at a time, experts converted in chunks), writes
``layer-XXXXX.safetensors`` files and ``manifest.json`` (format version, backend, scheme, the
weights class, every tensor's shape and dtype, the source checkpoint). ``ConvertedCheckpoint``
reads the result back into the backend pytrees that :func:`wna16_jax.moe.fused_moe` runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
from typing import Any, Iterator

import numpy as np

from .backends import TABLE, Backend
from .checkpoint import Checkpoint, MoELayer
from .errors import ConfigError, MissingTensorError, ShapeError
from .schemes import QuantScheme

MANIFEST = "manifest.json"
FORMAT = "wna16-jax-converted-moe"
VERSION = 1


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


def _meta_from_json(v: Any) -> Any:
    if isinstance(v, dict) and "__scheme__" in v:
        return QuantScheme(**v["__scheme__"])
    return v


def pytree_entry(prefix: str, obj: Any, tensors: dict[str, np.ndarray]) -> dict:
    """Record ``obj`` (a frozen dataclass pytree) into ``tensors`` and return its manifest entry."""
    cls = type(obj)
    meta = {}
    shapes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name in getattr(cls, "META", ()):
            meta[f.name] = _meta_to_json(v)
        elif v is not None:
            arr = np.asarray(v)
            tensors[f"{prefix}{f.name}"] = np.ascontiguousarray(arr)
            shapes[f.name] = {"shape": list(arr.shape), "dtype": arr.dtype.name}
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "meta": meta, "tensors": shapes}


def pytree_from_entry(prefix: str, entry: dict, tensors: dict[str, np.ndarray]) -> Any:
    module, _, name = entry["class"].partition(":")
    if not module.startswith("wna16_jax."):
        raise ConfigError(f"manifest: refusing to import weights class {entry['class']!r} outside wna16_jax")
    cls = getattr(importlib.import_module(module), name)
    kwargs = {k: _meta_from_json(v) for k, v in entry["meta"].items()}
    for field, info in entry["tensors"].items():
        key = f"{prefix}{field}"
        if key not in tensors:
            raise MissingTensorError(f"{key}: listed in the manifest but missing from the layer file")
        arr = tensors[key]
        if list(arr.shape) != info["shape"] or arr.dtype.name != info["dtype"]:
            raise ShapeError(f"{key}: manifest says {info['dtype']}{info['shape']}, "
                             f"file holds {arr.dtype.name}{list(arr.shape)}")
        kwargs[field] = arr
    return cls(**kwargs)


# --------------------------------------------------------------------------- conversion


def convert_layer(backend: Backend, scheme: QuantScheme, experts: Any, *, input_dtype: Any = None,
                  expert_chunk: int | None = None) -> Any:
    """Convert one layer's experts, ``expert_chunk`` experts at a time (bounded peak memory).

    int8 activations need the layer-wide scale maximum, so they always convert in one piece.
    """
    import jax

    spec = TABLE[backend]
    fn = spec.converter()
    if fn is None:
        raise ConfigError(f"{backend}: layout converter not implemented yet")
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
    fields = set(first.array_fields())
    merged = {}
    for f in dataclasses.fields(first):
        if f.name in getattr(type(first), "META", ()):
            continue
        vals = [getattr(p, f.name) for p in parts]
        if vals[0] is None:
            merged[f.name] = None
        elif f.name in fields:
            merged[f.name] = np.concatenate(vals, axis=0)
        else:
            merged[f.name] = vals[0]
    return dataclasses.replace(first, **merged)


def convert_checkpoint(src: str | os.PathLike, backend: Backend | str, out: str | os.PathLike, *,
                       input_dtype: Any = None, expert_chunk: int | None = 1, progress: bool = True,
                       tp_size: int = 1, tp_rank: int = 0) -> str:
    """Convert every MoE layer of ``src`` into ``backend``'s layout under ``out`` (streaming)."""
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm


    backend = Backend.parse(backend)
    ckpt = Checkpoint(src)
    reason = TABLE[backend].layout_supports(ckpt.scheme, input_dtype=input_dtype)
    if reason:
        raise ConfigError(f"backend {backend} cannot represent {ckpt.scheme.describe()}: {reason}")
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    layers = {}
    for li in tqdm(ckpt.moe_layer_indices, desc=f"convert → {backend}", unit="layer", disable=not progress):
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
        save_file(tensors, os.path.join(out, fname), metadata={"format": FORMAT})
        entry["file"] = fname
        layers[str(li)] = entry
        del layer, converted, tensors
    manifest = {
        "format": FORMAT, "version": VERSION, "backend": backend.name,
        "scheme": _meta_to_json(ckpt.scheme)["__scheme__"],
        "input_dtype": None if input_dtype is None else np.dtype(input_dtype).name,
        "model_config": dataclasses.asdict(ckpt.model_config),
        "tensor_parallel": {"tp_size": tp_size, "tp_rank": tp_rank},
        "source": {"path": os.path.abspath(os.fspath(src)), "quantization_config":
                   ckpt.config.get("quantization_config", ckpt.config.get("compression_config"))},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "layers": layers,
    }
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return out


class ConvertedCheckpoint:
    """Read a directory written by :func:`convert_checkpoint`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        mpath = os.path.join(self.path, MANIFEST)
        if not os.path.isfile(mpath):
            raise ConfigError(f"{MANIFEST}: not found in {self.path!r} (not a converted checkpoint)")
        with open(mpath) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise ConfigError(f"{mpath}: expected format {FORMAT!r} version {VERSION}, got "
                              f"{self.manifest.get('format')!r} version {self.manifest.get('version')!r}")
        self.backend = Backend[self.manifest["backend"]]
        self.scheme = QuantScheme(**self.manifest["scheme"])

    @property
    def moe_layer_indices(self) -> list[int]:
        return sorted(int(k) for k in self.manifest["layers"])

    def load_layer(self, layer_index: int) -> MoELayer:
        """The layer as a :class:`~wna16_jax.checkpoint.MoELayer` whose experts are in the backend layout."""
        from safetensors.numpy import load_file

        from .errors import ValueRangeError

        entry = self.manifest["layers"].get(str(layer_index))
        if entry is None:
            raise ValueRangeError(f"layer_index: {layer_index} is not in {self.path!r}; "
                                  f"layers are {self.moe_layer_indices}")
        t = load_file(os.path.join(self.path, entry["file"]))
        experts = pytree_from_entry("experts.", entry["experts"], t)
        shared = (pytree_from_entry("shared_experts.", entry["shared_experts"], t)
                  if "shared_experts" in entry else None)
        return MoELayer(layer_index, experts, t["router"], t.get("e_score_correction_bias"),
                        shared, t.get("shared_expert_gate"))

    def iter_layers(self) -> Iterator[MoELayer]:
        for li in self.moe_layer_indices:
            yield self.load_layer(li)
