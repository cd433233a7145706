"""Offline features: the frozen target runs once over the token dataset, its hidden states are
stored as safetensors shards in a cache entry (a "feature store"), and training reads them back
from disk (`OfflineDataset`).

A store is trusted only as far as it can be checked. Its index (`features.json`) records what it
was captured for (target fingerprint, layer ids, dtype, hidden width, final hidden states), the
sha256 of every shard file (hashed as it is written) and, for every sample, its token count and
the RMS and max |x| of each stored tensor, computed from the very values written; each shard also
holds every sample's token ids. The reader checks the index against the run when the store is
opened; when a shard is first opened, its safetensors header (names, dtypes, shapes [tokens, width],
offsets) and then its sha256 (one streamed read per shard per process); and when a sample is first
read, its values (finite, statistics as recorded) and its token ids against the dataset's. A
zeroed, rescaled, negated, reordered, re-typed, truncated or NaN shard, or a store joined to other
token data, is one error naming the shard (and the sample where one is to blame) and the entry to
delete, instead of a draft trained on garbage or a NaN loss steps later.

The checks find damage, not forgery: whoever rewrites a shard and its index together (digest and
statistics) is not caught; only capturing again could tell.

A capture writes into a temporary sibling of its entry (`.<entry>.<random>`) renamed into place at
the end. A capture killed before that (SIGKILL, out of memory, a node lost) leaves that folder
behind; the next capture of the same entry removes it under the entry's lock, which also proves
that no live process is still writing it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import datasets
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from trainer.console import worker_error_text
from trainer.fileio import (
    check_safetensors_file,
    digest,
    format_bytes,
    reporting_disk_full,
    sha256_file,
    write_directory_atomically,
)
from trainer.locks import FolderInUseError, FolderLock, entry_lock_file, lock_cache_entry
from trainer.models.target import FrozenTarget, TargetTokenizer

logger = logging.getLogger(__name__)

FEATURE_INDEX = "features.json"
STORE_FORMAT = 3  # 1 (no "format" key): no fingerprint, no statistics; 2: no shard digests, no token ids
# Tolerance on recomputed statistics: they are computed from the stored values themselves, so only
# the summation order (threads) and the rounding of a bf16 norm (one ulp is under 2^-7) can differ;
# zeros or a 1e6 scaling are off by orders of magnitude.
STATISTICS_RTOL = 2e-2
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",  # token ids
}
# The dtypes a store holds (the `offline_dtype` recipe values).
STORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The two feature tensors of a sample: (name prefix in a shard, column of the recorded statistics).
SAMPLE_TENSORS = (("sample", 0), ("final", 2))
TOKENS_PREFIX = "tokens"  # a sample's token ids (int64 [tokens]), checked against the dataset's
# A capture's temporary folder (`write_directory_atomically`: "." + entry + "." + mkdtemp's 8 characters);
# entries are named by `digest` (20 hex digits).
STAGING_NAME = re.compile(r"\.(?P<entry>[0-9a-f]{20})\.[a-z0-9_]{8}")


def token_fingerprint(dataset: datasets.Dataset) -> str:
    """Hash of every sample's token ids (stable across processes, unlike in-memory dataset fingerprints)."""
    hasher = hashlib.sha256()
    for batch in dataset.select_columns(["input_ids"]).iter(batch_size=1024):
        for ids in batch["input_ids"]:
            hasher.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
            hasher.update(b"|")
    return hasher.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the spelling of the `offline_dtype` recipe key)."""
    return str(dtype).removeprefix("torch.")


def store_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The dtype of `offline_dtype` (a torch dtype or its name) when a store can hold it, else one
    line naming the field and the choices (the recipe refuses other names first; this keeps a bad
    value from reaching the writer)."""
    for choice in STORE_DTYPES:
        if dtype == choice or dtype == dtype_name(choice):
            return choice
    choices = ", ".join(dtype_name(choice) for choice in STORE_DTYPES)
    shown = dtype_name(dtype) if isinstance(dtype, torch.dtype) else repr(dtype)[:40]
    raise ValueError(f"offline_dtype: {shown} is not a dtype a feature store holds (one of {choices})")


