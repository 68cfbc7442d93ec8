"""Tests of wna16_jax.routing against independent float64 / pure-Python references.

Every call under test is jit-compiled. Shapes come from small fixed menus (so the number of
compilations stays bounded); values are fresh random draws from a hypothesis-chosen seed.
Top-k checks tolerate near-ties: a chosen expert only has to be a valid top-k member of the
float64 reference up to a tiny tolerance, and weights are compared per chosen expert.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wna16_jax.errors import ConfigError, DTypeError, ShapeError, ValueRangeError, WNA16Error
from wna16_jax.routing import (
    AlignedBlocks,
    BatchedTokens,
    MoERouting,
    _moe_align,
    align_method,
    batched_moe_align_block_size,
    batched_overflow,
    combine_batched,
    determine_expert_map,
    dispatch_batched,
    fused_topk,
    grouped_topk,
    moe_align_block_size,
)

SEEDS = st.integers(0, 2**63 - 1)
RTOL = 1e-6
ATOL = 1e-7
TIE_TOL = 1e-6

J_FUSED = jax.jit(fused_topk, static_argnames=("topk", "renormalize", "scoring_func"))
J_GROUPED = jax.jit(
    grouped_topk,
    static_argnames=(
        "topk",
        "renormalize",
        "num_expert_group",
        "topk_group",
        "scoring_func",
    ),
)
J_ALIGN = jax.jit(
    moe_align_block_size, static_argnames=("block_size", "num_experts", "ignore_invalid_experts", "method")
)
J_DISPATCH = jax.jit(
    dispatch_batched,
    static_argnames=("num_experts", "max_tokens_per_expert", "num_local_experts"),
)
J_COMBINE = jax.jit(combine_batched, static_argnames=("num_tokens",))
J_OVERFLOW = jax.jit(batched_overflow)
J_BALIGN = jax.jit(
    batched_moe_align_block_size, static_argnames=("max_tokens_per_expert", "block_size")
)


# --------------------------------------------------------------------------------------------
# float64 / pure-Python references
# --------------------------------------------------------------------------------------------


def ref_scores(logits: np.ndarray, scoring_func: str) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    if scoring_func == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-x))


def kth_largest(values, k: int) -> float:
    return sorted(values, reverse=True)[k - 1]


def check_topk_row(ids_row, weights_row, choice_row, weight_row_ref, eligible, k, renorm, scale):
    """One token: ids are k distinct eligible experts forming a top-k of ``choice_row`` over
    ``eligible`` (up to TIE_TOL), and weights equal the reference weights of those ids."""
    ids_row = [int(i) for i in ids_row]
    assert len(set(ids_row)) == k, ids_row
    assert all(i in eligible for i in ids_row), (ids_row, sorted(eligible))
    thr = kth_largest([choice_row[e] for e in eligible], k)
    for i in ids_row:
        assert choice_row[i] >= thr - TIE_TOL, (i, choice_row[i], thr)
    # descending selection order
    sel = [choice_row[i] for i in ids_row]
    assert all(a >= b - TIE_TOL for a, b in zip(sel, sel[1:])), sel
    want = np.array([weight_row_ref[i] for i in ids_row])
    if renorm:
        want = want / want.sum()
    want = want * scale
    np.testing.assert_allclose(weights_row, want, rtol=RTOL, atol=ATOL)


def ref_max_padded(n: int, bs: int, num_experts: int) -> int:
    size = n + num_experts * (bs - 1) if n >= num_experts else n * bs
    return int(math.ceil(size / bs) * bs)


def ref_align(flat_keys, num_buckets, bs, max_padded, sentinel):
    """Python loops: per bucket, ascending flat ids, padded with the sentinel to whole blocks."""
    sorted_ids, experts = [], []
    for e in range(num_buckets):
        rows = [i for i, key in enumerate(flat_keys) if key == e]
        if not rows:
            continue
        nb = -(-len(rows) // bs)
        rows = rows + [sentinel] * (nb * bs - len(rows))
        sorted_ids += rows
        experts += [e] * nb
    post = len(sorted_ids)
    sorted_ids += [sentinel] * (max_padded - post)
    experts += [-1] * (max_padded // bs - len(experts))
    return np.array(sorted_ids, np.int64), np.array(experts, np.int64), post


def random_topk_ids(rng, T, k, E, skew):
    """Each row holds k distinct experts; with ``skew`` they come from a small subset."""
    pool = np.arange(E) if not skew else rng.choice(E, size=max(k, E // 4), replace=False)
    return np.stack([rng.choice(pool, size=k, replace=False) for _ in range(T)]).astype(np.int32)


def random_expert_map(rng, E, n_local=None):
    """A random subset of experts (>= 1) with local indices in a random order."""
    if n_local is None:
        n_local = int(rng.integers(1, E + 1))
    owned = rng.choice(E, size=n_local, replace=False)
    em = np.full(E, -1, np.int32)
    em[owned] = rng.permutation(n_local).astype(np.int32)
    return n_local, em


# --------------------------------------------------------------------------------------------
# fused_topk
# --------------------------------------------------------------------------------------------

FUSED_CONFIGS = [(1, 4, 1), (7, 8, 2), (16, 64, 6), (5, 60, 8), (3, 16, 16)]


@given(
    cfg=st.sampled_from(FUSED_CONFIGS),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renorm=st.booleans(),
    seed=SEEDS,
)
def test_fused_topk_matches_reference(cfg, scoring, renorm, seed):
    T, E, k = cfg
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, E)) * rng.uniform(0.5, 4.0)).astype(np.float32)
    w, ids = J_FUSED(logits, topk=k, renormalize=renorm, scoring_func=scoring)
    assert w.shape == (T, k) and w.dtype == jnp.float32
    assert ids.shape == (T, k) and ids.dtype == jnp.int32
    w, ids = np.asarray(w), np.asarray(ids)
    s = ref_scores(logits, scoring)
    for t in range(T):
        check_topk_row(ids[t], w[t], s[t], s[t], set(range(E)), k, renorm, 1.0)
    if renorm:
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_fused_topk_bf16_input_computed_in_float32():
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.standard_normal((6, 32)), jnp.bfloat16)
    w, ids = J_FUSED(logits, topk=4, renormalize=False, scoring_func="softmax")
    assert w.dtype == jnp.float32
    s = ref_scores(np.asarray(logits.astype(jnp.float32)), "softmax")
    for t in range(6):
        check_topk_row(np.asarray(ids[t]), np.asarray(w[t]), s[t], s[t], set(range(32)), 4,
                       False, 1.0)


# --------------------------------------------------------------------------------------------
# grouped_topk
# --------------------------------------------------------------------------------------------

# (T, E, num_expert_group, topk_group, topk)
GROUPED_CONFIGS = [(4, 8, 4, 2, 2), (9, 64, 8, 4, 8), (5, 16, 16, 3, 3), (6, 32, 4, 1, 4),
                   (3, 12, 3, 3, 12)]


def ref_group_scores(choice_row, scores_row, G, gs, has_bias):
    out = []
    for g in range(G):
        members = range(g * gs, (g + 1) * gs)
        if has_bias:
            out.append(sum(sorted((choice_row[e] for e in members), reverse=True)[:2]))
        else:
            out.append(max(scores_row[e] for e in members))
    return out


@given(
    cfg=st.sampled_from(GROUPED_CONFIGS),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renorm=st.booleans(),
    use_bias=st.booleans(),
    scale=st.sampled_from([1.0, 2.5]),
    seed=SEEDS,
)
def test_grouped_topk_matches_reference(cfg, scoring, renorm, use_bias, scale, seed):
    T, E, G, TG, k = cfg
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, E)) * 2.0).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32) if use_bias else None
    w, ids = J_GROUPED(
        logits, topk=k, renormalize=renorm, num_expert_group=G, topk_group=TG,
        scoring_func=scoring, e_score_correction_bias=bias, routed_scaling_factor=scale,
    )
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32 and ids.shape == (T, k)
    w, ids = np.asarray(w), np.asarray(ids)
    s = ref_scores(logits, scoring)
    c = s + bias.astype(np.float64) if use_bias else s
    gsize = E // G
    for t in range(T):
        gscore = ref_group_scores(c[t], s[t], G, gsize, use_bias)
        order = sorted(range(G), key=lambda g: -gscore[g])
        thr = gscore[order[TG - 1]]
        ambiguous = TG < G and thr - gscore[order[TG]] < TIE_TOL
        if ambiguous:  # near-tie between groups: only check group validity and weights
            assert all(gscore[int(i) // gsize] >= thr - TIE_TOL for i in ids[t])
            want = s[t][ids[t]]
            want = (want / want.sum() if renorm else want) * scale
            np.testing.assert_allclose(w[t], want, rtol=RTOL, atol=ATOL)
            continue
        kept = set(order[:TG])
        eligible = {e for e in range(E) if e // gsize in kept}
        check_topk_row(ids[t], w[t], c[t], s[t], eligible, k, renorm, scale)


def test_grouped_topk_bias_selects_but_weights_are_unbiased():
    rng = np.random.default_rng()
    T, E = 4, 16
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[:, 5] = -8.0  # a tiny score for expert 5 ...
    bias = np.zeros(E, np.float32)
    bias[5] = 10.0  # ... that the bias forces into the selection (and its group into the top)
    w, ids = J_GROUPED(logits, topk=2, renormalize=False, num_expert_group=4, topk_group=2,
                       scoring_func="sigmoid", e_score_correction_bias=bias)
    w, ids = np.asarray(w), np.asarray(ids)
    s = ref_scores(logits, "sigmoid")
    assert (ids[:, 0] == 5).all()
    np.testing.assert_allclose(w[:, 0], s[:, 5], rtol=RTOL, atol=ATOL)
    assert (w[:, 0] < 1e-3).all()


def test_grouped_topk_one_group_equals_fused_topk():
    rng = np.random.default_rng()
    logits = rng.standard_normal((8, 24)).astype(np.float32)
    wg, ig = J_GROUPED(logits, topk=3, renormalize=True, num_expert_group=1, topk_group=1)
    wf, iff = J_FUSED(logits, topk=3, renormalize=True)
    np.testing.assert_array_equal(np.asarray(ig), np.asarray(iff))
    np.testing.assert_allclose(np.asarray(wg), np.asarray(wf), rtol=RTOL)


# --------------------------------------------------------------------------------------------
# moe_align_block_size
# --------------------------------------------------------------------------------------------

# (T, k, E, block_size); several have T*k < E
ALIGN_CONFIGS = [(1, 1, 4, 1), (3, 2, 16, 4), (2, 2, 64, 16), (16, 4, 8, 4), (33, 2, 8, 16),
                 (40, 6, 24, 3), (64, 8, 64, 8),
                 (300, 2, 8, 16), (130, 8, 32, 8)]    # 3 and 5 chunks of 256 (rank; auto: compare, rank)


def check_blocks_belong(aligned: AlignedBlocks, flat_owner, n, bs):
    """Every used block's non-sentinel rows belong to its expert; each valid id once."""
    sid = np.asarray(aligned.sorted_token_ids)
    eids = np.asarray(aligned.expert_ids)
    post = int(np.asarray(aligned.num_tokens_post_padded)[0])
    assert post % bs == 0
    for b in range(post // bs):
        rows = sid[b * bs:(b + 1) * bs]
        real = rows[rows < n]
        assert real.size > 0, f"block {b} is empty"
        for i in real:
            assert flat_owner[int(i)] == eids[b], (b, int(i), flat_owner[int(i)], eids[b])
    assert (sid[post:] == n).all()
    assert (eids[post // bs:] == -1).all()


@settings(max_examples=min(settings().max_examples, 100))   # each new static shape / method compiles; 100 cover the 9 shapes many times
@given(
    cfg=st.sampled_from(ALIGN_CONFIGS),
    mode=st.sampled_from(["none", "legacy", "ignore"]),
    skew=st.booleans(),
    seed=SEEDS,
    method=st.sampled_from(["auto", "sort", "compare", "rank"]),
)
def test_moe_align_matches_brute_force(cfg, mode, skew, seed, method):
    T, k, E, bs = cfg
    rng = np.random.default_rng(seed)
    ids = random_topk_ids(rng, T, k, E, skew)
    ids_copy = ids.copy()
    n = T * k
    flat = [int(x) for x in ids.reshape(-1)]
    max_padded = ref_max_padded(n, bs, E)
    if mode == "none":
        out = J_ALIGN(ids, block_size=bs, num_experts=E, method=method)
        want_ids, want_eids, want_post = ref_align(flat, E, bs, max_padded, n)
        owner = flat
    else:
        _, em = random_expert_map(rng, E)
        em_copy = em.copy()
        ignore = mode == "ignore"
        out = J_ALIGN(ids, expert_map=em, block_size=bs, num_experts=E,
                      ignore_invalid_experts=ignore, method=method)
        if ignore:
            keys = [int(em[x]) for x in flat]  # -1 never matches a bucket
            want_ids, want_eids, want_post = ref_align(keys, E, bs, max_padded, n)
            owner = keys
        else:
            want_ids, want_eids, want_post = ref_align(flat, E, bs, max_padded, n)
            want_eids = np.array([em[e] if e >= 0 else -1 for e in want_eids])
            owner = [int(em[x]) for x in flat]
        np.testing.assert_array_equal(em, em_copy)
    np.testing.assert_array_equal(ids, ids_copy)
    assert isinstance(out, AlignedBlocks)
    assert out.block_size == bs and out.num_valid_tokens == n
    assert out.sorted_token_ids.shape == (max_padded,)
    assert out.expert_ids.shape == (max_padded // bs,)
    assert out.num_tokens_post_padded.shape == (1,)
    for a in (out.sorted_token_ids, out.expert_ids, out.num_tokens_post_padded):
        assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out.sorted_token_ids), want_ids)
    np.testing.assert_array_equal(np.asarray(out.expert_ids), want_eids)
    assert int(out.num_tokens_post_padded[0]) == want_post
    if mode != "legacy":
        check_blocks_belong(out, owner, n, bs)
    else:  # legacy: local blocks carry local ids, the rest -1; rows still grouped by expert
        sid, eids = np.asarray(out.sorted_token_ids), np.asarray(out.expert_ids)
        for b in range(want_post // bs):
            real = sid[b * bs:(b + 1) * bs]
            real = real[real < n]
            assert all(owner[int(i)] == eids[b] for i in real)
            assert len({flat[int(i)] for i in real}) == 1


_J_ROWS = jax.jit(functools.partial(_moe_align, with_rows=True),
                 static_argnames=("block_size", "num_experts", "ignore_invalid_experts", "method"))


@settings(max_examples=min(settings().max_examples, 100))   # each new static shape / method compiles; 100 cover the 9 shapes many times
@given(cfg=st.sampled_from(ALIGN_CONFIGS), ignore=st.booleans(), bad=st.booleans(), seed=SEEDS,
       method=st.sampled_from(["compare", "rank"]))
def test_moe_align_compare_rows_invert_the_order(cfg, ignore, bad, seed, method):
    """``method="compare"`` and ``"rank"`` also return each routed slot's padded row: exactly the
    inverse of ``sorted_token_ids`` on the slots that have a row, ``max_padded`` on the others (ids
    out of range under jit, non-local experts in ``ignore`` mode); the other methods return none."""
    T, k, E, bs = cfg
    rng = np.random.default_rng(seed)
    ids = random_topk_ids(rng, T, k, E, False)
    if bad:
        ids[rng.random((T, k)) < 0.2] = E + 3
    em = random_expert_map(rng, E)[1] if ignore else None
    out, rows = _J_ROWS(jnp.asarray(ids), block_size=bs, num_experts=E, expert_map=em, ignore_invalid_experts=ignore,
                        method=method)
    sid, rows, n = np.asarray(out.sorted_token_ids), np.asarray(rows), T * k
    assert rows.shape == (n,) and rows.dtype == np.int32
    want = np.full(n, out.max_padded)
    hit = np.nonzero(sid < n)[0]
    want[sid[hit]] = hit
    np.testing.assert_array_equal(rows, want)
    assert _moe_align(jnp.asarray(np.clip(ids, 0, E - 1)), bs, E, method="sort", with_rows=True)[1] is None


@pytest.mark.parametrize("method", ["compare", "rank"])
def test_moe_align_rows_are_materialized(method):
    """The pair rows of "compare" and "rank" sit behind an optimization barrier: left to XLA they
    fused, with their cumulative sums, into each consumer — the GPU layer's top-k sum recomputed
    them for every output element (142.5 µs of a 352 µs Qwen3 512-token layer; 6.5 once materialized,
    docs/journal/notes.md v21)."""
    ids = jax.ShapeDtypeStruct((64, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda i: _moe_align(i, 16, 128, method=method, with_rows=True))(ids)
    assert "optimization_barrier" in str(jaxpr)


def test_moe_align_auto_compares_where_timed():
    """``"auto"`` compares (its rows come back) up to 1024 routed pairs while the inverse's padded
    rows × pairs stay within ``COMPARE_MAX_WORK`` — Qwen3 128 tokens in 16-row blocks (1024 pairs,
    2944 rows), the largest case timed — and beyond either bound sorts (below 1024 pairs) or ranks."""
    from wna16_jax.routing import COMPARE_MAX_WORK

    def rows(t, k, e, bs):
        ids = jnp.asarray(np.random.default_rng().integers(0, e, (t, k)), jnp.int32)
        return jax.eval_shape(lambda i: _moe_align(i, bs, e, with_rows=True)[1], ids)

    assert rows(128, 8, 128, 16) is not None and rows(4, 2, 8, 8) is not None
    assert rows(129, 8, 128, 16) is not None                   # 1032 pairs: ranked (rows too)
    # 1024 pairs on 256 experts in 128-row blocks: 33 536 padded rows
    assert (1024 + 256 * 127) * 1024 > COMPARE_MAX_WORK and rows(128, 8, 256, 128) is not None   # ranked
    assert rows(125, 8, 256, 128) is None                      # 1000 pairs: sorted (no rows)
    cases = ((1024, 16, 128), (1032, 16, 128), (1024, 128, 256), (1000, 128, 256))
    assert [align_method(n, bs, e) for n, bs, e in cases] == ["compare", "rank", "rank", "sort"]
    assert align_method(8, 8, 8, "sort") == "sort"
    with pytest.raises(ConfigError, match="radix"):
        align_method(8, 8, 8, "radix")


def test_moe_align_is_a_pytree():
    ids = np.random.default_rng().integers(0, 8, (5, 2)).astype(np.int32)
    out = J_ALIGN(ids, block_size=4, num_experts=8)
    leaves, treedef = jax.tree_util.tree_flatten(out)
    assert len(leaves) == 3
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.block_size == 4 and back.num_valid_tokens == 10
    with pytest.raises(Exception):
        out.block_size = 8  # frozen


def test_moe_align_out_of_range_under_jit_is_skipped():
    rng = np.random.default_rng()
    T, k, E, bs = 16, 4, 8, 4
    for mode, method in [(m, a) for m in ("none", "legacy", "ignore") for a in ("sort", "compare", "rank")]:
        ids = random_topk_ids(rng, T, k, E, False)
        bad = rng.random((T, k)) < 0.2
        ids[bad] = rng.choice([-3, -1, E, E + 5, 1000], size=int(bad.sum()))
        n = T * k
        flat = [int(x) for x in ids.reshape(-1)]
        valid_keys = [x if 0 <= x < E else -1 for x in flat]
        max_padded = ref_max_padded(n, bs, E)
        if mode == "none":
            out = J_ALIGN(ids, block_size=bs, num_experts=E, method=method)
            want_ids, want_eids, _ = ref_align(valid_keys, E, bs, max_padded, n)
        else:
            _, em = random_expert_map(rng, E)
            out = J_ALIGN(ids, expert_map=em, block_size=bs, num_experts=E,
                          ignore_invalid_experts=mode == "ignore", method=method)
            if mode == "ignore":
                keys = [int(em[x]) if x >= 0 else -1 for x in valid_keys]
                want_ids, want_eids, _ = ref_align(keys, E, bs, max_padded, n)
            else:
                want_ids, want_eids, _ = ref_align(valid_keys, E, bs, max_padded, n)
                want_eids = np.array([em[e] if e >= 0 else -1 for e in want_eids])
        np.testing.assert_array_equal(np.asarray(out.sorted_token_ids), want_ids)
        np.testing.assert_array_equal(np.asarray(out.expert_ids), want_eids)


def test_moe_align_eager_concrete_matches_jit():
    ids = np.random.default_rng().integers(0, 16, (9, 3)).astype(np.int32)
    a = moe_align_block_size(ids, 4, 16)
    b = J_ALIGN(ids, block_size=4, num_experts=16)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------------------------
# batched-experts form
# --------------------------------------------------------------------------------------------

# (T, k, E, H, capacity)
BATCHED_CONFIGS = [(1, 1, 4, 8, 1), (12, 2, 8, 16, 12), (20, 4, 16, 8, 20), (9, 3, 64, 4, 3)]


def ref_dispatch(ids, E_local, local_of):
    """Per-expert lists of flat ids (ascending), from a Python loop over tokens."""
    lists = [[] for _ in range(E_local)]
    for i, x in enumerate(ids.reshape(-1)):
        le = local_of(int(x))
        if le >= 0:
            lists[le].append(i)
    return lists


@given(
    cfg=st.sampled_from(BATCHED_CONFIGS),
    use_map=st.booleans(),
    skew=st.booleans(),
    seed=SEEDS,
)
def test_dispatch_combine_round_trip(cfg, use_map, skew, seed):
    T, k, E, H, cap = cfg
    rng = np.random.default_rng(seed)
    ids = random_topk_ids(rng, T, k, E, skew)
    hidden = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    weights = ref_scores(logits, "softmax")[np.arange(T)[:, None], ids].astype(np.float32)
    if use_map:
        # the local count is static (it sizes the output): take it from a small menu
        E_local, em = random_expert_map(rng, E, int(rng.choice([max(1, E // 2), E])))
        local_of = lambda x: int(em[x])  # noqa: E731
        batched = J_DISPATCH(hidden, ids, expert_map=em, num_experts=E,
                             max_tokens_per_expert=cap, num_local_experts=E_local)
    else:
        E_local, em = E, None
        local_of = lambda x: x  # noqa: E731
        batched = J_DISPATCH(hidden, ids, num_experts=E, max_tokens_per_expert=cap)
    n = T * k
    lists = ref_dispatch(ids, E_local, local_of)
    assert isinstance(batched, BatchedTokens)
    assert batched.hidden_states.shape == (E_local, cap, H)
    assert batched.hidden_states.dtype == jnp.float32
    assert batched.token_index.shape == (E_local, cap) and batched.token_index.dtype == jnp.int32
    assert batched.expert_num_tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(batched.expert_num_tokens), [len(x) for x in lists])
    tok = np.asarray(batched.token_index)
    bh = np.asarray(batched.hidden_states)
    for e in range(E_local):
        kept = lists[e][:cap]
        np.testing.assert_array_equal(tok[e, :len(kept)], kept)
        assert (tok[e, len(kept):] == n).all()
        for r, i in enumerate(kept):
            np.testing.assert_array_equal(bh[e, r], hidden[i // k])
        assert (bh[e, len(kept):] == 0).all()
    overflow = any(len(x) > cap for x in lists)
    assert bool(J_OVERFLOW(batched)) == overflow

    # per-expert linear "experts" and the combine vs a per-token float64 loop
    Hout = 5
    W = rng.standard_normal((E_local, H, Hout)).astype(np.float32)
    outs = jnp.einsum("emh,eho->emo", batched.hidden_states, W,
                      precision=jax.lax.Precision.HIGHEST)
    got = np.asarray(J_COMBINE(outs, batched, weights, num_tokens=T))
    assert got.shape == (T, Hout) and got.dtype == np.float32
    want = np.zeros((T, Hout))
    kept_ids = {i for e in range(E_local) for i in lists[e][:cap]}
    for t in range(T):
        for j in range(k):
            le = local_of(int(ids[t, j]))
            if le >= 0 and t * k + j in kept_ids:
                want[t] += float(weights[t, j]) * (hidden[t].astype(np.float64) @ W[le])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # identity experts + renormalized weights + every expert local: combine gives hidden back
    if not use_map and not overflow:
        wn = weights / weights.sum(-1, keepdims=True)
        back = np.asarray(J_COMBINE(batched.hidden_states, batched, wn, num_tokens=T))
        np.testing.assert_allclose(back, hidden, rtol=1e-5, atol=1e-6)


def test_dispatch_overflow_concrete_raises_and_jit_drops():
    rng = np.random.default_rng()
    T, k, E, cap = 10, 2, 4, 3
    ids = random_topk_ids(rng, T, k, E, False)  # 20 slots over 4 experts: some expert has > 3
    hidden = rng.standard_normal((T, 6)).astype(np.float32)
    with pytest.raises(ValueRangeError, match="max_tokens_per_expert"):
        dispatch_batched(hidden, ids, E, cap)
    batched = J_DISPATCH(hidden, ids, num_experts=E, max_tokens_per_expert=cap)
    assert bool(J_OVERFLOW(batched))
    counts = np.bincount(ids.reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(batched.expert_num_tokens), counts)
    lists = ref_dispatch(ids, E, lambda x: x)
    for e in range(E):
        np.testing.assert_array_equal(np.asarray(batched.token_index[e]),
                                      (lists[e][:cap] + [T * k] * cap)[:cap])
    # no overflow with enough capacity, eager (concrete) call
    ok = dispatch_batched(hidden, ids, E, T)
    assert not bool(batched_overflow(ok))


def test_dispatch_eager_map_infers_local_count_and_garbage_rows_ignored():
    rng = np.random.default_rng()
    T, k, E = 6, 2, 8
    ids = random_topk_ids(rng, T, k, E, False)
    n_local, em = determine_expert_map(2, 1, E, "round_robin")
    b = dispatch_batched(rng.standard_normal((T, 4)).astype(np.float32), ids, E, T * k, em)
    assert b.num_local_experts == n_local == 4
    outs = np.asarray(b.hidden_states).copy()
    outs[np.asarray(b.token_index) == T * k] = np.nan  # unused rows must not leak into out
    w = rng.random((T, k)).astype(np.float32)
    got = np.asarray(J_COMBINE(jnp.asarray(outs), b, w, num_tokens=T))
    assert np.isfinite(got).all()


# (E_local, max_tokens_per_expert, block_size)
BATCHED_ALIGN_CONFIGS = [(1, 1, 1), (1, 5, 4), (3, 16, 4), (3, 5, 16), (8, 16, 16), (8, 7, 3)]


@given(cfg=st.sampled_from(BATCHED_ALIGN_CONFIGS), seed=SEEDS)
def test_batched_align_matches_brute_force(cfg, seed):
    E, cap, bs = cfg
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, cap + 3, size=E).astype(np.int32)  # may exceed capacity
    out = J_BALIGN(max_tokens_per_expert=cap, block_size=bs, expert_num_tokens=counts)
    n = E * cap
    rows_keys = [e if r < min(int(counts[e]), cap) else -1 for e in range(E) for r in range(cap)]
    max_padded = E * (-(-cap // bs)) * bs
    want_ids, want_eids, want_post = ref_align(rows_keys, E, bs, max_padded, n)
    assert out.num_valid_tokens == n and out.block_size == bs
    np.testing.assert_array_equal(np.asarray(out.sorted_token_ids), want_ids)
    np.testing.assert_array_equal(np.asarray(out.expert_ids), want_eids)
    assert int(out.num_tokens_post_padded[0]) == want_post
    check_blocks_belong(out, [key for key in rows_keys], n, bs)


# --------------------------------------------------------------------------------------------
# determine_expert_map
# --------------------------------------------------------------------------------------------


@given(P=st.integers(1, 16), extra=st.integers(0, 70), strategy=st.sampled_from(
    ["linear", "round_robin"]))
def test_determine_expert_map_partitions_experts(P, extra, strategy):
    E = P + extra
    owner = np.full(E, -1)
    base, rem = E // P, E % P
    next_start = 0
    for r in range(P):
        n_local, em = determine_expert_map(P, r, E, strategy)
        assert em.dtype == np.int32 and em.shape == (E,)
        if strategy == "linear":
            want_n = base + (1 if r < rem else 0)
            want_owned = list(range(next_start, next_start + want_n))
            next_start += want_n
        else:
            want_owned = [e for e in range(E) if e % P == r]
            want_n = len(want_owned)
        assert n_local == want_n
        owned = [e for e in range(E) if em[e] >= 0]
        assert owned == want_owned
        assert [int(em[e]) for e in owned] == list(range(want_n))
        assert (owner[owned] == -1).all()
        owner[owned] = r
    assert (owner >= 0).all()


def test_determine_expert_map_examples():
    n, em = determine_expert_map(3, 0, 8, "linear")
    assert n == 3 and em.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    n, em = determine_expert_map(3, 2, 8, "linear")
    assert n == 2 and em.tolist() == [-1, -1, -1, -1, -1, -1, 0, 1]
    n, em = determine_expert_map(3, 1, 8, "round_robin")
    assert n == 3 and em.tolist() == [-1, 0, -1, -1, 1, -1, -1, 2]


# --------------------------------------------------------------------------------------------
# error cases
# --------------------------------------------------------------------------------------------

F32 = np.float32
I32 = np.int32
_G = np.zeros((4, 8), F32)
_IDS = np.zeros((4, 2), I32)
_B = dispatch_batched(np.zeros((4, 3), F32), np.array([[0, 1], [1, 2], [2, 3], [3, 0]], I32), 4, 4)

ERROR_CASES = [
    ("gating rank", lambda: fused_topk(np.zeros(8, F32), 2, renormalize=True),
     ShapeError, ["gating_output", "(8,)"]),
    ("gating dtype", lambda: fused_topk(np.zeros((4, 8), I32), 2, renormalize=True),
     DTypeError, ["gating_output", "int32"]),
    ("topk > E", lambda: fused_topk(_G, 9, renormalize=True), ConfigError, ["topk", "9", "8"]),
    ("topk 0", lambda: fused_topk(_G, 0, renormalize=True), ConfigError, ["topk"]),
    ("scoring", lambda: fused_topk(_G, 2, renormalize=True, scoring_func="relu"),
     ConfigError, ["scoring_func", "relu"]),
    ("E % G", lambda: grouped_topk(_G, 2, renormalize=True, num_expert_group=3, topk_group=1),
     ConfigError, ["num_expert_group", "3"]),
    ("topk_group > G", lambda: grouped_topk(_G, 2, renormalize=True, num_expert_group=4,
                                            topk_group=5), ConfigError, ["topk_group", "5"]),
    ("grouped topk", lambda: grouped_topk(_G, 5, renormalize=True, num_expert_group=4,
                                          topk_group=2), ConfigError, ["topk", "5"]),
    ("grouped scoring", lambda: grouped_topk(_G, 2, renormalize=True, num_expert_group=4,
                                             topk_group=2, scoring_func="x"),
     ConfigError, ["scoring_func"]),
    ("bias shape", lambda: grouped_topk(_G, 2, renormalize=True, num_expert_group=4,
                                        topk_group=2, e_score_correction_bias=np.zeros(7, F32)),
     ShapeError, ["e_score_correction_bias", "(8,)", "(7,)"]),
    ("bias dtype", lambda: grouped_topk(_G, 2, renormalize=True, num_expert_group=4,
                                        topk_group=2, e_score_correction_bias=np.zeros(8, I32)),
     DTypeError, ["e_score_correction_bias"]),
    ("ids rank", lambda: moe_align_block_size(np.zeros(4, I32), 4, 8),
     ShapeError, ["topk_ids", "(4,)"]),
    ("ids dtype", lambda: moe_align_block_size(np.zeros((4, 2), F32), 4, 8),
     DTypeError, ["topk_ids", "float32"]),
    ("ids too big", lambda: moe_align_block_size(np.array([[0, 8]], I32), 4, 8),
     ValueRangeError, ["topk_ids", "[0, 8)", "8"]),
    ("ids negative", lambda: moe_align_block_size(np.array([[0, 1], [-2, 3]], I32), 4, 8),
     ValueRangeError, ["topk_ids", "[0, 8)", "-2"]),
    ("ids jax concrete", lambda: moe_align_block_size(jnp.array([[9]], jnp.int32), 4, 8),
     ValueRangeError, ["topk_ids", "9"]),
    ("block_size", lambda: moe_align_block_size(_IDS, 0, 8), ConfigError, ["block_size"]),
    ("num_experts", lambda: moe_align_block_size(_IDS, 4, 0), ConfigError, ["num_experts"]),
    ("align method", lambda: moe_align_block_size(_IDS, 4, 8, method="radix"), ConfigError, ["method", "radix"]),
    ("align topk > E", lambda: moe_align_block_size(np.zeros((2, 5), I32), 4, 4),
     ConfigError, ["topk"]),
    ("map shape", lambda: moe_align_block_size(_IDS, 4, 8, np.zeros(7, I32)),
     ShapeError, ["expert_map", "(8,)", "(7,)"]),
    ("map dtype", lambda: moe_align_block_size(_IDS, 4, 8, np.zeros(8, F32)),
     DTypeError, ["expert_map"]),
    ("map values", lambda: moe_align_block_size(_IDS, 4, 8, np.full(8, -2, I32)),
     ValueRangeError, ["expert_map", "-2"]),
    ("hidden rows", lambda: dispatch_batched(np.zeros((3, 4), F32), _IDS, 8, 4),
     ShapeError, ["hidden_states", "(3, 4)"]),
    ("hidden rank", lambda: dispatch_batched(np.zeros((4,), F32), _IDS, 8, 4),
     ShapeError, ["hidden_states"]),
    ("hidden dtype", lambda: dispatch_batched(np.zeros((4, 4), I32), _IDS, 8, 4),
     DTypeError, ["hidden_states"]),
    ("dispatch ids range", lambda: dispatch_batched(np.zeros((1, 4), F32),
                                                    np.array([[8]], I32), 8, 4),
     ValueRangeError, ["topk_ids", "[0, 8)"]),
    ("capacity", lambda: dispatch_batched(np.zeros((4, 4), F32), _IDS, 8, 3),
     ValueRangeError, ["max_tokens_per_expert", "3"]),
    ("capacity 0", lambda: dispatch_batched(np.zeros((4, 4), F32), _IDS, 8, 0),
     ConfigError, ["max_tokens_per_expert"]),
    ("traced map", lambda: jax.jit(lambda h, i, m: dispatch_batched(h, i, 8, 4, m))(
        np.zeros((4, 4), F32), np.ones((4, 2), I32), np.arange(8, dtype=I32)),
     ConfigError, ["num_local_experts"]),
    ("combine outputs", lambda: combine_batched(np.zeros((4, 3, 2), F32), _B,
                                                np.zeros((4, 2), F32), 4),
     ShapeError, ["expert_outputs", "(4, 4)"]),
    ("combine weights", lambda: combine_batched(np.zeros((4, 4, 2), F32), _B,
                                                np.zeros((4, 3), F32), 4),
     ShapeError, ["topk_weights", "(4, 2)", "(4, 3)"]),
    ("combine num_tokens", lambda: combine_batched(np.zeros((4, 4, 2), F32), _B,
                                                   np.zeros((5, 2), F32), 5),
     ShapeError, ["num_tokens"]),
    ("combine dtype", lambda: combine_batched(np.zeros((4, 4, 2), I32), _B,
                                              np.zeros((4, 2), F32), 4),
     DTypeError, ["expert_outputs"]),
    ("batched counts rank", lambda: batched_moe_align_block_size(4, 4, np.zeros((2, 2), I32)),
     ShapeError, ["expert_num_tokens"]),
    ("batched counts dtype", lambda: batched_moe_align_block_size(4, 4, np.zeros(2, F32)),
     DTypeError, ["expert_num_tokens"]),
    ("batched counts negative", lambda: batched_moe_align_block_size(4, 4,
                                                                     np.array([1, -1], I32)),
     ValueRangeError, ["expert_num_tokens", "-1"]),
    ("ep_rank", lambda: determine_expert_map(4, 4, 16), ConfigError, ["ep_rank", "4"]),
    ("ep_size", lambda: determine_expert_map(0, 0, 16), ConfigError, ["ep_size"]),
    ("strategy", lambda: determine_expert_map(2, 0, 16, "random"), ConfigError, ["strategy"]),
    ("too few experts", lambda: determine_expert_map(8, 0, 4), ConfigError,
     ["global_num_experts"]),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors(case):
    _, fn, exc, fragments = case
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, WNA16Error)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_errors_raised_under_jit_for_static_problems():
    with pytest.raises(ShapeError, match="gating_output"):
        J_FUSED(np.zeros((2, 3, 4), F32), topk=1, renormalize=False)
    with pytest.raises(ConfigError, match="topk"):
        J_FUSED(_G, topk=9, renormalize=False)
    with pytest.raises(DTypeError, match="topk_ids"):
        J_ALIGN(np.zeros((2, 2), F32), block_size=4, num_experts=8)


# --------------------------------------------------------------------------------------------
# MoERouting
# --------------------------------------------------------------------------------------------

ROUTING_ERRORS = [
    (dict(top_k=0), ["top_k", ">= 1", "0"]),
    (dict(top_k=True), ["top_k", "True"]),
    (dict(top_k=1.5), ["top_k", "1.5"]),
    (dict(top_k="2"), ["top_k", "'2'"]),
    (dict(top_k=2, renormalize=1), ["renormalize", "true or false", "1"]),
    (dict(top_k=2, scoring_func="tanh"), ["scoring_func", "softmax", "sigmoid", "'tanh'"]),
    (dict(top_k=2, scoring_func=None), ["scoring_func", "string", "None"]),
    (dict(top_k=2, num_expert_group=0), ["num_expert_group", ">= 1", "0"]),
    (dict(top_k=2, num_expert_group=4), ["topk_group", "<= 4", "None"]),
    (dict(top_k=2, num_expert_group=4, topk_group=5), ["topk_group", "<= 4", "5"]),
    (dict(top_k=2, num_expert_group=4, topk_group=0), ["topk_group", ">= 1", "0"]),
    (dict(top_k=2, topk_group=2), ["topk_group", "<= 1", "2"]),
    (dict(top_k=2, routed_scaling_factor=0), ["routed_scaling_factor", "> 0", "0"]),
    (dict(top_k=2, routed_scaling_factor=-2.5), ["routed_scaling_factor", "> 0", "-2.5"]),
    (dict(top_k=2, routed_scaling_factor=float("nan")), ["routed_scaling_factor", "finite", "nan"]),
    (dict(top_k=2, routed_scaling_factor=float("inf")), ["routed_scaling_factor", "finite", "inf"]),
    (dict(top_k=2, routed_scaling_factor=True), ["routed_scaling_factor", "True"]),
    (dict(top_k=2, activation="relu"), ["activation", "silu", "'relu'"]),
]


@pytest.mark.parametrize("kw, fragments", ROUTING_ERRORS, ids=[str(c[0]) for c in ROUTING_ERRORS])
def test_moe_routing_refuses_bad_fields(kw, fragments):
    with pytest.raises(ConfigError) as info:
        MoERouting(**kw)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))


def test_moe_routing_normalises_and_reads_configs():
    import dataclasses

    r = MoERouting(top_k=np.int64(3), num_expert_group=1, topk_group=1, routed_scaling_factor=2)
    assert (type(r.top_k), r.num_expert_group, r.topk_group, r.grouped) == (int, None, None, False)
    assert type(r.routed_scaling_factor) is float and r.routed_scaling_factor == 2.0
    assert hash(r) == hash(MoERouting(top_k=3, routed_scaling_factor=2.0))    # static: hashable, equal
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.top_k = 4

    class Config:                  # any object with the field names, extra attributes ignored
        top_k, renormalize, scoring_func, num_expert_group, topk_group = 4, False, "sigmoid", 4, 2
        routed_scaling_factor, activation, hidden_size = 2.5, "gelu", 64

    g = MoERouting.of(Config())
    assert g == MoERouting(4, False, "sigmoid", 4, 2, 2.5, "gelu") and g.grouped
    with pytest.raises(ConfigError, match=r"config: .*SimpleNamespace without \['renormalize'"):
        MoERouting.of(__import__("types").SimpleNamespace(top_k=2))
    Config.routed_scaling_factor = 0.0
    with pytest.raises(ConfigError, match="routed_scaling_factor"):
        MoERouting.of(Config())


def test_moe_routing_check_experts():
    MoERouting(top_k=8).check_experts(8)
    for r, e, frags in ((MoERouting(top_k=9), 8, ["top_k", "<= 8", "9"]),
                        (MoERouting(top_k=2, num_expert_group=3, topk_group=1), 8, ["num_expert_group", "8", "3"]),
                        (MoERouting(top_k=5, num_expert_group=4, topk_group=2), 8, ["top_k", "5", "= 4"])):
        with pytest.raises(ConfigError) as info:
            r.check_experts(e)
        assert all(f in str(info.value) for f in frags), str(info.value)


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_routing_route_matches_the_topk_functions(grouped):
    """``route`` is the top-k function its fields name, times the scaling factor (also where plain)."""
    rng = np.random.default_rng()
    logits = rng.standard_normal((6, 16)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(16)).astype(np.float32)
    r = MoERouting(top_k=3, renormalize=True, scoring_func="sigmoid", routed_scaling_factor=2.5,
                   **(dict(num_expert_group=4, topk_group=2) if grouped else {}))
    w, ids = jax.jit(r.route)(logits, bias if grouped else None)
    s = ref_scores(logits, "sigmoid")
    c = s + bias if grouped else s
    for t in range(6):
        eligible = set(range(16))
        if grouped:
            gsc = ref_group_scores(c[t], s[t], 4, 4, True)
            eligible = {e for e in range(16) if e // 4 in sorted(range(4), key=lambda g: -gsc[g])[:2]}
        check_topk_row(np.asarray(ids[t]), np.asarray(w[t]), c[t], s[t], eligible, 3, True, 2.5)
    if not grouped:         # a selection bias without groups: chosen by score + bias, all experts eligible
        w, ids = jax.jit(r.route)(logits, bias)
        for t in range(6):
            check_topk_row(np.asarray(ids[t]), np.asarray(w[t]), s[t] + bias, s[t], set(range(16)), 3, True, 2.5)
