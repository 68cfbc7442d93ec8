"""Tokenizer fixtures and what transformers does with them.

    python3 tools/tokenizer_fixtures/make_fixtures.py            # tokenizers (+ transformers) installed

Writes ``tests/fixtures/tokenizers/<style>/`` — ``tokenizer.json`` (a tiny BPE trained here with
the ``tokenizers`` package on the sentences below), ``tokenizer_config.json`` (special tokens and
a chat template written for this fixture in the style of the family) — for three styles:

* ``qwen3-chatml``: byte-level BPE, no BOS from the post-processor, ``eos_token`` ``<|im_end|>``,
  a ChatML template (``<|im_start|>role ... <|im_end|>``; tools rendered with ``tojson``,
  ``enable_thinking``, ``reasoning_content``);
* ``mixtral-inst``: Metaspace BPE with byte fallback (the pipeline transformers' own
  ``LlamaTokenizer`` builds), a post-processor that prepends ``<s>``, an ``[INST] ... [/INST]``
  template that writes ``bos_token`` itself and refuses non-alternating roles;
* ``deepseek-v3``: byte-level BPE with single digits, ``<｜begin▁of▁sentence｜>`` prepended, special
  tokens as AddedToken objects, a template with a system prompt and ``<｜User｜>`` /
  ``<｜Assistant｜>`` markers.

When transformers is importable, each folder also gets ``reference.json``: what
``AutoTokenizer.from_pretrained(folder)`` gives — ids of several texts with and without special
tokens, their decoding, the special tokens, ``apply_chat_template`` (text and ids) for several
conversations with ``add_generation_prompt`` true and false, the template's refusals — and the
same for *variants*: the folder with a few top-level fields of ``tokenizer.json`` /
``tokenizer_config.json`` replaced and files added (each variant lists its changes, so the test
rebuilds it). Also ``quantizer_folders.json``: transformers' ids and decodings for the tokenizers
of ``tests/fixtures/quantizers/*/``. Without transformers the references are left as they are.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
QUANTIZERS = os.path.join(ROOT, "tests", "fixtures", "quantizers")

BOS_DS, EOS_DS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER_DS, ASSISTANT_DS = "<｜User｜>", "<｜Assistant｜>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Name three colors: red, green and blue.",
    "You are a terse assistant. Answer in one short sentence.",
    "Numbers like 12345, 3.14 and 2025 appear in text too.",
    "Weights are packed four bits at a time, eight codes per word.",
    "The router sends each token to two experts of the layer.",
    "Unicode text: café, naïve, 日本語, emoji 😀 and symbols <>&.",
    "def add(a, b):\n    return a + b\n",
    "Thinking step by step, the answer is forty-two.",
    "The weather today is warm and the sky is clear.",
    "Please call the tool to look up the weather in Paris.",
]

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "Numbers 12345 and 3.14",
    "Unicode: café naïve 日本 😀",
    "",
    "line one\nline two\n\n",
    "zqxj vwk",                       # pieces the vocabulary barely covers
]

STYLE_TEXTS = {
    "qwen3-chatml": ["<|im_start|>user\nHi there<|im_end|>\n", "a<|im_end|>b<|endoftext|>",
                     "<think>\nplan\n</think>\n\nanswer"],
    "mixtral-inst": ["<s>[INST] Hi there [/INST]", "one</s>two <unk> three", "[INST]no spaces[/INST]"],
    "deepseek-v3": [f"{BOS_DS}{USER_DS}Hi there{ASSISTANT_DS}", f"end{EOS_DS}next", "<think>x</think>y 2025"],
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system_user": [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Name three colors."}],
    "multi_turn": [{"role": "system", "content": "You are a terse assistant."},
                   {"role": "user", "content": "Name three colors."},
                   {"role": "assistant", "content": "Red, green and blue."},
                   {"role": "user", "content": "  And one more?  "}],
    "ends_with_assistant": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
}

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city — « café » <b>&</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

STYLE_CONVERSATIONS = {
    "qwen3-chatml": {
        "tools": (CONVERSATIONS["system_user"], {"tools": [TOOL]}),
        "no_thinking": (CONVERSATIONS["user"], {"enable_thinking": False}),
        "reasoning": ([{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "4", "reasoning_content": " add two and two "},
                       {"role": "user", "content": "3+3?"}], {}),
        "thinking_alias": ([{"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "4", "thinking": "add"}], {}),
    },
    "mixtral-inst": {},
    "deepseek-v3": {
        "think_stripped": ([{"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "<think>add</think> 4"},
                            {"role": "user", "content": "3+3?"}], {}),
        "thinking_kwarg": (CONVERSATIONS["user"], {"thinking": True}),
        "default_system": (CONVERSATIONS["user"], {"default_system_prompt": "Be brief."}),
    },
}

#: conversations the template refuses (raise_exception), per style
REFUSED = {
    "mixtral-inst": [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                     [{"role": "assistant", "content": "I start"}]],
    "deepseek-v3": [[{"role": "tool", "content": "{}"}]],
    "qwen3-chatml": [],
}

# --------------------------------------------------------------------------- chat templates
# Written for these fixtures, in the style of each family (not copied from any model).

QWEN3_TEMPLATE = r"""{#- ChatML: each message is <|im_start|>role, newline, content, <|im_end|>, newline. -#}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] ~ '\n\n' }}
    {%- endif %}
    {{- 'Tools you may call, one JSON schema per line:\n' }}
    {%- for tool in tools %}
        {{- tool | tojson ~ '\n' }}
    {%- endfor %}
    {{- 'Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call> to call one.<|im_end|>\n' }}
    {%- set rest = messages[1:] if messages[0]['role'] == 'system' else messages %}
{%- else %}
    {%- set rest = messages %}
{%- endif %}
{%- for m in rest %}
    {%- if m['role'] == 'assistant' and m['reasoning_content'] is defined %}
        {{- '<|im_start|>assistant\n<think>\n' ~ m['reasoning_content'] | trim ~ '\n</think>\n\n' ~ m['content'] | trim ~ '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

MIXTRAL_TEMPLATE = r"""{#- Instruction format: <s>[INST] question [/INST] answer</s>[INST] ... ; a system text joins the first question. -#}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = '' %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for turn in turns %}
    {%- if (turn['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('roles must alternate user / assistant, starting with user (turn ' ~ loop.index ~ ' is ' ~ turn['role'] ~ ')') }}
    {%- endif %}
    {%- if turn['role'] == 'user' %}
        {%- set question = turn['content'] | trim %}
        {%- if loop.first and system_text %}
            {%- set question = system_text ~ '\n\n' ~ question %}
        {%- endif %}
        {{- '[INST] ' ~ question ~ ' [/INST]' }}
    {%- else %}
        {{- ' ' ~ turn['content'] | trim ~ eos_token }}
    {%- endif %}
{%- endfor %}
"""

DEEPSEEK_TEMPLATE = r"""{#- <bos>system text<｜User｜>question<｜Assistant｜>answer<eos>...; earlier answers lose their <think> part. -#}
{%- set ns = namespace(system='') %}
{%- for m in messages if m['role'] == 'system' %}
    {%- set ns.system = ns.system ~ ('\n\n' if ns.system else '') ~ m['content'] %}
{%- endfor %}
{%- if not ns.system and default_system_prompt is defined %}
    {%- set ns.system = default_system_prompt %}
{%- endif %}
{{- bos_token ~ ns.system }}
{%- for m in messages %}
    {%- if m['role'] == 'user' %}
        {{- '<｜User｜>' ~ m['content'] }}
    {%- elif m['role'] == 'assistant' %}
        {%- set answer = m['content'] %}
        {%- if '</think>' in answer %}
            {%- set answer = answer.split('</think>')[-1] | trim %}
        {%- endif %}
        {{- '<｜Assistant｜>' ~ answer ~ eos_token }}
    {%- elif m['role'] != 'system' %}
        {{- raise_exception('unknown role: ' ~ m['role']) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<｜Assistant｜>' }}
    {%- if not thinking | default(false) %}
        {{- '</think>' }}
    {%- endif %}
{%- endif %}
"""


#: a template using what the environment offers, without whitespace control (trim_blocks and
#: lstrip_blocks decide its layout): loop controls, the generation block, namespace, dict,
#: tojson and its options, formatting, operators, filters and str methods
FEATURES_TEMPLATE = r"""{# every feature of the environment, checked against transformers #}
{% set ns = namespace(count=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
[{{ loop.index }}/{{ loop.length }}] {{ m.role | upper }}: {{ m.content | trim | replace('colors', 'COLORS') }}
    {% if ns.count >= 2 %}{% break %}{% endif %}
{% endfor %}
{% generation %}gen:{{ "%-6s|" % "ab" }}{{ "{:>5}".format(7) }}{{ '%05.1f' | format(3.14159) }}{% endgeneration %}

{{ {"k": "é<&>", "n": [1, 2.5, none, true]} | tojson }}
{{ {"b": 1, "a": 2} | tojson(indent=1, sort_keys=true) }}
{{ {"x": "é"} | tojson(ensure_ascii=true, separators=(",", ":")) }}
{{ dict(a=1, b=[2]) | tojson }} {{ dict.fromkeys(['p', 'q'], 0) | tojson }}
{{ messages | map(attribute='role') | join(',') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{{ 'x' * 3 }} {{ 2 ** 10 }} {{ 7 // 2 }} {{ [1, 2] + [3] }} {{ 'abc'[::-1] }} {{ 'a,b'.split(',') }} {{ range(3) | list }}
{{ messages[0].content | indent(2, true) }}|{{ 'a b c d' | wordwrap(3) }}|{{ 'ab' | center(6) }}|
{% if add_generation_prompt %}ASSISTANT:{% endif %}
"""


# --------------------------------------------------------------------------- tokenizers


def _train_bpe(pre_tokenizer, vocab_size: int, alphabet, normalizer=None):
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def build_qwen3():
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok = _train_bpe(byte_level, 420, pre_tokenizers.ByteLevel.alphabet(), normalizers.NFC())
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "split_special_tokens": False, "model_max_length": 32768,
              "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
              "added_tokens_decoder": _decoder_entries(tok), "chat_template": QWEN3_TEMPLATE}
    return tok, config


def build_mixtral():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained = _train_bpe(metaspace, 300, [])
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = None
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(specials)
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "pad_token": None, "add_bos_token": True, "add_eos_token": False, "legacy": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 32768,
              "added_tokens_decoder": _decoder_entries(tok), "chat_template": MIXTRAL_TEMPLATE}
    return tok, config


def _added_token_object(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}


def build_deepseek():
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok = _train_bpe(pre, 400, pre_tokenizers.ByteLevel.alphabet())
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_DS, EOS_DS])
    tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in (USER_DS, ASSISTANT_DS)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    bos_id = tok.token_to_id(BOS_DS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_DS}:0 $A:0",
                                                       pair=f"{BOS_DS}:0 $A:0 {BOS_DS}:1 $B:1",
                                                       special_tokens=[(BOS_DS, bos_id)])
    config = {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
              "bos_token": _added_token_object(BOS_DS), "eos_token": _added_token_object(EOS_DS),
              "pad_token": _added_token_object(EOS_DS), "unk_token": None, "legacy": True,
              "clean_up_tokenization_spaces": False, "model_max_length": 16384,
              "added_tokens_decoder": _decoder_entries(tok), "chat_template": DEEPSEEK_TEMPLATE}
    return tok, config


