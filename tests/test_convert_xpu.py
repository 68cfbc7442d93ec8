"""XPU converter (docs/formats.md §6): int32 words → uint8 nibble pairs, low nibble = even k."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from convert_helpers import (
    AWQ, BF16, CT, GPTQ, SIZES, assert_decodes_like, make_checkpoint, make_scheme,
)
from wna16_jax.convert.xpu import XPUWeights, convert_xpu, process_weights_xpu
from wna16_jax.errors import DTypeError, ShapeError, UnsupportedError


def expected_bytes_from_gptq(qweight: np.ndarray) -> np.ndarray:
    """§6 from GPTQ K-first words ``[E, K/8, N]``: ``out[e, n, j] = u(k=2j) | u(k=2j+1) << 4``
    with ``u(k) = (W[e, k//8, n] >> 4·(k%8)) & 15``."""
    e, kw, n = qweight.shape

    def u(ex, k, c):
        return (int(qweight[ex, k // 8, c]) >> (4 * (k % 8))) & 0xF

    out = np.zeros((e, n, 4 * kw), np.uint8)
    for ex in range(e):
        for c in range(n):
            for j in range(4 * kw):
                out[ex, c, j] = u(ex, 2 * j, c) | (u(ex, 2 * j + 1, c) << 4)
    return out


def test_golden_process_weights_xpu_from_gptq_k_first():
    ck = make_checkpoint(make_scheme(GPTQ, 4, 32, False), e=2, h=64, i=32, seed=7, bias=True)
    out = process_weights_xpu(ck.w13_qweight, ck.w2_qweight, ck.w13_scales, ck.w2_scales,
                              ck.w13_bias, ck.w2_bias)
    assert out.w13.dtype == jnp.uint8 and out.w13.shape == (2, 64, 32)
    assert out.w2.shape == (2, 64, 16)
    np.testing.assert_array_equal(np.asarray(out.w13), expected_bytes_from_gptq(ck.w13_qweight))
    np.testing.assert_array_equal(np.asarray(out.w2), expected_bytes_from_gptq(ck.w2_qweight))
    np.testing.assert_array_equal(np.asarray(out.w13_scales), ck.w13_scales.transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(out.w2_scales), ck.w2_scales.transpose(0, 2, 1))
    assert out.w13_bias is ck.w13_bias and out.w2_bias is ck.w2_bias


def test_golden_convert_xpu_compressed_tensors_byte_view():
    ck = make_checkpoint(make_scheme(CT, 4, 64, False), e=1, h=64, i=64, seed=8)
    out = convert_xpu(ck.scheme, ck)
    # §6 byte view of the canonical words [E, N, K/8]: byte j = bits 8(j%4).. of word j//4
    w = ck.w13_qweight
    want = np.zeros((1, w.shape[1], 4 * w.shape[2]), np.uint8)
    for n in range(w.shape[1]):
        for j in range(4 * w.shape[2]):
            want[0, n, j] = (int(w[0, n, j // 4]) >> (8 * (j % 4))) & 0xFF
    np.testing.assert_array_equal(np.asarray(out.w13_weight), want)
    np.testing.assert_array_equal(np.asarray(out.w13_scales), ck.w13_scales)


def test_awq_is_converted_through_its_codes():
    """vLLM would view AWQ's N-packed words as bytes unchanged; we repack to N-first first."""
    ck = make_checkpoint(make_scheme(AWQ, 4, 32, False), e=1, h=32, i=32, seed=9)
    out = convert_xpu(ck.scheme, ck)
    codes = np.asarray(ck.decode()[0].codes)  # [E, 2I, H]
    want = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(out.w13_weight), want)


# ---------------------------------------------------------------------- property
@st.composite
def xpu_cases(draw):
    method = draw(st.sampled_from([AWQ, GPTQ, CT]))
    g = draw(st.sampled_from([32, 64, 128] + ([] if method is AWQ else [-1])))
    h, i = SIZES[g]
    scheme = make_scheme(method, 4, g, False)
    dtype = draw(st.sampled_from([np.float16, BF16, np.float32]))
    return make_checkpoint(scheme, e=2, h=h, i=i, seed=draw(st.integers(0, 2**31)),
                           bias=draw(st.booleans()), scale_dtype=dtype)


@given(xpu_cases())
def test_property_xpu_decode_equals_checkpoint(ck):
    out = convert_xpu(ck.scheme, ck)
    assert isinstance(out, XPUWeights)
    e, h, i = ck.num_experts, ck.hidden_size, ck.intermediate_size
    assert out.w13_weight.shape == (e, 2 * i, h // 2) and out.w13_weight.dtype == jnp.uint8
    assert out.w2_weight.shape == (e, h, i // 2)
    assert_decodes_like(out, ck)
    if ck.w13_bias is not None:
        np.testing.assert_array_equal(np.asarray(out.w13_bias), ck.w13_bias)


# ---------------------------------------------------------------------- refusals & jit
def test_big_endian_host_refused(monkeypatch):
    ck = make_checkpoint(make_scheme(GPTQ, 4, 32, False), e=1, h=32, i=32)
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(UnsupportedError, match=r"little-endian.*sys.byteorder='big'"):
        convert_xpu(ck.scheme, ck)
    with pytest.raises(UnsupportedError, match=r"little-endian.*sys.byteorder='big'"):
        process_weights_xpu(ck.w13_qweight, ck.w2_qweight, ck.w13_scales, ck.w2_scales)


@pytest.mark.parametrize("scheme, pattern", [
    (make_scheme(GPTQ, 8, 32, False), r"scheme.bits: .*4-bit.*got 8"),
    (make_scheme(AWQ, 4, 32, True), r"scheme.zero_point: .*no zero points.*awq 4-bit g32 asym"),
    (make_scheme(CT, 4, 32, True), r"scheme.zero_point: .*compressed-tensors 4-bit g32 asym"),
    (make_scheme(GPTQ, 4, 32, False, act_order=True),
     r"scheme.act_order: .*g_idx.*act-order"),
])
def test_unsupported_schemes_refused(scheme, pattern):
    ck = make_checkpoint(scheme, e=1, h=64, i=32)
    with pytest.raises(UnsupportedError, match=pattern):
        convert_xpu(scheme, ck)


def test_partial_word_rows_refused():
    ck = make_checkpoint(make_scheme(CT, 4, -1, False), e=1, h=12, i=16)
    with pytest.raises(ShapeError, match=r"hidden_size: 12 is not a multiple of 8"):
        convert_xpu(ck.scheme, ck)


def test_non_int32_words_refused():
    ck = make_checkpoint(make_scheme(GPTQ, 4, 32, False), e=1, h=32, i=32)
    with pytest.raises(DTypeError, match=r"w13_qweight: expected dtype int32, got uint32"):
        process_weights_xpu(ck.w13_qweight.view(np.uint32), ck.w2_qweight, ck.w13_scales,
                            ck.w2_scales)


def test_under_jit_matches_eager():
    ck = make_checkpoint(make_scheme(CT, 4, 32, False), e=2, h=64, i=32, seed=11, bias=True)
    jitted = jax.jit(convert_xpu, static_argnums=0)(ck.scheme, ck.to_jax())
    eager = convert_xpu(ck.scheme, ck)
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    g = make_checkpoint(make_scheme(GPTQ, 4, 32, False), e=1, h=32, i=32, seed=12)
    out = jax.jit(process_weights_xpu)(g.w13_qweight, g.w2_qweight, g.w13_scales, g.w2_scales)
    np.testing.assert_array_equal(np.asarray(out.w2), expected_bytes_from_gptq(g.w2_qweight))
