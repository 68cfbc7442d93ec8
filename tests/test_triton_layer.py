"""The MoE layer on the Triton-lowered kernels (:mod:`pallas_kernels.fused_moe_tiles`):
``fused_moe_tiles`` (pair and blocked schedules, every epilogue), ``batched_experts_tiles``, the
backward, the schedule choice, through the library's ``TileWeights`` (``wna16_jax.convert.tiles``)
too; against the float64 reference, outputs NaN-poisoned, in interpret mode on the CPU and
compiled on the GPU (the model-shape tests: GPU only)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine_helpers import (GPU_SHAPES, GPU_TOKENS, INTERPRET, SCHEMES, fast_reference, gpu, layer_case,
                            layer_close, needs_gpu, reference, routed_case, tiles_layer)
from pallas_kernels.errors import KernelConfigError, KernelDTypeError, KernelShapeError
from pallas_kernels.fused_moe_tiles import (EngineConfig, batched_experts_tiles, choose_config, fused_moe_tiles,
                                            fused_moe_tiles_bwd, layer_sizes, max_blocks)
from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import routing
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.convert.tiles import TileWeights, convert_tiles, tile_unsupported_reason
from wna16_jax.errors import UnsupportedError
from wna16_jax.schemes import QuantScheme


def _tiles(w):
    return convert_tiles(w.to_jax())


@pytest.mark.parametrize("key", sorted(SCHEMES))
@pytest.mark.parametrize("mode", ["pair", "blocked"])
def test_fused_moe_tiles_small(key, mode):
    rng = np.random.default_rng()
    w, x, tw, ids, em = layer_case(rng, SCHEMES[key], 6, 256, 256, 3, 2)
    got = tiles_layer(x, tw, ids, _tiles(w), interpret=INTERPRET, poison_outputs=True, mode=mode, split1=2, split2=2)
    layer_close(got, reference(w, x, tw, ids, em))


@pytest.mark.parametrize("key", ["awq_g128", "gptq8_channel"])
@pytest.mark.parametrize("mode, dot", [("pair", "fma"), ("pair", "swap"), ("blocked", "swap")])
def test_fused_moe_tiles_dot_variants(key, mode, dot):
    rng = np.random.default_rng()
    w, x, tw, ids, em = layer_case(rng, SCHEMES[key], 6, 256, 256, 3, 2, bias=True)
    got = tiles_layer(x, tw, ids, _tiles(w), interpret=INTERPRET, poison_outputs=True, mode=mode, dot=dot,
                      split1=2, split2=1)
    layer_close(got, reference(w, x, tw, ids, em))


@pytest.mark.parametrize("activation, bias, map_, on_input, split", [
    ("silu", True, True, False, 1),            # fused gated epilogue with bias, expert map
    ("gelu_tanh", False, False, True, 1),      # router weight on input inside the epilogue
    ("swigluoai", True, False, False, 1),      # not fused: XLA activation between the kernels
    ("gelu", False, True, True, 2)])
def test_fused_moe_tiles_epilogues(activation, bias, map_, on_input, split):
    rng = np.random.default_rng()
    w, x, tw, ids, em = layer_case(rng, SCHEMES["awq_g128"], 5, 256, 128, 9 if on_input else 7,
                                   1 if on_input else 2, bias=bias, map_=map_)
    got = tiles_layer(x, tw, ids, _tiles(w), activation=activation, apply_router_weight_on_input=on_input,
                      expert_map=em, interpret=INTERPRET, poison_outputs=True, mode="blocked",
                      split1=split, split2=split)
    layer_close(got, reference(w, x, tw, ids, em, activation, on_input))


def test_fused_moe_tiles_invalid_ids_and_empty():
    """An out-of-range expert id in any slot gives its token a NaN row, the other tokens match the
    float64 reference (both schedules); zero tokens give an empty output."""
    rng = np.random.default_rng()
    w, x, tw, ids, _ = layer_case(rng, SCHEMES["awq_g128"], 6, 256, 256, 5, 3)
    tiles = _tiles(w)
    bad_at = {1: (1, 6), 3: (2, -1)}                    # token: (slot, id) — past the experts, negative
    bad_ids = ids
    for tok, (slot, bad_id) in bad_at.items():
        bad_ids = bad_ids.at[tok, slot].set(bad_id)
    ok = np.array([t for t in range(5) if t not in bad_at])
    ref = reference(w, x[ok], tw[ok], ids[ok], None)
    for mode in ("pair", "blocked"):
        got = np.asarray(tiles_layer(x, tw, bad_ids, tiles, interpret=INTERPRET, poison_outputs=True, mode=mode)
                         .astype(jnp.float32), np.float64)
        assert np.isnan(got[list(bad_at)]).all(), mode
        layer_close(got[ok], ref, what=f"valid tokens, {mode}")
    assert tiles_layer(x[:0], tw[:0], ids[:0], tiles, interpret=INTERPRET).shape == (0, 256)


def test_blocked_mode_few_pairs_many_experts():
    """Fewer routed pairs than experts: the alignment pads at most min(N, E) runs, so the block
    bound must not exceed the aligned arrays (a shape bug once found only on the GPU)."""
    rng = np.random.default_rng()
    w, x, tw, ids, em = layer_case(rng, SCHEMES["awq_g128"], 16, 256, 128, 1, 4)
    got = tiles_layer(x, tw, ids, _tiles(w), interpret=INTERPRET, poison_outputs=True, mode="blocked", block_m=16)
    layer_close(got, reference(w, x, tw, ids, em))
    assert max_blocks(4, 16, 16) * 16 <= routing.max_padded_size(4, 16, 16)


@settings(max_examples=6)           # each distinct shape recompiles the alignment (3.5–5 s on 2 cores)
@given(st.sampled_from([1, 3, 17, 64]), st.sampled_from([1, 2, 6, 8]), st.sampled_from([8, 16, 64]),
       st.sampled_from([16, 64]), st.integers(0, 2**31 - 1))
def test_max_blocks_bounds_the_filled_prefix(t, k, e, bm, seed):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    aligned = routing.moe_align_block_size(jnp.asarray(ids), bm, e)
    post = int(aligned.num_tokens_post_padded[0])
    assert post <= max_blocks(t * k, bm, e) * bm
    assert (np.asarray(aligned.expert_ids)[post // bm:] == -1).all()


@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True)])
def test_batched_experts_tiles(activation, bias):
    """BATCHED_MARLIN's activation format on the engine, against the float64 reference."""
    rng = np.random.default_rng()
    w, x, tw, ids, _ = layer_case(rng, SCHEMES["gptq4_g128_actorder"], 4, 256, 128, 6, 2, bias=bias)
    bt = routing.dispatch_batched(x, ids, 4, max_tokens_per_expert=8)
    tiles = _tiles(w)
    w13, w2 = tiles.gemms()
    y = batched_experts_tiles(bt.hidden_states, bt.expert_num_tokens, w13, w2, bits=tiles.bits,
                              group_size=tiles.group_size, activation=activation, interpret=INTERPRET,
                              poison_outputs=True)
    r13, r2 = dequant_checkpoint(w, w.scheme)
    hb = np.asarray(bt.hidden_states.astype(jnp.float32), np.float64)
    ref = np.zeros(hb.shape)
    for e in range(4):
        for r in range(int(bt.expert_num_tokens[e])):
            one = fused_moe_ref(hb[e, r][None], np.ones((1, 1)), np.array([[e]]), r13, r2,
                                None if w.w13_bias is None else np.asarray(w.w13_bias, np.float64),
                                None if w.w2_bias is None else np.asarray(w.w2_bias, np.float64),
                                activation=activation)
            ref[e, r] = one[0]
    layer_close(y, ref)
    with pytest.raises(KernelShapeError, match="batched_hidden"):
        batched_experts_tiles(bt.hidden_states[:, :, :128], bt.expert_num_tokens, w13, w2, bits=4, group_size=128,
                              interpret=INTERPRET)
    with pytest.raises(KernelDTypeError, match="batched_hidden"):
        batched_experts_tiles(bt.hidden_states.astype(jnp.float32), bt.expert_num_tokens, w13, w2, bits=4,
                              group_size=128, interpret=INTERPRET)


