"""Time one device vs EP=2 (all-gather and all-to-all designs) vs TP=2 for one MoE layer.

Default: the Mixtral-8x7B shape (E=8, H=4096, I=14336, top-2, GPTQ int4 g128 random weights,
loader layout through the XLA decode) on the first two accelerators. ``--tiny`` runs a small
shape, which also works on a CPU with fake devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 benchmarks/sharding.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from wna16_jax import routing  # noqa: E402
from wna16_jax.checkpoint import random_checkpoint_weights  # noqa: E402
from wna16_jax.moe import fused_moe  # noqa: E402
from wna16_jax.schemes import QuantScheme  # noqa: E402
from wna16_jax.sharding import shard_weights, sharded_fused_moe, slice_tp, stack_tp_shards  # noqa: E402


def _time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())                 # compile + warm up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="E=8, H=128, I=256 (CPU-friendly)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if len(jax.devices()) < 2:
        raise SystemExit("needs >= 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    e, h, i, k = (8, 128, 256, 2) if args.tiny else (8, 4096, 14336, 2)
    tokens = args.tokens or ([4, 64] if args.tiny else [16, 256, 2048])
    rng = np.random.default_rng(0)
    scheme = QuantScheme("gptq", 4, 128, False)
    w = random_checkpoint_weights(rng, scheme, e, h, i).to_jax()
    d = np.array(jax.devices()[:2])
    one = jax.device_put(w, d[0])
    mesh_ep, mesh_tp = Mesh(d, ("ep",)), Mesh(d, ("tp",))
    w_ep = shard_weights(w, mesh_ep)
    w_tp = shard_weights(stack_tp_shards([slice_tp(w, 2, r) for r in range(2)]), mesh_tp, ep_axis=None, tp_axis="tp")
    single = jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w))
    print(f"{jax.devices()[0].platform} x{len(d)}: E={e} H={h} I={i} top-{k}, {scheme.describe()}, median of {args.repeats}")
    print("| tokens | 1 device (ms) | EP=2 all-gather (ms) | EP=2 all-to-all (ms) | TP=2 (ms) | max rel. diff |")
    print("|---|---|---|---|---|---|")
    out = {}
    for t in tokens:
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
        tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k, renormalize=True)
        runs = {
            "single": lambda: single(jax.device_put(x, d[0]), tw, ids, one),
            "ep_allgather": lambda: sharded_fused_moe(x, tw, ids, w_ep, mesh_ep, ep_method="allgather"),
            "ep_all_to_all": lambda: sharded_fused_moe(x, tw, ids, w_ep, mesh_ep, ep_method="all_to_all"),
            "tp": lambda: sharded_fused_moe(x, tw, ids, w_tp, mesh_tp, ep_axis=None, tp_axis="tp"),
        }
        ref = np.asarray(runs["single"](), np.float32)
        diff = max(float(np.max(np.abs(np.asarray(f(), np.float32) - ref)) / np.max(np.abs(ref)))
                   for f in runs.values())
        ms = {name: 1e3 * _time(f, args.repeats) for name, f in runs.items()}
        out[t] = dict(ms, max_rel_diff=diff)
        print(f"| {t} | {ms['single']:.2f} | {ms['ep_allgather']:.2f} | {ms['ep_all_to_all']:.2f} | "
              f"{ms['tp']:.2f} | {diff:.2e} |")
    return out


if __name__ == "__main__":
    main()
