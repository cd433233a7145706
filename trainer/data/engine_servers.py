"""The vLLM servers a run asks for target hidden states (`feature_endpoint`: one URL, or one per
engine replica, e.g. 2 x TP4 on one node), as one pool, and the one request that turns a sample's
token ids into its features: used alike by the offline store (`engine_features`) and the streamed
path (`online_features`).

A request is a one-token completion of the sample's token ids; the reply names the file the server
wrote its hidden states to, which is read (`engine_files`: inside the storage folder only, regular
files only, every wait bounded), removed, checked against the request and mapped to the draft's
layer order.

Load: each request goes to the live server with the fewest requests in flight. The counts, and which
servers are dropped, live in shared memory (`ServerBoard`), so the data-loader processes of a
streamed run spread their requests together and agree on what is gone.

Failure: a server that gives no answer at all (refused connection, reset, timeout) while another
is live is dropped for the rest of the run with one warning, and the sample is asked of another.
The last live server is asked as its settings allow (retries with backoff up to its deadline);
past that, one error names every server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from trainer.data.chat import render, template_kwargs
from trainer.data.endpoint import (
    PROBE_MESSAGES,
    EndpointClient,
    EndpointError,
    EndpointGone,
    EndpointRefusal,
    EndpointSettings,
    EndpointUnreachable,
)
from trainer.data.engine_files import (
    HEADER_BYTES,
    EngineStorage,
    engine_features,
    lock_state,
    read_hidden_states,
    remove_hidden_states,
)

logger = logging.getLogger(__name__)

NUDGE_INTERVAL = 0.25  # seconds between nudges


@dataclass(frozen=True)
class FeatureEndpointSettings:
    """Where and how to ask: the connection settings of each server (`endpoint`: one, or a sequence),
    how long a finished request's file may take, and the folder each server writes its files to
    (`storage`: its shared_storage_path as seen here; one folder shared by all, or one per server),
    the only places whose files the client reads or removes."""

    endpoint: EndpointSettings | Sequence[EndpointSettings]
    file_timeout: float = 120.0
    storage: str | os.PathLike | Sequence[str | os.PathLike] | None = None

    def __post_init__(self):
        if not self.file_timeout > 0:
            raise ValueError(f"feature_file_timeout must be > 0 seconds (got {self.file_timeout})")
        endpoints = (self.endpoint,) if isinstance(self.endpoint, EndpointSettings) else tuple(self.endpoint)
        folders = [self.storage] if isinstance(self.storage, str | os.PathLike) else list(self.storage or [])
        if not endpoints:
            raise ValueError("feature_endpoint: give at least one URL")
        if not folders or not all(folders):
            raise ValueError(
                "feature_endpoint needs feature_storage_path: the folder the server writes its hidden-state "
                "files to (the shared_storage_path of its --kv-transfer-config), as seen from this machine"
            )
        if len(folders) not in (1, len(endpoints)):
            raise ValueError(
                f"feature_storage_path: {len(folders)} folders for {len(endpoints)} feature_endpoint servers: "
                "give one folder all of them write to, or one per server in the same order"
            )
        urls = [endpoint.url for endpoint in endpoints]
        if len(set(urls)) != len(urls):
            raise ValueError(f"feature_endpoint lists a server twice: {', '.join(urls)}")
        object.__setattr__(self, "endpoints", endpoints)
        object.__setattr__(
            self, "storages", tuple(os.fspath(folder) for folder in folders) * (len(endpoints) // len(folders))
        )

    endpoints: tuple[EndpointSettings, ...] = field(init=False, default=())  # from `endpoint`
    storages: tuple[str, ...] = field(init=False, default=())  # from `storage`, one per server


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """The layer ids vLLM's `eagle_aux_hidden_state_layer_ids` takes for the draft's `target_layer_ids`."""
    return sorted({int(layer_id) + 1 for layer_id in layer_ids})


@dataclass(frozen=True)
class EngineLayout:
    """How a server's file becomes the draft's features: the layers vLLM returns (the draft's
    `target_layer_ids` + 1, sorted, once each), the draft's order into them, and the width."""

    layer_ids: tuple[int, ...]
    hidden_size: int

    @property
    def engine_ids(self) -> list[int]:
        return engine_layer_ids(self.layer_ids)

    @property
    def order(self) -> list[int]:
        return [self.engine_ids.index(int(layer_id) + 1) for layer_id in self.layer_ids]

    def max_file_bytes(self, tokens: int) -> int:
        """The most a request's file can hold: float64 at most, token ids, and a header."""
        return tokens * (len(self.engine_ids) * self.hidden_size + 1) * 8 + HEADER_BYTES


