"""Time the GPU engine against the project's XLA path and XLA baselines, per model shape.

    PYTHONPATH=$PWD python3 benchmarks/moe_engine.py [--quick] [--append benchmarks/RESULTS.md]

One fused MoE layer (W4A16, AWQ-style zero points, group 128, random weights, random routing,
bf16 activations) per row; µs per layer, timed as a jitted loop of R dependent layer calls
(median of 5 runs / R). Alternatives in the same run:

* ``engine v1``: :func:`pallas_kernels.fused_moe_tiles.fused_moe_tiles` (Pallas, Triton lowering);
* ``XLA path``: :func:`wna16_jax.moe.fused_moe` on the loader layout (automatic formulation);
* ``ragged_dot bf16``: ``jax.lax.ragged_dot`` on bf16 weights (no quantization);
* ``dequant→ragged_dot``: dequantize all experts to bf16 inside the program, then ragged_dot.

Floor = max(bytes of the int4 weights + scales of the experts the batch touches / 4.3 TB/s,
FLOPs / 640 TFLOP/s), as in the GPU engine issue.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fused_moe_tiles import convert_tiles, fused_moe_tiles
from wna16_jax import routing
from wna16_jax.checkpoint import random_checkpoint_weights
from wna16_jax.moe import fused_moe, fused_moe_ragged_dot, silu_and_mul
from wna16_jax.schemes import QuantScheme

SHAPES = {"Mixtral (8, 2, 4096, 14336)": ((8, 2, 4096, 14336), (1, 16, 64, 512, 4096)),
          "Qwen3-30B-A3B (128, 8, 2048, 768)": ((128, 8, 2048, 768), (1, 16, 64, 512, 4096)),
          "DeepSeek-V2-Lite (64, 6, 2048, 1408)": ((64, 6, 2048, 1408), (1, 16, 64))}
BW, FLOPS = 4.3e12, 640e12


def floor_us(ids, e, h, i, t, k, group=128):
    touched = len(np.unique(np.asarray(ids)))
    per_expert = 3 * h * i * 0.5 + 3 * h * i / group * 2 * 2        # int4 + bf16 scales and zeros
    return max(touched * per_expert / BW, 2 * t * k * 3 * h * i / FLOPS) * 1e6


def timed(layer, x, operands, reps):
    """µs per call of ``layer(c, *operands)`` in a jitted loop of ``reps`` dependent calls.

    Weights and routing are arguments, never closed-over constants (XLA would embed them)."""
    @jax.jit
    def run(x, operands):
        def body(_, c):
            return x + layer(c, *operands).astype(x.dtype) * jnp.asarray(1e-3, x.dtype)
        return jax.lax.fori_loop(0, reps, body, x)

    run(x, operands).block_until_ready()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        run(x, operands).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / reps * 1e6


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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer token counts")
    ap.add_argument("--skip", default="", help="comma-separated alternatives not to time")
    ap.add_argument("--append", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, metavar="PATH", help="also append one record per row to this results.json")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    scheme = QuantScheme("awq", 4, 128, True)
    alts = ["engine v1", "XLA path", "ragged_dot bf16", "dequant→ragged_dot"]
    header = ("| shape (E, top-k, H, I) | tokens | floor µs | " + " | ".join(f"{a} µs" for a in alts)
              + " | engine / floor |")
    lines = [header, "|" + "---|" * (len(alts) + 4)]
    print("\n".join(lines), flush=True)
    for name, ((e, k, h, i), tokens) in SHAPES.items():
        w = random_checkpoint_weights(rng, scheme, e, h, i).to_jax()
        tiles = convert_tiles(w)
        w13b, w2b = (jnp.swapaxes(a, 1, 2) for a in w.dequantize(jnp.bfloat16))   # [E, H, 2I], [E, I, H]
        for t in (tokens[:3] if args.quick else tokens):
            x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
            tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k, renormalize=True)
            fl = floor_us(ids, e, h, i, t, k)
            layers = {
                "engine v1": (fused_moe_tiles, (tw, ids, tiles)),
                "XLA path": (fused_moe, (tw, ids, w)),
                "ragged_dot bf16": (ragged_bf16, (tw, ids, w13b, w2b)),
                "dequant→ragged_dot": (lambda c, tw, ids, w: fused_moe_ragged_dot(
                    c, tw, ids, w, compute_dtype=jnp.bfloat16), (tw, ids, w)),
            }
            cells = []
            for a in alts:
                if a in args.skip.split(","):
                    cells.append(None)
                    continue
                try:
                    fn, operands = layers[a]
                    cells.append(timed(fn, x, operands, args.reps))
                except Exception as ex:  # noqa: BLE001 - report and continue (e.g. out of memory)
                    print(f"  {a} at {name} T={t}: {type(ex).__name__}: {str(ex)[:200]}", file=sys.stderr)
                    cells.append(None)
            ratio = f"{cells[0] / fl:.1f}" if cells[0] else "—"
            line = (f"| {name} | {t} | {fl:.1f} | " + " | ".join("—" if c is None else f"{c:.0f}" for c in cells)
                    + f" | {ratio} |")
            print(line, flush=True)
            lines.append(line)
            if args.json:
                from benchmarks.results_io import append_results

                append_results(args.json, {
                    "date": str(datetime.date.today()), "machine": f"{jax.devices()[0].device_kind}, jax {jax.__version__}",
                    "command": "PYTHONPATH=$PWD python3 benchmarks/moe_engine.py " + " ".join(argv or sys.argv[1:]),
                    "shape": name, "dims": [e, k, h, i], "tokens": t, "floor_ms": fl / 1e3,
                    "ms": {a: c / 1e3 for a, c in zip(alts, cells) if c is not None}})
    if args.append:
        with open(args.append, "a") as f:
            f.write(f"\n## GPU engine, {datetime.date.today()} ({jax.devices()[0].device_kind}, jax {jax.__version__})\n\n"
                    f"Command: `PYTHONPATH=$PWD python3 benchmarks/moe_engine.py"
                    f"{' --quick' if args.quick else ''} --reps {args.reps} --append {args.append}`. "
                    "W4A16 AWQ g128, random weights and routing, bf16 activations; µs per layer "
                    f"(jitted loop of {args.reps} dependent calls, median of 5).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
