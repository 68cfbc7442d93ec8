"""The OpenAI-compatible server (wna16_jax.serving.server) as a user meets it: uvicorn on a free
loopback port in a background thread, driven by the official ``openai`` client (and by raw
HTTP where the client cannot misbehave enough), on the numpy FakeEngine and a real Tokenizer
(tests/fixtures/tokenizers/qwen3-chatml).

Every answer is compared with an independent reference: ``fake_generate`` (the toy LM without
paging), decoded with the tokenizer, cut at stop strings / stop tokens by the rule the server
documents. Covered: completions and chat, streaming and not, stop strings across token
boundaries (never leaked into a stream), stop token ids, seeds, usage, 72 concurrent mixed
requests, the KV pool back to empty, client disconnects (stream and not) cancelling their
sequence, a full queue (429), an engine failure (500, the server goes on), and 40 hostile
requests each answered 4xx with OpenAI's error body naming the field, the server still
answering after each. Every wait has a deadline; both servers are stopped at the end.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import socket
import threading
import time

import numpy as np
import openai
import pytest

from server_helpers import BackgroundServer
from wna16_jax.errors import ConfigError
from wna16_jax.models.tokenizer import load_tokenizer
from wna16_jax.serving.engine import SamplingParams
from wna16_jax.serving.fake import FakeEngine, fake_generate
from wna16_jax.serving.server import MAX_BODY_BYTES, create_app, serve

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tokenizers", "qwen3-chatml")
MODEL = "fake-moe"
#: seconds any one wait of this module may take
DEADLINE = 20.0
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jolly bakers near the old stone bridge at dawn").split()


class SlowEngine(FakeEngine):
    """A FakeEngine whose decode steps take 30 ms (so a request can be caught mid-flight), and
    whose prefill fails on a prompt holding the token :attr:`POISON` three times."""

    POISON = 424

    def decode(self, *args):
        time.sleep(0.03)
        return super().decode(*args)

    def prefill(self, tokens, *args):
        if int(np.sum(tokens == self.POISON)) >= 3:
            raise RuntimeError("injected engine failure")
        return super().prefill(tokens, *args)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def eos(tok):
    return (tok.eos_token_id,)


@pytest.fixture(scope="module")
def server(tok, eos):
    engine = FakeEngine(eos_token_ids=eos, block_size=4, num_blocks=97, batch_sizes=(1, 2, 4, 8, 16),
                        chunk_sizes=(8, 16, 32), max_blocks_per_seq=16)
    s = BackgroundServer(create_app(engine, tok, MODEL, max_queue=256)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow(tok, eos):
    engine = SlowEngine(eos_token_ids=eos, block_size=4, num_blocks=40, batch_sizes=(1,), chunk_sizes=(16,),
                        max_blocks_per_seq=16)
    s = BackgroundServer(create_app(engine, tok, MODEL, max_queue=1)).start()
    yield s
    s.stop()


# --------------------------------------------------------------------------- the reference


def expected(tok, eos, prompt_ids, sampling: SamplingParams, stop=()):
    """``(text, finish_reason, completion_tokens)`` by the server's documented rule: text without
    special tokens; a stop token ends it (not shown, counted); a stop string is found on the
    first token whose decoded text (less a trailing incomplete character, except at the end)
    holds it, and the text is cut before it."""
    tokens, why = fake_generate(prompt_ids, sampling, eos_token_ids=eos)
    visible = tokens[:-1] if why == "stop" else tokens
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    checks = [(k, decode(visible[:k]).rstrip("\ufffd")) for k in range(1, len(visible) + 1)]
    checks.append((len(tokens), decode(visible)))
    for k, text in checks:
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[:min(hits)], "stop", k
    return decode(visible), why, len(tokens)


def sampling_of(max_tokens, temperature=0.0, top_p=1.0, seed=None, stop_token_ids=()):
    return SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens,
                          stop_token_ids=tuple(stop_token_ids))


def sse_events(raw: str) -> list:
    """The ``data:`` payloads of a server-sent-event body (``[DONE]`` kept as a string)."""
    out = []
    for block in raw.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# --------------------------------------------------------------------------- basic routes


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    m = server.metrics()
    assert m["wna16_kv_blocks_total"] == 96 and m["wna16_kv_blocks_used"] == 0
    for name in ("wna16_queue_length", "wna16_running_sequences", "wna16_generated_tokens_total",
                 "wna16_tokens_per_second"):
        assert name in m


def test_completion_text_usage_and_finish(server, tok, eos):
    client = server.client()
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt)
    for prompt_value in (prompt, ids):
        r = client.completions.create(model=MODEL, prompt=prompt_value, max_tokens=12, temperature=0)
        text, why, n = expected(tok, eos, ids, sampling_of(12))
        assert r.choices[0].text == text and r.choices[0].finish_reason == why
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)
        assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_chat_stream_and_not(server, tok, eos):
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "name a colour"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    text, why, n = expected(tok, eos, ids, sampling_of(20, 0.9, seed=42), ())
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.9, seed=42)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == why and r.usage.completion_tokens == n
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                                 temperature=0.9, seed=42, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [why]
    assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


def test_chat_default_max_tokens_fills_the_context(server, tok, eos):
    messages = [{"role": "user", "content": "go"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    r = server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0)
    text, why, n = expected(tok, eos, ids, sampling_of(64 - len(ids)))
    assert r.choices[0].message.content == text and r.usage.completion_tokens == n and r.choices[0].finish_reason == why


def test_raw_stream_format_ends_with_done(server, tok, eos):
    ids = tok.encode("seven wizards")
    status, raw = server.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": ids, "max_tokens": 9, "temperature": 0, "stream": True}).encode())
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    text, why, _ = expected(tok, eos, ids, sampling_of(9))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
    assert events[-2]["choices"][0]["finish_reason"] == why
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])


def test_seeds_reproduce_and_differ(server, tok, eos):
    client = server.client()
    ids = tok.encode("jolly bakers near the bridge")
    refs = {seed: expected(tok, eos, ids, sampling_of(16, 1.5, 0.95, seed))[0] for seed in (1, 2)}
    assert refs[1] != refs[2]                                       # the seed matters at this temperature
    for seed in (1, 2, 1):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=1.5, top_p=0.95, seed=seed)
        assert r.choices[0].text == refs[seed]


def _stop_across_tokens(tok, eos):
    """A prompt and a 2-character stop string made of the end of one generated token's text and
    the start of the next's, first occurring there."""
    for j in range(200):
        ids = tok.encode(" ".join(WORDS[(j + i) % len(WORDS)] for i in range(3 + j % 5)))
        tokens, _ = fake_generate(ids, sampling_of(30), eos_token_ids=eos)
        for k in range(3, len(tokens) - 1):
            before = tok.decode(tokens[:k], skip_special_tokens=True)
            after = tok.decode(tokens[:k + 1], skip_special_tokens=True)
            if "\ufffd" in after or len(after) <= len(before) or not before:
                continue
            stop = after[len(before) - 1:len(before) + 1]
            if stop.isprintable() and after.find(stop) == len(before) - 1:
                return ids, stop
    pytest.fail("no prompt gives a stop string across a token boundary")


