"""Helpers the three tool scripts share (torch side): running a model's sparse-MoE blocks and
the whole model through the tool's own quantized modules, and writing those outputs."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch

import common


def setup_torch() -> None:
    torch.manual_seed(0)
    # One thread: deterministic reductions, and polite to the other jobs on a 2-core machine.
    torch.set_num_threads(1)


def moe_blocks(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, sparse-MoE block) of every decoder layer of a HF causal LM."""
    layers = model.model.layers
    out = []
    for li, layer in enumerate(layers):
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "experts"):
            block = getattr(layer, "block_sparse_moe", None)
        out.append((li, block))
    return out


def block_forward(block: torch.nn.Module, x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The block's own forward on ``x [T, H]`` (cast to the tool's dtype), as float32."""
    dev = next(block.parameters()).device
    with torch.no_grad():
        y = block(torch.from_numpy(x).to(dev, dtype)[None])
    if isinstance(y, tuple):  # transformers 4.x blocks return (hidden, router_logits)
        y = y[0]
    return y[0].float().cpu().numpy()


def router_weight(block: torch.nn.Module) -> np.ndarray:
    return block.gate.weight.detach().float().cpu().numpy()


def model_logits(model, ids: np.ndarray) -> np.ndarray:
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids)[None].to(dev))
    return out.logits[0].float().cpu().numpy()


def tool_outputs(name: str, model, dtype: torch.dtype, blocks=None) -> dict:
    """Run every MoE layer and the whole model through the tool's in-memory quantized model."""
    s = common.sizes(name)
    res = {}
    for li, block in (blocks if blocks is not None else moe_blocks(model)):
        x = common.layer_inputs(name, li, router_weight(block), s["top_k"])
        res[f"layer{li}_x"] = x
        res[f"layer{li}_tool_out"] = block_forward(block, x, dtype)
    for j, text in enumerate(common.prompt_candidates()):
        res[f"tool_logits_cand{j}"] = model_logits(model, common.prompt_ids(text))
    return res


def save_tool_outputs(name: str, res: dict, meta: dict) -> None:
    out = common.work_dir(name, "tool_outputs.npz")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez(out, **res)
    with open(common.work_dir(name, "tool_meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def publish(name: str, saved: str, exclude: tuple[str, ...] = ()) -> str:
    """Copy what the tool wrote into the fixture folder (its own file and tensor names), add the
    tokenizer. Returns the fixture folder."""
    dst = common.fixture_dir(name)
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    os.makedirs(dst)
    for f in sorted(os.listdir(saved)):
        if f in exclude:
            continue
        shutil.copy2(os.path.join(saved, f), os.path.join(dst, f))
    common.save_tokenizer(dst)
    return dst


def versions(*mods: str) -> dict:
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    for m in ("transformers", "safetensors", "numpy", "tokenizers", "accelerate") + mods:
        try:
            out[m] = md.version(m)
        except md.PackageNotFoundError:
            pass
    return out
