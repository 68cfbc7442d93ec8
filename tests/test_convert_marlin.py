"""Tests of the Marlin converter (``wna16_jax.convert.marlin``; docs/formats.md §3).

Every expected array is computed here from the formulas of docs/formats.md — plain-Python loops for the
golden cases, an independent vectorised numpy transcription (itself checked against the loops)
for the whole-pipeline property — never by the converter under test.

XLA compiles each new shape (about 0.5–1 s on the CI machine), so the pipeline properties draw
their static configuration (method, bits, group size, sizes, act-order, padding, dtypes) from a
fixed pool that covers every feature, and the data (codes, scales, zeros, g_idx, bias) at random;
each configuration is compiled once with ``jax.jit`` and then reused.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wna16_jax import packing
from wna16_jax.convert import marlin as M
from wna16_jax.errors import ConfigError, DTypeError, MissingTensorError, ShapeError, UnsupportedError
from wna16_jax.schemes import QuantMethod, QuantScheme
from wna16_jax.weights import CheckpointWeights

BF16 = np.dtype(jnp.bfloat16)
FP8 = np.dtype(jnp.float8_e4m3fn)

# ============================================================ transcriptions of docs/formats.md
# §3.3 constants, copied from docs/formats.md.
DK4, DN4 = [0, 8, 0, 8, 1, 9, 1, 9], [0, 0, 8, 8, 0, 0, 8, 8]
DK8 = [0, 8, 1, 9]
DK4_A8 = [0, 16, 1, 17, 2, 18, 3, 19]


def to_i32(word: int) -> int:
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


def loop_repack(Q, bits: int, a8: bool) -> np.ndarray:
    """§3.3 literally: loop over output words with plain Python ints."""
    K, N = len(Q), len(Q[0])
    pf = 32 // bits
    rows, cols = K // 16, N * 16 // pf
    out = [[0] * cols for _ in range(rows)]
    if not a8:
        for kt in range(rows):
            for col in range(cols):
                word = 0
                if bits == 4:
                    nt, r = col // 128, col % 128
                    t, w = r // 4, r % 4
                    r0, c = 2 * (t % 4), 16 * w + t // 4
                    for s in range(8):
                        word |= int(Q[16 * kt + r0 + DK4[s]][64 * nt + c + DN4[s]]) << (4 * s)
                else:
                    nt, r = col // 256, col % 256
                    t, w, h = r // 8, (r % 8) // 2, r % 2
                    r0, c = 2 * (t % 4), 16 * w + t // 4 + 8 * h
                    for s in range(4):
                        word |= int(Q[16 * kt + r0 + DK8[s]][64 * nt + c]) << (8 * s)
                out[kt][col] = to_i32(word)
        return np.array(out, np.int64).astype(np.int32)
    T = 128 if bits == 4 else 256
    flat = []
    for f in range(rows * cols):
        tile, idx = f // T, f % T
        kt, nt = tile // (N // 32), tile % (N // 32)
        word = 0
        if bits == 4:
            t, w = idx // 4, idx % 4
            k0, n = 4 * (t % 4), 16 * (w // 2) + 8 * (w % 2) + t // 4
            for s in range(8):
                word |= int(Q[32 * kt + k0 + DK4_A8[s]][32 * nt + n]) << (4 * s)
        else:
            t, w, h = idx // 8, (idx % 8) // 2, idx % 2
            k0, n = 4 * (t % 4) + 16 * h, 16 * (w // 2) + 8 * (w % 2) + t // 4
            for s in range(4):
                word |= int(Q[32 * kt + k0 + s][32 * nt + n]) << (8 * s)
        flat.append(to_i32(word))
    return np.array(flat, np.int64).astype(np.int32).reshape(rows, cols)


def np_repack(Q: np.ndarray, bits: int, a8: bool) -> np.ndarray:
    """§3.3 vectorised: the (k, n) source of every (output word, slot), gathered from Q."""
    K, N = Q.shape
    pf = 32 // bits
    rows, cols = K // 16, N * 16 // pf
    if not a8:
        kt = np.arange(rows)[:, None, None]
        col = np.arange(cols)[None, :, None]
        s = np.arange(pf)[None, None, :]
        if bits == 4:
            nt, r = col // 128, col % 128
            t, w = r // 4, r % 4
            k = 16 * kt + 2 * (t % 4) + np.array(DK4)[s]
            n = 64 * nt + 16 * w + t // 4 + np.array(DN4)[s]
        else:
            nt, r = col // 256, col % 256
            t, w, h = r // 8, (r % 8) // 2, r % 2
            k = 16 * kt + 2 * (t % 4) + np.array(DK8)[s]
            n = 64 * nt + 16 * w + t // 4 + 8 * h + 0 * s
    else:
        T = 128 if bits == 4 else 256
        f = np.arange(rows * cols)[:, None]
        s = np.arange(pf)[None, :]
        tile, idx = f // T, f % T
        kt, nt = tile // (N // 32), tile % (N // 32)
        if bits == 4:
            t, w = idx // 4, idx % 4
            k = 32 * kt + 4 * (t % 4) + np.array(DK4_A8)[s]
        else:
            t, w, h = idx // 8, (idx % 8) // 2, idx % 2
            k = 32 * kt + 4 * (t % 4) + 16 * h + s
        n = 32 * nt + 16 * (w // 2) + 8 * (w % 2) + t // 4 + 0 * s
    vals = Q[k, n].astype(np.uint64) << (np.uint64(bits) * s.astype(np.uint64))
    words = vals.sum(axis=-1).astype(np.uint32).view(np.int32)
    return words.reshape(rows, cols)


def spec_scale_perm(grouped: bool) -> list[int]:
    """§3.4 as ``new[p] = old[perm[p]]``."""
    if grouped:
        perm = [0] * 64
        for i in range(8):
            for j in range(8):
                perm[8 * i + j] = 8 * j + i
        return perm
    perm = [0] * 32
    for i in range(4):
        for a in range(4):
            for b in range(2):
                perm[8 * i + 2 * a + b] = 8 * a + 2 * i + b
    return perm


def np_chunk_perm(x: np.ndarray, perm: list[int], per_expert: bool) -> np.ndarray:
    c = len(perm)
    lead = x.shape[:1] if per_expert else ()
    flat = x.reshape(lead + (-1, c))
    return flat[..., perm].reshape(x.shape)


def spec_grouped_choice(size_k: int, g: int, a8: bool) -> bool:
    return g != -1 and g < size_k and not a8


def spec_zp_word(Z: np.ndarray, g: int, w: int, bits: int, a8: bool) -> int:
    """One Marlin zero-point word (§3.5): closed forms for 16-bit activations, and for 8-bit
    activations the steps (grouped transpose only, then pack pf consecutive columns)."""
    word = 0
    pf = 32 // bits
    for s in range(pf):
        if a8:
            p = pf * w + s
            m, q = p // 64, p % 64
            i, j = q // 8, q % 8
            v = Z[g, 64 * m + 8 * j + i]
        elif bits == 4:
            v = Z[g, 64 * (w // 8) + 8 * [0, 2, 4, 6, 1, 3, 5, 7][s] + w % 8]
        else:
            m = w // 16
            rem = (4 * w) % 64 + [0, 2, 1, 3][s]
            i, j = rem // 8, rem % 8
            v = Z[g, 64 * m + 8 * j + i]
        word |= int(v) << (bits * s)
    return to_i32(word)


def np_zero_points(Z: np.ndarray, bits: int, a8: bool) -> np.ndarray:
    G, N = Z.shape
    pf = 32 // bits
    return np.array([[spec_zp_word(Z, g, w, bits, a8) for w in range(N // pf)] for g in range(G)],
                    np.int64).astype(np.int32)


def spec_fp8_code(u: int, z: int | None) -> int:
    """§3.7 per nibble."""
    if z is None:
        return u - 8 if u >= 8 else 15 - u
    return u - z if u >= z else 15 - u


def spec_int8_scales(s: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """§3.8: int16 values of round(s / max * 4096) (quotient rounded to the scale dtype)."""
    m = s.max()
    ratio = (s.astype(np.float32) / np.float32(m)).astype(s.dtype)
    q = np.round(ratio.astype(np.float32) * np.float32(4096)).astype(np.int16)
    return q, np.float32(m) / np.float32(4096)


def spec_padded(i: int, g: int) -> int:
    unit = math.lcm(64, g if g > 0 else 1)
    return -(-i // unit) * unit


def pack_rows(Q, bits):
    return packing.pack(np.asarray(Q), bits, axis=-2)


def awq_pack(Q, bits):
    return packing.pack(np.asarray(Q), bits, axis=-1, order=packing.awq_order(bits))


def i16_bits(x) -> np.ndarray:
    return np.asarray(x).view(np.int16)


# ============================================================================ jitted entry points
REPACK_STATIC = ("size_k", "size_n", "num_bits", "is_a_8bit")
j_gptq_repack = jax.jit(M.gptq_marlin_repack, static_argnames=REPACK_STATIC)
j_gptq_moe_repack = jax.jit(M.gptq_marlin_moe_repack, static_argnames=REPACK_STATIC)
j_awq_repack = jax.jit(M.awq_marlin_repack, static_argnames=REPACK_STATIC)
j_awq_moe_repack = jax.jit(M.awq_marlin_moe_repack, static_argnames=REPACK_STATIC)
j_unrepack = jax.jit(M.marlin_unrepack, static_argnames=REPACK_STATIC)
j_moe_unrepack = jax.jit(M.marlin_moe_unrepack, static_argnames=REPACK_STATIC)


# ============================================================================ §3.3 golden cases
@pytest.mark.parametrize("bits,a8,K,N,pos,value,word_rc,expected", [
    # 4-bit, 16-bit act: Q[9, 8] -> dk=9, dn=8 is slot 7 of thread t=0, warp w=0 -> M[0, 0].
    (4, False, 16, 64, (9, 8), 5, (0, 0), 5 << 28),
    # 4-bit: Q[16+2, 64+17]: kt=1, nt=1, r0=2 -> t%4=1, c=17 -> w=1, t//4=1 -> t=5, slot 0;
    # column 128*nt + 4t + w.
    (4, False, 32, 128, (18, 81), 3, (1, 128 + 4 * 5 + 1), 3),
    # 8-bit, 16-bit act: Q[9, 8] -> dk=9 is byte 3; c=8 -> w=0, h=1, t=0 -> col 1.
    (8, False, 16, 64, (9, 8), 200, (0, 1), to_i32(200 << 24)),
    # 4-bit, 8-bit act: Q[17, 9]: k0=0, slot 3 (17); n=9 -> w=1, t//4=1 -> t=4, idx 17.
    (4, True, 32, 32, (17, 9), 7, (0, 17), 7 << 12),
    # 8-bit, 8-bit act: Q[21, 9]: h=1, t%4=1, byte 1; n=9 -> w=1, t=5, idx 8*5+2+1=43.
    (8, True, 32, 32, (21, 9), 255, (0, 43), 255 << 8),
])
def test_repack_single_code_lands_where_spec_says(bits, a8, K, N, pos, value, word_rc, expected):
    Q = np.zeros((K, N), np.int64)
    Q[pos] = value
    out = np.asarray(M.gptq_marlin_repack(pack_rows(Q, bits), None, K, N, bits, a8))
    want = np.zeros_like(out)
    want[word_rc] = expected
    np.testing.assert_array_equal(out, want)
    assert out.dtype == np.int32


def test_repack_first_word_by_hand():
    # Q[k, n] = (3k + n) % 16: word M[0, 0] holds Q[0,0], Q[8,0], Q[0,8], Q[8,8], Q[1,0], Q[9,0],
    # Q[1,8], Q[9,8] = 0, 8, 8, 0, 3, 11, 11, 3 in nibbles 0..7.
    Q = (3 * np.arange(16)[:, None] + np.arange(64)[None, :]) % 16
    out = np.asarray(M.gptq_marlin_repack(pack_rows(Q, 4), None, 16, 64, 4))
    assert out.shape == (1, 128)
    assert out[0, 0] == 0x3BB30880
    # Word 5 = thread t=1, warp w=1: r0 = 2, c = 16: Q[2,16], Q[10,16], Q[2,24], Q[10,24],
    # Q[3,16], Q[11,16], Q[3,24], Q[11,24].
    want = [(3 * k + n) % 16 for k, n in [(2, 16), (10, 16), (2, 24), (10, 24),
                                          (3, 16), (11, 16), (3, 24), (11, 24)]]
    assert out[0, 5] == to_i32(sum(v << (4 * s) for s, v in enumerate(want)))


@pytest.mark.parametrize("bits,a8,K,N", [
    (4, False, 32, 128), (8, False, 32, 128), (4, True, 64, 64), (8, True, 64, 96),
    (4, False, 48, 64), (8, True, 32, 32),
])
def test_repack_equals_loop_golden_and_numpy_transcription(bits, a8, K, N):
    rng = np.random.default_rng(K * N + bits + a8)
    Q = rng.integers(0, 1 << bits, (K, N))
    golden = loop_repack(Q.tolist(), bits, a8)
    np.testing.assert_array_equal(np_repack(Q, bits, a8), golden)  # the test's own transcription
    got = j_gptq_repack(pack_rows(Q, bits), None, size_k=K, size_n=N, num_bits=bits, is_a_8bit=a8)
    np.testing.assert_array_equal(np.asarray(got), golden)


# ---------------------------------------------------------------------------- repack properties
@st.composite
def repack_case(draw):
    bits = draw(st.sampled_from([4, 8]))
    a8 = draw(st.booleans())
    tk, tn = (32, 32) if a8 else (16, 64)
    K = tk * draw(st.sampled_from([1, 3]))       # one tile / several tiles along each axis
    N = tn * draw(st.sampled_from([1, 3 if a8 else 2]))
    seed = draw(st.integers(0, 2**32 - 1))
    return bits, a8, K, N, 2, np.random.default_rng(seed)


@given(repack_case())
def test_repack_property_matches_spec_transcription(case):
    bits, a8, K, N, _, rng = case
    Q = rng.integers(0, 1 << bits, (K, N))
    got = j_gptq_repack(pack_rows(Q, bits), None, size_k=K, size_n=N, num_bits=bits, is_a_8bit=a8)
    np.testing.assert_array_equal(np.asarray(got), np_repack(Q, bits, a8))


@given(repack_case())
def test_awq_repack_equals_gptq_repack(case):
    # vLLM test_awq_marlin_repack: awq_marlin_repack(awq_pack(Q)) == gptq_marlin_repack(pack_rows(Q)).
    bits, a8, K, N, _, rng = case
    Q = rng.integers(0, 1 << bits, (K, N))
    a = j_awq_repack(awq_pack(Q, bits), None, size_k=K, size_n=N, num_bits=bits, is_a_8bit=a8)
    g = j_gptq_repack(pack_rows(Q, bits), None, size_k=K, size_n=N, num_bits=bits, is_a_8bit=a8)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(g))


@given(st.sampled_from([4, 8]), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_moe_repack_equals_stacked_dense_and_act_order_sorts_rows(bits, a8, with_perm, seed):
    rng = np.random.default_rng(seed)
    E, (tk, tn) = 2, ((32, 32) if a8 else (16, 64))
    K, N = 2 * tk, 2 * tn
    Q = rng.integers(0, 1 << bits, (E, K, N))
    perm = np.stack([rng.permutation(K) for _ in range(E)]).astype(np.int32) if with_perm \
        else np.zeros((E, 0), np.int32)  # [E, 0] = no act-order, as vLLM passes it
    kw = dict(size_k=K, size_n=N, num_bits=bits, is_a_8bit=a8)
    moe = np.asarray(j_gptq_moe_repack(pack_rows(Q, bits), perm, **kw))
    moe_awq = np.asarray(j_awq_moe_repack(awq_pack(Q, bits), perm, **kw))
    np.testing.assert_array_equal(moe_awq, moe)
    for e in range(E):
        rows = perm[e] if with_perm else np.arange(K)
        # act-order repack == repack of the row-sorted matrix Q_sorted[k] = Q[perm[k]] (§3.3)
        dense = j_gptq_repack(pack_rows(Q[e][rows], bits), None, **kw)
        np.testing.assert_array_equal(moe[e], np.asarray(dense))
        dense_perm = j_gptq_repack(pack_rows(Q[e], bits), perm[e] if with_perm else None, **kw)
        np.testing.assert_array_equal(moe[e], np.asarray(dense_perm))
    # the inverse recovers the codes in the original row order
    back = j_moe_unrepack(jnp.asarray(moe), perm, **kw)
    np.testing.assert_array_equal(np.asarray(back), Q)


# ============================================================================ §3.4 scales, §3.6 bias
def test_scale_permutations_by_hand():
    grouped, single = spec_scale_perm(True), spec_scale_perm(False)
    # grouped: new[8i + j] = old[8j + i]  -> new[1] = old[8], new[8] = old[1], new[9] = old[9]
    assert grouped[1] == 8 and grouped[8] == 1 and grouped[9] == 9 and grouped[63] == 63
    # single: new[8i + 2a + b] = old[8a + 2i + b] -> new[2] = old[8], new[3] = old[9], new[8] = old[2]
    assert single[2] == 8 and single[3] == 9 and single[8] == 2 and single[31] == 31
    lib_grouped, lib_single = M.get_scale_perms()
    assert list(lib_grouped) == grouped and list(lib_single) == single

    s = np.arange(128, dtype=np.float32).reshape(1, 128)
    out = np.asarray(M.marlin_permute_scales(s, size_k=256, size_n=128, group_size=64))
    assert out[0, 1] == 8 and out[0, 8] == 1 and out[0, 64 + 1] == 64 + 8
    out = np.asarray(M.marlin_permute_scales(s, size_k=256, size_n=128, group_size=-1))
    assert out[0, 2] == 8 and out[0, 3] == 9 and out[0, 32 + 8] == 32 + 2


@pytest.mark.parametrize("size_k,g,a8,grouped", [
    (256, 64, False, True),    # g < size_k: grouped
    (128, 128, False, False),  # g == size_k: single (quirk Q1 when size_k = I for w13)
    (256, -1, False, False),   # channelwise: single
    (256, 64, True, False),    # 8-bit activations: always single
    (64, 128, False, False),   # g > size_k: single
])
def test_scale_permutation_choice(size_k, g, a8, grouped):
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 3, 128)).astype(np.float16)
    want = np_chunk_perm(s, spec_scale_perm(grouped), per_expert=True)
    got = M.marlin_moe_permute_scales(s, size_k, 128, g, a8)
    assert got.dtype == jnp.float16 and got.shape == s.shape
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(M.marlin_permute_scales(s[1], size_k, 128, g, a8)),
                                  want[1])
    np.testing.assert_array_equal(
        np.asarray(M.marlin_moe_unpermute_scales(got, size_k, 128, g, a8)), s)
    np.testing.assert_array_equal(
        np.asarray(M.marlin_unpermute_scales(got[0], size_k, 128, g, a8)), s[0])


def test_bias_permutation():
    b = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    got = np.asarray(M.marlin_permute_bias(b))
    np.testing.assert_array_equal(got, np_chunk_perm(b, spec_scale_perm(False), per_expert=False))
    assert got[0, 2] == 8 and got[1, 3] == 64 + 9
    np.testing.assert_array_equal(np.asarray(M.marlin_unpermute_bias(got)), b)


# ============================================================================ §3.5 zero points
def test_zero_point_closed_form_by_hand():
    # 4-bit: nibble s of word (g, w) = Z[g, 64*(w//8) + 8*[0,2,4,6,1,3,5,7][s] + w%8]
    Z = np.zeros((1, 128), np.int64)
    Z[0, 64 + 8 * 6 + 3] = 9          # w//8 = 1, w%8 = 3, interleave slot s with il[s] = 6 -> s=3
    out = np.asarray(M.marlin_zero_points(Z, 1, 128, 4))
    want = np.zeros((1, 16), np.int32)
    want[0, 8 + 3] = 9 << 12
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("bits,a8", [(4, False), (8, False), (4, True), (8, True)])
def test_zero_points_golden_and_identities(bits, a8):
    rng = np.random.default_rng(bits + 10 * a8)
    E, G, N = 2, 3, 128
    pf = 32 // bits
    Z = rng.integers(0, 1 << bits, (E, G, N))
    want = np.stack([np_zero_points(Z[e], bits, a8) for e in range(E)])
    np.testing.assert_array_equal(np.asarray(M.marlin_zero_points(Z[0], G, N, bits, a8)), want[0])
    # standard-packed (CT / corrected GPTQ) and AWQ-packed zeros give the same Marlin zeros
    std = packing.pack(Z, bits, axis=-1)
    awq = awq_pack(Z, bits)
    np.testing.assert_array_equal(
        np.asarray(M.moe_packed_to_marlin_zero_points(std, G, N, bits, a8)), want)
    np.testing.assert_array_equal(
        np.asarray(M.moe_awq_to_marlin_zero_points(awq, G, N, bits, a8)), want)
    np.testing.assert_array_equal(
        np.asarray(M.awq_to_marlin_zero_points(awq[1], G, N, bits, a8)), want[1])
    assert want.shape == (E, G, N // pf)
    # inverse
    np.testing.assert_array_equal(
        np.asarray(M.moe_marlin_zero_points_decode(jnp.asarray(want), G, N, bits, a8)), Z)
    np.testing.assert_array_equal(
        np.asarray(M.marlin_zero_points_decode(want[0], G, N, bits, a8)), Z[0])


# ============================================================================ §3.2 padding
@pytest.mark.parametrize("i,g,want", [
    (96, 32, 128), (128, 128, 128), (72, -1, 128), (192, 128, 256), (64, 64, 64),
    (100, -1, 128), (192, 64, 192), (160, 32, 192), (1, -1, 64),
])
def test_padded_intermediate(i, g, want):
    assert M.marlin_moe_padded_intermediate(i, g) == want == spec_padded(i, g)


# ============================================================================ §3.7 fp8 preprocess
def test_fp8_preprocess_without_zeros_every_nibble():
    # word 0x76543210 holds u = 0..7 and 0xFEDCBA98 holds u = 8..15 (nibble s = u)
    words = np.array([[0x76543210, to_i32(0xFEDCBA98)]], np.int64).astype(np.int32)
    out = np.asarray(M.marlin_int4_fp8_preprocess(words))
    want = [sum(spec_fp8_code(u, None) << (4 * s) for s, u in enumerate(range(lo, lo + 8)))
            for lo in (0, 8)]
    # u < 8 -> 15 - u: 15..8 ; u >= 8 -> u - 8: 0..7
    assert want == [0x89ABCDEF, 0x76543210]
    np.testing.assert_array_equal(out, np.array([[to_i32(w) for w in want]], np.int32))
    # q = u - 8 >= 0 maps to q, q < 0 to 8 | (|q| - 1) (sign + magnitude - 1)
    for u in range(16):
        q = u - 8
        assert spec_fp8_code(u, None) == (q if q >= 0 else 8 | (-q - 1))


def test_fp8_preprocess_with_awq_zeros_uses_zero_row_k_div_group():
    rng = np.random.default_rng(3)
    K, C, G = 8, 3, 2                      # row k uses zero row k // (K / G) = k // 4
    qw = rng.integers(-(2**31), 2**31, (K, C), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-(2**31), 2**31, (G, C), dtype=np.int64).astype(np.int32)
    out = np.asarray(M.marlin_int4_fp8_preprocess(qw, qz))
    for k in range(K):
        for c in range(C):
            u_word, z_word = int(qw[k, c]) & 0xFFFFFFFF, int(qz[k // 4, c]) & 0xFFFFFFFF
            want = 0
            for s in range(8):
                u, z = (u_word >> 4 * s) & 15, (z_word >> 4 * s) & 15
                want |= spec_fp8_code(u, z) << (4 * s)
            assert out[k, c] == to_i32(want)
    # stacked [E, K, C] with [E, G, C] is the same as the flat view vLLM passes
    out3 = np.asarray(M.marlin_int4_fp8_preprocess(qw.reshape(2, 4, C), qz.reshape(2, 1, C)))
    np.testing.assert_array_equal(out3.reshape(K, C), out)
    # the recode is invertible given the zeros (ranges [0, 15-z] and [16-z, 15] are disjoint)
    u = np.arange(16)[:, None] + 0 * np.arange(16)[None, :]
    z = 0 * np.arange(16)[:, None] + np.arange(16)[None, :]
    v = np.vectorize(spec_fp8_code)(u, z)
    np.testing.assert_array_equal(np.asarray(M.marlin_int4_fp8_unpreprocess_codes(v, z)), u)
    v0 = np.vectorize(lambda x: spec_fp8_code(x, None))(np.arange(16))
    np.testing.assert_array_equal(np.asarray(M.marlin_int4_fp8_unpreprocess_codes(v0)),
                                  np.arange(16))


# ============================================================================ §3.8 int8 scales
@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_int8_scale_processing_numbers(dtype):
    s = np.array([[1.0, 0.5, 2.0, 0.25]], dtype)
    new, gs = M.marlin_act_int8_process_scales(s)
    assert new.dtype == dtype and new.shape == s.shape          # dtype kept, bits are int16
    np.testing.assert_array_equal(i16_bits(new), [[2048, 1024, 4096, 512]])
    assert gs.dtype == jnp.float32 and float(gs) == 2.0 / 4096
    # the bit pattern of 4096 as fp16 is NOT the value 4096 (quirk Q6)
    assert float(np.asarray(new, np.float32)[0, 2]) != 4096.0


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_int8_scale_processing_rounding(dtype):
    # 0.3 / 1.1 etc. exercise the rounding of the quotient to the scale dtype before * 4096.
    s = np.array([0.3, 0.7, 1.1, 0.0009, 1.0999], dtype)
    want, want_gs = spec_int8_scales(s)
    for fn in (M.marlin_act_int8_process_scales, jax.jit(M.marlin_act_int8_process_scales)):
        new, gs = fn(jnp.asarray(s))
        np.testing.assert_array_equal(i16_bits(new), want)
        assert np.float32(gs) == want_gs
    np.testing.assert_array_equal(
        np.asarray(M.marlin_act_int8_unprocess_scales(new, gs)),
        want.astype(np.float32) * want_gs)


# ============================================================================ whole pipeline
@dataclasses.dataclass(frozen=True)
class Cfg:
    method: str
    bits: int
    zp: bool
    g: int
    E: int
    H: int
    I: int  # noqa: E741
    act: bool = False
    bias: bool = False
    sdtype: str = "float16"
    input_dtype: str | None = None
    gptq_v2: bool = False

    @property
    def scheme(self) -> QuantScheme:
        m = {"awq": QuantMethod.AWQ, "gptq": QuantMethod.GPTQ, "ct": QuantMethod.COMPRESSED_TENSORS}
        kw = {"gptq_checkpoint_format": "gptq_v2"} if self.gptq_v2 else {}
        return QuantScheme(m[self.method], self.bits, self.g, self.zp, self.act, **kw)

    @property
    def jnp_input_dtype(self):
        return None if self.input_dtype is None else jnp.dtype(self.input_dtype)


# Pool for 16-bit activations: every method x bits x zero-point combination, group sizes
# 32/64/128/channel, padding (I % 64 != 0, incl. CT's partial last word I % 8 = 4), act-order,
# quirk Q1 (g == I), GPTQ v1 and v2 zeros, bias, fp16/bf16/fp32 scales, E = 1/2.
POOL_16 = [
    Cfg("awq", 4, True, 32, 2, 128, 96, bias=True),
    Cfg("awq", 4, True, 128, 2, 256, 128, bias=True, input_dtype="bfloat16"),
    Cfg("awq", 4, True, 64, 1, 64, 128, sdtype="bfloat16"),
    Cfg("gptq", 4, False, 32, 2, 128, 96, bias=True),
    Cfg("gptq", 4, False, 128, 2, 128, 128, act=True, bias=True, sdtype="bfloat16"),
    Cfg("gptq", 4, True, 64, 2, 128, 64, act=True),
    Cfg("gptq", 4, True, -1, 1, 64, 72, bias=True),
    Cfg("gptq", 4, True, 32, 2, 256, 160, bias=True, sdtype="bfloat16", gptq_v2=True),
    Cfg("gptq", 8, False, 32, 2, 128, 64, act=True, bias=True),
    Cfg("gptq", 8, False, -1, 2, 64, 100, bias=True, sdtype="bfloat16"),
    Cfg("ct", 4, False, 128, 2, 128, 256, act=True, bias=True, sdtype="bfloat16"),
    Cfg("ct", 4, True, 64, 2, 128, 192, act=True, bias=True),
    Cfg("ct", 4, False, -1, 2, 64, 68, sdtype="float32", input_dtype="float16"),
    Cfg("ct", 4, True, -1, 1, 128, 64, sdtype="bfloat16"),
    Cfg("ct", 8, False, 64, 2, 64, 128, act=True, bias=True),
    # I == g == 32 pads to 64: w13 scales use size_k = I -> single (Q1); w2 scales use
    # size_k = padded groups * g = 64 -> grouped for GPTQ/CT, but size_k = I -> single for AWQ.
    Cfg("gptq", 4, False, 32, 2, 64, 32, bias=True),
    Cfg("awq", 4, True, 32, 1, 128, 32),
]

# Pool for 8-bit activations: both 32x32 tile families, fp8 recode + x512 (AWQ with zeros,
# GPTQ/CT without; CT partial last word), int8 fixed-point scales (skipped for single-group
# tensors), act-order.
POOL_8 = [
    Cfg("awq", 4, True, 32, 2, 128, 96, bias=True, input_dtype="float8_e4m3fn"),
    Cfg("gptq", 4, False, -1, 2, 64, 72, bias=True, input_dtype="float8_e4m3fn"),
    Cfg("gptq", 4, False, 64, 2, 128, 128, act=True, sdtype="bfloat16",
        input_dtype="float8_e4m3fn"),
    Cfg("ct", 4, False, -1, 1, 64, 68, input_dtype="float8_e4m3fn"),
    Cfg("gptq", 4, False, 32, 2, 128, 96, bias=True, input_dtype="int8"),
    Cfg("gptq", 4, True, 128, 2, 256, 128, sdtype="bfloat16", input_dtype="int8"),
    Cfg("gptq", 8, False, 64, 2, 128, 192, act=True, bias=True, input_dtype="int8"),
    Cfg("ct", 4, True, -1, 2, 64, 64, input_dtype="int8"),
    Cfg("awq", 4, True, 32, 2, 128, 96, bias=True, sdtype="bfloat16", input_dtype="int8"),
    # w2 has I / g = 1 group (skipped) although padding gives it 2 rows of scales
    Cfg("ct", 4, False, 32, 2, 64, 32, input_dtype="int8"),
]


@dataclasses.dataclass
class Logical:
    """What the checkpoint means: codes [E, N, K], scales / zeros [E, N, G], g_idx [E, K]."""
    c13: np.ndarray
    c2: np.ndarray
    s13: np.ndarray
    s2: np.ndarray
    z13: np.ndarray | None
    z2: np.ndarray | None
    g13: np.ndarray | None
    g2: np.ndarray | None
    b13: np.ndarray | None
    b2: np.ndarray | None


def make_logical(cfg: Cfg, rng: np.random.Generator) -> Logical:
    E, H, I, g, b = cfg.E, cfg.H, cfg.I, cfg.g, cfg.bits
    G13, G2 = (H // g, I // g) if g > 0 else (1, 1)
    sd = np.dtype(cfg.sdtype)

    def scales(shape):  # positive, spread over several binades, exact in every scale dtype
        return (rng.integers(1, 256, shape) * 2.0 ** rng.integers(-12, -6, shape)).astype(sd)

    def gidx(k):
        return np.stack([rng.permutation(np.arange(k) // g) for _ in range(E)]).astype(np.int32)

    bias = (lambda n: rng.standard_normal((E, n)).astype(sd)) if cfg.bias else (lambda n: None)
    return Logical(
        c13=rng.integers(0, 1 << b, (E, 2 * I, H)), c2=rng.integers(0, 1 << b, (E, H, I)),
        s13=scales((E, 2 * I, G13)), s2=scales((E, H, G2)),
        z13=rng.integers(0, 1 << b, (E, 2 * I, G13)) if cfg.zp else None,
        z2=rng.integers(0, 1 << b, (E, H, G2)) if cfg.zp else None,
        g13=gidx(H) if cfg.act else None, g2=gidx(I) if cfg.act else None,
        b13=bias(2 * I), b2=bias(H))


def make_checkpoint(cfg: Cfg, L: Logical) -> CheckpointWeights:
    """The loader layout of §1.3–§1.5, built with packing.pack (see weights.py's table)."""
    b = cfg.bits
    T = lambda x: None if x is None else np.ascontiguousarray(np.swapaxes(x, 1, 2))  # noqa: E731
    if cfg.method == "awq":
        order = packing.awq_order(b)
        f = dict(w13_qweight=packing.pack(T(L.c13), b, axis=2, order=order),
                 w2_qweight=packing.pack(T(L.c2), b, axis=2, order=order),
                 w13_scales=T(L.s13), w2_scales=T(L.s2),
                 w13_qzeros=packing.pack(T(L.z13), b, axis=2, order=order),
                 w2_qzeros=packing.pack(T(L.z2), b, axis=2, order=order))
    elif cfg.method == "gptq":
        f = dict(w13_qweight=packing.pack(T(L.c13), b, axis=1),
                 w2_qweight=packing.pack(T(L.c2), b, axis=1),
                 w13_scales=T(L.s13), w2_scales=T(L.s2))
        if cfg.zp:  # v1 stores z - 1 (wrapping); v2 stores z
            d = 0 if cfg.gptq_v2 else 1
            mask = (1 << b) - 1
            f.update(w13_qzeros=packing.pack((T(L.z13) - d) & mask, b, axis=2),
                     w2_qzeros=packing.pack((T(L.z2) - d) & mask, b, axis=2))
    else:
        f = dict(w13_qweight=packing.pack(L.c13, b, axis=2), w2_qweight=packing.pack(L.c2, b, axis=2),
                 w13_scales=L.s13, w2_scales=L.s2)
        if cfg.zp:
            f.update(w13_qzeros=packing.pack(L.z13, b, axis=1),
                     w2_qzeros=packing.pack(L.z2, b, axis=1))
    ck = CheckpointWeights.of(**f, w13_g_idx=L.g13, w2_g_idx=L.g2, w13_bias=L.b13, w2_bias=L.b2,
                              scheme=cfg.scheme, hidden_size=cfg.H, intermediate_size=cfg.I)
    return ck.validate()


def expected_marlin(cfg: Cfg, L: Logical) -> dict[str, np.ndarray | None]:
    """vLLM's pipeline (docs/formats.md §3.1 / §3.1b) in numpy from its formulas (np_repack etc.)."""
    E, H, I, g, b = cfg.E, cfg.H, cfg.I, cfg.g, cfg.bits
    pf = 32 // b
    a8 = cfg.input_dtype in ("float8_e4m3fn", "int8")
    fp8 = cfg.input_dtype == "float8_e4m3fn"
    awq = cfg.method == "awq"
    Ip = spec_padded(I, g)
    T = lambda x: None if x is None else np.swapaxes(x, 1, 2)  # noqa: E731
    # K-first codes / scales / zeros
    q13, q2, s13, s2, z13, z2 = T(L.c13), T(L.c2), T(L.s13), T(L.s2), T(L.z13), T(L.z2)
    if cfg.method == "ct" and I % pf:
        # CT packs K with ceil(K b / 32): the extra code slots of w2's last word hold 0 and
        # go through the (elementwise) fp8 recode with the rest.
        q2 = np.concatenate([q2, np.zeros((E, -I % pf, H), q2.dtype)], axis=1)
    if fp8:
        if awq:
            rows = lambda k: np.arange(k) // g  # noqa: E731  (zero row k // (K / G))
            q13 = np.vectorize(spec_fp8_code)(q13, z13[:, rows(H), :])
            q2 = np.vectorize(spec_fp8_code)(q2, z2[:, rows(I), :])
        else:
            q13 = np.vectorize(lambda u: spec_fp8_code(u, None))(q13)
            q2 = np.vectorize(lambda u: spec_fp8_code(u, None))(q2)
        s13, s2 = s13 * s13.dtype.type(512), s2 * s2.dtype.type(512)

    def pad_halves(x, unit):  # [E, R, 2*I*unit] -> each half padded to Ip*unit
        if x is None:
            return None
        e, r, _ = x.shape
        x = x.reshape(e, r, 2, I * unit)
        x = np.concatenate([x, np.zeros((e, r, 2, (Ip - I) * unit), x.dtype)], axis=-1)
        return x.reshape(e, r, 2 * Ip * unit)

    def pad_rows(x, rows):
        if x is None:
            return None
        return np.concatenate([x, np.zeros((x.shape[0], rows - x.shape[1]) + x.shape[2:], x.dtype)], 1)

    q13, s13, z13 = pad_halves(q13, 1), pad_halves(s13, 1), pad_halves(z13, 1)
    q2 = pad_rows(q2, Ip)
    if g > 0:
        s2, z2 = pad_rows(s2, Ip // g), pad_rows(z2, Ip // g)
    b13 = None
    if L.b13 is not None:
        b13 = pad_halves(L.b13[:, None, :], 1)[:, 0, :]

    out: dict = {}
    perm13 = perm2 = None
    if cfg.act:
        perm13 = np.argsort(L.g13, axis=-1, kind="stable").astype(np.int32)
        perm2 = np.argsort(L.g2, axis=-1, kind="stable").astype(np.int32)
        out["w13_g_idx"] = np.take_along_axis(L.g13, perm13, -1)
        out["w2_g_idx"] = np.take_along_axis(L.g2, perm2, -1)
    out["w13_g_idx_sort_indices"], out["w2_g_idx_sort_indices"] = perm13, perm2
    sort = lambda q, p: q if p is None else np.take_along_axis(q, p[:, :, None], 1)  # noqa: E731
    out["w13_qweight"] = np.stack([np_repack(x, b, a8) for x in sort(q13, perm13)])
    out["w2_qweight"] = np.stack([np_repack(x, b, a8) for x in sort(q2, perm2)])

    k2 = I if awq else s2.shape[1] * (g if g != -1 else pf)          # quirk Q1: w13 uses I
    s13 = np_chunk_perm(s13, spec_scale_perm(spec_grouped_choice(I, g, a8)), True)
    s2 = np_chunk_perm(s2, spec_scale_perm(spec_grouped_choice(k2, g, a8)), True)
    gs13 = gs2 = None
    if cfg.input_dtype == "int8":
        if (H // g if g > 0 else 1) > 1:
            q, gs13 = spec_int8_scales(s13)
            s13 = q.view(s13.dtype)
        if (I // g if g > 0 else 1) > 1:
            q, gs2 = spec_int8_scales(s2)
            s2 = q.view(s2.dtype)
    out.update(w13_scales=s13, w2_scales=s2, w13_input_global_scale=gs13, w2_input_global_scale=gs2)
    out["w13_qzeros"] = None if z13 is None else np.stack([np_zero_points(z, b, a8) for z in z13])
    out["w2_qzeros"] = None if z2 is None else np.stack([np_zero_points(z, b, a8) for z in z2])
    bias_perm = spec_scale_perm(False)
    out["w13_bias"] = None if b13 is None else np_chunk_perm(b13, bias_perm, False)
    out["w2_bias"] = None if L.b2 is None else np_chunk_perm(L.b2, bias_perm, False)
    return out


def _convert_and_decode(scheme, ck, input_dtype):
    mw = M.convert_marlin(scheme, ck, input_dtype)
    return mw, mw.decode(), mw.decode_bias()


convert_and_decode = jax.jit(_convert_and_decode, static_argnums=(0, 2))


def assert_same(name, got, want):
    if want is None:
        assert got is None, f"{name}: expected None"
        return
    assert got is not None, f"{name}: missing"
    got = np.asarray(got)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    if want.dtype.kind == "f":  # compare bits (also for int16 patterns held in fp16/bf16)
        got, want = got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}")
    np.testing.assert_array_equal(got, want, err_msg=name)


def check_pipeline(cfg: Cfg, seed: int) -> None:
    rng = np.random.default_rng(seed)
    L = make_logical(cfg, rng)
    ck = make_checkpoint(cfg, L)
    # the builder means what the loader layout means
    c13, _ = ck.decode()
    np.testing.assert_array_equal(np.asarray(c13.codes), L.c13)

    mw, (l13, l2), biases = jax.tree_util.tree_map(
        np.asarray, convert_and_decode(cfg.scheme, ck, cfg.jnp_input_dtype))

    # -- the Marlin tensors are vLLM's pipeline, bit for bit
    want = expected_marlin(cfg, L)
    for name, w in want.items():
        assert_same(name, getattr(mw, name), w)
    Ip = spec_padded(cfg.I, cfg.g)
    pf = 32 // cfg.bits
    assert mw.w13_qweight.shape == (cfg.E, cfg.H // 16, 2 * Ip * 16 // pf)
    assert mw.w2_qweight.shape == (cfg.E, Ip // 16, cfg.H * 16 // pf)
    assert (mw.intermediate_size, mw.padded_intermediate_size) == (cfg.I, Ip)
    assert mw.is_a_8bit == (cfg.input_dtype in ("float8_e4m3fn", "int8"))

    # -- decode gives back what the checkpoint means
    for lq, codes, scales, zeros, gidx, gs in (
            (l13, L.c13, L.s13, L.z13, L.g13, mw.w13_input_global_scale),
            (l2, L.c2, L.s2, L.z2, L.g2, mw.w2_input_global_scale)):
        np.testing.assert_array_equal(np.asarray(lq.codes), codes)
        assert (lq.bits, lq.group_size) == (cfg.bits, cfg.g)
        if zeros is None:
            assert lq.zeros is None
        else:
            np.testing.assert_array_equal(np.asarray(lq.zeros), zeros)
        if gidx is None:
            assert lq.g_idx is None
        else:
            np.testing.assert_array_equal(np.asarray(lq.g_idx), gidx)
        got_s = np.asarray(lq.scales)
        if gs is not None:
            # int8 activations: the fixed-point scales the kernel applies (int16 value x global
            # scale, float32), exactly; they are within 4096·u + 0.5 steps of the checkpoint's
            q, want_gs = spec_int8_scales(scales)
            assert np.float32(gs) == want_gs
            assert_same("int8 scales", got_s, q.astype(np.float32) * want_gs)
            u = 2.0 ** (-11 if scales.dtype == np.float16 else -8)
            assert np.all(np.abs(got_s - scales.astype(np.float32)) <= (4096 * u + 0.5) * want_gs)
        else:
            assert_same("scales", got_s, scales)
    if cfg.input_dtype != "int8":
        d13, d2 = ck.dequantize(np.float32)
        np.testing.assert_array_equal(l13.dequantize(np.float32), d13)
        np.testing.assert_array_equal(l2.dequantize(np.float32), d2)
    assert_same("w13_bias", biases[0], L.b13)   # both None without bias
    assert_same("w2_bias", biases[1], L.b2)


@given(st.sampled_from(POOL_16), st.integers(0, 2**32 - 1))
def test_convert_marlin_16bit_activations_matches_seed_and_decodes(cfg, seed):
    check_pipeline(cfg, seed)


@given(st.sampled_from(POOL_8), st.integers(0, 2**32 - 1))
def test_convert_marlin_8bit_activations_matches_seed_and_decodes(cfg, seed):
    check_pipeline(cfg, seed)


# ============================================================================ act-order details
def run_pool_config(cfg: Cfg, L: Logical):
    """convert + decode through the same jitted function as the pool properties (shared cache)."""
    return convert_and_decode(cfg.scheme, make_checkpoint(cfg, L), cfg.jnp_input_dtype)


def test_act_order_stable_argsort_ties_and_sorted_g_idx():
    # quirk Q8: ties among equal group ids keep their original order (stable sort)
    cfg = POOL_16[8]
    assert cfg.act and (cfg.H, cfg.I, cfg.g) == (128, 64, 32)
    L = make_logical(cfg, np.random.default_rng(0))
    L.g13 = np.tile(3 - np.arange(128) % 4, (cfg.E, 1)).astype(np.int32)   # 3,2,1,0,3,2,1,0,...
    L.g2 = np.tile([1, 1, 0, 0] * 16, (cfg.E, 1)).astype(np.int32)
    mw, (l13, l2), _ = run_pool_config(cfg, L)
    want13 = [k for grp in range(4) for k in range(128) if 3 - k % 4 == grp]
    np.testing.assert_array_equal(mw.w13_g_idx_sort_indices[1], want13)
    np.testing.assert_array_equal(mw.w13_g_idx[1], np.repeat(np.arange(4), 32))
    np.testing.assert_array_equal(
        mw.w2_g_idx_sort_indices[0],
        [k for k in range(64) if k % 4 >= 2] + [k for k in range(64) if k % 4 < 2])
    assert mw.w13_g_idx_sort_indices.dtype == jnp.int32 and mw.w13_g_idx.dtype == jnp.int32
    np.testing.assert_array_equal(l13.g_idx, L.g13)
    np.testing.assert_array_equal(l2.g_idx, L.g2)
    np.testing.assert_array_equal(l2.codes, L.c2)


def test_padding_regions_are_zero():
    cfg = POOL_16[3]
    assert (cfg.I, cfg.g, cfg.bias) == (96, 32, True)
    L = make_logical(cfg, np.random.default_rng(1))
    mw, _, _ = run_pool_config(cfg, L)
    E, H, Ip = cfg.E, cfg.H, 128
    s13 = np.asarray(M.marlin_moe_unpermute_scales(mw.w13_scales, 96, 2 * Ip, 32))
    assert np.all(s13.reshape(E, -1, 2, Ip)[..., 96:] == 0)        # padded w13 channels: scale 0
    assert np.all(s13.reshape(E, -1, 2, Ip)[..., :96] != 0)
    q2 = np.asarray(M.marlin_moe_unrepack(mw.w2_qweight, None, Ip, H, 4))
    assert np.all(q2[:, 96:] == 0)                                    # padded w2 rows: code 0
    b13 = np.asarray(M.marlin_unpermute_bias(mw.w13_bias)).reshape(E, 2, Ip)
    assert np.all(b13[..., 96:] == 0)
    assert mw.w2_scales.shape == (E, Ip // 32, H)                     # w2 groups padded 3 -> 4


# ============================================================================ pytree behaviour, jit
def test_marlin_weights_pytree_take_experts_and_global_scales():
    cfg = POOL_8[4]
    assert cfg.input_dtype == "int8" and cfg.bias and cfg.E == 2
    L = make_logical(cfg, np.random.default_rng(2))
    mw, _, _ = run_pool_config(cfg, L)
    assert mw.w13_input_global_scale.shape == () and mw.w2_input_global_scale.shape == ()
    assert "w13_input_global_scale" not in mw.array_fields()
    sub = mw.take_experts(jnp.array([1, 0]))
    assert sub.num_experts == 2 and sub.w13_bias.shape[0] == 2
    assert sub.w13_input_global_scale is mw.w13_input_global_scale
    l13, _ = sub.decode()
    np.testing.assert_array_equal(l13.codes, L.c13[[1, 0]])
    np.testing.assert_array_equal(sub.decode_bias()[1], L.b2[[1, 0]])
    leaves, tree = jax.tree_util.tree_flatten(mw)
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert again.scheme == mw.scheme and again.input_dtype == "int8" and again.is_a_8bit
    with pytest.raises(dataclasses.FrozenInstanceError):
        mw.hidden_size = 1  # type: ignore[misc]


def test_every_converter_runs_under_jit():
    """Each public converter, called inside one outer jax.jit (sizes static), equals its direct
    call (the public functions are themselves jitted per shape)."""
    rng = np.random.default_rng(5)
    Q = rng.integers(0, 16, (2, 32, 64))
    perm = np.stack([rng.permutation(32) for _ in range(2)]).astype(np.int32)
    s = (rng.standard_normal((2, 2, 64)) + 4).astype(np.float16)
    Z = rng.integers(0, 16, (2, 2, 64))
    data = dict(q=pack_rows(Q, 4), qa=awq_pack(Q, 4), perm=perm, s=s, Z=Z,
                zs=packing.pack(Z, 4, axis=-1), za=awq_pack(Z, 4))
    kw = dict(size_k=32, size_n=64, num_bits=4, is_a_8bit=False)
    skw = dict(size_k=64, size_n=64, group_size=32, is_a_8bit=False)
    zkw = dict(size_k=2, size_n=64, num_bits=4, is_a_8bit=False)

    def everything(d):
        m = M.gptq_marlin_moe_repack(d["q"], d["perm"], **kw)
        out = dict(
            dense=M.gptq_marlin_repack(d["q"][0], d["perm"][0], **kw),
            moe=m,
            awq=M.awq_marlin_repack(d["qa"][0], None, **kw),
            awq_moe=M.awq_marlin_moe_repack(d["qa"], None, **kw),
            un=M.marlin_unrepack(m[0], d["perm"][0], **kw),
            un_moe=M.marlin_moe_unrepack(m, d["perm"], **kw),
            s=M.marlin_permute_scales(d["s"][0], **skw),
            s_moe=M.marlin_moe_permute_scales(d["s"], **skw),
            s_un=M.marlin_unpermute_scales(d["s"][0], **skw),
            s_un_moe=M.marlin_moe_unpermute_scales(d["s"], **skw),
            zp=M.marlin_zero_points(d["Z"][0], **zkw),
            zp_awq=M.awq_to_marlin_zero_points(d["za"][0], **zkw),
            zp_awq_moe=M.moe_awq_to_marlin_zero_points(d["za"], **zkw),
            zp_std_moe=M.moe_packed_to_marlin_zero_points(d["zs"], **zkw),
            bias=M.marlin_permute_bias(d["s"][:, 0]),
            bias_un=M.marlin_unpermute_bias(d["s"][:, 0]),
            fp8=M.marlin_int4_fp8_preprocess(d["q"]),
            fp8_awq=M.marlin_int4_fp8_preprocess(d["qa"], d["za"]),
            int8=M.marlin_act_int8_process_scales(d["s"]),
        )
        out["zp_dec"] = M.marlin_zero_points_decode(out["zp"], **zkw)
        out["zp_dec_moe"] = M.moe_marlin_zero_points_decode(out["zp_std_moe"], **zkw)
        out["fp8_undo"] = M.marlin_int4_fp8_unpreprocess_codes(packing.unpack(out["fp8"], 4, axis=1))
        out["int8_undo"] = M.marlin_act_int8_unprocess_scales(*out["int8"])
        return out

    got = jax.tree_util.tree_map(np.asarray, jax.jit(everything)(data))
    # every output against the docs/formats.md transcriptions of this file
    E = 2
    np.testing.assert_array_equal(got["dense"], np_repack(Q[0][perm[0]], 4, False))
    np.testing.assert_array_equal(got["moe"], np.stack([np_repack(Q[e][perm[e]], 4, False)
                                                        for e in range(E)]))
    np.testing.assert_array_equal(got["awq"], np_repack(Q[0], 4, False))
    np.testing.assert_array_equal(got["awq_moe"], np.stack([np_repack(Q[e], 4, False)
                                                            for e in range(E)]))
    np.testing.assert_array_equal(got["un"], Q[0])
    np.testing.assert_array_equal(got["un_moe"], Q)
    grouped = spec_scale_perm(True)                        # g=32 < size_k=64, 16-bit act
    np.testing.assert_array_equal(got["s"], np_chunk_perm(s[0], grouped, False))
    np.testing.assert_array_equal(got["s_moe"], np_chunk_perm(s, grouped, True))
    np.testing.assert_array_equal(np_chunk_perm(got["s_un"], grouped, False), s[0])
    np.testing.assert_array_equal(np_chunk_perm(got["s_un_moe"], grouped, True), s)
    zp = np.stack([np_zero_points(Z[e], 4, False) for e in range(E)])
    for name in ("zp", "zp_awq"):
        np.testing.assert_array_equal(got[name], zp[0])
    for name in ("zp_awq_moe", "zp_std_moe"):
        np.testing.assert_array_equal(got[name], zp)
    np.testing.assert_array_equal(got["zp_dec"], Z[0])
    np.testing.assert_array_equal(got["zp_dec_moe"], Z)
    single = spec_scale_perm(False)
    np.testing.assert_array_equal(got["bias"], np_chunk_perm(s[:, 0], single, False))
    np.testing.assert_array_equal(np_chunk_perm(got["bias_un"], single, False), s[:, 0])
    fp8 = np.vectorize(lambda u: spec_fp8_code(u, None))(Q)
    np.testing.assert_array_equal(packing.unpack(got["fp8"], 4, axis=1), fp8)
    Qa = Q                                                 # qa packs [E, K=32, N=64] along N
    Za = Z[:, np.arange(32) // 16, :]                      # 2 zero rows for 32 rows: k // 16
    np.testing.assert_array_equal(
        packing.unpack(got["fp8_awq"], 4, axis=2, order=packing.awq_order(4)),
        np.vectorize(spec_fp8_code)(Qa, Za))
    np.testing.assert_array_equal(got["fp8_undo"], Q)
    q16, gs = spec_int8_scales(s)
    np.testing.assert_array_equal(i16_bits(got["int8"][0]), q16)
    assert got["int8"][1] == gs
    np.testing.assert_array_equal(got["int8_undo"], q16.astype(np.float32) * gs)

    # convert_marlin: direct call (jitted internally) == the pool's outer-jitted conversion
    cfg = POOL_8[0]
    ck = make_checkpoint(cfg, make_logical(cfg, rng))
    direct_mw = M.convert_marlin(cfg.scheme, ck, jnp.float8_e4m3fn)
    by_name = M.convert_marlin(cfg.scheme, ck, "float8_e4m3fn")     # dtype names work too
    outer_mw, _, _ = convert_and_decode(cfg.scheme, ck, jnp.float8_e4m3fn)
    for other in (by_name, outer_mw):
        assert jax.tree_util.tree_structure(direct_mw) == jax.tree_util.tree_structure(other)
        for a, b in zip(jax.tree_util.tree_leaves(direct_mw), jax.tree_util.tree_leaves(other)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ============================================================================ bad input
def _ck(cfg: Cfg, seed: int = 0, **changes) -> CheckpointWeights:
    ck = make_checkpoint(cfg, make_logical(cfg, np.random.default_rng(seed)))
    return ck.replace(**changes) if changes else ck


@pytest.mark.parametrize("fn,args,exc,words", [
    (M.gptq_marlin_repack, (np.zeros((3, 64), np.int32), None, 24, 64, 4), ShapeError,
     ["b_q_weight", "size_k=24", "16"]),
    (M.gptq_marlin_repack, (np.zeros((4, 96), np.int32), None, 32, 96, 4), ShapeError,
     ["b_q_weight", "size_n=96", "64"]),
    (M.gptq_marlin_repack, (np.zeros((6, 64), np.int32), None, 48, 64, 4, True), ShapeError,
     ["b_q_weight", "size_k=48", "32"]),
    (M.gptq_marlin_repack, (np.zeros((4, 128), np.int32), None, 16, 64, 4), ShapeError,
     ["b_q_weight", "(4, 128)", "(2, 64)"]),
    (M.gptq_marlin_moe_repack, (np.zeros((2, 2, 64), np.int32), np.zeros((2, 8), np.int32),
                                16, 64, 4), ShapeError, ["perm", "(2, 8)", "(2, 16)"]),
    (M.awq_marlin_repack, (np.zeros((16, 64), np.int32), None, 16, 64, 4), ShapeError,
     ["b_q_weight", "(16, 64)", "(16, 8)"]),
    (M.gptq_marlin_repack, (np.zeros((2, 64), np.int32), None, 16, 64, 3), ConfigError,
     ["num_bits", "3"]),
    (M.marlin_permute_scales, (np.zeros((2, 64), np.float16), 64, 128, 32), ShapeError,
     ["s", "size_n=128", "(2, 64)"]),
    (M.marlin_permute_bias, (np.zeros((2, 20), np.float16),), ShapeError, ["bias", "40", "32"]),
    (M.marlin_zero_points, (np.zeros((2, 96), np.int32), 2, 96, 4), ShapeError,
     ["zp", "size_n=96", "64"]),
    (M.moe_awq_to_marlin_zero_points, (np.zeros((2, 2, 8), np.int32), 2, 128, 4), ShapeError,
     ["q_zp_packed", "(2, 2, 8)", "(2, 2, 16)"]),
    (M.marlin_int4_fp8_preprocess, (np.zeros((8, 4), np.int32), np.zeros((3, 4), np.int32)),
     ShapeError, ["qzeros", "3", "8"]),
    (M.marlin_int4_fp8_preprocess, (np.zeros((8, 4), np.int64),), DTypeError, ["qweight", "int64"]),
    (M.marlin_act_int8_process_scales, (np.ones((2, 4), np.float32),), DTypeError, ["s", "float32"]),
])
def test_helper_errors_name_tensor_and_value(fn, args, exc, words):
    with pytest.raises(exc) as info:
        fn(*args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_convert_errors_name_tensor_and_value():
    gptq = Cfg("gptq", 4, False, 32, 1, 64, 64)
    with pytest.raises(UnsupportedError, match=r"input_dtype.*float32"):
        M.convert_marlin(gptq.scheme, _ck(gptq), jnp.float32)
    with pytest.raises(UnsupportedError, match=r"input_dtype.*float8_e5m2"):
        M.convert_marlin(gptq.scheme, _ck(gptq), jnp.float8_e5m2)
    with pytest.raises(UnsupportedError, match=r"input_dtype.*'fp4'"):
        M.convert_marlin(gptq.scheme, _ck(gptq), "fp4")

    awq = Cfg("awq", 4, True, 32, 1, 64, 64)
    with pytest.raises(MissingTensorError, match="w13_qzeros: required by awq 4-bit g32 asym"):
        M.convert_marlin(awq.scheme, _ck(awq, w13_qzeros=None, w2_qzeros=None))
    awq_sym = dataclasses.replace(awq.scheme, zero_point=False)      # AWQ with zero_point=False
    with pytest.raises(UnsupportedError, match="AWQ Marlin MoE requires zero-point tensors"):
        M.convert_marlin(awq_sym, _ck(awq, w13_qzeros=None, w2_qzeros=None, scheme=awq_sym))

    act_pad = Cfg("gptq", 4, False, 32, 1, 64, 96, act=True)
    with pytest.raises(UnsupportedError, match=r"intermediate_size.*96 -> 128.*act-order"):
        M.convert_marlin(act_pad.scheme, _ck(act_pad))

    g8 = Cfg("gptq", 8, False, 32, 1, 64, 64)
    with pytest.raises(UnsupportedError, match=r"float8_e4m3fn.*8-bit"):
        M.convert_marlin(g8.scheme, _ck(g8), jnp.float8_e4m3fn)

    ct8z = Cfg("ct", 8, True, 32, 1, 64, 64)
    with pytest.raises(UnsupportedError, match=r"w13_qzeros.*8-bit"):
        M.convert_marlin(ct8z.scheme, _ck(ct8z))

    ctz = Cfg("ct", 4, True, 32, 1, 64, 64)
    with pytest.raises(UnsupportedError, match=r"float8_e4m3fn.*w13_qzeros"):
        M.convert_marlin(ctz.scheme, _ck(ctz), jnp.float8_e4m3fn)

    h96 = Cfg("gptq", 4, False, 32, 1, 96, 64)
    with pytest.raises(ShapeError, match=r"hidden_size: 96 .*64"):
        M.convert_marlin(h96.scheme, _ck(h96))

    f32 = Cfg("gptq", 4, False, 32, 1, 64, 64, sdtype="float32")
    with pytest.raises(DTypeError, match=r"s: .*float32"):
        M.convert_marlin(f32.scheme, _ck(f32), jnp.int8)

    other = Cfg("ct", 4, False, 32, 1, 64, 64).scheme
    with pytest.raises(ConfigError, match="scheme"):
        M.convert_marlin(other, _ck(gptq))

    # is_a_8bit tile: 8-bit activations need size_n % 32 only, 16-bit need % 64
    assert M.gptq_marlin_repack(np.zeros((4, 32), np.int32), None, 32, 32, 4, True).shape == (2, 64)
