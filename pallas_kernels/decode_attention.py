"""One decode step of grouped-query attention read straight from a stacked KV cache (Triton).

A decoder that generates one token per sequence attends, for each sequence ``b`` and key/value
head ``h``, from the ``G`` query heads that share ``h`` to the cache's first ``lengths[b]``
slots and to the step's own new key / value. XLA does this with a copy of the layer's cache
slice (a dot needs its operand whole), a score dot, a mask, a softmax and a value dot. Here
one kernel reads the cache rows where they lie — layer ``layer`` of a ``[L, B, H, T, D]``
stack, the layer index a traced scalar in a scanned decoder — and only the slots below
``lengths[b]``; the step's own key / value, not yet in the cache, join in the combine.

The slots are split among ``splits`` programs per ``(b, h)`` so that a small batch still spreads
over the GPU (flash-decoding): each program keeps a running max ``m``, sum ``l`` and weighted
value sum ``acc`` over its blocks of ``block_t`` slots, and :func:`combine` merges the splits
with the new row (a few XLA element-wise ops and two sums).

:func:`decode_attention` is the whole step; :func:`reference` is the same in plain ``jnp``.

**Paged caches.** :func:`paged_decode_attention` is the same step over a block pool
``[L, P, H, block_size, D]`` read through a block table ``[B, M]`` (sequence ``b``'s slot ``t``
lies in block ``table[b, t // block_size]`` at ``t % block_size``): each program walks its share
of the row's table entries, one block per loop step, and reads only the blocks below
``lengths[b]``; :func:`paged_reference` gathers the table's blocks and calls :func:`reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .errors import KernelConfigError, KernelDTypeError, KernelShapeError

#: query rows a program multiplies at once (the dot's smallest M); fewer heads are padded
MIN_GROUP = 16
#: slots a program reads per step of its loop, the largest of these that divides the cache length
BLOCK_T = (64, 32, 16)


def block_t_for(cache_len: int) -> int | None:
    """The block of slots for a cache of ``cache_len`` slots (None: no block divides it)."""
    return next((bt for bt in BLOCK_T if cache_len % bt == 0), None)


def unsupported_reason(q_shape, cache_shape, dtype) -> str | None:
    """Why :func:`decode_attention` cannot take these shapes / dtype (None: it can)."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {dtype.name}: the kernel takes bfloat16 or float16"
    d = int(q_shape[-1])
    if d < 16 or d & (d - 1):
        return f"head_dim {d}: the kernel takes a power of two ≥ 16"
    if block_t_for(int(cache_shape[-2])) is None:
        return f"cache length {cache_shape[-2]}: the kernel needs a multiple of {BLOCK_T[-1]}"
    return None


