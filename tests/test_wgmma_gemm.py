"""The wgmma grouped GEMM (Hopper, Mosaic GPU: :mod:`pallas_kernels.wgmma_gemm` and its kernel
forms plain / ``ws`` / the ``ws`` stream): the weight layout's indexing and the nibble
arithmetic replayed in numpy, the gate/up interleave, :class:`GemmConfig`'s validation, the
arrays' checks, the lowering to Mosaic GPU of every form and option combination on the CPU, the
stream's index math, the jnp reference (:func:`wgmma_grouped_gemm_reference`) against float64 on
the CPU, and on a Hopper GPU the kernel against float64 in every case. Fresh random data."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine_helpers import close, cpu_only, gated64, gpu, kernel_case, needs_hopper, weights64
from pallas_kernels.errors import KernelConfigError, KernelDTypeError, KernelShapeError
from pallas_kernels.wgmma_common import LOP3_AND_OR
from pallas_kernels.wgmma_config import SMEM_LIMIT, TRANSPOSED_STORE, GemmConfig, wgmma_smem_bytes
from pallas_kernels.wgmma_gemm import check_gemm, wgmma_grouped_gemm, wgmma_grouped_gemm_reference
from pallas_kernels.wgmma_layout import (deinterleave_gate_up, from_wgmma_layout, interleave_gate_up, magic,
                                         magic_value, to_wgmma_layout)
from pallas_kernels.wgmma_ws_stream import stream_item, stream_share, stream_tail
from pallas_kernels.wna16_grouped_gemm import pack_tiles

BF16, F16 = jnp.bfloat16, jnp.float16


def wgmma_case(rng, zp, group, bm, k=512, n=256, exact=False, dtype=BF16):
    """A 4-block wgmma GEMM case (experts 0, 1, 2 and one id -1 block, in random order) →
    ``(a, expert_ids, (words, scales, zeros), ref)``; ``ref`` in float64 from the
    ``dtype``-rounded weight values (the dequantize-then-matmul semantics), or with ``exact`` from
    the unrounded ``(c − z)·s`` (what the scale fold, ``sfold``, computes)."""
    codes, scales, zeros = kernel_case(rng, 4, group, zp, e=3, n=n, k=k)
    eids = np.array(rng.permutation([0, 1, 2, -1]), np.int32)
    a = jnp.asarray(rng.standard_normal((4 * bm, k)), dtype)
    lay = to_wgmma_layout(pack_tiles(jnp.asarray(codes), 4), jnp.asarray(scales, dtype),
                          None if zeros is None else jnp.asarray(zeros, jnp.uint8), dtype)
    if exact:                                   # scales as stored, unrounded products
        w = weights64(codes, np.asarray(jnp.asarray(scales, dtype).astype(jnp.float32)), zeros, 4, group,
                      dtype=jnp.float32)
    else:
        w = weights64(codes, scales, zeros, 4, group, dtype=dtype)
    af = np.asarray(a.astype(jnp.float32), np.float64).reshape(4, bm, k)
    ref = np.concatenate([af[b] @ w[ex] if ex >= 0 else np.zeros((bm, n)) for b, ex in enumerate(eids)])
    return a, eids, lay, ref


# ----------------------------------------------------------------------------- the layout


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("zp, group", [(True, 128), (False, -1)])
def test_wgmma_layout_indexing(zp, group, fold):
    """The kernel's arithmetic, replayed in numpy with exactly its indexing, against the float64
    reference — the layout half of the kernel, checked without a GPU. 16-bit words: tile
    ``[n, 32·kb + 16·u : +16]``, nibble ``t`` → row ``128·kb + 64·u + 16·t + w``, value
    ``(magic | c) − zero`` with the zero stored as magic + z (magic + 8 when symmetric), times the
    scale rounded to bf16; ``sfold`` (``fold``): per K-block, ``acc += s ⊙ Σ ((magic | c) − (magic + z))·x``."""
    rng = np.random.default_rng()
    bm = 16
    a, eids, (words, scales, zeros), ref = wgmma_case(rng, zp, group, bm, exact=fold)
    k = a.shape[1]
    out = np.zeros(ref.shape)
    for b, ex in enumerate(eids):
        if ex < 0:
            continue
        x = np.asarray(a[b * bm:(b + 1) * bm].astype(jnp.float32), np.float64)
        for kb in range(k // 128):
            g = 0 if group == -1 else kb
            sc = np.asarray(scales[ex, g].astype(jnp.float32))
            zc = np.full(sc.shape, magic_value(BF16) + 8, np.float32) if zeros is None else \
                np.asarray(zeros[ex, g].astype(jnp.float32))
            steps = []
            for u in range(2):
                wt = np.asarray(words[ex, :, kb * 32 + 16 * u: kb * 32 + 16 * u + 16]).view(np.uint16)
                for t in range(4):
                    bits = ((wt >> (4 * t)) & 15) | magic(BF16)
                    steps.append((64 * u + 16 * t, np.asarray(jax.lax.bitcast_convert_type(
                        jnp.asarray(bits.astype(np.uint16)), BF16).astype(jnp.float32))))
            if fold:                    # c − z exact in bf16 (both magic-biased): one scale per K-block
                xb = x[:, kb * 128:(kb + 1) * 128]
                part = sum(xb[:, k0:k0 + 16] @ (codes.astype(np.float64) - zc[:, None]).T for k0, codes in steps)
                out[b * bm:(b + 1) * bm] += part * sc[None, :]
                continue
            for k0, codes in steps:
                wv = jnp.asarray((codes.astype(np.float32) - zc[:, None]) * sc[:, None], jnp.float32).astype(BF16)
                out[b * bm:(b + 1) * bm] += x[:, kb * 128 + k0: kb * 128 + k0 + 16] @ \
                    np.asarray(wv.astype(jnp.float32), np.float64).T
    close(out, ref)


def test_wgmma_nibble_planes_bit_identity():
    """The kernel's nibble planes (``wgmma_common.nibble_planes``): one 32-bit
    ``(w >> 4t) & 0x000F000F | magic·0x10001`` on two adjacent 16-bit words (little-endian: the
    first word in the low half, as a WGMMA-layout register holds them) is, half by half, the
    16-bit ``(h >> 4t) & 15 | magic`` — for every word value, both dtypes' magic numbers — and
    the and/or is PTX's ``lop3.b32`` with the kernel's lookup table, emulated here bit by bit
    from PTX's definition (result bit = table bit number ``4a + 2b + c`` of the operands' bits)."""
    def lop3(a, b, c, lut):
        bits = [(a >> i & 1) * 4 + (b >> i & 1) * 2 + (c >> i & 1) for i in range(32)]
        return sum(((np.uint32(lut) >> idx.astype(np.uint32)) & 1) << np.uint32(i) for i, idx in enumerate(bits))

    rng = np.random.default_rng()
    lo = np.arange(1 << 16, dtype=np.uint32)
    hi = rng.permutation(lo)
    pair = lo | (hi << 16)
    assert LOP3_AND_OR == 0xEA
    for dt in (BF16, F16):
        m = magic(dt)
        assert np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(np.uint16(m | 5)), dt).astype(jnp.float32)) == \
            magic_value(dt) + 5
        for t in range(4):
            got = ((pair >> (4 * t)) & 0x000F000F) | (m * 0x10001)
            np.testing.assert_array_equal(got & 0xFFFF, ((lo >> (4 * t)) & 15) | m)
            np.testing.assert_array_equal(got >> 16, ((hi >> (4 * t)) & 15) | m)
            by_lop3 = lop3(pair >> (4 * t), np.uint32(0x000F000F), np.uint32(m * 0x10001), LOP3_AND_OR)
            np.testing.assert_array_equal(by_lop3.astype(np.uint32), got)


@pytest.mark.parametrize("dt", [BF16, F16])
def test_wgmma_layout_round_trip(dt):
    """``from_wgmma_layout`` inverts ``to_wgmma_layout``'s words bit-exactly; the zero points are
    stored biased by the dtype's magic number, the scales in the activation dtype."""
    rng = np.random.default_rng()
    codes, scales, zeros = kernel_case(rng, 4, 128, True, e=2, n=192, k=384)
    tiles = pack_tiles(jnp.asarray(codes), 4)
    words, sc, z = to_wgmma_layout(tiles, jnp.asarray(scales), jnp.asarray(zeros, jnp.uint8), dt)
    assert words.dtype == jnp.int16 and words.shape == (2, 192, 96)
    assert sc.dtype == dt and z.dtype == dt
    np.testing.assert_array_equal(np.asarray(from_wgmma_layout(words)), np.asarray(tiles))
    np.testing.assert_array_equal(np.asarray(z.astype(jnp.float32)), zeros + magic_value(dt))
    assert to_wgmma_layout(tiles, jnp.asarray(scales), None, dt)[2] is None


