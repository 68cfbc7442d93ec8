"""The wna16-jax command.

  demo               write a tiny MoE in every format, run every layout, compare with float64
  inspect DIR        scheme, MoE layers, shapes and backend selection of a checkpoint
  convert DIR        every MoE layer in a backend's layout (safetensors files + manifest.json)
  generate DIR       continue one prompt (streamed) or a batch of prompts with the whole model
  chat DIR           a multi-turn conversation through the checkpoint's chat template
  serve DIR          an OpenAI-compatible HTTP server (continuous batching, paged KV cache)

DIR is a checkpoint folder, a Hugging Face cache folder (models--ORG--NAME) or a hub id (ORG/NAME)
already in the local Hugging Face cache; nothing is downloaded. Bad input prints one line,
"error: <Kind>: <message>", and exits with status 2; Ctrl-C exits with status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
import warnings
from typing import Iterable, Iterator, Sequence, TextIO

import numpy as np

from .errors import ConfigError, OutputPathError, WNA16Error
from .fields import check_int, show_value

#: the activation dtypes ``--dtype`` takes (``load_model``'s ``dtype``)
DTYPES = ("float32", "bfloat16", "float16")
#: the activation dtypes ``convert --input-dtype`` takes (Marlin's 8-bit activations)
INPUT_DTYPES = ("int8", "float8_e4m3fn")
#: a larger ``--prompt-file`` is refused by its size, before it is read
MAX_PROMPT_FILE_BYTES = 64 * 2**20
#: the KV-cache length ``chat`` compiles for when ``--max-len`` is not given (or the model's
#: ``max_position_embeddings`` when that is smaller)
CHAT_MAX_LEN = 4096
#: the exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130
#: the exit status when stdout's reader went away (128 + SIGPIPE, as a shell reports it)
EXIT_BROKEN_PIPE = 141
#: what ends a chat besides the end of its input
CHAT_EXIT = "/exit"

# --------------------------------------------------------------------------- demo


@dataclasses.dataclass(frozen=True)
class DemoCase:
    name: str
    quant_config: dict
    model_type: str
    bias: bool = False
    grouped: bool = False          # DeepSeek-V3 style grouped sigmoid routing
    shared: bool = False


DEMO_CASES: tuple[DemoCase, ...] = (
    DemoCase("AWQ g128", {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                          "version": "gemm"}, "mixtral", bias=True),
    DemoCase("AWQ g32", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                         "version": "gemm"}, "qwen3_moe"),
    DemoCase("GPTQ 4b g128", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                              "sym": True}, "qwen3_moe", bias=True),
    DemoCase("GPTQ 4b g64 actorder", {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                       "desc_act": True, "sym": True}, "mixtral"),
    DemoCase("GPTQ 8b channel", {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False,
                                 "sym": True}, "mixtral"),
    DemoCase("CT 4b g128 sym", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                    "group_size": 128}}}}, "deepseek_v3", grouped=True, shared=True),
    DemoCase("CT 4b g32 sym", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                   "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                   "group_size": 32}}}}, "qwen3_moe"),
    DemoCase("CT 4b g64 asym", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                    "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                    "group_size": 64}}}}, "mixtral"),
    DemoCase("CT 8b channel", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                   "num_bits": 8, "type": "int", "symmetric": True,
                                   "strategy": "channel"}}}}, "qwen3_moe"),
)

#: relative error bound for bf16 activations vs the float64 reference (bf16 has an 8-bit mantissa:
#: rounding the input and the output alone costs ~2^-8 relative; a real bug costs O(1)).
DEMO_TOLERANCE = 2e-2


def _route(layer, cfg, x):
    """``(topk_weights, topk_ids)`` of ``x`` as the model routes it: :meth:`QuantizedMoE.route`
    of the layer (its router, scoring, renormalisation, grouped top-k and scaling), on the
    checkpoint's own layout (nothing converted)."""
    from .backends import Backend
    from .nn import QuantizedMoE

    return QuantizedMoE.from_layer(layer, cfg, backend=Backend.LOADER).route(x)


