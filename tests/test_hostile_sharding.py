"""Hostile input on the sharding helpers (``wna16_jax.sharding``) and the serving helpers
(``wna16_jax.serving``). Every case asserts the typed error (its exact ``WNA16Error`` subclass),
that the message names the offending argument and the value it got, that nothing was compiled
before the error, and that the inputs were not mutated (compared with copies taken before the
call). The accepted edge cases (no tokens, no slots, out-of-range ids under ``jax.jit``, neither
EP nor TP, integral counts of other types, fills at a dtype's limit) are checked against the
one-device result or the rule they follow.

The sharding cases need a mesh of several devices: they run in one subprocess with 8 host CPU
devices (as in ``tests/test_sharding.py``: this pytest process already initialised jax with one
device). The subprocess imports this module, runs every case of :data:`SHARDING_CASES` and the
accepted sharded calls on one tiny layer, and prints one JSON object; each test reads its part.
The serving cases need no mesh and run here."""

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wna16_jax.checkpoint import Checkpoint
from wna16_jax.writers import random_checkpoint_weights, random_moe_layer, write_checkpoint
from wna16_jax.errors import ConfigError, DTypeError, ShapeError, UnsupportedError, ValueRangeError
from wna16_jax.moe import fused_moe
from wna16_jax.schemes import QuantScheme
from wna16_jax.serving import (BucketedMoE, bucket_size, bucketed, buckets_used, check_buckets, count_compiles,
                               pad_rows, pad_tokens, power_of_two_buckets, unpad_tokens)
from wna16_jax.sharding import (check_tp, shard_weights, sharded_executor, sharded_fused_moe, slice_tp,
                                stack_tp_shards, tp_shards_from_checkpoint)
from wna16_jax.weights import layer_stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E, H, I, T, K = 8, 32, 64, 5, 2                 # T not a multiple of any EP size used
SCHEME = QuantScheme("gptq", 4, 32, False)
#: sharded vs one-device, float32 on the XLA executor: the sums are reordered only (tests/test_sharding.py)
TOL = 2e-6


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**63)


