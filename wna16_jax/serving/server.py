"""An OpenAI-compatible HTTP server over a :class:`~wna16_jax.serving.scheduler.Scheduler`.

``pip install "wna16-jax[serve]"`` (FastAPI, uvicorn, prometheus_client). ::

    app = create_app(engine, tokenizer, "my-model")     # engine: any serving.engine.Engine
    serve(app, host="127.0.0.1", port=8000)             # blocks; binds the loopback unless told

Routes: ``GET /v1/models``; ``POST /v1/completions`` (``prompt``: a string or a list of token
ids); ``POST /v1/chat/completions`` (``messages`` rendered with the tokenizer's chat template,
``add_generation_prompt=True``; each message's ``content`` a string); ``GET /health``; ``GET /metrics`` (Prometheus text: queue
length, running sequences, KV blocks used and total, generated tokens, tokens/s over the last
10 s, preemptions).

Request fields, as OpenAI's API defines them: ``model`` (required), ``max_tokens`` (chat also
``max_completion_tokens``; default 16 for completions, for chat all the context and pool leave),
``temperature`` (default 1, ``>= 0``), ``top_p`` (``(0, 1]``), ``seed``, ``stop`` (a string or up
to 4), ``stream``, ``stream_options.include_usage``, ``n`` (1 only); extensions ``top_k``
(0 or -1: off) and ``stop_token_ids``. Fields that would change the answer and are not
implemented (``logprobs``, ``echo``, ``best_of``, penalties, ``logit_bias``, tools, ...) are
refused when set to anything but their neutral value, never ignored. Unknown fields are ignored.

Answers: the text is decoded without special tokens; a stop string ends it (the text is cut
before it, finish reason ``stop``) and is found across token boundaries — a stream holds back
any tail that could begin a stop string, so no part of one is ever sent; an eos or stop token
ends it too (its text is not included; it counts in ``usage.completion_tokens``, as every
generated token does). Streams are server-sent events in OpenAI's chunk format ending with
``data: [DONE]``. A client that disconnects cancels its request and frees its KV blocks.

Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming
the field: 400 for a bad request (malformed JSON, a field of the wrong type or out of range, a
prompt longer than the context, ``max_tokens`` past it, ``n != 1``, an unsupported field), 404 for
an unknown model or route, 405 for a wrong method, 413 for a body over
:data:`MAX_BODY_BYTES`, and **429** (``type: "rate_limit_error"``, ``code: "queue_full"``) when the
scheduler's queue is full: the client should retry later (the official client retries 429 with
back-off). Only a failure of the engine itself is a 500, and then every request in flight gets it.

Concurrency: one background task runs the scheduler loop; every scheduler call (``step``,
``add``, ``cancel``) runs in one worker thread, in order, so the event loop stays responsive and
the scheduler needs no lock. Tokens reach the request coroutines through asyncio queues.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..errors import ConfigError, WNA16Error
from ..fields import Fields, check_int, check_number
from .engine import SEED_RANGE, Engine, SamplingParams
from .scheduler import QueueFullError, Scheduler, SchedulerStats, TokenEvent

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - the serve extra is not installed
    from ..errors import UnsupportedError

    raise UnsupportedError(f"wna16_jax.serving.server needs FastAPI, uvicorn and prometheus_client "
                           f"(pip install 'wna16-jax[serve]'): {e}") from None

log = logging.getLogger(__name__)

#: a request body larger than this is refused (413) before it is parsed
MAX_BODY_BYTES = 8 * 2**20
#: OpenAI's limit on stop strings
MAX_STOP_STRINGS = 4
#: the window of the tokens/s gauge
RATE_WINDOW_S = 10.0

#: fields this server does not implement, with the values that mean "off" (anything else: 400)
_NEUTRAL = {
    "echo": (False,), "best_of": (1,), "suffix": ("",), "logprobs": (False, 0), "top_logprobs": (0,),
    "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "tools": ([],),
    "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
    "response_format": ({"type": "text"},), "prediction": (),
}


# --------------------------------------------------------------------------- errors


class _HTTPError(Exception):
    """A request refused with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                    headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _bad(param: str, read):
    """``read()``, with a library error turned into a 400 naming ``param``."""
    try:
        return read()
    except WNA16Error as e:
        raise _HTTPError(400, str(e), param) from None