def _reference(x, tw, ids, experts) -> np.ndarray:
    """float64 per-token loop on the loader layout decoded with numpy (no jax)."""
    w = experts.to_numpy()
    l13, l2 = w.decode()
    w13 = _np_dequant(l13)
    w2 = _np_dequant(l2)
    b13 = None if w.w13_bias is None else np.asarray(w.w13_bias, np.float64)
    b2 = None if w.w2_bias is None else np.asarray(w.w2_bias, np.float64)
    xs = np.asarray(x, np.float64)
    out = np.zeros((xs.shape[0], w2.shape[1]))
    for t in range(xs.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ xs[t] + (0 if b13 is None else b13[e])
            i = h.shape[0] // 2
            a = h[:i] / (1 + np.exp(-h[:i])) * h[i:]
            out[t] += float(tw[t, j]) * (w2[e] @ a + (0 if b2 is None else b2[e]))
    return out


def _np_dequant(lq) -> np.ndarray:
    z, s = lq.expanded()
    return (np.asarray(lq.codes, np.int64) - np.asarray(z, np.int64)) * np.asarray(s, np.float64)


#: the demo table's columns after format and selection: every layout, the loader's first.
_DEMO_COLUMNS = ("LOADER", "CPU", "XPU", "MARLIN", "BATCHED_MARLIN", "FLASHINFER_TRTLLM", "HUMMING")
_DEMO_SHORT = {"BATCHED_MARLIN": "BMARLIN", "FLASHINFER_TRTLLM": "TRTLLM"}


def _say(msg: str, out) -> None:
    print(msg, file=out, flush=True)


def _demo_layer(case: DemoCase, rng, root: str, experts: int, hidden: int, intermediate: int):
    """Write ``case``'s one-layer checkpoint under ``root``; ``(scheme, layer, model config)``."""
    from .checkpoint import Checkpoint
    from .schemes import QuantScheme
    from .writers import random_moe_layer, write_checkpoint

    scheme = QuantScheme.from_quant_config(case.quant_config)
    layer_f = random_moe_layer(rng, experts, hidden, intermediate, bias=case.bias,
                               shared_intermediate=intermediate if case.shared else None,
                               score_bias=case.grouped)
    path = os.path.join(root, case.name.replace(" ", "_"))
    write_checkpoint(path, scheme, [layer_f], model_type=case.model_type,
                     top_k=2 if not case.grouped else 4,
                     renormalize=True, scoring_func="sigmoid" if case.grouped else "softmax",
                     num_expert_group=4 if case.grouped else None,
                     topk_group=2 if case.grouped else None,
                     routed_scaling_factor=2.5 if case.grouped else 1.0)
    ckpt = Checkpoint(path)
    return scheme, ckpt.load_layer(ckpt.moe_layer_indices[0]), ckpt.model_config


def _demo_selected(scheme, dev, layer):
    """``(the backend the table selects for the layer, a note)``: on a fallback to the loader
    layout the note lists every refusal (the table's warning is silenced), else it is None."""

    from .backends import Backend, BackendFallbackWarning, backend_reasons, priority_backends, select_backend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)
        selected = select_backend(scheme, dev, has_bias=layer.experts.has_bias())
    if selected is not Backend.LOADER:
        return selected, None
    reasons = backend_reasons(scheme, dev, has_bias=layer.experts.has_bias())
    return selected, "runs the loader layout; " + "; ".join(f"{b.name}: {reasons[b]}" for b in priority_backends(dev))


def _demo_cells(scheme, layer, x, tw, ids, ref, selected, fused) -> tuple[list[str], str, int]:
    """One table row's cells (each layout's relative error against ``ref``, ``-`` where the
    layout cannot hold the format), the selected layout's milliseconds, and the failures."""
    import jax.numpy as jnp

    from .backends import TABLE, Backend
    from .moe import shared_expert_moe

    cells, timing, failures = [], "", 0
    for col in _DEMO_COLUMNS:
        b = Backend[col]
        spec = TABLE[b]
        if spec.layout_supports(scheme, has_bias=layer.experts.has_bias()):
            cells.append("-")
            continue
        w = spec.convert(scheme, layer.experts.to_jax())
        y = fused(x, tw, ids, w).astype(jnp.float32)
        if layer.shared_experts is not None:
            y = y + shared_expert_moe(x, layer.shared_experts.to_jax()).astype(jnp.float32)
        y = np.asarray(y, np.float64)
        err = float(np.abs(y - ref).max() / np.abs(ref).max()) if np.isfinite(y).all() else float("inf")
        ok = err <= DEMO_TOLERANCE
        failures += not ok
        cells.append(f"{err:.1e}" if ok else "FAIL")
        if b is selected:
            timing = _demo_ms(fused, x, tw, ids, w)
    return cells, timing, failures


def _demo_ms(fused, x, tw, ids, w, reps: int = 5) -> str:
    """Milliseconds of one call (after a warm-up), the mean of ``reps``."""
    fused(x, tw, ids, w).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        fused(x, tw, ids, w).block_until_ready()
    return f"{(time.perf_counter() - t0) / reps * 1e3:.2f}"


def _demo_row(case: DemoCase, rng, root: str, sizes: tuple[int, int, int, int], dev, fused
              ) -> tuple[str, int, str | None]:
    """``(the table line, failures, a fallback note or None)`` of one format: write, load, route,
    reference, every layout."""
    import jax.numpy as jnp

    tokens, experts, hidden, intermediate = sizes
    scheme, layer, cfg = _demo_layer(case, rng, root, experts, hidden, intermediate)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    tw, ids = _route(layer, cfg, x)
    x64 = np.asarray(x.astype(jnp.float32))
    ref = _reference(x64, np.asarray(tw), np.asarray(ids), layer.experts)
    if layer.shared_experts is not None:
        ref = ref + _reference(x64, np.ones((tokens, 1)), np.zeros((tokens, 1), np.int64), layer.shared_experts)
    selected, note = _demo_selected(scheme, dev, layer)
    cells, timing, failures = _demo_cells(scheme, layer, x, tw, ids, ref, selected, fused)
    line = f"{case.name:<21}{selected.name:<8}" + "".join(f"{c:>9}" for c in cells) + f"{timing:>8}"
    return line, failures, None if note is None else f"{case.name}: {note}"


