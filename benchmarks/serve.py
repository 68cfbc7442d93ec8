"""Serving benchmark: N concurrent requests through the scheduler and a paged ModelEngine (no HTTP).

The script writes a random GPTQ 4-bit g128 checkpoint of a model shape (``benchmarks/generate.py``'s
:data:`~benchmarks.generate.SHAPES`), loads it, makes a :class:`~wna16_jax.serving.model_engine.ModelEngine`,
compiles every program once (``ModelEngine.warm_up``: each prefill chunk size and decode batch
size at each table width; the compile time is reported apart), then adds ``--requests`` requests of ``--prompt`` random tokens and
``--new`` new tokens at once and steps the :class:`~wna16_jax.serving.scheduler.Scheduler` until
all are done. It prints one table row:

* tokens/s: generated tokens over the run's wall time (prefill included);
* decode step: the median time of the steps that only decoded (no prefill chunk), each synced
  by reading its tokens back, with the median number of rows they ran;
* floor: the weight bytes such a step touches (``benchmarks/generate.py``'s
  :func:`~benchmarks.generate.touched_bytes` for the step's rows) at ``--bandwidth`` B/s (or the
  bandwidth of a device copy measured in the same run with ``--measure-bandwidth``), and step /
  floor. The KV bytes a step reads through its tables (every row the table width of the step's
  longest row, as the XLA gather path reads; the GPU's paged kernel reads each row's own blocks,
  at most that) are listed apart, not in the floor;
* latency: p50 / p99 of each request's time from the start to its last token, and p50 of the
  time to its first token; the preemptions and the pool's size.

GPU (one H100 or H200; say which): ``PYTHONPATH=$PWD python3 benchmarks/serve.py --model qwen3
--requests 64 --prompt 512 --new 128 --measure-bandwidth``.

``--mix`` replays a request mix instead: ``--requests`` requests with prompt and output lengths
uniform in ``--prompt-range`` / ``--new-range``, Poisson arrivals at ``--rate`` per second, at
most ``--streams`` in flight (each count in turn, the same requests), through the scheduler (no
HTTP: the server's own overhead is not in these numbers). Each row gives output tokens/s (and its
ratio to the static ``Generator`` batch of ``--static-batch`` on prompts and outputs of the mean
lengths, measured first in the same run), time to first token and time per output token (p50 /
p99) and the p99 TPOT over the static batch's decode step; the last line says whether the goal at
``--static-batch`` streams holds (tokens/s at least 0.8 of the static batch's, p99 TPOT under 2
static steps). ``--via`` picks what the mix is replayed through, each a row per streams count:
``scheduler`` (no HTTP: the scheduler stepped in this process) and ``http`` (the
OpenAI-compatible server of :func:`wna16_jax.serving.server.create_app` on a loopback port,
driven by the official ``openai`` client from a separate process, streaming completions of token-id
prompts; time to first token and per output token are measured at the client from the streamed
chunks, the output token counts from ``usage``). The goal line is the server's where it ran. For
``http`` the random checkpoint gets a word-level tokenizer of one word per id (every sampled id
streams as text). GPU: ``PYTHONPATH=$PWD python3 benchmarks/serve.py --model qwen3 --mix --requests 96``
(and ``--model mixtral``).
CPU smoke run: ``python3 benchmarks/serve.py --tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.generate import SHAPES, measure_bandwidth, touched_bytes, write_shape_model  # noqa: E402
from wna16_jax.models import load_model  # noqa: E402
from wna16_jax.serving.engine import SamplingParams  # noqa: E402
from wna16_jax.serving.model_engine import ModelEngine  # noqa: E402
from wna16_jax.serving.scheduler import Scheduler  # noqa: E402

#: what ``--tiny`` sets (a CPU smoke run of a few seconds)
TINY = dict(model="tiny", layers=1, requests=4, prompt=20, new=8, block_size=8, batch_sizes=[1, 2],
            chunk_sizes=[16], dtype="float32")

#: what ``--tiny --mix`` adds
TINY_MIX = dict(streams=[1, 2], requests=5, rate=0.0, prompt_range=[4, 20], new_range=[2, 8], static_batch=2)

HEADER = ("| model | requests | prompt | new | tokens/s | decode step ms | rows | floor ms | step / floor "
          "| KV MiB / step | p50 latency s | p99 latency s | p50 first token s | preemptions | pool MiB | compile s |")


class TimedEngine:
    """``engine`` with its decode calls timed (each syncs: its tokens are read back) and marked
    by whether a prefill chunk ran in the same scheduler step."""

    def __init__(self, engine: ModelEngine):
        self.engine = engine
        self.decodes: list[tuple[float, int, int, bool]] = []      # (seconds, real rows, KV bytes, pure)
        self._prefilled = False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, *args):
        self._prefilled = True
        return self.engine.prefill(*args)

    def decode(self, tokens, positions, block_tables, sampling, steps):
        rows = int((block_tables[:, 0] >= self.engine.reserved_blocks).sum())
        width = self.engine.table_width(int(positions.max()) // self.engine.block_size + 1)
        kv = len(tokens) * width * self.engine.bytes_per_block
        t0 = time.perf_counter()
        out = self.engine.decode(tokens, positions, block_tables, sampling, steps)
        self.decodes.append((time.perf_counter() - t0, rows, kv, not self._prefilled))
        self._prefilled = False
        return out


def compile_all(engine: ModelEngine) -> float:
    """Compile every program the run can use (:meth:`ModelEngine.warm_up`); returns the seconds."""
    t0 = time.perf_counter()
    engine.warm_up()
    return time.perf_counter() - t0


def run(engine: ModelEngine, *, requests: int, prompt: int, new: int, temperature: float, seed: int = 0) -> dict:
    """Serve ``requests`` requests added at once; the measurements of the run."""
    rng = np.random.default_rng(seed)
    timed = TimedEngine(engine)
    scheduler = Scheduler(timed)
    sampling = SamplingParams(temperature=temperature, max_tokens=new, seed=seed)
    t0 = time.perf_counter()
    for i in range(requests):
        scheduler.add(f"r{i}", rng.integers(3, engine.vocab_size, prompt).tolist(), sampling)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while scheduler.has_work:
        for event in scheduler.step():
            now = time.perf_counter() - t0
            first.setdefault(event.request_id, now)
            if event.finish_reason is not None:
                done[event.request_id] = now
    wall = time.perf_counter() - t0
    pure = [d for d in timed.decodes if d[3]] or timed.decodes
    latency = np.asarray(sorted(done.values()))
    return {"tokens_s": scheduler.generated_tokens / wall, "step_s": statistics.median(d[0] for d in pure),
            "rows": int(statistics.median(d[1] for d in pure)), "kv_bytes": statistics.median(d[2] for d in pure),
            "p50": float(np.percentile(latency, 50)), "p99": float(np.percentile(latency, 99)),
            "first_p50": float(np.median(list(first.values()))), "preemptions": scheduler.preemptions}


def mix_requests(vocab: int, n: int, prompt_range, new_range, rate: float, seed: int):
    """``n`` requests of a mix: prompt and output lengths uniform in their ``(low, high)`` ranges,
    arrival times of a Poisson process of ``rate`` requests / s (0: all at time 0)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
               for _ in range(n)]
    news = [int(rng.integers(new_range[0], new_range[1] + 1)) for _ in range(n)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    return prompts, news, arrivals


def run_mix(engine: ModelEngine, requests, *, concurrency: int, temperature: float) -> dict:
    """Replay ``requests`` (:func:`mix_requests`) through the scheduler, at most ``concurrency``
    in flight (a request waits for its arrival time and a free stream). Time to first token is
    from when a request is sent; time per output token is a request's (last - first token) over
    its tokens after the first."""
    prompts, news, arrivals = requests
    scheduler = Scheduler(engine)
    waiting, in_flight = list(range(len(prompts))), set()
    sent, first, last, count = {}, {}, {}, {}
    t0 = time.perf_counter()
    while waiting or scheduler.has_work:
        now = time.perf_counter() - t0
        while waiting and len(in_flight) < concurrency and arrivals[waiting[0]] <= now:
            i = waiting.pop(0)
            scheduler.add(f"r{i}", prompts[i], SamplingParams(temperature=temperature, max_tokens=news[i], seed=i))
            in_flight.add(i)
            sent[i], count[i] = now, 0
        if not scheduler.has_work:
            time.sleep(max(0.0, min(arrivals[waiting[0]] - now, 0.05)))
            continue
        for event in scheduler.step():
            t, i = time.perf_counter() - t0, int(event.request_id[1:])
            first.setdefault(i, t)
            last[i], count[i] = t, count[i] + 1
            if event.finish_reason is not None:
                in_flight.discard(i)
    wall = time.perf_counter() - t0
    ttft = np.asarray([first[i] - sent[i] for i in first])
    tpot = np.asarray([(last[i] - first[i]) / (count[i] - 1) for i in first if count[i] > 1] or [np.nan])
    return {"tokens_s": sum(count.values()) / wall, "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p99": float(np.percentile(ttft, 99)), "tpot_p50": float(np.percentile(tpot, 50)),
            "tpot_p99": float(np.percentile(tpot, 99)), "preemptions": scheduler.preemptions,
            "finished": len(first)}


def static_generator(model, batch: int, prompt: int, new: int, max_len: int, seed: int = 0) -> dict:
    """The static batch the server is compared with: ``Generator(batch_size=batch)`` on ``batch``
    random prompts of ``prompt`` tokens, ``new`` tokens each (no stop token), compiled first;
    ``step_s``: one decode step, from the difference of the median of 3 runs of ``new`` tokens and
    that of 3 runs of 2 tokens."""
    from wna16_jax.models.generation import Generator

    rng = np.random.default_rng(seed)
    gen = Generator(model, batch_size=batch, max_len=max_len)
    prompts = [rng.integers(3, model.config.vocab_size, prompt).tolist() for _ in range(batch)]

    def timed(n):
        t = time.perf_counter()
        gen.generate(prompts, n, stop_tokens=())
        return time.perf_counter() - t

    timed(2)                                         # compiles the prefill bucket and the decode step
    short = statistics.median(timed(2) for _ in range(3))
    full = statistics.median(timed(new) for _ in range(3))
    return {"tokens_s": batch * new / full, "step_s": (full - short) / max(1, new - 2)}


def word_tokenizer(folder: str, vocab: int) -> str:
    """Write a tokenizer of ``vocab`` words ``w0 … w{vocab-1}`` (word-level: one id per word, the
    text of ids the words joined by spaces) into ``folder`` (made), so that every id a random model
    samples streams as text; returns ``folder``."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    tok = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return folder


async def _client_mix(spec: dict) -> dict:
    """The client side of :func:`run_http` (in its own process): every request of ``spec`` sent at
    its arrival time, at most ``concurrency`` in flight, each streamed; per request the times
    (from the start) it was sent, of its first and last text chunk, and its output token count."""
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=spec["base_url"], api_key="unused", max_retries=0, timeout=spec["timeout"])
    gate = asyncio.Semaphore(spec["concurrency"])
    t0 = time.perf_counter()
    out: dict[int, dict] = {}

    async def one(i: int, prompt: list, new: int, arrival: float) -> None:
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - t0)))
        async with gate:
            r = out[i] = {"sent": time.perf_counter() - t0, "first": None, "last": None, "tokens": 0}
            stream = await client.completions.create(
                model=spec["model"], prompt=prompt, max_tokens=new, temperature=spec["temperature"], seed=i,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                t = time.perf_counter() - t0
                if chunk.choices and chunk.choices[0].text:
                    r["first"] = r["first"] if r["first"] is not None else t
                    r["last"] = t
                if chunk.usage is not None:
                    r["tokens"] = chunk.usage.completion_tokens

    await asyncio.gather(*(one(i, p, n, a) for i, (p, n, a) in
                           enumerate(zip(spec["prompts"], spec["news"], spec["arrivals"]))))
    await client.close()
    return {"wall": time.perf_counter() - t0, "requests": out}


def run_http(base_url: str, model_name: str, requests, *, concurrency: int, temperature: float,
             timeout: float = 600.0) -> dict:
    """Replay ``requests`` (:func:`mix_requests`) against the server at ``base_url`` from a client
    process of its own (its work does not share this process's interpreter with the server's); the
    measurements of :func:`run_mix`, taken at the client."""
    import subprocess

    prompts, news, arrivals = requests
    spec = {"base_url": base_url, "model": model_name, "concurrency": concurrency, "temperature": temperature,
            "timeout": timeout, "prompts": prompts, "news": news, "arrivals": [float(a) for a in arrivals]}
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "spec.json"), os.path.join(d, "out.json")
        with open(src, "w") as f:
            json.dump(spec, f)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--http-client", src, dst], check=True,
                       timeout=timeout + 60)
        with open(dst) as f:
            got = json.load(f)
    rs = [r for r in got["requests"].values() if r["first"] is not None]
    ttft = np.asarray([r["first"] - r["sent"] for r in rs] or [np.nan])
    tpot = np.asarray([(r["last"] - r["first"]) / (r["tokens"] - 1) for r in rs if r["tokens"] > 1] or [np.nan])
    return {"tokens_s": sum(r["tokens"] for r in got["requests"].values()) / got["wall"],
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": float(np.percentile(tpot, 99)),
            "preemptions": None, "finished": len(rs)}


MIX_HEADER = ("| model | via | streams | requests | rate /s | tokens/s | vs static | TTFT p50 s | TTFT p99 s "
              "| TPOT p50 ms | TPOT p99 ms | TPOT p99 / static step | preemptions |")


def mix_row(label: str, via: str, streams: int, args, r: dict, static: dict) -> str:
    pre = "–" if r["preemptions"] is None else r["preemptions"]
    return (f"| {label} | {via} | {streams} | {args.requests} | {args.rate:g} | {r['tokens_s']:.1f} | "
            f"{r['tokens_s'] / static['tokens_s']:.2f} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | "
            f"{r['tpot_p50'] * 1e3:.2f} | {r['tpot_p99'] * 1e3:.2f} | {r['tpot_p99'] / static['step_s']:.2f} | "
            f"{pre} |")


def main_mix(args, model, engine: ModelEngine, label: str, max_len: int, tokenizer=None) -> int:
    """``--mix``: the request mix at each ``--streams`` count beside the static Generator batch."""
    prompt = (args.prompt_range[0] + args.prompt_range[1]) // 2
    new = (args.new_range[0] + args.new_range[1]) // 2
    static = static_generator(model, args.static_batch, prompt, new, max_len)
    print(f"# static Generator, batch {args.static_batch}, prompt {prompt}, {new} new tokens: "
          f"{static['tokens_s']:.1f} tokens/s, decode step {static['step_s'] * 1e3:.2f} ms", flush=True)
    requests = mix_requests(engine.vocab_size, args.requests, args.prompt_range, args.new_range, args.rate, 0)
    lines = [MIX_HEADER, "|" + "|".join("---" for _ in MIX_HEADER.split("|")[1:-1]) + "|"]
    results = {}
    server = None
    if "http" in args.via:
        from wna16_jax.serving.server import BackgroundServer, create_app

        server = BackgroundServer(create_app(engine, tokenizer, "bench", max_queue=max(256, args.requests)),
                                  deadline=60).start()
    try:
        for streams in args.streams:
            for via in args.via:
                if via == "http":
                    r = run_http(server.base_url, "bench", requests, concurrency=streams, temperature=args.temperature)
                else:
                    r = run_mix(engine, requests, concurrency=streams, temperature=args.temperature)
                if r["finished"] != args.requests:
                    raise SystemExit(f"{r['finished']} of {args.requests} requests finished at {streams} streams "
                                     f"({via})")
                results[via, streams] = r
                lines.append(mix_row(label, via, streams, args, r, static))
                print(lines[-1], flush=True)
    finally:
        if server is not None:
            server.stop()
    print("\n".join(lines), flush=True)
    via = "http" if "http" in args.via else args.via[0]
    if (via, args.static_batch) in results:
        r = results[via, args.static_batch]
        ok = r["tokens_s"] >= 0.8 * static["tokens_s"] and r["tpot_p99"] < 2 * static["step_s"]
        print(f"goal at {args.static_batch} streams through the {via} (tokens/s >= 0.8 x static, TPOT p99 < 2 x "
              f"static step): {'met' if ok else 'not met'}", flush=True)
    return 0


def row_md(label: str, args, r: dict, floor_s: float, pool_bytes: int, compile_s: float) -> str:
    return (f"| {label} | {args.requests} | {args.prompt} | {args.new} | {r['tokens_s']:.1f} | "
            f"{r['step_s'] * 1e3:.2f} | {r['rows']} | {floor_s * 1e3:.3f} | {r['step_s'] / floor_s:.2f} | "
            f"{r['kv_bytes'] / 2**20:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['first_p50']:.2f} | "
            f"{r['preemptions']} | {pool_bytes / 2**20:,.0f} | {compile_s:.0f} |")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help=f"a CPU smoke run: {TINY}")
    ap.add_argument("--model", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="None: from the device's free memory")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="None: --prompt + --new rounded up to a block")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="B/s for the floor (default H200's 4.3e12)")
    ap.add_argument("--measure-bandwidth", action="store_true", help="use a device copy's bandwidth instead")
    ap.add_argument("--unrolled", action="store_true", help="load_model(scan_layers=False)")
    ap.add_argument("--workdir", default=None, help="where the random checkpoint goes (default: a temp folder)")
    ap.add_argument("--mix", action="store_true",
                    help="replay a request mix (Poisson arrivals, mixed lengths) at each --streams count, "
                         "beside the static Generator batch of --static-batch")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="--mix: requests in flight at most")
    ap.add_argument("--rate", type=float, default=16.0, help="--mix: Poisson arrivals per second (0: all at once)")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 1024], help="--mix: prompt lengths")
    ap.add_argument("--new-range", type=int, nargs=2, default=[32, 256], help="--mix: output lengths")
    ap.add_argument("--static-batch", type=int, default=32, help="--mix: the static Generator's batch")
    ap.add_argument("--via", nargs="+", default=["scheduler", "http"], choices=["scheduler", "http"],
                    help="--mix: replay through the scheduler in this process and / or the HTTP server")
    ap.add_argument("--http-client", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.http_client:                          # run_http's client process
        import asyncio

        with open(args.http_client[0]) as f:
            spec = json.load(f)
        with open(args.http_client[1], "w") as f:
            json.dump(asyncio.run(_client_mix(spec)), f)
        return 0
    if args.tiny:
        for k, v in {**TINY, **(TINY_MIX if args.mix else {})}.items():
            setattr(args, k, v)
    bs = args.block_size
    longest = args.prompt_range[1] + args.new_range[1] if args.mix else args.prompt + args.new
    max_len = args.max_model_len or -(-longest // bs) * bs
    bandwidth = measure_bandwidth() if args.measure_bandwidth else args.bandwidth
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; floor at "
          f"{bandwidth:.3g} B/s{' (measured)' if args.measure_bandwidth else ''}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        path, label = write_shape_model(tmp, args.model, args.layers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = load_model(path, dtype=jnp.dtype(args.dtype), scan_layers=False if args.unrolled else None)
        tokenizer = None
        if args.mix and "http" in args.via:
            from wna16_jax.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(word_tokenizer(os.path.join(tmp, "words"), model.config.vocab_size))
    engine = ModelEngine(model, block_size=bs, num_blocks=args.num_blocks, max_model_len=max_len,
                         batch_sizes=args.batch_sizes, chunk_sizes=args.chunk_sizes)
    print(f"# {label}: {engine!r}", flush=True)
    compile_s = compile_all(engine)
    if args.mix:
        print(f"# compiled the serving programs in {compile_s:.0f} s", flush=True)
        return main_mix(args, model, engine, label, max_len, tokenizer)
    r = run(engine, requests=args.requests, prompt=args.prompt, new=args.new, temperature=args.temperature)
    floor_s = touched_bytes(model, r["rows"]) / bandwidth
    print("\n".join([HEADER, "|" + "|".join("---" for _ in HEADER.split("|")[1:-1]) + "|",
                     row_md(label, args, r, floor_s, engine.pool_bytes, compile_s)]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
