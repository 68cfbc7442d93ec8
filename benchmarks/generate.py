"""Whole-model generation benchmark: Qwen3-30B-A3B- and Mixtral-8x7B-shaped GPTQ int4 models.

For each model shape the script writes a random GPTQ 4-bit g128 checkpoint to disk
(:func:`wna16_jax.models.write_random_model`: every attention projection and expert quantized,
embeddings / lm_head / norms / routers in float16, as the GPTQ tools write them), loads it onto the
device and, for each batch size, with prompts of ``--prompt`` random tokens and ``--new`` new
tokens, measures:

* prefill: one prefill program (all prompts, KV cache written, last-token logits), median of reps;
* decode tok/s: ``batch × (new - 1)`` tokens over the streamed decode loop (host sync per step,
  as a streaming server does);
* step: one decode program alone (median), against its floor: every weight byte the step touches
  (attention / dense weights, lm_head, and the experts a uniformly random routing of ``batch``
  tokens touches in expectation) read once at ``--bandwidth`` B/s (or the bandwidth of a device
  copy measured in the same run with ``--measure-bandwidth``);
* MoE share: ``1 - step(MoE layers replaced by identity) / step`` (differential timing);
* device memory: ``memory_stats()`` bytes in use after loading, and the peak, where the device
  reports them.

Then the same model with every quantized weight dequantized to bfloat16 at load and run by XLA
(``load_model(dequantized=True)``; its decode steps attend on XLA too, not on the decode kernel),
same measurements. ``--append PATH`` appends the table with
the date and the command to a RESULTS.md.

GPU: ``PYTHONPATH=$PWD python3 benchmarks/generate.py --append benchmarks/RESULTS.md``.
CPU smoke run: ``--models tiny --layers 1 --batch 1 --prompt 16 --new 4``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wna16_jax.models import load_model, write_random_model  # noqa: E402
from wna16_jax.models.synthetic import RandomModelSpec  # noqa: E402
from wna16_jax.models import decoder  # noqa: E402
from wna16_jax.models import generation as G  # noqa: E402
from wna16_jax.models.decoder import DecoderLayer, MoEDecoder  # noqa: E402
from wna16_jax.nn import QuantizedExperts, QuantizedMoE  # noqa: E402
from wna16_jax.schemes import QuantScheme  # noqa: E402
from flax import nnx  # noqa: E402 - after wna16_jax, which lets Flax import on JAX 0.11

GPTQ_4BIT_G128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}

#: name → RandomModelSpec fields but the scheme (num_layers is --layers or the default here)
SHAPES = {
    "qwen3": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                  num_kv_heads=4, head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=768,
                  intermediate_size=6144, rope_theta=1e6, max_position_embeddings=40960),
    "mixtral": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, moe_intermediate_size=14336,
                    rope_theta=1e6, max_position_embeddings=32768),
    # the first layer dense (first_k_dense_replace=1), the other 26 MoE with two shared experts;
    # latent attention with the real sizes, YaRN as the released config has it. The dense layer's
    # down_proj has K = 10944 = 85.5 groups of 128 (its last group partial: the XLA path runs it)
    "dsv2lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
                     num_kv_heads=16, head_dim=192, num_experts=64, top_k=6, moe_intermediate_size=1408,
                     intermediate_size=10944, first_k_dense_replace=1, n_shared_experts=2,
                     mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128),
                     rope_theta=10000.0, max_position_embeddings=163840,
                     extra_config={"rope_scaling": {"type": "yarn", "factor": 40,
                                                    "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                    "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    # for CPU smoke tests of this script
    "tiny": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=128,
                 intermediate_size=256, max_position_embeddings=4096),
}
LABELS = {"qwen3": "Qwen3-30B-A3B shape", "mixtral": "Mixtral-8x7B shape", "dsv2lite": "DeepSeek-V2-Lite shape",
          "tiny": "tiny Qwen3-MoE"}


def write_shape_model(folder: str, name: str, layers: int | None = None, *, shape: dict | None = None,
                      label: str | None = None) -> tuple[str, str]:
    """``(path, label)``: a random GPTQ int4 g128 checkpoint of model shape ``name``
    (:data:`SHAPES`, or ``shape`` / ``label`` given) written under ``folder``, cut to ``layers``
    decoder layers when given; prints how long the write took."""
    shape = dict(SHAPES[name] if shape is None else shape)
    if layers:
        shape["num_layers"] = layers
    label = f"{label or LABELS[name]}, {shape['num_layers']} layers"
    path = os.path.join(folder, name)
    t0 = time.perf_counter()
    write_random_model(path, RandomModelSpec(scheme=QuantScheme.from_quant_config(GPTQ_4BIT_G128), **shape), seed=0)
    print(f"# {label}: wrote the GPTQ int4 g128 checkpoint in {time.perf_counter() - t0:.0f} s", flush=True)
    return path, label


class _NoMLP(nnx.Module):
    """Stands in for a MoE layer: contributes nothing (the block becomes attention only)."""

    def __call__(self, x):
        return jnp.zeros_like(x)


class _Stacked(decoder._LayerStacker):
    """Layers already stacked: ``(graphdef, state)`` handed to :class:`MoEDecoder` as they are."""

    def __init__(self, graph, state):
        super().__init__(0)
        self.graph_state = graph, state

    def finish(self):
        return self.graph_state


def _no_moe(layer):
    return DecoderLayer(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                        _NoMLP() if isinstance(layer.mlp, QuantizedMoE) else layer.mlp)


def without_moe(model: MoEDecoder) -> MoEDecoder:
    """The same model with each MoE layer's MLP replaced by identity, sharing every array: a
    scanned model keeps its stacks (the layer body is rebuilt from shapes without the MoE, and
    its state is the original stacks minus the MoE's), so nothing is copied on the device."""
    head = [_no_moe(l) for l in model.layers]
    if not model.scan_layers:
        return MoEDecoder(model.config, model.embed_tokens[...], head, model.norm, model.lm_head,
                          dtype=model.dtype)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), model.stacked_layers)
    graph, shapes = nnx.split(_no_moe(nnx.merge(model.layer_graph, one)))
    stacks = dict(jax.tree_util.tree_flatten_with_path(model.stacked_layers)[0])
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    state = jax.tree_util.tree_unflatten(treedef, [stacks[p] for p, _ in paths])
    return MoEDecoder(model.config, model.embed_tokens[...], _Stacked(graph, state), model.norm, model.lm_head,
                      dtype=model.dtype, scan_layers=True, head_layers=head)


