"""The ``wna16-jax`` command: ``demo``, ``inspect DIR``, ``convert DIR --backend NAME --out OUT``,
``generate DIR --prompt TEXT``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from typing import Sequence

import numpy as np

from .errors import ConfigError, OutputPathError, WNA16Error

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
    import jax.numpy as jnp

    from . import routing

    logits = jnp.asarray(x, jnp.float32) @ jnp.asarray(layer.router, jnp.float32).T
    if cfg.grouped:
        return routing.grouped_topk(
            logits, cfg.top_k, renormalize=cfg.renormalize, num_expert_group=cfg.num_expert_group,
            topk_group=cfg.topk_group, scoring_func=cfg.scoring_func,
            e_score_correction_bias=None if layer.e_score_correction_bias is None
            else jnp.asarray(layer.e_score_correction_bias),
            routed_scaling_factor=cfg.routed_scaling_factor)
    return routing.fused_topk(logits, cfg.top_k, renormalize=cfg.renormalize, scoring_func=cfg.scoring_func)


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


def run_demo(*, tokens: int = 16, experts: int = 8, hidden: int = 256, intermediate: int = 256,
             seed: int = 0, out=sys.stdout, progress=sys.stderr, keep: str | None = None) -> int:
    """Write the tiny MoE in every format, load, select, run under jit, compare. Returns exit code.

    Each row is printed (and flushed) as soon as its format is done; ``progress`` gets a line
    before each format. ``keep``: a folder (new or empty) that keeps the written checkpoints.
    """
    import warnings

    import jax
    import jax.numpy as jnp

    from .backends import (TABLE, Backend, BackendFallbackWarning, Device, backend_reasons, priority_backends,
                           select_backend)
    from .checkpoint import Checkpoint
    from .writers import random_moe_layer, write_checkpoint
    from .moe import fused_moe, shared_expert_moe
    from .schemes import QuantScheme

    for name, v in (("--tokens", tokens), ("experts", experts), ("hidden", hidden),
                    ("intermediate", intermediate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}: expected a positive integer, got {v!r}")
    if keep is not None:
        keep = os.fspath(keep)
        if os.path.lexists(keep) and (not os.path.isdir(keep) or os.listdir(keep)):
            raise OutputPathError(f"--out {keep!r}: must be a new or empty folder")
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
    failures = 0
    notes = []
    fused = jax.jit(fused_moe)
    with tempfile.TemporaryDirectory() as tmp:
        root = keep or tmp
        for n, case in enumerate(DEMO_CASES, 1):
            _say(f"[{n}/{len(DEMO_CASES)}] {case.name}: writing, loading, converting to every layout, "
                 "compiling and running ...", progress)
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
            layer = ckpt.load_layer(ckpt.moe_layer_indices[0])
            cfg = ckpt.model_config
            x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
            tw, ids = _route(layer, cfg, x)
            ref = _reference(np.asarray(x.astype(jnp.float32)), np.asarray(tw), np.asarray(ids), layer.experts)
            if layer.shared_experts is not None:
                ref = ref + _reference(np.asarray(x.astype(jnp.float32)), np.ones((tokens, 1)),
                                       np.zeros((tokens, 1), np.int64), layer.shared_experts)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", BackendFallbackWarning)
                selected = select_backend(scheme, dev, has_bias=layer.experts.has_bias())
            if selected is Backend.LOADER:
                del caught
                reasons = backend_reasons(scheme, dev, has_bias=layer.experts.has_bias())
                notes.append(f"{case.name}: runs the loader layout; "
                             + "; ".join(f"{b.name}: {reasons[b]}" for b in priority_backends(dev)))
            cells, timing = [], ""
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
                    fused(x, tw, ids, w).block_until_ready()
                    reps = 5
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fused(x, tw, ids, w).block_until_ready()
                    timing = f"{(time.perf_counter() - t0) / reps * 1e3:.2f}"
            _say(f"{case.name:<21}{selected.name:<8}" + "".join(f"{c:>9}" for c in cells) + f"{timing:>8}", out)
    _say("-" * len(header), out)
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


def run_inspect(path: str, out=sys.stdout, device=None) -> int:
    """Describe a checkpoint folder, or a folder written by ``wna16-jax convert``."""
    from .serialize import MANIFEST

    if os.path.isfile(os.path.join(path, MANIFEST)):
        return _inspect_converted(path, out)
    return _inspect_checkpoint(path, out, device)


def _inspect_checkpoint(path: str, out, device) -> int:
    import warnings

    from .backends import TABLE, Backend, BackendFallbackWarning, Device, priority_backends, select_backend
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
    dev = device or Device.current()
    prio = priority_backends(dev)
    req = dict(has_bias=w.has_bias(), hidden_size=w.hidden_size, intermediate_size=w.intermediate_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)
        selected = select_backend(s, dev, **req)
    print(f"backends on {dev.describe()} (priority: {', '.join(b.name for b in prio) or 'none'}, "
          "then LOADER):", file=out)
    for b in Backend:
        reason = TABLE[b].supports(s, dev, **req)
        if b is selected:
            status = "SELECTED" + (" (fallback: no converting row accepts this layer)"
                                   if b is Backend.LOADER else "")
        elif reason is None:
            status = "supported" + ("" if b in prio or b is Backend.LOADER else " (not in this platform's list)")
        else:
            status = "no: " + reason
        layout = TABLE[b].layout_supports(s, **req)
        print(f"  {b.name:<18} {status}", file=out)
        print(f"  {'':<18} layout: {TABLE[b].layout}; "
              f"{'convertible here (runs via ' + TABLE[b].executes_on + ')' if layout is None else 'not convertible: ' + layout}",
              file=out)
    return 0


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


# --------------------------------------------------------------------------- generate


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ConfigError(f"--prompt-ids: expected comma-separated integers like 1,2,3, got {text!r}") from None
    return ids


def run_generate(path: str, *, prompt: str | None = None, prompt_ids: str | None = None, max_new_tokens: int = 32,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, max_len: int | None = None,
                 dtype: str | None = None, use_stop: bool = True, out=None, err=None) -> int:
    """Load the whole model at ``path``, generate after the prompt and stream the new tokens to
    ``out`` as they come (text with ``--prompt``, token ids with ``--prompt-ids``); timing to ``err``."""
    import jax
    import jax.numpy as jnp

    from .models.decoder import load_model
    from .models.generation import Generator, default_max_len
    from .models.tokenizer import load_tokenizer

    out, err = out or sys.stdout, err or sys.stderr
    if (prompt is None) == (prompt_ids is None):
        raise ConfigError("generate: give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    tok = None
    if prompt is not None:
        tok = load_tokenizer(path)
        ids = tok.encode(prompt)
        if not ids:
            raise ConfigError(f"--prompt: the tokenizer gives no tokens for {prompt!r}")
    else:
        ids = _parse_ids(prompt_ids)
    dt = None
    if dtype is not None:
        dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(dtype)
        if dt is None:
            raise ConfigError(f"--dtype: expected float32, bfloat16 or float16, got {dtype!r}")
    t_load = time.perf_counter()
    model = load_model(path, dtype=dt)
    # generation_config.json's eos ids, then config.json's (models.generation_config, read by load_model)
    stops = list(model.config.eos_token_ids) if use_stop else []
    if max_len is None:
        max_len = default_max_len([ids], max_new_tokens)
        if model.config.max_position_embeddings:
            max_len = min(max_len, model.config.max_position_embeddings)
    gen = Generator(model, batch_size=1, max_len=max_len)
    gen.check_request([ids], max_new_tokens, temperature, top_p, jax.random.key(seed), stops)
    print(f"loaded {path} ({model.config.family}, {model.config.num_layers} layers, {model.dtype}) in "
          f"{time.perf_counter() - t_load:.1f} s; prompt {len(ids)} tokens", file=err, flush=True)
    push = tok.stream_decoder(ids) if tok is not None else None
    print(",".join(str(i) for i in ids) if tok is None else tok.decode(ids), end="", file=out, flush=True)
    n, t0, t_first = 0, time.perf_counter(), None
    for toks in gen.stream([ids], max_new_tokens, temperature=temperature, top_p=top_p,
                           key=jax.random.key(seed), stop_tokens=stops):
        t = int(toks[0])
        if t < 0:
            break
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
        if t in stops:
            break
        if push is not None:
            print(push(t), end="", file=out, flush=True)
        else:
            print(f",{t}", end="", file=out, flush=True)
    t_end = time.perf_counter()
    print(file=out, flush=True)
    first = f"first after {t_first - t0:.2f} s (prefill, compiling included)" if t_first else "none"
    rate = (f"{(n - 1) / (t_end - t_first):.1f} tokens/s after it" if n > 1 and t_end > t_first
            else "no decode step")
    print(f"{n} new tokens; {first}; {rate}", file=err, flush=True)
    return 0


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wna16-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="write the tiny MoE in every format, run it, compare with float64")
    p_demo.add_argument("--tokens", type=int, default=16)
    p_demo.add_argument("--seed", type=int, default=0, help="random seed (default 0: the same data every run)")
    p_demo.add_argument("--out", default=None, help="keep the written checkpoints in this new or empty folder")
    p_inspect = sub.add_parser("inspect", help="scheme, MoE layers, shapes, backend selection of a "
                                               "checkpoint (or of a converted folder)")
    p_inspect.add_argument("path")
    p_conv = sub.add_parser("convert", help="convert every MoE layer into a backend layout (safetensors + manifest)")
    p_conv.add_argument("path")
    p_conv.add_argument("--backend", required=True,
                        help="cpu, xpu, marlin, batched_marlin, flashinfer_trtllm, humming, loader")
    p_conv.add_argument("--out", required=True, help="a new or empty folder (not inside the source)")
    p_conv.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p_conv.add_argument("--input-dtype", default=None, help="marlin only: int8 or float8_e4m3fn activations")
    p_conv.add_argument("--expert-chunk", type=int, default=1, help="experts converted at a time (memory bound)")
    p_conv.add_argument("--tp-size", type=int, default=1)
    p_conv.add_argument("--tp-rank", type=int, default=0)
    p_gen = sub.add_parser("generate", help="generate text with the whole quantized model (Qwen3-MoE, Qwen2-MoE, "
                                            "Mixtral, DeepSeek-V2 / V3), streaming the new tokens")
    p_gen.add_argument("path")
    p_gen.add_argument("--prompt", default=None, help="prompt text (needs the checkpoint's tokenizer.json and the "
                                                      "'tokenizers' package)")
    p_gen.add_argument("--prompt-ids", default=None, help="prompt token ids, e.g. 1,2,3")
    p_gen.add_argument("--max-new-tokens", type=int, default=32)
    p_gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    p_gen.add_argument("--max-len", type=int, default=None, help="KV cache length (default: prompt + new, "
                                                                  "rounded up to a power of two)")
    p_gen.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 activations (default: float32 "
                                                     "on CPU, bfloat16 elsewhere)")
    p_gen.add_argument("--no-stop", action="store_true", help="do not stop at the config's eos tokens")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return run_demo(tokens=args.tokens, seed=args.seed, keep=args.out)
        if args.command == "inspect":
            return run_inspect(args.path)
        if args.command == "generate":
            return run_generate(args.path, prompt=args.prompt, prompt_ids=args.prompt_ids,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, max_len=args.max_len, dtype=args.dtype, use_stop=not args.no_stop)
        if args.command == "convert":
            from .serialize import convert_checkpoint

            dtype = None
            if args.input_dtype:
                import jax.numpy as jnp

                dtype = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}.get(args.input_dtype)
                if dtype is None:
                    raise ConfigError(f"--input-dtype: expected int8 or float8_e4m3fn, got {args.input_dtype!r}")
            if args.expert_chunk < 1:
                raise ConfigError(f"--expert-chunk: expected a positive integer, got {args.expert_chunk}")
            out = convert_checkpoint(args.path, args.backend, args.out, input_dtype=dtype,
                                     expert_chunk=args.expert_chunk, tp_size=args.tp_size, tp_rank=args.tp_rank,
                                     overwrite=args.overwrite)
            print(f"wrote {out}")
            return 0
    except WNA16Error as e:
        print(f"error: {type(e).__name__}: " + " | ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
