"""The GPU engine benchmark script runs end to end on the CPU (Pallas interpret mode, the tiny
shape): its table, its error check and its per-kernel profile path — so it does not rot
between GPU sessions. Timings here mean nothing and are not checked."""

import re

from benchmarks import moe_engine


def test_moe_engine_table_and_sweep_on_cpu(capsys, tmp_path):
    out_md = tmp_path / "RESULTS.md"
    assert moe_engine.main(["--rows", "tiny:1", "--interpret", "--reps", "2", "--skip",
                            "engine←Marlin,dequant→ragged_dot", "--append", str(out_md)]) == 0
    text = out_md.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| tiny"))
    err = float(row.rstrip(" |").rsplit("|", 1)[1])
    assert err < 2e-2, row                                  # the engine agrees with float32 XLA
    hlo = tmp_path / "hlo"
    assert moe_engine.main(["--rows", "tiny:8", "--interpret", "--reps", "2", "--sweep", "--profile",
                            "--variants", "blocked=mode:blocked,dot:swap", "--dump-hlo", str(hlo)]) == 0
    printed = capsys.readouterr().out
    m = re.search(r"blocked\s+[\d.]+ µs .* rel err ([\d.e+-]+)", printed)
    assert m and float(m.group(1)) < 2e-2, printed
    assert "device busy" in printed
    dumped = sorted(hlo.iterdir())                          # --dump-hlo: the variant's compiled HLO
    assert [f.name for f in dumped] == ["tiny_8_blocked.hlo.txt"] and "ENTRY" in dumped[0].read_text()


def test_moe_engine_row_ratios():
    """The table's derived columns: time / floor, GPTQ / AWQ, the dense bf16 matmul's time over
    the wgmma layer's, and the layer's FLOP rate over the run's dense peak."""
    alts = ["wgmma AWQ", "wgmma GPTQ", "dense bf16"]
    row = {"shape": "s", "tokens": 512, "floor_us": 100.0, "cells": [200.0, 220.0, 150.0], "err": 1e-3,
           "tflop": 0.08, "peak_tflops": 800.0}      # 0.08 TFLOP in 200 µs = 400 TFLOP/s = 50% of 800
    cells = [c.strip() for c in moe_engine._row_md(row, alts).strip("| \n").split("|")]
    header = [c.strip() for c in moe_engine._header(alts).splitlines()[0].strip("| ").split("|")]
    got = dict(zip(header, cells))
    assert len(cells) == len(header) == len(moe_engine._header(alts).splitlines()[1].strip("|").split("|"))
    assert (got["wgmma / floor"], got["GPTQ / AWQ wgmma"]) == ("2.00", "1.10")
    assert (got["wgmma % dense"], got["wgmma % peak"], got["rel err"]) == ("75%", "50%", "1.0e-03")
    row.update(peak_tflops=None, cells=[None, 220.0, 150.0])
    got = dict(zip(header, (c.strip() for c in moe_engine._row_md(row, alts).strip("| \n").split("|"))))
    assert got["wgmma % dense"] == got["wgmma % peak"] == "—"