class Ctx:
    """Fresh inputs for one run of the cases: a tiny GPTQ layer (host arrays) and its routing
    (``x [T, H]``, ``tw``, ``ids [T, K]``, distinct experts per token); with ``devices`` (8 of
    them), the meshes of the sharding cases, the layer's TP=2 stack and a one-layer checkpoint."""

    def __init__(self, seed: int, devices=None, tmp=None):
        from jax.sharding import Mesh

        rng = np.random.default_rng(seed)
        self.w = random_checkpoint_weights(rng, SCHEME, E, H, I)
        self.x = rng.standard_normal((T, H)).astype(np.float32)
        tw = rng.random((T, K)).astype(np.float32) + 0.1
        self.tw = tw / tw.sum(axis=1, keepdims=True)
        self.ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
        if devices is not None:
            d = np.array(devices)
            self.m8, self.m3 = Mesh(d, ("ep",)), Mesh(d[:3], ("ep",))
            self.mt2, self.mt4 = Mesh(d[:2], ("tp",)), Mesh(d[:4], ("tp",))
            self.m22 = Mesh(d[:4].reshape(2, 2), ("ep", "tp"))
            self.stacked = stack_tp_shards([slice_tp(self.w, 2, r) for r in range(2)])
            write_checkpoint(tmp, SCHEME, [random_moe_layer(rng, E, H, I)])
            self.ckpt = Checkpoint(tmp)

    def ids_with(self, *values, dtype=np.int32):
        """A copy of the routing ids (in ``dtype``) with ``values`` put at token 1's first slot,
        then token 3's second, then token 4's first."""
        ids = self.ids.astype(dtype)
        for (t, j), v in zip(((1, 0), (3, 1), (4, 0)), values):
            ids[t, j] = v
        return ids


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile call: ``call(ctx) -> (fn, args, kwargs)``; it must raise exactly ``error`` with
    every string of ``names`` (the argument and the value it got) in the message."""

    id: str
    call: Callable[[Ctx], tuple]
    error: type
    names: tuple[str, ...]


def call(fn, *args, **kwargs):
    return fn, args, kwargs


def _host_arrays(tree) -> list[np.ndarray]:
    return [np.array(a, copy=True) for a in jax.tree.leaves(tree) if isinstance(a, np.ndarray)]


def attempt(case: Case, c: Ctx) -> dict[str, Any]:
    """Run ``case`` on ``c``: the raised error (class and bases by name, message), the number of
    compilations during the call and whether any host (numpy) input array changed (JAX arrays
    cannot be changed in place)."""
    fn, args, kwargs = case.call(c)
    before = _host_arrays((args, kwargs))
    raised = None
    with count_compiles() as compiles:
        try:
            fn(*args, **kwargs)
        except Exception as err:            # noqa: BLE001 - every kind is reported (and judged by the test)
            raised = err
    after = _host_arrays((args, kwargs))
    mutated = len(before) != len(after) or not all(
        a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        for a, b in zip(before, after))
    return {"error": None if raised is None else [k.__name__ for k in type(raised).__mro__],
            "message": "" if raised is None else str(raised), "compiles": compiles.count, "mutated": mutated}


def check_refused(case: Case, got: dict[str, Any]) -> None:
    assert got["error"] is not None, f"{case.id}: no error was raised"
    assert got["error"][0] == case.error.__name__ and "WNA16Error" in got["error"], \
        f"{case.id}: expected {case.error.__name__}, got {got['error'][0]}: {got['message']}"
    missing = [n for n in case.names if n not in got["message"]]
    assert not missing, f"{case.id}: message lacks {missing}: {got['message']}"
    assert got["compiles"] == 0, f"{case.id}: {got['compiles']} programs compiled before the error"
    assert not got["mutated"], f"{case.id}: an input array was changed"


# --------------------------------------------------------------------------- sharding cases

def _scales_of_7_experts(c):
    return c.w.replace(w2_scales=c.w.w2_scales[:7])


def _shard_with_other_dtype(c):
    s1 = slice_tp(c.w, 2, 1)
    return [slice_tp(c.w, 2, 0), s1.replace(w13_scales=s1.w13_scales.astype(np.float32))]


SHARDING_CASES = [
    # the mesh and its axes
    Case("fused-mesh-none", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, None), ConfigError,
         ("mesh", "NoneType")),
    Case("fused-mesh-device-array", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8.devices),
         ConfigError, ("mesh", "ndarray")),
    Case("fused-ep-axis-missing", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8, ep_axis="experts"),
         ConfigError, ("ep_axis", "'experts'", "('ep',)")),
    Case("fused-ep-axis-not-a-name", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8, ep_axis=["ep"]),
         ConfigError, ("ep_axis", "['ep']")),
    Case("fused-tp-axis-missing", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.stacked, c.m8,
                                                 tp_axis="model"), ConfigError, ("tp_axis", "'model'")),
    Case("fused-same-axis-twice", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.stacked, c.m22,
                                                 ep_axis="tp", tp_axis="tp"), ConfigError,
         ("ep_axis and tp_axis", "'tp'")),
    Case("fused-ep-does-not-divide-experts", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m3),
         ShapeError, ("ep_axis", "8 experts", "size 3")),
    Case("fused-tp-axis-on-unstacked-layer", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.mt4,
                                                            ep_axis=None, tp_axis="tp"),
         ShapeError, ("weights.w13.qvalue", "TP axis of size 4", "(8, 4, 128)")),
    Case("fused-tp-stack-of-other-size", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.stacked, c.mt4,
                                                        ep_axis=None, tp_axis="tp"),
         ShapeError, ("TP axis of size 4", "(2, 8,")),
    # the weights
    Case("fused-weights-not-arrays", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, {"w": "packed"}, c.m8),
         ConfigError, ("weights", "dict")),
    Case("fused-weights-plain-dict", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids,
                                                    {"w13": np.zeros((E, 4), np.int32)}, c.m8),
         ConfigError, ("weights", "dict")),
    Case("fused-weights-layer-stack", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids,
                                                     layer_stack(jax.tree.map(lambda a: a[None], c.w), 0), c.m8),
         UnsupportedError, ("weights", "LayerStack")),
    Case("fused-weights-expert-counts-differ", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids,
                                                              _scales_of_7_experts(c), c.m8),
         ShapeError, ("weights.w2.scale", "8 experts", "(7, 2, 32)")),
    # the routing and the activations, as one-device fused_moe checks them
    Case("fused-ids-above-range", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids_with(E), c.w, c.m8),
         ValueRangeError, ("topk_ids", "[0, 8)", "8]")),
    Case("fused-ids-negative-all-to-all", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids_with(-1), c.w, c.m8,
                                                         ep_method="all_to_all"),
         ValueRangeError, ("topk_ids", "[0, 8)", "[-1,")),
    Case("fused-ids-beyond-int32-tp", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids_with(2**33, dtype=np.int64),
                                                     c.stacked, c.mt2, ep_axis=None, tp_axis="tp"),
         ValueRangeError, ("topk_ids", "8589934592")),
    Case("fused-ids-float", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids.astype(np.float32) + 0.5, c.w, c.m8),
         DTypeError, ("topk_ids", "float32")),
    Case("fused-ids-one-row-short", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids[:4], c.w, c.m8),
         ShapeError, ("topk_ids", "(4, 2)")),
    Case("fused-weights-integer", lambda c: call(sharded_fused_moe, c.x, c.ids, c.ids, c.w, c.m8),
         DTypeError, ("topk_weights", "int32")),
    Case("fused-weights-other-k", lambda c: call(sharded_fused_moe, c.x, c.tw[:, :1], c.ids, c.w, c.m8),
         ShapeError, ("topk_weights", "(5, 1)")),
    Case("fused-weights-a-list", lambda c: call(sharded_fused_moe, c.x, c.tw.tolist(), c.ids, c.w, c.m8),
         ShapeError, ("topk_weights", "got ()")),
    Case("fused-hidden-float64", lambda c: call(sharded_fused_moe, c.x.astype(np.float64), c.tw, c.ids, c.w, c.m8),
         DTypeError, ("hidden_states", "float64")),
    Case("fused-hidden-size", lambda c: call(sharded_fused_moe, c.x[:, :16], c.tw, c.ids, c.w, c.m8),
         ShapeError, ("hidden_states", "hidden size 32", "(5, 16)")),
    Case("fused-hidden-1d", lambda c: call(sharded_fused_moe, c.x[0], c.tw, c.ids, c.w, c.m8),
         ShapeError, ("hidden_states", "(32,)")),
    # the options
    Case("fused-activation", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8, activation="relu"),
         ConfigError, ("activation", "'relu'")),
    Case("fused-activation-unhashable", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8,
                                                       activation=["silu"]), ConfigError, ("activation", "['silu']")),
    Case("fused-ep-method", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8, ep_method="ring"),
         ConfigError, ("ep_method", "'ring'")),
    Case("fused-ragged", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8, ragged=["auto"]),
         ConfigError, ("ragged", "['auto']")),
    Case("fused-formulation", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8, formulation="sparse"),
         ConfigError, ("formulation", "'sparse'")),
    Case("fused-executor", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8, executor="fastest"),
         ConfigError, ("executor", "'fastest'")),
    Case("fused-router-weight-on-input-string", lambda c: call(sharded_fused_moe, c.x, c.tw, c.ids, c.w, c.m8,
                                                               apply_router_weight_on_input="no"),
         ConfigError, ("apply_router_weight_on_input", "'no'")),
    # sharded_executor, shard_weights
    Case("executor-mesh-none", lambda c: call(sharded_executor, c.w, None), ConfigError, ("mesh", "NoneType")),
    Case("executor-hidden-dtype-name", lambda c: call(sharded_executor, c.w, c.m8, hidden_dtype="float99"),
         DTypeError, ("hidden_dtype", "'float99'")),
    Case("executor-hidden-dtype-int", lambda c: call(sharded_executor, c.w, c.m8, hidden_dtype=np.int8),
         DTypeError, ("hidden_dtype", "int8")),
    Case("executor-device-string", lambda c: call(sharded_executor, c.w, c.m8, device="gpu"),
         ConfigError, ("device", "str")),
    Case("shard-mesh-none", lambda c: call(shard_weights, c.w, None), ConfigError, ("mesh", "NoneType")),
    Case("shard-ep-does-not-divide", lambda c: call(shard_weights, c.w, c.m3), ShapeError,
         ("ep_axis", "8 experts", "size 3")),
    Case("shard-axis-missing", lambda c: call(shard_weights, c.stacked, c.m8, ep_axis=None, tp_axis="tp"),
         ConfigError, ("tp_axis", "'tp'", "('ep',)")),
    # slice_tp, check_tp, stack_tp_shards, tp_shards_from_checkpoint
    Case("slice-rank-out-of-range", lambda c: call(slice_tp, c.w, 2, 2), ConfigError, ("tp_rank", "<= 1", "got 2")),
    Case("slice-size-bool", lambda c: call(slice_tp, c.w, True, 0), ConfigError, ("tp_size", "True")),
    Case("slice-size-string", lambda c: call(slice_tp, c.w, "2", 0), ConfigError, ("tp_size", "'2'")),
    Case("slice-does-not-divide-intermediate", lambda c: call(slice_tp, c.w, 3, 0), ShapeError,
         ("tp_size", "intermediate size 64", "size 3")),
    Case("slice-not-loader-layout", lambda c: call(slice_tp, {"w13": c.w.w13_qweight}, 2, 0), UnsupportedError,
         ("CheckpointWeights", "dict")),
    Case("check-tp-zero", lambda c: call(check_tp, 64, 0), ConfigError, ("tp_size", "got 0")),
    Case("check-tp-fraction", lambda c: call(check_tp, 64, 2.5), ConfigError, ("tp_size", "2.5")),
    Case("check-tp-group-zero", lambda c: call(check_tp, 64, 2, 8, 0), ConfigError, ("group_size", "0")),
    Case("check-tp-group-split", lambda c: call(check_tp, 64, 4, 8, 32), ShapeError,
         ("tp_size", "local intermediate size 16", "group size 32")),
    Case("stack-one-layout", lambda c: call(stack_tp_shards, c.w), ConfigError, ("shards", "CheckpointWeights")),
    Case("stack-empty", lambda c: call(stack_tp_shards, []), ConfigError, ("no shards",)),
    Case("stack-dtypes-differ", lambda c: call(stack_tp_shards, _shard_with_other_dtype(c)), DTypeError,
         ("shard 1.w13.scale", "float16", "float32")),
    Case("stack-shapes-differ", lambda c: call(stack_tp_shards, [{"a": np.zeros((E, 2))}, {"a": np.zeros((E, 3))}]),
         ShapeError, ("shard 1['a']", "(8, 2)", "(8, 3)")),
    Case("from-checkpoint-path", lambda c: call(tp_shards_from_checkpoint, "/no/such/ckpt", 0, 2), ConfigError,
         ("ckpt", "str")),
    Case("from-checkpoint-layer-bool", lambda c: call(tp_shards_from_checkpoint, c.ckpt, True, 2), ConfigError,
         ("layer_index", "True")),
    Case("from-checkpoint-size-zero", lambda c: call(tp_shards_from_checkpoint, c.ckpt, 0, 0), ConfigError,
         ("tp_size", "got 0")),
]


def _accepted(c: Ctx) -> dict[str, Any]:
    """The accepted sharded edge cases, measured: the output shapes and dtypes of calls without
    tokens or without slots, and NaN rows of out-of-range ids under ``jax.jit`` against the
    one-device result (which are NaN there too)."""
    out = {}
    x16 = c.x.astype(jnp.bfloat16)
    designs = {"allgather": (c.m8, c.w, {}), "all_to_all": (c.m8, c.w, {"ep_method": "all_to_all"}),
               "tp": (c.mt2, c.stacked, {"ep_axis": None, "tp_axis": "tp"}),
               "ep_x_tp": (c.m22, c.stacked, {"tp_axis": "tp"})}
    for name, (mesh, w, kw) in designs.items():
        y0 = sharded_fused_moe(x16[:0], c.tw[:0], c.ids[:0], w, mesh, **kw)
        out[f"no_tokens_{name}"] = [list(y0.shape), str(y0.dtype)]
        yk = sharded_fused_moe(c.x, c.tw[:, :0], c.ids[:, :0], w, mesh, **kw)
        out[f"no_slots_{name}"] = [list(yk.shape), str(yk.dtype), float(np.abs(np.asarray(yk)).max())]
    one0 = fused_moe(x16[:0], c.tw[:0], c.ids[:0], c.w)
    out["no_tokens_one_device"] = [list(one0.shape), str(one0.dtype)]
    onek = fused_moe(c.x, c.tw[:, :0], c.ids[:, :0], c.w)
    out["no_slots_one_device"] = [list(onek.shape), str(onek.dtype), float(np.abs(np.asarray(onek)).max())]

    wj = shard_weights(c.w, c.m8)
    bad = c.ids_with(E, -1)                              # tokens 1 and 3 hold an id outside [0, E)
    one = jax.jit(lambda x, tw, ids: fused_moe(x, tw, ids, c.w))
    ref_bad, ref = np.asarray(one(c.x, c.tw, bad)), np.asarray(one(c.x, c.tw, c.ids))
    out["traced_nan_rows_one_device"] = np.flatnonzero(np.isnan(ref_bad).any(axis=1)).tolist()

    def rel(y, r):
        y = np.asarray(y, np.float64)
        return float("inf") if not np.isfinite(y).all() else float(np.abs(y - r).max() / np.abs(r).max())
    for method in ("allgather", "all_to_all"):
        y = np.asarray(jax.jit(lambda x, tw, ids, m=method: sharded_fused_moe(x, tw, ids, wj, c.m8, ep_method=m))(
            c.x, c.tw, bad))
        rows = np.isnan(y).any(axis=1)
        out[f"traced_nan_rows_{method}"] = np.flatnonzero(rows).tolist()
        out[f"traced_nan_whole_rows_{method}"] = bool(np.isnan(y[rows]).all())
        out[f"traced_other_rows_{method}"] = rel(y[~rows], ref[~rows])
    y = sharded_fused_moe(c.x, c.tw, c.ids, c.w, c.m8, ep_axis=None)   # neither EP nor TP: replicated
    out["replicated"] = rel(y, ref)
    return out


def _run_sharding_cases(tmp: str) -> None:
    """The subprocess's entry point: every sharding case and the accepted calls, as JSON."""
    assert len(jax.devices()) == 8, jax.devices()
    seed = _seed()
    c = Ctx(seed, jax.devices(), tmp)
    res = {"seed": seed, "cases": {case.id: attempt(case, c) for case in SHARDING_CASES}}
    res["accepted"] = _accepted(c)
    print("RESULT " + json.dumps(res))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=8").strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_hostile_sharding as t; "
            "t._run_sharding_cases(sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tests"),
                           str(tmp_path_factory.mktemp("ckpt"))], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", SHARDING_CASES, ids=lambda case: case.id)
