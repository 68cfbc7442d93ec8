"""Token-count buckets (wna16_jax.serving): bucket sizes, padding, pad-invariance of the real rows
against the unpadded call and a float64 reference, and the compile count of a serving loop over
every token count 1..300 (bounded by the buckets; unbucketed it grows with the token counts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import moe, routing
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.errors import ConfigError, ShapeError
from wna16_jax.nn import QuantizedMoE
from wna16_jax.schemes import QuantScheme
from wna16_jax.serving import (DEFAULT_BUCKETS, BucketedMoE, bucket_size, bucketed, buckets_used, count_compiles,
                               pad_rows, pad_tokens, power_of_two_buckets, unpad_tokens)

# sizes no other test file uses, so the compile counts below start from an empty cache
E, H, I, K = 6, 96, 32, 2
SCHEME = QuantScheme("awq", 4, 32, True)
N = 300


def _seed():
    return int(np.random.SeedSequence().entropy % (2**63))


@pytest.fixture(scope="module")
def layer():
    seed = _seed()
    rng = np.random.default_rng(seed)
    w = random_checkpoint_weights(rng, SCHEME, E, H, I, scale=0.05)
    r13, r2 = dequant_checkpoint(w, SCHEME)
    return seed, rng, w, w.to_jax(), r13, r2


def _routed(rng, t, e=E):
    """Fresh host inputs: ``x [t, H]`` float32 and routing from ``fused_topk`` as numpy arrays."""
    x = rng.standard_normal((t, H)).astype(np.float32)
    tw, ids = jax.jit(lambda lg: routing.fused_topk(lg, K, renormalize=True))(
        jnp.asarray(rng.standard_normal((t, e)), jnp.float32))
    return x, np.asarray(tw), np.asarray(ids)


def _close(got, ref, rtol, what):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), what
    err = np.abs(got - ref).max()
    assert err <= rtol * np.abs(ref).max(), f"{what}: max error {err:.3g}, max |ref| {np.abs(ref).max():.3g}"


# ----------------------------------------------------------------------------- bucket sizes


def test_bucket_sizes():
    assert DEFAULT_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert [bucket_size(t) for t in (0, 1, 2, 3, 5, 8, 9, 300, 512, 513, 1024, 1025)] == \
        [1, 1, 2, 4, 8, 8, 16, 512, 512, 1024, 1024, 1536]
    assert buckets_used(range(1, N + 1)) == DEFAULT_BUCKETS
    assert buckets_used(range(1, 2000)) == DEFAULT_BUCKETS + (1024, 1536, 2048)
    b = (16, 64, 256)
    assert [bucket_size(t, b) for t in (1, 16, 17, 64, 65, 256, 257, 600)] == [16, 16, 64, 64, 256, 256, 512, 768]
    assert buckets_used(range(1, N + 1), b) == (16, 64, 256, 512)
    for t in range(0, 3000, 7):
        s = bucket_size(t)
        assert s >= max(t, 1) and (s in DEFAULT_BUCKETS or s % 512 == 0)
    assert power_of_two_buckets(64, 8) == (8, 16, 32, 64)
    for bad in ((), (4, 4), (8, 2), (0, 2), (1.5,)):
        with pytest.raises(ConfigError, match="buckets"):
            bucket_size(3, bad)
    with pytest.raises(ConfigError, match="power of two"):
        power_of_two_buckets(100)
    with pytest.raises(ShapeError, match="num_tokens"):
        bucket_size(-1)


def test_pad_and_unpad():
    rng = np.random.default_rng(_seed())
    x, tw, ids = _routed(rng, 5)
    xp, twp, idp = pad_tokens(x, tw, ids, 8, fill_id=3)
    assert xp.shape == (8, H) and twp.shape == (8, K) and idp.shape == (8, K)
    assert xp.dtype == x.dtype and twp.dtype == tw.dtype and idp.dtype == ids.dtype
    np.testing.assert_array_equal(xp[:5], x)
    np.testing.assert_array_equal(twp[:5], tw)
    np.testing.assert_array_equal(idp[:5], ids)
    assert (xp[5:] == 0).all() and (twp[5:] == 0).all() and (idp[5:] == 3).all()
    # concrete JAX arrays pad on the host (numpy out); unpadding puts the rows back on the device
    xj = jnp.asarray(x, jnp.bfloat16)
    pj = pad_rows(xj, 8)
    assert isinstance(pj, np.ndarray) and pj.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pj[:5], np.float32), np.asarray(xj, np.float32))
    back = unpad_tokens(jnp.asarray(pj), 5)
    assert isinstance(back, jax.Array) and back.shape == (5, H)
    np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(xj, np.float32))
    assert pad_rows(x, 5) is x and unpad_tokens(xp, 8) is xp
    # traced arrays pad inside the trace
    f = jax.jit(lambda a, b, c: tuple(unpad_tokens(p, 5) for p in pad_tokens(a, b, c, 8)))
    for got, want in zip(f(x, tw, ids), (x, tw, ids)):
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ShapeError, match="bucket is smaller"):
        pad_tokens(x, tw, ids, 4)
    with pytest.raises(ShapeError, match="disagree"):
        pad_tokens(x, tw[:4], ids, 8)
    with pytest.raises(ConfigError, match="both"):
        BucketedMoE(moe.fused_moe)(x, tw)


# ----------------------------------------------------------------------------- pad-invariance


def _all_formulations(x, tw, ids, w):
    out = {f: moe.fused_moe(x, tw, ids, w, formulation=f, executor="xla") for f in moe.FORMULATIONS}
    out["blocked_bm16_on_input"] = moe.fused_moe(x, tw, ids, w, formulation="blocked", block_m=16, executor="xla",
                                                 apply_router_weight_on_input=True, activation="gelu_tanh")
    return out


_all_formulations_jit = jax.jit(_all_formulations)

# bit for bit against the unpadded call: the formulations whose per-row arithmetic has the same
# shapes at any token count (gather: one row at a time; blocked with a fixed block_m: the same
# [block_m, H] GEMMs, the same order of each token's slots). The others run GEMMs whose row count
# is the token count (dense) or a block_m chosen from it (blocked, default): XLA's CPU dot may then
# sum in another order: up to ~4e-7 of max|out| measured over 25 seeds (bound here 2e-6).
_BIT_EXACT = ("gather", "blocked_bm16_on_input")


def test_padded_rows_never_change_real_rows(layer):
    seed, rng, _, w, r13, r2 = layer
    t = 37
    x, tw, ids = _routed(rng, t)
    run = BucketedMoE(_all_formulations_jit)
    b = run.bucket(t)
    assert b == 64
    got = run(x, tw, ids, w)
    plain = _all_formulations_jit(x, tw, ids, w)
    # padded rows holding anything (random states, router weights, expert ids): the same program,
    # and the real rows are identical bit for bit
    xg, twg, idg = pad_tokens(x, tw, ids, b)
    xg[t:] = rng.standard_normal((b - t, H)) * 100
    twg[t:] = rng.random((b - t, K))
    idg[t:] = rng.integers(0, E, (b - t, K))
    garbage = _all_formulations_jit(xg, twg, idg, w)
    refs = {False: fused_moe_ref(x, tw, ids, r13, r2),
            True: fused_moe_ref(x, tw, ids, r13, r2, activation="gelu_tanh", on_input=True)}
    for name in got:
        what = f"{name} T={t} bucket={b} seed={seed}"
        g = np.asarray(got[name])
        assert g.shape == (t, H), what
        _close(g, refs[name.endswith("on_input")], 2e-5, what + " vs float64")
        np.testing.assert_array_equal(g, np.asarray(garbage[name])[:t], err_msg=what + " zero vs random padding")
        if name in _BIT_EXACT:
            np.testing.assert_array_equal(g, np.asarray(plain[name]), err_msg=what + " vs unpadded")
        else:
            _close(g, np.asarray(plain[name], np.float64), 2e-6, what + " vs unpadded")


# ----------------------------------------------------------------------------- compile counts


def test_compile_count_bounded_over_1_to_300_tokens(layer):
    """A serving loop over every token count 1..300 compiles one program per bucket it reaches;
    the same calls unbucketed compile one program per token count."""
    seed, rng, _, w, r13, r2 = layer
    x, tw, ids = _routed(rng, N)
    ref = fused_moe_ref(x, tw, ids, r13, r2)              # rows are independent: ref[:t] for every t
    buckets = (16, 64, 256)                               # 1..300 -> 16, 64, 256, 512
    used = buckets_used(range(1, N + 1), buckets)
    run = bucketed(moe.fused_moe, buckets=buckets)
    cache0 = moe._fused_moe_jit._cache_size()
    with count_compiles() as c:
        for t in range(1, N + 1):
            got = run(x[:t], tw[:t], ids[:t], w, formulation="dense")
            assert isinstance(got, jax.Array) and got.shape == (t, H)
            if t in (1, 2, 15, 16, 17, 64, 100, 256, 257, N):
                _close(got, ref[:t], 2e-5, f"bucketed T={t} seed={seed}")
    programs = moe._fused_moe_jit._cache_size() - cache0
    print(f"bucketed 1..{N}: {c.count} compilations, {programs} fused_moe programs, buckets {used}")
    assert len(used) == 4 and 1 <= c.count <= len(used) and programs <= len(used)
    _close(got, ref, 2e-5, f"bucketed T={N} seed={seed}")
    # the same loop again compiles nothing
    with count_compiles() as again:
        for t in (1, 7, 64, 199, N):
            run(x[:t], tw[:t], ids[:t], w, formulation="dense")
    assert again.count == 0
    # without bucketing every new token count is a new program (three fresh counts here)
    fresh = (5, 6, 7)
    with count_compiles() as plain:
        for t in fresh:
            _close(moe.fused_moe(x[:t], tw[:t], ids[:t], w, formulation="dense"), ref[:t], 2e-5, f"plain T={t}")
    assert plain.count == len(fresh), plain.count


def test_bucketed_quantized_moe(layer):
    """A QuantizedMoE (routes itself) bucketed over every token count 1..300: one nnx.jit
    program per bucket, each output against the float64 reference on the model's routing; a
    ``[B, S, H]`` input is bucketed on B·S tokens."""
    seed, rng, w_np, _, r13, r2 = layer
    router = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)
    model = QuantizedMoE(w_np, router, routing.MoERouting(top_k=K), formulation="dense")
    x = rng.standard_normal((N, H)).astype(np.float32)
    tw, ids = jax.jit(model.route)(jnp.asarray(x))
    ref = fused_moe_ref(x, np.asarray(tw), np.asarray(ids), r13, r2)
    buckets = (32, 128)                                   # 1..300 -> 32, 128, 256, 384
    used = buckets_used(range(1, N + 1), buckets)
    run = BucketedMoE(model, buckets)
    with count_compiles() as c:
        for t in range(1, N + 1):
            got = run(x[:t])
            assert got.shape == (t, H)
            if t in (1, 31, 32, 33, 200, N):
                _close(got, ref[:t], 2e-5, f"model T={t} seed={seed}")
    print(f"QuantizedMoE 1..{N}: {c.count} compilations, buckets {used}")
    assert len(used) == 4 and 1 <= c.count <= len(used)
    _close(got, ref, 2e-5, f"model T={N} seed={seed}")
    y3 = run(x[:30].reshape(3, 10, H))                    # 30 tokens: the 32-row program
    assert y3.shape == (3, 10, H)
    _close(y3.reshape(30, H), ref[:30], 2e-5, f"model [3, 10, H] seed={seed}")


def test_bucketed_inside_jit(layer):
    """Inside a jit trace the padding and the slice are traced operations."""
    seed, rng, _, w, r13, r2 = layer
    x, tw, ids = _routed(rng, 11)
    run = BucketedMoE(moe.fused_moe)
    got = jax.jit(lambda x, tw, ids: run(x, tw, ids, w, activation="gelu", formulation="dense"))(x, tw, ids)
    assert got.shape == (11, H)
    _close(got, fused_moe_ref(x, tw, ids, r13, r2, activation="gelu"), 2e-5, f"traced seed={seed}")
