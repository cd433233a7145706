"""An append-only journal of regenerated answers, so that an interrupted regeneration resumes.

Regenerating 100k-1M conversations takes hours; a crash, a preemption or `kill -9` must not cost
the answers already paid for. Each finished conversation is appended as one JSON line and flushed
to disk before the next is taken; a rerun reads the journal back and answers only the rest. A line
cut short by a kill (no final newline, or not JSON) is dropped and the file truncated to its last
whole line, so the journal never holds half a record. Records are plain JSON, never pickles.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ResponseJournal:
    """Finished conversations by row index: `{"row": i, "turns": [...]}` or `{"row": i, "skipped": why}`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.offsets: dict[int, int] = {}  # row -> byte offset of its record
        if self.path.exists():
            self._recover()
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open across appends

    def _recover(self) -> None:
        """Read the rows already finished, cutting a torn last line off the file."""
        good_bytes = 0
        with open(self.path, "rb") as handle:
            for line in handle:
                if not line.endswith(b"\n"):
                    break
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                self.offsets.setdefault(int(record["row"]), good_bytes)
                good_bytes += len(line)
        if good_bytes < self.path.stat().st_size:
            logger.warning("%s: dropping a torn last record (the previous run was killed mid-write)", self.path)
            os.truncate(self.path, good_bytes)
        if self.offsets:
            logger.info("Resuming regeneration: %d conversations already answered in %s", len(self.offsets), self.path)

    @property
    def done(self) -> set[int]:
        return set(self.offsets)

    def __contains__(self, row: int) -> bool:
        return row in self.offsets

    def append(self, record: dict[str, Any]) -> None:
        row = int(record["row"])
        if row in self.offsets:  # a row is answered once; a repeat would duplicate a sample
            return
        offset = self._file.tell()
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
        self._file.flush()
        os.fsync(self._file.fileno())
        self.offsets[row] = offset

    def close(self) -> None:
        self._file.close()

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record in row order (written concurrently, they arrive in any order), read one at
        a time from disk: memory holds the offsets, not the answers."""
        self._file.flush()
        with open(self.path, "rb") as handle:
            for row in sorted(self.offsets):
                handle.seek(self.offsets[row])
                yield json.loads(handle.readline())

    def __enter__(self) -> ResponseJournal:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
