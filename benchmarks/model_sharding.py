"""Whole decoders on 1 vs 2, 4, 8 devices: ``load_model(DIR, mesh=...)`` against the one-device model.

The script writes a random GPTQ 4-bit g128 checkpoint of each model shape
(``benchmarks/generate.py``'s :data:`~benchmarks.generate.SHAPES`), then loads it once per mesh
of ``--meshes`` (``1``: one device, no mesh; ``ep4``: expert parallel over 4 devices; ``tp2``:
tensor parallel over 2; ``ep2xtp2``: both, 4 devices) and, per batch size, measures what
``benchmarks/generate.py``'s :func:`~benchmarks.generate.bench_model` measures: the prefill of
``--prompt`` tokens, the streamed decode rate over ``--new`` tokens and one decode step alone.
Each row also gives the largest number of bytes of the model's arrays any one device holds, and
its decode rate over the one-device row's (in the same run; "—" where the one-device row is not
in the run). The greedy tokens of every mesh are compared with the one-device model's where both
ran (``tokens`` column: ``same`` or the first differing step).

GPU (several GPUs of one host; say which):
``PYTHONPATH=$PWD python3 benchmarks/model_sharding.py --models qwen3,mixtral --meshes 1 ep2 tp2 ep4 ep2xtp2 ep8``.
CPU smoke run: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 benchmarks/model_sharding.py --tiny``.
Bytes per device of the large shapes, loaded on 8 CPU devices (no timing worth reading):
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 benchmarks/model_sharding.py --models dsv3 --layers 2 --meshes ep8 --bytes-only``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from benchmarks.generate import LABELS, SHAPES, bench_model, write_shape_model  # noqa: E402
from flax import nnx  # noqa: E402
from wna16_jax.models import load_model  # noqa: E402
from wna16_jax.models.generation import Generator  # noqa: E402

#: shapes beyond benchmarks/generate.py's, for the bytes-per-device report (real widths and
#: expert counts; --layers keeps them small)
LARGE = {
    "dsv3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=2, num_heads=128,
                 num_kv_heads=128, head_dim=192, num_experts=256, top_k=8, moe_intermediate_size=2048,
                 intermediate_size=18432, first_k_dense_replace=1, n_shared_experts=1,
                 mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128),
                 routing=dict(topk_method="noaux_tc", n_group=8, topk_group=4, scoring_func="sigmoid",
                              norm_topk_prob=True, routed_scaling_factor=2.5), max_position_embeddings=4096),
    "qwen3_235b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_layers=2, num_heads=64,
                       num_kv_heads=4, head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=1536,
                       intermediate_size=12288, rope_theta=1e6, max_position_embeddings=4096),
}
LARGE_LABELS = {"dsv3": "DeepSeek-V3 shape", "qwen3_235b": "Qwen3-235B-A22B shape"}
#: what ``--tiny`` sets
TINY = dict(models="tiny", layers=2, meshes=["1", "ep2", "tp2", "ep2xtp2"], batch=[2], prompt=8, new=6, reps=1)

HEADER = ("| model | mesh | devices | batch | prefill ms | decode tok/s | step ms | vs 1 device | tokens "
          "| max MiB / device |")
def parse_mesh(text: str) -> tuple[int, int]:
    """``(ep, tp)`` of a ``--meshes`` entry (``1``, ``ep4``, ``tp2``, ``ep2xtp2``:
    :func:`wna16_jax.models.mesh.parse_mesh_spec`)."""
    from wna16_jax.errors import ConfigError
    from wna16_jax.models.mesh import parse_mesh_spec

    if text == "1":
        return 1, 1
    try:
        return parse_mesh_spec(text, "--meshes")
    except ConfigError as e:
        raise SystemExit(str(e)) from None


def make_mesh(ep: int, tp: int) -> Mesh | None:
    """The mesh of ``ep`` × ``tp`` of the first devices (None for one device)."""
    n = ep * tp
    if n == 1:
        return None
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"a mesh of {n} devices needs {n}, this run has {len(devices)}")
    axes = [(name, size) for name, size in (("ep", ep), ("tp", tp)) if size > 1]
    return Mesh(np.array(devices[:n]).reshape([s for _, s in axes]), tuple(a for a, _ in axes))


def bytes_per_device(model) -> dict:
    """Bytes of the model's arrays on each device (a replicated array counts on every device)."""
    out: dict = {}
    for a in jax.tree.leaves(nnx.state(model)):
        for shard in getattr(a, "addressable_shards", ()):
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def greedy_tokens(model, batch: int, prompt: int, new: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.config.vocab_size, prompt).tolist() for _ in range(batch)]
    return Generator(model, batch_size=batch, max_len=prompt + new).generate(prompts, new, stop_tokens=())


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for row_a, row_b in zip(a, b):
        for step, (x, y) in enumerate(zip(row_a, row_b)):
            if x != y:
                return f"differ at step {step}"
    return "same"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help=f"a CPU smoke run: {TINY}")
    ap.add_argument("--models", default="qwen3,mixtral", help=f"comma-separated of {sorted(SHAPES) + sorted(LARGE)}")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--meshes", nargs="+", default=["1", "ep2", "tp2"], help="1, epN, tpN, epNxtpM")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--bytes-only", action="store_true", help="load and report bytes per device; no timing")
    ap.add_argument("--workdir", default=None, help="where the random checkpoints go (default: a temp folder)")
    return ap


