"""The GPU engine (Pallas kernels, Triton lowering): in interpret mode on the CPU, compiled on
the GPU when one is present; the Triton lowering of every kernel variant is also checked on the
CPU (it is what the GPU compiles). Float64 references, fresh random data, poisoned outputs."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels.fused_moe_tiles import (EngineConfig, choose_config, convert_tiles,
                                            engine_unsupported_reason, fused_moe_tiles, fused_moe_tiles_bwd,
                                            max_blocks, tile_unsupported_reason)
from pallas_kernels.wna16_grouped_gemm import (asm_supported, choose_split, dequantize_tiles, grouped_gemm, grouped_gemm_t,
                                               pack_tiles, pair_gemm, unpack_tiles)
from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import routing
from wna16_jax.checkpoint import random_checkpoint_weights
from wna16_jax.errors import ConfigError, DTypeError, ShapeError, UnsupportedError
from wna16_jax.schemes import QuantScheme

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
MODES = ("asm", "magic", "i2f") if ON_GPU else ("magic", "i2f")
SCHEMES = {
    "awq_g128": QuantScheme("awq", 4, 128, True),
    "gptq4_g64": QuantScheme("gptq", 4, 64, False),
    "gptq4_g128_actorder": QuantScheme("gptq", 4, 128, False, True),
    "gptq8_channel": QuantScheme("gptq", 8, -1, False),
    "ct4_asym_g32": QuantScheme("compressed-tensors", 4, 32, True),
    "ct8_sym_g128": QuantScheme("compressed-tensors", 8, 128, False),
}


# ----------------------------------------------------------------------------- kernel level


def _kernel_case(rng, bits, group, zp, e=3, n=256, k=256):
    codes = rng.integers(0, 1 << bits, (e, n, k))
    g = 1 if group == -1 else k // group
    scales = (rng.random((e, g, n)) * 0.1 + 0.01).astype(np.float32)
    zeros = rng.integers(0, 1 << bits, (e, g, n)) if zp else None
    return codes, scales, zeros


def _weights64(codes, scales, zeros, bits, group, dtype=jnp.bfloat16):
    """[E, K, N] float64 of the kernel's weight values: (code - zero)·scale rounded to ``dtype``."""
    k = codes.shape[-1]
    gi = np.zeros(k, int) if group == -1 else np.arange(k) // group
    s = np.asarray(jnp.asarray(scales, dtype).astype(jnp.float32), np.float64)[:, gi, :]      # [E, K, N]
    z = (1 << (bits - 1)) if zeros is None else zeros[:, gi, :]
    w = (np.swapaxes(codes, 1, 2) - z) * s
    return np.asarray(jnp.asarray(w, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def _close(got, ref, rtol=2e-5):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits, group, zp, split, dot", [(4, 128, False, 1, "mma"), (4, 128, True, 2, "mma"),
                                                         (4, 32, True, 1, "mma"), (8, -1, False, 2, "mma"),
                                                         (8, 64, True, 1, "mma"), (4, 128, True, 2, "swap"),
                                                         (8, 32, False, 1, "swap")])
def test_grouped_gemm(bits, group, zp, split, dot, mode):
    if mode == "asm" and asm_supported(bits, group, jnp.bfloat16):
        pytest.skip(asm_supported(bits, group, jnp.bfloat16))
    rng = np.random.default_rng()
    codes, scales, zeros = _kernel_case(rng, bits, group, zp)
    bm, eids = 16, np.array(rng.permutation([0, 1, 2, -1]), np.int32)            # one unused block
    a = jnp.asarray(rng.standard_normal((4 * bm, 256)), jnp.bfloat16)
    rs = jnp.asarray(rng.random(4 * bm), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    poison = jnp.full((split, 4 * bm, 256), jnp.nan, jnp.float32)
    out = grouped_gemm(a, jnp.asarray(eids), pack_tiles(jnp.asarray(codes), bits), jnp.asarray(scales, jnp.bfloat16),
                       None if zeros is None else jnp.asarray(zeros, jnp.uint8), rs, bias, poison, bits=bits,
                       group_size=group, block_m=bm, split_k=split, dequant=mode, dot=dot, interpret=INTERPRET)
    w = _weights64(codes, scales, zeros, bits, group)
    eb = np.repeat(eids, bm)
    ref = np.einsum("mk,mkn->mn", np.asarray(a.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    ref = (ref + np.asarray(bias, np.float64)[np.maximum(eb, 0)]) * np.asarray(rs, np.float64)[:, None]
    ref[eb < 0] = 0.0
    assert out.shape == (split, 4 * bm, 256)
    _close(np.asarray(out, np.float64).sum(0), ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dot", ["mma", "fma", "swap"])
@pytest.mark.parametrize("bits, group, zp", [(4, 128, True), (4, -1, False), (8, 32, True)])
def test_pair_gemm(bits, group, zp, dot, mode):
    if mode == "asm" and asm_supported(bits, group, jnp.bfloat16):
        pytest.skip(asm_supported(bits, group, jnp.bfloat16))
    rng = np.random.default_rng()
    codes, scales, zeros = _kernel_case(rng, bits, group, zp)
    t, k = 3, 2
    x = jnp.asarray(rng.standard_normal((t, 256)), jnp.bfloat16)
    pe = np.array([0, 2, -1, 1, 1, 0], np.int32)
    rs = jnp.asarray(rng.random(t * k), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    out = pair_gemm(x, jnp.asarray(pe), pack_tiles(jnp.asarray(codes), bits), jnp.asarray(scales, jnp.bfloat16),
                    None if zeros is None else jnp.asarray(zeros, jnp.uint8), rs, bias,
                    jnp.full((2, t * k, 256), jnp.nan, jnp.float32), top_k=k, bits=bits, group_size=group,
                    split_k=2, block_n=64, dequant=mode, dot=dot, interpret=INTERPRET)
    w = _weights64(codes, scales, zeros, bits, group)
    xr = np.repeat(np.asarray(x.astype(jnp.float32), np.float64), k, axis=0)
    ref = np.einsum("pk,pkn->pn", xr, w[np.maximum(pe, 0)]) + np.asarray(bias, np.float64)[np.maximum(pe, 0)]
    ref = ref * np.asarray(rs, np.float64)[:, None]
    ref[pe < 0] = 0.0
    _close(np.asarray(out, np.float64).sum(0), ref)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_epilogue(activation):
    rng = np.random.default_rng()
    codes, scales, zeros = _kernel_case(rng, 4, 128, True)
    bm, eids = 16, np.array([2, 0, -1], np.int32)
    a = jnp.asarray(rng.standard_normal((3 * bm, 256)), jnp.bfloat16)
    rs = jnp.asarray(rng.random(3 * bm) + 0.5, jnp.float32)
    out = grouped_gemm(a, jnp.asarray(eids), pack_tiles(jnp.asarray(codes), 4), jnp.asarray(scales, jnp.bfloat16),
                       jnp.asarray(zeros, jnp.uint8), rs, None, jnp.full((3 * bm, 128), jnp.nan, jnp.float32),
                       bits=4, group_size=128, block_m=bm, activation=activation, out_dtype=jnp.float32,
                       interpret=INTERPRET)
    w = _weights64(codes, scales, zeros, 4, 128)
    eb = np.repeat(eids, bm)
    h = np.einsum("mk,mkn->mn", np.asarray(a.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    h *= np.asarray(rs, np.float64)[:, None]
    g, u = h[:, :128], h[:, 128:]
    if activation == "silu":
        ref = g / (1 + np.exp(-g)) * u
    else:
        ref = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    ref[eb < 0] = 0.0
    _close(out, ref, rtol=5e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits, group, zp", [(4, 128, True), (4, 32, False), (8, -1, True)])
def test_grouped_gemm_t(bits, group, zp, mode):
    if mode == "asm" and asm_supported(bits, group, jnp.bfloat16):
        pytest.skip(asm_supported(bits, group, jnp.bfloat16))
    rng = np.random.default_rng()
    codes, scales, zeros = _kernel_case(rng, bits, group, zp)
    bm, eids = 16, np.array([1, -1, 0, 2], np.int32)
    g = jnp.asarray(rng.standard_normal((4 * bm, 256)), jnp.bfloat16)
    out = grouped_gemm_t(g, jnp.asarray(eids), pack_tiles(jnp.asarray(codes), bits), jnp.asarray(scales, jnp.bfloat16),
                         None if zeros is None else jnp.asarray(zeros, jnp.uint8),
                         jnp.full((4 * bm, 256), jnp.nan, jnp.float32), bits=bits, group_size=group, block_m=bm,
                         dequant=mode, interpret=INTERPRET)
    w = _weights64(codes, scales, zeros, bits, group)                      # [E, K, N]
    eb = np.repeat(eids, bm)
    ref = np.einsum("mn,mkn->mk", np.asarray(g.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    ref[eb < 0] = 0.0
    _close(out, ref)


@settings(max_examples=6)           # each distinct shape recompiles the alignment (3.5–5 s on 2 cores)
@given(st.sampled_from([1, 3, 17, 64]), st.sampled_from([1, 2, 6, 8]), st.sampled_from([8, 16, 64]), st.sampled_from([16, 64]),
       st.integers(0, 2**31 - 1))
def test_max_blocks_bounds_the_filled_prefix(t, k, e, bm, seed):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    aligned = routing.moe_align_block_size(jnp.asarray(ids), bm, e)
    post = int(aligned.num_tokens_post_padded[0])
    assert post <= max_blocks(t * k, bm, e) * bm
    assert (np.asarray(aligned.expert_ids)[post // bm:] == -1).all()


def test_pack_roundtrip_and_split_choice():
    rng = np.random.default_rng()
    for bits in (4, 8):
        codes = rng.integers(0, 1 << bits, (2, 32, 256))
        np.testing.assert_array_equal(np.asarray(unpack_tiles(pack_tiles(jnp.asarray(codes), bits), bits)), codes)
    assert choose_split(1000, 32, sms=132) == 1
    assert choose_split(2 * 224, 32, sms=132) == 2
    s = choose_split(16, 11, sms=132)                       # never an empty chunk
    chunk = -(-11 // s)
    assert (s - 1) * chunk < 11 and s <= 11


# ----------------------------------------------------------------------------- Triton lowering


def _abstract_h200():
    """Lowering target for Triton kernels without a GPU: jax ≥ 0.11 asks the device for its
    compute capability, so name an abstract H200 (jax 0.10.2 needs nothing)."""
    import contextlib

    sh = jax.sharding
    if not hasattr(sh, "AbstractDevice") or not hasattr(sh, "use_abstract_mesh"):
        return contextlib.nullcontext()
    dev = sh.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return sh.use_abstract_mesh(sh.AbstractMesh((1,), ("x",), abstract_device=dev))


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile the kernels for real")
def test_every_kernel_variant_lowers_to_triton():
    """What interpret mode cannot check: each kernel variant lowers to Triton IR for CUDA
    (inline PTX included) — on the CPU, without a GPU."""
    s = jax.ShapeDtypeStruct
    w, sc, z = s((4, 128, 512), jnp.int32), s((4, 8, 512), jnp.bfloat16), s((4, 8, 512), jnp.uint8)
    a, ids, rs, b = s((64, 1024), jnp.bfloat16), s((4,), jnp.int32), s((64,), jnp.float32), s((4, 512), jnp.float32)

    def lower(fn, *args):
        with _abstract_h200():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text
        return text

    for mode in ("asm", "magic", "i2f"):
        kw = dict(bits=4, group_size=128, dequant=mode)
        lower(functools.partial(grouped_gemm, block_m=16, split_k=2, **kw), a, ids, w, sc, z, rs, b)
        lower(functools.partial(grouped_gemm, block_m=16, activation="silu", **kw), a, ids, w, sc, z, None, b)
        for dot in ("mma", "fma", "swap"):
            lower(functools.partial(pair_gemm, top_k=2, split_k=4, dot=dot, **kw), s((3, 1024), jnp.bfloat16),
                  s((6,), jnp.int32), w, sc, z, s((6,), jnp.float32), b)
        lower(functools.partial(grouped_gemm, block_m=16, split_k=2, dot="swap", **kw), a, ids, w, sc, z, rs, b)
        lower(functools.partial(grouped_gemm_t, block_m=16, **kw), s((64, 512), jnp.bfloat16), ids, w, sc, z)
    lower(functools.partial(grouped_gemm, block_m=64, block_n=128, bits=4, group_size=32, activation="silu"),
          a, s((1,), jnp.int32), w, s((4, 32, 512), jnp.bfloat16), s((4, 32, 512), jnp.uint8))


def _wgmma_case(rng, zp, group, bm, k=512, n=256, word_bits=16, tile_n=None, exact=False, a_div=1):
    """A 4-block wgmma GEMM case; ``ref`` in float64 from the bf16-rounded weight values (the
    dequantize-then-matmul semantics), or with ``exact`` from the unrounded ``(c − z)·s``
    (what ``zfold`` computes). ``a_div``: ``a`` holds one block per ``a_div`` expert blocks (block
    ``i`` reads block ``i // a_div``, the kernel's ``a_div``)."""
    from pallas_kernels.wgmma_w4a16 import to_wgmma_layout

    codes, scales, zeros = _kernel_case(rng, 4, group, zp, e=3, n=n, k=k)
    eids = np.array(rng.permutation([0, 1, 2, -1]), np.int32)
    a_own = jnp.asarray(rng.standard_normal((-(-4 // a_div) * bm, k)), jnp.bfloat16)
    a = a_own.reshape(-1, bm, k)[np.arange(4) // a_div].reshape(4 * bm, k)        # the rows each block reads
    lay = to_wgmma_layout(pack_tiles(jnp.asarray(codes), 4), jnp.asarray(scales, jnp.bfloat16),
                          None if zeros is None else jnp.asarray(zeros, jnp.uint8), word_bits=word_bits,
                          tile_n=tile_n)
    if exact:                                   # bf16 scales (as stored), unrounded products
        w = _weights64(codes, np.asarray(jnp.asarray(scales, jnp.bfloat16).astype(jnp.float32)), zeros, 4, group,
                       dtype=jnp.float32)
    else:
        w = _weights64(codes, scales, zeros, 4, group)
    eb = np.repeat(eids, bm)
    ref = np.einsum("mk,mkn->mn", np.asarray(a.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    ref[eb < 0] = 0.0
    return a_own, eids, lay, ref


@pytest.mark.parametrize("word_bits, fold", [(16, None), (32, None), (16, "z"), (16, "s")])
@pytest.mark.parametrize("zp, group", [(True, 128), (False, -1)])
def test_wgmma_layout_indexing(zp, group, word_bits, fold):
    """The v4 kernel's arithmetic, replayed in numpy with exactly its indexing, against the
    float64 reference — the layout half of the kernel, checked without a GPU. int32 words: tile
    ``[n, 16·kb : 16·kb+16]``, slot ``s`` → K row ``128·kb + 16·s + w``, zero 8 when symmetric.
    int16 words: tile ``[n, 32·kb + 16·u : +16]``, nibble ``t`` → row ``128·kb + 64·u + 16·t + w``,
    value ``(magic | c) − zero`` with the zero stored as magic + z (magic + 8 when symmetric).
    ``zfold``: per K-block, ``acc += s ⊙ (Σ (magic | c)·x − (magic + z) ⊗ Σx)``; ``sfold``: per
    K-block, ``acc += s ⊙ Σ ((magic | c) − (magic + z))·x``."""
    from pallas_kernels.wgmma_w4a16 import magic, magic_value

    rng = np.random.default_rng()
    bm = 16
    a, eids, (words, scales, zeros), ref = _wgmma_case(rng, zp, group, bm, word_bits=word_bits, exact=bool(fold))
    k = a.shape[1]
    out = np.zeros(ref.shape)
    for b, ex in enumerate(eids):
        if ex < 0:
            continue
        x = np.asarray(a[b * bm:(b + 1) * bm].astype(jnp.float32), np.float64)
        for kb in range(k // 128):
            g = 0 if group == -1 else kb
            sc = np.asarray(scales[ex, g].astype(jnp.float32))
            if word_bits == 32:
                zc = np.full(sc.shape, 8.0, np.float32) if zeros is None else np.asarray(zeros[ex, g].astype(jnp.float32))
                wt = np.asarray(words[ex, :, kb * 16:(kb + 1) * 16]).astype(np.uint32)        # [N, 16]
                steps = [(16 * s, (wt >> (4 * s)) & 15) for s in range(8)]
            else:
                zc = np.full(sc.shape, magic_value(jnp.bfloat16) + 8, np.float32) if zeros is None else \
                    np.asarray(zeros[ex, g].astype(jnp.float32))
                steps = []
                for u in range(2):
                    wt = np.asarray(words[ex, :, kb * 32 + 16 * u: kb * 32 + 16 * u + 16]).view(np.uint16)
                    for t in range(4):
                        bits = ((wt >> (4 * t)) & 15) | magic(jnp.bfloat16)
                        steps.append((64 * u + 16 * t, np.asarray(jax.lax.bitcast_convert_type(
                            jnp.asarray(bits.astype(np.uint16)), jnp.bfloat16).astype(jnp.float32))))
            if fold == "s":              # c − z exact in bf16 (both magic-biased): one scale per K-block
                xb = x[:, kb * 128:(kb + 1) * 128]
                part = sum(xb[:, k0:k0 + 16] @ (codes.astype(np.float64) - zc[:, None]).T for k0, codes in steps)
                out[b * bm:(b + 1) * bm] += part * sc[None, :]
                continue
            if fold == "z":
                xb = x[:, kb * 128:(kb + 1) * 128]
                part = sum(xb[:, k0:k0 + 16] @ codes.astype(np.float64).T for k0, codes in steps)
                out[b * bm:(b + 1) * bm] += (part - xb.sum(1)[:, None] * zc[None, :]) * sc[None, :]
                continue
            for k0, codes in steps:
                wv = jnp.asarray((codes.astype(np.float32) - zc[:, None]) * sc[:, None], jnp.float32).astype(jnp.bfloat16)
                out[b * bm:(b + 1) * bm] += x[:, kb * 128 + k0: kb * 128 + k0 + 16] @ \
                    np.asarray(wv.astype(jnp.float32), np.float64).T
    _close(out, ref)


def test_wgmma_shift32_bit_identity():
    """``shift32``'s register arithmetic: one 32-bit ``(w >> 4t) & 0x000F000F | magic·0x10001`` on
    two adjacent 16-bit words (little-endian: the first word in the low half, as a WGMMA-layout
    register holds them) is, half by half, the 16-bit ``(h >> 4t) & 15 | magic`` the kernel's
    default path computes — for every word value, both dtypes' magic numbers. With ``lop3`` the and/or
    is PTX's ``lop3.b32`` with the kernel's lookup table, emulated here bit by bit from PTX's
    definition (result bit = table bit number ``4a + 2b + c`` of the operands' bits)."""
    from pallas_kernels.wgmma_w4a16 import LOP3_AND_OR, magic

    def lop3(a, b, c, lut):
        bits = [(a >> i & 1) * 4 + (b >> i & 1) * 2 + (c >> i & 1) for i in range(32)]
        return sum(((np.uint32(lut) >> idx.astype(np.uint32)) & 1) << np.uint32(i) for i, idx in enumerate(bits))

    rng = np.random.default_rng()
    lo = np.arange(1 << 16, dtype=np.uint32)
    hi = rng.permutation(lo)
    pair = lo | (hi << 16)
    for dt in (jnp.bfloat16, jnp.float16):
        m = magic(dt)
        for t in range(4):
            got = ((pair >> (4 * t)) & 0x000F000F) | (m * 0x10001)
            np.testing.assert_array_equal(got & 0xFFFF, ((lo >> (4 * t)) & 15) | m)
            np.testing.assert_array_equal(got >> 16, ((hi >> (4 * t)) & 15) | m)
            by_lop3 = lop3(pair >> (4 * t), np.uint32(0x000F000F), np.uint32(m * 0x10001), LOP3_AND_OR)
            np.testing.assert_array_equal(by_lop3.astype(np.uint32), got)


@pytest.mark.parametrize("tile_n", [64, 128])
def test_wgmma_tile_major_layout(tile_n):
    """Tile-major words are the 16-bit layout's rows regrouped per (column tile, K-block):
    ``tiled[e, j, kb·t + r] == plain[e, j·t + r, 32·kb : 32·kb + 32]``."""
    from pallas_kernels.wgmma_w4a16 import to_wgmma_layout

    rng = np.random.default_rng()
    codes = rng.integers(0, 16, (3, 256, 512))
    tiles = pack_tiles(jnp.asarray(codes), 4)
    sc = jnp.ones((3, 4, 256), jnp.bfloat16)
    plain = np.asarray(to_wgmma_layout(tiles, sc)[0])
    tiled = np.asarray(to_wgmma_layout(tiles, sc, tile_n=tile_n)[0])
    assert tiled.shape == (3, 256 // tile_n, 4 * tile_n, 32)
    for j in range(256 // tile_n):
        for kb in range(4):
            np.testing.assert_array_equal(tiled[:, j, kb * tile_n:(kb + 1) * tile_n],
                                          plain[:, j * tile_n:(j + 1) * tile_n, 32 * kb:32 * kb + 32])
    with pytest.raises(ConfigError, match="tile_n"):
        to_wgmma_layout(tiles, sc, tile_n=96)


@pytest.mark.skipif(ON_GPU, reason="the GPU test compiles and runs it")
def test_wgmma_kernel_lowers_to_mosaic_gpu():
    from pallas_kernels.wgmma_w4a16 import TRANSPOSED_STORE, magic, wgmma_grouped_gemm

    s = jax.ShapeDtypeStruct
    for dt in (jnp.bfloat16, jnp.float16):
        for zp in (True, False):
            args = (s((48, 512), dt), s((3,), jnp.int32), s((4, 256, 64), jnp.int32), s((4, 4, 256), dt),
                    s((4, 4, 256), dt) if zp else None)
            fn = functools.partial(wgmma_grouped_gemm, block_m=16, split_k=2)
            assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            args = (args[0], args[1], s((4, 256, 128), jnp.int16)) + args[3:]                # 16-bit words
            assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    fn = functools.partial(wgmma_grouped_gemm, block_m=64, group_size=-1, stages=4)     # channelwise, 8 K-blocks
    args = (s((128, 1024), jnp.bfloat16), s((2,), jnp.int32), s((4, 512, 128), jnp.int32),
            s((4, 1, 512), jnp.bfloat16))
    assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for kpb in (1, 2):                                  # tile-major words, 128-column tiles
        tm = (s((48, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 2, 4 * 128, 32), jnp.int16),
              s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16))
        fn = functools.partial(wgmma_grouped_gemm, block_m=16, block_n=128, kpb=kpb)
        assert "mosaic_gpu" in jax.jit(fn).trace(*tm).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ConfigError, match="block_n"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, block_n=64)).trace(*tm)
    with pytest.raises(ConfigError, match="wide"):                                  # wide: plain 16-bit words only
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, block_n=128, kpb=2, wide=True)).trace(*tm)
    for bn, zp in ((128, True), (64, False)):           # wide: 128-byte swizzled [bn, 64] word tiles
        wd = (s((48, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),
              s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16) if zp else None)
        fn = functools.partial(wgmma_grouped_gemm, block_m=16, block_n=bn, kpb=2, wide=True, stages=4)
        assert "mosaic_gpu" in jax.jit(fn).trace(*wd).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ConfigError, match="wide"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, kpb=1, wide=True)).trace(*wd)
    for opts in (dict(block_n=128), dict(block_n=64, kpb=2, wide=True)):    # 32-bit nibble extraction
        for dt in (jnp.bfloat16, jnp.float16):
            sh = (s((48, 512), dt), s((3,), jnp.int32), s((4, 256, 128), jnp.int16), s((4, 4, 256), dt),
                  s((4, 4, 256), dt))
            for lop3 in (True, False):          # lop3: each plane's mask-and-magic as one inline lop3.b32
                fn = functools.partial(wgmma_grouped_gemm, block_m=16, shift32=True, lop3=lop3, **opts)
                text = jax.jit(fn).trace(*sh).lower(lowering_platforms=("cuda",)).as_text()
                magic_hex = f"{magic(dt) * 0x10001:#010x}"
                assert "mosaic_gpu" in text and (f"lop3.b32 $0, $1, 0x000F000F, {magic_hex}, 0xea" in text) == lop3
    for opts in (dict(block_n=128), dict(block_n=64, kpb=2, wide=True, shift32=True, split_k=2)):   # zfold
        for gs, g in ((128, 4), (-1, 1)):
            zf = (s((24, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),
                  s((4, g, 256), jnp.bfloat16), s((4, g, 256), jnp.bfloat16))
            fn = functools.partial(wgmma_grouped_gemm, block_m=8, group_size=gs, zfold=True, **opts)
            assert "mosaic_gpu" in jax.jit(fn).trace(*zf).lower(lowering_platforms=("cuda",)).as_text()
    for opts in (dict(block_n=128), dict(block_n=64, kpb=2, wide=True, shift32=True, split_k=2)):   # sfold
        for gs, g in ((128, 4), (-1, 1)):
            for dt in (jnp.bfloat16, jnp.float16):
                sf = (s((24, 512), dt), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),
                      s((4, g, 256), dt), s((4, g, 256), dt) if gs == 128 else None)
                fn = functools.partial(wgmma_grouped_gemm, block_m=8, group_size=gs, sfold=True, **opts)
                assert "mosaic_gpu" in jax.jit(fn).trace(*sf).lower(lowering_platforms=("cuda",)).as_text()
    sf24 = (s((72, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),      # v17: 24-row sfold
            s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16))
    fn = functools.partial(wgmma_grouped_gemm, block_m=24, block_n=128, kpb=2, wide=True, shift32=True, sfold=True,
                           stages=2, out_dtype=jnp.bfloat16, tout=TRANSPOSED_STORE, gated="silu")
    assert "mosaic_gpu" in jax.jit(fn).trace(*sf24).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ConfigError, match="pick one"):        # (sf: the last case, channelwise)
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=8, group_size=-1, zfold=True, sfold=True)).trace(*sf)
    with pytest.raises(ConfigError, match="overlap"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=8, group_size=-1, overlap=True, sfold=True)).trace(*sf)
    for opts in (dict(block_n=128, kpb=2, wide=True, shift32=True), dict(split_k=4)):      # overlap
        ov = (s((24, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),
              s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16))
        fn = functools.partial(wgmma_grouped_gemm, block_m=8, overlap=True, **opts)
        assert "mosaic_gpu" in jax.jit(fn).trace(*ov).lower(lowering_platforms=("cuda",)).as_text()
    for opts in (dict(block_n=128, stages=4), dict(block_n=64, kpb=2, wide=True, shift32=True, stages=3),
                 dict(block_n=128, shift32=True, split_k=2)):                                        # ws
        for zp in (True, False):
            wa = (s((3 * 64, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),
                  s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16) if zp else None)
            fn = functools.partial(wgmma_grouped_gemm, block_m=64, ws=True, **opts)
            assert "mosaic_gpu" in jax.jit(fn).trace(*wa).lower(lowering_platforms=("cuda",)).as_text()
    for bad in (dict(zfold=True), dict(sfold=True, cluster=2), dict(overlap=True), dict(block_n=256), dict(group_size=-1)):
        with pytest.raises((ConfigError, ShapeError), match="ws=True|block_n|scales"):
            jax.jit(functools.partial(wgmma_grouped_gemm, block_m=64, ws=True, **bad)).trace(*wa)
    for opts in (dict(), dict(kpb=2, wide=True, shift32=True, sfold=True), dict(programs=3, stages=3)):   # persistent
        for zp, rsc in ((True, False), (False, True)):
            ps = (s((3 * 48, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),
                  s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16) if zp else None,
                  s((3 * 48,), jnp.float32) if rsc else None)
            fn = functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, persistent=True, **opts)
            assert "mosaic_gpu" in jax.jit(fn).trace(*ps).lower(lowering_platforms=("cuda",)).as_text()
    if TRANSPOSED_STORE:
        fn = functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, persistent=True, out_dtype=jnp.bfloat16,
                               tout=True, gated="silu", kpb=2, wide=True, shift32=True, stages=2)
        assert "mosaic_gpu" in jax.jit(fn).trace(*ps).lower(lowering_platforms=("cuda",)).as_text()
    fn = functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, persistent=True, split_k=2, sfold=True)
    assert "mosaic_gpu" in jax.jit(fn).trace(*ps).lower(lowering_platforms=("cuda",)).as_text()    # K splits
    for bad in (dict(ws=True), dict(overlap=True), dict(zfold=True)):     # (ps: with row scales)
        with pytest.raises(ConfigError, match="persistent=True"):
            jax.jit(functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, persistent=True, **bad)).trace(*ps)
    # persistent with ws: one chained warp-specialized pipeline per item (no row scales, a ring depth
    # dividing an item's steps)
    for zp in (True, False):
        pw = (s((3 * 48, 1024), jnp.bfloat16), s((3,), jnp.int32), s((4, 512, 256), jnp.int16),
              s((4, 8, 512), jnp.bfloat16), s((4, 8, 512), jnp.bfloat16) if zp else None)
        for opts in (dict(block_n=128, stages=2, kpb=2, wide=True, shift32=True, programs=5),
                     dict(block_n=64, stages=4), dict(block_n=128, stages=2, split_k=2, programs=1)):
            fn = functools.partial(wgmma_grouped_gemm, block_m=48, ws=True, persistent=True, **opts)
            assert "mosaic_gpu" in jax.jit(fn).trace(*pw).lower(lowering_platforms=("cuda",)).as_text()
        if TRANSPOSED_STORE:
            fn = functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, ws=True, persistent=True, stages=2,
                                   out_dtype=jnp.bfloat16, tout=True, gated="silu")
            assert "mosaic_gpu" in jax.jit(fn).trace(*pw).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ConfigError, match="stages dividing the 8 steps"):              # 8 steps, 3 stages
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, ws=True, persistent=True,
                                  stages=3)).trace(*pw)
    with pytest.raises(ConfigError, match="programs=3 needs persistent"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, programs=3)).trace(*ps)
    for bm, opts in ((48, dict(kpb=2, wide=True, shift32=True, stages=2)), (64, dict(ws=True)),       # dest
                     (16, dict(kpb=2, wide=True, shift32=True, sfold=True)), (48, dict(persistent=True))):
        da = (s((3 * bm, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 128), jnp.int16),
              s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16), s((3 * bm,), jnp.float32),
              s((3 * bm,), jnp.int32))
        fn = functools.partial(wgmma_grouped_gemm, block_m=bm, block_n=128, out_dtype=jnp.bfloat16, tout=True,
                               dest_rows=50, **opts)
        if not TRANSPOSED_STORE:
            with pytest.raises(ConfigError, match="tout=True needs jax"):
                jax.jit(fn).trace(*da)
            continue
        traced = jax.jit(fn).trace(*da)
        assert traced.out_info.shape == (50, 256) and traced.out_info.dtype == jnp.bfloat16
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        # the zeros it adds into are the kernel's output buffer itself (aliased, no copy)
        assert "mosaic_gpu" in text and "output_operand_aliases" in text
    for bad in (dict(dest_rows=None), dict(tout=False), dict(split_k=2), dict(dest_rows=0)):
        kw = dict(block_m=48, block_n=128, out_dtype=jnp.bfloat16, tout=True, dest_rows=50)
        kw.update(bad)
        with pytest.raises(ConfigError, match="dest and dest_rows"):
            jax.jit(functools.partial(wgmma_grouped_gemm, **kw)).trace(*da)
    for dst, err in ((s((3 * 48,), jnp.float32), DTypeError), (s((3 * 48 - 8,), jnp.int32), ShapeError)):
        with pytest.raises(err, match="dest: expected int32"):
            jax.jit(functools.partial(wgmma_grouped_gemm, block_m=48, block_n=128, out_dtype=jnp.bfloat16, tout=True,
                                      dest_rows=50)).trace(*da[:-1], dst)
    ov32 = (s((24, 512), jnp.bfloat16), s((3,), jnp.int32), s((4, 256, 64), jnp.int32),
            s((4, 4, 256), jnp.bfloat16), s((4, 4, 256), jnp.bfloat16))           # overlap on 32-bit words
    fn = functools.partial(wgmma_grouped_gemm, block_m=8, overlap=True, block_n=128)
    assert "mosaic_gpu" in jax.jit(fn).trace(*ov32).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ConfigError, match="overlap"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=8, overlap=True, zfold=True)).trace(*ov)
    with pytest.raises(ConfigError, match="zfold"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=64, group_size=-1, zfold=True)).trace(*args)
    with pytest.raises(ConfigError, match="shift32"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=64, group_size=-1, shift32=True)).trace(*args)
    with pytest.raises(ConfigError, match="sfold"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=64, group_size=-1, sfold=True)).trace(*args)
    many = (s((16 * 300, 256), jnp.bfloat16), s((300,), jnp.int32), s((4, 128, 64), jnp.int16),
            s((4, 2, 128), jnp.bfloat16))              # 300 blocks: the ids copy stays within TMA's 256
    assert "mosaic_gpu" in jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16)).trace(*many).lower(
        lowering_platforms=("cuda",)).as_text()
    o16 = (s((64, 1024), jnp.bfloat16), s((4,), jnp.int32), s((4, 512, 256), jnp.int16), s((4, 8, 512), jnp.bfloat16),
           s((4, 8, 512), jnp.bfloat16))
    for opts in (dict(block_n=128, shift32=True), dict(kpb=2, wide=True, shift32=True, stages=2, zfold=True),
                 dict(block_n=128, shift32=True, ws=True, stages=4), dict(block_n=64, kpb=2, wide=True, ws=True)):
        for tout in (False, True):                      # 16-bit output, [N, M] or (tout) [M, N] tiles
            fn = functools.partial(wgmma_grouped_gemm, block_m=16, out_dtype=jnp.bfloat16, tout=tout, **opts)
            if tout and not TRANSPOSED_STORE:           # jax 0.10: a clear error, not Mosaic's
                with pytest.raises(ConfigError, match="tout=True needs jax >= 0.11"):
                    jax.jit(fn).trace(*o16)
                continue
            assert jax.eval_shape(fn, *o16) == s((1, 64, 512), jnp.bfloat16)
            assert "mosaic_gpu" in jax.jit(fn).trace(*o16).lower(lowering_platforms=("cuda",)).as_text()
    for opts in (dict(shift32=True), dict(kpb=2, wide=True, shift32=True, stages=2, zfold=True),
                 dict(kpb=2, wide=True, stages=2, sfold=True), dict(shift32=True, overlap=True),
                 dict(shift32=True, ws=True, stages=4), dict(kpb=2, wide=True, ws=True, stages=2)):
        for tout in (False, True) if TRANSPOSED_STORE else (False,):        # gated epilogue: [.., N/2]
            for act in ("silu", "gelu_tanh"):
                fn = functools.partial(wgmma_grouped_gemm, block_m=16, block_n=128, out_dtype=jnp.bfloat16,
                                       tout=tout, gated=act, **opts)
                assert jax.eval_shape(fn, *o16) == s((1, 64, 256), jnp.bfloat16)
                assert "mosaic_gpu" in jax.jit(fn).trace(*o16).lower(lowering_platforms=("cuda",)).as_text()
    rs = s((64,), jnp.float32)                          # row_scale: the epilogue's per-row factor
    for opts in (dict(split_k=2), dict(kpb=2, wide=True, shift32=True, stages=2, zfold=True),
                 dict(block_n=128, shift32=True, ws=True, stages=4, out_dtype=jnp.bfloat16),
                 dict(block_n=128, shift32=True, out_dtype=jnp.bfloat16, tout=TRANSPOSED_STORE, gated="silu")):
        fn = functools.partial(wgmma_grouped_gemm, block_m=16, **opts)
        assert "mosaic_gpu" in jax.jit(fn).trace(*o16, rs).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ShapeError, match=r"row_scale: expected float32 of shape \(64,\)"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16)).trace(*o16, s((48,), jnp.float32))
    with pytest.raises(DTypeError, match="row_scale: expected float32"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16)).trace(*o16, s((64,), jnp.bfloat16))
    for bad in (dict(gated="gelu"), dict(gated="silu", block_n=64), dict(gated="silu", block_n=128, split_k=2)):
        with pytest.raises(ConfigError, match="gated"):
            jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, **bad)).trace(*o16)
    with pytest.raises(ConfigError, match="out_dtype"):            # 16-bit partials of a K split
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, split_k=2, out_dtype=jnp.bfloat16)).trace(*o16)
    with pytest.raises(ConfigError, match="out_dtype"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, out_dtype=jnp.float16)).trace(*o16)
    with pytest.raises(ConfigError, match="tout"):                 # no transposed float32 store
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, tout=True)).trace(*o16)
    if TRANSPOSED_STORE:
        with pytest.raises(ConfigError, match="16-bit out_dtype"):
            jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, tout=True)).trace(*o16)
    with pytest.raises(ValueError, match="group_size"):
        wgmma_grouped_gemm(jnp.zeros((16, 512), jnp.bfloat16), jnp.zeros((1,), jnp.int32),
                           jnp.zeros((1, 64, 64), jnp.int32), jnp.zeros((1, 8, 64), jnp.bfloat16),
                           block_m=16, group_size=64)


