"""The tokenizer and chat templates against transformers' stored answers, and hostile input.

The references (``tests/fixtures/tokenizers/*/reference.json``, ``quantizer_folders.json``) were
written by ``tools/tokenizer_fixtures/make_fixtures.py`` with transformers 5.25
(``AutoTokenizer.from_pretrained``); CI has no transformers. Every refusal is a typed error whose
message names the file / field / argument and the value; nothing is ever written into a
tokenizer folder and no input is mutated.
"""

import copy
import datetime
import hashlib
import json
import os
import shutil
import sys

import numpy as np
import pytest

from wna16_jax.errors import ConfigError, CorruptFileError, UnsupportedError, WNA16Error
from wna16_jax.models import chat_template as ct
from wna16_jax.models import tokenizer as tk
from wna16_jax.models.tokenizer import Tokenizer, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
QUANTIZERS = os.path.join(ROOT, "tests", "fixtures", "quantizers")
STYLES = ("qwen3-chatml", "mixtral-inst", "deepseek-v3")


def _ref(style):
    with open(os.path.join(FIXTURES, style, "reference.json"), encoding="utf-8") as f:
        return json.load(f)


REFS = {style: _ref(style) for style in STYLES}
with open(os.path.join(FIXTURES, "quantizer_folders.json"), encoding="utf-8") as _f:
    QUANTIZER_REFS = json.load(_f)["folders"]
VARIANTS = [(style, v["name"]) for style in STYLES for v in REFS[style]["variants"]]
USER = [{"role": "user", "content": "What is the capital of France?"}]


def _snapshot(folder):
    """Every file under ``folder``: relative path -> (size, mtime, sha256)."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder)] = (os.path.getsize(p), os.path.getmtime(p),
                                                    hashlib.sha256(f.read()).hexdigest())
    return out


def _copy(tmp_path, style="qwen3-chatml", name=None):
    dst = tmp_path / (name or f"tok{len(os.listdir(tmp_path))}")
    shutil.copytree(os.path.join(FIXTURES, style), dst, ignore=shutil.ignore_patterns("reference.json"))
    return dst


def _patch_json(path, **fields):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(fields)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def _variant(tmp_path, style, variant):
    """The variant's folder, rebuilt from its description (as the generator built it)."""
    dst = _copy(tmp_path, style, "variant")
    for name, key in (("tokenizer.json", "tokenizer_json"), ("tokenizer_config.json", "tokenizer_config")):
        if variant.get(key) or variant.get(f"drop_from_{key}"):
            with open(dst / name, encoding="utf-8") as f:
                data = json.load(f)
            data.update(copy.deepcopy(variant.get(key, {})))
            for k in variant.get(f"drop_from_{key}", []):
                del data[k]
            with open(dst / name, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False)
    for rel, text in variant.get("files", {}).items():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_text(text, encoding="utf-8")
    return dst


def _check_encodings(tok, encodings):
    assert encodings
    for e in encodings:
        assert tok.encode(e["text"]) == e["ids"], e["text"]
        assert tok.encode(e["text"], add_special_tokens=False) == e["ids_no_special"], e["text"]
        assert tok.decode(e["ids"]) == e["decoded"], e["text"]
        assert tok.decode(e["ids"], skip_special_tokens=True) == e["decoded_skip_special"], e["text"]


# --------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("style", STYLES)
def test_encode_and_decode_give_transformers_ids(style):
    _check_encodings(load_tokenizer(os.path.join(FIXTURES, style)), REFS[style]["encode"])


@pytest.mark.parametrize("style", STYLES)
def test_special_tokens_are_transformers(style):
    ref, tok = REFS[style], load_tokenizer(os.path.join(FIXTURES, style))
    assert tok.special_tokens_map == ref["special_tokens_map"]
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(tok, name) == ref["special_tokens_map"].get(name)
        assert getattr(tok, name + "_id") == ref["ids"].get(name)
    assert tok.chat_template == ref["chat_template"] and tok.chat_templates == {"default": ref["chat_template"]}


