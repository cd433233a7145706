"""Sequence packing: whole samples laid end to end in rows of at most `max_length` tokens, so the
target's capture and the draft's context run on documents, not on padding (docs/objective.md §10).

A packed row carries `position_ids` that restart at 0 where each sample starts; they are the only
record of the boundaries, read alike by transformers' packed-sequence masks (the target) and by
`trainer.objective.blocks` (the draft). A sample is never split across rows.

The rows are a pure function of (the samples' lengths, `max_length`, seed): the samples are
shuffled with the seed, each goes into the open row it fills best (best fit, so rows come out
nearly full whatever the length distribution), and the rows are shuffled again. They are fixed for
the run, so the number of rows (HF's steps per epoch) is the same every epoch and a resume replays
exactly; HF's own sampler reorders the rows each epoch from the seed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import datasets
import pyarrow.compute
import torch

PACKING_SEED_SALT = 0x9AC4  # the rows' shuffle is not the sampler's


def sample_lengths(dataset: Any) -> list[int]:
    """Token count of every sample, read from the Arrow column (no sample is decoded); an offline
    dataset answers for its token samples."""
    tokens = getattr(dataset, "tokens", dataset)
    if isinstance(tokens, datasets.Dataset):
        column = tokens.select_columns(["input_ids"]).with_format("arrow")
        lengths: list[int] = []
        for batch in column.iter(batch_size=65536):
            lengths.extend(pyarrow.compute.list_value_length(batch["input_ids"]).to_pylist())
        return lengths
    return [len(tokens[index]["input_ids"]) for index in range(len(tokens))]


def pack_rows(lengths: Sequence[int], max_length: int, seed: int) -> list[list[int]]:
    """Rows of sample indices, each row's lengths summing to at most `max_length`.

    Best fit in a seeded random order: a sample goes into the open row with the least room that
    still holds it (a new row if none does). Open rows are kept by remaining room in a sorted list,
    so each placement is a bisection; a row with no room left for the shortest sample is closed.
    """
    if max_length < 1:
        raise ValueError(f"max_length={max_length}: packing needs rows of at least one token")
    too_long = [index for index, length in enumerate(lengths) if length > max_length]
    if too_long:
        raise ValueError(
            f"packing: sample {too_long[0]} has {lengths[too_long[0]]} tokens, more than max_length={max_length} "
            "(samples are truncated to max_length before packing)"
        )
    generator = torch.Generator().manual_seed(seed ^ PACKING_SEED_SALT)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    shortest = min(lengths, default=0)
    rows: list[list[int]] = []
    room: list[int] = []
    open_rooms: list[tuple[int, int]] = []  # (room left, row), ascending
    for index in order:
        length = lengths[index]
        place = bisect.bisect_left(open_rooms, (length, -1))
        if place < len(open_rooms):
            _, row = open_rooms.pop(place)
        else:
            row = len(rows)
            rows.append([])
            room.append(max_length)
        rows[row].append(index)
        room[row] -= length
        if room[row] >= shortest and room[row] > 0:
            bisect.insort(open_rooms, (room[row], row))
    shuffle = torch.randperm(len(rows), generator=generator).tolist()
    return [rows[index] for index in shuffle]


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset of packed rows over a dataset of samples (tokens, or offline features).

    Item i concatenates the samples of row i: `input_ids`, `loss_mask`, any stored target features
    (the per-sample ones, as captured: the target never saw the documents together), and
    `position_ids` restarting at 0 per sample. `tokens` is the underlying token dataset (what a
    resume fingerprints)."""

    def __init__(self, samples: Any, rows: list[list[int]]):
        self.samples, self.rows = samples, rows
        self.tokens = getattr(samples, "tokens", samples)

    @classmethod
    def pack(cls, samples: Any, max_length: int, seed: int) -> PackedDataset:
        return cls(samples, pack_rows(sample_lengths(samples), max_length, seed))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._joined([self.samples[sample] for sample in self.rows[index]])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at `indices`; samples that fetch together (`__getitems__`, e.g. streamed engine
        features) are asked for all their documents at once."""
        fetch = getattr(self.samples, "__getitems__", None)
        if fetch is None:
            return [self[index] for index in indices]
        documents = [self.rows[index] for index in indices]
        parts = iter(fetch([sample for row in documents for sample in row]))
        return [self._joined([next(parts) for _ in row]) for row in documents]

    @staticmethod
    def _joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
        row: dict[str, Any] = {
            key: torch.cat([torch.as_tensor(part[key]) for part in parts]) for key in ("input_ids", "loss_mask")
        }
        row["position_ids"] = torch.cat([torch.arange(len(part["input_ids"])) for part in parts])
        for key in parts[0]:
            if key not in row and isinstance(parts[0][key], torch.Tensor):
                row[key] = torch.cat([part[key] for part in parts])
        return row


def padding_fraction(batches: Sequence[Sequence[int]]) -> float:
    """Padded share of the positions a right-padding collator computes on, for micro-batches given
    as the token counts of their rows (each padded to its longest)."""
    computed = sum(len(rows) * max(rows) for rows in batches)
    real = sum(sum(rows) for rows in batches)
    return 1.0 - real / computed if computed else 0.0