_WGMMA_GPU_CASES = [
    (True, 128, 16, 2, {}), (False, -1, 64, 1, {}), (True, 128, 8, 4, {}),
    (True, 128, 8, 1, dict(block_n=128)), (False, 128, 16, 1, dict(kpb=2, stages=2)),
    (True, 128, 8, 2, dict(stages=4)), (True, -1, 16, 1, dict(block_n=128, kpb=2)),
    (True, 128, 8, 1, dict(block_n=128, tile_n=128)), (False, 128, 64, 2, dict(block_n=64, tile_n=64, kpb=2)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, stages=4)), (False, -1, 16, 2, dict(kpb=2, wide=True)),
    (True, 128, 64, 1, dict(block_n=128, kpb=2, wide=True, stages=2)),
    (True, 128, 8, 1, dict(block_n=128, shift32=True)), (False, -1, 16, 2, dict(shift32=True)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True)),
    (True, 128, 8, 1, dict(block_n=128, zfold=True)), (False, -1, 16, 2, dict(zfold=True, stages=4)),
    (True, 128, 8, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, zfold=True)),
    (False, 128, 64, 1, dict(block_n=128, zfold=True, shift32=True)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, stages=4, overlap=True)),
    (False, -1, 16, 4, dict(overlap=True)), (True, 128, 8, 1, dict(block_n=128, shift32=True, stages=2, overlap=True)),
    # overlap where the v5 version raced (a step's wgmmas against the next step's dequantization):
    # 128-row blocks, 16 K-blocks per program
    (True, 128, 128, 1, dict(block_n=128, shift32=True, stages=4, overlap=True, k=2048)),
    (False, 128, 64, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, stages=3, overlap=True, k=2048)),
    (True, -1, 128, 2, dict(block_n=64, stages=3, overlap=True, k=2048)),
    # sfold: the scale-only fold (c − z into the wgmma, s per K-block partial)
    (True, 128, 8, 1, dict(block_n=128, sfold=True)), (False, -1, 16, 2, dict(sfold=True, stages=4)),
    (True, 128, 8, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, stages=2, k=2048)),
    # shift32's and/or as two instructions (lop3=False; every other shift32 case runs the default inline lop3.b32)
    (True, 128, 8, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, stages=2, k=2048, lop3=False)),
    (False, 128, 64, 1, dict(block_n=128, shift32=True, lop3=False)),
    # ws: two compute warpgroups (block_n columns each) and a copy warpgroup
    (True, 128, 64, 1, dict(block_n=64, ws=True)),
    (False, 128, 128, 2, dict(block_n=128, shift32=True, ws=True, k=2048)),
    (True, 128, 8, 1, dict(block_n=64, kpb=2, wide=True, shift32=True, ws=True, stages=4, k=2048)),
    (True, 128, 128, 1, dict(block_n=128, stages=4, ws=True, k=2048)),
    # out16: the output in the activations' dtype; tout: written [M, N] through a transposed
    # shared-memory store (plain, fold, channelwise and ws epilogues)
    (True, 128, 16, 1, dict(block_n=128, shift32=True, out16=True)),
    (True, 128, 16, 1, dict(block_n=128, shift32=True, out16=True, tout=True)),
    (False, -1, 64, 1, dict(out16=True, tout=True, stages=4)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, zfold=True, out16=True, tout=True)),
    # the v16 default at 8-row blocked GEMMs: sfold with the [M, N] store (GEMM1 gated, GEMM2 row scales)
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True,
                           gated="silu", k=2048)),
    (False, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True, rs=True,
                            k=2048)),
    # the v17 default at 24-row blocks (FOLD_ROWS): the same, and channelwise
    (True, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True,
                            gated="silu", stages=2, k=2048)),
    (False, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True, rs=True,
                             stages=2, k=2048)),
    (False, -1, 24, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True)),
    (True, 128, 64, 1, dict(block_n=128, ws=True, out16=True)),
    (True, 128, 128, 1, dict(block_n=128, shift32=True, ws=True, out16=True, tout=True, k=2048)),
    (False, 128, 32, 1, dict(block_n=64, kpb=2, wide=True, shift32=True, ws=True, stages=2, out16=True, tout=True,
                             k=2048)),
    # gated: act(gate)·up of each 128-column tile's 64-column halves in the epilogue (plain, fold,
    # overlap, channelwise, ws; [N, M] and [M, N] stores; float32 and 16-bit outputs)
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, zfold=True, out16=True, gated="silu")),
    (True, 128, 8, 1, dict(block_n=128, sfold=True, gated="gelu_tanh")),
    (True, 128, 16, 1, dict(block_n=128, shift32=True, out16=True, tout=True, gated="silu")),
    (False, -1, 64, 1, dict(block_n=128, out16=True, tout=True, stages=4, gated="gelu_tanh")),
    (True, 128, 16, 1, dict(block_n=128, shift32=True, overlap=True, gated="silu")),
    (True, 128, 64, 1, dict(block_n=128, ws=True, out16=True, gated="silu")),
    (False, 128, 128, 1, dict(block_n=128, shift32=True, ws=True, stages=3, out16=True, tout=True, gated="silu",
                              k=2048)),
    (True, 128, 32, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, ws=True, stages=2, gated="gelu_tanh")),
    # row_scale: each output row times its own float32 scale in the epilogue (split partials,
    # [N, M] and [M, N] stores, fold, ws), and blocks that are not a power of two (48, 144 rows)
    (True, 128, 8, 2, dict(block_n=128, rs=True)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, zfold=True, rs=True)),
    (True, 128, 16, 1, dict(block_n=128, shift32=True, out16=True, tout=True, rs=True)),
    (True, 128, 128, 1, dict(block_n=128, shift32=True, ws=True, out16=True, tout=True, k=2048, rs=True)),
    (False, -1, 48, 1, dict(block_n=128, out16=True, tout=True, rs=True)),
    (True, 128, 48, 1, dict(block_n=128, ws=True, out16=True, tout=True, rs=True)),
    (True, 128, 144, 1, dict(block_n=128, shift32=True, ws=True, stages=2, out16=True, tout=True, k=1024, rs=True)),
    (True, 128, 48, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, out16=True, tout=True, gated="silu")),
    # persistent: programs streaming several (block, column tile, K split) items through one ring —
    # fewer programs than items, more (capped), one; the id -1 block in the middle (zeros stored in
    # the stream) or last (the tail's zeros); sfold, gated, row scales, both stores, K splits
    (True, 128, 48, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, out16=True, tout=True, stages=2,
                            persistent=True)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, persistent=True, programs=3)),
    (False, -1, 48, 1, dict(block_n=128, out16=True, tout=True, rs=True, persistent=True, programs=2)),
    (True, 128, 48, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, out16=True, tout=True, gated="silu",
                            persistent=True, programs=5)),
    (True, 128, 16, 1, dict(block_n=128, stages=3, persistent=True, programs=64)),
    (False, 128, 32, 1, dict(block_n=64, persistent=True, programs=1, rs=True)),
    (True, 128, 8, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, persistent=True, programs=5)),
    (True, 128, 8, 4, dict(block_n=64, persistent=True, rs=True)),
    # persistent with ws: one chained warp-specialized pipeline per item (START / STEADY / STOP, or a lone
    # one), the id -1 block in the stream or in the tail; 2·block_n column tiles, K splits, the gated
    # 16-bit transposed epilogue
    (True, 128, 48, 1, dict(block_n=128, ws=True, persistent=True, programs=3, stages=2, k=1024)),
    (True, 128, 64, 2, dict(block_n=64, ws=True, persistent=True, programs=2, stages=2)),
    (False, 128, 128, 1, dict(block_n=128, shift32=True, ws=True, persistent=True, stages=2, out16=True, tout=True,
                              gated="silu", k=1024)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, ws=True, persistent=True, programs=1,
                           stages=4, k=2048)),
    # dest: each row added into its destination row by a TMA reduce-add (the layer's top-k sum in
    # GEMM2) — the blocks of Qwen3 512 / 4096 and Mixtral 4096 tokens (plain, ws), a fold, persistent
    (True, 128, 48, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, out16=True, tout=True, stages=2, rs=True,
                            dest=True)),
    (True, 128, 144, 1, dict(block_n=128, shift32=True, ws=True, stages=2, out16=True, tout=True, k=1024, dest=True)),
    (True, 128, 128, 1, dict(block_n=128, shift32=True, ws=True, stages=3, out16=True, tout=True, k=2048, rs=True,
                             dest=True)),
    (False, -1, 16, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True,
                            dest=True)),
    (True, 128, 48, 1, dict(block_n=128, out16=True, tout=True, persistent=True, programs=5, rs=True, dest=True)),
    # cluster (v22): neighbouring column tiles multicast each step's activation tile — the decode
    # blocks' fold (8 / 16 / 24 rows; GEMM1's gated and GEMM2's row-scaled epilogues), no fold,
    # 128-deep steps (split along the 8-row tiles), channelwise, K splits, clusters of 4, 32-bit
    # words, destination rows; more steps than stages, so every slot is refilled across the cluster
    (True, 128, 16, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, stages=2, cluster=2, k=2048)),
    (True, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True,
                            gated="silu", stages=2, cluster=2, k=2048)),
    (False, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True, rs=True,
                             stages=2, cluster=2, k=2048)),
    (True, 128, 8, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, stages=2, cluster=2, k=2048)),
    (True, 128, 16, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, stages=3, cluster=4, n=512, k=2048)),
    (False, -1, 16, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, stages=3, cluster=2, k=1024)),
    (True, 128, 16, 1, dict(block_n=128, shift32=True, sfold=True, stages=3, cluster=2, k=1024)),
    (True, 128, 16, 1, dict(block_n=64, stages=3, cluster=2, rs=True, k=1024)),
    (True, 128, 16, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True,
                            dest=True, cluster=2, k=1024)),
    # ... and ws (the warp-specialized pipeline's multicast operand) and its persistent stream (shares
    # of whole clusters; a dead block inside the stream)
    (True, 128, 64, 1, dict(block_n=128, ws=True, stages=3, cluster=2, n=512, k=2048)),
    (True, 128, 128, 1, dict(block_n=128, shift32=True, ws=True, out16=True, tout=True, rs=True, cluster=2, n=512,
                             k=2048)),
    (False, 128, 48, 1, dict(block_n=128, ws=True, persistent=True, programs=6, stages=2, cluster=2, n=512, k=1024)),
    (True, 128, 48, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, ws=True, persistent=True, stages=2,
                            out16=True, tout=True, gated="silu", cluster=2, n=512, k=1024)),
    # v24: a_div — blocks sharing a's rows (the pair schedule's token rows): the decode fold split and
    # unsplit with the gated [M, N] epilogue, and no fold (channelwise, 32-bit words too)
    (True, 128, 8, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, stages=4, a_div=2)),
    (False, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, out16=True, tout=True,
                            gated="silu", a_div=4)),
    (True, -1, 8, 1, dict(block_n=64, a_div=3)),
    # v24: the scale-only fold in ws programs (64- and 128-column warpgroups), split, with the gated
    # [M, N] epilogue and row scales, and the ws stream
    (True, 128, 24, 1, dict(block_n=64, kpb=2, wide=True, shift32=True, sfold=True, ws=True, stages=2, n=512, k=2048)),
    (False, 128, 16, 2, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, ws=True, stages=2, k=2048)),
    (True, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, ws=True, stages=2, out16=True,
                            tout=True, gated="silu", rs=True, n=512, k=2048)),
    (True, 128, 16, 1, dict(block_n=64, kpb=2, wide=True, shift32=True, sfold=True, ws=True, persistent=True,
                            programs=5, stages=2, n=512, k=1024))]


