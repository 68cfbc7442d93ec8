"""Whole quantized MoE decoders in Flax NNX: :class:`MoEDecoder` and :func:`load_model`.

One decoder class covers the Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek-V2 / V3 families;
:class:`DecoderConfig` (from ``config.json``) switches the family's details on and off:

* attention: grouped-query attention with rotary embeddings (``rope_theta``, linear or YaRN
  scaling), queries / keys normed per head (Qwen3), q/k/v biases (Qwen2), Mixtral's sliding
  window; DeepSeek's multi-head latent attention (:class:`LatentAttention`, a latent KV cache);
* MLPs: :class:`wna16_jax.nn.QuantizedMoE` on the MoE layers (router, top-k, shared experts and
  Qwen2's sigmoid gate as the checkpoint has them, DeepSeek's grouped top-k with its
  score-correction bias), a gated SiLU MLP on the dense ones (``decoder_sparse_step`` /
  ``mlp_only_layers``, ``first_k_dense_replace`` / ``moe_layer_freq``);
* every linear layer the checkpoint quantizes is a :class:`~wna16_jax.models.linear.QuantizedLinear`
  (packed as stored), except latent attention's ``kv_b_proj``, only ever read whole, which is kept
  dequantized and frozen (:func:`absorb_dtype`), cut into its key and value parts (:class:`AbsorbedKV`); the rest (embeddings, ``lm_head``, norms, routers) stays 16-bit;
  ``lm_head`` is the embedding matrix when ``tie_word_embeddings``.

State: ``nnx.Param`` for the 16-bit weights (embeddings, norms, 16-bit linears, routers),
:class:`~wna16_jax.models.linear.QuantizedWeight` and :class:`~wna16_jax.nn.QuantizedExperts`
for the frozen quantized ones.

Computation runs in ``dtype`` (the activations' dtype; float32 reproduces the float reference).
RMS norms and softmaxes are computed in float32, every product accumulates in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from .. import attention as attention_table
from ..backends import Backend, BackendFallbackWarning, fallback_summary
from ..checkpoint import Checkpoint, DenseWeights
from ..device import Device
from ..errors import ConfigError, DTypeError, MissingTensorError, ShapeError, UnexpectedTensorError, ValueRangeError
from ..nn import SHARDING_KEY, QuantizedExperts, QuantizedMoE
from ..hub import resolve_model_dir
from ..model_config import EXPERT_FIELDS
from ..safetensors_io import load_json
from ..serialize import MANIFEST, ConvertedCheckpoint
from .config import DecoderConfig
from .generation_config import read_generation_config
from .. import formats
from ..checkpoint import MatrixPart, read_matrix
from ..weights import CheckpointForm, CheckpointWeights, LayerStack, at_layer
from .kv_cache import KVCache
from .linear import DenseLinear, QuantizedLinear, QuantizedWeight, engine_for, quantized_matmul

_MASKED = -1e30


def default_dtype():
    """float32 on the CPU, bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nnx.Module):
    """``w · x / sqrt(mean(x²) + eps)``, the statistics in float32."""

    def __init__(self, weight, eps: float, *, param_dtype=None):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.asarray(weight, param_dtype) if param_dtype else jnp.asarray(weight))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, factor: float = 1.0) -> np.ndarray:
    """``1 / (theta ** (2j / head_dim)) / factor`` for ``j < head_dim / 2`` (float32)."""
    exps = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps) / np.float32(factor)).astype(np.float32)


def yarn_inverse_frequencies(dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float,
                             original_max_positions: int) -> np.ndarray:
    """YaRN's blend of the original frequencies (dimensions that turn fast within the original
    context, above ``beta_fast`` turns) and the frequencies divided by ``factor`` (those below
    ``beta_slow`` turns), with a linear ramp between (float32)."""
    base = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)

    def dim_at(turns):                      # the dimension whose wavelength fits `turns` times
        return dim * np.log(original_max_positions / (turns * 2 * np.pi)) / (2 * np.log(theta))

    low, high = max(np.floor(dim_at(beta_fast)), 0.0), min(np.ceil(dim_at(beta_slow)), dim - 1.0)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp                       # 1: the original frequency, 0: the interpolated one
    return (1.0 / base * keep + 1.0 / (factor * base) * (1.0 - keep)).astype(np.float32)


def rope_frequencies(config: DecoderConfig) -> tuple[tuple[float, ...], float]:
    """The rotary inverse frequencies over ``config.rope_dim`` dimensions and the factor the
    cos / sin tables are multiplied by (YaRN's attention factor; 1 otherwise)."""
    d = config.rope_dim
    if config.rope_type == "yarn":
        beta_fast, beta_slow, orig, attn = config.rope_yarn
        inv = yarn_inverse_frequencies(d, config.rope_theta, config.rope_factor, beta_fast, beta_slow, orig)
        return tuple(float(f) for f in inv), float(attn)
    factor = config.rope_factor if config.rope_type == "linear" else 1.0
    return tuple(float(f) for f in rope_inverse_frequencies(d, config.rope_theta, factor)), 1.0


