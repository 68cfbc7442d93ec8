"""Fingerprints of the GPU engine's default programs, computed on any machine (no GPU needed).

    PYTHONPATH=$PWD python3 benchmarks/program_fingerprints.py [--out FILE] [--compare FILE]

For every row of the benchmark table (Mixtral, Qwen3-30B-A3B, DeepSeek-V2-Lite × their token
counts × AWQ with zero points / GPTQ symmetric) and a few Triton-engine formats (8-bit
channelwise, group 64, the batched-experts format), the layer is traced with
:func:`jax.make_jaxpr` on abstract weights — the kernels' own jaxprs, grids and compiler
parameters included — with an H200's 132 SMs patched in. The printed jaxpr, with function names
removed (so that moving or renaming code does not count), is hashed. The layers are traced on
the weight pytrees the library holds (their leaves in the pytrees' order), through
``benchmarks.wgmma_plan.wgmma_layer`` and ``_triton_layer``.

A refactoring that leaves every fingerprint unchanged leaves every program the GPU compiles
unchanged, hence its speed: compare a run before and after with ``--compare``. Exit status 1
when any fingerprint differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp

from benchmarks.moe_engine import SHAPES
from benchmarks.wgmma_plan import abstract_weights


def _normalise(text: str) -> str:
    text = re.sub(r"name=[^\s\]]+", "name=_", text)
    text = re.sub(r"<function \S+ at", "<function _ at", text)       # inline Mosaic GPU functions
    return re.sub(r"\b(file|line|loc)=\S+", "", text)


def _digest(fn, *args) -> str:
    return hashlib.sha256(_normalise(str(jax.make_jaxpr(fn)(*args))).encode()).hexdigest()[:16]


def _inputs(t, k, h):
    s = jax.ShapeDtypeStruct
    return s((t, h), jnp.bfloat16), s((t, k), jnp.float32), s((t, k), jnp.int32)


def _tile_weights(scheme, e, h, i):
    from wna16_jax.convert.tiles import convert_tiles
    from wna16_jax.weights import CheckpointWeights

    shapes = CheckpointWeights.expected_shapes(scheme, e, h, i)
    s = jax.ShapeDtypeStruct
    leaves = {n: s(shp, jnp.int32 if ("qweight" in n or "qzeros" in n or "g_idx" in n) else jnp.float16)
              for n, shp in shapes.items() if not n.endswith("bias")}
    return jax.eval_shape(convert_tiles, CheckpointWeights.of(**leaves, scheme=scheme, hidden_size=h,
                                                           intermediate_size=i))


def _triton_layer(x, tw, ids, weights):
    from pallas_kernels.fused_moe_tiles import fused_moe_tiles

    w13, w2 = weights.gemms()
    return fused_moe_tiles(x, tw, ids, w13, w2, bits=weights.bits, group_size=weights.group_size)


def fingerprints() -> dict[str, str]:
    import pallas_kernels.device as dev
    from benchmarks.wgmma_plan import wgmma_layer as fused_moe_wgmma
    from wna16_jax.schemes import QuantScheme

    dev.num_sms = lambda: 132                    # an H200's, as on the device
    out = {}
    for key, (_, (e, k, h, i), tokens) in SHAPES.items():
        if key == "tiny":
            continue
        for t in tokens:
            for zeros in (True, False):
                fmt = "awq" if zeros else "gptq"
                out[f"wgmma {key} {t} {fmt}"] = _digest(fused_moe_wgmma, *_inputs(t, k, h),
                                                        abstract_weights(e, h, i, zeros=zeros))
    triton = {"gptq8 channel": QuantScheme("gptq", 8, -1, False), "gptq4 g64": QuantScheme("gptq", 4, 64, False),
              "awq g128": QuantScheme("awq", 4, 128, True)}
    for key in ("mixtral", "qwen3"):
        _, (e, k, h, i), _ = SHAPES[key]
        for fmt, scheme in triton.items():
            w = _tile_weights(scheme, e, h, i)
            for t in (1, 64, 512):
                out[f"triton {key} {t} {fmt}"] = _digest(_triton_layer, *_inputs(t, k, h), w)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the fingerprints as JSON")
    ap.add_argument("--compare", help="a JSON file of an earlier run: list the rows that differ")
    args = ap.parse_args(argv)
    got = fingerprints()
    for name, digest in got.items():
        print(f"{name:<34} {digest}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            want = json.load(f)
        differ = sorted(n for n in set(want) | set(got) if want.get(n) != got.get(n))
        print(f"{len(differ)} of {len(set(want) | set(got))} programs differ" + (":" if differ else ""))
        for n in differ:
            print(f"  {n}: {want.get(n)} -> {got.get(n)}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
