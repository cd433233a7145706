"""Loose ends of issue 31: settings files are read like recipes, a folder lock's grace for an empty
record counts from when the record was seen empty, and a converted GGUF target is never unpickled."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny_target import tiny_target
from trainer import locks
from trainer.commands.plan import main as plan_main
from trainer.commands.runner import run
from trainer.locks import FolderInUseError, FolderLock
from trainer.models.target import TargetSource, _load_gguf_through_cache, converted_gguf_path
from trainer.plan.facts import read_accelerate_config

REPO = Path(__file__).resolve().parents[2]
FSDP2 = REPO / "examples" / "accelerate" / "fsdp2.yaml"
RECIPE_8B = REPO / "examples" / "recipes" / "qwen3-8b-fsdp2.yaml"
TARGET_8B = REPO / "tests" / "fixtures" / "targets" / "qwen3-8b"


def test_an_accelerate_config_with_a_key_given_twice_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "accelerate.yaml"
    lines = FSDP2.read_text().splitlines()
    first = lines.index("num_processes: 8") + 1
    path.write_text("\n".join(lines) + "\nnum_processes: 2\n")
    with pytest.raises(ValueError) as refused:
        read_accelerate_config(str(path))
    message = str(refused.value)
    assert message.startswith(f"--accelerate-config {path}: key 'num_processes' is given twice (first on line {first})")
    assert message.endswith(f"(line {len(lines) + 1}, column 1)")


def test_an_accelerate_config_with_an_alias_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: &kind FSDP\nmixed_precision: *kind\nnum_processes: 2\n")
    with pytest.raises(ValueError, match=rf"^--accelerate-config {path}: YAML anchors \(&kind\) are not allowed"):
        read_accelerate_config(str(path))


def test_the_plan_command_names_a_damaged_accelerate_config_in_one_line(tmp_path, capsys):
    path = tmp_path / "accelerate.yaml"
    path.write_text("num_processes: 8\nnum_processes: 1\n")
    with pytest.raises(SystemExit) as stop:
        run(plan_main, [str(RECIPE_8B), "--target", str(TARGET_8B), "--accelerate-config", str(path)])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --accelerate-config {path}: key 'num_processes' is given twice (first on line 1): keep one "
        "(line 2, column 1)"
    ]


# ---------------------------------------------------------------------------------------------
# A same-job waiter's grace for an empty record counts from when it reads it empty
# ---------------------------------------------------------------------------------------------


class FakeClock:
    """`time` for trainer.locks: sleeping advances a fake monotonic clock and runs the holder's
    scripted steps due by then, so the waiter's polls meet each state at a known time."""

    def __init__(self, steps: list[tuple[float, Callable[[], None]]]):
        self.now, self.steps = 0.0, sorted(steps, key=lambda step: step[0])

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        while self.steps and self.steps[0][0] <= self.now:
            self.steps.pop(0)[1]()

    time, strftime, localtime = time.time, time.strftime, time.localtime


def same_job_locks(tmp_path, monkeypatch) -> tuple[FolderLock, FolderLock]:
    """A holder and a waiter of one job on one entry (two open files: flock makes them contend)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    entry = tmp_path / "entry"
    return locks.lock_cache_entry(entry, "feature store"), locks.lock_cache_entry(entry, "feature store")


def clear_record(lock: FolderLock) -> Callable[[], None]:
    return lambda: os.ftruncate(lock._descriptor, 0)


def test_a_waiter_that_has_waited_long_takes_the_lock_its_holder_is_releasing(tmp_path, monkeypatch):
    holder, waiter = same_job_locks(tmp_path, monkeypatch)
    holder.acquire()
    # release() in two halves, 3 s into the wait: the record is cleared, then (100 ms later) unlocked
    clock = FakeClock([(3.0, clear_record(holder)), (3.1, holder.release)])
    monkeypatch.setattr(locks, "time", clock)
    waiter.acquire()  # before the fix: "in use by another run (another process (it recorded no details))"
    assert waiter.held and 3.1 <= clock.now < 3.2
    assert waiter.holder()["pid"] == os.getpid()
    waiter.release()


def test_an_empty_record_counts_as_a_stranger_after_the_grace_from_when_it_was_seen(tmp_path, monkeypatch):
    holder, waiter = same_job_locks(tmp_path, monkeypatch)
    holder.acquire()
    record = holder.lock_file.read_text()
    os.ftruncate(holder._descriptor, 0)  # a holder that has locked but not yet written itself in

    def write_record() -> None:
        os.pwrite(holder._descriptor, record.encode(), 0)

    # empty 0-1.5 s, its record 1.5-4 s (the grace restarts), then empty while still held
    clock = FakeClock([(1.5, write_record), (4.0, clear_record(holder))])
    monkeypatch.setattr(locks, "time", clock)
    with pytest.raises(FolderInUseError, match=r"in use by another run \(another process \(it recorded no details\)\)"):
        waiter.acquire()
    assert 4.0 + locks.EMPTY_RECORD_GRACE_SECONDS <= clock.now < 4.0 + locks.EMPTY_RECORD_GRACE_SECONDS + 0.6
    holder.release()


# ---------------------------------------------------------------------------------------------
# A GGUF target's converted cache entry is loaded as safetensors only, like every other checkpoint
# ---------------------------------------------------------------------------------------------


def converted_tiny_entry(tmp_path):
    """A GGUF source and its converted cache entry, filled with the tiny target's safetensors."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    source = TargetSource(str(tmp_path), "model.gguf")
    converted = converted_gguf_path(source, tmp_path / "cache")
    tiny = tiny_target()
    tiny.model.save_pretrained(converted)
    tiny.tokenizer.save_pretrained(converted)
    return source, converted, tiny


def test_a_converted_gguf_entry_holding_only_pickle_weights_is_refused(tmp_path):
    source, converted, _ = converted_tiny_entry(tmp_path)
    weights = converted / "model.safetensors"  # replaced by a pickle: what a tampered cache could hold
    torch.save(load_file(weights), converted / "pytorch_model.bin")
    weights.unlink()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(converted))} holds only pickle weights \(pytorch_model"):
        _load_gguf_through_cache(source, torch.float32, tmp_path / "cache")


def test_a_converted_gguf_entry_is_loaded_from_its_safetensors(tmp_path):
    source, _, tiny = converted_tiny_entry(tmp_path)
    model, _ = _load_gguf_through_cache(source, torch.float32, tmp_path / "cache")
    expected = tiny.model.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())