# --------------------------------------------------------------------------- request parsing


async def _json_body(request: Request) -> Fields:
    """The body as a JSON object (:class:`Fields`), read up to :data:`MAX_BODY_BYTES`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _HTTPError(413, f"request body: {declared} bytes exceed the limit of {MAX_BODY_BYTES}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _HTTPError(413, f"request body: more than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(bytes(body))
    except (ValueError, RecursionError) as e:
        raise _HTTPError(400, f"request body: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise _HTTPError(400, f"request body: expected a JSON object, got {type(data).__name__}")
    return Fields(data, "request body")


def _check_neutral(f: Fields) -> None:
    for key, neutral in _NEUTRAL.items():
        if key in f and f.get(key) not in neutral:
            raise _HTTPError(400, f"request body: field {key!r} is not supported by this server (only "
                             f"{' or '.join(json.dumps(v) for v in neutral) or 'null'}), got {str(f.get(key))[:80]}",
                             key, "unsupported_parameter")


def _stop_strings(f: Fields) -> tuple[str, ...]:
    value = f.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _HTTPError(400, f"request body: field 'stop' must be a non-empty string or a list of non-empty "
                         f"strings, got {str(value)[:80]}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _HTTPError(400, f"request body: field 'stop' must list at most {MAX_STOP_STRINGS} strings, got "
                         f"{len(stops)}", "stop")
    return tuple(stops)


class _Job:
    """A parsed request: the prompt's token ids, its sampling and how to answer."""

    def __init__(self, prompt_ids: list[int], sampling: SamplingParams, stream: bool, include_usage: bool,
                 prompt_param: str, max_tokens_param: str):
        self.prompt_ids, self.sampling, self.stream, self.include_usage = prompt_ids, sampling, stream, include_usage
        self.prompt_param, self.max_tokens_param = prompt_param, max_tokens_param


def _parse_job(f: Fields, prompt_ids: list[int], prompt_param: str, scheduler: Scheduler, chat: bool) -> _Job:
    """The sampling and answer options of a request whose prompt is ``prompt_ids``."""
    n = _bad("n", lambda: f.integer("n", 1))
    if n != 1:
        raise _HTTPError(400, f"request body: field 'n' must be 1 (one choice per request), got {n}", "n")
    _check_neutral(f)
    key = "max_completion_tokens" if chat and "max_completion_tokens" in f else "max_tokens"
    limit = scheduler.token_limit(len(prompt_ids))
    max_tokens = _bad(key, lambda: f.integer(key, None, low=1))
    if max_tokens is None:
        max_tokens = max(1, limit) if chat else 16
    top_k = _bad("top_k", lambda: f.integer("top_k", 0, low=-1))
    stream = _bad("stream", lambda: f.flag("stream", False))
    options = _bad("stream_options", lambda: f.object("stream_options"))
    include_usage = False if options is None else _bad("stream_options", lambda: options.flag("include_usage", False))
    sampling = SamplingParams(
        temperature=_bad("temperature", lambda: f.number("temperature", 1.0, low=0.0)),
        top_p=_bad("top_p", lambda: f.number("top_p", 1.0, above=0.0, high=1.0)),
        top_k=max(top_k, 0),
        seed=_bad("seed", lambda: f.integer("seed", None, low=SEED_RANGE[0], high=SEED_RANGE[1])),
        max_tokens=max_tokens,
        stop_token_ids=_bad("stop_token_ids", lambda: f.integers("stop_token_ids", (), low=0,
                                                                 high=scheduler.vocab_size - 1)),
        stop=_stop_strings(f))
    return _Job(prompt_ids, sampling, stream, include_usage, prompt_param, key)


# --------------------------------------------------------------------------- text out


