"""What the wgmma GEMM's kernel forms share: register-level dequantization, the accumulation
of one pipeline step, the epilogue, and the per-block bookkeeping (expert ids, row scales).

Operands are swapped as in Marlin's small-M schedule: per program, ``accᵀ[BN, BM] += Wᵀ · Aᵀ``
where ``Wᵀ`` (64 or 128 output columns × 16 of K) is the wgmma's register operand and the ``BM``
activation rows (8 to 256) its shared-memory operand, so a block of 8 tokens fills the wgmma's
N side instead of wasting a 64-row M side. :class:`GemmBuild` holds one launch's sizes and
options (a :class:`~pallas_kernels.wgmma_config.GemmConfig` applied to its arrays) and emits the
pieces each kernel form (``wgmma_plain``, ``wgmma_ws``, ``wgmma_ws_stream``) is made of.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .activations import act_pair
from .wgmma_config import IDS_PAD, GemmConfig, row_words
from .wgmma_layout import BLOCK_K, magic, magic_value


@functools.cache
def _load_needs_index() -> bool:
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu
    return inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def smem_load(ref, *, layout):
    """``plgpu.load`` of a whole (already indexed) shared-memory ref into registers: jax 0.10
    needs an explicit empty index, jax 0.11 deprecates passing one."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.load(ref, (), layout=layout) if _load_needs_index() else plgpu.load(ref, layout=layout)


LOP3_AND_OR = (0xF0 & 0xCC) | 0xAA      # lop3.b32's lookup table for (a & b) | c (a, b, c: 0xF0, 0xCC, 0xAA)


def nibble_planes(bn: int, dtype):
    """Mosaic GPU function: a ``[bn, 16]`` int16 word tile in the WGMMA register layout → its four
    nibble planes as ``magic + c`` in ``dtype`` (the same values as ``bits(magic | (w >> 4t & 15))``),
    computed on each 32-bit register (two adjacent words) with one 32-bit shift and one
    ``lop3.b32`` (inline PTX, ``(a & 0x000F000F) | magic·0x10001``) per plane — two codes per
    instruction, where the same jnp ops on int16 lower to two scalar 16-bit shifts per register
    and an ``and`` / ``or`` pair becomes two ``LOP3.LUT`` (v14)."""
    import numpy as np
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector

    layout = plgpu.Layout.WGMMA
    magic32 = magic(dtype) * 0x10001

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=tuple(plgpu.ShapeDtypeStruct((bn, 16), dtype, layout) for _ in range(4)))
    def planes(_ctx, words):
        i32 = ir.IntegerType.get_signless(32)
        one = ir.VectorType.get([1], i32)
        regs = words.registers
        out_ty = ir.VectorType.get(ir.VectorType(regs.flat[0].type).shape, mgpu.utils.dtype_to_ir_type(dtype))
        outs = []
        for t in range(4):
            plane = np.empty(regs.shape, dtype=object)
            for idx, r in np.ndenumerate(regs):
                x = vector.extract(vector.bitcast(one, r), dynamic_position=[], static_position=[0])
                if t:
                    x = arith.shrui(x, arith.constant(i32, 4 * t))
                x = llvm.inline_asm(i32, [x], f"lop3.b32 $0, $1, 0x000F000F, {magic32:#010x}, {LOP3_AND_OR:#x};",
                                    "=r,r", asm_dialect=0)
                plane[idx] = vector.bitcast(out_ty, vector.broadcast(one, x))
            outs.append(mgpu.FragmentedArray(_registers=plane, _layout=words.layout, _is_signed=None))
        return tuple(outs)

    return planes


def transposed(x_smem):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return x_smem.transpose((1, 0)) if hasattr(x_smem, "transpose") else plgpu.transpose_ref(x_smem, (1, 0))


