"""The MoE layer on the wgmma GEMMs (:mod:`pallas_kernels.wgmma_layer`) and its plans
(:func:`pallas_kernels.wgmma_config.plan_gemm`): the library's wgmma layout (``WgmmaWeights``:
conversion, decode), the layer's XLA glue on the CPU with ``kernels="reference"`` (the jnp
references of the GEMM and the row gather) against the float64 reference, the GEMM
configurations each GEMM gets by default (``plan_gemm`` called as the layer calls it, and the
layer checked to pass exactly those), invalid ids, the gated epilogue, the block rows; on a
Hopper GPU the layer at the model shapes, its defaults per schedule and its forced options,
against the float64 reference. Fresh random data."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.wgmma_config as wgc
import pallas_kernels.wgmma_layer as wgl
from engine_helpers import (GPU_SHAPES, GPU_TOKENS, SCHEMES, WGMMA_SCHEMES, cpu_only, gpu, layer_case, layer_close,
                            needs_hopper, reference, routed_case, table_weights, wgmma_layer, wgmma_reference_layer)
from pallas_kernels import device
from pallas_kernels.activations import FUSED_ACTIVATIONS
from pallas_kernels.align import max_padded_size
from pallas_kernels.errors import KernelConfigError, KernelDTypeError, KernelShapeError
from pallas_kernels.experts import GemmExperts
from pallas_kernels.fused_moe_tiles import max_blocks
from pallas_kernels.wgmma_config import (LayerConfig, expected_blocks, pair_schedule, plan_gemm,
                                         tuning, wgmma_block_m)
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.convert.tiles import convert_tiles
from wna16_jax.convert.wgmma import WgmmaWeights, convert_wgmma, wgmma_unsupported_reason
from wna16_jax.errors import UnsupportedError


@pytest.fixture(params=[False, True], ids=["jax0.10-stores", "transposed-store"])
def transposed_store(request, monkeypatch):
    """The plans with and without ``tout``'s transposed store (jax >= 0.11): the jnp reference
    the layer runs here ignores the store, so both are checked whatever jax this is."""
    monkeypatch.setattr(wgc, "TRANSPOSED_STORE", request.param)
    return request.param


# ----------------------------------------------------------------------------- the wgmma layout


@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_weights_convert_and_decode(key):
    """``convert_wgmma`` holds exactly the engine tiles' content (decode round trip, zero points
    re-biased for fp16), and formats outside the kernel get a reason and a typed error."""
    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, WGMMA_SCHEMES[key], 4, 256, 256).to_jax()
    tiles = convert_tiles(w)
    for dt in (jnp.bfloat16, jnp.float16):
        wg = convert_wgmma(w, dt)
        assert convert_wgmma(wg) is wg and wgmma_unsupported_reason(wg) is None
        assert wg.w13_words.dtype == jnp.int16 and wg.w13_words.shape == (4, 512, 64)
        assert wg.w13_interleaved                      # I = 256: w13 stored in the gated column order
        g13, g2 = wg.gemms()
        assert g13.words is wg.w13_words and g2.zeros is wg.w2_zeros and g13.perm is wg.w13_perm
        back = wg.to_tiles()
        for f in ("w13_qweight", "w2_qweight", "w13_zeros", "w2_zeros", "w13_perm", "w2_perm", "w13_scales",
                  "w2_scales"):
            a, b = getattr(back, f), getattr(tiles, f)
            assert (a is None) == (b is None), f
            if a is not None:
                b = b.astype(dt) if f.endswith("scales") else b     # stored in the activation dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f)
        assert convert_tiles(wg).group_size == back.group_size            # its tile view is to_tiles
    for bad, why in (("gptq8_channel", "8-bit"), ("ct4_asym_g32", "group size 32"), ("gptq4_g64", "group size 64")):
        wb = random_checkpoint_weights(rng, SCHEMES[bad], 2, 256, 256).to_jax()
        assert why in wgmma_unsupported_reason(wb)
        with pytest.raises(UnsupportedError, match="wgmma engine"):
            convert_wgmma(wb)
    w_odd = random_checkpoint_weights(rng, WGMMA_SCHEMES["awq_g128"], 2, 256, 128 * 3)  # I = 384: 3 tiles of 128
    assert wgmma_unsupported_reason(w_odd) is None and convert_wgmma(w_odd.to_jax()).w13_interleaved


@pytest.mark.parametrize("key", ["awq_g128", "gptq4_g128_actorder"])
def test_wgmma_decode_with_hidden_equal_to_group(key):
    """H = 128 = the group size: w13 has one scale group (like a channelwise layer), w2 has I/128.
    The wgmma layout's decode (its XLA path and the backward's re-layout) must still read w2 as
    group-128, matching the loader layout's decode exactly."""

    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, WGMMA_SCHEMES[key], 2, 128, 384).to_jax()
    want13, want2 = (np.asarray(a, np.float64) for a in w.dequantize(jnp.float32))
    for dt in (jnp.bfloat16, jnp.float16):
        wg = convert_wgmma(w, dt)
        got13, got2 = (np.asarray(a, np.float64) for a in jax.jit(lambda x: x.dequantize(jnp.float32))(wg))
        # the wgmma layout stores scales in the activation dtype: compare with scales rounded the same way
        ref = w.replace(w13_scales=w.w13_scales.astype(dt), w2_scales=w.w2_scales.astype(dt))
        r13, r2 = (np.asarray(a, np.float64) for a in ref.dequantize(jnp.float32))
        np.testing.assert_array_equal(got13, r13)
        np.testing.assert_array_equal(got2, r2)
        assert np.abs(got2 - want2).max() <= 1e-2 * np.abs(want2).max()


@pytest.mark.parametrize("key, h, i", [("awq_g128", 128, 384), ("gptq4_channel", 256, 128)])
def test_fused_moe_wgmma_one_k_block_cpu(monkeypatch, key, h, i):
    """A GEMM over one K-block (K = 128) has one scale group whatever the format: it runs as group
    128 (the same math as channelwise, and the ``ws`` forms stay open: here at 64-row blocks),
    while the other GEMM keeps its own group size — channelwise over several K-blocks, group 128
    over I/128 groups; the layer matches the float64 reference."""
    p = _Picks(monkeypatch, 4, h, i, key=key)
    (c1, _), (c2, _) = p.plans(run=True, block_m=64)
    one, other = (c1, c2) if h == 128 else (c2, c1)
    assert one.group_size == 128 and one.ws
    assert other.group_size == (128 if key == "awq_g128" else -1)
    p.plans(run=True, schedule="pair")