class _TextStream:
    """Token ids in, text out: incremental decoding (a character split over tokens is sent when
    complete) and stop strings (the text ends before the first one; a tail that may begin one is
    held back until it cannot)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self._tok, self._stop = tokenizer, stop
        self._longest = max(map(len, stop), default=0)
        self._ids: list[int] = []
        self._start = self._read = 0          # ids[_start:_read] is the decoded context of the next delta
        self.text = ""                        # the text decoded so far (cut at a stop string once found)
        self._sent = 0                        # characters of ``text`` handed out
        self._searched = 0                    # stop strings cannot start before this index
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The text ``token`` lets out (maybe none)."""
        self._ids.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Whatever text is still held back (the sequence has ended)."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        context = self._decode(self._ids[self._start:self._read])
        window = self._decode(self._ids[self._start:])
        grown = window.startswith(context)
        if final or (grown and not window.endswith("\ufffd")):
            delta = window[len(context):]
            self.text += delta
            if delta:                 # the next context ends in text: an id that decodes to nothing
                self._start = self._read    # (out of vocabulary, special) must not be all of it, or
            self._read = len(self._ids)     # the decoder's space before the next word is lost
            return self._release(final, "")
        # a character is still incomplete: hold the window, but look for stop strings in its
        # complete part already, so a stop is found on the token that completes it
        return self._release(final, window[len(context):].rstrip("\ufffd") if grown else "")

    def _release(self, final: bool, pending: str) -> str:
        """The committed text not yet handed out, less a tail that may begin a stop string;
        ``pending``: text decoded but not committed (searched for stop strings only)."""
        safe = len(self.text)
        if self._stop:
            seen = self.text + pending
            hits = [i for s in self._stop if (i := seen.find(s, self._searched)) >= 0]
            if hits:
                self.text, self.stopped = seen[:min(hits)], True
                safe = len(self.text)
            else:
                self._searched = max(self._searched, len(self.text) - self._longest + 1)
                if not final:
                    safe -= self._held_tail()
        out = self.text[self._sent:safe]
        self._sent = max(self._sent, safe)
        return out

    def _held_tail(self) -> int:
        """The length of the longest tail of the text that begins some stop string."""
        for k in range(min(len(self.text), self._longest - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


class _Piece:
    """A piece of one answer: new ``text``, and on the last piece its ``finish_reason`` and the
    ``completion_tokens`` generated."""

    __slots__ = ("text", "finish_reason", "completion_tokens")

    def __init__(self, text: str, finish_reason: str | None = None, completion_tokens: int = 0):
        self.text, self.finish_reason, self.completion_tokens = text, finish_reason, completion_tokens


class _EngineFailure:
    """Put on a request's queue when the scheduler loop failed."""

    def __init__(self, message: str):
        self.message = message


# --------------------------------------------------------------------------- the scheduler loop


class _Rate:
    """Tokens per second over the last :data:`RATE_WINDOW_S` seconds."""

    def __init__(self):
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, total: int) -> None:
        self._samples.append((time.monotonic(), total))
        self._trim()

    def _trim(self) -> None:
        now = time.monotonic()
        while len(self._samples) > 1 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()

    def value(self) -> float:
        self._trim()
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (_, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / max(time.monotonic() - t0, 1e-9)


class _Service:
    """The scheduler, its worker thread, the loop task and the queues of the requests in flight."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str, max_queue: int, token_budget: int | None):
        self.scheduler = Scheduler(engine, max_queue=max_queue, token_budget=token_budget)
        self.tokenizer, self.model_name = tokenizer, model_name
        self.created = int(time.time())
        self.stats: SchedulerStats = self.scheduler.stats()
        self.rate = _Rate()
        self._queues: dict[str, asyncio.Queue] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._stopping = False

    # the worker thread's functions: each refreshes the stats snapshot the metrics read
    def _in_worker(self, fn, *args):
        try:
            return fn(*args)
        finally:
            self.stats = self.scheduler.stats()

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._in_worker, fn, *args)

    def _step(self) -> tuple[list[TokenEvent], bool]:
        return self.scheduler.step(), self.scheduler.has_work

    def _cancel_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.cancel(rid)

    async def start(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wna16-scheduler")
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    async def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                events, busy = await self._call(self._step)
            except Exception as e:                      # an engine failure: fail what is in flight, go on
                log.exception("the scheduler step failed; failing %d requests", len(self._queues))
                failed = list(self._queues)
                for rid in failed:
                    self._queues.pop(rid).put_nowait(_EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
                await self._call(self._cancel_all, failed)
                continue
            self.rate.record(self.stats.generated_tokens)
            for event in events:
                queue = self._queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
            if not busy:
                await self._wake.wait()

    async def submit(self, request_id: str, job: _Job) -> asyncio.Queue:
        """Add the request to the scheduler; its events arrive on the returned queue."""
        if not self.alive:
            raise _HTTPError(503, "the scheduler loop is not running (the server is starting or stopping)")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            await self._call(self.scheduler.add, request_id, job.prompt_ids, job.sampling)
        except QueueFullError as e:
            self._queues.pop(request_id, None)
            raise _HTTPError(429, str(e), None, "queue_full") from None
        except WNA16Error as e:
            self._queues.pop(request_id, None)
            field = str(e).split(":", 1)[0].split("[", 1)[0]
            param = {"prompt_ids": job.prompt_param, "max_tokens": job.max_tokens_param}.get(field, field)
            raise _HTTPError(400, str(e).replace("prompt_ids", job.prompt_param, 1), param) from None
        self._wake.set()
        return queue

    def release(self, request_id: str) -> None:
        """Stop delivering ``request_id``'s tokens and cancel it in the scheduler (its blocks are
        freed before the next step); no-op when already released."""
        if self._queues.pop(request_id, None) is not None and self._executor is not None:
            self._executor.submit(self._in_worker, self.scheduler.cancel, request_id)

    async def pieces(self, request_id: str, queue: asyncio.Queue, stop: tuple[str, ...]) -> AsyncIterator[_Piece]:
        """The answer's text as it comes; the last piece has the finish reason. Leaving early
        (a disconnect) cancels the request."""
        text, count = _TextStream(self.tokenizer, stop), 0
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _EngineFailure):
                    raise _HTTPError(500, item.message, None, "engine_failure")
                count += 1
                reason = item.finish_reason
                delta = "" if reason == "stop" else text.push(item.token)   # a stop token is not text
                if text.stopped:
                    self.release(request_id)
                    yield _Piece(delta, "stop", count)
                    return
                if reason is not None:
                    yield _Piece(delta + text.finish(), reason, count)
                    return
                if delta:
                    yield _Piece(delta)
        finally:
            self.release(request_id)


# --------------------------------------------------------------------------- responses


class _EventStream(StreamingResponse):
    """A server-sent-event response that stops (and closes its source, which cancels the
    request) as soon as the client disconnects, whatever ASGI version the server speaks."""

    def __init__(self, chunks: AsyncIterator[str]):
        super().__init__(chunks, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        async def watch_disconnect():
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watch_disconnect)
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self._chunks:
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()
        except OSError:                                  # the client went away mid-send
            pass
        finally:
            await self._chunks.aclose()


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Answer:
    """OpenAI's response objects for one request (completions or chat)."""

    def __init__(self, answer_id: str, model: str, chat: bool, prompt_tokens: int):
        self.id, self.chat, self.model, self.prompt_tokens = answer_id, chat, model, prompt_tokens
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def full(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        usage = _usage(self.prompt_tokens, completion_tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._object("chat.completion", [choice], usage)
        return self._object("text_completion", [{"index": 0, "text": text, "logprobs": None,
                                                 "finish_reason": finish_reason}], usage)

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
            return self._object("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None,
                                                           "finish_reason": finish_reason}])
        return self._object("text_completion", [{"index": 0, "text": text or "", "logprobs": None,
                                                 "finish_reason": finish_reason}])

    def usage_chunk(self, completion_tokens: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], _usage(self.prompt_tokens, completion_tokens))


