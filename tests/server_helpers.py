"""A uvicorn server on a free loopback port in a daemon thread, for the tests that meet the
server as a user does (tests/test_server.py, tests/test_model_engine.py): started, driven by a
real client, stopped, every wait bounded by ``deadline`` seconds."""

from __future__ import annotations

import http.client
import json
import time

import openai

from wna16_jax.serving import server


class BackgroundServer(server.BackgroundServer):
    """The library's :class:`~wna16_jax.serving.server.BackgroundServer` on a free 127.0.0.1 port,
    with the clients the tests drive it by; ``deadline``: the seconds any one wait (start, stop, a
    request) may take."""

    def __init__(self, app, *, deadline: float = 20.0):
        super().__init__(app, "127.0.0.1", 0, deadline=deadline)

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=self.deadline, **kw)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """``(status, parsed JSON or text)`` of one raw HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.deadline)
        try:
            conn.request(method, path, body=body, headers=headers or {"content-type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data.decode()

    def post(self, path: str, payload) -> tuple[int, object]:
        return self.request("POST", path, json.dumps(payload).encode())

    def metrics(self) -> dict[str, float]:
        status, text = self.request("GET", "/metrics")
        assert status == 200
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def wait_metrics(self, ok, what: str) -> dict[str, float]:
        deadline = time.monotonic() + self.deadline
        while True:
            m = self.metrics()
            if ok(m):
                return m
            assert time.monotonic() < deadline, f"{what}: {m}"
            time.sleep(0.02)

