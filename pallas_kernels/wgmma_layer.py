"""The fused MoE layer on the wgmma GEMMs (semantics of ``wna16_jax.moe.fused_moe``).

Two schedules. ``"pair"`` (decode): no alignment — every routed pair is its own 8-row block (row
0 holds the token, rows 1–7 are zero). ``"blocked"``: rows sorted into expert blocks of
:func:`~pallas_kernels.wgmma_config.wgmma_block_m` rows by :mod:`pallas_kernels.align` and
gathered (the row-gather kernel from many pairs on, XLA's gather below). Both: GEMM1 (the
activation in its epilogue where it is fused; else split sum, bias, router weight on the input
and activation in XLA) → GEMM2 (the router weights in its epilogue where they go there) → split
sum, bias and the top-k sum in XLA. Each GEMM's :class:`~pallas_kernels.wgmma_config.GemmConfig`
comes from :func:`~pallas_kernels.wgmma_config.plan_gemm`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import device
from .activations import FUSED_ACTIVATIONS, check_activation
from .errors import KernelConfigError, KernelShapeError
from .experts import GemmExperts
from .fused_moe_tiles import layer_inputs, local_expert_ids, permute_cols, sorted_blocks
from .row_gather import gather_rows, gather_rows_reason, gather_rows_reference
from .wgmma_config import LayerConfig, pair_schedule, plan_gemm, tuning, wgmma_block_m
from .wgmma_gemm import wgmma_grouped_gemm, wgmma_grouped_gemm_reference
from .wgmma_layout import BLOCK_K, deinterleave_gate_up, magic_value


def wgmma_layer_sizes(w13: GemmExperts, w2: GemmExperts, num_experts: int | None = None) -> tuple[int, int, int]:
    """``(E, H, I)`` of a layer in the wgmma layout (``w13 [E, 2I, H/4]``, ``w2 [E, H, I/4]``);
    ``num_experts``: the layer's ``E`` where the arrays hold several layers' experts (a multiple)."""
    e, n13, kw13 = w13.words.shape
    if n13 % 2 or w2.words.shape != (e, 4 * kw13, n13 // 8):
        raise KernelShapeError(f"w2.words: expected shape {(e, 4 * kw13, n13 // 8)} for w13.words "
                               f"{tuple(w13.words.shape)}, got {tuple(w2.words.shape)}")
    if num_experts is not None:
        if num_experts < 1 or e % num_experts:
            raise KernelShapeError(f"num_experts: expected a divisor of the {e} experts the arrays hold, "
                                   f"got {num_experts}")
        e = num_experts
    return e, 4 * kw13, n13 // 2


def _group(scales, k: int) -> int:
    """One scale group over several K-blocks: channelwise; else group 128 — a K of 128 included:
    its one group is the same math either way, and as group 128 the GEMM keeps the ``ws`` forms
    (as the plans before the redesign did; a channelwise GEMM takes no ``ws``)."""
    return -1 if scales.shape[1] == 1 and k > BLOCK_K else BLOCK_K


def fused_moe_wgmma(hidden_states, topk_weights, topk_ids, w13: GemmExperts, w2: GemmExperts, *,
                    interleaved: bool = False, activation: str = "silu", apply_router_weight_on_input: bool = False,
                    expert_map=None, global_num_experts: int | None = None, config: LayerConfig | None = None,
                    num_experts: int | None = None, expert_offset=None, **options):
    """The MoE layer on the wgmma GEMMs; returns ``[T, H]`` in the input dtype (bf16 / fp16),
    NaN rows for tokens with an out-of-range expert id.

    ``w13`` / ``w2``: the two GEMMs' experts in the wgmma layout (:mod:`pallas_kernels.wgmma_layout`;
    ``interleaved``: ``w13``'s words, scales and zero points — not its bias — in the gated
    epilogue's column order). ``config`` (or its fields as keyword ``options``): the layer's
    :class:`~pallas_kernels.wgmma_config.LayerConfig`.

    Several layers' experts in one stack (a scanned decoder): ``w13`` / ``w2`` hold ``L·E``
    experts, ``num_experts`` is the layer's ``E`` and ``expert_offset`` (an int32 scalar, may be
    traced) the stack index of its expert 0; routing, schedules and plans are the layer's, and
    only the kernels' expert indices move, so the kernels read the layer where it lies."""
    layer = config if config is not None else LayerConfig(**options)
    if config is not None and options:
        raise KernelConfigError(f"fused_moe_wgmma: pass either config or its fields, not both ({sorted(options)})")
    act = check_activation(activation)
    if (num_experts is None) != (expert_offset is None):
        raise KernelConfigError("fused_moe_wgmma: num_experts and expert_offset go together (a stack of layers)")
    t, k, cdt, e, h_dim, i_dim, gne = layer_inputs(hidden_states, topk_ids, wgmma_layer_sizes(w13, w2, num_experts),
                                                   expert_map, global_num_experts)

    def stack_index(ids):
        """The stack's index of local expert ids (``-1``, no expert, stays)."""
        if expert_offset is None:
            return ids
        return jnp.where(ids >= 0, ids + jnp.asarray(expert_offset, jnp.int32), ids)
    if t == 0:
        return jnp.zeros_like(hidden_states)
    tune = tuning()
    reference = layer.kernels == "reference"
    gemm_fn = wgmma_grouped_gemm_reference if reference else wgmma_grouped_gemm
    gather_fn = gather_rows_reference if reference else gather_rows
    sms = device.num_sms()

    def total(x, axis=0):
        """``x.sum(axis)`` as unrolled adds over the (small, static) axis, which XLA fuses into the
        neighbouring elementwise work (a reduction is a kernel of its own: v11)."""
        parts = [jax.lax.index_in_dim(x, j, axis, keepdims=False) for j in range(x.shape[axis])]
        return functools.reduce(jnp.add, parts)

    def nan_bad(out):
        """NaN rows for tokens with an out-of-range expert id."""
        anybad = functools.reduce(jnp.logical_or, [bad[:, j] for j in range(k)])
        return jnp.where(anybad[:, None], jnp.nan, out)

    schedule = pair_schedule(t * k, e, layer)
    row_gather = ((gather_rows_reason(h_dim, cdt) is None and t * k >= tune.row_gather_min_pairs)
                  if layer.row_gather is None else bool(layer.row_gather))
    local, bad = local_expert_ids(topk_ids, expert_map, gne, e)
    tw = topk_weights.astype(jnp.float32).reshape(-1)

    def operands(g: GemmExperts):
        words, scales, zeros = g.words, g.scales, g.zeros
        if scales.dtype != cdt:                      # stored for the other 16-bit dtype: re-bias
            zeros = None if zeros is None else (zeros.astype(jnp.float32) - magic_value(scales.dtype)
                                                 + magic_value(cdt)).astype(cdt)
            scales = scales.astype(cdt)
        return words, scales, zeros

    fuse = ((True if layer.fuse_act is None else bool(layer.fuse_act)) and interleaved and layer.block_n == 128
            and activation in FUSED_ACTIVATIONS and w13.bias is None and not apply_router_weight_on_input)
    stages_of, pers_of = layer.stages_pair, layer.persistent_pair

    def gemm(a, experts, bm, ops, n, kdim, split, gate=None, rs=None, per_sm4=False, whole=False,
             rs_optional=False, persistent=None, stages=None):
        """``(output [rows, N] — or [rows, N/2] act(gate)·up where gated —, gated, rs applied)``: the
        kernel's own output without a K split (16-bit with ``out16``), else the float32 sum of the
        splits. ``rs_optional``: the row scales may be left to the caller (the third value says
        whether the kernel applied them)."""
        cfg, applies_rs = plan_gemm(layer, n_blocks=experts.shape[0], block_m=bm, n=n, k=kdim,
                                    has_zp=ops[2] is not None, group_size=_group(ops[1], kdim), sms=sms, split=split,
                                    gate=gate, has_row_scale=rs is not None, row_scale_optional=rs_optional,
                                    per_sm4=per_sm4, whole=whole, persistent=persistent, stages=stages, tune=tune)
        out = gemm_fn(a, stack_index(experts), *ops, row_scale=rs if applies_rs else None, config=cfg)
        return ((out[0] if cfg.split_k == 1 else total(out.astype(jnp.float32))), cfg.gated is not None,
                applies_rs)

    ops1, ops2 = operands(w13), operands(w2)
    if schedule == "pair":
        bm = 8
        experts = local.reshape(-1)                                              # [P], -1: no expert
        row_expert = jnp.repeat(experts, bm)
        live = experts >= 0
        tw_rows = jnp.where(live, tw, 0.0)

        def spread(rows):                     # [P, D] → [P·8, D]: row 8p = rows[p], the rest zero
            return jnp.pad(rows[:, None, :], ((0, 0), (0, bm - 1), (0, 0))).reshape(-1, rows.shape[1])

        def first_rows(y):
            return y.reshape(-1, bm, y.shape[1])[:, 0]

        x_rows = hidden_states[jnp.arange(t * k) // k].astype(cdt)
        expert_of_row = experts
    else:
        bm = layer.block_m or wgmma_block_m(t * k, e, tune)
        _, experts, row_expert, live, flat, tok, pair_rows = sorted_blocks(topk_ids, bad, bm, gne, expert_map, e,
                                                                            layer.align)
        tw_rows = jnp.where(live, tw[flat], 0.0)

        def spread(rows):
            return rows

        def first_rows(y):
            return y

        if row_gather:                       # only the rows of pairs in blocks with an expert
            x_rows = gather_fn(hidden_states.astype(cdt), jnp.where(live & (row_expert >= 0), tok, -1)
                               .astype(jnp.int32), block_m=bm)
        elif h_dim % 2 == 0:                 # the same bits, moved as 32-bit words (v10/v11)
            xc = hidden_states.astype(cdt)
            words = jax.lax.bitcast_convert_type(xc.reshape(t, h_dim // 2, 2), jnp.uint32)
            x_rows = jax.lax.bitcast_convert_type(jnp.where(live[:, None], words[tok], 0), cdt).reshape(-1, h_dim)
        else:
            x_rows = jnp.where(live[:, None], hidden_states[tok], 0).astype(cdt)
        expert_of_row = row_expert
    a1 = permute_cols(spread(x_rows), w13.perm, stack_index(row_expert))
    h, gated, _ = gemm(a1, experts, bm, ops1, 2 * i_dim, h_dim, layer.split1, activation if fuse else None,
                       per_sm4=schedule == "pair", persistent=pers_of[0], stages=stages_of[0])
    if schedule == "pair" and gated and w2.perm is None and h.dtype == cdt:
        # GEMM1 wrote act(gate)·up in 8-row blocks whose rows 1–7 are act(0)·0 = 0: already
        # GEMM2's input, with no XLA pass between the two kernels
        a2 = h
    else:
        h = first_rows(h)
        if not gated:
            h = h.astype(jnp.float32)
            if interleaved:
                h = deinterleave_gate_up(h, 1)
            if w13.bias is not None:
                h = h + w13.bias[jnp.maximum(stack_index(expert_of_row), 0)].astype(jnp.float32)
            if apply_router_weight_on_input:
                h = h * tw_rows[:, None]
            h = act(h)
        a2 = permute_cols(spread(h.astype(cdt)), w2.perm, stack_index(row_expert))
    # the router weights: in GEMM2's epilogue (rows of pairs that route nowhere and padding rows
    # scaled by 0) or in XLA below; with the weights on the input GEMM2's rows are weighted
    # already (padding rows and expert −1 blocks are zero). Default: in GEMM2 for the blocked
    # schedule (where the ws stream, which takes none, may move them back to XLA), in XLA for the
    # pair schedule (laying them out for the kernel is one more XLA kernel: v11)
    in_gemm2 = (not apply_router_weight_on_input
                and (schedule == "blocked" if layer.weight_in_gemm2 is None else bool(layer.weight_in_gemm2)))
    rs = None if not in_gemm2 else tw_rows if schedule == "blocked" else spread(tw_rows[:, None])[:, 0]
    y, _, in_gemm2 = gemm(a2, experts, bm, ops2, h_dim, i_dim, layer.split2, rs=rs,
                          whole=schedule == "blocked" and bm <= 16, rs_optional=layer.weight_in_gemm2 is None,
                          persistent=pers_of[1], stages=stages_of[1])
    y = first_rows(y).astype(jnp.float32)
    row_w = live.astype(jnp.float32) if apply_router_weight_on_input else tw_rows
    if w2.bias is not None:
        bias = w2.bias[jnp.maximum(stack_index(expert_of_row), 0)].astype(jnp.float32)
        y = y + (bias * row_w[:, None] if in_gemm2 else bias)
    if not in_gemm2:
        y = y * row_w[:, None]
    if schedule == "pair":
        out = total(y.reshape(t, k, h_dim), 1)
    else:                                     # each token gathers its k rows (r: none — a zero row)
        r = y.shape[0]
        if pair_rows is not None:             # the alignment's own ("compare", "rank"): no scatter
            pos = jnp.minimum(pair_rows, r)
        else:
            pos = jnp.full((t * k + 1,), r, jnp.int32).at[jnp.where(live, flat, t * k)].set(
                jnp.arange(r, dtype=jnp.int32))[:t * k]
        # a plain sum: XLA already fuses this gather and its top-k reduction into one loop fusion
        out = jnp.where((pos < r)[:, None], y[jnp.minimum(pos, r - 1)], 0.0).reshape(t, k, h_dim).sum(1)
    out = nan_bad(out)
    return out.astype(cdt)


__all__ = ["fused_moe_wgmma", "wgmma_layer_sizes"]
