"""Files the project writes for users (never half-written, never lost), and the checks that make a
user's missing or damaged file an error naming that file."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Names that can only be local files: a Hub id is `name` or `org/name`, never one of these.
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".gguf", ".yaml", ".yml", ".safetensors", ".bin", ".pt")
SAFETENSORS_INDEX = "model.safetensors.index.json"
CHECKPOINT_WEIGHTS = ("model.safetensors", "adapter_model.safetensors")


def default_cache_root() -> Path:
    """Where converted targets, generated datasets and features are cached (`DFLASH2_CACHE` overrides)."""
    override = os.environ.get("DFLASH2_CACHE")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash2-hub"


def digest(payload: Any) -> str:
    """A short stable hash of a JSON-serialisable payload (cache keys)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def write_directory_atomically(directory: Path, write: Callable[[Path], None]) -> None:
    """Fill a temporary sibling with `write`, then rename it into place: readers see the whole
    directory or nothing, and an interrupted write leaves no partial result behind."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        write(temporary)
        if directory.exists():  # another process finished the same cache entry first
            shutil.rmtree(temporary)
            return
        os.replace(temporary, directory)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A write ran out of space (or quota); the message names what was being written, where, and
    what is kept (an OSError: the scripts print it in one line and exit 2)."""


def format_bytes(count: float) -> str:
    """`count` bytes for messages: `512 bytes`, `4.1 KiB`, ..., `20.5 GiB`."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


def existing_folder(path: Path) -> Path:
    """`path` when it is a folder, else its nearest existing parent folder."""
    path = Path(path)
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def free_space(path: Path) -> str:
    """Free space on the filesystem holding `path` (or its nearest existing parent), for messages."""
    try:
        return format_bytes(shutil.disk_usage(existing_folder(path)).free)
    except OSError:
        return "unknown"


PROBE_BYTES = 64 * 1024
SAFETENSORS_ERRNOS = {"os error 28": errno.ENOSPC, "os error 122": errno.EDQUOT}


def _probe_disk_full(path: Path) -> int | None:
    """ENOSPC / EDQUOT when the folder of `path` cannot take 64 KiB now, else None."""
    probe = existing_folder(path) / f".dflash2-space-probe-{os.getpid()}-{id(path):x}"
    try:
        with probe.open("wb") as handle:
            handle.write(b"\0" * PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        return error.errno if error.errno in DISK_FULL_ERRNOS else None
    finally:
        probe.unlink(missing_ok=True)
    return None


def disk_full_errno(error: BaseException, path: Path) -> int | None:
    """ENOSPC / EDQUOT when `error` is a full disk, whichever library hit it: an OSError says so
    itself; safetensors reports `os error 28` inside a SafetensorError, and torch.save only an
    `unexpected pos` RuntimeError, so for that one the filesystem is probed."""
    if isinstance(error, OSError):
        return error.errno if error.errno in DISK_FULL_ERRNOS else None
    message = str(error)
    for marker, code in SAFETENSORS_ERRNOS.items():
        if marker in message:
            return code
    if isinstance(error, RuntimeError) and ("inline_container" in message or "PytorchStreamWriter" in message):
        return _probe_disk_full(path)
    return None


@contextlib.contextmanager
def reporting_disk_full(what: str, path: Path, kept: str = "") -> Iterator[None]:
    """Turn a full disk or quota hit inside (`disk_full_errno`: an OSError, or a library's own error
    for it) into a `DiskFullError` naming `what`, `path`, the free space left and `kept` (what
    survives, e.g. the last complete checkpoint); other errors pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        code = disk_full_errno(error, path)
        if code is None:
            raise
        reason = "no space left on device" if code == errno.ENOSPC else "disk quota exceeded"
        message = f"{reason} while writing {what} {path} ({free_space(path)} free)"
        full = DiskFullError(f"{message}{'; ' + kept if kept else ''}")
        full.errno = code
        raise full from error


# Names of what the atomic writers below leave behind only when killed mid-write.
SAVING_PREFIX = ".saving-"
REPLACED_PREFIX = ".replaced-"  # an old folder moved aside by replace_directory or remove_directory
TEMPORARY_SUFFIX = ".tmp"


