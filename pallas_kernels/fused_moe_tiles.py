"""The fused MoE layer on the Triton-lowered Pallas kernels (:mod:`pallas_kernels.wna16_grouped_gemm`).

:func:`fused_moe_tiles` runs one layer whose two GEMMs' experts are given in the kernels' tile
layout (:class:`~pallas_kernels.experts.GemmExperts` of ``[E, K/pf, N]`` int32 tiles), with the
semantics of ``wna16_jax.moe.fused_moe``, in one of two schedules:

* ``"pair"`` (decode; default while the routed pairs are no more than the experts): no
  alignment; GEMM1 over the pairs (split-K) → bias + activation (XLA, fused with the split sum)
  → GEMM2 with the router weights in its epilogue → split and top-k sums (one XLA reduction).
* ``"blocked"``: rows sorted by expert into ``block_m`` blocks (only as many blocks as can be
  non-empty), gathered; GEMM1 with bias, router weight (on input) and activation in its
  epilogue when no split-K is needed; GEMM2 with bias and router weight in its epilogue; the
  top-k sum as one segment sum.

Act-order layers come with each expert's K rows sorted by group (``perm``) and the activations
are permuted to match at run time, as Marlin does. :func:`batched_experts_tiles` runs the
batched-experts format, :func:`fused_moe_tiles_bwd` the input and router-weight gradients.
The kernels take 16-bit activations and K a multiple of the tile depth (128 rows for 4-bit, 64
for 8-bit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import device
from .activations import FUSED_ACTIVATIONS, check_activation
from .align import align_pairs, vllm_block_m
from .errors import KernelConfigError, KernelDTypeError, KernelShapeError
from .experts import GemmExperts
from .wna16_grouped_gemm import (DEQUANT_MODES, DOTS, choose_split, grouped_gemm, grouped_gemm_t, pair_gemm, tile_bk,
                                 valid_split)

ENGINE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MODES = ("pair", "blocked")


# ----------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static launch choices for one layer call (see :func:`choose_config`), checked when built:
    a :class:`KernelConfigError` names the field, what it must be and what it is."""

    mode: str
    block_m: int            # rows per expert block (blocked mode)
    block_n1: int           # output columns per program, GEMM1
    block_n2: int           # output columns per program, GEMM2
    split1: int             # split-K, GEMM1
    split2: int             # split-K, GEMM2
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "auto"
    dot: str = "mma"        # "mma", "swap" (weights as the MMA's A operand) or, pair mode, "fma"

    def __post_init__(self):
        def bad(field, want):
            raise KernelConfigError(f"EngineConfig.{field}: expected {want}, got {getattr(self, field)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if self.mode not in MODES:
            bad("mode", f"one of {MODES}")
        for field in ("block_m", "block_n1", "block_n2"):    # the Triton lowering's block shapes
            v = getattr(self, field)
            if not is_int(v) or v < 16 or v & (v - 1):
                bad(field, "a power of two >= 16")
        if self.mode == "pair" and self.block_m != 16:
            bad("block_m", "16 in pair mode (one 16-row MMA tile per routed pair)")
        for field in ("split1", "split2", "num_stages"):
            if not is_int(getattr(self, field)) or getattr(self, field) < 1:
                bad(field, "a positive integer")
        if self.num_warps not in (1, 2, 4, 8, 16) or not is_int(self.num_warps):
            bad("num_warps", "one of (1, 2, 4, 8, 16)")
        if self.dequant not in ("auto",) + DEQUANT_MODES:
            bad("dequant", f"one of {('auto',) + DEQUANT_MODES}")
        dots = DOTS if self.mode == "pair" else tuple(d for d in DOTS if d != "fma")
        if self.dot not in dots:
            bad("dot", f"one of {dots} in {self.mode} mode")


def _divisor(n, prefs):
    for b in prefs:
        if n % b == 0:
            return b
    raise KernelShapeError(f"no column tile among {prefs} divides {n}")


def _pow2(n: int) -> int:
    """The Triton lowering needs power-of-two block shapes: round up."""
    return 1 << (int(n) - 1).bit_length()


def max_blocks(num_pairs: int, block_m: int, num_experts: int) -> int:
    """Blocks that can be non-empty: ``Σ_e ceil(c_e / bm) ≤ ceil(n / bm) + min(n, E)``."""
    return min(-(-num_pairs // block_m) + min(num_pairs, num_experts),
               -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m))


def choose_config(num_tokens: int, top_k: int, num_experts: int, hidden_size: int, intermediate_size: int,
                  bits: int, *, mode: str | None = None, block_m: int | None = None, **overrides) -> EngineConfig:
    """The engine's static schedule for ``num_tokens`` tokens on a layer of ``num_experts`` experts
    of ``bits``-bit codes (measured: docs/journal/notes.md)."""
    e = num_experts
    pairs = num_tokens * top_k
    h, i = hidden_size, intermediate_size
    bk = tile_bk(bits)
    mode = mode or ("pair" if pairs <= e else "blocked")
    if mode not in MODES:
        raise KernelConfigError(f"mode: expected one of {MODES}, got {mode!r}")
    sms = device.num_sms()
    if mode == "pair":
        # Measured (docs/journal/notes.md, v2): 64-column tiles and many split-K programs (~16 per SM) keep the
        # most weight loads in flight; Mixtral 1 token 143 µs (128 cols, 2 splits) → 103 µs.
        bn1 = _divisor(2 * i, (64, 32, 16))
        bn2 = _divisor(h, (64, 32, 16))
        s1 = choose_split(pairs * (2 * i // bn1), h // bk, sms=sms, waves=16)
        s2 = choose_split(pairs * (h // bn2), i // bk, sms=sms, waves=16)
        cfg = EngineConfig("pair", 16, bn1, bn2, s1, s2)
    else:
        avg = pairs / max(e, 1)
        if avg < 48:      # decode-sized blocks: 16/32 rows, 64 columns, 4 warps (measured best)
            bm = _pow2(max(16, block_m or vllm_block_m(num_tokens, top_k, e)))
            bn1, bn2, warps = _divisor(i, (64, 32, 16)), _divisor(h, (64, 32, 16)), 4
            # weights as the MMA's A operand pay off from 64-row blocks on (Qwen3 512 tokens,
            # 64-row blocks: 704 → 612 µs; 16/32-row blocks: slower, e.g. Mixtral 16 411 → 551)
            dot = "swap" if bm >= 64 else "mma"
            waves2 = 8    # v3: GEMM2 split-K 2 at Mixtral 16/64 tokens, 406 → 378 and 657 → 530 µs
        else:             # prefill: 64 × 128 tiles, 4 warps beat 128-row / 256-column / 8-warp ones;
            # weights as the MMA's A operand: Mixtral 4096 tokens 11.5 → 10.1 ms, Qwen3 4096 2032 → 1859 µs
            bm = _pow2(max(16, block_m or 64))
            bn1, bn2, warps, dot = _divisor(i, (128, 64, 32, 16)), _divisor(h, (128, 64, 32, 16)), 4, "swap"
            waves2 = 2
        nb = max_blocks(pairs, bm, e)
        s1 = choose_split(nb * (i // bn1), h // bk, sms=sms, waves=2)
        s2 = choose_split(nb * (h // bn2), i // bk, sms=sms, waves=waves2)
        cfg = EngineConfig("blocked", bm, bn1, bn2, s1, s2, num_warps=warps, dot=dot)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


# ----------------------------------------------------------------------------- the layer


def local_expert_ids(topk_ids, expert_map, gne, e):
    ids = topk_ids.astype(jnp.int32)
    bad = (ids < 0) | (ids >= gne)
    if expert_map is not None:
        local = jnp.asarray(expert_map, jnp.int32)[jnp.clip(ids, 0, gne - 1)]
    else:
        local = ids
    local = jnp.where(bad | (local < 0) | (local >= e), -1, local)
    return local, bad


def sorted_blocks(topk_ids, bad, bm, gne, expert_map, e, method="auto"):
    """The routed pairs sorted by expert into ``bm``-row blocks, keeping only the blocks that can
    be non-empty. Returns ``(nb, block_expert [nb], row_expert [nb·bm], valid, flat pair id,
    token, pair_rows)`` per row (``valid`` false on padding rows; ids out of range count as expert
    0 and the caller NaNs their tokens); ``pair_rows [T·k]``: the row of each pair (``nb·bm`` or
    more where it has none) where the alignment ``method`` gives them for free (``"compare"``,
    ``"rank"``), else ``None``."""
    t, k = topk_ids.shape
    em = None if expert_map is None else jnp.asarray(expert_map).astype(jnp.int32)
    sorted_ids, block_expert, _, rows = align_pairs(jnp.where(bad, 0, topk_ids.astype(jnp.int32)), bm, gne, em,
                                                    ignore_invalid_experts=True, method=method)
    nb = min(max_blocks(t * k, bm, e), block_expert.shape[0])
    ids = sorted_ids[:nb * bm]
    experts = block_expert[:nb]
    valid = ids < t * k
    flat = jnp.where(valid, ids, 0)
    return nb, experts, jnp.repeat(experts, bm), valid, flat, flat // k, rows


def layer_sizes(w13: GemmExperts, w2: GemmExperts, bits: int) -> tuple[int, int, int]:
    """``(E, H, I)`` of a layer in the tile layout (``w13 [E, H/pf, 2I]``, ``w2 [E, I/pf, H]``)."""
    pf = 32 // bits
    e, kw13, n13 = w13.words.shape
    if w2.words.shape != (e, n13 // 2 // pf, kw13 * pf) or n13 % 2:
        raise KernelShapeError(f"w2.words: expected shape {(e, n13 // 2 // pf, kw13 * pf)} for w13.words "
                               f"{tuple(w13.words.shape)} ({bits}-bit tiles), got {tuple(w2.words.shape)}")
    return e, kw13 * pf, n13 // 2


def layer_inputs(hidden_states, topk_ids, sizes, expert_map, global_num_experts):
    """The engine layers' shared argument checks, for a layer of ``sizes = (E, H, I)`` →
    ``(t, k, cdt, e, H, I, gne)``."""
    t, k = topk_ids.shape
    e, h, i = sizes
    if hidden_states.shape != (t, h):
        raise KernelShapeError(f"hidden_states: expected shape ({t}, {h}), got {hidden_states.shape}")
    cdt = jnp.dtype(hidden_states.dtype)
    if cdt not in ENGINE_DTYPES:
        raise KernelDTypeError(f"hidden_states: the engine takes bfloat16 or float16, got {cdt.name}")
    gne = global_num_experts or (e if expert_map is None else expert_map.shape[0])
    return t, k, cdt, e, h, i, gne


def permute_cols(a, perm, row_expert):
    if perm is None:
        return a
    return jnp.take_along_axis(a, perm[jnp.maximum(row_expert, 0)], axis=1)


def fused_moe_tiles(hidden_states, topk_weights, topk_ids, w13: GemmExperts, w2: GemmExperts, *, bits: int,
                    group_size: int, activation: str = "silu", apply_router_weight_on_input: bool = False, expert_map=None,
                    global_num_experts: int | None = None, config: EngineConfig | None = None,
                    interpret: bool = False, poison_outputs: bool = False, **config_overrides):
    """The fused MoE layer on the Pallas kernels; returns ``[T, H]`` in the input dtype.

    ``config`` (or keyword overrides of :func:`choose_config`: ``mode``, ``block_m``,
    ``block_n1``, ``split1``, ``dequant``, …) fixes the schedule; ``poison_outputs`` (tests):
    every kernel writes into a NaN-filled buffer, so an element a kernel misses shows as NaN.
    Ids that are out of range give NaN rows, as in :func:`wna16_jax.moe.fused_moe`.
    """
    act_name = activation
    act = check_activation(activation)
    t, k, cdt, e, h_dim, i_dim, gne = layer_inputs(hidden_states, topk_ids, layer_sizes(w13, w2, bits), expert_map,
                                                    global_num_experts)
    if t == 0:
        return jnp.zeros_like(hidden_states)
    cfg = config or choose_config(t, k, e, h_dim, i_dim, bits, **config_overrides)
    bk = tile_bk(bits)
    cfg = dataclasses.replace(cfg, split1=valid_split(cfg.split1, h_dim // bk),
                              split2=valid_split(cfg.split2, i_dim // bk))
    local, bad = local_expert_ids(topk_ids, expert_map, gne, e)
    tw = topk_weights.astype(jnp.float32)
    kw = dict(bits=bits, group_size=group_size, interpret=interpret, dequant=cfg.dequant,
              num_warps=cfg.num_warps, num_stages=cfg.num_stages, dot=cfg.dot)
    x = hidden_states

    def poison(shape, dtype=jnp.float32):
        return jnp.full(shape, jnp.nan, dtype) if poison_outputs else None

    if cfg.mode == "pair":
        pe = local.reshape(-1)
        p = pe.shape[0]
        twf = jnp.where(pe >= 0, tw.reshape(-1), 0.0)
        a1, top = (x, k)
        if w13.perm is not None:
            a1, top = permute_cols(jnp.repeat(x, k, axis=0), w13.perm, pe), 1
        part = pair_gemm(a1, pe, w13.words, w13.scales, w13.zeros, None,
                         w13.bias, poison((cfg.split1, p, 2 * i_dim)), top_k=top,
                         block_n=cfg.block_n1, split_k=cfg.split1, **kw)
        hh = part.sum(0)
        if apply_router_weight_on_input:
            hh = hh * twf[:, None]
        a2 = permute_cols(act(hh).astype(cdt), w2.perm, pe)
        rs = (pe >= 0).astype(jnp.float32) if apply_router_weight_on_input else twf
        y = pair_gemm(a2, pe, w2.words, w2.scales, w2.zeros, rs, w2.bias,
                      poison((cfg.split2, p, h_dim)), top_k=1, block_n=cfg.block_n2, split_k=cfg.split2, **kw)
        out = y.sum(0).reshape(t, k, h_dim).sum(1)
    else:
        bm = cfg.block_m
        nb, experts, row_expert, valid, flat, tok, _ = sorted_blocks(topk_ids, bad, bm, gne, expert_map, e)
        a1 = permute_cols(jnp.where(valid[:, None], x[tok], 0).astype(cdt), w13.perm, row_expert)
        tw_rows = jnp.where(valid, tw.reshape(-1)[flat], 0.0)
        fuse = cfg.split1 == 1 and act_name in FUSED_ACTIVATIONS
        rs1 = tw_rows if apply_router_weight_on_input else None
        if fuse:
            a2 = grouped_gemm(a1, experts, w13.words, w13.scales, w13.zeros, rs1,
                              w13.bias, poison((nb * bm, i_dim), cdt), block_m=bm, block_n=cfg.block_n1,
                              activation=act_name, **kw)
        else:
            part = grouped_gemm(a1, experts, w13.words, w13.scales, w13.zeros, rs1,
                                w13.bias, poison((cfg.split1, nb * bm, 2 * i_dim)), block_m=bm,
                                block_n=_divisor(2 * i_dim, (cfg.block_n1, 64, 32, 16)), split_k=cfg.split1, **kw)
            a2 = act(part.sum(0)).astype(cdt)
        a2 = permute_cols(a2, w2.perm, row_expert)
        rs2 = valid.astype(jnp.float32) if apply_router_weight_on_input else tw_rows
        y = grouped_gemm(a2, experts, w2.words, w2.scales, w2.zeros, rs2, w2.bias,
                         poison((cfg.split2, nb * bm, h_dim)), block_m=bm, block_n=cfg.block_n2,
                         split_k=cfg.split2, **kw)
        seg = jnp.where(valid, tok, t)
        out = jax.ops.segment_sum(y.sum(0), seg, num_segments=t + 1)[:t]
    out = jnp.where(bad.any(axis=1)[:, None], jnp.nan, out)
    return out.astype(cdt)


def batched_experts_tiles(batched_hidden, expert_num_tokens, w13: GemmExperts, w2: GemmExperts, *, bits: int,
                          group_size: int, activation: str = "silu", block_m: int | None = None,
                          interpret: bool = False, poison_outputs: bool = False):
    """The BatchedExperts format on the engine (BATCHED_MARLIN's activations, docs/moe-semantics.md §2.8).

    ``batched_hidden [E, M, H]`` (first ``expert_num_tokens[e]`` rows of expert ``e`` valid) →
    ``[E, M, H]`` float32 expert outputs, invalid rows zero, no router weights — the semantics of
    :func:`wna16_jax.moe.batched_experts_forward`. Each expert's rows are already contiguous, so
    the blocks are the experts' row ranges (blocks past an expert's count are skipped).
    """
    act = check_activation(activation)
    e, m, h = batched_hidden.shape
    ne, hw, i_dim = layer_sizes(w13, w2, bits)
    if e != ne or h != hw:
        raise KernelShapeError(f"batched_hidden: expected shape ({ne}, M, {hw}), got {tuple(batched_hidden.shape)}")
    cdt = jnp.dtype(batched_hidden.dtype)
    if cdt not in ENGINE_DTYPES:
        raise KernelDTypeError(f"batched_hidden: the engine takes bfloat16 or float16, got {cdt.name}")
    bm = _pow2(max(16, block_m or min(64, m)))
    mp = -(-m // bm) * bm
    nbe = mp // bm
    counts = expert_num_tokens.astype(jnp.int32)
    x = jnp.pad(batched_hidden, ((0, 0), (0, mp - m), (0, 0)))
    valid = (jnp.arange(mp)[None, :] < counts[:, None]).reshape(-1)                     # [E·Mp]
    x = jnp.where(valid[:, None], x.reshape(e * mp, h), 0).astype(cdt)
    experts = jnp.where(jnp.arange(nbe)[None, :] * bm < counts[:, None], jnp.arange(e)[:, None], -1).reshape(-1)
    row_expert = jnp.repeat(experts, bm)
    kw = dict(bits=bits, group_size=group_size, interpret=interpret, block_m=bm)
    wide = bm >= 64
    bn1 = _divisor(i_dim, (128, 64, 32, 16) if wide else (64, 32, 16))
    bn2 = _divisor(h, (128, 64, 32, 16) if wide else (64, 32, 16))

    def poison(shape, dtype=jnp.float32):
        return jnp.full(shape, jnp.nan, dtype) if poison_outputs else None

    a1 = permute_cols(x, w13.perm, row_expert)
    if activation in FUSED_ACTIVATIONS:
        a2 = grouped_gemm(a1, experts, w13.words, w13.scales, w13.zeros, None,
                          w13.bias, poison((e * mp, i_dim), cdt), block_n=bn1, activation=activation, **kw)
    else:
        part = grouped_gemm(a1, experts, w13.words, w13.scales, w13.zeros, None,
                            w13.bias, poison((1, e * mp, 2 * i_dim)), block_n=_divisor(2 * i_dim, (bn1, 64, 32, 16)),
                            **kw)
        a2 = act(part.sum(0)).astype(cdt)
    a2 = permute_cols(a2, w2.perm, row_expert)
    y = grouped_gemm(a2, experts, w2.words, w2.scales, w2.zeros, None, w2.bias,
                     poison((1, e * mp, h)), block_n=bn2, **kw).sum(0)
    y = jnp.where(valid[:, None], y, 0.0).reshape(e, mp, h)[:, :m]
    return y


# ----------------------------------------------------------------------------- backward


def fused_moe_tiles_bwd(g, hidden_states, topk_weights, topk_ids, w13: GemmExperts, w2: GemmExperts, *,
                        bits: int, group_size: int, activation: str = "silu", apply_router_weight_on_input: bool = False, expert_map=None,
                        global_num_experts: int | None = None, block_m: int | None = None,
                        interpret: bool = False, poison_outputs: bool = False):
    """``(dx [T, H] float32, dtw [T, k] float32)`` for the output cotangent ``g [T, H]``.

    The same schedule as the forward's blocked mode; the two input-gradient products
    ``dy @ W2`` and ``dh @ W13`` run on :func:`grouped_gemm_t` (transposed access to the packed
    tiles, dequantized in registers). The forward of each block is recomputed on the forward
    kernels (nothing but the inputs is saved), activations' VJPs in XLA, float32 throughout
    except the 16-bit GEMM operands.
    """
    act = check_activation(activation)
    on_input = apply_router_weight_on_input
    t, k, cdt, e, h_dim, i_dim, gne = layer_inputs(hidden_states, topk_ids, layer_sizes(w13, w2, bits), expert_map,
                                                    global_num_experts)
    bm = _pow2(max(16, block_m or vllm_block_m(t, k, e)))      # Triton: power-of-two blocks
    _, bad = local_expert_ids(topk_ids, expert_map, gne, e)
    nb, experts, row_expert, valid, flat, tok, _ = sorted_blocks(topk_ids, bad, bm, gne, expert_map, e)
    live = valid & (row_expert >= 0)
    w_rows = jnp.where(live, topk_weights.astype(jnp.float32).reshape(-1)[flat], 0.0)
    kw = dict(bits=bits, group_size=group_size, interpret=interpret, block_m=bm)

    def poison(shape):
        return jnp.full(shape, jnp.nan, jnp.float32) if poison_outputs else None

    def unpermute(d, perm):       # gradient w.r.t. the permuted columns → original columns
        if perm is None:
            return d
        idx = perm[jnp.maximum(row_expert, 0)]
        return jnp.zeros_like(d).at[jnp.arange(d.shape[0])[:, None], idx].set(d)

    x_rows = permute_cols(jnp.where(live[:, None], hidden_states[tok], 0).astype(cdt), w13.perm,
                           row_expert)
    h = grouped_gemm(x_rows, experts, w13.words, w13.scales, w13.zeros, None,
                     w13.bias, block_n=_divisor(2 * i_dim, (64, 32, 16)), **kw).sum(0)   # [M, 2I]
    g_rows = jnp.where(live[:, None], g.astype(jnp.float32)[tok], 0.0)
    hw = h * w_rows[:, None] if on_input else h
    a, act_vjp = jax.vjp(act, hw)
    dy = g_rows if on_input else g_rows * w_rows[:, None]
    a2 = permute_cols(a.astype(cdt), w2.perm, row_expert)
    da = grouped_gemm_t(dy.astype(cdt), experts, w2.words, w2.scales, w2.zeros,
                        poison((nb * bm, i_dim)), block_n=_divisor(h_dim, (64, 32, 16)), **kw)
    da = unpermute(da, w2.perm)
    (dhw,) = act_vjp(da)
    if on_input:
        dw = jnp.sum(dhw * h, axis=-1)
        dh = dhw * w_rows[:, None]
    else:
        y = grouped_gemm(a2, experts, w2.words, w2.scales, w2.zeros, None,
                         w2.bias, block_n=_divisor(h_dim, (64, 32, 16)), **kw).sum(0)
        dw = jnp.sum(g_rows * y, axis=-1)
        dh = dhw
    dx_rows = grouped_gemm_t(dh.astype(cdt), experts, w13.words, w13.scales, w13.zeros,
                             poison((nb * bm, h_dim)), block_n=_divisor(2 * i_dim, (64, 32, 16)), **kw)
    dx_rows = jnp.where(live[:, None], unpermute(dx_rows, w13.perm), 0.0)
    dx = jax.ops.segment_sum(dx_rows, jnp.where(live, tok, t), num_segments=t + 1)[:t]
    slot = jnp.where(live, flat, t * k)
    dtw = jax.ops.segment_sum(jnp.where(live, dw, 0.0), slot, num_segments=t * k + 1)[:t * k].reshape(t, k)
    nan_rows = bad.any(axis=1)
    return jnp.where(nan_rows[:, None], jnp.nan, dx), jnp.where(nan_rows[:, None], jnp.nan, dtw)


__all__ = ["ENGINE_DTYPES", "EngineConfig", "MODES", "batched_experts_tiles", "choose_config", "fused_moe_tiles",
           "fused_moe_tiles_bwd", "layer_sizes", "max_blocks"]