class ServerNudger:
    """Makes an idle server take a step (a one-token request), so a finished request's file is
    written; at most one nudge in flight, at most one per NUDGE_INTERVAL."""

    def __init__(self, client: EndpointClient, prompt: list[int], storage: EngineStorage):
        self.client, self.prompt, self.storage = client, prompt, storage
        self.files: list[str] = []  # the nudges' own hidden-state files, removed once written
        self._lock = asyncio.Lock()
        self._last = 0.0

    async def nudge(self) -> None:
        if self._lock.locked():
            return
        async with self._lock:
            if time.monotonic() - self._last < NUDGE_INTERVAL:
                return
            body = await self.client.completion_of_ids(self.prompt, max_tokens=1)
            self._last = time.monotonic()
            self.files.append(self.storage.file_named(body))

    def remove_files(self) -> None:
        """Remove the nudges' files that are written; the others (written at the server's next step)
        are kept for a later call."""
        waiting = []
        for path in self.files:
            if lock_state(path) == "released":
                remove_hidden_states(path)
            else:
                waiting.append(path)
        self.files = waiting


class ServerBoard:
    """Requests in flight and dropped flags of each server, in shared memory: every process of a
    run (the data-loader workers are forked from the one that made it) sees the same load and the
    same drops."""

    def __init__(self, count: int):
        self.count = count
        self._cells = multiprocessing.Array("i", 2 * count)  # in flight, then dropped (0/1), per server

    def take(self) -> int | None:
        """The live server with the fewest requests in flight (counted as one more), None when none is live."""
        with self._cells.get_lock():
            live = [index for index in range(self.count) if not self._cells[self.count + index]]
            if not live:
                return None
            index = min(live, key=lambda server: self._cells[server])
            self._cells[index] += 1
            return index

    def release(self, index: int) -> None:
        with self._cells.get_lock():
            self._cells[index] -= 1

    def others_live(self, index: int) -> bool:
        with self._cells.get_lock():
            return any(not self._cells[self.count + other] for other in range(self.count) if other != index)

    def drop(self, index: int) -> bool:
        """Drop server `index` when another is live; True when this call dropped it (the caller warns)."""
        with self._cells.get_lock():
            if self._cells[self.count + index]:
                return False
            if not any(not self._cells[self.count + other] for other in range(self.count) if other != index):
                return False
            self._cells[self.count + index] = 1
            return True

    def dropped(self) -> list[int]:
        with self._cells.get_lock():
            return [index for index in range(self.count) if self._cells[self.count + index]]


@dataclass
class EngineServer:
    """One server: its client, the folder its files land in, and its nudger."""

    index: int
    client: EndpointClient
    storage: EngineStorage | None = None
    nudger: ServerNudger | None = None

    def ready(self, nudge_prompt: list[int], folder: str) -> None:
        """Use `folder` once the server is known to write there (after its probe: it creates it)."""
        self.storage = EngineStorage(folder, self.client.name)
        self.nudger = ServerNudger(self.client, nudge_prompt, self.storage)

    def attached(self) -> tuple[EngineStorage, ServerNudger]:
        """Its storage folder and nudger, which exist once `ready` ran (after the probe)."""
        if self.storage is None or self.nudger is None:
            raise RuntimeError(f"{self.client.name} {self.client.base}: its files were asked for before its probe")
        return self.storage, self.nudger


