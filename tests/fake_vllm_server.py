"""A stand-in for vLLM's OpenAI server, for the faults the real one cannot be made to show on cue.

Started as the local serve step starts vLLM (`<python> -m vllm.entrypoints.openai.api_server --port=N ...`, this
file in the python's place through a wrapper script); $FAKE_VLLM picks the behaviour:
- `empty`: /health, /version (`fake-0`) and chat answers of whitespace only (a good server is the real one:
  tests/test_local_serving.py, tests/test_shipped_pipelines.py);
- `crash`: says why on stderr and exits 1 before it listens;
- `never`: never listens (a load that hangs);
- `port-taken`: exits as vLLM does when another process bound its port first, each start (its argv appended
  to $FAKE_VLLM_ARGV_FILE.starts); `port-taken-once`: the first start does, later ones serve as `empty`.
It writes its pid to $FAKE_VLLM_PID_FILE (and where its sockets would go, $VLLM_RPC_BASE_PATH, to the same name with
`.sockets`, leaving a file there as vLLM does) and its argv to $FAKE_VLLM_ARGV_FILE, so that a test can check that the
step stopped it and what it was started with.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BEHAVIOUR = os.environ.get("FAKE_VLLM", "empty")


class JsonHandler(BaseHTTPRequestHandler):
    """JSON answers, no access log (tests/test_rollout.py's fake vLLM is one too)."""

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


class Handler(JsonHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            return self._send(200, {})
        if self.path == "/version":
            return self._send(200, {"version": "fake-0"})
        return self._send(404, {"error": self.path})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "  "}}]})


def main() -> int:
    Path(os.environ["FAKE_VLLM_PID_FILE"]).write_text(str(os.getpid()))
    sockets = Path(os.environ["VLLM_RPC_BASE_PATH"])  # as vLLM's engine makes its ZeroMQ sockets there
    (sockets / "engine-ipc").touch()
    Path(os.environ["FAKE_VLLM_PID_FILE"] + ".sockets").write_text(str(sockets))
    Path(os.environ["FAKE_VLLM_ARGV_FILE"]).write_text(json.dumps(sys.argv[1:]))
    options = dict(arg[2:].split("=", 1) for arg in sys.argv[1:] if arg.startswith("--") and "=" in arg)
    if BEHAVIOUR == "crash":
        print("ValueError: the model's head size is not supported", file=sys.stderr, flush=True)
        return 1
    if BEHAVIOUR == "never":
        while True:
            time.sleep(1)
    if BEHAVIOUR.startswith("port-taken"):
        starts = Path(os.environ["FAKE_VLLM_ARGV_FILE"] + ".starts")
        first = not starts.exists()
        with starts.open("a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
        if first or BEHAVIOUR == "port-taken":
            print("OSError: [Errno 98] Address already in use", file=sys.stderr, flush=True)
            return 1
    ThreadingHTTPServer((options["host"], int(options["port"])), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
