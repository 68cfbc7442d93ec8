"""CPU converter (docs/formats.md §5): blocked int4 layout with compensation sums."""

from __future__ import annotations

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from convert_helpers import (
    AWQ, AWQ_REVERSE, BF16, CT, GPTQ, assert_decodes_like, assert_logical_equal, int32_of, make_checkpoint, make_scheme,
)
from wna16_jax.convert.cpu import CPUWeights, convert_cpu, prepare_int4_moe_layer_for_cpu
from wna16_jax.errors import ConfigError, ShapeError, UnsupportedError
from wna16_jax.schemes import QuantScheme

#: jitted once per (scheme/algo, shapes): much cheaper on the 2-core CI machine than compiling
#: every eager op for every shape. test_under_jit_matches_eager covers the eager path.
prepare_jit = jax.jit(prepare_int4_moe_layer_for_cpu, static_argnames="quant_algo")
convert_and_decode = jax.jit(lambda s, w: (lambda o: (o, o.decode()))(convert_cpu(s, w)),
                             static_argnums=0)


# ------------------------------------------------------- docs/formats.md formulas (loops)
def unpack_loops(algo, qweight, qzeros, n_groups):
    """§5 step 1 for one expert: ``Wu [N, K]`` and ``Z [N, G]`` from the K-first words."""
    if algo == "awq":
        k, n = qweight.shape[0], 8 * qweight.shape[1]
        wu = [[(int(qweight[kk, c // 8]) >> (4 * AWQ_REVERSE[c % 8])) & 0xF for kk in range(k)]
              for c in range(n)]
        z = [[(int(qzeros[g, c // 8]) >> (4 * AWQ_REVERSE[c % 8])) & 0xF for g in range(n_groups)]
             for c in range(n)]
    else:
        k, n = 8 * qweight.shape[0], qweight.shape[1]
        wu = [[(int(qweight[kk // 8, c]) >> (4 * (kk % 8))) & 0xF for kk in range(k)]
              for c in range(n)]
        z = [[((int(qzeros[g, c // 8]) >> (4 * (c % 8))) & 0xF) + 1 for g in range(n_groups)]
             for c in range(n)]
    return wu, z


def blocked_loops(wu, z, s):
    """§5 steps 2-5 for one expert, byte by byte."""
    n, k, g = len(wu), len(wu[0]), len(z[0])
    gs = k // g
    bk = min(gs, 128)
    nc, kc = n // 32, k // bk
    w = np.zeros((nc, kc, 16 * bk + 128), np.uint8)
    for b in range(nc):
        for c in range(kc):
            for ln in range(32):
                for lk in range(bk):
                    kq, ki, p, ni, hi = lk // 4, lk % 4, ln // 16, ln % 8, (ln % 16) // 8
                    w[b, c, kq * 64 + p * 32 + ni * 4 + ki] |= wu[32 * b + ln][c * bk + lk] << (4 * hi)
                comp = sum(wu[32 * b + ln][kk] - z[32 * b + ln][kk // gs]
                           for kk in range(c * bk, (c + 1) * bk))
                w[b, c, 16 * bk + 4 * ln: 16 * bk + 4 * ln + 4] = list(struct.pack("<i", comp))
    zb = np.array([[[z[32 * b + j][gg] for j in range(32)] for gg in range(g)] for b in range(nc)],
                  np.int8)
    sb = np.array([[[s[gg, 32 * b + j] for j in range(32)] for gg in range(g)] for b in range(nc)],
                  np.float32)
    return w, zb, sb


def avoid_v1_wrap(ck):
    """Golden data for the literal ``nibble + 1`` rule: stored GPTQ zero nibbles in [0, 14]."""
    rng = np.random.default_rng(0)

    def words(shape):
        nib = rng.integers(0, 15, size=shape + (8,), dtype=np.uint32)
        return (nib << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)

    return ck.replace(w13_qzeros=words(ck.w13_qzeros.shape),
                               w2_qzeros=words(ck.w2_qzeros.shape)).validate()


@pytest.mark.parametrize("scheme, h, i", [
    (make_scheme(AWQ, 4, 32, True), 64, 32),       # bk = 32, Kc = 2 / 1
    (make_scheme(GPTQ, 4, 32, True), 64, 64),       # asym v1: zeros nibble + 1
    (make_scheme(GPTQ, 4, 256, False), 256, 256),   # sym (synthesized 0x77777777), bk = 128 < gs
    (make_scheme(GPTQ, 4, -1, False), 32, 16),      # channelwise: bk = K
])
def test_golden_blocked_layout(scheme, h, i):
    ck = make_checkpoint(scheme, e=2, h=h, i=i, seed=h + i)
    if ck.w13_qzeros is not None and scheme.method is GPTQ:
        ck = avoid_v1_wrap(ck)
    algo = "awq" if scheme.method is AWQ else "gptq"
    out = prepare_jit(ck.w13_qweight, ck.w2_qweight, ck.w13_scales, ck.w2_scales,
                      quant_algo=algo, w13_zeros=ck.w13_qzeros, w2_zeros=ck.w2_qzeros)
    for got_w, got_z, got_s, qw, qz, sc in (
            (out.w13, out.w13_zeros, out.w13_scales, ck.w13_qweight, ck.w13_qzeros, ck.w13_scales),
            (out.w2, out.w2_zeros, out.w2_scales, ck.w2_qweight, ck.w2_qzeros, ck.w2_scales)):
        assert got_w.dtype == jnp.uint8 and got_z.dtype == jnp.int8 and got_s.dtype == jnp.float32
        for e in range(2):
            zeros = qz[e] if qz is not None else np.full(
                (sc.shape[1], sc.shape[2] // 8), int32_of(0x77777777), np.int32)
            wu, z = unpack_loops(algo, qw[e], zeros, sc.shape[1])
            w, zb, sb = blocked_loops(wu, z, sc[e].astype(np.float32))
            np.testing.assert_array_equal(np.asarray(got_w[e]), w)
            np.testing.assert_array_equal(np.asarray(got_z[e]), zb)
            np.testing.assert_array_equal(np.asarray(got_s[e]), sb)
    if ck.w13_qzeros is None:
        assert set(np.unique(np.asarray(out.w13_zeros))) == {8}


def test_gptq_v1_true_zero_zero_wraps():
    """Stored nibble 15 (AutoGPTQ v1 for true zero 0): vLLM's unpacker would give 16; we give 0."""
    ck = make_checkpoint(make_scheme(GPTQ, 4, 32, True), e=1, h=32, i=32, seed=1)
    qz = np.asarray(ck.w13_qzeros).copy()
    qz[0, 0, 0] = int32_of(0x7777777F)
    ck = ck.replace(w13_qzeros=qz).validate()
    out, decoded = convert_and_decode(ck.scheme, ck)
    assert int(out.w13_zeros[0, 0, 0, 0]) == 0 and int(out.w13_zeros[0, 0, 0, 1]) == 8
    assert_logical_equal(decoded[0], ck.decode()[0], same_scale_dtype=False)


# ---------------------------------------------------------------------- property
#: (method, zero points, GPTQ format, scale dtype, bias). Scale dtype and bias are tied to the
#: config rather than drawn, to bound the number of distinct XLA compilations (each config ×
#: group size compiles once); together the rows cover every dtype with and without bias.
CONFIGS = [
    (AWQ, True, "gptq", np.float16, True), (AWQ, False, "gptq", BF16, False),
    (GPTQ, False, "gptq", np.float32, True),
    (GPTQ, True, "gptq", BF16, True), (GPTQ, True, "gptq_v2", np.float16, False),
    (CT, False, "gptq", BF16, True), (CT, True, "gptq", np.float32, False),
]
CPU_SIZES = {32: (64, 32), 128: (256, 128), 256: (256, 256), -1: (64, 32)}


@st.composite
def cpu_cases(draw):
    method, zp, fmt, dtype, bias = draw(st.sampled_from(CONFIGS))
    g = draw(st.sampled_from([32, 128, 256] + ([] if method is AWQ else [-1])))
    h, i = CPU_SIZES[g]
    return make_checkpoint(make_scheme(method, 4, g, zp, gptq_format=fmt), e=2, h=h, i=i,
                           seed=draw(st.integers(0, 2**31)), bias=bias, scale_dtype=dtype)


def compensation_from_logical(lq, bk):
    """§5 step 4 from the checkpoint's own decode: Σ_block (Wu − Z) → [E, Nc, Kc, 32] int32."""
    codes = np.asarray(lq.codes).astype(np.int64)
    e, n, k = codes.shape
    z = np.asarray(lq.zeros) if lq.zeros is not None else np.full(np.asarray(lq.scales).shape, 8)
    gs = k // z.shape[2]
    diff = codes - np.repeat(z, gs, axis=2)
    return diff.reshape(e, n // 32, 32, k // bk, bk).sum(-1).transpose(0, 1, 3, 2).astype(np.int32)


@given(cpu_cases())
def test_property_cpu_decode_equals_checkpoint(ck):
    out, decoded = convert_and_decode(ck.scheme, ck)
    assert isinstance(out, CPUWeights)
    e, h, i = ck.num_experts, ck.hidden_size, ck.intermediate_size
    gs13 = h if ck.scheme.group_size == -1 else ck.scheme.group_size
    gs2 = i if ck.scheme.group_size == -1 else ck.scheme.group_size
    bk13, bk2 = min(gs13, 128), min(gs2, 128)
    assert out.w13_weight.shape == (e, 2 * i // 32, h // bk13, 16 * bk13 + 128)
    assert out.w2_weight.shape == (e, h // 32, i // bk2, 16 * bk2 + 128)
    assert out.w13_scales.shape == out.w13_zeros.shape == (e, 2 * i // 32, h // gs13, 32)
    for got, want in zip(decoded, ck.decode()):
        assert_logical_equal(got, want, same_scale_dtype=False)
    for w, lq, bk in ((out.w13_weight, ck.decode()[0], bk13), (out.w2_weight, ck.decode()[1], bk2)):
        tail = np.ascontiguousarray(np.asarray(w)[..., 16 * bk:])
        np.testing.assert_array_equal(tail.view("<i4"), compensation_from_logical(lq, bk))
    if ck.w13_bias is not None:
        assert out.w13_bias.dtype == jnp.float32 and out.w2_bias.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out.w2_bias), ck.w2_bias.astype(np.float32))
    else:
        assert out.w13_bias is None and out.w2_bias is None


# ---------------------------------------------------------------------- refusals & jit
@pytest.mark.parametrize("scheme, pattern", [
    (make_scheme(GPTQ, 8, 32, False), r"scheme.bits: .*only int4 weights.*got 8"),
    (make_scheme(GPTQ, 4, 32, False, act_order=True),
     r"scheme.act_order: .*g_idx reordering.*gptq 4-bit g32 sym act-order"),
    (QuantScheme(GPTQ, 4, -1, False, desc_act=True),
     r"scheme.act_order: .*desc_act.*gptq 4-bit channel sym"),
])
def test_unsupported_schemes_refused(scheme, pattern):
    ck = make_checkpoint(scheme, e=1, h=64, i=32)
    with pytest.raises(UnsupportedError, match=pattern):
        convert_cpu(scheme, ck)


def test_layout_divisibility_refused():
    ck = make_checkpoint(make_scheme(GPTQ, 4, -1, False), e=1, h=32, i=8)
    with pytest.raises(ShapeError, match=r"w13 N \(output channels\): 16 is not a multiple of 32 "
                                         r"\(CPU block_n is 32\)"):
        convert_cpu(ck.scheme, ck)
    ck = make_checkpoint(make_scheme(GPTQ, 4, 192, False), e=1, h=192, i=192)
    with pytest.raises(ShapeError, match=r"w13 K \(input channels\): 192 is not a multiple of 128 "
                                         r"\(K must be a multiple of block_k"):
        convert_cpu(ck.scheme, ck)
    ck = make_checkpoint(make_scheme(CT, 4, -1, False), e=1, h=36, i=32)
    with pytest.raises(ShapeError, match=r"hidden_size: 36 is not a multiple of 8"):
        convert_cpu(ck.scheme, ck)


def test_bad_arguments_refused():
    ck = make_checkpoint(make_scheme(GPTQ, 4, 32, True), e=1, h=64, i=32)
    args = (ck.w13_qweight, ck.w2_qweight, ck.w13_scales, ck.w2_scales)
    with pytest.raises(ConfigError, match=r"quant_algo: expected one of \['awq', 'gptq'\], got 'marlin'"):
        prepare_int4_moe_layer_for_cpu(*args, "marlin")
    with pytest.raises(ShapeError, match=r"w13_zeros: expected shape \(1, 2, 8\), got \(1, 2, 4\)"):
        prepare_int4_moe_layer_for_cpu(*args, "gptq", ck.w13_qzeros[..., :4], ck.w2_qzeros)
    with pytest.raises(ShapeError, match=r"w2_scales: expected shape \(1, 1, 64\), got \(1, 1, 32\)"):
        prepare_int4_moe_layer_for_cpu(ck.w13_qweight, ck.w2_qweight, ck.w13_scales,
                                       ck.w2_scales[..., :32], "gptq")
    with pytest.raises(UnsupportedError, match=r"input_dtype: the CPU backend .*got int8"):
        convert_cpu(ck.scheme, ck, input_dtype=jnp.int8)


def test_under_jit_matches_eager():
    ck = make_checkpoint(make_scheme(CT, 4, 32, True), e=2, h=64, i=32, seed=5, bias=True)
    jitted = jax.jit(convert_cpu, static_argnums=0)(ck.scheme, ck.to_jax())
    eager = convert_cpu(ck.scheme, ck)
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_decodes_like(eager, ck, same_scale_dtype=False)  # eager decode
    a = make_checkpoint(make_scheme(AWQ, 4, 32, True), e=1, h=64, i=32, seed=6)
    out = prepare_jit(a.w13_qweight, a.w2_qweight, a.w13_scales, a.w2_scales, quant_algo="awq",
                      w13_zeros=a.w13_qzeros, w2_zeros=a.w2_qzeros)
    layout, _ = convert_and_decode(a.scheme, a)
    np.testing.assert_array_equal(np.asarray(out.w13), np.asarray(layout.w13_weight))
    np.testing.assert_array_equal(np.asarray(out.w2_zeros), np.asarray(layout.w2_zeros))