def test_the_styles_are_what_the_fixtures_claim():
    """Qwen: no BOS, eos <|im_end|>; Mixtral and DeepSeek: the post-processor's BOS, once."""
    qwen, mixtral, deepseek = (load_tokenizer(os.path.join(FIXTURES, s)) for s in STYLES)
    assert qwen.bos_token is None and qwen.bos_token_id is None and qwen.eos_token == "<|im_end|>"
    assert qwen.encode("Hello") == qwen.encode("Hello", add_special_tokens=False)
    for tok, bos in ((mixtral, "<s>"), (deepseek, "<｜begin▁of▁sentence｜>")):
        assert tok.bos_token == bos and tok.bos_token_id == tok.token_id(bos)
        plain = tok.encode("Hello", add_special_tokens=False)
        assert tok.encode("Hello") == [tok.bos_token_id] + plain
        ids = tok.apply_chat_template(USER)                     # the template writes bos_token itself
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert (mixtral.add_bos_token, mixtral.add_eos_token) == (True, False)
    assert (qwen.add_bos_token, qwen.add_eos_token) == (False, None)


@pytest.mark.parametrize("style", STYLES)
def test_chat_template_gives_transformers_text_and_ids(style):
    tok = load_tokenizer(os.path.join(FIXTURES, style))
    chats = REFS[style]["chats"]
    assert {c["add_generation_prompt"] for c in chats} == {True, False} and len(chats) >= 8
    for c in chats:
        messages = copy.deepcopy(c["messages"])
        text = tok.apply_chat_template(messages, add_generation_prompt=c["add_generation_prompt"], tokenize=False,
                                       **c["kwargs"])
        assert text == c["text"], (c["name"], c["add_generation_prompt"])
        ids = tok.apply_chat_template(messages, add_generation_prompt=c["add_generation_prompt"], **c["kwargs"])
        assert ids == c["ids"], (c["name"], c["add_generation_prompt"])
        assert messages == c["messages"]                          # not mutated (reasoning aliases included)


@pytest.mark.parametrize("style", [s for s in STYLES if REFS[s]["refused"]])
def test_template_refusals_are_typed_and_carry_the_templates_message(style):
    tok = load_tokenizer(os.path.join(FIXTURES, style))
    for r in REFS[style]["refused"]:
        with pytest.raises(ConfigError) as e:
            tok.apply_chat_template(r["messages"])
        msg = str(e.value)
        assert r["message"] in msg and "raise_exception" in msg and "tokenizer_config.json: chat_template" in msg


@pytest.mark.parametrize("style,name", VARIANTS)
def test_variants_give_transformers_answers(tmp_path, style, name):
    variant = next(v for v in REFS[style]["variants"] if v["name"] == name)
    tok = load_tokenizer(_variant(tmp_path, style, variant))
    _check_encodings(tok, variant["encode"])
    assert tok.special_tokens_map == variant["special_tokens_map"]
    assert {k: tok.token_id(v) for k, v in tok.special_tokens_map.items()} == variant["ids"]
    assert (sorted(tok.chat_templates) or None) == variant["chat_template_names"]
    conversation = {"user": USER, "multi_turn": next(c["messages"] for c in REFS[style]["chats"]
                                                     if c["name"] == "multi_turn")}[variant.get("conversation", "user")]
    for c in variant.get("chats", []):
        if isinstance(c["text"], dict):                            # transformers: no default template
            with pytest.raises(ConfigError, match="none is 'default'"):
                tok.apply_chat_template(conversation, template_name=c["template_name"], **c["kwargs"])
        else:
            assert tok.apply_chat_template(conversation, tokenize=False, template_name=c["template_name"],
                                           **c["kwargs"]) == c["text"], c


@pytest.mark.parametrize("case", sorted(QUANTIZER_REFS))
def test_quantizer_folders_encode_as_transformers(case):
    ref, tok = QUANTIZER_REFS[case], load_tokenizer(os.path.join(QUANTIZERS, case))
    _check_encodings(tok, ref["encode"])
    assert tok.special_tokens_map == ref["special_tokens_map"]
    assert tok.decode(ref["generated"]["ids"]) == ref["generated"]["decoded"]
    assert max(ref["generated"]["ids"]) > tok._tokenizer_id_limit()  # ids past the tokenizer's own vocabulary


