"""One Mosaic GPU kernel for a whole decode MoE layer on the pair schedule (engine v9, Hopper).

At one token the layer's two GEMMs stream a few MB of weights in a few µs each, and the rest of
its 40–60 µs is launches and XLA passes between them (``docs/journal/notes.md`` v6–v8; XLA's
command buffers measured slower). :func:`wgmma_decode_layer` runs GEMM1, the gate/up activation
and GEMM2 in one launch:

* A persistent grid of at most one program per SM, so every program is resident at once.
* Phase 1: items ``(pair p, 128-column tile j of w13)``, dealt round-robin to the programs. Each
  streams its tile's int4 weights over all of ``K = H`` (TMA ring, dequantized in registers as in
  :func:`~pallas_kernels.wgmma_w4a16.wgmma_grouped_gemm`: 16-bit magic-number words, ``shift32``,
  128-byte rows where the K-blocks pair up), applies ``act(gate)·up`` to its ``[128, 8]``
  float32 accumulator (the columns are stored in 64-column gate/up halves by
  :func:`~pallas_kernels.wgmma_w4a16.convert_wgmma`) and writes the pair's ``[8, 64]`` slice of
  ``h`` (a second output of the kernel, global scratch) with one TMA store. When the store has
  completed, it adds 1 to each of the pair's ``H/128`` semaphores.
* Phase 2: items ``(pair p, 128-column tile j2 of w2)``. Each waits until its own semaphore
  ``(p, j2)`` counts all ``2I/128`` phase-1 tiles of its pair (and takes them off again, so the
  semaphores are back at zero for the next call), then streams ``w2``'s tile over ``K = I`` with
  the pair's 8 rows of ``h`` as the activation tile and writes ``y``'s ``[8, 128]`` tile.

No deadlock: every program finishes all its phase-1 items before it waits on anything, and all
programs are resident (grid ≤ SMs). The semaphores are Mosaic GPU globals
(``pl.get_global``): signalled with release semantics after the producer's TMA store has
completed, acquired by the waiting program before its TMA loads of ``h``, with an async-proxy
fence on both sides.

Rows ``8p+1 … 8p+7`` of each pair's block are zero in ``a`` (the spread form of the pair
schedule), so they are zero in ``h`` (``act(0)·0 = 0``) and in ``y``; the layer reads row ``8p``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from wna16_jax.errors import ConfigError, DTypeError, ShapeError

from .wgmma_w4a16 import (BLOCK_K, GATED_ACTIVATIONS, IDS_PAD, SMEM_LIMIT, TRANSPOSED_STORE, _nibble_planes,
                          act_pair, magic_value, smem_load)

ROWS = 8              # rows per pair block (the pair schedule)
TILE = 128            # output columns per item (GEMM1: 64 gate + 64 up columns)


def _proxy_fence():
    """``fence.proxy.async.global``: orders this thread's generic-proxy accesses to global memory
    with the async proxy's (the TMA copies) — after a TMA store has completed and before the
    release that publishes it; after the acquire and before TMA loads of what it published."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def fence(_ctx):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)

    fence()


