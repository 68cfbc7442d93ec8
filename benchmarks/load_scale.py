"""Load a Qwen3-30B-A3B-shaped GPTQ checkpoint from disk: is loading I/O-bound at real size?

    python benchmarks/load_scale.py --workdir /tmp/qwen3_scale [--layers 48] [--convert-layers 48]
        [--append benchmarks/RESULTS.md] [--keep]

Synthesizes (once; ``--keep`` leaves it for the next run) a checkpoint shaped like
Qwen3-30B-A3B-GPTQ-Int4: 48 decoder layers, each with 128 experts (H=2048, I=768, GPTQ 4-bit
group 128, symmetric, fp16 scales, the trivial ``g_idx`` GPTQ writes), a router, quantized
attention projections (32 query / 4 key-value heads of 128) with q/k norms, layer norms, and
bf16 embeddings and ``lm_head`` over a 151,936-token vocabulary — about 74,000 tensor names in
an index over shards of at most 4 GB, written in layer order as ``save_pretrained`` writes them.

Then, in one run, with the page cache emptied of the checkpoint's files before each timed read
(``posix_fadvise(DONTNEED)``), it times:

* ``cat`` of every shard to ``/dev/null``: the time to read the bytes;
* opening the checkpoint (``config.json``, the index, every shard header, the name index);
* loading every MoE layer (``Checkpoint.load_layer``), split into reading the tensors, the
  header/name phase and the value checks (finite scales, ``g_idx`` and zero points);
* converting every loaded layer to the MARLIN layout on the CPU (``--convert-layers``), outside
  the read timing.

and the peak resident memory against one layer's bytes. Prints a table; ``--append`` adds it to
the results file with the date and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

LAYERS, E, H, I, G = 48, 128, 2048, 768, 128
HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4, 128, 151936
SHARD_BYTES = 4 * 1000**3
_ST_DTYPES = {np.dtype(np.int32): "I32", np.dtype(np.float16): "F16"}


# --------------------------------------------------------------------------- synthesis
class _Pool:
    """Random bytes to slice tensors from: distinct data per tensor, cheap to make."""

    def __init__(self, rng: np.random.Generator, nbytes: int = 64 << 20):
        import ml_dtypes

        self.words = rng.integers(-2**31, 2**31, nbytes // 4, dtype=np.int64).astype(np.int32)
        small = rng.random(1 << 20, dtype=np.float32) * 0.01 + 1e-3
        self.scales = {np.dtype(np.float16): small.astype(np.float16),
                       np.dtype(ml_dtypes.bfloat16): small.astype(ml_dtypes.bfloat16)}
        self.rng = rng

    def int32(self, shape) -> np.ndarray:
        n = int(np.prod(shape))
        start = int(self.rng.integers(0, self.words.size - n)) if n < self.words.size else 0
        return self.words[start:start + n].reshape(shape)

    def floats(self, shape, dtype=np.float16) -> np.ndarray:
        pool = self.scales[np.dtype(dtype)]
        start = int(self.rng.integers(0, pool.size))
        return np.resize(np.roll(pool, -start), shape)


def _gptq_linear(pool: _Pool, prefix: str, k: int, n: int) -> list[tuple[str, np.ndarray]]:
    """One symmetric GPTQ v1 linear ``[n, k]``: qweight, qzeros (implicit 8 stored as 7), scales, g_idx."""
    return [(f"{prefix}.qweight", pool.int32((k // 8, n))),
            (f"{prefix}.qzeros", np.full((k // G, n // 8), 0x77777777, np.int32)),
            (f"{prefix}.scales", pool.floats((k // G, n))),
            (f"{prefix}.g_idx", (np.arange(k) // G).astype(np.int32))]


def _layer_tensors(pool: _Pool, li: int, bf16) -> list[tuple[str, np.ndarray]]:
    p = f"model.layers.{li}"
    out = []
    for proj, (k, n) in (("q_proj", (H, HEADS * HEAD_DIM)), ("k_proj", (H, KV_HEADS * HEAD_DIM)),
                         ("v_proj", (H, KV_HEADS * HEAD_DIM)), ("o_proj", (HEADS * HEAD_DIM, H))):
        out += _gptq_linear(pool, f"{p}.self_attn.{proj}", k, n)
    out += [(f"{p}.self_attn.q_norm.weight", np.ones(HEAD_DIM, bf16)),
            (f"{p}.self_attn.k_norm.weight", np.ones(HEAD_DIM, bf16)),
            (f"{p}.input_layernorm.weight", np.ones(H, bf16)),
            (f"{p}.post_attention_layernorm.weight", np.ones(H, bf16)),
            (f"{p}.mlp.gate.weight", pool.floats((E, H), bf16))]
    for e in range(E):
        for proj, (k, n) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
            out += _gptq_linear(pool, f"{p}.mlp.experts.{e}.{proj}", k, n)
    return out


class _ShardWriter:
    """Streams tensors into ``model-XXXXX.safetensors`` shards of at most ``SHARD_BYTES``."""

    def __init__(self, path: str):
        self.path, self.pending, self.size, self.shards, self.weight_map = path, [], 0, [], {}

    def add(self, name: str, a: np.ndarray) -> None:
        if self.pending and self.size + a.nbytes > SHARD_BYTES:
            self.flush()
        self.pending.append((name, np.ascontiguousarray(a)))
        self.size += a.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        fname = f"model-{len(self.shards) + 1:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, a in self.pending:
            dt = "BF16" if a.dtype.name == "bfloat16" else _ST_DTYPES[a.dtype]
            header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
            off += a.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(self.path, fname), "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name, a in self.pending:
                f.write(memoryview(a.reshape(-1).view(np.uint8)))
                self.weight_map[name] = fname
        self.shards.append(fname)
        self.pending, self.size = [], 0

    def close(self) -> None:
        self.flush()
        n = len(self.shards)
        renamed = {}
        for i, fname in enumerate(self.shards):           # the usual -XXXXX-of-YYYYY names
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.path, fname), os.path.join(self.path, final))
            renamed[fname] = final
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {k: renamed[v] for k, v in self.weight_map.items()}}, f)


def synthesize(path: str, layers: int) -> None:
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    os.makedirs(path, exist_ok=True)
    pool = _Pool(np.random.default_rng(0))
    w = _ShardWriter(path)
    w.add("model.embed_tokens.weight", pool.floats((VOCAB, H), bf16))
    for li in range(layers):
        for name, a in _layer_tensors(pool, li, bf16):
            w.add(name, a)
    w.add("model.norm.weight", np.ones(H, bf16))
    w.add("lm_head.weight", pool.floats((VOCAB, H), bf16))
    w.close()
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
           "intermediate_size": 6144, "moe_intermediate_size": I, "num_experts": E,
           "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": layers,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "vocab_size": VOCAB, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": G,
                                   "desc_act": False, "sym": True, "checkpoint_format": "gptq"}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


# --------------------------------------------------------------------------- measuring
def shard_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def evict(files: list[str]) -> None:
    """Drop the files' pages from the page cache, so the next read comes from the disk."""
    for fn in files:
        fd = os.open(fn, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024**2
    return float("nan")


class PeakRSS:
    def __init__(self):
        self.peak, self._stop = rss_gib(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_gib())
            time.sleep(0.02)

    def reset(self) -> None:
        self.peak = rss_gib()

    def stop(self) -> float:
        self._stop.set()
        return self.peak


class Timer:
    """Accumulates the wall time spent inside a wrapped method."""

    def __init__(self, owner, name: str):
        self.total, self.owner, self.name = 0.0, owner, name
        self.orig = getattr(owner, name)
        timer = self

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return timer.orig(*a, **k)
            finally:
                timer.total += time.perf_counter() - t0
        setattr(owner, name, wrapped)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.orig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--convert-layers", type=int, default=None,
                    help="how many loaded layers to convert to MARLIN (default: all)")
    ap.add_argument("--append", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the synthesized checkpoint")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers must be positive, got {args.layers}")
    convert_layers = args.layers if args.convert_layers is None else args.convert_layers

    src = os.path.join(args.workdir, f"qwen3-30b-a3b-gptq-{args.layers}l")
    t0 = time.time()
    if not os.path.isfile(os.path.join(src, "config.json")):
        shutil.rmtree(src, ignore_errors=True)
        synthesize(src, args.layers)
    files = shard_files(src)
    total = sum(os.path.getsize(f) for f in files)
    print(f"checkpoint: {total / 1e9:.2f} GB in {len(files)} shards ({time.time() - t0:.0f} s to "
          f"synthesize or find)", flush=True)

    from wna16_jax import checkpoint as ckmod, formats
    from wna16_jax.backends import TABLE, Backend
    from wna16_jax.safetensors_io import SafetensorsFile

    evict(files)
    t0 = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    t_cat = time.perf_counter() - t0
    print(f"cat to /dev/null: {t_cat:.1f} s ({total / t_cat / 1e9:.2f} GB/s)", flush=True)

    evict(files)
    peak = PeakRSS()
    base_rss = rss_gib()
    t0 = time.perf_counter()
    index_timer = Timer(ckmod, "_index_names")
    ckpt = ckmod.Checkpoint(src)
    t_open = time.perf_counter() - t0
    t_index = index_timer.total
    index_timer.restore()
    names = len(ckpt.tensor_names())
    print(f"open: {t_open * 1e3:.0f} ms ({names} tensor names; name index {t_index * 1e3:.0f} ms)", flush=True)

    reads = Timer(SafetensorsFile, "read_into")          # every tensor read goes through it
    headers = Timer(ckmod, "_check_headers")
    value_timers = [Timer(formats, "check_values")]
    copies = Timer(ckmod, "_place")        # gate / up halves into the w13 stacks
    layer_bytes = 0
    per_layer, rest, checks = [], [], []        # per layer: wall time, its remainder, its value checks
    t0 = time.perf_counter()
    for li in ckpt.moe_layer_indices:
        before = (reads.total, copies.total, value_timers[0].total)
        t1 = time.perf_counter()
        layer = ckpt.load_layer(li)
        per_layer.append(time.perf_counter() - t1)
        d_reads, d_copies, d_checks = (now - was for now, was in zip((reads.total, copies.total, value_timers[0].total),
                                                                     before))
        rest.append(per_layer[-1] - d_reads - d_copies - d_checks)
        checks.append(d_checks)
        layer_bytes = max(layer_bytes, sum(getattr(layer.experts, f).nbytes for f in layer.experts.array_fields()
                                            if getattr(layer.experts, f) is not None) + layer.router.nbytes)
        del layer
    t_load = time.perf_counter() - t0
    for t in (reads, headers, copies, *value_timers):
        t.restore()
    t_values = sum(t.total for t in value_timers)
    load_peak = peak.peak
    moe_bytes = sum(ckpt.tensor_info(n).end - ckpt.tensor_info(n).begin for n in ckpt.tensor_names()
                    if ".mlp." in n)
    name_ms = (t_load - reads.total - t_values - copies.total) / len(per_layer) * 1e3
    # medians over the layers: on a 2-core machine the kernel's read-ahead work preempts the loader
    # now and then, and charges a layer's Python work with it
    name_med = statistics.median(rest) * 1e3
    checks_med = statistics.median(checks)
    print(f"load {len(per_layer)} MoE layers: {t_load:.1f} s ({moe_bytes / t_load / 1e9:.2f} GB/s of "
          f"MoE tensors); reads {reads.total:.1f} s, header/name phase {headers.total * 1e3:.0f} ms, "
          f"value checks {t_values:.2f} s; peak RSS {load_peak:.2f} GiB", flush=True)

    t_conv = float("nan")
    if convert_layers:
        import jax

        peak.reset()
        spec = TABLE[Backend.MARLIN]
        t_conv = 0.0
        for n, li in enumerate(ckpt.moe_layer_indices[:convert_layers]):
            layer = ckpt.load_layer(li).experts.to_jax()
            t1 = time.perf_counter()
            jax.block_until_ready(spec.convert(ckpt.scheme, layer))
            dt = time.perf_counter() - t1
            if n == 0:
                print(f"convert layer {li} to MARLIN (compiles once): {dt:.1f} s", flush=True)
            else:
                t_conv += dt
            del layer
        t_conv = t_conv / max(convert_layers - 1, 1) * convert_layers
    conv_peak = peak.stop()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2

    ratio = t_load / t_cat
    rows = [
        ("checkpoint", f"{args.layers} layers × {E} experts (H={H}, I={I}), GPTQ 4-bit g{G}: "
                       f"{total / 1e9:.2f} GB in {len(files)} shards, {names} tensor names"),
        ("`cat` every shard to /dev/null (cold cache)", f"{t_cat:.1f} s ({total / t_cat / 1e9:.2f} GB/s)"),
        ("open (config, index, shard headers, name index)", f"{t_open * 1e3:.0f} ms (name index {t_index * 1e3:.0f} ms)"),
        ("load every MoE layer (cold cache)", f"{t_load:.1f} s = {ratio:.2f}× the `cat` time "
                                              f"(the MoE tensors are {moe_bytes / total:.0%} of the bytes)"),
        ("  of which reading tensors", f"{reads.total:.1f} s"),
        ("  copying gate / up halves into the w13 stacks", f"{copies.total:.1f} s"),
        ("  name handling per layer: the rest (name lookups, header checks, read plans, allocation)",
         f"median {name_med:.1f} ms, mean {name_ms:.1f} ms (header checks {headers.total / len(per_layer) * 1e3:.1f} ms; "
         f"the name index at open {t_index / len(per_layer) * 1e3:.1f} ms per layer)"),
        ("  value checks (finite scales, g_idx, zero points)",
         f"{t_values:.2f} s = {t_values / t_load:.1%} of the load (median per layer {checks_med * 1e3:.1f} ms, "
         f"{checks_med * len(per_layer) / t_load:.1%})"),
        ("convert every layer to MARLIN (CPU, jitted; load excluded)",
         f"{t_conv:.0f} s ({t_conv / max(convert_layers, 1):.2f} s/layer)" if convert_layers else "not run"),
        ("peak RSS while loading / converting", f"{load_peak:.2f} / {conv_peak:.2f} GiB (max RSS {maxrss:.2f}; "
                                                f"one layer = {layer_bytes / 1024**3:.2f} GiB, "
                                                f"before loading {base_rss:.2f})"),
    ]
    table = "| what | measured |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    print(table, flush=True)
    if args.append:
        cmd = " ".join(["python", "benchmarks/load_scale.py", *(argv if argv is not None else sys.argv[1:])])
        with open(args.append, "a") as f:
            f.write(f"\n## Loading a Qwen3-30B-A3B-shaped checkpoint, {datetime.date.today()} "
                    f"({os.cpu_count()} CPU cores)\n\nCommand: `{cmd}`\n\n{table}\n")
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
