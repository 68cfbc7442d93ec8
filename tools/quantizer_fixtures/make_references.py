"""Compute the float references of every fixture from its STORED tensors and write
``reference.npz`` + ``reference.json`` into the fixture folder.

Runs in the llm-compressor virtualenv (torch + transformers 5), after the tool scripts:

    /work/venvs/llmc/bin/python tools/quantizer_fixtures/make_references.py [fixture ...]

Reference (b), per MoE layer: the stored quantized expert tensors are decoded by this
generator's own code (``common.dequantize_checkpoint``: codes, zero points, float32/float64
upcast scales; never the tool's dequantization), then the HF sparse-MoE block's math is
evaluated in float64 with numpy:

    logits = x @ router.T                         (router as stored, upcast)
    p      = softmax(logits)                      (float64, over all experts)
    ids, w = top-k of p (descending)              (k = num_experts_per_tok)
    w     /= sum(w)        if norm_topk_prob      (Mixtral: always; Qwen3-MoE: config field)
    out    = sum_j w_j * W2[e_j] @ (silu(W1[e_j] @ x) * (W3[e_j] @ x))

Whole model: every quantized linear dequantized the same way, every other tensor as stored,
loaded into the transformers model class in float32; logits of the prompt, then 32 greedy tokens
(argmax of the last position, full recompute each step, no sampling, no stop token).

Reference (a) (the tool's own quantized forward) comes from the tool scripts
(``tool_outputs.npz``) and is only merged here, after checking it against (b).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

def canonical_name(key: str, arch: str) -> str:
    """Map a stored module name onto this generator's canonical per-expert naming."""
    import re

    block, gate, up, down = common.expert_names(arch)
    role = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
            "down_proj": "down"}
    m = re.match(r"^(model\.layers\.\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\."
                 r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(.+)$", key)
    if m:
        proj = {"gate": gate, "up": up, "down": down}[role[m[4]]]
        return f"{m[1]}.{block}.experts.{m[3]}.{proj}.{m[5]}"
    m = re.match(r"^(model\.layers\.\d+)\.(mlp|block_sparse_moe)\.gate\.(.+)$", key)
    if m:
        return f"{m[1]}.{block}.gate.{m[3]}"
    return key


def silu(v):
    return v / (1.0 + np.exp(-v))


def moe_reference(w: dict, arch: str, li: int, x: np.ndarray, e: int, k: int, norm_topk: bool):
    block, gate, up, down = common.expert_names(arch)
    p = f"model.layers.{li}.{block}"
    router = w[f"{p}.gate.weight"]
    x64 = x.astype(np.float64)
    logits = x64 @ router.T
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    tw = np.take_along_axis(probs, ids, -1)
    if norm_topk:
        tw = tw / tw.sum(-1, keepdims=True)
    out = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for j in range(k):
            q = f"{p}.experts.{ids[t, j]}"
            h = silu(w[f"{q}.{gate}.weight"] @ x64[t]) * (w[f"{q}.{up}.weight"] @ x64[t])
            out[t] += tw[t, j] * (w[f"{q}.{down}.weight"] @ h)
    return logits, ids.astype(np.int32), tw, out


def float_model(path: str, w: dict, arch: str):
    """The transformers model class in float32 holding the dequantized weights."""
    import torch
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    cfg.pop("transformers_version", None)
    cls = common.config_class(arch)
    config = cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    block, gate, up, down = common.expert_names(arch)
    sd = model.state_dict()
    used = set()
    new = {}
    e = config.num_local_experts if arch == "mixtral" else config.num_experts
    for key in sd:
        m = key.split(".")
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            li = int(m[2])
            names = []
            for ei in range(e):
                q = f"model.layers.{li}.{block}.experts.{ei}"
                if key.endswith("gate_up_proj"):
                    names += [f"{q}.{gate}.weight", f"{q}.{up}.weight"]
                else:
                    names += [f"{q}.{down}.weight"]
            if key.endswith("gate_up_proj"):
                t = np.stack([np.concatenate([w[names[2 * ei]], w[names[2 * ei + 1]]]) for ei in range(e)])
            else:
                t = np.stack([w[n] for n in names])
            used.update(names)
        elif key.endswith("mlp.gate.weight"):
            src = f"model.layers.{m[2]}.{block}.gate.weight"
            t = w[src]
            used.add(src)
        else:
            t = w[key]
            used.add(key)
        if tuple(t.shape) != tuple(sd[key].shape):
            raise AssertionError(f"{key}: shape {t.shape} vs model {tuple(sd[key].shape)}")
        new[key] = torch.from_numpy(np.ascontiguousarray(t)).to(torch.float32)
    unused = sorted(set(w) - used)
    if unused:
        raise AssertionError(f"stored tensors not used by the float model: {unused[:8]}")
    model.load_state_dict(new, strict=True)
    return model


class RouterProbe:
    """Forward hooks on every router of the float model: records each call's router logits."""

    def __init__(self, model):
        self.calls: list[tuple[int, np.ndarray]] = []
        self.handles = []
        for li, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                self.handles.append(gate.register_forward_hook(self._hook(li)))

    def _hook(self, li):
        def fn(module, args, out):
            logits = out[0] if isinstance(out, tuple) else out
            self.calls.append((li, logits.detach().double().reshape(-1, logits.shape[-1]).numpy()))
        return fn

    def min_margin(self, k: int) -> float:
        return min(float(common.route_margin(lg, k).min()) for _, lg in self.calls)

    def clear(self):
        self.calls.clear()


def greedy(model, ids: np.ndarray, n: int):
    import torch

    seq = torch.from_numpy(ids)[None]
    margins = []
    with torch.no_grad():
        prompt_logits = model(input_ids=seq).logits[0].numpy()
        for _ in range(n):
            last = model(input_ids=seq).logits[0, -1].double()
            top2 = torch.topk(last, 2).values
            margins.append(float(top2[0] - top2[1]))
            seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
    return prompt_logits, seq[0, len(ids):].numpy(), np.array(margins)


def sequence_margin(model, ids: np.ndarray, k: int) -> float:
    """Smallest routing margin (float model) over every token of ``ids`` and every MoE layer."""
    import torch

    probe = RouterProbe(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids)[None])
        return probe.min_margin(k)
    finally:
        for h in probe.handles:
            h.remove()