def test_tiles_decode_is_the_checkpoint():
    rng = np.random.default_rng()
    for scheme in (SCHEMES["gptq4_g128_actorder"], SCHEMES["ct4_asym_g32"]):
        w = random_checkpoint_weights(rng, scheme, 3, 256, 128).to_jax()
        tiles = convert_tiles(w)
        assert isinstance(tiles, TileWeights) and convert_tiles(tiles) is tiles
        t13, t2 = tiles.dequantize(jnp.float32)
        r13, r2 = w.dequantize(jnp.float32)
        np.testing.assert_array_equal(np.asarray(t13), np.asarray(r13))
        np.testing.assert_array_equal(np.asarray(t2), np.asarray(r2))
        g13, g2 = tiles.gemms()                        # the kernels' arrays: the pytree's own
        assert g13.words is tiles.w13_qweight and g2.scales is tiles.w2_scales and g13.perm is tiles.w13_perm
        assert g13.num_experts == 3 and layer_sizes(g13, g2, tiles.bits) == (3, 256, 128)


def test_layer_and_backward_reject_bad_hidden_states():
    rng = np.random.default_rng()
    w, x, tw, ids, _ = layer_case(rng, SCHEMES["awq_g128"], 4, 256, 128, 3, 2)
    tiles = _tiles(w)
    g = jnp.zeros((3, 256), jnp.float32)
    w13, w2 = tiles.gemms()
    kw = dict(bits=4, group_size=128, interpret=INTERPRET)
    for fn in (functools.partial(fused_moe_tiles, **kw), functools.partial(fused_moe_tiles_bwd, g, **kw)):
        with pytest.raises(KernelShapeError, match=r"hidden_states: expected shape \(3, 256\), got \(3, 128\)"):
            fn(x[:, :128], tw, ids, w13, w2)
        with pytest.raises(KernelDTypeError, match="bfloat16 or float16, got float32"):
            fn(x.astype(jnp.float32), tw, ids, w13, w2)
    with pytest.raises(KernelShapeError, match="w2.words"):
        fused_moe_tiles(x, tw, ids, w13, w13, **kw)
    with pytest.raises(KernelConfigError, match="activation"):
        fused_moe_tiles(x, tw, ids, w13, w2, activation="relu", **kw)