def test_template_file_wins_and_template_names(tmp_path):
    """Independently of the references: a chat_template.jinja replaces the config's template and
    additional_chat_templates/<name>.jinja adds named ones."""
    d = _copy(tmp_path)
    (d / "chat_template.jinja").write_text("F{{ messages|length }}{{ eos_token }}\n", encoding="utf-8")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("T{{ tools|length }}", encoding="utf-8")
    tok = load_tokenizer(d)
    assert tok.chat_template == "F{{ messages|length }}{{ eos_token }}\n"
    assert sorted(tok.chat_templates) == ["default", "tool_use"]
    assert tok.apply_chat_template(USER, tokenize=False) == "F1<|im_end|>"        # trailing newline dropped
    assert tok.apply_chat_template(USER, tokenize=False, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.apply_chat_template(USER, tokenize=False, template_name="default", tools=[1]) == "F1<|im_end|>"
    assert tok.apply_chat_template(USER) == tok.encode("F1<|im_end|>", add_special_tokens=False)
    _patch_json(d / "tokenizer_config.json", chat_template=7)          # unused, but still checked
    with pytest.raises(ConfigError, match="field 'chat_template' must be a string or a list"):
        load_tokenizer(d)


# --------------------------------------------------------------------------- the environment


def _template_folder(tmp_path, template, style="qwen3-chatml"):
    d = _copy(tmp_path, style)
    _patch_json(d / "tokenizer_config.json", chat_template=template)
    return d


def _render(tmp_path, template, messages=USER, **kwargs):
    return load_tokenizer(_template_folder(tmp_path, template)).apply_chat_template(messages, tokenize=False,
                                                                                    **kwargs)


def test_template_variables_and_globals(tmp_path):
    t = ("{{ messages|length }}|{{ add_generation_prompt }}|{{ tools is none }}|{{ documents is none }}|"
         "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ extra }}|{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    out = _render(tmp_path, t, add_generation_prompt=False, extra=[1, "x"])
    after = datetime.datetime.now().strftime("%Y-%m-%d")
    head, date = out.rsplit("|", 1)
    assert head == "1|False|True|True|<|im_end|>|<|endoftext|>|False|[1, 'x']" and date in (before, after)
    # keyword arguments override the special tokens, as transformers merges them
    assert _render(tmp_path, "{{ eos_token }}", eos_token="<E>") == "<E>"


def test_tojson_is_transformers_not_jinjas(tmp_path):
    """No HTML escaping, non-ASCII kept, the four options; jinja2's own filter would escape <>&'."""
    value = {"b": "<é & 'x'>", "a": [1, 2.5, None, True]}
    out = _render(tmp_path, "{{ v|tojson }}#{{ v|tojson(indent=2, sort_keys=true) }}#"
                            "{{ v|tojson(ensure_ascii=true, separators=(',', ':')) }}", v=value)
    assert out.split("#") == [json.dumps(value, ensure_ascii=False),
                              json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True),
                              json.dumps(value, ensure_ascii=True, separators=(",", ":"))]


def test_namespace_dict_loopcontrols_generation(tmp_path):
    t = ("{% set ns = namespace(n=0) %}{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}"
         "{% if i == 4 %}{% break %}{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}|"
         "{% generation %}g{{ 1 }}{% endgeneration %}|{{ dict(a=1)|tojson }}|{{ dict.fromkeys('ab', 0)|tojson }}")
    assert _render(tmp_path, t) == '5|g1|{"a": 1}|{"a": 0, "b": 0}'


# --------------------------------------------------------------------------- hostile: templates


def test_template_syntax_error_names_the_template_and_line(tmp_path):
    d = _template_folder(tmp_path, "line one\n{{ ok }}\n{% for x in %}")
    tok = load_tokenizer(d)                                  # compiled on first use, not at load
    with pytest.raises(ConfigError) as e:
        tok.apply_chat_template(USER)
    msg = str(e.value)
    assert str(d / "tokenizer_config.json") in msg and "chat_template" in msg and "syntax error at line 3" in msg
    with pytest.raises(ConfigError, match=r"chat_template\.jinja: chat template syntax error at line 1.*urlize"):
        (d / "chat_template.jinja").write_text("{{ 'x'|urlize }}", encoding="utf-8")
        load_tokenizer(d).apply_chat_template(USER)


def test_raise_exception_is_a_typed_error(tmp_path):
    with pytest.raises(ConfigError, match=r"refused the conversation \(raise_exception \(template line 2\)\): "
                                          r"no system prompt for user"):
        _render(tmp_path, "ok\n{{ raise_exception('no system prompt for ' ~ messages[0].role) }}")


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ strftime_now.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ lipsum.__globals__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ messages.__class__ }}",
    "{% if ''.__class__ %}silently false in transformers{% endif %}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__}'.format(1) }}",
    "{{ messages.append(1) }}",
    "{{ (messages|first).update(role='x') }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ namespace(_hidden=1) }}",
    "{{ loop.__class__ }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_escapes_are_refused_and_run_nothing(tmp_path, template):
    marker = tmp_path / "MARKER"
    template = template.replace("MARKER", str(marker))
    d = _template_folder(tmp_path, template)
    before = _snapshot(d)
    messages = copy.deepcopy(USER)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d).apply_chat_template(messages)
    msg = str(e.value)
    assert "tokenizer_config.json: chat_template" in msg
    assert "sandbox forbids" in msg or "undefined value" in msg, msg
    assert not marker.exists() and messages == USER and _snapshot(d) == before