def fsync_path(path: Path) -> None:
    """Flush a file's data or a directory's entries to disk, so a rename that follows survives a crash."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace_files_atomically(directory: Path, write: Callable[[Path], None]) -> None:
    """Fill a temporary folder inside `directory` with `write`, then move each file over its old
    version with one rename: every file in `directory` is always either the old or the new one,
    and everything else there (a run's checkpoints) is left alone."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=directory, prefix=SAVING_PREFIX))
    try:
        write(temporary)
        for path in sorted(temporary.iterdir()):
            if path.is_dir():  # none in a draft save; replaced whole
                shutil.rmtree(directory / path.name, ignore_errors=True)
            else:
                fsync_path(path)
            os.replace(path, directory / path.name)
        fsync_path(directory)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _aside_name(path: Path, prefix: str) -> Path:
    """A fresh sibling name for `path` out of its own namespace (`prefix` marks what left it there)."""
    return path.with_name(f"{prefix}{path.name}-{uuid.uuid4().hex[:8]}")


def replace_directory(new: Path, destination: Path, aside_prefix: str = REPLACED_PREFIX) -> None:
    """Swap the finished folder `new` into place as `destination` (a sibling on the same filesystem).

    Guarantee: the old folder is never lost, and readers see the old folder or the new one, never a
    mix. The old one is renamed aside first (`aside_prefix`), then `new` onto its name; if that rename
    fails the old folder is renamed back before the error is raised (`new` is left for the caller),
    and it is deleted only once the new one is in place. Between the two renames the name is briefly
    absent; a kill in that instant leaves both folders whole under their temporary names.
    """
    new, destination = Path(new), Path(destination)
    aside = _aside_name(destination, aside_prefix) if destination.exists() else None
    if aside is not None:
        os.replace(destination, aside)
    try:
        os.replace(new, destination)
    except BaseException:
        if aside is not None:
            os.replace(aside, destination)
        raise
    fsync_path(destination.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_directory(path: Path, aside_prefix: str = REPLACED_PREFIX) -> None:
    """Delete a folder without ever leaving it half-deleted under its own name: renamed aside, then removed."""
    path = Path(path)
    if not path.exists():
        return
    aside = _aside_name(path, aside_prefix)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Checks on what users point the project at
# ---------------------------------------------------------------------------------------------


def looks_like_local_path(spec: str | os.PathLike) -> bool:
    """True when `spec` cannot be a Hub id (`name` or `org/name`), so that a missing one is reported
    as a missing path rather than as a malformed Hub repo id."""
    if not isinstance(spec, str):
        return True  # a Path object is local by intent
    if "://" in spec:
        return False  # URLs (hf://, https://) are resolved by the libraries themselves
    return (
        spec.startswith(("/", "./", "../", "~"))
        or spec in (".", "..")
        or spec.count("/") > 1
        or spec.endswith(LOCAL_SUFFIXES)
        or Path(spec).is_absolute()
    )


def require_existing_path(spec: str | os.PathLike, what: str, *, local_only: bool = False) -> str:
    """`spec` with `~` expanded (the libraries do not expand it); raises FileNotFoundError naming
    `what` when it looks like a local path (or `local_only`) and does not exist. Hub ids pass
    through unchecked."""
    if not (local_only or looks_like_local_path(spec)):
        return str(spec)
    expanded = os.path.expanduser(spec)
    if not os.path.exists(expanded):
        raise FileNotFoundError(f"{what}: local path {spec} does not exist")
    return expanded


# Bytes per element of each safetensors dtype (a dtype not listed has its offsets checked, not its size).
SAFETENSORS_ELEMENT_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def check_safetensors_file(path: str | os.PathLike) -> dict[str, Any]:
    """Refuse a truncated or corrupt safetensors file from its header alone (the tensor data is
    never read), so the error names the file instead of coming from deep inside the loader; returns
    the parsed header (tensor name -> dtype, shape, data_offsets; `__metadata__` left out).

    Layout: an 8-byte little-endian header length, a JSON header mapping each tensor to its
    `data_offsets` [begin, end) in the data section, then the data section itself. Each tensor's
    shape x dtype size must equal end - begin, and the tensors must tile the data section exactly
    (sorted by offset, each beginning where the previous ends, the last ending at its end).
    """
    path = Path(path)
    size = path.stat().st_size
    damaged = f"{path} is truncated or corrupt"
    if size < 8:
        raise ValueError(f"{damaged}: header is not valid (only {size} bytes, no room for the 8-byte header length)")
    with path.open("rb") as file:
        header_length = int.from_bytes(file.read(8), "little")
        if header_length > size - 8:
            raise ValueError(
                f"{damaged}: header is not valid (it claims {header_length} bytes, the file has {size - 8} after it)"
            )
        raw_header = file.read(header_length)
    data_size = size - 8 - header_length
    try:
        header = json.loads(raw_header)
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        spans = {name: entry["data_offsets"] for name, entry in tensors.items()}
        valid = all(
            isinstance(span, list) and len(span) == 2 and all(type(offset) is int for offset in span)
            for span in spans.values()
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        valid = False
    if not valid:
        raise ValueError(f"{damaged}: header is not valid (not a JSON map of tensors to data_offsets)")
    expected = max((end for _, end in spans.values()), default=0)
    if expected != data_size:
        raise ValueError(f"{damaged}: header says {expected} bytes of tensor data, the file has {data_size}")
    for name, entry in tensors.items():
        shape, (begin, end) = entry.get("shape"), spans[name]
        if not isinstance(shape, list) or not all(type(extent) is int and extent >= 0 for extent in shape):
            raise ValueError(f"{damaged}: header is not valid (tensor {name} has shape {shape!r})")
        element_bytes = SAFETENSORS_ELEMENT_BYTES.get(entry.get("dtype"))
        if element_bytes is not None and math.prod(shape) * element_bytes != end - begin:
            raise ValueError(
                f"{damaged}: tensor {name} is {entry['dtype']} {shape} ({math.prod(shape) * element_bytes} bytes) "
                f"but its data_offsets [{begin}, {end}] span {end - begin} bytes"
            )
    previous_end, previous = 0, None
    for name, (begin, end) in sorted(spans.items(), key=lambda item: tuple(item[1])):
        if begin != previous_end or end < begin:
            after = f"tensor {previous} ends at {previous_end}" if previous else "the data section begins at 0"
            raise ValueError(f"{damaged}: tensor {name} has data_offsets [{begin}, {end}], but {after}")
        previous_end, previous = end, name
    return tensors


# Pickle weights (torch.save) that transformers or PEFT would load when no safetensors sit beside them:
# pytorch_model.bin, its shards pytorch_model-0000i-of-0000n.bin (listed in PICKLE_INDEX), adapter_model.bin.
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_WEIGHTS = r"pytorch_model.*\.bin|adapter_model\.bin"


def refuse_pickle_only_weights(directory: Path) -> None:
    """Refuse a local checkpoint whose only weights are pickles, naming them and a command that
    converts them where the user trusts the file: nothing a user or the Hub supplies is unpickled
    here, not even by torch's weights-only unpickler, which still parses whatever bytes it is given."""
    names = {path.name for path in directory.iterdir()}
    pickles = sorted(name for name in names if re.fullmatch(PICKLE_WEIGHTS, name))
    if not pickles and PICKLE_INDEX not in names:
        return
    converted = "adapter_model.safetensors" if pickles == ["adapter_model.bin"] else "model.safetensors"
    sources = ", ".join(json.dumps(str(directory / name)) for name in pickles)
    code = (
        "import torch; from safetensors.torch import save_file; "
        f"save_file({{k: v.contiguous().clone() for f in [{sources}] "
        "for k, v in torch.load(f, weights_only=True).items()}, "
        f'{json.dumps(str(directory / converted))}, metadata={{"format": "pt"}})'
    )
    raise ValueError(
        f"{directory} holds only pickle weights ({', '.join(pickles) or PICKLE_INDEX}), which are never loaded: "
        f"convert them to safetensors once, where you trust the file, e.g. python -c {shlex.quote(code)}"
    )


def check_checkpoint_weights(directory: str | os.PathLike) -> None:
    """Header-check every safetensors file a local checkpoint directory loads from (single file,
    adapter, or the shards of an index); a Hub id or a missing directory is left to the loader.
    A directory with pickle weights and no safetensors is refused (`refuse_pickle_only_weights`)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    files = [directory / name for name in CHECKPOINT_WEIGHTS if (directory / name).is_file()]
    index = directory / SAFETENSORS_INDEX
    if not files and not index.is_file():
        refuse_pickle_only_weights(directory)
    if index.is_file():
        content = read_json(index, None, dict)  # a damaged index is named with its line and column
        try:
            shards = set(content["weight_map"].values())
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index} is truncated or corrupt: no valid weight_map") from error
        files.extend(directory / shard for shard in sorted(shards))
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in {index} but does not exist")
        check_safetensors_file(file)


def check_local_checkpoint(spec: str | os.PathLike, what: str, subfolder: str | None = None) -> str:
    """`require_existing_path`, then `check_checkpoint_weights` on a local directory; returns the
    spec to load from."""
    resolved = require_existing_path(spec, what)
    check_checkpoint_weights(Path(resolved) / (subfolder or ""))
    return resolved


def write_file_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(temporary)` into a sibling, then one rename: readers see the old file or the new one."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}{TEMPORARY_SUFFIX}")
    try:
        write(temporary)
        fsync_path(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Reading what users and earlier runs wrote: every failure names the file
# ---------------------------------------------------------------------------------------------


class DamagedFileError(ValueError):
    """A file the project reads is not what it should be (not UTF-8, not valid JSON, the wrong JSON
    type). The message names the file and, where the parser knows it, the line and column;
    `reason` is the message without the file, for callers that name it themselves."""

    def __init__(self, path: str | os.PathLike, what: str | None, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{what + ' ' if what else ''}{path} {reason}")


JSON_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}


def _json_type_name(value: Any) -> str:
    if isinstance(value, bool | type(None) | dict | list | str):
        return JSON_TYPE_NAMES[type(value)]
    return "a number"


def read_text(path: str | os.PathLike, what: str | None = None) -> str:
    """The UTF-8 text of `path`; bytes that are not UTF-8 are refused naming the file, line and column
    (an OSError, e.g. a missing file, passes unchanged: it names the file itself)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        reason = f"is not UTF-8 text (byte 0x{data[error.start]:02x} at line {line}, column {column})"
        raise DamagedFileError(path, what, reason) from None


def read_json(
    path: str | os.PathLike,
    what: str | None = None,
    kind: type | tuple[type, ...] | None = None,
    limit: int | None = None,
) -> Any:
    """`path` parsed as JSON, refused in one line naming the file (and line and column) when it is
    not UTF-8 or not valid JSON, or when its top-level value is not of `kind` (dict, list, ...).
    With `limit`, a file larger than `limit` bytes is refused before it is read: parsing a huge
    file is as slow as what it would describe."""
    if limit is not None and (size := Path(path).stat().st_size) > limit:
        raise DamagedFileError(path, what, f"is {size} bytes, more than the {limit} bytes such a file holds; not read")
    text = read_text(path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise DamagedFileError(
            path, what, f"is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None
    except RecursionError:
        raise DamagedFileError(path, what, "is not valid JSON (nested too deeply)") from None
    kinds = kind if isinstance(kind, tuple) else (kind,) if kind is not None else ()
    if kinds and not isinstance(value, kinds):
        expected = " or ".join(JSON_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise DamagedFileError(path, what, f"holds {_json_type_name(value)}, not {expected} (JSON)")
    return value


def read_json_object(path: str | os.PathLike, what: str | None = None, limit: int | None = None) -> dict[str, Any]:
    """`read_json(path, what, dict, limit)`: the JSON object in `path`, or one line naming the file."""
    return read_json(path, what, dict, limit)


# ---------------------------------------------------------------------------------------------
# Content digests
# ---------------------------------------------------------------------------------------------

HASH_BUFFER = 1 << 20
# A digest is remembered per file version only once the file's timestamps are older than this:
# timestamps tick coarsely (a few ms), so a same-size rewrite right after could keep them equal.
SETTLED_NS = 2_000_000_000


def _signature(path: Path) -> tuple[int, ...]:
    """What changes whenever a file's content can have changed (no path: a moved file keeps it)."""
    stat = path.stat()
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@functools.lru_cache(maxsize=8192)
def _remembered(key: tuple, compute: Callable[[Path], str], path: Path) -> str:
    return compute(path)


def _once_per_version(path: Path, compute: Callable[[Path], str]) -> str:
    """`compute(path)`, remembered in this process for the file's current version (`_signature`)
    once its timestamps have settled, so checking a checkpoint twice reads it once."""
    signature = _signature(path)
    if time.time_ns() - max(signature[3], signature[4]) < SETTLED_NS:
        return compute(path)
    return _remembered((signature, compute.__name__), compute, path)


def _stream_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_BUFFER):
            hasher.update(chunk)
    return hasher.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """The file's sha256, streamed in 1 MiB reads (hashlib runs at about 1-2 GB/s per core and
    releases the GIL, so threads hash several files at once)."""
    return _once_per_version(Path(path), _stream_sha256)


SAMPLE_HEAD_BYTES = 16 << 20
SAMPLE_WINDOWS = 256
SAMPLE_WINDOW_BYTES = 4096


def _sampled_sha256(path: Path) -> str:
    size = path.stat().st_size
    hasher = hashlib.sha256(f"{size}|".encode())
    with path.open("rb") as handle:
        hasher.update(handle.read(SAMPLE_HEAD_BYTES))
        if size > SAMPLE_HEAD_BYTES:
            span = size - SAMPLE_WINDOW_BYTES
            for index in range(SAMPLE_WINDOWS + 1):
                handle.seek(SAMPLE_HEAD_BYTES + (span - SAMPLE_HEAD_BYTES) * index // SAMPLE_WINDOWS)
                hasher.update(handle.read(SAMPLE_WINDOW_BYTES))
    return hasher.hexdigest()


def sampled_file_digest(path: str | os.PathLike) -> str:
    """An identity of a (possibly huge) file read in O(17 MiB): its size, its first 16 MiB (a GGUF's
    metadata and tokenizer, a checkpoint's header) and 257 evenly spaced 4 KiB windows up to its
    last bytes. Another model or quantisation differs in nearly every window; a same-size edit
    between windows does not change it (an identity, not an integrity check: `sha256_file`)."""
    return _once_per_version(Path(path), _sampled_sha256)


TENSOR_WINDOW_BYTES = 1024


def _safetensors_sampled_sha256(path: Path) -> str:
    size = path.stat().st_size
    with path.open("rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        if not 0 < header_length <= min(size - 8, 100 << 20):
            return _sampled_sha256(path)  # not a readable header: sample it as any file
        header = handle.read(header_length)
        hasher = hashlib.sha256(f"{size}|".encode() + header)
        try:
            spans = sorted(
                tuple(entry["data_offsets"]) for name, entry in json.loads(header).items() if name != "__metadata__"
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return _sampled_sha256(path)
        start = 8 + header_length
        for begin, end in spans:
            for offset in (begin, (begin + end) // 2):
                handle.seek(start + offset)
                hasher.update(handle.read(min(TENSOR_WINDOW_BYTES, max(end - offset, 0))))
    return hasher.hexdigest()


def safetensors_digest(path: str | os.PathLike) -> str:
    """An identity of a safetensors file read in O(header + 2 KiB per tensor): its size, its whole
    header (every tensor's name, dtype, shape and offsets) and 1 KiB at the start and the middle of
    each tensor, so another fine-tune of the same architecture differs while a 60 GB target costs a
    few MB of reads. Like `sampled_file_digest`, an identity, not an integrity check."""
    return _once_per_version(Path(path), _safetensors_sampled_sha256)
