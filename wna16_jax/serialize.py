"""Converted checkpoints on disk: whole checkpoints whose MoE experts are in a backend's layout.

``convert_checkpoint(src, backend, out)`` streams a checkpoint layer by layer (one source layer
and its converted form resident at a time, experts converted in chunks) and writes, into a
temporary folder beside ``out`` that is renamed into place at the end (an interrupted run leaves
no half-written output):

* ``layer-XXXXX.safetensors``: each MoE layer's converted experts, router, shared experts;
* ``model-XXXXX-of-XXXXX.safetensors``: every other tensor of the source (attention projections
  quantized as stored, norms, embeddings, ``lm_head``, routers, shared experts as stored), byte
  for byte with names and dtypes kept, at most ``max_file_bytes`` of tensor data per file, read
  and written one tensor at a time;
* ``config.json``, ``generation_config.json`` and the tokenizer files, copied as they are;
* ``manifest.json``: format version, backend, scheme, model config, each layer's layout name
  and tensor shapes and dtypes, the copied files with their sizes, which file holds each
  non-expert tensor, and the source checkpoint.

:class:`ConvertedCheckpoint` reads the result with the reading interface of
:class:`~wna16_jax.checkpoint.Checkpoint` (``config``, ``quant_config``, ``model_config``,
``scheme``, ``moe_layer_indices``, ``load_layer``, ``tensor_names``, ``tensor_info``,
``read_tensor``, ``read_many``, ``locate``), so a whole-model loader takes either;
:func:`open_checkpoint` opens a folder as whichever it is. Folders of manifest versions 1 and 2
hold only the converted layers: ``load_layer`` reads them, the whole-model parts raise
:class:`~wna16_jax.errors.UnsupportedError`.

A manifest is data, never code: the layout it names is looked up in :data:`LAYOUTS` (a fixed
table of this library's layout classes), every file it names must stay inside its folder (links
included), the files it lists must have the sizes it records, and every field is checked before
anything is built from it. Nothing is ever written into the source folder, and no file is
copied from it through a link that leaves it (a Hugging Face cache snapshot's links into its own
repository's ``blobs/`` excepted: that is how the cache stores every snapshot's files).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import secrets
import shutil
import stat
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .backends import TABLE, Backend
from .checkpoint import EXPERT_TENSOR_RE, Checkpoint, DenseWeights, MoELayer, MoEModelConfig, index_by_module
from .errors import (ConfigError, CorruptFileError, MissingTensorError, OutputPathError, ShapeError,
                     UnexpectedTensorError, UnsafePathError, UnsupportedError, ValueRangeError, WNA16Error)
from .fields import REQUIRED, Fields, check_expert_ids, check_int
from .routing import MoERouting
from .safetensors_io import DTYPES, SafetensorsFile, TensorInfo, confined_path, load_json
from .schemes import QuantConfig, QuantScheme
from .weights import CheckpointWeights

MANIFEST = "manifest.json"
FORMAT = "wna16-jax-converted-moe"
#: 3: the folder is a whole checkpoint (config, tokenizer, every non-expert tensor);
#: 4: ``model_config`` holds the routing as one object (``model_config.routing``), not flat
VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
#: the first version whose folders carry the whole model
WHOLE_MODEL_VERSION = 3
CONFIG = "config.json"
#: default cap on the tensor data of one non-expert file (as Hugging Face shards, a few GB)
DEFAULT_MAX_FILE_BYTES = 4 << 30


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


def pytree_from_entry(prefix: str, entry: Any, read, *, where: str, rows: tuple[int, int] | None = None) -> Any:
    """Build the layout pytree an entry describes; ``read(name)`` returns a tensor of the layer
    file. Every name, shape and dtype is checked against the layout class first. ``rows``
    ``(total, kept)``: ``read`` returns ``kept`` of the ``total`` experts of every tensor whose
    manifest shape leads with ``total`` (the experts one process holds)."""
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
        want = list(info["shape"])
        if rows is not None and want[:1] == [rows[0]]:
            want[0] = rows[1]
        if list(arr.shape) != want or arr.dtype.name != info["dtype"]:
            raise ShapeError(f"{key}: manifest says {info['dtype']}{want}, "
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


def _path_arg(name: str, value: Any) -> str:
    """``value`` as a folder path string, or a :class:`ConfigError` naming the argument."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise ConfigError(f"{name}: expected a folder path (str or os.PathLike), got "
                          f"{type(value).__name__}") from None
    if not isinstance(path, str):
        raise ConfigError(f"{name}: expected a folder path as text, got {type(path).__name__} {path!r}")
    return path


