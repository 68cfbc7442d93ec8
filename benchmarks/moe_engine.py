"""Time the GPU engine against the project's XLA path and XLA baselines, per model shape.

    PYTHONPATH=$PWD python3 benchmarks/moe_engine.py [--rows mixtral:1,16 qwen3:1] [--reps 20]
        [--append benchmarks/RESULTS.md] [--json benchmarks/results.json]
    PYTHONPATH=$PWD python3 benchmarks/moe_engine.py --sweep ...   # engine variants only
    PYTHONPATH=$PWD python3 benchmarks/moe_engine.py --sweep --profile ...   # + time per kernel

One fused MoE layer (W4A16 group 128, random weights, random routing, bf16 activations) per
row; µs per layer, timed as jitted programs of dependent calls (a fori_loop; ``--timing
unrolled`` for straight-line calls), each on its own random routing (R routings, used in turn, so
the experts a call touches are not all still in L2 from the call before): per layer =
(time of the 2R-call program − time of the R-call program) / R, median of 5 such pairs, so the
fixed cost of starting a program and waiting for it (0.08–0.45 ms on the H200, docs/journal/notes.md v11)
is not spread over the layers; in the table the alternatives' runs are interleaved round-robin
(one pair of each, five times), so clock drift affects every column alike.
Alternatives in the same run:

* ``engine AWQ`` / ``engine GPTQ``: :func:`pallas_kernels.fused_moe_tiles.fused_moe_tiles` on
  the kernel-native tile layout, converted once ahead of time (AWQ: zero points; GPTQ: symmetric);
* ``wgmma AWQ`` / ``wgmma GPTQ``: :func:`pallas_kernels.wgmma_layer.fused_moe_wgmma`, the
  Mosaic GPU (Hopper wgmma) kernels on their own 16-bit-word layout, converted once ahead of
  time (GPU only; skipped in interpret mode);
* ``engine←Marlin``: the same engine fed the vLLM Marlin layout, re-laid into tiles inside the
  jitted call (the cost of *not* converting ahead of time to the kernel-native layout);
* ``XLA path``: :func:`wna16_jax.moe.fused_moe` on the loader layout, bf16 compute;
* ``ragged_dot bf16``: ``jax.lax.ragged_dot`` on bf16 weights (no quantization);
* ``dequant→ragged_dot``: dequantize every expert to bf16 inside the program, then ragged_dot;
* ``dense bf16``: the dense bf16 matmul rate measured in the same run, the reference of the
  prefill target: two plain bf16 matmuls with the layer's FLOPs and no routing,
  ``[T, H] @ [H, top_k·2I]``, SiLU-and-multiply, ``[T, top_k·I] @ [top_k·I, H]`` (random bf16
  weights); the ``wgmma % dense`` column is its time over the wgmma AWQ layer's, and
  ``wgmma % peak`` the layer's FLOP rate over the run's peak (chained ``[8192, 8192]`` bf16
  matmuls, timed once per run: :func:`dense_peak_tflops`).

Each engine output is checked against a float32 XLA evaluation of the same layer before it is
timed (``rel err`` column; > 2e-2 is reported as a failure). Floor = max(bytes of the int4
weights + bf16 scales (+ zeros) of the experts each call touches / 4.3 TB/s, FLOPs / 640 TFLOP/s),
as in the GPU engine issue.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fused_moe_tiles import choose_config, fused_moe_tiles
from wna16_jax import routing
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.convert.tiles import convert_tiles
from wna16_jax.moe import fused_moe, fused_moe_ragged_dot, silu_and_mul
from wna16_jax.schemes import QuantScheme

SHAPES = {"mixtral": ("Mixtral (8, 2, 4096, 14336)", (8, 2, 4096, 14336), (1, 16, 64, 512, 4096)),
          "qwen3": ("Qwen3-30B-A3B (128, 8, 2048, 768)", (128, 8, 2048, 768), (1, 16, 64, 512, 4096)),
          "dsv2lite": ("DeepSeek-V2-Lite (64, 6, 2048, 1408)", (64, 6, 2048, 1408), (1, 16, 64)),
          # a smoke-test shape for the CPU (with --interpret); never in the default rows
          "tiny": ("tiny (8, 2, 256, 256)", (8, 2, 256, 256), (1, 8))}
INTERPRET = False
BW, FLOPS = 4.3e12, 640e12
AWQ = QuantScheme("awq", 4, 128, True)
GPTQ = QuantScheme("gptq", 4, 128, False)


def floor_us(ids_all, h, i, t, k, group=128, zeros=True):
    """Mean over the timed calls of max(weight bytes touched / BW, FLOPs / FLOPS), µs."""
    per_expert = 3 * h * i * 0.5 + 3 * h * i / group * 2 * (2 if zeros else 1)
    touched = np.mean([len(np.unique(ids)) for ids in np.asarray(ids_all)])
    return max(touched * per_expert / BW, 2 * t * k * 3 * h * i / FLOPS) * 1e6


def dense_bf16(c, tw, ids, w13, w2):
    """The dense-rate reference (no routing; ``tw``/``ids`` unused): the layer's FLOPs as two
    plain bf16 matmuls, ``w13 [H, top_k, 2I]`` then ``w2 [top_k, I, H]`` (each flattened to one
    matrix), float32 accumulation."""
    del tw, ids
    (t, h), (_, k, i2) = c.shape, w13.shape
    g = jnp.dot(c.astype(jnp.bfloat16), w13.reshape(h, k * i2), preferred_element_type=jnp.float32)
    a = silu_and_mul(g.reshape(t, k, i2)).astype(jnp.bfloat16).reshape(t, k * i2 // 2)
    return jnp.dot(a, w2.reshape(k * i2 // 2, h), preferred_element_type=jnp.float32)


def dense_peak_tflops(n, reps=10):
    """The dense bf16 matmul rate of this run, TFLOP/s: a chain of ``[n, n] @ [n, n]`` bf16
    matmuls (float32 accumulation), timed differentially like the layers (the peak the prefill
    target's "dense rate" refers to; the ``dense bf16`` column is the same-shape rate)."""
    from benchmarks.timing import differential_us

    ka, kb = jax.random.split(jax.random.key(2))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16) * (1.0 / n ** 0.5)

    def build(calls):
        def run(a, b):
            return jax.lax.fori_loop(0, calls, lambda _, c: jnp.dot(
                c, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16), a)
        return jax.jit(run)
    return 2 * n ** 3 / differential_us(build, (a, b), reps) / 1e6