def test_stop_strings_across_token_boundaries(server, tok, eos):
    client = server.client()
    ids, stop = _stop_across_tokens(tok, eos)
    stops = [stop, "never-appears-here"]
    text, why, n = expected(tok, eos, ids, sampling_of(30), stops)
    assert why == "stop" and n < 30
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0, stop=stops)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (text, "stop", n)
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=30, temperature=0, stop=stops, stream=True)]
    assert "".join(pieces) == text                                  # nothing of the stop string leaked


def test_stop_token_ids(server, tok, eos):
    ids = tok.encode("over a lazy dog")
    tokens, _ = fake_generate(ids, sampling_of(20), eos_token_ids=eos)
    stopper = tokens[5]
    text, why, n = expected(tok, eos, ids, sampling_of(20, stop_token_ids=[stopper]))
    assert why == "stop" and n == tokens.index(stopper) + 1
    r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0,
                                           extra_body={"stop_token_ids": [stopper]})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (text, "stop", n)


# --------------------------------------------------------------------------- many at once


def _mixed_requests(tok, count: int):
    rng = random.Random(7)
    out = []
    for i in range(count):
        chat = rng.random() < 0.4
        ids = [0] * 64
        while len(ids) > 48:                                     # room for some tokens in the context
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 10))) + f" #{i}"
            messages = [{"role": "user", "content": words}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True) if chat else tok.encode(words)
        sampled = rng.random() < 0.5
        out.append({"chat": chat, "stream": rng.random() < 0.5, "words": words, "messages": messages, "ids": ids,
                    "max_tokens": rng.randrange(1, min(24, 64 - len(ids)) + 1),
                    "temperature": 1.0 if sampled else 0.0, "seed": rng.randrange(2**31) if sampled else None})
    return out


