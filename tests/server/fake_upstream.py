"""A stand-in for one `fastgen serve` replica, for the balancer's routing and restart tests: the
standard library only (it starts in a fraction of a second and loads no model).

    python tests/server/fake_upstream.py PORT

``/health`` answers 200 (``{"status": "ok"}``); ``/v1/models`` names the model ``fake``;
``/v1/completions`` and ``/v1/chat/completions`` generate ``max_tokens`` (default 16) tokens "x",
one every ``TOKEN_S`` seconds, streamed (SSE, then ``[DONE]``) or whole, with OpenAI's usage;
``/dashboard/feed`` sends a ``hello`` record, then a ``step`` record every ``TOKEN_S``; ``/whoami``
answers this process's pid (which upstream served a request).
"""
from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_S = 0.02


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _events(self) -> None:
        """Start an SSE body, chunked as uvicorn sends it: a process killed mid-stream leaves the
        client an incomplete chunked body (an error), not a clean end."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _send_event(self, obj) -> None:
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_events(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        elif self.path == "/whoami":
            self._json(200, {"pid": os.getpid()})
        elif self.path == "/dashboard/feed":
            self._events()
            try:
                self._send_event({"kind": "hello", "num_blocks": 64, "pid": os.getpid()})
                while True:
                    time.sleep(TOKEN_S)
                    self._send_event({"kind": "step", "pid": os.getpid()})
            except OSError:
                return
        else:
            self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
        n = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        if not body.get("stream"):
            time.sleep(TOKEN_S * n)
            return self._json(200, {"object": "text_completion", "pid": os.getpid(), "usage": usage,
                                    "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}]})
        self._events()
        try:
            for _ in range(n):
                self._send_event({"choices": [{"index": 0, "text": "x", "finish_reason": None}], "pid": os.getpid()})
                time.sleep(TOKEN_S)
            self._send_event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage})
            self._send_event("[DONE]")
            self._end_events()
        except OSError:
            return


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
