"""Grouped int4/int8 GEMMs over experts with in-register dequantization (Pallas, Triton lowering).

The kernels of the GPU engine (``docs/journal/notes.md`` has each version's numbers):

* :func:`grouped_gemm` — rows sorted by expert in blocks of ``block_m``
  (``routing.moe_align_block_size``; ``expert_ids[b]`` names block ``b``'s expert, ``-1`` an
  unused block, written as zeros). ``split_k`` programs share one output tile (partials
  ``[split_k, M, N]``, summed by the caller — deterministic, and every element is written, so
  poisoned-output tests see a missed tile). Epilogue: bias (split 0 only), per-row scale
  (router weights), or — ``gated`` — the gate/up activation, written in the activation dtype.
* :func:`pair_gemm` — decode: one program row per routed (token, slot) pair, no alignment, no
  gathered copy of the activations (row ``p`` reads ``a[p // top_k]``); split-K for
  parallelism when a handful of pairs must keep every SM busy.
* :func:`grouped_gemm_t` — the transposed access, ``out = g @ W`` (the input gradient of a
  frozen quantized layer): K tiles are the output, N is reduced.

Weights are in a kernel-native tile layout (:func:`pack_tiles`): ``[E, K / pf, N]`` int32 where,
inside each K-block of ``bk = 16 · pf`` rows, slot ``s`` of word ``w`` holds row ``16 · s + w``.
Unpacking slot ``s`` of a ``[16, BN]`` word tile yields 16 contiguous K rows: one 16-deep MMA
step. Scales ``[E, G, N]``, zero points ``[E, G, N]`` uint8 (or the implicit ``2**(bits-1)``).

Dequantization modes (``dequant=``):

* ``"asm"`` (GPU, 4-bit, 16-bit activations, one group per K-block): PTX through
  ``elementwise_inline_asm``, two words per call: ``prmt`` pairs their halves, one ``lop3``
  ORs a slot's two nibbles into the mantissa of ``128.0`` (bf16) / ``1024.0`` (fp16), and two
  packed ``fma`` give ``(code - zero) · scale`` rounded once — the same value as the reference's
  float32 dequantization cast to the activation dtype, at 2.5 instructions per weight and no
  integer→float conversions.
* ``"magic"`` (portable, any bits/group): ``code | 0x4B000000`` read as float32 is
  ``2**23 + code``; subtract ``2**23 + zero``, multiply by the scale, cast.

:func:`grouped_gemm_reference` is the plain-jnp twin the tests compare against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import device
from .activations import FUSED_ACTIVATIONS, act_pair
from .errors import KernelConfigError, KernelShapeError, KernelUnsupportedError

ROWS_PER_SLOT = 16  # one MMA k-step for 16-bit operands
DEQUANT_MODES = ("asm", "magic")
_F32_MAGIC = 0x4B000000            # float32 bits of 2**23
_F32_MAGIC_VALUE = float(1 << 23)


def tile_bk(bits: int) -> int:
    """K rows per weight tile: 16 rows per slot × (32 / bits) slots."""
    return ROWS_PER_SLOT * (32 // bits)


def pack_tiles(codes, bits: int):
    """``codes [E, N, K]`` (unsigned) → kernel tile layout ``[E, K / pf, N]`` int32."""
    pf = 32 // bits
    bk = tile_bk(bits)
    e, n, k = codes.shape
    if k % bk:
        raise KernelShapeError(f"codes: K={k} is not a multiple of the tile depth {bk}")
    c = jnp.swapaxes(codes, 1, 2).astype(jnp.uint32)               # [E, K, N]
    c = c.reshape(e, k // bk, pf, ROWS_PER_SLOT, n)                 # [E, kb, slot, w, N]
    shifts = (jnp.arange(pf, dtype=jnp.uint32) * bits)[None, None, :, None, None]
    words = jnp.sum(c << shifts, axis=2, dtype=jnp.uint32)          # [E, kb, w, N]
    return jax.lax.bitcast_convert_type(words.reshape(e, k // pf, n), jnp.int32)


def unpack_tiles(words, bits: int):
    """Inverse of :func:`pack_tiles`: ``[E, K / pf, N]`` → ``codes [E, N, K]`` int32."""
    pf = 32 // bits
    e, kw, n = words.shape
    u = jax.lax.bitcast_convert_type(words, jnp.uint32).reshape(e, kw // ROWS_PER_SLOT, 1, ROWS_PER_SLOT, n)
    shifts = (jnp.arange(pf, dtype=jnp.uint32) * bits)[None, None, :, None, None]
    c = (u >> shifts) & jnp.uint32((1 << bits) - 1)                 # [E, kb, slot, w, N]
    return jnp.swapaxes(c.reshape(e, kw * pf, n), 1, 2).astype(jnp.int32)


def one_group_per_block(bits: int, group_size: int) -> bool:
    """Every K-block of the tile layout lies in one scale group (channelwise, or group % bk == 0)."""
    return group_size <= 0 or group_size % tile_bk(bits) == 0


def asm_supported(bits: int, group_size: int, dtype) -> str | None:
    """``None`` if the inline-PTX dequantization applies, else why not."""
    if bits != 4:
        return "the PTX dequantization is 4-bit only (8-bit codes overflow a bf16 magic number)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"activations are {jnp.dtype(dtype).name}, the PTX dequantization emits bf16/fp16"
    if not one_group_per_block(bits, group_size):
        return f"group size {group_size} is smaller than the {tile_bk(bits)}-row tile"
    return None


# ----------------------------------------------------------------------------- dequantization


def _asm_text(dtype, slot: int) -> str:
    """PTX for one slot of two words: ``$1, $2`` words, ``$3`` −(magic + zero) pair, ``$4`` scale
    pair, ``$5`` one pair, ``$6`` −0 pair → ``$0`` the slot's two dequantized values."""
    magic = "0x43004300" if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else "0x64006400"
    fma = "fma.rn.bf16x2" if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else "fma.rn.f16x2"
    sel, sh = ("0x5410", 4 * slot) if slot < 4 else ("0x7632", 4 * (slot - 4))
    lines = ["{", ".reg .b32 t;", f"prmt.b32 t, $1, $2, {sel};"]
    if sh:
        lines.append(f"shr.u32 t, t, {sh};")
    lines += [f"lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;",     # (t & 0xF000F) | magic: magic + code
              f"{fma} t, t, $5, $3;",                           # code - zero: exact
              f"{fma} $0, t, $4, $6;",                          # · scale, rounded once
              "}"]
    return "\n".join(lines)


