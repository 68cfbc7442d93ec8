"""The README's API tour runs as written, on CPU, for the README's own quantization config and
for every format the demo writes (the tour's QUANT_CONFIG line swapped, nothing else)."""

import json
import os
import re
import warnings

import numpy as np
import pytest

from wna16_jax.cli import DEMO_CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tour() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## API tour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the API tour holds one python block"
    return blocks[0]


def _run(code: str) -> dict:
    ns: dict = {"__name__": "readme_tour"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # the LOADER fallback warns by design
        exec(compile(code, "README.md", "exec"), ns)
    return ns


def _check(ns):
    import jax.numpy as jnp

    y = np.asarray(ns["y"].astype(jnp.float32), np.float64)
    assert y.shape == (4, ns["ckpt"].model_config.hidden_size) and np.isfinite(y).all()
    assert np.abs(y).max() > 0
    m = np.asarray(ns["moe"](ns["x"]).astype(jnp.float32), np.float64)
    # the NNX layer and fused_moe run the same layer; both round to bf16 at the end
    assert np.abs(m - y).max() <= 2e-2 * np.abs(y).max()


def test_readme_tour_runs_verbatim():
    _check(_run(_tour()))


@pytest.mark.parametrize("case", DEMO_CASES, ids=lambda c: c.name)
def test_readme_tour_on_every_format(case):
    code = _tour()
    line = next(ln for ln in code.splitlines() if ln.startswith("QUANT_CONFIG = "))
    _check(_run(code.replace(line, "QUANT_CONFIG = " + json.dumps(case.quant_config).replace("null", "None")
                             .replace("true", "True").replace("false", "False"))))