def _decoder_entries(tok) -> dict:
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(tok.get_added_tokens_decoder().items())}


STYLES = {"qwen3-chatml": build_qwen3, "mixtral-inst": build_mixtral, "deepseek-v3": build_deepseek}

#: the variants of each style (see the module doc): a name, top-level replacements in
#: tokenizer.json and tokenizer_config.json, files to add; and which checks they get
VARIANTS = {
    "mixtral-inst": [
        {"name": "no_post_processor_add_bos", "tokenizer_json": {"post_processor": None},
         "tokenizer_config": {"add_bos_token": True, "add_eos_token": True}},
        {"name": "add_bos_false", "tokenizer_config": {"add_bos_token": False}},
        {"name": "legacy_special_tokens_map", "drop_from_tokenizer_config": ["added_tokens_decoder"],
         "files": {"special_tokens_map.json": json.dumps({
             "eos_token": "<unk>", "pad_token": {"content": "<pad>", "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False}})},
         "texts": ["a<pad>b</s>c<unk>"]},
        {"name": "truncation_padding",
         "tokenizer_json": {"truncation": {"direction": "Right", "max_length": 3, "strategy": "LongestFirst",
                                           "stride": 0},
                            "padding": {"strategy": {"Fixed": 12}, "direction": "Right", "pad_to_multiple_of": None,
                                        "pad_id": 2, "pad_type_id": 0, "pad_token": "</s>"}}},
    ],
    "deepseek-v3": [
        {"name": "add_bos_false", "tokenizer_config": {"add_bos_token": False}},
    ],
    "qwen3-chatml": [
        {"name": "config_only_specials",
         "tokenizer_config": {"pad_token": "<pad>", "mask_token": {"__type": "AddedToken", "content": "<mask>",
                                                                   "lstrip": True, "normalized": False,
                                                                   "rstrip": False, "single_word": False},
                              "image_token": "<|image|>",
                              "additional_special_tokens": ["<|im_start|>", "<|extra_0|>"]},
         "texts": ["x<pad>y <mask> z<|image|>w <|extra_0|>", "<|im_start|>a"]},
        {"name": "template_files", "files": {"chat_template.jinja": "FILE {{ messages[0]['content'] }}\n",
                                             "additional_chat_templates/brief.jinja": "BRIEF {{ bos_token }}"}},
        {"name": "template_file_only_extra", "files": {"additional_chat_templates/brief.jinja": "BRIEF"}},
        {"name": "template_list",
         "tokenizer_config": {"chat_template": [{"name": "default", "template": "DEFAULT {{ messages|length }}"},
                                                {"name": "tool_use",
                                                 "template": "TOOLS {{ tools|tojson(indent=2, sort_keys=True) }}"}]}},
        {"name": "template_features", "tokenizer_config": {"chat_template": FEATURES_TEMPLATE},
         "conversation": "multi_turn"},
    ],
}


def write_folder(style: str, folder: str) -> None:
    tok, config = STYLES[style]()
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"), pretty=False)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")


def apply_variant(src: str, dst: str, variant: dict) -> None:
    """``src`` copied to ``dst`` with the variant's replacements and files (the test does the same)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference.json"))
    for name, key in (("tokenizer.json", "tokenizer_json"), ("tokenizer_config.json", "tokenizer_config")):
        if variant.get(key) or variant.get(f"drop_from_{key}"):
            path = os.path.join(dst, name)
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            data.update(copy.deepcopy(variant.get(key, {})))
            for k in variant.get(f"drop_from_{key}", []):
                del data[k]
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False)
    for rel, text in variant.get("files", {}).items():
        path = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


# --------------------------------------------------------------------------- references (transformers)


def _encodings(tok, texts) -> list[dict]:
    out = []
    for text in texts:
        with_special = tok.encode(text, add_special_tokens=True)
        out.append({"text": text, "ids": with_special, "ids_no_special": tok.encode(text, add_special_tokens=False),
                    "decoded": tok.decode(with_special),
                    "decoded_skip_special": tok.decode(with_special, skip_special_tokens=True)})
    return out


def _chat(tok, messages, kwargs, **extra) -> list[dict]:
    out = []
    for generation in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False, **kwargs, **extra)
        ids = tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True, return_dict=False,
                                      **kwargs, **extra)
        out.append({"messages": messages, "kwargs": kwargs, "add_generation_prompt": generation, "text": text,
                    "ids": list(ids)})
    return out


def _special(tok) -> dict:
    return {"special_tokens_map": tok.special_tokens_map,
            "ids": {k: tok.convert_tokens_to_ids(v) for k, v in tok.special_tokens_map.items()}}


def reference(style: str, folder: str) -> dict:
    import jinja2
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    chats = []
    for name, messages in CONVERSATIONS.items():
        chats += [{"name": name, **c} for c in _chat(tok, messages, {})]
    for name, (messages, kwargs) in STYLE_CONVERSATIONS[style].items():
        chats += [{"name": name, **c} for c in _chat(tok, messages, kwargs)]
    refused = []
    for messages in REFUSED[style]:
        try:
            tok.apply_chat_template(messages, tokenize=False)
        except jinja2.TemplateError as e:
            refused.append({"messages": messages, "message": str(e)})
        else:
            raise AssertionError(f"{style}: the template accepted {messages}")
    variants = []
    for variant in VARIANTS.get(style, []):
        with tempfile.TemporaryDirectory() as tmp:
            vdir = os.path.join(tmp, "v")
            apply_variant(folder, vdir, variant)
            vtok = AutoTokenizer.from_pretrained(vdir)
            entry = {**variant, "class": type(vtok).__name__,
                     "encode": _encodings(vtok, TEXTS[:3] + STYLE_TEXTS[style] + variant.get("texts", [])),
                     **_special(vtok)}
            templates = vtok.chat_template
            entry["chat_template_names"] = sorted(templates) if isinstance(templates, dict) else (
                None if templates is None else ["default"])
            if templates is not None:
                names = [None] + (sorted(templates) if isinstance(templates, dict) else [])
                entry["chats"] = []
                for name in names:
                    for kwargs in ({}, {"tools": [TOOL]}):
                        try:
                            text = vtok.apply_chat_template(CONVERSATIONS[variant.get("conversation", "user")],
                                                            add_generation_prompt=True,
                                                            tokenize=False, chat_template=name, **kwargs)
                        except ValueError as e:      # a dict of templates with no "default"
                            text = {"error": str(e)[:60]}
                        entry["chats"].append({"template_name": name, "kwargs": kwargs, "text": text})
            variants.append(entry)
    return {
        "generated_by": "tools/tokenizer_fixtures/make_fixtures.py",
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "jinja2": jinja2.__version__},
        "class": type(tok).__name__,
        **_special(tok),
        "chat_template": tok.chat_template,
        "encode": _encodings(tok, TEXTS + STYLE_TEXTS[style]),
        "chats": chats,
        "refused": refused,
        "variants": variants,
    }


def quantizer_reference() -> dict:
    import numpy as np
    import transformers
    from transformers import AutoTokenizer

    texts = ["the <s> cat", "a</s>b <unk> c", "word that is unknownword", ""]
    out = {"generated_by": "tools/tokenizer_fixtures/make_fixtures.py",
           "versions": {"transformers": transformers.__version__}, "folders": {}}
    for case in sorted(os.listdir(QUANTIZERS)):
        folder = os.path.join(QUANTIZERS, case)
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            continue
        ref = np.load(os.path.join(folder, "reference.npz"))
        tok = AutoTokenizer.from_pretrained(folder)
        ids = [int(i) for i in np.concatenate([ref["prompt_ids"], ref["generated_ids"][:12]])]
        out["folders"][case] = {"class": type(tok).__name__, **_special(tok),
                                "encode": _encodings(tok, [str(ref["prompt_text"])] + texts),
                                "generated": {"ids": ids, "decoded": tok.decode(ids)}}
    return out


def main() -> int:
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        transformers = None
    for style in STYLES:
        folder = os.path.join(OUT, style)
        write_folder(style, folder)
        if transformers is not None:
            text = json.dumps(reference(style, folder), ensure_ascii=False, indent=1)
            with open(os.path.join(folder, "reference.json"), "w", encoding="utf-8") as f:
                f.write(text + "\n")
        print(f"wrote {folder}" + ("" if transformers else " (no transformers: reference.json not written)"))
    if transformers is not None:
        path = os.path.join(OUT, "quantizer_folders.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(quantizer_reference(), f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