def _rows(label: str, model, name: str, devices: int, args, base: dict, tokens: dict) -> list[str]:
    per = bytes_per_device(model)
    top = max(per.values()) / 2**20 if per else float("nan")
    if args.bytes_only:
        return [f"| {label} | {name} | {devices} | — | — | — | — | — | — | {top:,.1f} |"]
    rows = []
    for b in args.batch:
        r = bench_model(model, batch=b, prompt=args.prompt, new=args.new, reps=args.reps, bandwidth=1.0,
                        moe_share=False)
        got = greedy_tokens(model, b, min(args.prompt, 16), min(args.new, 8))
        if name == "1":
            base[b], tokens[b] = r["decode_tps"], got
        ratio = f"{r['decode_tps'] / base[b]:.2f}" if b in base else "—"
        same = first_difference(tokens[b], got) if b in tokens else "—"
        rows.append(f"| {label} | {name} | {devices} | {b} | {r['prefill_ms']:.2f} | {r['decode_tps']:.1f} | "
                    f"{r['step_ms']:.3f} | {ratio} | {same} | {top:,.1f} |")
    return rows


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if n not in SHAPES and n not in LARGE]
    if bad:
        raise SystemExit(f"--models: unknown {bad}; known: {sorted(SHAPES) + sorted(LARGE)}")
    meshes = [(m, *parse_mesh(m)) for m in args.meshes]
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}) x {len(jax.devices())}, "
          f"jax {jax.__version__}", flush=True)
    table = [HEADER, "|" + "|".join("---" for _ in HEADER.split("|")[1:-1]) + "|"]
    print("\n".join(table), flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for model_name in names:
            shape = SHAPES.get(model_name) or LARGE[model_name]
            path, label = write_shape_model(tmp, model_name, args.layers, shape=shape,
                                            label=LABELS.get(model_name) or LARGE_LABELS[model_name])
            base: dict = {}
            tokens: dict = {}
            for name, ep, tp in meshes:
                mesh = make_mesh(ep, tp)
                whole = tp > 1 and (shape["moe_intermediate_size"] // tp) % 128 != 0    # slices of whole groups
                rules = {"expert_intermediate": None} if whole else None
                name = f"{name} (experts whole)" if whole else name
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = load_model(path, dtype=jnp.dtype(args.dtype), mesh=mesh, sharding=rules)
                print(f"# {label}, mesh {name}: loaded in {time.perf_counter() - t0:.0f} s", flush=True)
                for line in _rows(label, model, name, ep * tp, args, base, tokens):
                    print(line, flush=True)
                    table.append(line)
                del model
                gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
