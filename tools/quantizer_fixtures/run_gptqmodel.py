"""Quantize the GPTQ fixtures (4-bit, group 128; symmetric with/without desc_act, asymmetric) with GPTQModel.

Run in the GPTQModel virtualenv (see README.md):

    GPTQMODEL_CPU_WORKERS=2 /work/venvs/gptq/bin/python tools/quantizer_fixtures/run_gptqmodel.py [fixture ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import common  # noqa: E402
import tool_common as tc  # noqa: E402


def quantize(name: str) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    f = common.FIXTURES[name]
    tc.setup_torch()
    src = common.write_float_checkpoint(name)
    # offload_to_disk (default on) records a random temporary path in the saved config.
    sym = f.get("sym", True)
    qcfg = QuantizeConfig(bits=4, group_size=128, desc_act=f["desc_act"], sym=sym, device="cpu",
                          offload_to_disk=False)
    model = GPTQModel.load(src, qcfg, dtype=torch.float16)
    ids = common.calibration_ids(name)
    calib = [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids]
    model.quantize(calib, batch_size=1)
    saved = common.work_dir(name, "saved")
    model.save(saved)
    del model
    # The tool's own inference path: reload the saved checkpoint with GPTQModel's torch kernel.
    qmodel = GPTQModel.load(saved, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    hf = qmodel.model.eval()
    res = tc.tool_outputs(name, hf, torch.float16)
    # quant_log.csv (per-module loss and wall time) is a log, not part of the checkpoint, and
    # its timings differ on every run: left out so that regeneration is byte-for-byte stable.
    tc.publish(name, saved, exclude=("quant_log.csv",))
    tc.save_tool_outputs(name, res, {
        "tool": "GPTQModel",
        "entry_point": f"GPTQModel.load(float, QuantizeConfig(bits=4, group_size=128, desc_act={f['desc_act']}, "
                       f"sym={sym}, device='cpu', offload_to_disk=False)).quantize(calib) + save",
        "tool_dtype": "float16",
        "tool_forward": "the saved checkpoint reloaded with GPTQModel.load(backend=BACKEND.TORCH) "
                        "(TorchQuantLinear: dequantize to fp16, fp16 matmul)",
        "versions": tc.versions("gptqmodel", "defuser"),
    })
    print(name, "written; fixture size", common.file_sizes(common.fixture_dir(name)))


if __name__ == "__main__":
    # GPTQModel writes a logs/ folder into the working directory: keep it out of the repository.
    os.makedirs(common.WORK, exist_ok=True)
    os.chdir(common.WORK)
    names = sys.argv[1:] or [n for n, f in common.FIXTURES.items() if f["tool"] == "gptqmodel"]
    for n in names:
        quantize(n)
