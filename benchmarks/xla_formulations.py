"""Time the XLA executor's formulations of fused_moe side by side (CPU or GPU).

    python benchmarks/xla_formulations.py [--quick] [--append benchmarks/RESULTS.md] \
        [--json benchmarks/results.json]

For each shape and token count: gather (per-token), dense (all experts), blocked (sorted
blocks, one expert dequantized per block), and jax.lax.ragged_dot on all-experts dequantized
weights (the cross-check). Median of several timed calls of one jitted function after warm-up,
random int4 AWQ weights (group 128) and random routing. Prints one table; ``--shapes cpu``
(default) uses scaled-down shapes for a 2-core CPU, ``--shapes issue`` the model shapes of the
GPU engine issue. ``--json PATH`` also appends one machine-readable record per row to PATH
(see ``benchmarks/results_io.py``; ``notebooks/benchmarks.ipynb`` plots them).
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
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.moe import FORMULATIONS, choose_formulation, fused_moe, fused_moe_ragged_dot
from wna16_jax.schemes import QuantScheme

try:                                     # run as a script: benchmarks/ is on sys.path
    from results_io import append_results
except ImportError:                      # imported as benchmarks.xla_formulations
    from benchmarks.results_io import append_results

SHAPES = {
    # name: (E, top_k, H, I) — scaled-down versions of the model shapes for the CPU
    "cpu": {"mixtral-like (8, 2, 1024, 2048)": (8, 2, 1024, 2048),
            "qwen3-like (64, 8, 512, 256)": (64, 8, 512, 256)},
    # the GPU engine issue's shapes
    "issue": {"Mixtral (8, 2, 4096, 14336)": (8, 2, 4096, 14336),
              "Qwen3-30B-A3B (128, 8, 2048, 768)": (128, 8, 2048, 768),
              "DeepSeek-V2-Lite (64, 6, 2048, 1408)": (64, 6, 2048, 1408)},
}
TOKENS = {"cpu": (1, 8, 64, 256), "issue": (1, 16, 64, 512)}
#: skip a formulation whose dequantized temporaries would exceed this many bytes
MAX_TEMP_BYTES = 8 << 30


def bench(fn, *args, reps=5):
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="cpu")
    ap.add_argument("--append", default=None)
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also append one record per row to this results.json")
    args = ap.parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    dev = jax.devices()[0]
    machine = f"{os.cpu_count()}-core CPU" if dev.platform == "cpu" else dev.device_kind
    machine += f", jax {jax.__version__}"
    rng = np.random.default_rng(0)
    scheme = QuantScheme("awq", 4, 128, True)
    rows = []
    header = f"| shape (E, k, H, I) | tokens | {' | '.join(FORMULATIONS)} | ragged_dot | auto picks |"
    print(header)
    print("|" + "---|" * (len(FORMULATIONS) + 4))
    for name, (e, k, h, i) in SHAPES[args.shapes].items():
        w = random_checkpoint_weights(rng, scheme, e, h, i).to_jax()
        tokens = TOKENS[args.shapes]
        for t in (tokens[:2] if args.quick else tokens):
            x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
            tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k,
                                         renormalize=True)
            temp = {"gather": t * k, "dense": e, "blocked": 1, "ragged_dot": e}   # experts dequantized at once
            cells = []
            for form in FORMULATIONS + ("ragged_dot",):
                if temp[form] * 3 * h * i * 4 > MAX_TEMP_BYTES:
                    cells.append(None)
                    continue
                if form == "ragged_dot":
                    f = jax.jit(fused_moe_ragged_dot)
                else:
                    f = jax.jit(lambda x, tw, ids, w, form=form: fused_moe(x, tw, ids, w, formulation=form))
                cells.append(bench(f, x, tw, ids, w))
            row = (f"| {name} | {t} | " + " | ".join("skipped (memory)" if c is None else f"{c:.2f}" for c in cells)
                   + f" | {choose_formulation(t, k, e)} |")
            print(row, flush=True)
            rows.append(row)
            if args.json:
                append_results(args.json, {
                    "date": datetime.date.today().isoformat(), "machine": machine,
                    "command": " ".join(["python", "benchmarks/xla_formulations.py"] + argv_used),
                    "shape": name, "dims": [e, k, h, i], "tokens": t,
                    "ms": {form: round(c, 4) for form, c in zip(FORMULATIONS + ("ragged_dot",), cells)
                           if c is not None},
                    "auto_picks": choose_formulation(t, k, e),
                    "notes": "ms per layer call (median of 5), bf16 activations, AWQ int4 g128 "
                             "weights, float32 compute",
                })
    if args.append:
        with open(args.append, "a") as f:
            f.write(f"\n## XLA executor formulations, {datetime.date.today()} "
                    f"({jax.devices()[0].device_kind}, jax {jax.__version__})\n\n")
            f.write(f"Command: `python benchmarks/xla_formulations.py --shapes {args.shapes}"
                    f"{' --quick' if args.quick else ''} "
                    f"--append {args.append}`. ms per layer call (median of 5), bf16 activations, "
                    "AWQ int4 g128 weights.\n\n")
            f.write(header + "\n|" + "---|" * (len(FORMULATIONS) + 4) + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    sys.exit(main())
