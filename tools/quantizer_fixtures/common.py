"""Shared pieces of the quantizer-fixture generator.

Imported by the per-tool scripts, each of which runs in its own virtualenv (the tools pin
incompatible transformers versions), so this module needs only numpy, torch, safetensors and
tokenizers, and works with transformers 4.51 and 5.x alike.

What lives here:

* ``FIXTURES``: every fixture, the tool that writes it, the architecture and the sizes;
* the tiny float models: weights drawn with numpy from a fixed seed in the per-expert tensor
  naming of the architecture's Hugging Face checkpoints, written as a float checkpoint that each
  tool then loads with ``from_pretrained`` exactly as it would load a downloaded model;
* the tokenizer (a ``tokenizers`` WordLevel model over a few sentences) and the prompt;
* the MoE-layer inputs ``x`` (drawn so that every token's top-k routing has a clear margin);
* an independent float64 decoder of the stored tensors of each format (AWQ GEMM, GPTQ v1,
  compressed-tensors pack-quantized), used for the float references.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURE_ROOT = os.path.join(REPO, "tests", "fixtures", "quantizers")
#: scratch space for float checkpoints and the tools' own outputs (not committed).
WORK = os.environ.get("QF_WORK", "/tmp/quantizer_fixtures_work")

NUM_TOKENS = 16          # rows of the stored MoE-layer input x
PROMPT_LEN_CHECK = (8, 12)
GENERATE = 32            # greedy tokens continuing the prompt
MIN_ROUTE_MARGIN = 0.02  # min gap (in softmax probability) between the k-th and (k+1)-th expert

# --------------------------------------------------------------------------- the fixtures

# Sizes: group size 128 needs H and I multiples of 128; act-order needs >= 2 groups along K to
# give g_idx something to permute (H = I = 256).
ARCH_SIZES = {
    "qwen3_moe_h256": dict(arch="qwen3_moe", hidden=256, inter=128, experts=8, top_k=2, norm_topk=True),
    "qwen3_moe_h256_i256_nonorm": dict(arch="qwen3_moe", hidden=256, inter=256, experts=4, top_k=2,
                                       norm_topk=False),
    "qwen3_moe_h128": dict(arch="qwen3_moe", hidden=128, inter=128, experts=4, top_k=2, norm_topk=True),
    "mixtral_h256": dict(arch="mixtral", hidden=256, inter=256, experts=4, top_k=2, norm_topk=True),
    "mixtral_h128": dict(arch="mixtral", hidden=128, inter=256, experts=4, top_k=2, norm_topk=True),
}

FIXTURES = {
    # name: tool, model size key, tool options, float dtype the tool works in, seed
    "ct-w4a16-qwen3moe": dict(tool="llmcompressor", size="qwen3_moe_h256", scheme="W4A16",
                              modifier="gptq", dtype="bfloat16", seed=101),
    "ct-w4a16asym-mixtral": dict(tool="llmcompressor", size="mixtral_h128", scheme="W4A16_ASYM",
                                 modifier="rtn", dtype="bfloat16", seed=102),
    "ct-w8a16-qwen3moe": dict(tool="llmcompressor", size="qwen3_moe_h128", scheme="W8A16",
                              modifier="gptq", dtype="bfloat16", seed=103),
    "awq-mixtral": dict(tool="autoawq", size="mixtral_h256", dtype="float16", seed=104),
    "awq-qwen3moe": dict(tool="autoawq", size="qwen3_moe_h256", dtype="float16", seed=105),
    "gptq-descact-qwen3moe": dict(tool="gptqmodel", size="qwen3_moe_h256_i256_nonorm", desc_act=True,
                                  dtype="float16", seed=106),
    "gptq-mixtral": dict(tool="gptqmodel", size="mixtral_h128", desc_act=False, dtype="float16",
                         seed=107),
    "gptq-asym-qwen3moe": dict(tool="gptqmodel", size="qwen3_moe_h128", desc_act=False, sym=False,
                               dtype="float16", seed=108),
}

VOCAB_SIZE = 320


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURE_ROOT, name)


def work_dir(name: str, sub: str) -> str:
    return os.path.join(WORK, name, sub)


def sizes(name: str) -> dict:
    return ARCH_SIZES[FIXTURES[name]["size"]]


# --------------------------------------------------------------------------- model config


def hf_config_kwargs(name: str) -> dict:
    """Keyword arguments of the transformers config class (same in transformers 4.51 and 5.x)."""
    s = sizes(name)
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=s["hidden"], num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", num_experts_per_tok=s["top_k"],
        bos_token_id=1, eos_token_id=None, pad_token_id=None, initializer_range=0.02,
        torch_dtype=FIXTURES[name]["dtype"],
    )
    if s["arch"] == "qwen3_moe":
        common.update(num_experts=s["experts"], moe_intermediate_size=s["inter"],
                      intermediate_size=2 * s["inter"], norm_topk_prob=s["norm_topk"],
                      decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
                      use_sliding_window=False)
    else:
        common.update(num_local_experts=s["experts"], intermediate_size=s["inter"], sliding_window=None,
                      router_jitter_noise=0.0)
    return common


def config_class(arch: str):
    import transformers

    return {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[arch]


def expert_names(arch: str) -> tuple[str, str, str, str]:
    """(block, gate, up, down) module names of the architecture's per-expert checkpoints."""
    if arch == "mixtral":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def float_weights(name: str) -> dict[str, np.ndarray]:
    """The float model in the architecture's per-expert checkpoint naming (float32 numpy).

    Magnitudes are chosen so that the random model is "alive": linear weights ~ N(0, 1/fan_in),
    embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1²), router ~ N(0, 4/H) so that routing is
    decisive, lm_head ~ N(0, 4/H) so that greedy decoding does not sit on near-ties.
    """
    s = sizes(name)
    rng = np.random.default_rng(FIXTURES[name]["seed"])
    h, i, e = s["hidden"], s["inter"], s["experts"]
    nh, nkv, hd = 4, 2, 64
    block, gate, up, down = expert_names(s["arch"])

    def lin(n_out, n_in, gain=1.0):
        return (gain * rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB_SIZE, h)).astype(np.float32)}
    for li in range(2):
        p = f"model.layers.{li}"
        w[f"{p}.input_layernorm.weight"] = norm(h)
        w[f"{p}.post_attention_layernorm.weight"] = norm(h)
        w[f"{p}.self_attn.q_proj.weight"] = lin(nh * hd, h)
        w[f"{p}.self_attn.k_proj.weight"] = lin(nkv * hd, h)
        w[f"{p}.self_attn.v_proj.weight"] = lin(nkv * hd, h)
        w[f"{p}.self_attn.o_proj.weight"] = lin(h, nh * hd)
        if s["arch"] == "qwen3_moe":
            w[f"{p}.self_attn.q_norm.weight"] = norm(hd)
            w[f"{p}.self_attn.k_norm.weight"] = norm(hd)
        w[f"{p}.{block}.gate.weight"] = lin(e, h, gain=2.0)
        for ei in range(e):
            q = f"{p}.{block}.experts.{ei}"
            w[f"{q}.{gate}.weight"] = lin(i, h)
            w[f"{q}.{up}.weight"] = lin(i, h)
            w[f"{q}.{down}.weight"] = lin(h, i)
    w["model.norm.weight"] = norm(h)
    w["lm_head.weight"] = lin(VOCAB_SIZE, h, gain=2.0)
    return w


