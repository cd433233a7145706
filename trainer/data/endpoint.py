"""The target answering through a serving engine: the OpenAI-compatible chat-completions API that
vLLM (`vllm serve`) and SGLang (`python -m sglang.launch_server`) expose.

At scale, regenerating the training answers on the training GPUs with `generate` is the slow part;
a serving engine batches continuously and runs on other machines. This client sends one request per
assistant turn (the server applies the chat template), keeps at most `concurrency` requests in
flight, retries what a busy or restarting server answers (429, 5xx, timeouts, refused connections)
with exponential backoff, and refuses an endpoint whose model does not tokenize like the target.
`timeout` bounds each whole request (a server trickling a byte at a time is cut off too), and a
body that is not the API's (an HTML page, no `choices`, a null `message`) is an error naming the URL
and what was wrong, never a traceback.

A call, its retries included, has a deadline the recipe fixes (`EndpointSettings.deadline`: every
attempt's `timeout` and the backoff schedule between them): a server's `Retry-After` is honoured
only when the wait and one more attempt fit in what is left of it, else the call ends at once with
one line, so no server can hold a run longer than its settings say.

The answer's text is turned back into the target's token ids with the target's own tokenizer; when
the server stopped on the end of the turn, the template's end-of-turn token closes the answer, as
`generate` would have produced it. A server with a reasoning parser returns a thinking model's
reasoning apart (`reasoning_content`): it is kept (`EndpointAnswer.reasoning`), and the answer's
ids are the template's rendering of the turn with it (trainer/data/regeneration.py).
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import httpx
from transformers import PreTrainedTokenizerBase

from trainer.recipe_types import API_KEY_VARIABLE

logger = logging.getLogger(__name__)

# Statuses a server answers while busy, restarting or behind a proxy: worth asking again.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Statuses that refuse one request for what it asks (a prompt over the server's max_model_len).
REFUSED_STATUSES = frozenset({400, 413, 422})
PROBE_MESSAGES = [{"role": "user", "content": "Probe: 17 × 3 = 51, naïve café, 東京, \t tabs and  spaces."}]


class ServedModel(TypedDict):
    """What GET /models says of the model that answers (JSON: part of the cached answers' key)."""

    id: str
    root: str | None


class EndpointError(ConnectionError):
    """The endpoint cannot be used: unreachable, the wrong model, or failing past the retries (an
    OSError, so the scripts report it in one line)."""


class EndpointUnreachable(EndpointError):
    """A call failed past its retries or its deadline (no connection, timeouts, busy statuses): the
    server said nothing about what it serves."""


class EndpointGone(EndpointUnreachable):
    """A call that got no answer at all, ended at once because another server can take it
    (`EndpointClient.fail_fast`)."""


@dataclass(frozen=True)
class EndpointSettings:
    url: str  # http://host:port/v1
    model: str | None = None  # the served model name; None: the one model the server serves
    concurrency: int = 64
    timeout: float = 600.0  # seconds for one whole request (a long answer on a loaded server)
    max_retries: int = 8
    backoff: float = 1.0  # seconds before the first retry, doubled each time up to `max_backoff`
    max_backoff: float = 60.0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    keys: str = "regenerate"  # the recipe keys' prefix, for messages: regenerate_* or feature_*

    def key(self, name: str) -> str:
        """The recipe key of a setting, e.g. `key("endpoint")` -> "regenerate_endpoint"."""
        return f"{self.keys}_{name}"

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"{self.key('endpoint')} must be an http(s) URL such as http://host:8000/v1 (got {self.url!r})"
            )
        if self.concurrency < 1:
            raise ValueError(f"{self.key('concurrency')} must be >= 1 (got {self.concurrency})")
        if not self.timeout > 0:
            raise ValueError(f"{self.key('timeout')} must be > 0 seconds (got {self.timeout})")
        if self.max_retries < 0:
            raise ValueError(f"{self.key('max_retries')} must be >= 0 (got {self.max_retries})")

    def backoff_delay(self, attempt: int) -> float:
        """Seconds before retry `attempt + 1`: `backoff` doubled each time, up to `max_backoff`."""
        return min(self.backoff * 2**attempt, self.max_backoff)

    @property
    def deadline(self) -> float:
        """Seconds one call may take with its retries: every attempt's `timeout` and the backoff
        schedule between them (a longer Retry-After must fit in it)."""
        return self.timeout * (self.max_retries + 1) + sum(self.backoff_delay(i) for i in range(self.max_retries))