def test_sharding_refuses(sharded, case):
    check_refused(case, sharded["cases"][case.id])


def test_sharded_no_tokens_or_slots_as_one_device(sharded):
    """No tokens: ``[0, H]`` in the activations' dtype, as one-device ``fused_moe``; no slots
    (``k = 0``): zeros ``[T, H]``, as one-device ``fused_moe``, in every design."""
    a = sharded["accepted"]
    assert a["no_tokens_one_device"] == [[0, H], "bfloat16"]
    assert a["no_slots_one_device"] == [[T, H], "float32", 0.0]
    for name in ("allgather", "all_to_all", "tp", "ep_x_tp"):
        assert a[f"no_tokens_{name}"] == a["no_tokens_one_device"], (name, a[f"no_tokens_{name}"])
        assert a[f"no_slots_{name}"] == a["no_slots_one_device"], (name, a[f"no_slots_{name}"])


def test_sharded_traced_out_of_range_ids_give_nan_rows(sharded):
    """Under ``jax.jit`` the ids cannot be checked: the tokens holding an out-of-range id come out
    NaN (whole rows), exactly those one-device ``fused_moe`` makes NaN; the others are right."""
    a = sharded["accepted"]
    assert a["traced_nan_rows_one_device"] == [1, 3], a["traced_nan_rows_one_device"]
    for method in ("allgather", "all_to_all"):
        assert a[f"traced_nan_rows_{method}"] == [1, 3], (method, a[f"traced_nan_rows_{method}"])
        assert a[f"traced_nan_whole_rows_{method}"] is True, method
        err = a[f"traced_other_rows_{method}"]
        assert err <= TOL, f"{method}: relative error {err} (seed {sharded['seed']})"


