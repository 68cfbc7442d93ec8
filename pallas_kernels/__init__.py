"""Pallas GPU kernels for wna16-jax: a leaf package (it imports only jax and numpy).

Kernels take arrays and a configuration and return arrays; each has a plain-``jnp`` reference
beside it that the tests compare against. The Triton-lowered engine: ``wna16_grouped_gemm``
(GEMMs on the tile layout) and ``fused_moe_tiles`` (its MoE layer, batched form and backward).
The Hopper wgmma engine: ``wgmma_layout``, ``wgmma_config``, ``wgmma_common``, the kernel forms
``wgmma_plain`` / ``wgmma_ws`` / ``wgmma_ws_stream``, ``wgmma_gemm`` and the layer
``wgmma_layer``. Attention: ``decode_attention`` (one decode step of grouped-query attention
read from a stacked KV cache, Triton). Shared: ``row_gather``, ``align``, ``activations``,
``device``, ``experts``, ``errors``.
"""