TIMING = "loop"
UNROLL = 1          # --unroll: calls per fori_loop iteration


def timed(layer, x, tw_all, ids_all, operands, reps):
    """µs per call of ``layer(c, tw, ids, *operands)``: :func:`runner`'s differential time, median
    of 5. Weights are arguments, never constants."""
    once = runner(layer, x, tw_all, ids_all, operands, reps)
    return statistics.median(once() for _ in range(5)) / reps * 1e6


def program(layer, calls):
    """The timed program (not jitted): ``calls`` dependent calls of ``layer``, call ``r`` routed by
    ``tw_all[r % R], ids_all[r % R]`` (``R`` routings given) — a ``fori_loop``, or straight-line
    code unless ``TIMING`` is ``"loop"``."""
    def run(x, tw_all, ids_all, operands):
        n = tw_all.shape[0]

        def body(r, c):
            y = layer(c, tw_all[r % n], ids_all[r % n], *operands)
            return x + y.astype(x.dtype) * jnp.asarray(1e-3, x.dtype)
        if TIMING == "loop":
            return jax.lax.fori_loop(0, calls, body, x, unroll=max(1, min(UNROLL, calls)))
        c = x
        for r in range(calls):
            c = body(r, c)
        return c
    return run


def runner(layer, x, tw_all, ids_all, operands, reps):
    """Compile and warm the timed programs of :func:`timed`; returns a function that runs them
    once and returns ``reps`` calls' wall time in seconds (so several alternatives can be timed
    round-robin).

    ``TIMING = "loop"`` (default): a ``fori_loop``; ``"unrolled"``: the calls as straight-line
    code (no while loop around them). Both differential: the programs of ``reps`` and
    ``2·reps`` calls each run once and the difference is returned, which leaves out what a
    program costs once (dispatch, argument handling, the final synchronization; before v11 it
    was divided into the layers: 8–45 µs per layer at 10 calls, docs/journal/notes.md v11).
    ``"calls"``: one jitted call per layer, dispatched from Python back to back (how a serving
    loop steps), synchronized once at the end (not differential: the dispatch is what it
    measures). The loop and the straight-line program measured the same on the H200 in v3; in
    v11 the straight-line difference was too noisy at 10 calls (its two programs are different
    executables). The loop compiles faster."""
    if TIMING == "calls":                     # one jitted layer call per step, dispatched from Python
        step = jax.jit(lambda c, x0, tw, ids, operands: x0 + layer(c, tw, ids, *operands).astype(x0.dtype)
                       * jnp.asarray(1e-3, x0.dtype))
        routes = [(tw_all[r], ids_all[r]) for r in range(reps)]
        step(x, x, *routes[0], operands).block_until_ready()

        def calls():
            t0 = time.perf_counter()
            c = x
            for tw, ids in routes:
                c = step(c, x, tw, ids, operands)
            c.block_until_ready()
            return time.perf_counter() - t0
        return calls

    from benchmarks.timing import pair_timer

    return pair_timer(lambda n: jax.jit(program(layer, n)), (x, tw_all, ids_all, operands), reps)


