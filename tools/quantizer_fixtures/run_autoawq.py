"""Quantize the AutoAWQ fixtures (GEMM, 4-bit, group 128, zero points) with AutoAWQ.

Run in the AutoAWQ virtualenv (transformers 4.51, see README.md):

    /work/venvs/awq/bin/python tools/quantizer_fixtures/run_autoawq.py [fixture ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import tool_common as tc  # noqa: E402

QUANT_CONFIG = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}


def quantize(name: str) -> None:
    import torch
    from awq import AutoAWQForCausalLM
    from awq.modules.linear import gemm

    f = common.FIXTURES[name]
    tc.setup_torch()
    src = common.write_float_checkpoint(name)
    model = AutoAWQForCausalLM.from_pretrained(src, torch_dtype=torch.float16, device_map="cpu")
    tok = common.hf_tokenizer(src)
    # Calibration: token-id lists are accepted as they are (AutoAWQ concatenates the samples and
    # cuts them into blocks of max_calib_seq_len).
    calib = common.calibration_ids(name).tolist()
    qc = dict(QUANT_CONFIG)
    if common.sizes(name)["arch"] == "qwen3_moe":
        # AutoAWQ's Qwen3-MoE definition names no modules_to_not_convert, so the router
        # (nn.Linear in transformers 4.51) would be quantized too; here its out-features (the
        # expert count, 8) also trips the clip search (assert out_features % 64 == 0). The match
        # is by substring: "gate" would also exclude every expert's gate_proj.
        qc["modules_to_not_convert"] = ["mlp.gate"]
    model.quantize(tok, quant_config=qc, calib_data=calib,
                   max_calib_samples=len(calib), max_calib_seq_len=len(calib[0]))
    # Triton has no CPU backend; AutoAWQ's own fallback (dequantize to fp16, fp16 matmul) runs.
    gemm.TRITON_AVAILABLE = False
    model.model.eval()
    res = tc.tool_outputs(name, model.model, torch.float16)
    saved = common.work_dir(name, "saved")
    model.save_quantized(saved)
    tc.publish(name, saved)
    tc.save_tool_outputs(name, res, {
        "tool": "AutoAWQ",
        "entry_point": f"AutoAWQForCausalLM.from_pretrained(...).quantize(quant_config={qc})"
                       " + save_quantized",
        "tool_dtype": "float16",
        "tool_forward": "the in-memory model after quantize(): WQLinear_GEMM's CPU fallback "
                        "(dequantize_gemm to fp16 weights, fp16 matmul)",
        "versions": tc.versions("autoawq"),
    })
    print(name, "written; fixture size", common.file_sizes(common.fixture_dir(name)))


if __name__ == "__main__":
    names = sys.argv[1:] or [n for n, f in common.FIXTURES.items() if f["tool"] == "autoawq"]
    for n in names:
        quantize(n)
