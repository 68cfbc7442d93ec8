"""Where the time of one jitted call goes, per device kernel (the JAX profiler's trace).

    from benchmarks.kernel_profile import kernel_breakdown, format_breakdown
    print(format_breakdown(kernel_breakdown(fn, args)))

Runs ``fn(*args)`` ``calls`` times under :func:`jax.profiler.trace` (with its Perfetto JSON
export), then sums the durations of the GPU stream events by kernel name, and measures the idle
time between a call's first and last kernel (the gaps where the device waits for the next
launch). Used by ``moe_engine.py --profile`` to split a layer's time into its kernels and XLA
fusions.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

import jax


def kernel_breakdown(fn, args, calls: int = 20, parts: int = 1):
    """``(rows, wall_us, timeline, host)``: rows ``(name, µs per call, launches per call)`` for the
    kernels on the device streams, largest first; ``wall_us`` is the host time per call (dispatch
    included); ``timeline``: :func:`call_timeline` of the device events (None where they do not
    split into ``calls`` equal calls); ``host``: the same rows for the host threads' events (the
    runtime's own spans — nested ones each count — and no Python frames, ``$``-named), whose
    durations the profiler itself inflates: where the host's time goes, not how much. ``parts``:
    each call of ``fn`` runs that many identical steps (a program of ``parts`` layer calls): the
    rows and the timeline are per step."""
    jf = jax.jit(fn)
    jax.block_until_ready(jf(*args))

    def run():
        out = None
        for _ in range(calls):
            out = jf(*args)
        jax.block_until_ready(out)

    return traced_breakdown(run, calls, parts)


def traced_breakdown(run, calls: int, parts: int = 1):
    """:func:`kernel_breakdown`'s result for ``run()``, a function that makes ``calls`` identical
    calls (already compiled and warmed up) and waits for them: for programs that thread state
    from call to call (a decode step whose cache is donated) or that were compiled with options."""
    import time

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
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
    host_tot, host_cnt = collections.Counter(), collections.Counter()
    device = []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu and not str(e.get("name", "$")).startswith("$"):
            host_tot[e["name"]] += float(e.get("dur", 0.0))
            host_cnt[e["name"]] += 1
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        if stream and (e["pid"], e.get("tid")) not in stream:
            continue
        tot[e["name"]] += float(e.get("dur", 0.0))
        cnt[e["name"]] += 1
        device.append((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]))
    steps = calls * parts
    rows = [(name, us / steps, cnt[name] / steps) for name, us in tot.most_common()]
    host = [(name, us / steps, host_cnt[name] / steps) for name, us in host_tot.most_common()]
    timeline = call_timeline(device, calls)
    if timeline is not None and parts > 1:
        timeline = {"span": timeline["span"] / parts, "busy": timeline["busy"] / parts,
                    "idle": timeline["idle"] / parts, "gaps": [(us / parts, a, b) for us, a, b in timeline["gaps"]]}
    return rows, wall / parts, timeline, host


def call_timeline(device, calls: int, top: int = 4):
    """Where a call's device time has holes. ``device``: ``(start µs, duration µs, name)`` of every
    kernel of ``calls`` identical calls. Sorted by start, they are cut into ``calls`` runs of equal
    length; per call: ``span`` (first start to last end), ``busy`` (the union of the kernels'
    intervals), ``idle = span − busy``, and the ``top`` largest gaps between consecutive kernels as
    ``(µs, kernel before, kernel after)``, each averaged over the calls. None if the events do not
    split into equal calls."""
    if not device or calls < 1 or len(device) % calls:
        return None
    device = sorted(device)
    n = len(device) // calls
    span = busy = 0.0
    gaps = collections.defaultdict(float)
    for c in range(calls):
        run = device[c * n:(c + 1) * n]
        end = run[0][0]
        span += max(ts + dur for ts, dur, _ in run) - run[0][0]
        prev = None
        for ts, dur, name in run:
            if ts > end and prev is not None:
                gaps[(prev, name)] += ts - end
            busy += max(0.0, ts + dur - max(ts, end))
            end = max(end, ts + dur)
            prev = name
    largest = sorted(((us / calls, a, b) for (a, b), us in gaps.items()), reverse=True)[:top]
    return {"span": span / calls, "busy": busy / calls, "idle": (span - busy) / calls, "gaps": largest}


def format_breakdown(result, top: int = 12, indent: str = "    ", host_top: int = 10) -> str:
    rows, wall, timeline, host = result
    busy = sum(us for _, us, _ in rows)
    launches = sum(n for _, _, n in rows)
    lines = [f"{indent}device busy {busy:.1f} µs/call in {launches:.0f} kernels; host wall {wall:.1f} µs/call"]
    if timeline is not None:
        lines.append(f"{indent}first kernel to last: {timeline['span']:.1f} µs/call, {timeline['idle']:.1f} of it "
                     f"idle; largest gaps: " + "; ".join(f"{us:.1f} µs {a[:40]} → {b[:40]}"
                                                         for us, a, b in timeline["gaps"]))
    for name, us, n in rows[:top]:
        lines.append(f"{indent}  {us:8.1f} µs  ×{n:g}  {name[:90]}")
    if host:
        lines.append(f"{indent}host spans (profiled, inflated):")
        for name, us, n in host[:host_top]:
            lines.append(f"{indent}  {us:8.1f} µs  ×{n:g}  {name[:90]}")
    return "\n".join(lines)