def apply_rope(x, positions, inv_freq, *, interleaved: bool = False, attention_factor: float = 1.0):
    """Rotate ``x [B, S, n, d]`` by ``positions [B, S]``. The rotated pairs are the two halves of
    each head (Hugging Face's ``rotate_half``), or with ``interleaved`` the adjacent dimensions
    ``(2j, 2j+1)`` (DeepSeek's complex-number form); cos and sin are scaled by ``attention_factor``."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    cos = (jnp.cos(freqs) * attention_factor)[:, :, None, :]
    sin = (jnp.sin(freqs) * attention_factor)[:, :, None, :]
    if interleaved:
        pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)
    cos = jnp.concatenate([cos, cos], axis=-1).astype(x.dtype)
    sin = jnp.concatenate([sin, sin], axis=-1).astype(x.dtype)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


#: the variables a scanned decoder keeps stacked (read in place at the layer's index, never sliced)
STACKED_IN_PLACE = (QuantizedWeight, QuantizedExperts)


def bind_layer(in_place, index):
    """The stacked in-place variables (:data:`STACKED_IN_PLACE`) of a scanned decoder's layers,
    each holding :class:`~wna16_jax.weights.LayerStack` ``(stack, index)``: merged into the
    layer's module, its quantized linears and experts read layer ``index`` of the stacks where
    they lie. The scan body calls it once; no module is told its layer."""
    return jax.tree.map(lambda v: v.replace(LayerStack(v.get_value(), index)), in_place,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


#: whether decode steps may attend with the Triton kernel (:func:`decode_kernel_mode`); False
#: keeps them on XLA (``benchmarks/generate.py --decode-kernel off`` for one run; docs/models.md)
DECODE_KERNEL = True


def decode_kernel_mode() -> str | None:
    """How a decode step (one new token per sequence) attends on this device: ``"gpu"`` (the
    Triton kernel :mod:`pallas_kernels.decode_attention`, on an NVIDIA GPU of SM80 or later,
    where :data:`DECODE_KERNEL` allows it) or None (XLA). Read when a step is traced; the tests
    replace it with ``"interpret"`` (the kernel in Pallas's interpreter) to run the kernel's
    path on the CPU."""
    dev = Device.current()
    return "gpu" if DECODE_KERNEL and dev.is_nvidia and dev.compute_capability >= (8, 0) else None


def _mask(positions, kpos, sliding_window=None):
    """``[B, S, T]``: key ``t`` is visible from query ``s`` (causal, optionally windowed)."""
    qp, kp = positions[:, :, None], kpos[:, None, :]
    mask = kp <= qp
    if sliding_window is not None:
        mask = mask & (qp - kp < sliding_window)
    return mask


class Attention(nnx.Module):
    """Grouped-query attention with rotary embeddings; optional per-head q/k RMS norms and a
    sliding window. With a cache, the new keys / values are written at their positions (cache
    slot = position) and the queries attend to the first ``kv_len`` slots."""

    def __init__(self, config: DecoderConfig, qkv, o_proj, q_norm=None, k_norm=None):
        """``qkv``: the q, k and v projections as three linears, or as one (``qkv_proj``, read as one
        matrix of three parts where an engine runs it: one GEMM)."""
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.sliding_window = config.sliding_window
        self.inv_freq, self.rope_scale = rope_frequencies(config)
        self.softmax_scale = float(config.scale)
        self.qkv_proj, (q_proj, k_proj, v_proj) = (qkv, (None,) * 3) if not isinstance(qkv, tuple) else (None, qkv)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm

    def __call__(self, x, positions, cache: KVCache | None = None, kv_len: int | None = None):
        """``cache``: bound to this layer (:meth:`KVCache.at_layer`), or None."""
        b, s, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        else:
            q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.reshape(b, s, nh, hd), k.reshape(b, s, nkv, hd), v.reshape(b, s, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv = np.asarray(self.inv_freq, np.float32)
        q, k = (apply_rope(t, positions, inv, attention_factor=self.rope_scale) for t in (q, k))
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)           # [B, n_kv, S, d]
        mode = decode_kernel_mode() if cache is not None and s == 1 else None
        if (mode and cache.k.dtype == q.dtype
                and not attention_table.kernel_reason(cache.paged_pool, q.shape, cache.k.shape, q.dtype)):
            return self._decode_step(q, k, v, positions, cache, interpret=mode == "interpret")
        if cache is None:
            keys, vals, kpos = k, v, positions
        else:
            cache = cache.update(k, v, positions)
            keys, vals, kpos = cache.read(kv_len, x.dtype)
        g = nh // nkv
        prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        if x.dtype != jnp.float32 and jax.default_backend() == "cpu":
            # XLA:CPU has no 16-bit × 16-bit → float32 dot for some batched shapes (DotThunk
            # UNIMPLEMENTED); widened first, the products are the same (exact in float32)
            q, keys, vals = q.astype(jnp.float32), keys.astype(jnp.float32), vals.astype(jnp.float32)
        scores = jnp.einsum("bsngd,bntd->bngst", q.reshape(b, s, nkv, g, hd), keys, precision=prec,
                            preferred_element_type=jnp.float32) * np.float32(self.softmax_scale)
        scores = jnp.where(_mask(positions, kpos, self.sliding_window)[:, None, None], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype).astype(vals.dtype)
        out = jnp.einsum("bngst,bntd->bsngd", probs, vals, precision=prec,
                         preferred_element_type=jnp.float32).astype(x.dtype)
        return self.o_proj(out.reshape(b, s, nh * hd)), cache

    def _decode_step(self, q, k, v, positions, cache: KVCache, *, interpret: bool):
        """One new token per sequence: the kernel of the cache's form (:mod:`wna16_jax.attention`)
        reads the bound layer's earlier slots (contiguous: the row's block; paged: the blocks of
        its table) before the new rows are written (they join its softmax from registers), then
        the rows are written in place. A row at position ``p`` reads slots ``0 … p - 1``."""
        b = q.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        start = positions[:, 0]                      # the new row's slot = the old slots' count
        out = attention_table.kernel_decode(
            q.reshape(b, nkv, nh // nkv, hd), k[:, :, 0], v[:, :, 0], cache.k, cache.v,
            jnp.asarray(cache.layer, jnp.int32), cache.block_table, start, scale=self.softmax_scale,
            window=self.sliding_window, interpret=interpret)
        return self.o_proj(out.reshape(b, 1, nh * hd)), cache.update(k, v, positions)


def absorb_dtype(dtype):
    """What :class:`LatentAttention` absorbs ``kv_b_proj`` in for ``dtype`` activations: their own
    dtype on a GPU (and for float32), float32 for 16-bit activations on the CPU."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype == jnp.float32 or jax.default_backend() != "cpu" else jnp.dtype(jnp.float32)


