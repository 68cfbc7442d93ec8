"""The arrays of one GEMM's experts as the kernels take them (a pytree of arrays, nothing else)."""

from __future__ import annotations

from typing import Any, NamedTuple


class GemmExperts(NamedTuple):
    """One GEMM's experts in a kernel layout, the expert axis first on every array.

    ``words``: packed codes (the Triton-lowered kernels' tiles ``[E, K/pf, N]`` int32, or the wgmma
    kernels' 16-bit words ``[E, N, K/4]``); ``scales [E, G, N]``; ``zeros [E, G, N]`` or None (the
    implicit ``2**(bits-1)``); ``bias [E, N]`` or None; ``perm [E, K]`` int32 or None: act-order
    row order (row ``j`` of the packed codes is input row ``perm[e, j]``)."""

    words: Any
    scales: Any
    zeros: Any = None
    bias: Any = None
    perm: Any = None

    @property
    def num_experts(self) -> int:
        return int(self.words.shape[0])


__all__ = ["GemmExperts"]
