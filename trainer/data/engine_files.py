"""The files a vLLM server writes its hidden states to, read without trusting the server: only a
`.safetensors` file directly in the storage folder the recipe names (`feature_storage_path`), only a
regular file (never through a symbolic link, never a FIFO or device that would block), only once its
lock is released, never larger than its request's hidden states can be, every wait bounded; then
checked against the request (token ids, shape, layer count, finiteness) and mapped to the draft's
layer order. Used alike by the offline store (`engine_features`) and the streamed path
(`online_features`), through `engine_servers.request_features`."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import time
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from trainer.data.endpoint import EndpointError

NUDGE_AFTER = 0.25  # seconds a file may be late before the server is asked to take a step
POLL_INTERVAL = 0.02
ENGINE_FILE_SUFFIX = ".safetensors"  # vLLM's hidden-states connector writes <storage>/<request id>.safetensors
HEADER_BYTES = 1 << 20  # room for a file's safetensors header beyond its tensors' bytes
SHOWN_PATH = 200  # characters of a server-named path quoted in a message


class Nudger(Protocol):
    """What makes an idle server take a step (so a finished request's file gets written)."""

    async def nudge(self) -> None: ...


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


def lock_state(path: str) -> str:
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
    lock = lock_state(path)
    descriptor = _open_regular(path)
    exists = descriptor is not None
    if descriptor is not None:
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
    path: str, timeout: float, nudger: Nudger, name: str, max_bytes: int | None = None
) -> dict[str, torch.Tensor]:
    """The server's regular file at `path` once it is whole: its lock is free and it parses. Nudges
    an idle server; gives up `timeout` seconds after the call, the nudges' own requests included,
    with one line saying what is true of the file (missing, still locked, not a regular file)."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    while True:
        try:
            tensors = _load_regular(path, max_bytes) if lock_state(path) == "released" else None
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