class AbsorbedKV(nnx.Module):
    """Latent attention's ``kv_b_proj`` as the two matrices absorption reads, each stored apart in
    the layout its product reads: ``w_uk [heads, qk_nope_head_dim, kv_lora_rank]`` (each query's
    plain part into latent space) and ``w_uv [heads, v_head_dim, kv_lora_rank]`` (the attended
    latent out to each head's value). Cut once at load: cutting them from one ``[heads ·
    (nope + v), rank]`` matrix at every step was two strided copies a layer. ``frozen``: the two
    are :class:`~wna16_jax.models.linear.QuantizedWeight` (a quantized checkpoint's matrix kept
    dequantized: optimizers leave it alone), else trainable ``nnx.Param``."""

    def __init__(self, weight, num_heads: int, nope: int, *, frozen: bool = False):
        w = jnp.asarray(weight)
        n, r = (int(d) for d in w.shape)
        if n % num_heads or not 0 < nope < n // num_heads:
            raise ShapeError(f"kv_b_proj: {n} rows are not {num_heads} heads of {nope} key and some value rows")
        var = QuantizedWeight if frozen else nnx.Param
        w = w.reshape(num_heads, n // num_heads, r)
        self.w_uk, self.w_uv = var(w[:, :nope]), var(w[:, nope:])
        self.out_features, self.in_features = n, r

    def matrices(self, dtype):
        """``(w_uk, w_uv)`` in ``dtype`` (in a scanned decoder, the bound layer's)."""
        return tuple(at_layer(v.get_value()).astype(dtype) for v in (self.w_uk, self.w_uv))

    def dense(self, dtype):
        """The ``[heads · (nope + v), rank]`` matrix ``kv_b_proj`` was (as a linear's ``W``)."""
        uk, uv = self.matrices(dtype)
        return jnp.concatenate([uk, uv], axis=1).reshape(self.out_features, self.in_features)


class LatentAttention(nnx.Module):
    """DeepSeek's multi-head latent attention (MLA). Queries: ``q_proj``, or ``q_a_proj`` →
    RMS norm → ``q_b_proj``; each head's query is ``qk_nope_head_dim`` plain dimensions and
    ``qk_rope_head_dim`` rotated ones. ``kv_a_proj_with_mqa`` gives a latent of ``kv_lora_rank``
    (RMS-normed) and one rotated key shared by every head; ``kv_b_proj`` would expand the latent
    into each head's plain key and value.

    The cache holds only the normed latent and the rotated shared key (``kv_lora_rank +
    qk_rope_head_dim`` numbers per token and layer, against ``n_heads · (qk_head_dim + v_head_dim)``
    for expanded keys and values), and ``kv_b_proj`` is absorbed: each query's plain part is
    taken into latent space (``q · W_uk``), scores are ``q_lat · latent + q_rope · k_rope``, and
    the attention-weighted latent is expanded by ``W_uv`` per head before ``o_proj``: the same
    products, in another order."""

    def __init__(self, config: DecoderConfig, x_proj, q_a_layernorm, q_b_proj, kv_a_layernorm, kv_b_proj, o_proj):
        """``x_proj``: the two projections of ``x`` — ``(q_proj, None, kv_a_proj_with_mqa)`` or
        ``(None, q_a_proj, kv_a_proj_with_mqa)`` — or one linear holding both (read as one matrix of
        two parts where an engine runs it)."""
        m = config.mla
        self.num_heads = config.num_heads
        self.nope, self.rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.rank, self.v_dim = m.kv_lora_rank, m.v_head_dim
        self.inv_freq, self.rope_scale = rope_frequencies(config)
        self.interleaved = bool(config.rope_interleaved)
        self.softmax_scale = float(config.scale)
        self.x_proj, (q_proj, q_a_proj, kv_a_proj_with_mqa) = ((x_proj, (None,) * 3) if not isinstance(x_proj, tuple)
                                                              else (None, x_proj))
        self.q_proj, self.q_a_proj, self.q_a_layernorm, self.q_b_proj = q_proj, q_a_proj, q_a_layernorm, q_b_proj
        self.kv_a_proj_with_mqa, self.kv_a_layernorm, self.kv_b_proj = kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
        self.o_proj = o_proj

    def __call__(self, x, positions, cache: KVCache | None = None, kv_len: int | None = None):
        b, s, _ = x.shape
        nh, nope, r = self.num_heads, self.nope, self.rank
        if self.x_proj is not None:
            q, kva = self.x_proj.split(self.x_proj(x))
        else:
            q = (self.q_proj if self.q_proj is not None else self.q_a_proj)(x)
            kva = self.kv_a_proj_with_mqa(x)                             # [B, S, rank + rope]
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(b, s, nh, nope + self.rope)
        latent = self.kv_a_layernorm(kva[..., :r])[:, None]              # [B, 1, S, rank]
        inv = np.asarray(self.inv_freq, np.float32)
        q_rope, k_rope = (apply_rope(t, positions, inv, interleaved=self.interleaved,
                                     attention_factor=self.rope_scale)
                          for t in (q[..., nope:], kva[..., None, r:]))
        k_rope = jnp.swapaxes(k_rope, 1, 2)                               # [B, 1, S, rope]
        cdt = absorb_dtype(x.dtype)
        prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
        w_uk, w_uv = self.kv_b_proj.matrices(cdt)

        def dot(spec, a, c):
            return jnp.einsum(spec, a.astype(cdt), c.astype(cdt), precision=prec, preferred_element_type=jnp.float32)

        q_lat = dot("bsnd,ndr->bsnr", q[..., :nope], w_uk).astype(cdt)
        mode = decode_kernel_mode() if cache is not None and s == 1 else None
        if (mode and cache.k.dtype == x.dtype
                and not attention_table.latent_kernel_reason(cache.paged_pool, q_lat[:, 0].shape, self.rope,
                                                             cache.k.shape, x.dtype)):
            # one decode step: the kernel reads the layer's earlier slots where they lie, the new
            # latent / rotated key join its softmax, then they are written in place
            o_lat = attention_table.latent_kernel_decode(
                q_lat[:, 0].astype(x.dtype), q_rope[:, 0].astype(x.dtype), latent[:, 0, 0].astype(x.dtype),
                k_rope[:, 0, 0].astype(x.dtype), cache.k, cache.v,
                jnp.asarray(cache.layer, jnp.int32), cache.block_table, positions[:, 0],
                scale=self.softmax_scale, interpret=mode == "interpret")
            out = dot("bsnr,nvr->bsnv", o_lat[:, None], w_uv).astype(x.dtype)
            return self.o_proj(out.reshape(b, s, nh * self.v_dim)), cache.update(latent, k_rope, positions)
        if cache is None:
            lat, kr, kpos = latent, k_rope, positions
        else:
            cache = cache.update(latent, k_rope, positions)
            lat, kr, kpos = cache.read(kv_len, x.dtype)
        lat, kr = lat[:, 0], kr[:, 0]                                     # [B, T, rank], [B, T, rope]
        scores = dot("bsnr,btr->bnst", q_lat, lat) + dot("bsnd,btd->bnst", q_rope, kr)
        scores = scores * np.float32(self.softmax_scale)
        scores = jnp.where(_mask(positions, kpos)[:, None], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        o_lat = dot("bnst,btr->bsnr", probs, lat).astype(x.dtype)
        out = dot("bsnr,nvr->bsnv", o_lat, w_uv).astype(x.dtype)
        return self.o_proj(out.reshape(b, s, nh * self.v_dim)), cache


class GatedMLP(nnx.Module):
    """``down(silu(gate(x)) · up(x))`` (the dense MLP of Qwen's ``mlp_only_layers``)."""

    def __init__(self, gate_proj, up_proj, down_proj):
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x):
        g = self.gate_proj(x).astype(jnp.float32)
        u = self.up_proj(x).astype(jnp.float32)
        return self.down_proj((jax.nn.silu(g) * u).astype(x.dtype))


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp):
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def __call__(self, x, positions, cache: KVCache | None = None, kv_len=None):
        """``cache``: bound to this layer, or None."""
        h, cache = self.self_attn(self.input_layernorm(x), positions, cache, kv_len)
        x = x + h
        y = self.mlp(self.post_attention_layernorm(x))
        return x + y.astype(x.dtype), cache


def _checked_ids(name: str, a, high: int | None, *, shape=None):
    """``a`` as an int32 array ``[B, S]`` of values in ``[0, high)``, checked where concrete."""
    try:
        np.asarray(a) if isinstance(a, jax.Array) else None
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return a                                     # traced: checked by no one (see __call__)
    if isinstance(a, (list, tuple)):
        try:
            a = np.asarray(a)
        except ValueError:
            raise ShapeError(f"{name}: expected a rectangular [batch, length] array of integers") from None
    a = np.asarray(a) if not isinstance(a, (np.ndarray, jax.Array)) else a
    if not jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == np.bool_:
        raise DTypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    if a.ndim != 2 or (shape is not None and tuple(a.shape) != tuple(shape)):
        want = f"shape {tuple(shape)}" if shape is not None else "a 2-D [batch, length] array"
        raise ShapeError(f"{name}: expected {want}, got shape {tuple(a.shape)}")
    v = np.asarray(a)
    if v.size and (v.min() < 0 or (high is not None and v.max() >= high)):
        bad = v.min() if v.min() < 0 else v.max()
        rule = f"[0, {high}) (vocab_size)" if high is not None else ">= 0"
        raise ValueRangeError(f"{name}: expected values in {rule}, got {int(bad)}")
    return jnp.asarray(v, jnp.int32)