def _demo_options(tokens, experts, hidden, intermediate, seed, keep) -> tuple[int, str | None]:
    """The checked ``(seed, keep)``; the sizes are checked too."""
    for name, v in (("--tokens", tokens), ("experts", experts), ("hidden", hidden),
                    ("intermediate", intermediate)):
        check_int(name, v, low=1)
    seed = check_int("--seed", seed, low=0)
    if keep is not None:
        keep = os.fspath(keep)
        if os.path.lexists(keep) and (not os.path.isdir(keep) or os.listdir(keep)):
            raise OutputPathError(f"--out {keep!r}: must be a new or empty folder")
    return seed, keep


def run_demo(*, tokens: int = 16, experts: int = 8, hidden: int = 256, intermediate: int = 256,
             seed: int = 0, out=None, progress=None, keep: str | None = None) -> int:
    """Write the tiny MoE in every format, load, select, run under jit, compare. Returns exit code.

    Each row is printed (and flushed) as soon as its format is done; ``progress`` gets a line
    before each format. ``keep``: a folder (new or empty) that keeps the written checkpoints.
    ``out`` / ``progress`` default to stdout / stderr.
    """
    import jax

    from .backends import Device
    from .moe import fused_moe

    seed, keep = _demo_options(tokens, experts, hidden, intermediate, seed, keep)
    out, progress = out or sys.stdout, progress or sys.stderr
    rng = np.random.default_rng(seed)
    dev = Device.current()
    _say(f"wna16-jax demo on {dev.describe()} (jax {jax.__version__}), seed {seed}: a tiny MoE "
         f"(E={experts}, H={hidden}, I={intermediate}) in {len(DEMO_CASES)} formats, {tokens} bf16 "
         f"tokens.", out)
    _say(f"Cells: relative error max|out - ref| / max|ref| of each layout against a float64 "
         f"reference (tolerance {DEMO_TOLERANCE:g}); '-': the layout cannot hold the format. "
         "ms: one call of the selected layout.", out)
    header = (f"{'format':<21}{'selected':<8}" + "".join(f"{_DEMO_SHORT.get(c, c):>9}" for c in _DEMO_COLUMNS)
              + f"{'ms':>8}")
    _say(header, out)
    _say("-" * len(header), out)
    failures, notes, fused = 0, [], jax.jit(fused_moe)
    with tempfile.TemporaryDirectory() as tmp:
        for n, case in enumerate(DEMO_CASES, 1):
            _say(f"[{n}/{len(DEMO_CASES)}] {case.name}: writing, loading, converting to every layout, "
                 "compiling and running ...", progress)
            line, failed, note = _demo_row(case, rng, keep or tmp, (tokens, experts, hidden, intermediate), dev,
                                           fused)
            failures += failed
            notes += [note] if note else []
            _say(line, out)
    _say("-" * len(header), out)
    return _demo_verdict(failures, notes, keep, out)


def _demo_verdict(failures: int, notes: list[str], keep: str | None, out) -> int:
    """Print the fallback notes and the verdict; the exit status (1 if any result failed)."""
    for note in notes:
        _say("fallback: " + note, out)
    if keep:
        _say(f"checkpoints kept in {keep}", out)
    if failures:
        _say(f"FAILED: {failures} result(s) out of tolerance", out)
        return 1
    _say("all results within tolerance", out)
    return 0


# --------------------------------------------------------------------------- inspect


def run_inspect(path: str, out=None, device=None, *, revision: str | None = None) -> int:
    """Describe a checkpoint folder, or a folder written by ``wna16-jax convert``; ``path`` may
    also be a Hugging Face cache folder or a cached hub id (:func:`~wna16_jax.hub.resolve_model_dir`)."""
    from .hub import resolve_model_dir
    from .serialize import MANIFEST

    out = out or sys.stdout
    path = resolve_model_dir(path, revision=revision)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return _inspect_converted(path, out)
    return _inspect_checkpoint(path, out, device)


def _inspect_checkpoint(path: str, out, device) -> int:
    from .backends import Device
    from .checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    s, cfg = ckpt.scheme, ckpt.model_config
    print(f"checkpoint: {path}", file=out)
    print(f"scheme:     {s.describe()}  (weight type {s.weight_type}, key {s.weight_key})", file=out)
    print(f"model:      {cfg.model_type}: {cfg.num_experts} experts, top-{cfg.top_k}, H={cfg.hidden_size}, "
          f"I={cfg.moe_intermediate_size}, {cfg.scoring_func}"
          f"{' renormalized' if cfg.renormalize else ''}"
          f"{f', {cfg.num_expert_group} groups keep {cfg.topk_group}' if cfg.grouped else ''}", file=out)
    idx = ckpt.moe_layer_indices
    print(f"MoE layers: {len(idx)} ({idx[0]}..{idx[-1]})", file=out)
    layer = ckpt.load_layer(idx[0])
    print(f"layer {idx[0]} tensors (loader layout):", file=out)
    w = layer.experts
    for name in w.array_fields():
        a = getattr(w, name)
        if a is not None:
            print(f"  {name:<14} {str(tuple(a.shape)):<20} {np.dtype(a.dtype).name}", file=out)
    print(f"  router         {str(tuple(layer.router.shape)):<20} {np.dtype(layer.router.dtype).name}", file=out)
    if layer.shared_experts is not None:
        print(f"  shared experts {type(layer.shared_experts).__name__} "
              f"(I={layer.shared_experts.intermediate_size})", file=out)
    _print_backends(s, device or Device.current(), dict(has_bias=w.has_bias(), hidden_size=w.hidden_size,
                                                       intermediate_size=w.intermediate_size), out)
    return 0


