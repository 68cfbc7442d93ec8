"""The wgmma kernels' configurations: one frozen, validated config per kernel (the grouped GEMM,
the layer), the measured choices as data, and the heuristics that turn a shape into a config.

* :class:`GemmConfig` — one :func:`~pallas_kernels.wgmma_gemm.wgmma_grouped_gemm` launch. Its
  construction checks the rules that do not depend on the arrays (which options combine); the
  GEMM checks the rest against the arrays it is given (divisibility, shared memory).
* :class:`LayerConfig` — :func:`~pallas_kernels.wgmma_layer.fused_moe_wgmma`'s options; ``None``
  fields are chosen per GEMM by :func:`plan_gemm` from the shape and :data:`TUNING`.
* :data:`TUNING` — the thresholds measured on the H200 (keyed by compute capability), each with
  the journal entry that measured it (``docs/journal/notes.md``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax

from .activations import FUSED_ACTIVATIONS
from .align import ALIGN_METHODS
from .errors import KernelConfigError
from .wgmma_layout import BLOCK_K, BLOCK_N
from .wna16_grouped_gemm import choose_split

# ``tout``'s store of the wgmma accumulator into a transposed shared-memory view lowers from jax
# 0.11 on (0.10's Mosaic GPU rejects it: "Tiled strides must be a multiple of the vector length")
TRANSPOSED_STORE = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)

# Shared memory one thread block may use on sm_90 (H100 / H200): 227 KB. Mosaic GPU rejects a
# kernel above it only when it compiles, on the GPU; :func:`wgmma_smem_bytes` lets the layer fit
# its stage count and the GEMM refuse a configuration with a clear error on any machine.
SMEM_LIMIT = 232448
SM_SMEM = 233472      # one SM's shared memory (228 KB), shared by the programs resident on it
IDS_PAD = 32          # TMA copies whole multiples of 128 bytes: the block → expert ids are padded
_SMEM_ALIGN = 1024    # Mosaic GPU aligns every shared-memory allocation to 1 KB


def row_words(block_m: int) -> int:
    """float32 words of a block's row-scale row: ``block_m`` padded to whole 128-byte TMA rows."""
    return -(-block_m // IDS_PAD) * IDS_PAD


def wgmma_smem_bytes(*, block_m: int, block_n: int, kpb: int, stages: int, n_blocks: int, ws: bool = False,
                     tout: bool = False, gated: bool = False, has_zp: bool = True, channelwise: bool = False,
                     row_scale: bool = False, stream: bool = False) -> int:
    """Shared memory of one GEMM program, as Mosaic GPU allocates it: the block → expert ids (and
    with ``row_scale`` the block's row scales), one ``stages``-deep buffer per pipelined operand
    (words: 64 bytes per column and K-block; activations; scales; zero points) and, with ``tout``,
    the output tile — beside the pipeline with ``ws`` (both compute warpgroups' tiles), after it
    without (its scope opens when the pipeline's has closed). Each allocation is rounded up to
    1 KB; 512 bytes cover the barriers. ``stages`` is the ring depth in effect (``min(stages,
    steps)``). ``stream`` (the chained ``ws`` stream): the ids hold one more slot and the output
    tile lives beside the ring."""
    def al(b):
        return -(-b // _SMEM_ALIGN) * _SMEM_ALIGN

    cols = 2 * block_n if ws else block_n
    bufs = [stages * cols * 64 * kpb, stages * block_m * BLOCK_K * kpb * 2,
            stages * (1 if channelwise else kpb) * cols * 2]
    if has_zp:
        bufs.append(bufs[-1])
    ring = sum(al(b) for b in bufs)
    out = al((2 if ws else 1) * block_m * (block_n // 2 if gated else block_n) * 2) if tout else 0
    ids = al(-(-(n_blocks + stream) // IDS_PAD) * IDS_PAD * 4) + (0 if stream else al(row_words(block_m) * 4) * int(row_scale))
    return ids + (ring + out if ws or stream else max(ring, out)) + 512


def _int(name: str, value, *allowed) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (allowed and value not in allowed):
        raise KernelConfigError(f"{name}: expected {' or '.join(map(str, allowed)) if allowed else 'an integer'}, "
                                f"got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch of the wgmma grouped GEMM (``out[s, r] = a[r] @ W[expert of r's block]ᵀ`` over
    split ``s``'s share of K).

    ``block_m``: rows per expert block (a multiple of 8, 8–256). ``block_n``: output columns per
    program (64 or 128). ``kpb``: 128-deep K-blocks per pipeline step (1, 2 or 4). ``split_k``: K
    splits, each its own float32 partial. ``stages``: the ring of TMA-fed shared-memory buffers.
    ``group_size``: 128 or -1 (channelwise). ``wide`` (``kpb=2``): each step's ``[block_n, 64]``
    word tile copied with a 128-byte swizzle and loaded into registers whole. ``sfold``: each
    K-block's partial ``Σ (c − z)·x`` in its own accumulator, scaled in float32 (no per-weight
    multiply). ``ws``: warp specialization — two compute warpgroups of ``block_n`` columns each
    and a copy warpgroup (group 128). ``stream`` (with ``ws``): one program per SM (``programs``),
    each running its share of the (block, column tile, K split) items as chained warp-specialized
    pipelines. ``out16``: the output in the activations' dtype, rounded once from the float32
    accumulator (``split_k=1``). ``tout`` (``out16``, jax >= 0.11): the output written ``[M, N]``
    through a transposed shared-memory store. ``gated`` (``silu`` / ``gelu_tanh``; ``block_n=128``,
    ``split_k=1``): ``act(gate)·up`` of each 128-column tile's 64-column halves in the epilogue.
    """

    block_m: int
    block_n: int = BLOCK_N
    kpb: int = 1
    split_k: int = 1
    stages: int = 3
    group_size: int = 128
    wide: bool = False
    sfold: bool = False
    ws: bool = False
    stream: bool = False
    programs: int | None = None
    out16: bool = False
    tout: bool = False
    gated: str | None = None

    def __post_init__(self):
        bm = _int("block_m", self.block_m)
        if bm % 8 or not 8 <= bm <= 256:
            raise KernelConfigError(f"block_m: expected a multiple of 8 in [8, 256], got {bm}")
        _int("block_n", self.block_n, 64, 128)
        _int("kpb", self.kpb, 1, 2, 4)
        if _int("split_k", self.split_k) < 1 or _int("stages", self.stages) < 1:
            raise KernelConfigError(f"split_k and stages: expected >= 1, got {self.split_k} and {self.stages}")
        _int("group_size", self.group_size, BLOCK_K, -1)
        for flag in ("wide", "sfold", "ws", "stream", "out16", "tout"):
            if not isinstance(getattr(self, flag), bool):
                raise KernelConfigError(f"{flag}: expected a bool, got {getattr(self, flag)!r}")
        if self.wide and self.kpb != 2:
            raise KernelConfigError(f"wide=True needs kpb=2 (two K-blocks per 64-word tile), got kpb={self.kpb}")
        if self.ws and self.group_size != BLOCK_K:
            raise KernelConfigError("ws=True takes group-128 scales, not channelwise ones")
        if self.stream and not self.ws:
            raise KernelConfigError("stream=True is the chained warp-specialized stream: it needs ws=True")
        if self.programs is not None and (not self.stream or _int("programs", self.programs) < 1):
            raise KernelConfigError(f"programs={self.programs!r} needs stream=True and programs >= 1")
        if self.out16 and self.split_k != 1:
            raise KernelConfigError(f"out16=True needs split_k=1 (a split's partials are summed in float32), "
                                    f"got split_k={self.split_k}")
        if self.tout and not self.out16:
            raise KernelConfigError("tout=True needs out16=True (the transposed store writes 16-bit tiles)")
        if self.tout and not TRANSPOSED_STORE:
            raise KernelConfigError(f"tout=True needs jax >= 0.11 (Mosaic GPU's transposed shared-memory store), "
                                    f"this is jax {jax.__version__}")
        if self.gated is not None and (self.gated not in FUSED_ACTIVATIONS or self.block_n != 128 or self.split_k != 1):
            raise KernelConfigError(f"gated={self.gated!r} needs an activation in {FUSED_ACTIVATIONS}, block_n=128 "
                                    f"and split_k=1, got block_n={self.block_n}, split_k={self.split_k}")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Thresholds of the layer's heuristics, measured on one GPU kind (``docs/journal/notes.md``)."""

    #: blocks of up to this many rows fold each K-block's partial (``sfold``): v17, 24-row blocks,
    #: Mixtral 64 tokens 290.0 vs 300.7–301.9 µs; at 32 rows no faster (315.7)
    fold_rows: int = 24
    #: the row-gather kernel from this many routed pairs on: v20/v23, Qwen3 4096 tokens 768–795 µs
    #: against 789–805 with XLA's gather; below, XLA's gather fuses into its neighbours
    row_gather_min_pairs: int = 1024
    #: ws from blocks of this many rows on (v7: Mixtral 4096 tokens 6238 vs 8607 µs) ...
    ws_min_rows: int = 64
    #: ... and from this many where a program streams ``long_k_blocks`` K-blocks or more
    #: (v12: Mixtral 64 tokens 316–323 vs 333 µs)
    ws_long_k_rows: int = 32
    long_k_blocks: int = 32
    #: the pair schedule's GEMM1 aims at this many programs per SM (v14: Mixtral 1 token 67.7 vs
    #: 72.9–73.0 µs at split 2 against 1), the other GEMMs at ``waves``
    pair_waves: int = 4
    waves: int = 2


#: measured tunings by compute capability; other devices use the SM90 one
TUNING: dict[tuple[int, int], Tuning] = {(9, 0): Tuning()}


def tuning(compute_capability: tuple[int, int] | None = None) -> Tuning:
    return TUNING.get(tuple(compute_capability or (9, 0)), TUNING[(9, 0)])


def _stage_pair(name, value):
    """``None``, a value, or a pair ``(GEMM1's, GEMM2's)`` → a pair."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2:
        raise KernelConfigError(f"{name}: expected a value or a pair (GEMM1's, GEMM2's), got {value!r}")
    return pair


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Options of the wgmma MoE layer; ``None``: chosen per GEMM by the heuristics.

    ``schedule``: ``"pair"`` (every routed pair its own 8-row block, no alignment: decode;
    default while the pairs are no more than the experts and no ``block_m`` is given) or
    ``"blocked"`` (rows sorted into ``block_m`` expert blocks; default :func:`wgmma_block_m`).
    ``split1`` / ``split2``: each GEMM's K split (the largest divisor of its steps up to the
    value). ``block_n``: 128 (default) or 64 columns per program. ``stages``: ring depth, or a
    pair (GEMM1's, GEMM2's). ``wide``, ``sfold``, ``ws``, ``out16``, ``tout``: as in
    :class:`GemmConfig` (``sfold=False`` turns the fold off in the fold blocks). ``fuse_act``: the
    activation in GEMM1's epilogue where it applies. ``align``: the alignment method
    (:mod:`pallas_kernels.align`). ``weight_in_gemm2``: the router weights in GEMM2's epilogue.
    ``row_gather``: gather the token rows with the row-gather kernel. ``persistent``: the chained
    ``ws`` stream for a GEMM (``True``), never (``False``), or where it measured faster (``None``);
    or a pair. ``kernels``: ``"mosaic"`` (the GPU kernels) or ``"reference"`` (their plain-jnp
    references, to run the layer's XLA glue on any device).
    """

    schedule: str | None = None
    block_m: int | None = None
    split1: int | None = None
    split2: int | None = None
    block_n: int = 128
    stages: int | None | tuple = None
    wide: bool | None = None
    sfold: bool = True
    ws: bool | None = None
    out16: bool | None = None
    tout: bool | None = None
    fuse_act: bool | None = None
    align: str = "auto"
    weight_in_gemm2: bool | None = None
    row_gather: bool | None = None
    persistent: bool | None | tuple = None
    kernels: str = "mosaic"

    def __post_init__(self):
        if self.schedule not in (None, "pair", "blocked"):
            raise KernelConfigError(f"schedule: expected 'pair' or 'blocked', got {self.schedule!r}")
        if self.block_m is not None:
            _int("block_m", self.block_m)
        _int("block_n", self.block_n, 64, 128)
        for name in ("split1", "split2"):
            v = getattr(self, name)
            if v is not None and _int(name, v) < 1:
                raise KernelConfigError(f"{name}: expected >= 1, got {v}")
        for d in _stage_pair("stages", self.stages):
            if d is not None and _int("stages", d) < 1:
                raise KernelConfigError(f"stages: expected None, a ring depth >= 1 or a pair of them, got {self.stages!r}")
        for p in _stage_pair("persistent", self.persistent):
            if p not in (None, True, False):
                raise KernelConfigError(f"persistent: expected True, False, None or a pair of them, got {self.persistent!r}")
        if self.align not in ALIGN_METHODS:
            raise KernelConfigError(f"align: expected one of {ALIGN_METHODS}, got {self.align!r}")
        if self.kernels not in ("mosaic", "reference"):
            raise KernelConfigError(f"kernels: expected 'mosaic' or 'reference', got {self.kernels!r}")

    @property
    def stages_pair(self) -> tuple:
        return tuple(None if d is None else int(d) for d in _stage_pair("stages", self.stages))

    @property
    def persistent_pair(self) -> tuple:
        return tuple(None if p is None else bool(p) for p in _stage_pair("persistent", self.persistent))


# --------------------------------------------------------------------------- heuristics


BLOCK_ROW_COST = 128    # rows of wgmma work one block's weight stream and dequantization are worth
BLOCK_M_CHOICES = (8, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160)


def expected_blocks(num_pairs: int, num_experts: int, block_m: int) -> float:
    """``E · Σ_n P(n) ⌈n / block_m⌉``: the expected number of non-empty blocks when each of
    ``num_pairs`` routed pairs picks one of ``num_experts`` experts uniformly (an expert's rows
    ``n`` are binomial)."""
    e = max(num_experts, 1)
    if num_pairs <= 0:
        return 0.0
    if e == 1:
        return float(-(-num_pairs // block_m))
    p = 1.0 / e
    mean, sd = num_pairs * p, math.sqrt(num_pairs * p * (1.0 - p))
    lo, hi = max(0, int(mean - 12 * sd) - 2), min(num_pairs, int(mean + 12 * sd) + 2)
    head = math.lgamma(num_pairs + 1)
    total = 0.0
    for n in range(max(lo, 1), hi + 1):
        log_pmf = (head - math.lgamma(n + 1) - math.lgamma(num_pairs - n + 1) + n * math.log(p)
                   + (num_pairs - n) * math.log1p(-p))
        total += math.exp(log_pmf) * -(-n // block_m)
    return e * total


def wgmma_block_m(num_pairs: int, num_experts: int, tune: Tuning | None = None) -> int:
    """Rows per expert block (8 to 160) for a blocked layer of ``num_pairs`` routed pairs: the
    block that minimizes ``expected_blocks · max(BLOCK_ROW_COST, block_m)`` under uniform routing,
    a larger block only where it saves more than 3%; a 32-row pick becomes the fold blocks'
    ``fold_rows`` where those are at most 3% more.

    Every block of an expert streams and dequantizes all of that expert's weights, and its wgmma
    work grows with its rows, padding included; the two overlap, so a block costs about the larger
    of the two, and ``BLOCK_ROW_COST`` puts the dequantization at 128 rows of wgmma work (v9, v10,
    v17 in ``docs/journal/notes.md``). The cap of 160 rows keeps the float32 accumulator at 160
    registers per thread."""
    tune = tune or tuning()
    best, best_cost = BLOCK_M_CHOICES[0], None
    for bm in BLOCK_M_CHOICES:
        cost = expected_blocks(num_pairs, num_experts, bm) * max(BLOCK_ROW_COST, bm)
        if best_cost is None or cost < 0.97 * best_cost:
            best, best_cost = bm, cost
    if best == 32 and (expected_blocks(num_pairs, num_experts, tune.fold_rows)
                       <= 1.03 * expected_blocks(num_pairs, num_experts, 32)):
        return tune.fold_rows
    return best


def plan_gemm(layer: LayerConfig, *, n_blocks: int, block_m: int, n: int, k: int, has_zp: bool, group_size: int,
              sms: int, split: int | None = None, gate: str | None = None, has_row_scale: bool = False,
              row_scale_optional: bool = False, per_sm4: bool = False, whole: bool = False,
              persistent: bool | None = None, stages: int | None = None,
              tune: Tuning | None = None) -> tuple[GemmConfig, bool]:
    """The :class:`GemmConfig` of one of the layer's GEMMs — ``n_blocks`` blocks of ``block_m``
    rows, ``N = n`` output columns, ``K = k`` — and whether it applies the row scales (with
    ``row_scale_optional`` the caller takes them back where the ``ws`` stream, which applies none,
    measured faster). ``split``: the GEMM's K split asked for; ``gate``: the activation to fuse
    where it can; ``per_sm4``: the pair schedule's GEMM1 (``pair_waves`` programs per SM, each
    streaming at least 4 steps); ``whole``: no K split unless asked for (a 16-bit ``tout`` output
    leaves no float32 partials for XLA to sum: v16, Mixtral 16 tokens 216.2 µs against 227.0 at
    split 2); ``persistent`` / ``stages``: the layer's options for this GEMM.

    Defaults, as measured on the H200 (``docs/journal/notes.md``): 256-deep ``wide`` steps below
    128-row blocks; ``out16`` and ``tout`` wherever the output is unsplit (v7, v8, v16); the fold
    (``sfold``) in blocks of up to ``fold_rows``; ``ws`` from ``ws_min_rows`` rows, and from
    ``ws_long_k_rows`` where a program streams ``long_k_blocks`` or more (the fold blocks too, v25);
    medium blocks that stay off ``ws`` run as the chained ``ws`` stream where it applies (v15:
    Qwen3 512 tokens 211.4 µs against 228.3–234.0), else at two stages, two programs per SM; rings
    of 2 for decode blocks streaming long K ranges, else 4, lowered until the program fits."""
    tune = tune or tuning()
    bm = block_m
    bn = layer.block_n if n % layer.block_n == 0 else BLOCK_N
    n_kb = k // BLOCK_K
    kpb = 2 if (bm < 128 if layer.wide is None else layer.wide) and n_kb % 2 == 0 else 1
    steps = n_kb // kpb
    tiles = n_blocks * (n // bn)
    if split or whole:
        want = split or 1
    elif per_sm4:
        want = min(choose_split(tiles, n_kb, sms=sms, waves=tune.pair_waves), max(1, (n_kb // kpb) // 4))
    else:
        want = choose_split(tiles, n_kb, sms=sms, waves=tune.waves)
    s = max(d for d in range(1, min(want, steps) + 1) if steps % d == 0)   # the kernel needs a divisor
    gated = gate if s == 1 and bn == 128 else None          # the activation needs whole sums
    o16 = s == 1 and (True if layer.out16 is None else bool(layer.out16))
    tr = o16 and TRANSPOSED_STORE and (True if layer.tout is None else bool(layer.tout))
    fold = layer.sfold and bm <= tune.fold_rows
    ws_default = layer.ws is None
    long_k = n_kb // s >= tune.long_k_blocks
    want_ws = ((bm >= tune.ws_min_rows or (bm >= tune.ws_long_k_rows and long_k)
                or (fold and bm >= tune.fold_rows and long_k)) if ws_default else layer.ws)
    chunk = steps // s                    # the K steps of one program (one item of the stream)
    rs = has_row_scale

    def smem(st, tr, stream, wsp, rs):
        return wgmma_smem_bytes(block_m=bm, block_n=bn, kpb=kpb, stages=st if stream else min(st, chunk),
                                n_blocks=n_blocks, ws=wsp, tout=tr, gated=gated is not None, has_zp=has_zp,
                                channelwise=group_size == -1, row_scale=rs, stream=stream)

    def fitted(st, **kw):
        # fewer stages, down to 2, until the program fits the 227 KB of shared memory
        while st > 2 and smem(st, tr, **kw) > SMEM_LIMIT:
            st -= 1
        return st

    auto = (persistent is None and ws_default and bm > 32 and not want_ws and not fold and group_size == BLOCK_K
            and n % (2 * bn) == 0 and (not rs or row_scale_optional))
    if auto:
        d = fitted(stages or 4, stream=True, wsp=True, rs=False)
        d = max(x for x in range(1, min(d, chunk) + 1) if chunk % x == 0)
        auto = d >= 2 and smem(d, False, stream=True, wsp=True, rs=False) <= SMEM_LIMIT
    if auto:
        rs = False
    ws_ok = ((want_ws or auto) and (not fold or bool(want_ws)) and group_size == BLOCK_K and n % (2 * bn) == 0)
    stream = (auto or bool(persistent)) and ws_ok and not rs
    if auto:
        st = d
    elif stages is not None:
        st = stages
    elif ws_default and bm > 32 and not want_ws:  # two programs per SM, each filling while the other computes
        st = 2
    else:                         # 2-deep rings for decode blocks streaming long K ranges (v6)
        st = 2 if bm <= 32 and chunk >= 8 else 4
    kw = dict(stream=stream, wsp=ws_ok, rs=rs)
    st = fitted(st, **kw)
    if stream and chunk % min(st, chunk):
        st = max(x for x in range(1, st + 1) if chunk % x == 0)
        if st < 2:                        # a 1-deep ring would stall every step: no stream then
            stream = False
            kw = dict(stream=False, wsp=ws_ok, rs=rs)
            st = fitted(stages or 2, **kw)
    if tr and smem(st, tr, **kw) > SMEM_LIMIT:
        tr = False
    cfg = GemmConfig(block_m=bm, block_n=bn, kpb=kpb, split_k=s, stages=st, group_size=group_size, wide=kpb == 2,
                     sfold=fold, ws=ws_ok, stream=stream, out16=o16, tout=tr, gated=gated)
    return cfg, rs


def pair_schedule(num_pairs: int, num_experts: int, layer: LayerConfig) -> str:
    """``"pair"`` while the pairs are no more than the experts and no ``block_m`` is given."""
    return layer.schedule or ("pair" if num_pairs <= num_experts and layer.block_m is None else "blocked")


__all__ = ["BLOCK_M_CHOICES", "BLOCK_ROW_COST", "GemmConfig", "IDS_PAD", "LayerConfig", "SMEM_LIMIT", "SM_SMEM",
           "TRANSPOSED_STORE", "TUNING", "Tuning", "expected_blocks", "pair_schedule", "plan_gemm", "tuning",
           "wgmma_block_m", "wgmma_smem_bytes"]