@pytest.mark.parametrize("key, on_input", [("gptq4_g128_actorder", False), ("awq_g128", True)])
def test_backward_matches_float64_gradient(key, on_input):
    """dx and d(topk_weights) from the transposed-access kernels against the float64 gradient of
    the reference (central differences would need float64 kernels: the reference is linear
    algebra, so its gradient is written out in float64 here), outputs poisoned; the router
    weight after GEMM2 and (``on_input``) on GEMM1's output."""
    rng = np.random.default_rng()
    w, x, tw, ids, _ = layer_case(rng, SCHEMES[key], 4, 256, 128, 5, 2)
    tiles = _tiles(w)
    w13, w2 = tiles.gemms()
    g = rng.standard_normal((5, 256))
    dx, dtw = fused_moe_tiles_bwd(jnp.asarray(g, jnp.float32), x, tw, ids, w13, w2, bits=tiles.bits,
                                  group_size=tiles.group_size, apply_router_weight_on_input=on_input,
                                  interpret=INTERPRET, poison_outputs=True)
    r13, r2 = dequant_checkpoint(w, w.scheme)                       # [E, 2I, H], [E, H, I] float64
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    ids_np, tw_np = np.asarray(ids), np.asarray(tw, np.float64)
    rdx, rdtw = np.zeros_like(xf), np.zeros_like(tw_np)
    for t in range(5):
        for j in range(2):
            e, wt = ids_np[t, j], tw_np[t, j]
            h = r13[e] @ xf[t]
            hw = h * wt if on_input else h
            gate, up = hw[:128], hw[128:]
            sig = 1 / (1 + np.exp(-gate))
            a = gate * sig * up
            y = r2[e] @ a
            da = r2[e].T @ g[t] * (1.0 if on_input else wt)
            dgate = da * up * (sig + gate * sig * (1 - sig))
            dup = da * gate * sig
            dhw = np.concatenate([dgate, dup])
            if on_input:
                rdtw[t, j] = dhw @ h
                rdx[t] += r13[e].T @ (dhw * wt)
            else:
                rdtw[t, j] = g[t] @ y
                rdx[t] += r13[e].T @ dhw
    layer_close(dx, rdx, 2e-2)
    layer_close(dtw, rdtw, 2e-2)