#: float32 noise between two float32 implementations is ~1e-6 relative; the references keep only
#: greedy sequences whose routing (probability gap) and argmax (logit gap) margins dwarf it.
MIN_SEQUENCE_ROUTE_MARGIN = 1e-3
MIN_GREEDY_MARGIN = 1e-3


def choose_prompt(model, k: int):
    """The first prompt candidate whose prompt tokens all route with a margin of at least
    ``common.MIN_PROMPT_ROUTE_MARGIN`` and whose whole greedy sequence has no near-tie."""
    tried = []
    for j, text in enumerate(common.prompt_candidates()):
        ids = common.prompt_ids(text)
        pm = sequence_margin(model, ids, k)
        if pm < common.MIN_PROMPT_ROUTE_MARGIN:
            tried.append((j, "prompt routing", pm))
            continue
        plog, gen, margins = greedy(model, ids, common.GENERATE)
        sm = sequence_margin(model, np.concatenate([ids, gen]), k)
        if sm < MIN_SEQUENCE_ROUTE_MARGIN or margins.min() < MIN_GREEDY_MARGIN:
            tried.append((j, "sequence", sm, float(margins.min())))
            continue
        return j, text, ids, plog, gen, margins, pm, sm
    raise AssertionError(f"no prompt candidate without near-ties: {tried}")


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def make(name: str) -> None:
    import torch

    torch.set_num_threads(1)
    fx = common.FIXTURES[name]
    s = common.sizes(name)
    arch = s["arch"]
    path = common.fixture_dir(name)
    tool = dict(np.load(common.work_dir(name, "tool_outputs.npz")))
    with open(common.work_dir(name, "tool_meta.json")) as f:
        meta = json.load(f)
    raw, info = common.dequantize_checkpoint(path)
    w = {canonical_name(k, arch): v for k, v in raw.items()}
    assert len(w) == len(raw)
    ref: dict[str, np.ndarray] = {}
    stats = {}
    layers = []
    block = common.expert_names(arch)[0]
    for li in range(2):
        if f"model.layers.{li}.{block}.gate.weight" not in w:
            continue
        layers.append(li)
        x = common.layer_inputs(name, li, w[f"model.layers.{li}.{block}.gate.weight"], s["top_k"])
        if not np.array_equal(x, tool[f"layer{li}_x"]):
            raise AssertionError(f"{name} layer {li}: the tool saw a different x (router changed on save?)")
        logits, ids, tw, out = moe_reference(w, arch, li, x, s["experts"], s["top_k"], s["norm_topk"])
        ref[f"layer{li}_x"] = x
        ref[f"layer{li}_router_logits"] = logits
        ref[f"layer{li}_topk_ids"] = ids
        ref[f"layer{li}_topk_weights"] = tw
        ref[f"layer{li}_out_float"] = out
        ref[f"layer{li}_out_tool"] = tool[f"layer{li}_tool_out"].astype(np.float32)
        r = rel(ref[f"layer{li}_out_tool"], out)
        stats[f"layer{li}_rel_err_tool_vs_float"] = r
        stats[f"layer{li}_min_route_margin"] = float(common.route_margin(logits, s["top_k"]).min())
        # A decoding mistake (nibble order, zero-point offset, g_idx) shows up as O(1) error.
        if not r < 5e-2:
            raise AssertionError(f"{name} layer {li}: tool forward and float reference differ by {r:.3g}")
    ref["layers"] = np.array(layers, np.int32)
    model = float_model(path, w, arch)
    cand, text, pids, plog, gen, margins, prompt_margin, seq_margin = choose_prompt(model, s["top_k"])
    ref["prompt_ids"] = pids
    ref["prompt_text"] = np.array(text)
    ref["logits_float"] = plog.astype(np.float32)
    ref["generated_ids"] = gen.astype(np.int64)
    ref["generated_margins"] = margins
    ref["logits_tool"] = tool[f"tool_logits_cand{cand}"].astype(np.float32)
    stats["prompt_candidate"] = cand
    stats["prompt_min_route_margin"] = prompt_margin
    stats["sequence_min_route_margin"] = seq_margin
    stats["logits_rel_err_tool_vs_float"] = rel(ref["logits_tool"], plog.astype(np.float64))
    stats["min_greedy_margin"] = float(margins.min())
    if not stats["logits_rel_err_tool_vs_float"] < 5e-2:
        raise AssertionError(f"{name}: whole-model logits differ by {stats['logits_rel_err_tool_vs_float']:.3g}")
    np.savez_compressed(os.path.join(path, "reference.npz"), **ref)
    doc = {
        "fixture": name,
        "architecture": arch,
        "model": {k: s[k] for k in ("hidden", "inter", "experts", "top_k", "norm_topk")},
        "tool": meta,
        "quantized_modules": {m: info[m] for m in sorted(info)},
        "routing": ("logits = x @ router.T (stored router upcast to float64); softmax over all experts "
                    "in float64; top-k by probability (ties by lower expert id); "
                    + ("renormalized to sum 1 (norm_topk_prob)" if s["norm_topk"] else
                       "NOT renormalized (norm_topk_prob = false)")),
        "out_float": "reference (b): stored tensors decoded by tools/quantizer_fixtures/common.py, "
                     "scales upcast exactly, the MoE block evaluated in float64",
        "out_tool": f"reference (a): the tool's own quantized block forward in {meta['tool_dtype']}",
        "logits_float": "whole model in float32 (transformers, eager attention) on the dequantized weights",
        "logits_tool": f"the tool's own quantized model forward in {meta['tool_dtype']}",
        "generated_ids": f"{common.GENERATE} greedy tokens after the prompt, float32 model, "
                         "full recompute each step, no stop token",
        "stats": stats,
    }
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    print(name, json.dumps(stats), "size", common.file_sizes(path))


if __name__ == "__main__":
    for n in sys.argv[1:] or list(common.FIXTURES):
        make(n)
