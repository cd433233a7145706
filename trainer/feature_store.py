"""Offline features: the frozen target runs once over the token dataset, its hidden states are
stored as safetensors shards in a cache entry (a "feature store"), and training reads them back
from disk (`OfflineDataset`)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from trainer.fileio import digest, write_directory_atomically
from trainer.target import FrozenTarget

logger = logging.getLogger(__name__)

FEATURE_INDEX = "features.json"


def token_fingerprint(dataset: datasets.Dataset) -> str:
    """Hash of every sample's token ids (stable across processes, unlike in-memory dataset fingerprints)."""
    hasher = hashlib.sha256()
    for batch in dataset.select_columns(["input_ids"]).iter(batch_size=1024):
        for ids in batch["input_ids"]:
            hasher.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
            hasher.update(b"|")
    return hasher.hexdigest()


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

    Keyed by the target, the token ids, the layer ids and whether final states are stored; an
    existing store is reused.
    """
    fields = {"target": target.fingerprint(), "data": token_fingerprint(dataset), "layers": list(layer_ids)}
    fields["dtype"] = str(dtype)
    if final_hidden:  # (absent otherwise, so the stores written before it keep their keys)
        fields["final_hidden"] = True
    key = digest(fields)
    path = cache_root / "features" / key
    if (path / FEATURE_INDEX).exists():
        logger.info("Reusing offline target features from %s", path)
        return path

    def write(directory: Path) -> None:
        shards, shard, shard_index = [], {}, 0
        for start in tqdm(range(0, len(dataset), batch_size), desc="capturing target hidden states"):
            batch = dataset[start : start + batch_size]["input_ids"]
            lengths = [len(ids) for ids in batch]
            input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(batch):  # right padding: a causal target ignores what follows
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
            captured = target.capture(
                input_ids.to(target.device), attention_mask.to(target.device), layer_ids, final_hidden=final_hidden
            )
            hidden, final = captured if final_hidden else (captured, None)
            for row, length in enumerate(lengths):
                shard[f"sample_{start + row}"] = hidden[row, :length].to("cpu", dtype).contiguous()
                if final is not None:
                    shard[f"final_{start + row}"] = final[row, :length].to("cpu", dtype).contiguous()
            samples = sorted(int(key.split("_")[1]) for key in shard if key.startswith("sample_"))
            if len(samples) >= shard_samples or start + batch_size >= len(dataset):
                name = f"shard-{shard_index:05d}.safetensors"
                save_file(shard, directory / name)
                shards.append({"file": name, "samples": samples})
                shard, shard_index = {}, shard_index + 1
        (directory / FEATURE_INDEX).write_text(
            json.dumps(
                {
                    "num_samples": len(dataset),
                    "layer_ids": list(layer_ids),
                    "final_hidden": final_hidden,
                    "shards": shards,
                }
            )
        )

    write_directory_atomically(path, write)
    return path


class OfflineDataset(torch.utils.data.Dataset):
    """Token samples joined with their stored target features (memory-mapped on access)."""

    def __init__(self, tokens: datasets.Dataset, features: Path):
        index = json.loads((features / FEATURE_INDEX).read_text())
        if index["num_samples"] != len(tokens):
            raise ValueError(f"feature store {features} has {index['num_samples']} samples, dataset {len(tokens)}.")
        self.tokens = tokens
        self.features = features
        self.shard_of = {sample: shard["file"] for shard in index["shards"] for sample in shard["samples"]}
        self.final_hidden = bool(index.get("final_hidden", False))
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.tokens[index])
        shard = self.shard_of[index]
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.features / shard, "pt")
        hidden = self._handles[shard].get_tensor(f"sample_{index}")
        if hidden.shape[0] != len(sample["input_ids"]):
            raise ValueError(f"sample {index}: {hidden.shape[0]} feature rows for {len(sample['input_ids'])} tokens.")
        sample["target_hidden"] = hidden
        if self.final_hidden:
            sample["target_final_hidden"] = self._handles[shard].get_tensor(f"final_{index}")
        return sample

    def __getstate__(self):  # dataloader workers open their own handles
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state