def test_gate_up_interleave_order():
    """The gated epilogue's column order: tile j holds gate columns 64j… then up columns I+64j…,
    along any axis, numpy or jax; the inverse restores the order; 2·I not a multiple of 128 is a
    shape error naming the size."""
    i = 192
    x = np.arange(2 * i)
    y = interleave_gate_up(x, 0)
    j, c = np.divmod(np.arange(2 * i), 128)
    np.testing.assert_array_equal(y, np.where(c < 64, 64 * j + c, i + 64 * j + c - 64))
    z = jnp.asarray(np.random.default_rng().standard_normal((3, 2 * i, 5)))
    np.testing.assert_array_equal(np.asarray(deinterleave_gate_up(interleave_gate_up(z, 1), -2)), np.asarray(z))
    np.testing.assert_array_equal(np.asarray(interleave_gate_up(z, 1))[1, :, 2], np.asarray(z)[1, y, 2])
    with pytest.raises(KernelShapeError, match="2·I = 320"):
        interleave_gate_up(np.zeros((2, 320)), 1)


# ----------------------------------------------------------------------------- the configuration


def test_gemm_config_validation():
    """``GemmConfig`` checks at construction every rule that does not depend on the arrays, with a
    ``KernelConfigError`` naming the option; it is frozen and hashable (the jitted GEMM's static
    argument)."""
    bad = [(dict(block_m=12), "block_m: expected a multiple of 8"), (dict(block_m=264), "block_m"),
           (dict(block_m=16.0), "block_m: expected an integer"), (dict(block_m=16, block_n=96), "block_n"),
           (dict(block_m=16, block_n=256), "block_n"), (dict(block_m=16, kpb=3), "kpb"),
           (dict(block_m=16, split_k=0), "split_k and stages"), (dict(block_m=16, stages=0), "split_k and stages"),
           (dict(block_m=16, group_size=64), "group_size"), (dict(block_m=16, wide=1, kpb=2), "wide: expected a bool"),
           (dict(block_m=16, sfold="yes"), "sfold: expected a bool"),
           (dict(block_m=16, wide=True), "wide=True needs kpb=2"),
           (dict(block_m=16, wide=True, kpb=4), "wide=True needs kpb=2"),
           (dict(block_m=64, ws=True, group_size=-1), "ws=True takes group-128"),
           (dict(block_m=48, stream=True), "stream=True .* needs ws=True"),
           (dict(block_m=48, programs=3), "programs=3 needs stream=True"),
           (dict(block_m=48, ws=True, stream=True, programs=0), "programs=0 needs stream=True and programs >= 1"),
           (dict(block_m=16, split_k=2, out16=True), "out16=True needs split_k=1"),
           (dict(block_m=16, tout=True), "tout=True needs out16=True"),
           (dict(block_m=16, block_n=128, gated="gelu"), "gated='gelu'"),
           (dict(block_m=16, gated="silu"), "gated='silu' needs .* block_n=128"),
           (dict(block_m=16, block_n=128, split_k=2, gated="silu"), "split_k=1")]
    if not TRANSPOSED_STORE:            # jax 0.10: a clear error, not Mosaic GPU's
        bad.append((dict(block_m=16, out16=True, tout=True), r"tout=True needs jax >= 0.11"))
    for kw, msg in bad:
        with pytest.raises(KernelConfigError, match=msg):
            GemmConfig(**kw)
    cfg = GemmConfig(block_m=48, block_n=128, kpb=2, wide=True, sfold=True, ws=True, stream=True, programs=5,
                     out16=True, tout=TRANSPOSED_STORE, gated="silu", stages=2)
    assert hash(cfg) == hash(dataclasses.replace(cfg)) and cfg == dataclasses.replace(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stages = 3
    assert GemmConfig(block_m=np.int64(24)).block_m == 24                      # numpy integers are integers


def test_wgmma_smem_bytes():
    """The shared-memory model: every ring buffer grows with the stages, ``ws`` holds two column
    tiles, zero points and the output tile (``tout``) add their buffers, the stream keeps its
    output tile beside the ring."""
    base = dict(block_m=64, block_n=128, kpb=2, stages=2, n_blocks=8)
    b = wgmma_smem_bytes(**base)
    assert wgmma_smem_bytes(**{**base, "stages": 3}) > b
    assert wgmma_smem_bytes(**base, ws=True) > b and wgmma_smem_bytes(**base, has_zp=False) < b
    assert wgmma_smem_bytes(**base, tout=True) >= b
    assert wgmma_smem_bytes(**base, ws=True, tout=True) > wgmma_smem_bytes(**base, ws=True)
    assert wgmma_smem_bytes(**base, ws=True, stream=True, tout=True) > wgmma_smem_bytes(**base, ws=True, stream=True)
    assert wgmma_smem_bytes(**base, row_scale=True) > b
    assert wgmma_smem_bytes(block_m=64, block_n=128, kpb=2, stages=4, n_blocks=2, ws=True) > SMEM_LIMIT


def _abstract(bm, rows=3, n=256, k=512, dt=BF16, zp=True, group=128, rs=False):
    """ShapeDtypeStructs of a GEMM's arguments: ``rows`` blocks of ``bm`` rows, 4 experts."""
    s = jax.ShapeDtypeStruct
    g = 1 if group == -1 else k // 128
    return (s((rows * bm, k), dt), s((rows,), jnp.int32), s((4, n, k // 4), jnp.int16), s((4, g, n), dt),
            s((4, g, n), dt) if zp else None, s((rows * bm,), jnp.float32) if rs else None)


def test_wgmma_rejects_bad_input():
    """The arrays against the configuration (``check_gemm``): typed errors naming the tensor,
    raised while tracing (before any GPU lowering), by the kernel and by its jnp reference alike."""
    a = jnp.zeros((32, 256), BF16)
    ids = jnp.zeros((2,), jnp.int32)
    w16 = jnp.zeros((3, 128, 64), jnp.int16)
    sc = jnp.ones((3, 2, 128), BF16)
    cfg = GemmConfig(block_m=16)
    for fn in (wgmma_grouped_gemm, wgmma_grouped_gemm_reference):
        with pytest.raises(KernelDTypeError, match="words"):
            fn(a, ids, w16.astype(jnp.int8), sc, config=cfg)
        with pytest.raises(KernelDTypeError, match="words"):                    # 32-bit words are gone
            fn(a, ids, jnp.zeros((3, 128, 32), jnp.int32), sc, config=cfg)
        with pytest.raises(KernelDTypeError, match="scales"):
            fn(a, ids, w16, sc.astype(jnp.float32), config=cfg)
        with pytest.raises(KernelShapeError, match="zeros"):
            fn(a, ids, w16, sc, sc[:, :1], config=cfg)
        with pytest.raises(KernelDTypeError, match="a: expected"):
            fn(a.astype(jnp.float32), ids, w16, sc, config=cfg)
        with pytest.raises(KernelShapeError, match="a must hold 2 blocks of block_m=8 rows, got 32"):
            fn(a, ids, w16, sc, config=GemmConfig(block_m=8))
        with pytest.raises(KernelShapeError, match="K = 4·words.shape"):
            fn(a[:, :128], ids, w16, sc, config=cfg)
        with pytest.raises(KernelConfigError, match="split_k=3 must divide the 2 K-blocks"):
            fn(a, ids, w16, sc, config=GemmConfig(block_m=16, split_k=3))
        with pytest.raises(KernelConfigError, match="kpb=2 the 1 K-blocks per split"):
            fn(a, ids, w16, sc, config=GemmConfig(block_m=16, kpb=2, split_k=2))
        with pytest.raises(KernelConfigError, match="block_n=128 must divide N=192"):
            fn(a, ids, jnp.zeros((3, 192, 64), jnp.int16), jnp.ones((3, 2, 192), BF16),
               config=GemmConfig(block_m=16, block_n=128))
        with pytest.raises(KernelShapeError, match=r"row_scale: expected float32 of shape \(32,\)"):
            fn(a, ids, w16, sc, row_scale=jnp.ones((16,), jnp.float32), config=cfg)
        with pytest.raises(KernelDTypeError, match="row_scale: expected float32"):
            fn(a, ids, w16, sc, row_scale=jnp.ones((32,), BF16), config=cfg)
        with pytest.raises(KernelConfigError, match="config: expected a GemmConfig"):
            check_gemm(a, ids, w16, sc, None, None, dict(block_m=16))
    s = jax.ShapeDtypeStruct
    big = (s((128, 2048), BF16), s((2,), jnp.int32), s((2, 256, 512), jnp.int16), s((2, 16, 256), BF16),
           s((2, 16, 256), BF16))                # a program that would not fit the H100/H200's shared memory
    with pytest.raises(KernelConfigError, match="shared memory"):
        wgmma_grouped_gemm.trace(*big, config=GemmConfig(block_m=64, block_n=128, ws=True, kpb=2, wide=True,
                                                         stages=4))
    wgmma_grouped_gemm.trace(*big, config=GemmConfig(block_m=64, block_n=128, ws=True, kpb=2, wide=True, stages=3))
    many = _abstract(8, rows=8193, n=128, k=256)[:4]                              # the ids copy: 256 rows of 32
    with pytest.raises(KernelShapeError, match="8193 blocks > 8192"):
        check_gemm(*many, None, None, GemmConfig(block_m=8))
    with pytest.raises(KernelShapeError, match="8192 blocks > 8191"):            # the stream's extra slot
        check_gemm(*_abstract(8, rows=8192, n=256, k=256)[:4], None, None,
                   GemmConfig(block_m=8, ws=True, stream=True, stages=1))
    ws_args = _abstract(64, n=192)
    with pytest.raises(KernelConfigError, match="ws=True needs N=192 a multiple of 2·block_n=128"):
        check_gemm(*ws_args, GemmConfig(block_m=64, ws=True))
    pw = _abstract(48, n=512, k=1024, rs=True)                       # 8 steps of 128
    with pytest.raises(KernelConfigError, match="stages dividing the 8 steps"):
        check_gemm(*pw[:5], None, GemmConfig(block_m=48, block_n=128, ws=True, stream=True, stages=3))
    with pytest.raises(KernelConfigError, match="stream=True .* takes no row_scale"):
        check_gemm(*pw, GemmConfig(block_m=48, block_n=128, ws=True, stream=True, stages=2))


# ----------------------------------------------------------------------------- lowering (CPU)


def _lower(cfg, args):
    text = wgmma_grouped_gemm.trace(*args, config=cfg).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, cfg
    return text


def _shape(cfg, args):
    return jax.eval_shape(functools.partial(wgmma_grouped_gemm, config=cfg), *args)


@cpu_only
def test_wgmma_plain_lowers_to_mosaic_gpu():
    """The plain form lowers to Mosaic GPU in every option combination: both dtypes, zero points
    or not, K splits, channelwise scales, 128- / 256- / 512-deep steps (``kpb``), ``wide`` 128-byte
    word tiles, the scale fold (``sfold``), row scales, the 16-bit output (``out16``; ``tout``'s
    ``[M, N]`` store where jax has it), the gated epilogue, 300 blocks; the nibble planes as one
    inline ``lop3.b32`` each."""
    for dt in (BF16, F16):
        for zp in (True, False):
            _lower(GemmConfig(block_m=16, split_k=2), _abstract(16, dt=dt, zp=zp))
    _lower(GemmConfig(block_m=64, group_size=-1, stages=4), _abstract(64, rows=2, n=512, k=1024, group=-1, zp=False))
    _lower(GemmConfig(block_m=16, block_n=128, kpb=2), _abstract(16))
    _lower(GemmConfig(block_m=16, kpb=4, stages=2), _abstract(16, k=1024))
    for bn, zp in ((128, True), (64, False)):            # wide: 128-byte swizzled [bn, 64] word tiles
        _lower(GemmConfig(block_m=16, block_n=bn, kpb=2, wide=True, stages=4), _abstract(16, zp=zp))
    for opts in (dict(block_n=128), dict(block_n=64, kpb=2, wide=True)):
        for dt in (BF16, F16):                   # each plane's mask-and-magic: one inline lop3.b32
            text = _lower(GemmConfig(block_m=16, **opts), _abstract(16, dt=dt))
            assert f"lop3.b32 $0, $1, 0x000F000F, {magic(dt) * 0x10001:#010x}, 0xea" in text
    for opts in (dict(block_n=128), dict(block_n=64, kpb=2, wide=True, split_k=2)):       # sfold
        for gs in (128, -1):
            for dt in (BF16, F16):
                _lower(GemmConfig(block_m=8, group_size=gs, sfold=True, **opts),
                       _abstract(8, dt=dt, group=gs, zp=gs == 128))
    sf24 = dict(block_m=24, block_n=128, kpb=2, wide=True, sfold=True, stages=2, out16=True, gated="silu")
    for tout in (False, True) if TRANSPOSED_STORE else (False,):                  # the 24-row decode fold
        _lower(GemmConfig(**sf24, tout=tout), _abstract(24))
    many = _abstract(16, rows=300, n=128, k=256)         # 300 blocks: the ids copy stays within TMA's 256
    _lower(GemmConfig(block_m=16), many)
    o16 = _abstract(16, rows=4, n=512, k=1024)
    for opts in (dict(block_n=128), dict(kpb=2, wide=True, stages=2), dict(kpb=2, wide=True, sfold=True)):
        for tout in (False, True) if TRANSPOSED_STORE else (False,):      # 16-bit output, [N, M] or [M, N] tiles
            cfg = GemmConfig(block_m=16, out16=True, tout=tout, **opts)
            assert _shape(cfg, o16) == jax.ShapeDtypeStruct((1, 64, 512), BF16)
            _lower(cfg, o16)
            for act in ("silu", "gelu_tanh"):                              # gated epilogue: [.., N/2]
                cfg = GemmConfig(block_m=16, out16=True, tout=tout, gated=act, **{**opts, "block_n": 128})
                assert _shape(cfg, o16) == jax.ShapeDtypeStruct((1, 64, 256), BF16)
                _lower(cfg, o16)
    cfg = GemmConfig(block_m=16, block_n=128, gated="silu")                     # gated, float32 [N, M] store
    assert _shape(cfg, o16) == jax.ShapeDtypeStruct((1, 64, 256), jnp.float32)
    _lower(cfg, o16)
    rs = _abstract(16, rows=4, n=512, k=1024, rs=True)           # row_scale: the epilogue's per-row factor
    for opts in (dict(split_k=2), dict(kpb=2, wide=True, stages=2), dict(kpb=2, wide=True, sfold=True, stages=2),
                 dict(block_n=128, out16=True, tout=TRANSPOSED_STORE, gated="silu")):
        _lower(GemmConfig(block_m=16, **opts), rs)
    for bm in (48, 144):                                          # blocks that are not a power of two
        _lower(GemmConfig(block_m=bm, block_n=128, out16=True, tout=TRANSPOSED_STORE), _abstract(bm, rs=True))


@cpu_only
def test_wgmma_ws_lowers_to_mosaic_gpu():
    """The warp-specialized form (``ws``: two compute warpgroups of ``block_n`` columns and a copy
    warpgroup) lowers to Mosaic GPU: 64- / 128-column warpgroups, ``wide`` steps, K splits, zero
    points or not, row scales, 16-bit and gated epilogues, and the scale fold (``sfold``, the
    decode blocks' ``ws``)."""
    for opts in (dict(block_n=128, stages=4), dict(block_n=64, kpb=2, wide=True, stages=3),
                 dict(block_n=128, split_k=2)):
        for zp in (True, False):
            _lower(GemmConfig(block_m=64, ws=True, **opts), _abstract(64, zp=zp))
    o16 = _abstract(16, rows=4, n=512, k=1024)
    for opts in (dict(block_n=128, stages=4), dict(block_n=64, kpb=2, wide=True)):
        for tout in (False, True) if TRANSPOSED_STORE else (False,):
            cfg = GemmConfig(block_m=16, ws=True, out16=True, tout=tout, **opts)
            assert _shape(cfg, o16) == jax.ShapeDtypeStruct((1, 64, 512), BF16)
            _lower(cfg, o16)
            cfg = GemmConfig(block_m=16, ws=True, out16=True, tout=tout, gated="silu", **{**opts, "block_n": 128})
            assert _shape(cfg, o16) == jax.ShapeDtypeStruct((1, 64, 256), BF16)
            _lower(cfg, o16)
    _lower(GemmConfig(block_m=16, block_n=128, ws=True, stages=4, out16=True),
           _abstract(16, rows=4, n=512, k=1024, rs=True))
    fold = dict(kpb=2, wide=True, sfold=True, ws=True, stages=2)       # ws with the scale-only fold
    cases = [(24, True, dict(fold, block_n=64)), (16, False, dict(fold, block_n=128, split_k=2)),
             (8, True, dict(fold, block_n=64, stages=4))]
    if TRANSPOSED_STORE:
        cases.append((24, True, dict(fold, block_n=128, gated="silu", tout=True, out16=True)))
    for bm, zp, opts in cases:
        _lower(GemmConfig(block_m=bm, **opts), _abstract(bm, n=512, k=1024, zp=zp))


@cpu_only
def test_wgmma_ws_stream_lowers_to_mosaic_gpu():
    """The chained ``ws`` stream (``stream=True``: one program per SM streaming its share of the
    items, each a warp-specialized pipeline chained to the next) lowers to Mosaic GPU: given
    program counts (one, a few, the default), 64- / 128-column warpgroups, ``wide`` steps, K
    splits, zero points or not, the scale fold, and the gated 16-bit ``[M, N]`` epilogue where jax
    has the transposed store."""
    for zp in (True, False):
        pw = _abstract(48, n=512, k=1024, zp=zp)
        for opts in (dict(block_n=128, stages=2, kpb=2, wide=True, programs=5), dict(block_n=64, stages=4),
                     dict(block_n=128, stages=2, split_k=2, programs=1)):
            _lower(GemmConfig(block_m=48, ws=True, stream=True, **opts), pw)
        if TRANSPOSED_STORE:
            _lower(GemmConfig(block_m=48, block_n=128, ws=True, stream=True, stages=2, out16=True, tout=True,
                              gated="silu"), pw)
    _lower(GemmConfig(block_m=16, block_n=64, kpb=2, wide=True, sfold=True, ws=True, stream=True, stages=2),
           _abstract(16, n=512, k=1024))


# ----------------------------------------------------------------------------- the stream's index math


@settings(deadline=None, max_examples=min(settings().max_examples, 100))
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 4), st.integers(1, 300), st.data())
def test_ws_stream_covers_every_item_once(nb, tiles, split, programs, data):
    """The ``ws`` stream's index math (``stream_share`` over the programs, ``stream_item`` per
    item, ``stream_tail`` for the blocks after the last live one — the functions its loops
    call): over all programs the streamed items (the live ones, in stream order within a share)
    and the zeroed tail cover every (block, column-pair tile, K split) output exactly once;
    shares differ by at most one item."""
    live_blocks = data.draw(st.integers(0, nb))
    nt = tiles * split
    n_live, n_all = live_blocks * nt, nb * nt
    programs = max(1, min(programs, n_all))                  # as the kernel caps it
    seen, counts = [], []
    for p in range(programs):
        lo, count = (int(v) for v in stream_share(np.int32(p), programs, np.int32(n_live)))
        counts.append(count)
        for t in range(count):
            blk, j, sp = (int(v) for v in stream_item(np.int32(lo + t), nt, split))
            assert 0 <= blk < live_blocks and 0 <= j < tiles and 0 <= sp < split
            assert (blk * nt + j * split + sp) == lo + t          # block-major, then column tile, then split
            seen.append((blk, j, sp))
        for r in range(int(stream_tail(np.int32(p), programs, np.int32(n_live), n_all))):
            item = n_live + p + r * programs
            assert n_live <= item < n_all
            seen.append(tuple(int(v) for v in stream_item(np.int32(item), nt, split)))
    assert sorted(seen) == [(b, j, s) for b in range(nb) for j in range(tiles) for s in range(split)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == n_live


# ----------------------------------------------------------------------------- the GEMM vs float64


# (zero points, group, block rows, K split, options): GemmConfig fields, and k / n (the GEMM's
# K and N, default 512 / 256), rs (row scales: signed, zero on some rows), dtype (default bf16)
WGMMA_CASES = [
    (True, 128, 16, 2, {}), (False, -1, 64, 1, {}), (True, 128, 8, 4, {}), (False, -1, 16, 2, {}),
    (True, 128, 8, 1, dict(block_n=128)), (False, 128, 16, 1, dict(kpb=2, stages=2)),
    (True, 128, 8, 2, dict(stages=4)), (True, -1, 16, 1, dict(block_n=128, kpb=2)),
    (True, 128, 16, 1, dict(kpb=4, stages=2, k=1024)),
    (False, 128, 64, 1, dict(block_n=128)), (True, 128, 128, 1, dict(block_n=128, stages=4, k=2048)),
    # wide: 128-byte swizzled [block_n, 64] word tiles, two K-blocks per step
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, stages=4)), (False, -1, 16, 2, dict(kpb=2, wide=True)),
    (True, 128, 64, 1, dict(block_n=128, kpb=2, wide=True, stages=2)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True)),
    # fp16 activations (magic number 1024)
    (True, 128, 16, 1, dict(block_n=128, kpb=2, wide=True, dtype=F16)),
    (False, -1, 8, 1, dict(block_n=128, sfold=True, out16=True, dtype=F16)),
    (True, 128, 64, 1, dict(block_n=128, ws=True, rs=True, dtype=F16)),
    # sfold: the scale-only fold (c − z into the wgmma, s per K-block partial)
    (True, 128, 8, 1, dict(block_n=128, sfold=True)), (False, -1, 16, 2, dict(sfold=True, stages=4)),
    (True, 128, 8, 2, dict(block_n=128, kpb=2, wide=True, sfold=True, stages=2, k=2048)),
    # ws: two compute warpgroups (block_n columns each) and a copy warpgroup
    (True, 128, 64, 1, dict(block_n=64, ws=True)),
    (False, 128, 128, 2, dict(block_n=128, ws=True, k=2048)),
    (True, 128, 8, 1, dict(block_n=64, kpb=2, wide=True, ws=True, stages=4, k=2048)),
    (True, 128, 128, 1, dict(block_n=128, stages=4, ws=True, k=2048)),
    # out16: the output in the activations' dtype; tout: written [M, N] through a transposed
    # shared-memory store (plain, fold, channelwise and ws epilogues)
    (True, 128, 16, 1, dict(block_n=128, out16=True)),
    (True, 128, 16, 1, dict(block_n=128, out16=True, tout=True)),
    (False, -1, 64, 1, dict(out16=True, tout=True, stages=4)),
    # the decode defaults at 8- and 24-row blocked GEMMs: sfold with the [M, N] store (GEMM1 gated,
    # GEMM2 row scales), and channelwise
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, sfold=True, out16=True, tout=True, gated="silu", k=2048)),
    (False, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, sfold=True, out16=True, tout=True, rs=True, k=2048)),
    (True, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, sfold=True, out16=True, tout=True, gated="silu",
                            stages=2, k=2048)),
    (False, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, sfold=True, out16=True, tout=True, rs=True, stages=2,
                             k=2048)),
    (False, -1, 24, 1, dict(block_n=128, kpb=2, wide=True, sfold=True, out16=True, tout=True)),
    (True, 128, 64, 1, dict(block_n=128, ws=True, out16=True)),
    (True, 128, 128, 1, dict(block_n=128, ws=True, out16=True, tout=True, k=2048)),
    (False, 128, 32, 1, dict(block_n=64, kpb=2, wide=True, ws=True, stages=2, out16=True, tout=True, k=2048)),
    # gated: act(gate)·up of each 128-column tile's 64-column halves in the epilogue (plain, fold,
    # channelwise, ws; [N, M] and [M, N] stores; float32 and 16-bit outputs)
    (True, 128, 16, 1, dict(block_n=128, gated="silu")),
    (True, 128, 8, 1, dict(block_n=128, sfold=True, gated="gelu_tanh")),
    (True, 128, 16, 1, dict(block_n=128, out16=True, tout=True, gated="silu")),
    (False, -1, 64, 1, dict(block_n=128, out16=True, tout=True, stages=4, gated="gelu_tanh")),
    (True, 128, 64, 1, dict(block_n=128, ws=True, out16=True, gated="silu")),
    (False, 128, 128, 1, dict(block_n=128, ws=True, stages=3, out16=True, tout=True, gated="silu", k=2048)),
    (True, 128, 32, 1, dict(block_n=128, kpb=2, wide=True, ws=True, stages=2, gated="gelu_tanh")),
    # row_scale: each output row times its own float32 scale in the epilogue (split partials,
    # [N, M] and [M, N] stores, wide, ws), and blocks that are not a power of two (48, 144 rows)
    (True, 128, 8, 2, dict(block_n=128, rs=True)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, rs=True)),
    (True, 128, 16, 1, dict(block_n=128, out16=True, tout=True, rs=True)),
    (True, 128, 128, 1, dict(block_n=128, ws=True, out16=True, tout=True, k=2048, rs=True)),
    (False, -1, 48, 1, dict(block_n=128, out16=True, tout=True, rs=True)),
    (True, 128, 48, 1, dict(block_n=128, ws=True, out16=True, tout=True, rs=True)),
    (True, 128, 144, 1, dict(block_n=128, ws=True, stages=2, out16=True, tout=True, k=1024, rs=True)),
    (True, 128, 48, 1, dict(block_n=128, kpb=2, wide=True, out16=True, tout=True, gated="silu")),
    # the ws stream: one chained warp-specialized pipeline per item (START / STEADY / STOP, or a
    # lone one), the id -1 block in the stream or in the tail; 2·block_n column tiles, K splits, the
    # gated 16-bit transposed epilogue, one program streaming everything
    (True, 128, 48, 1, dict(block_n=128, ws=True, stream=True, programs=3, stages=2, k=1024)),
    (True, 128, 64, 2, dict(block_n=64, ws=True, stream=True, programs=2, stages=2)),
    (False, 128, 128, 1, dict(block_n=128, ws=True, stream=True, stages=2, out16=True, tout=True, gated="silu",
                              k=1024)),
    (True, 128, 8, 1, dict(block_n=128, kpb=2, wide=True, ws=True, stream=True, programs=1, stages=4, k=2048)),
    (True, 128, 48, 1, dict(block_n=128, ws=True, stream=True, stages=2, k=1024)),        # one program per SM
    # the scale-only fold in ws programs (64- and 128-column warpgroups), split, with the gated
    # [M, N] epilogue and row scales, and the ws stream
    (True, 128, 24, 1, dict(block_n=64, kpb=2, wide=True, sfold=True, ws=True, stages=2, n=512, k=2048)),
    (False, 128, 16, 2, dict(block_n=128, kpb=2, wide=True, sfold=True, ws=True, stages=2, k=2048)),
    (True, 128, 24, 1, dict(block_n=128, kpb=2, wide=True, sfold=True, ws=True, stages=2, out16=True, tout=True,
                            gated="silu", rs=True, n=512, k=2048)),
    (True, 128, 16, 1, dict(block_n=64, kpb=2, wide=True, sfold=True, ws=True, stream=True, programs=5, stages=2,
                            n=512, k=1024)),
]


