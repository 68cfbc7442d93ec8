"""The decoder's one KV-cache type: :class:`KVCache`, a pool of blocks read through block tables.

Every layer's cache lies in two stacked pools, ``k [L, P, n, block_size, dk]`` and
``v [L, P, n, block_size, dv]`` (for DeepSeek's latent attention, ``n = 1`` and the pair is the
normed latent and the rotated shared key). Sequence ``b``'s position ``t`` lives in block
``block_table[b, t // block_size]`` at slot ``t % block_size``.

Two ways to fill the pool share the type:

* **contiguous** (``block_table`` None): one block per sequence, ``P = B`` and
  ``block_size = max_len``: block ``b`` is row ``b`` (the identity table). :class:`~wna16_jax.models.Generator`
  uses it; writes are one ``dynamic_update_slice`` per row, reads a slice of the layer.
* **paged** (``block_table [B, M]`` int32): blocks are handed out by a scheduler
  (:mod:`wna16_jax.serving`), ``-1`` marks an unused entry; writes scatter each token to its block,
  reads gather the table's blocks. Memory follows the blocks in use, not ``batch × max_len``.

A cache is *bound* to one layer (:meth:`at_layer`; a Python int for unrolled layers, a traced
int32 inside the scan over the layers) before attention reads or writes it: the layer index is
set once, where the decoder walks its layers, and attention sees one layer's cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError, ShapeError
from ..fields import check_int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer (see the module doc). ``k``, ``v``: the pools;
    ``block_table``: ``[B, M]`` int32 or None (contiguous); ``layer``: the bound layer or None."""

    k: Any
    v: Any
    block_table: Any = None
    layer: Any = None

    # ------------------------------------------------------------------ making
    @classmethod
    def contiguous(cls, num_layers: int, batch_size: int, max_len: int, shapes, dtype) -> "KVCache":
        """A zeroed cache of ``batch_size`` rows of ``max_len`` positions; ``shapes``: the
        ``(n, dk)`` and ``(n, dv)`` of one position."""
        (nk, dk), (nv, dv) = shapes
        l, b, t = (check_int(n, v, low=1) for n, v in (("num_layers", num_layers), ("batch_size", batch_size),
                                                       ("max_len", max_len)))
        return cls(jnp.zeros((l, b, nk, t, dk), dtype), jnp.zeros((l, b, nv, t, dv), dtype))

    @classmethod
    def paged(cls, num_layers: int, num_blocks: int, block_size: int, shapes, dtype) -> "KVCache":
        """A zeroed pool of ``num_blocks`` blocks of ``block_size`` positions (no table yet:
        :meth:`with_block_table`)."""
        (nk, dk), (nv, dv) = shapes
        l, p, s = (check_int(n, v, low=1) for n, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                                                       ("block_size", block_size)))
        return cls(jnp.zeros((l, p, nk, s, dk), dtype), jnp.zeros((l, p, nv, s, dv), dtype),
                   jnp.zeros((1, 1), jnp.int32))

    def with_block_table(self, block_table) -> "KVCache":
        """The same pool read through ``block_table [B, M]`` (int32 block ids, ``-1``: unused)."""
        t = jnp.asarray(block_table)
        if t.ndim != 2 or not jnp.issubdtype(t.dtype, jnp.integer):
            raise ShapeError(f"block_table: expected a [B, M] integer array, got {t.dtype} {tuple(t.shape)}")
        if self.block_table is None:
            raise ConfigError("block_table: this cache is contiguous (one block per row); make a paged one "
                              "with KVCache.paged")
        return dataclasses.replace(self, block_table=t.astype(jnp.int32))

    def at_layer(self, layer) -> "KVCache":
        """This cache bound to ``layer`` (what attention reads and writes)."""
        return dataclasses.replace(self, layer=layer)

    def unbound(self) -> "KVCache":
        return dataclasses.replace(self, layer=None)

    # ------------------------------------------------------------------ facts
    @property
    def paged_pool(self) -> bool:
        return self.block_table is not None

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[3])

    @property
    def max_len(self) -> int:
        """Positions one row can hold."""
        return self.block_size * (int(self.block_table.shape[1]) if self.paged_pool else 1)

    @property
    def nbytes(self) -> int:
        return int(self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize)

    def _layer(self):
        if self.layer is None:
            raise ConfigError("KVCache: not bound to a layer (at_layer) where attention reads it")
        return jnp.asarray(self.layer, jnp.int32)

    # ------------------------------------------------------------------ attention's view
    def update(self, k, v, positions) -> "KVCache":
        """The cache with the new rows ``k [B, n, S, dk]``, ``v [B, n, S, dv]`` of positions
        ``positions [B, S]`` written into the bound layer (in place: nothing else is touched).
        Contiguous rows are written from slot ``positions[b, 0]`` on (consecutive positions);
        paged ones token by token, a negative position (padding) written nowhere."""
        if self.paged_pool:
            return dataclasses.replace(self, k=self._scatter(self.k, k, positions),
                                       v=self._scatter(self.v, v, positions))
        i, start = self._layer(), positions[:, 0].astype(jnp.int32)

        def write(pool, new):
            return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x[None].astype(c.dtype), (i, 0, s, 0)),
                            in_axes=(1, 0, 0), out_axes=1)(pool, new, start)

        return dataclasses.replace(self, k=write(self.k, k), v=write(self.v, v))

    def _scatter(self, pool, new, positions):
        p, s = pool.shape[1], self.block_size
        pos = positions.astype(jnp.int32)
        entry = jnp.clip(pos // s, 0, self.block_table.shape[1] - 1)
        block = jnp.take_along_axis(self.block_table, entry, axis=1)
        block = jnp.where((pos >= 0) & (pos < self.max_len) & (block >= 0), block, p)   # p: dropped
        rows = jnp.swapaxes(new, 1, 2).astype(pool.dtype)                                # [B, S, n, d]
        return pool.at[self._layer(), block, :, pos % s].set(rows, mode="drop")

    def read(self, kv_len: int | None, dtype):
        """``(keys [B, n, T, dk], values [B, n, T, dv], key positions [B, T])`` of the bound layer:
        the first ``kv_len`` positions (default: all a row holds), in ``dtype``."""
        i = self._layer()
        ck, cv = (jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False) for c in (self.k, self.v))
        if self.paged_pool:
            table = jnp.maximum(self.block_table, 0)               # unused entries read block 0, masked

            def gather(c):                                          # [P, n, s, d] → [B, n, M·s, d]
                g = jnp.take(c, table, axis=0)
                b, m, n, s, d = g.shape
                return jnp.swapaxes(g, 1, 2).reshape(b, n, m * s, d)

            ck, cv = gather(ck), gather(cv)
        b = ck.shape[0] if not self.paged_pool else self.block_table.shape[0]
        t = kv_len or ck.shape[2]
        kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        return ck[:, :, :t].astype(dtype), cv[:, :, :t].astype(dtype), kpos


def cache_bytes(num_layers: int, rows: int, positions: int, shapes, dtype) -> int:
    """Bytes of a cache of ``rows`` blocks (contiguous: sequences) of ``positions`` each."""
    (nk, dk), (nv, dv) = shapes
    return int(num_layers) * int(rows) * int(positions) * (nk * dk + nv * dv) * np.dtype(dtype).itemsize


__all__ = ["KVCache", "cache_bytes"]