async def _stream_chunks(answer: _Answer, pieces: AsyncIterator[_Piece], include_usage: bool) -> AsyncIterator[str]:
    try:
        if answer.chat:
            yield _sse(answer.chunk(None, role=True))
        async for piece in pieces:
            if piece.finish_reason is None:
                yield _sse(answer.chunk(piece.text))
                continue
            if piece.text:
                yield _sse(answer.chunk(piece.text))
            yield _sse(answer.chunk(None, piece.finish_reason))
            if include_usage:
                yield _sse(answer.usage_chunk(piece.completion_tokens))
        yield "data: [DONE]\n\n"
    except _HTTPError as e:                               # after the headers: an error event, then the end
        yield _sse({"error": {"message": e.message, "type": _ERROR_TYPES.get(e.status, "invalid_request_error"),
                              "param": e.param, "code": e.code}})
        yield "data: [DONE]\n\n"
    finally:
        await pieces.aclose()


async def _collect(request: Request, answer: _Answer, pieces: AsyncIterator[_Piece]) -> Response:
    """The whole answer; a client that disconnects first cancels the request."""
    async def gather() -> dict:
        parts = []
        async for piece in pieces:
            parts.append(piece.text)
            if piece.finish_reason is not None:
                return answer.full("".join(parts), piece.finish_reason, piece.completion_tokens)
        raise AssertionError("the answer ended without a finish reason")  # pragma: no cover

    work, gone = asyncio.ensure_future(gather()), asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            await pieces.aclose()
    if work.cancelled():
        return Response(status_code=499)                 # nobody reads it
    return JSONResponse(work.result())