class MoEDecoder(nnx.Module):
    """A decoder-only MoE language model (see the module doc). Build with :func:`load_model`.

    ``model(tokens [B, S])`` → float32 logits ``[B, S, V]`` (causal, positions ``0..S-1``,
    no cache). Generation (KV cache, bucketed compiles, sampling): :mod:`wna16_jax.models.generation`.
    """

    def __init__(self, config: DecoderConfig, embed_tokens, layers: Sequence[DecoderLayer], norm: RMSNorm,
                 lm_head: DenseLinear | None, *, dtype=jnp.float32, scan_layers: bool = False,
                 head_layers: Sequence[DecoderLayer] = ()):
        """``scan_layers``: ``layers`` (alike) are stacked and scanned; ``head_layers`` (DeepSeek's
        leading dense layers) run unrolled before them. Without ``scan_layers`` the decoder is
        ``head_layers + layers``, unrolled."""
        self.config = config
        self.dtype = jnp.dtype(dtype).name
        self.embed_tokens = nnx.Param(embed_tokens)
        self.norm = norm
        self.lm_head = lm_head
        self.scan_layers = bool(scan_layers)
        self.mesh_plan = None        # on a mesh: its MeshPlan (wna16_jax.models.mesh.place_model)
        if self.scan_layers:
            self.layer_graph, stacked = (layers.finish() if isinstance(layers, _LayerStacker)
                                         else _stacked_layers(list(layers)))
            self.stacked_layers = nnx.data(stacked)
            self.layers = nnx.List(list(head_layers))        # run unrolled, before the scan
        else:
            self.layer_graph, self.stacked_layers = None, None
            self.layers = nnx.List(list(head_layers) + list(layers))

    # ------------------------------------------------------------------ pieces
    def embed(self, tokens):
        return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.dtype)

    def hidden_states(self, tokens, positions, cache: KVCache | None = None, kv_len: int | None = None):
        """Final-normed hidden states ``[B, S, H]`` and the updated cache (a :class:`KVCache` as
        :meth:`init_cache` makes it, or None). Each layer sees the cache bound to its index."""
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):          # unrolled (with scan_layers: the dense head)
            x, cache = layer(x, positions, None if cache is None else cache.at_layer(i), kv_len)
        if self.scan_layers:
            x, cache = self._scanned(x, positions, cache, kv_len)
        return self.norm(x), None if cache is None else cache.unbound()

    @property
    def num_scanned_layers(self) -> int:
        return self.config.num_layers - len(self.layers) if self.scan_layers else 0

    def _scanned(self, x, positions, cache, kv_len):
        """The stacked layers as one ``lax.scan`` (one compiled layer body; the cache rides in the
        carry and is written in place). The scan slices each layer's 16-bit weights; the frozen
        quantized ones stay stacked and are read in place at the layer's index (:func:`bind_layer`):
        a slice would be a copy of the layer's weights ahead of every kernel that reads them, more
        bytes than the layer's own step reads. The layer index is bound here, once."""
        graph = self.layer_graph
        in_place, sliced = nnx.split_state(self.stacked_layers, nnx.Any(*STACKED_IN_PLACE), ...)
        head = len(self.layers)

        def body(carry, xs):
            h, c = carry
            state, i = xs
            layer = nnx.merge(graph, state, bind_layer(in_place, i))
            h, c = layer(h, positions, None if c is None else c.at_layer(head + i), kv_len)
            return (h, None if c is None else c.unbound()), None

        layers = jnp.arange(self.num_scanned_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, None if cache is None else cache.unbound()), (sliced, layers))
        return x, cache

    def logits(self, h):
        """float32 logits of hidden states ``h [..., H]`` (products accumulated in float32)."""
        if isinstance(self.lm_head, QuantizedLinear):
            b = None if self.lm_head.bias is None else self.lm_head.bias.get_value()
            return quantized_matmul(h, self.lm_head.weight.get_value(), b, out_dtype=jnp.float32)
        w = (self.embed_tokens if self.lm_head is None else self.lm_head.weight)[...].astype(h.dtype)
        prec = jax.lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
        return jnp.einsum("...h,vh->...v", h, w, precision=prec, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions=None):
        """float32 logits ``[B, S, V]`` of token ids ``tokens [B, S]`` (positions ``0..S-1``, or
        ``positions [B, S]``). Concrete inputs are checked (a 2-D integer array of ids in
        ``[0, vocab_size)``, non-negative positions of the same shape); traced ones cannot be."""
        tokens = _checked_ids("tokens", tokens, self.config.vocab_size)
        if positions is not None:
            positions = _checked_ids("positions", positions, None, shape=tokens.shape)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
        h, _ = self.hidden_states(tokens, positions)
        return self.logits(h)

    # ------------------------------------------------------------------ facts
    def layer_modules(self) -> list:
        """The decoder layers as modules (with ``scan_layers``, each rebuilt from its slice of
        the stacked state: for inspection, not for running)."""
        if not self.scan_layers:
            return list(self.layers)
        n = self.num_scanned_layers
        return list(self.layers) + [nnx.merge(self.layer_graph, jax.tree.map(lambda a: a[i], self.stacked_layers))
                                    for i in range(n)]

    def cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((n, dk), (n, dv))`` of one position of one layer's cache: the KV heads' keys and
        values, or for latent attention (DeepSeek) the normed latent and the rotated shared key."""
        c = self.config
        if c.mla is not None:
            return (1, c.mla.kv_lora_rank), (1, c.mla.qk_rope_head_dim)
        return (c.num_kv_heads, c.head_dim), (c.num_kv_heads, c.head_dim)

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """A zeroed contiguous :class:`KVCache` of every layer: ``k``, ``v``
        ``[num_layers, batch_size, n, max_len, d]`` (heads before positions, the order attention
        reads them in; :meth:`cache_shapes`). On a mesh (``mesh_plan``) the pools are sharded as
        :meth:`MeshPlan.cache_spec <wna16_jax.models.mesh.MeshPlan.cache_spec>` says."""
        cache = KVCache.contiguous(self.config.num_layers, batch_size, max_len, self.cache_shapes(),
                                   dtype or self.dtype)
        return cache if self.mesh_plan is None else self.mesh_plan.constrain_cache(cache)

    def init_paged_cache(self, num_blocks: int, block_size: int, dtype=None) -> KVCache:
        """A zeroed paged :class:`KVCache` pool of ``num_blocks`` blocks of ``block_size`` positions
        for every layer (read through the block table :meth:`KVCache.with_block_table` sets); on a
        mesh, sharded as :meth:`init_cache`'s."""
        cache = KVCache.paged(self.config.num_layers, num_blocks, block_size, self.cache_shapes(),
                              dtype or self.dtype)
        return cache if self.mesh_plan is None else self.mesh_plan.constrain_cache(cache)


