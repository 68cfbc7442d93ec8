"""One MoE layer on one GPU vs two: EP=2 (all-gather and all-to-all designs) and TP=2.

Rows: the Mixtral-8x7B shape (E=8, H=4096, I=14336, top-2) and the Qwen3-30B-A3B shape (E=128,
H=2048, I=768, top-8) at 1, 16, 256 and 4096 tokens; GPTQ int4 g128 random weights, converted
once into the layout the dispatch table's MARLIN row prepares on this device (the wgmma layout
on an H200; the TP=2 column converts each rank's slice on its own). Columns, per design: time
per layer, the communication share, the executor that ran each device's shard, the time over
the one-GPU time, and the largest relative difference from the one-GPU output.

* **Time per layer**: differential timing (``benchmarks/timing.py``) of one compiled program
  that runs ``n`` dependent layers (``n`` a traced argument: ``R`` and ``2R`` run the same
  program), so what a program costs once is not charged to the layer.
* **Communication share**: the same program with the per-device ``fused_moe`` replaced by an
  elementwise stub of the same output shape (what is left: the collectives and the sharded
  path's glue — padding, the all-to-all's sort and offsets), over the real program's time.

    python3 benchmarks/sharding.py                       # both shapes on the first two GPUs
    python3 benchmarks/sharding.py --shapes qwen3 --tokens 1 16
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 benchmarks/sharding.py --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks.timing import pair_timer  # noqa: E402
from wna16_jax import executors, routing, sharding  # noqa: E402
from wna16_jax.backends import TABLE, Backend  # noqa: E402
from wna16_jax.writers import random_checkpoint_weights  # noqa: E402
from wna16_jax.moe import fused_moe  # noqa: E402
from wna16_jax.schemes import QuantScheme  # noqa: E402

SHAPES = {"mixtral": (8, 4096, 14336, 2), "qwen3": (128, 2048, 768, 8),
          "tiny": (8, 256, 512, 2)}                     # a smoke-test shape (CPU, --tiny)
TOKENS = (1, 16, 256, 4096)
SCHEME = QuantScheme("gptq", 4, 128, False)
DESIGNS = ("one GPU", "EP=2 all-gather", "EP=2 all-to-all", "TP=2")


def _stub(x, topk_weights, topk_ids, weights, **_):
    """Stands in for the per-device layer: elementwise work of its output shape and dtype."""
    return (x.astype(jnp.float32) * topk_weights.sum(axis=1, keepdims=True)).astype(x.dtype)


@contextlib.contextmanager
def _layer_stubbed():
    """Run the sharded programs with :func:`_stub` in place of ``fused_moe`` (rebuilt, then restored)."""
    real = sharding.fused_moe
    sharding._build.cache_clear()
    sharding.fused_moe = _stub
    try:
        yield
    finally:
        sharding.fused_moe = real
        sharding._build.cache_clear()


def _repeated(layer):
    """A jitted program running ``n`` (traced) dependent calls of ``layer(x, tw, ids, w)``: each
    input is ``x + 1e-30·y`` of the previous output ``y`` (the same values, a true dependency)."""
    def prog(n, x, tw, ids, w):
        def step(_, y):
            return layer((x + jnp.asarray(1e-30, x.dtype) * y).astype(x.dtype), tw, ids, w)
        return jax.lax.fori_loop(0, n, step, jnp.zeros_like(x))
    return jax.jit(prog)


def _time_us(layer, args, reps: int, samples: int) -> float:
    prog = _repeated(layer)
    once = pair_timer(lambda n: functools.partial(prog, jnp.int32(n)), args, reps)
    return statistics.median(once() for _ in range(samples)) / reps * 1e6


def _rel(y, ref) -> float:
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
    if not np.isfinite(y).all():
        return float("inf")
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def _prepare(w):
    """The layout the MARLIN row prepares here (the engine's on an NVIDIA GPU), for bf16 activations."""
    return TABLE[Backend.MARLIN].prepare(w.scheme, w, jnp.bfloat16)


def run_shape(name: str, tokens, devices, *, reps: int, samples: int, executor: str, seed: int = 0) -> list[dict]:
    e, h, i, k = SHAPES[name]
    rng = np.random.default_rng(seed)
    w = random_checkpoint_weights(rng, SCHEME, e, h, i, scale=0.02).to_jax()
    one = jax.device_put(_prepare(w), devices[0])
    mesh_ep, mesh_tp = Mesh(devices, ("ep",)), Mesh(devices, ("tp",))
    w_ep = sharding.shard_weights(_prepare(w), mesh_ep)
    w_tp = sharding.shard_weights(sharding.stack_tp_shards([_prepare(sharding.slice_tp(w, 2, r)) for r in range(2)]),
                                  mesh_tp, ep_axis=None, tp_axis="tp")
    del w
    layers = {
        "one GPU": (lambda x, tw, ids, w: fused_moe(x, tw, ids, w, executor=executor), one),
        "EP=2 all-gather": (lambda x, tw, ids, w: sharding.sharded_fused_moe(
            x, tw, ids, w, mesh_ep, ep_method="allgather", executor=executor), w_ep),
        "EP=2 all-to-all": (lambda x, tw, ids, w: sharding.sharded_fused_moe(
            x, tw, ids, w, mesh_ep, ep_method="all_to_all", executor=executor), w_ep),
        "TP=2": (lambda x, tw, ids, w: sharding.sharded_fused_moe(
            x, tw, ids, w, mesh_tp, ep_axis=None, tp_axis="tp", executor=executor), w_tp),
    }
    ran = {"one GPU": executors.select(one, jnp.bfloat16, executor=executor).executor.name,
           "EP=2 all-gather": sharding.sharded_executor(w_ep, mesh_ep, executor=executor).executor.name,
           "TP=2": sharding.sharded_executor(w_tp, mesh_tp, ep_axis=None, tp_axis="tp",
                                             executor=executor).executor.name}
    ran["EP=2 all-to-all"] = ran["EP=2 all-gather"]
    rows = []
    for t in tokens:
        x = jax.device_put(jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16), devices[0])
        logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
        tw, ids = (jax.device_put(a, devices[0]) for a in routing.fused_topk(logits, k, renormalize=True))
        ref = jax.jit(layers["one GPU"][0])(x, tw, ids, one)
        row = {"shape": name, "tokens": t, "cells": {}}
        on_mesh = [jax.device_put(a, NamedSharding(mesh_ep, P())) for a in (x, tw, ids)]    # replicated
        for design, (layer, wd) in layers.items():
            args = (x, tw, ids, wd) if design == "one GPU" else (*on_mesh, wd)
            us = _time_us(layer, args, reps, samples)
            cell = {"us": us, "executor": ran[design], "ratio": us / row["cells"]["one GPU"]["us"] if row["cells"]
                    else 1.0, "err": _rel(layer(*args), ref), "comm": None}
            if design != "one GPU":
                with _layer_stubbed():
                    cell["comm"] = _time_us(layer, args, reps, samples) / us
            row["cells"][design] = cell
        print(_row_md(row), flush=True)
        rows.append(row)
    return rows