def test_fused_moe_wgmma_rejects_bad_input():
    """Typed errors naming the argument, raised while tracing (before any GPU lowering): the
    layer's arrays and its ``LayerConfig`` (validated at construction)."""
    rng = np.random.default_rng()
    w, x, tw, ids, _ = layer_case(rng, SCHEMES["awq_g128"], 4, 256, 256, 3, 2)
    wg = convert_wgmma(w.to_jax())
    with pytest.raises(KernelShapeError, match="hidden_states"):
        wgmma_layer(x[:, :128], tw, ids, wg)
    with pytest.raises(KernelDTypeError, match="hidden_states"):
        wgmma_layer(x.astype(jnp.float32), tw, ids, wg)
    w13, w2 = wg.gemms()
    with pytest.raises(KernelShapeError, match="w2.words"):
        wgl.fused_moe_wgmma(x, tw, ids, w13, w13)
    with pytest.raises(KernelConfigError, match="activation"):
        wgmma_layer(x, tw, ids, wg, activation="relu")
    for bad, what in ((dict(schedule="stream"), "schedule"), (dict(align="radix"), "align"),
                      (dict(align="count"), "align"), (dict(kernels="triton"), "kernels"),
                      (dict(block_n=256), "block_n: expected 64 or 128"), (dict(split1=0), "split1"),
                      (dict(block_m=24.0), "block_m"), (dict(persistent="gemm2"), "persistent")):
        with pytest.raises(KernelConfigError, match=what):
            wgmma_layer(x, tw, ids, wg, **bad)
        with pytest.raises(KernelConfigError, match=what):
            LayerConfig(**bad)
    for removed in ("combine", "cluster", "zfold", "overlap", "one_kernel", "token_rows", "static_sums"):
        with pytest.raises(TypeError, match=removed):                  # options of the deleted experiments
            LayerConfig(**{removed: True})
    with pytest.raises(KernelConfigError, match="either config or its fields"):
        wgmma_layer(x, tw, ids, wg, config=LayerConfig(), block_m=16)
    assert wgmma_reference_layer(x[:0], tw[:0], ids[:0], wg).shape == (0, 256)


# ----------------------------------------------------------------------------- the glue on the CPU


_GLUE_CASES = [(3, False, False, False, "silu"), (40, True, True, False, "silu"), (9, True, False, True, "gelu_tanh")]
_GLUE_SCHEDULES = [(None, None), (3, "pair"), (3, "blocked"), (None, "wide")]


# every scheme × every schedule, the three epilogue cases in turn (each case meets every scheme
# and every schedule at least once): 12 layers instead of the full 36-way product
@pytest.mark.parametrize("key, t, bias, map_, on_input, activation, split, schedule", [
    (key,) + _GLUE_CASES[(i + j) % 3] + _GLUE_SCHEDULES[j]
    for i, key in enumerate(sorted(WGMMA_SCHEMES)) for j in range(4)])
def test_fused_moe_wgmma_glue_cpu(key, t, bias, map_, on_input, activation, split, schedule):
    """The wgmma layer's schedules (pair: no alignment; blocked: sorted rows), bias, router
    weights (on input too), expert map, activation and top-k sum against the float64 reference
    on the CPU, the kernels replaced by their jnp references (``kernels="reference"``; the kernels
    themselves are checked on the GPU by ``test_wgmma_grouped_gemm_gpu`` and
    ``test_fused_moe_wgmma_gpu_shapes``). The blocked rows' top-k sum through each alignment
    method's pair rows (compare, rank) or the inverse order (sort), the router weights in GEMM2's
    epilogue and in XLA (each schedule's default, then both forced), the token rows gathered by
    XLA (as 32-bit words) or by the row gather — whose reference leaves NaN in the rows outside
    the pairs' blocks, so a layer that read them would fail."""
    rng = np.random.default_rng()
    w, x, tw, ids, em = layer_case(rng, WGMMA_SCHEMES[key], 6, 256, 256, t, 2, bias=bias, map_=map_)
    wg = convert_wgmma(w.to_jax())
    wide = schedule == "wide"                           # 256-deep steps: splits must divide K-blocks / 2
    ref = reference(w, x, tw, ids, em, activation=activation, on_input=on_input)
    cases = [("auto", None, None), ("compare", True, True), ("rank", False, False)]
    for align, in_gemm2, rg in cases + ([] if schedule == "pair" else [("sort", None, True)]):
        got = jax.jit(functools.partial(wgmma_reference_layer, activation=activation, split1=split, split2=split,
                                        schedule=None if wide else schedule, wide=True if wide else None,
                                        apply_router_weight_on_input=on_input, align=align,
                                        weight_in_gemm2=in_gemm2, row_gather=rg))(x, tw, ids, wg, em)
        layer_close(got, ref, what=f"align={align} weight_in_gemm2={in_gemm2} row_gather={rg}")


@pytest.mark.parametrize("schedule", ["pair", "blocked"])
def test_fused_moe_wgmma_invalid_ids_cpu(schedule):
    """An out-of-range expert id in any top-k slot (not only the first) gives its token a NaN row;
    the other tokens match the float64 reference (kernels replaced by their jnp references)."""
    rng = np.random.default_rng()
    w, x, tw, ids, _ = layer_case(rng, WGMMA_SCHEMES["awq_g128"], 6, 256, 256, 5, 3)
    bad_at = {1: (1, 6), 3: (2, -1)}                    # token: (slot, id) — past the experts, negative
    bad_ids = ids
    for tok, (slot, bad_id) in bad_at.items():
        bad_ids = bad_ids.at[tok, slot].set(bad_id)
    got = np.asarray(jax.jit(functools.partial(wgmma_reference_layer, schedule=schedule))(
        x, tw, bad_ids, convert_wgmma(w.to_jax())).astype(jnp.float32), np.float64)
    ok = np.array([t for t in range(5) if t not in bad_at])
    assert np.isnan(got[list(bad_at)]).all()
    layer_close(got[ok], reference(w, x[ok], tw[ok], ids[ok], None), what=f"valid tokens, {schedule}")