def test_wgmma_a_div_lowers_cpu():
    """``a_div`` (v24): blocks that share ``a``'s rows (block ``i`` reads ``a``'s block
    ``i // a_div``) lower to Mosaic GPU in the plain kernel — the pair schedule's scale fold, split
    and unsplit with the gated epilogue, and no fold — with one output block per expert id; the
    kernel forms without it and a wrong row count are typed errors naming them."""
    from pallas_kernels.wgmma_w4a16 import wgmma_grouped_gemm

    s = jax.ShapeDtypeStruct

    def args(a_blocks, nb=8, bm=8):
        return (s((a_blocks * bm, 1024), jnp.bfloat16), s((nb,), jnp.int32), s((4, 512, 256), jnp.int16),
                s((4, 8, 512), jnp.bfloat16), s((4, 8, 512), jnp.bfloat16))

    fold = dict(block_m=8, kpb=2, wide=True, shift32=True, sfold=True)
    for a_div, opts, shape in ((4, dict(fold, split_k=2, stages=4), (2, 64, 512)),
                               (3, dict(fold, out_dtype=jnp.bfloat16, gated="silu", block_n=128), (1, 64, 256)),
                               (8, dict(block_m=8, shift32=True), (1, 64, 512))):
        fn = functools.partial(wgmma_grouped_gemm, a_div=a_div, **opts)
        a = args(-(-8 // a_div))
        assert jax.eval_shape(fn, *a).shape == shape, (a_div, opts)
        assert "mosaic_gpu" in jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text(), (a_div, opts)
    for bad in (dict(ws=True, block_m=64), dict(persistent=True), dict(zfold=True, block_m=8), dict(cluster=2)):
        bad = {"block_m": 16, **bad}
        with pytest.raises(ConfigError, match="a_div=2"):
            jax.jit(functools.partial(wgmma_grouped_gemm, a_div=2, **bad)).trace(*args(4, bm=bad["block_m"]))
    with pytest.raises(ShapeError, match="a must hold 2 blocks .* got 64 rows"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=8, a_div=4)).trace(*args(8))
    with pytest.raises(ConfigError, match="a_div must be an int >= 1"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=8, a_div=0)).trace(*args(8))


def test_wgmma_ws_sfold_lowers_cpu():
    """``ws`` with the scale-only fold (v24): two compute warpgroups of 64 or 128 columns folding
    each K-block's partial, split, the gated ``[M, N]`` epilogue where jax has it, and the ``ws``
    stream, lower to Mosaic GPU; ``zfold`` and ``sfold`` with ``cluster`` stay ConfigErrors."""
    from pallas_kernels.wgmma_w4a16 import TRANSPOSED_STORE, wgmma_grouped_gemm

    s = jax.ShapeDtypeStruct

    def args(bm, zp=True):
        return (s((3 * bm, 1024), jnp.bfloat16), s((3,), jnp.int32), s((4, 512, 256), jnp.int16),
                s((4, 8, 512), jnp.bfloat16), s((4, 8, 512), jnp.bfloat16) if zp else None)

    fold = dict(kpb=2, wide=True, shift32=True, sfold=True, ws=True, stages=2)
    cases = [(24, True, dict(fold, block_n=64)), (16, False, dict(fold, block_n=128, split_k=2)),
             (8, True, dict(fold, block_n=64, stages=4)), (16, True, dict(fold, block_n=64, persistent=True))]
    if TRANSPOSED_STORE:
        cases.append((24, True, dict(fold, block_n=128, gated="silu", tout=True, out_dtype=jnp.bfloat16)))
    for bm, zp, opts in cases:
        fn = functools.partial(wgmma_grouped_gemm, block_m=bm, **opts)
        assert "mosaic_gpu" in jax.jit(fn).trace(*args(bm, zp)).lower(lowering_platforms=("cuda",)).as_text(), opts
    for bad in (dict(fold, block_n=64, cluster=2), dict(fold, block_n=64, sfold=False, zfold=True)):
        with pytest.raises(ConfigError, match="ws=True takes"):
            jax.jit(functools.partial(wgmma_grouped_gemm, block_m=16, **bad)).trace(*args(16))


def test_wgmma_cluster_lowers_cpu():
    """``cluster``: programs in clusters of neighbouring column tiles that multicast each step's
    activation tile lower to Mosaic GPU with a cluster launch — the plain and scale-fold kernels
    (K-block-major rows), 16- and 32-bit words, 128-deep steps (split along the 8-row tiles),
    clusters of 4, row scales, the gated epilogue and destination rows; ``ws`` and its persistent
    stream (the rows split along their 8-row tiles); the tile splits it cannot make, and the
    kernel forms it does not take, are ConfigErrors naming the option."""
    from pallas_kernels.wgmma_w4a16 import TRANSPOSED_STORE, _cluster_splits, wgmma_grouped_gemm

    # as Mosaic GPU partitions a multicast [kpb, block_m, 128] tile: K-blocks, then 8-row tiles
    assert [_cluster_splits(kpb, bm, c) for kpb, bm, c in
            ((2, 8, 2), (2, 24, 2), (1, 16, 2), (1, 8, 2), (1, 24, 2), (2, 16, 4), (2, 24, 4), (4, 8, 4),
             (2, 8, 4), (1, 32, 4))] == [True, True, True, False, False, True, False, True, False, True]
    s = jax.ShapeDtypeStruct

    def lowers(bm, rows=3, n=512, k=512, words16=True, zp=True, rs=False, **opts):
        g = 1 if opts.get("group_size") == -1 else k // 128
        args = (s((rows * bm, k), jnp.bfloat16), s((rows,), jnp.int32),
                s((4, n, k // 4), jnp.int16) if words16 else s((4, n, k // 8), jnp.int32),
                s((4, g, n), jnp.bfloat16), s((4, g, n), jnp.bfloat16) if zp else None,
                s((rows * bm,), jnp.float32) if rs else None)
        text = jax.jit(functools.partial(wgmma_grouped_gemm, block_m=bm, **opts)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, opts
        return args

    fold = dict(block_n=128, kpb=2, wide=True, shift32=True, sfold=True, stages=2)
    lowers(16, cluster=2, **fold)
    lowers(24, cluster=2, rs=True, split_k=2, **fold)
    lowers(16, cluster=4, zp=False, **fold)
    lowers(16, cluster=2, block_n=128, kpb=2, wide=True, shift32=True, stages=4)          # no fold
    lowers(16, cluster=2, block_n=128, shift32=True, sfold=True, stages=4)               # 128-deep steps
    lowers(16, cluster=2, block_n=64, stages=3, words16=False)                            # 32-bit words
    lowers(16, cluster=2, group_size=-1, zp=False, **{**fold, "stages": 3})                 # channelwise
    if TRANSPOSED_STORE:
        lowers(24, cluster=2, out_dtype=jnp.bfloat16, tout=True, gated="silu", **fold)
        args = lowers(16, cluster=2, out_dtype=jnp.bfloat16, tout=True, **fold)
        da = args[:5] + (None, s((args[0].shape[0],), jnp.int32))
        fn = functools.partial(wgmma_grouped_gemm, block_m=16, cluster=2, out_dtype=jnp.bfloat16, tout=True,
                               dest_rows=20, **fold)
        assert "mosaic_gpu" in jax.jit(fn).trace(*da).lower(lowering_platforms=("cuda",)).as_text()
    ws = dict(block_n=128, ws=True, stages=2)                 # ws: the pipeline's own multicast operand
    lowers(64, cluster=2, k=1024, **ws)
    lowers(128, cluster=2, zp=False, shift32=True, k=1024, **ws)
    lowers(48, cluster=2, persistent=True, kpb=2, wide=True, shift32=True, k=1024, n=1024, **ws)     # the stream
    lowers(48, cluster=2, persistent=True, programs=6, split_k=2, k=1024, n=1024, **ws)
    if TRANSPOSED_STORE:
        lowers(48, cluster=2, persistent=True, out_dtype=jnp.bfloat16, tout=True, gated="silu", k=1024, n=1024, **ws)
    for bm, bad in ((40, dict(ws, cluster=2)), (48, dict(ws, cluster=4, n=1024)), (64, dict(ws, cluster=2, n=256))):
        with pytest.raises(ConfigError, match=f"cluster={bad['cluster']} .*with ws=True"):
            lowers(bm, k=1024, **bad)
    for bm, bad in ((16, dict(cluster=3)), (24, dict(cluster=4)),
                    (16, dict(cluster=2, persistent=True)), (16, dict(cluster=2, overlap=True, sfold=False)),
                    (16, dict(cluster=2, zfold=True, sfold=False)), (8, dict(cluster=2, kpb=1, wide=False)),
                    (16, dict(cluster=4, block_n=128, n=256))):
        with pytest.raises(ConfigError, match=f"cluster={bad['cluster']}"):
            lowers(bm, **{**fold, **bad})


def _gated64_np(ref, act):
    """float64 numpy twin of the ``gated`` epilogue: ``[M, N]`` → ``[M, N/2]``."""
    q = ref.reshape(ref.shape[0], -1, 2, 64)
    g, u = q[:, :, 0].reshape(ref.shape[0], -1), q[:, :, 1].reshape(ref.shape[0], -1)
    if act == "silu":
        return g / (1.0 + np.exp(-g)) * u
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3))) * u


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("word_bits, zp, group, bm, split, opts", [
    pytest.param(wb, *c, id=f"w{wb}-zp{int(c[0])}-g{c[1]}-bm{c[2]}-s{c[3]}-"
                 + "-".join(f"{key}{int(v) if isinstance(v, bool) else v}" for key, v in c[4].items()))
    for wb in (16, 32) for c in _WGMMA_GPU_CASES
    if wb == 16 or not {"tile_n", "wide", "shift32", "zfold", "sfold"} & set(c[-1])])
