"""What one launch costs inside a jitted program, per kind of kernel — the fixed cost under a
1-token MoE layer (docs/journal/notes.md v9: the one-kernel Qwen3 decode layer is 24 µs device-busy but takes
47–69 µs per layer; Mosaic GPU encodes its TMA descriptors on the host at every launch).

Each variant is a chain of dependent tiny calls on an ``[8, 256]`` bf16 array, timed as one
jitted program of ``2·--reps`` calls less the same of ``--reps`` (:mod:`benchmarks.timing`;
before v11 one program / reps, which spread the program's fixed 0.08–0.45 ms over the calls) —
a ``fori_loop`` and straight-line code, as ``moe_engine.py`` times layers — median of 5, µs per
call:

* ``xla``: one XLA fusion (``x * a + b``);
* ``mgpu regs``: a Mosaic GPU kernel that reads and writes global memory from registers (no
  TMA descriptor); ``mgpu regs 128 KB smem``: the same with 128 KB of shared memory;
* ``mgpu tma 1`` / ``mgpu tma 8``: Mosaic GPU kernels that copy through shared memory with TMA,
  one input (2 descriptors: load and store) / eight inputs (9 descriptors);
* ``triton``: a Pallas kernel on the Triton lowering (pointer loads, no descriptors).

Run on the GPU machine: ``PYTHONPATH=$PWD python3 benchmarks/launch_overhead.py``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

ROWS, COLS = 8, 256


def xla_step(x, ys):
    return x * jnp.asarray(0.999, x.dtype) + ys[0]


def mgpu_regs():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(x_gmem, y_gmem, o_gmem):
        o_gmem[...] = x_gmem[...] * jnp.asarray(0.999, x_gmem.dtype) + y_gmem[...]

    def step(x, ys):
        return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                            grid_names=("g",))(x, ys[0])
    return step


def mgpu_regs_smem():
    """As ``mgpu_regs``, plus 128 KB of (barely used) shared memory: a launch that must raise the
    kernel's dynamic shared-memory limit, as the GEMM kernels do."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(x_gmem, y_gmem, o_gmem):
        def body(scratch):
            scratch[pl.ds(0, ROWS)] = x_gmem[...] * jnp.asarray(0.999, x_gmem.dtype)
            plgpu.commit_smem()
            o_gmem[...] = scratch[pl.ds(0, ROWS)] + y_gmem[...]
        pl.run_scoped(body, plgpu.SMEM((256, COLS), jnp.bfloat16))

    def step(x, ys):
        return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                            grid_names=("g",))(x, ys[0])
    return step


def mgpu_tma(n_in):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(x_gmem, *refs):
        *ins, o_gmem = refs

        def body(x_smem, in_smem, o_smem, bar):
            plgpu.copy_gmem_to_smem(x_gmem, x_smem, bar.at[0])
            for i, r in enumerate(ins):
                plgpu.copy_gmem_to_smem(r, in_smem.at[i], bar.at[1 + i])
            for i in range(1 + n_in):
                plgpu.barrier_wait(bar.at[i])
            acc = x_smem[...] * jnp.asarray(0.999, x_smem.dtype)
            for i in range(n_in):
                acc = acc + in_smem[i]
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(body, plgpu.SMEM((ROWS, 256), jnp.bfloat16), plgpu.SMEM((n_in, ROWS, 256), jnp.bfloat16),
                      plgpu.SMEM((ROWS, 256), jnp.bfloat16), plgpu.Barrier(num_arrivals=1, num_barriers=1 + n_in))

    def step(x, ys):
        return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                            grid_names=("g",))(x, *ys[:n_in])
    return step


def triton():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * jnp.asarray(0.999, x_ref.dtype) + y_ref[...]

    def step(x, ys):
        spec = pl.BlockSpec((ROWS, COLS), lambda j: (0, 0))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                              in_specs=[spec, spec], out_specs=spec,
                              compiler_params=pltriton.CompilerParams(num_warps=4))(x, ys[0])
    return step


VARIANTS = {"xla": lambda: xla_step, "mgpu regs": mgpu_regs, "mgpu regs 128 KB smem": mgpu_regs_smem,
            "mgpu tma 1": lambda: mgpu_tma(1),
            "mgpu tma 8": lambda: mgpu_tma(8), "triton": triton}


def time_chain(step, reps, timing):
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (ROWS, COLS), jnp.bfloat16)
    ys = [jax.random.normal(jax.random.fold_in(key, i), (ROWS, COLS), jnp.bfloat16) * 1e-3 for i in range(8)]

    from benchmarks.timing import differential_us

    def build(n):
        @jax.jit
        def run(x, ys):
            if timing == "loop":
                return jax.lax.fori_loop(0, n, lambda _, c: step(c, ys), x)
            for _ in range(n):
                x = step(x, ys)
            return x
        return run

    out = build(reps)(x, ys).block_until_ready()
    if not bool(jnp.isfinite(out.astype(jnp.float32)).all()):
        raise RuntimeError("non-finite result")
    return differential_us(build, (x, ys), reps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--only", nargs="*", default=None, help=f"variants (default: all of {list(VARIANTS)})")
    args = ap.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; µs per call, {args.reps} chained calls")
    print("| variant | loop µs | unrolled µs |")
    print("|---|---|---|")
    for name in args.only or VARIANTS:
        row = []
        for timing in ("loop", "unrolled"):
            try:
                row.append(f"{time_chain(VARIANTS[name](), args.reps, timing):.1f}")
            except Exception as err:  # noqa: BLE001 - a variant that does not build: say so, go on
                row.append(f"FAILED {type(err).__name__}: {str(err).splitlines()[0][:80]}")
        print(f"| {name} | {row[0]} | {row[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