@pytest.fixture
def small_bounds(monkeypatch):
    """Smaller bounds, so that the tests that reach them stay fast and small."""
    monkeypatch.setattr(ct, "MAX_RENDER_STEPS", 20_000)
    monkeypatch.setattr(ct, "MAX_RENDER_CHARS", 1 << 20)


BOUNDS = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "MAX_RENDER_STEPS"),
    ("{% for x in [1] recursive %}{{ loop(range(3)) }}{% endfor %}", "recursion"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}", "MAX_RENDER_STEPS"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "MAX_RENDER_CHARS"),
    ("{% macro m() %}{% for i in range(10000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}{% set s = m() %}",
     "MAX_RENDER_CHARS"),
    ("{% set s %}{% for i in range(10000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}", "MAX_RENDER_CHARS"),
    ("{{ 'a' * 10**12 }}", "MAX_RENDER_CHARS"),
    ("{{ ['a'] * 10**12 }}", "MAX_RENDER_CHARS"),
    ("{{ (['x' * 1000] * 1000) | join }}", "MAX_RENDER_CHARS"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "MAX_RENDER_CHARS"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "MAX_RENDER_CHARS"),
    ("{{ ('x' * 2000) | replace('x', 'y' * 2000) }}", "MAX_RENDER_CHARS"),
    ("{{ ('x' * 2000).replace('x', 'y' * 2000) }}", "MAX_RENDER_CHARS"),
    ("{{ ('y' * 2000) | join('z' * 2000) }}", "MAX_RENDER_CHARS"),
    ("{{ ('y\n' * 2000) | indent(2000) }}", "MAX_RENDER_CHARS"),
    ("{{ ('y ' * 2000) | wordwrap(1, wrapstring='z' * 2000) }}", "MAX_RENDER_CHARS"),
    ("{{ 'ab'.center(10**12) }}", "MAX_RENDER_CHARS"),
    ("{{ 'ab' | center(10**12) }}", "MAX_RENDER_CHARS"),
    ("{{ 'a\tb'.expandtabs(10**12) }}", "MAX_RENDER_CHARS"),
    ("{{ 'a,b'.join(['x' * 1000] * 1000) }}", "MAX_RENDER_CHARS"),
    ("{{ (1).to_bytes(10**12, 'big') }}", "MAX_RENDER_CHARS"),
    ("{{ ([[1] * 1000] * 1000) | sum(start=[]) }}", "MAX_RENDER_CHARS"),
    ("{{ lipsum(10**6, false, 100, 10**6) }}", "MAX_RENDER_CHARS"),
    ("{{ {'a': 'x' * 1000} | tojson(indent=5000) * 1000 }}", "MAX_RENDER_CHARS"),
    ("{{ 2 ** 10000000 }}", "MAX_INT_BITS"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "MAX_INT_BITS"),
    ("{{ '%999999d' % 1 }}", "MAX_FORMAT_WIDTH"),
    ("{{ '%.999999f' % 1 }}", "MAX_FORMAT_WIDTH"),
    ("{{ '%*d' % (10**9, 1) }}", "'*' width"),
    ("{{ '%999999d' | format(1) }}", "MAX_FORMAT_WIDTH"),
    ("{{ '{:>999999}'.format(1) }}", "MAX_FORMAT_WIDTH"),
    ("{{ '{:>{w}}'.format(1, w=10**9) }}", "nested field"),
    ("{{ [1] | batch(10**9, 0) | list }}", "parts"),
    ("{{ {'a': 1} | tojson(indent=10**9) }}", "MAX_FORMAT_WIDTH"),
    ("{{ range(10**9) | list }}", "Range too big"),
]