async def _one(client, req):
    common = {"model": MODEL, "max_tokens": req["max_tokens"], "temperature": req["temperature"], "seed": req["seed"]}
    if req["chat"]:
        if req["stream"]:
            text, reason, usage = "", None, None
            async for c in await client.chat.completions.create(messages=req["messages"], stream=True,
                                                                stream_options={"include_usage": True}, **common):
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    reason = c.choices[0].finish_reason or reason
                usage = c.usage or usage
            return text, reason, usage.completion_tokens
        r = await client.chat.completions.create(messages=req["messages"], **common)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    prompt = req["words"] if len(req["ids"]) % 2 else req["ids"]
    if req["stream"]:
        text, reason, usage = "", None, None
        async for c in await client.completions.create(prompt=prompt, stream=True,
                                                       stream_options={"include_usage": True}, **common):
            if c.choices:
                text += c.choices[0].text
                reason = c.choices[0].finish_reason or reason
            usage = c.usage or usage
        return text, reason, usage.completion_tokens
    r = await client.completions.create(prompt=prompt, **common)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


def test_72_concurrent_mixed_requests(server, tok, eos):
    requests = _mixed_requests(tok, 72)
    want = [expected(tok, eos, r["ids"], sampling_of(r["max_tokens"], r["temperature"], seed=r["seed"]))
            for r in requests]
    assert len({w[0] for w in want}) > 60                           # answers tell the requests apart
    before = server.metrics()["wna16_generated_tokens_total"]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                      timeout=DEADLINE) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, r) for r in requests)), 2 * DEADLINE)

    got = asyncio.run(run_all())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (i, requests[i])
    m = server.wait_metrics(lambda m: m["wna16_kv_blocks_used"] == 0 and m["wna16_running_sequences"] == 0,
                            "the pool is not empty after the requests")
    assert m["wna16_queue_length"] == 0
    assert m["wna16_generated_tokens_total"] - before == sum(w[2] for w in want)


# --------------------------------------------------------------------------- disconnects, a full queue, failures