def _print_backends(s, dev, req: dict, out) -> None:
    """Every backend of the table for scheme ``s`` and the layer ``req`` on ``dev``: selected,
    supported or the reason not, and whether its layout can hold the layer."""

    from .backends import TABLE, Backend, BackendFallbackWarning, backend_reasons, priority_backends, select_backend

    prio = priority_backends(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)
        selected = select_backend(s, dev, **req)
    print(f"backends on {dev.describe()} (priority: {', '.join(b.name for b in prio) or 'none'}, "
          "then LOADER):", file=out)
    for b, reason in backend_reasons(s, dev, **req).items():
        if b is selected:
            status = "SELECTED" + (" (fallback: no converting row accepts this layer)"
                                   if b is Backend.LOADER else "")
        elif reason is None:
            status = "supported" + ("" if b in prio or b is Backend.LOADER else " (not in this platform's list)")
        else:
            status = "no: " + reason
        layout = TABLE[b].layout_supports(s, **req)
        where = ("convertible here (runs via " + TABLE[b].executes_on + ")" if layout is None
                 else "not convertible: " + layout)
        print(f"  {b.name:<18} {status}", file=out)
        print(f"  {'':<18} layout: {TABLE[b].layout}; {where}", file=out)


def _inspect_converted(path: str, out) -> int:
    from .safetensors_io import SafetensorsFile, confined_path
    from .serialize import ConvertedCheckpoint

    conv = ConvertedCheckpoint(path)
    m, cfg = conv.manifest, conv.model_config
    print(f"converted checkpoint: {path}", file=out)
    print(f"backend:    {conv.backend.name}  (input dtype {m.get('input_dtype') or '16-bit'})", file=out)
    print(f"scheme:     {conv.scheme.describe()}", file=out)
    if cfg is not None:
        print(f"model:      {cfg.model_type}: {cfg.num_experts} experts, top-{cfg.top_k}, "
              f"H={cfg.hidden_size}, I={cfg.moe_intermediate_size}", file=out)
    src = m.get("source") if isinstance(m.get("source"), dict) else {}
    print(f"source:     {src.get('path', '?')}", file=out)
    idx = conv.moe_layer_indices
    print(f"MoE layers: {len(idx)}" + (f" ({idx[0]}..{idx[-1]})" if idx else ""), file=out)
    if idx:
        entry = m["layers"][str(idx[0])]
        f = SafetensorsFile(confined_path(path, entry["file"], source="manifest"))
        print(f"layer {idx[0]} tensors ({entry['experts'].get('class')}, from the file header):", file=out)
        for name, t in f.tensors.items():
            print(f"  {name:<32} {str(t.shape):<22} {t.dtype.name}", file=out)
    return 0


# --------------------------------------------------------------------------- prompts


#: one ``--prompt-ids`` entry: an optionally negative decimal integer (refused below when negative)
_ID_TEXT = re.compile(r"-?[0-9]{1,40}", re.ASCII)


def parse_prompt_ids(text: str, name: str = "--prompt-ids") -> list[int]:
    """``"1,2,3"`` as ``[1, 2, 3]``: comma-separated decimal token ids (spaces around them
    allowed); an empty entry, a non-integer or a negative id is a :class:`ConfigError` naming
    ``name`` and the entry. The upper bound (the vocabulary) is checked where the model is known."""
    ids = []
    for j, entry in enumerate(text.split(",")):
        entry = entry.strip()
        if not entry:
            raise ConfigError(f"{name}: entry {j} of {show_value(text)} is empty (expected comma-separated token ids "
                              "like 1,2,3)")
        if not _ID_TEXT.fullmatch(entry):
            raise ConfigError(f"{name}: entry {j} of {show_value(text)} must be a token id (a decimal integer), "
                              f"got {show_value(entry)}")
        ids.append(check_int(f"{name}[{j}]", int(entry), low=0))
    return ids


def read_prompt_file(path: str) -> list[str]:
    """The prompts of ``path``: one per line (``\\n`` or ``\\r\\n``), blank lines skipped. The file
    must be a regular UTF-8 file of at most :data:`MAX_PROMPT_FILE_BYTES` (checked by its size
    before it is read) holding at least one prompt."""
    from .models.tokenizer import read_text_file, regular_file_size

    what = "--prompt-file"
    if regular_file_size(path, MAX_PROMPT_FILE_BYTES, what) is None:
        raise ConfigError(f"{what} {path!r}: no such file")
    lines = [line.removesuffix("\r") for line in read_text_file(path, MAX_PROMPT_FILE_BYTES, what).split("\n")]
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"{what} {path!r}: holds no prompt (expected one prompt per line; every line is blank)")
    return prompts


