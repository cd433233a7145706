"""A loopback OpenAI-compatible chat-completions server for the regeneration benchmark and the tests,
answering with a real target's greedy `generate` (what vLLM / SGLang would serve for that model).

Routes: GET /v1/models, POST /v1/chat/completions (non-streaming; `usage.prompt_tokens` from the
server's own templating), POST /tokenize (vLLM's and SGLang's, beside /v1; off with
`tokenize=False`). Faults for the retry and resume tests: `fail_every = n` answers HTTP 503 to every
n-th completion request; `die_after = n` stops the server abruptly after n answered completions
(later connections are refused); `delay` slows every answer; `token_shift` makes /tokenize answer
with other ids (another vocabulary behind the same template); `refuse_containing` answers HTTP 400
(context length exceeded) to conversations containing that text; `empty_answers` answers every
completion with `content: ""`; `raw_completions` / `raw_models` = (content type, body) answer HTTP 200
with that body instead (an HTML page, JSON of the wrong shape); `trickle = s` sends a completion's
headers, then one byte every s seconds (for at most `trickle_for` seconds, then hangs up);
`busy_for = n` answers HTTP 429 with `Retry-After: retry_after` to the first n completion requests.
`model_root` is what GET /v1/models reports as the model's `root` (vLLM's path of the weights).
`completions` counts the answered completion requests, and `asked` lists every conversation asked,
to show nothing was asked twice.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from trainer.data.chat import end_of_turn_ids


class LoopbackOpenAI:
    def __init__(
        self, target, model_name: str = "tiny-target", tokenize: bool = True, chat_template: str | None = None
    ):
        self.target, self.model_name, self.tokenize = target, model_name, tokenize
        self.chat_template = chat_template  # another template: a server whose model is not the target
        self.fail_every: int | None = None
        self.die_after: int | None = None
        self.delay = 0.0  # seconds added to every completion (slow answers)
        self.token_shift = 0  # /tokenize ids shifted: a server with another vocabulary
        self.refuse_containing: str | None = None  # HTTP 400 for conversations with this text (too long)
        self.empty_answers = False  # every answer's content is ""
        self.raw_completions: tuple[str, bytes] | None = None  # (content type, body) for every completion
        self.raw_models: tuple[str, bytes] | None = None  # (content type, body) for GET /v1/models
        self.trickle: float | None = None  # seconds between the bytes of a completion's body
        self.trickle_for = 20.0  # then the connection is closed: a client without a deadline still returns
        self.busy_for = 0  # completion requests answered 429 first
        self.retry_after = "1"  # their Retry-After header (seconds or an HTTP date)
        self.model_root: str | None = None  # GET /v1/models' `root` (None: not reported)
        self.completions = 0
        self.requests = 0
        self.in_flight = 0  # completions being computed now
        self.asked: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no completion is being computed (those of a killed client finish unheard)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- what the model does ---------------------------------------------------------------------

    def prompt_ids(self, messages, template_kwargs) -> list[int]:
        tokenizer = self.target.tokenizer
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, chat_template=self.chat_template, **template_kwargs
        )
        return list(encoded["input_ids"])

    @torch.no_grad()
    def complete(self, request: dict) -> dict:
        tokenizer = self.target.tokenizer
        prompt = self.prompt_ids(request["messages"], request.get("chat_template_kwargs") or {})
        stops = sorted(end_of_turn_ids(tokenizer))
        with self.lock:  # one generate at a time on the shared model
            output = self.target.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=request.get("max_tokens", 16),
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        stop = next((index for index, token in enumerate(output) if token in stops), None)
        answer = output if stop is None else output[:stop]
        content = "" if self.empty_answers else tokenizer.decode(answer, skip_special_tokens=True)
        return {
            "id": "chatcmpl-loopback",
            "object": "chat.completion",
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "length" if stop is None else "stop",
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)},
        }

    # -- HTTP --------------------------------------------------------------------------------------

    def _handler(self) -> type[_Handler]:
        """The request handler class bound to this server (the HTTP server makes one per request)."""
        return type("Handler", (_Handler,), {"loopback": self})


class _Handler(BaseHTTPRequestHandler):
    """Answers one connection for `loopback`: its routes, faults and counters."""

    protocol_version = "HTTP/1.1"
    loopback: LoopbackOpenAI

    def log_message(self, *args):
        pass

    def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client was killed meanwhile
            self.close_connection = True

    def _send_raw(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self) -> None:
        """Headers at once, then a byte at a time: every read arrives well within a read timeout."""
        server = self.loopback
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        self.close_connection = True
        deadline = time.monotonic() + server.trickle_for
        try:
            while time.monotonic() < deadline:
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(server.trickle)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self):
        server = self.loopback
        if self.path == "/v1/models" and server.raw_models:
            self._send_raw(*server.raw_models)
        elif self.path == "/v1/models":
            entry = {"id": server.model_name, "object": "model"}
            if server.model_root is not None:
                entry["root"] = server.model_root
            self._send(200, {"object": "list", "data": [entry]})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        server = self.loopback
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/tokenize" and server.tokenize:
            ids = server.target.tokenizer.encode(request["prompt"], add_special_tokens=False)
            ids = [token + server.token_shift for token in ids]
            self._send(200, {"tokens": ids, "count": len(ids)})
            return
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        refusal = self._refusal(request)
        if refusal is not None:
            self._send(*refusal)
        elif server.raw_completions:
            self._send_raw(*server.raw_completions)
        elif server.trickle:
            self._trickle()
        else:
            with server.lock:
                server.in_flight += 1
            try:
                self._answer(request)
            finally:
                with server.lock:
                    server.in_flight -= 1

    def _refusal(self, request: dict) -> tuple[int, dict, dict[str, str] | None] | None:
        """The error answer (status, payload, headers) a completion request gets, or None: too long,
        an unknown model, busy (429) or failing (503). Counts the request."""
        server = self.loopback
        if server.refuse_containing and server.refuse_containing in json.dumps(request.get("messages")):
            return 400, {"error": {"message": "This model's maximum context length is exceeded"}}, None
        if request.get("model") != server.model_name:
            return 404, {"error": {"message": f"model {request.get('model')} does not exist"}}, None
        with server.lock:
            server.requests += 1
            failing = server.fail_every and server.requests % server.fail_every == 0
            busy = server.requests <= server.busy_for
        if busy:
            return 429, {"error": {"message": "too many requests"}}, {"Retry-After": server.retry_after}
        if failing:
            return 503, {"error": {"message": "busy"}}, None
        return None

    def _answer(self, request: dict) -> None:
        server = self.loopback
        time.sleep(server.delay)
        answer = server.complete(request)
        with server.lock:
            if server.die_after is not None and server.completions >= server.die_after:
                dying = True
            else:
                dying = False
                server.completions += 1
                server.asked.append(json.dumps(request["messages"], sort_keys=True))
        if dying:  # the process is gone: no answer, and nobody listens any more
            self.close_connection = True
            threading.Thread(target=server.stop, daemon=True).start()
            return
        self._send(200, answer)