# --------------------------------------------------------------------------- the app


def _completion_prompt(f: Fields, tokenizer: Any, vocab_size: int) -> list[int]:
    value = f.get("prompt")
    if value is None:
        raise _HTTPError(400, "request body: field 'prompt' is required, but missing", "prompt")
    if isinstance(value, str):
        ids = _bad("prompt", lambda: tokenizer.encode(value))
    elif isinstance(value, list) and all(not isinstance(t, (str, list, dict)) for t in value):
        ids = list(_bad("prompt", lambda: f.integers("prompt", low=0, high=vocab_size - 1)))
    else:
        raise _HTTPError(400, "request body: field 'prompt' must be a string or a list of token ids (one prompt; "
                         f"batched prompts are not supported), got {str(value)[:80]}", "prompt")
    if not ids:
        raise _HTTPError(400, "request body: field 'prompt' must hold at least one token, got an empty prompt",
                         "prompt")
    return ids


def _chat_prompt(f: Fields, tokenizer: Any) -> list[int]:
    if "messages" not in f:
        raise _HTTPError(400, "request body: field 'messages' is required, but missing", "messages")
    return list(_bad("messages", lambda: tokenizer.apply_chat_template(f.get("messages"), add_generation_prompt=True)))


def _check_model(f: Fields, service: _Service) -> None:
    model = _bad("model", lambda: f.string("model"))
    if model != service.model_name:
        raise _HTTPError(404, f"request body: field 'model' names {model[:80]!r}, but this server serves only "
                         f"{service.model_name!r}", "model", "model_not_found")


class _Metrics:
    """The Prometheus collector: the scheduler's last snapshot and the token rate."""

    def __init__(self, service: _Service):
        self._service = service

    def collect(self):
        s, rate = self._service.stats, self._service.rate.value()
        for name, doc, value in (("wna16_queue_length", "Requests waiting to be scheduled", s.waiting),
                                 ("wna16_running_sequences", "Sequences prefilling or decoding", s.running),
                                 ("wna16_kv_blocks_used", "KV cache blocks in use", s.blocks_used),
                                 ("wna16_kv_blocks_total", "KV cache blocks the scheduler hands out", s.blocks_total),
                                 ("wna16_tokens_per_second", f"Tokens generated per second over the last "
                                                             f"{RATE_WINDOW_S:g} s", rate)):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("wna16_generated_tokens", "Tokens generated since the start",
                                  value=s.generated_tokens)
        yield CounterMetricFamily("wna16_preemptions", "Sequences preempted for KV blocks", value=s.preemptions)


