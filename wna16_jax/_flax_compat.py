"""Lets the released Flax import on JAX 0.11.

Flax 0.12.7 and 0.12.8 define hijax-backed variable primitives at import time from names that
``jax.experimental.hijax`` had up to JAX 0.10 (``HiPrimitive``, ``AvalQDD``, ``AvalMutableQDD``,
``MutableHiType``) and that JAX 0.11 renamed or dropped, so ``from flax import nnx`` fails
there before any model code runs. Importing this module first adds inert stand-ins for exactly
the missing names: Flax then imports, and what this library uses from it (modules, variables,
``nnx.split`` / ``nnx.merge``, ``nnx.jit``, ``nnx.grad``) works unchanged — none of it goes
through those primitives. Flax's opt-in hijax variables (``flax_hijax_variable``) stay
unavailable on such a JAX. Where JAX still has the names, nothing is changed. (Flax 0.12.1–0.12.6
fail on JAX 0.11 for another reason, ``jax.core.Effect``, which this does not address; 0.12.0 and
older need ``jax._src.core.mutable_array``.)

Every module here that imports Flax imports this one before it; import :mod:`wna16_jax` (or any
of its modules) before ``flax`` in a program of your own.
"""

from __future__ import annotations

import jax.experimental.hijax as _hijax

#: the names Flax needs at import time; those missing from this JAX get a stand-in
NAMES = ("HiPrimitive", "AvalQDD", "AvalMutableQDD", "MutableHiType")


class _StandIn:
    """An inert placeholder: Flax subclasses and instantiates it at import time, never calls it."""

    def __init__(self, *args, **kwargs):
        self.name = args[0] if args else None


ADDED = tuple(name for name in NAMES if not hasattr(_hijax, name))
for _name in ADDED:
    setattr(_hijax, _name, type(_name, (_StandIn,), {"__module__": __name__}))
