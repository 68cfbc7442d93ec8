"""Pack/unpack round trips for every bit width, order and axis; numpy and jnp twins agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wna16_jax import packing
from wna16_jax.errors import ConfigError, DTypeError, ShapeError, ValueRangeError


def test_awq_order_golden():
    # Columns 0..7 with value = column index: slot s must hold column [0,2,4,6,1,3,5,7][s].
    word = packing.pack(np.arange(8)[None], 4, axis=1, order=packing.AWQ_ORDER_4BIT)
    assert word.dtype == np.int32 and word.view(np.uint32)[0, 0] == 0x75316420
    assert packing.pack(np.arange(8)[None], 4, axis=1).view(np.uint32)[0, 0] == 0x76543210
    # 8-bit: bytes LSB first
    assert packing.pack(np.array([[1, 2, 3, 0xAB]]), 8).view(np.uint32)[0, 0] == 0xAB030201
    # the high nibble set makes a negative int32 (bit reinterpretation, not value conversion)
    assert packing.pack(np.array([[0, 0, 0, 0, 0, 0, 0, 15]]), 4)[0, 0] == np.int32(-0x10000000)
    assert packing.AWQ_REVERSE_ORDER_4BIT == tuple(packing.AWQ_ORDER_4BIT.index(j) for j in range(8))


# One jitted twin, so each (shape, bits, axis, order) compiles once, not once per example.
_pack_jit = jax.jit(packing.pack, static_argnums=(1, 2, 3))
_unpack_jit = jax.jit(packing.unpack, static_argnums=(1, 2, 3))


# Few distinct shapes (each jit compiles once per shape); the data is fresh for every example.
@given(bits=st.sampled_from([4, 8]), awq=st.booleans(), axis=st.integers(0, 2),
       words=st.sampled_from([1, 3]), other=st.sampled_from([(1, 3), (2, 1)]),
       seed=st.integers(0, 2**32 - 1))
def test_round_trip(bits, awq, axis, words, other, seed):
    rng = np.random.default_rng(seed)
    pf = 32 // bits
    shape = list(other)
    shape.insert(axis, words * pf)
    v = rng.integers(0, 1 << bits, shape)
    order = packing.awq_order(bits) if awq else None
    p = packing.pack(v, bits, axis, order)
    assert p.dtype == np.int32 and p.shape[axis] == words
    np.testing.assert_array_equal(packing.unpack(p, bits, axis, order), v)
    # independent check of one word: slot s holds logical index order[s]
    idx = [0] * 3
    word = int(p[tuple(idx)]) & 0xFFFFFFFF
    sl = [slice(0, 1)] * 3
    sl[axis] = slice(0, pf)
    group = v[tuple(sl)].reshape(-1)
    ordr = order or tuple(range(pf))
    assert word == sum(int(group[ordr[s]]) << (bits * s) for s in range(pf))
    # jnp twin under jit equals numpy
    pj = _pack_jit(jnp.asarray(v, jnp.int32), bits, axis, order)
    np.testing.assert_array_equal(np.asarray(pj), p)
    uj = _unpack_jit(pj, bits, axis, order)
    np.testing.assert_array_equal(np.asarray(uj), v)


def test_padding_and_size():
    v = np.arange(10).reshape(1, 10) % 16
    p = packing.pack(v, 4)                       # 10 values → 2 words, zero padded
    assert p.shape == (1, 2)
    np.testing.assert_array_equal(packing.unpack(p, 4, size=10), v)
    with pytest.raises(ShapeError, match="size 20"):
        packing.unpack(p, 4, size=20)


def test_errors():
    with pytest.raises(ConfigError, match="bits.*3"):
        packing.pack(np.zeros((1, 8)), 3)
    with pytest.raises(ConfigError, match="order"):
        packing.pack(np.zeros((1, 8)), 4, order=(0, 1, 2, 3, 4, 5, 6, 6))
    with pytest.raises(DTypeError, match="int32.*float32"):
        packing.unpack(np.zeros((1, 1), np.float32), 4)
    with pytest.raises(ValueRangeError, match="codes.*16"):
        packing.check_codes("codes", np.array([0, 16]), 4)


def test_inputs_not_mutated():
    v = np.arange(16).reshape(2, 8) % 16
    keep = v.copy()
    p = packing.pack(v, 4)
    pk = p.copy()
    packing.unpack(p, 4)
    np.testing.assert_array_equal(v, keep)
    np.testing.assert_array_equal(p, pk)