def cli_tokenizer(folder: str, needed_by: str, alternative: str):
    """The folder's tokenizer for ``needed_by`` (an argument or a command); a folder without
    ``tokenizer.json`` is told to use ``alternative``."""
    from .models.tokenizer import TOKENIZER_JSON, load_tokenizer

    if not os.path.lexists(os.path.join(folder, TOKENIZER_JSON)):
        raise ConfigError(f"{needed_by}: {folder!r} has no {TOKENIZER_JSON} to turn text into tokens; "
                          f"{alternative}")
    return load_tokenizer(folder)


def _require_chat_template(tok, needed_by: str) -> None:
    from .models.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG

    if not tok.chat_templates:
        raise ConfigError(f"{needed_by}: {tok.folder!r} has no chat template (no 'chat_template' in "
                          f"{TOKENIZER_CONFIG}, no {CHAT_TEMPLATE_FILE}); use generate with a plain --prompt")


def _conversation_start(system: str | None) -> list[dict]:
    return [] if system is None else [{"role": "system", "content": system}]


# --------------------------------------------------------------------------- shared by generate and chat


@dataclasses.dataclass(frozen=True)
class _GenerationArgs:
    """The generation settings both commands take, checked before the model is loaded (a bad
    value is refused before minutes of loading, by the same rules the generator applies)."""

    max_new_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int
    max_len: int | None

    @classmethod
    def checked(cls, max_new_tokens, temperature, top_p, top_k, seed, max_len) -> "_GenerationArgs":
        from .models.generation import MAX_CACHE_LEN, MAX_SEED, sampling_settings
        from .models.generation_config import GenerationDefaults

        sampling_settings(GenerationDefaults(), temperature, top_p, top_k, keyed=True)
        return cls(check_int("--max-new-tokens", max_new_tokens, low=1), temperature, top_p, top_k,
                   check_int("--seed", seed, low=0, high=MAX_SEED),
                   None if max_len is None else check_int("--max-len", max_len, low=1, high=MAX_CACHE_LEN))

    def key(self):
        from .models.generation import as_prng_key

        return as_prng_key(self.seed)


def load_cli_model(folder: str, dtype: str | None, mesh: str | None = None):
    """``(model, description)``: the model of ``folder`` (already resolved) in ``dtype`` (one of
    :data:`DTYPES`; None: the library's default), placed on the mesh of spec ``mesh`` (``--mesh``:
    ``tp2``, ``ep4xtp2``, over this process's first devices; None: one device), and what was
    loaded in how long, for the user. The callers print it once the request is accepted, so that a
    refused one prints one line."""
    from .models.decoder import load_model
    from .models.mesh import local_mesh

    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype: expected one of {list(DTYPES)}, got {show_value(dtype)}")
    devices = None if mesh is None else local_mesh(mesh, name="--mesh")
    t0 = time.perf_counter()
    model = load_model(folder, dtype=dtype, mesh=devices)
    c = model.config
    seconds = time.perf_counter() - t0
    where = "" if devices is None else f", on {devices.devices.size} devices as {mesh}"
    return model, f"loaded {folder} ({c.family}, {c.num_layers} layers, {model.dtype}{where}) in {seconds:.1f} s"


class _Printer:
    """Prints completions as the generator reports its steps (``callback(step, tokens)``).

    One prompt is streamed token by token, after the prompt's own text when ``echo`` (printed with
    the first new token, so a refused request prints nothing); a batch prints each prompt's
    completion, labelled ``[i]``, when its row finishes. Text goes through the tokenizer
    (``tok``); without one, ids are printed comma-separated. Stop tokens are not printed. Counts
    the tokens and times the first one, for :meth:`summary`."""

    def __init__(self, rows: Sequence[Sequence[int]], stops: Iterable[int], tok, *, echo: bool, out: TextIO):
        self.rows, self.stops, self.tok, self.echo, self.out = rows, frozenset(stops), tok, echo, out
        self.new: list[list[int]] = [[] for _ in rows]
        self.done = [False] * len(rows)
        self.streaming = len(rows) == 1
        self.push = tok.stream_decoder(rows[0]) if self.streaming and tok is not None else None
        self.count, self.t0, self.t_first, self.t_end = 0, time.perf_counter(), None, None

    def _write(self, text: str) -> None:
        print(text, end="", file=self.out, flush=True)

    def _text(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids)) if self.tok is not None else ",".join(map(str, ids))

    def step(self, step: int, tokens: np.ndarray) -> None:
        if self.t_first is None:         # the request was accepted
            self.t_first = time.perf_counter()
            if self.streaming and self.echo:
                self._write(self._text(self.rows[0]))
        for i, t in enumerate(int(t) for t in tokens):
            if t < 0 or self.done[i]:
                continue
            self.count += 1
            if t in self.stops:
                self._finish(i)
                continue
            self.new[i].append(t)
            if self.streaming:
                self._write(self.push(t) if self.push is not None else f",{t}")

    def _finish(self, i: int) -> None:
        self.done[i] = True
        if self.streaming:
            self._write("\n")
        else:
            ids = [*self.rows[i], *self.new[i]] if self.echo else self.new[i]
            self._write(f"[{i}] {self._text(ids)}\n")

    def close(self) -> None:
        """Print the rows that ran to ``max_new_tokens`` (they met no stop token)."""
        self.t_end = time.perf_counter()
        for i, done in enumerate(self.done):
            if not done:
                self._finish(i)

    def summary(self) -> str:
        if self.t_first is None:
            return "no new tokens"
        first = f"first after {self.t_first - self.t0:.2f} s (prefill, compiling included)"
        after = self.count - len(self.rows)
        rate = (f"{after / (self.t_end - self.t_first):.1f} tokens/s after it" if after > 0 and
                self.t_end > self.t_first else "no decode step")
        return f"{self.count} new tokens; {first}; {rate}"


