"""Where one decode step of a whole model goes, and what running it differently would save.

For each model shape (:data:`benchmarks.generate.SHAPES`, random GPTQ int4 g128 checkpoints) and
batch size, with the cache filled by a ``--prompt``-token prefill, the script times:

* ``step``: the library's decode program (one token per sequence, the cache donated and fed
  back), each call waited for, median of ``--reps`` — what a streaming loop pays per token when
  it reads every token back;
* ``chained``: the same program dispatched ``--reps`` times back to back, waited for once (the
  host's launch work overlaps the device's), per step;
* the same two with the program compiled with XLA's command buffers extended to ``while`` loops
  and conditionals (``cmdbuf``: the scanned layer loop captured as one CUDA graph), set per
  compilation through ``compiler_options``, not through ``XLA_FLAGS``;
* ``loop K``: ``K`` decode steps in one program (``lax.fori_loop``, greedy on the device), the
  ``K`` tokens read back once per program, per token; with and without ``cmdbuf``;

and from the JAX profiler's trace of ``--profile-calls`` chained steps: the device's busy time per
step, kernels launched per step and per layer, and the idle time between the step's first and
last kernel (with the largest gaps). Floor: :func:`benchmarks.generate.touched_bytes` at the
measured copy bandwidth. Prefill of one ``--prompt``-token prompt (batch 1) is timed too.

GPU: ``PYTHONPATH=$PWD python3 benchmarks/decode_breakdown.py --models qwen3,dsv2lite --batch 1 8``.
CPU smoke run: ``--models tiny --batch 1 --prompt 16 --reps 2 --k 2``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.generate import SHAPES, measure_bandwidth, touched_bytes, write_shape_model  # noqa: E402
from benchmarks.kernel_profile import format_breakdown, traced_breakdown  # noqa: E402
from wna16_jax.models import load_model  # noqa: E402
from wna16_jax.models import generation as G  # noqa: E402

#: XLA debug options that extend command buffers (CUDA graphs) to while loops and conditionals;
#: the default set is FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN (XLA's DebugOptions)
CMDBUF = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}


def compile_decode(progs, args, options):
    """The decode program (cache donated) compiled with XLA ``options`` (None: the defaults)."""
    def step(leaves, cache, tok, pos, key, i, temp, top_p):
        return progs.decode(leaves, cache, tok, pos, key, i, temp, top_p, sample=False)

    lowered = jax.jit(step, donate_argnums=(1,)).lower(*args)
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def compile_loop(progs, args, k: int, options):
    """``k`` greedy decode steps in one program: ``(tokens [k, B], last token, positions, cache)``."""
    def loop(leaves, cache, tok, pos, key, i0, temp, top_p):
        def body(j, carry):
            t, p, c, out = carry
            nxt, _, c = progs.decode(leaves, c, t, p, key, i0 + j, temp, top_p, sample=False)
            return nxt, p + 1, c, out.at[j].set(nxt)

        out = jnp.zeros((k,) + tok.shape, jnp.int32)
        t, p, c, out = jax.lax.fori_loop(0, k, body, (tok, pos, cache, out))
        return out, t, p, c

    lowered = jax.jit(loop, donate_argnums=(1,)).lower(*args)
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def time_step(fn, leaves, cache, tok, pos, rest, reps):
    """``(waited, chained, cache)``: seconds per call with each call waited for, and per call of
    ``reps`` calls dispatched back to back."""
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out = fn(leaves, cache, tok, pos, *rest)
        np.asarray(out[0])
        ts.append(time.perf_counter() - t0)
        cache = out[2]
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(leaves, cache, tok, pos, *rest)
        cache = out[2]
    jax.block_until_ready(out)
    return statistics.median(ts[1:]), (time.perf_counter() - t0) / reps, cache


def time_loop(fn, leaves, cache, tok, pos, rest, reps, k):
    """``(seconds per token, cache)``: each program's ``k`` tokens read back before the next."""
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out, _, _, cache = fn(leaves, cache, tok, pos, *rest)
        np.asarray(out)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) / k, cache


def profile_step(fn, leaves, cache, tok, pos, rest, calls):
    state = {"cache": cache}

    def run():
        out = None
        for _ in range(calls):
            out = fn(leaves, state["cache"], tok, pos, *rest)
            state["cache"] = out[2]
        jax.block_until_ready(out)

    return traced_breakdown(run, calls), state["cache"]


