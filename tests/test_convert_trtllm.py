"""FLASHINFER_TRTLLM MXINT4 converter (docs/formats.md §4, steps 1-7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from convert_helpers import (
    AWQ, BF16, CT, GPTQ, assert_decodes_like, assert_logical_equal, make_checkpoint, make_scheme,
)
from wna16_jax.convert.trtllm_mxint4 import (
    TrtllmMxint4Weights,
    block_scale_interleave,
    convert_trtllm_mxint4,
    prepare_static_weights_for_trtllm_mxint4_moe,
)
from wna16_jax.errors import DTypeError, ShapeError, UnsupportedError


# ------------------------------------------------------- docs/formats.md formulas (loops)
def p1(m):
    return [32 * (p // 32) + 4 * ((p % 32) % 8) + (p % 32) // 8 for p in range(m)]


def p0(m):
    out = [0] * m
    for i in range(m // 2):
        out[2 * i], out[2 * i + 1] = i, m // 2 + i
    return out


def swizzle_loops(s: np.ndarray) -> np.ndarray:
    """Step 6 for one expert: ``s [M, Kg]`` → flat ``[pad128(M)·pad4(Kg)]`` (zero padded)."""
    m, kg = s.shape
    mp, kp = -(-m // 128) * 128, -(-kg // 4) * 4
    out = np.zeros(mp * kp, dtype=s.dtype)
    for r in range(m):
        for k in range(kg):
            idx = ((r // 128) * 128 * kp + (k // 4) * 512 + (r % 32) * 16
                   + ((r % 128) // 32) * 4 + (k % 4))
            out[idx] = s[r, k]
    return out


def expected_mxint4(words: np.ndarray, scales: np.ndarray, gated: bool):
    """Steps 1-7 for one expert from canonical words ``[M, K/8]`` and scales ``[M, K/32]``."""
    m, kw = words.shape
    if gated:  # step 2: [gate; up] → [up; gate]
        words = np.concatenate([words[m // 2:], words[: m // 2]])
        scales = np.concatenate([scales[m // 2:], scales[: m // 2]])
    by = np.zeros((m, 4 * kw), np.uint8)  # steps 1 + 3: signed nibbles, byte j = k 2j | 2j+1
    for r in range(m):
        for j in range(4 * kw):
            word = int(words[r, j // 4])
            lo = (((word >> (4 * (2 * j % 8))) & 0xF) - 8) & 0xF
            hi = (((word >> (4 * ((2 * j + 1) % 8))) & 0xF) - 8) & 0xF
            by[r, j] = lo | (hi << 4)
    perm = [p0(m)[q] for q in p1(m)] if gated else p1(m)  # steps 4 / 5
    by, scales = by[perm], scales[perm]
    blocks = np.zeros((4 * kw // 128, m, 128), np.uint8)  # step 7
    for b in range(blocks.shape[0]):
        for r in range(m):
            for j in range(128):
                blocks[b, r, j] = by[r, 128 * b + j]
    return blocks, swizzle_loops(scales)


def test_golden_steps_1_to_7():
    ck = make_checkpoint(make_scheme(CT, 4, 32, False), e=1, h=256, i=256, seed=3,
                         scale_dtype=BF16)
    out = prepare_static_weights_for_trtllm_mxint4_moe(ck.w13_qweight, ck.w13_scales,
                                                        ck.w2_qweight, ck.w2_scales)
    assert out.gemm1_weights.shape == (1, 1, 512, 128) and out.gemm1_weights.dtype == jnp.uint8
    assert out.gemm1_scales.shape == (1, 512 * 8) and out.gemm1_scales.dtype == jnp.bfloat16
    assert out.gemm2_weights.shape == (1, 1, 256, 128)
    assert out.gemm2_scales.shape == (1, 256 * 8)
    w1, s1 = expected_mxint4(ck.w13_qweight[0], ck.w13_scales[0], gated=True)
    w2, s2 = expected_mxint4(ck.w2_qweight[0], ck.w2_scales[0], gated=False)
    np.testing.assert_array_equal(np.asarray(out.gemm1_weights[0]), w1)
    np.testing.assert_array_equal(np.asarray(out.gemm2_weights[0]), w2)
    np.testing.assert_array_equal(np.asarray(out.gemm1_scales[0]).view(np.uint16), s1.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(out.gemm2_scales[0]).view(np.uint16), s2.view(np.uint16))


def test_golden_block_scale_interleave_with_padding():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 150, 6)).astype(BF16)  # pads to [256, 8]
    got = np.asarray(block_scale_interleave(jnp.asarray(s)))
    assert got.shape == (2, 256 * 8)
    for e in range(2):
        np.testing.assert_array_equal(got[e].view(np.uint16), swizzle_loops(s[e]).view(np.uint16))
    assert np.count_nonzero(got.astype(np.float32)) == np.count_nonzero(s.astype(np.float32))


def test_uint8_input_is_taken_as_already_signed():
    ck = make_checkpoint(make_scheme(CT, 4, 32, False), e=1, h=256, i=256, seed=4,
                         scale_dtype=BF16)
    w = ck.w13_qweight.view(np.uint32)
    signed = w ^ np.uint32(0x88888888)  # (u - 8) & 0xF per nibble
    as_bytes = signed.view(np.uint8).reshape(1, 512, 128)  # little-endian host (CI machines)
    a = prepare_static_weights_for_trtllm_mxint4_moe(ck.w13_qweight, ck.w13_scales,
                                                      ck.w2_qweight, ck.w2_scales)
    b = prepare_static_weights_for_trtllm_mxint4_moe(as_bytes, ck.w13_scales,
                                                      ck.w2_qweight, ck.w2_scales)
    np.testing.assert_array_equal(np.asarray(a.gemm1_weights), np.asarray(b.gemm1_weights))


# ---------------------------------------------------------------------- property
@st.composite
def mxint4_cases(draw):
    method = draw(st.sampled_from([AWQ, GPTQ, CT]))
    h, i = draw(st.sampled_from([(256, 256), (512, 256), (256, 512)]))
    return make_checkpoint(make_scheme(method, 4, 32, False), e=2, h=h, i=i,
                           seed=draw(st.integers(0, 2**31)), bias=draw(st.booleans()),
                           scale_dtype=BF16)


@given(mxint4_cases())
def test_property_mxint4_decode_equals_checkpoint(ck):
    out = convert_trtllm_mxint4(ck.scheme, ck)
    assert isinstance(out, TrtllmMxint4Weights)
    e, h, i = ck.num_experts, ck.hidden_size, ck.intermediate_size
    assert out.gemm1_weights.shape == (e, h // 256, 2 * i, 128)
    assert out.gemm2_weights.shape == (e, i // 256, h, 128)
    assert out.gemm1_scales.shape == (e, 2 * i * (h // 32))
    assert out.gemm2_scales.shape == (e, h * (i // 32))
    assert_decodes_like(out, ck)
    assert (out.w13_bias is None) == (ck.w13_bias is None)


# ---------------------------------------------------------------------- refusals & jit
@pytest.mark.parametrize("scheme, pattern", [
    (make_scheme(GPTQ, 8, 32, False), r"scheme.bits: MXINT4 needs 4-bit weights, got 8"),
    (make_scheme(CT, 4, 32, True), r"scheme.zero_point: .*symmetric.*asym"),
    (make_scheme(CT, 4, 64, False), r"scheme.group_size: MXINT4 needs group size 32, got 64"),
    (make_scheme(CT, 4, 32, False, act_order=True), r"scheme.act_order: .*act-order"),
])
def test_unsupported_schemes_refused(scheme, pattern):
    ck = make_checkpoint(scheme, e=1, h=256, i=256, scale_dtype=BF16)
    with pytest.raises(UnsupportedError, match=pattern):
        convert_trtllm_mxint4(scheme, ck)


def test_fp16_scales_refused():
    ck = make_checkpoint(make_scheme(CT, 4, 32, False), e=1, h=256, i=256)
    with pytest.raises(DTypeError, match=r"w13_scales: .*bfloat16, got float16"):
        convert_trtllm_mxint4(ck.scheme, ck)
    with pytest.raises(DTypeError, match=r"gemm1_scales: .*bfloat16, got float16"):
        prepare_static_weights_for_trtllm_mxint4_moe(ck.w13_qweight, ck.w13_scales,
                                                      ck.w2_qweight, ck.w2_scales)


def test_block_layout_sizes_refused():
    ck = make_checkpoint(make_scheme(CT, 4, 32, False), e=1, h=128, i=256, scale_dtype=BF16)
    with pytest.raises(ShapeError, match=r"hidden_size: 128 is not a multiple of 256"):
        convert_trtllm_mxint4(ck.scheme, ck)
    with pytest.raises(ShapeError, match=r"gemm1_weights bytes per row \(K/2\): 64 is not a "
                                         r"multiple of 128 \(block layout needs K % 256 == 0\)"):
        prepare_static_weights_for_trtllm_mxint4_moe(ck.w13_qweight, ck.w13_scales,
                                                      ck.w2_qweight, ck.w2_scales)


def test_bad_dtypes_and_shapes_refused():
    ck = make_checkpoint(make_scheme(CT, 4, 32, False), e=1, h=256, i=256, scale_dtype=BF16)
    with pytest.raises(DTypeError, match=r"gemm2_weights: expected int32 .* or uint8 .*got float32"):
        prepare_static_weights_for_trtllm_mxint4_moe(ck.w13_qweight, ck.w13_scales,
                                                      ck.w2_qweight.astype(np.float32), ck.w2_scales)
    with pytest.raises(ShapeError, match=r"gemm1_scales: expected shape \(1, 512, 8\), got \(1, 512, 4\)"):
        prepare_static_weights_for_trtllm_mxint4_moe(ck.w13_qweight, ck.w13_scales[..., :4],
                                                      ck.w2_qweight, ck.w2_scales)
    with pytest.raises(UnsupportedError, match=r"input_dtype: .*bfloat16 activations, got float16"):
        convert_trtllm_mxint4(ck.scheme, ck, input_dtype=jnp.float16)


def test_under_jit_matches_eager():
    ck = make_checkpoint(make_scheme(GPTQ, 4, 32, False), e=2, h=256, i=256, seed=6, bias=True,
                         scale_dtype=BF16)
    jitted = jax.jit(convert_trtllm_mxint4, static_argnums=0)(ck.scheme, ck.to_jax())
    eager = convert_trtllm_mxint4(ck.scheme, ck)
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    decoded = jax.jit(lambda w: w.decode())(jitted)  # decode is jit-able too
    for got, want in zip(decoded, ck.decode()):
        assert_logical_equal(got, want)
    canon = (ck.w13_qweight.transpose(0, 2, 1), ck.w13_scales.transpose(0, 2, 1),
             ck.w2_qweight.transpose(0, 2, 1), ck.w2_scales.transpose(0, 2, 1))
    out = jax.jit(prepare_static_weights_for_trtllm_mxint4_moe)(*canon)
    np.testing.assert_array_equal(np.asarray(out.gemm1_weights), np.asarray(eager.gemm1_weights))
    np.testing.assert_array_equal(np.asarray(out.gemm2_scales).view(np.uint16),
                                  np.asarray(eager.gemm2_scales).view(np.uint16))
