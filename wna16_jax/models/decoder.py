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
  (packed as stored); the rest (embeddings, ``lm_head``, norms, routers) stays 16-bit;
  ``lm_head`` is the embedding matrix when ``tie_word_embeddings``.

State: ``nnx.Param`` for the 16-bit weights (embeddings, norms, 16-bit linears, routers),
:class:`~wna16_jax.models.linear.QuantizedWeight` and :class:`~wna16_jax.nn.QuantizedExperts`
for the frozen quantized ones.

Computation runs in ``dtype`` (the activations' dtype; float32 reproduces the float reference).
RMS norms and softmaxes are computed in float32, every product accumulates in float32.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from pallas_kernels import decode_attention

from ..checkpoint import Checkpoint, DenseWeights
from ..device import Device
from ..errors import ConfigError, DTypeError, MissingTensorError, ShapeError, UnexpectedTensorError, ValueRangeError
from ..nn import SHARDING_KEY, QuantizedExperts, QuantizedMoE
from ..safetensors_io import load_json
from .config import DecoderConfig
from .generation_config import read_generation_config
from .. import formats
from ..checkpoint import MatrixPart, read_matrix
from ..weights import CheckpointForm
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


def _apply(module, x, layer=None):
    """``module(x)``; in a scanned decoder (``layer``: the layer index), the modules whose frozen
    quantized weights stay stacked are told which layer to read."""
    if layer is not None and isinstance(module, (QuantizedLinear, QuantizedMoE)):
        return module(x, layer=layer)
    return module(x)


def _write_rows(cache, new, start, layer=None):
    """``cache [B, n, T, d]`` with ``new [B, n, S, d]`` written at slot ``start[b]`` of row ``b``;
    with ``layer``, ``cache`` is every layer's ``[L, B, n, T, d]`` and layer ``layer``'s is written
    (in place: the rest of the stack is not touched)."""
    start = start.astype(jnp.int32)
    if layer is None:
        return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (0, s, 0)))(
            cache, new, start)
    i = jnp.asarray(layer, jnp.int32)
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x[None].astype(c.dtype), (i, 0, s, 0)),
                    in_axes=(1, 0, 0), out_axes=1)(cache, new, start)


