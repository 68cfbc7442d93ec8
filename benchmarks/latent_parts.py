"""Latent attention's ``kv_b_proj``: its two parts stored apart (the library) against one matrix
sliced at every step (the form before), one decode step of a whole DeepSeek-shaped model.

The library keeps a dequantized ``kv_b_proj`` as :class:`~wna16_jax.models.decoder.AbsorbedKV`:
``w_uk [heads, nope, rank]`` and ``w_uv [heads, v, rank]``, cut once at load. Before, it kept one
``[heads · (nope + v), rank]`` matrix and cut the two parts from it inside every step (on an H100
the optimized HLO showed two strided copies of them a layer). This script loads the same random
GPTQ int4 g128 checkpoint twice, once as the library does and once with :class:`Joined` (the
earlier form, rebuilt here: the library keeps no switch for it), checks that both give the same
greedy first token on most rows (their float sums may differ in order), and times one decode step
of each (``benchmarks/decode_breakdown.py``'s program: the cache donated and fed back) at each
batch size, the two in turn, ``--rounds`` rounds of ``--reps`` chained steps; then one profile
of each (device busy time, kernels per step and per layer).

GPU: ``PYTHONPATH=$PWD python3 benchmarks/latent_parts.py`` (DeepSeek-V2-Lite shape, 27 layers,
batch 1 and 8). CPU smoke run: ``--tiny``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.decode_breakdown import compile_decode, profile_step, time_step  # noqa: E402
from benchmarks.generate import LABELS, SHAPES, measure_bandwidth, touched_bytes, write_shape_model  # noqa: E402
from benchmarks.kernel_profile import format_breakdown  # noqa: E402
from flax import nnx  # noqa: E402
from wna16_jax.models import decoder as D  # noqa: E402
from wna16_jax.models import generation as G  # noqa: E402
from wna16_jax.models import load_model  # noqa: E402
from wna16_jax.models.linear import QuantizedWeight  # noqa: E402
from wna16_jax.weights import at_layer  # noqa: E402

#: a small DeepSeek-V2 shape for the CPU smoke run
TINY_SHAPE = dict(model_type="deepseek_v2", vocab_size=512, hidden_size=256, num_layers=3, num_heads=4,
                  num_kv_heads=4, head_dim=48, num_experts=8, top_k=2, moe_intermediate_size=128,
                  intermediate_size=256, first_k_dense_replace=1, n_shared_experts=1,
                  mla=dict(q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                           v_head_dim=32),
                  rope_theta=10000.0, max_position_embeddings=4096)
TINY = dict(layers=3, batch=[1, 2], prompt=16, reps=2, rounds=2, profile_calls=2)

HEADER = ("| model | batch | kv_b_proj | step µs (waited) | chained µs | floor µs | chained / floor | busy µs "
          "| kernels / step | / layer |")


class Joined(D.AbsorbedKV):
    """The form before: ``kv_b_proj`` kept as one ``[heads · (nope + v), rank]`` matrix, the two
    parts cut from it inside every step."""

    def __init__(self, weight, num_heads: int, nope: int, *, frozen: bool = False):
        w = jnp.asarray(weight)
        self.heads, self.nope = num_heads, nope
        self.out_features, self.in_features = (int(d) for d in w.shape)
        self.w = (QuantizedWeight if frozen else nnx.Param)(w)

    def matrices(self, dtype):
        w = at_layer(self.w.get_value()).astype(dtype).reshape(self.heads, -1, self.in_features)
        return w[:, :self.nope], w[:, self.nope:]


def load_both(path: str, dtype) -> dict:
    """``{"one matrix": model, "two parts": model}`` of the checkpoint at ``path``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        library = D.AbsorbedKV
        D.AbsorbedKV = Joined                     # the loader builds the form before
        try:
            before = load_model(path, dtype=dtype)
        finally:
            D.AbsorbedKV = library
        after = load_model(path, dtype=dtype)
    for model, cls in ((before, Joined), (after, library)):
        assert type(model.layers[0].self_attn.kv_b_proj) is cls
        assert model.stacked_layers is None or type(model.stacked_layers.self_attn.kv_b_proj) is cls
    return {"one matrix": before, "two parts": after}


