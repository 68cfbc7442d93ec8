"""Stream-convert a Mixtral-8x7B-sized GPTQ checkpoint (synthesized, random packed int4) to a
backend layout on the CPU, and report wall time and peak memory.

    python benchmarks/convert_scale.py --workdir /tmp/mixtral_scale [--layers 32] [--backend marlin]
        [--append benchmarks/RESULTS.md]

32 layers, E=8, H=4096, I=14336, GPTQ 4-bit group 128 (symmetric): 22.5 GB of int4 weights in one
safetensors shard per layer, as a real checkpoint is laid out. The converter holds one source
layer and its converted form at a time, converting one expert at a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import sys
import threading
import time

import numpy as np

E, H, I, G = 8, 4096, 14336, 128


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def synthesize(path: str, layers: int) -> None:
    from safetensors.numpy import save_file

    from wna16_jax.schemes import QuantScheme

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    scheme = QuantScheme("gptq", 4, G, False)
    weight_map = {}
    for li in range(layers):
        t = {}
        for e in range(E):
            base = f"model.layers.{li}.block_sparse_moe.experts.{e}"
            for proj, (k, n) in (("w1", (H, I)), ("w3", (H, I)), ("w2", (I, H))):
                t[f"{base}.{proj}.qweight"] = rng.integers(-2**31, 2**31, (k // 8, n), dtype=np.int64).astype(np.int32)
                t[f"{base}.{proj}.scales"] = (rng.random((k // G, n), dtype=np.float32) * 0.01 + 1e-3).astype(np.float16)
                t[f"{base}.{proj}.qzeros"] = np.full((k // G, n // 8), 0x77777777, np.int32)
                t[f"{base}.{proj}.g_idx"] = (np.arange(k) // G).astype(np.int32)
        t[f"model.layers.{li}.block_sparse_moe.gate.weight"] = rng.standard_normal((E, H)).astype(np.float16)
        fname = f"model-{li + 1:05d}-of-{layers:05d}.safetensors"
        save_file(t, os.path.join(path, fname))
        weight_map.update({k: fname for k in t})
        del t
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": H,
           "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": layers, "quantization_config": scheme.to_quant_config()}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--backend", default="marlin")
    ap.add_argument("--append", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    src, out = os.path.join(args.workdir, "src"), os.path.join(args.workdir, "out")
    t0 = time.time()
    if not os.path.isfile(os.path.join(src, "config.json")):
        synthesize(src, args.layers)
    t_syn = time.time() - t0
    size_gb = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)) / 1e9
    print(f"source: {size_gb:.1f} GB in {args.layers} shards (synthesized in {t_syn:.0f} s)", flush=True)

    peak = [rss_mb()]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    from wna16_jax.serialize import convert_checkpoint

    base = rss_mb()
    t1 = time.time()
    convert_checkpoint(src, args.backend, out, expert_chunk=1)
    wall = time.time() - t1
    stop.set()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out_gb = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 1e9
    layer_gb = size_gb / args.layers
    line = (f"| {args.layers} × (E={E}, H={H}, I={I}), GPTQ 4-bit g{G} → {args.backend.upper()} | "
            f"{size_gb:.1f} GB → {out_gb:.1f} GB | {wall:.0f} s ({wall / args.layers:.1f} s/layer) | "
            f"{max(peak[0], maxrss) / 1024:.2f} GiB (one source layer = {layer_gb:.2f} GB; "
            f"RSS before converting {base / 1024:.2f} GiB) |")
    print(line)
    if args.append:
        with open(args.append, "a") as f:
            f.write(f"\n## Streaming conversion at Mixtral-8x7B scale, {datetime.date.today()} "
                    f"({os.cpu_count()} CPU cores)\n\nCommand: `python benchmarks/convert_scale.py "
                    f"--workdir {args.workdir} --layers {args.layers} --backend {args.backend} "
                    f"--append {args.append}`\n\n| model | bytes in → out | wall time | peak RSS |\n|---|---|---|---|\n"
                    f"{line}\n")
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
