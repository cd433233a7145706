"""The rehearsal's data: the first rows of the recipe's own dataset when they can be read here, else
local conversations in the recipe's format, written to a JSONL file the rewritten recipe names.

A Hub dataset is streamed (only its first rows are read, the shortest of them kept: the rehearsal's
rows are 128 tokens) unless the Hub is unreachable; a local
dataset (a folder, a JSON/JSONL/Parquet file, or `chitchat`) is kept as it is, since training reads
it the same way here as on the GPU node. The stand-in is the PyPI `chitchat-dataset` conversations
(the package `dataset: chitchat` reads), first two turns of each as a user and an assistant message,
under the recipe's `messages_column`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.data.dataset import load_raw_dataset


def is_local(spec: str) -> bool:
    return spec == "chitchat" or Path(spec).expanduser().exists()


def shortest(rows: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The `count` shortest rows (by their JSON text), in their order: the rehearsal's rows are
    short, and a prompt longer than them would be skipped."""
    lengths = [len(json.dumps(row, ensure_ascii=False, default=str)) for row in rows]
    kept = sorted(sorted(range(len(rows)), key=lengths.__getitem__)[:count])
    return [rows[index] for index in kept]


def hub_rows(spec: str, split: str, count: int, scanned: int = 4) -> list[dict[str, Any]]:
    """The shortest `count` of the first `scanned` x `count` rows of a Hub dataset, streamed
    (nothing else is downloaded)."""
    import datasets

    rows = []
    for row in datasets.load_dataset(spec, split=split, streaming=True):
        rows.append(row)
        if len(rows) == scanned * count:
            break
    return shortest(rows, count)


# the stand-in's turns are short: the rehearsal's rows are 128 tokens, and a stand-in tokenizer spends
# a token on every byte
STAND_IN_CHARACTERS = 24


def stand_in_rows(column: str, count: int) -> list[dict[str, Any]]:
    """`count` short two-turn conversations from the packaged chitchat-dataset, under `column`."""
    try:
        import chitchat_dataset
    except ImportError as error:
        raise ValueError("the rehearsal's stand-in data needs the PyPI package chitchat-dataset") from error
    rows = []
    for conversation in chitchat_dataset.ConversationDataset():
        turns = [str(turn).strip() for turn in conversation][:2]
        if len(turns) == 2 and all(0 < len(turn) <= STAND_IN_CHARACTERS for turn in turns):
            rows.append({column: [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": turns[1]}]})
        if len(rows) == count:
            break
    return rows


def write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))
    return path


def rehearsal_dataset(data_args: Any, count: int, folder: Path, hub_reachable: bool) -> tuple[str, str, bool]:
    """(dataset to train on, what it is, whether it is the recipe's own data): the recipe's own
    local dataset, `count` of the first rows of its Hub dataset, or the stand-in."""
    spec = data_args.dataset
    if is_local(spec):
        if spec != "chitchat":
            load_raw_dataset(spec, data_args.dataset_split)  # readable here, or its one line now
        return spec, f"the recipe's own ({spec})", True
    if hub_reachable:
        try:
            rows = hub_rows(spec, data_args.dataset_split, count)
        except (OSError, ValueError) as error:
            reason = f"{spec} cannot be read ({str(error).splitlines()[0][:200]})"
        else:
            if rows:
                path = write_rows(rows, folder / "data.jsonl")
                return (
                    str(path),
                    f"the {len(rows)} shortest of the first rows of {spec} (split {data_args.dataset_split})",
                    True,
                )
            reason = f"{spec} split {data_args.dataset_split} has no rows"
    else:
        reason = "the Hub is unreachable from here"
    path = write_rows(stand_in_rows(data_args.messages_column, count), folder / "data.jsonl")
    return (
        str(path),
        f"stand-in: {count} chitchat-dataset conversations as '{data_args.messages_column}' ({reason})",
        False,
    )