def ragged_bf16(x, tw, ids, w13, w2):
    t, k = ids.shape
    e = w13.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[order // k]
    h = jax.lax.ragged_dot(xs, w13, sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(silu_and_mul(h).astype(x.dtype), w2, sizes, preferred_element_type=jnp.float32)
    y = y * tw.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(y, order // k, num_segments=t).astype(x.dtype)


def engine(**cfg):
    """A layer on the Triton-lowered engine, or (``kernel="wgmma"``) on the wgmma kernels, over the
    library's weight pytrees (``TileWeights`` / ``WgmmaWeights``)."""
    if cfg.pop("kernel", None) == "wgmma":
        from pallas_kernels.wgmma_layer import fused_moe_wgmma

        def wg_layer(c, tw, ids, wg):
            w13, w2 = wg.gemms()
            return fused_moe_wgmma(c, tw, ids, w13, w2, interleaved=wg.w13_interleaved, **cfg)
        return wg_layer

    def layer(c, tw, ids, tiles):
        w13, w2 = tiles.gemms()
        return fused_moe_tiles(c, tw, ids, w13, w2, bits=tiles.bits, group_size=tiles.group_size,
                               interpret=INTERPRET, **cfg)
    return layer


def engine_from_marlin(c, tw, ids, marlin):
    return engine()(c, tw, ids, convert_tiles(marlin))


def sweep_variants(key, t, k, e):
    """Engine variants worth comparing at this row (name → fused_moe_tiles keyword overrides)."""
    v = {"auto": {}, "magic": {"dequant": "magic"}}
    if t * k <= 4 * e and t <= 64:
        v["pair"] = {"mode": "pair"}
        v["blocked"] = {"mode": "blocked"}
        v["split=1"] = {"split1": 1, "split2": 1}
    if t >= 512:
        v["bm128 bn128 w8"] = {"block_m": 128, "block_n1": 128, "block_n2": 128, "num_warps": 8}
        v["bm64 bn128 w4"] = {"block_m": 64, "block_n1": 128, "block_n2": 128, "num_warps": 4}
        v["bm64 bn64 w4"] = {"block_m": 64, "block_n1": 64, "block_n2": 64, "num_warps": 4}
        v["stages4"] = {"num_stages": 4}
    return v


def parse_variants(spec):
    """``"name=key:value,key:value;name2=..."`` → {name: overrides} (values int where they parse;
    ``a/b`` a pair, ``-`` in it None: ``persistent:-/1`` → ``(None, 1)``, one value per GEMM)."""
    def value(val):
        return int(val) if val.lstrip("-").isdigit() else None if val == "-" else val

    out = {}
    for item in filter(None, spec.split(";")):
        name, _, body = item.partition("=")
        over = {}
        for kv in filter(None, body.split(",")):
            key, _, val = kv.partition(":")
            over[key] = tuple(value(v) for v in val.split("/")) if "/" in val else value(val)
        out[name.strip()] = over
    return out


def parse_rows(specs):
    rows = []
    for spec in specs:
        key, _, toks = spec.partition(":")
        if key not in SHAPES:
            raise SystemExit(f"--rows: unknown shape {key!r} (have {sorted(SHAPES)})")
        rows.append((key, [int(x) for x in toks.split(",")] if toks else list(SHAPES[key][2])))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=["mixtral", "qwen3", "dsv2lite"],
                    help="shape[:tokens,...] (default: the three model shapes, all token counts)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke test)")
    ap.add_argument("--sweep", action="store_true", help="time engine variants instead of the alternatives")
    ap.add_argument("--variants", default=None, help="with --sweep: 'name=key:value,...;...' instead of the "
                    "built-in variant list (keys: fused_moe_tiles config overrides)")
    ap.add_argument("--profile", action="store_true", help="with --sweep: also split each variant's time into "
                    "its device kernels (JAX profiler)")
    ap.add_argument("--profile-top", type=int, default=12, help="with --profile: the kernels listed per call, "
                    "largest first")
    ap.add_argument("--dump-hlo", default=None, metavar="DIR", help="with --sweep: write each variant's compiled "
                    "(optimized) HLO to DIR/<shape>_<tokens>_<variant>.hlo.txt, to map the profile's kernel names "
                    "(fusions) to the ops they run")
    ap.add_argument("--timing", choices=("loop", "unrolled", "calls"), default="loop",
                    help="the timed program: a fori_loop of calls (default), straight-line calls, or one "
                    "jitted call per layer dispatched from Python")
    ap.add_argument("--unroll", type=int, default=1, help="with --timing loop: calls per loop iteration "
                    "(the fori_loop's unroll). Each iteration of the loop costs something of its own on the "
                    "device (part 55: two D2D copies and 5–7 µs of idle per 1-token call), which a model's "
                    "forward pass, its layers back to back, does not pay per layer")
    ap.add_argument("--skip", default="", help="comma-separated alternatives not to time")
    ap.add_argument("--append", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, metavar="PATH", help="append one record per row to this results.json")
    args = ap.parse_args(argv)
    global INTERPRET, TIMING, UNROLL
    INTERPRET, TIMING, UNROLL = args.interpret, args.timing, args.unroll
    if UNROLL < 1:
        raise SystemExit(f"--unroll: expected at least 1, got {UNROLL}")
    rng = np.random.default_rng(0)
    alts = ["engine AWQ", "engine GPTQ", "wgmma AWQ", "wgmma GPTQ", "engine←Marlin", "XLA path", "ragged_dot bf16",
            "dequant→ragged_dot", "dense bf16"]
    skip = set(filter(None, args.skip.split(",")))
    if INTERPRET:
        skip |= {"wgmma AWQ", "wgmma GPTQ"}          # Mosaic GPU kernels: Hopper only
    lines = []
    peak = None
    if not args.sweep and "dense bf16" not in skip:
        n = 512 if INTERPRET else 8192
        peak = dense_peak_tflops(n, reps=2 if INTERPRET else 10)
        print(f"# dense bf16 peak: {peak:.0f} TFLOP/s ([{n}, {n}] @ [{n}, {n}] matmuls)", flush=True)
    for key, tokens in parse_rows(args.rows):
        name, (e, k, h, i), _ = SHAPES[key]
        t0 = time.perf_counter()
        w = random_checkpoint_weights(rng, AWQ, e, h, i).to_jax()
        tiles = jax.jit(convert_tiles)(w)
        gptq_tiles = jax.jit(convert_tiles)(random_checkpoint_weights(rng, GPTQ, e, h, i).to_jax())
        wg = gptq_wg = None
        if not INTERPRET:
            from wna16_jax.convert.wgmma import convert_wgmma

            wg, gptq_wg = jax.jit(convert_wgmma)(tiles), jax.jit(convert_wgmma)(gptq_tiles)
        dense = flat = None
        if not args.sweep and "dense bf16" not in skip:    # the dense-rate reference's weights, on the device
            kw = jax.random.split(jax.random.key(1))
            flat = (jax.random.normal(kw[0], (h, k, 2 * i), jnp.bfloat16) * 0.02,
                    jax.random.normal(kw[1], (k, i, h), jnp.bfloat16) * 0.02)
        print(f"# {name}: weights ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for t in tokens:
            reps = args.reps if t <= 64 else max(3, args.reps // 4)
            x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
            routed = [routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k, renormalize=True)
                      for _ in range(reps)]
            tw_all = jnp.stack([r[0] for r in routed])
            ids_all = jnp.stack([r[1] for r in routed])
            fl = floor_us(ids_all, h, i, t, k)
            ref = jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w, compute_dtype=jnp.float32))(
                x.astype(jnp.float32), tw_all[0], ids_all[0], tiles)
            refs = {}

            def check(fn, operands, gptq=False):
                r = ref
                if gptq:                         # the GPTQ layer's own float32 reference
                    if "gptq" not in refs:
                        refs["gptq"] = jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w, compute_dtype=jnp.float32))(
                            x.astype(jnp.float32), tw_all[0], ids_all[0], gptq_tiles)
                    r = refs["gptq"]
                got = jax.jit(fn)(x, tw_all[0], ids_all[0], *operands).astype(jnp.float32)
                return float(jnp.abs(got - r).max()) / float(jnp.abs(r).max())

            if args.sweep:
                cfg = choose_config(t, k, tiles.num_experts, tiles.hidden_size, tiles.intermediate_size, tiles.bits)
                print(f"## {name} T={t} floor {fl:.1f} µs; auto config {cfg}", flush=True)
                variants = parse_variants(args.variants) if args.variants else sweep_variants(key, t, k, e)
                for vname, over in variants.items():
                    try:
                        ops = (wg,) if over.get("kernel") == "wgmma" else (tiles,)
                        err = check(engine(**over), ops)
                        us = timed(engine(**over), x, tw_all, ids_all, ops, reps)
                        flag = "" if err < 2e-2 else "  <-- WRONG"
                        print(f"  {vname:16s} {us:9.1f} µs  {us / fl:6.2f}× floor  rel err {err:.1e}{flag}", flush=True)
                        lines.append({"shape": name, "tokens": t, "variant": vname, "us": us, "floor": fl, "err": err})
                        if args.dump_hlo:
                            os.makedirs(args.dump_hlo, exist_ok=True)
                            tag = re.sub(r"[^A-Za-z0-9]+", "_", f"{key}_{t}_{vname}").strip("_")
                            text = jax.jit(engine(**over)).lower(x, tw_all[0], ids_all[0], *ops).compile().as_text()
                            with open(os.path.join(args.dump_hlo, tag + ".hlo.txt"), "w") as f:
                                f.write(text)
                        if args.profile:
                            from benchmarks.kernel_profile import format_breakdown, kernel_breakdown

                            print(format_breakdown(kernel_breakdown(engine(**over), (x, tw_all[0], ids_all[0], *ops)),
                                                   top=args.profile_top), flush=True)
                            # the timed program itself (fresh routing per call, as timed): its
                            # device timeline cut into the calls, and the idle time between them
                            prog = kernel_breakdown(program(engine(**over), reps), (x, tw_all, ids_all, ops),
                                                    calls=3, parts=reps)
                            shape_of = "loop" if TIMING == "loop" else "straight-line"
                            print(f"    the timed program ({shape_of}, {reps} calls), per call:", flush=True)
                            print(format_breakdown(prog, top=0, host_top=0), flush=True)
                    except Exception as ex:  # noqa: BLE001 - report and continue
                        print(f"  {vname:16s} FAILED {type(ex).__name__}: {str(ex)[:400]}", flush=True)
                continue

            if dense is None and not {"ragged_dot bf16", "dequant→ragged_dot"} <= skip:
                dense = tuple(jnp.swapaxes(a, 1, 2) for a in jax.jit(lambda w: w.dequantize(jnp.bfloat16))(w))
            marlin = None
            if "engine←Marlin" not in skip:
                from wna16_jax.backends import TABLE, Backend

                marlin = TABLE[Backend.MARLIN].convert(AWQ, w)
            layers = {
                "engine AWQ": (engine(), (tiles,)),
                "engine GPTQ": (engine(), (gptq_tiles,)),
                "wgmma AWQ": (engine(kernel="wgmma"), (wg,)),
                "wgmma GPTQ": (engine(kernel="wgmma"), (gptq_wg,)),
                "engine←Marlin": (engine_from_marlin, (marlin,)),
                "XLA path": (lambda c, tw, ids, w: fused_moe(c, tw, ids, w, compute_dtype=jnp.bfloat16), (w,)),
                "ragged_dot bf16": (ragged_bf16, dense),
                "dequant→ragged_dot": (lambda c, tw, ids, w: fused_moe_ragged_dot(
                    c, tw, ids, w, compute_dtype=jnp.bfloat16), (w,)),
                "dense bf16": (dense_bf16, flat),
            }
            runs, errs = {}, []
            for a in alts:
                if a in skip:
                    continue
                try:
                    fn, operands = layers[a]
                    if a.startswith(("engine", "wgmma")):
                        errs.append(check(fn, operands, gptq=a.endswith("GPTQ")))
                    runs[a] = runner(fn, x, tw_all, ids_all, operands, reps)
                except Exception as ex:  # noqa: BLE001 - report and continue (e.g. out of memory)
                    print(f"  {a} at {name} T={t}: {type(ex).__name__}: {str(ex)[:300]}", file=sys.stderr, flush=True)
            # round-robin: every alternative's k-th run follows every alternative's (k-1)-th, so a
            # drift of the GPU's clocks or of the host touches all columns alike
            samples = {a: [] for a in runs}
            for _ in range(5):
                for a, once in runs.items():
                    samples[a].append(once())
            cells = [statistics.median(samples[a]) / reps * 1e6 if a in runs else None for a in alts]
            row = {"shape": name, "dims": [e, k, h, i], "tokens": t, "floor_us": fl, "cells": cells,
                   "tflop": 2 * t * k * 3 * h * i / 1e12, "peak_tflops": peak,
                   "err": max(errs) if errs else None, "config": dataclasses.asdict(choose_config(t, k, tiles.num_experts, tiles.hidden_size, tiles.intermediate_size, tiles.bits))}
            lines.append(row)
            print(_row_md(row, alts), flush=True)
            if args.json:
                from benchmarks.results_io import append_results

                append_results(args.json, {
                    "date": str(datetime.date.today()),
                    "machine": f"{jax.devices()[0].device_kind}, jax {jax.__version__}",
                    "command": "PYTHONPATH=$PWD python3 benchmarks/moe_engine.py " + " ".join(argv or sys.argv[1:]),
                    "shape": name, "dims": [e, k, h, i], "tokens": t, "floor_ms": fl / 1e3,
                    "ms": {a: c / 1e3 for a, c in zip(alts, cells) if c is not None},
                    **({"dense_peak_tflops": round(peak, 1)} if peak else {})})
    if args.sweep:
        return 0
    table = [_header(alts)] + [_row_md(r, alts) for r in lines]
    print("\n".join(table))
    if args.append:
        from benchmarks.results_io import append_markdown

        append_markdown(args.append, "GPU engine", "moe_engine.py", argv or sys.argv[1:],
                        "W4A16 group 128 (AWQ with zero points unless the column says GPTQ), random weights, "
                        f"random routing per call, bf16 activations; µs per layer ({TIMING} timing: "
                        + ("one jitted call per layer from Python, median of 5 runs" if TIMING == "calls" else
                           "the 2R-call program's time less the R-call program's, / R, median of 5 pairs"
                           + (f", {UNROLL} calls per loop iteration" if TIMING == "loop" and UNROLL > 1 else ""))
                        + ", the alternatives' runs interleaved). dense bf16: two plain bf16 matmuls with the layer's "
                        "FLOPs, no routing (the same-shape dense rate, measured in this run); wgmma % dense: its time over "
                        "the wgmma AWQ layer's; wgmma % peak: the layer's FLOP rate over the dense bf16 peak of this run "
                        + (f"({peak:.0f} TFLOP/s, chained square matmuls)" if peak else "(not measured)")
                        + ". rel err: the engine's output vs a float32 XLA evaluation.", table)
    return 0