def bench(model, batch, args, bandwidth, label):
    rng = np.random.default_rng(batch)
    vocab, layers = model.config.vocab_size, model.config.num_layers
    gen = G.Generator(model, batch_size=batch, max_len=args.prompt + max(args.k * (2 * args.reps + 4), 64) + 8)
    max_len = gen.cache_len            # the positions the Generator's own cache holds (a multiple of 64)
    prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(batch)]
    progs, leaves = G.programs(model)
    p = gen.bucket(args.prompt)
    tokens = np.zeros((batch, p), np.int32)
    tokens[:, :args.prompt] = np.asarray(prompts, np.int32)
    lengths = jnp.full((batch,), args.prompt, jnp.int32)
    key, zero, one = G.row_keys(None, 0, batch), jnp.float32(0), jnp.float32(1)

    def prefill():
        return progs.prefill(leaves, jnp.asarray(tokens), lengths, key, zero, one, max_len=max_len, sample=False)

    jax.block_until_ready(prefill())
    ts = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(prefill())
        ts.append(time.perf_counter() - t0)
    t_prefill = statistics.median(ts)
    tok, _, cache = prefill()
    pos = lengths
    rest = (key, jnp.int32(1), zero, one)
    floor = touched_bytes(model, batch) / bandwidth
    rows = []
    for name, options in (("default", None), ("cmdbuf", CMDBUF)):
        if name == "cmdbuf" and (args.no_cmdbuf or jax.default_backend() != "gpu"):
            continue
        t0 = time.perf_counter()
        try:
            step = compile_decode(progs, (leaves, cache, tok, pos) + rest, options)
        except Exception as ex:  # noqa: BLE001 - an option this XLA does not take: say so, go on
            print(f"# {label}, batch {batch}, {name}: did not compile: {str(ex).splitlines()[0][:200]}", flush=True)
            continue
        t_compile = time.perf_counter() - t0
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            hlo = os.path.join(args.hlo_dir, f"{label.split(',')[0].replace(' ', '_')}-b{batch}-{name}.hlo.txt")
            with open(hlo, "w") as f:
                f.write(step.as_text())
            print(f"# optimized HLO of the step: {hlo}", flush=True)
        waited, chained, cache = time_step(step, leaves, cache, tok, pos, rest, args.reps)
        prof, cache = profile_step(step, leaves, cache, tok, pos, rest, args.profile_calls)
        kern, busy = sum(n for _, _, n in prof[0]), sum(us for _, us, _ in prof[0])
        idle = prof[2]["idle"] if prof[2] else float("nan")
        print(f"# {label}, batch {batch}, {name} step: compiled in {t_compile:.0f} s", flush=True)
        print(format_breakdown(prof, top=args.top), flush=True)
        row = dict(variant=name, waited=waited, chained=chained, busy=busy * 1e-6, kernels=kern,
                   per_layer=kern / layers, idle=idle * 1e-6)
        for k in args.k_list:
            loop = compile_loop(progs, (leaves, cache, tok, pos) + rest, k, options)
            row[f"loop{k}"], cache = time_loop(loop, leaves, cache, tok, pos, rest, args.reps, k)
        rows.append(row)
    return t_prefill, floor, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3,dsv2lite", help=f"comma-separated of {sorted(SHAPES)}")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--k", dest="k_list", type=int, nargs="*", default=[8],
                    help="steps per program of the loop variants (none: skip them)")
    ap.add_argument("--profile-calls", type=int, default=10)
    ap.add_argument("--top", type=int, default=25, help="kernels listed per profile")
    ap.add_argument("--no-cmdbuf", action="store_true", help="skip the command-buffer variants")
    ap.add_argument("--unrolled", action="store_true", help="load the layers unrolled (default: scanned)")
    ap.add_argument("--hlo-dir", default=None, help="write each step program's optimized HLO here (to name "
                                                   "the profile's kernels)")
    args = ap.parse_args(argv)
    args.k = max(args.k_list or [1])
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if n not in SHAPES]
    if bad:
        ap.error(f"--models: unknown {bad}; known: {sorted(SHAPES)}")
    bandwidth = measure_bandwidth()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
          f"copy bandwidth {bandwidth:.3g} B/s", flush=True)
    table = ["| model | batch | variant | step µs (waited) | chained µs | " + "".join(
        f"loop {k} µs/token | " for k in args.k_list) + "floor µs | waited / floor | busy µs | idle µs "
             "| kernels / step | / layer | prefill ms |"]
    table.append("|" + "---|" * (table[0].count("|") - 1))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.perf_counter()
            path, label = write_shape_model(tmp, name, args.layers)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = load_model(path, dtype=jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32,
                                   scan_layers=False if args.unrolled else None)
            print(f"# {label}: written and loaded in {time.perf_counter() - t0:.0f} s "
                  f"({'scanned' if model.scan_layers else 'unrolled'})", flush=True)
            for b in args.batch:
                t_prefill, floor, rows = bench(model, b, args, bandwidth, label)
                for r in rows:
                    loops = " | ".join(f"{r[f'loop{k}'] * 1e6:.1f}" for k in args.k_list)
                    line = (f"| {label} | {b} | {r['variant']} | {r['waited'] * 1e6:.1f} | {r['chained'] * 1e6:.1f} | "
                            + (loops + " | " if loops else "")
                            + f"{floor * 1e6:.1f} | {r['waited'] / floor:.2f} | {r['busy'] * 1e6:.1f} | "
                              f"{r['idle'] * 1e6:.1f} | {r['kernels']:.0f} | {r['per_layer']:.1f} | "
                              f"{t_prefill * 1e3:.2f} |")
                    print(line, flush=True)
                    table.append(line)
            del model
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