# --------------------------------------------------------------------------- generate


def _text_rows(tok, texts: Sequence[str], chat: bool, system: str | None) -> list[list[int]]:
    """The token ids of each text prompt: encoded, or with ``chat`` rendered as a user turn (after
    ``system``) by the chat template; a prompt without tokens is refused, naming it."""
    if chat:
        _require_chat_template(tok, "--chat")
    rows = []
    for i, text in enumerate(texts):
        label = "--prompt" if len(texts) == 1 else f"--prompt[{i}]"
        ids = (tok.apply_chat_template([*_conversation_start(system), {"role": "user", "content": text}])
               if chat else tok.encode(text))
        if not ids:
            raise ConfigError(f"{label}: the tokenizer gives no tokens for {show_value(text)}")
        rows.append(ids)
    return rows


def run_generate(path: str, *, prompts: Sequence[str] = (), prompt_file: str | None = None,
                 prompt_ids: Sequence[str] = (), chat: bool = False, system: str | None = None,
                 max_new_tokens: int = 32, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int = 0, max_len: int | None = None, dtype: str | None = None,
                 mesh: str | None = None, revision: str | None = None, use_stop: bool = True, out=None,
                 err=None) -> int:
    """Load the whole model at ``path`` and continue the prompts: text (``prompts`` and the lines
    of ``prompt_file``, through the folder's tokenizer; with ``chat`` each one rendered as a
    user turn, after ``system``, by the chat template) or token ids (``prompt_ids``: strings like
    ``"1,2,3"``). All prompts run as one batch through :func:`wna16_jax.models.generation.generate`;
    one prompt is streamed to ``out`` as it is generated, a batch printed prompt by prompt as each
    finishes. ``mesh``: a ``--mesh`` spec (:func:`load_cli_model`). ``temperature`` / ``top_p`` /
    ``top_k`` None: the model's generation_config.json
    defaults. What was loaded and the timing go to ``err``, in one line at the end (so that a refused
    request prints only its error). Returns the exit status (0)."""
    from .hub import resolve_model_dir
    from .models.generation import as_prompts, as_stop_tokens, generate

    out, err = out or sys.stdout, err or sys.stderr
    texts = list(prompts) + (read_prompt_file(prompt_file) if prompt_file is not None else [])
    if bool(texts) == bool(prompt_ids):
        raise ConfigError("generate: give text prompts (--prompt TEXT, --prompt-file FILE) or token ids "
                          "(--prompt-ids 1,2,3), " + ("not both" if texts else "got none"))
    if chat and not texts:
        raise ConfigError("--chat: renders text prompts through the chat template; --prompt-ids are token ids")
    if system is not None and not chat:
        raise ConfigError("--system: is the system message of a --chat prompt; pass --chat too")
    settings = _GenerationArgs.checked(max_new_tokens, temperature, top_p, top_k, seed, max_len)
    rows = [parse_prompt_ids(text, "--prompt-ids" if len(prompt_ids) == 1 else f"--prompt-ids[{i}]")
            for i, text in enumerate(prompt_ids)]
    folder = resolve_model_dir(path, revision=revision)
    tok = None
    if texts:
        tok = cli_tokenizer(folder, "--prompt", "give token ids with --prompt-ids 1,2,3 instead")
        rows += _text_rows(tok, texts, chat, system)
    model, loaded = load_cli_model(folder, dtype, mesh)
    name = "--prompt" if texts else "--prompt-ids"
    checked = as_prompts(rows[0] if len(rows) == 1 else rows, model.config.vocab_size, name=name)
    stops = as_stop_tokens(None if use_stop else (), model.config.eos_token_ids, model.config.vocab_size)
    printer = _Printer(checked.rows, stops, tok, echo=not chat, out=out)
    generate(model, checked, settings.max_new_tokens, max_len=settings.max_len, temperature=settings.temperature,
             top_p=settings.top_p, top_k=settings.top_k, key=settings.key(), stop_tokens=stops,
             callback=printer.step)
    printer.close()
    print(f"{loaded}; {len(checked.rows)} prompt(s) of {', '.join(str(len(r)) for r in checked.rows)} tokens: "
          f"{printer.summary()}", file=err, flush=True)
    return 0


