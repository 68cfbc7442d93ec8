"""Sharded fused MoE (EP all-gather, EP all-to-all, TP, EP×TP) equals the single-device result.

Runs in a subprocess with 8 fake CPU devices (this pytest process already initialised jax
with one). The subprocess prints one JSON object; each check reads its part. Routing leaves
experts without tokens (checked). Covered: every design on the XLA executor (float32 and
bfloat16 activations) against the single-device result and float64; the engine layouts (tiles,
wgmma) stacked per TP rank and sharded; the Triton-lowered engine's kernels in Pallas interpret
mode (``executor="triton_interpret"``) on 2- and 2x2-device meshes against the single-device
engine and float64; the per-device executor choice, the fallback warning, and typed errors."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r'''
    import json, os, sys, time, types, typing, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    assert len(jax.devices()) == 8, jax.devices()
    sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
    from reference import dequant_checkpoint, fused_moe_ref
    from engine_helpers import SCHEMES, layer_case, reference
    from wna16_jax import routing
    from wna16_jax.backends import TABLE, Backend
    from wna16_jax.checkpoint import Checkpoint
    from wna16_jax.writers import random_moe_layer, write_checkpoint
    from wna16_jax.convert.tiles import convert_tiles
    from wna16_jax.convert.wgmma import convert_wgmma
    from wna16_jax.device import Device
    from wna16_jax.errors import WNA16Error
    from wna16_jax.moe import EngineFallbackWarning, fused_moe
    from wna16_jax.nn import convert_experts
    from wna16_jax.sharding import (EP_METHODS, shard_weights, sharded_executor, sharded_fused_moe, slice_tp,
                                    stack_tp_shards, tp_shards_from_checkpoint)
    from wna16_jax.schemes import QuantScheme

    tmp = sys.argv[1]
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    E, H, I, T, K = 8, 64, 128, 13, 2                      # T not a multiple of the EP size
    res = {"seed": seed, "errors": {}, "seconds": {}}
    clock = time.perf_counter()
    write_checkpoint(tmp, QuantScheme("gptq", 4, 32, False), [random_moe_layer(rng, E, H, I, bias=True)])
    ck = Checkpoint(tmp)
    loader = ck.load_layer(0).experts.to_jax()
    cpu, _ = convert_experts(loader, None)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    empty = rng.choice(E, 3, replace=False)                 # three experts get no tokens
    logits = jnp.asarray(rng.standard_normal((T, E)), jnp.float32).at[:, empty].add(-100.0)
    tw, ids = routing.fused_topk(logits, K, renormalize=True)
    res["empty_expert_rows"] = int(np.isin(np.asarray(ids), empty).sum())
    res["used_experts"] = int(np.unique(np.asarray(ids)).size)
    devs = np.array(jax.devices())

    def single(w, on_input=False, xx=x):
        return jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w, apply_router_weight_on_input=on_input))(
            xx, tw, ids, w)

    def err(y, ref):
        y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64); ref = np.asarray(ref, np.float64)
        if y.shape != ref.shape or not np.all(np.isfinite(y)):
            return float("inf")
        return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))

    ln = loader.to_numpy()
    r13, r2 = dequant_checkpoint(ln, ln.scheme)
    ref64 = fused_moe_ref(np.asarray(x), np.asarray(tw), np.asarray(ids), r13, r2, np.asarray(ln.w13_bias, np.float64),
                          np.asarray(ln.w2_bias, np.float64))
    ref = single(cpu)
    ref_in = single(cpu, True)
    res["ref_vs_float64"] = err(ref, ref64)
    res["ref_vs_loader"] = err(single(loader), ref)
    m8 = Mesh(devs, ("ep",))
    for meth in EP_METHODS:
        res[f"ep8_{meth}"] = err(sharded_fused_moe(x, tw, ids, cpu, m8, ep_method=meth), ref)
        res[f"ep8_{meth}_on_input"] = err(sharded_fused_moe(x, tw, ids, cpu, m8, ep_method=meth,
                                                            apply_router_weight_on_input=True), ref_in)
    for tp in (2, 4):
        mt = Mesh(devs[:tp], ("tp",))
        res[f"tp{tp}_checkpoint_cpu"] = err(sharded_fused_moe(
            x, tw, ids, tp_shards_from_checkpoint(ck, 0, tp, None), mt, ep_axis=None, tp_axis="tp"), ref)
        sliced = [slice_tp(loader, tp, r) for r in range(tp)]
        loaded = [ck.load_layer(0, tp_size=tp, tp_rank=r).experts for r in range(tp)]
        res[f"tp{tp}_slice_equals_load"] = all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for s_, l_ in zip(sliced, loaded) for a, b in zip(jax.tree.leaves(s_), jax.tree.leaves(l_)))
        res[f"tp{tp}_slice_loader"] = err(sharded_fused_moe(
            x, tw, ids, stack_tp_shards(sliced), mt, ep_axis=None, tp_axis="tp"), ref)
    m42 = Mesh(devs.reshape(4, 2), ("ep", "tp"))
    st = tp_shards_from_checkpoint(ck, 0, 2, None)
    for meth in EP_METHODS:
        res[f"ep4xtp2_{meth}"] = err(sharded_fused_moe(x, tw, ids, st, m42, tp_axis="tp", ep_method=meth), ref)
        res[f"ep4xtp2_{meth}_on_input"] = err(sharded_fused_moe(
            x, tw, ids, st, m42, tp_axis="tp", ep_method=meth, apply_router_weight_on_input=True), ref_in)
    # bfloat16 activations keep their dtype; the XLA executor computes them in float32
    xb = x.astype(jnp.bfloat16)
    ref_b = single(cpu, xx=xb)
    res["bf16_ep8_all_to_all"] = err(y := sharded_fused_moe(xb, tw, ids, cpu, m8, ep_method="all_to_all"), ref_b)
    res["bf16_dtypes"] = [str(y.dtype), str(ref_b.dtype)]
    c = sharded_executor(cpu, m8)
    res["cpu_choice"] = [c.executor.name, c.reason]
    # engine layouts (Marlin, tiles, wgmma) stacked per TP rank and sharded, run here on the XLA executor
    w, xe, twe, ide, _ = layer_case(rng, SCHEMES["awq_g128"], 4, 128, 256, 6, 2, bias=True)   # expert 0 empty
    res["engine_empty_expert_rows"] = int((np.asarray(ide) == 0).sum())
    wj = w.to_jax()
    e64 = reference(w, xe, twe, ide, None)
    x32 = xe.astype(jnp.float32)
    mt2, m22 = Mesh(devs[:2], ("tp",)), Mesh(devs[:4].reshape(2, 2), ("ep", "tp"))
    ref_e = jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w))(x32, twe, ide, wj)
    res["engine_layer_xla_vs_float64"] = err(ref_e, e64)

    def marlin(w):                                      # the MARLIN row's own layout (its CPU-side converter)
        return TABLE[Backend.MARLIN].convert(w.scheme, w)
    # the tile layout is exact (its single-device result is the loader's); the wgmma layout rounds
    # the float16 scales to bfloat16, so it is compared with its own single-device result
    stk = shard_weights(stack_tp_shards([convert_tiles(slice_tp(wj, 2, r)) for r in range(2)]), m22, tp_axis="tp")
    res["layout_tiles"] = type(stk).__name__
    res["tp_tiles"] = err(sharded_fused_moe(x32, twe, ide, stk, m22, tp_axis="tp", ep_method="all_to_all"), ref_e)
    one_e = jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w))(x32, twe, ide, convert_wgmma(wj))
    stk = stack_tp_shards([convert_wgmma(slice_tp(wj, 2, r)) for r in range(2)])
    res["layout_wgmma"] = type(stk).__name__
    res["tp_wgmma"] = err(sharded_fused_moe(x32, twe, ide, stk, mt2, ep_axis=None, tp_axis="tp"), one_e)
    res["seconds"]["xla"] = time.perf_counter() - clock

    # ---- the Triton-lowered engine's kernels in interpret mode on a 2-device (and 2x2) mesh
    clock = time.perf_counter()
    tiles = convert_tiles(wj)
    eng = "triton_interpret"
    one = fused_moe(xe, twe, ide, tiles, executor=eng)
    res["engine_single_vs_float64"] = err(one, e64)
    m2, t2 = Mesh(devs[:2], ("ep",)), Mesh(devs[:2], ("tp",))
    c = sharded_executor(tiles, m2, executor=eng)
    res["engine_choice"] = [c.executor.name, c.reason]
    tiles_ep = shard_weights(tiles, m2)
    res["engine_ep_local_experts"] = sorted({s.data.shape[0] for a in jax.tree.leaves(tiles_ep)
                                             for s in a.addressable_shards})
    runs = {f"ep2_{meth}": lambda meth=meth: sharded_fused_moe(xe, twe, ide, tiles_ep, m2, ep_method=meth,
                                                                executor=eng) for meth in EP_METHODS}
    tile_tp = stack_tp_shards([convert_tiles(slice_tp(wj, 2, r)) for r in range(2)])
    runs["tp2"] = lambda: sharded_fused_moe(xe, twe, ide, tile_tp, t2, ep_axis=None, tp_axis="tp", executor=eng)
    marlin_tp = stack_tp_shards([marlin(slice_tp(wj, 2, r)) for r in range(2)])
    runs["ep2xtp2_marlin"] = lambda: sharded_fused_moe(xe, twe, ide, marlin_tp, m22, tp_axis="tp", executor=eng)
    for name, run in runs.items():
        y = run()
        res[f"engine_{name}_dtype"] = str(y.dtype)
        res[f"engine_{name}_vs_single"] = err(y, one)
        res[f"engine_{name}_vs_float64"] = err(y, e64)
    res["seconds"]["engine"] = time.perf_counter() - clock

    def expect_error(name, fn):
        try:
            fn()
            res["errors"][name] = "no error"
        except WNA16Error as e:
            res["errors"][name] = f"{type(e).__name__}: {e}"
    expect_error("ep3", lambda: sharded_fused_moe(x, tw, ids, cpu, Mesh(devs[:3], ("ep",))))
    expect_error("tp3", lambda: slice_tp(loader, 3, 0))
    expect_error("tp8_group", lambda: tp_shards_from_checkpoint(ck, 0, 8, None))
    expect_error("tp_axis_mismatch", lambda: sharded_fused_moe(
        x, tw, ids, stack_tp_shards([slice_tp(loader, 2, r) for r in range(2)]), Mesh(devs[:4], ("tp",)),
        ep_axis=None, tp_axis="tp"))
    expect_error("bad_axis", lambda: sharded_fused_moe(x, tw, ids, cpu, m8, ep_axis="experts"))
    expect_error("bad_executor", lambda: sharded_fused_moe(x, tw, ids, cpu, m8, executor="fastest"))
    expect_error("engine_float32", lambda: sharded_fused_moe(xe.astype(jnp.float32), twe, ide, tiles, m2,
                                                             executor=eng))
    expect_error("engine_loader", lambda: sharded_fused_moe(xe, twe, ide, wj, m2, executor=eng))
    marlin_small = stack_tp_shards([marlin(slice_tp(loader, 2, r)) for r in range(2)])   # H 64, I 64 a rank
    expect_error("engine_tp_tile", lambda: sharded_fused_moe(xb, tw, ids, marlin_small, mt2, ep_axis=None,
                                                             tp_axis="tp", executor=eng))
    expect_error("not_arrays", lambda: sharded_fused_moe(x, tw, ids, {"w": "packed"}, m8))
    expect_error("ids_1d", lambda: sharded_fused_moe(x, tw[:, 0], ids[:, 0], cpu, m8))
    expect_error("shard_not_arrays", lambda: stack_tp_shards([types.SimpleNamespace(w2_bias=np.ones(3))] * 2))

    class Derived(typing.NamedTuple):                  # a layout whose w2_bias is computed, not a leaf
        b: np.ndarray

        @property
        def w2_bias(self):
            return self.b * 2
    expect_error("bias_not_a_leaf", lambda: stack_tp_shards([Derived(np.ones((2, 3)))] * 2))

    try:
        sharded_fused_moe(x, tw, ids, cpu, m8, ep_method="all_to_all", ragged="native")
        res["native_ragged_cpu"] = "ran"
    except Exception as e:
        res["native_ragged_cpu"] = f"{type(e).__name__}: {e}"[:300]

    # an engine layout that falls back on an NVIDIA GPU warns once, with the reasons (a described H200)
    Device.current = classmethod(lambda cls, d=None: Device("gpu", "H200", (9, 0)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            y = sharded_fused_moe(xe.astype(jnp.float32), twe, ide, tiles, m2)
    res["fallback_warnings"] = [f"{w_.category.__name__}: {w_.message}" for w_ in caught
                                if issubclass(w_.category, EngineFallbackWarning)]
    res["fallback_vs_float64"] = err(y, e64)
    print("RESULT " + json.dumps(res))
''')


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=8").strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("ckpt")), ROOT],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


#: XLA executor, float32 activations: the sharded sums reorder float32 additions only
TOL = 2e-6
#: XLA executor, bfloat16 activations: float32 inside, so at most the final rounding to bfloat16 differs
#: (one bfloat16 ulp, 2^-8 of the largest output)
TOL_BF16 = 2.0 ** -8
#: engine vs the single-device engine: each device's bfloat16 partial output is rounded once before the
#: reduction and the reduced sum once more: two bfloat16 ulps of the largest output
TOL_ENGINE = 2.0 ** -7
#: engine vs float64: the engine's own layer tolerance (tests/engine_helpers.layer_close)
TOL_ENGINE64 = 1.5e-2
ENGINE_RUNS = ("ep2_allgather", "ep2_all_to_all", "tp2", "ep2xtp2_marlin")


def _ok(results, key, tol=TOL):
    v = results[key]
    assert v is not None and v == v and v <= tol, f"{key}: relative error {v} > {tol:.1e} (seed {results['seed']})"


def _routing_leaves_experts_empty(results):
    assert results["empty_expert_rows"] == 0 and results["used_experts"] <= 5, results["used_experts"]
    assert results["engine_empty_expert_rows"] == 0


def _expert_parallel_8(results):
    _ok(results, "ref_vs_float64", 1e-5)
    _ok(results, "ref_vs_loader")
    for method in ("allgather", "all_to_all"):
        _ok(results, f"ep8_{method}")
        _ok(results, f"ep8_{method}_on_input")


def _tensor_parallel(results):
    for tp in (2, 4):
        _ok(results, f"tp{tp}_checkpoint_cpu")
        _ok(results, f"tp{tp}_slice_loader")
        assert results[f"tp{tp}_slice_equals_load"] is True, f"tp{tp}_slice_equals_load"


def _ep4_x_tp2(results):
    for method in ("allgather", "all_to_all"):
        _ok(results, f"ep4xtp2_{method}")
        _ok(results, f"ep4xtp2_{method}_on_input")


def _engine_layouts_stack_and_shard(results):
    _ok(results, "engine_layer_xla_vs_float64", 1e-5)
    for name, cls in (("tiles", "TileWeights"), ("wgmma", "WgmmaWeights")):
        assert results[f"layout_{name}"] == cls
        _ok(results, f"tp_{name}")


def _bfloat16_keeps_its_dtype(results):
    assert results["bf16_dtypes"] == ["bfloat16", "bfloat16"], results["bf16_dtypes"]
    _ok(results, "bf16_ep8_all_to_all", TOL_BF16)


def _executor_per_device(results):
    name, reason = results["cpu_choice"]
    assert name == "xla" and "NVIDIA GPU" in reason, results["cpu_choice"]
    assert results["engine_choice"] == ["triton_interpret", None], results["engine_choice"]
    assert results["engine_ep_local_experts"] == [2], results["engine_ep_local_experts"]     # 4 experts / EP 2


def _engine_in_interpret_mode(results):
    _ok(results, "engine_single_vs_float64", TOL_ENGINE64)
    for run in ENGINE_RUNS:
        assert results[f"engine_{run}_dtype"] == "bfloat16", run
        _ok(results, f"engine_{run}_vs_single", TOL_ENGINE)
        _ok(results, f"engine_{run}_vs_float64", TOL_ENGINE64)


def _fallback_warns_once_with_reasons(results):
    w = results["fallback_warnings"]
    assert len(w) == 1 and "EngineFallbackWarning" in w[0] and "activations are float32" in w[0], w
    _ok(results, "fallback_vs_float64", 1e-5)


def _typed_errors_name_the_numbers(results):
    e = results["errors"]
    assert e["ep3"].startswith("ShapeError") and "8 experts" in e["ep3"] and "size 3" in e["ep3"], e["ep3"]
    assert e["tp3"].startswith("ShapeError") and "128" in e["tp3"] and " 3" in e["tp3"], e["tp3"]
    assert e["tp8_group"].startswith("ShapeError") and "16" in e["tp8_group"], e["tp8_group"]
    assert e["tp_axis_mismatch"].startswith("ShapeError") and "size 4" in e["tp_axis_mismatch"]
    assert e["bad_axis"].startswith("ConfigError") and "'experts'" in e["bad_axis"]
    assert e["bad_executor"].startswith("ConfigError") and "'fastest'" in e["bad_executor"]
    assert e["engine_float32"].startswith("UnsupportedError") and "float32" in e["engine_float32"]
    assert e["engine_loader"].startswith("UnsupportedError") and "CheckpointWeights" in e["engine_loader"]
    t = e["engine_tp_tile"]
    assert t.startswith("UnsupportedError") and "size 64" in t and "128-row tile" in t, t
    assert e["not_arrays"].startswith("ConfigError") and "dict" in e["not_arrays"]
    assert e["ids_1d"].startswith("ShapeError") and "(13,)" in e["ids_1d"]
    assert e["shard_not_arrays"].startswith("ConfigError") and "shard 0" in e["shard_not_arrays"]
    assert e["bias_not_a_leaf"].startswith("UnsupportedError") and "Derived.w2_bias" in e["bias_not_a_leaf"]


def _native_ragged_all_to_all_on_cpu_is_reported(results):
    # XLA:CPU in jax 0.10.2 has no ragged-all-to-all; the emulated path above covers the design.
    r = results["native_ragged_cpu"]
    assert r == "ran" or "ragged-all-to-all" in r, r


def test_sharding_on_8_cpu_devices(results):
    """Every check of the 8-device subprocess's results, in one test: the subprocess (~60 s) runs
    once per xdist worker that runs a test of this module, so one test keeps it to one run. Each
    check's failure is reported; the test fails if any does."""
    failures = []
    for check in (_routing_leaves_experts_empty, _expert_parallel_8, _tensor_parallel, _ep4_x_tp2,
                  _engine_layouts_stack_and_shard, _bfloat16_keeps_its_dtype, _executor_per_device,
                  _engine_in_interpret_mode, _fallback_warns_once_with_reasons, _typed_errors_name_the_numbers,
                  _native_ragged_all_to_all_on_cpu_is_reported):
        try:
            check(results)
        except (AssertionError, KeyError, TypeError) as err:     # a missing or malformed result fails too
            failures.append(f"{check.__name__}: {type(err).__name__}: {err}")
    assert not failures, "\n".join(failures)
