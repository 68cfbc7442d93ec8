"""On the CPU: the CPU backend's layout against the loader layout (no conversion), same layer.

    python benchmarks/cpu_layouts.py [--reps 5] [--append benchmarks/RESULTS.md]

The dispatch table selects the CPU row on a CPU (as vLLM does); its layout holds the same bytes
as the checkpoint, so running it must cost no more than running the checkpoint's own layout.
For a Qwen3-like and a Mixtral-like layer (scaled to a 2-core CPU) and 1, 16 and 128 tokens, it
times ``fused_moe`` on both layouts of one random GPTQ 4-bit g128 layer (and AWQ, which the CPU
row also takes), with the same routing, and checks that the two outputs agree. ms per call:
median of ``--reps`` calls of the compiled program after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from wna16_jax import routing
from wna16_jax.backends import TABLE, Backend
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.moe import fused_moe
from wna16_jax.schemes import QuantScheme

SHAPES = {"qwen3-like (64, 8, 1024, 512)": (64, 8, 1024, 512),
          "mixtral-like (8, 2, 1024, 2048)": (8, 2, 1024, 2048)}
SCHEMES = {"GPTQ": QuantScheme("gptq", 4, 128, False), "AWQ": QuantScheme("awq", 4, 128, True)}
TOKENS = (1, 16, 128)


def bench_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--append", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    header = "| shape (E, k, H, I) | format | tokens | loader layout ms | CPU layout ms | CPU / loader | max rel diff |"
    rows = [header, "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for name, (e, k, h, i) in SHAPES.items():
        for fmt, scheme in SCHEMES.items():
            loader = random_checkpoint_weights(rng, scheme, e, h, i).to_jax()
            cpu = TABLE[Backend.CPU].convert(scheme, loader)
            for t in args.tokens:
                x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
                tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k,
                                             renormalize=True)
                y_l = fused_moe(x, tw, ids, loader).astype(jnp.float32)
                y_c = fused_moe(x, tw, ids, cpu).astype(jnp.float32)
                diff = float(jnp.abs(y_l - y_c).max() / jnp.maximum(jnp.abs(y_l).max(), 1e-30))
                ms_l = bench_ms(lambda: fused_moe(x, tw, ids, loader), args.reps)
                ms_c = bench_ms(lambda: fused_moe(x, tw, ids, cpu), args.reps)
                row = (f"| {name} | {fmt} | {t} | {ms_l:.1f} | {ms_c:.1f} | {ms_c / ms_l:.2f} | {diff:.1e} |")
                print(row, flush=True)
                rows.append(row)
    if args.append:
        cmd = " ".join(["python", "benchmarks/cpu_layouts.py", *(argv if argv is not None else sys.argv[1:])])
        with open(args.append, "a") as f:
            f.write(f"\n## CPU layout against the loader layout on the XLA executor, {datetime.date.today()} "
                    f"({os.cpu_count()}-core CPU, jax {jax.__version__})\n\nCommand: `{cmd}`. ms per "
                    "`fused_moe` call (median), bf16 activations, float32 compute, same routing for both "
                    "layouts.\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