def test_gemm_kernels_on_cpu(capsys):
    from benchmarks import gemm_kernels

    assert gemm_kernels.main(["--interpret", "--gemms", "tiny", "--block-m", "16", "--reps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert len(rows) >= 2 and all(float(r.rstrip(" |").rsplit("|", 1)[1]) < 2e-2 for r in rows), rows


def test_ptxas_report_summary(tmp_path):
    """The device-side report keeps only ptxas's summary lines and a PTX opcode histogram of the
    files a kernel wrote (the dump itself is too many files to bring back)."""
    from benchmarks.ptxas_report import summarize

    (tmp_path / "kernel_3.ptxas").write_text("ptxas info    : Compiling entry function 'k'\n"
                                             "ptxas info    : Used 168 registers, 0 bytes smem\n"
                                             "noise line\n")
    (tmp_path / "kernel_3.ptx").write_text("// Used 1 registers (not a ptxas file)\n\tshr.u16 \t%rs1, %rs2, 4;\n"
                                           "\t@%p1 bra $L__BB0_2;\n\tshr.u16 %rs3, %rs1, 8;\n"
                                           "\tfma.rn.bf16x2 %r1, %r2, %r3, %r4;\n")
    (tmp_path / "kernel_3.mlir").write_text("not summarized\n")
    lines = summarize(set(tmp_path.iterdir()))
    assert len(lines) == 3 and "168 registers" in lines[2] and all("kernel_3.ptx" in ln for ln in lines)
    assert "4 PTX instructions; shr.u16 2, bra 1, fma.rn.bf16x2 1" in lines[0]
    assert "dumped files: kernel_3.mlir" in summarize({tmp_path / "kernel_3.mlir"})[0]


def test_sass_loops_finds_the_k_loop():
    """``sass_loops.py`` counts the instructions of the largest predicated backward branch's span
    (the K loop) — not a forward branch's, and not the unpredicated jump back from a barrier
    wait's slow path placed after the exit, which spans more but is no loop."""
    from benchmarks.sass_loops import loops

    def insn(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;"

    sass = "\n".join([
        ".L_x_0:",
        insn(0x10, "MOV R1, R2"),
        ".L_x_4:",                                   # the K loop: 5 instructions
        insn(0x20, "LOP3.LUT R3, R4, 0xf000f, RZ, 0xc0, !PT"),
        insn(0x30, "@!P1 BRA `(.L_x_9)"),            # forward: not a loop
        insn(0x40, "HGMMA.64x8x16.F32.BF16 R8, R12, gdesc[UR4], R8"),
        insn(0x50, "LOP3.LUT R3, R3, 0x43004300, RZ, 0xfc, !PT"),
        insn(0x60, "@P0 BRA `(.L_x_4)"),
        ".L_x_9:",
        insn(0x70, "EXIT"),
        ".L_x_7:",
        insn(0x80, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5"),
        insn(0x90, "@!P0 BRA `(.L_x_7)"),            # the slow path's own retry: 2 instructions
        insn(0xa0, "BRA `(.L_x_0)"),                 # back into the code, unpredicated: no loop
    ])
    found = loops(sass)
    assert [(label, n) for label, n, _ in found] == [(".L_x_4", 5), (".L_x_7", 2)]
    assert found[0][2] == {"LOP3.LUT": 2, "BRA": 2, "HGMMA.64": 1}      # (opcodes up to the first lowercase)


def test_call_timeline_gaps():
    """A call's span, busy time (overlapping kernels counted once) and the largest gaps between
    consecutive kernels, averaged over the calls; events that do not split into equal calls give
    None; the formatted breakdown names the largest gap."""
    from benchmarks.kernel_profile import call_timeline, format_breakdown

    # two calls of three kernels: a [0, 10), b [14, 20) (gap 4), c [18, 30) overlapping b; the
    # second call 1000 µs later with the a → b gap 6 and c ending at 1032
    one = [(0.0, 10.0, "a"), (14.0, 6.0, "b"), (18.0, 12.0, "c")]
    two = [(1000.0, 10.0, "a"), (1016.0, 6.0, "b"), (1020.0, 12.0, "c")]
    t = call_timeline(two + one, 2)
    assert t["span"] == 31.0 and t["busy"] == 26.0 and t["idle"] == 5.0
    assert t["gaps"] == [(5.0, "a", "b")]
    assert call_timeline(one + two[:2], 2) is None and call_timeline([], 3) is None
    text = format_breakdown(([("a", 10.0, 1.0)], 50.0, t, [("Thunk::Execute", 7.5, 2.0)]))
    assert "first kernel to last: 31.0 µs/call, 5.0 of it idle" in text and "5.0 µs a → b" in text
    assert "7.5 µs  ×2  Thunk::Execute" in text
    assert "first kernel" not in format_breakdown(([("a", 10.0, 1.0)], 50.0, None, []))


def test_timed_program_uses_routings_in_turn():
    """The timed program of ``calls`` layer calls routes call ``r`` by routing ``r % R`` (the
    differential timing runs R and 2R calls on the same R routings), in a loop (also with several
    calls per iteration, ``--unroll``, 7 calls in iterations of 3) or straight-line."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def layer(c, tw, ids, scale):          # depends on the carry, the routing and an operand
        return c * 0.5 + tw.sum() * scale + ids.sum().astype(c.dtype)

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    tw_all = jnp.asarray(rng.random((3, 2, 2)), jnp.float32)
    ids_all = jnp.asarray(rng.integers(0, 8, (3, 2, 2)), jnp.int32)
    scale = jnp.float32(1.7)
    c = np.asarray(x, np.float64)
    for r in range(7):                      # 7 calls over 3 routings: 0 1 2 0 1 2 0
        y = c * 0.5 + float(tw_all[r % 3].sum()) * 1.7 + float(ids_all[r % 3].sum())
        c = np.asarray(x, np.float64) + y * 1e-3
    old = moe_engine.TIMING, moe_engine.UNROLL
    try:
        for timing, unroll in (("loop", 1), ("loop", 3), ("unrolled", 1)):
            moe_engine.TIMING, moe_engine.UNROLL = timing, unroll
            got = jax.jit(moe_engine.program(layer, 7))(x, tw_all, ids_all, (scale,))
            np.testing.assert_allclose(np.asarray(got), c, rtol=1e-5, err_msg=f"{timing} {unroll}")
        moe_engine.TIMING, moe_engine.UNROLL = "loop", 3
        once = moe_engine.runner(layer, x, tw_all, ids_all, (scale,), 3)
        assert np.isfinite(once())
    finally:
        moe_engine.TIMING, moe_engine.UNROLL = old


def test_differential_timing_leaves_out_the_fixed_cost(monkeypatch):
    """``pair_timer`` returns the 2R-call program's time less the R-call program's: with fake
    programs that cost 50 ms once and 1 ms per call (on a fake clock, so the test cannot be
    flaky) the difference is R calls' time, the fixed cost gone, and ``differential_us`` divides
    by R."""
    import pytest

    from benchmarks import timing

    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    built = []

    def build(n):
        built.append(n)

        def run(x):
            clock[0] += 0.05 + 1e-3 * n
            return x
        return run

    once = timing.pair_timer(build, (1.0,), 10)
    assert built == [10, 20]
    assert once() == pytest.approx(0.010)                 # 10 calls' 10 ms, not 60–70 ms
    assert timing.differential_us(build, (1.0,), 10, samples=3) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="reps"):
        timing.pair_timer(build, (1.0,), 0)


def test_wgmma_plan_reports_the_layer_rules(capsys):
    """``wgmma_plan.py`` traces the layer on abstract weights (nothing computed) and reports the
    options its rules pick per GEMM: the pair schedule's K splits at Qwen3 1 token, the chained
    ``ws`` stream in Qwen3 512's 48-row blocks (v15: one program per SM, 3 stages for GEMM2's 3
    steps, the router weights out of GEMM2) and two programs per SM without ``ws`` there with
    ``persistent:0`` (v12), the scale-only fold in Mixtral 64's 24-row blocks (v17: three programs
    per SM) and ``ws`` in its 32-row blocks with ``block_m:32`` (one program per SM); the programs
    follow from the grid (live ones from the expected blocks)."""
    from benchmarks import wgmma_plan

    assert wgmma_plan.main(["--rows", "qwen3:1,512", "mixtral:64"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for block in out.split("## ")[1:]:
        head, *lines = block.strip().splitlines()
        rows[head.split(":")[0]] = {ln.split()[0]: ln.split() for ln in lines if ln.strip().startswith("GEMM1")
                                    or ln.strip().startswith("GEMM2")}
    q1, q512, m64 = (rows[f"{name} T={t}"] for name, t in (("Qwen3-30B-A3B (128, 8, 2048, 768)", 1),
                                                           ("Qwen3-30B-A3B (128, 8, 2048, 768)", 512),
                                                           ("Mixtral (8, 2, 4096, 14336)", 64)))
    # columns: GEMM bm blocks N K bn kpb st split steps programs live smem /SM waves MB flags...
    assert q1["GEMM1"][1:3] == ["8", "8"] and q1["GEMM1"][8] == "2" and q1["GEMM2"][8] == "3"
    assert q1["GEMM1"][10] == str(8 * 1536 // 128 * 2) and "sfold" in q1["GEMM1"][16:]
    assert q512["GEMM1"][1] == "48" and q512["GEMM1"][7] == "2" and q512["GEMM1"][13] == "1"
    assert q512["GEMM2"][7] == "3" and q512["GEMM1"][10] == q512["GEMM2"][10] == "132"
    assert {"ws", "stream", "gated"} <= set(q512["GEMM1"][16:]) and "row_scale" not in q512["GEMM2"][16:]
    # v17: 24-row fold blocks; v25: on ws (K streams of 32 / 112 K-blocks), one program per SM
    assert m64["GEMM1"][1:3] == ["24", "13"] and m64["GEMM1"][13] == m64["GEMM2"][13] == "1"
    assert all({"sfold", "ws"} <= set(m64[g][16:]) for g in ("GEMM1", "GEMM2"))
    assert m64["GEMM2"][10] == str(13 * 4096 // 256)      # a ws program covers 2·block_n columns
    assert "pair schedule, 8 pair blocks" in out and "blocked, 128.4 of 211 blocks live" in out
    assert "aligned by rank" in out and "aligned by compare" in out      # 4096 / 128 routed pairs (v16, v21)
    assert wgmma_plan.main(["--rows", "qwen3:512", "--set", "persistent:0"]) == 0
    v12 = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("GEMM")}
    assert v12["GEMM1"][7] == "2" and v12["GEMM1"][13] == "2" and "ws" not in v12["GEMM1"][16:]
    assert "row_scale" in v12["GEMM2"][16:]
    assert wgmma_plan.main(["--rows", "mixtral:64", "--set", "block_m:32"]) == 0
    v16 = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("GEMM")}
    assert v16["GEMM1"][1] == "32" and "ws" in v16["GEMM1"][16:] and "ws" in v16["GEMM2"][16:]
    assert v16["GEMM2"][10] == str(12 * 4096 // 256) and v16["GEMM2"][13] == "1"   # ws: two column tiles


def test_parse_variants_values():
    """``--variants``: ints where they parse (negative too), strings otherwise, and ``a/b`` a pair
    with ``-`` for None (``persistent:-/1``: one value per GEMM)."""
    got = moe_engine.parse_variants("a=kernel:wgmma,persistent:-/1,weight_in_gemm2:0;b=stages:-3,x:1/0;c=")
    assert got == {"a": {"kernel": "wgmma", "persistent": (None, 1), "weight_in_gemm2": 0},
                   "b": {"stages": -3, "x": (1, 0)}, "c": {}}


def test_sharding_benchmark_tiny_on_two_cpu_devices(tmp_path):
    """``benchmarks/sharding.py --tiny`` on 2 fake CPU devices (a subprocess: this process's jax
    has one): every design's row, its executor, a communication share, and its output equal to
    the one-device output (XLA executor: float32 inside, so at most the final bfloat16 rounding)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=2").strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "sharding.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "sharding.py"), "--tiny", "--tokens", "5",
                           "--reps", "1", "--samples", "1", "--json", str(out), "--append", str(tmp_path / "R.md")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["tokens"]) for r in rows] == [("tiny", 5)]
    cells = rows[0]["cells"]
    assert list(cells) == ["one GPU", "EP=2 all-gather", "EP=2 all-to-all", "TP=2"]
    for design, c in cells.items():
        assert c["executor"] == "xla" and c["us"] > 0 and c["err"] <= 2.0 ** -8, (design, c)
        assert (c["comm"] is None) == (design == "one GPU"), (design, c)
    assert "| tiny | 5 |" in (tmp_path / "R.md").read_text()


