"""Target hidden states from a vLLM server (`feature_endpoint`), for targets the training nodes
cannot hold: the offline feature store is built from what the serving engine computes.

The server runs the target with vLLM's `extract_hidden_states` speculative method and a
hidden-states connector (`engine_feature_command` prints the command): every request's prompt
hidden states at the configured layers are written by the server to `<request>.safetensors`
(`hidden_states` [tokens, layers, H], `token_ids`) under its `shared_storage_path`, and the reply
names the file (`kv_transfer_params.hidden_states_path`). This client sends each sample's token ids
as a one-token completion, reads the file (which must be visible here at the same path: the same
machine or a shared filesystem) and stores the features exactly as in-process capture would: the
same store layout, index, statistics and cache entry, so `train.py` finds the store under the
same key.

Nothing a server names is trusted: the recipe names the folder the server writes to
(`feature_storage_path`), and a file is read and removed only when the reply names a
`.safetensors` file directly in it (paths resolved) and it is a regular file (never through a
symbolic link, never a FIFO or device that would block); any other reply is one error line.

vLLM's layer ids are the draft's `target_layer_ids` + 1 (the input of layer id + 1 is the output
of layer id, i.e. transformers' `hidden_states[id + 1]`), sorted and de-duplicated; the store keeps
the draft's order. Two things vLLM cannot give are refused in one line: the last layer (vLLM
returns it before the final norm, in-process capture after it) and the final-normed hidden states
distillation needs.

A finished request's file is written at the engine's *next* step, so the last requests of a run
would wait forever on an idle server: after a short wait the client sends a one-token "nudge"
request to make it step, and every wait has a deadline (`feature_file_timeout`). Requests run
`feature_concurrency` at a time with the regeneration client's retries and deadlines; finished
shards are kept in `<entry>.partial/` and journaled, so a capture killed with SIGKILL resumes with
only the unfinished shard asked again.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors import SafetensorError
from safetensors.torch import load
from tqdm.auto import tqdm

from trainer.data.chat import render, template_kwargs
from trainer.data.endpoint import (
    PROBE_MESSAGES,
    EndpointClient,
    EndpointError,
    EndpointRefusal,
    EndpointSettings,
    run_workers,
)
from trainer.data.feature_store import (
    FEATURE_INDEX,
    ShardWriter,
    feature_store_path,
    remove_interrupted_captures,
    store_fingerprint,
)
from trainer.fileio import check_safetensors_file, fsync_path, reporting_disk_full, write_file_atomically
from trainer.locks import lock_cache_entry
from trainer.models.target import TargetTokenizer

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.jsonl"  # one line per finished shard of an unfinished store
NUDGE_AFTER = 0.25  # seconds a file may be late before the server is asked to take a step
NUDGE_INTERVAL = 0.25  # seconds between nudges
POLL_INTERVAL = 0.02
ENGINE_SHARD_SAMPLES = 64  # samples per shard: what a killed capture asks again at most
ENGINE_FILE_SUFFIX = ".safetensors"  # vLLM's hidden-states connector writes <storage>/<request id>.safetensors
HEADER_BYTES = 1 << 20  # room for a file's safetensors header beyond its tensors' bytes
SHOWN_PATH = 200  # characters of a server-named path quoted in a message


@dataclass(frozen=True)
class FeatureEndpointSettings:
    """Where and how to ask: the connection settings, how long a finished request's file may take,
    and the folder the server writes its files to (`feature_storage_path`: its shared_storage_path
    as seen here), the only place whose files the client reads or removes."""

    endpoint: EndpointSettings
    file_timeout: float = 120.0
    storage: str | os.PathLike | None = None

    def __post_init__(self):
        if not self.file_timeout > 0:
            raise ValueError(f"feature_file_timeout must be > 0 seconds (got {self.file_timeout})")
        if not self.storage:
            raise ValueError(
                "feature_endpoint needs feature_storage_path: the folder the server writes its hidden-state "
                "files to (the shared_storage_path of its --kv-transfer-config), as seen from this machine"
            )


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """The layer ids vLLM's `eagle_aux_hidden_state_layer_ids` takes for the draft's `target_layer_ids`."""
    return sorted({int(layer_id) + 1 for layer_id in layer_ids})


STOCK_CONNECTOR = {"kv_connector": "ExampleHiddenStatesConnector"}


def engine_feature_arguments(
    layer_ids: Sequence[int], storage: str | Path, connector: dict[str, str] | None = None
) -> list[str]:
    """vLLM's two flags that make a server write the hidden states of `layer_ids` (the draft's
    target_layer_ids) under `storage`: extract_hidden_states, and the hidden-states connector
    (`connector` replaces the stock one, e.g. the CPU variant of the engine tests)."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(layer_ids)}},
    }
    transfer = {
        **(connector or STOCK_CONNECTOR),
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


def engine_feature_command(
    target: str, layer_ids: Sequence[int], storage: str, tensor_parallel: int = 1, served_name: str | None = None
) -> list[str]:
    """The `vllm serve` command of a GPU node serving the target's hidden states for `layer_ids`."""
    command = ["vllm", "serve", target]
    if served_name:
        command += ["--served-model-name", served_name]
    if tensor_parallel > 1:
        command += ["--tensor-parallel-size", str(tensor_parallel)]
    return [*command, *engine_feature_arguments(layer_ids, storage)]


def check_engine_layers(layer_ids: Sequence[int], num_layers: int, final_hidden: bool) -> None:
    """Refuse, in one line, what a vLLM feature endpoint cannot return as in-process capture does."""
    if final_hidden:
        raise ValueError(
            "feature_endpoint: distillation (loss_type kd, or kd_weight > 0) needs the target's final-normed "
            "hidden states, which vLLM's extract_hidden_states does not return: capture in process "
            "(unset feature_endpoint) or train with loss_type ce"
        )
    last = num_layers - 1
    if last in [int(layer_id) for layer_id in layer_ids]:
        raise ValueError(
            f"feature_endpoint: target_layer_ids {list(layer_ids)} includes the target's last layer ({last}), "
            "which vLLM returns before the final norm and in-process capture after it: choose earlier layers, "
            "or capture in process (unset feature_endpoint)"
        )


def prepare_engine_features(
    settings: FeatureEndpointSettings,
    target: TargetTokenizer,
    dataset: datasets.Dataset,
    layer_ids: Sequence[int],
    cache_root: Path,
    dtype: torch.dtype = torch.float32,
    shard_samples: int = ENGINE_SHARD_SAMPLES,
) -> Path:
    """The feature store of `dataset` (as `prepare_features` would write it), built through a vLLM
    server. An existing store is reused; an unfinished one is resumed; one process writes it."""
    check_engine_layers(layer_ids, target.num_layers, final_hidden=False)
    path = feature_store_path(target, dataset, layer_ids, cache_root, dtype)
    if (path / FEATURE_INDEX).exists():
        logger.info("Reusing offline target features from %s", path)
        return path
    with lock_cache_entry(path, "feature store"):
        if (path / FEATURE_INDEX).exists():
            logger.info("Reusing offline target features from %s (captured by another process)", path)
            return path
        remove_interrupted_captures(path)  # an in-process capture of this entry that was killed
        staging = path.with_name(path.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        shards = _recovered_shards(staging)
        done = {sample for shard in shards for sample in shard["samples"]}
        progress_file = staging / PROGRESS_FILE

        kept = f"the finished shards are kept in {staging}: free space, then rerun to resume"

        def journal(shard: dict[str, Any]) -> None:
            with reporting_disk_full("feature store", path, kept), progress_file.open("a") as file:
                file.write(json.dumps(shard) + "\n")
                file.flush()
                os.fsync(file.fileno())

        writer = ShardWriter(staging, path, len(dataset), shard_samples, shards, journal, kept)
        rows = [row for row in range(len(dataset)) if row not in done]
        logger.info(
            "Capturing target hidden states through %s: asking %d of %d samples",
            settings.endpoint.url,
            len(rows),
            len(dataset),
        )
        try:
            asyncio.run(_capture_through_engine(settings, target, dataset, rows, layer_ids, dtype, writer))
        except EndpointError as error:
            writer.flush()  # the samples already read are kept too
            raise EndpointError(
                f"{error}; {writer.captured} of {len(dataset)} samples are captured and kept in {staging}: "
                "rerun to resume"
            ) from None
        writer.flush()
        index = writer.index(store_fingerprint(target, layer_ids, dtype, False))
        with reporting_disk_full("feature store", path, kept):
            write_file_atomically(staging / FEATURE_INDEX, lambda temporary: temporary.write_text(json.dumps(index)))
        progress_file.unlink()
        fsync_path(staging)
        os.replace(staging, path)
    return path


def _recovered_shards(staging: Path) -> list[dict[str, Any]]:
    """The journaled shards of an unfinished store whose files are whole; anything else in the
    folder (a shard written but not journaled, a torn journal line) is removed and asked again."""
    progress_file = staging / PROGRESS_FILE
    shards: list[dict[str, Any]] = []
    lines = progress_file.read_text().splitlines() if progress_file.exists() else []
    for line in lines:
        try:
            shard = json.loads(line)
            header = check_safetensors_file(staging / shard["file"])
            if not all(f"sample_{sample}" in header for sample in shard["samples"]):
                raise ValueError("a journaled sample is missing from its shard")
        except (ValueError, KeyError, TypeError, OSError):
            continue
        shards.append(shard)
    if len(shards) != len(lines):
        logger.warning(
            "%s: %d of %d journaled shards are damaged and asked again", staging, len(lines) - len(shards), len(lines)
        )
    if shards or lines:
        logger.info("Resuming the feature capture in %s: %d shards already captured", staging, len(shards))
    keep = {shard["file"] for shard in shards}
    for leftover in staging.iterdir():
        if leftover.name not in keep:
            leftover.unlink()
    text = "".join(json.dumps(shard) + "\n" for shard in shards)
    write_file_atomically(progress_file, lambda temporary: temporary.write_text(text))
    return shards


class EngineStorage:
    """The folder the server writes to (`feature_storage_path`), resolved once: a file a reply names
    is used only when it is a `.safetensors` name directly in it."""

    def __init__(self, folder: str | os.PathLike, name: str):
        self.folder, self.name = os.path.realpath(folder), name
        if not os.path.isdir(self.folder):
            raise EndpointError(
                f"feature_storage_path {os.fspath(folder)} is not a folder on this machine: set it to the "
                "server's shared_storage_path as seen here (same machine or a shared filesystem)"
            )

    def file_named(self, body: dict[str, Any]) -> str:
        """The path of the hidden-state file a reply names (`kv_transfer_params.hidden_states_path`),
        once it is a .safetensors file directly in the folder; any other reply is an EndpointError."""
        params = body.get("kv_transfer_params")
        named = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not isinstance(named, str) or not named:
            raise EndpointError(
                f"{self.name} answered without kv_transfer_params.hidden_states_path: serve the target with "
                "--speculative-config method extract_hidden_states and a hidden-states --kv-transfer-config "
                "(see docs/your-own-target.md)"
            )
        try:
            inside = (
                os.path.isabs(named)
                and os.path.basename(named).endswith(ENGINE_FILE_SUFFIX)
                and os.path.realpath(os.path.dirname(named)) == self.folder
            )
        except ValueError:  # an embedded NUL byte
            inside = False
        if not inside:
            raise EndpointError(
                f"{self.name} named the hidden-state file {named[:SHOWN_PATH]!r}, which is not a {ENGINE_FILE_SUFFIX} "
                f"file directly in feature_storage_path {self.folder}: it is neither read nor removed (set "
                "feature_storage_path to the folder the server writes, its shared_storage_path)"
            )
        return os.path.join(self.folder, os.path.basename(named))


class NotRegularFileError(EndpointError):
    """A server's file (or its lock) that is a symbolic link, a folder, a FIFO or a device."""


def _open_regular(path: str) -> int | None:
    """A read descriptor of `path` when it is a regular file, None when it does not exist; anything
    else is a NotRegularFileError. Never follows a symbolic link and never blocks on a FIFO."""
    try:
        kind = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(kind):
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.ENXIO):
                raise
        else:
            if stat.S_ISREG(os.fstat(descriptor).st_mode):  # still the file checked (not swapped meanwhile)
                return descriptor
            os.close(descriptor)
        kind = os.lstat(path).st_mode
    what = "a symbolic link" if stat.S_ISLNK(kind) else "a folder" if stat.S_ISDIR(kind) else "a special file"
    raise NotRegularFileError(f"{path} is {what}, not a regular file: the client reads and removes only regular files")


class _Nudger:
    """Makes an idle server take a step (a one-token request), so a finished request's file is
    written; at most one nudge in flight, at most one per NUDGE_INTERVAL."""

    def __init__(self, client: EndpointClient, prompt: list[int], storage: EngineStorage):
        self.client, self.prompt, self.storage = client, prompt, storage
        self.files: list[str] = []  # the nudges' own hidden-state files, removed at the end
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
        """Remove the nudges' files that are written (the last one is written at the server's next step)."""
        for path in self.files:
            if _lock_state(path) == "released":
                remove_hidden_states(path)


def _lock_state(path: str) -> str:
    """The server's lock on the file at `path` (`path.lock`, held while it writes): "held",
    "released" or "missing"."""
    descriptor = _open_regular(path + ".lock")
    if descriptor is None:
        return "missing"
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return "released"
    except BlockingIOError:
        return "held"
    finally:
        os.close(descriptor)


def remove_hidden_states(path: str) -> None:
    """Remove a consumed file and its lock: only regular files (a link or folder a server put
    there under that name is left alone)."""
    for leftover in (path, path + ".lock"):
        try:
            if stat.S_ISREG(os.lstat(leftover).st_mode):
                os.unlink(leftover)
        except FileNotFoundError:
            pass


def _load_regular(path: str, max_bytes: int | None) -> dict[str, torch.Tensor] | None:
    """The tensors of the regular file at `path` (safetensors: tensors only, never pickles), None
    when it does not exist; a file over `max_bytes` is an error (never read into memory)."""
    descriptor = _open_regular(path)
    if descriptor is None:
        return None
    with os.fdopen(descriptor, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise EndpointError(
                f"{path} holds {size} bytes, more than the {max_bytes} its request's hidden states can take"
            )
        return load(file.read())


def _waiting_for(path: str) -> str:
    """What is true of a file that has not come: still locked, released but missing, or neither
    (the folder is not the server's)."""
    lock = _lock_state(path)
    descriptor = _open_regular(path)
    exists = descriptor is not None
    if exists:
        os.close(descriptor)
    if exists and lock == "missing":
        return (
            "it exists but has no lock file, so it is never known to be whole: keep the connector's "
            "use_synchronization_lock on"
        )
    if lock == "held":
        if exists:
            return "it exists but is still locked by the server"
        return "it does not exist yet, and its lock file is still locked by the server"
    if lock == "released":
        return "its lock is released but the file does not exist: the server did not write it"
    return (
        "neither it nor its lock file exists on this machine: prepare must see the server's "
        "shared_storage_path at the same path (feature_storage_path; same machine or a shared filesystem)"
    )


async def read_hidden_states(
    path: str, timeout: float, nudger: _Nudger, name: str, max_bytes: int | None = None
) -> dict[str, torch.Tensor]:
    """The server's regular file at `path` once it is whole: its lock is free and it parses. Nudges
    an idle server; gives up `timeout` seconds after the call, the nudges' own requests included,
    with one line saying what is true of the file (missing, still locked, not a regular file)."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    while True:
        try:
            tensors = _load_regular(path, max_bytes) if _lock_state(path) == "released" else None
        except EndpointError as error:  # not a regular file, or too large: no wait changes that
            raise EndpointError(f"{name}: the hidden-state file {error}") from None
        except (SafetensorError, OSError) as error:
            if time.monotonic() >= deadline:
                raise EndpointError(f"{name}: the hidden-state file {path} is not readable ({error})") from None
            tensors = None
        if tensors is not None:
            return tensors
        if time.monotonic() >= deadline:
            try:
                where = _waiting_for(path)
            except NotRegularFileError as error:
                raise EndpointError(f"{name}: the hidden-state file {error}") from None
            raise EndpointError(
                f"{name}: the hidden-state file {path} was not written within feature_file_timeout={timeout:g} s "
                f"({where})"
            )
        if time.monotonic() - started > NUDGE_AFTER:
            try:
                await asyncio.wait_for(nudger.nudge(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                continue  # the deadline has come: say what is true of the file
        await asyncio.sleep(min(POLL_INTERVAL, max(deadline - time.monotonic(), 0.0)))


def engine_features(
    tensors: dict[str, torch.Tensor], ids: list[int], order: list[int], hidden_size: int, where: str
) -> torch.Tensor:
    """[tokens, n*H] in the draft's layer order, from a server file checked against the request."""
    hidden, token_ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if hidden is None or token_ids is None:
        raise EndpointError(f"{where}: expected tensors hidden_states and token_ids, found {sorted(tensors)}")
    if token_ids.tolist() != ids:
        raise EndpointError(f"{where}: token_ids are not the {len(ids)} token ids sent")
    layers = max(order) + 1
    if hidden.dim() != 3 or hidden.shape[0] != len(ids) or hidden.shape[2] != hidden_size:
        raise EndpointError(
            f"{where}: hidden_states has shape {list(hidden.shape)}, expected [{len(ids)}, {layers}, {hidden_size}]"
        )
    if hidden.shape[1] != layers:
        raise EndpointError(
            f"{where}: the server returns {hidden.shape[1]} layers, the draft needs {layers}: start it with the "
            "eagle_aux_hidden_state_layer_ids of `engine_feature_command` (the target_layer_ids + 1)"
        )
    if not torch.isfinite(hidden).all():
        raise EndpointError(f"{where}: hidden_states holds non-finite values")
    return hidden[:, order].reshape(len(ids), -1)


async def _capture_through_engine(
    settings: FeatureEndpointSettings,
    target: TargetTokenizer,
    dataset: datasets.Dataset,
    rows: list[int],
    layer_ids: Sequence[int],
    dtype: torch.dtype,
    writer: ShardWriter,
) -> None:
    tokenizer = target.tokenizer
    aux = engine_layer_ids(layer_ids)
    order = [aux.index(int(layer_id) + 1) for layer_id in layer_ids]
    pending = iter(rows)
    total = len(dataset)
    async with EndpointClient(settings.endpoint) as client:
        await client.checked_model(tokenizer, render(tokenizer, PROBE_MESSAGES, True, template_kwargs(tokenizer, None)))
        storage = EngineStorage(settings.storage, client.name)  # after the probe: the server has made it
        nudger = _Nudger(client, tokenizer.encode("Hi", add_special_tokens=False)[:1] or [0], storage)
        nudger.files.append(storage.file_named(client.probe_reply))  # the probe's own file
        progress = tqdm(
            total=total, initial=total - len(rows), desc=f"capturing target hidden states through {client.base}"
        )

        async def capture(row: int) -> None:
            ids = [int(token) for token in dataset[row]["input_ids"]]
            try:
                body = await client.completion_of_ids(ids, max_tokens=1)
            except EndpointRefusal as refusal:
                raise EndpointError(
                    f"{client.name} refused sample {row} ({len(ids)} tokens): {refusal} (start the server with "
                    "--max-model-len above the recipe's max_length)"
                ) from None
            path = storage.file_named(body)
            limit = len(ids) * (len(aux) * target.hidden_size + 1) * 8 + HEADER_BYTES  # 8 bytes: float64 at most
            tensors = await read_hidden_states(path, settings.file_timeout, nudger, client.name, limit)
            features = engine_features(tensors, ids, order, target.hidden_size, f"{client.name} file {path}")
            writer.add(row, features.to(dtype), token_ids=ids)
            remove_hidden_states(path)
            progress.update(1)

        async def worker() -> None:
            for row in pending:
                await capture(row)

        try:
            await run_workers(worker, settings.endpoint.concurrency)
        finally:
            progress.close()
            nudger.remove_files()