def test_sharded_without_ep_or_tp_is_replicated(sharded):
    """Neither ``ep_axis`` nor ``tp_axis``: every device computes the whole layer (accepted)."""
    err = sharded["accepted"]["replicated"]
    assert err <= TOL, f"relative error {err} (seed {sharded['seed']})"


# --------------------------------------------------------------------------- serving cases

def _constant(value):
    """A routed 'layer' that returns ``value`` whatever it is given."""
    return lambda x, tw, ids: value


SERVING_CASES = [
    Case("bucket-size-string", lambda c: call(bucket_size, "5"), ConfigError, ("num_tokens", "'5'")),
    Case("bucket-size-fraction", lambda c: call(bucket_size, 2.7), ConfigError, ("num_tokens", "2.7")),
    Case("bucket-size-bool", lambda c: call(bucket_size, True), ConfigError, ("num_tokens", "True")),
    Case("bucket-size-none", lambda c: call(bucket_size, None), ConfigError, ("num_tokens", "None")),
    Case("bucket-size-negative", lambda c: call(bucket_size, -3), ShapeError, ("num_tokens", "-3")),
    Case("buckets-none", lambda c: call(bucket_size, 3, None), ConfigError, ("buckets", "NoneType")),
    Case("buckets-an-int", lambda c: call(bucket_size, 3, 16), ConfigError, ("buckets", "int")),
    Case("buckets-a-string", lambda c: call(bucket_size, 3, "16"), ConfigError, ("buckets", "str")),
    Case("buckets-bool-entry", lambda c: call(check_buckets, (True, 4)), ConfigError, ("buckets[0]", "True")),
    Case("buckets-decreasing", lambda c: call(check_buckets, [8, 4]), ConfigError, ("buckets", "(8, 4)")),
    Case("buckets-empty", lambda c: call(check_buckets, []), ConfigError, ("buckets", "none")),
    Case("buckets-used-an-int", lambda c: call(buckets_used, 5), ConfigError, ("token_counts", "int")),
    Case("buckets-used-string-entry", lambda c: call(buckets_used, [1, "x"]), ConfigError,
         ("token_counts[1]", "'x'")),
    Case("power-of-two-bool", lambda c: call(power_of_two_buckets, True), ConfigError, ("max_size", "True")),
    Case("power-of-two-not", lambda c: call(power_of_two_buckets, 100), ConfigError, ("max_size", "100")),
    Case("power-of-two-min-above-max", lambda c: call(power_of_two_buckets, 64, 128), ConfigError,
         ("min_size 128", "max_size 64")),
    Case("pad-rows-scalar", lambda c: call(pad_rows, np.float32(1.0), 3), ShapeError, ("a:", "()")),
    Case("pad-rows-count-string", lambda c: call(pad_rows, c.x, "8"), ConfigError, ("rows", "'8'")),
    Case("pad-rows-fewer", lambda c: call(pad_rows, c.x, 2), ShapeError, ("rows", "5 rows", "to 2")),
    Case("pad-rows-fraction-into-ints", lambda c: call(pad_rows, c.ids, 8, 0.5), ConfigError, ("fill", "0.5")),
    Case("pad-rows-fill-overflows-uint8", lambda c: call(pad_rows, c.ids.astype(np.uint8), 8, 300),
         ValueRangeError, ("fill", "300", "uint8")),
    Case("pad-rows-fill-nan", lambda c: call(pad_rows, c.x, 8, float("nan")), ConfigError, ("fill", "nan")),
    Case("pad-rows-fill-overflows-float16", lambda c: call(pad_rows, c.x.astype(np.float16), 8, 1e6),
         ValueRangeError, ("fill", "1000000.0", "float16")),
    Case("pad-tokens-fill-id-negative", lambda c: call(pad_tokens, c.x, c.tw, c.ids, 8, fill_id=-1), ConfigError,
         ("fill_id", "-1")),
    Case("pad-tokens-fill-id-beyond-int32", lambda c: call(pad_tokens, c.x, c.tw, c.ids, 8, fill_id=2**40),
         ValueRangeError, ("fill_id", "1099511627776", "int32")),
    Case("pad-tokens-fill-id-fraction", lambda c: call(pad_tokens, c.x, c.tw, c.ids, 8, fill_id=1.5), ConfigError,
         ("fill_id", "1.5")),
    Case("pad-tokens-bucket-fraction", lambda c: call(pad_tokens, c.x, c.tw, c.ids, 8.5), ConfigError,
         ("bucket", "8.5")),
    Case("pad-tokens-x-list", lambda c: call(pad_tokens, c.x.tolist(), c.tw, c.ids, 8), ShapeError, ("x:", "list")),
    Case("pad-tokens-weights-none", lambda c: call(pad_tokens, c.x, None, c.ids, 8), ShapeError,
         ("topk_weights", "NoneType")),
    Case("pad-tokens-counts-differ", lambda c: call(pad_tokens, c.x, c.tw[:4], c.ids, 8), ShapeError,
         ("disagree", "5, 4, 5")),
    Case("unpad-negative", lambda c: call(unpad_tokens, c.x, -2), ShapeError, ("num_tokens", "-2")),
    Case("unpad-more-than-rows", lambda c: call(unpad_tokens, c.x, 9), ShapeError, ("num_tokens", "9", "5 rows")),
    Case("unpad-fraction", lambda c: call(unpad_tokens, c.x, 2.5), ConfigError, ("num_tokens", "2.5")),
    Case("unpad-list", lambda c: call(unpad_tokens, [1.0, 2.0], 1), ShapeError, ("y:", "list")),
    Case("bucketed-fn-string", lambda c: call(BucketedMoE, "fused_moe"), ConfigError, ("fn", "str")),
    Case("bucketed-buckets-none", lambda c: call(BucketedMoE, fused_moe, None), ConfigError,
         ("buckets", "NoneType")),
    Case("bucketed-fill-id-string", lambda c: call(BucketedMoE, fused_moe, fill_id="0"), ConfigError,
         ("fill_id", "'0'")),
    Case("bucketed-fill-id-out-of-range", lambda c: call(BucketedMoE(fused_moe, fill_id=99), c.x, c.tw, c.ids, c.w),
         ValueRangeError, ("fill_id", "99", "[0, 8)", "3 padded rows")),
    Case("bucketed-3d-routed", lambda c: call(BucketedMoE(fused_moe), c.x[None], c.tw, c.ids, c.w), ShapeError,
         ("hidden_states", "(1, 5, 32)")),
    Case("bucketed-ids-without-weights", lambda c: call(BucketedMoE(fused_moe), c.x, None, c.ids, c.w), ConfigError,
         ("topk_weights and topk_ids",)),
    Case("bucketed-output-not-an-array", lambda c: call(BucketedMoE(_constant(3.0)), c.x, c.tw, c.ids), ShapeError,
         ("output", "float")),
    Case("bucketed-decorator-buckets", lambda c: call(bucketed, buckets=(0, 4)), ConfigError, ("buckets[0]", "0")),
    Case("bucketed-buckets-positional", lambda c: call(bucketed, (16, 64)), ConfigError, ("fn", "tuple")),
]


