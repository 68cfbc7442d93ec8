"""DeepSeek-V2 / V3 fixtures checked against Hugging Face transformers.

Two steps, two Pythons (the library's environment has no torch; the reference one has no jax):

    python3 tools/hf_deepseek/make_fixtures.py write                         # wna16_jax installed
    /work/venvs/hf/bin/python tools/hf_deepseek/make_fixtures.py reference   # torch + transformers

``write`` writes each case's tiny quantized checkpoint with ``wna16_jax.models.write_random_model``
(random packed words in the GPTQ / AWQ layouts, the tensor names of DeepSeek's checkpoints) into
``tests/fixtures/hf_deepseek/<case>/``. ``reference`` dequantizes the stored tensors with the
independent numpy decoder of ``tools/quantizer_fixtures/common.py``, loads them into
transformers' own ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` in float32 (eager
attention), and stores the logits of a prompt and 32 greedy tokens in ``reference.npz`` (what is
what: ``reference.json``). The prompt is the first of a fixed series of random ones whose greedy
continuation has no near-tie (top-2 logit gap >= 1e-3) and whose routing has no near-tie at any
MoE layer (gap between the k-th and (k+1)-th selection score >= 1e-3).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "tests", "fixtures", "hf_deepseek")
GENERATE = 32
PROMPT_LEN = 10
MIN_MARGIN = 1e-3

GPTQ_ACT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
TINY = dict(vocab_size=96, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=24, num_experts=4, top_k=2,
            moe_intermediate_size=32, intermediate_size=96, max_position_embeddings=256)

CASES = {
    # V2-Lite's form: one q_proj, greedy softmax routing, two shared experts, a dense first layer, YaRN
    "v2-lite-gptq": dict(model_type="deepseek_v2", quant=GPTQ_ACT, num_layers=3, first_k_dense_replace=1,
                         n_shared_experts=2, seed=21,
                         mla=dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16),
                         extra_config={"rope_scaling": {"type": "yarn", "factor": 8.0,
                                                        "original_max_position_embeddings": 8, "beta_fast": 4,
                                                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    # V2's group-limited greedy routing with a routed scaling factor, q LoRA
    "v2-grouped-awq": dict(model_type="deepseek_v2", quant=AWQ, num_layers=2, first_k_dense_replace=0,
                           n_shared_experts=1, seed=22,
                           mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                    v_head_dim=16),
                           routing=dict(topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                        routed_scaling_factor=1.5)),
    # V3: sigmoid scores, score-correction bias, noaux_tc groups, renormalized and scaled weights
    "v3-awq": dict(model_type="deepseek_v3", quant=AWQ, num_layers=3, first_k_dense_replace=1, n_shared_experts=1,
                   seed=23,
                   mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16),
                   routing=dict(topk_method="noaux_tc", n_group=2, topk_group=1, scoring_func="sigmoid",
                                norm_topk_prob=True, routed_scaling_factor=2.5)),
}


def write() -> None:
    sys.path.insert(0, ROOT)
    from wna16_jax.models.synthetic import RandomModelSpec, write_random_model
    from wna16_jax.schemes import QuantScheme

    for name, case in CASES.items():
        args = {**TINY, **{k: v for k, v in case.items() if k not in ("quant", "seed")}}
        path = os.path.join(OUT, name)
        spec = RandomModelSpec(scheme=QuantScheme.from_quant_config(case["quant"]), **args)
        write_random_model(path, spec, seed=case["seed"])
        print(f"wrote {path}")


# --------------------------------------------------------------------------- the transformers side


def _hf_model(path: str, w: dict):
    import torch
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items()
                                                                          if k != "architectures"})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    sd = model.state_dict()
    new, used = {}, set()
    for key in sd:
        parts = key.split(".")
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            base = ".".join(parts[:-1])
            e = sd[key].shape[0]
            if key.endswith("gate_up_proj"):
                names = [[f"{base}.{i}.gate_proj.weight", f"{base}.{i}.up_proj.weight"] for i in range(e)]
                t = np.stack([np.concatenate([w[g], w[u]]) for g, u in names])
                used.update(n for pair in names for n in pair)
            else:
                names = [f"{base}.{i}.down_proj.weight" for i in range(e)]
                t = np.stack([w[n] for n in names])
                used.update(names)
        else:
            t = w[key]
            used.add(key)
        if tuple(t.shape) != tuple(sd[key].shape):
            raise AssertionError(f"{key}: shape {t.shape} vs model {tuple(sd[key].shape)}")
        new[key] = torch.from_numpy(np.ascontiguousarray(t)).to(sd[key].dtype)
    unused = sorted(set(w) - used)
    if unused:
        raise AssertionError(f"stored tensors not used by the transformers model: {unused[:8]}")
    model.load_state_dict(new, strict=True)
    return model, cfg


def _route_margin(model, ids) -> float:
    """Smallest gap between the k-th and (k+1)-th selection score over every token and MoE layer."""
    import torch

    gaps = []

    def hook(module, args, out):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        logits = x @ module.weight.double().T
        if hasattr(module, "e_score_correction_bias"):
            sc = logits.sigmoid() + module.e_score_correction_bias.double()
        else:
            sc = logits.softmax(-1)
        top = torch.topk(sc, module.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers
               if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(ids)[None])
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


def reference() -> None:
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tools", "quantizer_fixtures"))
    import common  # the independent numpy decoder of the stored tensors
    from make_references import greedy

    torch.set_num_threads(1)
    for name in CASES:
        path = os.path.join(OUT, name)
        w, _ = common.dequantize_checkpoint(path)
        model, cfg = _hf_model(path, w)
        rng = np.random.default_rng(1000 + list(CASES).index(name))
        for attempt in range(50):
            ids = rng.integers(3, cfg["vocab_size"], PROMPT_LEN)
            prompt_logits, gen, margins = greedy(model, ids, GENERATE)
            full = np.concatenate([ids, gen])
            route = _route_margin(model, full)
            if margins.min() >= MIN_MARGIN and route >= MIN_MARGIN:
                break
        else:
            raise AssertionError(f"{name}: no prompt without near-ties in 50 tries")
        np.savez(os.path.join(path, "reference.npz"), prompt_ids=ids.astype(np.int32),
                 logits=prompt_logits.astype(np.float32), generated_ids=full[PROMPT_LEN:].astype(np.int32),
                 greedy_margins=margins)
        with open(os.path.join(path, "reference.json"), "w") as f:
            json.dump({
                "case": name, "model_class": type(model).__name__, "torch": torch.__version__,
                "transformers": transformers.__version__, "attempt": attempt,
                "prompt_ids": "random token ids (numpy default_rng(1000 + case index)), the first "
                              "draw without near-ties",
                "logits": "float32 logits of the prompt (positions 0..S-1) from the transformers model "
                          "holding the dequantized weights in float32 (eager attention)",
                "generated_ids": f"{GENERATE} greedy tokens continuing the prompt (full recompute each step)",
                "min_greedy_margin": float(margins.min()), "min_route_margin": route,
                "max_abs_logit": float(np.abs(prompt_logits).max()),
            }, f, indent=1)
        print(f"{name}: attempt {attempt}, greedy margin {margins.min():.3g}, route margin {route:.3g}")


if __name__ == "__main__":
    {"write": write, "reference": reference}[sys.argv[1]]()