def _confined_file(folder: str, name: Any, *, source: str, within: Sequence[str] = ()) -> str:
    """``folder/name`` for a file name read from ``source`` (:func:`confined_path`), refused as
    well when it resolves, through a symbolic link, to a place outside ``folder`` (and outside
    each of ``within``)."""
    path = confined_path(folder, name, source=source)
    if not any(_inside(path, root) for root in (folder, *within)):
        raise UnsafePathError(f"{source}: {name!r} is a link to {os.path.realpath(path)!r}, outside "
                              f"{folder!r}; files are never read through a link that leaves the folder")
    return path


def _blob_store(src: str) -> list[str]:
    """``[<repo>/blobs]`` when ``src`` is a Hugging Face cache snapshot ``<repo>/snapshots/<commit>``
    (whose files are links into the repository's blob store, as :mod:`wna16_jax.hub` resolves
    hub ids), else ``[]``: the one place outside a source folder its files may resolve to."""
    snapshots = os.path.dirname(os.path.realpath(src))
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return [blobs] if os.path.basename(snapshots) == "snapshots" and os.path.isdir(blobs) else []


def _new_folder(parent: str, prefix: str) -> str:
    """A new, uniquely named folder in ``parent`` with the usual permissions (``0o777`` less the
    umask, as ``mkdir`` gives them; ``tempfile.mkdtemp`` would give ``0o700``)."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(6))
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:         # pragma: no cover - a 48-bit name taken
            continue


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


# --------------------------------------------------------------------------- the rest of the model


def model_file_names(src: str) -> list[str]:
    """The files beside the tensors that a whole model needs and ``src`` has (relative names):
    ``config.json``, ``generation_config.json``, the tokenizer's files and its chat templates
    (``chat_template.jinja``, ``additional_chat_templates/*.jinja``) — the files
    :func:`~wna16_jax.models.load_model` and :func:`~wna16_jax.models.load_tokenizer` read."""
    from .models.generation_config import GENERATION_CONFIG
    from .models.tokenizer import (CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG,
                                   TOKENIZER_JSON)

    names = [CONFIG, GENERATION_CONFIG, TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE]
    templates = _confined_file(src, CHAT_TEMPLATE_DIR, source=src, within=_blob_store(src))
    if os.path.isdir(templates):
        names += [f"{CHAT_TEMPLATE_DIR}/{e}" for e in sorted(os.listdir(templates))
                  if e.endswith(".jinja") and not e.startswith(".")]
    return [n for n in names if os.path.lexists(os.path.join(src, *n.split("/")))]


def _checked_source_file(src: str, name: str) -> str:
    """The path of ``src``'s file ``name``, to be copied: a regular file inside ``src``, any link
    on the way resolving inside ``src`` too (or into a cache snapshot's blob store,
    :func:`_blob_store`), checked before anything is written."""
    path = _confined_file(src, name, source=f"source {src!r}", within=_blob_store(src))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: is a link to a file that does not exist") from None
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: expected a regular file to copy, got {stat.filemode(st.st_mode)}")
    return path


def _copy_file(path: str, dst: str) -> int:
    """Copy the file ``path`` (checked by :func:`_checked_source_file`) into the new file ``dst``
    byte for byte; returns the number of bytes. The resolved file is opened without following a
    link, so one put in its place after the check is refused, not followed."""
    try:
        fd = os.open(os.path.realpath(path), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as fin:
        if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
            raise ConfigError(f"{path}: expected a regular file to copy")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
            return fout.tell()


def non_expert_tensor_names(ckpt: Checkpoint) -> list[str]:
    """Every tensor name of ``ckpt`` except the routed experts' (those become the layer files):
    attention, norms, embeddings, ``lm_head``, dense MLPs, routers, shared experts."""
    return [n for n in ckpt.tensor_names() if EXPERT_TENSOR_RE.match(n) is None]


def _plan_tensor_files(ckpt: Checkpoint, names: Sequence[str], max_file_bytes: int) -> dict[str, list[str]]:
    """``names`` split, in order, into files of at most ``max_file_bytes`` of tensor data (a
    larger tensor gets a file of its own), from the headers alone: file name → tensor names."""
    groups: list[list[str]] = []
    size = 0
    for n in names:
        t = ckpt.tensor_info(n)
        if not groups or size + (t.end - t.begin) > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += t.end - t.begin
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


#: numpy dtype → the safetensors dtype name (the reader's table, inverted)
_DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in DTYPES.items()}


def _write_safetensors(dst: str, layout: Sequence[tuple[str, str, tuple[int, ...]]],
                       read: Callable[[str], np.ndarray], metadata: dict[str, str]) -> int:
    """Write the new safetensors file ``dst`` one tensor at a time: the header from ``layout``
    (name, dtype name, shape) first, then each tensor's bytes as ``read(name)`` returns them, in
    the same order. The file is created as ``open`` creates files (``0o666`` less the umask;
    the safetensors package's writer gives ``0o600``). Returns the file's size."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype_name, shape in layout:
        nbytes = math.prod(shape) * DTYPES[dtype_name].itemsize
        header[name] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                 # the data starts 8-byte aligned
    with open(dst, "xb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, _, _ in layout:
            f.write(np.ascontiguousarray(read(name)).reshape(-1).view(np.uint8))
        return f.tell()


def _write_arrays(dst: str, tensors: dict[str, np.ndarray]) -> int:
    """Write the arrays ``tensors`` (a converted layer) into the new safetensors file ``dst``."""
    layout = []
    for name, a in tensors.items():
        dtype_name = _DTYPE_NAMES.get(a.dtype)
        if dtype_name is None:
            raise ConfigError(f"{name}: dtype {a.dtype} cannot be stored in a safetensors file "
                              f"(known: {sorted(str(d) for d in _DTYPE_NAMES)})")
        layout.append((name, dtype_name, a.shape))
    return _write_safetensors(dst, layout, tensors.__getitem__, {"format": FORMAT})


def _copy_tensors(ckpt: Checkpoint, names: Sequence[str], dst: str) -> int:
    """Copy the tensors ``names`` of ``ckpt`` into the new safetensors file ``dst`` as stored
    (dtype names and shapes from the source headers, bytes as read), one tensor at a time."""
    layout = [(n, t.dtype_name, t.shape) for n, t in ((n, ckpt.tensor_info(n)) for n in names)]
    return _write_safetensors(dst, layout, ckpt.read_tensor, {"format": "pt"})


# --------------------------------------------------------------------------- conversion


def convert_checkpoint(src: str | os.PathLike, backend: Backend | str, out: str | os.PathLike, *,
                       input_dtype: Any = None, expert_chunk: int | None = 1, progress: bool = True,
                       tp_size: int = 1, tp_rank: int = 0, overwrite: bool = False,
                       max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> str:
    """Convert every MoE layer of ``src`` into ``backend``'s layout under ``out`` (streaming), with
    the rest of the model beside it (module doc): a whole checkpoint.

    ``out`` must not be ``src`` (or inside it), a file, or a non-empty folder unless
    ``overwrite``. ``max_file_bytes``: the most tensor data in one file of non-expert tensors.
    Everything is checked (the source's files to copy included) before anything is written; the
    files are written to a temporary folder beside ``out`` (created with the usual permissions)
    and renamed into place when all are written.
    """
    from tqdm.auto import tqdm

    _check_chunk(expert_chunk)
    for name, v, lo in (("tp_size", tp_size, 1), ("tp_rank", tp_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ConfigError(f"{name}: expected an integer >= {lo}, got {v!r}")
    if tp_rank >= tp_size:
        raise ConfigError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank}")
    max_file_bytes = check_int("max_file_bytes", max_file_bytes, low=1)
    backend = Backend.parse(backend)
    src, out = _path_arg("src", src), _path_arg("out", out)
    if os.path.isfile(os.path.join(src, MANIFEST)):
        raise ConfigError(f"src {src!r}: holds {MANIFEST}, so it was written by wna16-jax convert; convert "
                          "reads a source checkpoint (the one named in its manifest's 'source')")
    ckpt = Checkpoint(src)
    check_output_folder(src, out, overwrite=overwrite)
    reason = TABLE[backend].layout_supports(ckpt.scheme, input_dtype=input_dtype)
    if reason:
        raise ConfigError(f"backend {backend} cannot represent {ckpt.scheme.describe()}: {reason}")
    to_copy = {name: _checked_source_file(src, name) for name in model_file_names(src)}
    plan = _plan_tensor_files(ckpt, non_expert_tensor_names(ckpt), max_file_bytes)
    parent = os.path.dirname(os.path.abspath(out))
    base = os.path.basename(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = _new_folder(parent, f".{base}.partial-")
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
            _write_arrays(os.path.join(tmp, fname), tensors)
            entry["file"] = fname
            layers[str(li)] = entry
            del layer, converted, tensors
        tensor_files = {fname: {"bytes": _copy_tensors(ckpt, names, os.path.join(tmp, fname))}
                        for fname, names in tqdm(plan.items(), desc="copy the other tensors", unit="file",
                                                 disable=not progress)}
        copied = {name: {"bytes": _copy_file(path, os.path.join(tmp, *name.split("/")))}
                  for name, path in to_copy.items()}
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
            "model": {"copied": copied, "tensor_files": tensor_files, "max_file_bytes": max_file_bytes,
                      "weight_map": {n: fname for fname, names in plan.items() for n in names}},
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.isdir(out):
            check_output_folder(src, out, overwrite=overwrite)     # nothing appeared meanwhile
            old = _new_folder(parent, f".{base}.old-")
            os.rename(out, os.path.join(old, "out"))
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------- reading


def _listed_files(folder: str, listing: Fields) -> dict[str, str]:
    """The files a manifest's ``listing`` (name → ``{"bytes": size}``) names, as name → path:
    each inside ``folder`` (links included), present, a regular file of the recorded size."""
    out = {}
    for name, entry in listing.data.items():
        where = f"{listing.where}[{name!r}]"
        path = _confined_file(folder, name, source=where)
        size = Fields(entry, where).integer("bytes", low=0)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise MissingTensorError(f"{where}: {name!r} is listed in the manifest but not found in "
                                     f"{folder!r}") from None
        except OSError as e:
            raise CorruptFileError(f"{path}: cannot read ({e.strerror or e})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptFileError(f"{path}: expected a regular file, got {stat.filemode(st.st_mode)}")
        if st.st_size != size:
            raise CorruptFileError(f"{path}: {st.st_size} bytes, but the manifest records {size} bytes "
                                   "(the file was truncated or replaced)")
        out[name] = path
    return out


class _ModelFiles:
    """The whole-model part of a converted folder (manifest version 3): the copied files and the
    non-expert tensor files, every name, size and confinement checked on open, each tensor
    file's header checked against the weight map, ``config.json`` parsed."""

    def __init__(self, folder: str, section: Any, where: str):
        if section is None:
            raise ConfigError(f"{where}: required field 'model' is missing (manifest version {VERSION} "
                              "folders carry the whole model)")
        f = Fields(section, f"{where}: field 'model'")
        self.folder = folder
        self.copied = _listed_files(folder, f.object("copied", REQUIRED))
        tensor_paths = _listed_files(folder, f.object("tensor_files", REQUIRED))
        weight_map = f.object("weight_map", REQUIRED)
        for name, fname in weight_map.data.items():
            if not isinstance(fname, str) or fname not in tensor_paths:
                raise weight_map.fail(name, f"must name one of the tensor_files {sorted(tensor_paths)}")
        self.weight_map: dict[str, str] = dict(weight_map.data)
        self.modules: dict[str, dict[str, str]] | None = None       # by module, when first asked
        self.files = {fname: self._checked_file(path, {n for n, fn in self.weight_map.items() if fn == fname})
                      for fname, path in tensor_paths.items()}
        if CONFIG not in self.copied:
            raise f.fail("copied", f"must list {CONFIG}", sorted(self.copied))
        cfg_path = self.copied[CONFIG]
        self.config = load_json(cfg_path, what=CONFIG)
        if not isinstance(self.config, dict):
            raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(self.config).__name__}")
        self.quant_config = QuantConfig.from_hf_config(self.config)

    @staticmethod
    def _checked_file(path: str, listed: set[str]) -> SafetensorsFile:
        """The safetensors file ``path`` (header checked), holding exactly the tensors ``listed``."""
        f = SafetensorsFile(path)
        missing, extra = sorted(listed - set(f.tensors)), sorted(set(f.tensors) - listed)
        if missing:
            raise MissingTensorError(f"{path}: lacks {len(missing)} tensor(s) the manifest's weight_map "
                                     f"puts there, e.g. {missing[:3]}")
        if extra:
            raise UnexpectedTensorError(f"{path}: holds {len(extra)} tensor(s) the manifest's weight_map "
                                        f"does not list, e.g. {extra[:3]}")
        return f

    def file_of(self, name: str) -> SafetensorsFile:
        """The file holding the non-expert tensor ``name``."""
        fname = self.weight_map.get(name) if isinstance(name, str) else None
        if fname is None:
            raise MissingTensorError(f"{name!r}: not a non-expert tensor of {self.folder!r} (the routed "
                                     "experts are read with load_layer)")
        return self.files[fname]


class ConvertedCheckpoint:
    """Read a folder written by :func:`convert_checkpoint`, through the reading interface of
    :class:`~wna16_jax.checkpoint.Checkpoint`.

    Attributes: ``path``, ``backend``, ``scheme`` (the experts'), ``model_config`` (the source's
    :class:`~wna16_jax.checkpoint.MoEModelConfig`), ``manifest`` (the parsed JSON), ``version``;
    the whole model (version 3): ``config`` (the parsed ``config.json``), ``quant_config``,
    :meth:`tensor_names` (the non-expert tensors), :meth:`tensor_info`, :meth:`read_tensor`,
    :meth:`read_many`, :meth:`locate`. :meth:`load_layer` gives a layer's experts in the backend
    layout. Opening checks the manifest, that each file it names lies inside the folder (links
    included), that the copied and non-expert files have the sizes it records and that each
    non-expert file's header is sound and holds the tensors the manifest puts there. A
    ConvertedCheckpoint is not a path: :func:`os.fspath` of one raises a
    :class:`~wna16_jax.errors.ConfigError`, so an API that expects a checkpoint folder says so.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = _path_arg("path", path)
        mpath = os.path.join(self.path, MANIFEST)
        if not os.path.isfile(mpath):
            raise ConfigError(f"{MANIFEST}: not found in {self.path!r} (not a converted checkpoint)")
        self._mpath = mpath
        m = load_json(mpath, what="the manifest")
        if not isinstance(m, dict):
            raise CorruptFileError(f"{mpath}: expected a JSON object, got {type(m).__name__}")
        if m.get("format") != FORMAT or isinstance(m.get("version"), bool) or m.get("version") not in READ_VERSIONS:
            raise ConfigError(f"{mpath}: expected format {FORMAT!r} version {VERSION}, got "
                              f"{m.get('format')!r} version {m.get('version')!r}")
        for key in ("backend", "scheme", "layers"):
            if key not in m:
                raise ConfigError(f"{mpath}: required field {key!r} is missing")
        self.manifest = m
        self.version: int = m["version"]
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
            _confined_file(self.path, entry["file"], source=f"{mpath}: layers[{k!r}].file")
        self._model = (_ModelFiles(self.path, m.get("model"), mpath) if self.version >= WHOLE_MODEL_VERSION
                       else None)
        if self._model is not None:
            self._check_config_agrees()

    def __fspath__(self):
        raise ConfigError(f"{self.path!r}: got a ConvertedCheckpoint where a checkpoint folder path (or a "
                          "wna16_jax.Checkpoint) is expected; pass it to an API that takes a converted "
                          "checkpoint (QuantizedMoE.from_checkpoint, wna16_jax.serialize.open_checkpoint)")

    def __repr__(self) -> str:
        return f"ConvertedCheckpoint({self.path!r}, backend={self.backend.name}, version={self.version})"

    def _check_config_agrees(self) -> None:
        cfg_path = self._model.copied[CONFIG]
        from_config = MoEModelConfig.from_hf_config(self._model.config)
        if self.model_config is None:
            raise ConfigError(f"{self._mpath}: required field 'model_config' is missing")
        diff = {f.name: (getattr(from_config, f.name), getattr(self.model_config, f.name))
                for f in dataclasses.fields(MoEModelConfig)
                if getattr(from_config, f.name) != getattr(self.model_config, f.name)}
        if diff:
            raise ConfigError(f"{cfg_path}: disagrees with the manifest's model_config: "
                              + ", ".join(f"{k} is {a!r} there, {b!r} in the manifest" for k, (a, b) in diff.items()))

    # ------------------------------------------------------------------ the whole model
    def _whole(self, what: str) -> _ModelFiles:
        if self._model is None:
            raise UnsupportedError(f"{self._mpath}: manifest version {self.version} holds only the converted MoE "
                                   f"layers, not the whole model (no {what}); convert the source again with "
                                   f"this version of wna16-jax (manifest version {VERSION})")
        return self._model

    @property
    def config(self) -> dict:
        """The parsed ``config.json`` (copied from the source as it is)."""
        return self._whole(CONFIG).config

    @property
    def quant_config(self) -> QuantConfig:
        """The source's ``quantization_config`` (the non-expert tensors are stored as it says)."""
        return self._whole(CONFIG).quant_config

    def tensor_names(self) -> list[str]:
        """Every non-expert tensor of the source, sorted (the routed experts: :meth:`load_layer`)."""
        return sorted(self._whole("non-expert tensors").weight_map)

    def tensor_info(self, name: str) -> TensorInfo:
        """Header entry (dtype, shape, offsets) of the non-expert tensor ``name``, no data read."""
        return self._whole("non-expert tensors").file_of(name).info(name)

    def read_tensor(self, name: str) -> np.ndarray:
        """The non-expert tensor ``name`` as stored in the source."""
        return self._whole("non-expert tensors").file_of(name).read(name)

    def read_many(self, into: Sequence[tuple[str, np.ndarray]], names: Sequence[str],
                  slices: Any = None) -> dict[str, np.ndarray]:
        """As :meth:`Checkpoint.read_many`: each ``(name, destination)`` of ``into`` read straight
        into its destination, each of ``names`` into a new array (returned by name), a name of
        ``slices`` (``name: (axis, slice)``) as that slice only."""
        files = self._whole("non-expert tensors")
        slices = slices or {}
        for name, dst in into:
            files.file_of(name).read_into(name, dst)
        return {name: (files.file_of(name).read(name) if name not in slices
                       else files.file_of(name).read_slice(name, *slices[name])) for name in names}

    def module_tensors(self, module: str) -> dict[str, str]:
        """As :meth:`Checkpoint.module_tensors`, over the non-expert tensors."""
        files = self._whole("non-expert tensors")
        if files.modules is None:
            files.modules = index_by_module(files.weight_map)
        return files.modules.get(module, {})

    def locate(self, name: str) -> str:
        """``name (in <file>)``, for messages."""
        fname = self._model.weight_map.get(name, "?") if self._model is not None else "?"
        return f"{name} (in {fname})"

    # ------------------------------------------------------------------ the converted layers
    @property
    def moe_layer_indices(self) -> list[int]:
        return sorted(int(k) for k in self.manifest["layers"])

    def load_layer(self, layer_index: int, *, experts: Sequence[int] | None = None) -> MoELayer:
        """The layer as a :class:`~wna16_jax.checkpoint.MoELayer` whose experts are in the backend
        layout. ``experts``: the routed experts to read (increasing indices; None: all), reading
        only their rows of each stacked tensor; the router and shared experts are read whole."""
        entry = self.manifest["layers"].get(str(layer_index)) if isinstance(layer_index, (int, np.integer)) \
            and not isinstance(layer_index, bool) else None
        if entry is None:
            raise ValueRangeError(f"layer_index: {layer_index!r} is not in {self.path!r}; "
                                  f"layers are {self.moe_layer_indices}")
        where = f"{self._mpath}: layers['{layer_index}']"
        fpath = _confined_file(self.path, entry["file"], source=f"{where}.file")
        if not os.path.isfile(fpath):
            raise MissingTensorError(f"{where}.file: {entry['file']!r} not found in {self.path!r}")
        f = SafetensorsFile(fpath)
        known = {"router", "e_score_correction_bias", "shared_expert_gate"}
        for name in f.keys():
            if name not in known and not name.startswith(("experts.", "shared_experts.")):
                raise UnexpectedTensorError(f"{fpath}: tensor {name!r} is not part of a converted layer")

        if "router" not in f.tensors:
            raise MissingTensorError(f"router: listed in the manifest but missing from {fpath}")
        total = int((f.info("router").shape or (0,))[0])      # the layer's experts, from the header
        chosen = check_expert_ids(experts, total)

        def read(name):
            if name not in f.tensors:
                raise MissingTensorError(f"{name}: listed in the manifest but missing from {fpath}")
            if chosen is not None and name.startswith("experts.") and f.info(name).shape[:1] == (total,):
                return f.read_rows(name, chosen)
            return f.read(name)

        experts = pytree_from_entry("experts.", entry["experts"], read, where=f"{where}.experts",
                                    rows=None if chosen is None else (total, len(chosen)))
        shared = (pytree_from_entry("shared_experts.", entry["shared_experts"], read,
                                    where=f"{where}.shared_experts")
                  if "shared_experts" in entry else None)
        cfg = self.model_config
        if cfg is not None:
            tp = self.manifest.get("tensor_parallel", {}).get("tp_size", 1) if isinstance(
                self.manifest.get("tensor_parallel"), dict) else 1
            for what, want, got in (("experts", cfg.num_experts, total),
                                    ("hidden size", cfg.hidden_size, experts.hidden_size),
                                    ("intermediate size", cfg.moe_intermediate_size,
                                     experts.intermediate_size * (tp if isinstance(tp, int) else 1))):
                if want != got:
                    raise ShapeError(f"{where}: {what} {got} disagrees with the manifest's model_config ({want})")
        _check_decodes(experts, f"{where}.experts")
        if shared is not None:
            _check_decodes(shared, f"{where}.shared_experts")
        router = read("router")
        if router.shape != (total, experts.hidden_size):
            raise ShapeError(f"{fpath}: router: expected shape {(total, experts.hidden_size)}, "
                             f"got {router.shape}")
        bias = read("e_score_correction_bias") if "e_score_correction_bias" in f.tensors else None
        gate = read("shared_expert_gate") if "shared_expert_gate" in f.tensors else None
        return MoELayer(layer_index, experts, router, bias, shared, gate)

    def iter_layers(self) -> Iterator[MoELayer]:
        for li in self.moe_layer_indices:
            yield self.load_layer(li)


def open_checkpoint(path: str | os.PathLike | Checkpoint | ConvertedCheckpoint) -> Checkpoint | ConvertedCheckpoint:
    """The checkpoint folder ``path`` opened as what it is: a folder holding ``manifest.json``
    (written by :func:`convert_checkpoint`) as a :class:`ConvertedCheckpoint`, any other as a
    :class:`~wna16_jax.checkpoint.Checkpoint`; an already opened one is returned as it is."""
    if isinstance(path, (Checkpoint, ConvertedCheckpoint)):
        return path
    folder = _path_arg("path", path)
    return ConvertedCheckpoint(folder) if os.path.isfile(os.path.join(folder, MANIFEST)) else Checkpoint(folder)


def _model_config(d: Any, where: str) -> MoEModelConfig | None:
    """The manifest's ``model_config``: the routing nested (version 4) or flat (versions 1–3)."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: field 'model_config' must be an object, got {d!r}")
    d = dict(d)
    routing_names = [f.name for f in dataclasses.fields(MoERouting)]
    if "routing" in d:
        r = d.pop("routing")
        if not isinstance(r, dict):
            raise ConfigError(f"{where}: field 'model_config.routing' must be an object, got {r!r}")
        unknown = sorted(set(r) - set(routing_names))
        if unknown:
            raise ConfigError(f"{where}: field 'model_config.routing' has unknown keys {unknown}")
    else:
        r = {n: d.pop(n) for n in routing_names if n in d}
    fields = {f.name for f in dataclasses.fields(MoEModelConfig)} - {"routing"}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ConfigError(f"{where}: field 'model_config' has unknown keys {unknown}")
    for k in ("num_experts", "hidden_size", "moe_intermediate_size"):
        v = d.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where}: model_config.{k} must be a positive integer, got {v!r}")
    try:
        routing = MoERouting(**r)
        return MoEModelConfig(**d, routing=routing)
    except TypeError as e:
        raise ConfigError(f"{where}: field 'model_config' is incomplete ({e})") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: model_config.{e}") from None


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


__all__ = ["convert_checkpoint", "convert_layer", "ConvertedCheckpoint", "open_checkpoint", "LAYOUTS", "MANIFEST",
           "VERSION", "check_output_folder", "model_file_names", "non_expert_tensor_names"]