# --------------------------------------------------------------------------- chat


def _user_turns(stdin: TextIO, err: TextIO) -> Iterator[str]:
    """The user's turns: the lines of ``stdin`` (blank ones skipped) until its end or a line
    :data:`CHAT_EXIT`; a ``> `` prompt on ``err`` before each when ``stdin`` is a terminal."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=err, flush=True)
        line = stdin.readline()
        if not line:
            return
        text = line.removesuffix("\n").removesuffix("\r")
        if text.strip() == CHAT_EXIT:
            return
        if text.strip():
            yield text


def run_chat(path: str, *, system: str | None = None, max_new_tokens: int = 256, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None, seed: int = 0, max_len: int | None = None,
             dtype: str | None = None, mesh: str | None = None, revision: str | None = None, stdin=None, out=None,
             err=None) -> int:
    """A conversation with the model at ``path``: each line of ``stdin`` is a user turn; the whole
    conversation (after ``system``, when given) is rendered by the folder's chat template with the
    assistant's header, the reply is streamed to ``out`` as it is generated, up to the model's eos
    ids or ``max_new_tokens``, and its decoded text joins the conversation as the assistant's turn.
    The input's end or a line ``/exit`` ends it. One :class:`~wna16_jax.models.generation.Generator`
    of ``max_len`` positions (default :data:`CHAT_MAX_LEN`, at most ``max_position_embeddings``)
    serves every turn; turn ``i`` samples with ``fold_in(key(seed), i)``. Returns the exit status (0)."""
    import jax

    from .hub import resolve_model_dir
    from .models.generation import Generator, as_stop_tokens

    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    settings = _GenerationArgs.checked(max_new_tokens, temperature, top_p, top_k, seed, max_len)
    folder = resolve_model_dir(path, revision=revision)
    tok = cli_tokenizer(folder, "chat", "chat needs the folder's tokenizer and chat template")
    _require_chat_template(tok, "chat")
    model, loaded = load_cli_model(folder, dtype, mesh)
    limit = model.config.max_position_embeddings
    gen = Generator(model, batch_size=1, max_len=settings.max_len or min(CHAT_MAX_LEN, limit or CHAT_MAX_LEN))
    print(f"{loaded}; a cache of {gen.max_len} tokens; one user turn per line, {CHAT_EXIT} or the end of the "
          "input ends the chat", file=err, flush=True)
    stops = as_stop_tokens(None, model.config.eos_token_ids, model.config.vocab_size)
    messages = _conversation_start(system)
    for turn, text in enumerate(_user_turns(stdin, err)):
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        printer = _Printer([ids], stops, tok, echo=False, out=out)
        gen.generate([ids], settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                     top_k=settings.top_k, key=jax.random.fold_in(settings.key(), turn), stop_tokens=stops,
                     callback=printer.step)
        printer.close()
        messages.append({"role": "assistant", "content": tok.decode(printer.new[0])})
        print(f"turn {turn + 1}: prompt {len(ids)} tokens; {printer.summary()}", file=err, flush=True)
    return 0


# --------------------------------------------------------------------------- the parser


def package_version() -> str:
    """The installed distribution's version, else (a source checkout) pyproject.toml's."""
    import importlib.metadata

    try:
        return importlib.metadata.version("wna16-jax")
    except importlib.metadata.PackageNotFoundError:
        pass
    import tomllib

    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(pyproject, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help shows its default; descriptions keep their line breaks."""