def test_refusals_and_reasons():
    """The tile layout's refusals at the library's boundary (``UnsupportedError``), the kernels'
    at theirs (Kernel* errors)."""
    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, QuantScheme("gptq", 4, 32, False), 2, 128, 96)
    assert "96" in tile_unsupported_reason(w)
    with pytest.raises(UnsupportedError, match="96"):
        convert_tiles(w)
    w = random_checkpoint_weights(rng, QuantScheme("gptq", 4, 8, False, True), 2, 256, 128)
    assert "act-order with group size 8" in tile_unsupported_reason(w)
    w = random_checkpoint_weights(rng, QuantScheme("awq", 4, 128, True), 2, 128, 128)
    tiles = convert_tiles(w.to_jax())
    w13, w2 = tiles.gemms()
    x = jnp.zeros((2, 128), jnp.float32)
    with pytest.raises(KernelDTypeError, match="bfloat16"):
        fused_moe_tiles(x, jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32), w13, w2, bits=4, group_size=128,
                        interpret=True)


def test_choose_config_modes():
    e, h, i = 16, 256, 256
    assert choose_config(1, 2, e, h, i, 4).mode == "pair"
    cfg = choose_config(512, 2, e, h, i, 4)
    assert cfg.mode == "blocked" and cfg.block_m >= 64 and cfg.dot == "swap"
    assert choose_config(16, 2, e, h, i, 4).dot == "mma"
    assert choose_config(32, 2, e, h, i, 4, block_m=64).dot == "swap"     # by block height, not token count
    assert isinstance(cfg, EngineConfig)
    with pytest.raises(KernelConfigError, match="mode"):
        choose_config(1, 2, e, h, i, 4, mode="nope")
    # the Triton lowering takes power-of-two blocks only: vLLM's rule (48 here) is rounded up
    assert choose_config(256, 2, e, h, i, 4).block_m == 64
    assert choose_config(8, 2, e, h, i, 4, mode="blocked", block_m=24).block_m == 32
    assert choose_config(1, 2, e, h, i, 4, split1=3).split1 == 3                # keyword overrides
    tiles = convert_tiles(random_checkpoint_weights(np.random.default_rng(), QuantScheme("awq", 4, 128, True), e, h,
                                                    i).to_jax())
    assert layer_sizes(*tiles.gemms(), tiles.bits) == (e, h, i)


@pytest.mark.parametrize("field,value,want", [
    ("mode", "grid", "one of"), ("block_m", 24, "power of two"), ("block_n1", 8, "power of two"),
    ("block_n2", True, "power of two"), ("split1", 0, "positive"), ("split2", 1.5, "positive"),
    ("num_stages", 0, "positive"), ("num_warps", 3, "one of"), ("dequant", "i2f", "one of"),
    ("dot", "fma", "blocked mode"), ("dot", "wgmma", "one of")])
def test_engine_config_is_checked_when_built(field, value, want):
    """Every combination rule of the Triton engine's schedule is checked at construction, naming the
    field, the rule and the value — from the constructor and from choose_config's overrides."""
    import dataclasses

    good = EngineConfig("blocked", 32, 64, 64, 1, 1)
    with pytest.raises(KernelConfigError, match=f"EngineConfig.{field}: expected .*{want}.*got {value!r}"):
        dataclasses.replace(good, **{field: value})
    if field not in ("mode", "block_m"):       # (choose_config rounds a block_m up to a power of two)
        with pytest.raises(KernelConfigError, match=f"EngineConfig.{field}"):
            choose_config(64, 2, 16, 256, 256, 4, mode="blocked", **{field: value})
    # pair mode runs 16-row tiles and may use the FMA dot
    assert EngineConfig("pair", 16, 64, 64, 2, 2, dot="fma").dot == "fma"
    with pytest.raises(KernelConfigError, match="EngineConfig.block_m: expected 16 in pair mode"):
        EngineConfig("pair", 32, 64, 64, 1, 1)


# ----------------------------------------------------------------------------- the GPU reference


def test_fast_reference_is_the_reference():
    """The GPU layer tests' reference (:func:`engine_helpers.fast_reference`: float64 dots on the
    device, only the routed experts) equals the suite's float64 reference (numpy over every
    expert) to float64 rounding, every format, expert 0 never routed; jnp stays 32-bit outside
    its float64 dots."""
    rng = np.random.default_rng()
    for key in sorted(SCHEMES):              # 7 tokens: up to 7 rows per expert; 29: ~14 (padded to 16 / 32)
        t = 7 if key != "awq_g128" else 29
        w, x, tw, ids, _ = layer_case(rng, SCHEMES[key], 5, 256, 128, t, 2)
        got, ref = fast_reference(w.to_jax(), x, tw, ids), reference(w, x, tw, ids, None)
        assert got.dtype == np.float64 and np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max(), key
    assert jnp.arange(2).dtype == jnp.int32 and jnp.zeros(()).dtype == jnp.float32


