"""trainer.data.response_journal: recovery keeps every valid record and drops only invalid ones (named by
line in one warning), crash-safely; skips to ask again are superseded; a full disk is one line and
leaves no half record."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from trainer import fileio
from trainer.data import response_journal as journal_module
from trainer.data.response_journal import SKIP_EMPTY, SKIP_TOO_LONG, ResponseJournal
from trainer.fileio import DiskFullError

ROWS, VOCABULARY = 12, 1000


def answer(row: int) -> dict:
    return {"row": row, "turns": [{"text": f"answer {row}", "ids": [row + 1, 7]}]}


def write_lines(path: Path, records: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def recovered(path: Path, caplog) -> tuple[set[int], str]:
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger=journal_module.__name__),
        ResponseJournal(path, ROWS, VOCABULARY) as journal,
    ):
        done = journal.done
        assert [record["row"] for record in journal.records()] == sorted(journal.offsets)
    return done, caplog.text


def test_a_garbage_line_in_the_middle_drops_that_line_alone(tmp_path, caplog):
    path = tmp_path / "journal.jsonl"
    records: list = [answer(row) for row in range(ROWS)]
    records[3] = "garbage"
    write_lines(path, records)
    done, warnings = recovered(path, caplog)
    assert done == set(range(ROWS)) - {3}
    assert f"journal {path}: kept 11 records, dropped 1 invalid (line 4: not JSON)" in warnings
    assert "garbage" not in path.read_text()  # rewritten without it
    assert recovered(path, caplog) == (done, "")  # and the next open finds nothing to drop


def test_every_record_is_checked_and_each_drop_is_named_by_line(tmp_path, caplog):
    path = tmp_path / "journal.jsonl"
    records = [
        answer(0),
        {"row": 15, "turns": [{"text": "x", "ids": [1]}]},  # line 2: another dataset's row
        {"row": -1, "turns": [{"text": "x", "ids": [1]}]},
        {"row": "3", "turns": [{"text": "x", "ids": [1]}]},
        {"row": 0, "turns": [{"text": "again", "ids": [1]}]},  # line 5: a second record for row 0
        {"row": 4, "turns": [{"text": "x", "ids": [100000, -5]}]},
        {"row": 5, "turns": [{"text": "x", "ids": [True]}]},
        {"row": 6, "turns": []},
        {"row": 7, "turns": [{"text": "", "ids": [1]}]},
        {"row": 8},
        [1, 2],
        {"row": 11, "skipped": ""},
        {"row": 9, "skipped": SKIP_TOO_LONG},
        answer(10),
    ]
    write_lines(path, records)
    done, warnings = recovered(path, caplog)
    assert done == {0, 9, 10}
    assert (
        f"journal {path}: kept 3 records, dropped 11 invalid (line 2: row 15 out of range (0..11); "
        "line 3: row -1 out of range (0..11); line 4: row '3' is not an integer; "
        "line 5: row 0 repeated (first on line 1); "
        "line 6: row 4 answer 0 has token id 100000 outside the vocabulary (0..999); "
        "line 7: row 5 answer 0 has token id True outside the vocabulary (0..999); line 8: row 6 has no answers; "
        "line 9: row 7 answer 0 is empty; line 10: row 8 has neither answers nor a skip reason; "
        "line 11: not a JSON object; and 1 more)"
    ) in warnings
    with ResponseJournal(path, ROWS, VOCABULARY) as journal:
        assert next(journal.records())["turns"][0]["text"] == "answer 0"  # the first record for row 0 is kept


def test_bad_lines_at_the_end_are_truncated_off_in_place(tmp_path, caplog):
    path = tmp_path / "journal.jsonl"
    write_lines(path, [answer(0), answer(1), "garbage", {"row": 99}])
    good = b"".join(path.read_bytes().splitlines(keepends=True)[:2])
    path.write_bytes(path.read_bytes() + b'{"row": 2, "tur')  # and a torn last line
    inode = path.stat().st_ino
    done, warnings = recovered(path, caplog)
    assert done == {0, 1} and path.read_bytes() == good and path.stat().st_ino == inode
    assert "dropped 3 invalid (line 3: not JSON; line 4: row 99 out of range (0..11); line 5: torn" in warnings


def test_a_rewrite_killed_before_its_rename_leaves_the_journal_as_it_was(tmp_path, monkeypatch, caplog):
    path = tmp_path / "journal.jsonl"
    write_lines(path, [answer(0), "garbage", answer(1)])
    before = path.read_bytes()

    def killed(path: Path) -> None:  # the temporary copy is written; the process dies before the rename
        raise SystemExit("killed")

    with monkeypatch.context() as patched:
        patched.setattr(fileio, "fsync_path", killed)
        with pytest.raises(SystemExit):
            ResponseJournal(path, ROWS, VOCABULARY)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["journal.jsonl"]
    assert recovered(path, caplog)[0] == {0, 1}


def test_a_skip_to_ask_again_is_superseded_by_the_answer(tmp_path, caplog):
    path = tmp_path / "journal.jsonl"
    write_lines(path, [answer(0), {"row": 1, "skipped": SKIP_EMPTY}, {"row": 2, "skipped": SKIP_TOO_LONG}])
    with ResponseJournal(path, ROWS, VOCABULARY) as journal:
        assert journal.done == {0, 2} and journal.ask_again == {1} and 1 not in journal
        journal.append({"row": 1, "skipped": SKIP_EMPTY})  # empty again: still to ask again
        journal.append(answer(1))
        journal.append({"row": 1, "turns": [{"text": "twice", "ids": [3]}]})  # ignored: row 1 is done
        assert journal.done == {0, 1, 2} and not journal.ask_again
    done, warnings = recovered(path, caplog)
    assert done == {0, 1, 2} and warnings == ""
    with ResponseJournal(path, ROWS, VOCABULARY) as journal:
        assert [record.get("turns", [{}])[0].get("text") for record in journal.records()] == [
            "answer 0",
            "answer 1",
            None,
        ]


def test_a_full_disk_while_appending_is_one_line_and_leaves_no_half_record(tmp_path, monkeypatch, caplog):
    path = tmp_path / "journal.jsonl"
    real = journal_module.write_record

    def half_then_full(descriptor: int, data: bytes) -> None:
        real(descriptor, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    with ResponseJournal(path, ROWS, VOCABULARY) as journal:
        journal.append(answer(0))
        journal.append(answer(1))
        monkeypatch.setattr(journal_module, "write_record", half_then_full)
        with pytest.raises(DiskFullError) as error:
            journal.append(answer(2))
    assert str(error.value).startswith(f"no space left on device while writing the regeneration journal {path} (")
    assert str(error.value).endswith("free); 2 of 12 conversations are kept in it: free space, then rerun to resume")
    monkeypatch.undo()
    assert recovered(path, caplog) == ({0, 1}, "")  # no torn line was left behind