def _case_id(c):
    zp, group, bm, split, opts = c
    flags = "-".join(f"{key}{int(v) if isinstance(v, bool) else getattr(v, '__name__', v)}" for key, v in opts.items())
    return f"zp{int(zp)}-g{group}-bm{bm}-s{split}" + (f"-{flags}" if flags else "")


def _run_case(rng, zp, group, bm, split, opts, fn, exact):
    """``fn`` (the kernel or its reference) on a fresh case → ``(out, float64 ref, out16)``."""
    opts = dict(opts)
    k, n, rs, dt = opts.pop("k", 512), opts.pop("n", 256), opts.pop("rs", False), opts.pop("dtype", BF16)
    if fn is wgmma_grouped_gemm_reference and not TRANSPOSED_STORE:
        opts.pop("tout", None)                   # the reference's output is the same either way
    cfg = GemmConfig(block_m=bm, group_size=group, split_k=split, **opts)
    a, eids, (words, scales, zeros), ref = wgmma_case(rng, zp, group, bm, k=k, n=n, exact=exact and cfg.sfold,
                                                      dtype=dt)
    if cfg.gated:
        ref = gated64(ref, cfg.gated)
    row_scale = None
    if rs:                                     # signed, and zero on some rows
        row_scale = rng.uniform(-2.0, 2.0, ref.shape[0]).astype(np.float32) * (rng.random(ref.shape[0]) > 0.1)
        ref = ref * row_scale[:, None].astype(np.float64)
        row_scale = jnp.asarray(row_scale)
    out = fn(a, jnp.asarray(eids), words, scales, zeros, row_scale, config=cfg)
    assert out.shape == (split,) + ref.shape and out.dtype == (dt if cfg.out16 else jnp.float32)
    return np.asarray(out.astype(jnp.float32), np.float64).sum(0), ref, cfg


