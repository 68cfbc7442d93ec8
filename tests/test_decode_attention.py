"""The decode-step attention kernel (:mod:`pallas_kernels.decode_attention`) against float64, in
interpret mode on the CPU and compiled on the GPU; its Triton lowering on the CPU; the shapes it
refuses; and a decoder whose decode steps take it, against the same decoder on XLA. Fresh random
data, NaN-poisoned outputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import INTERPRET, ON_GPU, abstract_h200, cpu_only, gpu, needs_gpu
from pallas_kernels import decode_attention as da
from pallas_kernels.errors import KernelConfigError, KernelDTypeError, KernelShapeError


def _case(rng, layers, b, h, g, t, d, dtype=jnp.bfloat16):
    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return r(b, h, g, d), r(b, h, d), r(b, h, d), r(layers, b, h, t, d), r(layers, b, h, t, d)


def _ref64(q, kn, vn, kc, vc, layer, lengths, scale, window):
    f64 = [np.asarray(a.astype(jnp.float32), np.float64) for a in (q, kn, vn, kc, vc)]
    with jax.enable_x64():
        return np.asarray(da.reference(*(jnp.asarray(a) for a in f64), layer, jnp.asarray(lengths), scale=scale,
                                       window=window))


# Tolerance: the kernel rounds the softmax weights to the cache's dtype before the value dot
# (bf16: 2^-8 relative) and sums in float32; outputs are averages of N(0, 1) values, so the error
# stays near 1e-2 of the largest output. A wrong slot, a missing new row or a foreign layer moves
# outputs by order one.
TOL = 2e-2


@pytest.mark.parametrize("b, h, g, t, d, window, splits", [
    (1, 4, 8, 256, 128, None, None),       # Qwen3-30B-A3B's heads, one sequence: many splits
    (3, 2, 3, 64, 64, None, 1),            # a group that is not a power of two (padded to 16), one split
    (2, 8, 4, 192, 32, 40, 5),             # Mixtral's grouping with a sliding window, uneven splits
    (4, 1, 16, 128, 128, None, 3),         # one key/value head (multi-query)
])
def test_decode_attention_matches_float64(b, h, g, t, d, window, splits):
    rng = np.random.default_rng()
    layers = 3
    q, kn, vn, kc, vc = _case(rng, layers, b, h, g, t, d)
    lengths = rng.integers(0, t + 1, b)
    lengths[0] = t                       # a full cache (the new row is the one past its end)
    if b > 1:
        lengths[1] = 0                   # an empty one: only the new row is seen
    if b > 2:
        lengths[2] = t + 7               # past the cache's end: every slot, nothing read beyond it
    layer = int(rng.integers(layers))
    scale = float(d) ** -0.5
    fn = jax.jit(functools.partial(da.decode_attention, scale=scale, window=window, splits=splits,
                                   interpret=INTERPRET))
    got = np.asarray(fn(q, kn, vn, kc, vc, jnp.int32(layer), jnp.asarray(lengths, jnp.int32)), np.float64)
    ref = _ref64(q, kn, vn, kc, vc, layer, lengths, scale, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=TOL * np.abs(ref).max(), rtol=0)
    # reading another layer's slots would be far off
    other = _ref64(q, kn, vn, kc, vc, (layer + 1) % layers, lengths, scale, window)
    assert np.abs(got - other).max() > 10 * TOL * np.abs(ref).max()


def test_every_program_writes_its_partials():
    """Programs whose slots all lie past ``lengths[b]`` still write their blocks (``m = -inf``,
    ``l = 0``, ``acc = 0``): into NaN-poisoned buffers, nothing NaN is left."""
    rng = np.random.default_rng()
    b, h, g, t, d = 2, 2, 16, 256, 32
    q, _, _, kc, vc = _case(rng, 2, b, h, g, t, d)
    lengths = jnp.asarray([5, 130], jnp.int32)
    _, _, splits = da.split_plan(b, h, t, 4)
    out = (jnp.full((b, h, splits, g, d), jnp.nan, jnp.float32), jnp.full((b, h, splits, g), jnp.nan, jnp.float32),
           jnp.full((b, h, splits, g), jnp.nan, jnp.float32))
    acc, m, l = jax.jit(functools.partial(da.partials, scale=0.2, splits=4, interpret=INTERPRET))(
        q, kc, vc, jnp.asarray([1], jnp.int32), lengths, out)
    acc, m, l = np.asarray(acc), np.asarray(m), np.asarray(l)
    assert not np.isnan(acc).any() and not np.isnan(m).any() and not np.isnan(l).any()
    assert np.isneginf(m[0, :, 1:]).all() and (l[0, :, 1:] == 0).all() and (acc[0, :, 1:] == 0).all()
    assert np.isfinite(m[1, :, :3]).all() and np.isneginf(m[1, :, 3:]).all()


def test_refused_shapes_name_what_they_got():
    rng = np.random.default_rng()
    q, kn, vn, kc, vc = _case(rng, 2, 2, 2, 4, 64, 32)
    lengths = jnp.asarray([3, 4], jnp.int32)
    call = functools.partial(da.decode_attention, scale=1.0, interpret=True)
    assert da.unsupported_reason(q.shape, kc.shape, jnp.float32) == "dtype float32: the kernel takes bfloat16 or float16"
    assert "head_dim 96" in da.unsupported_reason((2, 2, 4, 96), (2, 2, 2, 64, 96), jnp.bfloat16)
    assert "cache length 40" in da.unsupported_reason(q.shape, (2, 2, 2, 40, 32), jnp.bfloat16)
    with pytest.raises(KernelConfigError, match="dtype float32"):
        call(q.astype(jnp.float32), kn, vn, kc.astype(jnp.float32), vc.astype(jnp.float32), 0, lengths)
    with pytest.raises(KernelDTypeError, match="k_cache: expected bfloat16, got float16"):
        call(q, kn, vn, kc.astype(jnp.float16), vc, 0, lengths)
    with pytest.raises(KernelShapeError, match=r"v_cache: expected \[L, 2, 2, T, 32\], got shape \(2, 2, 64, 32\)"):
        call(q, kn, vn, kc, vc[0], 0, lengths)
    with pytest.raises(KernelShapeError, match=r"k_new: expected \[2, 2, 32\], got shape \(2, 32\)"):
        call(q, kn[0], vn, kc, vc, 0, lengths)
    with pytest.raises(KernelShapeError, match=r"lengths: expected \[2\], got shape \(3,\)"):
        call(q, kn, vn, kc, vc, 0, jnp.zeros(3, jnp.int32))


@cpu_only
def test_decode_attention_lowers_to_triton():
    """What interpret mode cannot check: the kernel lowers to Triton IR for CUDA at a full-size
    stacked cache (48 layers × 64 sequences × 4 heads × 2048 slots × 128: past 2^32 bytes, so
    its offsets are 64-bit), with and without a window."""
    s = jax.ShapeDtypeStruct
    for window in (None, 4096):
        args = (s((64, 4, 8, 128), jnp.bfloat16), s((64, 4, 128), jnp.bfloat16), s((64, 4, 128), jnp.bfloat16),
                s((48, 64, 4, 2048, 128), jnp.bfloat16), s((48, 64, 4, 2048, 128), jnp.bfloat16),
                s((), jnp.int32), s((64,), jnp.int32))
        with abstract_h200():
            text = jax.jit(functools.partial(da.decode_attention, scale=0.1, window=window)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text


def _decode_logits(model, prompts, steps=3, cache=None):
    """Last-position float32 logits of ``steps`` decode steps after a prefill of ``prompts``
    (``[B, P]``), the model's own greedy tokens fed back; jitted afresh, so the decoder's
    attention path is chosen when this traces."""
    b, p = prompts.shape
    cache = model.init_cache(b, 64) if cache is None else cache

    @jax.jit
    def run(tokens, cache):
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
        h, cache = model.hidden_states(tokens, pos, cache)
        nxt = jnp.argmax(model.logits(h[:, -1]), -1)
        out = []
        for i in range(steps):
            h, cache = model.hidden_states(nxt[:, None], jnp.full((b, 1), p + i, jnp.int32), cache)
            logits = model.logits(h[:, 0])
            out.append(logits)
            nxt = jnp.argmax(logits, -1)
        return jnp.stack(out, 1)

    return np.asarray(run(jnp.asarray(prompts), cache))


@gpu                                 # on the CPU too (the kernel in the interpreter)
@pytest.mark.parametrize("model_type, scan", [("qwen3_moe", True), ("mixtral", False)])
def test_decoder_decode_steps_on_the_kernel(tmp_path, monkeypatch, model_type, scan):
    """A bf16 decoder's decode steps with the kernel (Qwen3-MoE scanned: the layer's slots read
    from the stacked cache; Mixtral unrolled, with a sliding window shorter than the prompts)
    against the same steps on XLA. Both round in bf16; rows agree to ~1% of their largest logit
    unless a router near-tie flips (order one), so most rows, not all, must agree to 3%."""
    from wna16_jax.models import decoder, load_model, write_random_model
    from wna16_jax.models.synthetic import RandomModelSpec
    from wna16_jax.schemes import QuantScheme

    window = 12 if model_type == "mixtral" else None
    spec = RandomModelSpec(model_type=model_type, scheme=QuantScheme("gptq", 4, 128, False), vocab_size=512,
                           hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32, num_experts=4,
                           top_k=2, moe_intermediate_size=128, sliding_window=window)
    path = write_random_model(str(tmp_path / "m"), spec, seed=int(np.random.default_rng().integers(1 << 30)))
    model = load_model(path, dtype=jnp.bfloat16, scan_layers=scan)
    assert model.config.sliding_window == window
    prompts = np.random.default_rng().integers(3, 512, (6, 20))
    monkeypatch.setattr(decoder, "decode_kernel_mode", lambda: None)
    xla = _decode_logits(model, prompts)
    monkeypatch.setattr(decoder, "decode_kernel_mode", lambda: "gpu" if ON_GPU else "interpret")
    calls = []
    kernel = da.decode_attention
    monkeypatch.setattr(da, "decode_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    got = _decode_logits(model, prompts)
    # traced once per decode step (scanned: one layer body), per layer and step (unrolled)
    assert len(calls) == (3 if scan else 9) and all(k["window"] == window for k in calls)
    _mostly_close(got, xla)


def _mostly_close(got, ref):
    """A bf16 decoder's kernel logits against XLA's: finite, and at least three quarters of the
    rows within 3% of their largest logit (both round in bf16; a router near-tie moves a single
    row by order one, a wrong slot, layer or row every row)."""
    assert np.isfinite(got).all()
    err = (np.abs(got - ref).max(axis=-1) / np.abs(ref).max(axis=-1)).ravel()
    assert (err <= 3e-2).mean() >= 0.75, err


def _paged_decode_logits(model, prompts, table, blocks, block_size, steps=3):
    """:func:`_decode_logits` over a paged pool of ``blocks`` blocks read through ``table``."""
    return _decode_logits(model, prompts, steps, model.init_paged_cache(blocks, block_size).with_block_table(table))


@gpu                                 # on the CPU too (the kernel in the interpreter)
@pytest.mark.parametrize("model_type, scan", [("qwen3_moe", True), ("mixtral", False)])
def test_decoder_paged_decode_steps_on_the_kernel(tmp_path, monkeypatch, model_type, scan):
    """The decoder's decode steps over a paged pool (scrambled block tables, the other blocks
    holding other rows' data) with the paged kernel, against the same steps through the XLA
    gather and against the contiguous cache on XLA. XLA paged and contiguous read the same
    values (extra masked slots add exact zeros): equal to float32 rounding. The kernel rounds in
    bf16 as in :func:`test_decoder_decode_steps_on_the_kernel` (most rows within 3%)."""
    from wna16_jax.models import decoder, load_model, write_random_model
    from wna16_jax.models.synthetic import RandomModelSpec
    from wna16_jax.schemes import QuantScheme

    window = 12 if model_type == "mixtral" else None
    spec = RandomModelSpec(model_type=model_type, scheme=QuantScheme("gptq", 4, 128, False), vocab_size=512,
                           hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32, num_experts=4,
                           top_k=2, moe_intermediate_size=128, sliding_window=window)
    path = write_random_model(str(tmp_path / "m"), spec, seed=int(np.random.default_rng().integers(1 << 30)))
    model = load_model(path, dtype=jnp.bfloat16, scan_layers=scan)
    rng = np.random.default_rng()
    prompts = rng.integers(3, 512, (4, 20))
    bs, m, blocks = 16, 3, 16                            # 23 positions need 2 blocks of each row's 3
    table = np.full((4, m), -1, np.int32)
    table[:, :2] = rng.permutation(np.arange(1, blocks))[:8].reshape(4, 2)
    monkeypatch.setattr(decoder, "decode_kernel_mode", lambda: None)
    xla_contiguous = _decode_logits(model, prompts)
    xla_paged = _paged_decode_logits(model, prompts, table, blocks, bs)
    assert np.isfinite(xla_paged).all()
    np.testing.assert_allclose(xla_paged, xla_contiguous, rtol=0, atol=1e-2 * np.abs(xla_contiguous).max())
    monkeypatch.setattr(decoder, "decode_kernel_mode", lambda: "gpu" if ON_GPU else "interpret")
    calls = []
    kernel = da.paged_decode_attention
    monkeypatch.setattr(da, "paged_decode_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    got = _paged_decode_logits(model, prompts, table, blocks, bs)
    assert len(calls) == (3 if scan else 9) and all(k["window"] == window for k in calls)
    _mostly_close(got, xla_paged)


@gpu
@needs_gpu
def test_decode_attention_at_model_shapes_gpu():
    """Compiled on the GPU at Qwen3-30B-A3B's and Mixtral's decode shapes (48 / 32 layers of
    cache, batch 1 / 8 / 64, 1024 slots) against float64."""
    rng = np.random.default_rng()
    for layers, h, g, b in ((48, 4, 8, 1), (48, 4, 8, 64), (32, 8, 4, 8)):
        q, kn, vn, kc, vc = _case(rng, layers, b, h, g, 1024, 128)
        lengths = rng.integers(0, 1025, b)
        layer = int(rng.integers(layers))
        got = np.asarray(jax.jit(functools.partial(da.decode_attention, scale=128 ** -0.5))(
            q, kn, vn, kc, vc, jnp.int32(layer), jnp.asarray(lengths, jnp.int32)), np.float64)
        ref = _ref64(q, kn, vn, kc, vc, layer, lengths, 128 ** -0.5, None)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, atol=TOL * np.abs(ref).max(), rtol=0)


def test_decode_kernel_mode_follows_the_device_and_the_switch(monkeypatch):
    """The kernel is chosen only on an NVIDIA GPU (SM80 or later) and only while
    ``DECODE_KERNEL`` allows it; everywhere else decode steps attend on XLA."""
    from wna16_jax.device import Device
    from wna16_jax.models import decoder

    assert decoder.DECODE_KERNEL is True                  # the default
    dev = Device.current()
    gpu_ok = dev.is_nvidia and dev.compute_capability >= (8, 0)
    monkeypatch.setattr(decoder, "DECODE_KERNEL", True)
    assert decoder.decode_kernel_mode() == ("gpu" if gpu_ok else None)
    monkeypatch.setattr(decoder, "DECODE_KERNEL", False)
    assert decoder.decode_kernel_mode() is None


# --------------------------------------------------------------------------- paged caches


def _paged_case(rng, layers, blocks, b, h, g, bs, m, d, lengths, dtype=jnp.bfloat16):
    """``(q, k_new, v_new, k_pool, v_pool, table)``: random pools of ``blocks`` blocks, each row's
    table a scrambled set of distinct blocks for its ``lengths[b]`` slots, -1 after them."""
    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    table = np.full((b, m), -1, np.int32)
    order = rng.permutation(blocks)
    used = 0
    for i, n in enumerate(lengths):
        need = -(-min(int(n), m * bs) // bs)
        table[i, :need] = order[used:used + need]
        used += need
    assert used <= blocks
    return r(b, h, g, d), r(b, h, d), r(b, h, d), r(layers, blocks, h, bs, d), r(layers, blocks, h, bs, d), table


def _gather_ref64(q, kn, vn, kp, vp, layer, table, lengths, scale, window):
    """float64 attention through the XLA gather path: ``KVCache.read`` of the table (every slot of
    the row's blocks), then a softmax over slots ``< lengths[b]`` (and the window) and the new row."""
    from wna16_jax.models.kv_cache import KVCache

    keys, vals, kpos = KVCache(kp, vp, jnp.asarray(table)).at_layer(layer).read(None, jnp.float32)
    keys, vals = (np.asarray(a, np.float64) for a in (keys, vals))
    qq, kn, vn = (np.asarray(a.astype(jnp.float32), np.float64) for a in (q, kn, vn))
    keys = np.concatenate([keys, kn[:, :, None]], axis=2)                  # [B, H, T + 1, D]
    vals = np.concatenate([vals, vn[:, :, None]], axis=2)
    n = np.asarray(lengths)[:, None]
    slot = np.asarray(kpos)
    ok = slot < n
    if window is not None:
        ok &= slot > n - window
    ok = np.concatenate([ok, np.ones_like(ok[:, :1])], axis=1)             # the new row
    sc = np.einsum("bhgd,bhtd->bhgt", qq, keys) * scale
    sc = np.where(ok[:, None, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhgt,bhtd->bhgd", p, vals)


@pytest.mark.parametrize("b, h, g, bs, m, d, window, splits", [
    (3, 2, 8, 16, 6, 64, None, None),      # a few blocks per row, the default splits
    (2, 4, 3, 32, 5, 32, None, 2),         # a group that is not a power of two (padded to 16)
    (4, 2, 4, 16, 8, 64, 40, 3),           # a sliding window across blocks, uneven splits
    (2, 1, 16, 64, 3, 128, None, 1),       # one key/value head, large blocks, one split
])
def test_paged_decode_attention_matches_the_gather_path(b, h, g, bs, m, d, window, splits):
    """The paged kernel (interpret mode on the CPU) against the XLA gather path in float64, on
    scrambled tables: a full row, an empty one (only the new row), one ending mid-block; the
    blocks outside a row's table hold other data, so reading one would show."""
    rng = np.random.default_rng()
    layers, blocks = 2, b * m + 3
    lengths = rng.integers(1, m * bs + 1, b)
    lengths[0] = m * bs
    lengths[1] = 0
    if b > 2:
        lengths[2] = bs + bs // 2
    q, kn, vn, kp, vp, table = _paged_case(rng, layers, blocks, b, h, g, bs, m, d, lengths)
    layer = int(rng.integers(layers))
    scale = float(d) ** -0.5
    fn = jax.jit(functools.partial(da.paged_decode_attention, scale=scale, window=window, splits=splits,
                                   interpret=INTERPRET))
    args = (q, kn, vn, kp, vp, jnp.int32(layer), jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
    got = np.asarray(fn(*args).astype(jnp.float32), np.float64)
    ref = _gather_ref64(q, kn, vn, kp, vp, layer, table, lengths, scale, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=TOL * np.abs(ref).max(), rtol=0)
    plain = np.asarray(da.paged_reference(*args, scale=scale, window=window), np.float64)
    np.testing.assert_allclose(plain, ref, atol=TOL * np.abs(ref).max(), rtol=0)
    # another row's blocks (a shifted table) would be far off
    wrong = np.roll(table, 1, axis=0)
    other = _gather_ref64(q, kn, vn, kp, vp, layer, np.where(wrong < 0, 0, wrong), lengths, scale, window)
    assert np.abs(got[0] - other[0]).max() > 3 * TOL * np.abs(ref[0]).max()    # row 0 reads foreign blocks: far outside the tolerance


@gpu                                 # on the CPU too, where it checks less (below)
def test_paged_lengths_past_the_table_read_only_the_table():
    """A row whose length runs past its table's ``M × block_size`` slots: both paged kernels read
    the table's blocks and nothing beyond it, as if the length were the table's capacity. On a GPU
    an entry past the table is a read out of bounds; Pallas's interpreter clamps such reads, so on
    the CPU this checks only the result, not the bound (it passes there without the bound too)."""
    rng = np.random.default_rng()
    b, h, g, bs, m, d = 2, 2, 4, 16, 3, 32
    lengths = np.asarray([m * bs + 9, 20])
    q, kn, vn, kp, vp, table = _paged_case(rng, 2, 12, b, h, g, bs, m, d, lengths)
    args = (q, kn, vn, kp, vp, jnp.int32(1), jnp.asarray(table))
    fn = jax.jit(functools.partial(da.paged_decode_attention, scale=0.2, interpret=INTERPRET))
    got = np.asarray(fn(*args, jnp.asarray(lengths, jnp.int32)).astype(jnp.float32), np.float64)
    ref = _gather_ref64(q, kn, vn, kp, vp, 1, table, np.minimum(lengths, m * bs), 0.2, None)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=TOL * np.abs(ref).max(), rtol=0)
    qq, qr, cn, rn, cp, rp = _latent_case(rng, 2, 12, b, 16, 32, 16, bs)
    lat = jax.jit(functools.partial(da.latent_decode_attention, scale=0.2, interpret=INTERPRET))(
        qq, qr, cn, rn, cp, rp, jnp.int32(1), jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
    want = _latent_ref64(qq, qr, cn, rn, cp, rp, 1, table, np.minimum(lengths, m * bs), 0.2)
    got = np.asarray(lat.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOL * np.abs(want).max(), rtol=0)


def test_paged_refused_shapes_name_what_they_got():
    rng = np.random.default_rng()
    q, kn, vn, kp, vp, table = _paged_case(rng, 2, 8, 2, 2, 4, 16, 3, 32, [5, 20])
    lengths = jnp.asarray([5, 20], jnp.int32)
    call = functools.partial(da.paged_decode_attention, scale=1.0, interpret=True)
    assert "block_size 8" in da.paged_unsupported_reason(q.shape, (2, 8, 2, 8, 32), jnp.bfloat16)
    assert "block_size 24" in da.paged_unsupported_reason(q.shape, (2, 8, 2, 24, 32), jnp.bfloat16)
    assert "dtype float32" in da.paged_unsupported_reason(q.shape, kp.shape, jnp.float32)
    with pytest.raises(KernelConfigError, match="block_size 8"):
        call(q, kn, vn, kp[:, :, :, :8], vp[:, :, :, :8], 0, table, lengths)
    with pytest.raises(KernelDTypeError, match="v_pool: expected bfloat16, got float16"):
        call(q, kn, vn, kp, vp.astype(jnp.float16), 0, table, lengths)
    with pytest.raises(KernelShapeError, match=r"k_pool: expected \[L, P, 2, block_size, 32\]"):
        call(q, kn, vn, kp[0], vp, 0, table, lengths)
    with pytest.raises(KernelShapeError, match=r"block_table: expected an integer \[2, M\]"):
        call(q, kn, vn, kp, vp, 0, table[:1], lengths)
    with pytest.raises(KernelShapeError, match=r"block_table: expected an integer"):
        call(q, kn, vn, kp, vp, 0, table.astype(np.float32), lengths)
    with pytest.raises(KernelShapeError, match=r"lengths: expected \[2\]"):
        call(q, kn, vn, kp, vp, 0, table, lengths[:1])


@cpu_only
def test_paged_decode_attention_lowers_to_triton():
    """The paged kernel lowers to Triton IR for CUDA at a serving shape: a 48-layer pool of 8192
    blocks of 16 (past 2^32 bytes: 64-bit offsets), 64 rows of 256 table entries."""
    s = jax.ShapeDtypeStruct
    for window in (None, 4096):
        args = (s((64, 4, 8, 128), jnp.bfloat16), s((64, 4, 128), jnp.bfloat16), s((64, 4, 128), jnp.bfloat16),
                s((48, 8192, 4, 16, 128), jnp.bfloat16), s((48, 8192, 4, 16, 128), jnp.bfloat16),
                s((), jnp.int32), s((64, 256), jnp.int32), s((64,), jnp.int32))
        with abstract_h200():
            text = jax.jit(functools.partial(da.paged_decode_attention, scale=0.1, window=window)).trace(
                *args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text


@gpu
@needs_gpu
def test_paged_decode_attention_at_model_shapes_gpu():
    """Compiled on the GPU at Qwen3-30B-A3B's and Mixtral's head shapes (batch 1 / 8 / 32, blocks
    of 16, up to 1024 slots a row) against the gather path in float64."""
    rng = np.random.default_rng()
    for h, g, b in ((4, 8, 1), (4, 8, 32), (8, 4, 8)):
        bs, m = 16, 64
        lengths = rng.integers(0, m * bs + 1, b)
        q, kn, vn, kp, vp, table = _paged_case(rng, 4, b * m + 5, b, h, g, bs, m, 128, lengths)
        layer = int(rng.integers(4))
        got = np.asarray(jax.jit(functools.partial(da.paged_decode_attention, scale=128 ** -0.5))(
            q, kn, vn, kp, vp, jnp.int32(layer), jnp.asarray(table), jnp.asarray(lengths, jnp.int32)
        ).astype(jnp.float32), np.float64)
        ref = _gather_ref64(q, kn, vn, kp, vp, layer, table, lengths, 128 ** -0.5, None)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, atol=TOL * np.abs(ref).max(), rtol=0)


# --------------------------------------------------------------------------- latent attention


def _latent_case(rng, layers, rows, b, h, r, dr, slots):
    def x(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    return x(b, h, r), x(b, h, dr), x(b, r), x(b, dr), x(layers, rows, 1, slots, r), x(layers, rows, 1, slots, dr)


def _latent_ref64(q, qr, cn, rn, cp, rp, layer, table, lengths, scale):
    """The latent step in numpy float64: the layer's rows (through ``table`` where paged), the new
    row appended, every head scoring latent + rotated key and taking the latent back."""
    q, qr, cn, rn, cp, rp = (np.asarray(a.astype(jnp.float32), np.float64) for a in (q, qr, cn, rn, cp, rp))
    c, r = cp[layer][:, 0], rp[layer][:, 0]                                  # [P, S, d]
    if table is not None:
        t = np.maximum(np.asarray(table), 0)
        c, r = c[t].reshape(t.shape[0], -1, c.shape[-1]), r[t].reshape(t.shape[0], -1, r.shape[-1])
    n_slots = c.shape[1]
    c = np.concatenate([c, cn[:, None]], 1)
    r = np.concatenate([r, rn[:, None]], 1)
    sc = (np.einsum("bhr,btr->bht", q, c) + np.einsum("bhd,btd->bht", qr, r)) * scale
    slot = np.arange(n_slots + 1)
    ok = (slot[None] < np.asarray(lengths)[:, None]) | (slot[None] == n_slots)
    sc = np.where(ok[:, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bht,btr->bhr", p, c)


@pytest.mark.parametrize("paged, b, h, r, dr, slots, splits", [
    (False, 3, 16, 64, 16, 96, None),      # contiguous, DeepSeek's 16 heads, the default splits
    (False, 2, 5, 32, 16, 64, 3),          # heads not a power of two (padded to 16), uneven splits
    (False, 2, 40, 32, 16, 64, None),      # three tiles of 16 heads, the last padded
    (True, 3, 16, 64, 32, 16, None),       # paged, blocks of 16
    (True, 2, 8, 128, 16, 32, 2),          # paged, larger blocks
])
def test_latent_decode_attention_matches_float64(paged, b, h, r, dr, slots, splits):
    """The latent kernel (interpret mode on the CPU) against float64 and against its jnp
    reference: a full row, an empty one (only the new row), one ending mid-block; in a paged pool
    the blocks outside a row's table hold other data, and a contiguous pool's other layers too."""
    rng = np.random.default_rng()
    layers, m = 3, 5
    rows = b * m + 3 if paged else b
    q, qr, cn, rn, cp, rp = _latent_case(rng, layers, rows, b, h, r, dr, slots)
    row_slots = m * slots if paged else slots
    lengths = rng.integers(1, row_slots + 1, b)
    lengths[0], lengths[1] = row_slots, 0
    if b > 2:
        lengths[2] = row_slots // 2 + 3
    table = None
    if paged:
        table = rng.permutation(np.arange(rows))[:b * m].reshape(b, m).astype(np.int32)
        table[1, 1:] = -1                                              # unused entries of the empty row
    layer = int(rng.integers(layers))
    scale = 0.11
    fn = jax.jit(functools.partial(da.latent_decode_attention, scale=scale, splits=splits, interpret=INTERPRET))
    args = (q, qr, cn, rn, cp, rp, jnp.int32(layer), None if table is None else jnp.asarray(table),
            jnp.asarray(lengths, jnp.int32))
    got = np.asarray(fn(*args).astype(jnp.float32), np.float64)
    ref = _latent_ref64(q, qr, cn, rn, cp, rp, layer, table, lengths, scale)
    assert got.shape == (b, h, r) and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=TOL * np.abs(ref).max(), rtol=0)
    plain = np.asarray(da.latent_reference(*args, scale=scale), np.float64)
    np.testing.assert_allclose(plain, ref, atol=TOL * np.abs(ref).max(), rtol=0)
    other = _latent_ref64(q, qr, cn, rn, cp, rp, (layer + 1) % layers, table, lengths, scale)
    assert np.abs(got[0] - other[0]).max() > 10 * TOL * np.abs(ref).max()    # another layer's rows: far off


def test_latent_partials_fill_poisoned_buffers():
    """Every latent program writes its three blocks, also where its slots lie past the row's
    length (``m = -inf``, ``l = 0``, ``acc = 0``): compiled afresh twice on the same inputs, the
    outputs are identical and finite where they must be (no uninitialised memory leaks in)."""
    rng = np.random.default_rng()
    b, h, r, dr, slots = 2, 16, 32, 16, 128
    q, qr, _, _, cp, rp = _latent_case(rng, 2, b, b, h, r, dr, slots)
    lengths = jnp.asarray([5, 70], jnp.int32)
    fn = jax.jit(functools.partial(da.latent_partials, scale=0.2, paged=False, splits=4, interpret=INTERPRET))
    acc, m, l = (np.asarray(a) for a in fn(q, qr, cp, rp, jnp.asarray([1], jnp.int32), jnp.zeros((1, 1), jnp.int32),
                                            lengths))
    assert acc.shape == (b, 4, h, r) and m.shape == l.shape == (b, 4, h)
    assert not np.isnan(acc).any() and not np.isnan(m).any() and not np.isnan(l).any()
    assert np.isneginf(m[0, 1:]).all() and (l[0, 1:] == 0).all() and (acc[0, 1:] == 0).all()
    assert np.isfinite(m[1, :3]).all() and np.isneginf(m[1, 3:]).all()


def test_latent_refused_shapes_name_what_they_got():
    rng = np.random.default_rng()
    q, qr, cn, rn, cp, rp = _latent_case(rng, 2, 2, 2, 16, 32, 16, 64)
    lengths = jnp.asarray([3, 4], jnp.int32)
    call = functools.partial(da.latent_decode_attention, scale=1.0, interpret=True)
    why = da.latent_unsupported_reason
    assert "qk_rope_head_dim 8" in why(q.shape, 8, cp.shape, jnp.bfloat16, paged=False)
    assert "kv_lora_rank 48" in why((2, 16, 48), 16, (2, 2, 1, 64, 48), jnp.bfloat16, paged=False)
    assert "cache length 40" in why(q.shape, 16, (2, 2, 1, 40, 32), jnp.bfloat16, paged=False)
    assert "block_size 24" in why(q.shape, 16, (2, 2, 1, 24, 32), jnp.bfloat16, paged=True)
    assert "dtype float32" in why(q.shape, 16, cp.shape, jnp.float32, paged=False)
    with pytest.raises(KernelConfigError, match="cache length 40"):
        call(q, qr, cn, rn, cp[:, :, :, :40], rp[:, :, :, :40], 0, None, lengths)
    with pytest.raises(KernelDTypeError, match="r_pool: expected bfloat16, got float16"):
        call(q, qr, cn, rn, cp, rp.astype(jnp.float16), 0, None, lengths)
    with pytest.raises(KernelShapeError, match=r"c_pool: expected \[L, P, 1, S, 32\], got shape \(2, 2, 64, 32\)"):
        call(q, qr, cn, rn, cp[:, :, 0], rp, 0, None, lengths)
    with pytest.raises(KernelShapeError, match=r"c_new: expected \[2, 32\], got shape \(32,\)"):
        call(q, qr, cn[0], rn, cp, rp, 0, None, lengths)
    with pytest.raises(KernelShapeError, match=r"a contiguous pool holds one row per sequence"):
        call(q, qr, cn, rn, jnp.concatenate([cp, cp], 1), jnp.concatenate([rp, rp], 1), 0, None, lengths)
    with pytest.raises(KernelShapeError, match=r"block_table: expected an integer \[2, M\]"):
        call(q, qr, cn, rn, cp, rp, 0, jnp.zeros((3, 2), jnp.int32), lengths)
    with pytest.raises(KernelShapeError, match=r"lengths: expected \[2\]"):
        call(q, qr, cn, rn, cp, rp, 0, None, lengths[:1])


@cpu_only
def test_latent_decode_attention_lowers_to_triton():
    """The latent kernel lowers to Triton IR for CUDA at DeepSeek-V3's widths (rank 512, rope 64,
    128 heads) over a 61-layer cache of 64 rows of 4096 slots (past 2^32 bytes: 64-bit offsets),
    contiguous and paged."""
    s = jax.ShapeDtypeStruct
    q, qr, cn, rn = (s((64, 128, 512), jnp.bfloat16), s((64, 128, 64), jnp.bfloat16), s((64, 512), jnp.bfloat16),
                     s((64, 64), jnp.bfloat16))
    for pools, table in ((((61, 64, 1, 4096, 512), (61, 64, 1, 4096, 64)), None),
                         (((61, 16384, 1, 16, 512), (61, 16384, 1, 16, 64)), s((64, 256), jnp.int32))):
        args = (q, qr, cn, rn, s(pools[0], jnp.bfloat16), s(pools[1], jnp.bfloat16), s((), jnp.int32), table,
                s((64,), jnp.int32))
        with abstract_h200():
            text = jax.jit(functools.partial(da.latent_decode_attention, scale=0.1)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text


@gpu                                 # on the CPU too (the kernel in the interpreter)
@pytest.mark.parametrize("paged", [False, True])
def test_deepseek_decode_steps_on_the_latent_kernel(tmp_path, monkeypatch, paged):
    """A scanned bf16 DeepSeek-V2 decoder (latent rank 32, rope 16) whose decode steps attend with
    the latent kernel, against the same steps on XLA, over a contiguous cache and a paged pool
    with a scrambled table. Both round in bf16 (the kernel its softmax weights, XLA its
    probabilities); most rows agree to 3%, as for the grouped-query kernel."""
    from wna16_jax.models import decoder, load_model, write_random_model
    from wna16_jax.models.synthetic import RandomModelSpec
    from wna16_jax.schemes import QuantScheme

    spec = RandomModelSpec(model_type="deepseek_v2", scheme=QuantScheme("gptq", 4, 32, False), vocab_size=256,
                           hidden_size=128, num_layers=3, num_heads=8, num_kv_heads=8, head_dim=48, num_experts=4,
                           top_k=2, moe_intermediate_size=64, intermediate_size=128, first_k_dense_replace=1,
                           n_shared_experts=1,
                           mla=dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                    v_head_dim=32))
    path = write_random_model(str(tmp_path / "m"), spec, seed=int(np.random.default_rng().integers(1 << 30)))
    model = load_model(path, dtype=jnp.bfloat16, scan_layers=True)
    rng = np.random.default_rng()
    prompts = rng.integers(3, 256, (4, 20))
    cache = None
    if paged:
        bs, m, blocks = 16, 3, 16
        table = np.full((4, m), -1, np.int32)
        table[:, :2] = rng.permutation(np.arange(1, blocks))[:8].reshape(4, 2)
        cache = model.init_paged_cache(blocks, bs).with_block_table(table)
    monkeypatch.setattr(decoder, "decode_kernel_mode", lambda: None)
    xla = _decode_logits(model, prompts, cache=cache)
    monkeypatch.setattr(decoder, "decode_kernel_mode", lambda: "gpu" if ON_GPU else "interpret")
    calls = []
    kernel = da.latent_decode_attention
    monkeypatch.setattr(da, "latent_decode_attention", lambda *a, **k: calls.append(a[7]) or kernel(*a, **k))
    got = _decode_logits(model, prompts, cache=cache)
    # the dense head layer (unrolled) and the scanned layer body, traced once per decode step
    assert len(calls) == 2 * 3 and all((t is not None) == paged for t in calls)
    _mostly_close(got, xla)


@gpu
@needs_gpu
def test_latent_decode_attention_at_model_shapes_gpu():
    """Compiled on the GPU at DeepSeek-V2-Lite's (16 heads) and V3's (128 heads) latent widths,
    batch 1 / 8, 1024 slots contiguous and a paged pool of blocks of 16, against float64."""
    rng = np.random.default_rng()
    for h, b, paged in ((16, 1, False), (16, 8, False), (128, 4, False), (128, 2, True), (16, 8, True)):
        layers, m = 4, 64
        rows, slots = (b * m + 5, 16) if paged else (b, 1024)
        q, qr, cn, rn, cp, rp = _latent_case(rng, layers, rows, b, h, 512, 64, slots)
        lengths = rng.integers(0, (m * 16 if paged else slots) + 1, b)
        table = rng.permutation(np.arange(rows))[:b * m].reshape(b, m).astype(np.int32) if paged else None
        layer = int(rng.integers(layers))
        got = np.asarray(jax.jit(functools.partial(da.latent_decode_attention, scale=192 ** -0.5))(
            q, qr, cn, rn, cp, rp, jnp.int32(layer), None if table is None else jnp.asarray(table),
            jnp.asarray(lengths, jnp.int32)).astype(jnp.float32), np.float64)
        ref = _latent_ref64(q, qr, cn, rn, cp, rp, layer, table, lengths, 192 ** -0.5)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, atol=TOL * np.abs(ref).max(), rtol=0)
