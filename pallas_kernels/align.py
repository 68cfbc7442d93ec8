"""Sorting routed (token, slot) pairs by expert into fixed-size row blocks (the MoE alignment).

Pure ``jnp``, jit-able; sizes are static Python ints. ``docs/moe-semantics.md`` §1.2 states the
semantics; ``wna16_jax.routing.moe_align_block_size`` is the checked public entry point and the
layers here call :func:`align_pairs` on ids they have already made safe. The methods give the same
order: ``"sort"`` (one int32 sort), ``"compare"`` (all pairs compared, no sort, scatter or search:
few GPU launches, for up to about a thousand pairs), ``"rank"`` (per-chunk counts and one
scatter), and ``"auto"``, which picks by the number of pairs (the thresholds below were measured
on the H200 in the wgmma layer; docs/journal/notes.md v16 and v21).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .errors import KernelConfigError

def max_padded_size(num_flat_tokens: int, block_size: int, num_experts: int) -> int:
    """Static length of ``sorted_token_ids``: ``N + E*(bs-1)``, or ``N*bs`` when ``N < E``.

    ``N = T*k``. At most ``min(N, E)`` experts are non-empty and each wastes at most
    ``bs - 1`` padding rows, so this bounds the padded total; it is rounded up to a multiple
    of ``block_size``.
    """
    n = num_flat_tokens
    size = n + min(n, num_experts) * (block_size - 1)
    return -(-size // block_size) * block_size


ALIGN_METHODS = ("auto", "sort", "compare", "rank")
RANK_MIN_PAIRS = 1024       # "auto" ranks from this many routed pairs on, above COMPARE_MAX_PAIRS
# "auto" compares all pairs up to this many routed pairs: on the H200 the wgmma layer with the
# compared alignment, same runs (docs/journal/notes.md v16), Qwen3 64 tokens (512 pairs) 110.9 µs against
# 124.8–125.2 sorted, DeepSeek-V2-Lite 16 tokens 96.4 against 107.2–107.4, DeepSeek-V2-Lite 128
# tokens (768 pairs) 145.3 against 171.6–171.7, Qwen3 128 tokens (1024 pairs) 133.0 against
# 146.8–150.1 counted (its inverse: 2944 padded rows × 1024 pairs); not timed beyond, so "auto"
# also keeps the inverse's padded rows × pairs within COMPARE_MAX_WORK (many experts in large blocks)
COMPARE_MAX_PAIRS = 1024
COMPARE_MAX_WORK = 1 << 22
_CHUNK = 256                # positions per chunk of the rank method


def _padded_from_ranks(k, rank, counts, block_size: int, max_padded: int, inverse):
    """The alignment's outputs from each position's ``rank`` within its bucket and the buckets'
    ``counts``: the blocks' starts (a cumulative sum over the buckets), each position's padded
    row (``max_padded`` for invalid ones), the padded list as ``inverse(row)``, and each block's
    expert read from its first row (blocks are whole runs of one bucket, so a block's first row
    always holds a position) → ``(sorted_ids, block_expert, post, row)``."""
    num_buckets = counts.shape[0]
    n = k.shape[0]
    nblocks = (counts + (block_size - 1)) // block_size
    cum_blocks = jnp.cumsum(nblocks)
    total_blocks = cum_blocks[-1]
    first_block = cum_blocks - nblocks
    row = jnp.where(k < num_buckets, first_block[jnp.minimum(k, num_buckets - 1)] * block_size + rank,
                    max_padded).astype(jnp.int32)
    # materialized once: left to XLA, the rows (a gather from the blocks' cumulative sum, itself a
    # reduce-window) fuse into every consumer — in the layer's top-k sum that is one recomputation
    # of both cumulative sums per output element (on the H200 that fusion took 142.5 µs at Qwen3
    # 512 tokens against 6.9 for the same sum over materialized rows, 1134 at 4096: docs/journal/notes.md v21)
    row = jax.lax.optimization_barrier(row)
    sorted_ids = inverse(row).astype(jnp.int32)
    b = jnp.arange(max_padded // block_size, dtype=jnp.int32)
    first = sorted_ids[b * block_size]
    block_expert = jnp.where(b < total_blocks, k[jnp.clip(first, 0, n - 1)], -1).astype(jnp.int32)
    post = (total_blocks * block_size).astype(jnp.int32).reshape(1)
    return sorted_ids, block_expert, post, row


def _align_compare(k, num_buckets: int, block_size: int, max_padded: int, sentinel: int):
    """:func:`_align_sorted` by comparing all pairs, for up to about a thousand positions: each
    position's rank among its bucket's (an ``n × n`` compare-and-count), the buckets' counts
    (``n × buckets``), their blocks' starts (a cumulative sum over the buckets), each position's
    padded row from those, and the padded list as the inverse of the rows (``rows × n``
    compares) — reductions and elementwise work only, no sort, scatter or search (each of which
    is a GPU kernel of its own: with the sort, the alignment and the inverse of its order were
    about 8 of a Mixtral 16-token layer's 14 small XLA kernels; compared, the wgmma layer at
    Qwen3 64 tokens took 110 µs against 125, docs/journal/notes.md v16). ``k``: keys, ``num_buckets`` for
    invalid positions. Also returns the padded row of each position (``max_padded`` for invalid
    ones)."""
    n = k.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    counts = (k[None, :] == jnp.arange(num_buckets, dtype=jnp.int32)[:, None]).sum(1, dtype=jnp.int32)
    rank = ((k[None, :] == k[:, None]) & (i[None, :] < i[:, None])).sum(1, dtype=jnp.int32)
    r = jnp.arange(max_padded, dtype=jnp.int32)

    def inverse(row):                         # rows × n compares, no scatter
        return sentinel + jnp.where(row[None, :] == r[:, None], i[None, :] - sentinel, 0).sum(1, dtype=jnp.int32)
    return _padded_from_ranks(k, rank, counts, block_size, max_padded, inverse)


def _align_rank(k, num_buckets: int, block_size: int, max_padded: int, sentinel: int):
    """:func:`_align_sorted` from each position's rank within its bucket, for any number of
    positions: the positions cut into chunks of 256, per chunk the buckets' counts (a reduction,
    no scatter-add), their exclusive sum over the chunks, and each position's equals earlier in
    its chunk (a 256 × 256 compare per chunk) give the rank; the blocks' starts (a cumulative sum
    over the buckets) give each position's padded row, and one scatter of the positions into
    their rows gives the padded list. Each block's expert is read from its first row. Returns,
    like :func:`_align_compare`, the padded row of each position too (``max_padded`` for invalid
    ones), so a caller needs no scatter to invert the order. ``k``: keys, ``num_buckets`` for
    invalid positions. ``"auto"``'s pick from :data:`RANK_MIN_PAIRS` pairs on since v21 (docs/journal/notes.md:
    Qwen3 4096 tokens 755 against 779 µs counted; v17's 363 / 1869 µs at 512 / 4096 tokens were
    XLA recomputing the rows inside the top-k sum, fixed in :func:`_padded_from_ranks`)."""
    n = k.shape[0]
    c = min(_CHUNK, n)
    nc = -(-n // c)
    kc = jnp.pad(k, (0, nc * c - n), constant_values=num_buckets).reshape(nc, c)   # padding: invalid
    per_chunk = (kc[:, :, None] == jnp.arange(num_buckets, dtype=jnp.int32)).sum(1, dtype=jnp.int32)
    upto = jnp.cumsum(per_chunk, axis=0)                          # equal keys up to each chunk's end
    before = upto - per_chunk                                     # equal keys in earlier chunks
    r = jnp.arange(c, dtype=jnp.int32)
    within = ((kc[:, :, None] == kc[:, None, :]) & (r[None, :] < r[:, None])).sum(-1, dtype=jnp.int32)
    rank = (jnp.take_along_axis(before, jnp.minimum(kc, num_buckets - 1), axis=1) + within).reshape(-1)[:n]

    def inverse(row):                         # one scatter; invalid positions (row max_padded) dropped
        return jnp.full((max_padded,), sentinel, jnp.int32).at[row].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    # the counts: the cumulative sum's last row (a reduction over the chunks of the one-hot compare
    # became one reduction of the whole [chunks, 256, buckets] compare, 9.6 µs at Qwen3 512 tokens)
    return _padded_from_ranks(k, rank, upto[-1], block_size, max_padded, inverse)


def _resolve_method(n: int, max_padded: int, method: str) -> str:
    if method != "auto":
        return method
    if 0 < n <= COMPARE_MAX_PAIRS and max_padded * n <= COMPARE_MAX_WORK:
        return "compare"
    return "rank" if n >= RANK_MIN_PAIRS else "sort"


def align_method(num_pairs: int, block_size: int, num_experts: int, method: str = "auto") -> str:
    """The method :func:`moe_align_block_size` runs for ``num_pairs`` routed pairs (``"auto"``
    resolved: ``"compare"``, ``"sort"`` or ``"rank"``)."""
    if method not in ALIGN_METHODS:
        raise KernelConfigError(f"method: expected one of {ALIGN_METHODS}, got {method!r}")
    return _resolve_method(num_pairs, max_padded_size(num_pairs, block_size, num_experts), method)


def align_sorted(keys, valid, num_buckets: int, block_size: int, max_padded: int, sentinel: int,
                 method: str = "auto"):
    """Core of the alignment: group the positions of ``keys`` by bucket (stable) and pad.

    Written for the GPU's few-launch needs: one int32 sort (no payload), gathers instead of a
    scatter for the padded list, and a compare-all ``searchsorted`` (the default binary search is
    a loop of small launches); ``"compare"`` (``"auto"``: up to :data:`COMPARE_MAX_PAIRS`
    positions, and padded rows × positions up to :data:`COMPARE_MAX_WORK`): :func:`_align_compare`;
    ``"rank"`` (``"auto"``: from :data:`RANK_MIN_PAIRS` positions on, where it does not compare):
    :func:`_align_rank`. Returns ``(sorted_ids, block_expert, post, rows)``: ``rows`` each
    position's padded row (``max_padded`` for invalid ones) where the method has it for free
    (``"compare"``, ``"rank"``), else ``None``."""
    n = keys.shape[0]
    max_blocks = max_padded // block_size
    k = jnp.where(valid, keys, num_buckets).astype(jnp.int32)
    method = _resolve_method(n, max_padded, method)
    if n and method in ("compare", "rank"):
        return (_align_compare if method == "compare" else _align_rank)(k, num_buckets, block_size, max_padded,
                                                                         sentinel)
    counts = jnp.zeros((num_buckets + 1,), jnp.int32).at[k].add(1)[:num_buckets]
    nblocks = (counts + (block_size - 1)) // block_size
    cum_blocks = jnp.cumsum(nblocks)
    total_blocks = cum_blocks[-1]
    b = jnp.arange(max_blocks, dtype=jnp.int32)
    block_expert = jnp.searchsorted(cum_blocks, b, side="right", method="compare_all").astype(jnp.int32)
    post = (total_blocks * block_size).astype(jnp.int32).reshape(1)
    if n == 0:
        return jnp.full((max_padded,), sentinel, jnp.int32), jnp.full((max_blocks,), -1, jnp.int32), post, None
    if (num_buckets + 1) * n < 2 ** 31:    # stable order from one sort of unique keys
        order = (jnp.sort(k * n + jnp.arange(n, dtype=jnp.int32)) % n).astype(jnp.int32)
    else:
        order = jnp.argsort(k, stable=True).astype(jnp.int32)
    raw_start = jnp.cumsum(counts) - counts                    # first sorted position per bucket
    # padded slot r belongs to bucket e = block_expert[r // bs] at rank r - (first slot of e)
    r = jnp.arange(max_padded, dtype=jnp.int32)
    e_r = jnp.minimum(block_expert[r // block_size], num_buckets - 1)
    rank = r - (cum_blocks - nblocks)[e_r] * block_size
    ok = (r < total_blocks * block_size) & (rank < counts[e_r])
    sorted_ids = jnp.where(ok, order[jnp.clip(raw_start[e_r] + rank, 0, n - 1)], sentinel).astype(jnp.int32)
    block_expert = jnp.where(b < total_blocks, block_expert, -1)
    return sorted_ids, block_expert, post, None


def align_pairs(topk_ids, block_size: int, num_experts: int, expert_map=None, *, ignore_invalid_experts=False,
                method: str = "auto"):
    """The routed pairs ``topk_ids [T, k]`` (global expert ids; checked by the caller) sorted by
    expert into ``block_size``-row blocks: ``(sorted_ids [max_padded], block_expert [max_padded /
    block_size], post [1], rows [T·k] or None)``, the sentinel ``T·k`` on padding rows.
    ``ignore_invalid_experts`` (with ``expert_map``): the pairs of non-local experts own no rows
    and the blocks name local experts; else every expert gets blocks and their ids are mapped
    through ``expert_map`` afterwards (non-local: -1). Ids outside ``[0, num_experts)`` are
    never counted."""
    num_tokens, topk = topk_ids.shape
    n = num_tokens * topk
    max_padded = max_padded_size(n, block_size, num_experts)
    flat = jnp.asarray(topk_ids).reshape(-1).astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_experts)
    keys = flat
    if expert_map is not None and ignore_invalid_experts:
        local = expert_map[jnp.clip(flat, 0, num_experts - 1)]
        valid = valid & (local >= 0) & (local < num_experts)
        keys = local
    sorted_ids, block_expert, post, rows = align_sorted(keys, valid, num_experts, block_size, max_padded, n, method)
    if expert_map is not None and not ignore_invalid_experts:
        mapped = expert_map[jnp.clip(block_expert, 0, num_experts - 1)]
        block_expert = jnp.where((block_expert >= 0) & (mapped >= 0), mapped, -1)
    return sorted_ids, block_expert, post, rows


def vllm_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """vLLM's block size rule: the first of 8..64 with (T·k/E)/block_m < 0.9."""
    avg = num_tokens * top_k / max(num_experts, 1)
    for bm in (8, 16, 32, 48, 64):
        if avg / bm < 0.9:
            return bm
    return 64