def _check_gemm(name, words, scales, zeros, e, n, k, dtype):
    if jnp.dtype(words.dtype) != jnp.dtype(jnp.int16) or words.shape != (e, n, k // 4):
        raise ShapeError(f"{name}_words: expected int16 {(e, n, k // 4)} (convert_wgmma's 16-bit words), got "
                         f"{words.dtype}{words.shape}")
    groups = scales.shape[1] if scales.ndim == 3 else None
    if groups not in (1, k // BLOCK_K) or scales.shape != (e, groups, n):
        raise ShapeError(f"{name}_scales: expected {(e, k // BLOCK_K, n)} (group 128) or {(e, 1, n)} "
                         f"(channelwise), got {scales.shape}")
    for t, what in ((scales, "scales"), (zeros, "zeros")):
        if t is not None and jnp.dtype(t.dtype) != jnp.dtype(dtype):
            raise DTypeError(f"{name}_{what}: expected {jnp.dtype(dtype).name} (the activation dtype), got {t.dtype}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ShapeError(f"{name}_zeros: expected {scales.shape} (as the scales), got {zeros.shape}")


def decode_layer_smem_bytes(*, kpb1: int, kpb2: int, stages1: int, stages2: int, num_pairs: int,
                            has_zp: bool = True) -> int:
    """Shared memory of one :func:`wgmma_decode_layer` program: the pair → expert ids, the two
    output tiles, and the larger of the two phases' pipeline rings (``stages1`` / ``stages2``
    deep, the depths in effect; their scopes do not overlap); every allocation rounded up to 1 KB
    as Mosaic GPU does, 512 bytes for the barriers."""
    def al(b):
        return -(-b // 1024) * 1024

    def ring(kpb, st):
        return (al(st * TILE * 64 * kpb) + al(st * ROWS * BLOCK_K * kpb * 2)
                + (2 if has_zp else 1) * al(st * kpb * TILE * 2))
    ids = al(-(-num_pairs // IDS_PAD) * IDS_PAD * 4)
    return ids + al(ROWS * TILE // 2 * 2) + al(ROWS * TILE * 2) + max(ring(kpb1, stages1), ring(kpb2, stages2)) + 512


@functools.partial(jax.jit, static_argnames=("activation", "programs", "stages"))
def wgmma_decode_layer(a, experts, w13_words, w13_scales, w13_zeros, w2_words, w2_scales, w2_zeros, *,
                       activation: str = "silu", programs: int | None = None, stages: int = 4):
    """GEMM1 → ``act(gate)·up`` → GEMM2 of the pair schedule in one kernel (module docstring).

    ``a [P·8, H]`` bf16/fp16: row ``8p`` the token of routed pair ``p``, rows ``8p+1 … 8p+7``
    zero; ``experts [P]`` int32 (``-1``: no expert — its rows come out zero). ``w13_*`` as
    :func:`~pallas_kernels.wgmma_w4a16.convert_wgmma` stores them with ``w13_interleaved``
    (``[E, 2I, H/4]`` int16 words, ``[E, G, 2I]`` scales / zero points in the activation dtype,
    group 128 or channelwise; ``zeros=None``: symmetric), ``w2_*`` likewise ``[E, H, I/4]`` /
    ``[E, G, H]``. ``activation``: ``"silu"`` or ``"gelu_tanh"``; ``programs``: the persistent
    grid (default: the GPU's SMs, at most the larger phase's item count); ``stages``: TMA ring
    depth. Returns ``y [P·8, H]`` in ``a``'s dtype (rows ``8p`` hold the pairs' outputs, the
    rest zero): ``y = act(gate)·up`` of ``a @ W13ᵀ`` (float32 accumulation, rounded once to the
    activation dtype, as the two-kernel layer's gated GEMM1 writes it) ``@ W2ᵀ``, rounded once.
    jax >= 0.11 (the ``[M, N]`` output tiles use Mosaic GPU's transposed shared-memory store)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from .wna16_grouped_gemm import num_sms

    if activation not in GATED_ACTIVATIONS:
        raise ConfigError(f"wgmma_decode_layer: activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
    dtype = jnp.dtype(a.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise DTypeError(f"a: expected bfloat16 or float16, got {a.dtype}")
    if a.ndim != 2 or a.shape[0] % ROWS or experts.shape != (a.shape[0] // ROWS,):
        raise ShapeError(f"wgmma_decode_layer: a must be [P·{ROWS}, H] and experts [P], got a {a.shape}, "
                         f"experts {experts.shape}")
    p_n, h_dim = experts.shape[0], a.shape[1]
    e, n1 = w13_words.shape[0], w13_words.shape[1]
    i_dim = n1 // 2
    if h_dim % TILE or i_dim % BLOCK_K or n1 % TILE:
        raise ShapeError(f"wgmma_decode_layer: H={h_dim} and 2I={n1} must be multiples of {TILE}, I of {BLOCK_K}")
    _check_gemm("w13", w13_words, w13_scales, w13_zeros, e, n1, h_dim, dtype)
    _check_gemm("w2", w2_words, w2_scales, w2_zeros, e, h_dim, i_dim, dtype)
    if (w13_zeros is None) != (w2_zeros is None):
        raise ConfigError("wgmma_decode_layer: zero points for both GEMMs or for neither")
    has_zp = w13_zeros is not None
    t1, t2 = n1 // TILE, h_dim // TILE                 # column tiles per pair, GEMM1 / GEMM2
    items1, items2 = p_n * t1, p_n * t2
    on_gpu = jax.devices()[0].platform == "gpu"
    sms = num_sms() if on_gpu else 1024             # off the GPU (lowering only): no bound to check
    g_n = programs or min(sms, max(items1, items2))
    if not 1 <= g_n <= sms:
        raise ConfigError(f"wgmma_decode_layer: programs={g_n} must be in [1, {sms}] (the GPU's SMs: every "
                          f"program must be resident, since the phase-2 items wait on phase-1 work)")
    n_kb1, n_kb2 = h_dim // BLOCK_K, i_dim // BLOCK_K
    kpb1, kpb2 = (2 if n_kb1 % 2 == 0 else 1), (2 if n_kb2 % 2 == 0 else 1)
    need = decode_layer_smem_bytes(kpb1=kpb1, kpb2=kpb2, stages1=min(stages, n_kb1 // kpb1),
                                   stages2=min(stages, n_kb2 // kpb2), num_pairs=p_n, has_zp=has_zp)
    if need > SMEM_LIMIT:
        raise ConfigError(f"wgmma_decode_layer: stages={stages} need {need} bytes of shared memory, more than "
                          f"{SMEM_LIMIT}")

    if not TRANSPOSED_STORE:
        raise ConfigError(f"wgmma_decode_layer needs jax >= 0.11 (Mosaic GPU's transposed shared-memory store), "
                          f"this is jax {jax.__version__}")
    rows_ids = -(-p_n // IDS_PAD)
    ids = jnp.full((rows_ids * IDS_PAD,), -1, jnp.int32).at[:p_n].set(experts.astype(jnp.int32))
    ids = ids.reshape(rows_ids, IDS_PAD)
    row = plgpu.Layout.WGMMA.reduce(1)
    planes = _nibble_planes(TILE, dtype)
    zero_point = magic_value(dtype) + 8.0

    def zero(rows=TILE):
        return plgpu.layout_cast(jnp.zeros((rows, ROWS), jnp.float32), plgpu.Layout.WGMMA)

    def transposed(ref):
        return ref.transpose((1, 0)) if hasattr(ref, "transpose") else plgpu.transpose_ref(ref, (1, 0))

    def specs(kpb, channelwise):
        wide = kpb == 2
        return [plgpu.BlockSpec((TILE, 32 * kpb), lambda kb: (0, kb),
                                transforms=((plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if wide
                                            else (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)))),
                plgpu.BlockSpec((ROWS, BLOCK_K * kpb), lambda kb: (0, kb),
                                transforms=(plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))),
                *[plgpu.BlockSpec((1, TILE), lambda kb: (0, 0)) if channelwise else
                  plgpu.BlockSpec((kpb, TILE), lambda kb: (kb, 0))] * (2 if has_zp else 1)]

    def gemm(acc_ref, kpb, channelwise, refs, n_kb):
        """Stream one item's K range; returns its ``[TILE, 8]`` float32 accumulator."""
        def step(_, w_smem, x_smem, s_smem, *rest):
            z_smem, acc = (rest[0] if has_zp else None), rest[-1]
            xt = transposed(x_smem)
            whole = smem_load(w_smem, layout=plgpu.Layout.WGMMA) if kpb == 2 else None
            acc_ref[...] = acc
            for q in range(kpb):
                g = 0 if channelwise else q

                def rows(ref):
                    return jax.lax.broadcast_in_dim(smem_load(ref.at[g], layout=row).astype(dtype),
                                                    (TILE, 16), (0,))
                sc = rows(s_smem)
                zc = rows(z_smem) if has_zp else jnp.asarray(zero_point, dtype)
                for u in range(2):
                    tile = (whole[:, 32 * q + 16 * u: 32 * q + 16 * u + 16] if whole is not None else
                            smem_load(w_smem.at[:, pl.ds(32 * q + 16 * u, 16)], layout=plgpu.Layout.WGMMA))
                    for t, v in enumerate(planes(tile)):
                        plgpu.wgmma(acc_ref, (v - zc) * sc, xt.at[pl.ds(BLOCK_K * q + 64 * u + 16 * t, 16)])
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        steps = n_kb // kpb
        return plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=min(stages, steps),
                                   in_specs=specs(kpb, channelwise), init_carry=zero())(*refs)

    def store(val, o_smem, dst):
        transposed(o_smem)[...] = val.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, dst)
        plgpu.wait_smem_to_gmem(0)

    cw1, cw2 = w13_scales.shape[1] == 1, w2_scales.shape[1] == 1

    def kernel(ids_gmem, a_gmem, w13_gmem, s13_gmem, *rest):
        if has_zp:
            z13_gmem, w2_gmem, s2_gmem, z2_gmem, y_gmem, h_gmem = rest
        else:
            (w2_gmem, s2_gmem, y_gmem, h_gmem), z13_gmem, z2_gmem = rest, None, None
        g = jax.lax.axis_index("g")
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((p_n, t2)))

        def body(ids_smem, ids_bar, o1_smem, o2_smem):
            plgpu.copy_gmem_to_smem(ids_gmem, ids_smem, ids_bar)
            plgpu.barrier_wait(ids_bar)

            def each_item(n_items, work):
                """``work(item)`` for this program's share of ``n_items`` items, dealt round-robin."""
                @pl.loop(0, -(-n_items // g_n))
                def _(r):
                    it = g + r * g_n

                    @pl.when(it < n_items)
                    def _():
                        work(it)

            def phase1(it):
                p, j = it // t1, it % t1
                ex = ids_smem[p // IDS_PAD, p % IDS_PAD]
                dst = h_gmem.at[pl.ds(p * ROWS, ROWS), pl.ds(j * (TILE // 2), TILE // 2)]
                cols = pl.ds(j * TILE, TILE)

                @pl.when(ex >= 0)
                def _():
                    refs = (w13_gmem.at[ex, cols], a_gmem.at[pl.ds(p * ROWS, ROWS)],
                            s13_gmem.at[ex, :, cols], *([z13_gmem.at[ex, :, cols]] if has_zp else []))

                    def with_acc(acc_ref):
                        acc = gemm(acc_ref, kpb1, cw1, refs, n_kb1)
                        store(act_pair(activation, acc[:TILE // 2], acc[TILE // 2:]), o1_smem, dst)
                    pl.run_scoped(with_acc, plgpu.ACC((TILE, ROWS), jnp.float32))

                @pl.when(ex < 0)
                def _():
                    store(zero(TILE // 2), o1_smem, dst)

                _proxy_fence()                       # the h tile (async proxy) before the release

                @pl.loop(0, t2)
                def _(j2):
                    plgpu.semaphore_signal(sems.at[p, j2], 1, memory_scope="gpu")

            def phase2(it):
                p, j2 = it // t2, it % t2
                plgpu.semaphore_wait(sems.at[p, j2], t1, memory_scope="gpu")     # takes the t1 off again
                _proxy_fence()                       # the acquire before the TMA loads of h
                ex = ids_smem[p // IDS_PAD, p % IDS_PAD]
                cols = pl.ds(j2 * TILE, TILE)
                dst = y_gmem.at[pl.ds(p * ROWS, ROWS), cols]

                @pl.when(ex >= 0)
                def _():
                    refs = (w2_gmem.at[ex, cols], h_gmem.at[pl.ds(p * ROWS, ROWS)],
                            s2_gmem.at[ex, :, cols], *([z2_gmem.at[ex, :, cols]] if has_zp else []))

                    def with_acc(acc_ref):
                        store(gemm(acc_ref, kpb2, cw2, refs, n_kb2), o2_smem, dst)
                    pl.run_scoped(with_acc, plgpu.ACC((TILE, ROWS), jnp.float32))

                @pl.when(ex < 0)
                def _():
                    store(zero(), o2_smem, dst)

            each_item(items1, phase1)            # every phase-1 item of this program before any wait
            each_item(items2, phase2)

        pl.run_scoped(body, plgpu.SMEM((rows_ids, IDS_PAD), jnp.int32), plgpu.Barrier(num_arrivals=1),
                      plgpu.SMEM((ROWS, TILE // 2), dtype), plgpu.SMEM((ROWS, TILE), dtype))

    y, _h = plgpu.kernel(kernel, out_type=(jax.ShapeDtypeStruct((p_n * ROWS, h_dim), dtype),
                                           jax.ShapeDtypeStruct((p_n * ROWS, i_dim), dtype)),
                         grid=(g_n,), grid_names=("g",))(
        ids, a, w13_words, w13_scales, *([w13_zeros] if has_zp else []),
        w2_words, w2_scales, *([w2_zeros] if has_zp else []))
    return y