def write_float_checkpoint(name: str) -> str:
    """Write the float model (in the tool's working dtype), its config and the tokenizer."""
    import torch
    from safetensors.torch import save_file

    out = work_dir(name, "float")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    s = sizes(name)
    cfg = config_class(s["arch"])(**hf_config_kwargs(name))
    cfg.architectures = ["Qwen3MoeForCausalLM" if s["arch"] == "qwen3_moe" else "MixtralForCausalLM"]
    cfg.save_pretrained(out)
    dt = getattr(torch, FIXTURES[name]["dtype"])
    tensors = {k: torch.from_numpy(v).to(dt).contiguous() for k, v in float_weights(name).items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(out)
    return out


# --------------------------------------------------------------------------- tokenizer & prompt

SENTENCES = [
    "the small model reads a short line of text",
    "a quiet river runs past the old stone mill",
    "every expert sees only the tokens the router sends to it",
    "four bits per weight and one scale for each group of weights",
    "the cat sat near the warm window and watched the rain",
    "we count the groups and pack eight codes into one word",
    "green hills under a pale sky at the end of the day",
    "numbers go in and numbers come out of the layer",
]
PROMPT_TEXT = "the router sends every token to two of the experts"
SPECIALS = ["<unk>", "<s>", "</s>"]


def build_tokenizer():
    """A WordLevel tokenizer over the words of ``SENTENCES`` (ids: specials first, then sorted words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = sorted({w for s in SENTENCES + [PROMPT_TEXT] for w in s.split()})
    vocab = {t: n for n, t in enumerate(SPECIALS + words)}
    assert len(vocab) <= VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def save_tokenizer(path: str) -> None:
    tok = build_tokenizer()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
                   "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 256}, f, indent=2)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, f, indent=2)


def hf_tokenizer(path: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>")


NUM_PROMPT_CANDIDATES = 64
MIN_PROMPT_ROUTE_MARGIN = 0.01


def prompt_candidates() -> list[str]:
    """``PROMPT_TEXT`` first, then word sequences drawn from the vocabulary. The reference step
    keeps, per fixture, the first candidate whose every MoE routing decision (every prompt token,
    every layer, in the float model) has a top-k margin of at least ``MIN_PROMPT_ROUTE_MARGIN``:
    with smaller margins the tools' bf16/fp16 forward can pick another expert for a token, and the
    tool's logits stop being comparable with the float32 ones at that position."""
    words = sorted({w for s in SENTENCES for w in s.split()})
    rng = np.random.default_rng(4242)
    out = [PROMPT_TEXT]
    while len(out) < NUM_PROMPT_CANDIDATES:
        out.append(" ".join(words[j] for j in rng.integers(0, len(words), 10)))
    return out


def prompt_ids(text: str = PROMPT_TEXT) -> np.ndarray:
    ids = np.array(build_tokenizer().encode(text).ids, np.int64)
    assert PROMPT_LEN_CHECK[0] <= len(ids) <= PROMPT_LEN_CHECK[1], len(ids)
    assert build_tokenizer().token_to_id("<unk>") not in ids.tolist(), text
    return ids


def calibration_ids(name: str, n: int = 16, length: int = 64) -> np.ndarray:
    """Random token sequences (the tiny calibration set), ``[n, length]`` int64."""
    rng = np.random.default_rng(FIXTURES[name]["seed"] + 1000)
    return rng.integers(0, VOCAB_SIZE, (n, length)).astype(np.int64)


def calibration_texts(name: str, n: int = 16, length: int = 64) -> list[str]:
    """The same kind of calibration data as text (for tools that tokenize themselves)."""
    words = sorted({w for s in SENTENCES for w in s.split()})
    rng = np.random.default_rng(FIXTURES[name]["seed"] + 1000)
    return [" ".join(words[j] for j in rng.integers(0, len(words), length)) for _ in range(n)]


# --------------------------------------------------------------------------- MoE-layer inputs


def route_margin(logits: np.ndarray, k: int) -> np.ndarray:
    """Per token, the gap between the k-th and (k+1)-th largest softmax probability."""
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    ps = -np.sort(-p, axis=-1)
    return ps[:, k - 1] - ps[:, k]


def layer_inputs(name: str, layer: int, router: np.ndarray, top_k: int) -> np.ndarray:
    """``x [NUM_TOKENS, H]`` float32 for MoE layer ``layer``: N(0, 1) rows, each redrawn until its
    top-k routing has a margin of at least ``MIN_ROUTE_MARGIN`` under the stored router, so that
    no rounding (bf16 in the tools, float32 in the library) can flip an expert choice."""
    rng = np.random.default_rng([FIXTURES[name]["seed"], 7, layer])
    r = router.astype(np.float64)
    rows = []
    while len(rows) < NUM_TOKENS:
        x = rng.standard_normal(r.shape[1]).astype(np.float32)
        if route_margin((x.astype(np.float64) @ r.T)[None], top_k)[0] >= MIN_ROUTE_MARGIN:
            rows.append(x)
    return np.stack(rows)


# --------------------------------------------------------------------------- decoding stored tensors


def _unpack_cols(packed: np.ndarray, bits: int, order=None) -> np.ndarray:
    """Unpack int32 words along the last axis: value j of a word sits at bits ``bits*pos(j)``."""
    per = 32 // bits
    u = packed.astype(np.int64) & 0xFFFFFFFF
    order = list(range(per)) if order is None else order
    mask = (1 << bits) - 1
    # shift for the value at logical position j inside each word
    vals = [(u >> (bits * order.index(j))) & mask for j in range(per)]
    out = np.stack(vals, axis=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * per)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # position j of a word holds logical column AWQ_ORDER[j]


def decode_awq(qweight, qzeros, scales, bits: int, group: int) -> np.ndarray:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [G, N/8], scales [G, N] -> W [N, K] float64."""
    assert bits == 4
    # the word's nibble j (bits 4j..4j+3) holds column AWQ_ORDER[j]
    def unpack(p):
        u = p.astype(np.int64) & 0xFFFFFFFF
        cols = np.empty((*p.shape[:-1], p.shape[-1], 8), np.int64)
        for j in range(8):
            cols[..., AWQ_ORDER[j]] = (u >> (4 * j)) & 0xF
        return cols.reshape(*p.shape[:-1], p.shape[-1] * 8)
    q = unpack(qweight)                      # [K, N]
    z = unpack(qzeros)                       # [G, N]
    k = q.shape[0]
    gi = np.arange(k) // group
    w = (q - z[gi]) * scales.astype(np.float64)[gi]
    return w.T


def decode_gptq(qweight, qzeros, scales, g_idx, bits: int, zeros_minus_one: bool = True) -> np.ndarray:
    """GPTQ (v1 unless told otherwise): qweight [K/pf, N] packed along K, qzeros [G, N/pf] (v1
    stores z - 1), scales [G, N], g_idx [K] -> W [N, K] float64."""
    per = 32 // bits
    mask = (1 << bits) - 1
    u = qweight.astype(np.int64) & 0xFFFFFFFF           # [K/pf, N]
    q = np.stack([(u >> (bits * j)) & mask for j in range(per)], axis=1)  # [K/pf, pf, N]
    q = q.reshape(-1, qweight.shape[1])                 # [K, N]
    z = _unpack_cols(qzeros, bits)                      # [G, N]
    if zeros_minus_one:
        z = (z + 1) & mask
    gi = np.asarray(g_idx, np.int64)
    w = (q - z[gi]) * scales.astype(np.float64)[gi]
    return w.T


def decode_ct(weight_packed, weight_scale, weight_shape, bits: int, group: int | None,
              weight_zero_point=None, g_idx=None) -> np.ndarray:
    """compressed-tensors pack-quantized: weight_packed [N, ceil(K/pf)] int32 (codes stored
    unsigned: signed value + 2^(b-1)), weight_scale [N, G], weight_zero_point [ceil(N/pf), G]
    packed along N (signed zero points + 2^(b-1)) -> W [N, K] float64."""
    n, k = (int(v) for v in np.asarray(weight_shape).reshape(-1))
    off = 1 << (bits - 1)
    q = _unpack_cols(weight_packed, bits)[:, :k] - off            # signed codes [N, K]
    sc = weight_scale.astype(np.float64)
    if group is None or group == -1 or sc.shape[1] == 1:
        gi = np.zeros(k, np.int64)
    else:
        gi = np.arange(k) // group if g_idx is None else np.asarray(g_idx, np.int64)
    if weight_zero_point is not None:
        zp = _unpack_cols(weight_zero_point.T, bits)[:, :n].T - off  # [N, G] signed
    else:
        zp = np.zeros_like(sc)
    return (q - zp[:, gi]) * sc[:, gi]


def to_f64(t) -> np.ndarray:
    """safetensors tensor (numpy or torch, any float dtype incl. bf16) -> float64 numpy."""
    try:
        import torch

        if isinstance(t, torch.Tensor):
            return t.to(torch.float64).numpy()
    except ImportError:
        pass
    return np.asarray(t).astype(np.float64)


def read_safetensors(path: str) -> dict:
    """All tensors of a checkpoint directory as torch tensors (bf16 kept)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def dequantize_checkpoint(path: str) -> tuple[dict, dict]:
    """Every tensor of a quantized checkpoint as float64 numpy, quantized linears dequantized
    (from the stored codes, zero points and scales, with the scales upcast exactly).

    Returns ``(weights, info)``: ``weights`` maps ``<module>.weight`` (and every other unquantized
    tensor name) to float64; ``info`` maps each quantized module to its format facts.
    """
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    qc = cfg["quantization_config"]
    t = read_safetensors(path)
    method = qc["quant_method"]
    out, info = {}, {}
    if method == "awq":
        mods = sorted({k[: -len(".qweight")] for k in t if k.endswith(".qweight")})
        for m in mods:
            out[m + ".weight"] = decode_awq(t[m + ".qweight"].numpy(), t[m + ".qzeros"].numpy(),
                                            to_f64(t[m + ".scales"]), qc["bits"], qc["group_size"])
            info[m] = {"scale_dtype": str(t[m + ".scales"].dtype)}
        done = {f"{m}.{s}" for m in mods for s in ("qweight", "qzeros", "scales")}
    elif method == "gptq":
        mods = sorted({k[: -len(".qweight")] for k in t if k.endswith(".qweight")})
        v1 = qc.get("checkpoint_format", "gptq") != "gptq_v2"
        for m in mods:
            out[m + ".weight"] = decode_gptq(t[m + ".qweight"].numpy(), t[m + ".qzeros"].numpy(),
                                             to_f64(t[m + ".scales"]), t[m + ".g_idx"].numpy(),
                                             qc["bits"], zeros_minus_one=v1)
            info[m] = {"scale_dtype": str(t[m + ".scales"].dtype)}
        done = {f"{m}.{s}" for m in mods for s in ("qweight", "qzeros", "scales", "g_idx")}
    else:
        groups = qc["config_groups"]
        assert len(groups) == 1, groups
        wq = next(iter(groups.values()))["weights"]
        bits, group = wq["num_bits"], wq.get("group_size")
        mods = sorted({k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")})
        for m in mods:
            zp = t.get(m + ".weight_zero_point")
            gi = t.get(m + ".weight_g_idx")
            out[m + ".weight"] = decode_ct(t[m + ".weight_packed"].numpy(), to_f64(t[m + ".weight_scale"]),
                                           t[m + ".weight_shape"].numpy(), bits, group,
                                           None if zp is None else zp.numpy(),
                                           None if gi is None else gi.numpy())
            info[m] = {"scale_dtype": str(t[m + ".weight_scale"].dtype)}
        done = {f"{m}.{s}" for m in mods for s in ("weight_packed", "weight_scale", "weight_shape",
                                                   "weight_zero_point", "weight_g_idx")}
    for k, v in t.items():
        if k not in done:
            if k in out:
                raise AssertionError(f"{k}: both stored and dequantized")
            out[k] = to_f64(v)
    return out, info


def file_sizes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