def _nbytes(tree) -> int:
    return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
                   if hasattr(a, "dtype")))


def layer_shapes(model: MoEDecoder) -> list:
    """The decoder layers as modules for counting bytes: a scanned model's layers are rebuilt
    from its stacks with each array's one-layer shape and dtype (``jax.ShapeDtypeStruct``), not
    sliced: ``MoEDecoder.layer_modules`` copies every layer's weights on the device, which would
    double the memory this script reports."""
    if not model.scan_layers:
        return list(model.layers)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), model.stacked_layers)
    return list(model.layers) + [nnx.merge(model.layer_graph, one)] * model.num_scanned_layers


def touched_bytes(model: MoEDecoder, batch: int) -> int:
    """Weight bytes one decode step of ``batch`` tokens reads: everything except the embedding
    table (one row per token) and the experts, plus the expected experts a uniformly random
    top-k routing of ``batch`` tokens touches, per MoE layer."""
    total = 0
    h = model.config.hidden_size
    total += batch * h * np.dtype(model.embed_tokens[...].dtype).itemsize
    if model.lm_head is None:
        total += _nbytes(model.embed_tokens[...])
    for layer in layer_shapes(model):
        if isinstance(layer.mlp, QuantizedMoE):
            moe = layer.mlp
            e, k = moe.num_experts, moe.routing.top_k
            experts = _nbytes(moe.expert_weights())
            expected = e * (1.0 - (1.0 - k / e) ** batch)
            total += int(experts / e * expected)
            if moe.shared_experts is not None:                  # every token runs them
                total += _nbytes(moe.shared_expert_weights())
            rest = nnx.state(layer, nnx.Not(QuantizedExperts))
            total += _nbytes(rest)
        else:
            total += _nbytes(nnx.state(layer))
    total += _nbytes(nnx.state(model.norm))
    if model.lm_head is not None:
        total += _nbytes(nnx.state(model.lm_head))
    return total


