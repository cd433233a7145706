"""trainer.locks: one writer per folder, the holder named, dead holders never block, one lock per job."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.locks import (
    FolderInUseError,
    FolderLock,
    entry_lock_file,
    lock_cache_entry,
    lock_run_folder,
    run_lock_file,
)

REPO = Path(__file__).resolve().parents[2]
READY = "locked"


def hold_in_subprocess(lock_file: Path, folder: Path, seconds: float, env: dict[str, str] | None = None):
    """Another process that takes the lock, says so on stdout, holds it `seconds`, then exits."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from trainer.locks import FolderLock\n"
        f"lock = FolderLock(Path({str(lock_file)!r}), Path({str(folder)!r}), 'cache entry').acquire()\n"
        f"print({READY!r}, flush=True)\n"
        f"time.sleep({seconds})\n"
    )
    environment = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=environment)
    assert process.stdout.readline().strip() == READY
    return process


def test_a_second_holder_is_refused_with_the_folder_and_the_holder(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    folder = tmp_path / "run"
    with lock_run_folder(folder) as first:
        assert first.held and first.holder()["pid"] == os.getpid()
        with pytest.raises(FolderInUseError) as refused:
            lock_run_folder(folder).acquire()
    message = str(refused.value)
    assert message.startswith(
        f"output_dir {folder} is in use by another run (pid {os.getpid()} on {socket.gethostname()}"
    )
    assert message.endswith("wait for it to finish, or choose another output_dir")
    with lock_run_folder(folder):  # released: free again
        pass
    assert run_lock_file(folder).read_text() == ""  # nobody is recorded as holding it


def test_another_process_holding_the_entry_is_named_and_its_death_frees_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    entry = tmp_path / "features" / "abc"
    holder = hold_in_subprocess(entry_lock_file(entry), entry, seconds=60)
    try:
        with pytest.raises(
            FolderInUseError, match=rf"feature store {entry} is in use by another run \(pid {holder.pid} "
        ):
            lock_cache_entry(entry, "feature store").acquire()
        holder.send_signal(signal.SIGKILL)  # a kill -9 leaves the lock file with the dead pid in it
        holder.wait(timeout=30)
        assert str(holder.pid) in entry_lock_file(entry).read_text()
        with lock_cache_entry(entry, "feature store") as taken:  # never stale: the kernel dropped it
            assert taken.holder()["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_holder_of_the_same_job_is_waited_for_and_another_job_is_refused(tmp_path, monkeypatch):
    entry = tmp_path / "generated" / "abc"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    holder = hold_in_subprocess(entry_lock_file(entry), entry, seconds=1.5, env={"TORCHELASTIC_RUN_ID": "job-a"})
    try:
        started = time.monotonic()
        with lock_cache_entry(entry, "regeneration cache entry"):
            waited = time.monotonic() - started
        assert waited > 0.5  # it waited for the peer rank instead of failing
    finally:
        holder.wait(timeout=30)
    holder = hold_in_subprocess(entry_lock_file(entry), entry, seconds=30, env={"TORCHELASTIC_RUN_ID": "job-b"})
    try:
        with pytest.raises(FolderInUseError, match="is in use by another run"):
            lock_cache_entry(entry, "regeneration cache entry").acquire()
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_same_job_wait_has_a_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    entry = tmp_path / "entry"
    holder = hold_in_subprocess(entry_lock_file(entry), entry, seconds=30, env={"TORCHELASTIC_RUN_ID": "job-a"})
    try:
        started = time.monotonic()
        with pytest.raises(FolderInUseError, match=r"is still held by another process of this job .* after 1 s"):
            FolderLock(entry_lock_file(entry), entry, "cache entry", same_job_wait=1.0).acquire()
        assert time.monotonic() - started < 10
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_file_as_output_dir_is_named(tmp_path):
    path = tmp_path / "output"
    path.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=f"output_dir {path} is a file, not a folder"):
        lock_run_folder(path)


GO_FILE_ENV = "DFLASH2_TEST_GO_FILE"
# `python -m trainer`, whose training waits before its first step (its output_dir lock already
# taken) until the file named by $DFLASH2_TEST_GO_FILE exists: a run that stays running as long as
# the test needs, without hundreds of steps of margin
HELD_BEFORE_THE_FIRST_STEP = f"""
import os, runpy, sys, time
from transformers import TrainerCallback
import trainer.training.run as train_script
go = os.environ[{GO_FILE_ENV!r}]

class Held(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        while state.global_step == 0 and not os.path.exists(go):
            time.sleep(0.05)

class HeldTrainer(train_script.DFlash2Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(Held())

train_script.DFlash2Trainer = HeldTrainer
sys.argv[0] = "trainer"
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
"""


def run_train(recipe: Path, *flags: str, cwd: Path, held_until: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for variable in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "DFLASH2_DEBUG"):
        env.pop(variable, None)
    program = ["-m", "trainer"] if held_until is None else ["-c", HELD_BEFORE_THE_FIRST_STEP]
    if held_until is not None:
        env[GO_FILE_ENV] = str(held_until)
    command = [sys.executable, *program, "train", str(recipe), *flags]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_training_on_the_same_output_dir_stops_and_the_first_keeps_its_checkpoints(tmp_path):
    """Two recipes on one output_dir, started while the first runs: the second exits 2 with one line
    naming the folder and the holder; every checkpoint is the first run's (its learning rate).
    The first run waits before its first step until the second has exited."""
    from tests.support.distributed.tiny_setup import write_tiny_run

    recipe = write_tiny_run(tmp_path, num_eval_samples=0, max_steps=6, save_steps=1, save_total_limit=None)
    output, go = tmp_path / "output", tmp_path / "go"
    first = run_train(recipe, cwd=tmp_path, held_until=go)
    try:
        deadline = time.monotonic() + 300  # (a hang guard: imports alone take a minute on a busy machine)
        while not (run_lock_file(output).is_file() and run_lock_file(output).read_text()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took its lock"
            time.sleep(0.05)
        second = run_train(recipe, "--learning_rate", "0.05", cwd=tmp_path)
        _, second_err = second.communicate(timeout=300)
        assert first.poll() is None  # (held: the second met a running first run)
        go.touch()
        _, first_err = first.communicate(timeout=300)
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                process.kill()
    assert second.returncode == 2, second_err
    last = second_err.strip().splitlines()[-1]
    assert last.startswith(f"error: output_dir {output} is in use by another run (pid {first.pid} on ")
    assert "Traceback" not in second_err
    assert first.returncode == 0, first_err
    checkpoints = sorted(output.glob("checkpoint-*"))
    assert len(checkpoints) == 6
    rates = {
        json.loads((c / "dflash2_recipe.json").read_text())["training_arguments"]["learning_rate"] for c in checkpoints
    }
    assert rates == {0.005}


def test_a_holder_caught_between_clearing_its_record_and_unlocking_is_not_a_stranger(tmp_path, monkeypatch):
    """release() empties the record, then unlocks (and acquire() locks, then writes itself in): a
    peer of the same job polling in that moment used to read an empty record and stop with "in use by
    another run (another process (it recorded no details))". Here the holder stays in that moment for
    0.5 s: the peer must wait it out and take the lock."""
    entry = tmp_path / "features" / "abc"
    lock_file = entry_lock_file(entry)
    lock_file.parent.mkdir(parents=True)
    code = (
        "import fcntl, os, sys, time\n"
        f"descriptor = os.open({str(lock_file)!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
        "fcntl.flock(descriptor, fcntl.LOCK_EX)\n"
        "os.ftruncate(descriptor, 0)\n"
        f"print({READY!r}, flush=True)\n"
        "time.sleep(0.5)\n"
        "fcntl.flock(descriptor, fcntl.LOCK_UN)\n"
        "time.sleep(30)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == READY
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
        with lock_cache_entry(entry, "feature store") as taken:
            assert taken.holder()["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait(timeout=30)