def test_wgmma_grouped_gemm_gpu(word_bits, zp, group, bm, split, opts):
    """Engine v4 (Mosaic GPU wgmma, weights as the register operand) vs float64, every
    schedule option (column tile, K-blocks per pipeline step, stages, tile-major words) and
    epilogue (16-bit, transposed, gated)."""
    from pallas_kernels.wgmma_w4a16 import wgmma_grouped_gemm

    opts = dict(opts)
    tile_n = opts.pop("tile_n", None)
    k = opts.pop("k", 512)
    n = opts.pop("n", 256)
    rng = np.random.default_rng()
    out16 = opts.pop("out16", False)
    rs = opts.pop("rs", False)
    zfold = opts.get("zfold", False) or opts.get("sfold", False)   # exact (c − z)·s, float32 accumulation
    a, eids, (words, scales, zeros), ref = _wgmma_case(rng, zp, group, bm, k=k, n=n, word_bits=word_bits,
                                                       tile_n=tile_n, exact=zfold, a_div=opts.get("a_div", 1))
    if opts.get("gated"):
        ref = _gated64_np(ref, opts["gated"])
    row_scale = None
    if rs:                                     # signed, and zero on some rows
        row_scale = rng.uniform(-2.0, 2.0, ref.shape[0]).astype(np.float32) * (rng.random(ref.shape[0]) > 0.1)
        ref = ref * row_scale[:, None].astype(np.float64)
        row_scale = jnp.asarray(row_scale)
    if opts.pop("dest", False):                # 4 rows per destination row, ~10% of the rows dropped
        m = a.shape[0]
        dest = (rng.permutation(m) % (m // 4)).astype(np.int32)
        dest[rng.random(m) < 0.1] = -1
        summed = np.zeros((m // 4, ref.shape[1]))
        np.add.at(summed, dest[dest >= 0], ref[dest >= 0])
        out = wgmma_grouped_gemm(a, jnp.asarray(eids), words, scales, zeros, row_scale, jnp.asarray(dest), block_m=bm,
                                 group_size=group, split_k=split, out_dtype=a.dtype, dest_rows=m // 4, **opts)
        assert out.shape == summed.shape and out.dtype == a.dtype
        # each row rounded to bf16, then up to 3 bf16 additions (relative 2^-9 each)
        _close(np.asarray(out, np.float64), summed, 1e-2)
        return
    out = wgmma_grouped_gemm(a, jnp.asarray(eids), words, scales, zeros, row_scale, block_m=bm, group_size=group,
                             split_k=split, out_dtype=a.dtype if out16 else jnp.float32, **opts)
    assert out.shape == (split,) + ref.shape and out.dtype == (a.dtype if out16 else jnp.float32)
    # out16: one bf16 rounding of each output (relative 2^-9 at most)
    _close(np.asarray(out, np.float64).sum(0), ref, 4e-3 if out16 else 1e-4 if zfold else 2e-5)


def test_gate_up_interleave_order():
    """The gated epilogue's column order: tile j holds gate columns 64j… then up columns I+64j…,
    along any axis, numpy or jax; the inverse restores the order; 2·I not a multiple of 128 is a
    ShapeError naming the size."""
    from pallas_kernels.wgmma_w4a16 import deinterleave_gate_up, interleave_gate_up

    i = 192
    x = np.arange(2 * i)
    y = interleave_gate_up(x, 0)
    j, c = np.divmod(np.arange(2 * i), 128)
    np.testing.assert_array_equal(y, np.where(c < 64, 64 * j + c, i + 64 * j + c - 64))
    z = jnp.asarray(np.random.default_rng().standard_normal((3, 2 * i, 5)))
    np.testing.assert_array_equal(np.asarray(deinterleave_gate_up(interleave_gate_up(z, 1), -2)), np.asarray(z))
    np.testing.assert_array_equal(np.asarray(interleave_gate_up(z, 1))[1, :, 2], np.asarray(z)[1, y, 2])
    with pytest.raises(ShapeError, match="2·I = 320"):
        interleave_gate_up(np.zeros((2, 320)), 1)


def _gated64(out, act):
    """The kernel's ``gated`` epilogue on ``out [..., N]`` (64-column gate / up halves per 128
    columns) → ``[..., N/2]``, with the library's (unfused) activation."""
    from wna16_jax.moe import ACTIVATIONS

    q = out.reshape(out.shape[:-1] + (out.shape[-1] // 128, 2, 64))
    g, u = q[..., 0, :].reshape(out.shape[:-1] + (-1,)), q[..., 1, :].reshape(out.shape[:-1] + (-1,))
    return ACTIVATIONS[act](jnp.concatenate([g, u], -1))


def _emulated_wgmma_gemm(a, expert_ids, words, scales, zeros=None, row_scale=None, dest=None, *, block_m,
                         group_size=128, split_k=1, kpb=1, wide=False, out_dtype=jnp.float32, tout=False, gated=None,
                         block_n=64, dest_rows=None, a_div=1, **_):
    """``wgmma_grouped_gemm``'s contract in jnp (float32 partials ``[split_k, M, N]``, split ``i``
    over the ``i``-th K range, zero rows for id -1; with ``gated`` the activation of each 128-column
    tile's 64-column halves; with ``dest`` each row rounded to ``out_dtype`` and added in that dtype
    into row ``dest[r]`` of ``[dest_rows, N]`` zeros; with ``a_div`` block ``i`` reads ``a``'s block
    ``i // a_div``), for testing the layer's glue on the CPU."""
    from pallas_kernels.wgmma_w4a16 import _check, from_wgmma_layout, magic_value

    _check(a, expert_ids, words, scales, zeros, block_m, split_k, group_size, row_scale, dest, a_div)   # the contract
    if a_div > 1:
        a = a.reshape(-1, block_m, a.shape[1])[jnp.arange(expert_ids.shape[0]) // a_div].reshape(-1, a.shape[1])
    assert (a.shape[1] // 128 // split_k) % kpb == 0 and (not wide or kpb == 2), (split_k, kpb, wide)
    z = None if zeros is None else (zeros.astype(jnp.float32) - magic_value(a.dtype)).astype(jnp.uint8)
    w = dequantize_tiles(from_wgmma_layout(words), scales, z, bits=4, group_size=group_size, dtype=a.dtype)
    blocks = a.reshape(-1, block_m, a.shape[1]).astype(jnp.float32)
    wb = w[jnp.maximum(expert_ids, 0)].astype(jnp.float32)
    kc = a.shape[1] // split_k                 # each split's share of K, as the kernel splits it
    out = jnp.stack([jnp.einsum("bmk,bkn->bmn", blocks[:, :, i * kc:(i + 1) * kc], wb[:, i * kc:(i + 1) * kc],
                                precision=jax.lax.Precision.HIGHEST) for i in range(split_k)])
    out = jnp.where((expert_ids >= 0)[None, :, None, None], out, 0.0).reshape(split_k, a.shape[0], -1)
    assert out_dtype == jnp.float32 or (out_dtype == a.dtype and split_k == 1), (out_dtype, split_k)
    assert not tout or out_dtype != jnp.float32
    if gated is not None:
        assert split_k == 1 and block_n == 128 and gated in ("silu", "gelu_tanh"), (split_k, block_n, gated)
        out = _gated64(out, gated)
    if row_scale is not None:
        out = out * row_scale[:, None]
    if dest is not None:
        assert tout and split_k == 1 and dest_rows is not None, (tout, split_k, dest_rows)
        to = jnp.where(dest >= 0, dest, dest_rows)                # -1: dropped
        return jnp.zeros((dest_rows, out.shape[2]), out_dtype).at[to].add(out[0].astype(out_dtype), mode="drop")
    assert dest_rows is None
    return out.astype(out_dtype)


def _emulated_gather_rows(x, idx, *, block_m):
    """``gather_rows``'s contract in jnp: row ``r`` is ``x[idx[r]]`` where ``idx[r] >= 0``; the
    other rows are unspecified — NaN here, so a layer that let them reach its output would fail
    its float64 comparison (NaN never passes ``_layer_close``)."""
    from pallas_kernels.row_gather import gather_rows_reason

    assert x.ndim == 2 and gather_rows_reason(x.shape[1], x.dtype) is None, (x.shape, x.dtype)
    assert idx.dtype == jnp.int32 and idx.ndim == 1 and idx.shape[0] % block_m == 0, (idx.dtype, idx.shape, block_m)
    return jnp.where((idx >= 0)[:, None], x[jnp.maximum(idx, 0)], jnp.nan).astype(x.dtype)


def _emulate_kernels(monkeypatch, wgm, gemm=None):
    """The layer's Mosaic GPU kernels replaced by their jnp contracts: the grouped GEMM (``gemm``,
    default :func:`_emulated_wgmma_gemm`) and the row gather (:func:`_emulated_gather_rows`)."""
    monkeypatch.setattr(wgm, "wgmma_grouped_gemm", gemm or _emulated_wgmma_gemm)
    monkeypatch.setattr(wgm, "gather_rows", _emulated_gather_rows)


WGMMA_SCHEMES = {"awq_g128": SCHEMES["awq_g128"], "gptq4_g128_actorder": SCHEMES["gptq4_g128_actorder"],
                 "gptq4_channel": QuantScheme("gptq", 4, -1, False)}


@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_weights_convert_and_decode(key):
    """``convert_wgmma`` holds exactly the engine tiles' content (decode round trip, zero points
    re-biased for fp16), and formats outside the kernel get a reason and a typed error."""
    from pallas_kernels.wgmma_w4a16 import convert_wgmma, wgmma_unsupported_reason

    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, WGMMA_SCHEMES[key], 4, 256, 256).to_jax()
    tiles = convert_tiles(w)
    for dt in (jnp.bfloat16, jnp.float16):
        wg = convert_wgmma(w, dt)
        assert wg.w13_words.dtype == jnp.int16 and wg.w13_words.shape == (4, 512, 64)
        back = wg.to_tiles()
        assert wg.w13_interleaved                      # I = 256: w13 stored in the gated column order
        for f in ("w13_qweight", "w2_qweight", "w13_zeros", "w2_zeros", "w13_perm", "w2_perm", "w13_scales",
                  "w2_scales"):
            a, b = getattr(back, f), getattr(tiles, f)
            assert (a is None) == (b is None), f
            if a is not None:
                b = b.astype(dt) if f.endswith("scales") else b     # stored in the activation dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f)
    for bad in ("gptq8_channel", "ct4_asym_g32", "gptq4_g64"):
        wb = random_checkpoint_weights(rng, SCHEMES[bad], 2, 256, 256).to_jax()
        assert wgmma_unsupported_reason(wb)
        with pytest.raises(UnsupportedError, match="wgmma engine"):
            convert_wgmma(wb)


@pytest.mark.parametrize("key", ["awq_g128", "gptq4_g128_actorder"])
def test_wgmma_decode_with_hidden_equal_to_group(key):
    """H = 128 = the group size: w13 has one scale group (like a channelwise layer), w2 has I/128.
    The wgmma layout's decode (its XLA path and the backward's re-layout) must still read w2 as
    group-128, matching the loader layout's decode exactly."""
    from pallas_kernels.wgmma_w4a16 import convert_wgmma

    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, WGMMA_SCHEMES[key], 2, 128, 384).to_jax()
    want13, want2 = (np.asarray(a, np.float64) for a in w.dequantize(jnp.float32))
    for dt in (jnp.bfloat16, jnp.float16):
        wg = convert_wgmma(w, dt)
        got13, got2 = (np.asarray(a, np.float64) for a in jax.jit(lambda x: x.dequantize(jnp.float32))(wg))
        # the wgmma layout stores scales in the activation dtype: compare with scales rounded the same way
        ref = dataclasses.replace(w, w13_scales=w.w13_scales.astype(dt), w2_scales=w.w2_scales.astype(dt))
        r13, r2 = (np.asarray(a, np.float64) for a in ref.dequantize(jnp.float32))
        np.testing.assert_array_equal(got13, r13)
        np.testing.assert_array_equal(got2, r2)
        assert np.abs(got2 - want2).max() <= 1e-2 * np.abs(want2).max()


def test_wgmma_rejects_bad_input():
    """Typed errors naming the tensor, raised while tracing (before any GPU lowering)."""
    from pallas_kernels.wgmma_w4a16 import convert_wgmma, fused_moe_wgmma, wgmma_grouped_gemm

    a = jnp.zeros((32, 256), jnp.bfloat16)
    ids = jnp.zeros((2,), jnp.int32)
    w16 = jnp.zeros((3, 128, 64), jnp.int16)
    sc = jnp.ones((3, 2, 128), jnp.bfloat16)
    with pytest.raises(DTypeError, match="words"):
        wgmma_grouped_gemm(a, ids, w16.astype(jnp.int8), sc, block_m=16)
    with pytest.raises(DTypeError, match="scales"):
        wgmma_grouped_gemm(a, ids, w16, sc.astype(jnp.float32), block_m=16)
    with pytest.raises(ShapeError, match="zeros"):
        wgmma_grouped_gemm(a, ids, w16, sc, sc[:, :1], block_m=16)
    with pytest.raises(DTypeError, match="a: expected"):
        wgmma_grouped_gemm(a.astype(jnp.float32), ids, w16, sc, block_m=16)
    with pytest.raises(ShapeError, match="block_m"):
        wgmma_grouped_gemm(a, ids, w16, sc, block_m=8)
    with pytest.raises(ConfigError, match="split_k"):
        wgmma_grouped_gemm(a, ids, w16, sc, block_m=16, split_k=3)
    with pytest.raises(ConfigError, match="block_n"):
        wgmma_grouped_gemm(a, ids, w16, sc, block_m=16, block_n=96)
    s = jax.ShapeDtypeStruct       # a program that would not fit the H100/H200's shared memory
    big = (s((128, 2048), jnp.bfloat16), s((2,), jnp.int32), s((2, 256, 512), jnp.int16),
           s((2, 16, 256), jnp.bfloat16), s((2, 16, 256), jnp.bfloat16))
    with pytest.raises(ConfigError, match="shared memory"):
        jax.jit(functools.partial(wgmma_grouped_gemm, block_m=64, block_n=128, ws=True, kpb=2, wide=True,
                                  stages=4)).trace(*big)
    jax.jit(functools.partial(wgmma_grouped_gemm, block_m=64, block_n=128, ws=True, kpb=2, wide=True,
                              stages=3)).trace(*big)
    rng = np.random.default_rng()
    w, x, tw, ids2, _ = _layer_case(rng, SCHEMES["awq_g128"], 4, 256, 256, 3, 2)
    wg = convert_wgmma(w.to_jax())
    with pytest.raises(ShapeError, match="hidden_states"):
        fused_moe_wgmma(x[:, :128], tw, ids2, wg)
    with pytest.raises(DTypeError, match="hidden_states"):
        fused_moe_wgmma(x.astype(jnp.float32), tw, ids2, wg)
    with pytest.raises(ConfigError, match="schedule"):
        fused_moe_wgmma(x, tw, ids2, wg, schedule="stream")
    with pytest.raises(ConfigError, match="combine"):
        fused_moe_wgmma(x, tw, ids2, wg, combine="atomic")
    with pytest.raises(ConfigError, match="align"):
        fused_moe_wgmma(x, tw, ids2, wg, align="radix")


_GLUE_CASES = [(3, False, False, False, "silu"), (40, True, True, False, "silu"), (9, True, False, True, "gelu_tanh")]
_GLUE_SCHEDULES = [(None, None), (3, "pair"), (3, "blocked"), (None, "wide")]


# every scheme × every schedule, the three epilogue cases in turn (each case meets every scheme
# and every schedule at least once): 12 layers instead of the full 36-way product
@pytest.mark.parametrize("key, t, bias, map_, on_input, activation, split, schedule", [
    (key,) + _GLUE_CASES[(i + j) % 3] + _GLUE_SCHEDULES[j]
    for i, key in enumerate(sorted(WGMMA_SCHEMES)) for j in range(4)])
def test_fused_moe_wgmma_glue_cpu(monkeypatch, key, t, bias, map_, on_input, activation, split, schedule):
    """The wgmma layer's schedules (pair: no alignment; blocked: sorted rows), bias, router
    weights (on input too), expert map, activation and top-k sum against the float64 reference
    on the CPU, with the kernel replaced by its jnp
    contract (the kernel itself is checked on the GPU by ``test_wgmma_grouped_gemm_gpu`` and
    ``test_fused_moe_wgmma_gpu_shapes``)."""
    import pallas_kernels.wgmma_w4a16 as wgm

    _emulate_kernels(monkeypatch, wgm, _emulated_wgmma_gemm)
    rng = np.random.default_rng()
    w, x, tw, ids, em = _layer_case(rng, WGMMA_SCHEMES[key], 6, 256, 256, t, 2, bias=bias, map_=map_)
    wg = wgm.convert_wgmma(w.to_jax())
    wide = schedule == "wide"                           # 256-deep steps: splits must divide K-blocks / 2
    ref = _reference(w, x, tw, ids, em, activation=activation, on_input=on_input)
    # the top-k sum of sorted rows (blocked only): the inverse-order gather (default) and
    # segment_sum; the expert sort by one sort, by counting, by comparing and by ranks (their pair rows
    # inverting the order for the gather); the router weights in GEMM2's
    # epilogue and in XLA (each schedule's default, then both forced); the split and top-k sums
    # as unrolled adds (default) and as reductions; the token rows gathered as 32-bit words
    # (default) and as 16-bit values
    # and GEMM2 adding its rows into the output itself (combine="add", the kernel's dest; jax >= 0.11
    # in the kernel, which the jnp contract does not need)
    monkeypatch.setattr(wgm, "TRANSPOSED_STORE", True)
    # (rg: the rows gathered by the row-gather kernel, default, whose rows outside the pairs' blocks the
    # jnp contract fills with NaN; or by XLA)
    cases = [("gather", "count", None, True, None, None), ("gather", "compare", True, True, True, False),
             ("gather", "rank", False, False, False, False)]
    for combine, align, in_gemm2, static, g32, rg in cases + (
            [] if schedule == "pair" else [("scatter", "sort", None, True, True, None),
                                           ("add", "count", None, True, True, None)]):
        got = jax.jit(functools.partial(wgm.fused_moe_wgmma, activation=activation, split1=split, split2=split,
                                        schedule=None if wide else schedule, wide=True if wide else None,
                                        apply_router_weight_on_input=on_input, combine=combine, align=align,
                                        weight_in_gemm2=in_gemm2, static_sums=static, gather32=g32,
                                        row_gather=rg))(x, tw, ids, wg, expert_map=em)
        _layer_close(got, ref, what=f"combine={combine} align={align} weight_in_gemm2={in_gemm2} "
                                    f"static_sums={static} gather32={g32} row_gather={rg}")


def test_fused_moe_wgmma_combine_add_errors_cpu(monkeypatch):
    """``combine="add"`` where GEMM2 cannot add its rows into the output: a ConfigError naming why
    (jax < 0.11, a K split, no 16-bit output tile, the router weights outside GEMM2); kernel
    replaced by its jnp contract."""
    import pallas_kernels.wgmma_w4a16 as wgm

    _emulate_kernels(monkeypatch, wgm, _emulated_wgmma_gemm)
    w, x, tw, ids, _ = _layer_case(np.random.default_rng(), WGMMA_SCHEMES["awq_g128"], 4, 256, 512, 24, 2)
    wg = wgm.convert_wgmma(w.to_jax())

    def run(**kw):
        return jax.jit(functools.partial(wgm.fused_moe_wgmma, schedule="blocked", combine="add", **kw))(x, tw, ids, wg)
    monkeypatch.setattr(wgm, "TRANSPOSED_STORE", False)
    with pytest.raises(ConfigError, match="combine='add'.*< 0.11"):
        run()
    monkeypatch.setattr(wgm, "TRANSPOSED_STORE", True)
    for kw, why in ((dict(split2=2, wide=False), "a K split of 2"), (dict(out16=False), "out16=False"),
                    (dict(tout=False), "tout=False"), (dict(weight_in_gemm2=False), "router weights")):
        with pytest.raises(ConfigError, match=f"combine='add'.*{why}"):
            run(**kw)
    _layer_close(run(), _reference(w, x, tw, ids, None), what="combine=add")


def _check_layer_picks(monkeypatch, pick, cases, experts, hidden, inter, close=None):
    """Run ``fused_moe_wgmma`` with each case's options (24 tokens, top-2, AWQ), the kernel
    replaced by its jnp contract: the options it passes each GEMM (``pick(kwargs)``, GEMM1 then
    GEMM2) must be the case's, and the layer must match the float64 reference — in every case,
    or only in the cases whose indices ``close`` lists (the others are traced, not compiled: the
    contract ignores the kernel options, so their numbers differ only where the glue does)."""
    import pallas_kernels.wgmma_w4a16 as wgm

    seen = []

    def spy(*args, **kw):
        seen.append(pick(kw))
        return _emulated_wgmma_gemm(*args, **kw)

    _emulate_kernels(monkeypatch, wgm, spy)
    w, x, tw, ids, _ = _layer_case(np.random.default_rng(), WGMMA_SCHEMES["awq_g128"], experts, hidden, inter, 24, 2)
    wg = wgm.convert_wgmma(w.to_jax())
    ref = _reference(w, x, tw, ids, None)
    for n, (over, want) in enumerate(cases):
        seen.clear()
        layer = jax.jit(functools.partial(wgm.fused_moe_wgmma, **over))
        if close is None or n in close:
            _layer_close(layer(x, tw, ids, wg), ref, what=str(over))
        else:
            jax.eval_shape(layer, x, tw, ids, wg)
        assert seen == want, (over, seen)


def test_fused_moe_wgmma_token_rows_cpu(monkeypatch):
    """``token_rows=True`` (v24): in the pair schedule GEMM1 reads one 8-row block per token (the
    kernel's ``a_div = k``) instead of one per routed pair; GEMM2 and the blocked schedule are
    unchanged; where GEMM1 does not run the plain kernel (``persistent``) the rows are spread per
    pair after all, and act-order weights keep their per-pair rows. The layer matches the float64
    reference in every case (kernels replaced by their jnp contracts)."""
    import pallas_kernels.wgmma_w4a16 as wgm

    seen = []

    def spy(a, expert_ids, *args, **kw):
        seen.append((kw.get("a_div", 1), a.shape[0] // kw["block_m"], expert_ids.shape[0]))
        return _emulated_wgmma_gemm(a, expert_ids, *args, **kw)

    _emulate_kernels(monkeypatch, wgm, spy)
    rng = np.random.default_rng()
    t, k = 6, 2
    for key, cases in (("awq_g128", [
            (dict(schedule="pair", token_rows=True), [(k, t, t * k), (1, t * k, t * k)]),
            (dict(schedule="pair", token_rows=True, persistent=(True, None)), [(1, t * k, t * k), (1, t * k, t * k)]),
            (dict(schedule="pair"), [(1, t * k, t * k), (1, t * k, t * k)]),
            (dict(schedule="blocked", block_m=16, token_rows=True), None)]),
            ("gptq4_g128_actorder", [(dict(schedule="pair", token_rows=True), [(1, t * k, t * k), (1, t * k, t * k)])])):
        w, x, tw, ids, _ = _layer_case(rng, WGMMA_SCHEMES[key], 8, 256, 256, t, k)
        wg = wgm.convert_wgmma(w.to_jax())
        ref = _reference(w, x, tw, ids, None)
        for over, want in cases:
            seen.clear()
            _layer_close(jax.jit(functools.partial(wgm.fused_moe_wgmma, **over))(x, tw, ids, wg), ref,
                         what=f"{key} {over}")
            if want is None:                       # blocked: every GEMM reads its own blocks
                assert seen and all(d == 1 and ab == nb for d, ab, nb in seen), (over, seen)
            else:
                assert seen == want, (key, over, seen)


def test_fused_moe_wgmma_row_gather_default_cpu(monkeypatch):
    """v23: the blocked schedule gathers the token rows with the row-gather kernel by default only
    from ``ROW_GATHER_MIN_PAIRS`` routed pairs on (XLA's gather below, which fuses into the glue);
    ``row_gather=True`` / ``False`` force either. Traced with the kernels replaced by their jnp
    contracts, counting the row-gather calls."""
    import pallas_kernels.wgmma_w4a16 as wgm

    calls = []

    def spy(x, idx, *, block_m):
        calls.append(idx.shape)
        return _emulated_gather_rows(x, idx, block_m=block_m)

    _emulate_kernels(monkeypatch, wgm)
    monkeypatch.setattr(wgm, "gather_rows", spy)
    h, i, e, k = 256, 256, 8, 4
    w = wgm.convert_wgmma(random_checkpoint_weights(np.random.default_rng(), WGMMA_SCHEMES["awq_g128"], e, h, i)
                          .to_jax())
    bf = jnp.bfloat16
    lim = wgm.ROW_GATHER_MIN_PAIRS
    for t, over, want in [(lim // k - 1, {}, 0), (lim // k, {}, 1), (lim // k - 1, dict(row_gather=True), 1),
                          (lim // k, dict(row_gather=False), 0), (4, dict(block_m=16), 0)]:
        calls.clear()
        s = jax.ShapeDtypeStruct
        jax.eval_shape(functools.partial(wgm.fused_moe_wgmma, schedule="blocked", **over),
                       s((t, h), bf), s((t, k), jnp.float32), s((t, k), jnp.int32), w)
        assert len(calls) == want, (t, over, calls)


def test_fused_moe_wgmma_fold_defaults_cpu(monkeypatch):
    """Which fold each GEMM gets by default (docs/journal/notes.md v12, v17): blocks of up to 24 rows — the pair
    schedule's 8-row blocks and blocked ones — the scale-only fold (``sfold``), 32-row and larger
    blocks none unless ``zfold=True`` (up to 32 rows); ``sfold=False`` puts them back on ``zfold``;
    the layer stays right in each case (kernel replaced by its jnp contract)."""
    cases = [(dict(schedule="pair"), (8, False, True)), (dict(schedule="pair", sfold=False), (8, True, False)),
             (dict(block_m=16), (16, False, True)), (dict(block_m=16, sfold=False), (16, True, False)),
             (dict(block_m=24), (24, False, True)), (dict(block_m=24, zfold=False), (24, False, False)),
             (dict(block_m=32), (32, False, False)), (dict(block_m=32, zfold=True), (32, False, True)),
             (dict(block_m=48, zfold=True), (48, False, False))]
    _check_layer_picks(monkeypatch, lambda kw: (kw["block_m"], kw.get("zfold", False), kw.get("sfold", False)),
                       [(over, [want, want]) for over, want in cases], 6, 256, 256)


def test_fused_moe_wgmma_cluster_picks_cpu(monkeypatch):
    """The layer's ``cluster`` option reaches each GEMM that runs the plain kernel or ``ws`` and
    whose column tiles and row tile split evenly (here GEMM1: N = 512, 4 tiles of 128 or 2 ``ws``
    tiles of 256; GEMM2: N = 256, 2 or 1; both K = 256, 256-deep steps), and no other: not by
    default, not clusters of 4 over GEMM2's 2 tiles or a 24-row tile, not GEMM2's one ``ws`` tile,
    not 40-row ``ws`` blocks (5 row tiles), not ``zfold``; the layer stays right (kernel replaced
    by its jnp contract); ``cluster=3`` is a ConfigError."""
    import pallas_kernels.wgmma_w4a16 as wgm

    cases = [(dict(block_m=16), [1, 1]), (dict(block_m=16, cluster=2), [2, 2]),
             (dict(schedule="pair", cluster=2), [2, 2]), (dict(block_m=24, cluster=2), [2, 2]),
             (dict(block_m=16, cluster=4), [4, 1]), (dict(block_m=24, cluster=4), [1, 1]),
             (dict(block_m=64, cluster=2), [2, 1]), (dict(block_m=32, cluster=2, ws=True), [2, 1]),
             (dict(block_m=40, cluster=2, ws=True), [1, 1]), (dict(block_m=16, cluster=2, zfold=True, sfold=False),
                                                              [1, 1])]
    _check_layer_picks(monkeypatch, lambda kw: kw.get("cluster", 1), cases, 6, 256, 256, close=(1, 4))
    w, x, tw, ids, _ = _layer_case(np.random.default_rng(), WGMMA_SCHEMES["awq_g128"], 6, 256, 256, 4, 2)
    wg = wgm.convert_wgmma(w.to_jax())
    with pytest.raises(ConfigError, match="cluster: expected 1, 2 or 4"):
        wgm.fused_moe_wgmma(x, tw, ids, wg, cluster=3)
    with pytest.raises(ConfigError, match="block_n: expected 64 or 128 .* got 256"):
        wgm.fused_moe_wgmma(x, tw, ids, wg, block_n=256)


def test_fused_moe_wgmma_clusters_lower_at_table_shapes():
    """The layer with ``cluster=2`` at two of the benchmark's rows, abstract weights of the real
    sizes: Mixtral 64 tokens (24-row blocks: the plain fold kernels, rows made K-block-major) and
    Qwen3 512 tokens (48-row blocks: the chained ``ws`` stream) lower to Mosaic GPU kernels
    launched in clusters (their programs ask for their cluster position), and without the option
    nothing does."""
    from pallas_kernels.wgmma_w4a16 import WgmmaWeights, fused_moe_wgmma

    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for (e, k, h, i), t in (((8, 2, 4096, 14336), 64), ((128, 8, 2048, 768), 512)):
        w = WgmmaWeights(s((e, 2 * i, h // 4), jnp.int16), s((e, h, i // 4), jnp.int16), s((e, h // 128, 2 * i), bf),
                         s((e, i // 128, h), bf), s((e, h // 128, 2 * i), bf), s((e, i // 128, h), bf),
                         hidden_size=h, intermediate_size=i, w13_interleaved=True)
        args = (s((t, h), bf), s((t, k), jnp.float32), s((t, k), jnp.int32), w)
        for cl in (1, 2):
            text = jax.jit(functools.partial(fused_moe_wgmma, cluster=cl)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text and ("cluster_block_id" in text) == (cl == 2), (e, t, cl)


def test_fused_moe_wgmma_ws_fold_cpu(monkeypatch):
    """``ws=True`` given (v24) puts the scale-only fold GEMMs (blocks of up to FOLD_ROWS rows) on
    the kernel's ``ws`` with ``sfold``, 64- or 128-column warpgroups, never clustered; by default
    and with ``zfold`` they keep the plain kernel; the layer stays right (kernels replaced by
    their jnp contracts)."""
    pick = lambda kw: (kw["ws"], kw["sfold"], kw.get("cluster", 1), kw["block_n"])     # noqa: E731
    cases = [(dict(block_m=16, ws=True), [(True, True, 1, 128)] * 2),
             (dict(block_m=24, ws=True, block_n=64), [(True, True, 1, 64)] * 2),
             (dict(block_m=16, ws=1, cluster=2), [(True, True, 1, 128)] * 2),
             (dict(block_m=16), [(False, True, 1, 128)] * 2),
             (dict(block_m=16, ws=True, zfold=True, sfold=False), [(False, False, 1, 128)] * 2)]
    _check_layer_picks(monkeypatch, pick, cases, 6, 256, 256, close=(0, 1, 4))


def test_fused_moe_wgmma_ws_defaults_cpu(monkeypatch):
    """Which GEMMs are warp-specialized by default, and at what depth (docs/journal/notes.md v12): 64-row blocks
    and up always; 32- to 63-row blocks only where a program streams 32 or more K-blocks (here
    GEMM1 over H = 4096, also in 128-deep steps), else no ``ws`` and 2 stages (two programs per
    SM; since v15 those with 2+ steps run as the chained ``ws`` stream by default, see
    ``test_fused_moe_wgmma_ws_stream_default_cpu``); an explicit ``ws=False`` keeps the stage rule
    of the blocks without it; since v25 the 24-row scale-only fold blocks streaming 32+ K-blocks
    too, unless ``cluster`` is asked for; the layer stays right."""
    # GEMM1: K = 4096, 16 steps of 256 (its ws programs fitted to shared memory at 3 stages); GEMM2:
    # K = 256, one step (32-row blocks keep the rule of decode blocks: 4 stages below 8 steps); in
    # 128-deep steps GEMM2's two steps take the ws stream unless persistent=False
    cases = [(dict(block_m=48), [(True, 3), (False, 2)]), (dict(block_m=64), [(True, 3), (True, 4)]),
             (dict(block_m=32), [(True, 2), (False, 4)]), (dict(block_m=48, ws=False), [(False, 4), (False, 4)]),
             (dict(block_m=48, stages=3), [(True, 3), (False, 3)]),
             (dict(block_m=48, wide=False, persistent=False), [(True, 4), (False, 2)]),
             (dict(block_m=48, wide=False), [(True, 4), (True, 2)]),
             # v25: the 24-row scale-only fold blocks too where a program streams 32+ K-blocks (GEMM1 here),
             # not 16-row ones, not without the scale-only fold, not ws=False
             (dict(block_m=24), [(True, 2), (False, 4)]), (dict(block_m=16), [(False, 2), (False, 4)]),
             (dict(block_m=24, sfold=False), [(False, 2), (False, 4)]),
             (dict(block_m=24, ws=False), [(False, 2), (False, 4)]),
             (dict(block_m=24, cluster=2), [(False, 2), (False, 4)])]      # a cluster asked for: the plain kernel
    _check_layer_picks(monkeypatch, lambda kw: (kw["ws"], kw["stages"]), cases, 4, 4096, 256, close={0, 6, 7})


def test_fused_moe_wgmma_ws_stream_default_cpu(monkeypatch):
    """v15's default for medium blocks (33–63 rows) whose short K streams keep them off ``ws``:
    the chained ``ws`` stream (``persistent`` and ``ws``), its ring the deepest of 4 that fits and
    divides an item's steps, with the router weights moved from GEMM2's epilogue to XLA. Not with
    ``persistent=False`` (the v12 form: no ``ws``, 2 stages, two programs per SM), an explicit
    ``weight_in_gemm2=True`` (GEMM2 keeps its row scales, so it keeps the v12 form), ``ws=False``,
    at 32 or 64 rows, or where an item is one step; a pair sets the two GEMMs apart; the layer
    stays right (kernel replaced by its jnp contract), with biases and an expert map too; a bad
    ``persistent`` is a ConfigError."""
    from pallas_kernels.wgmma_w4a16 import TRANSPOSED_STORE

    def pick(kw):
        return kw["persistent"], kw["ws"], kw["stages"], kw.get("row_scale") is not None
    # H = 1024: GEMM1 8 K-blocks, 4 steps of 256 (4 stages do not fit with ws at 48 rows, 3 do not
    # divide 4: 2); I = 512: GEMM2 4 K-blocks, 2 steps (in 128-deep steps: 8 and 4 steps)
    stream, v12 = (True, True, 2, False), (False, False, 2, False)
    cases = [(dict(block_m=48), [stream, stream]),
             (dict(block_m=48, persistent=False), [v12, (False, False, 2, True)]),
             (dict(block_m=48, weight_in_gemm2=True), [stream, (False, False, 2, True)]),
             (dict(block_m=48, ws=False), [(False, False, 4, False), (False, False, 4, True)]),
             (dict(block_m=48, wide=False), [(True, True, 4, False), (True, True, 4, False)]),
             (dict(block_m=32), [(False, False, 4, False), (False, False, 4, True)]),
             (dict(block_m=64), [(False, True, 3, False), (False, True, 4, True)]),
             (dict(block_m=48, split2=2), [stream, (False, False, 2, True)]),
             # one value per GEMM
             (dict(block_m=48, persistent=(False, None)), [v12, stream]),
             (dict(block_m=48, persistent=(None, False)), [stream, (False, False, 2, True)]),
             # GEMM2's 2-step items at 64 rows: 3 stages fit, 2 with the output tile (jax >= 0.11)
             (dict(block_m=64, persistent=(None, True), weight_in_gemm2=False),
              [(False, True, 3, False), (True, True, 2 if TRANSPOSED_STORE else 3, False)])]
    # the numbers where the glue differs: the router weights left to XLA (the stream), in GEMM2 (v12)
    _check_layer_picks(monkeypatch, pick, cases, 4, 1024, 512, close={0, 1})
    # with biases (w13's keeps the activation out of GEMM1) and an expert map: the router weights
    # GEMM2 leaves to XLA still scale its bias, as in the reference
    import pallas_kernels.wgmma_w4a16 as wgm

    seen = []

    def spy(*args, **kw):
        seen.append(pick(kw))
        return _emulated_wgmma_gemm(*args, **kw)

    _emulate_kernels(monkeypatch, wgm, spy)
    rng = np.random.default_rng()
    w, x, tw, ids, em = _layer_case(rng, WGMMA_SCHEMES["gptq4_g128_actorder"], 4, 1024, 512, 24, 2, bias=True,
                                    map_=True)
    got = jax.jit(functools.partial(wgm.fused_moe_wgmma, block_m=48))(x, tw, ids, wgm.convert_wgmma(w.to_jax()),
                                                                       expert_map=em)
    assert seen == [stream, stream], seen
    _layer_close(got, _reference(w, x, tw, ids, em), what="ws stream default, biases and an expert map")
    for bad in ((True,), (None, True, False), 2, "gemm2"):
        with pytest.raises(ConfigError, match="persistent"):
            wgm.fused_moe_wgmma(x, tw, ids, wgm.convert_wgmma(w.to_jax()), expert_map=em, persistent=bad)


def test_fused_moe_wgmma_split_defaults_cpu(monkeypatch):
    """GEMM2's K split by default on an H200's 132 SMs (v16): the blocked schedule's GEMM2 in fold
    blocks (up to 16 rows) runs unsplit, its output 16-bit and, with jax >= 0.11, ``[M, N]``
    tiles (``tout``, 8-row blocks too) — v14–v15 split it to about 4 programs per SM (here 2 of
    its 8 steps); a given ``split2`` still splits (float32 partials, no ``tout``); 32-row blocks
    keep about 2 programs per SM; GEMM1 keeps its rule; the layer stays right (kernel replaced by
    its jnp contract)."""
    import pallas_kernels.wna16_grouped_gemm as gg
    from pallas_kernels.wgmma_w4a16 import TRANSPOSED_STORE as tr

    monkeypatch.setattr(gg, "num_sms", lambda: 132)

    def pick(kw):
        return kw["block_m"], kw["split_k"], jnp.dtype(kw["out_dtype"]).name, kw["tout"]
    # H = I = 2048: 8 steps of 256 per GEMM, few tiles (4 experts, 24 tokens)
    cases = [(dict(block_m=8), [(8, 1, "bfloat16", tr), (8, 1, "bfloat16", tr)]),
             (dict(block_m=16), [(16, 2, "float32", False), (16, 1, "bfloat16", tr)]),
             (dict(block_m=8, split2=2), [(8, 1, "bfloat16", tr), (8, 2, "float32", False)]),
             (dict(block_m=8, tout=False), [(8, 1, "bfloat16", False), (8, 1, "bfloat16", False)]),
             (dict(block_m=32), [(32, 2, "float32", False), (32, 2, "float32", False)])]
    _check_layer_picks(monkeypatch, pick, cases, 4, 2048, 2048, close={0})


def test_fused_moe_wgmma_persistent_cpu(monkeypatch):
    """``persistent=True`` reaches every GEMM without ``overlap`` or ``zfold`` (K splits and the
    scale-only fold take it); with ``ws`` where ``ws`` applies and the GEMM has neither row scales
    nor destination rows (the chained warp-specialized stream, v14: GEMM1 at 128-row blocks, and
    GEMM2 too once the router weights leave it), else without; the layer stays right (kernel
    replaced by its jnp contract; the kernel itself is lowered in
    ``test_wgmma_kernel_lowers_to_mosaic_gpu``)."""
    one = dict(persistent=True, split1=1, split2=1)
    cases = [(dict(block_m=48, **one), [(True, True), (True, False)]),     # GEMM1: ws by default (32 K-blocks)
             (dict(block_m=128, **one), [(True, True), (True, False)]),
             (dict(block_m=128, weight_in_gemm2=False, **one), [(True, True)] * 2),
             (dict(block_m=48, ws=True, weight_in_gemm2=False, **one), [(True, True)] * 2),
             (dict(block_m=48, persistent=True, split1=2, split2=1), [(True, False)] * 2),
             (dict(schedule="pair", persistent=True, split1=2, split2=2), [(True, False)] * 2),
             (dict(block_m=16, **one), [(True, False)] * 2),
             (dict(block_m=16, sfold=False, **one), [(False, False)] * 2),
             (dict(block_m=64, overlap=True, **one), [(False, False)] * 2),
             (dict(block_m=128, split1=1, split2=1), [(False, True)] * 2)]
    _check_layer_picks(monkeypatch, lambda kw: (kw["persistent"], kw["ws"]), cases, 4, 4096, 256, close={0, 2, 5})
    # the stream's ring depth divides an item's steps: GEMM1's 16 steps of 256 at 48 rows fit 3 stages
    # with ws, so 2; stages=4 given: 4 would not fit, 3 does not divide 16, so 2 again
    cases = [(dict(block_m=48, **one), [(True, True, 2), (True, False, 2)]),
             (dict(block_m=48, stages=4, **one), [(True, True, 2), (True, False, 4)])]
    _check_layer_picks(monkeypatch, lambda kw: (kw["persistent"], kw["ws"], kw["stages"]), cases, 4, 4096, 256,
                       close=())


@pytest.mark.parametrize("schedule", ["pair", "blocked"])
@pytest.mark.parametrize("static", [True, False])
def test_fused_moe_wgmma_invalid_ids_cpu(monkeypatch, schedule, static):
    """An out-of-range expert id in any top-k slot (not only the first) gives its token a NaN row;
    the other tokens match the float64 reference (kernel replaced by its jnp contract)."""
    import pallas_kernels.wgmma_w4a16 as wgm

    _emulate_kernels(monkeypatch, wgm, _emulated_wgmma_gemm)
    rng = np.random.default_rng()
    w, x, tw, ids, _ = _layer_case(rng, WGMMA_SCHEMES["awq_g128"], 6, 256, 256, 5, 3)
    bad_at = {1: (1, 6), 3: (2, -1)}                    # token: (slot, id) — past the experts, negative
    for tok, (slot, bad_id) in bad_at.items():
        ids = ids.at[tok, slot].set(bad_id)
    got = np.asarray(jax.jit(functools.partial(wgm.fused_moe_wgmma, schedule=schedule, static_sums=static))(
        x, tw, ids, wgm.convert_wgmma(w.to_jax())).astype(jnp.float32), np.float64)
    ok = [t for t in range(5) if t not in bad_at]
    assert np.isnan(got[list(bad_at)]).all()
    ref = _reference(w, x[np.asarray(ok)], tw[np.asarray(ok)], ids[np.asarray(ok)], None)
    _layer_close(got[ok], ref, what=f"valid tokens, {schedule}")


@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_fused_moe_wgmma_gated_cpu(monkeypatch, key):
    """GEMM1's gated epilogue (the default without a K split) and the unfused path on the same
    interleaved weights (XLA restores the column order), both activations, pair and blocked
    schedules, against the float64 reference; a w13 bias turns the fusion off and stays correct."""
    import pallas_kernels.wgmma_w4a16 as wgm

    seen = []

    def spy(*args, **kw):
        seen.append(kw.get("gated"))
        return _emulated_wgmma_gemm(*args, **kw)

    _emulate_kernels(monkeypatch, wgm, spy)
    rng = np.random.default_rng()
    for t, act, bias, schedule in ((2, "silu", False, "pair"), (24, "gelu_tanh", False, "blocked"),
                                   (24, "silu", True, "blocked")):
        w, x, tw, ids, _ = _layer_case(rng, WGMMA_SCHEMES[key], 6, 256, 384, t, 2, bias=bias)
        wg = wgm.convert_wgmma(w.to_jax())
        assert wg.w13_interleaved and wg.w13_words.shape[1] == 768
        ref = _reference(w, x, tw, ids, None, activation=act, on_input=False)
        for fuse in (None, False):
            seen.clear()
            got = jax.jit(functools.partial(wgm.fused_moe_wgmma, activation=act, split1=1, split2=1,
                                            schedule=schedule, fuse_act=fuse))(x, tw, ids, wg)
            assert seen[0] == (act if fuse is None and not bias else None), (seen, fuse, bias)
            _layer_close(got, ref, what=f"{act} fuse_act={fuse} bias={bias} {schedule}")


def test_wgmma_block_m():
    """Block rows per shape: the fewest expected blocks below 128 rows (the measured decode choices
    of docs/journal/notes.md v9), blocks sized to the binomial spread of an expert's rows at prefill (docs/journal/notes.md v10);
    the expected block count against a simulation of uniform routing."""
    from pallas_kernels.wgmma_w4a16 import expected_blocks, wgmma_block_m

    # v17: 24 rows (FOLD_ROWS) where a 32-row pick needs at most 3% fewer blocks (Mixtral 64 tokens,
    # Qwen3 256, DeepSeek-V2-Lite 128); 32 rows stay at Mixtral 80 tokens (8.0 blocks against 9.1)
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


def _emulated_decode_layer(a, experts, w13, s13, z13, w2, s2, z2, *, activation="silu", **_):
    """``wgmma_decode_layer``'s contract in jnp: the gated GEMM1 of 8-row pair blocks, rounded to
    the activation dtype, then GEMM2, rounded once (zero blocks for expert -1)."""
    g1, g2 = (128 if s13.shape[1] > 1 else -1), (128 if s2.shape[1] > 1 else -1)
    h = _emulated_wgmma_gemm(a, experts, w13, s13, z13, block_m=8, group_size=g1, block_n=128, gated=activation,
                             out_dtype=a.dtype)[0]
    return _emulated_wgmma_gemm(h, experts, w2, s2, z2, block_m=8, group_size=g2, out_dtype=a.dtype)[0]


@pytest.mark.parametrize("key", ["awq_g128", "gptq4_channel"])
def test_fused_moe_wgmma_one_kernel_cpu(monkeypatch, key):
    """The layer's glue around the one-kernel decode layer (``one_kernel=True``: rows spread into
    8-row pair blocks, the kernel, row 0 of each block times the router weight, the top-k sum) with
    the kernel replaced by its jnp contract, against the float64 reference — 1 and 2 tokens, an
    expert map that leaves pairs without a local expert, both gated activations; where it does not
    apply it says why."""
    import pallas_kernels.wgmma_decode as wgd
    import pallas_kernels.wgmma_w4a16 as wgm

    calls = []

    def spy(*args, **kw):
        calls.append(kw)
        return _emulated_decode_layer(*args, **kw)

    monkeypatch.setattr(wgd, "wgmma_decode_layer", spy)
    monkeypatch.setattr(wgm, "TRANSPOSED_STORE", True)           # the kernel itself needs jax >= 0.11
    rng = np.random.default_rng()
    for t, act, map_ in ((1, "silu", False), (2, "gelu_tanh", True), (1, "silu", True)):
        for _ in range(100):           # with the map: some pairs on local experts and some on none
            w, x, tw, ids, em = _layer_case(rng, WGMMA_SCHEMES[key], 8, 256, 384, t, 2, map_=map_)
            local = None if em is None else np.asarray(em)[np.asarray(ids)]
            if local is None or ((local >= 0).any() and (local < 0).any()):
                break
        assert local is None or ((local >= 0).any() and (local < 0).any())
        wg = wgm.convert_wgmma(w.to_jax())
        calls.clear()
        got = jax.jit(functools.partial(wgm.fused_moe_wgmma, activation=act, one_kernel=True))(x, tw, ids, wg,
                                                                                              expert_map=em)
        assert len(calls) == 1 and calls[0]["activation"] == act
        _layer_close(got, _reference(w, x, tw, ids, em, activation=act), what=f"one_kernel {act} T={t}")
    w, x, tw, ids, _ = _layer_case(rng, WGMMA_SCHEMES[key], 8, 256, 384, 1, 2, bias=True)
    with pytest.raises(ConfigError, match="one_kernel=True.*not fused"):              # a w13 bias
        wgm.fused_moe_wgmma(x, tw, ids, wgm.convert_wgmma(w.to_jax()), one_kernel=True)
    w, x, tw, ids, _ = _layer_case(rng, WGMMA_SCHEMES[key], 8, 256, 384, 1, 2)
    wg = wgm.convert_wgmma(w.to_jax())
    with pytest.raises(ConfigError, match="one_kernel=True.*pair"):
        wgm.fused_moe_wgmma(x, tw, ids, wg, one_kernel=True, block_m=8)
    with pytest.raises(ConfigError, match="one_kernel=True.*not fused"):
        wgm.fused_moe_wgmma(x, tw, ids, wg, one_kernel=True, apply_router_weight_on_input=True)
    w, x, tw, ids, _ = _layer_case(rng, WGMMA_SCHEMES["gptq4_g128_actorder"], 8, 256, 384, 1, 2)
    with pytest.raises(ConfigError, match="one_kernel=True.*act-order"):
        wgm.fused_moe_wgmma(x, tw, ids, wgm.convert_wgmma(w.to_jax()), one_kernel=True)


def test_wgmma_decode_layer_lowers_and_checks():
    """The one-kernel decode layer lowers to Mosaic GPU (jax >= 0.11; group 128 and channelwise,
    with and without zero points, 256- and 128-deep steps) and rejects bad operands by name."""
    from pallas_kernels.wgmma_decode import decode_layer_smem_bytes, wgmma_decode_layer
    from pallas_kernels.wgmma_w4a16 import SMEM_LIMIT, TRANSPOSED_STORE

    s = jax.ShapeDtypeStruct
    e, h, i, p = 4, 512, 384, 3

    def args(g1=4, g2=3, zp=True, dt=jnp.bfloat16, i=i, p=p):
        return (s((p * 8, h), dt), s((p,), jnp.int32), s((e, 2 * i, h // 4), jnp.int16), s((e, g1, 2 * i), dt),
                s((e, g1, 2 * i), dt) if zp else None, s((e, h, i // 4), jnp.int16), s((e, g2, h), dt),
                s((e, g2, h), dt) if zp else None)

    def lower(a, **kw):
        return jax.jit(functools.partial(wgmma_decode_layer, **kw)).trace(*a).lower(lowering_platforms=("cuda",))

    if TRANSPOSED_STORE:
        for a, kw in ((args(), {}), (args(1, 1, zp=False, dt=jnp.float16), dict(activation="gelu_tanh")),
                      (args(4, 1), dict(programs=7, stages=2))):
            assert "mosaic_gpu" in lower(a, **kw).as_text()
    else:
        with pytest.raises(ConfigError, match="jax >= 0.11"):
            lower(args())
    bad = [((args()[0].update(dtype=jnp.float32),) + args()[1:], DTypeError, "a: expected"),
           (args()[:1] + (s((p + 1,), jnp.int32),) + args()[2:], ShapeError, "experts"),
           (args()[:2] + (s((e, 2 * i, h // 8), jnp.int32),) + args()[3:], ShapeError, "w13_words"),
           (args()[:6] + (s((e, 2, h), jnp.bfloat16),) + args()[7:], ShapeError, "w2_scales"),
           (args()[:4] + (s((e, 4, 2 * i), jnp.float16),) + args()[5:], DTypeError, "w13_zeros"),
           (args()[:7] + (None,), ConfigError, "both GEMMs")]
    for a, err, msg in bad:
        with pytest.raises(err, match=msg):
            lower(a)
    with pytest.raises(ConfigError, match="activation"):
        lower(args(), activation="relu")
    big = (s((p * 8, 4096), jnp.bfloat16), args()[1], s((e, 2 * i, 1024), jnp.int16), s((e, 32, 2 * i), jnp.bfloat16),
           s((e, 32, 2 * i), jnp.bfloat16), s((e, 4096, i // 4), jnp.int16), s((e, 3, 4096), jnp.bfloat16),
           s((e, 3, 4096), jnp.bfloat16))                  # H = 4096: 16 steps of 256 in GEMM1
    with pytest.raises(ConfigError, match="shared memory"):
        lower(big, stages=12)
    assert decode_layer_smem_bytes(kpb1=2, kpb2=2, stages1=4, stages2=4, num_pairs=8) <= SMEM_LIMIT


def test_fused_moe_wgmma_kernel_options_cpu(monkeypatch):
    """The per-GEMM kernel options the wgmma layer picks (the measured defaults of docs/journal/notes.md v6):
    2 stages for blocks of up to 32 rows streaming >= 8 steps, else 4; a fold only up to 16 rows
    unless forced (then up to 32), scale-only (``sfold``) unless ``sfold=False`` (v12); wide below
    128-row blocks, and then 2 stages; overlap never with a fold; ws (docs/journal/notes.md v7, v12) from 64
    rows, and from 32 rows for streams of 32+ K-blocks, where the columns split into 2·block_n,
    never with overlap or ``zfold``, with the scale-only fold only when ``ws=True`` is given (v24);
    explicit options win."""
    import pallas_kernels.wgmma_w4a16 as wgm

    calls = []

    def spy(*args, **kw):
        calls.append((args[0].shape[1], kw))
        return _emulated_wgmma_gemm(*args, **kw)

    _emulate_kernels(monkeypatch, wgm, spy)
    rng = np.random.default_rng()
    w, x, tw, ids, _ = _layer_case(rng, WGMMA_SCHEMES["awq_g128"], 2, 2048, 128, 8, 2)
    wg = wgm.convert_wgmma(w.to_jax())

    def picks(**over):
        calls.clear()
        over = {"split1": 1, "split2": 1, **over}
        jax.jit(functools.partial(wgm.fused_moe_wgmma, **over)).trace(x, tw, ids, wg)
        return {k: dict(kw) for k, kw in calls}       # K → options (GEMM1: K = 2048, GEMM2: K = 128)

    def opts(o, *names):
        return tuple(o[n] for n in names)

    names = ("block_m", "stages", "kpb", "wide", "zfold", "overlap", "ws")
    assert picks(block_m=128, ws=True)[2048]["ws"] and not picks(block_m=8)[2048]["ws"]    # folds: no ws by default,
    assert picks(block_m=8, ws=True)[2048]["ws"] and picks(block_m=8, ws=True)[2048]["sfold"]   # ws=True: the scale
    assert not picks(block_m=8, ws=True, zfold=True, sfold=False)[2048]["ws"]        # fold on ws (v24), zfold never
    assert not picks(block_m=64, ws=True, overlap=True)[2048]["ws"]
    assert not picks(block_m=128, ws=False)[2048]["ws"] and not picks(block_m=16, zfold=False)[2048]["ws"]
    tr = wgm.TRANSPOSED_STORE                                      # tout: jax >= 0.11 only
    o = picks(block_m=32)[2048]                                    # no K split: bf16 out, [M, N] tiles
    assert o["out_dtype"] == jnp.bfloat16 and o["tout"] == tr and not picks(block_m=32, tout=False)[2048]["tout"]
    o = picks(block_m=128)[2048]                                   # 128 rows: tout with one stage fewer
    assert o["out_dtype"] == jnp.bfloat16 and o["tout"] == tr and o["stages"] == (3 if tr else 4)
    o = picks(block_m=128, tout=False)[2048]
    assert not o["tout"] and o["stages"] == 4
    o = picks(block_m=128, wide=True, tout=True)[2048]             # 2 stages of 256-deep steps: no room
    assert o["kpb"] == 2 and o["stages"] == 2 and not o["tout"]
    o = picks(block_m=8, split1=1)[2048]                           # 8-row blocks too since v16
    assert o["out_dtype"] == jnp.bfloat16 and o["tout"] == tr and not picks(block_m=8, split1=1, tout=False)[2048]["tout"]
    o = picks(block_m=8, split1=4)[2048]                           # split partials stay float32
    assert o["split_k"] == 4 and o["out_dtype"] == jnp.float32 and not picks(block_m=8, split1=4, tout=True)[2048]["tout"]
    assert picks(block_m=32, out16=False)[2048]["out_dtype"] == jnp.float32 and not picks(block_m=32, out16=False)[2048]["tout"]
    assert (opts(picks(block_m=8, sfold=True)[2048], "zfold", "sfold", "overlap")
            == opts(picks(block_m=8, sfold=True)[128], "zfold", "sfold", "overlap") == (False, True, False))
    p = picks(block_m=8)
    assert opts(p[2048], *names) == (8, 2, 2, True, False, False, False)     # 16 K-blocks, 2 per step: 8 steps
    assert opts(p[128], *names) == (8, 4, 1, False, False, False, False)     # one K-block
    assert p[2048]["sfold"] and p[128]["sfold"]                              # the fold is scale-only (v12)
    # 32-row blocks: ws only for streams of 32+ K-blocks (v12), here 16 and 1
    assert opts(picks(block_m=32)[2048], *names) == (32, 2, 2, True, False, False, False)
    assert opts(picks(block_m=32)[128], *names) == (32, 4, 1, False, False, False, False)
    assert opts(picks(block_m=32, ws=True)[128], *names) == (32, 4, 1, False, False, False, True)   # N = 2048
    o = picks(block_m=32, zfold=True)[2048]
    assert opts(o, *names) == (32, 2, 2, True, False, False, False) and o["sfold"]
    assert opts(picks(block_m=32, zfold=True, sfold=False)[2048], *names) == (32, 2, 2, True, True, False, False)
    assert opts(picks(block_m=64, overlap=True)[2048], *names) == (64, 4, 2, True, False, True, False)
    assert opts(picks(block_m=128, tout=False)[2048], *names) == (128, 4, 1, False, False, False, True)
    assert opts(picks(block_m=128, wide=True)[2048], *names) == (128, 2, 2, True, False, False, True)
    o = picks(block_m=8, stages=3, overlap=True)[2048]                   # a fold: overlap stays off
    assert opts(o, *names) == (8, 3, 2, True, False, False, False) and o["sfold"]
    # 64-row blocks with 256-deep steps: 4 stages (288 KB with the output tile, part 16) do not fit
    # the 227 KB of shared memory: 3 for GEMM1; GEMM2 (one K-block: 128-deep steps) keeps 4
    o = picks(block_m=64)
    assert opts(o[2048], *names) == (64, 3, 2, True, False, False, True) and o[2048]["tout"] == tr
    assert opts(o[128], *names) == (64, 4, 1, False, False, False, True) and o[128]["tout"] == tr
    assert picks(block_m=64, stages=6)[2048]["stages"] == 3                 # explicit stages are fitted too
    for bm in (8, 16, 32, 64, 128):                                          # every pick fits
        for k_, kw in picks(block_m=bm).items():
            steps = k_ // 128 // kw["kpb"] // kw["split_k"]
            assert wgm.wgmma_smem_bytes(block_m=bm, block_n=kw["block_n"], kpb=kw["kpb"], n_blocks=1,
                                        stages=min(kw["stages"], steps), ws=kw["ws"], tout=kw["tout"],
                                        gated=kw["gated"] is not None, zfold=kw["zfold"]) <= wgm.SMEM_LIMIT, (bm, k_, kw)
    # 128-deep steps: 16 per program (DeepSeek-V2-Lite's odd K-block count takes this path)
    assert opts(picks(block_m=16, zfold=False, wide=False)[2048], *names) == (16, 2, 1, False, False, False, False)
    assert opts(picks(block_m=16, split1=4)[2048], *names) == (16, 4, 2, True, False, False, False)   # 2 steps, sfold
    # the gated epilogue: GEMM1 without a K split, 128-column tiles, weights in the gated order, no
    # w13 bias, the router weight not on the input, an activation the epilogue has
    assert wg.w13_interleaved
    for bm in (8, 32, 128):
        p = picks(block_m=bm)
        assert p[2048]["gated"] == "silu" and p[128]["gated"] is None
    assert picks(block_m=32, activation="gelu_tanh")[2048]["gated"] == "gelu_tanh"
    for over in (dict(split1=4), dict(fuse_act=False), dict(block_n=64), dict(apply_router_weight_on_input=True),
                 dict(activation="swigluoai"), dict(activation="gelu")):
        assert picks(block_m=32, **over)[2048]["gated"] is None, over


# ----------------------------------------------------------------------------- layer level


def _layer_case(rng, scheme, e, h, i, t, k, *, bias=False, map_=False):
    w = random_checkpoint_weights(rng, scheme, e, h, i, scale=0.05)
    if bias:          # about the size of the GEMM outputs they are added to, so a misplaced bias shows
        w = dataclasses.replace(w, w13_bias=(1.0 * rng.standard_normal((e, 2 * i))).astype(np.float16),
                                w2_bias=(3.0 * rng.standard_normal((e, h))).astype(np.float16))
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


def _reference(w, x, tw, ids, em, activation="silu", on_input=False):
    r13, r2 = dequant_checkpoint(w, w.scheme)
    b13 = None if w.w13_bias is None else np.asarray(w.w13_bias, np.float64)
    b2 = None if w.w2_bias is None else np.asarray(w.w2_bias, np.float64)
    return fused_moe_ref(np.asarray(x.astype(jnp.float32)), np.asarray(tw), np.asarray(ids), r13, r2, b13, b2,
                         activation=activation, expert_map=None if em is None else np.asarray(em),
                         on_input=on_input)


def _layer_close(got, ref, tol=1.5e-2, what=""):      # bf16 activations and bf16-rounded weights
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{what}: {np.isnan(got).sum()} NaN of {got.size}"
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= tol, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("key", sorted(SCHEMES))
@pytest.mark.parametrize("mode", ["pair", "blocked"])
def test_fused_moe_tiles_small(key, mode):
    rng = np.random.default_rng()
    w, x, tw, ids, em = _layer_case(rng, SCHEMES[key], 6, 256, 256, 3, 2)
    tiles = convert_tiles(w.to_jax())
    got = fused_moe_tiles(x, tw, ids, tiles, interpret=INTERPRET, poison_outputs=True, mode=mode, split1=2, split2=2)
    _layer_close(got, _reference(w, x, tw, ids, em))


@pytest.mark.parametrize("key", ["awq_g128", "gptq8_channel"])
@pytest.mark.parametrize("mode, dot", [("pair", "fma"), ("pair", "swap"), ("blocked", "swap")])
def test_fused_moe_tiles_dot_variants(key, mode, dot):
    rng = np.random.default_rng()
    w, x, tw, ids, em = _layer_case(rng, SCHEMES[key], 6, 256, 256, 3, 2, bias=True)
    tiles = convert_tiles(w.to_jax())
    got = fused_moe_tiles(x, tw, ids, tiles, interpret=INTERPRET, poison_outputs=True, mode=mode, dot=dot,
                          split1=2, split2=1)
    _layer_close(got, _reference(w, x, tw, ids, em))


@pytest.mark.parametrize("activation, bias, map_, on_input, split", [
    ("silu", True, True, False, 1),            # fused gated epilogue with bias, expert map
    ("gelu_tanh", False, False, True, 1),      # router weight on input inside the epilogue
    ("swigluoai", True, False, False, 1),      # not fused: XLA activation between the kernels
    ("gelu", False, True, True, 2)])
def test_fused_moe_tiles_epilogues(activation, bias, map_, on_input, split):
    rng = np.random.default_rng()
    w, x, tw, ids, em = _layer_case(rng, SCHEMES["awq_g128"], 5, 256, 128, 9 if on_input else 7,
                                    1 if on_input else 2, bias=bias, map_=map_)
    tiles = convert_tiles(w.to_jax())
    got = fused_moe_tiles(x, tw, ids, tiles, activation=activation, apply_router_weight_on_input=on_input,
                          expert_map=em, interpret=INTERPRET, poison_outputs=True, mode="blocked",
                          split1=split, split2=split)
    _layer_close(got, _reference(w, x, tw, ids, em, activation, on_input))


def test_blocked_mode_few_pairs_many_experts():
    """Fewer routed pairs than experts: the alignment pads at most min(N, E) runs, so the block
    bound must not exceed the aligned arrays (a shape bug once found only on the GPU)."""
    rng = np.random.default_rng()
    w, x, tw, ids, em = _layer_case(rng, SCHEMES["awq_g128"], 16, 256, 128, 1, 4)
    tiles = convert_tiles(w.to_jax())
    got = fused_moe_tiles(x, tw, ids, tiles, interpret=INTERPRET, poison_outputs=True, mode="blocked", block_m=16)
    _layer_close(got, _reference(w, x, tw, ids, em))
    assert max_blocks(4, 16, 16) * 16 <= routing.max_padded_size(4, 16, 16)


@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True)])
def test_batched_experts_tiles(activation, bias):
    """BATCHED_MARLIN's activation format on the engine, against the float64 reference."""
    from pallas_kernels.fused_moe_tiles import batched_experts_tiles

    rng = np.random.default_rng()
    w, x, tw, ids, _ = _layer_case(rng, SCHEMES["gptq4_g128_actorder"], 4, 256, 128, 6, 2, bias=bias)
    bt = routing.dispatch_batched(x, ids, 4, max_tokens_per_expert=8)
    y = batched_experts_tiles(bt.hidden_states, bt.expert_num_tokens, convert_tiles(w.to_jax()),
                              activation=activation, interpret=INTERPRET, poison_outputs=True)
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
    _layer_close(y, ref)


def test_tiles_decode_is_the_checkpoint():
    rng = np.random.default_rng()
    for scheme in (SCHEMES["gptq4_g128_actorder"], SCHEMES["ct4_asym_g32"]):
        w = random_checkpoint_weights(rng, scheme, 3, 256, 128).to_jax()
        t13, t2 = convert_tiles(w).dequantize(jnp.float32)
        r13, r2 = w.dequantize(jnp.float32)
        np.testing.assert_array_equal(np.asarray(t13), np.asarray(r13))
        np.testing.assert_array_equal(np.asarray(t2), np.asarray(r2))


def test_layer_and_backward_reject_bad_hidden_states():
    rng = np.random.default_rng()
    w, x, tw, ids, _ = _layer_case(rng, SCHEMES["awq_g128"], 4, 256, 128, 3, 2)
    tiles = convert_tiles(w.to_jax())
    g = jnp.zeros((3, 256), jnp.float32)
    for fn in (functools.partial(fused_moe_tiles, interpret=INTERPRET),
               functools.partial(fused_moe_tiles_bwd, g, interpret=INTERPRET)):
        with pytest.raises(ShapeError, match=r"hidden_states: expected shape \(3, 256\), got \(3, 128\)"):
            fn(x[:, :128], tw, ids, tiles)
        with pytest.raises(DTypeError, match="bfloat16 or float16, got float32"):
            fn(x.astype(jnp.float32), tw, ids, tiles)


def test_backward_matches_float64_gradient():
    """dx and d(topk_weights) from the transposed-access kernels against the float64 gradient of
    the reference (central differences would need float64 kernels: the reference is linear
    algebra, so its gradient is written out in float64 here)."""
    rng = np.random.default_rng()
    w, x, tw, ids, _ = _layer_case(rng, SCHEMES["gptq4_g128_actorder"], 4, 256, 128, 5, 2)
    tiles = convert_tiles(w.to_jax())
    g = rng.standard_normal((5, 256))
    dx, dtw = fused_moe_tiles_bwd(jnp.asarray(g, jnp.float32), x, tw, ids, tiles, interpret=INTERPRET,
                                  poison_outputs=True)
    r13, r2 = dequant_checkpoint(w, w.scheme)                       # [E, 2I, H], [E, H, I] float64
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    ids_np, tw_np = np.asarray(ids), np.asarray(tw, np.float64)
    rdx, rdtw = np.zeros_like(xf), np.zeros_like(tw_np)
    for t in range(5):
        for j in range(2):
            e = ids_np[t, j]
            h = r13[e] @ xf[t]
            gate, up = h[:128], h[128:]
            sig = 1 / (1 + np.exp(-gate))
            a = gate * sig * up
            y = r2[e] @ a
            rdtw[t, j] = g[t] @ y
            da = tw_np[t, j] * (r2[e].T @ g[t])
            dgate = da * up * (sig + gate * sig * (1 - sig))
            dup = da * gate * sig
            rdx[t] += r13[e].T @ np.concatenate([dgate, dup])
    _layer_close(dx, rdx, 2e-2)
    _layer_close(dtw, rdtw, 2e-2)


def test_refusals_and_reasons():
    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, QuantScheme("gptq", 4, 32, False), 2, 128, 96)
    assert "96" in tile_unsupported_reason(w)
    with pytest.raises(UnsupportedError, match="96"):
        convert_tiles(w)
    w = random_checkpoint_weights(rng, QuantScheme("awq", 4, 128, True), 2, 128, 128)
    tiles = convert_tiles(w.to_jax())
    assert "float32" in engine_unsupported_reason(tiles, jnp.float32)
    x = jnp.zeros((2, 128), jnp.float32)
    with pytest.raises(DTypeError, match="bfloat16"):
        fused_moe_tiles(x, jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32), tiles, interpret=True)
    with pytest.raises(ValueError, match="split_k"):
        grouped_gemm(jnp.zeros((16, 128), jnp.bfloat16), jnp.zeros((1,), jnp.int32), tiles.w13_qweight,
                     tiles.w13_scales, bits=4, group_size=128, block_m=16, split_k=2, interpret=True)
    with pytest.raises(ValueError, match="interpret"):
        grouped_gemm(jnp.zeros((16, 128), jnp.bfloat16), jnp.zeros((1,), jnp.int32), tiles.w13_qweight,
                     tiles.w13_scales, bits=4, group_size=128, block_m=16, dequant="asm", interpret=True)
    assert "8-bit" in asm_supported(8, 128, jnp.bfloat16) and "float32" in asm_supported(4, 128, jnp.float32)


def test_choose_config_modes():
    rng = np.random.default_rng()
    tiles = convert_tiles(random_checkpoint_weights(rng, QuantScheme("awq", 4, 128, True), 16, 256, 256).to_jax())
    assert choose_config(1, 2, tiles).mode == "pair"
    cfg = choose_config(512, 2, tiles)
    assert cfg.mode == "blocked" and cfg.block_m >= 64 and cfg.dot == "swap"
    assert choose_config(16, 2, tiles).dot == "mma"
    assert choose_config(32, 2, tiles, block_m=64).dot == "swap"     # by block height, not token count
    assert isinstance(cfg, EngineConfig)
    with pytest.raises(ValueError, match="mode"):
        choose_config(1, 2, tiles, mode="nope")
    # the Triton lowering takes power-of-two blocks only: vLLM's rule (48 here) is rounded up
    assert choose_config(256, 2, tiles).block_m == 64 and choose_config(8, 2, tiles, mode="blocked", block_m=24).block_m == 32


# ----------------------------------------------------------------------------- dispatch


def test_dispatch_on_cpu_uses_xla_with_reason():
    from wna16_jax.moe import fused_moe, select_executor

    rng = np.random.default_rng()
    w = random_checkpoint_weights(rng, QuantScheme("awq", 4, 128, True), 4, 256, 128)
    tiles = convert_tiles(w.to_jax())
    if not ON_GPU:
        which, reason = select_executor(tiles, jnp.bfloat16)
        assert which == "xla" and "NVIDIA GPU" in reason
        with pytest.raises(UnsupportedError, match="NVIDIA GPU"):
            select_executor(tiles, jnp.bfloat16, executor="pallas")
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((3, 4)), jnp.float32), 2, renormalize=True)
    from wna16_jax.moe import EngineFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)   # none off-GPU, none on the engine
        got = fused_moe(x, tw, ids, tiles)
    _layer_close(got, _reference(w, x, tw, ids, None))


def test_table_prepares_wgmma_layout_for_hopper(monkeypatch):
    """MARLIN on a Hopper GPU prepares the wgmma layout for the 4-bit layers the wgmma kernels
    take, the tile layout otherwise (with the reason), ``WNA16_JAX_GPU_KERNELS`` overrides; a
    wgmma-layout layer off Hopper falls back to XLA with a reason and stays exact."""
    from pallas_kernels.fused_moe_tiles import TileWeights
    from pallas_kernels.wgmma_w4a16 import WgmmaWeights
    from wna16_jax import moe
    from wna16_jax.backends import TABLE, Backend, Device

    rng = np.random.default_rng()
    h200, a100, b200 = Device("gpu", "H200", (9, 0)), Device("gpu", "A100", (8, 0)), Device("gpu", "B200", (10, 0))
    marlin, batched = TABLE[Backend.MARLIN], TABLE[Backend.BATCHED_MARLIN]
    w4, x, tw, ids, _ = _layer_case(rng, SCHEMES["awq_g128"], 4, 256, 128, 5, 2)
    w8 = random_checkpoint_weights(rng, SCHEMES["gptq8_channel"], 4, 256, 128)
    w64 = random_checkpoint_weights(rng, SCHEMES["gptq4_g64"], 4, 256, 128)
    assert marlin.wgmma_reason(w4, h200) is None
    assert "SM90" in marlin.wgmma_reason(w4, a100) and "SM90" in marlin.wgmma_reason(w4, b200)
    assert "8-bit" in marlin.wgmma_reason(w8, h200) and "group size 64" in marlin.wgmma_reason(w64, h200)
    assert "batched" in batched.wgmma_reason(w4, h200)
    wg = marlin.prepare(w4.scheme, w4.to_jax(), device=h200)
    assert isinstance(wg, WgmmaWeights) and wg.w13_scales.dtype == jnp.bfloat16
    assert marlin.prepare(w4.scheme, w4.to_jax(), jnp.float16, device=h200).w13_scales.dtype == jnp.float16
    for other, dev in ((w8, h200), (w64, h200), (w4, a100)):
        assert isinstance(marlin.prepare(other.scheme, other.to_jax(), device=dev), TileWeights)
    assert isinstance(batched.prepare(w4.scheme, w4.to_jax(), device=h200), TileWeights)
    monkeypatch.setenv("WNA16_JAX_GPU_KERNELS", "triton")
    assert isinstance(marlin.prepare(w4.scheme, w4.to_jax(), device=h200), TileWeights)
    monkeypatch.setenv("WNA16_JAX_GPU_KERNELS", "wgmma")
    with pytest.raises(UnsupportedError, match="8-bit"):
        marlin.prepare(w8.scheme, w8.to_jax(), device=h200)
    monkeypatch.setenv("WNA16_JAX_GPU_KERNELS", "fastest")
    with pytest.raises(ConfigError, match="WNA16_JAX_GPU_KERNELS"):
        marlin.wgmma_reason(w4, h200)
    monkeypatch.delenv("WNA16_JAX_GPU_KERNELS")
    # the wgmma layout is exactly the checkpoint, and its tile view is the tile conversion
    np.testing.assert_array_equal(np.asarray(convert_tiles(wg).w13_qweight),
                                  np.asarray(convert_tiles(w4.to_jax()).w13_qweight))
    # off Hopper the layer goes to the XLA executor, with the reason
    monkeypatch.setattr(Device, "current", classmethod(lambda cls, d=None: a100))
    assert "SM90" in moe.engine_reason(wg, jnp.bfloat16, platform="gpu")
    monkeypatch.setattr(Device, "current", classmethod(lambda cls, d=None: h200))
    assert moe.engine_reason(wg, jnp.bfloat16, platform="gpu") is None
    assert "float32" in moe.engine_reason(wg, jnp.float32, platform="gpu")
    monkeypatch.undo()
    if not ON_GPU:
        assert moe.select_executor(wg, jnp.bfloat16)[0] == "xla"
        _layer_close(jax.jit(moe.fused_moe)(x, tw, ids, wg), _reference(w4, x, tw, ids, None))


# ----------------------------------------------------------------------------- GPU: model shapes


GPU_SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768), "dsv2lite": (64, 6, 2048, 1408)}
GPU_TOKENS = {"mixtral": (1, 5), "qwen3": (1, 16), "dsv2lite": (1, 16)}


def _routed_case(rng, w, t, k, magnitude=False):
    """Fresh layer inputs for ``t`` tokens on checkpoint weights ``w``: bf16 activations, top-``k``
    routing of random logits with expert 0 never routed, and the float64 reference
    (:func:`_fast_reference`) → ``(x, topk_weights, topk_ids, ref)``; with ``magnitude`` the
    reference is ``(ref, Σ|row|)``."""
    x = jnp.asarray(rng.standard_normal((t, w.hidden_size)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((t, w.num_experts)), jnp.float32).at[:, 0].add(-100.0)
    tw, ids = routing.fused_topk(logits, k, renormalize=True)
    return x, tw, ids, _fast_reference(w, x, tw, ids, magnitude)


def _sum16_close(got, ref, mag, k, tol=1.5e-2, what=""):
    """:func:`_layer_close` for a layer whose top-k sum accumulates in the 16-bit dtype
    (``combine="add"``: each of a token's ``k`` weighted rows rounded once to bf16 and added into
    its bf16 output row, in an order that varies from run to run): per element, the usual bound
    plus bf16's unit roundoff (2⁻⁸, relative: 8 significant bits) of the rows' magnitude sum
    ``mag`` (``Σ_j |row_j|``, which bounds every partial sum) for each of those ``k`` roundings —
    the row's own and ``k − 1`` additions."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{what}: {np.isnan(got).sum()} NaN of {got.size}"
    over = (np.abs(got - ref) / (tol * np.abs(ref).max() + k * 2.0 ** -8 * mag)).max()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert over <= 1, f"{what}: error {over:.2f}× its bound (relative error {err:.2e})"


def _dot64(a, w):
    """``a @ wᵀ`` in float64 on the default device (``a`` float64 on the host, ``w`` a float32 device
    array): XLA's own float64 dot (a float64 GEMM on the GPU), not the engines' code, and no
    float64 copy of a model-sized weight on the host (that copy took most of a GPU layer test's
    reference time). ``a``'s rows are zero-padded to a power of two (at least 8) and the product
    cut back: each expert's row count would otherwise compile a dot of its own (up to 128 experts
    per reference), the padded rows are zeros and change no other row's value."""
    rows = max(8, 1 << (len(a) - 1).bit_length())
    with jax.enable_x64(True):
        a64 = jnp.asarray(np.pad(a, ((0, rows - len(a)), (0, 0))), jnp.float64)
        return np.asarray(jnp.dot(a64, w.astype(jnp.float64).T), np.float64)[:len(a)]


def _fast_reference(w, x, tw, ids, magnitude=False):
    """Float64 reference for model-sized layers: each used expert dequantized exactly in float32
    on the device from the CHECKPOINT layout (independent of the tile conversion; the products
    of 4/8-bit codes, zero points and 16-bit scales are exact there), the two GEMMs in float64
    (:func:`_dot64`), the activation and the top-k sum in float64 on the host. ``magnitude``:
    ``(out, Σ|row|)``, the second the sum of the absolute weighted rows that each output adds."""
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    ids, tw = np.asarray(ids), np.asarray(tw, np.float64)
    out = np.zeros((xf.shape[0], w.hidden_size))
    mag = np.zeros_like(out)
    for e in np.unique(ids):
        w13, w2 = (a[0] for a in w.take_experts(jnp.asarray([e])).dequantize(jnp.float32))
        tok, slot = np.nonzero(ids == e)
        h = _dot64(xf[tok], w13)
        i = h.shape[1] // 2
        a = h[:, :i] / (1 + np.exp(-h[:, :i])) * h[:, i:]
        rows = tw[tok, slot][:, None] * _dot64(a, w2)
        out[tok] += rows                       # (tok is unique: a token routes to an expert once)
        mag[tok] += np.abs(rows)
    return (out, mag) if magnitude else out


def test_fast_reference_is_the_reference():
    """The GPU layer tests' reference (:func:`_fast_reference`: float64 dots on the device, only
    the routed experts) equals the suite's float64 reference (:func:`_reference`, numpy over every
    expert) to float64 rounding, every format, expert 0 never routed; jnp stays 32-bit outside
    its float64 dots."""
    rng = np.random.default_rng()
    for key in sorted(SCHEMES):              # 7 tokens: up to 7 rows per expert; 29: ~14 (padded to 16 / 32)
        t = 7 if key != "awq_g128" else 29
        w, x, tw, ids, _ = _layer_case(rng, SCHEMES[key], 5, 256, 128, t, 2)
        got, ref = _fast_reference(w.to_jax(), x, tw, ids), _reference(w, x, tw, ids, None)
        assert got.dtype == np.float64 and np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max(), key
        same, mag = _fast_reference(w.to_jax(), x, tw, ids, magnitude=True)
        assert np.array_equal(same, got) and (mag >= np.abs(got) * (1 - 1e-12)).all() and (mag > 0).any(), key
    assert jnp.arange(2).dtype == jnp.int32 and jnp.zeros(()).dtype == jnp.float32


def test_sum16_close_bounds_a_bf16_top_k_sum():
    """The check of ``combine="add"``'s GPU test (:func:`_sum16_close`) passes a top-8 sum done as
    the kernel does it (each weighted row rounded to bf16, added into a bf16 row in a random order)
    and fails the same sum with one row left out, or a NaN."""
    rng = np.random.default_rng()
    k = 8
    rows = rng.standard_normal((k, 64, 256)) * rng.dirichlet(np.ones(k), (64, 1)).transpose(2, 0, 1)

    def bf16(v):
        return np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    ref, mag = rows.sum(0), np.abs(rows).sum(0)
    order = rng.permutation(k)
    acc = bf16(rows[order[0]])
    for j in order[1:]:
        acc = bf16(acc + bf16(rows[j]))
    _sum16_close(acc, ref, mag, k)
    with pytest.raises(AssertionError, match="its bound"):
        _sum16_close(bf16(acc - rows[order[3]]), ref, mag, k)
    with pytest.raises(AssertionError, match="NaN"):
        _sum16_close(np.where(rng.random(acc.shape) < 1e-3, np.nan, acc), ref, mag, k)


# (rows of H 16-bit values, block rows, rows per program): Qwen3 / DeepSeek-V2-Lite, Mixtral, a small
# row, DeepSeek-V3's 7168 (four 14 KB rows in 64 KB)
_ROW_GATHER_CASES = [(2048, 144, 16), (4096, 24, 8), (256, 8, 8), (7168, 24, 4)]


@pytest.mark.skipif(ON_GPU, reason="the GPU test compiles and runs it")
def test_row_gather_lowers_and_checks():
    """The row-gather kernel lowers to Mosaic GPU for bf16 and fp16 rows; a program's rows divide
    the block and fit 64 KB; bad input is a typed error naming the array."""
    from pallas_kernels.row_gather import gather_rows, program_rows

    s = jax.ShapeDtypeStruct
    for h, bm, g in _ROW_GATHER_CASES:
        assert program_rows(bm, 2 * h) == g
        for dt in (jnp.bfloat16, jnp.float16):
            fn = jax.jit(functools.partial(gather_rows, block_m=bm))
            text = fn.trace(s((37, h), dt), s((5 * bm,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text
    fn = functools.partial(gather_rows, block_m=8)
    for x, idx, err, what in ((s((4, 256), jnp.float32), s((8,), jnp.int32), DTypeError, "x: 16-bit"),
                              (s((4, 12), jnp.bfloat16), s((8,), jnp.int32), ShapeError, "x: rows of a multiple"),
                              (s((2, 4, 256), jnp.bfloat16), s((8,), jnp.int32), ShapeError, r"x must be \[T, H\]"),
                              (s((4, 256), jnp.bfloat16), s((8,), jnp.float32), DTypeError, "idx must be a 1-D int32"),
                              (s((4, 256), jnp.bfloat16), s((2, 4), jnp.int32), DTypeError, "idx must be a 1-D int32"),
                              (s((4, 256), jnp.bfloat16), s((12,), jnp.int32), ConfigError, "idx.s 12 rows are not whole")):
        with pytest.raises(err, match=f"gather_rows: {what}"):
            jax.jit(fn).trace(x, idx)


@given(st.integers(1, 512), st.integers(1, 40000))
def test_row_gather_program_rows(block_m, row_bytes):
    """A program's rows: the largest divisor of the block that fits 64 KB (one row at least) and
    the 31 index slots — so a program never spans two blocks."""
    from pallas_kernels.row_gather import IDX_W, ROW_BYTES_PER_PROGRAM, program_rows

    g = program_rows(block_m, row_bytes)
    assert block_m % g == 0 and 1 <= g <= IDX_W - 1
    assert g == 1 or g * row_bytes <= ROW_BYTES_PER_PROGRAM
    assert not any(block_m % d == 0 and d * row_bytes <= ROW_BYTES_PER_PROGRAM for d in range(g + 1, IDX_W))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("h, bm, g", _ROW_GATHER_CASES)
def test_row_gather_gpu(h, bm, g):
    """Every row with an index is its token's row, bit for bit (random 16-bit rows: a row the kernel
    did not write cannot match), with ~20% of the rows and one whole block without an index, twice
    with fresh inputs, the input unchanged."""
    from pallas_kernels.row_gather import gather_rows

    rng = np.random.default_rng()
    t, nb = 37, 7
    fn = jax.jit(functools.partial(gather_rows, block_m=bm))
    for dt in (jnp.bfloat16, jnp.float16):
        x_np = rng.standard_normal((t, h)).astype(np.float32)
        x = jnp.asarray(x_np, dt)
        before = np.asarray(x).copy()
        idx = rng.integers(0, t, nb * bm).astype(np.int32)
        idx[rng.random(nb * bm) < 0.2] = -1
        idx[2 * bm:3 * bm] = -1
        got = np.asarray(fn(x, jnp.asarray(idx)))
        live = idx >= 0
        assert got.shape == (nb * bm, h) and got.dtype == before.dtype
        np.testing.assert_array_equal(got[live].view(np.uint16), before[idx[live]].view(np.uint16))
        np.testing.assert_array_equal(np.asarray(x).view(np.uint16), before.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(SCHEMES))
def test_fused_moe_gpu_shapes(shape, key):
    """Every format at the three model shapes, decode and a few-token batch, through
    ``fused_moe`` (which must pick the engine), outputs poisoned; experts with no tokens."""
    from wna16_jax.moe import fused_moe, select_executor

    rng = np.random.default_rng()
    e, k, h, i = GPU_SHAPES[shape]
    w = random_checkpoint_weights(rng, SCHEMES[key], e, h, i, scale=0.02).to_jax()
    tiles = jax.jit(convert_tiles)(w)
    assert select_executor(tiles, jnp.bfloat16) == ("pallas", None)
    for t in GPU_TOKENS[shape]:
        x, tw, ids, ref = _routed_case(rng, w, t, k)
        _layer_close(jax.jit(fused_moe)(x, tw, ids, tiles), ref, what=f"fused_moe T={t}")
        for over in (dict(mode="pair"), dict(mode="pair", dot="fma"), dict(mode="blocked"),
                     dict(mode="blocked", dot="swap")):
            got = jax.jit(functools.partial(fused_moe_tiles, poison_outputs=True, **over))(x, tw, ids, tiles)
            _layer_close(got, ref, what=f"{over} T={t}")


def _table_weights(shape, key):
    """``(rng, top-k, checkpoint weights, the weights the dispatch table prepares on the H200)`` for
    a GPU layer test: random ``WGMMA_SCHEMES[key]`` weights at ``GPU_SHAPES[shape]``."""
    from wna16_jax.backends import TABLE, Backend

    rng = np.random.default_rng()
    e, k, h, i = GPU_SHAPES[shape]
    w = random_checkpoint_weights(rng, WGMMA_SCHEMES[key], e, h, i, scale=0.02).to_jax()
    return rng, k, w, TABLE[Backend.MARLIN].prepare(w.scheme, w)


def _layer_rows(shape, key, rows, table=False, sum16=False, **fixed):
    """The GPU layer tests' loop: on random ``WGMMA_SCHEMES[key]`` weights at ``GPU_SHAPES[shape]``
    that the table prepares, for each ``(tokens, options)`` of ``rows`` fresh inputs with expert 0
    never routed; with ``table`` the layer through ``fused_moe`` (the table's defaults), then
    :func:`fused_moe_wgmma` with each option dict of ``options`` over ``fixed`` (one jitted function
    per dict, so a repeated dict runs the same compiled program); every output against the
    float64 reference (``sum16``: with the bound of a top-k sum in the 16-bit dtype,
    :func:`_sum16_close`)."""
    from pallas_kernels.wgmma_w4a16 import fused_moe_wgmma
    from wna16_jax.moe import fused_moe

    rng, k, w, wg = _table_weights(shape, key)
    jitted = {}
    for t, options in rows:
        x, tw, ids, ref = _routed_case(rng, w, t, k, magnitude=sum16)
        ref, mag = ref if sum16 else (ref, None)
        if table:
            _layer_close(jax.jit(fused_moe)(x, tw, ids, wg), ref, what=f"fused_moe T={t}")
        for over in options:
            opts = {**fixed, **over}
            name = repr(sorted(opts.items()))
            if name not in jitted:
                jitted[name] = jax.jit(functools.partial(fused_moe_wgmma, **opts))
            got = jitted[name](x, tw, ids, wg)
            if sum16:
                _sum16_close(got, ref, mag, k, what=f"{opts} T={t}")
            else:
                _layer_close(got, ref, what=f"{opts} T={t}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", ["awq_g128", "gptq4_channel"])
def test_wgmma_decode_layer_gpu(shape, key):
    """The one-kernel decode layer (``one_kernel=True``) on the weights the table prepares, at 1
    and 2 tokens with expert 0 never routed, three calls in a row with fresh inputs (its global
    semaphores must be back at zero after each call), against the float64 reference."""
    _layer_rows(shape, key, [(t, [dict(one_kernel=True)]) for t in (1, 2, 1)])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_fused_moe_wgmma_gpu_shapes(shape, key):
    """The layer on the wgmma kernels at the three model shapes, on the weights the dispatch table
    prepares on the H200 and through ``fused_moe``: decode, a few-token batch and a prefill batch,
    the default options, all options off, and forced schedules / options per regime (8- to
    128-row blocks, split-K, 64-column tiles, wide, shift32, zfold), against the float64
    reference; expert 0 never routed. (The kernel creates its outputs and
    writes every element in both branches — an id of -1 writes zeros — so there is no buffer to
    poison; NaN or a missed tile fails the finite/error checks.)"""
    from pallas_kernels.wgmma_w4a16 import WgmmaWeights, fused_moe_wgmma
    from wna16_jax.moe import fused_moe, select_executor

    rng, k, w, wg = _table_weights(shape, key)                    # what the table runs on the H200
    assert isinstance(wg, WgmmaWeights) and select_executor(wg, jnp.bfloat16) == ("pallas", None)
    for t in GPU_TOKENS[shape] + (300,):
        x, tw, ids, ref = _routed_case(rng, w, t, k)
        _layer_close(jax.jit(fused_moe)(x, tw, ids, wg), ref, what=f"fused_moe (wgmma) T={t}")   # defaults
        decode = (dict(schedule="pair", wide=False), dict(schedule="blocked", zfold=False, overlap=True),
                  dict(block_m=16, split1=2, split2=2, shift32=False, sfold=True),
                  dict(block_m=32, wide=False, zfold=True), dict(block_m=16, split1=1, split2=1, tout=True),
                  dict(schedule="blocked", combine="gather"), dict(block_m=16, split1=1, split2=1, fuse_act=False))
        prefill = (dict(block_m=64, block_n=64, stages=2, overlap=True), dict(block_m=128, wide=True, shift32=False),
                   dict(block_m=128, overlap=True), dict(block_m=128, ws=True, out16=False),
                   dict(block_m=32, block_n=64, ws=True), dict(block_m=128, tout=True), dict(block_m=32, tout=True),
                   dict(combine="gather"), dict(block_m=128, fuse_act=False), dict(block_m=32, fuse_act=False),
                   dict(block_m=64),                     # stages fitted to shared memory (3 / 2 with tout)
                   dict(block_m=144), dict(block_m=48, ws=False))    # blocks that are not a power of two
        for over in (dict(shift32=False, wide=False, zfold=False),) + (decode if t <= 16 else prefill):
            got = jax.jit(functools.partial(fused_moe_wgmma, **over))(x, tw, ids, wg)
            _layer_close(got, ref, what=f"wgmma {over} T={t}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_pair_defaults_gpu(shape, key):
    """The decode (pair) schedule's defaults since v11 — ``sfold``, ``static_sums``; since v14
    GEMM1's K split to ~4 programs per SM (Mixtral 1 token: 2) and ``lop3`` — and the
    v10 forms (``sfold=False``: zfold and XLA's Σx; ``static_sums=False``), through ``fused_moe``
    on the weights the table prepares, at 1 token and at 3 (Mixtral: 4, the most whose pairs its
    8 experts hold; the layer picks the pair schedule for both), expert 0 never routed, fresh
    inputs per call, against the float64 reference."""
    overs = (dict(sfold=False), dict(static_sums=False), dict(sfold=True, split1=1))
    _layer_rows(shape, key, [(t, overs) for t in (1, 4 if shape == "mixtral" else 3)], table=True, schedule="pair")


TOKEN_ROWS_TOKENS = {"mixtral": (1, 4), "qwen3": (1, 3, 16), "dsv2lite": (1, 3, 10)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_token_rows_gpu(shape, key):
    """``token_rows=True`` (v24: GEMM1 reads one 8-row block per token, the kernel's ``a_div``) in
    the pair schedule, with its default K split and unsplit (the gated epilogue), on the weights
    the table prepares (act-order keeps its per-pair rows), expert 0 never routed, fresh inputs
    per call, against the float64 reference."""
    _layer_rows(shape, key, [(t, (dict(), dict(split1=1))) for t in TOKEN_ROWS_TOKENS[shape]],
                schedule="pair", token_rows=True)


WS_FOLD_TOKENS = {"mixtral": (16, 64), "qwen3": (64,), "dsv2lite": (16,)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_ws_fold_gpu(shape, key):
    """``ws=True`` (v24: the scale-only fold GEMMs on the kernel's ``ws``, 128- and 64-column
    warpgroups) at the blocked decode rows, on the weights the table prepares, expert 0 never
    routed, fresh inputs per call, against the float64 reference."""
    _layer_rows(shape, key, [(t, (dict(block_n=128), dict(block_n=64))) for t in WS_FOLD_TOKENS[shape]], ws=True)


V12_TOKENS = {"mixtral": (16,), "qwen3": (64, 512), "dsv2lite": (16, 256)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_blocked_defaults_gpu(shape, key):
    """The blocked schedule's defaults since v12 — ``sfold`` in 8-row blocks (Mixtral 16, Qwen3
    64, DeepSeek-V2-Lite 16 tokens; since v16 both GEMMs unsplit there with ``[M, N]`` tiles, v14–v15
    split GEMM2 at Mixtral 16 — ``split2=2`` below), in 48-row blocks of short K streams (Qwen3 512, DeepSeek-V2-Lite 256 tokens)
    the chained ``ws`` stream since v15 (GEMM2 at DeepSeek-V2-Lite's 11 steps excepted) and the
    v12 form there (``persistent=False``: no ``ws``, 2 stages) — the v11 forms (``sfold=False``, ``ws=True``),
    128-deep steps at 3 stages there, and the ``persistent`` GEMMs (since v14 also the chained ``ws``
    stream, with the router weights out of GEMM2), through ``fused_moe`` on the weights the table prepares,
    expert 0 never routed, fresh inputs per call, against the float64 reference."""
    decode = (dict(sfold=False), dict(persistent=True, split1=1, split2=1), dict(split2=2, tout=False))
    medium = (dict(ws=True), dict(wide=False, stages=3), dict(persistent=True), dict(persistent=True, stages=3),
              dict(persistent=True, ws=True, weight_in_gemm2=False), dict(persistent=False))
    _layer_rows(shape, key, [(t, decode if t <= 64 else medium) for t in V12_TOKENS[shape]], table=True,
                schedule="blocked")


V16_TOKENS = {"mixtral": (16, 32), "qwen3": (16, 64, 128), "dsv2lite": (16, 128)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_v16_defaults_gpu(shape, key):
    """The decode rows v16's defaults change — ``[M, N]`` tiles (``tout``) at 8-row blocks and the
    blocked schedule's GEMM2 unsplit in blocks of up to 16 rows: Mixtral 16 / 32 tokens (8- / 16-row
    blocks), Qwen3 16 (the pair schedule, both GEMMs unsplit) and 64, DeepSeek-V2-Lite 16 — and the
    alignment by comparing all pairs that "auto" picks since v16 up to 1024 routed pairs (every
    blocked row here; at 128 tokens, 768 / 1024 pairs, the sizes it took over from the sort and
    the count), through ``fused_moe`` on the weights the table prepares, and v15's forms
    (``tout=False, split2=2``; at 128 tokens the sorted alignment instead), expert 0 never
    routed, fresh inputs per call, against the float64 reference."""
    _layer_rows(shape, key, [(t, [dict(align="sort") if t >= 128 else dict(tout=False, split2=2)])
                             for t in V16_TOKENS[shape]], table=True)


V17_TOKENS = {"mixtral": (48, 64), "qwen3": (256,), "dsv2lite": (128,)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_v17_defaults_gpu(shape, key):
    """The rows v17's defaults change — 24-row blocks with the scale-only fold where v16 took 32-row
    blocks (Qwen3 256, DeepSeek-V2-Lite 128: plain kernels; Mixtral 48 and 64 tokens: on ``ws``
    since v25, their K streams being 32+ K-blocks) — through ``fused_moe``
    on the weights the table prepares, and v16's form (``block_m=32``), expert 0 never routed,
    fresh inputs per call, against the float64 reference."""
    from pallas_kernels.wgmma_w4a16 import wgmma_block_m

    e, k = GPU_SHAPES[shape][:2]
    assert all(wgmma_block_m(t * k, e) == 24 for t in V17_TOKENS[shape])
    _layer_rows(shape, key, [(t, [dict(block_m=32)]) for t in V17_TOKENS[shape]], table=True)


CLUSTER_TOKENS = {"mixtral": ((1, dict(cluster=2)), (16, dict(cluster=2)), (16, dict(cluster=4, block_m=16)),
                              (64, dict(cluster=2))),
                  "qwen3": ((1, dict(cluster=2)), (64, dict(cluster=2)), (512, dict(cluster=2))),
                  "dsv2lite": ((16, dict(cluster=2)),)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_cluster_gpu(shape, key):
    """The layer with ``cluster`` (v22: clusters of neighbouring column tiles multicasting each
    step's token rows) at the decode rows where the plain fold kernels run — the pair schedule
    (1 token: 8-row blocks, K splits), 8- and 24-row blocked folds (Mixtral 16 / 64 tokens), clusters
    of 4 over 16-row blocks — and at Qwen3 512 tokens, the chained ``ws`` stream (the plain ``ws``
    kernel's clusters: the kernel cases), on the weights the table prepares, expert 0 never
    routed, fresh inputs per call, against the float64 reference."""
    _layer_rows(shape, key, [(t, [over]) for t, over in CLUSTER_TOKENS[shape]])


ADD_TOKENS = {"mixtral": (16, 512), "qwen3": (64, 512, 4096), "dsv2lite": (256,)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("key", sorted(WGMMA_SCHEMES))
def test_wgmma_combine_add_gpu(shape, key):
    """GEMM2 adding each row into its token's output row itself (``combine="add"``: TMA reduce-adds
    from its output tile) in the blocks each shape's token counts get — 8-row blocks with the
    scale-only fold (Mixtral 16, Qwen3 64 tokens), 48-row blocks without ``ws`` (Qwen3 512,
    DeepSeek-V2-Lite 256), 64- and 128-row ``ws`` blocks (Mixtral 512, Qwen3 4096) — and with the
    persistent GEMMs; expert 0 never routed, fresh inputs per call, against the float64 reference
    with the bound of the bf16 accumulation ``combine="add"`` does (:func:`_sum16_close`: at top-8
    the error reached 1.59e-2 of the largest output in part 107, docs/journal/notes.md v26)."""
    _layer_rows(shape, key, [(t, (dict(), dict(persistent=True))) for t in ADD_TOKENS[shape]], sum16=True,
                schedule="blocked", combine="add")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (runs on the device machine)")
def test_gpu_prefill_batched_and_backward_qwen3():
    from wna16_jax.autodiff import fused_moe_trainable

    rng = np.random.default_rng()
    e, k, h, i = GPU_SHAPES["qwen3"]
    w = random_checkpoint_weights(rng, SCHEMES["awq_g128"], e, h, i, scale=0.02).to_jax()
    tiles = jax.jit(convert_tiles)(w)
    t = 512
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k, renormalize=True)
    got = jax.jit(functools.partial(fused_moe_tiles, poison_outputs=True))(x, tw, ids, tiles)
    _layer_close(got, _fast_reference(w, x, tw, ids))
    g = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)

    def loss(x, tw, weights, executor):
        return jnp.sum(fused_moe_trainable(x, tw, ids, weights, executor=executor).astype(jnp.float32) * g)

    from wna16_jax.moe import batched_experts_forward

    bt = routing.dispatch_batched(x[:64], ids[:64], e, max_tokens_per_expert=16)
    got_b = jax.jit(batched_experts_forward)(bt.hidden_states, bt.expert_num_tokens, tiles)        # engine
    ref_b = jax.jit(functools.partial(batched_experts_forward, executor="xla"))(
        bt.hidden_states.astype(jnp.float32), bt.expert_num_tokens, w)
    _layer_close(got_b, np.asarray(ref_b, np.float64), what="batched experts")
    dx, dtw = jax.jit(jax.grad(functools.partial(loss, executor="pallas"), argnums=(0, 1)))(x, tw, tiles)
    rdx, rdtw = jax.jit(jax.grad(functools.partial(loss, executor="xla"), argnums=(0, 1)))(
        x.astype(jnp.float32), tw, w)
    _layer_close(dx, np.asarray(rdx, np.float64), 3e-2)
    _layer_close(dtw, np.asarray(rdtw, np.float64), 3e-2)
    # the layout the table prepares on the H200 (wgmma): forward on the wgmma kernels, backward on
    # the Triton-lowered transposed kernels through its exact tile view
    from wna16_jax.backends import TABLE, Backend

    wg = TABLE[Backend.MARLIN].prepare(w.scheme, w)
    assert type(wg).__name__ == "WgmmaWeights"
    dx2, dtw2 = jax.jit(jax.grad(functools.partial(loss, executor="pallas"), argnums=(0, 1)))(x, tw, wg)
    _layer_close(dx2, np.asarray(rdx, np.float64), 3e-2)
    _layer_close(dtw2, np.asarray(rdtw, np.float64), 3e-2)


@settings(deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 40), st.integers(1, 3), st.integers(1, 4), st.integers(1, 150),
       st.data())
def test_ws_stream_clusters_cover_every_item_once(cluster, nb, tiles_per, split, clusters, data):
    """The ``ws`` stream's index math with ``cluster`` (``persistent_share`` over the clusters,
    :func:`stream_item` per program of a cluster, ``persistent_tail`` over the programs): the two
    programs (or four) of a cluster stream the same block and K split at every step — the
    multicast row tile is theirs in common — each its own column tile, and over all programs the
    streamed items and the zeroed tail cover every (block, column-pair tile, K split) output
    exactly once."""
    from pallas_kernels.wgmma_w4a16 import persistent_share, persistent_tail, stream_item

    tiles = tiles_per * cluster
    live_blocks = data.draw(st.integers(0, nb))
    nt = tiles * split
    n_live, n_all = live_blocks * nt, nb * nt
    programs = max(cluster, min(clusters * cluster, n_all) // cluster * cluster)     # as the kernel caps it
    seen = []
    for q in range(programs // cluster):
        lo, count = (int(v) for v in persistent_share(np.int32(q), programs // cluster, np.int32(n_live // cluster)))
        for t in range(count):
            items = [tuple(int(v) for v in stream_item(np.int32(lo + t), np.int32(cn), nt, split, cluster))
                     for cn in range(cluster)]
            assert len({(b, sp) for b, _, sp in items}) == 1            # one block and split per cluster step
            assert all(0 <= b < live_blocks and 0 <= j < tiles for b, j, _ in items)
            seen += items
        for cn in range(cluster):
            p = q * cluster + cn
            for r in range(int(persistent_tail(np.int32(p), programs, np.int32(n_live), n_all))):
                item = n_live + p + r * programs
                seen.append(tuple(int(v) for v in stream_item(np.int32(item), 0, nt, split)))
    assert sorted(seen) == [(b, j, s) for b in range(nb) for j in range(tiles) for s in range(split)]


@settings(deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 4), st.integers(1, 5), st.integers(1, 300),
       st.data())
def test_persistent_schedule_covers_every_item_once(nb, tiles, split, chunk, programs, data):
    """The persistent kernel's index math (``persistent_share`` / ``persistent_item`` /
    ``persistent_tail``, the functions its index maps and loops call): over all programs, the
    streamed items and the zeroed tail cover every (block, column tile, K split) output exactly
    once, the live items in stream order; each streamed item runs its ``chunk`` K steps of its own
    split, in order; shares differ by at most one item."""
    from pallas_kernels.wgmma_w4a16 import persistent_item, persistent_share, persistent_tail

    live_blocks = data.draw(st.integers(0, nb))
    ipb = tiles * split
    n_live, n_all = live_blocks * ipb, nb * ipb
    programs = min(programs, n_all)                   # as the kernel caps it
    seen, counts = [], []
    for p in range(programs):
        lo, count = (int(v) for v in persistent_share(np.int32(p), programs, np.int32(n_live)))
        counts.append(count)
        for g in range(count * chunk):
            blk, j, sp, kk = (int(v) for v in persistent_item(np.int32(lo), np.int32(g), chunk, ipb, split))
            assert 0 <= blk < live_blocks and 0 <= j < tiles and 0 <= sp < split
            assert kk == sp * chunk + g % chunk          # the split's own K steps, in order
            if g % chunk == chunk - 1:                   # the item's last step: its output
                seen.append((blk, j, sp))
        for r in range(int(persistent_tail(np.int32(p), programs, np.int32(n_live), n_all))):
            item = n_live + p + r * programs
            assert n_live <= item < n_all
            seen.append((item // ipb, item % ipb // split, item % ipb % split))
    assert sorted(seen) == [(b, j, s) for b in range(nb) for j in range(tiles) for s in range(split)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == n_live


def test_fused_moe_wgmma_stages_pair_cpu(monkeypatch):
    """``stages`` as a pair ``(GEMM1's, GEMM2's)`` (v26) sets the two GEMMs' ring depths apart
    (``None`` in it: that GEMM's default), one value sets both, and anything else is a
    ConfigError naming the option; the layer stays right (kernels replaced by their jnp
    contracts)."""
    import pallas_kernels.wgmma_w4a16 as wgm

    # GEMM1: K = 4096 in 256-deep steps (2 stages by default at 16-row blocks); GEMM2: K = 256, one step (4)
    cases = [(dict(block_m=16), [2, 4]), (dict(block_m=16, stages=(None, 3)), [2, 3]),
             (dict(block_m=16, stages=(3, None)), [3, 4]), (dict(block_m=16, stages=3), [3, 3]),
             (dict(schedule="pair", stages=[None, np.int64(2)]), [2, 2])]
    _check_layer_picks(monkeypatch, lambda kw: kw["stages"], cases, 4, 4096, 256, close={1, 4})
    w, x, tw, ids, _ = _layer_case(np.random.default_rng(), WGMMA_SCHEMES["awq_g128"], 4, 256, 256, 4, 2)
    wg = wgm.convert_wgmma(w.to_jax())
    for bad in ((2, 3, 4), 0, (2, "x"), True, (None, -1)):
        with pytest.raises(ConfigError, match="stages: expected"):
            jax.eval_shape(functools.partial(wgm.fused_moe_wgmma, stages=bad), x, tw, ids, wg)