def measure_bandwidth() -> float:
    """B/s of a device copy (read + write) of a large array, median of 5."""
    n = (1 << 30) if jax.default_backend() != "cpu" else (1 << 26)
    x = jnp.ones((n // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(ts)


def _median_s(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _stats() -> dict:
    """The device's memory statistics (empty where the platform keeps none)."""
    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - platforms without stats
        return {}


def _memory() -> tuple[int | None, int | None]:
    stats = _stats()
    return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")


def bench_model(model: MoEDecoder, *, batch: int, prompt: int, new: int, reps: int, bandwidth: float,
                seed: int = 0, profile: bool = False, moe_share: bool = True, decode_steps: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, prompt).tolist() for _ in range(batch)]
    max_len = prompt + new
    gen = G.Generator(model, batch_size=batch, max_len=max_len, decode_steps=decode_steps)
    t0 = time.perf_counter()                                     # first call: compiling included
    temp = prefill_temp_bytes(model, batch, gen.bucket(prompt), max_len)
    free = _free_bytes()
    if free is not None and temp > free:
        raise MemoryError(f"the prefill program needs {temp / 2**30:.1f} GiB of temporaries; "
                          f"{free / 2**30:.1f} GiB are free")
    gen.generate(prompts, 2 + decode_steps)                      # compile prefill + decode
    t_compile = time.perf_counter() - t0
    progs, leaves = G.programs(model)
    tokens = np.zeros((batch, gen.bucket(prompt)), np.int32)
    tokens[:, :prompt] = np.asarray(prompts, np.int32)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    key, zero, one = G.row_keys(None, 0, batch), jnp.float32(0), jnp.float32(1)
    tok_dev = jnp.asarray(tokens)

    def prefill():
        return progs.prefill(leaves, tok_dev, lengths, key, zero, one, max_len=max_len, sample=False)

    t_prefill = _median_s(prefill, reps)
    # the streamed decode loop
    t_first = None
    n = 0
    for _ in gen.stream(prompts, new):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    decode_tps = batch * (n - 1) / (t_end - t_first) if n > 1 else float("nan")
    # one decode step alone, at the middle of the generation: the program the stream runs (the
    # cache donated and fed back), each call synchronized
    nxt, _, cache0 = prefill()
    pos = jnp.full((batch,), prompt + new // 2, jnp.int32)

    def step_time(p, lv) -> float:
        cache = jax.tree.map(jnp.copy, cache0)
        decode = p.decode_donating if jax.default_backend() != "cpu" else p.decode
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            out = decode(lv, cache, nxt, pos, key, jnp.int32(1), zero, one, sample=False)
            jax.block_until_ready(out)
            ts.append(time.perf_counter() - t0)
            cache = out[2]
        return statistics.median(ts[1:])

    t_step = step_time(progs, leaves)
    if profile:
        print_step_profile(progs, leaves, cache0, nxt, pos, key, zero, one, batch)
    t_bare = step_time(*G.programs(without_moe(model))) if moe_share else float("nan")
    floor = touched_bytes(model, batch) / bandwidth
    in_use, peak = _memory()
    if in_use is not None and in_use > 1.05 * _nbytes(nnx.state(model)) + 2**30:
        print_live_arrays(f"batch {batch}: {in_use / 2**30:.1f} GiB in use, "
                          f"{_nbytes(nnx.state(model)) / 2**30:.1f} GiB of it the model's")
    return {"batch": batch, "compile_s": t_compile, "prefill_ms": t_prefill * 1e3, "decode_tps": decode_tps,
            "step_ms": t_step * 1e3,
            "floor_ms": floor * 1e3, "moe_share": 1.0 - t_bare / t_step, "in_use": in_use, "peak": peak}


def prefill_temp_bytes(model: MoEDecoder, batch: int, bucket: int, max_len: int) -> int:
    """Compile the prefill program for ``[batch, bucket]`` prompts (nothing runs), print and
    return its temporary bytes (XLA's memory analysis), so a program whose own buffers would not
    fit is refused before it runs."""
    progs, leaves = G.programs(model)
    tokens = jnp.zeros((batch, bucket), jnp.int32)
    lengths = jnp.full((batch,), bucket, jnp.int32)
    compiled = progs.prefill.lower(leaves, tokens, lengths, G.row_keys(None, 0, batch), jnp.float32(0), jnp.float32(1),
                                   max_len=max_len, sample=False).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    print(f"#   prefill [{batch}, {bucket}]: {temp / 2**30:.2f} GiB of temporaries", flush=True)
    return temp


def print_live_arrays(title: str, show: int = 6) -> None:
    """The largest arrays alive in this process (what holds device memory beyond the model)."""
    arrays = jax.live_arrays()
    live = sorted(arrays, key=lambda a: -a.nbytes)[:show]

    def where(a):               # the device, where it is not the default one
        devs = a.devices()
        return "" if devs == {jax.devices()[0]} else f" on {sorted(str(d) for d in devs)}"

    print(f"# {title}; live arrays {sum(a.nbytes for a in arrays) / 2**30:.2f} GiB, the largest: " + ", ".join(
        f"{a.dtype}{list(a.shape)} {a.nbytes / 2**30:.2f} GiB{where(a)}" for a in live), flush=True)


def _free_bytes() -> int | None:
    stats = _stats()
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def print_step_profile(progs, leaves, cache, tok, pos, key, zero, one, batch: int) -> None:
    """One decode step's device kernels (the JAX profiler's trace, ``kernel_profile``), by name and
    grouped by kind, with the device's idle time between the step's first and last kernel."""
    from benchmarks.kernel_profile import format_breakdown, kernel_breakdown

    def step(lv, c, t, p):
        return progs.decode(lv, c, t, p, key, jnp.int32(1), zero, one, sample=False)

    result = kernel_breakdown(step, (leaves, cache, tok, pos), calls=10)
    print(f"# profile, batch {batch}: one decode step")
    print(format_breakdown(result, top=80))
    groups: dict = {}
    for name, us, n in result[0]:
        kind = name.split(".")[0].split("_")[0] if not name.startswith(("wna16", "wgmma", "fused_moe")) else name
        g = groups.setdefault(kind, [0.0, 0.0])
        g[0] += us
        g[1] += n
    for kind, (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"    group {kind[:60]:60s} {us:8.1f} µs ×{n:g}")


def _mb(v):
    return "—" if v is None else f"{v / 2**20:,.0f}"


HEADER = ("| model | weights | batch | prefill ms | decode tok/s | step µs | floor µs | step / floor | MoE share "
          "| device MiB in use | peak MiB | first call s |")


def row_md(label: str, variant: str, r: dict) -> str:
    share = "—" if np.isnan(r["moe_share"]) else f"{100 * r['moe_share']:.0f}%"
    return (f"| {label} | {variant} | {r['batch']} | {r['prefill_ms']:.2f} | {r['decode_tps']:.1f} | "
            f"{r['step_ms'] * 1e3:.1f} | {r['floor_ms'] * 1e3:.1f} | {r['step_ms'] / r['floor_ms']:.2f} | "
            f"{share} | {_mb(r['in_use'])} | {_mb(r['peak'])} | {r['compile_s']:.0f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3,mixtral", help=f"comma-separated of {sorted(SHAPES)}")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--bf16-batch", type=int, nargs="+", default=None,
                    help="batch sizes for the bf16-dequantized variant (default: --batch)")
    ap.add_argument("--no-moe-share", action="store_true",
                    help="skip the MoE share (one more compiled program per batch size)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="B/s for the floor (default H200's 4.3e12)")
    ap.add_argument("--measure-bandwidth", action="store_true", help="use a device copy's bandwidth instead")
    ap.add_argument("--decode-kernel", choices=("on", "off"), default=None,
                    help="decode steps of the int4 model attend with the Triton kernel (on) or XLA (off); "
                         "default: the library's (wna16_jax.models.decoder.DECODE_KERNEL)")
    ap.add_argument("--no-dequantized", action="store_true", help="skip the bf16-dequantized XLA variant")
    ap.add_argument("--only-dequantized", action="store_true", help="run only the bf16-dequantized XLA variant")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workdir", default=None, help="where the random checkpoints go (default: a temp folder)")
    ap.add_argument("--append", default=None, metavar="RESULTS.md")
    layers_mode = ap.add_mutually_exclusive_group()
    layers_mode.add_argument("--scan-layers", action="store_true",
                             help="run the decoder layers as one lax.scan (load_model(scan_layers=True); "
                                  "default: load_model's choice, scanned from 8 alike layers)")
    layers_mode.add_argument("--unrolled", action="store_true", help="one compiled layer per decoder layer")
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[1],
                    help="Generator(decode_steps=K) for the int4 rows: one row per K (tokens/s is the stream's)")
    ap.add_argument("--profile", action="store_true",
                    help="also print one decode step's device kernels (JAX profiler trace), every batch size")
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if n not in SHAPES]
    if bad:
        ap.error(f"--models: unknown {bad}; known: {sorted(SHAPES)}")
    if args.new < 2 or args.prompt < 1 or any(b < 1 for b in args.batch):
        ap.error("--new must be >= 2, --prompt and --batch >= 1")
    if any(k < 1 or k + 2 > args.new for k in args.decode_steps):
        ap.error(f"--decode-steps: each K must be >= 1 and at most --new - 2 = {args.new - 2}")
    bandwidth = measure_bandwidth() if args.measure_bandwidth else args.bandwidth
    dtype = jnp.dtype(args.dtype)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; floor at "
          f"{bandwidth:.3g} B/s{' (measured)' if args.measure_bandwidth else ''}", flush=True)
    table = [HEADER, "|" + "|".join("---" for _ in HEADER.split("|")[1:-1]) + "|"]
    print("\n".join(table), flush=True)
    if args.decode_kernel:
        decoder.DECODE_KERNEL = args.decode_kernel == "on"
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in names:
            path, label = write_shape_model(tmp, name, args.layers)
            variants = (([] if args.only_dequantized else ["GPTQ int4"])
                        + ([] if args.no_dequantized else ["bf16 (dequantized, XLA)"]))
            for variant in variants:
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = load_model(path, dtype=dtype, dequantized=variant != "GPTQ int4",
                                       scan_layers=True if args.scan_layers else False if args.unrolled else None)
                print(f"# {label}, {variant}: loaded in {time.perf_counter() - t0:.0f} s", flush=True)
                batches = args.batch if variant == "GPTQ int4" or not args.bf16_batch else args.bf16_batch
                steps = args.decode_steps if variant == "GPTQ int4" else [1]
                for b, k in ((b, k) for b in batches for k in steps):
                    shown = variant if steps == [1] else f"{variant}, {k} steps / program"
                    try:
                        # the bf16 twin is what XLA alone does: its decode steps attend on XLA too
                        with (contextlib.nullcontext() if variant == "GPTQ int4" else
                              mock.patch.object(decoder, "decode_kernel_mode", lambda: None)):
                            r = bench_model(model, batch=b, prompt=args.prompt, new=args.new, reps=args.reps,
                                            bandwidth=bandwidth, profile=args.profile,
                                            moe_share=not args.no_moe_share, decode_steps=k)
                    except Exception as ex:  # noqa: BLE001 - out of memory: report the row, go on
                        if not isinstance(ex, MemoryError) and "RESOURCE_EXHAUSTED" not in str(ex):
                            raise
                        print_live_arrays("out of memory")
                        print("# memory (GiB): " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in _stats().items()
                                                             if "bytes" in k), flush=True)
                        line = f"| {label} | {shown} | {b} | out of memory: {str(ex).splitlines()[0][:160]} |"
                        print(line, flush=True)
                        table.append(line)
                        continue
                    line = row_md(label, shown, r)
                    print(line, flush=True)
                    table.append(line)
                del model
                gc.collect()
            if os.path.isdir(path):
                import shutil

                shutil.rmtree(path)
    if args.append:
        from benchmarks.results_io import append_markdown

        argv_s = list(argv if argv is not None else sys.argv[1:])
        append_markdown(args.append, "Whole-model generation (benchmarks/generate.py)", "generate.py", argv_s,
                        f"Random GPTQ 4-bit g128 checkpoints, {args.prompt}-token prompts, {args.new} new tokens, "
                        f"{args.dtype} activations. Floor: the weight bytes a decode step touches (experts: the "
                        f"expected number a uniform top-k routing of the batch touches) at {bandwidth:.3g} B/s; "
                        "KV-cache reads are not in the floor. MoE share: 1 - step time with the MoE layers "
                        "replaced by identity / step time.", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