# ----------------------------------------------------------------------------- GPU: model shapes


@gpu
@needs_gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(SCHEMES))
def test_fused_moe_gpu_shapes(shape, key):
    """Every format at the three model shapes, decode and a few-token batch, through
    ``fused_moe`` (which must pick the Triton-lowered engine for the tile layout), outputs
    poisoned; experts with no tokens."""
    from wna16_jax import executors
    from wna16_jax.moe import fused_moe

    rng = np.random.default_rng()
    e, k, h, i = GPU_SHAPES[shape]
    w = random_checkpoint_weights(rng, SCHEMES[key], e, h, i, scale=0.02).to_jax()
    tiles = jax.jit(convert_tiles)(w)
    assert executors.select(tiles, jnp.bfloat16).executor is executors.TRITON
    for t in GPU_TOKENS[shape]:
        x, tw, ids, ref = routed_case(rng, w, t, k)
        layer_close(jax.jit(fused_moe)(x, tw, ids, tiles), ref, what=f"fused_moe T={t}")
        for over in (dict(mode="pair"), dict(mode="pair", dot="fma"), dict(mode="blocked"),
                     dict(mode="blocked", dot="swap")):
            got = jax.jit(functools.partial(tiles_layer, poison_outputs=True, **over))(x, tw, ids, tiles)
            layer_close(got, ref, what=f"{over} T={t}")


@gpu
@needs_gpu
def test_gpu_prefill_batched_and_backward_qwen3():
    """Qwen3-shaped prefill (512 tokens) on the Triton-lowered engine, the batched-experts format
    through ``batched_experts_forward``, and the backward (``fused_moe_trainable``) on the tile
    layout and — on Hopper — on the wgmma layout the table prepares (its forward on the wgmma
    kernels, its backward on the transposed-access kernels through its exact tile view), against
    the float64 reference / the XLA executor's float32 gradient."""
    from wna16_jax.autodiff import fused_moe_trainable
    from wna16_jax.backends import TABLE, Backend
    from wna16_jax.moe import batched_experts_forward

    rng = np.random.default_rng()
    e, k, h, i = GPU_SHAPES["qwen3"]
    w = random_checkpoint_weights(rng, SCHEMES["awq_g128"], e, h, i, scale=0.02).to_jax()
    tiles = jax.jit(convert_tiles)(w)
    t = 512
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k, renormalize=True)
    got = jax.jit(functools.partial(tiles_layer, poison_outputs=True))(x, tw, ids, tiles)
    layer_close(got, fast_reference(w, x, tw, ids))
    g = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)

    def loss(x, tw, weights, executor):
        return jnp.sum(fused_moe_trainable(x, tw, ids, weights, executor=executor).astype(jnp.float32) * g)

    bt = routing.dispatch_batched(x[:64], ids[:64], e, max_tokens_per_expert=16)
    got_b = jax.jit(batched_experts_forward)(bt.hidden_states, bt.expert_num_tokens, tiles)        # engine
    ref_b = jax.jit(functools.partial(batched_experts_forward, executor="xla"))(
        bt.hidden_states.astype(jnp.float32), bt.expert_num_tokens, w)
    layer_close(got_b, np.asarray(ref_b, np.float64), what="batched experts")
    dx, dtw = jax.jit(jax.grad(functools.partial(loss, executor="pallas"), argnums=(0, 1)))(x, tw, tiles)
    rdx, rdtw = jax.jit(jax.grad(functools.partial(loss, executor="xla"), argnums=(0, 1)))(
        x.astype(jnp.float32), tw, w)
    layer_close(dx, np.asarray(rdx, np.float64), 3e-2)
    layer_close(dtw, np.asarray(rdtw, np.float64), 3e-2)
    wg = TABLE[Backend.MARLIN].prepare(w.scheme, w)
    if type(wg).__name__ != "WgmmaWeights":                     # not a Hopper GPU: the tile layout again
        assert isinstance(wg, TileWeights)
        return
    dx2, dtw2 = jax.jit(jax.grad(functools.partial(loss, executor="pallas"), argnums=(0, 1)))(x, tw, wg)
    layer_close(dx2, np.asarray(rdx, np.float64), 3e-2)
    layer_close(dtw2, np.asarray(rdtw, np.float64), 3e-2)