@pytest.fixture
def ctx():
    return Ctx(_seed())


@pytest.mark.parametrize("case", SERVING_CASES, ids=lambda case: case.id)
def test_serving_refuses(ctx, case):
    check_refused(case, attempt(case, ctx))


def test_real_ids_out_of_range_are_not_blamed_on_fill_id(ctx):
    """The layer refuses the real tokens' ids: the error stays the layer's (about topk_ids), even
    with a non-default fill id (here a valid one)."""
    bad = ctx.ids_with(E)
    case = Case("real-ids", lambda c: call(BucketedMoE(fused_moe, fill_id=E - 1), c.x, c.tw, bad, c.w),
                ValueRangeError, ("topk_ids", "[0, 8)"))
    got = attempt(case, ctx)
    check_refused(case, got)
    assert "fill_id" not in got["message"], got["message"]


def test_serving_accepts_edge_values(ctx):
    """Integral counts of other integer types and integral floats (as :func:`~wna16_jax.fields.check_int`
    reads them), fills at a dtype's limit, bool rows, zero rows and zero tokens."""
    assert bucket_size(np.int64(5)) == 8 and bucket_size(8.0) == 8 and bucket_size(0) == 1
    assert check_buckets(np.array([4, 16])) == (4, 16) and buckets_used([0, 3, np.int32(17)], (4, 16)) == (4, 32)
    assert power_of_two_buckets(8.0) == (1, 2, 4, 8)
    ids8 = ctx.ids.astype(np.uint8)
    xp, twp, idp = pad_tokens(ctx.x, ctx.tw, ids8, 8, fill_id=255)
    assert idp.dtype == np.uint8 and (idp[T:] == 255).all() and np.array_equal(idp[:T], ids8)
    assert (xp[T:] == 0).all() and (twp[T:] == 0).all() and np.array_equal(xp[:T], ctx.x)
    mask = pad_rows(np.ones((3, 2), bool), 4)
    assert mask.dtype == bool and mask[:3].all() and not mask[3].any()
    assert unpad_tokens(ctx.x, 0).shape == (0, H)
    # no tokens: the smallest bucket runs (padded rows only) and nothing comes back
    seen = []
    layer = BucketedMoE(lambda x, tw, ids: seen.append(x.shape) or x * 2, (4,), fill_id=E - 1)
    y = layer(ctx.x[:0], ctx.tw[:0], ctx.ids[:0])
    assert seen == [(4, H)] and y.shape == (0, H)
    y = layer(ctx.x, ctx.tw, ctx.ids)
    assert seen[-1] == (8, H) and np.array_equal(y, ctx.x * 2)