def _cached(k, v, positions, cache, kv_len, layer, dtype):
    """The keys / values attention reads and the updated cache. ``k``, ``v`` ``[B, n, S, d]`` are
    the new rows; without a cache they are all there is (key positions = ``positions``); with one
    (a scanned decoder, ``layer`` given, passes every layer's ``[L, B, n, T, d]``) they are written
    at their positions and the first ``kv_len`` slots are read (key position = slot)."""
    if cache is None:
        return (k, v, positions), None
    b = k.shape[0]
    ck, cv = cache
    ck, cv = _write_rows(ck, k, positions[:, 0], layer), _write_rows(cv, v, positions[:, 0], layer)
    cache = (ck, cv)
    if layer is not None:
        ck, cv = (jax.lax.dynamic_index_in_dim(c, jnp.asarray(layer, jnp.int32), 0, keepdims=False)
                  for c in (ck, cv))
    t = kv_len or ck.shape[2]
    kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    return (ck[:, :, :t].astype(dtype), cv[:, :, :t].astype(dtype), kpos), cache


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

    def __call__(self, x, positions, cache=None, kv_len: int | None = None, layer=None):
        b, s, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj.split(_apply(self.qkv_proj, x, layer))
        else:
            q, k, v = (_apply(proj, x, layer) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.reshape(b, s, nh, hd), k.reshape(b, s, nkv, hd), v.reshape(b, s, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv = np.asarray(self.inv_freq, np.float32)
        q, k = (apply_rope(t, positions, inv, attention_factor=self.rope_scale) for t in (q, k))
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)           # [B, n_kv, S, d]
        mode = decode_kernel_mode() if cache is not None and s == 1 else None
        if (mode and cache[0].dtype == q.dtype
                and not decode_attention.unsupported_reason(q.shape, cache[0].shape, q.dtype)):
            return self._decode_step(q, k, v, positions, cache, layer, interpret=mode == "interpret")
        (keys, vals, kpos), cache = _cached(k, v, positions, cache, kv_len, layer, x.dtype)
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
        return _apply(self.o_proj, out.reshape(b, s, nh * hd), layer), cache

    def _decode_step(self, q, k, v, positions, cache, layer, *, interpret: bool):
        """One new token per sequence: the kernel reads the cache before the new rows are written
        (they join its softmax from registers), then the rows are written in place."""
        b = q.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        ck, cv = cache
        stacked = layer is not None
        i = jnp.asarray(layer if stacked else 0, jnp.int32)
        kc, vc = (ck, cv) if stacked else (ck[None], cv[None])
        start = positions[:, 0]                      # the new row's slot = the old slots' count
        out = decode_attention.decode_attention(
            q.reshape(b, nkv, nh // nkv, hd), k[:, :, 0], v[:, :, 0], kc, vc, i, start,
            scale=self.softmax_scale, window=self.sliding_window, interpret=interpret)
        cache = (_write_rows(ck, k, start, layer), _write_rows(cv, v, start, layer))
        return _apply(self.o_proj, out.reshape(b, 1, nh * hd), layer), cache


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

    def __call__(self, x, positions, cache=None, kv_len: int | None = None, layer=None):
        b, s, _ = x.shape
        nh, nope, r = self.num_heads, self.nope, self.rank
        if self.x_proj is not None:
            q, kva = self.x_proj.split(_apply(self.x_proj, x, layer))
        else:
            q = _apply(self.q_proj if self.q_proj is not None else self.q_a_proj, x, layer)
            kva = _apply(self.kv_a_proj_with_mqa, x, layer)              # [B, S, rank + rope]
        if self.q_b_proj is not None:
            q = _apply(self.q_b_proj, self.q_a_layernorm(q), layer)
        q = q.reshape(b, s, nh, nope + self.rope)
        latent = self.kv_a_layernorm(kva[..., :r])[:, None]              # [B, 1, S, rank]
        inv = np.asarray(self.inv_freq, np.float32)
        q_rope, k_rope = (apply_rope(t, positions, inv, interleaved=self.interleaved,
                                     attention_factor=self.rope_scale)
                          for t in (q[..., nope:], kva[..., None, r:]))
        k_rope = jnp.swapaxes(k_rope, 1, 2)                               # [B, 1, S, rope]
        (lat, kr, kpos), cache = _cached(latent, k_rope, positions, cache, kv_len, layer, x.dtype)
        lat, kr = lat[:, 0], kr[:, 0]                                     # [B, T, rank], [B, T, rope]
        cdt = x.dtype if x.dtype == jnp.float32 or jax.default_backend() != "cpu" else jnp.float32
        prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
        w = self.kv_b_proj.dense(cdt, layer).reshape(nh, nope + self.v_dim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]

        def dot(spec, a, c):
            return jnp.einsum(spec, a.astype(cdt), c.astype(cdt), precision=prec, preferred_element_type=jnp.float32)

        q_lat = dot("bsnd,ndr->bsnr", q[..., :nope], w_uk).astype(cdt)
        scores = dot("bsnr,btr->bnst", q_lat, lat) + dot("bsnd,btd->bnst", q_rope, kr)
        scores = scores * np.float32(self.softmax_scale)
        scores = jnp.where(_mask(positions, kpos)[:, None], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        o_lat = dot("bnst,btr->bsnr", probs, lat).astype(x.dtype)
        out = dot("bsnr,nvr->bsnv", o_lat, w_uv).astype(x.dtype)
        return _apply(self.o_proj, out.reshape(b, s, nh * self.v_dim), layer), cache


class GatedMLP(nnx.Module):
    """``down(silu(gate(x)) · up(x))`` (the dense MLP of Qwen's ``mlp_only_layers``)."""

    def __init__(self, gate_proj, up_proj, down_proj):
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x, layer=None):
        g = _apply(self.gate_proj, x, layer).astype(jnp.float32)
        u = _apply(self.up_proj, x, layer).astype(jnp.float32)
        return _apply(self.down_proj, (jax.nn.silu(g) * u).astype(x.dtype), layer)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp):
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def __call__(self, x, positions, cache=None, kv_len=None, layer=None):
        """``layer``: the layer index in a scanned decoder (its quantized weights stacked)."""
        h, cache = self.self_attn(self.input_layernorm(x), positions, cache, kv_len, layer)
        x = x + h
        y = self.post_attention_layernorm(x)
        y = self.mlp(y, layer) if isinstance(self.mlp, GatedMLP) else _apply(self.mlp, y, layer)
        return x + y.astype(x.dtype), cache


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

    def hidden_states(self, tokens, positions, cache=None, kv_len: int | None = None):
        """Final-normed hidden states ``[B, S, H]`` and the updated cache (as :meth:`init_cache`
        makes it, or None)."""
        x = self.embed(tokens)
        if self.scan_layers and not len(self.layers):
            return self._scanned(x, positions, cache, kv_len)
        head_cache, scan_cache = (cache, None) if not self.scan_layers or cache is None else cache
        new = []
        for i, layer in enumerate(self.layers):
            x, c = layer(x, positions, None if head_cache is None else head_cache[i], kv_len)
            new.append(c)
        new = None if cache is None else tuple(new)
        if not self.scan_layers:
            return self.norm(x), new
        h, scan_cache = self._scanned(x, positions, scan_cache, kv_len)
        return h, None if cache is None else (new, scan_cache)

    @property
    def num_scanned_layers(self) -> int:
        return self.config.num_layers - len(self.layers) if self.scan_layers else 0

    def _scanned(self, x, positions, cache, kv_len):
        """The layers as one ``lax.scan`` (one compiled layer body; the cache is then ``(k, v)``,
        each ``[L, B, n_kv, T, d]``, carried through the scan and written in place). The scan slices each layer's 16-bit weights; the frozen
        quantized ones stay stacked and are read in place at the layer's index
        (:class:`~wna16_jax.weights.LayerStack`): a slice would be a copy of the layer's weights
        ahead of every kernel that reads them, more bytes than the layer's own step reads."""
        graph = self.layer_graph
        in_place, sliced = nnx.split_state(self.stacked_layers, nnx.Any(*STACKED_IN_PLACE), ...)
        n = self.num_scanned_layers

        def body(carry, xs):                   # the cache rides in the carry, written in place
            h, c = carry
            state, i = xs
            h, c = nnx.merge(graph, state, in_place)(h, positions, c, kv_len, layer=i)
            return (h, c), None

        layers = jnp.arange(n, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, None if cache is None else tuple(cache)), (sliced, layers))
        return self.norm(x), cache

    def logits(self, h):
        """float32 logits of hidden states ``h [..., H]`` (products accumulated in float32)."""
        if isinstance(self.lm_head, QuantizedLinear):
            b = None if self.lm_head.bias is None else self.lm_head.bias.get_value()
            return quantized_matmul(h, self.lm_head.weight.get_value(), b, out_dtype=jnp.float32)
        w = (self.embed_tokens if self.lm_head is None else self.lm_head.weight)[...].astype(h.dtype)
        prec = jax.lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
        return jnp.einsum("...h,vh->...v", h, w, precision=prec, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions=None):
        tokens = jnp.asarray(tokens)
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

    def init_cache(self, batch_size: int, max_len: int, dtype=None):
        """A zeroed KV cache: per layer ``(k, v)`` of shape ``[batch_size, n_kv, max_len, d]`` (heads
        before positions, the order attention reads them in). For latent attention (DeepSeek)
        the pair is the normed latent ``[batch_size, 1, max_len, kv_lora_rank]`` and the rotated
        shared key ``[batch_size, 1, max_len, qk_rope_head_dim]``. A scanned decoder stacks the
        scanned layers' pairs (``[L, ...]`` each); with unrolled head layers (DeepSeek's leading
        dense ones) its cache is ``(head layers' pairs, stacked pair)``."""
        c = self.config
        b, t = int(batch_size), int(max_len)
        if c.mla is not None:
            shapes = ((b, 1, t, c.mla.kv_lora_rank), (b, 1, t, c.mla.qk_rope_head_dim))
        else:
            shapes = ((b, c.num_kv_heads, t, c.head_dim),) * 2
        dt = dtype or self.dtype
        per_layer = tuple(tuple(jnp.zeros(sh, dt) for sh in shapes) for _ in range(len(self.layers)))
        if not self.scan_layers:
            return per_layer
        stacked = tuple(jnp.zeros((self.num_scanned_layers,) + sh, dt) for sh in shapes)   # as the scan reads them
        return (per_layer, stacked) if len(self.layers) else stacked


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