@pytest.mark.parametrize("case", WGMMA_CASES, ids=_case_id)
def test_wgmma_reference_matches_float64(case):
    """The GEMM's contract in jnp (:func:`wgmma_grouped_gemm_reference`, the layer's
    ``kernels="reference"`` and what the GPU kernels are held to) against float64 in every case:
    the K splits, the gated halves, the row scales, the output dtype, id -1 blocks zero."""
    got, ref, cfg = _run_case(np.random.default_rng(), *case, wgmma_grouped_gemm_reference, exact=False)
    close(got, ref, 4e-3 if cfg.out16 else 2e-5)        # out16: one rounding of each output (2^-9 relative)


@gpu
@needs_hopper
@pytest.mark.parametrize("case", WGMMA_CASES, ids=_case_id)
def test_wgmma_grouped_gemm_gpu(case):
    """The wgmma kernel (Mosaic GPU, weights as the register operand) against float64 in every
    case: every kernel form (plain, ws, the ws stream) and option (column tile, K-blocks per
    step, stages, K splits, wide, sfold) and epilogue (16-bit, transposed, gated, row scales).
    The kernel creates its outputs and writes every element (an id of -1 writes zeros), so NaN
    or a missed tile fails the finite / error checks."""
    zp, group, bm, split, opts = case
    if opts.get("tout") and not TRANSPOSED_STORE:
        pytest.skip("tout=True needs jax >= 0.11")
    got, ref, cfg = _run_case(np.random.default_rng(), *case, wgmma_grouped_gemm, exact=True)
    # out16: one 16-bit rounding of each output; sfold: exact (c − z)·s with float32 partials
    close(got, ref, (4e-3 if opts.get("dtype") is None else 1e-3) if cfg.out16 else 1e-4 if cfg.sfold else 2e-5)
