"""An append-only journal of regenerated answers, so that an interrupted regeneration resumes.

Regenerating 100k-1M conversations takes hours; a crash, a preemption or `kill -9` must not cost
the answers already paid for. Each finished conversation is appended as one JSON line and synced
to disk before the next is taken (an append cut short, by a full disk or Ctrl-C, is cut back off
the file); a rerun reads the journal back and answers only the rest.
Records are plain JSON, never pickles.

Recovery keeps every valid record and drops only the invalid ones, each checked on its own: a torn
last line (killed mid-write), a line that is not JSON, a row out of range or already seen, token
ids outside the target's vocabulary, an empty answer. One warning lists what was dropped, by line.
Dropping never risks a good record: invalid lines at the end are truncated off, anything else is
fixed by writing the kept lines to a temporary file, syncing it and renaming it over the journal.

A conversation skipped for the server's sake (refused, or answered with nothing) is asked again by
a rerun: its new record supersedes the skip.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.fileio import fsync_path, reporting_disk_full, write_file_atomically

logger = logging.getLogger(__name__)

SKIP_TOO_LONG = "prompt over max_prompt_length"
SKIP_REFUSED = "refused by the endpoint"
SKIP_EMPTY = "empty answer"
ASK_AGAIN = frozenset({SKIP_REFUSED, SKIP_EMPTY})  # the server's doing: another run (or server) may answer
LISTED_PROBLEMS = 10  # dropped lines named one by one in the recovery warning


def write_record(descriptor: int, data: bytes) -> None:
    """All of `data` at the end of the file (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]


