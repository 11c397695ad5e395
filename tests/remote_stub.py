"""A scriptable stand-in for a vLLM-compatible server on 127.0.0.1, for the remote backend's tests:
it records every request (path, headers, JSON body), checks `prompt_embeds` with Bridge's own wire
loader (so a wrong hidden size is a 400, as on vLLM), and answers each completion as `script`
says: normally, with an error status, after a delay, by hanging up, or by shutting the server down.

A normal answer is derived from the embeddings: text `rows=N first=F`, token ids `[N, round(F)]`,
so a test can tell which prompt an output came from.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bridge.wire import load_prompt_embeds

Action = tuple  # ("ok",) | ("status", code, message[, headers]) | ("sleep", s) | ("hangup",) | ("die",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubServer:
    def __init__(self, *, hidden_size: int, models: list[dict] | None = None, port: int = 0,
                 script: Callable[[int, dict], Action] | None = None):
        self.hidden_size = hidden_size
        self.models = models if models is not None else [{"id": "stub", "object": "model", "root": "stub"}]
        self.script = script or (lambda n, body: ("ok",))
        self.requests: list[dict] = []  # {"path", "headers", "body"} in arrival order
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> StubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def completions(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["path"] == "/v1/completions"]

    def _handler_class(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, data: object, headers: dict | None = None) -> None:
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                with stub._lock:
                    stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": None})
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": stub.models})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "NotFound", "code": 404}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    n = sum(r["path"] == "/v1/completions" for r in stub.requests)
                    stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    self._answer(stub.script(n, body), body)
                finally:
                    with stub._lock:
                        stub.in_flight -= 1

            def _answer(self, action: Action, body: dict) -> None:
                kind = action[0]
                if kind == "sleep":
                    time.sleep(action[1])
                    action = ("ok",)
                    kind = "ok"
                if kind == "status":
                    headers = action[3] if len(action) > 3 else None
                    error = {"message": action[2], "type": "Stub", "code": action[1]}
                    self._send(action[1], {"error": error}, headers)
                    return
                if kind in ("hangup", "die"):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    if kind == "die":
                        threading.Thread(target=stub.stop, daemon=True).start()
                    return
                try:
                    t = load_prompt_embeds(body["prompt_embeds"], hidden_size=stub.hidden_size)
                except ValueError as exc:
                    self._send(400, {"error": {"message": str(exc), "type": "BadRequestError", "code": 400}})
                    return
                rows, first = t.shape[0], float(t[0, 0])
                text, ids = f"rows={rows} first={first:g}", [rows, round(first)]
                if body.get("stream"):
                    self._stream(text, ids)
                    return
                choice = {"index": 0, "text": text, "finish_reason": "length", "stop_reason": None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"tokens": [f"token_id:{i}" for i in ids],
                                          "token_logprobs": [-0.5 for _ in ids],
                                          "top_logprobs": [{f"token_id:{i}": -0.5} for i in ids],
                                          "text_offset": [0 for _ in ids]}
                self._send(200, {"id": "cmpl-stub", "object": "text_completion", "created": 0,
                                 "model": body.get("model"), "choices": [choice],
                                 "usage": {"prompt_tokens": rows, "completion_tokens": 2,
                                           "total_tokens": rows + 2}})

            def _stream(self, text: str, ids: list[int]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                half = len(text) // 2
                parts = [(text[:half], ids[:1], None), (text[half:], ids[1:], "length")]
                for piece, piece_ids, finish in parts:
                    chunk = {"id": "cmpl-stub", "object": "text_completion", "choices": [
                        {"index": 0, "text": piece, "token_ids": piece_ids, "finish_reason": finish}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        return Handler