def _header() -> str:
    cols = ["shape", "tokens"]
    for d in DESIGNS:
        cols += [f"{d} µs"] if d == "one GPU" else [f"{d} µs", f"{d} / one", f"{d} comm", f"{d} rel err"]
    cols.append("executor (one GPU / EP / TP)")
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def _row_md(row) -> str:
    c = row["cells"]
    out = [row["shape"], str(row["tokens"])]
    for d in DESIGNS:
        out.append(f"{c[d]['us']:.1f}")
        if d != "one GPU":
            out += [f"{c[d]['ratio']:.2f}", f"{100 * c[d]['comm']:.0f}%", f"{c[d]['err']:.1e}"]
    out.append(" / ".join(dict.fromkeys(c[d]["executor"] for d in ("one GPU", "EP=2 all-gather", "TP=2"))))
    return "| " + " | ".join(out) + " |"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="the tiny shape at 1 and 16 tokens (a CPU with fake devices)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--reps", type=int, default=None, help="R of the differential timing (default 20; --tiny 2)")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--executor", default="auto", choices=executors.EXECUTOR_CHOICES)
    ap.add_argument("--append", help="append the table to this markdown file")
    ap.add_argument("--json", help="write the rows to this JSON file")
    args = ap.parse_args(argv)
    if len(jax.devices()) < 2:
        raise SystemExit("needs >= 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    shapes = args.shapes or (["tiny"] if args.tiny else ["mixtral", "qwen3"])
    tokens = args.tokens or ([1, 16] if args.tiny else list(TOKENS))
    reps = args.reps or (2 if args.tiny else 20)
    devices = np.array(jax.devices()[:2])
    title = (f"{devices[0].device_kind} x2, jax {jax.__version__}: {SCHEME.describe()} random weights, bf16 "
             f"activations; differential timing R={reps}, median of {args.samples}")
    print(title)
    print(_header(), flush=True)
    rows = []
    for name in shapes:
        rows += run_shape(name, tokens, devices, reps=reps, samples=args.samples, executor=args.executor)
    if args.append:
        with open(args.append, "a") as f:
            f.write(f"\n### benchmarks/sharding.py\n\n{title}\n\n{_header()}\n"
                    + "\n".join(_row_md(r) for r in rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