class EngineServers:
    """The pool: `features(ids)` asks the least-loaded live server. Use as an async context manager;
    `check` (once per run, in one process) probes every server and returns the served model names
    the other processes pass as `models` instead of probing again."""

    def __init__(
        self,
        settings: FeatureEndpointSettings,
        layout: EngineLayout,
        board: ServerBoard | None = None,
        models: Sequence[str] | None = None,
        nudge_prompt: list[int] | None = None,
    ):
        self.settings, self.layout = settings, layout
        self.board = board or ServerBoard(len(settings.endpoints))
        self.servers: list[EngineServer] = []
        for index, endpoint in enumerate(settings.endpoints):
            if models is not None:
                endpoint = replace(endpoint, model=models[index])
            client = EndpointClient(endpoint, fail_fast=partial(self.board.others_live, index))
            self.servers.append(EngineServer(index, client))
        if models is not None:
            for server, folder in zip(self.servers, settings.storages, strict=True):
                server.ready(nudge_prompt or [0], folder)
        self.reasons: dict[int, str] = {}  # why this process saw each server fail

    async def __aenter__(self) -> EngineServers:
        return self

    async def __aexit__(self, *exc_info) -> None:
        for server in self.servers:
            if server.nudger is not None:
                server.nudger.remove_files()
            await server.client.__aexit__(*exc_info)

    @property
    def urls(self) -> list[str]:
        return [server.client.base for server in self.servers]

    async def check(self, tokenizer: Any, probe_ids: list[int], nudge_prompt: list[int]) -> list[str]:
        """Probe every server (it serves the target: `checked_model`), then read the probe's own
        file: it must be in the server's storage folder as seen here and hold the draft's layers at
        the target's width; it is removed. Returns the served model names."""
        models = []
        for server, folder in zip(self.servers, self.settings.storages, strict=True):
            models.append(await server.client.checked_model(tokenizer, probe_ids))
            server.ready(nudge_prompt, folder)
            storage, nudger = server.attached()
            path = storage.file_named(server.client.probe_reply)
            tensors = await read_hidden_states(
                path,
                self.settings.file_timeout,
                nudger,
                server.client.name,
                self.layout.max_file_bytes(len(probe_ids)),
            )
            remove_hidden_states(path)
            # the layers and width training needs (its token ids are the server's templating of the probe)
            written = tensors.get("token_ids")
            ids = written.tolist() if isinstance(written, torch.Tensor) and written.dim() == 1 else probe_ids
            where = f"{server.client.base} probe file {path}"
            engine_features(tensors, ids, self.layout.order, self.layout.hidden_size, where)
            nudger.remove_files()
        return models

    async def features(self, ids: list[int], what: str) -> torch.Tensor:
        """[tokens, n*H] of `ids` in the draft's layer order, from the least-loaded live server; a
        server gone meanwhile is dropped and the sample asked of another."""
        while True:
            index = self.board.take()
            if index is None:
                raise self._all_gone()
            server = self.servers[index]
            try:
                return await request_features(server, ids, self.layout, self.settings.file_timeout, what)
            except EndpointGone as error:
                self.reasons[index] = str(error)
                self._drop(index, error)  # else it is the last one now: asked again, with its retries
            except EndpointUnreachable as error:
                self.reasons[index] = str(error)
                if not self._drop(index, error):
                    raise self._all_gone() from None
            finally:
                self.board.release(index)

    def _drop(self, index: int, error: EndpointError) -> bool:
        if self.board.drop(index):
            live = [url for other, url in enumerate(self.urls) if other not in self.board.dropped()]
            logger.warning(
                "feature_endpoint %s is dropped for the rest of the run (%s); its requests go to %s",
                self.urls[index],
                error,
                ", ".join(live),
            )
            return True
        return index in self.board.dropped()

    def _all_gone(self) -> EndpointError:
        described = [f"{url} ({self.reasons.get(index, 'dropped')})" for index, url in enumerate(self.urls)]
        return EndpointError(
            f"feature_endpoint: no server answers any more, past every deadline: {'; '.join(described)}"
        )

    def remove_nudge_files(self) -> None:
        for server in self.servers:
            if server.nudger is not None:
                server.nudger.remove_files()


def probe_inputs(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The probe conversation's token ids (as the server must template them) and the one-token
    prompt of the nudges."""
    probe = render(tokenizer, PROBE_MESSAGES, True, template_kwargs(tokenizer, None))
    return probe, tokenizer.encode("Hi", add_special_tokens=False)[:1] or [0]


async def request_features(
    server: EngineServer, ids: list[int], layout: EngineLayout, file_timeout: float, what: str
) -> torch.Tensor:
    """One sample's features from one server: the request, the file it names (read, then removed),
    and the checks against the request (token ids, shape, layers, finiteness)."""
    client = server.client
    try:
        body = await client.completion_of_ids(ids, max_tokens=1)
    except EndpointRefusal as refusal:
        raise EndpointError(
            f"{client.name} {client.base} refused {what} ({len(ids)} tokens): {refusal} (start the server with "
            "--max-model-len above the recipe's max_length)"
        ) from None
    storage, nudger = server.attached()
    path = storage.file_named(body)
    tensors = await read_hidden_states(path, file_timeout, nudger, client.name, layout.max_file_bytes(len(ids)))
    remove_hidden_states(path)
    return engine_features(tensors, ids, layout.order, layout.hidden_size, f"{client.name} file {path}")
