"""Where the time of one jitted call goes, per device kernel (the JAX profiler's trace).

    from benchmarks.kernel_profile import kernel_breakdown, format_breakdown
    print(format_breakdown(kernel_breakdown(fn, args)))

Runs ``fn(*args)`` ``calls`` times under :func:`jax.profiler.trace` (with its Perfetto JSON
export), then sums the durations of the GPU stream events by kernel name. Used by
``moe_engine.py --profile`` to split a layer's time into its kernels and XLA fusions.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

import jax


def kernel_breakdown(fn, args, calls: int = 20):
    """``(rows, wall_us)``: rows ``(name, µs per call, launches per call)`` for the kernels on the
    device streams, largest first; ``wall_us`` is the host time per call (dispatch included)."""
    import time

    jf = jax.jit(fn)
    jax.block_until_ready(jf(*args))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            out = None
            for _ in range(calls):
                out = jf(*args)
            jax.block_until_ready(out)
        wall = (time.perf_counter() - t0) / calls * 1e6
        paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError("the profiler wrote no perfetto_trace.json.gz")
        with gzip.open(paths[0]) as f:
            events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {pid for pid, name in procs.items() if "GPU" in name or "gpu" in name}
    stream = {key for key, name in threads.items() if key[0] in gpu and name.lower().startswith("stream")}
    tot, cnt = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        if stream and (e["pid"], e.get("tid")) not in stream:
            continue
        tot[e["name"]] += float(e.get("dur", 0.0))
        cnt[e["name"]] += 1
    rows = [(name, us / calls, cnt[name] / calls) for name, us in tot.most_common()]
    return rows, wall


def format_breakdown(result, top: int = 12, indent: str = "    ") -> str:
    rows, wall = result
    busy = sum(us for _, us, _ in rows)
    launches = sum(n for _, _, n in rows)
    lines = [f"{indent}device busy {busy:.1f} µs/call in {launches:.0f} kernels; host wall {wall:.1f} µs/call"]
    for name, us, n in rows[:top]:
        lines.append(f"{indent}  {us:8.1f} µs  ×{n:g}  {name[:90]}")
    return "\n".join(lines)