class GemmBuild:
    """One GEMM launch: its sizes, its options and the pieces its kernel is built from."""

    def __init__(self, cfg: GemmConfig, *, dtype, m: int, n: int, k: int, nb: int, has_zp: bool, has_rs: bool,
                 programs: int | None = None):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.bm, self.bn, self.kpb = cfg.block_m, cfg.block_n, cfg.kpb
        self.m, self.n, self.k, self.nb = m, n, k, nb
        self.n_kb = k // BLOCK_K
        self.split_k, self.stages = cfg.split_k, cfg.stages
        self.chunk = self.n_kb // cfg.split_k // cfg.kpb       # pipeline steps per program (per item of a stream)
        self.has_zp, self.has_rs = has_zp, has_rs
        self.channelwise = cfg.group_size == -1
        self.wide, self.sfold, self.tout, self.gated = cfg.wide, cfg.sfold, cfg.tout, cfg.gated
        self.odt = self.dtype if cfg.out16 else jnp.dtype(jnp.float32)
        self.bno = self.bn // 2 if cfg.gated else self.bn       # output columns per (warpgroup's) column tile
        self.n_out = n // 2 if cfg.gated else n
        self.rows_ids = -(-(nb + cfg.stream) // IDS_PAD)
        self.rw = row_words(self.bm)
        self.programs = programs
        self.wcols, self.wswz = 32, 32                         # words per row per K-block; bytes per tile row
        self.row = plgpu.Layout.WGMMA.reduce(1)
        self.col = plgpu.Layout.WGMMA.reduce(0)
        self.planes = nibble_planes(self.bn, self.dtype)

    # ---------------------------------------------------------------- values
    def zero(self, rows=None):
        """A ``[rows, bm]`` float32 array of zeros in the wgmma layout."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.layout_cast(jnp.zeros((rows or self.bn, self.bm), jnp.float32), plgpu.Layout.WGMMA)

    def finish(self, acc):
        """The epilogue's value of a ``[bn, bm]`` accumulator: itself, or ``act(gate) · up`` of its
        64-row halves (gate rows first) with ``gated``."""
        return act_pair(self.gated, acc[:self.bno], acc[self.bno:]) if self.gated else acc

    def scaled(self, val, rs_smem):
        """``val [rows, bm]`` with each column (an output row) times its ``row_scale``."""
        from jax.experimental import pallas as pl
        if not self.has_rs:
            return val
        r = smem_load(rs_smem.at[0, pl.ds(0, self.bm)], layout=self.col)
        return val * jax.lax.broadcast_in_dim(r, val.shape, (1,))

    # ---------------------------------------------------------------- block bookkeeping
    def row_types(self):
        """Scratch for this block's row of ``row_scale``: a ``(1, rw)`` buffer and its barrier."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return [plgpu.SMEM((1, self.rw), jnp.float32), plgpu.Barrier(num_arrivals=1)] if self.has_rs else []

    def fetch_ids(self, ids_gmem, ids_smem, ids_bar, row_gmem, row_scratch):
        """Start copying the block → expert ids and this block's row of ``row_scale`` (``row_gmem``,
        when given) into shared memory."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu
        plgpu.copy_gmem_to_smem(ids_gmem, ids_smem, ids_bar)
        for q, ref in enumerate(row_gmem):
            plgpu.copy_gmem_to_smem(ref.at[pl.ds(jax.lax.axis_index("b"), 1)], *row_scratch[2 * q: 2 * q + 2])

    def wait_ids(self, ids_bar, row_scratch):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        plgpu.barrier_wait(ids_bar)
        for bar in row_scratch[1::2]:
            plgpu.barrier_wait(bar)

    def block_start(self, ids_gmem, ids_smem, ids_bar, row_gmem, row_scratch):
        """A one-program-per-item kernel's start: fetch and wait for the ids and the block's row of
        ``row_scale``; returns ``(expert of block i, row_scale's row or None)``."""
        self.fetch_ids(ids_gmem, ids_smem, ids_bar, row_gmem, row_scratch)
        self.wait_ids(ids_bar, row_scratch)
        i = jax.lax.axis_index("b")
        return ids_smem[i // IDS_PAD, i % IDS_PAD], self.row_smem(row_scratch)

    def row_smem(self, row_scratch):
        return row_scratch[0] if self.has_rs else None

    # ---------------------------------------------------------------- one pipeline step
    def dequantized(self, w_smem, s_smem, z_smem):
        """The step's weights dequantized into ``(K offset, [bn, 16] register operand)`` pairs, in K
        order: bf16/fp16 arithmetic on magic-number codes — ``bits(m | c) = m + c`` exactly,
        ``(m + c) − (m + z)`` exact, one rounding in the scale multiply (the reference's value); with
        ``sfold`` ``c − z`` only, the scale left to the fold."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu
        bn, dtype = self.bn, self.dtype
        whole = []                                # wide: the [bn, 64] words of both K-blocks, loaded once
        out = []
        for q in range(self.kpb):
            for u in range(2):
                g = 0 if self.channelwise else q

                def rows(ref, dt, g=g):
                    return jax.lax.broadcast_in_dim(smem_load(ref.at[g], layout=self.row).astype(dt), (bn, 16), (0,))

                if not self.sfold:
                    sc = rows(s_smem, dtype)
                zc = rows(z_smem, dtype) if self.has_zp else jnp.asarray(magic_value(dtype) + 8.0, dtype)
                if self.wide:
                    if not whole:
                        whole.append(smem_load(w_smem, layout=plgpu.Layout.WGMMA))
                    tile = whole[0][:, self.wcols * q + 16 * u: self.wcols * q + 16 * u + 16]
                else:
                    tile = smem_load(w_smem.at[:, pl.ds(self.wcols * q + 16 * u, 16)], layout=plgpu.Layout.WGMMA)
                for t, v in enumerate(self.planes(tile)):
                    out.append((BLOCK_K * q + 64 * u + 16 * t, v - zc if self.sfold else (v - zc) * sc))
        return out

    def accumulate(self, acc_ref, acc, w_smem, x_smem, s_smem, z_smem):
        """``acc`` plus one pipeline step's product: the step's weights dequantized in registers
        against its activation tile, through ``acc_ref`` (the wgmma accumulator); with ``sfold``
        each K-block's partial scaled in float32 into ``acc``."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu
        ops = self.dequantized(w_smem, s_smem, z_smem)
        xt = transposed(x_smem)
        if not self.sfold:
            acc_ref[...] = acc
            for k0, w in ops:
                plgpu.wgmma(acc_ref, w, xt.at[pl.ds(k0, 16)])
            plgpu.wgmma_wait(0)
            return acc_ref[...]
        for q in range(self.kpb):                     # one K-block (one scale group) per partial
            g = 0 if self.channelwise else q

            def cols(ref, g=g):
                return jax.lax.broadcast_in_dim(smem_load(ref.at[g], layout=self.row).astype(jnp.float32),
                                                (self.bn, self.bm), (0,))
            acc_ref[...] = self.zero()
            for k0, w in ops[len(ops) // self.kpb * q: len(ops) // self.kpb * (q + 1)]:
                plgpu.wgmma(acc_ref, w, xt.at[pl.ds(k0, 16)])
            plgpu.wgmma_wait(0)
            acc = acc + cols(s_smem) * acc_ref[...]   # the partial is Σ (c − z)·x: scale it
        return acc

    # ---------------------------------------------------------------- the epilogue
    def store(self, val, dst, o_smem=None):
        """The program's ``[bn, bm]`` accumulator (``[bn/2, bm]`` with ``gated``: :meth:`finish`)
        into ``dst``: directly (its window of the ``[split_k, N, M]`` output), or with ``tout``
        through ``o_smem [bm, ·]`` (a transposed store, then a TMA copy into the window of
        ``[split_k, M, N]``)."""
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu
        if not self.tout:
            dst[...] = val.astype(self.odt)
            return

        def through(o_smem):
            transposed(o_smem)[...] = val.astype(self.odt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, dst)
            plgpu.wait_smem_to_gmem(0)
        if o_smem is None:
            pl.run_scoped(through, plgpu.SMEM((self.bm, self.bno), self.odt))
        else:
            through(o_smem)

    def window(self, o_gmem, sp, blk, ocols):
        """Where block ``blk``'s output tile of columns ``ocols`` (K split ``sp``) goes."""
        from jax.experimental import pallas as pl
        bm = self.bm
        return o_gmem.at[sp, pl.ds(blk * bm, bm), ocols] if self.tout else o_gmem.at[sp, ocols, pl.ds(blk * bm, bm)]

    def word_spec(self, cols: int):
        """The pipeline's BlockSpec of a step's ``[cols, 32·kpb]`` word tile: 128-byte swizzled
        ``[cols, 64]`` tiles with ``wide`` (128-byte TMA rows; the ``(8, 16)``-tiled 32-byte rows
        cap the copy ring near 2.4 TB/s), else ``(8, 16)`` tiles."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        tr = ((plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if self.wide else
              (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(self.wswz)))
        return plgpu.BlockSpec((cols, self.wcols * self.kpb), lambda kb: (0, kb), transforms=tr)

    def x_spec(self):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.BlockSpec((self.bm, BLOCK_K * self.kpb), lambda kb: (0, kb),
                               transforms=(plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)))


def named(fn, name: str):
    """``fn`` under the function name ``name`` (the name Mosaic GPU gives the kernel)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)
    wrapped.__name__ = wrapped.__qualname__ = name
    return wrapped


__all__ = ["GemmBuild", "LOP3_AND_OR", "named", "nibble_planes", "smem_load", "transposed"]