#: ``load_model(scan_layers=None)`` scans models of at least this many identical layers
SCAN_MIN_LAYERS = 8


def _write_layer(stack, x, i):
    return jax.lax.dynamic_update_index_in_dim(stack, jnp.asarray(x, stack.dtype), i, 0)


_write_layer_jit = jax.jit(_write_layer, donate_argnums=0)


class _LayerStacker:
    """Alike decoder layers stacked as they are built: each layer's arrays are written in place
    into stacks ``[L, ...]`` allocated at the first layer, and the layer can then be dropped, so
    loading a scanned model holds the stacks and one layer rather than every layer twice."""

    def __init__(self, num_layers: int):
        self.num_layers = int(num_layers)
        self.count = 0
        self.graph = self.treedef = None
        self.stacks: list = []

    def add(self, layer) -> bool:
        """Write ``layer`` into the stacks; False (nothing written) when its graph, state tree,
        shapes or dtypes differ from the first layer's."""
        graph, state = nnx.split(layer)
        leaves, treedef = jax.tree.flatten(state)
        dtypes = [jax.dtypes.canonicalize_dtype(a.dtype) for a in leaves]     # as jnp.asarray stores them
        if self.count == 0:
            self.graph, self.treedef = graph, treedef
            self.stacks = [jnp.zeros((self.num_layers,) + tuple(a.shape), d) for a, d in zip(leaves, dtypes)]
        elif graph != self.graph or treedef != self.treedef or any(
                s.shape[1:] != tuple(a.shape) or s.dtype != d for s, a, d in zip(self.stacks, leaves, dtypes)):
            return False
        if self.count >= self.num_layers:
            raise ConfigError(f"scan_layers: more than the {self.num_layers} layers the stacks were made for")
        i = jnp.int32(self.count)
        with warnings.catch_warnings():          # backends that cannot donate copy instead
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            self.stacks = [_write_layer_jit(s, a, i) for s, a in zip(self.stacks, leaves)]
        self.count += 1
        return True

    def layers(self) -> list:
        """The layers written so far as modules (each rebuilt from its slice of the stacks)."""
        return [nnx.merge(self.graph, jax.tree.unflatten(self.treedef, [s[i] for s in self.stacks]))
                for i in range(self.count)]

    def finish(self) -> tuple[Any, Any]:
        """``(graphdef, state)`` of the stacked layers (partition metadata gains a leading
        ``"layers"`` name)."""
        if self.count != self.num_layers:
            raise ConfigError(f"scan_layers: {self.count} of {self.num_layers} layers were stacked")

        def relabel(v):
            if not isinstance(v, nnx.Variable):
                return v
            meta = dict(v.get_metadata())
            if meta.get(SHARDING_KEY) is not None:
                meta[SHARDING_KEY] = ("layers",) + tuple(meta[SHARDING_KEY])
            return type(v)(v.get_value(), **meta)

        state = jax.tree.unflatten(self.treedef, self.stacks)
        return self.graph, jax.tree.map(relabel, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _stacked_layers(layers: list) -> tuple[Any, Any]:
    """``(graphdef, state)`` of identical decoder layers with every array stacked on a new leading
    axis (the layer axis; partition metadata gains a leading ``"layers"`` name)."""
    stacker = _LayerStacker(len(layers))
    for i, layer in enumerate(layers):
        if not stacker.add(layer):
            raise ConfigError(f"scan_layers: decoder layer {i} differs from layer 0 in structure, shapes or "
                              "dtypes (dense and sparse layers mixed, or layers of different layouts); "
                              "load with scan_layers=False")
    return stacker.finish()


# --------------------------------------------------------------------------- loading

#: the epsilon of DeepSeek's ``q_a_layernorm`` / ``kv_a_layernorm`` (their modules' default, not
#: ``rms_norm_eps``)
LATENT_NORM_EPS = 1e-6
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _float_dtype(name: str, value, default):
    """``value`` (None: ``default``) as a float dtype, or a :class:`DTypeError` naming ``name``."""
    if value is None:
        return default if default is None else jnp.dtype(default)
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise DTypeError(f"{name}: expected one of {list(_FLOATS)}, got {value!r}") from None
    if dt.name not in _FLOATS:
        raise DTypeError(f"{name}: expected one of {list(_FLOATS)}, got {dt.name}")
    return dt


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How :func:`load_model` lays the weights out (its keyword arguments, checked)."""

    dtype: Any
    param_dtype: Any = None
    backend: Any = None
    dequantized: bool = False

    @classmethod
    def checked(cls, dtype, param_dtype, backend, dequantized) -> "LoadOptions":
        if not isinstance(dequantized, (bool, np.bool_)):
            raise ConfigError(f"dequantized: expected True or False, got {dequantized!r}")
        return cls(_float_dtype("dtype", dtype, default_dtype()), _float_dtype("param_dtype", param_dtype, None),
                   backend, bool(dequantized))


class _Loader:
    """The checkpoint's tensors mapped onto the decoder's modules by name: each method builds one
    module of the config's structure from the tensors its name holds."""

    def __init__(self, ckpt, config: DecoderConfig, opts: LoadOptions):
        self.ckpt, self.c, self.o = ckpt, config, opts
        self.fallback: list[str] = []
        self.fallback_why: str | None = None

    def tensors(self, module: str) -> dict[str, str]:
        return self.ckpt.module_tensors(module)

    def float_tensor(self, name: str, shape: tuple[int, ...], part: tuple[int, tuple[int, int]] | None = None
                     ) -> np.ndarray:
        """The 16/32-bit tensor ``name`` of ``shape``, checked finite; ``part = (axis, (start,
        stop))``: only that slice of one axis is read (its bytes alone)."""
        t = self.ckpt.tensor_info(name)            # MissingTensorError naming it
        if t.dtype.kind != "f" and t.dtype_name != "BF16":
            raise DTypeError(f"{name}: expected a 16/32-bit float tensor, got {t.dtype_name}")
        if tuple(t.shape) != tuple(shape):
            raise ShapeError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        a = (self.ckpt.read_tensor(name) if part is None else
             self.ckpt.read_many((), [name], {name: (part[0], slice(*part[1]))})[name])
        if not np.isfinite(a.astype(np.float32)).all():
            raise ValueRangeError(f"{name}: holds NaN or Inf")
        return a

    def norm(self, name: str, size: int, eps: float | None = None) -> RMSNorm:
        return RMSNorm(self.float_tensor(name, (size,)), self.c.rms_norm_eps if eps is None else eps,
                       param_dtype=self.o.param_dtype)

    # ------------------------------------------------------------------ linears
    def scheme(self, module: str, bias: bool):
        """The scheme of ``module`` if the checkpoint stores it quantized (None: a 16-bit linear),
        its bias checked against the config."""
        found = self.tensors(module)
        if not any(m in found for m in formats.QUANTIZED_MARKERS):
            return None
        scheme = self.ckpt.quant_config.scheme_for(module)
        if scheme is None:
            raise ConfigError(f"{module}: the checkpoint stores it quantized ({sorted(found)}), but "
                              f"quantization_config leaves it unquantized "
                              f"({self.ckpt.quant_config.group_for(module) or 'no matching group'})")
        _check_bias(module, found, bias)
        return scheme

    def quantized(self, modules: Sequence[str], ns: Sequence[int], k: int, scheme, *, tp: tuple[int, int] = (1, 0),
                  tp_axis: str | None = None, engine: bool | None = None) -> QuantizedLinear:
        """One :class:`QuantizedLinear` reading ``modules`` (which read the same input) as one
        matrix of their parts along N; ``tp = (size, rank)`` with ``tp_axis`` ``"n"`` / ``"k"``:
        only that slice is read (:func:`~wna16_jax.checkpoint.read_matrix`); ``engine`` as
        :class:`QuantizedLinear` takes it."""
        reason = next((r for r in (formats.size_reason(scheme, n, k) for n in ns) if r), None)
        if reason:
            raise ShapeError(f"{modules[0]}: {reason}")
        parts = [MatrixPart([dict(self.tensors(m))], n, m) for m, n in zip(modules, ns)]
        m, bias = read_matrix(self.ckpt, scheme, parts, k=k, tp=tp, tp_axis=tp_axis)
        splits = [n // tp[0] if tp_axis == "n" else n for n in ns]
        return QuantizedLinear(m, None if bias is None else bias[0], compute_dtype=self.o.dtype, splits=splits,
                               engine=engine)

    def linear(self, module: str, n: int, k: int, bias: bool = False,
               part: tuple[int, tuple[int, int]] | None = None):
        """The linear ``module`` (``W [n, k]``): quantized if its tensors are, else 16-bit;
        ``part = (axis, (start, stop))``: of a 16-bit one, only that slice of ``W``'s rows (axis 0,
        and of the bias) or columns (axis 1) is read (a quantized one is read whole)."""
        scheme = self.scheme(module, bias)
        if scheme is not None:
            layer = self.quantized([module], [n], k, scheme)
            return layer.dequantized(jnp.bfloat16) if self.o.dequantized else layer
        found = self.tensors(module)
        if "weight" not in found:
            raise MissingTensorError(f"{module}.weight: not found in {self.ckpt.path!r} (nor a quantized "
                                     f"{module}.qweight / {module}.weight_packed)")
        extra = sorted(set(found) - {"weight", "bias"})
        if extra:
            raise UnexpectedTensorError(f"{module}: a 16-bit linear with unexpected tensors "
                                        f"{[f'{module}.{s}' for s in extra]}")
        _check_bias(module, found, bias)
        w = self.float_tensor(found["weight"], (n, k), part)
        b = self.float_tensor(found["bias"], (n,), part if part is not None and part[0] == 0 else None) if bias else None
        return DenseLinear(w, b, compute_dtype=self.o.dtype, param_dtype=self.o.param_dtype)

    def linears(self, specs: Sequence[tuple[str, int, bool]], k: int):
        """The linears ``(module, n, bias)`` that read the same input: one :class:`QuantizedLinear`
        reading them as one matrix (one GEMM) where they are quantized alike and an engine runs
        the whole (a load-time concatenation along N), else a tuple of one linear each."""
        modules, ns, biases = ([s[j] for s in specs] for j in range(3))
        schemes = [self.scheme(m, b) for m, b in zip(modules, biases)]
        s0 = schemes[0]
        if (not self.o.dequantized and s0 is not None and all(s == s0 for s in schemes) and len(set(biases)) == 1
                and engine_for(CheckpointForm(sum(ns), k, s0), self.o.dtype)[0] is not None):
            return self.quantized(modules, ns, k, s0)
        return tuple(self.linear(m, n, k, b) for m, n, b in specs)

    # ------------------------------------------------------------------ blocks
    def attention(self, p: str) -> Attention:
        c = self.c
        h, nh, nkv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self.linears([(f"{p}.q_proj", nh * hd, c.qkv_bias), (f"{p}.k_proj", nkv * hd, c.qkv_bias),
                            (f"{p}.v_proj", nkv * hd, c.qkv_bias)], h)
        norms = (self.norm(f"{p}.q_norm.weight", hd), self.norm(f"{p}.k_norm.weight", hd)) if c.qk_norm else (None,) * 2
        return Attention(c, qkv, self.linear(f"{p}.o_proj", h, nh * hd, c.o_bias), *norms)

    def latent_attention(self, p: str) -> LatentAttention:
        m, h, nh = self.c.mla, self.c.hidden_size, self.c.num_heads
        kv_a = (f"{p}.kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, m.attention_bias)
        q_a_norm = q_b = None
        if m.q_lora_rank is None:
            x_proj = self.linears([(f"{p}.q_proj", nh * m.qk_head_dim, False), kv_a], h)
            x_proj = (x_proj[0], None, x_proj[1]) if isinstance(x_proj, tuple) else x_proj
        else:
            x_proj = self.linears([(f"{p}.q_a_proj", m.q_lora_rank, m.attention_bias), kv_a], h)
            x_proj = (None, x_proj[0], x_proj[1]) if isinstance(x_proj, tuple) else x_proj
            q_a_norm = self.norm(f"{p}.q_a_layernorm.weight", m.q_lora_rank, LATENT_NORM_EPS)
            q_b = self.linear(f"{p}.q_b_proj", nh * m.qk_head_dim, m.q_lora_rank)
        kv_b = self.linear(f"{p}.kv_b_proj", nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        # absorbed, kv_b is only ever read whole (into the queries and the attended latent), never
        # multiplied as a linear: dequantizing it at every step was two kernels a layer, so a
        # quantized one is kept dequantized, frozen, in the dtype the absorption computes in, cut
        # into its two parts (AbsorbedKV); a 16-bit one is cut alike and stays trainable
        frozen = isinstance(kv_b, QuantizedLinear)
        kv_b = AbsorbedKV(kv_b.dense(absorb_dtype(self.o.dtype)) if frozen else kv_b.weight.get_value(),
                          nh, m.qk_nope_head_dim, frozen=frozen)
        return LatentAttention(
            self.c, x_proj, q_a_norm, q_b, self.norm(f"{p}.kv_a_layernorm.weight", m.kv_lora_rank, LATENT_NORM_EPS),
            kv_b, self.linear(f"{p}.o_proj", h, nh * m.v_head_dim, m.attention_bias))

    def moe(self, i: int, *, experts=None, tp_size: int = 1, tp_rank: int = 0) -> QuantizedMoE:
        """MoE layer ``i``: its experts in the layout the dispatch table picks (or dequantized).
        ``experts``: only these routed experts are read (a process's share on a mesh); with
        ``tp_size`` > 1, rank ``tp_rank``'s slice of their intermediate size."""
        read = {} if experts is None else {"experts": experts}
        if tp_size > 1:                  # the routed experts' slice; the shared ones whole (replicated)
            read.update(tp_size=tp_size, tp_rank=tp_rank, slice_shared=False)
        layer = self.ckpt.load_layer(i, **read)
        if self.c.model_type == "qwen2_moe" and layer.shared_experts is not None and layer.shared_expert_gate is None:
            raise MissingTensorError(f"model.layers.{i}.mlp.shared_expert_gate.weight: required by Qwen2-MoE's "
                                     "shared expert (its sigmoid gate), not found")
        if self.o.dequantized:
            layer = dataclasses.replace(layer, experts=_dense_experts(layer.experts, jnp.bfloat16),
                                        shared_experts=_dense_experts(layer.shared_experts, jnp.bfloat16))
            return QuantizedMoE.from_layer(layer, self.c.moe, expert_ids=experts)
        with warnings.catch_warnings(record=True):      # the CLI and load_model say it once, below
            warnings.simplefilter("always")
            mlp = QuantizedMoE.from_layer(layer, self.c.moe, self.o.backend, activation_dtype=self.o.dtype,
                                          expert_ids=experts)
        if self.o.backend is None and mlp.backend == str(Backend.LOADER) and isinstance(layer.experts,
                                                                                       CheckpointWeights):
            self.fallback.append(i)
            # the warning is given once per process: the reason does not depend on it
            self.fallback_why = self.fallback_why or fallback_summary(layer.experts.scheme, Device.current())
        return mlp

    def layer(self, i: int) -> DecoderLayer:
        c, p = self.c, f"model.layers.{i}"
        attn = self.latent_attention(f"{p}.self_attn") if c.mla is not None else self.attention(f"{p}.self_attn")
        if c.sparse_layers[i]:
            mlp = self.moe(i)
        else:
            h, inter = c.hidden_size, c.intermediate_size
            mlp = GatedMLP(self.linear(f"{p}.mlp.gate_proj", inter, h), self.linear(f"{p}.mlp.up_proj", inter, h),
                           self.linear(f"{p}.mlp.down_proj", h, inter))
        return DecoderLayer(self.norm(f"{p}.input_layernorm.weight", c.hidden_size), attn,
                            self.norm(f"{p}.post_attention_layernorm.weight", c.hidden_size), mlp)

    def embeddings(self, rows: tuple[int, int] | None = None):
        """The embedding matrix (``rows``: only those vocabulary rows, ``[start, stop)``)."""
        e = self.float_tensor("model.embed_tokens.weight", (self.c.vocab_size, self.c.hidden_size),
                              None if rows is None else (0, rows))
        return jnp.asarray(e if self.o.param_dtype is None else e.astype(self.o.param_dtype))

    def lm_head(self):
        """``lm_head`` (None: the embeddings, ``tie_word_embeddings``)."""
        if not self.c.tie_word_embeddings:
            return self.linear("lm_head", self.c.vocab_size, self.c.hidden_size)
        if self.tensors("lm_head"):
            warnings.warn(f"{self.ckpt.path}: tie_word_embeddings is true, so lm_head is the embedding matrix "
                          "(as transformers ties them); the stored lm_head tensors are not read", stacklevel=3)
        return None


def _check_bias(module: str, found, bias: bool) -> None:
    if bias and "bias" not in found:
        raise MissingTensorError(f"{module}.bias: required by config.json (attention biases), not found")
    if not bias and "bias" in found:
        raise UnexpectedTensorError(f"{module}.bias: present, but config.json says the layer has no bias")


def _dense_experts(w, dtype):
    """Loader-layout (or float) experts as :class:`DenseWeights` in ``dtype``, on the device."""
    if w is None:
        return None
    w = jax.tree.map(jnp.asarray, w)
    w13, w2 = w.dequantize(dtype)
    b13, b2 = w.decode_bias()
    return DenseWeights(w13, w2, None if b13 is None else b13.astype(dtype), None if b2 is None else b2.astype(dtype),
                        hidden_size=int(w13.shape[2]), intermediate_size=int(w13.shape[1]) // 2)


def _open(path, revision):
    """``(checkpoint, config)``: the folder (a hub id, cache root, checkpoint or converted folder)
    opened, ``config.json`` parsed once and the generation defaults read, before any weight."""
    folder = resolve_model_dir(path, revision=revision)
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        ckpt = ConvertedCheckpoint(folder)
        config = DecoderConfig.from_hf_config(ckpt.config)
    else:
        cfg_file = os.path.join(folder, "config.json")
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"config.json: not found in {folder!r}")
        config = DecoderConfig.from_hf_config(load_json(cfg_file, what="config.json"))
        ckpt = None
    if config.moe is None:
        raise ConfigError(f"config.json: gives no routed experts (none of {EXPERT_FIELDS}, or 0), but "
                          "wna16_jax.models loads MoE decoders (set the experts count the checkpoint holds)")
    generation = read_generation_config(folder, vocab_size=config.vocab_size)
    config = dataclasses.replace(config, generation=generation,
                                 eos_token_ids=generation.stop_token_ids(config.eos_token_ids))
    return ckpt or Checkpoint(folder, model_config=config.moe), config


def _check_layers(ckpt, config: DecoderConfig) -> None:
    """The checkpoint's MoE layers where the config puts them; layers past ``num_hidden_layers``
    (other than DeepSeek-V3's multi-token-prediction modules, which generation does not use)
    are not loaded, with a warning."""
    mtp = config.num_nextn_predict_layers if config.mla is not None else 0
    found = [i for i in ckpt.moe_layer_indices if i < config.num_layers]
    if found != config.moe_layer_indices:
        raise ConfigError(f"config.json: puts MoE layers at {config.moe_layer_indices} "
                          f"(decoder_sparse_step / mlp_only_layers / first_k_dense_replace), but the checkpoint "
                          f"has expert tensors for layers {ckpt.moe_layer_indices}")
    extra = sorted({int(n.split(".")[2]) for n in ckpt.tensor_names() if n.startswith("model.layers.")
                    and n.split(".")[2].isdigit() and int(n.split(".")[2]) >= config.num_layers + mtp})
    if extra:
        warnings.warn(f"{ckpt.path}: tensors of layers {extra[:8]}{' ...' if len(extra) > 8 else ''} lie past "
                      f"num_hidden_layers={config.num_layers}; they are not loaded", stacklevel=3)


def _layer_plan(config: DecoderConfig, scan_layers) -> tuple[int, bool]:
    """``(head, scanned)``: how many leading layers run unrolled ahead of the scan (DeepSeek's
    dense ``first_k_dense_replace`` layers before only MoE ones), and whether the rest is scanned
    (``scan_layers=None``: when at least :data:`SCAN_MIN_LAYERS` of them are alike by config)."""
    if scan_layers is not None and not isinstance(scan_layers, (bool, np.bool_)):
        raise ConfigError(f"scan_layers: expected True, False or None, got {scan_layers!r}")
    sparse = config.sparse_layers
    head = 0 if len(set(sparse)) == 1 else next(i for i, sp in enumerate(sparse) if sp)
    if not all(sparse[head:]):
        head = 0
    alike = len(set(sparse)) == 1 or head > 0
    scanned = bool(scan_layers) or (scan_layers is None and alike and config.num_layers - head >= SCAN_MIN_LAYERS)
    return head, scanned


def _load_layers(loader: _Loader, head: int, scanned: bool, strict: bool, tick) -> tuple[list, Any]:
    """``(head layers, layers or the stacker)``: every decoder layer built from its tensors;
    a scanned model's alike layers are written into the stacks as they load (the load holds the
    stacks and about one layer). Alike by config but not by layout (a layer that fell back to
    another executor): unrolled after all, unless ``scan_layers=True`` insisted."""
    n = loader.c.num_layers
    heads = [loader.layer(i) for i in range(head)] if scanned else []
    for _ in heads:
        tick()
    stacker, layers = (_LayerStacker(n - head) if scanned else None), []
    for i in range(len(heads), n):
        layer = loader.layer(i)
        tick()
        if stacker is not None and stacker.add(layer):
            continue
        if stacker is not None:
            if strict:
                raise ConfigError(f"scan_layers: decoder layer {i} differs from layer {head} in structure, shapes "
                                  "or dtypes (dense and sparse layers mixed, or layers of different layouts); "
                                  "load with scan_layers=False")
            layers, heads, stacker = heads + stacker.layers(), [], None      # unrolled after all
        layers.append(layer)
    return heads, (layers if stacker is None else stacker)


def _progress(total: int, enabled: bool | None, what: str):
    """A progress bar over the layers on stderr (``enabled=None``: where stderr is a terminal)."""
    import sys

    on = sys.stderr.isatty() if enabled is None else bool(enabled)
    if not on:
        return contextlib.nullcontext(lambda: None)
    from tqdm import tqdm

    @contextlib.contextmanager
    def bar():
        with tqdm(total=total, desc=what, unit="layer", leave=False, file=sys.stderr) as t:
            yield lambda: t.update(1)

    return bar()


def load_model(path: str | os.PathLike, *, dtype=None, param_dtype=None, backend: Any = None,
               dequantized: bool = False, scan_layers: bool | None = None, revision: str | None = None,
               progress: bool | None = None, mesh=None, sharding=None) -> MoEDecoder:
    """Build the :class:`MoEDecoder` of checkpoint ``path``: a folder (``config.json`` +
    safetensors, or a folder :func:`wna16_jax.convert_checkpoint` wrote), a Hugging Face cache
    folder or a hub id in the local cache (:func:`wna16_jax.resolve_model_dir`; ``revision``
    picks the snapshot).

    ``dtype``: the activations' dtype (default :func:`default_dtype`). ``param_dtype``: the dtype
    of the 16-bit parameters (default: as stored; float32 for fine-tuning). ``backend``: the MoE
    experts' layout (``None``: the dispatch table's choice; see :func:`wna16_jax.select_backend`).
    ``dequantized=True`` dequantizes every quantized linear and expert to bfloat16 while loading
    (a reference point for benchmarks: the same model as plain XLA on 16-bit weights).
    ``scan_layers=True`` stacks the decoder layers and runs them as one ``lax.scan``: one compiled
    layer instead of one per layer, the quantized weights read in place from the stacks; every
    layer must have the same structure, except leading dense layers before only MoE ones
    (DeepSeek's ``first_k_dense_replace``), which run unrolled ahead of the scan and are then all
    that ``model.layers`` holds (:meth:`MoEDecoder.layer_modules` rebuilds the rest). The stacks
    are filled as the layers load, so the load holds the stacks and about one layer. ``None``
    (default): scanned when at least :data:`SCAN_MIN_LAYERS` layers (after such a dense head) are
    alike. ``progress``: a progress bar over the layers on stderr (None: where it is a terminal).
    MoE layers that run the loader layout on the XLA executor (no backend converts the scheme on
    this device) are counted in one warning.

    Refuses, before reading any weight data: an unsupported ``model_type`` (naming the supported
    families), config values out of their rules, rope types / sliding-window settings it would
    get wrong, MoE layers where the config does not put them; then, per tensor, missing,
    unexpected, misshapen or non-finite tensors, naming them. Only files inside the folder are read.

    ``mesh`` (a ``jax.sharding.Mesh``): the decoder is placed on it, split as ``sharding`` (a
    :class:`~wna16_jax.models.mesh.MeshRules`, a mapping of its fields, or None for the defaults)
    says; a mesh whose axes do not divide what the rules split over them, or an axis that does not
    exist, is a typed error naming the axis, its size and the dimension, before any weight is read
    (:func:`~wna16_jax.models.mesh.check_mesh`; docs/models.md, "On a mesh").
    """
    opts = LoadOptions.checked(dtype, param_dtype, backend, dequantized)
    ckpt, config = _open(path, revision)
    head, scanned = _layer_plan(config, scan_layers)
    _check_layers(ckpt, config)
    plan = None
    if mesh is not None or sharding is not None:               # checked before any weight is read
        from . import mesh as _mesh
        plan = _mesh.plan_for_load(config, ckpt, mesh, sharding, opts)
    loader = (_Loader if plan is None else _mesh.mesh_loader(_Loader, plan))(ckpt, config, opts)
    with _progress(config.num_layers, progress, "loading layers") as tick:
        heads, layers = _load_layers(loader, head, scanned, bool(scan_layers), tick)
    if loader.fallback:
        n = len(loader.fallback)
        warnings.warn(f"{n} of {len(config.moe_layer_indices)} MoE layer{'s' if n > 1 else ''} run the loader layout "
                      f"on the XLA executor ({loader.fallback_why or 'no backend converts the scheme here'})",
                      BackendFallbackWarning, stacklevel=2)
    model = MoEDecoder(config, loader.embeddings(), layers, loader.norm("model.norm.weight", config.hidden_size),
                       loader.lm_head(), dtype=opts.dtype, scan_layers=isinstance(layers, _LayerStacker),
                       head_layers=heads)
    return model if plan is None else loader.place(model)


__all__ = ["MoEDecoder", "LoadOptions", "bind_layer", "DecoderLayer", "Attention", "LatentAttention", "GatedMLP", "yarn_inverse_frequencies",
           "rope_frequencies", "RMSNorm", "load_model", "apply_rope",
           "rope_inverse_frequencies", "default_dtype"]
