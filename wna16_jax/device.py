"""What the dispatch table and the executors need to know about a device, and the activation
dtypes they name."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Device:
    """What the dispatch table needs to know about the device a layer will run on."""

    platform: str                       # "cpu", "gpu" (NVIDIA CUDA), "rocm", "xpu", "tpu", ...
    name: str = ""
    compute_capability: tuple[int, int] | None = None   # NVIDIA only
    byteorder: str = sys.byteorder

    @property
    def is_nvidia(self) -> bool:
        return self.platform == "gpu" and self.compute_capability is not None

    def describe(self) -> str:
        cc = f" (SM{self.compute_capability[0]}{self.compute_capability[1]})" if self.compute_capability else ""
        name = self.name or "unknown"
        return f"{self.platform}{cc}" if name == self.platform else f"{self.platform}: {name}{cc}"

    @classmethod
    def current(cls, jax_device: Any = None) -> "Device":
        """Describe ``jax_device`` (default: the first JAX device)."""
        import jax

        d = jax_device if jax_device is not None else jax.devices()[0]
        platform = str(d.platform).lower()
        cc = None
        raw = getattr(d, "compute_capability", None)
        if platform in ("gpu", "cuda"):
            platform = "gpu"
            version = str(getattr(d.client, "platform_version", "")).lower()
            if "rocm" in version or "hip" in version:
                platform = "rocm"
            elif raw:
                major, _, minor = str(raw).partition(".")
                cc = (int(major), int(minor or 0))
        return cls(platform=platform, name=str(getattr(d, "device_kind", "")), compute_capability=cc)


ACT_DTYPES = (None, "float16", "bfloat16", "int8", "float8_e4m3fn")


def input_dtype_name(input_dtype: Any) -> str | None:
    if input_dtype is None:
        return None
    import numpy as np

    try:
        name = np.dtype(input_dtype).name
    except TypeError:
        name = str(input_dtype)
    if name not in ACT_DTYPES:
        raise ConfigError(f"input_dtype: expected one of float16, bfloat16, int8, float8_e4m3fn, got {name!r}")
    return None if name in ("float16", "bfloat16") else name


__all__ = ["ACT_DTYPES", "Device"]