def prepared(model, batch: int, prompt: int, max_len: int):
    """``[step, leaves, cache, token, positions, rest]``: the compiled decode step and its inputs
    after a greedy prefill of ``batch`` random prompts (the same for every model: seed ``batch``)."""
    gen = G.Generator(model, batch_size=batch, max_len=max_len)
    progs, leaves = G.programs(model)
    tokens = np.zeros((batch, gen.bucket(prompt)), np.int32)
    tokens[:, :prompt] = np.random.default_rng(batch).integers(3, model.config.vocab_size, (batch, prompt))
    lengths = jnp.full((batch,), prompt, jnp.int32)
    key, zero, one = G.row_keys(None, 0, batch), jnp.float32(0), jnp.float32(1)
    tok, _, cache = progs.prefill(leaves, jnp.asarray(tokens), lengths, key, zero, one, max_len=gen.cache_len,
                                  sample=False)
    rest = (key, jnp.int32(1), zero, one)
    return [compile_decode(progs, (leaves, cache, tok, lengths) + rest, None), leaves, cache, tok, lengths, rest]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help=f"a CPU smoke run: {TINY}")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's 27)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20, help="chained steps per timing")
    ap.add_argument("--rounds", type=int, default=6, help="timings of each form, the two in turn")
    ap.add_argument("--profile-calls", type=int, default=10)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    shape, label = SHAPES["dsv2lite"], LABELS["dsv2lite"]
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
        shape, label = TINY_SHAPE, "tiny DeepSeek-V2"
    bandwidth = measure_bandwidth()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
          f"copy bandwidth {bandwidth:.3g} B/s", flush=True)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    with tempfile.TemporaryDirectory() as tmp:
        path, label = write_shape_model(tmp, "dsv2lite", args.layers, shape=shape, label=label)
        t0 = time.perf_counter()
        models = load_both(path, dtype)
        print(f"# {label}: loaded in both forms in {time.perf_counter() - t0:.0f} s", flush=True)
    layers = models["two parts"].config.num_layers
    for batch in args.batch:
        max_len = args.prompt + (args.rounds * 2 + 4) * (args.reps + 1) + args.profile_calls + 8
        state = {name: prepared(m, batch, args.prompt, max_len) for name, m in models.items()}
        first = {name: np.asarray(s[0](s[1], s[2], s[3], s[4], *s[5])[0]) for name, s in state.items()}
        same = int((first["one matrix"] == first["two parts"]).sum())
        print(f"# batch {batch}: the first decode token is the same in {same} of {batch} rows", flush=True)
        state = {name: prepared(m, batch, args.prompt, max_len) for name, m in models.items()}  # fresh caches
        times = {name: ([], []) for name in state}
        for r in range(args.rounds):
            for name in (list(state) if r % 2 == 0 else list(state)[::-1]):
                step, leaves, cache, tok, pos, rest = state[name]
                waited, chained, state[name][2] = time_step(step, leaves, cache, tok, pos, rest, args.reps)
                times[name][0].append(waited)
                times[name][1].append(chained)
        floor = touched_bytes(models["two parts"], batch) / bandwidth
        for name, s in state.items():
            prof, s[2] = profile_step(s[0], s[1], s[2], s[3], s[4], s[5], args.profile_calls)
            kernels, busy = sum(n for _, _, n in prof[0]), sum(us for _, us, _ in prof[0])
            print(f"# batch {batch}, {name}:\n{format_breakdown(prof, top=12)}", flush=True)
            waited, chained = statistics.median(times[name][0]), statistics.median(times[name][1])
            lines.append(f"| {label} | {batch} | {name} | {waited * 1e6:.1f} | {chained * 1e6:.1f} | "
                         f"{floor * 1e6:.1f} | {chained / floor:.2f} | {busy:.1f} | {kernels:.0f} | "
                         f"{kernels / layers:.1f} |")
            print(lines[-1], flush=True)
        del state
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