def _spy_gemms(monkeypatch, seen):
    """Record ``(GemmConfig, row scales given)`` of each GEMM the layer runs on the reference."""
    real = wgl.wgmma_grouped_gemm_reference

    def spy(a, expert_ids, words, scales, zeros=None, row_scale=None, *, config):
        seen.append((config, row_scale is not None))
        return real(a, expert_ids, words, scales, zeros, row_scale, config=config)

    monkeypatch.setattr(wgl, "wgmma_grouped_gemm_reference", spy)


@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_fused_moe_wgmma_gated_cpu(monkeypatch, key):
    """GEMM1's gated epilogue (the default without a K split) and the unfused path on the same
    interleaved weights (XLA restores the column order), both activations, pair and blocked
    schedules, against the float64 reference; a w13 bias turns the fusion off and stays correct."""
    seen = []
    _spy_gemms(monkeypatch, seen)
    rng = np.random.default_rng()
    for t, act, bias, schedule in ((2, "silu", False, "pair"), (24, "gelu_tanh", False, "blocked"),
                                   (24, "silu", True, "blocked")):
        w, x, tw, ids, _ = layer_case(rng, WGMMA_SCHEMES[key], 6, 256, 384, t, 2, bias=bias)
        wg = convert_wgmma(w.to_jax())
        assert wg.w13_interleaved and wg.w13_words.shape[1] == 768
        ref = reference(w, x, tw, ids, None, activation=act, on_input=False)
        for fuse in (None, False):
            seen.clear()
            got = jax.jit(functools.partial(wgmma_reference_layer, activation=act, split1=1, split2=1,
                                            schedule=schedule, fuse_act=fuse))(x, tw, ids, wg)
            assert seen[0][0].gated == (act if fuse is None and not bias else None), (seen, fuse, bias)
            assert seen[1][0].gated is None
            layer_close(got, ref, what=f"{act} fuse_act={fuse} bias={bias} {schedule}")


