"""What each process of a multi-process mesh reads and holds while it loads a model.

The script writes a random GPTQ 4-bit g128 checkpoint of a shape (``benchmarks/generate.py``'s
:data:`~benchmarks.generate.SHAPES` or ``benchmarks/model_sharding.py``'s large ones), then starts
``--processes`` processes of ``--devices`` CPU devices each on 127.0.0.1
(``jax.distributed.initialize``, JAX's CPU collectives); each loads the checkpoint with
``load_model(DIR, mesh=...)`` on one global mesh of all their devices (``--mesh``: ``epN``,
``tpN`` or ``epNxtpM``; ``--tp-across``: the tp axis spans the processes, each holding whole tp
ranks, instead of lying inside each process) and reports, per process:

* read: the bytes of tensor data it read (every positioned read counted), against the
  checkpoint's bytes;
* share: the bytes of the parts of the model's arrays its devices hold (each distinct shard
  once: a replicated array counts once);
* host peak: the most memory the load's host arrays (numpy, Python: ``tracemalloc``, which
  does not see the runtime's device buffers) held at once, what a GPU host pays; the goal is the
  share plus about one layer (the checkpoint's largest, listed);
* RSS: the process's peak resident memory during the load (``VmHWM``) and after it, less its
  resident memory just before. On CPU devices the device buffers are host memory too, so these
  hold the placed arrays (a replicated one once per device) beside the host arrays.

CPU (the host's cores; not a timing):
``python3 benchmarks/host_memory.py --model qwen3_235b --layers 2 --mesh ep8``; a smoke run:
``--tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: what ``--tiny`` sets
TINY = dict(model="tiny", layers=2, mesh="ep4", processes=2, devices=2)

HEADER = ("| model | mesh | process | read MiB | of checkpoint | share MiB | host peak MiB | largest layer MiB "
          "| host peak / (share + layer) | RSS peak MiB | RSS after MiB |")


def _status_kib(field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of /proc/self/status, KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field} (this script needs Linux)")


def _reset_peak() -> None:
    """Reset VmHWM to the current resident size (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(pid: int, port: str, spec: dict) -> dict:
    """One process: initialize, build the mesh, load, measure (see the module doc)."""
    import warnings

    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=spec["processes"],
                               process_id=pid, initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    from wna16_jax import safetensors_io
    from wna16_jax.models import load_model

    ep, tp = spec["ep"], spec["tp"]
    devs = np.array(jax.devices())
    if ep * tp != len(devs):
        raise SystemExit(f"--mesh: {ep} x {tp} devices, the processes have {len(devs)}")
    grid = devs.reshape(tp, ep).T if spec["tp_across"] else devs.reshape(ep, tp)
    axes = [(n, s) for n, s in (("ep", ep), ("tp", tp)) if s > 1]
    mesh = Mesh(grid.reshape([s for _, s in axes]), tuple(n for n, _ in axes))
    read_fully, seen = safetensors_io._read_fully, [0]

    def counted(fd, buf, pos, path, name):
        seen[0] += len(buf)
        return read_fully(fd, buf, pos, path, name)

    safetensors_io._read_fully = counted
    jax.numpy.zeros(1).block_until_ready()          # the runtime's own memory before the baseline
    before = _status_kib("VmRSS")
    _reset_peak()
    tracemalloc.start()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(spec["path"], dtype=jnp.bfloat16, mesh=mesh)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    host_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    share = 0
    for a in jax.tree.leaves(nnx.state(model)):
        held = {}
        for s in getattr(a, "addressable_shards", ()):
            held[tuple((i.start, i.stop) for i in s.index)] = s.data.nbytes
        share += sum(held.values())
    return {"process": pid, "read": seen[0], "share": share, "host_peak": host_peak,
            "peak_growth": (peak - before) * 1024, "after": (after - before) * 1024, "seconds": seconds}


def checkpoint_bytes(path: str) -> tuple[int, int]:
    """``(all tensor bytes, the largest layer's)`` of the checkpoint at ``path``, from its headers."""
    import re

    from wna16_jax.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    total, layers = 0, {}
    for n in ckpt.tensor_names():
        t = ckpt.tensor_info(n)
        total += t.end - t.begin
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if m:
            layers[m[1]] = layers.get(m[1], 0) + t.end - t.begin
    return total, max(layers.values(), default=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(spec: dict, timeout: float) -> list[dict]:
    """Start the processes of ``spec`` (this script with ``--worker``), each printing one JSON
    line; their results by process, or SystemExit with their stderr."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={spec['devices']}"}
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as d:
        files = [(open(os.path.join(d, f"out{i}"), "w+"), open(os.path.join(d, f"err{i}"), "w+"))
                 for i in range(spec["processes"])]
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i), port,
                                   json.dumps(spec)], stdout=o, stderr=e, env=env, text=True)
                 for i, (o, e) in enumerate(files)]
        end = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for o, e in files:
            o.seek(0), e.seek(0)
            texts.append((o.read(), e.read()))
            o.close(), e.close()
    if any(p.returncode for p in procs):
        raise SystemExit(f"exit codes {[p.returncode for p in procs]}; stderr:\n"
                         + "\n----\n".join(e[-3000:] for _, e in texts))
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in texts]


def _parser() -> argparse.ArgumentParser:
    from benchmarks.generate import SHAPES
    from benchmarks.model_sharding import LARGE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help=f"a smoke run: {TINY}")
    ap.add_argument("--model", default="qwen3_235b", choices=sorted(SHAPES) + sorted(LARGE))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mesh", default="ep8", help="epN, tpN or epNxtpM over all the processes' devices")
    ap.add_argument("--tp-across", action="store_true", help="the tp axis spans the processes")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=4, help="CPU devices per process")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds the processes may take")
    ap.add_argument("--workdir", default=None, help="where the random checkpoint goes (default: a temp folder)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1], json.loads(args.worker[2]))), flush=True)
        return 0
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    from benchmarks.generate import LABELS, SHAPES, write_shape_model
    from benchmarks.model_sharding import LARGE, LARGE_LABELS, parse_mesh

    ep, tp = parse_mesh(args.mesh)
    mib = 2 ** 20
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        path, label = write_shape_model(tmp, args.model, args.layers, shape=SHAPES.get(args.model) or LARGE[args.model],
                                        label=LABELS.get(args.model) or LARGE_LABELS[args.model])
        total, layer = checkpoint_bytes(path)
        spec = {"path": path, "ep": ep, "tp": tp, "tp_across": args.tp_across, "processes": args.processes,
                "devices": args.devices}
        results = run_processes(spec, args.timeout)
    mesh = args.mesh + (" (tp across processes)" if args.tp_across and tp > 1 else "")
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in sorted(results, key=lambda r: r["process"]):
        lines.append(f"| {label} | {mesh} | {r['process']} of {args.processes} | {r['read'] / mib:,.0f} | "
                     f"{r['read'] / total:.0%} | {r['share'] / mib:,.0f} | {r['host_peak'] / mib:,.0f} | "
                     f"{layer / mib:,.0f} | {r['host_peak'] / (r['share'] + layer):.2f} | "
                     f"{r['peak_growth'] / mib:,.0f} | {r['after'] / mib:,.0f} |")
    print(f"# checkpoint: {total / mib:,.0f} MiB, its largest layer {layer / mib:,.0f} MiB; "
          f"{args.processes} processes x {args.devices} CPU devices", flush=True)
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