@pytest.mark.parametrize("spec,words", [
    ("tp", ["epN, tpN or epNxtpM", "'tp'"]), ("ep2tp2", ["'ep2tp2'"]), ("tp2xep2", ["'tp2xep2'"]),
    ("ep2x", ["'ep2x'"]), (" tp2", ["' tp2'"]), ("ep0", ["at least 1", "'ep0'"]), ("tp0", ["at least 1"]),
    ("ep1234567", ["'ep1234567'"]), (2, ["epN", "2"]), (None, ["epN", "None"]),
    ("ep4xtp2", ["needs 8 devices", "has 3"]),
])
def test_hostile_mesh_specs(spec, words):
    """``local_mesh`` (the command line's ``--mesh``): a spec outside ``epN`` / ``tpN`` /
    ``epNxtpM``, a size below 1 or more devices than given is a ConfigError naming the argument and
    the value; good specs give the axes in order, the size-1 ones left out."""
    from wna16_jax.models.mesh import local_mesh

    devices = [jax.devices()[0]] * 3
    with pytest.raises(ConfigError) as e:
        local_mesh(spec, devices, name="--mesh")
    assert str(e.value).startswith("--mesh: ") and all(w in str(e.value) for w in words), str(e.value)


def test_mesh_specs_give_their_axes():
    from wna16_jax.models.mesh import parse_mesh_spec

    assert [parse_mesh_spec(s) for s in ("tp2", "ep4", "ep4xtp2", "ep1xtp1")] == [(1, 2), (4, 1), (4, 2), (1, 1)]
