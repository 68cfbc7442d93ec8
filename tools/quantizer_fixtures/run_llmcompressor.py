"""Quantize the compressed-tensors fixtures with llm-compressor (``oneshot``).

Run in the llm-compressor virtualenv (see README.md):

    /work/venvs/llmc/bin/python tools/quantizer_fixtures/run_llmcompressor.py [fixture ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import tool_common as tc  # noqa: E402


def quantize(name: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modeling.moe.linearize import linearize_moe

    f = common.FIXTURES[name]
    tc.setup_torch()
    src = common.write_float_checkpoint(name)
    dtype = getattr(torch, f["dtype"])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    # transformers 5 holds the experts as fused 3-D parameters; llm-compressor quantizes
    # nn.Linear modules, so it splits them into per-expert Linears first (what oneshot would do
    # by itself, with a warning; its load_quantizable_moe helper imports vision models).
    linearize_moe(model)
    ids = common.calibration_ids(name)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * len(ids)})
    kw = dict(targets="Linear", scheme=f["scheme"], ignore=["lm_head"])
    recipe = GPTQModifier(**kw) if f["modifier"] == "gptq" else QuantizationModifier(**kw)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    model.eval()
    res = tc.tool_outputs(name, model, dtype)
    saved = common.work_dir(name, "saved")
    model.save_pretrained(saved, save_compressed=True)
    tc.publish(name, saved)
    tc.save_tool_outputs(name, res, {
        "tool": "llm-compressor", "entry_point": f"oneshot({type(recipe).__name__}(targets='Linear', "
        f"scheme={f['scheme']!r}, ignore=['lm_head']))",
        "tool_dtype": f["dtype"],
        "tool_forward": "the in-memory model after oneshot: compressed-tensors fake-quantizes each "
                        f"Linear's weight in {f['dtype']} (quantize-dequantize) in its forward",
        "versions": tc.versions("llmcompressor", "compressed-tensors"),
    })
    print(name, "written; fixture size", common.file_sizes(common.fixture_dir(name)))


if __name__ == "__main__":
    names = sys.argv[1:] or [n for n, f in common.FIXTURES.items() if f["tool"] == "llmcompressor"]
    for n in names:
        quantize(n)