def _open_stream(s: BackgroundServer, payload: dict):
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=DEADLINE)
    conn.request("POST", "/v1/completions", json.dumps({**payload, "stream": True}),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _read_event(resp) -> object:
    line = resp.readline().decode()
    assert line.startswith("data: "), line
    assert resp.readline() == b"\n"                                # the blank line after it
    payload = line[len("data: "):].strip()
    return payload if payload == "[DONE]" else json.loads(payload)


def _long_running_prompt(tok, eos, skip: int = 0) -> list[int]:
    """A prompt whose greedy answer runs the whole 50 tokens (no eos), so a request that is not
    cancelled generates all 50."""
    found = [ids for ids in (tok.encode(f"{a} {b}") for a in WORDS for b in WORDS[:6])
             if fake_generate(ids, sampling_of(50), eos_token_ids=eos)[1] == "length"]
    return found[skip]


def _idle(m):
    return m["wna16_kv_blocks_used"] == 0 and m["wna16_running_sequences"] == 0 and m["wna16_queue_length"] == 0


def test_disconnect_mid_stream_frees_the_sequence(slow, tok, eos):
    before = slow.wait_metrics(_idle, "the slow server is busy")["wna16_generated_tokens_total"]
    conn, resp = _open_stream(slow, {"model": MODEL, "prompt": _long_running_prompt(tok, eos), "max_tokens": 50,
                                     "temperature": 0})
    first = [_read_event(resp) for _ in range(2)]
    assert all(e["choices"][0]["finish_reason"] is None for e in first)
    assert slow.metrics()["wna16_kv_blocks_used"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    resp.close()
    conn.close()
    m = slow.wait_metrics(_idle, "the disconnected stream still holds blocks")
    assert m["wna16_generated_tokens_total"] - before < 50            # cancelled, not run to the end


def test_disconnect_while_waiting_for_a_whole_answer(slow, tok, eos):
    before = slow.wait_metrics(_idle, "the slow server is busy")["wna16_generated_tokens_total"]
    conn = http.client.HTTPConnection("127.0.0.1", slow.port, timeout=0.3)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": _long_running_prompt(tok, eos, 1),
                                                        "max_tokens": 50, "temperature": 0}),
                 {"content-type": "application/json"})
    with pytest.raises((socket.timeout, TimeoutError)):
        conn.getresponse()
    conn.close()
    m = slow.wait_metrics(_idle, "the abandoned request still holds blocks")
    assert m["wna16_generated_tokens_total"] - before < 50


def test_full_queue_is_429_and_the_server_goes_on(slow, tok, eos):
    slow.wait_metrics(_idle, "the slow server is busy")
    long_ids = _long_running_prompt(tok, eos, 2)                   # 50 steps of 30 ms
    conn, resp = _open_stream(slow, {"model": MODEL, "prompt": long_ids, "max_tokens": 50, "temperature": 0})
    pieces = [_read_event(resp)]                                    # running: the one batch slot is taken
    waiting_ids = tok.encode("lazy dog")
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=slow.client().completions.create(
        model=MODEL, prompt=waiting_ids, max_tokens=3, temperature=0)), daemon=True)
    waiter.start()
    slow.wait_metrics(lambda m: m["wna16_queue_length"] == 1, "the second request is not queued")
    with pytest.raises(openai.RateLimitError) as info:
        slow.client().completions.create(model=MODEL, prompt="third", max_tokens=3, temperature=0)
    err = info.value.body
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "max_queue" in err["message"]
    assert info.value.response.headers["retry-after"] == "1"
    while pieces[-1] != "[DONE]":
        pieces.append(_read_event(resp))
    conn.close()
    waiter.join(DEADLINE)
    assert not waiter.is_alive()
    assert "".join(p["choices"][0]["text"] for p in pieces[:-1]) == expected(tok, eos, long_ids, sampling_of(50))[0]
    assert result["r"].choices[0].text == expected(tok, eos, waiting_ids, sampling_of(3))[0]
    slow.wait_metrics(_idle, "the pool is not empty")


def test_engine_failure_is_500_and_the_server_goes_on(slow, tok, eos):
    poison = [SlowEngine.POISON] * 3 + [5, 6]
    status, body = slow.post("/v1/completions", {"model": MODEL, "prompt": poison, "max_tokens": 4})
    assert status == 500 and body["error"]["code"] == "engine_failure"
    assert "injected engine failure" in body["error"]["message"]
    status, raw = slow.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": poison, "max_tokens": 4, "stream": True}).encode())
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_failure"
    slow.wait_metrics(_idle, "the failed requests hold blocks")
    ids = tok.encode("stone")
    r = slow.client().completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == expected(tok, eos, ids, sampling_of(5))[0]


# --------------------------------------------------------------------------- hostile requests

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _with(base, **fields):
    out = dict(base)
    for key, value in fields.items():
        if value is _DROP:
            out.pop(key)
        else:
            out[key] = value
    return out


_DROP = object()