@pytest.mark.parametrize("template,bound", BOUNDS)
def test_runaway_templates_are_bounded(tmp_path, small_bounds, template, bound):
    d = _template_folder(tmp_path, template)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d).apply_chat_template(USER)
    msg = str(e.value)
    assert bound in msg and "tokenizer_config.json: chat_template" in msg, msg


def test_the_default_bounds_stop_a_runaway_render(tmp_path):
    """The module's own constants (not the small test ones): a loop nest of 10^10 iterations
    stops after MAX_RENDER_STEPS, and a wall-clock limit of 0 s stops any loop."""
    assert ct.MAX_RENDER_STEPS == 1_000_000 and ct.MAX_RENDER_CHARS == 64 * 2**20
    with pytest.raises(ConfigError, match="more than MAX_RENDER_STEPS = 1000000 steps"):
        _render(tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(ConfigError, match="MAX_RENDER_CHARS"):
        _render(tmp_path, "{{ 'ab' * 2**30 }}")


def test_wall_clock_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(ct, "MAX_RENDER_SECONDS", 0.0)
    with pytest.raises(ConfigError, match="MAX_RENDER_SECONDS"):
        _render(tmp_path, "{% for i in range(3) %}{{ i }}{% endfor %}")


def test_template_source_cap(tmp_path):
    with pytest.raises(ConfigError, match=f"more than MAX_TEMPLATE_CHARS = {ct.MAX_TEMPLATE_CHARS}"):
        _render(tmp_path, "x" * (ct.MAX_TEMPLATE_CHARS + 1))


def test_bounds_leave_ordinary_chats_alone(tmp_path):
    """A long conversation (400 turns, 40 000 characters) renders with the default bounds."""
    tok = load_tokenizer(os.path.join(FIXTURES, "qwen3-chatml"))
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "word " * 20} for i in range(400)]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.count("<|im_start|>") == 401 and text.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- hostile: messages and arguments


@pytest.mark.parametrize("messages,words", [
    ("hello", ["messages", "str"]),
    ({"role": "user", "content": "x"}, ["messages", "dict"]),
    ([], ["messages", "at least one"]),
    ([{"role": "user"}], ["messages[0]", "'content'", "missing"]),
    ([{"role": "user", "content": 5}], ["messages[0]", "'content'", "int 5"]),
    ([{"role": None, "content": "x"}], ["messages[0]", "'role'"]),
    ([{"role": "user", "content": "x"}, "hi"], ["messages[1]", "str"]),
    ([[{"role": "user", "content": "x"}]], ["messages[0]", "list"]),
    ([{"role": "user", "content": "x", "meta": object()}], ["messages[0]['meta']", "object"]),
    ([{"role": "user", "content": "x", "meta": {1: "y"}}], ["messages[0]['meta']", "key 1"]),
    ([{"role": "user", "content": "x", "meta": [{"deep": {1, 2}}]}], ["messages[0]['meta'][0]['deep']", "set"]),
])
def test_messages_of_the_wrong_shape(messages, words):
    tok = load_tokenizer(os.path.join(FIXTURES, "qwen3-chatml"))
    with pytest.raises(ConfigError) as e:
        tok.apply_chat_template(messages)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_reasoning_aliases_do_not_touch_the_callers_messages():
    tok = load_tokenizer(os.path.join(FIXTURES, "qwen3-chatml"))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "t", "x": None}]
    before = copy.deepcopy(messages)
    text = tok.apply_chat_template(messages, tokenize=False)
    assert "<think>\nt\n</think>" in text and messages == before