def _dequant_asm(words, zero, scale, dtype):
    """4-bit ``words [R, C]`` → 8 tiles ``[R, C]`` of ``(code_s - zero) · scale`` in ``dtype``.

    ``zero`` float32 / ``scale``: ``[C]`` (one group for the whole tile). One single-result asm
    per slot (the Pallas lowering of ``elementwise_inline_asm`` takes one result per call)."""
    from jax.experimental.pallas import triton as pltriton

    dtype = jnp.dtype(dtype)
    magic = 128.0 if dtype == jnp.dtype(jnp.bfloat16) else 1024.0
    zc = jnp.broadcast_to((-(zero + magic)).astype(dtype)[None, :], words.shape)
    sc = jnp.broadcast_to(scale.astype(dtype)[None, :], words.shape)
    one = jnp.full(words.shape, 1.0, dtype)
    nz = jnp.full(words.shape, -0.0, dtype)
    return [pltriton.elementwise_inline_asm(
        _asm_text(dtype, s), args=[words, zc, sc, one, nz], constraints="=r,r,r,r,r,r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, dtype)])[0] for s in range(8)]


def _codes(words, slot, bits):
    mask = (1 << bits) - 1
    shifted = words if slot == 0 else jax.lax.shift_right_logical(words, jnp.int32(bits * slot))
    return shifted & mask if bits * (slot + 1) < 32 else shifted


def _dequant_slot(words, slot, zero, scale, *, bits, dtype, mode):
    """One slot of ``words [R, C]`` → ``[R, C]`` ``dtype``; ``zero`` float32 ``[C]``, ``scale`` ``[C]``."""
    codes = _codes(words, slot, bits)
    m = jax.lax.bitcast_convert_type(codes | _F32_MAGIC, jnp.float32)       # 2**23 + code
    v = m - (zero + _F32_MAGIC_VALUE)[None, :]
    return (v * scale.astype(jnp.float32)[None, :]).astype(dtype)


def _block_tiles(w_ref, s_ref, z_ref, e, kb, cols, *, bits, group, has_zp, dtype, mode):
    """The ``pf`` dequantized ``[16, BN]`` tiles of K-block ``kb`` of expert ``e``, columns ``cols``."""
    pf = 32 // bits
    bk = tile_bk(bits)
    words = w_ref[e, pl.ds(kb * ROWS_PER_SLOT, ROWS_PER_SLOT), cols]              # [16, BN] int32

    def zero_scale(k0):
        g = 0 if group <= 0 else k0 // group
        scale = s_ref[e, g, cols]
        zero = z_ref[e, g, cols].astype(jnp.float32) if has_zp else jnp.full(scale.shape, 1 << (bits - 1),
                                                                              jnp.float32)
        return zero, scale

    if one_group_per_block(bits, group):
        zero, scale = zero_scale(kb * bk)
        if mode == "asm":
            return _dequant_asm(words, zero, scale, dtype)
        return [_dequant_slot(words, s, zero, scale, bits=bits, dtype=dtype, mode=mode) for s in range(pf)]
    tiles = []
    for s in range(pf):
        zero, scale = zero_scale(kb * bk + s * ROWS_PER_SLOT)
        tiles.append(_dequant_slot(words, s, zero, scale, bits=bits, dtype=dtype, mode=mode))
    return tiles


# ----------------------------------------------------------------------------- epilogues


# act_pair and FUSED_ACTIVATIONS: pallas_kernels.activations


# ----------------------------------------------------------------------------- kernels


def _split_range(s, chunk, n_kb):
    kb0 = s * chunk
    return kb0, jnp.minimum(kb0 + chunk, n_kb)


def _gemm_kernel(eid_ref, a_ref, w_ref, s_ref, z_ref, rs_ref, b_ref, o_ref, *, bits, group, n_kb, chunk,
                 has_zp, has_rs, has_bias, mode, gated, act, n_half, pair_top_k, dot):
    bk = tile_bk(bits)
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = eid_ref[i]
    bn = o_ref.shape[-1]
    bm = ROWS_PER_SLOT if pair_top_k else o_ref.shape[0]
    dtype = a_ref.dtype
    kw = dict(bits=bits, group=group, has_zp=has_zp, dtype=dtype, mode=mode)
    col_sets = [pl.ds(j * bn, bn)] + ([pl.ds(n_half + j * bn, bn)] if gated else [])

    def a_tile(k0):
        if pair_top_k:                              # one row, broadcast to a 16-row MMA operand
            row = a_ref[i // pair_top_k, pl.ds(k0, ROWS_PER_SLOT)]
            return jnp.broadcast_to(row[None, :], (ROWS_PER_SLOT, ROWS_PER_SLOT))
        return a_ref[:, pl.ds(k0, ROWS_PER_SLOT)]

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    def step(acc, k0, w):
        if dot == "fma":                            # pair rows only: acc[16, BN] += a[k0:k0+16]ᵀ · w
            row = a_ref[i // pair_top_k, pl.ds(k0, ROWS_PER_SLOT)].astype(jnp.float32)
            return acc + row[:, None] * w.astype(jnp.float32)
        if dot == "swap":                           # accᵀ[BN, BM] += wᵀ · aᵀ (weights as the A operand)
            return acc + jnp.dot(w.T, a_tile(k0).T, preferred_element_type=jnp.float32)
        return acc + jnp.dot(a_tile(k0), w, preferred_element_type=jnp.float32)   # one 16-deep MMA

    @pl.when(e >= 0)
    def _():
        def body(kb, accs):
            out = []
            for cols, acc in zip(col_sets, accs):
                for slot, w in enumerate(_block_tiles(w_ref, s_ref, z_ref, e, kb, cols, **kw)):
                    acc = step(acc, kb * bk + slot * ROWS_PER_SLOT, w)
                out.append(acc)
            return tuple(out)

        kb0, kb1 = _split_range(s, chunk, n_kb)
        shape = (bn, bm) if dot == "swap" else (bm, bn)
        init = tuple(jnp.zeros(shape, jnp.float32) for _ in col_sets)
        accs = list(jax.lax.fori_loop(kb0, kb1, body, init))
        if dot == "swap":
            accs = [acc.T for acc in accs]
        if pair_top_k and dot == "fma":              # the 16 partial sums of each column
            accs = [jnp.sum(acc, axis=0) for acc in accs]
        elif pair_top_k:                             # keep MMA row 0 (the others repeat it)
            keep = jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) == 0
            accs = [jnp.sum(jnp.where(keep, acc, 0.0), axis=0) for acc in accs]
        if has_bias:
            first = (s == 0).astype(jnp.float32)
            accs = [acc + first * b_ref[e, cols].astype(jnp.float32) for acc, cols in zip(accs, col_sets)]
        if has_rs:
            r = rs_ref[i] if pair_top_k else rs_ref[...][:, None]
            accs = [acc * r for acc in accs]
        res = act_pair(act, accs[0], accs[1]) if gated else accs[0]
        o_ref[...] = res.astype(o_ref.dtype)


def _dummy(dtype=jnp.float32):
    return jnp.zeros((1, 1, 1), dtype)


def _compiler(interpret, num_warps, num_stages):
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def valid_split(split: int, n_kb: int) -> int:
    """The largest split-K ≤ ``split`` whose K chunks (of ``ceil(n_kb / split)`` blocks) are all
    non-empty."""
    split = max(1, min(int(split), n_kb))
    chunk = -(-n_kb // split)
    return -(-n_kb // chunk)


def choose_split(programs: int, n_kb: int, *, sms: int | None = None, waves: int = 4) -> int:
    """Split-K factor that gives about ``waves`` programs per SM (at most one K-block each)."""
    sms = sms or device.num_sms()
    return valid_split(-(-waves * sms // max(programs, 1)), n_kb)


def _chunk(n_kb: int, split_k: int, name: str) -> int:
    """K-blocks per split; ``split_k`` must leave no split empty (see :func:`valid_split`)."""
    if valid_split(split_k, n_kb) != split_k:
        raise KernelConfigError(f"{name}: split_k={split_k} does not divide {n_kb} K-blocks into non-empty chunks")
    return -(-n_kb // split_k)


def _launch(kernel, args, in_specs, *, grid, out_shape, out_spec, out, interpret, num_warps, num_stages):
    """``pallas_call`` with the Triton compiler parameters; with ``out`` (a buffer of the result's
    shape and dtype, e.g. NaN-poisoned by a test) the kernel writes into it in place."""
    kwargs = _compiler(interpret, num_warps, num_stages)
    if out is not None:
        if out.shape != out_shape.shape or out.dtype != out_shape.dtype:
            raise KernelShapeError(f"out: expected {out_shape.dtype} {out_shape.shape}, got {out.dtype} {out.shape}")
        base, n_in = kernel, len(args)

        def kernel(*refs):                  # the aliased input ref is skipped: write the output ref
            base(*refs[:n_in], refs[n_in + 1])

        in_specs = [*in_specs, out_spec]
        args = [*args, out]
        kwargs["input_output_aliases"] = {n_in: 0}
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_spec,
                          interpret=interpret, **kwargs)(*args)


def _full(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _call(kernel, *, grid, a, a_spec, ids, words, scales, zeros, rs, rs_spec, bias, **launch):
    args = [ids.astype(jnp.int32), a, words, scales, zeros, rs, bias]
    in_specs = [_full(args[0]), a_spec, _full(words), _full(scales), _full(zeros), rs_spec, _full(bias)]
    return _launch(kernel, args, in_specs, grid=grid, **launch)


def _check(a, words, bits, k_axis_len, n, block_n, name):
    bk = tile_bk(bits)
    e, kw, nw = words.shape
    if kw * (32 // bits) != k_axis_len or k_axis_len % bk or nw != n or n % block_n:
        raise KernelShapeError(f"{name}: inconsistent shapes a={a.shape}, words={words.shape} "
                         f"(bits={bits}, tile depth {bk}), block_n={block_n}")


def _resolve_mode(dequant, bits, group_size, dtype, interpret):
    if dequant == "auto":
        return "magic" if interpret or asm_supported(bits, group_size, dtype) else "asm"
    if dequant not in DEQUANT_MODES:
        raise KernelConfigError(f"dequant: expected 'auto' or one of {DEQUANT_MODES}, got {dequant!r}")
    if dequant == "asm":
        reason = asm_supported(bits, group_size, dtype) or ("inline PTX cannot run in interpret mode"
                                                          if interpret else None)
        if reason:
            raise KernelUnsupportedError(f"dequant='asm': {reason}")
    return dequant


def _kernel(a, k, n, zeros, row_scale, bias, *, bits, group_size, split_k, dequant, interpret, gated, act,
            pair_top_k, dot, name):
    """:func:`_gemm_kernel` with its static configuration (dequantization mode, split-K chunk)."""
    mode = _resolve_mode(dequant, bits, group_size, a.dtype, interpret)
    n_kb = k // tile_bk(bits)
    return functools.partial(
        _gemm_kernel, bits=bits, group=group_size, n_kb=n_kb, chunk=_chunk(n_kb, split_k, name),
        has_zp=zeros is not None, has_rs=row_scale is not None, has_bias=bias is not None, mode=mode, gated=gated,
        act=act, n_half=n // 2, pair_top_k=pair_top_k, dot=dot)


_STATIC = ("bits", "group_size", "block_m", "block_n", "split_k", "interpret", "num_warps", "num_stages",
           "dequant", "activation", "out_dtype", "dot")
DOTS = ("mma", "fma", "swap")


def _check_dot(dot, pair, name):
    if dot not in DOTS or (dot == "fma" and not pair):
        raise KernelConfigError(f"{name}: dot must be one of {DOTS if pair else ('mma', 'swap')}, got {dot!r}")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_gemm(a, expert_ids, words, scales, zeros=None, row_scale=None, bias=None, out=None, *,
                 bits: int, group_size: int, block_m: int, block_n: int = 64, split_k: int = 1,
                 activation: str | None = None, out_dtype=None, dequant: str = "auto",
                 interpret: bool = False, num_warps: int = 4, num_stages: int = 3, dot: str = "mma"):
    """Block-sorted grouped GEMM: ``out[r] = a[r] @ W[expert_ids[r // block_m]]ᵀ`` (float32).

    ``a [M, K]`` (rows gathered and sorted, ``M = len(expert_ids) · block_m``),
    ``words [E, K / pf, N]`` (:func:`pack_tiles`), ``scales [E, G, N]``, ``zeros [E, G, N]`` uint8
    or None, ``row_scale [M]`` float32 or None (multiplies each row), ``bias [E, N]`` or None.

    Returns partials ``[split_k, M, N]`` float32 (sum them), or with ``activation`` (``"silu"``,
    ``"gelu_tanh"``; ``split_k`` must be 1) ``act(h[:, :N/2]) · h[:, N/2:]`` ``[M, N / 2]`` in
    ``out_dtype`` (default ``a.dtype``). ``out``, if given, is the buffer the kernel writes into
    (aliased): tests pass a NaN-poisoned one to prove every element is written. ``dot``: ``"mma"``
    (activation rows × weight tile) or ``"swap"`` (weight tileᵀ × activation rowsᵀ: the weights
    are the MMA's A operand, as in Marlin's small-M schedule).
    """
    _check_dot(dot, False, "grouped_gemm")
    m, k = a.shape
    e, kw, n = words.shape
    nb = expert_ids.shape[0]
    gated = activation is not None
    n_out = n // 2 if gated else n
    _check(a, words, bits, k, n, block_n, "grouped_gemm")
    if m != nb * block_m or n_out % block_n:
        raise KernelShapeError(f"grouped_gemm: a={a.shape} is not {nb} blocks of {block_m} rows, or "
                         f"{n_out} columns are not a multiple of block_n={block_n}")
    if gated and split_k != 1:
        raise KernelConfigError("grouped_gemm: the gated epilogue needs split_k=1")
    if gated and activation not in FUSED_ACTIVATIONS:
        raise KernelConfigError(f"grouped_gemm: activation {activation!r} is not fused (have {FUSED_ACTIVATIONS})")
    kernel = _kernel(a, k, n, zeros, row_scale, bias, bits=bits, group_size=group_size, split_k=split_k,
                     dequant=dequant, interpret=interpret, gated=gated, act=activation, pair_top_k=0, dot=dot,
                     name="grouped_gemm")
    rs = jnp.zeros((m,), jnp.float32) if row_scale is None else row_scale.astype(jnp.float32)
    if gated:
        odt = jnp.dtype(out_dtype or a.dtype)
        out_shape = jax.ShapeDtypeStruct((m, n_out), odt)
        out_spec = pl.BlockSpec((block_m, block_n), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j))
    return _call(kernel, grid=(nb, n_out // block_n, split_k), a=a,
                 a_spec=pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)), ids=expert_ids, words=words,
                 scales=scales, zeros=_dummy(jnp.uint8) if zeros is None else zeros, rs=rs,
                 rs_spec=pl.BlockSpec((block_m,), lambda i, j, s: (i,)),
                 bias=_dummy() if bias is None else bias, out_shape=out_shape, out_spec=out_spec, out=out,
                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=_STATIC + ("top_k",))
def pair_gemm(a, pair_experts, words, scales, zeros=None, row_scale=None, bias=None, out=None, *, top_k: int,
              bits: int, group_size: int, block_n: int = 128, split_k: int = 1, dequant: str = "auto",
              interpret: bool = False, num_warps: int = 4, num_stages: int = 3, block_m: int = 0,
              activation: str | None = None, out_dtype=None, dot: str = "mma"):
    """Decode GEMM, one routed pair per program row: ``out[s, p] = a[p // top_k] @ W[pair_experts[p]]ᵀ``
    over split ``s``'s share of K (float32 partials ``[split_k, P, N]``; sum them).

    ``pair_experts [P]`` local expert per pair (``-1``: zeros), ``row_scale [P]`` multiplies each
    pair's row, ``bias [E, N]`` is added once (in split 0). ``block_m``/``activation``/``out_dtype``
    are accepted for a uniform signature and must be left at their defaults. ``dot``: ``"mma"``
    (the pair's row broadcast to a 16-row MMA operand), ``"swap"`` (weights as the A operand) or
    ``"fma"`` (no MMA: float32 multiply-adds into a ``[16, BN]`` accumulator, summed at the end).
    """
    _check_dot(dot, True, "pair_gemm")
    if block_m or activation is not None or out_dtype is not None:
        raise KernelConfigError("pair_gemm: block_m, activation and out_dtype are not used")
    t, k = a.shape
    e, kw, n = words.shape
    p = pair_experts.shape[0]
    _check(a, words, bits, k, n, block_n, "pair_gemm")
    if p != t * top_k:
        raise KernelShapeError(f"pair_gemm: {p} pairs for {t} rows × top_k={top_k}")
    kernel = _kernel(a, k, n, zeros, row_scale, bias, bits=bits, group_size=group_size, split_k=split_k,
                     dequant=dequant, interpret=interpret, gated=False, act=None, pair_top_k=top_k, dot=dot,
                     name="pair_gemm")
    rs = jnp.zeros((p,), jnp.float32) if row_scale is None else row_scale.astype(jnp.float32)
    return _call(kernel, grid=(p, n // block_n, split_k), a=a, a_spec=_full(a), ids=pair_experts,
                 words=words, scales=scales, zeros=_dummy(jnp.uint8) if zeros is None else zeros, rs=rs,
                 rs_spec=_full(rs), bias=_dummy() if bias is None else bias,
                 out_shape=jax.ShapeDtypeStruct((split_k, p, n), jnp.float32),
                 out_spec=pl.BlockSpec((None, None, block_n), lambda i, j, s: (s, i, j)), out=out,
                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- transposed access


def _gemm_t_kernel(eid_ref, g_ref, w_ref, s_ref, z_ref, o_ref, *, bits, group, n, block_n, has_zp, mode):
    i, kb = pl.program_id(0), pl.program_id(1)
    e = eid_ref[i]
    pf = 32 // bits
    bm = o_ref.shape[0]
    dtype = g_ref.dtype

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(e >= 0)
    def _():
        def body(nb, accs):
            cols = pl.ds(nb * block_n, block_n)
            tiles = _block_tiles(w_ref, s_ref, z_ref, e, kb, cols, bits=bits, group=group, has_zp=has_zp,
                                 dtype=dtype, mode=mode)
            g = g_ref[:, cols]                                                   # [BM, BN]
            return tuple(acc + jax.lax.dot_general(g, w, (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32)
                         for acc, w in zip(accs, tiles))

        init = tuple(jnp.zeros((bm, ROWS_PER_SLOT), jnp.float32) for _ in range(pf))
        accs = jax.lax.fori_loop(0, n // block_n, body, init)
        for slot, acc in enumerate(accs):
            o_ref[:, pl.ds(slot * ROWS_PER_SLOT, ROWS_PER_SLOT)] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_m", "block_n", "interpret",
                                             "num_warps", "num_stages", "dequant"))
def grouped_gemm_t(g, expert_ids, words, scales, zeros=None, out=None, *, bits: int, group_size: int,
                   block_m: int, block_n: int = 64, dequant: str = "auto", interpret: bool = False,
                   num_warps: int = 4, num_stages: int = 3):
    """Transposed access: ``out[r] = g[r] @ W[expert_ids[r // block_m]]`` (float32 ``[M, K]``).

    ``g [M, N]`` (e.g. the output cotangent of the layer ``a @ Wᵀ``); one program per (row
    block, K-block of the tile layout), looping over N. The weights stay packed: each K-block is
    dequantized in registers, as in the forward kernels.
    """
    m, n = g.shape
    e, kw, nw = words.shape
    bk = tile_bk(bits)
    k = kw * (32 // bits)
    nb = expert_ids.shape[0]
    if nw != n or m != nb * block_m or n % block_n:
        raise KernelShapeError(f"grouped_gemm_t: inconsistent shapes g={g.shape}, words={words.shape}, "
                         f"blocks={nb}x{block_m}, block_n={block_n}")
    mode = _resolve_mode(dequant, bits, group_size, g.dtype, interpret)
    kernel = functools.partial(_gemm_t_kernel, bits=bits, group=group_size, n=n, block_n=block_n,
                               has_zp=zeros is not None, mode=mode)
    zeros = _dummy(jnp.uint8) if zeros is None else zeros
    args = [expert_ids.astype(jnp.int32), g, words, scales, zeros]
    in_specs = [_full(args[0]), pl.BlockSpec((block_m, n), lambda i, j: (i, 0)), _full(words), _full(scales),
                _full(zeros)]
    return _launch(kernel, args, in_specs, grid=(nb, k // bk), out_shape=jax.ShapeDtypeStruct((m, k), jnp.float32),
                   out_spec=pl.BlockSpec((block_m, bk), lambda i, j: (i, j)), out=out, interpret=interpret,
                   num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- references


def dequantize_tiles(words, scales, zeros, *, bits: int, group_size: int, dtype):
    """``[E, K, N]`` weights in ``dtype``: ``(code - zero) · scale`` in float32, then cast."""
    codes = unpack_tiles(words, bits)                                   # [E, N, K]
    k = codes.shape[-1]
    gi = jnp.zeros((k,), jnp.int32) if group_size <= 0 else jnp.arange(k) // group_size
    s = jnp.take(scales, gi, axis=1)                                    # [E, K, N]
    z = (1 << (bits - 1)) if zeros is None else jnp.take(zeros, gi, axis=1).astype(jnp.int32)
    w = (jnp.swapaxes(codes, 1, 2) - z).astype(jnp.float32) * s.astype(jnp.float32)
    return w.astype(dtype)


def grouped_gemm_reference(a, expert_ids, words, scales, zeros=None, *, bits: int, group_size: int,
                           block_m: int):
    """Plain-jnp twin of :func:`grouped_gemm` without epilogue (float32 ``[M, N]``, HIGHEST precision)."""
    w = dequantize_tiles(words, scales, zeros, bits=bits, group_size=group_size, dtype=a.dtype)
    eb = jnp.repeat(jnp.maximum(expert_ids, 0), block_m)
    out = jnp.einsum("mk,mkn->mn", a.astype(jnp.float32), w.astype(jnp.float32)[eb],
                     precision=jax.lax.Precision.HIGHEST)
    return jnp.where(jnp.repeat(expert_ids >= 0, block_m)[:, None], out, 0.0)


__all__ = ["DEQUANT_MODES", "asm_supported", "choose_split", "dequantize_tiles", "valid_split",
           "grouped_gemm", "grouped_gemm_reference", "grouped_gemm_t", "one_group_per_block",
           "pack_tiles", "pair_gemm", "tile_bk", "unpack_tiles"]
