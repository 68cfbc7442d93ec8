"""The ``wna16-jax`` command: ``demo``, ``inspect DIR``, ``convert DIR --backend NAME --out OUT``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError, WNA16Error

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
    DemoCase("GPTQ 4b g64 act-order", {"quant_method": "gptq", "bits": 4, "group_size": 64,
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


def run_demo(*, tokens: int = 16, experts: int = 8, hidden: int = 256, intermediate: int = 256,
             seed: int | None = None, out=sys.stdout) -> int:
    """Write the tiny MoE in every format, load, select, run under jit, compare. Returns exit code."""
    import jax
    import jax.numpy as jnp

    from .backends import TABLE, Backend, Device, select_backend
    from .checkpoint import Checkpoint, random_moe_layer, write_checkpoint
    from .errors import BackendSelectionError
    from .moe import fused_moe, shared_expert_moe
    from .schemes import QuantScheme

    rng = np.random.default_rng(seed)
    dev = Device.current()
    print(f"wna16-jax demo on {dev.describe()} (jax {jax.__version__}); tiny MoE E={experts} "
          f"H={hidden} I={intermediate}, {tokens} bf16 tokens. Per layout: relative error "
          f"max|out-ref| / max|ref| vs a float64 per-token reference (tolerance {DEMO_TOLERANCE:g}); "
          "'max abs' and ms/call are for the selected backend's layout (the loader layout when "
          "none is selected)", file=out)
    cols = ["loader"] + [b.name for b in Backend]
    header = (f"{'format':<22} {'scheme':<34} {'selected':<9} {'max abs':>9} "
              + " ".join(f"{c:>14}" for c in cols) + "   ms/call")
    print(header, file=out)
    print("-" * len(header), file=out)
    failures = 0
    notes = []
    fused = jax.jit(fused_moe, static_argnames=("activation",))
    with tempfile.TemporaryDirectory() as tmp:
        for case in DEMO_CASES:
            scheme = QuantScheme.from_quant_config(case.quant_config)
            layer_f = random_moe_layer(rng, experts, hidden, intermediate, bias=case.bias,
                                       shared_intermediate=intermediate if case.shared else None,
                                       score_bias=case.grouped)
            path = f"{tmp}/{case.name.replace(' ', '_')}"
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
            try:
                selected = select_backend(scheme, dev, has_bias=layer.experts.has_bias()).name
            except BackendSelectionError as e:
                selected = "none"
                reason = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
                notes.append(f"{case.name}: no backend selected on this device ({reason}); "
                             "fused_moe runs the loader layout with XLA")
            cells, timing, abs_err = [], "", ""
            layouts: list[tuple[str, Any]] = [("loader", layer.experts)]
            for b in Backend:
                spec = TABLE[b]
                why = spec.layout_supports(scheme, has_bias=layer.experts.has_bias())
                if why:
                    layouts.append((b.name, why))
                    continue
                try:
                    layouts.append((b.name, spec.convert(scheme, layer.experts.to_jax())))
                except WNA16Error as e:
                    layouts.append((b.name, f"convert refused: {e}"))
            for name, w in layouts:
                if isinstance(w, str):
                    cells.append("—")
                    continue
                wj = w.to_jax()
                y = fused(x, tw, ids, wj).astype(jnp.float32)
                if layer.shared_experts is not None:
                    y = y + shared_expert_moe(x, layer.shared_experts.to_jax()).astype(jnp.float32)
                y = np.asarray(y, np.float64)
                err = float(np.abs(y - ref).max() / np.abs(ref).max()) if np.isfinite(y).all() else float("inf")
                ok = err <= DEMO_TOLERANCE
                failures += not ok
                cells.append(f"{err:10.2e} {'ok' if ok else 'FAIL'}")
                if name == (selected if selected != "none" else "loader"):
                    abs_err = f"{float(np.abs(y - ref).max()):9.2e}"
                    fused(x, tw, ids, wj).block_until_ready()
                    t0 = time.perf_counter()
                    reps = 5
                    for _ in range(reps):
                        fused(x, tw, ids, wj).block_until_ready()
                    timing = f"{(time.perf_counter() - t0) / reps * 1e3:9.2f}"
            print(f"{case.name:<22} {scheme.describe():<34} {selected:<9} {abs_err:>9} "
                  + " ".join(f"{c:>14}" for c in cells) + f"  {timing}", file=out)
    print("-" * len(header), file=out)
    print("'—': the layout cannot represent that scheme (see `wna16-jax inspect`); every layout is "
          "executed through its XLA decode on this device.", file=out)
    for n in notes:
        print("note: " + n, file=out)
    if failures:
        print(f"FAILED: {failures} result(s) out of tolerance", file=out)
        return 1
    print("all results within tolerance", file=out)
    return 0


# --------------------------------------------------------------------------- inspect


def run_inspect(path: str, out=sys.stdout, device=None) -> int:
    from .backends import TABLE, Backend, Device, priority_backends
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
    print(f"backends on {dev.describe()} (priority: {', '.join(b.name for b in prio) or 'none'}):", file=out)
    selected = None
    for b in Backend:
        reason = TABLE[b].supports(s, dev, **req)
        if reason is None and b in prio and selected is None:
            selected = b
            status = "SELECTED"
        elif reason is None:
            status = "supported" + ("" if b in prio else " (not in this platform's list)")
        else:
            status = "no: " + reason
        layout = TABLE[b].layout_supports(s, **req)
        print(f"  {b.name:<18} {status}", file=out)
        print(f"  {'':<18} layout: {TABLE[b].layout}; "
              f"{'convertible here (runs via ' + TABLE[b].executes_on + ')' if layout is None else 'not convertible: ' + layout}",
              file=out)
    if selected is None:
        print("no backend selected; fused_moe runs the loader layout with the XLA executor", file=out)
    return 0


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wna16-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="write the tiny MoE in every format, run it, compare with float64")
    p_demo.add_argument("--tokens", type=int, default=16)
    p_demo.add_argument("--seed", type=int, default=None)
    p_inspect = sub.add_parser("inspect", help="scheme, MoE layers, shapes, backend selection of a checkpoint")
    p_inspect.add_argument("path")
    p_conv = sub.add_parser("convert", help="convert every MoE layer into a backend layout (safetensors + manifest)")
    p_conv.add_argument("path")
    p_conv.add_argument("--backend", required=True, help="cpu, xpu, marlin, batched_marlin, flashinfer_trtllm, humming")
    p_conv.add_argument("--out", required=True)
    p_conv.add_argument("--input-dtype", default=None, help="marlin only: int8 or float8_e4m3fn activations")
    p_conv.add_argument("--expert-chunk", type=int, default=1, help="experts converted at a time (memory bound)")
    p_conv.add_argument("--tp-size", type=int, default=1)
    p_conv.add_argument("--tp-rank", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return run_demo(tokens=args.tokens, seed=args.seed)
        if args.command == "inspect":
            return run_inspect(args.path)
        if args.command == "convert":
            from .serialize import convert_checkpoint

            dtype = None
            if args.input_dtype:
                import jax.numpy as jnp

                dtype = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}.get(args.input_dtype)
                if dtype is None:
                    raise ConfigError(f"--input-dtype: expected int8 or float8_e4m3fn, got {args.input_dtype!r}")
            out = convert_checkpoint(args.path, args.backend, args.out, input_dtype=dtype,
                                     expert_chunk=args.expert_chunk, tp_size=args.tp_size, tp_rank=args.tp_rank)
            print(f"wrote {out}")
            return 0
    except WNA16Error as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