def test_before_after_on_cpu(tmp_path):
    """benchmarks/before_after.py with this tree as both sides (interpret mode, the tiny shape):
    four workers build the same layers from the same data (equal errors, within the engine's
    check), and the table is appended."""
    import os

    from benchmarks import before_after

    root = os.path.dirname(os.path.dirname(os.path.abspath(before_after.__file__)))
    out_md = tmp_path / "RESULTS.md"
    before_after.main(["--before", root, "--after", root, "--rows", "tiny:1", "--interpret", "--reps", "2",
                       "--samples", "1", "--append", str(out_md)])
    row = next(line for line in out_md.read_text().splitlines() if line.startswith("| tiny"))
    before, after = (float(v) for v in row.rstrip(" |").rsplit("|", 1)[1].split("/"))
    assert before == after and before < 2e-2, row


def test_model_sharding_benchmark_tiny_on_four_cpu_devices():
    """``benchmarks/model_sharding.py --tiny`` on 4 fake CPU devices (a subprocess): one row per
    mesh (one device, EP=2, TP=2, EP×TP), each with a decode rate, its ratio to the one-device
    row, the greedy tokens equal to the one-device model's, and the bytes the fullest device
    holds, fewer on a mesh than on one device."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=4").strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "model_sharding.py"), "--tiny"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| tiny")]
    assert [r[1].split(" ")[0] for r in rows] == ["1", "ep2", "tp2", "ep2xtp2"]
    assert [r[2] for r in rows] == ["1", "2", "2", "4"]
    for r in rows:
        assert float(r[5]) > 0 and float(r[7]) > 0 and r[8] == "same", r
    top = [float(r[9].replace(",", "")) for r in rows]
    assert all(t < top[0] for t in top[1:]), top


def test_host_memory_benchmark_two_processes_on_cpu(capsys):
    """``benchmarks/host_memory.py --tiny``: two processes of 2 CPU devices load a tiny model on
    one ep4 mesh; each reports the bytes it read (fewer than the checkpoint's: half the experts)
    and its host peak."""
    from benchmarks import host_memory

    assert host_memory.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| tiny")]
    assert [r[2] for r in rows] == ["0 of 2", "1 of 2"], out
    for r in rows:
        assert 0 < int(r[4].rstrip("%")) < 100 and float(r[8]) > 0, r


def test_latent_parts_benchmark_on_cpu(capsys):
    """``benchmarks/latent_parts.py --tiny``: a tiny DeepSeek-V2 loaded in both forms of
    ``kv_b_proj`` (its parts apart, and one matrix cut at every step), a row for each at each
    batch size, and the two forms' first greedy tokens compared."""
    from benchmarks import latent_parts

    assert latent_parts.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.strip("|").split("|"))[1:3] for line in out.splitlines()
            if line.startswith("| tiny DeepSeek")}
    assert rows == {(b, f) for b in ("1", "2") for f in ("one matrix", "two parts")}, out
    assert "the first decode token is the same in 1 of 1 rows" in out, out