class _Tensors:
    """The checkpoint's tensor names by module (``a.b.c.suffix`` → ``a.b.c`` → suffix → name)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.modules: dict[str, dict[str, str]] = {}
        for name in ckpt.tensor_names():
            module, _, suffix = name.rpartition(".")
            self.modules.setdefault(module, {})[suffix] = name

    def float_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        t = self.ckpt.tensor_info(name)            # MissingTensorError naming it
        if t.dtype.kind != "f" and t.dtype_name != "BF16":
            raise DTypeError(f"{name}: expected a 16/32-bit float tensor, got {t.dtype_name}")
        if tuple(t.shape) != tuple(shape):
            raise ShapeError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        a = self.ckpt.read_tensor(name)
        if not np.isfinite(a.astype(np.float32)).all():
            raise ValueRangeError(f"{name}: holds NaN or Inf")
        return a


def _quantized_scheme(tensors: _Tensors, module: str, bias: bool):
    """The scheme of ``module`` if the checkpoint stores it quantized (None: a 16-bit linear), its
    bias checked against the config."""
    found = tensors.modules.get(module, {})
    if not any(m in found for m in formats.QUANTIZED_MARKERS):
        return None
    scheme = tensors.ckpt.quant_config.scheme_for(module)
    if scheme is None:
        raise ConfigError(f"{module}: the checkpoint stores it quantized "
                          f"({sorted(found)}), but quantization_config leaves it unquantized "
                          f"({tensors.ckpt.quant_config.group_for(module) or 'no matching group'})")
    _check_bias(module, found, bias)
    return scheme


def _check_bias(module: str, found, bias: bool) -> None:
    if bias and "bias" not in found:
        raise MissingTensorError(f"{module}.bias: required by config.json (attention biases), not found")
    if not bias and "bias" in found:
        raise UnexpectedTensorError(f"{module}.bias: present, but config.json says the layer has no bias")


def _quantized_linear(tensors: _Tensors, modules: Sequence[str], ns: Sequence[int], k: int, scheme, *, dtype):
    """One :class:`QuantizedLinear` reading ``modules`` (which read the same input) as one matrix
    of their parts along N."""
    reason = next((formats.size_reason(scheme, n, k) for n in ns if formats.size_reason(scheme, n, k)), None)
    if reason:
        raise ShapeError(f"{modules[0]}: {reason}")
    parts = [MatrixPart([dict(tensors.modules.get(m, {}))], n, m) for m, n in zip(modules, ns)]
    m, bias = read_matrix(tensors.ckpt, scheme, parts, k=k)
    return QuantizedLinear(m, None if bias is None else bias[0], compute_dtype=dtype, splits=ns)


def _linear(tensors: _Tensors, module: str, n: int, k: int, *, bias: bool, dtype, param_dtype,
            dequantized: bool):
    """The linear ``module`` (``W [n, k]``): quantized if its tensors are, else 16-bit."""
    scheme = _quantized_scheme(tensors, module, bias)
    if scheme is not None:
        layer = _quantized_linear(tensors, [module], [n], k, scheme, dtype=dtype)
        return layer.dequantized(jnp.bfloat16) if dequantized else layer
    found = tensors.modules.get(module, {})
    if "weight" not in found:
        raise MissingTensorError(f"{module}.weight: not found in {tensors.ckpt.path!r} (nor a quantized "
                                 f"{module}.qweight / {module}.weight_packed)")
    extra = sorted(set(found) - {"weight", "bias"})
    if extra:
        raise UnexpectedTensorError(f"{module}: a 16-bit linear with unexpected tensors "
                                    f"{[f'{module}.{s}' for s in extra]}")
    _check_bias(module, found, bias)
    w = tensors.float_tensor(found["weight"], (n, k))
    b = tensors.float_tensor(found["bias"], (n,)) if bias else None
    return DenseLinear(w, b, compute_dtype=dtype, param_dtype=param_dtype)


def _linears(tensors: _Tensors, modules: Sequence[str], ns: Sequence[int], k: int, biases: Sequence[bool], *,
             dtype, param_dtype, dequantized: bool):
    """The linears ``modules``, which read the same input: one :class:`QuantizedLinear` reading them
    as one matrix (one GEMM) where they are quantized alike and an engine runs the whole (a
    load-time concatenation along N), else a tuple of one linear each."""
    schemes = [_quantized_scheme(tensors, m, b) for m, b in zip(modules, biases)]
    s0 = schemes[0]
    if (not dequantized and s0 is not None and all(s == s0 for s in schemes) and len(set(biases)) == 1
            and engine_for(CheckpointForm(sum(ns), k, s0), dtype)[0] is not None):
        return _quantized_linear(tensors, modules, ns, k, s0, dtype=dtype)
    return tuple(_linear(tensors, m, n, k, bias=b, dtype=dtype, param_dtype=param_dtype, dequantized=dequantized)
                 for m, n, b in zip(modules, ns, biases))


def _dense_experts(w, dtype):
    """Loader-layout (or float) experts as :class:`DenseWeights` in ``dtype``, on the device."""
    if w is None:
        return None
    w = jax.tree.map(jnp.asarray, w)
    w13, w2 = w.dequantize(dtype)
    b13, b2 = w.decode_bias()
    return DenseWeights(w13, w2, None if b13 is None else b13.astype(dtype), None if b2 is None else b2.astype(dtype),
                        hidden_size=int(w13.shape[2]), intermediate_size=int(w13.shape[1]) // 2)


#: the epsilon of DeepSeek's ``q_a_layernorm`` / ``kv_a_layernorm`` (their modules' default, not
#: ``rms_norm_eps``)
LATENT_NORM_EPS = 1e-6


def _latent_attention(c: DecoderConfig, p: str, lin, lins, norm) -> LatentAttention:
    """The :class:`LatentAttention` of module prefix ``p`` (``model.layers.{i}.self_attn``)."""
    m, h, nh = c.mla, c.hidden_size, c.num_heads
    kv_a = (f"{p}.kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, m.attention_bias)
    if m.q_lora_rank is None:
        x_proj = lins((f"{p}.q_proj", nh * m.qk_head_dim, False), kv_a)
        q_a_norm = q_b = None
        if isinstance(x_proj, tuple):
            x_proj = (x_proj[0], None, x_proj[1])
    else:
        x_proj = lins((f"{p}.q_a_proj", m.q_lora_rank, m.attention_bias), kv_a)
        q_a_norm = norm(f"{p}.q_a_layernorm.weight", m.q_lora_rank, LATENT_NORM_EPS)
        q_b = lin(f"{p}.q_b_proj", nh * m.qk_head_dim, m.q_lora_rank)
        if isinstance(x_proj, tuple):
            x_proj = (None, x_proj[0], x_proj[1])
    return LatentAttention(
        c, x_proj, q_a_norm, q_b, norm(f"{p}.kv_a_layernorm.weight", m.kv_lora_rank, LATENT_NORM_EPS),
        lin(f"{p}.kv_b_proj", nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        lin(f"{p}.o_proj", h, nh * m.v_head_dim, m.attention_bias))


def load_model(path: str | os.PathLike, *, dtype=None, param_dtype=None, backend: Any = None,
               dequantized: bool = False, scan_layers: bool | None = None) -> MoEDecoder:
    """Build the :class:`MoEDecoder` of checkpoint folder ``path`` (``config.json`` + safetensors).

    ``dtype``: the activations' dtype (default :func:`default_dtype`). ``param_dtype``: the dtype
    of the 16-bit parameters (default: as stored; float32 for fine-tuning). ``backend``: the MoE
    experts' layout (``None``: the dispatch table's choice; see :func:`wna16_jax.select_backend`).
    ``dequantized=True`` dequantizes every quantized linear and expert to bfloat16 while loading
    (a reference point for benchmarks: the same model as plain XLA on 16-bit weights).
    ``scan_layers=True`` stacks the decoder layers and runs them as one ``lax.scan``: one compiled
    layer instead of one per layer (a 48-layer model's prefill and decode compile in under a
    minute), the quantized weights read in place from the stacks, the KV cache one ``(k, v)`` pair stacked per
    layer; every layer must have the same structure (not configs that mix dense and sparse
    layers), except leading dense layers before only MoE ones (DeepSeek's
    ``first_k_dense_replace``), which run unrolled ahead of the scan and are then all that
    ``model.layers`` holds (:meth:`MoEDecoder.layer_modules` rebuilds the rest).
    The stacks are filled as the layers load, so the load holds the stacks and about one layer.
    ``None`` (default): scanned when at least :data:`SCAN_MIN_LAYERS` layers (after such a
    dense head) have the same structure, unrolled otherwise.

    Refuses, before reading any weight data: an unsupported ``model_type`` (naming the supported
    families), rope types / sliding-window settings it would get wrong, MoE layers where the
    config does not put them; then, per tensor, missing, unexpected, misshapen or non-finite
    tensors, naming them. Only files inside ``path`` are read.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"{path!r}: not a folder (expected a checkpoint folder with config.json)")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"config.json: not found in {path!r}")
    raw = load_json(cfg_file, what="config.json")
    config = DecoderConfig.from_hf_config(raw)
    generation = read_generation_config(path, vocab_size=config.vocab_size)      # refused before any weight is read
    config = dataclasses.replace(config, generation=generation,
                                 eos_token_ids=generation.stop_token_ids(config.eos_token_ids))
    ckpt = Checkpoint(path)
    dtype = jnp.dtype(dtype or default_dtype())
    if ckpt.model_config.hidden_size != config.hidden_size:      # pragma: no cover - same field
        raise ConfigError("config.json: hidden_size read differently")
    # DeepSeek-V3's multi-token-prediction modules are stored as layers after the last decoder
    # layer (num_nextn_predict_layers); generation does not use them, they are not loaded
    mtp = raw.get("num_nextn_predict_layers") if config.mla is not None else None
    mtp = mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0 else 0
    found = [i for i in ckpt.moe_layer_indices if i < config.num_layers + mtp]
    if [i for i in found if i < config.num_layers] != config.moe_layer_indices or len(found) != len(
            ckpt.moe_layer_indices):
        raise ConfigError(f"config.json: puts MoE layers at {config.moe_layer_indices} "
                          f"(decoder_sparse_step / mlp_only_layers / first_k_dense_replace), but the checkpoint "
                          f"has expert tensors for layers {ckpt.moe_layer_indices}")
    tensors = _Tensors(ckpt)
    c = config
    h, nh, nkv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

    def lin(module, n, k, bias=False):
        return _linear(tensors, module, n, k, bias=bias, dtype=dtype, param_dtype=param_dtype,
                       dequantized=dequantized)

    def lins(*specs, k=h):                 # (module, n, bias) of linears that read the same input
        return _linears(tensors, [m for m, _, _ in specs], [n for _, n, _ in specs], k, [b for _, _, b in specs],
                        dtype=dtype, param_dtype=param_dtype, dequantized=dequantized)

    def norm(name, size, eps=c.rms_norm_eps):
        return RMSNorm(tensors.float_tensor(name, (size,)), eps, param_dtype=param_dtype)

    layers: list = []
    fallback: list[str] = []
    # Scanned models are stacked as their layers are built (the load then holds the stacks and one
    # layer); scan_layers=None tries it when the config makes every layer alike.
    alike = len(set(c.sparse_layers)) == 1
    # DeepSeek's leading dense layers (first_k_dense_replace) before alike MoE layers: those run
    # unrolled ahead of the scan
    head = 0 if alike else next(i for i, sp in enumerate(c.sparse_layers) if sp)
    if not all(c.sparse_layers[head:]):
        head = 0
    tail_alike = alike or head > 0
    stacker = (_LayerStacker(c.num_layers - head)
               if scan_layers or (scan_layers is None and tail_alike and c.num_layers - head >= SCAN_MIN_LAYERS)
               else None)
    head_layers: list = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        if c.mla is not None:
            attn = _latent_attention(c, f"{p}.self_attn", lin, lins, norm)
        else:
            a = f"{p}.self_attn"
            attn = Attention(
                c, lins((f"{a}.q_proj", nh * hd, c.qkv_bias), (f"{a}.k_proj", nkv * hd, c.qkv_bias),
                        (f"{a}.v_proj", nkv * hd, c.qkv_bias)),
                lin(f"{a}.o_proj", h, nh * hd, c.o_bias),
                norm(f"{p}.self_attn.q_norm.weight", hd) if c.qk_norm else None,
                norm(f"{p}.self_attn.k_norm.weight", hd) if c.qk_norm else None)
        if c.sparse_layers[i]:
            if dequantized:
                moe_layer = ckpt.load_layer(i)
                moe_layer = dataclasses.replace(moe_layer, experts=_dense_experts(moe_layer.experts, jnp.bfloat16),
                                                shared_experts=_dense_experts(moe_layer.shared_experts, jnp.bfloat16))
                mlp = QuantizedMoE.from_layer(moe_layer, ckpt.model_config)
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    mlp = QuantizedMoE.from_checkpoint(ckpt, i, backend, activation_dtype=dtype)
                fallback.extend(str(w.message) for w in caught)
        else:
            inter = c.intermediate_size
            mlp = GatedMLP(lin(f"{p}.mlp.gate_proj", inter, h), lin(f"{p}.mlp.up_proj", inter, h),
                           lin(f"{p}.mlp.down_proj", h, inter))
        layer = DecoderLayer(norm(f"{p}.input_layernorm.weight", h), attn,
                             norm(f"{p}.post_attention_layernorm.weight", h), mlp)
        if stacker is not None and i < head:
            head_layers.append(layer)
            continue
        if stacker is not None:
            if stacker.add(layer):
                continue
            if scan_layers:
                raise ConfigError(f"scan_layers: decoder layer {i} differs from layer {head} in structure, shapes "
                                  "or dtypes (dense and sparse layers mixed, or layers of different layouts); "
                                  "load with scan_layers=False")
            layers, stacker = head_layers + stacker.layers(), None          # not alike after all: unrolled
            head_layers = []
        layers.append(layer)
    embed = tensors.float_tensor("model.embed_tokens.weight", (c.vocab_size, h))
    if param_dtype is not None:
        embed = embed.astype(param_dtype)
    lm_head = None
    if not c.tie_word_embeddings:
        lm_head = lin("lm_head", c.vocab_size, h)
    if fallback:
        warnings.warn(f"{len(fallback)} MoE layer(s): {fallback[0]}", stacklevel=2)
    return MoEDecoder(c, jnp.asarray(embed), layers if stacker is None else stacker, norm("model.norm.weight", h),
                      lm_head, dtype=dtype, scan_layers=stacker is not None, head_layers=head_layers)


__all__ = ["MoEDecoder", "DecoderLayer", "Attention", "LatentAttention", "GatedMLP", "yarn_inverse_frequencies",
           "rope_frequencies", "RMSNorm", "load_model", "apply_rope",
           "rope_inverse_frequencies", "default_dtype"]
