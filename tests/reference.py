"""Independent float64 references for tests: written from docs/formats.md, sharing no code with the
library beyond nothing at all (pure numpy, explicit bit arithmetic)."""

from __future__ import annotations

import math

import numpy as np

AWQ_SLOT_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]  # logical column j lives in nibble slot [j]


def _nibble(word: np.ndarray, slot: np.ndarray, bits: int) -> np.ndarray:
    w = word.astype(np.int64) & 0xFFFFFFFF
    return (w >> (bits * slot)) & ((1 << bits) - 1)


def unpack_rows(q: np.ndarray, bits: int, k: int) -> np.ndarray:
    """``q [..., K/pf, N]`` packed along rows (GPTQ) → codes ``[..., K, N]``."""
    pf = 32 // bits
    rows = np.arange(k)
    return _nibble(q[..., rows // pf, :], (rows % pf)[:, None], bits)


def unpack_cols(q: np.ndarray, bits: int, n: int, awq: bool = False) -> np.ndarray:
    """``q [..., R, N/pf]`` packed along columns → ``[..., R, N]`` (AWQ order if ``awq``)."""
    pf = 32 // bits
    cols = np.arange(n)
    if awq:
        assert bits == 4
        slot = np.array([AWQ_SLOT_OF_COLUMN[c % 8] for c in cols])
    else:
        slot = cols % pf
    return _nibble(q[..., cols // pf], slot, bits)


def dequant_checkpoint(w, scheme) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` from a CheckpointWeights (docs/formats.md §1.3–§1.8)."""
    h, i = w.hidden_size, w.intermediate_size
    out = []
    for qw, sc, qz, gi, n, k in ((w.w13_qweight, w.w13_scales, w.w13_qzeros, w.w13_g_idx, 2 * i, h),
                                 (w.w2_qweight, w.w2_scales, w.w2_qzeros, w.w2_g_idx, h, i)):
        qw, sc = np.asarray(qw), np.asarray(sc).astype(np.float64)
        b, g = scheme.bits, scheme.group_size
        m = scheme.method.value
        if m == "awq":
            codes = unpack_cols(qw, b, n, awq=True)                 # [E, K, N]
            z = unpack_cols(np.asarray(qz), b, n, awq=True) if qz is not None else None  # [E, G, N]
            s = sc
        elif m == "gptq":
            codes = unpack_rows(qw, b, k)                          # [E, K, N]
            z = None
            if qz is not None:
                z = unpack_cols(np.asarray(qz), b, n)
                if scheme.gptq_checkpoint_format != "gptq_v2":
                    z = (z + 1) % (1 << b)
            s = sc
        else:
            codes = np.swapaxes(unpack_cols(qw, b, k), 1, 2)       # [E, K, N]
            s = np.swapaxes(sc, 1, 2)                              # [E, G, N]
            z = None
            if qz is not None:
                z = np.swapaxes(unpack_rows(np.asarray(qz), b, n), 1, 2)
        e = codes.shape[0]
        res = np.empty((e, n, k))
        for ei in range(e):
            for kk in range(k):
                grp = (int(np.asarray(gi)[ei, kk]) if gi is not None
                       else (0 if g == -1 else kk // g))
                zero = z[ei, grp] if z is not None else (1 << (b - 1))
                res[ei, :, kk] = (codes[ei, kk] - zero) * s[ei, grp]
        out.append(res)
    return out[0], out[1]


def act_ref(name: str, h: np.ndarray) -> np.ndarray:
    i = h.shape[-1] // 2
    silu = lambda v: v / (1.0 + np.exp(-v))  # noqa: E731
    if name == "silu":
        return silu(h[..., :i]) * h[..., i:]
    if name == "gelu":
        erf = np.vectorize(math.erf)
        g = h[..., :i]
        return 0.5 * g * (1.0 + erf(g / math.sqrt(2.0))) * h[..., i:]
    if name == "gelu_tanh":
        g = h[..., :i]
        return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * h[..., i:]
    if name == "swigluoai":
        g = np.minimum(h[..., 0::2], 7.0)
        u = np.clip(h[..., 1::2], -7.0, 7.0)
        return (u + 1.0) * g / (1.0 + np.exp(-1.702 * g))
    raise ValueError(name)


def fused_moe_ref(x, topk_weights, topk_ids, w13, w2, b13=None, b2=None, *, activation="silu",
                  on_input=False, expert_map=None) -> np.ndarray:
    """Per-token float64 loop over the chosen experts."""
    x = np.asarray(x, np.float64)
    t, k = np.asarray(topk_ids).shape
    out = np.zeros((t, w2.shape[1]))
    for ti in range(t):
        for j in range(k):
            e = int(topk_ids[ti, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            wt = float(topk_weights[ti, j])
            h = w13[e] @ x[ti]
            if b13 is not None:
                h = h + b13[e]
            if on_input:
                h = h * wt
            y = w2[e] @ act_ref(activation, h)
            if b2 is not None:
                y = y + b2[e]
            out[ti] += y if on_input else wt * y
    return out