class Parser(argparse.ArgumentParser):
    """A parser whose usage errors are :class:`ConfigError` (one line, exit status 2, like every
    other bad input) instead of argparse's usage text and ``SystemExit``."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="DIR", help="checkpoint folder, Hugging Face cache folder (models--ORG--NAME) "
                                               "or hub id (ORG/NAME) in the local cache")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id or cache folder; "
                                                    "None: main")


def _add_generation_arguments(p: argparse.ArgumentParser, *, max_new_tokens: int, max_len: str) -> None:
    """The options generate and chat share; ``max_len`` says what ``--max-len`` None means."""
    p.add_argument("--system", default=None, help="system message, the conversation's first turn")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="most tokens generated per reply")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0: greedy; None: the model's generation_config.json default")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]; None: the model's")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens, 0: all; "
                                                           "None: the model's")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling, in [0, 2**32)")
    p.add_argument("--max-len", type=int, default=None, help=f"KV-cache length in tokens; None: {max_len}")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="activation dtype; None: float32 on the CPU, bfloat16 on GPUs")
    add_mesh_argument(p)


def add_mesh_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, help="place the model on this process's first devices: epN (experts "
                                                "over N), tpN (heads, MLPs, vocabulary and expert slices over "
                                                "N) or epNxtpM; None: one device")


def build_parser() -> argparse.ArgumentParser:
    """The ``wna16-jax`` argument parser (its usage errors raise :class:`ConfigError`)."""
    parser = Parser(prog="wna16-jax", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the package version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do (each command has its own --help)")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter)

    p = command("demo", "write a tiny MoE in every format, run it, compare with float64",
                "Write a tiny MoE layer in every quantization format, load it, convert it to every backend "
                "layout,\nrun each under jit and compare with a float64 reference.")
    p.add_argument("--tokens", type=int, default=16, help="tokens per MoE call")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights and tokens")
    p.add_argument("--out", default=None, help="keep the written checkpoints in this new or empty folder")

    p = command("inspect", "scheme, MoE layers, shapes and backend selection of a checkpoint",
                "Describe a checkpoint (or a folder written by convert): its scheme, MoE layers, the first "
                "layer's tensors\nand which backend is selected on this machine, with every refusal's reason.")
    add_model_arguments(p)

    p = command("convert", "convert every MoE layer into a backend layout (safetensors + manifest)",
                "Stream the checkpoint layer by layer into one safetensors file per layer plus manifest.json,\n"
                "written to a temporary folder and renamed into place at the end; the input is never written.")
    add_model_arguments(p)
    p.add_argument("--backend", required=True,
                   help="the layout: cpu, xpu, marlin, batched_marlin, flashinfer_trtllm, humming or loader")
    p.add_argument("--out", required=True, help="a new or empty folder (not inside the source)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--input-dtype", choices=INPUT_DTYPES, default=None,
                   help="marlin only: 8-bit activations; None: 16-bit")
    p.add_argument("--expert-chunk", type=int, default=1, help="experts converted at a time (bounds memory)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ways to slice each layer")
    p.add_argument("--tp-rank", type=int, default=0, help="which tensor-parallel slice to write")

    p = command("generate", "continue prompts with the whole quantized model",
                "Continue prompts with the whole model (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2 / V3). One "
                "prompt is\nstreamed as it is generated; several run as one batch, each printed, labelled [i], "
                "when it is done.\nWhat was loaded and the timing go to stderr at the end.")
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text, repeatable (needs the folder's tokenizer.json and the 'tokenizers' package)")
    p.add_argument("--prompt-file", default=None, help="a text file of prompts, one per line (blank lines skipped)")
    p.add_argument("--prompt-ids", action="append", default=None,
                   help="prompt token ids like 1,2,3, repeatable (for folders without tokenizer.json)")
    p.add_argument("--chat", action="store_true",
                   help="render each --prompt as a user turn (after --system) through the chat template")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the model's eos tokens")
    _add_generation_arguments(p, max_new_tokens=32, max_len="the longest prompt + --max-new-tokens rounded up "
                                                            "to a power of two, at most max_position_embeddings")

    p = command("chat", "a multi-turn conversation through the checkpoint's chat template",
                f"Chat with the model: each line of stdin is a user turn; the conversation is rendered by the\n"
                f"checkpoint's chat template and the reply streamed to stdout until an eos token. The end of "
                f"the\ninput or a line {CHAT_EXIT} ends it.")
    add_model_arguments(p)
    _add_generation_arguments(p, max_new_tokens=256,
                              max_len=f"{CHAT_MAX_LEN}, or max_position_embeddings when smaller")
    from .serving.cli import add_serve_parser

    add_serve_parser(sub)
    return parser


# --------------------------------------------------------------------------- main


def _run(args: argparse.Namespace) -> int:
    gen_args = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "max_len", "dtype", "mesh", "revision")
    if args.command == "demo":
        return run_demo(tokens=args.tokens, seed=args.seed, keep=args.out)
    if args.command == "inspect":
        return run_inspect(args.path, revision=args.revision)
    if args.command == "generate":
        return run_generate(args.path, prompts=args.prompt or (), prompt_file=args.prompt_file,
                            prompt_ids=args.prompt_ids or (), chat=args.chat, system=args.system,
                            use_stop=not args.no_stop, **{k: getattr(args, k) for k in gen_args})
    if args.command == "serve":
        from .serving.cli import run_serve

        return run_serve(args)
    if args.command == "chat":
        return run_chat(args.path, system=args.system, **{k: getattr(args, k) for k in gen_args})
    from .hub import resolve_model_dir
    from .serialize import convert_checkpoint

    dtype = None
    if args.input_dtype is not None:
        import jax.numpy as jnp

        dtype = jnp.dtype(args.input_dtype)
    chunk = check_int("--expert-chunk", args.expert_chunk, low=1)
    out = convert_checkpoint(resolve_model_dir(args.path, revision=args.revision), args.backend, args.out,
                             input_dtype=dtype, expert_chunk=chunk, tp_size=args.tp_size,
                             tp_rank=args.tp_rank, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of what is still
    buffered for a reader that went away does not print an error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (a test's capture): nothing will be flushed to a closed pipe


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning on the command line is one line on stderr (no Python source line): the usual
    ones (a fallback that is the normal route on this device) are facts, not faults."""
    print("warning: " + " | ".join(str(message).splitlines()), file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status: 0, 2
    for bad input (one line on stderr), 130 on Ctrl-C, 141 when stdout's reader went away
    (``wna16-jax inspect DIR | head -1``), 1 for another operating-system error."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            status = _run(build_parser().parse_args(argv))
        sys.stdout.flush()               # a reader that went away shows up here, not at exit
        return status
    except WNA16Error as e:
        print(f"error: {type(e).__name__}: " + " | ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