@pytest.mark.parametrize("kwargs,error,words", [
    ({"add_generation_prompt": "yes"}, ConfigError, ["add_generation_prompt", "'yes'"]),
    ({"tokenize": 1}, ConfigError, ["tokenize", "int 1"]),
    ({"template_name": "nope"}, ConfigError, ["template_name", "['default']", "'nope'"]),
    ({"template_name": 3}, ConfigError, ["template_name", "3"]),
    ({"tools": object()}, ConfigError, ["tools", "object"]),
    ({"documents": [b"bytes"]}, ConfigError, ["documents[0]", "bytes"]),
    ({"continue_final_message": True}, UnsupportedError, ["continue_final_message"]),
    ({"chat_template": "{{ 1 }}"}, UnsupportedError, ["chat_template", "template_name="]),
    ({"return_dict": True}, UnsupportedError, ["return_dict"]),
    ({"messages": USER}, UnsupportedError, ["messages"]),
])
def test_chat_arguments_are_checked(kwargs, error, words):
    tok = load_tokenizer(os.path.join(FIXTURES, "qwen3-chatml"))
    with pytest.raises(error) as e:
        tok.apply_chat_template(USER, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_no_chat_template():
    tok = load_tokenizer(os.path.join(QUANTIZERS, "awq-mixtral"))
    assert tok.chat_template is None and tok.chat_templates == {}
    with pytest.raises(ConfigError, match="has no chat template"):
        tok.apply_chat_template(USER)


# --------------------------------------------------------------------------- hostile: encode / decode


@pytest.mark.parametrize("text", [5, b"bytes", None, ["a"]])
def test_encode_refuses_non_strings(text):
    tok = load_tokenizer(os.path.join(FIXTURES, "mixtral-inst"))
    with pytest.raises(ConfigError, match=f"text: expected a string, got {type(text).__name__}"):
        tok.encode(text)
    with pytest.raises(ConfigError, match=f"token: expected a string, got {type(text).__name__}"):
        tok.token_id(text)
    with pytest.raises(ConfigError, match="add_special_tokens: expected True or False, got str 'no'"):
        tok.encode("x", add_special_tokens="no")


def test_lone_surrogates_are_refused_naming_the_position():
    tok = load_tokenizer(os.path.join(FIXTURES, "qwen3-chatml"))
    with pytest.raises(ConfigError, match=r"text: not valid Unicode \(a lone surrogate '\\ud800' at position 2\)"):
        tok.encode("ab\ud800")
    with pytest.raises(ConfigError, match="token: not valid Unicode"):
        tok.token_id("\udfff")
    with pytest.raises(ConfigError, match="the rendered chat: not valid Unicode"):
        tok.apply_chat_template([{"role": "user", "content": "x\ud800"}])
    assert tok.apply_chat_template([{"role": "user", "content": "x\ud800"}], tokenize=False).count("\ud800") == 1


@pytest.mark.parametrize("ids,where,value", [
    ([5, 6, -1], "ids[2]", "-1"),
    ([5, 320], "ids[1]", "320"),
    ([2**40], "ids[0]", str(2**40)),
    ([5, 1.5], "ids[1]", "1.5"),
    ([True], "ids[0]", "True"),
    ([5, "3"], "ids[1]", "'3'"),
    ([None], "ids[0]", "None"),
    (np.array([1, -2]), "ids[1]", "-2"),
])
def test_decode_refuses_bad_ids(ids, where, value):
    tok = load_tokenizer(os.path.join(QUANTIZERS, "awq-mixtral"))     # config.json's vocab_size: 320
    assert tok.id_limit == 320
    with pytest.raises(ConfigError) as e:
        tok.decode(ids)
    assert where in str(e.value) and value in str(e.value) and "<= 319" in str(e.value), str(e.value)


@pytest.mark.parametrize("ids,words", [
    ("123", ["ids", "str"]), (5, ["ids", "int"]), ({"a": 1}, ["ids", "dict"]),
    (np.zeros((2, 2), np.int64), ["ids", "1-D", "(2, 2)"]), (np.array([True]), ["ids", "bool"]),
    (np.array([1.0]), ["ids", "float64"]),
])
def test_decode_refuses_non_sequences(ids, words):
    tok = load_tokenizer(os.path.join(FIXTURES, "qwen3-chatml"))
    with pytest.raises(ConfigError) as e:
        tok.decode(ids)
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ConfigError, match="skip_special_tokens"):
        tok.decode([1], skip_special_tokens=1)


def test_decode_past_the_tokenizer_vocabulary_within_the_models():
    """An id the model's (padded) embedding has but the tokenizer lacks decodes to nothing, as in
    transformers; numpy ids are fine."""
    tok = load_tokenizer(os.path.join(QUANTIZERS, "awq-mixtral"))
    assert tok._tokenizer_id_limit() == 71
    assert tok.decode([300]) == "" and tok.decode(np.array([58, 300, 7], np.int32)) == "the cat"


def test_stream_decoder_checks_ids():
    tok = load_tokenizer(os.path.join(FIXTURES, "mixtral-inst"))
    ids = tok.encode("Hello world, the cat")
    push = tok.stream_decoder(ids[:2])
    assert "".join(push(t) for t in ids[2:]) == tok.decode(ids)[len(tok.decode(ids[:2])):]
    with pytest.raises(ConfigError, match=r"token_id must be an integer >= 0 and <= \d+, got -3"):
        push(-3)
    with pytest.raises(ConfigError, match=r"prefix\[1\] must be an integer"):
        tok.stream_decoder([1, "x"])