def create_app(engine: Engine, tokenizer: Any, model_name: str, *, max_queue: int = 256,
               token_budget: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name`` (see the module doc).

    ``tokenizer``: a :class:`wna16_jax.models.tokenizer.Tokenizer` (``encode``, ``decode``,
    ``apply_chat_template``) whose ids cover the engine's vocabulary; ``max_queue`` and
    ``token_budget``: the :class:`~wna16_jax.serving.scheduler.Scheduler`'s."""
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError(f"model_name: expected a non-empty string, got {model_name!r:.80}")
    for method in ("encode", "decode", "apply_chat_template"):
        if not callable(getattr(tokenizer, method, None)):
            raise ConfigError(f"tokenizer: expected a Tokenizer, {type(tokenizer).__name__} has no {method}()")
    service = _Service(engine, tokenizer, model_name, max_queue, token_budget)
    limit = getattr(tokenizer, "id_limit", None)
    if isinstance(limit, int) and limit < service.scheduler.vocab_size:
        raise ConfigError(f"tokenizer: decodes ids below {limit}, but the engine's vocab_size is "
                          f"{service.scheduler.vocab_size}")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="wna16-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    registry = CollectorRegistry()
    registry.register(_Metrics(service))

    @app.exception_handler(_HTTPError)
    async def _on_refusal(_request, e: _HTTPError):
        return _error_response(e.status, e.message, e.param, e.code,
                               {"retry-after": "1"} if e.status == 429 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_request, e: StarletteHTTPException):
        return _error_response(e.status_code, str(e.detail), None, None, getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _on_bug(_request, e: Exception):                  # a bug, never bad input
        log.exception("unhandled error")
        return _error_response(500, f"internal error: {type(e).__name__}", None, "internal_error")

    @app.get("/health")
    async def health():
        if not service.alive:
            return _error_response(503, "the scheduler loop is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": service.created,
                                            "owned_by": "wna16-jax",
                                            "max_model_len": service.scheduler.max_model_len}]}

    async def answer(request: Request, chat: bool) -> Response:
        f = await _json_body(request)
        _check_model(f, service)
        if chat:
            prompt, param = _chat_prompt(f, tokenizer), "messages"
        else:
            prompt, param = _completion_prompt(f, tokenizer, service.scheduler.vocab_size), "prompt"
        job = _parse_job(f, prompt, param, service.scheduler, chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        queue = await service.submit(request_id, job)
        reply = _Answer(request_id, model_name, chat, len(prompt))
        pieces = service.pieces(request_id, queue, job.sampling.stop)
        if job.stream:
            return _EventStream(_stream_chunks(reply, pieces, job.include_usage))
        return await _collect(request, reply, pieces)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    return app


def _checked_address(host: Any, port: Any) -> tuple[str, int]:
    if not isinstance(host, str) or not host:
        raise ConfigError(f"host: expected a host name or address, got {host!r:.80}")
    return host, check_int("port", port, low=0, high=65535)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until interrupted (binds the loopback unless ``host`` says otherwise)."""
    import uvicorn

    host, port = _checked_address(host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


class BackgroundServer:
    """``app`` served by uvicorn in a daemon thread of this process, on ``port`` of ``host``
    (port 0: a free one, then :attr:`port`), from :meth:`start` to :meth:`stop` (or a ``with``):
    the server beside other work in one process (a notebook, a test, a benchmark). uvicorn leaves
    logging as it is: its own configuration would bind its handlers to the ``sys.stderr`` of the
    moment, which a caller may close before the thread's last message. ``deadline``: the seconds
    start and stop may each take (:class:`TimeoutError` past it)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, deadline: float = 20.0,
                 log_level: str = "warning"):
        import socket
        import threading

        import uvicorn

        host, port = _checked_address(host, port)
        self.deadline = check_number("deadline", deadline, above=0)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", log_config=None,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "BackgroundServer":
        self.thread.start()
        end = time.monotonic() + self.deadline
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise TimeoutError(f"the server on {self.host}:{self.port} did not start within {self.deadline:g} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.deadline)
        self.sock.close()
        if self.thread.is_alive():
            raise TimeoutError(f"the server on {self.host}:{self.port} did not stop within {self.deadline:g} s")

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (``http://host:port/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["create_app", "serve", "BackgroundServer", "MAX_BODY_BYTES", "MAX_STOP_STRINGS"]