def store_fingerprint(
    target: FrozenTarget | TargetTokenizer, layer_ids: Sequence[int], dtype: torch.dtype, final_hidden: bool
) -> dict[str, Any]:
    """What a store must have been captured for to serve this run (recorded in its index)."""
    return {
        "target": target.fingerprint(),
        "layer_ids": [int(layer_id) for layer_id in layer_ids],
        "dtype": dtype_name(dtype),
        "hidden_size": int(target.hidden_size),
        "final_hidden": bool(final_hidden),
    }


def feature_store_path(
    target: FrozenTarget | TargetTokenizer,
    dataset: datasets.Dataset,
    layer_ids: Sequence[int],
    cache_root: Path,
    dtype: torch.dtype = torch.float32,
    final_hidden: bool = False,
) -> Path:
    """The cache entry of a store: keyed by the target, the token ids, the layer ids, the dtype and
    whether final states are stored."""
    fields: dict[str, Any] = {
        "target": target.fingerprint(),
        "data": token_fingerprint(dataset),
        "layers": list(layer_ids),
    }
    fields["dtype"] = str(dtype)
    if final_hidden:  # (absent otherwise, so the stores written before it keep their keys)
        fields["final_hidden"] = True
    return Path(cache_root) / "features" / digest(fields)


def tensor_statistics(tensor: torch.Tensor) -> tuple[float, float]:
    """(RMS, max |x|) of a stored tensor: two reductions in its own dtype, no copy (float16 is
    accumulated in float32, whose range a norm needs). NaN or inf anywhere makes both non-finite."""
    if tensor.numel() == 0:
        return 0.0, 0.0
    low, high = torch.aminmax(tensor)
    accumulate = torch.float32 if tensor.dtype == torch.float16 else None
    norm = float(torch.linalg.vector_norm(tensor, dtype=accumulate))
    return norm / math.sqrt(tensor.numel()), float(torch.maximum(-low, high)) + 0.0  # (never -0)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write `tensors` as one safetensors file through Python file I/O, so that a full disk is an
    OSError with its errno (safetensors' own writer raises a SafetensorError carrying only text);
    returns the bytes written and their sha256, hashed on the way out (no second read). Tensor data
    is written from the tensors' memory, never copied."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    hasher = hashlib.sha256()
    with path.open("wb") as file:
        for chunk in (len(encoded).to_bytes(8, "little"), encoded):
            file.write(chunk)
            hasher.update(chunk)
        for tensor in tensors.values():
            _write_tensor(file, hasher, tensor)
    return 8 + len(encoded) + offset, hasher.hexdigest()


def _write_tensor(file: BinaryIO, hasher: Any, tensor: torch.Tensor) -> None:
    if tensor.numel():
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
        file.write(data)
        hasher.update(data)


def remove_interrupted_captures(entry: Path) -> None:
    """Remove the partial stores that killed captures left beside `entry`: the temporary siblings
    `.<entry>.<random>/` of `write_directory_atomically`. Call it holding `entry`'s lock. Every
    writer of an entry holds its lock while writing, so the entry's own leftovers are dead, and
    another entry's are removed only when its lock can be taken at once (never a live writer's)."""
    entry = Path(entry)
    if not entry.parent.is_dir():
        return
    for leftover in sorted(entry.parent.iterdir()):
        match = STAGING_NAME.fullmatch(leftover.name)
        if match is None or not leftover.is_dir() or leftover.is_symlink():
            continue
        if match["entry"] == entry.name:
            _remove_leftover(leftover)
            continue
        lock = FolderLock(entry_lock_file(entry.parent / match["entry"]), leftover, "feature store", same_job_wait=0.0)
        try:
            lock.acquire()
        except FolderInUseError:
            continue  # being written now
        try:
            if leftover.is_dir():
                _remove_leftover(leftover)
        finally:
            lock.release()


def _remove_leftover(leftover: Path) -> None:
    size = sum(path.stat().st_size for path in leftover.rglob("*") if path.is_file())
    logger.warning(
        "Removing %s (%s): the partial feature store of an interrupted capture", leftover, format_bytes(size)
    )
    shutil.rmtree(leftover)


def prepare_features(
    target: FrozenTarget,
    dataset: datasets.Dataset,
    layer_ids: Sequence[int],
    cache_root: Path,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
    shard_samples: int = 256,
    final_hidden: bool = False,
) -> Path:
    """Capture `hidden_states[id + 1]` for every sample once; store safetensors shards on disk.
    With `final_hidden` (distillation) each sample also stores the target's final hidden states,
    one more H-wide feature per token, from the same forward.

    An existing store is reused. One process writes an entry (`lock_cache_entry`; another rank of
    the same job waits for it, then reuses the store); a full disk is one error saying how much was
    captured, and nothing partial is kept. The partial store of an earlier capture of the entry
    that was killed is removed first (`remove_interrupted_captures`), and the capture starts over.
    """
    dtype = store_dtype(dtype)
    path = feature_store_path(target, dataset, layer_ids, cache_root, dtype, final_hidden)
    if (path / FEATURE_INDEX).exists():
        logger.info("Reusing offline target features from %s", path)
        return path
    with lock_cache_entry(path, "feature store"):
        if (path / FEATURE_INDEX).exists():  # finished by the holder we waited for
            logger.info("Reusing offline target features from %s (captured by another process)", path)
            return path
        remove_interrupted_captures(path)
        with reporting_disk_full("feature store", path, "nothing partial is kept"):

            def write(directory: Path) -> None:
                _capture(target, dataset, layer_ids, dtype, batch_size, shard_samples, final_hidden, directory, path)

            write_directory_atomically(path, write)
    return path


class ShardWriter:
    """Collects captured samples into the shards of a store being written (in process or through
    an engine), each with its statistics, and writes a shard every `shard_samples` samples.

    `shards` are the shards already written (a resumed engine capture; one journaled before shards
    recorded their sha256 is hashed now); `on_shard` is called with each new shard's index entry
    once its file is complete (the engine capture journals it)."""

    def __init__(
        self,
        directory: Path,
        entry: Path,
        total: int,
        shard_samples: int,
        shards: list[dict[str, Any]] | None = None,
        on_shard: Callable[[dict[str, Any]], None] | None = None,
        kept: str = "nothing partial is kept",
    ):
        self.directory, self.entry, self.total = directory, entry, total
        self.shard_samples, self.on_shard, self.kept = shard_samples, on_shard, kept
        self.shards = [
            shard if "sha256" in shard else {**shard, "sha256": sha256_file(directory / shard["file"])}
            for shard in shards or []
        ]
        self.captured = sum(len(shard["samples"]) for shard in self.shards)
        self.written = sum((directory / shard["file"]).stat().st_size for shard in self.shards)
        self._next = 1 + max((int(shard["file"][6:11]) for shard in self.shards), default=-1)
        self._shard: dict[str, torch.Tensor] = {}
        self._entries: dict[str, list] = {"samples": [], "tokens": [], "statistics": []}

    def add(
        self,
        sample: int,
        hidden: torch.Tensor,
        final: torch.Tensor | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """One sample's stored tensors ([tokens, width], in the store's dtype, on any device): the
        statistics are those of the values written. `token_ids` (the ids the features were computed
        from) are stored too, for the reader to check against its dataset."""
        store_dtype(hidden.dtype)
        statistics = list(tensor_statistics(hidden))
        self._shard[f"sample_{sample}"] = hidden.to("cpu").contiguous()
        if final is not None:
            statistics += tensor_statistics(final)
            self._shard[f"final_{sample}"] = final.to("cpu").contiguous()
        if token_ids is not None:
            ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
            if len(ids) != hidden.shape[0]:
                raise ValueError(f"sample {sample}: {hidden.shape[0]} feature rows for {len(ids)} token ids")
            self._shard[f"{TOKENS_PREFIX}_{sample}"] = ids
        self._entries["samples"].append(sample)
        self._entries["tokens"].append(int(hidden.shape[0]))
        self._entries["statistics"].append(statistics)
        if len(self._entries["samples"]) >= self.shard_samples:
            self.flush()

    def flush(self) -> None:
        """Write the samples collected so far as one shard (temporary name, then renamed)."""
        if not self._entries["samples"]:
            return
        name = f"shard-{self._next:05d}.safetensors"
        shard_bytes = sum(tensor.numel() * tensor.element_size() for tensor in self._shard.values())
        needed = (self.written + shard_bytes) / (self.captured + len(self._entries["samples"])) * self.total
        kept = (
            f"{self.captured} of {self.total} samples captured ({format_bytes(self.written)} written, about "
            f"{format_bytes(needed)} needed for all); {self.kept}"
        )
        partial = self.directory / f".{name}.partial"
        with reporting_disk_full("feature store", self.entry, kept):
            written, sha256 = write_shard(partial, self._shard)
            os.replace(partial, self.directory / name)
        self.written += written
        entry = {"file": name, "sha256": sha256, **self._entries}
        self.shards.append(entry)
        self.captured += len(self._entries["samples"])
        self._next += 1
        self._shard, self._entries = {}, {"samples": [], "tokens": [], "statistics": []}
        if self.on_shard is not None:
            self.on_shard(entry)

    def index(self, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """The store's index (`features.json`), once every sample is in a shard."""
        return {
            "format": STORE_FORMAT,
            "store": fingerprint,
            "num_samples": self.total,
            "layer_ids": fingerprint["layer_ids"],
            "final_hidden": fingerprint["final_hidden"],
            "shards": self.shards,
        }


def _capture(
    target: FrozenTarget,
    dataset: datasets.Dataset,
    layer_ids: Sequence[int],
    dtype: torch.dtype,
    batch_size: int,
    shard_samples: int,
    final_hidden: bool,
    directory: Path,
    entry: Path,
) -> None:
    """Fill `directory` (the temporary sibling of `entry`) with the shards and, last, the index."""
    writer = ShardWriter(directory, entry, len(dataset), shard_samples)
    for start in tqdm(range(0, len(dataset), batch_size), desc="capturing target hidden states"):
        batch = dataset[start : start + batch_size]["input_ids"]
        lengths = [len(ids) for ids in batch]
        input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch):  # right padding: a causal target ignores what follows
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        captured_batch = target.capture(
            input_ids.to(target.device), attention_mask.to(target.device), layer_ids, final_hidden=final_hidden
        )
        hidden, final = captured_batch if isinstance(captured_batch, tuple) else (captured_batch, None)
        for row, length in enumerate(lengths):
            stored_final = None if final is None else final[row, :length].to(dtype)
            writer.add(start + row, hidden[row, :length].to(dtype), stored_final, batch[row])
    writer.flush()
    index = writer.index(store_fingerprint(target, layer_ids, dtype, final_hidden))
    (directory / FEATURE_INDEX).write_text(json.dumps(index))


class FeatureStoreError(ValueError):
    """A feature store that cannot serve this run (a ValueError: the scripts print it in one line).

    Raised in a DataLoader worker, it is rebuilt in the main process from "Caught ... Original
    Traceback ...: <message>"; the rebuilt error keeps the one-line message alone."""

    def __init__(self, message: str):
        super().__init__(worker_error_text(message))


class OfflineDataset(torch.utils.data.Dataset):
    """Token samples joined with their stored target features (memory-mapped on access).

    `expected` (`store_fingerprint` of the run) is checked against the store's index on opening;
    each shard's header and sha256 when it is first opened in this process (one streamed read of
    the file), and each sample's values and token ids when it is first read (they are read anyway:
    the check costs two reductions over them).
    """

    def __init__(self, tokens: datasets.Dataset, features: Path, expected: dict[str, Any] | None = None):
        self.tokens = tokens
        self.features = Path(features)
        index_path = self.features / FEATURE_INDEX
        try:
            index = json.loads(index_path.read_text())
            count, shards = index["num_samples"], index["shards"]
            self.shard_of = {sample: shard["file"] for shard in shards for sample in shard["samples"]}
            self.samples_of = {shard["file"]: shard["samples"] for shard in shards}
            self.digests: dict[str, str | None] = {shard["file"]: shard.get("sha256") for shard in shards}
            for file, recorded_digest in self.digests.items():
                if recorded_digest is not None and not (
                    isinstance(recorded_digest, str) and len(recorded_digest) == 64
                ):
                    raise ValueError(f"shard {file} has sha256 {str(recorded_digest)[:70]!r}, not 64 hex digits")
            self.final_hidden = bool(index.get("final_hidden", False))
            self.recorded: dict[str, Any] | None = index.get("store")
            self.token_counts = torch.full((count,), -1, dtype=torch.int64)
            self.statistics = torch.full((count, 4), math.nan, dtype=torch.float64)
            if self.recorded is not None:
                for shard in shards:  # per shard, vectorised over its samples
                    samples = torch.tensor(shard["samples"], dtype=torch.int64)
                    self.token_counts[samples] = torch.tensor(shard["tokens"], dtype=torch.int64)
                    statistics = torch.tensor(shard["statistics"], dtype=torch.float64).reshape(len(samples), -1)
                    self.statistics[samples, : statistics.shape[1]] = statistics
        except (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as error:
            raise self._error(f"{index_path} is not a valid feature index ({type(error).__name__}: {error})") from None
        if count != len(tokens):
            raise self._error(f"it holds {count} samples, the dataset {len(tokens)}")
        if len(self.shard_of) != count or set(self.shard_of) != set(range(count)):
            raise self._error(f"{index_path} lists {len(self.shard_of)} distinct samples, not 0..{count - 1}")
        self._check_index(index, expected)
        known = self.recorded or expected or {}
        self.dtype = known.get("dtype")
        hidden_size = known.get("hidden_size")
        self.columns = {
            "sample": len(known["layer_ids"]) * hidden_size if hidden_size else None,
            "final": hidden_size,
        }
        self._handles: dict[str, Any] = {}
        self._checked = torch.zeros(count, dtype=torch.bool)
        self._has_tokens = torch.zeros(count, dtype=torch.bool)  # filled from each shard's header on opening

    def _error(self, problem: str) -> FeatureStoreError:
        return FeatureStoreError(f"feature store {self.features}: {problem}: delete {self.features} to capture again")

    def _check_index(self, index: dict[str, Any], expected: dict[str, Any] | None) -> None:
        """The store's recorded fingerprint (or, for a format-1 store, its layer ids and final-states
        flag) against what the run expects."""
        if self.recorded is None:
            logger.warning(
                "feature store %s was written before stores recorded their statistics: only its headers, "
                "finiteness and zero samples are checked (delete it to capture again with full checks)",
                self.features,
            )
            recorded = {"layer_ids": index.get("layer_ids"), "final_hidden": self.final_hidden}
        else:
            recorded = self.recorded
            if None in self.digests.values():
                logger.warning(
                    "feature store %s was written before stores recorded a sha256 per shard: its shards are "
                    "checked by header and statistics only, which a negated or reordered shard passes (delete "
                    "it to capture again with full checks)",
                    self.features,
                )
        if expected is None:
            return
        differences = [
            f"{field} {recorded[field]} (this run: {value})"
            for field, value in expected.items()
            if field in recorded and recorded[field] != value
        ]
        if differences:
            raise self._error(f"it was captured for {', '.join(differences)}")

    def __len__(self) -> int:
        return len(self.tokens)

    def _open(self, shard: str) -> Any:
        """safe_open a shard after checking its file and header (names, dtypes, shapes) against the index."""
        path = self.features / shard
        try:
            header = check_safetensors_file(path)
        except (ValueError, OSError) as error:
            raise self._error(str(error)) from None
        dtype = getattr(torch, self.dtype, None) if self.dtype else None
        wanted = SAFETENSORS_DTYPES.get(dtype) if isinstance(dtype, torch.dtype) else None
        for sample in self.samples_of[shard]:
            tokens = int(self.token_counts[sample])
            for prefix, _ in SAMPLE_TENSORS:
                if prefix == "final" and not self.final_hidden:
                    continue
                name, columns = f"{prefix}_{sample}", self.columns[prefix]
                entry = header.get(name)
                if entry is None:
                    raise self._error(f"{path} sample {sample}: tensor {name} is missing")
                stored_dtype = entry.get("dtype")
                if wanted is not None and stored_dtype != wanted:
                    raise self._error(
                        f"{path} sample {sample}: {name} is stored as {stored_dtype}, the store holds {self.dtype}"
                    )
                shape = entry["shape"]
                if (
                    len(shape) != 2
                    or (tokens >= 0 and shape[0] != tokens)
                    or (columns is not None and shape[1] != columns)
                ):
                    expected = f"[{tokens if tokens >= 0 else 'tokens'}, {columns or 'width'}]"
                    raise self._error(f"{path} sample {sample}: {name} has shape {shape}, expected {expected}")
            name = f"{TOKENS_PREFIX}_{sample}"
            entry = header.get(name)
            if entry is not None and (entry.get("dtype") != "I64" or len(entry["shape"]) != 1):
                raise self._error(
                    f"{path} sample {sample}: {name} is {entry.get('dtype')} {entry['shape']}, not I64 [tokens]"
                )
            self._has_tokens[sample] = entry is not None
        recorded = self.digests.get(shard)
        if recorded is not None:
            try:
                actual = sha256_file(path)
            except OSError as error:
                raise self._error(f"{path} cannot be read ({error})") from None
            if actual != recorded:
                self._diagnose(shard, safe_open(path, "pt"))
                raise self._error(
                    f"{path} has sha256 {actual[:16]}..., but {recorded[:16]}... when it was written "
                    "(its content changed after capture)"
                )
        return safe_open(path, "pt")

    def _read(self, handle: Any, sample: int) -> dict[str, torch.Tensor]:
        """A sample's stored tensors: "sample", "final" (distillation), "tokens" (where stored)."""
        tensors = {"sample": handle.get_tensor(f"sample_{sample}")}
        if self.final_hidden:
            tensors["final"] = handle.get_tensor(f"final_{sample}")
        if self._has_tokens[sample]:
            tensors["tokens"] = handle.get_tensor(f"{TOKENS_PREFIX}_{sample}")
        return tensors

    def _check_sample(self, shard: str, sample: int, tensors: dict[str, torch.Tensor], input_ids: list[int]) -> None:
        """A sample's token ids against the dataset's, then its values (`_check_values`)."""
        where = f"{self.features / shard} sample {sample}"
        stored = tensors.get("tokens")
        if stored is not None:
            wanted = torch.as_tensor(input_ids, dtype=torch.int64)
            if stored.shape != wanted.shape or not torch.equal(stored, wanted):
                common = min(len(stored), len(wanted))
                differ = (stored[:common] != wanted[:common]).nonzero()
                position = int(differ[0]) if len(differ) else common
                raise self._error(
                    f"{where}: the token ids stored with its features differ from the dataset's at position "
                    f"{position} ({len(stored)} stored, {len(wanted)} in the dataset): it was captured for other data"
                )
        self._check_values(shard, sample, tensors)

    def _diagnose(self, shard: str, handle: Any) -> None:
        """On a sha256 mismatch, raise the error of the first sample to blame (values or token ids),
        if any: it says more than the digest alone."""
        for sample in self.samples_of[shard]:
            self._check_sample(shard, sample, self._read(handle, sample), self.tokens[sample]["input_ids"])

    def _check_values(self, shard: str, sample: int, tensors: dict[str, torch.Tensor]) -> None:
        """Finite, not all zeros, and (format 2) the statistics recorded at capture."""
        where = f"{self.features / shard} sample {sample}"
        for prefix, column in SAMPLE_TENSORS:
            tensor = tensors.get(prefix)
            if tensor is None:
                continue
            rms, max_abs = tensor_statistics(tensor)
            name = f"{prefix}_{sample}"
            if not (math.isfinite(rms) and math.isfinite(max_abs)):
                raise self._error(f"{where}: {name} holds non-finite values (NaN or inf)")
            recorded_rms, recorded_max = self.statistics[sample, column : column + 2].tolist()
            if math.isnan(recorded_rms):
                if max_abs == 0:
                    raise self._error(f"{where}: {name} is all zeros")
                continue
            if not (_close(rms, recorded_rms) and _close(max_abs, recorded_max)):
                raise self._error(
                    f"{where}: {name} has RMS {rms:.6g} and max |x| {max_abs:.6g}, "
                    f"but {recorded_rms:.6g} and {recorded_max:.6g} when it was captured"
                )

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.tokens[index])
        shard = self.shard_of[index]
        if shard not in self._handles:
            self._handles[shard] = self._open(shard)
        handle = self._handles[shard]
        tensors = self._read(handle, index)
        hidden = tensors["sample"]
        if hidden.shape[0] != len(sample["input_ids"]):
            raise self._error(
                f"{self.features / shard} sample {index}: {hidden.shape[0]} feature rows for "
                f"{len(sample['input_ids'])} tokens"
            )
        if not self._checked[index]:
            self._check_sample(shard, index, tensors, sample["input_ids"])
            self._checked[index] = True
        sample["target_hidden"] = hidden
        if self.final_hidden:
            sample["target_final_hidden"] = tensors["final"]
        return sample

    def __getstate__(self):  # dataloader workers open their own handles
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def _close(value: float, recorded: float) -> bool:
    return abs(value - recorded) <= STATISTICS_RTOL * max(abs(value), abs(recorded))
