"""A vLLM-like feature server for the tests (tests/e2e/engines runs the real one): /v1/models, the probe
(chat completion) and /v1/completions, each writing the request's `hidden_states` [tokens, layers, H]
and `token_ids` to `<storage>/req-N.safetensors` with a released lock, as vLLM's hidden-states
connector does, and naming it in `kv_transfer_params`.

What a real server cannot be made to do on cue is a switch here: `hostile(path, kind)` names another
path (kind "probe" or "sample"), `die_after` kills the server while it holds its N-th sample request
(the connection is cut, the port then refuses), `hold_after` keeps every sample request after the
N-th unanswered until `release` is set, and `hidden_of(ids)` computes the hidden states (a
tiny target's real ones, for equality with in-process capture; random by default)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file


class FakeFeatureServer:
    def __init__(
        self,
        storage: Path,
        layers: int,
        hidden: int,
        hostile: Callable[[str, str], str] | None = None,
        hidden_of: Callable[[list[int]], torch.Tensor] | None = None,
        die_after: int | None = None,
        hold_after: int | None = None,
    ):
        self.storage, self.layers, self.hidden, self.hostile = Path(storage), layers, hidden, hostile
        self.hidden_of, self.die_after, self.hold_after = hidden_of, die_after, hold_after
        self.holding = threading.Event()  # set once a request is held (hold_after)
        self.release = threading.Event()  # lets held requests go on
        self.written: dict[str, torch.Tensor] = {}  # path -> hidden_states written
        self.samples: list[tuple[int, ...]] = []  # the token ids of each sample request, in arrival order
        self.most_files = 0  # the most hidden-state files seen in the storage folder at once
        self.count = 0
        self.dead = False
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeFeatureServer:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()

    def kill(self) -> None:
        """Stop serving: the port refuses from now on."""
        with self.lock:
            if self.dead:
                return
            self.dead = True
        self.server.shutdown()
        self.server.server_close()

    def write(self, ids: list[int], kind: str) -> str:
        with self.lock:
            self.count += 1
            path = str(self.storage / f"{self.url.split(':')[-1].split('/')[0]}-req-{self.count}.safetensors")
        if self.hidden_of is not None and kind == "sample":
            hidden = self.hidden_of(ids)
        else:
            hidden = torch.randn(len(ids), self.layers, self.hidden)
        save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids)}, path)
        Path(path + ".lock").touch()  # written: the lock is released
        with self.lock:
            self.written[path] = hidden
            self.most_files = max(self.most_files, len(list(self.storage.glob("*.safetensors"))))
        return self.hostile(path, kind) if self.hostile else path

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"data": [{"id": "tiny", "root": "/models/tiny"}]})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/v1/chat/completions":
                    named = server.write([0], "probe")
                    choice = {"message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
                elif self.path == "/v1/completions":
                    ids = list(request["prompt"])
                    with server.lock:
                        if len(ids) > 1:  # (a nudge is one token)
                            server.samples.append(tuple(ids))
                        dies = server.die_after is not None and len(server.samples) >= server.die_after
                    if server.hold_after is not None and len(server.samples) > server.hold_after:
                        server.holding.set()  # a client waits here until released (or 60 s)
                        server.release.wait(60)
                    if dies:  # killed while holding this request: the connection is cut, no answer
                        threading.Thread(target=server.kill, daemon=True).start()
                        self.close_connection = True
                        self.connection.close()
                        return
                    named = server.write(ids, "sample")
                    choice = {"text": "x", "finish_reason": "length"}
                else:
                    self._send(404, {"error": {"message": "no route"}})
                    return
                self._send(200, {"choices": [choice], "kv_transfer_params": {"hidden_states_path": named}})

        return Handler
