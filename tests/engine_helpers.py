"""Shared helpers of the GPU-engine tests (``test_triton_*``, ``test_wgmma_*``, ``test_row_gather``,
``test_executors``): random kernel and layer cases, float64 weights and references, the closeness
checks (NaN never passes), the layer wrappers over the library's layout pytrees, and the GPU skip
markers. Kernels run in interpret mode on the CPU and compiled on the GPU when one is present."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import routing
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.schemes import QuantScheme

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _on_hopper() -> bool:
    if not ON_GPU:
        return False
    from wna16_jax.backends import Device

    return Device.current().compute_capability == (9, 0)


ON_HOPPER = _on_hopper()

#: GPU-only tests: ``@gpu`` then ``@needs_gpu`` (the Triton-lowered engine) or ``@needs_hopper``
#: (the wgmma kernels, Mosaic GPU); skipped without one (run on the device machine with ``-m gpu``)
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (runs on the device machine)")
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
#: CPU-only tests of what the GPU tests compile and run for real (lowering without a GPU)
cpu_only = pytest.mark.skipif(ON_GPU, reason="the GPU tests compile and run it")

SCHEMES = {
    "awq_g128": QuantScheme("awq", 4, 128, True),
    "gptq4_g64": QuantScheme("gptq", 4, 64, False),
    "gptq4_g128_actorder": QuantScheme("gptq", 4, 128, False, True),
    "gptq8_channel": QuantScheme("gptq", 8, -1, False),
    "ct4_asym_g32": QuantScheme("compressed-tensors", 4, 32, True),
    "ct8_sym_g128": QuantScheme("compressed-tensors", 8, 128, False),
}
#: the formats the wgmma kernels take (4-bit, group 128 or channelwise)
WGMMA_SCHEMES = {"awq_g128": SCHEMES["awq_g128"], "gptq4_g128_actorder": SCHEMES["gptq4_g128_actorder"],
                 "gptq4_channel": QuantScheme("gptq", 4, -1, False)}


# ----------------------------------------------------------------------------- kernel level


def kernel_case(rng, bits, group, zp, e=3, n=256, k=256):
    """Random codes ``[E, N, K]``, scales ``[E, G, N]`` float32 and zero points (or None)."""
    codes = rng.integers(0, 1 << bits, (e, n, k))
    g = 1 if group == -1 else k // group
    scales = (rng.random((e, g, n)) * 0.1 + 0.01).astype(np.float32)
    zeros = rng.integers(0, 1 << bits, (e, g, n)) if zp else None
    return codes, scales, zeros


def weights64(codes, scales, zeros, bits, group, dtype=jnp.bfloat16):
    """[E, K, N] float64 of the kernel's weight values: (code - zero)·scale rounded to ``dtype``."""
    k = codes.shape[-1]
    gi = np.zeros(k, int) if group == -1 else np.arange(k) // group
    s = np.asarray(jnp.asarray(scales, dtype).astype(jnp.float32), np.float64)[:, gi, :]      # [E, K, N]
    z = (1 << (bits - 1)) if zeros is None else zeros[:, gi, :]
    w = (np.swapaxes(codes, 1, 2) - z) * s
    return np.asarray(jnp.asarray(w, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def close(got, ref, rtol=2e-5):
    """Relative max error of ``got`` against the float64 ``ref``; NaN (unwritten, poisoned) fails."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert got.shape == np.shape(ref), (got.shape, np.shape(ref))
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


def gated64(ref, act):
    """float64 twin of the wgmma ``gated`` epilogue: ``[M, N]`` (64-column gate / up halves per 128
    columns) → ``[M, N/2]``."""
    q = ref.reshape(ref.shape[0], -1, 2, 64)
    g, u = q[:, :, 0].reshape(ref.shape[0], -1), q[:, :, 1].reshape(ref.shape[0], -1)
    if act == "silu":
        return g / (1.0 + np.exp(-g)) * u
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3))) * u


def abstract_h200():
    """Lowering target for Triton kernels without a GPU: jax ≥ 0.11 asks the device for its
    compute capability, so name an abstract H200 (jax 0.10.2 needs nothing)."""
    import contextlib

    sh = jax.sharding
    if not hasattr(sh, "AbstractDevice") or not hasattr(sh, "use_abstract_mesh"):
        return contextlib.nullcontext()
    dev = sh.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return sh.use_abstract_mesh(sh.AbstractMesh((1,), ("x",), abstract_device=dev))


# ----------------------------------------------------------------------------- layer level


def layer_case(rng, scheme, e, h, i, t, k, *, bias=False, map_=False):
    """A random loader-layout layer (CheckpointWeights, numpy) and ``t`` tokens routed top-``k``
    (expert 0 never routed) → ``(w, x, topk_weights, topk_ids, expert_map or None)``; with
    ``map_`` ``e + 3`` global experts, ``e`` of them local."""
    w = random_checkpoint_weights(rng, scheme, e, h, i, scale=0.05)
    if bias:          # about the size of the GEMM outputs they are added to, so a misplaced bias shows
        w = w.replace(w13_bias=(1.0 * rng.standard_normal((e, 2 * i))).astype(np.float16),
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


def reference(w, x, tw, ids, em, activation="silu", on_input=False):
    """The layer in float64 (numpy, every expert decoded from the checkpoint layout by
    ``tests/reference.py``, which shares no code with the library)."""
    r13, r2 = dequant_checkpoint(w, w.scheme)
    b13 = None if w.w13_bias is None else np.asarray(w.w13_bias, np.float64)
    b2 = None if w.w2_bias is None else np.asarray(w.w2_bias, np.float64)
    return fused_moe_ref(np.asarray(x.astype(jnp.float32)), np.asarray(tw), np.asarray(ids), r13, r2, b13, b2,
                         activation=activation, expert_map=None if em is None else np.asarray(em),
                         on_input=on_input)


def layer_close(got, ref, tol=1.5e-2, what=""):      # bf16 activations and bf16-rounded weights
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert got.shape == np.shape(ref), f"{what}: shape {got.shape} != {np.shape(ref)}"
    assert np.isfinite(got).all(), f"{what}: {np.isnan(got).sum()} NaN of {got.size}"
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= tol, f"{what}: relative error {err:.2e}"


def tiles_layer(x, tw, ids, tiles, **kw):
    """:func:`pallas_kernels.fused_moe_tiles.fused_moe_tiles` on the library's ``TileWeights``."""
    from pallas_kernels.fused_moe_tiles import fused_moe_tiles

    w13, w2 = tiles.gemms()
    return fused_moe_tiles(x, tw, ids, w13, w2, bits=tiles.bits, group_size=tiles.group_size, **kw)


def wgmma_layer(x, tw, ids, wg, expert_map=None, **options):
    """:func:`pallas_kernels.wgmma_layer.fused_moe_wgmma` on the library's ``WgmmaWeights``
    (``options``: the layer's ``LayerConfig`` fields, ``activation``, ...)."""
    from pallas_kernels.wgmma_layer import fused_moe_wgmma

    w13, w2 = wg.gemms()
    return fused_moe_wgmma(x, tw, ids, w13, w2, interleaved=wg.w13_interleaved, expert_map=expert_map, **options)


def wgmma_reference_layer(x, tw, ids, wg, expert_map=None, **options):
    """:func:`wgmma_layer` with ``kernels="reference"``: the layer's XLA glue around the jnp
    references of its kernels (the grouped GEMM and the row gather, which fills the rows its
    contract leaves unspecified with NaN), on any device."""
    return wgmma_layer(x, tw, ids, wg, expert_map, kernels="reference", **options)


# ----------------------------------------------------------------------------- GPU: model shapes


GPU_SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768), "dsv2lite": (64, 6, 2048, 1408)}
GPU_TOKENS = {"mixtral": (1, 5), "qwen3": (1, 16), "dsv2lite": (1, 16)}