def test_fused_moe_wgmma_row_gather_default_cpu(monkeypatch):
    """The blocked schedule gathers the token rows with the row-gather kernel by default only from
    ``row_gather_min_pairs`` routed pairs on (XLA's gather below, which fuses into the glue);
    ``row_gather=True`` / ``False`` force either; never in the pair schedule. Traced with the
    kernels replaced by their jnp references, counting the row-gather calls."""
    calls = []
    real = wgl.gather_rows_reference

    def spy(x, idx, *, block_m):
        calls.append(idx.shape)
        return real(x, idx, block_m=block_m)

    monkeypatch.setattr(wgl, "gather_rows_reference", spy)
    h, i, e, k = 256, 256, 8, 4
    wg = convert_wgmma(random_checkpoint_weights(np.random.default_rng(), WGMMA_SCHEMES["awq_g128"], e, h, i).to_jax())
    bf = jnp.bfloat16
    lim = tuning().row_gather_min_pairs
    s = jax.ShapeDtypeStruct
    for t, over, want in [(lim // k - 1, {}, 0), (lim // k, {}, 1), (lim // k - 1, dict(row_gather=True), 1),
                          (lim // k, dict(row_gather=False), 0), (4, dict(block_m=16), 0),
                          (1, dict(schedule="pair", row_gather=True), 0)]:
        calls.clear()
        jax.eval_shape(functools.partial(wgmma_reference_layer, schedule=over.pop("schedule", "blocked"), **over),
                       s((t, h), bf), s((t, k), jnp.float32), s((t, k), jnp.int32), wg)
        assert len(calls) == want, (t, over, calls)


# ----------------------------------------------------------------------------- the plans


def _plans(options, *, e, h, i, t=24, k=2, gne=None, zp=True, groups=(128, 128), sms=1, interleaved=True,
           w13_bias=False):
    """``((GemmConfig, applies row scales) of GEMM1, the same of GEMM2)``: :func:`plan_gemm` called
    with the arguments the layer gives it for a layer of ``E, H, I`` at ``t`` tokens top-``k``
    (``options``: the ``LayerConfig`` fields, ``activation``, ``apply_router_weight_on_input``;
    ``groups``: each GEMM's group size — channelwise where one scale group spans several K-blocks,
    else 128, a K of 128 included)."""
    options = dict(options)
    activation = options.pop("activation", "silu")
    on_input = options.pop("apply_router_weight_on_input", False)
    layer = LayerConfig(**options)
    schedule = pair_schedule(t * k, e, layer)
    if schedule == "pair":
        bm, nb = 8, t * k
    else:
        bm = layer.block_m or wgmma_block_m(t * k, e)
        nb = min(max_blocks(t * k, bm, e), max_padded_size(t * k, bm, gne or e) // bm)
    fuse = ((layer.fuse_act is None or layer.fuse_act) and interleaved and layer.block_n == 128
            and activation in FUSED_ACTIVATIONS and not w13_bias and not on_input)
    in_gemm2 = not on_input and (schedule == "blocked" if layer.weight_in_gemm2 is None
                                 else bool(layer.weight_in_gemm2))
    common = dict(n_blocks=nb, block_m=bm, has_zp=zp, sms=sms)
    (s1, s2), (p1, p2) = layer.stages_pair, layer.persistent_pair
    return (plan_gemm(layer, n=2 * i, k=h, split=layer.split1, gate=activation if fuse else None,
                      per_sm4=schedule == "pair", persistent=p1, stages=s1, group_size=groups[0], **common),
            plan_gemm(layer, n=h, k=i, split=layer.split2, has_row_scale=in_gemm2,
                      row_scale_optional=layer.weight_in_gemm2 is None, whole=schedule == "blocked" and bm <= 16,
                      persistent=p2, stages=s2, group_size=groups[1], **common))


class _Picks:
    """A random AWQ layer of ``E, H, I`` at ``t`` tokens top-``k`` and its float64 reference, to
    check plans: :meth:`plans` calls :func:`plan_gemm` as the layer does, and checks that the
    layer (traced with ``kernels="reference"``, a spy on its GEMMs) runs exactly those
    configurations; :meth:`run` also compares the layer's output with the float64 reference."""

    def __init__(self, monkeypatch, e, h, i, t=24, k=2, sms=1, key="awq_g128", **case):
        self.mp, self.sms = monkeypatch, sms
        self.w, self.x, self.tw, self.ids, self.em = layer_case(np.random.default_rng(), WGMMA_SCHEMES[key], e, h, i,
                                                                t, k, **case)
        self.wg = convert_wgmma(self.w.to_jax())
        self.shape = dict(e=e, h=h, i=i, t=t, k=k, gne=None if self.em is None else self.em.shape[0], sms=sms,
                          zp=self.wg.w13_zeros is not None,
                          groups=tuple(-1 if sc.shape[1] == 1 and kd > 128 else 128      # one group over K > 128
                                       for sc, kd in ((self.wg.w13_scales, h), (self.wg.w2_scales, i))),
                          w13_bias=self.w.w13_bias is not None)
        self.seen = []
        _spy_gemms(monkeypatch, self.seen)
        monkeypatch.setattr(device, "num_sms", lambda: sms)

    def plans(self, run=False, **options):
        """``[(GemmConfig, applies row scales)] * 2`` of the layer with ``options``."""
        want = list(_plans(options, **self.shape))
        self.seen.clear()
        layer = jax.jit(functools.partial(wgmma_reference_layer, **options))
        if run:
            layer_close(layer(self.x, self.tw, self.ids, self.wg, self.em),
                        reference(self.w, self.x, self.tw, self.ids, self.em,
                                  activation=options.get("activation", "silu"),
                                  on_input=options.get("apply_router_weight_on_input", False)), what=str(options))
        else:
            jax.eval_shape(layer, self.x, self.tw, self.ids, self.wg, self.em)
        assert self.seen == want, (options, self.seen, want)
        return want         # (every plan fits the shared memory: the reference runs the GEMM's checks)

    def check(self, pick, cases, close=()):
        """Each ``(options, [GEMM1's pick, GEMM2's])`` of ``cases``, the layer run (not only traced)
        in the cases whose indices ``close`` lists."""
        for n, (over, want) in enumerate(cases):
            got = [pick(cfg, rs) for cfg, rs in self.plans(run=n in close, **over)]
            assert got == want, (over, got, want)


def test_fused_moe_wgmma_fold_defaults_cpu(monkeypatch):
    """Which GEMMs fold each K-block's partial (``sfold``) by default: blocks of up to
    ``fold_rows`` (24) rows — the pair schedule's 8-row blocks and blocked ones — and no larger
    ones; ``sfold=False`` turns it off; the layer stays right in each case."""
    p = _Picks(monkeypatch, 6, 256, 256)
    assert tuning().fold_rows == 24
    cases = [(dict(schedule="pair"), (8, True)), (dict(schedule="pair", sfold=False), (8, False)),
             (dict(block_m=16), (16, True)), (dict(block_m=16, sfold=False), (16, False)),
             (dict(block_m=24), (24, True)), (dict(block_m=24, sfold=False), (24, False)),
             (dict(block_m=32), (32, False)), (dict(block_m=48), (48, False))]
    p.check(lambda c, rs: (c.block_m, c.sfold), [(over, [want, want]) for over, want in cases], close=(0, 1, 4, 6))


def test_fused_moe_wgmma_ws_fold_cpu(monkeypatch):
    """``ws=True`` given puts the scale-only fold GEMMs (blocks of up to ``fold_rows`` rows) on the
    kernel's ``ws`` with ``sfold``, 64- or 128-column warpgroups; by default they keep the plain
    kernel; ``sfold=False`` with ``ws=True``: ``ws`` without the fold; the layer stays right."""
    p = _Picks(monkeypatch, 6, 256, 256)
    cases = [(dict(block_m=16, ws=True), [(True, True, 128)] * 2),
             (dict(block_m=24, ws=True, block_n=64), [(True, True, 64)] * 2),
             (dict(block_m=16), [(False, True, 128)] * 2),
             (dict(block_m=16, ws=True, sfold=False), [(True, False, 128)] * 2)]
    p.check(lambda c, rs: (c.ws, c.sfold, c.block_n), cases, close=(0, 1, 3))


def test_fused_moe_wgmma_ws_defaults_cpu(monkeypatch):
    """Which GEMMs are warp-specialized by default, and at what depth: 64-row blocks and up
    always; 32- to 63-row blocks only where a program streams 32 or more K-blocks (here GEMM1 over
    H = 4096, also in 128-deep steps), else no ``ws`` and 2 stages (two programs per SM; those
    with 2+ steps run as the chained ``ws`` stream by default, see
    ``test_fused_moe_wgmma_ws_stream_default_cpu``); an explicit ``ws=False`` keeps the stage rule
    of the blocks without it; the 24-row scale-only fold blocks streaming 32+ K-blocks too (v25);
    the layer stays right."""
    # GEMM1: K = 4096, 16 steps of 256 (its ws programs fitted to shared memory at 3 stages); GEMM2:
    # K = 256, one step (32-row blocks keep the rule of decode blocks: 4 stages below 8 steps); in
    # 128-deep steps GEMM2's two steps take the ws stream unless persistent=False
    p = _Picks(monkeypatch, 4, 4096, 256)
    cases = [(dict(block_m=48), [(True, 3), (False, 2)]), (dict(block_m=64), [(True, 3), (True, 4)]),
             (dict(block_m=32), [(True, 2), (False, 4)]), (dict(block_m=48, ws=False), [(False, 4), (False, 4)]),
             (dict(block_m=48, stages=3), [(True, 3), (False, 3)]),
             (dict(block_m=48, wide=False, persistent=False), [(True, 4), (False, 2)]),
             (dict(block_m=48, wide=False), [(True, 4), (True, 2)]),
             # the 24-row scale-only fold blocks too where a program streams 32+ K-blocks (GEMM1
             # here), not 16-row ones, not without the scale-only fold, not ws=False
             (dict(block_m=24), [(True, 2), (False, 4)]), (dict(block_m=16), [(False, 2), (False, 4)]),
             (dict(block_m=24, sfold=False), [(False, 2), (False, 4)]),
             (dict(block_m=24, ws=False), [(False, 2), (False, 4)])]
    p.check(lambda c, rs: (c.ws, c.stages), cases, close=(0, 6, 7))


def test_fused_moe_wgmma_ws_stream_default_cpu(monkeypatch, transposed_store):
    """The default for medium blocks (33–63 rows) whose short K streams keep them off ``ws``:
    the chained ``ws`` stream (``stream=True``), its ring the deepest of 4 that fits and divides
    an item's steps, with the router weights moved from GEMM2's epilogue to XLA. Not with
    ``persistent=False`` (no ``ws``, 2 stages, two programs per SM), an explicit
    ``weight_in_gemm2=True`` (GEMM2 keeps its row scales, so it keeps that form), ``ws=False``,
    at 32 or 64 rows, or where an item is one step; a pair sets the two GEMMs apart; the layer
    stays right, with biases and an expert map too; a bad ``persistent`` is a config error."""
    # H = 1024: GEMM1 8 K-blocks, 4 steps of 256 (4 stages do not fit with ws at 48 rows, 3 do not
    # divide 4: 2); I = 512: GEMM2 4 K-blocks, 2 steps (in 128-deep steps: 8 and 4 steps)
    p = _Picks(monkeypatch, 4, 1024, 512)

    def pick(c, rs):
        return c.stream, c.ws, c.stages, rs
    stream, plain2 = (True, True, 2, False), (False, False, 2, False)
    cases = [(dict(block_m=48), [stream, stream]),
             (dict(block_m=48, persistent=False), [plain2, (False, False, 2, True)]),
             (dict(block_m=48, weight_in_gemm2=True), [stream, (False, False, 2, True)]),
             (dict(block_m=48, ws=False), [(False, False, 4, False), (False, False, 4, True)]),
             (dict(block_m=48, wide=False), [(True, True, 4, False), (True, True, 4, False)]),
             (dict(block_m=32), [(False, False, 4, False), (False, False, 4, True)]),
             (dict(block_m=64), [(False, True, 3, False), (False, True, 4, True)]),
             (dict(block_m=48, split2=2), [stream, (False, False, 2, True)]),
             # one value per GEMM
             (dict(block_m=48, persistent=(False, None)), [plain2, stream]),
             (dict(block_m=48, persistent=(None, False)), [stream, (False, False, 2, True)]),
             # GEMM2's 2-step items at 64 rows: 3 stages fit, 2 with the output tile (jax >= 0.11)
             (dict(block_m=64, persistent=(None, True), weight_in_gemm2=False),
              [(False, True, 3, False), (True, True, 2 if transposed_store else 3, False)])]
    # the numbers where the glue differs: the router weights left to XLA (the stream), in GEMM2
    p.check(pick, cases, close=(0, 1))
    # with biases (w13's keeps the activation out of GEMM1) and an expert map: the router weights
    # GEMM2 leaves to XLA still scale its bias, as in the reference
    q = _Picks(monkeypatch, 4, 1024, 512, key="gptq4_g128_actorder", bias=True, map_=True)
    assert [pick(c, rs) for c, rs in q.plans(run=True, block_m=48)] == [stream, stream]
    for bad in ((True,), (None, True, False), 2, "gemm2"):
        with pytest.raises(KernelConfigError, match="persistent"):
            wgmma_reference_layer(q.x, q.tw, q.ids, q.wg, q.em, persistent=bad)


def test_fused_moe_wgmma_persistent_cpu(monkeypatch):
    """``persistent=True`` asks for the chained ``ws`` stream in every GEMM where ``ws`` applies
    and the GEMM applies no row scales (GEMM1 at 48 rows over a 32-K-block stream, at 128 rows;
    GEMM2 too once the router weights leave it); elsewhere the GEMM keeps its form (the plain
    kernel below ``ws``'s rows, the plain ``ws`` kernel where row scales stay); the stream's ring
    depth divides an item's steps; the layer stays right."""
    p = _Picks(monkeypatch, 4, 4096, 256)
    one = dict(persistent=True, split1=1, split2=1)
    cases = [(dict(block_m=48, **one), [(True, True), (False, False)]),     # GEMM1: ws by default (32 K-blocks)
             (dict(block_m=128, **one), [(True, True), (False, True)]),
             (dict(block_m=128, weight_in_gemm2=False, **one), [(True, True)] * 2),
             (dict(block_m=48, ws=True, weight_in_gemm2=False, **one), [(True, True)] * 2),
             (dict(block_m=48, persistent=True, split1=2, split2=1), [(False, False)] * 2),
             (dict(schedule="pair", persistent=True, split1=2, split2=2), [(False, False)] * 2),
             (dict(block_m=16, **one), [(False, False)] * 2),
             (dict(block_m=128, split1=1, split2=1), [(False, True)] * 2)]
    p.check(lambda c, rs: (c.stream, c.ws), cases, close=(0, 2, 5))
    # the stream's ring depth divides an item's steps: GEMM1's 16 steps of 256 at 48 rows fit 3 stages
    # with ws, so 2; stages=4 given: 4 would not fit, 3 does not divide 16, so 2 again; GEMM2 (its
    # row scales keep it off the stream) takes the medium blocks' 2 stages, or the 4 given
    cases = [(dict(block_m=48, **one), [(True, True, 2), (False, False, 2)]),
             (dict(block_m=48, stages=4, **one), [(True, True, 2), (False, False, 4)])]
    p.check(lambda c, rs: (c.stream, c.ws, c.stages), cases)


def test_fused_moe_wgmma_split_defaults_cpu(monkeypatch, transposed_store):
    """GEMM2's K split by default on an H200's 132 SMs (v16): the blocked schedule's GEMM2 in fold
    blocks (up to 16 rows) runs unsplit, its output 16-bit and, with the transposed store, ``[M,
    N]`` tiles (``tout``, 8-row blocks too); a given ``split2`` still splits (float32 partials, no
    ``tout``); 32-row blocks keep about 2 programs per SM; GEMM1 keeps its rule; the layer stays
    right."""
    tr = transposed_store
    p = _Picks(monkeypatch, 4, 2048, 2048, sms=132)

    def pick(c, rs):
        return c.block_m, c.split_k, c.out16, c.tout
    # H = I = 2048: 8 steps of 256 per GEMM, few tiles (4 experts, 24 tokens)
    cases = [(dict(block_m=8), [(8, 1, True, tr), (8, 1, True, tr)]),
             (dict(block_m=16), [(16, 2, False, False), (16, 1, True, tr)]),
             (dict(block_m=8, split2=2), [(8, 1, True, tr), (8, 2, False, False)]),
             (dict(block_m=8, tout=False), [(8, 1, True, False), (8, 1, True, False)]),
             (dict(block_m=32), [(32, 2, False, False), (32, 2, False, False)])]
    p.check(pick, cases, close=(0,))


def test_fused_moe_wgmma_stages_pair_cpu(monkeypatch):
    """``stages`` as a pair ``(GEMM1's, GEMM2's)`` sets the two GEMMs' ring depths apart (``None``
    in it: that GEMM's default), one value sets both, and anything else is a config error
    naming the option; the layer stays right."""
    # GEMM1: K = 4096 in 256-deep steps (2 stages by default at 16-row blocks); GEMM2: K = 256, one step (4)
    p = _Picks(monkeypatch, 4, 4096, 256)
    cases = [(dict(block_m=16), [2, 4]), (dict(block_m=16, stages=(None, 3)), [2, 3]),
             (dict(block_m=16, stages=(3, None)), [3, 4]), (dict(block_m=16, stages=3), [3, 3]),
             (dict(schedule="pair", stages=[None, np.int64(2)]), [2, 2])]
    p.check(lambda c, rs: c.stages, cases, close=(1, 4))
    for bad in ((2, 3, 4), 0, (2, "x"), True, (None, -1)):
        with pytest.raises(KernelConfigError, match="stages: expected"):
            jax.eval_shape(functools.partial(wgmma_reference_layer, stages=bad), p.x, p.tw, p.ids, p.wg)


def test_fused_moe_wgmma_kernel_options_cpu(monkeypatch, transposed_store):
    """The per-GEMM kernel options the layer picks (the measured defaults of
    docs/journal/notes.md): 2 stages for blocks of up to 32 rows streaming >= 8 steps, else 4; the
    scale-only fold up to ``fold_rows`` rows; ``wide`` below 128-row blocks; ``ws`` from 64 rows,
    and from 32 rows for streams of 32+ K-blocks, with the fold only when ``ws=True`` is given;
    the 16-bit output where unsplit, ``tout`` with the transposed store where it fits; stages
    fitted to shared memory; the gated epilogue where it applies; explicit options win."""
    tr = transposed_store
    p = _Picks(monkeypatch, 2, 2048, 128, t=8)

    def picks(**over):
        (c1, _), (c2, _) = p.plans(**{"split1": 1, "split2": 1, **over})
        return {2048: c1, 128: c2}                   # K → config (GEMM1: K = 2048, GEMM2: K = 128)

    def opts(c):
        return c.block_m, c.stages, c.kpb, c.wide, c.ws

    assert picks(block_m=128, ws=True)[2048].ws and not picks(block_m=8)[2048].ws     # folds: no ws by default,
    assert picks(block_m=8, ws=True)[2048].ws and picks(block_m=8, ws=True)[2048].sfold    # ws=True: with the fold
    assert not picks(block_m=128, ws=False)[2048].ws and not picks(block_m=16)[2048].ws
    o = picks(block_m=32)[2048]                                    # no K split: 16-bit out, [M, N] tiles
    assert o.out16 and o.tout == tr and not picks(block_m=32, tout=False)[2048].tout
    o = picks(block_m=128)[2048]                                   # 128 rows: tout with one stage fewer
    assert o.out16 and o.tout == tr and o.stages == (3 if tr else 4)
    o = picks(block_m=128, tout=False)[2048]
    assert not o.tout and o.stages == 4
    o = picks(block_m=128, wide=True, tout=True)[2048]             # 2 stages of 256-deep steps: no room
    assert o.kpb == 2 and o.stages == 2 and not o.tout
    o = picks(block_m=8)[2048]                                     # 8-row blocks too
    assert o.out16 and o.tout == tr and not picks(block_m=8, tout=False)[2048].tout
    o = picks(block_m=8, split1=4)[2048]                           # split partials stay float32
    assert o.split_k == 4 and not o.out16 and not picks(block_m=8, split1=4, tout=True)[2048].tout
    assert not picks(block_m=32, out16=False)[2048].out16 and not picks(block_m=32, out16=False)[2048].tout
    p8 = picks(block_m=8)
    assert opts(p8[2048]) == (8, 2, 2, True, False)               # 16 K-blocks, 2 per step: 8 steps
    assert opts(p8[128]) == (8, 4, 1, False, False)               # one K-block
    assert p8[2048].sfold and p8[128].sfold                       # the fold is scale-only
    assert picks(block_m=8, sfold=True) == p8
    # 32-row blocks: ws only for streams of 32+ K-blocks, here 16 and 1
    assert opts(picks(block_m=32)[2048]) == (32, 2, 2, True, False)
    assert opts(picks(block_m=32)[128]) == (32, 4, 1, False, False)
    assert opts(picks(block_m=32, ws=True)[128]) == (32, 4, 1, False, True)   # N = 2048
    assert opts(picks(block_m=128, tout=False)[2048]) == (128, 4, 1, False, True)
    assert opts(picks(block_m=128, wide=True)[2048]) == (128, 2, 2, True, True)
    o = picks(block_m=8, stages=3)[2048]
    assert opts(o) == (8, 3, 2, True, False) and o.sfold
    # 64-row blocks with 256-deep steps: 4 stages (288 KB with the output tile) do not fit the
    # 227 KB of shared memory: 3 for GEMM1; GEMM2 (one K-block: 128-deep steps) keeps 4
    o = picks(block_m=64)
    assert opts(o[2048]) == (64, 3, 2, True, True) and o[2048].tout == tr
    assert opts(o[128]) == (64, 4, 1, False, True) and o[128].tout == tr
    assert picks(block_m=64, stages=6)[2048].stages == 3                 # explicit stages are fitted too
    # 128-deep steps: 16 per program
    assert opts(picks(block_m=16, wide=False)[2048]) == (16, 2, 1, False, False)
    assert opts(picks(block_m=16, split1=4)[2048]) == (16, 4, 2, True, False)   # 2 steps, sfold
    # the gated epilogue: GEMM1 without a K split, 128-column tiles, weights in the gated order, no
    # w13 bias, the router weight not on the input, an activation the epilogue has
    assert p.wg.w13_interleaved
    for bm in (8, 32, 128):
        c = picks(block_m=bm)
        assert c[2048].gated == "silu" and c[128].gated is None
    assert picks(block_m=32, activation="gelu_tanh")[2048].gated == "gelu_tanh"
    for over in (dict(split1=4), dict(fuse_act=False), dict(block_n=64), dict(apply_router_weight_on_input=True),
                 dict(activation="swigluoai"), dict(activation="gelu")):
        assert picks(block_m=32, **over)[2048].gated is None, over


def test_wgmma_block_m():
    """Block rows per shape: the fewest expected blocks below 128 rows (the measured decode choices
    of docs/journal/notes.md v9), blocks sized to the binomial spread of an expert's rows at
    prefill (v10), 24 rows (``fold_rows``) where a 32-row pick needs at most 3% fewer blocks (v17);
    the expected block count against a simulation of uniform routing."""
    # 24 rows where a 32-row pick needs at most 3% fewer blocks (Mixtral 64 tokens, Qwen3 256,
    # DeepSeek-V2-Lite 128); 32 rows stay at Mixtral 80 tokens (8.0 blocks against 9.1)
    cases = {(2, 8): 8, (32, 8): 8, (64, 8): 16, (128, 8): 24, (160, 8): 32, (1024, 8): 144, (8192, 8): 128,
             (512, 128): 8, (2048, 128): 24, (4096, 128): 48, (32768, 128): 144,                 # Qwen3
             (96, 64): 8, (384, 64): 16, (768, 64): 24, (3072, 64): 64,                          # DeepSeek-V2-Lite
             (1, 1): 8, (300, 1): 160, (0, 8): 8}
    assert {c: wgmma_block_m(*c) for c in cases} == cases
    rng = np.random.default_rng()
    for pairs, e, bm in ((1024, 8, 128), (1024, 8, 144), (4096, 128, 32), (64, 8, 16), (5, 1, 8)):
        counts = np.stack([np.bincount(rng.integers(0, e, pairs), minlength=e) for _ in range(4000)])
        sim = np.ceil(counts / bm).sum(1).mean()
        assert abs(expected_blocks(pairs, e, bm) - sim) < 0.01 * sim + 0.05, (pairs, e, bm, sim)
    assert pair_schedule(16, 16, LayerConfig()) == "pair" and pair_schedule(17, 16, LayerConfig()) == "blocked"
    assert pair_schedule(2, 16, LayerConfig(block_m=16)) == "blocked"
    assert pair_schedule(200, 16, LayerConfig(schedule="pair")) == "pair"


@cpu_only
def test_fused_moe_wgmma_lowers_at_table_shapes():
    """The layer at two of the benchmark's rows, abstract weights of the real sizes — Mixtral 64
    tokens (24-row blocks: the plain fold kernels) and Qwen3 512 tokens (48-row blocks: the
    chained ``ws`` stream, and the row-gather kernel from 1024 routed pairs on) — lowers to
    Mosaic GPU kernels, and so does the pair schedule at 1 token."""
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for (e, k, h, i), t in (((8, 2, 4096, 14336), 64), ((128, 8, 2048, 768), 512), ((8, 2, 4096, 14336), 1)):
        w13 = GemmExperts(s((e, 2 * i, h // 4), jnp.int16), s((e, h // 128, 2 * i), bf), s((e, h // 128, 2 * i), bf))
        w2 = GemmExperts(s((e, h, i // 4), jnp.int16), s((e, i // 128, h), bf), s((e, i // 128, h), bf))
        args = (s((t, h), bf), s((t, k), jnp.float32), s((t, k), jnp.int32), w13, w2)
        text = jax.jit(functools.partial(wgl.fused_moe_wgmma, interleaved=True)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (e, t)
        assert ("row_gather" in text) == (t * k >= tuning().row_gather_min_pairs), (e, t)


# ----------------------------------------------------------------------------- GPU: model shapes


@gpu
@needs_hopper
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_fused_moe_wgmma_gpu_shapes(shape, key):
    """The layer on the wgmma kernels at the three model shapes, on the weights the dispatch table
    prepares on the H200 and through ``fused_moe``: decode, a few-token batch and a prefill batch,
    the default options, all options off, and forced schedules / options per regime (8- to
    144-row blocks, split-K, 64-column tiles, wide, sfold, ws, tout, the row gather, the alignment
    methods), against the float64 reference; expert 0 never routed. (The kernels create their
    outputs and write every element — an id of -1 writes zeros — so there is no buffer to poison;
    NaN or a missed tile fails the finite / error checks.)"""
    from wna16_jax import executors
    from wna16_jax.moe import fused_moe

    rng, k, w, wg = table_weights(shape, key)                    # what the table runs on the H200
    assert isinstance(wg, WgmmaWeights) and executors.select(wg, jnp.bfloat16).executor is executors.WGMMA
    off = dict(wide=False, sfold=False, ws=False, out16=False, fuse_act=False, persistent=False,
               weight_in_gemm2=False, row_gather=False)
    decode = (dict(schedule="pair", wide=False), dict(schedule="blocked"),
              dict(block_m=16, split1=2, split2=2, sfold=True), dict(block_m=32, wide=False),
              dict(block_m=16, split1=1, split2=1, tout=True), dict(block_m=16, split1=1, split2=1, fuse_act=False),
              dict(schedule="blocked", align="sort", row_gather=True))
    prefill = (dict(block_m=64, block_n=64, stages=2), dict(block_m=128, wide=True), dict(block_m=128),
               dict(block_m=128, ws=True, out16=False), dict(block_m=32, block_n=64, ws=True),
               dict(block_m=128, tout=True), dict(block_m=32, tout=True), dict(block_m=128, fuse_act=False),
               dict(block_m=32, fuse_act=False), dict(align="rank", row_gather=True),
               dict(block_m=64),                     # stages fitted to shared memory (3 / 2 with tout)
               dict(block_m=144), dict(block_m=48, ws=False))    # blocks that are not a power of two
    for t in GPU_TOKENS[shape] + (300,):
        x, tw, ids, ref = routed_case(rng, w, t, k)
        layer_close(jax.jit(fused_moe)(x, tw, ids, wg), ref, what=f"fused_moe (wgmma) T={t}")   # defaults
        for over in (off,) + (decode if t <= 16 else prefill):
            got = jax.jit(functools.partial(wgmma_layer, **over))(x, tw, ids, wg)
            layer_close(got, ref, what=f"wgmma {over} T={t}")


def _layer_rows(shape, key, rows, **fixed):
    """The GPU defaults tests' loop: on random ``WGMMA_SCHEMES[key]`` weights at
    ``GPU_SHAPES[shape]`` that the table prepares, for each ``(tokens, options)`` of ``rows`` fresh
    inputs with expert 0 never routed; the layer through ``fused_moe`` (the table's defaults),
    then the wgmma layer with each option dict of ``options`` over ``fixed`` (one jitted function
    per dict, so a repeated dict runs the same compiled program); every output against the
    float64 reference."""
    from wna16_jax.moe import fused_moe

    rng, k, w, wg = table_weights(shape, key)
    assert isinstance(wg, WgmmaWeights)
    jitted = {}
    for t, options in rows:
        x, tw, ids, ref = routed_case(rng, w, t, k)
        layer_close(jax.jit(fused_moe)(x, tw, ids, wg), ref, what=f"fused_moe T={t}")
        for over in options:
            opts = {**fixed, **over}
            name = repr(sorted(opts.items()))
            if name not in jitted:
                jitted[name] = jax.jit(functools.partial(wgmma_layer, **opts))
            layer_close(jitted[name](x, tw, ids, wg), ref, what=f"{opts} T={t}")


# the pair schedule's rows: 1 token and 3 (Mixtral: 4, the most whose pairs its 8 experts hold),
# Qwen3 16 (128 pairs on 128 experts)
PAIR_ROWS = {"mixtral": ((1, ()), (4, ())), "qwen3": ((1, ()), (3, ()), (16, (dict(tout=False, split2=2),))),
             "dsv2lite": ((1, ()), (3, ()))}


@gpu
@needs_hopper
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_pair_defaults_gpu(shape, key):
    """The decode (pair) schedule's defaults — ``sfold``, GEMM1's K split to ~4 programs per SM
    (Mixtral 1 token: 2), the gated GEMM1 writing GEMM2's input, both GEMMs unsplit with ``[M, N]``
    tiles at Qwen3 16 tokens — and the earlier forms (``sfold=False``; GEMM1 unsplit; ``tout=False,
    split2=2``), through ``fused_moe`` on the weights the table prepares, expert 0 never routed,
    fresh inputs per call, against the float64 reference."""
    e, k = GPU_SHAPES[shape][:2]
    assert all(pair_schedule(t * k, e, LayerConfig()) == "pair" for t, _ in PAIR_ROWS[shape])
    overs = (dict(sfold=False), dict(sfold=True, split1=1))
    _layer_rows(shape, key, [(t, overs + extra) for t, extra in PAIR_ROWS[shape]], schedule="pair")


_DECODE = (dict(sfold=False), dict(persistent=True, split1=1, split2=1), dict(split2=2, tout=False))
_WS_FOLD = (dict(ws=True, block_n=128), dict(ws=True, block_n=64))
_MEDIUM = (dict(ws=True), dict(wide=False, stages=3), dict(persistent=True), dict(persistent=True, stages=3),
           dict(persistent=True, ws=True, weight_in_gemm2=False), dict(persistent=False))
_FOLD24 = (dict(block_m=32),)
# the blocked schedule's rows: the 8-row fold blocks (Mixtral 16, Qwen3 64, DeepSeek-V2-Lite 16
# tokens: both GEMMs unsplit with [M, N] tiles; and on ws with the fold, ws=True), 16-row fold
# blocks (Mixtral 32), the 24-row fold blocks where 32 rows were taken before (Mixtral 48 and 64 —
# on ws, their K streams being 32+ K-blocks —, Qwen3 256, DeepSeek-V2-Lite 128), the alignment by
# comparing all pairs up to 1024 routed pairs (Qwen3 128, DeepSeek-V2-Lite 128: 1024 / 768 pairs;
# against the sort), and the chained ws stream in 48-row blocks of short K streams (Qwen3 512,
# DeepSeek-V2-Lite 256 tokens; GEMM2 at DeepSeek-V2-Lite's 11 steps excepted)
BLOCKED_ROWS = {
    "mixtral": ((16, _DECODE + _WS_FOLD), (32, (dict(split2=2, tout=False),)), (48, _FOLD24), (64, _FOLD24 + _WS_FOLD)),
    "qwen3": ((64, _DECODE + _WS_FOLD), (128, (dict(align="sort"),)), (256, _FOLD24), (512, _MEDIUM)),
    "dsv2lite": ((16, _DECODE + _WS_FOLD), (128, (dict(align="sort"),) + _FOLD24), (256, _MEDIUM)),
}


@gpu
@needs_hopper
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_blocked_defaults_gpu(shape, key):
    """The blocked schedule's defaults at the rows where they were measured (:data:`BLOCKED_ROWS`:
    the scale-only fold in 8-, 16- and 24-row blocks, GEMM2 unsplit with ``[M, N]`` tiles, the
    compared alignment, the chained ``ws`` stream in medium blocks with the router weights out of
    GEMM2), through ``fused_moe`` on the weights the table prepares, and at each row the forms
    they replaced or the options forced there (``sfold=False``; ``split2=2, tout=False``; 32-row
    blocks; the sorted alignment; ``ws=True`` with the fold in 64- and 128-column warpgroups;
    ``persistent`` on and off, ``ws=True``, 128-deep steps at 3 stages), expert 0 never routed,
    fresh inputs per call, against the float64 reference."""
    e, k = GPU_SHAPES[shape][:2]
    for t, over in BLOCKED_ROWS[shape]:
        assert pair_schedule(t * k, e, LayerConfig()) == "blocked", t
        if dict(block_m=32) in over:
            assert wgmma_block_m(t * k, e) == 24, t
    _layer_rows(shape, key, BLOCKED_ROWS[shape], schedule="blocked")