# (id, path, body (bytes: raw), status, param, words the message must hold)
HOSTILE = [
    ("malformed-json", C, b'{"model": ', 400, None, "not valid JSON"),
    ("not-utf8", C, b'\xff\xfe{"model"', 400, None, "not valid JSON"),
    ("deeply-nested", C, b"[" * 100000 + b"]" * 100000, 400, None, "not valid JSON"),
    ("not-an-object", C, b"[1, 2]", 400, None, "expected a JSON object, got list"),
    ("model-missing", C, _with(OK, model=_DROP), 400, "model", "'model' is required"),
    ("model-unknown", C, _with(OK, model="gpt-9"), 404, "model", "'gpt-9'"),
    ("model-not-string", C, _with(OK, model=5), 400, "model", "'model' must be a string"),
    ("prompt-missing", C, _with(OK, prompt=_DROP), 400, "prompt", "'prompt' is required"),
    ("prompt-number", C, _with(OK, prompt=5), 400, "prompt", "'prompt' must be a string or a list of token ids"),
    ("prompt-batch", C, _with(OK, prompt=["a", "b"]), 400, "prompt", "batched prompts are not supported"),
    ("prompt-id-past-vocab", C, _with(OK, prompt=[1, 99999]), 400, "prompt", "'prompt'"),
    ("prompt-id-negative", C, _with(OK, prompt=[-1]), 400, "prompt", "'prompt'"),
    ("prompt-empty", C, _with(OK, prompt=""), 400, "prompt", "at least one token"),
    ("prompt-lone-surrogate", C, b'{"model": "fake-moe", "prompt": "a\\ud800"}', 400, "prompt", "not valid Unicode"),
    ("chat-content-parts", CHAT, _with(OK_CHAT, messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages", "field 'content' must be a string"),
    ("prompt-too-long", C, _with(OK, prompt=[1] * 64), 400, "prompt", "the prompt has 64 tokens"),
    ("max-tokens-zero", C, _with(OK, max_tokens=0), 400, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ("max-tokens-string", C, _with(OK, max_tokens="16"), 400, "max_tokens", "'max_tokens'"),
    ("max-tokens-past-context", C, _with(OK, prompt=[1] * 10, max_tokens=60), 400, "max_tokens",
     "max_tokens must be at most 54"),
    ("temperature-negative", C, _with(OK, temperature=-0.5), 400, "temperature", "'temperature' must be"),
    ("temperature-nan", C, b'{"model": "fake-moe", "prompt": "hi", "temperature": NaN}', 400, "temperature",
     "'temperature'"),
    ("temperature-bool", C, _with(OK, temperature=True), 400, "temperature", "'temperature'"),
    ("top-p-zero", C, _with(OK, top_p=0), 400, "top_p", "'top_p' must be a finite number > 0.0 and <= 1.0"),
    ("top-p-above-one", C, _with(OK, top_p=1.5), 400, "top_p", "'top_p'"),
    ("top-k-fraction", C, _with(OK, top_k=2.5), 400, "top_k", "'top_k'"),
    ("n-two", C, _with(OK, n=2), 400, "n", "'n' must be 1"),
    ("stop-five", C, _with(OK, stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    ("stop-empty-string", C, _with(OK, stop=[""]), 400, "stop", "'stop' must be a non-empty string"),
    ("stop-number", C, _with(OK, stop=7), 400, "stop", "'stop'"),
    ("stop-token-ids-negative", C, _with(OK, stop_token_ids=[-1]), 400, "stop_token_ids", "'stop_token_ids'"),
    ("seed-string", C, _with(OK, seed="abc"), 400, "seed", "'seed' must be an integer"),
    ("seed-huge", C, _with(OK, seed=2**70), 400, "seed", "'seed'"),
    ("stream-string", C, _with(OK, stream="yes"), 400, "stream", "'stream' must be true or false"),
    ("stream-options-list", C, _with(OK, stream_options=[1]), 400, "stream_options", "'stream_options'"),
    ("logprobs-unsupported", C, _with(OK, logprobs=3), 400, "logprobs", "'logprobs' is not supported"),
    ("echo-unsupported", C, _with(OK, echo=True), 400, "echo", "'echo' is not supported"),
    ("chat-messages-missing", CHAT, _with(OK_CHAT, messages=_DROP), 400, "messages", "'messages' is required"),
    ("chat-messages-string", CHAT, _with(OK_CHAT, messages="hi"), 400, "messages", "messages: expected a list"),
    ("chat-message-no-content", CHAT, _with(OK_CHAT, messages=[{"role": "user"}]), 400, "messages",
     "messages[0]: field 'content'"),
    ("chat-max-completion-zero", CHAT, _with(OK_CHAT, max_completion_tokens=0), 400, "max_completion_tokens",
     "'max_completion_tokens'"),
    ("chat-tools-unsupported", CHAT, _with(OK_CHAT, tools=[{"type": "function"}]), 400, "tools",
     "'tools' is not supported"),
]


def _still_serves(s: BackgroundServer, tok, eos):
    assert s.request("GET", "/health")[0] == 200
    status, body = s.post(C, {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected(tok, eos, [3, 4, 5], sampling_of(3))[0]


def _check_error_body(body, status, param, words):
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param
    assert words in body["error"]["message"], body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_request(server, tok, eos, case):
    _, path, body, status, param, words = case
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got_status, got = server.request("POST", path, raw)
    assert got_status == status, got
    _check_error_body(got, status, param, words)
    if status == 404:
        assert got["error"]["code"] == "model_not_found"
    _still_serves(server, tok, eos)


@pytest.mark.parametrize("method, path, headers, status, words", [
    ("GET", "/v1/nothing", None, 404, "Not Found"),
    ("GET", C, None, 405, "Method Not Allowed"),
    ("POST", C, {"content-type": "application/json", "content-length": str(MAX_BODY_BYTES + 1)}, 413, "exceed"),
])
def test_hostile_route_method_and_size(server, tok, eos, method, path, headers, status, words):
    got_status, got = server.request(method, path, b"{}" if method == "POST" else None, headers)
    assert got_status == status
    _check_error_body(got, status, None, words)
    _still_serves(server, tok, eos)


def test_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi")
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert info.value.body["param"] == "temperature"


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("call, match", [
    (lambda tok: create_app(FakeEngine(), tok, ""), "model_name"),
    (lambda tok: create_app(FakeEngine(), None, MODEL), "tokenizer: expected a Tokenizer"),
    (lambda tok: create_app(FakeEngine(vocab_size=1000), tok, MODEL), "engine's vocab_size is 1000"),
    (lambda tok: create_app(FakeEngine(), tok, MODEL, max_queue=0), "max_queue"),
    (lambda tok: create_app(object(), tok, MODEL), "engine: expected the Engine interface"),
    (lambda tok: serve(create_app(FakeEngine(), tok, MODEL), port=70000), "port"),
    (lambda tok: serve(create_app(FakeEngine(), tok, MODEL), host=""), "host"),
])
def test_bad_configuration(tok, call, match):
    with pytest.raises(ConfigError, match=match):
        call(tok)


@pytest.mark.parametrize("kw,words", [
    (dict(host=""), ["host", "''"]), (dict(host=None), ["host", "None"]),
    (dict(port=-1), ["port", "-1"]), (dict(port=70000), ["port", "70000"]), (dict(port="80"), ["port", "'80'"]),
    (dict(deadline=0), ["deadline", "> 0", "0"]), (dict(deadline=float("nan")), ["deadline", "nan"]),
])
def test_background_server_refuses_bad_arguments(tok, eos, kw, words):
    """``BackgroundServer`` (the server in a thread of this process): a bad host, port or deadline
    is a ConfigError naming it, before any socket is opened."""
    from wna16_jax.serving.server import BackgroundServer

    app = create_app(FakeEngine(eos_token_ids=eos, block_size=4, num_blocks=9, batch_sizes=(1,), chunk_sizes=(8,),
                                max_blocks_per_seq=2), tok, MODEL)
    with pytest.raises(ConfigError) as e:
        BackgroundServer(app, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)