def dot64(a, w):
    """``a @ wᵀ`` in float64 on the default device (``a`` float64 on the host, ``w`` a float32 device
    array): XLA's own float64 dot (a float64 GEMM on the GPU), not the engines' code, and no
    float64 copy of a model-sized weight on the host. ``a``'s rows are zero-padded to a power of
    two (at least 8) and the product cut back: each expert's row count would otherwise compile a
    dot of its own, the padded rows are zeros and change no other row's value."""
    rows = max(8, 1 << (len(a) - 1).bit_length())
    with jax.enable_x64(True):
        a64 = jnp.asarray(np.pad(a, ((0, rows - len(a)), (0, 0))), jnp.float64)
        return np.asarray(jnp.dot(a64, w.astype(jnp.float64).T), np.float64)[:len(a)]


def fast_reference(w, x, tw, ids):
    """Float64 reference for model-sized layers (silu): each used expert dequantized exactly in
    float32 on the device from the CHECKPOINT layout (independent of the engines' layouts; the
    products of 4/8-bit codes, zero points and 16-bit scales are exact there), the two GEMMs in
    float64 (:func:`dot64`), the activation and the top-k sum in float64 on the host."""
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    ids, tw = np.asarray(ids), np.asarray(tw, np.float64)
    out = np.zeros((xf.shape[0], w.hidden_size))
    for e in np.unique(ids):
        w13, w2 = (a[0] for a in w.take_experts(jnp.asarray([e])).dequantize(jnp.float32))
        tok, slot = np.nonzero(ids == e)
        h = dot64(xf[tok], w13)
        i = h.shape[1] // 2
        a = h[:, :i] / (1 + np.exp(-h[:, :i])) * h[:, i:]
        out[tok] += tw[tok, slot][:, None] * dot64(a, w2)   # (tok is unique: a token routes to an expert once)
    return out


def routed_case(rng, w, t, k):
    """Fresh layer inputs for ``t`` tokens on checkpoint weights ``w``: bf16 activations, top-``k``
    routing of random logits with expert 0 never routed, and the float64 reference
    (:func:`fast_reference`) → ``(x, topk_weights, topk_ids, ref)``."""
    x = jnp.asarray(rng.standard_normal((t, w.hidden_size)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((t, w.num_experts)), jnp.float32).at[:, 0].add(-100.0)
    tw, ids = routing.fused_topk(logits, k, renormalize=True)
    return x, tw, ids, fast_reference(w, x, tw, ids)


def table_weights(shape, key):
    """``(rng, top-k, checkpoint weights, the weights the dispatch table prepares on this GPU)`` for
    a GPU layer test: random ``WGMMA_SCHEMES[key]`` weights at ``GPU_SHAPES[shape]``."""
    from wna16_jax.backends import TABLE, Backend

    rng = np.random.default_rng()
    e, k, h, i = GPU_SHAPES[shape]
    w = random_checkpoint_weights(rng, WGMMA_SCHEMES[key], e, h, i, scale=0.02).to_jax()
    return rng, k, w, TABLE[Backend.MARLIN].prepare(w.scheme, w)
