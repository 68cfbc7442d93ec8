"""Shared builders for the converter tests: random loader-layout layers made with numpy and
``packing.pack`` (independently of any converter), and the logical-equality assertion."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from wna16_jax import packing
from wna16_jax.schemes import QuantMethod, QuantScheme
from wna16_jax.weights import CheckpointWeights, LogicalQuant

AWQ, GPTQ, CT = QuantMethod.AWQ, QuantMethod.GPTQ, QuantMethod.COMPRESSED_TENSORS
BF16 = np.dtype(jnp.bfloat16)
#: one (hidden, intermediate) size per group size keeps the number of distinct shapes (and so
#: of XLA compilations) small: w13 spans two groups, w2 one (channelwise: one group each).
SIZES = {32: (64, 32), 64: (128, 64), 128: (256, 128), -1: (64, 32)}
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # docs/formats.md §1.3: logical column j lives in slot AWQ_REVERSE[j]


def make_scheme(method, bits=4, group_size=128, zero_point=False, act_order=False,
                gptq_format="gptq") -> QuantScheme:
    return QuantScheme(method, bits, group_size, zero_point, act_order,
                       gptq_checkpoint_format=gptq_format if method is GPTQ else None)


def make_checkpoint(scheme: QuantScheme, *, e: int, h: int, i: int, seed: int = 0,
                    bias: bool = False, scale_dtype=np.float16) -> CheckpointWeights:
    """A random, valid loader-layout layer, built from random logical codes with numpy and
    ``packing.pack`` (independently of any converter)."""
    rng = np.random.default_rng(seed)
    b, mask = scheme.bits, (1 << scheme.bits) - 1
    m = scheme.method

    def one(n, k):
        g = scheme.num_groups(k)
        codes = rng.integers(0, 1 << b, size=(e, n, k))
        scales = rng.uniform(-2.0, 2.0, size=(e, n, g)).astype(scale_dtype)
        zeros = rng.integers(0, 1 << b, size=(e, n, g)) if scheme.zero_point else None
        g_idx = rng.integers(0, g, size=(e, k)).astype(np.int32) if scheme.act_order else None
        if m is AWQ:
            order = packing.awq_order(b)
            qw = packing.pack(codes.transpose(0, 2, 1), b, axis=2, order=order)
            qz = None if zeros is None else packing.pack(zeros.transpose(0, 2, 1), b, axis=2,
                                                         order=order)
            sc = scales.transpose(0, 2, 1)
        elif m is GPTQ:
            qw = packing.pack(codes.transpose(0, 2, 1), b, axis=1)
            qz = None
            if zeros is not None:
                stored = (zeros - 1) & mask if scheme.gptq_zeros_minus_one else zeros
                qz = packing.pack(stored.transpose(0, 2, 1), b, axis=2)
            sc = scales.transpose(0, 2, 1)
        else:
            qw = packing.pack(codes, b, axis=2)
            qz = None if zeros is None else packing.pack(zeros, b, axis=1)
            sc = scales
        return qw, np.ascontiguousarray(sc), qz, g_idx

    w13, s13, z13, g13 = one(2 * i, h)
    w2, s2, z2, g2 = one(h, i)
    b13 = rng.normal(size=(e, 2 * i)).astype(np.float16) if bias else None
    b2 = rng.normal(size=(e, h)).astype(np.float16) if bias else None
    return CheckpointWeights.of(w13_qweight=w13, w2_qweight=w2, w13_scales=s13, w2_scales=s2, w13_qzeros=z13,
                                w2_qzeros=z2, w13_g_idx=g13, w2_g_idx=g2, w13_bias=b13, w2_bias=b2,
                                scheme=scheme, hidden_size=h, intermediate_size=i).validate()


def assert_logical_equal(got: LogicalQuant, want: LogicalQuant, *, same_scale_dtype=True):
    """Codes bit-for-bit, scales exactly, zeros exactly (``None`` = implicit 2**(bits-1))."""
    got, want = (jax.tree_util.tree_map(np.asarray, lq) for lq in (got, want))  # numpy decode
    assert got.bits == want.bits
    gc, wc = np.asarray(got.codes), np.asarray(want.codes)
    assert gc.shape == wc.shape
    np.testing.assert_array_equal(gc.astype(np.int64), wc.astype(np.int64))
    gs, ws = np.asarray(got.scales), np.asarray(want.scales)
    if same_scale_dtype:
        assert gs.dtype == ws.dtype
    np.testing.assert_array_equal(gs.astype(np.float32), ws.astype(np.float32))

    def zeros(lq):
        if lq.zeros is None:
            return np.full(np.asarray(lq.scales).shape, 1 << (lq.bits - 1), np.int64)
        return np.asarray(lq.zeros).astype(np.int64)

    np.testing.assert_array_equal(zeros(got), zeros(want))
    assert got.g_idx is None and want.g_idx is None
    np.testing.assert_array_equal(np.asarray(got.dequantize(jnp.float32)),
                                  np.asarray(want.dequantize(jnp.float32)))


def assert_decodes_like(layout, ckpt: CheckpointWeights, *, same_scale_dtype=True):
    for got, want in zip(layout.decode(), ckpt.decode()):
        assert_logical_equal(got, want, same_scale_dtype=same_scale_dtype)


def int32_of(u: int) -> int:
    """A Python integer holding 32 bits → the int32 value with those bits."""
    u &= 0xFFFFFFFF
    return u - (1 << 32) if u >= 1 << 31 else u
