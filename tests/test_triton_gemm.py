"""The Triton-lowered grouped GEMMs (:mod:`pallas_kernels.wna16_grouped_gemm`): ``grouped_gemm``,
``pair_gemm`` and ``grouped_gemm_t`` against float64, in interpret mode on the CPU and compiled on
the GPU; the Triton lowering of every kernel variant on the CPU (it is what the GPU compiles);
the tile packing and the split choice. Fresh random data, NaN-poisoned outputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import INTERPRET, ON_GPU, abstract_h200, close, cpu_only, kernel_case, weights64
from pallas_kernels.errors import KernelConfigError, KernelShapeError, KernelUnsupportedError
from pallas_kernels.wna16_grouped_gemm import (DEQUANT_MODES, asm_supported, choose_split, dequantize_tiles,
                                               grouped_gemm, grouped_gemm_reference, grouped_gemm_t, pack_tiles,
                                               pair_gemm, unpack_tiles, valid_split)

MODES = ("asm", "magic") if ON_GPU else ("magic",)       # inline PTX cannot run in interpret mode


def _skip_asm(mode, bits, group):
    if mode == "asm" and asm_supported(bits, group, jnp.bfloat16):
        pytest.skip(asm_supported(bits, group, jnp.bfloat16))


def _operands(codes, scales, zeros, bits):
    return (pack_tiles(jnp.asarray(codes), bits), jnp.asarray(scales, jnp.bfloat16),
            None if zeros is None else jnp.asarray(zeros, jnp.uint8))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits, group, zp, split, dot", [(4, 128, False, 1, "mma"), (4, 128, True, 2, "mma"),
                                                         (4, 32, True, 1, "mma"), (8, -1, False, 2, "mma"),
                                                         (8, 64, True, 1, "mma"), (4, 128, True, 2, "swap"),
                                                         (8, 32, False, 1, "swap")])
def test_grouped_gemm(bits, group, zp, split, dot, mode):
    _skip_asm(mode, bits, group)
    rng = np.random.default_rng()
    codes, scales, zeros = kernel_case(rng, bits, group, zp)
    bm, eids = 16, np.array(rng.permutation([0, 1, 2, -1]), np.int32)            # one unused block
    a = jnp.asarray(rng.standard_normal((4 * bm, 256)), jnp.bfloat16)
    rs = jnp.asarray(rng.random(4 * bm), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    poison = jnp.full((split, 4 * bm, 256), jnp.nan, jnp.float32)
    out = grouped_gemm(a, jnp.asarray(eids), *_operands(codes, scales, zeros, bits), rs, bias, poison, bits=bits,
                       group_size=group, block_m=bm, split_k=split, dequant=mode, dot=dot, interpret=INTERPRET)
    w = weights64(codes, scales, zeros, bits, group)
    eb = np.repeat(eids, bm)
    ref = np.einsum("mk,mkn->mn", np.asarray(a.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    ref = (ref + np.asarray(bias, np.float64)[np.maximum(eb, 0)]) * np.asarray(rs, np.float64)[:, None]
    ref[eb < 0] = 0.0
    assert out.shape == (split, 4 * bm, 256)
    close(np.asarray(out, np.float64).sum(0), ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dot", ["mma", "fma", "swap"])
@pytest.mark.parametrize("bits, group, zp", [(4, 128, True), (4, -1, False), (8, 32, True)])
def test_pair_gemm(bits, group, zp, dot, mode):
    _skip_asm(mode, bits, group)
    rng = np.random.default_rng()
    codes, scales, zeros = kernel_case(rng, bits, group, zp)
    t, k = 3, 2
    x = jnp.asarray(rng.standard_normal((t, 256)), jnp.bfloat16)
    pe = np.array([0, 2, -1, 1, 1, 0], np.int32)
    rs = jnp.asarray(rng.random(t * k), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    out = pair_gemm(x, jnp.asarray(pe), *_operands(codes, scales, zeros, bits), rs, bias,
                    jnp.full((2, t * k, 256), jnp.nan, jnp.float32), top_k=k, bits=bits, group_size=group,
                    split_k=2, block_n=64, dequant=mode, dot=dot, interpret=INTERPRET)
    w = weights64(codes, scales, zeros, bits, group)
    xr = np.repeat(np.asarray(x.astype(jnp.float32), np.float64), k, axis=0)
    ref = np.einsum("pk,pkn->pn", xr, w[np.maximum(pe, 0)]) + np.asarray(bias, np.float64)[np.maximum(pe, 0)]
    ref = ref * np.asarray(rs, np.float64)[:, None]
    ref[pe < 0] = 0.0
    close(np.asarray(out, np.float64).sum(0), ref)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_epilogue(activation):
    rng = np.random.default_rng()
    codes, scales, zeros = kernel_case(rng, 4, 128, True)
    bm, eids = 16, np.array([2, 0, -1], np.int32)
    a = jnp.asarray(rng.standard_normal((3 * bm, 256)), jnp.bfloat16)
    rs = jnp.asarray(rng.random(3 * bm) + 0.5, jnp.float32)
    out = grouped_gemm(a, jnp.asarray(eids), *_operands(codes, scales, zeros, 4), rs, None,
                       jnp.full((3 * bm, 128), jnp.nan, jnp.float32), bits=4, group_size=128, block_m=bm,
                       activation=activation, out_dtype=jnp.float32, interpret=INTERPRET)
    w = weights64(codes, scales, zeros, 4, 128)
    eb = np.repeat(eids, bm)
    h = np.einsum("mk,mkn->mn", np.asarray(a.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    h *= np.asarray(rs, np.float64)[:, None]
    g, u = h[:, :128], h[:, 128:]
    if activation == "silu":
        ref = g / (1 + np.exp(-g)) * u
    else:
        ref = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    ref[eb < 0] = 0.0
    close(out, ref, rtol=5e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits, group, zp", [(4, 128, True), (4, 32, False), (8, -1, True)])
def test_grouped_gemm_t(bits, group, zp, mode):
    _skip_asm(mode, bits, group)
    rng = np.random.default_rng()
    codes, scales, zeros = kernel_case(rng, bits, group, zp)
    bm, eids = 16, np.array([1, -1, 0, 2], np.int32)
    g = jnp.asarray(rng.standard_normal((4 * bm, 256)), jnp.bfloat16)
    out = grouped_gemm_t(g, jnp.asarray(eids), *_operands(codes, scales, zeros, bits),
                         jnp.full((4 * bm, 256), jnp.nan, jnp.float32), bits=bits, group_size=group, block_m=bm,
                         dequant=mode, interpret=INTERPRET)
    w = weights64(codes, scales, zeros, bits, group)                      # [E, K, N]
    eb = np.repeat(eids, bm)
    ref = np.einsum("mn,mkn->mk", np.asarray(g.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    ref[eb < 0] = 0.0
    close(out, ref)


@pytest.mark.parametrize("bits, group, zp", [(4, 128, True), (4, 32, False), (8, -1, True), (8, 64, True)])
def test_grouped_gemm_reference_and_dequantize(bits, group, zp):
    """The jnp twin (``grouped_gemm_reference``, ``dequantize_tiles``) against float64: the same
    weight values (rounded to the activation dtype once), zero rows for id -1."""
    rng = np.random.default_rng()
    codes, scales, zeros = kernel_case(rng, bits, group, zp)
    words, sc, z = _operands(codes, scales, zeros, bits)
    w = weights64(codes, scales, zeros, bits, group)
    np.testing.assert_array_equal(np.asarray(dequantize_tiles(words, sc, z, bits=bits, group_size=group,
                                                              dtype=jnp.bfloat16).astype(jnp.float32)), w)
    bm, eids = 16, np.array([2, -1, 0, 1], np.int32)
    a = jnp.asarray(rng.standard_normal((4 * bm, 256)), jnp.bfloat16)
    eb = np.repeat(eids, bm)
    ref = np.einsum("mk,mkn->mn", np.asarray(a.astype(jnp.float32), np.float64), w[np.maximum(eb, 0)])
    ref[eb < 0] = 0.0
    close(grouped_gemm_reference(a, jnp.asarray(eids), words, sc, z, bits=bits, group_size=group, block_m=bm), ref)


def test_pack_roundtrip_and_split_choice():
    rng = np.random.default_rng()
    for bits in (4, 8):
        codes = rng.integers(0, 1 << bits, (2, 32, 256))
        np.testing.assert_array_equal(np.asarray(unpack_tiles(pack_tiles(jnp.asarray(codes), bits), bits)), codes)
    with pytest.raises(KernelShapeError, match="K=96"):
        pack_tiles(jnp.zeros((1, 8, 96), jnp.int32), 4)
    assert choose_split(1000, 32, sms=132) == 1
    assert choose_split(2 * 224, 32, sms=132) == 2
    s = choose_split(16, 11, sms=132)                       # never an empty chunk
    chunk = -(-11 // s)
    assert (s - 1) * chunk < 11 and s <= 11
    for n_kb in range(1, 40):                               # valid_split: the largest split without empty chunks
        for want in range(1, 45):
            got = valid_split(want, n_kb)
            chunk = -(-n_kb // got)
            assert 1 <= got <= min(want, n_kb) and (got - 1) * chunk < n_kb, (want, n_kb, got)


def test_kernel_refusals():
    """Bad configurations are the kernel package's typed errors, naming the option."""
    w = jnp.zeros((1, 16, 128), jnp.int32)
    sc = jnp.ones((1, 1, 128), jnp.bfloat16)
    a = jnp.zeros((16, 128), jnp.bfloat16)
    ids = jnp.zeros((1,), jnp.int32)
    kw = dict(bits=4, group_size=128, block_m=16, interpret=True)
    with pytest.raises(KernelConfigError, match="split_k"):
        grouped_gemm(a, ids, w, sc, split_k=2, **kw)
    with pytest.raises(KernelUnsupportedError, match="interpret"):
        grouped_gemm(a, ids, w, sc, dequant="asm", **kw)
    with pytest.raises(KernelConfigError, match="dequant"):                 # "i2f" is gone
        grouped_gemm(a, ids, w, sc, dequant="i2f", **kw)
    assert DEQUANT_MODES == ("asm", "magic")
    with pytest.raises(KernelConfigError, match="dot"):                     # fma: pair rows only
        grouped_gemm(a, ids, w, sc, dot="fma", **kw)
    with pytest.raises(KernelConfigError, match="gated epilogue needs split_k=1"):
        grouped_gemm(jnp.zeros((16, 256), jnp.bfloat16), ids, jnp.zeros((1, 32, 128), jnp.int32),
                     jnp.ones((1, 2, 128), jnp.bfloat16), split_k=2, activation="silu", **kw)
    with pytest.raises(KernelShapeError, match="blocks of 16 rows"):
        grouped_gemm(jnp.zeros((32, 128), jnp.bfloat16), ids, w, sc, **kw)
    with pytest.raises(KernelShapeError, match="out: expected"):
        grouped_gemm(a, ids, w, sc, out=jnp.zeros((1, 16, 64), jnp.float32), **kw)
    with pytest.raises(KernelConfigError, match="not used"):
        pair_gemm(a[:1], ids, w, sc, top_k=1, bits=4, group_size=128, block_m=16, interpret=True)
    assert "8-bit" in asm_supported(8, 128, jnp.bfloat16) and "float32" in asm_supported(4, 128, jnp.float32)
    assert "smaller than the 128-row tile" in asm_supported(4, 64, jnp.bfloat16)
    assert asm_supported(4, 128, jnp.float16) is None and asm_supported(4, -1, jnp.bfloat16) is None


@cpu_only
def test_every_kernel_variant_lowers_to_triton():
    """What interpret mode cannot check: each kernel variant lowers to Triton IR for CUDA
    (inline PTX included) — on the CPU, without a GPU."""
    s = jax.ShapeDtypeStruct
    w, sc, z = s((4, 128, 512), jnp.int32), s((4, 8, 512), jnp.bfloat16), s((4, 8, 512), jnp.uint8)
    a, ids, rs, b = s((64, 1024), jnp.bfloat16), s((4,), jnp.int32), s((64,), jnp.float32), s((4, 512), jnp.float32)

    def lower(fn, *args):
        with abstract_h200():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text
        return text

    for mode in DEQUANT_MODES:
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
    w8 = s((4, 256, 512), jnp.int32)                     # 8-bit codes, channelwise (the magic dequantization)
    lower(functools.partial(grouped_gemm, block_m=16, bits=8, group_size=-1, split_k=2), a, ids, w8,
          s((4, 1, 512), jnp.bfloat16), s((4, 1, 512), jnp.uint8), rs, b)