# --------------------------------------------------------------------------- hostile: the folder's files


@pytest.mark.parametrize("fields,named,value", [
    ({"chat_template": 5}, "'chat_template'", "5"),
    ({"chat_template": ["x"]}, "'chat_template'", "entry 0 is a str"),
    ({"chat_template": [{"name": "a"}]}, "chat_template[0]: field 'template'", "missing"),
    ({"chat_template": [{"name": "a", "template": "x"}, {"name": "a", "template": "y"}]},
     "chat_template[1]: field 'name'", "'a'"),
    ({"add_bos_token": "yes"}, "'add_bos_token'", "'yes'"),
    ({"add_eos_token": 1}, "'add_eos_token'", "1"),
    ({"bos_token": ["<s>"]}, "'bos_token'", "['<s>']"),
    ({"eos_token": {"content": 5}}, "eos_token: field 'content'", "5"),
    ({"eos_token": {"lstrip": True}}, "eos_token: field 'content'", "missing"),
    ({"pad_token": {"__type": "Other", "content": "x"}}, "pad_token: field '__type'", "'Other'"),
    ({"unk_token": {"content": "<unk>", "lstrip": "no"}}, "unk_token: field 'lstrip'", "'no'"),
    ({"additional_special_tokens": "<x>"}, "'additional_special_tokens'", "'<x>'"),
    ({"additional_special_tokens": ["<x>", 3]}, "'additional_special_tokens' entry 1", "3"),
    ({"extra_special_tokens": {"image_token": 5}}, "'image_token'", "5"),
    ({"added_tokens_decoder": {"abc": {"content": "<x>"}}}, "added_tokens_decoder: field 'abc'", "'abc'"),
    ({"added_tokens_decoder": {"1": "<s>"}}, "added_tokens_decoder: field '1'", "'<s>'"),
    ({"added_tokens_decoder": {"7": {"content": "<|im_end|>"}}}, "'added_tokens_decoder'", "id 7"),
    ({"added_tokens_decoder": []}, "'added_tokens_decoder'", "[]"),
    ({"chat_template": {"default": "x"}}, "'chat_template'", "{'default': 'x'}"),
])
def test_tokenizer_config_with_wrong_types(tmp_path, fields, named, value):
    d = _copy(tmp_path)
    _patch_json(d / "tokenizer_config.json", **fields)
    before = _snapshot(d)
    with pytest.raises(ConfigError) as e:
        Tokenizer(d)
    msg = str(e.value)
    assert str(d / "tokenizer_config.json") in msg and named in msg and value in msg, msg
    assert _snapshot(d) == before


@pytest.mark.parametrize("name,content,error,words", [
    ("tokenizer_config.json", b"[1, 2]", ConfigError, ["expected a JSON object", "list"]),
    ("tokenizer_config.json", b'{"bos_token": ', CorruptFileError, ["not valid JSON", "line 1"]),
    ("tokenizer_config.json", b'{"a": 1, "a": 2}', CorruptFileError, ["'a' appears twice"]),
    ("tokenizer_config.json", b'{"x": "\xff"}', CorruptFileError, ["not UTF-8"]),
    ("special_tokens_map.json", b'{"eos_token": 7}', ConfigError, ["'eos_token'", "7"]),
    ("config.json", b'{"vocab_size": "big"}', ConfigError, ["'vocab_size'", "'big'"]),
    ("config.json", b'{"vocab_size": true}', ConfigError, ["'vocab_size'", "True"]),
    ("chat_template.jinja", b"\xff\xfe", CorruptFileError, ["not UTF-8"]),
    ("tokenizer.json", b"\xff", CorruptFileError, ["not UTF-8"]),
    ("tokenizer.json", b'{"model": 5}', ConfigError, ["not a tokenizer"]),
    ("tokenizer.json", b"", ConfigError, ["not a tokenizer"]),
])
def test_bad_files_are_typed_errors_naming_the_file(tmp_path, name, content, error, words):
    d = _copy(tmp_path)
    if name == "special_tokens_map.json":                     # read only without added_tokens_decoder
        _patch_json(d / "tokenizer_config.json", added_tokens_decoder=None)
    (d / name).write_bytes(content)
    before = _snapshot(d)
    with pytest.raises(error) as e:
        Tokenizer(d)
    msg = str(e.value)
    assert str(d / name) in msg and all(w in msg for w in words), msg
    assert _snapshot(d) == before


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"])
def test_oversized_files_are_refused_before_reading(tmp_path, monkeypatch, name):
    cap = tk.MAX_TOKENIZER_JSON_BYTES if name == "tokenizer.json" else tk.MAX_CONFIG_BYTES
    d = _copy(tmp_path)
    with open(d / name, "wb") as f:                           # sparse: nothing large is written
        f.truncate(cap + 1)

    def refuse_reading(read):
        def guarded(path, *args, **kwargs):
            assert os.path.basename(path) != name, f"{path} was read"
            return read(path, *args, **kwargs)
        return guarded

    monkeypatch.setattr(tk, "read_text_file", refuse_reading(tk.read_text_file))
    monkeypatch.setattr(tk, "load_json", refuse_reading(tk.load_json))
    with pytest.raises(ConfigError) as e:
        Tokenizer(d)
    assert str(d / name) in str(e.value) and f"at most {cap} bytes, got {cap + 1} bytes" in str(e.value)
    assert tk.MAX_TOKENIZER_JSON_BYTES == 256 * 2**20