def record_problem(record: Any, rows: int, vocabulary: int) -> str | None:
    """Why `record` is not a valid journal record for `rows` conversations and a vocabulary of
    `vocabulary` token ids, or None when it is one (the row's repetition is checked by the caller)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    row = record.get("row")
    if type(row) is not int:
        return f"row {row!r} is not an integer"
    if not 0 <= row < rows:
        return f"row {row} out of range (0..{rows - 1})"
    if "turns" in record:
        return turns_problem(record["turns"], row, vocabulary)
    reason = record.get("skipped")
    if not isinstance(reason, str) or not reason:
        return f"row {row} has neither answers nor a skip reason"
    return None


def turns_problem(turns: Any, row: int, vocabulary: int) -> str | None:
    """Why row `row`'s answers are not a non-empty list of {text, ids[, reasoning]} with every id
    below `vocabulary`, or None."""
    if not isinstance(turns, list) or not turns:
        return f"row {row} has no answers"
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"row {row} answer {index} is not a JSON object"
        text, ids = turn.get("text"), turn.get("ids")
        if not isinstance(text, str) or not text:
            return f"row {row} answer {index} is empty"
        if not isinstance(ids, list) or not ids:
            return f"row {row} answer {index} has no token ids"
        if not isinstance(turn.get("reasoning", ""), str):
            return f"row {row} answer {index} has a reasoning that is not a string"
        for token in ids:
            if type(token) is not int or not 0 <= token < vocabulary:
                outside = f"outside the vocabulary (0..{vocabulary - 1})"
                return f"row {row} answer {index} has token id {token!r} {outside}"
    return None


class ResponseJournal:
    """Finished conversations by row index: `{"row": i, "turns": [{"text", "ids"[, "reasoning"]}, ...]}` or
    `{"row": i, "skipped": why}`, for `rows` conversations answered with token ids below `vocabulary`."""

    def __init__(self, path: Path, rows: int, vocabulary: int):
        self.path = Path(path)
        self.rows, self.vocabulary = rows, vocabulary
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.offsets: dict[int, int] = {}  # row -> byte offset of its record
        self.ask_again: set[int] = set()  # rows whose record is a skip a rerun asks again for
        if self.path.exists():
            self._recover()
        self._descriptor: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _recover(self) -> None:
        """Read the rows already finished, dropping every invalid line (and only those)."""
        kept: list[tuple[int, int]] = []  # (offset, length) of the valid lines, in file order
        problems: list[tuple[int, str]] = []  # (line number, why dropped)
        first_line_of: dict[int, int] = {}
        offset = 0
        with open(self.path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                problem = self._check_line(line, number, offset, first_line_of)
                if problem is None:
                    kept.append((offset, len(line)))
                else:
                    problems.append((number, problem))
                offset += len(line)
        if problems:
            self._drop(kept, problems, offset)
        if self.offsets:
            logger.info(
                "Resuming regeneration: %d conversations already answered in %s (%d to ask again)",
                len(self.offsets) - len(self.ask_again),
                self.path,
                len(self.ask_again),
            )

    def _check_line(self, line: bytes, number: int, offset: int, first_line_of: dict[int, int]) -> str | None:
        """Accept one journal line (recording its row) or say why it is dropped."""
        if not line.endswith(b"\n"):
            return "torn (no final newline: the previous run was killed mid-write)"
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            return "not JSON"
        problem = record_problem(record, self.rows, self.vocabulary)
        if problem is not None:
            return problem
        row = record["row"]
        if row in self.offsets and row not in self.ask_again:
            return f"row {row} repeated (first on line {first_line_of[row]})"
        self.offsets[row] = offset
        first_line_of[row] = number
        if record.get("skipped") in ASK_AGAIN:
            self.ask_again.add(row)
        else:
            self.ask_again.discard(row)
        return None

    def _drop(self, kept: list[tuple[int, int]], problems: list[tuple[int, str]], size: int) -> None:
        """Remove the invalid lines: truncate when they all come after the last valid one, else
        rewrite the valid ones into a synced temporary file renamed over the journal."""
        listed = "; ".join(f"line {number}: {why}" for number, why in problems[:LISTED_PROBLEMS])
        if len(problems) > LISTED_PROBLEMS:
            listed += f"; and {len(problems) - LISTED_PROBLEMS} more"
        logger.warning(
            "journal %s: kept %d records, dropped %d invalid (%s)", self.path, len(kept), len(problems), listed
        )
        end_of_kept = kept[-1][0] + kept[-1][1] if kept else 0
        if sum(length for _, length in kept) == end_of_kept:  # every bad line is after the good ones
            with reporting_disk_full("the regeneration journal", self.path):
                os.truncate(self.path, end_of_kept)
            return
        moved: dict[int, int] = {}  # old offset -> new offset

        def write(temporary: Path) -> None:
            with open(self.path, "rb") as source, open(temporary, "wb") as copy:
                for old, length in kept:
                    moved[old] = copy.tell()
                    source.seek(old)
                    copy.write(source.read(length))

        with reporting_disk_full("the regeneration journal", self.path, f"the journal is unchanged ({size} bytes)"):
            write_file_atomically(self.path, write)
            fsync_path(self.path.parent)
        self.offsets = {row: moved[old] for row, old in self.offsets.items()}

    @property
    def done(self) -> set[int]:
        """Rows finished for good (a skip to ask again is not)."""
        return set(self.offsets) - self.ask_again

    def __contains__(self, row: int) -> bool:
        return row in self.offsets and row not in self.ask_again

    def __len__(self) -> int:
        """Conversations with a record kept (answered or skipped)."""
        return len(self.offsets)

    def append(self, record: dict[str, Any]) -> None:
        row = int(record["row"])
        if row in self:  # a row is answered once; a repeat would duplicate a sample
            return
        if self._descriptor is None:
            raise ValueError(f"journal {self.path} is closed")
        kept = f"{len(self.offsets)} of {self.rows} conversations are kept in it: free space, then rerun to resume"
        with reporting_disk_full("the regeneration journal", self.path, kept):
            offset = os.lseek(self._descriptor, 0, os.SEEK_END)
            try:
                write_record(self._descriptor, (json.dumps(record, ensure_ascii=False) + "\n").encode())
                os.fsync(self._descriptor)
            except BaseException:  # a full disk, or Ctrl-C between two writes of one record
                with contextlib.suppress(OSError):  # no half record left for the next append or run to follow
                    os.ftruncate(self._descriptor, offset)
                raise
        self.offsets[row] = offset
        if record.get("skipped") in ASK_AGAIN:
            self.ask_again.add(row)
        else:
            self.ask_again.discard(row)

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record in row order (written concurrently, they arrive in any order), read one at
        a time from disk: memory holds the offsets, not the answers."""
        with open(self.path, "rb") as handle:
            for row in sorted(self.offsets):
                handle.seek(self.offsets[row])
                yield json.loads(handle.readline())

    def __enter__(self) -> ResponseJournal:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
