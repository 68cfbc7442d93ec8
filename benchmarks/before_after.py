"""Time the wgmma engine of two source trees against each other, interleaved, on one GPU.

    python3 benchmarks/before_after.py --before DIR --after DIR [--rows qwen3:512,4096 dsv2lite]
        [--reps 40] [--append PATH]

``DIR`` is a source tree (``wna16_jax/``, ``pallas_kernels/``, ``benchmarks/``), e.g. an older
commit unpacked with ``git archive TAG | tar -x -C DIR``. The two trees cannot share one Python
process (they are the same packages), so each tree runs in worker processes with that tree first
on their path, one per layer timed (AWQ, GPTQ): the four build and compile a row's programs at
the same time, then this process asks them for timed runs in turn — one differential pair of the
before tree, one of the after tree, alternating which goes first — so the GPU is never shared
while a run is timed and a drift of its clocks touches both columns alike. Each worker builds the layer exactly as that tree's
``benchmarks/moe_engine.py`` does (same seed, same weights, same routings; W4A16 group 128, AWQ
with zero points and GPTQ symmetric, bf16 activations) and checks its output against a float32
XLA evaluation before timing. µs per layer = median over ``--samples`` pairs of
(time of 2R calls − time of R calls) / R.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ALTS = ("wgmma AWQ", "wgmma GPTQ")


# --------------------------------------------------------------------------- worker (one tree)

def _worker(alt, interpret=False):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from benchmarks import moe_engine as me          # this tree's benchmark module
    try:
        from wna16_jax.convert.wgmma import convert_wgmma
    except ImportError:                              # trees before the kernel redesign
        from pallas_kernels.wgmma_w4a16 import convert_wgmma

    me.INTERPRET = interpret                         # CPU smoke test: the Triton-lowered engine, interpreted
    rng = np.random.default_rng(0)
    built = {}
    weights = {}

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "build":
                key, t, reps = cmd["key"], cmd["tokens"], cmd["reps"]
                _, (e, k, h, i), _ = me.SHAPES[key]
                if key not in weights:
                    weights.clear()
                    built.clear()
                    # both layers' weights drawn, in moe_engine.py's order, so every worker holds
                    # the same data; this worker lays out and times its own
                    drawn = {"wgmma AWQ": me.random_checkpoint_weights(rng, me.AWQ, e, h, i)}
                    drawn["wgmma GPTQ"] = me.random_checkpoint_weights(rng, me.GPTQ, e, h, i)
                    ckpt = drawn.pop(alt)
                    del drawn
                    tl = jax.jit(me.convert_tiles)(ckpt.to_jax())
                    weights[key] = (tl, tl if interpret else jax.jit(convert_wgmma)(tl))
                x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
                routed = [me.routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k,
                                                renormalize=True) for _ in range(reps)]
                tw_all = jnp.stack([r[0] for r in routed])
                ids_all = jnp.stack([r[1] for r in routed])
                t0 = time.perf_counter()
                tl, wg = weights[key]
                fn = me.engine() if interpret else me.engine(kernel="wgmma")
                ref = jax.jit(lambda x, tw, ids, w: me.fused_moe(x, tw, ids, w, compute_dtype=jnp.float32))(
                    x.astype(jnp.float32), tw_all[0], ids_all[0], tl)
                got = jax.jit(fn)(x, tw_all[0], ids_all[0], wg).astype(jnp.float32)
                err = float(jnp.abs(got - ref).max()) / float(jnp.abs(ref).max())
                built[(key, t)] = me.runner(fn, x, tw_all, ids_all, (wg,), reps)
                reply({"ok": True, "err": err, "build_s": time.perf_counter() - t0,
                       "floor_us": me.floor_us(ids_all, h, i, t, k)})
            elif cmd["op"] == "time":
                reply({"ok": True, "s": built[(cmd["key"], cmd["tokens"])]()})
            elif cmd["op"] == "quit":
                return
        except Exception as ex:  # noqa: BLE001 - reported to the parent, which prints it
            reply({"ok": False, "error": f"{type(ex).__name__}: {str(ex)[:400]}"})


# --------------------------------------------------------------------------- parent

class Tree:
    """One worker process: one source tree, one of :data:`ALTS`."""

    def __init__(self, name, path, alt, interpret=False):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path), PYTHONUNBUFFERED="1")
        self.name, self.alt = name, alt
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", alt]
                                     + (["interpret"] if interpret else []), env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} {self.alt} worker exited (rc {self.proc.wait()})")
        return json.loads(line)

    def ask(self, **cmd):
        self.send(**cmd)
        return self.recv()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="source tree timed as 'before'")
    ap.add_argument("--after", default=".", help="source tree timed as 'after' (default: this one)")
    ap.add_argument("--rows", nargs="*", default=["mixtral", "qwen3", "dsv2lite:1,16,64,512,4096"],
                    help="shape[:tokens,...] as in moe_engine.py (default: the 15-row table)")
    ap.add_argument("--reps", type=int, default=40, help="calls per program at ≤ 64 tokens (a quarter beyond)")
    ap.add_argument("--samples", type=int, default=7, help="differential pairs per entry and tree")
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test: the Triton-lowered engine "
                    "in interpret mode instead of the wgmma kernels (use --rows tiny)")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.reps < 1:
        raise SystemExit("--samples and --reps: expected at least 1")
    rows = []
    for spec in args.rows:
        key, _, toks = spec.partition(":")
        defaults = {"tiny": (1, 8), "mixtral": (1, 16, 64, 512, 4096), "qwen3": (1, 16, 64, 512, 4096),
                    "dsv2lite": (1, 16, 64, 512, 4096)}
        if key not in defaults:
            raise SystemExit(f"--rows: unknown shape {key!r} (have {sorted(defaults)})")
        rows += [(key, int(t)) for t in (toks.split(",") if toks else defaults[key])]
    # four workers (two trees × AWQ / GPTQ) compile each row at once; their timed runs take turns
    workers = {(name, alt): Tree(name, path, alt, args.interpret)
               for alt in ALTS for name, path in (("before", args.before), ("after", args.after))}
    header = ("| row | tokens | floor µs | before AWQ µs | after AWQ µs | AWQ after / before | before GPTQ µs "
              "| after GPTQ µs | GPTQ after / before | rel err before / after |")
    lines = [header, "|" + "---|" * 10]
    print(header, flush=True)
    for key, t in rows:
        reps = args.reps if t <= 64 else max(3, args.reps // 4)
        for w in workers.values():                           # all compile at once
            w.send(op="build", key=key, tokens=t, reps=reps)
        built = {kw: w.recv() for kw, w in workers.items()}
        bad = [f"{n} {a}: {b['error']}" for (n, a), b in built.items() if not b["ok"]]
        if bad:
            print(f"# {key} {t}: " + "; ".join(bad), flush=True)
            continue
        samples = {kw: [] for kw in workers}
        for s in range(args.samples):
            for alt in ALTS:
                for name in (("before", "after") if s % 2 == 0 else ("after", "before")):
                    r = workers[(name, alt)].ask(op="time", key=key, tokens=t)
                    if not r["ok"]:
                        raise SystemExit(f"{name} {key} {t} {alt}: {r['error']}")
                    samples[(name, alt)].append(r["s"])
        us = {kw: statistics.median(v) / reps * 1e6 for kw, v in samples.items()}
        errs = " / ".join(f"{max(built[(n, a)]['err'] for a in ALTS):.1e}" for n in ("before", "after"))
        cells = []
        for alt in ALTS:
            b, a = us[("before", alt)], us[("after", alt)]
            cells += [f"{b:.1f}", f"{a:.1f}", f"{a / b:.3f}"]
        floor = built[("after", ALTS[0])]["floor_us"]
        line = f"| {key} | {t} | {floor:.1f} | " + " | ".join(cells) + f" | {errs} |"
        lines.append(line)
        print(line + f"   (build {max(b['build_s'] for b in built.values()):.0f} s)", flush=True)
    for w in workers.values():
        w.send(op="quit")
        w.proc.wait(timeout=60)
    if args.append:
        import jax

        stamp = datetime.date.today().isoformat()
        with open(args.append, "a") as f:
            f.write(f"\n## Before / after, {stamp} ({jax.devices()[0].device_kind})\n\n"
                    f"`python3 benchmarks/before_after.py {' '.join(argv or sys.argv[1:])}`\n\n"
                    + "\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], interpret=sys.argv[3:] == ["interpret"])
    else:
        main()