def test_missing_and_odd_paths(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json: not found"):
        Tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="is not a folder"):
        Tokenizer(tmp_path / "absent")
    with pytest.raises(ConfigError, match="folder: expected a path"):
        Tokenizer(5)
    d = _copy(tmp_path)
    os.remove(d / "tokenizer_config.json")
    os.mkdir(d / "tokenizer_config.json")
    with pytest.raises(ConfigError, match="tokenizer_config.json must be a regular file"):
        Tokenizer(d)
    os.rmdir(d / "tokenizer_config.json")
    os.symlink(tmp_path / "nowhere", d / "tokenizer_config.json")
    with pytest.raises(CorruptFileError, match="link to a file that does not exist"):
        Tokenizer(d)


def test_folder_without_tokenizer_config(tmp_path):
    """Only tokenizer.json: the post-processor still decides, no special tokens are named."""
    d = _copy(tmp_path, "mixtral-inst")
    os.remove(d / "tokenizer_config.json")
    tok = Tokenizer(d)
    assert tok.special_tokens_map == {} and tok.bos_token_id is None and tok.chat_template is None
    assert tok.encode("Hello")[0] == 1


def test_nothing_is_written_and_inputs_are_untouched(tmp_path):
    """Every public call on each fixture (failures included) leaves the folder as it was."""
    for style in STYLES:
        d = _copy(tmp_path, style, style)
        before = _snapshot(d)
        tok = load_tokenizer(d)
        messages = copy.deepcopy(REFS[style]["chats"][4]["messages"])
        tools = [{"type": "function", "function": {"name": "f"}}]
        ids = tok.apply_chat_template(messages, tools=tools)
        tok.decode(ids), tok.encode("x <s> y"), tok.stream_decoder(ids)(ids[0])
        with pytest.raises(WNA16Error):
            tok.decode([-1])
        assert messages == REFS[style]["chats"][4]["messages"] and tools == [{"type": "function",
                                                                            "function": {"name": "f"}}]
        assert _snapshot(d) == before and sorted(os.listdir(d)) == sorted(before)


# --------------------------------------------------------------------------- missing packages


def test_jinja2_is_needed_only_for_chat_templates(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    ct._environment.cache_clear()
    try:
        tok = load_tokenizer(os.path.join(FIXTURES, "mixtral-inst"))
        assert tok.encode("Hello")[0] == 1 and tok.chat_template is not None
        with pytest.raises(UnsupportedError, match=r"pip install 'wna16-jax\[models\]'"):
            tok.apply_chat_template(USER)
    finally:
        ct._environment.cache_clear()


def test_old_jinja2_is_refused(monkeypatch):
    import jinja2

    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    ct._environment.cache_clear()
    try:
        with pytest.raises(UnsupportedError, match=r"jinja2 3\.1\.5 has known sandbox escapes"):
            ct.ChatTemplate("x", "where")
    finally:
        ct._environment.cache_clear()


def test_tokenizers_is_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(UnsupportedError, match=r"'tokenizers' package \(pip install 'wna16-jax\[models\]'\)"):
        Tokenizer(os.path.join(FIXTURES, "qwen3-chatml"))