def _header(alts):
    return ("| shape (E, top-k, H, I) | tokens | floor µs | " + " | ".join(f"{a} µs" for a in alts)
            + " | engine / floor | wgmma / floor | GPTQ / AWQ engine | GPTQ / AWQ wgmma | wgmma % dense | wgmma % peak | rel err |\n|"
            + "---|" * (len(alts) + 10))


def _row_md(row, alts):
    c = dict(zip(alts, row["cells"]))

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "—"

    err = "—" if row["err"] is None else f"{row['err']:.1e}"
    d, wg = c.get("dense bf16"), c.get("wgmma AWQ")      # the dense rate's time over the layer's
    pct = f"{100 * d / wg:.0f}%" if d and wg else "—"
    peak = row.get("peak_tflops")                        # the layer's FLOP rate over the run's peak
    pk = f"{100 * row['tflop'] / (wg * 1e-6) / peak:.0f}%" if wg and peak else "—"
    return (f"| {row['shape']} | {row['tokens']} | {row['floor_us']:.1f} | "
            + " | ".join("—" if v is None else f"{v:.0f}" for v in row["cells"])
            + f" | {ratio(c.get('engine AWQ'), row['floor_us'])} | {ratio(c.get('wgmma AWQ'), row['floor_us'])}"
            f" | {ratio(c.get('engine GPTQ'), c.get('engine AWQ'))} | {ratio(c.get('wgmma GPTQ'), c.get('wgmma AWQ'))}"
            f" | {pct} | {pk} | {err} |")


if __name__ == "__main__":
    sys.exit(main())