@dataclass(frozen=True)
class EndpointAnswer:
    text: str
    finish_reason: str  # "stop": the model ended its turn; "length": cut at max_tokens
    reasoning: str = ""  # the thinking a server's reasoning parser returned apart from the content
    body: dict[str, Any] = field(default_factory=dict)  # the whole reply, with an engine's extra fields


class EndpointClient:
    """Chat completions against one endpoint, with a bounded pool and retries. Use as an async
    context manager; `checked_model` must run before `answer`."""

    def __init__(self, settings: EndpointSettings, fail_fast: Callable[[], bool] | None = None):
        self.settings = settings
        # When it answers True, a failure to get any answer (refused connection, reset, timeout) ends
        # the call at once instead of being retried: another server can take the request.
        self.fail_fast = fail_fast
        self.base = settings.url.rstrip("/")
        self.model: str | None = settings.model
        self.name = settings.key("endpoint")  # how messages name it: regenerate_endpoint or feature_endpoint
        self.probe_reply: dict[str, Any] = {}  # the probe's whole body (set by checked_model)
        headers = {}
        api_key = os.environ.get(API_KEY_VARIABLE) or os.environ.get("OPENAI_API_KEY")
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
        self._client = httpx.AsyncClient(headers=headers, timeout=settings.timeout, limits=limits)
        self._slots = asyncio.Semaphore(settings.concurrency)

    async def __aenter__(self) -> EndpointClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> httpx.Response:
        """One call, retried on RETRY_STATUSES and transport failures; other statuses are returned.
        The call ends by `settings.deadline` (the wait for a free slot aside): each attempt counts
        at most `timeout`, each wait its length, and a wait that leaves no room for a whole attempt
        more (a long Retry-After) ends the call at once."""
        settings = self.settings
        url = f"{self.base}{path}"
        attempt, spent = 0, 0.0  # seconds of this call's deadline used
        while True:
            try:
                async with self._slots:  # the deadline runs once a slot is free
                    began = time.monotonic()
                    try:
                        response = await asyncio.wait_for(
                            self._client.request(method, url, json=payload), settings.timeout
                        )
                    finally:
                        spent += min(time.monotonic() - began, settings.timeout)
                if response.status_code not in RETRY_STATUSES:
                    return response
                problem = f"HTTP {response.status_code}: {response.text[:200]!r}"
                retry_after = retry_after_seconds(response.headers.get("retry-after"))
                answered = True  # busy, not gone: asked again here
            except (TimeoutError, httpx.TimeoutException) as error:
                kind = f", {type(error).__name__}" if isinstance(error, httpx.TimeoutException) else ""
                problem = f"no whole answer within {settings.key('timeout')}={settings.timeout:g} s{kind}"
                retry_after, answered = None, False
            except httpx.TransportError as error:
                problem, retry_after, answered = f"{type(error).__name__}: {error}", None, False
            if not answered and self.fail_fast is not None and self.fail_fast():
                raise EndpointGone(f"{url}: no answer ({problem})")
            failing = f"{url}: still failing after {attempt + 1} attempts ({problem})"
            if attempt >= settings.max_retries:
                raise EndpointUnreachable(failing)
            delay = settings.backoff_delay(attempt)
            if retry_after is not None and retry_after > delay:
                delay = retry_after
                if spent + delay + settings.timeout > settings.deadline:
                    raise EndpointUnreachable(
                        f"{failing}; it asks to retry after {retry_after:g} s, past this call's deadline of "
                        f"{settings.deadline:g} s ({settings.key('timeout')} per attempt and the backoff between "
                        f"{settings.max_retries + 1} attempts): rerun once the server is free"
                    )
            logger.debug("%s failed (%s); retry %d in %.2f s", url, problem, attempt + 1, delay)
            await asyncio.sleep(delay)
            spent += delay
            attempt += 1

    async def served_models(self) -> list[dict[str, Any]]:
        """GET /models: the entries the server lists (each with a string `id`)."""
        try:
            response = await self._request("GET", "/models")
        except EndpointUnreachable as error:
            raise EndpointUnreachable(f"{self.name} {self.base} cannot be reached: {error}") from None
        if response.status_code != 200:
            raise EndpointError(
                f"{self.name} {self.base}: GET /models answered HTTP {response.status_code} "
                "(is the URL the server's OpenAI base, ending in /v1?)"
            )
        body = json_body(response, f"{self.base}/models")
        entries = body.get("data") if isinstance(body, dict) else None
        if not isinstance(entries, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get("id"), str) for entry in entries
        ):
            raise EndpointError(
                f"{self.name} {self.base}: GET /models answered a malformed body (expected "
                f'{{"data": [{{"id": "<model>"}}, ...]}}): {response.text[:100]!r}'
            )
        return entries

    async def served_model(self) -> ServedModel:
        """Which model answers, as the server reports it: `id` (the served name: `model`, or the
        one model served) and `root` (vLLM's and SGLang's path or Hub id of the weights, None when
        not reported). What the server serves, not what the recipe calls it, keys cached answers."""
        entries = await self.served_models()
        served = [entry["id"] for entry in entries]
        if self.model is None:
            if len(served) != 1:
                raise EndpointError(
                    f"{self.name} {self.base} serves {len(served)} models ({', '.join(served) or 'none'}): "
                    f"set {self.settings.key('model')} to the target's served name"
                )
            self.model = served[0]
        elif self.model not in served:
            raise EndpointError(
                f"{self.settings.key('model')} {self.model!r} is not served by {self.base} "
                f"(it serves: {', '.join(served) or 'none'})"
            )
        root = next(entry.get("root") for entry in entries if entry["id"] == self.model)
        return {"id": self.model, "root": root if isinstance(root, str) else None}

    async def checked_model(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> str:
        """The served model to ask, after checking that it is the target: the server must template
        and tokenize the probe conversation into exactly `prompt_ids` tokens (the target's tokenizer
        and chat template), and, where the server has vLLM's and SGLang's /tokenize, into the same ids."""
        model = (await self.served_model())["id"]
        try:
            answer = await self.answer(PROBE_MESSAGES, max_tokens=1, temperature=0.0, top_p=1.0, seed=None)
        except EndpointRefusal as refusal:
            raise EndpointError(f"{self.name} {self.base} refused the probe request ({refusal})") from None
        self.probe_reply = answer.body  # (an engine's extra fields: vLLM's hidden-state file of the probe)
        usage = answer.body.get("usage")
        served_length = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(served_length, int) and served_length != len(prompt_ids):
            raise EndpointError(
                f"{self.name} model {self.model!r} is not the recipe's target: it reads the probe "
                f"conversation as {served_length} tokens, the target's tokenizer and chat template as "
                f"{len(prompt_ids)} (serve the target, with its own chat template)"
            )
        served_ids = await self._tokenize(PROBE_MESSAGES[0]["content"])
        expected = tokenizer.encode(PROBE_MESSAGES[0]["content"], add_special_tokens=False)
        if served_ids is not None and served_ids[-len(expected) :] != expected:
            raise EndpointError(
                f"{self.name} model {self.model!r} is not the recipe's target: its tokenizer gives "
                f"other token ids than the target's for the same text (vocabulary differs)"
            )
        return model

    async def _tokenize(self, text: str) -> list[int] | None:
        """Token ids from the server's /tokenize (vLLM and SGLang serve it beside /v1), or None."""
        root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        try:
            response = await asyncio.wait_for(
                self._client.post(f"{root}/tokenize", json={"model": self.model, "prompt": text}),
                self.settings.timeout,
            )
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, TimeoutError, ValueError):
            return None
        tokens = body.get("tokens") if isinstance(body, dict) else None
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None

    async def _post_object(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST `payload` (retried as `_request` does) and return the JSON object answered; a
        refused request raises EndpointRefusal, any other failure an EndpointError naming the URL."""
        response = await self._request("POST", path, payload)
        url = f"{self.base}{path}"
        if response.status_code in REFUSED_STATUSES:
            raise EndpointRefusal(response.status_code, response.text[:300])
        if response.status_code != 200:
            raise EndpointError(f"{url} answered HTTP {response.status_code}: {response.text[:300]}")
        body = json_body(response, url)
        if not isinstance(body, dict):
            raise EndpointError(f"{url} answered {type(body).__name__} JSON, not an object")
        return body

    async def completion_of_ids(self, prompt_ids: list[int], *, max_tokens: int) -> dict[str, Any]:
        """A greedy completion of token ids (no chat template): the body, with the engine's extra
        fields such as vLLM's `kv_transfer_params`. A refused request raises EndpointRefusal."""
        payload = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0}
        return await self._post_object("/completions", payload)

    async def answer(
        self,
        messages,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> EndpointAnswer:
        """The target's answer to `messages` (the server templates them, with `chat_template_kwargs`
        over the settings' own): its content, and its reasoning when a reasoning parser split it off."""
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stream": False,
        }
        if seed is not None:
            payload["seed"] = seed
        template_kwargs = {**self.settings.chat_template_kwargs, **(chat_template_kwargs or {})}
        if template_kwargs:
            payload["chat_template_kwargs"] = template_kwargs
        body = await self._post_object("/chat/completions", payload)
        url = f"{self.base}/chat/completions"
        choices = body.get("choices")
        if not isinstance(choices, list):
            raise EndpointError(f"{url} answered a body without `choices`: {json.dumps(body)[:100]}")
        if not choices:
            raise EndpointError(f"{url} answered an empty `choices` list")
        choice = choices[0]
        if not isinstance(choice, dict):
            raise EndpointError(f"{url} answered a choice that is not an object: {json.dumps(choice)[:100]}")
        message = choice.get("message")
        if not isinstance(message, dict):
            raise EndpointError(f"{url} answered a choice whose `message` is {json.dumps(message)[:100]}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise EndpointError(f"{url} answered a `message.content` that is not a string: {json.dumps(content)[:100]}")
        finish_reason = choice.get("finish_reason")
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        if not isinstance(reasoning, str):
            raise EndpointError(f"{url} answered a reasoning that is not a string: {json.dumps(reasoning)[:100]}")
        return EndpointAnswer(
            text=content or "",
            finish_reason=finish_reason if isinstance(finish_reason, str) else "stop",
            reasoning=reasoning,
            body=body,
        )


async def run_workers(worker: Callable[[], Awaitable[None]], count: int) -> None:
    """`count` concurrent copies of `worker`; the first failure cancels the others (which would
    otherwise go on sending through a closed client) and is raised alone."""
    tasks = [asyncio.ensure_future(worker()) for _ in range(count)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    failures = [failure for failure in failures if not isinstance(failure, asyncio.CancelledError)] or failures
    if failures:
        raise failures[0]


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header's delay in seconds (RFC 9110: a number of seconds or an HTTP date), or
    None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.replace(".", "", 1).isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max((when - datetime.datetime.now(datetime.timezone.utc)).total_seconds(), 0.0)


def json_body(response: httpx.Response, url: str) -> Any:
    """The response's JSON, or an EndpointError naming `url`, the content type and the body's start."""
    try:
        return response.json()
    except ValueError:
        content_type = response.headers.get("content-type", "none")
        raise EndpointError(
            f"{url} answered HTTP {response.status_code} with a body that is not JSON "
            f"(content-type {content_type}): {response.text[:100]!r}"
        ) from None


class EndpointRefusal(Exception):
    """The server refused one request for what it asks (REFUSED_STATUSES): e.g. a prompt over its
    max_model_len. That conversation is skipped and counted; the others go on."""

    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