def choose_splits(batch: int, kv_heads: int, blocks: int, *, programs: int = 264) -> int:
    """Splits of the slots per ``(b, h)``: about ``programs`` programs in all (two per SM of an
    H100 / H200), at least one block each."""
    return max(1, min(blocks, -(-programs // max(1, batch * kv_heads))))


def _attend_blocks(qs, n, lo, hi, block, read, acc_ref, m_ref, l_ref, *, scale, window):
    """The online softmax of the queries ``qs`` (a tuple of ``[G, D_i]`` parts, whose scores add)
    over the cache blocks ``lo … hi - 1`` of ``block`` slots, slots ``t < n`` (and
    ``t > n - window``) visible; ``read(j)``: block ``j``'s ``(key parts, values)`` — a tuple of
    ``[block, D_i]`` keys matching ``qs``, and ``[block, Dv]`` values (which may be a key part:
    latent attention attends to its latent and reads it once). Writes the unnormalised partials
    ``acc [G, Dv]``, ``m``, ``l``. Every kernel here runs it; they differ in how a block is found."""
    g = qs[0].shape[0]
    neg = jnp.float32(-jnp.inf)

    def body(j, carry):
        m, l, acc = carry
        keys, vb = read(j)
        sc = None
        for q, kb in zip(qs, keys):                                       # [G, D_i] · [S, D_i]ᵀ
            part = jax.lax.dot_general(q, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            sc = part if sc is None else sc + part
        sc = sc * np.float32(scale)                                       # [G, S]
        t = j * block + jax.lax.broadcasted_iota(jnp.int32, (g, block), 1)
        ok = t < n
        if window is not None:
            ok = ok & (t > n - window)
        sc = jnp.where(ok, sc, neg)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        m_safe = jnp.where(m_new == neg, 0.0, m_new)                      # a row with nothing seen yet
        p = jnp.exp(sc - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    m0 = jnp.full((g,), neg, jnp.float32)
    l0 = jnp.zeros((g,), jnp.float32)
    acc0 = jnp.zeros((g, acc_ref.shape[-1]), jnp.float32)
    m, l, acc = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), body, (m0, l0, acc0))
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _kernel(layer_ref, len_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, block_t, per_split, blocks, scale,
            window):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    n = len_ref[b]                                     # slots 0 .. n-1 are valid
    first = s * per_split
    lo = first
    if window is not None:                             # visible: slot > n - window
        lo = jnp.maximum(first, (n - window + 1) // block_t)
    hi = jnp.minimum(jnp.minimum(first + per_split, blocks), (n + block_t - 1) // block_t)   # never past the cache

    def rows(ref):
        return lambda j: ref[layer, b, h, pl.ds(pl.multiple_of(j * block_t, block_t), block_t), :]

    rk, rv = rows(k_ref), rows(v_ref)
    _attend_blocks((q_ref[...],), n, lo, hi, block_t, lambda j: ((rk(j),), rv(j)), acc_ref, m_ref, l_ref,
                   scale=scale, window=window)


def split_plan(batch: int, kv_heads: int, cache_len: int, splits: int | None = None) -> tuple[int, int, int]:
    """``(block_t, blocks per split, splits)`` for a cache of ``cache_len`` slots (``splits``: at
    most this many; default :func:`choose_splits`)."""
    bt = block_t_for(cache_len)
    blocks = cache_len // bt
    per_split = -(-blocks // (splits or choose_splits(batch, kv_heads, blocks)))
    return bt, per_split, -(-blocks // per_split)


@functools.partial(jax.jit, static_argnames=("scale", "window", "splits", "interpret", "num_warps", "num_stages"))
def partials(q, k_cache, v_cache, layer, lengths, out=None, *, scale: float, window: int | None = None,
             splits: int | None = None, interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
    """The per-split running ``(acc [B, H, S, G, D], m [B, H, S, G], l [B, H, S, G])``, float32,
    of ``q [B, H, G, D]`` (``G`` a power of two ≥ 16) against layer ``layer`` (int32 ``[1]``) of
    the caches ``[L, B, H, T, D]``, slots ``t < lengths[b]`` (and ``t > lengths[b] - window``).
    Every program writes its three blocks, also where it has no slot to read (``m = -inf``,
    ``l = 0``, ``acc = 0``); with ``out`` (three buffers of those shapes, e.g. NaN-poisoned by a
    test) the kernel writes into them in place."""
    bsz, hk, g, d = q.shape
    t = int(k_cache.shape[3])
    bt, per_split, splits = split_plan(bsz, hk, t, splits)
    kernel = functools.partial(_kernel, block_t=bt, per_split=per_split, blocks=t // bt, scale=float(scale),
                               window=window)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - the whole array
    out_specs = [pl.BlockSpec((None, None, None, g, d), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, g), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, g), lambda b, h, s: (b, h, s, 0))]
    out_shape = [jax.ShapeDtypeStruct((bsz, hk, splits, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, hk, splits, g), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, hk, splits, g), jnp.float32)]
    in_specs = [full(layer), full(lengths), pl.BlockSpec((None, None, g, d), lambda b, h, s: (b, h, 0, 0)),
                full(k_cache), full(v_cache)]
    args = [layer, lengths, q, k_cache, v_cache]
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if out is not None:
        for name, a, want in zip(("acc", "m", "l"), out, out_shape):
            if a.shape != want.shape or a.dtype != want.dtype:
                raise KernelShapeError(f"out {name}: expected {want.dtype} {want.shape}, got {a.dtype} {a.shape}")
        base = kernel

        def kernel(*refs):                  # the aliased input refs are skipped: write the output refs
            base(*refs[:5], *refs[8:])

        in_specs, args = in_specs + out_specs, args + list(out)
        kwargs["input_output_aliases"] = {5: 0, 6: 1, 7: 2}
    return pl.pallas_call(
        kernel, grid=(bsz, hk, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name=f"decode_attention_b{bsz}_h{hk}_t{t}_s{splits}", **kwargs,
    )(*args)


def combine(acc, m, l, q, k_new, v_new, scale: float):
    """Merge the splits' partials with the step's own key / value: ``q [B, H, G, D]`` (the real
    heads), ``k_new``, ``v_new`` ``[B, H, D]``; returns ``[B, H, G, D]`` float32."""
    s_new = jnp.einsum("bhgd,bhd->bhg", q.astype(jnp.float32), k_new.astype(jnp.float32)) * np.float32(scale)
    return combine_scores(acc, m, l, s_new, v_new)


def combine_scores(acc, m, l, s_new, v_new):
    """:func:`combine` with the new row's scaled scores ``s_new [B, H, G]`` given (``G`` the real
    heads; the partials may hold padding heads past them) and its values ``v_new [B, H, Dv]``."""
    g = s_new.shape[2]
    acc, m, l = acc[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g]
    top = jnp.maximum(jnp.max(m, axis=2), s_new)                                 # finite: s_new is
    w = jnp.exp(m - top[:, :, None])                                             # [B, H, S, G]
    w_new = jnp.exp(s_new - top)
    num = jnp.sum(acc * w[..., None], axis=2) + w_new[..., None] * v_new.astype(jnp.float32)[:, :, None, :]
    den = jnp.sum(l * w, axis=2) + w_new
    return num / den[..., None]


def _check_step(kernel, q, k_new, v_new, pools, lengths, pool_ok, pool_shape, reason):
    """The checks both grouped-query kernels share: ``q [B, H, G, D]``; the two pools (``pools``:
    ``(name, array)`` pairs) of ``q``'s dtype, of one shape, each passing ``pool_ok(a, b, h, d)``
    (else named with the expected ``pool_shape(b, h, d)``); ``k_new``, ``v_new`` ``[B, H, D]``;
    ``lengths [B]``; then the kernel's own ``reason``."""
    if q.ndim != 4:
        raise KernelShapeError(f"q: expected [B, H, G, D], got shape {tuple(q.shape)}")
    bsz, hk, _, d = q.shape
    for name, a in pools:
        if not pool_ok(a, bsz, hk, d):
            raise KernelShapeError(f"{name}: expected {pool_shape(bsz, hk, d)}, got shape {tuple(a.shape)}")
        if a.dtype != q.dtype:
            raise KernelDTypeError(f"{name}: expected {q.dtype}, got {a.dtype}")
    (k_name, k), (v_name, v) = pools
    if k.shape != v.shape:
        raise KernelShapeError(f"{v_name}: expected the shape of {k_name} {tuple(k.shape)}, got {tuple(v.shape)}")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if tuple(a.shape) != (bsz, hk, d):
            raise KernelShapeError(f"{name}: expected [{bsz}, {hk}, {d}], got shape {tuple(a.shape)}")
    if tuple(lengths.shape) != (bsz,):
        raise KernelShapeError(f"lengths: expected [{bsz}], got shape {tuple(lengths.shape)}")
    why = reason()
    if why:
        raise KernelConfigError(f"{kernel}: {why}")


def _check(q, k_new, v_new, k_cache, v_cache, lengths):
    _check_step("decode_attention", q, k_new, v_new, (("k_cache", k_cache), ("v_cache", v_cache)), lengths,
                lambda a, b, h, d: a.ndim == 5 and tuple(a.shape[1:3]) == (b, h) and a.shape[4] == d,
                lambda b, h, d: f"[L, {b}, {h}, T, {d}]",
                lambda: unsupported_reason(q.shape, k_cache.shape, q.dtype))


def decode_attention(q, k_new, v_new, k_cache, v_cache, layer, lengths, *, scale: float,
                     window: int | None = None, splits: int | None = None, interpret: bool = False):
    """Attention of one new token per sequence; returns ``[B, H, G, D]`` in ``q``'s dtype.

    ``q [B, H, G, D]``: the query heads grouped by the key/value head they share; ``k_new``,
    ``v_new`` ``[B, H, D]``: the step's own key / value (attended to, not written: the caller
    writes them into the cache, after this reads it); ``k_cache``, ``v_cache`` ``[L, B, H, T, D]``
    and ``layer`` (an int32 scalar, may be traced): the cache read is layer ``layer``'s, slots
    ``t < lengths[b]`` (int32 ``[B]``), and with ``window`` only ``t > lengths[b] - window``.
    ``scale`` multiplies the scores."""
    _check(q, k_new, v_new, k_cache, v_cache, lengths)
    g = q.shape[2]
    gp = max(MIN_GROUP, 1 << (g - 1).bit_length())
    qp = q if gp == g else jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    acc, m, l = partials(qp, k_cache, v_cache, layer, lengths.astype(jnp.int32), scale=float(scale),
                         window=window, splits=splits, interpret=interpret)
    return combine(acc, m, l, q, k_new, v_new, scale).astype(q.dtype)


def reference(q, k_new, v_new, k_cache, v_cache, layer, lengths, *, scale: float, window: int | None = None):
    """:func:`decode_attention` in plain ``jnp`` (in the inputs' precision promoted to at least
    float32)."""
    dt = jnp.promote_types(q.dtype, jnp.float32)
    kc = jnp.asarray(k_cache)[layer].astype(dt)                                   # [B, H, T, D]
    vc = jnp.asarray(v_cache)[layer].astype(dt)
    t = kc.shape[2]
    keys = jnp.concatenate([kc, k_new.astype(dt)[:, :, None]], axis=2)
    vals = jnp.concatenate([vc, v_new.astype(dt)[:, :, None]], axis=2)
    sc = jnp.einsum("bhgd,bhtd->bhgt", q.astype(dt), keys, precision=jax.lax.Precision.HIGHEST) * scale
    slot = jnp.arange(t + 1)
    n = jnp.asarray(lengths)[:, None]
    ok = (slot[None] < n) | (slot[None] == t)
    if window is not None:
        ok = ok & ((slot[None] > n - window) | (slot[None] == t))
    sc = jnp.where(ok[:, None, None], sc, -jnp.inf)
    p = jax.nn.softmax(sc, axis=-1)
    return jnp.einsum("bhgt,bhtd->bhgd", p, vals, precision=jax.lax.Precision.HIGHEST)


# --------------------------------------------------------------------------- paged caches


def paged_unsupported_reason(q_shape, pool_shape, dtype) -> str | None:
    """Why :func:`paged_decode_attention` cannot take these shapes / dtype (None: it can);
    ``pool_shape``: ``[L, P, H, block_size, D]``."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {dtype.name}: the kernel takes bfloat16 or float16"
    d = int(q_shape[-1])
    if d < 16 or d & (d - 1):
        return f"head_dim {d}: the kernel takes a power of two ≥ 16"
    s = int(pool_shape[-2])
    if s < 16 or s & (s - 1):
        return f"block_size {s}: the kernel reads whole blocks, a power of two ≥ 16"
    return None


def _paged_kernel(layer_ref, len_ref, table_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, block_size,
                  per_split, entries, scale, window):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    n = len_ref[b]                                     # slots 0 .. n-1 are valid
    first = s * per_split
    lo = first
    if window is not None:                             # visible: slot > n - window
        lo = jnp.maximum(first, (n - window + 1) // block_size)
    hi = jnp.minimum(jnp.minimum(first + per_split, entries),                # never past the table,
                     (n + block_size - 1) // block_size)                      # nor the row's blocks

    def block(ref):                                    # entries below n's blocks are real; -1 never read
        return lambda j: ref[layer, jnp.maximum(table_ref[b, j], 0), h, :, :]

    rk, rv = block(k_ref), block(v_ref)
    _attend_blocks((q_ref[...],), n, lo, hi, block_size, lambda j: ((rk(j),), rv(j)), acc_ref, m_ref, l_ref,
                   scale=scale, window=window)


@functools.partial(jax.jit, static_argnames=("scale", "window", "splits", "interpret", "num_warps", "num_stages"))
def paged_partials(q, k_pool, v_pool, layer, block_table, lengths, *, scale: float, window: int | None = None,
                   splits: int | None = None, interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
    """:func:`partials` over a block pool: ``q [B, H, G, D]`` (``G`` a power of two ≥ 16) against
    layer ``layer`` (int32 ``[1]``) of the pools ``[L, P, H, S, D]`` read through
    ``block_table [B, M]`` (int32), slots ``t < lengths[b]``; the ``M`` entries are split among
    ``splits`` programs per ``(b, h)`` (default :func:`choose_splits`)."""
    bsz, hk, g, d = q.shape
    bs, width = int(k_pool.shape[3]), int(block_table.shape[1])
    per_split = -(-width // (splits or choose_splits(bsz, hk, width)))
    n_splits = -(-width // per_split)
    kernel = functools.partial(_paged_kernel, block_size=bs, per_split=per_split, entries=width, scale=float(scale),
                               window=window)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - the whole array
    out_specs = [pl.BlockSpec((None, None, None, g, d), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, g), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, g), lambda b, h, s: (b, h, s, 0))]
    out_shape = [jax.ShapeDtypeStruct((bsz, hk, n_splits, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, hk, n_splits, g), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, hk, n_splits, g), jnp.float32)]
    in_specs = [full(layer), full(lengths), full(block_table),
                pl.BlockSpec((None, None, g, d), lambda b, h, s: (b, h, 0, 0)), full(k_pool), full(v_pool)]
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel, grid=(bsz, hk, n_splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name=f"paged_decode_attention_b{bsz}_h{hk}_m{width}_s{n_splits}", **kwargs,
    )(layer, lengths, block_table, q, k_pool, v_pool)


def _check_paged(q, k_new, v_new, k_pool, v_pool, block_table, lengths):
    def table_then_reason():
        bsz = q.shape[0]
        if block_table.ndim != 2 or block_table.shape[0] != bsz or not jnp.issubdtype(block_table.dtype, jnp.integer):
            raise KernelShapeError(f"block_table: expected an integer [{bsz}, M], got {block_table.dtype} "
                                   f"{tuple(block_table.shape)}")
        return paged_unsupported_reason(q.shape, k_pool.shape, q.dtype)

    _check_step("paged_decode_attention", q, k_new, v_new, (("k_pool", k_pool), ("v_pool", v_pool)), lengths,
                lambda a, b, h, d: a.ndim == 5 and a.shape[2] == h and a.shape[4] == d,
                lambda b, h, d: f"[L, P, {h}, block_size, {d}]", table_then_reason)


def paged_decode_attention(q, k_new, v_new, k_pool, v_pool, layer, block_table, lengths, *, scale: float,
                           window: int | None = None, splits: int | None = None, interpret: bool = False):
    """:func:`decode_attention` over a paged cache; returns ``[B, H, G, D]`` in ``q``'s dtype.

    ``k_pool``, ``v_pool`` ``[L, P, H, S, D]`` (``S`` = block_size, a power of two ≥ 16) and
    ``layer`` (an int32 scalar, may be traced): sequence ``b``'s slot ``t`` is in block
    ``block_table[b, t // S]`` (int32 ``[B, M]``) at ``t % S``; the entries of the slots
    ``t < lengths[b]`` must name pool blocks (the others are never read: ``-1`` is fine).
    ``k_new``, ``v_new`` ``[B, H, D]``: the step's own key / value, attended to, not written."""
    _check_paged(q, k_new, v_new, k_pool, v_pool, block_table, lengths)
    g = q.shape[2]
    gp = max(MIN_GROUP, 1 << (g - 1).bit_length())
    qp = q if gp == g else jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    acc, m, l = paged_partials(qp, k_pool, v_pool, layer, block_table.astype(jnp.int32), lengths.astype(jnp.int32),
                               scale=float(scale), window=window, splits=splits, interpret=interpret)
    return combine(acc, m, l, q, k_new, v_new, scale).astype(q.dtype)


def paged_reference(q, k_new, v_new, k_pool, v_pool, layer, block_table, lengths, *, scale: float,
                    window: int | None = None):
    """:func:`paged_decode_attention` in plain ``jnp``: the table's blocks gathered into a
    contiguous cache, then :func:`reference`."""
    table = jnp.maximum(jnp.asarray(block_table), 0)

    def gather(pool):                                  # [L, P, H, S, D] → [1, B, H, M·S, D]
        g = jnp.take(jnp.asarray(pool)[layer], table, axis=0)              # [B, M, H, S, D]
        b, m, h, s, d = g.shape
        return jnp.swapaxes(g, 1, 2).reshape(1, b, h, m * s, d)

    return reference(q, k_new, v_new, gather(k_pool), gather(v_pool), 0, lengths, scale=scale, window=window)



# --------------------------------------------------------------------------- latent attention

#: slots a latent-attention program reads per loop step (a block of the latent is ``[block, R]``:
#: at R = 512, 32 rows are 32 KiB of bfloat16; chosen to bound the block, not tuned on a GPU)
LATENT_BLOCK_T = (32, 16)


def latent_unsupported_reason(q_shape, rope_dim: int, pool_shape, dtype, *, paged: bool) -> str | None:
    """Why :func:`latent_decode_attention` cannot take these shapes / dtype (None: it can):
    ``q_shape`` ``[B, H, R]`` (the queries in latent space), ``rope_dim`` the rotated part's width,
    ``pool_shape`` the latent pool's ``[L, P, 1, S, R]`` (contiguous: ``P = B``, ``S`` the cache
    length)."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {dtype.name}: the kernel takes bfloat16 or float16"
    for name, d in (("kv_lora_rank", int(q_shape[-1])), ("qk_rope_head_dim", int(rope_dim))):
        if d < 16 or d & (d - 1):
            return f"{name} {d}: the kernel takes a power of two ≥ 16"
    s = int(pool_shape[-2])
    if paged:
        if s < 16 or s & (s - 1):
            return f"block_size {s}: the kernel reads whole blocks, a power of two ≥ 16"
    elif not any(s % bt == 0 for bt in LATENT_BLOCK_T):
        return f"cache length {s}: the kernel needs a multiple of {LATENT_BLOCK_T[-1]}"
    return None


def _latent_kernel(layer_ref, len_ref, table_ref, q_ref, qr_ref, c_ref, r_ref, acc_ref, m_ref, l_ref, *, block,
                   per_split, blocks, scale, paged):
    b, s = pl.program_id(0), pl.program_id(2)          # axis 1: the tile of heads
    layer = layer_ref[0]
    n = len_ref[b]                                     # slots 0 .. n-1 are valid
    lo = s * per_split
    hi = jnp.minimum(jnp.minimum(lo + per_split, blocks), (n + block - 1) // block)   # never past the cache / table

    def read(j):
        if paged:                                      # entries below n's blocks are real; -1 never read
            p = jnp.maximum(table_ref[b, j], 0)
            lat, rot = c_ref[layer, p, 0, :, :], r_ref[layer, p, 0, :, :]
        else:
            rows = pl.ds(pl.multiple_of(j * block, block), block)
            lat, rot = c_ref[layer, b, 0, rows, :], r_ref[layer, b, 0, rows, :]
        return (lat, rot), lat                         # the latent is both a key part and the value

    _attend_blocks((q_ref[...], qr_ref[...]), n, lo, hi, block, read, acc_ref, m_ref, l_ref, scale=scale,
                   window=None)


@functools.partial(jax.jit, static_argnames=("scale", "paged", "splits", "interpret", "num_warps", "num_stages"))
def latent_partials(q, q_rope, c_pool, r_pool, layer, block_table, lengths, *, scale: float, paged: bool,
                    splits: int | None = None, interpret: bool = False, num_warps: int = 8, num_stages: int = 2):
    """The per-split ``(acc [B, S, G, R], m [B, S, G], l [B, S, G])``, float32, of the latent
    queries ``q [B, G, R]`` and ``q_rope [B, G, Dr]`` (``G`` a multiple of :data:`MIN_GROUP`: each
    program takes one tile of that many heads, so that its accumulator ``[16, R]`` stays in
    registers however many heads share the latent — 128 for DeepSeek-V3) against layer
    ``layer`` (int32 ``[1]``) of the latent pool ``c_pool [L, P, 1, S, R]`` and the rotated-key
    pool ``r_pool [L, P, 1, S, Dr]``, slots ``t < lengths[b]``; with ``paged``, read through
    ``block_table [B, M]`` (int32), else (a placeholder table) row ``b`` of a contiguous pool
    (``P = B``, ``S`` the cache length). Every program writes its three blocks, also where it has
    no slot to read."""
    bsz, g, r = q.shape
    dr = q_rope.shape[-1]
    width = int(c_pool.shape[3])
    if paged:
        block, entries = width, int(block_table.shape[1])
    else:
        block = next(bt for bt in LATENT_BLOCK_T if width % bt == 0)
        entries = width // block
    tiles = g // MIN_GROUP
    per_split = -(-entries // (splits or choose_splits(bsz, tiles, entries)))
    n_splits = -(-entries // per_split)
    kernel = functools.partial(_latent_kernel, block=block, per_split=per_split, blocks=entries, scale=float(scale),
                               paged=paged)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - the whole array
    t = MIN_GROUP
    out_specs = [pl.BlockSpec((None, None, t, r), lambda b, h, s: (b, s, h, 0)),
                 pl.BlockSpec((None, None, t), lambda b, h, s: (b, s, h)),
                 pl.BlockSpec((None, None, t), lambda b, h, s: (b, s, h))]
    out_shape = [jax.ShapeDtypeStruct((bsz, n_splits, g, r), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, n_splits, g), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, n_splits, g), jnp.float32)]
    in_specs = [full(layer), full(lengths), full(block_table), pl.BlockSpec((None, t, r), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((None, t, dr), lambda b, h, s: (b, h, 0)), full(c_pool), full(r_pool)]
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel, grid=(bsz, tiles, n_splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name=f"latent_decode_attention_b{bsz}_{'m' if paged else 't'}"
                                  f"{entries if paged else width}_s{n_splits}", **kwargs,
    )(layer, lengths, block_table, q, q_rope, c_pool, r_pool)


def _check_latent(q, q_rope, c_new, r_new, c_pool, r_pool, block_table, lengths):
    if q.ndim != 3 or q_rope.ndim != 3 or q_rope.shape[:2] != q.shape[:2]:
        raise KernelShapeError(f"q, q_rope: expected [B, H, R] and [B, H, Dr], got shapes {tuple(q.shape)} and "
                               f"{tuple(q_rope.shape)}")
    bsz, _, r = q.shape
    dr = q_rope.shape[2]
    for name, a, d in (("c_pool", c_pool, r), ("r_pool", r_pool, dr)):
        if a.ndim != 5 or a.shape[2] != 1 or a.shape[4] != d:
            raise KernelShapeError(f"{name}: expected [L, P, 1, S, {d}], got shape {tuple(a.shape)}")
        if a.dtype != q.dtype:
            raise KernelDTypeError(f"{name}: expected {q.dtype}, got {a.dtype}")
    if c_pool.shape[:4] != r_pool.shape[:4]:
        raise KernelShapeError(f"r_pool: expected [{', '.join(map(str, c_pool.shape[:4]))}, {dr}] beside c_pool "
                               f"{tuple(c_pool.shape)}, got shape {tuple(r_pool.shape)}")
    if q_rope.dtype != q.dtype:
        raise KernelDTypeError(f"q_rope: expected {q.dtype}, got {q_rope.dtype}")
    for name, a, d in (("c_new", c_new, r), ("r_new", r_new, dr)):
        if tuple(a.shape) != (bsz, d):
            raise KernelShapeError(f"{name}: expected [{bsz}, {d}], got shape {tuple(a.shape)}")
    if block_table is None:
        if c_pool.shape[1] != bsz:
            raise KernelShapeError(f"c_pool: a contiguous pool holds one row per sequence, expected [L, {bsz}, 1, T, "
                                   f"{r}], got shape {tuple(c_pool.shape)}")
    elif block_table.ndim != 2 or block_table.shape[0] != bsz or not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise KernelShapeError(f"block_table: expected an integer [{bsz}, M], got {block_table.dtype} "
                               f"{tuple(block_table.shape)}")
    if tuple(lengths.shape) != (bsz,):
        raise KernelShapeError(f"lengths: expected [{bsz}], got shape {tuple(lengths.shape)}")
    reason = latent_unsupported_reason(q.shape, dr, c_pool.shape, q.dtype, paged=block_table is not None)
    if reason:
        raise KernelConfigError(f"latent_decode_attention: {reason}")


def latent_decode_attention(q, q_rope, c_new, r_new, c_pool, r_pool, layer, block_table, lengths, *, scale: float,
                            splits: int | None = None, interpret: bool = False):
    """One decode step of DeepSeek's latent attention (the absorbed form); returns the attended
    latent ``[B, H, R]`` in ``q``'s dtype (``W_uv`` and ``o_proj`` are the caller's).

    Every head attends to the one shared latent key / value: the score of slot ``t`` is
    ``(q · c_t + q_rope · r_t) · scale`` and the output ``Σ_t p_t c_t``. ``q [B, H, R]``: the
    queries taken into latent space (``q_nope · W_uk``), ``q_rope [B, H, Dr]`` their rotated part;
    ``c_new [B, R]``, ``r_new [B, Dr]``: the step's own normed latent and rotated key (attended to,
    not written). ``c_pool [L, P, 1, S, R]``, ``r_pool [L, P, 1, S, Dr]`` and ``layer`` (an int32
    scalar, may be traced): layer ``layer``'s slots ``t < lengths[b]``, read where they lie —
    through ``block_table [B, M]`` (a paged pool, ``S`` the block size) or, with ``block_table``
    None, row ``b`` of a contiguous pool (``P = B``, ``S`` the cache length)."""
    _check_latent(q, q_rope, c_new, r_new, c_pool, r_pool, block_table, lengths)
    h = q.shape[1]
    gp = -(-h // MIN_GROUP) * MIN_GROUP                # whole tiles of heads
    pad = ((0, 0), (0, gp - h), (0, 0))
    qp, qrp = (q, q_rope) if gp == h else (jnp.pad(q, pad), jnp.pad(q_rope, pad))
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    paged = block_table is not None
    table = block_table.astype(jnp.int32) if paged else jnp.zeros((1, 1), jnp.int32)
    acc, m, l = latent_partials(qp, qrp, c_pool, r_pool, layer, table, lengths.astype(jnp.int32), scale=float(scale),
                                paged=paged, splits=splits, interpret=interpret)
    f32 = jnp.float32
    s_new = (jnp.einsum("bhr,br->bh", q.astype(f32), c_new.astype(f32))
             + jnp.einsum("bhd,bd->bh", q_rope.astype(f32), r_new.astype(f32))) * np.float32(scale)
    out = combine_scores(acc[:, None], m[:, None], l[:, None], s_new[:, None], c_new[:, None])
    return out[:, 0].astype(q.dtype)


def latent_reference(q, q_rope, c_new, r_new, c_pool, r_pool, layer, block_table, lengths, *, scale: float):
    """:func:`latent_decode_attention` in plain ``jnp`` (in the inputs' precision promoted to at least
    float32): the layer's rows (gathered through the table where paged), the new row appended."""
    dt = jnp.promote_types(q.dtype, jnp.float32)

    def rows(pool):                                    # → [B, T, d]
        a = jnp.asarray(pool)[layer][:, 0]                                 # [P, S, d]
        if block_table is None:
            return a
        g = jnp.take(a, jnp.maximum(jnp.asarray(block_table), 0), axis=0)  # [B, M, S, d]
        return g.reshape(g.shape[0], -1, g.shape[-1])

    c, r = rows(c_pool).astype(dt), rows(r_pool).astype(dt)
    t = c.shape[1]
    c = jnp.concatenate([c, c_new.astype(dt)[:, None]], axis=1)
    r = jnp.concatenate([r, r_new.astype(dt)[:, None]], axis=1)
    hi = jax.lax.Precision.HIGHEST
    sc = (jnp.einsum("bhr,btr->bht", q.astype(dt), c, precision=hi)
          + jnp.einsum("bhd,btd->bht", q_rope.astype(dt), r, precision=hi)) * scale
    slot = jnp.arange(t + 1)
    ok = (slot[None] < jnp.asarray(lengths)[:, None]) | (slot[None] == t)
    p = jax.nn.softmax(jnp.where(ok[:, None], sc, -jnp.inf), axis=-1)
    return jnp.einsum("bht,btr->bhr", p, c, precision=hi)

__all__ = ["BLOCK_T", "LATENT_BLOCK_T", "block_t_for", "choose_splits", "combine", "combine_scores", "decode_attention",
           "latent_decode_attention", "latent_partials", "latent_reference", "latent_unsupported_reason",
           "paged_decode_attention",
           "paged_partials", "paged_reference", "paged_unsupported_reason", "partials", "reference",
           "split_plan", "unsupported_reason"]
