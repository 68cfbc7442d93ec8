"""Engine v1 (Pallas grouped GEMM, Triton lowering): in interpret mode on the CPU, on the GPU
when one is present. Float64 references, fresh random data, poisoned outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fused_moe_tiles import convert_tiles, fused_moe_tiles, tile_unsupported_reason
from pallas_kernels.wna16_grouped_gemm import grouped_gemm, grouped_gemm_reference, pack_tiles, unpack_tiles
from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import routing
from wna16_jax.checkpoint import random_checkpoint_weights
from wna16_jax.errors import UnsupportedError
from wna16_jax.schemes import QuantScheme

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
SCHEMES = {
    "awq_g128": QuantScheme("awq", 4, 128, True),
    "gptq4_g64": QuantScheme("gptq", 4, 64, False),
    "gptq8_channel": QuantScheme("gptq", 8, -1, False),
    "ct4_asym_g32": QuantScheme("compressed-tensors", 4, 32, True),
    "ct8_sym_g128": QuantScheme("compressed-tensors", 8, 128, False),
}


@pytest.mark.parametrize("bits, group, zp", [(4, 128, False), (4, 32, True), (8, -1, False), (8, 64, True)])
def test_grouped_gemm_matches_reference(bits, group, zp):
    rng = np.random.default_rng()
    e, n, k, bm, nb = 3, 128, 256, 16, 4
    codes = rng.integers(0, 1 << bits, (e, n, k))
    w = pack_tiles(jnp.asarray(codes), bits)
    np.testing.assert_array_equal(np.asarray(unpack_tiles(w, bits)), codes)
    g = 1 if group == -1 else k // group
    s = jnp.asarray(rng.random((e, g, n)) * 0.1 + 0.01, jnp.bfloat16)
    z = jnp.asarray(rng.integers(0, 1 << bits, (e, g, n)), jnp.uint8) if zp else None
    a = jnp.asarray(rng.standard_normal((nb * bm, k)), jnp.bfloat16)
    eids = jnp.asarray(rng.permutation([0, 1, 2, -1]), jnp.int32)            # one unused block
    poison = jnp.full((nb * bm, n), jnp.nan, jnp.float32)
    out = grouped_gemm(a, eids, w, s, z, poison, bits=bits, group_size=group, block_m=bm, interpret=INTERPRET)
    ref = grouped_gemm_reference(a, eids, w, s, z, bits=bits, group_size=group, block_m=bm)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))


def _layer_case(rng, scheme, e, h, i, t, k, *, bias=False, map_=False):
    w = random_checkpoint_weights(rng, scheme, e, h, i, scale=0.05)
    if bias:
        import dataclasses

        w = dataclasses.replace(w, w13_bias=(0.1 * rng.standard_normal((e, 2 * i))).astype(np.float16),
                                w2_bias=(0.1 * rng.standard_normal((e, h))).astype(np.float16))
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    n_route = e + 3 if map_ else e
    logits = jnp.asarray(rng.standard_normal((t, n_route)), jnp.float32)
    logits = logits.at[:, 0].add(-100.0)                          # expert 0 gets no tokens
    tw, ids = routing.fused_topk(logits, k, renormalize=True)
    em = None
    if map_:
        emap = np.full(n_route, -1, np.int32)
        emap[rng.permutation(n_route)[:e]] = np.arange(e)
        em = jnp.asarray(emap)
    return w, x, tw, ids, em


def _reference(w, x, tw, ids, em, activation="silu"):
    r13, r2 = dequant_checkpoint(w, w.scheme)
    b13 = None if w.w13_bias is None else np.asarray(w.w13_bias, np.float64)
    b2 = None if w.w2_bias is None else np.asarray(w.w2_bias, np.float64)
    return fused_moe_ref(np.asarray(x.astype(jnp.float32)), np.asarray(tw), np.asarray(ids), r13, r2, b13, b2,
                         activation=activation, expert_map=None if em is None else np.asarray(em))


@pytest.mark.parametrize("key", sorted(SCHEMES))
@pytest.mark.parametrize("activation, bias, map_", [("silu", False, False), ("swigluoai", True, True)])
def test_fused_moe_tiles_small(key, activation, bias, map_):
    rng = np.random.default_rng()
    w, x, tw, ids, em = _layer_case(rng, SCHEMES[key], 6, 128, 256, 5, 2, bias=bias, map_=map_)
    tiles = convert_tiles(w.to_jax())
    got = fused_moe_tiles(x, tw, ids, tiles, activation=activation, expert_map=em, interpret=INTERPRET,
                          poison_outputs=True)
    ref = _reference(w, x, tw, ids, em, activation)
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 1.5e-2 * np.abs(ref).max()   # bf16 activations and weights


def test_refusals():
    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, QuantScheme("gptq", 4, 64, False, True), 2, 128, 128)
    assert "act-order" in tile_unsupported_reason(w)
    with pytest.raises(UnsupportedError, match="act-order"):
        convert_tiles(w)
    w = random_checkpoint_weights(rng, QuantScheme("gptq", 4, 32, False), 2, 128, 96)
    assert "96" in tile_unsupported_reason(w)


GPU_SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768), "dsv2lite": (64, 6, 2048, 1408)}


def _fast_reference(w, x, tw, ids):
    """Vectorized float64 reference for model-sized layers: the numpy decode (itself checked
    bit-exactly against tests/reference.py on the CPU) of the used experts, float64 matmuls."""
    x = np.asarray(x.astype(jnp.float32), np.float64)
    ids, tw = np.asarray(ids), np.asarray(tw, np.float64)
    out = np.zeros((x.shape[0], w.hidden_size))
    for e in np.unique(ids):
        l13, l2 = w.take_experts(np.array([e])).to_numpy().decode()
        w13, w2 = ((np.asarray(l.codes, np.int64) - np.asarray(z, np.int64)) * np.asarray(s, np.float64)
                   for l in (l13, l2) for z, s in [l.expanded()])
        tok, slot = np.nonzero(ids == e)
        h = x[tok] @ w13[0].T
        i = h.shape[1] // 2
        a = h[:, :i] / (1 + np.exp(-h[:, :i])) * h[:, i:]
        out[tok] += tw[tok, slot][:, None] * (a @ w2[0].T)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(SCHEMES))
def test_fused_moe_tiles_gpu_shapes(shape, key):
    rng = np.random.default_rng()
    e, k, h, i = GPU_SHAPES[shape]
    w, x, tw, ids, em = _layer_case(rng, SCHEMES[key], e, h, i, 16, k)
    tiles = convert_tiles(w.to_jax())
    got = np.asarray(fused_moe_tiles(x, tw, ids, tiles, poison_outputs=True).astype(jnp.float32), np.float64)
    ref = _fast_reference(w, x, tw, ids)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 1.5e-2 * np.abs(ref).max()
