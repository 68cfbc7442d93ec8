"""The kernel package's errors: a call whose arrays or configuration a kernel cannot take.

Every class is a :class:`ValueError`. ``wna16_jax`` translates them at its boundary into its own
``WNA16Error`` subclasses of the same kind (:func:`wna16_jax.errors.from_kernel_error`), so a
user of the library meets one error hierarchy; a user of the kernels alone catches these.
"""

from __future__ import annotations


class KernelError(ValueError):
    """Base class: the message names the argument, the rule and the value given."""


class KernelConfigError(KernelError):
    """A configuration value, or a combination of them, that the kernel does not take."""


class KernelShapeError(KernelError):
    """An array of the wrong shape."""


class KernelDTypeError(KernelError):
    """An array of the wrong dtype."""


class KernelUnsupportedError(KernelError):
    """Well-formed input that these kernels do not cover (a layout, a bit width, a device)."""


__all__ = ["KernelConfigError", "KernelDTypeError", "KernelError", "KernelShapeError", "KernelUnsupportedError"]
