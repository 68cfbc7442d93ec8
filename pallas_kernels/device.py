"""What the kernels need to know about the GPU: its streaming multiprocessors and whether it has
Hopper's ``wgmma`` instruction. The caller describes its device (compute capability); nothing
here imports a device abstraction of its own."""

from __future__ import annotations

import jax


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H200; 1 off-GPU)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0) or 1)
    except Exception:  # noqa: BLE001 - no device information: assume one
        return 1


def wgmma_device_reason(compute_capability: tuple[int, int] | None, description: str = "this device") -> str | None:
    """Why the wgmma kernels cannot run on a device of ``compute_capability`` (``None``: not an
    NVIDIA GPU); None on an SM90 (Hopper) GPU. wgmma is an ``sm_90a`` instruction: neither older
    GPUs nor Blackwell (whose tensor cores take ``tcgen05``) have it."""
    if compute_capability is None:
        return f"the wgmma kernels need an NVIDIA Hopper (SM90) GPU, not {description}"
    if tuple(compute_capability) != (9, 0):
        return f"the wgmma kernels need an SM90 (Hopper) GPU; {description} has no wgmma"
    return None


__all__ = ["num_sms", "wgmma_device_reason"]
