"""Test-only: run `dflash2 train` (trainer.commands.train) and hit it with a fault at a named point of a named step.

Usage: python tests/support/faults/train_with_fault.py POINT STEP RECIPE [--key value ...]

Kills are SIGKILL (nothing can be cleaned up); a file "in the middle" of its write is left with
half of its bytes. The signal points send SIGTERM / SIGINT to the process itself while step STEP
is computed, as a scheduler or a user would. Under torchrun, the rank that reports last says its
line LAST_LINE_DELAY_S late, so the launcher, seeing the other rank exit, has signalled it first.
`enospc` makes the disk "full" (OSError ENOSPC) when optimizer.pt of step STEP is written.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import safetensors.torch
import torch
import transformers.modeling_utils
from transformers import TrainerCallback, TrainerState

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import trainer.training.run as train_script
from trainer.commands import train as train_command
from trainer.commands.runner import run
from trainer.training.checkpoints import MANIFEST, STAGING_PREFIX, TRASH_PREFIX
from trainer.training.watchdog import Watchdog

LAST_LINE_DELAY_S = 2.0  # torchrun checks on its workers every 0.1 s


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def cut_in_half(path: str | os.PathLike) -> None:
    size = os.path.getsize(path)
    os.truncate(path, size // 2)


def fault_on_write(write, match, *, half: bool = True):
    """Wrap a `write(obj, path, ...)`: for a matching path, write half of the file, then die."""

    def wrapped(obj, path, *args, **kwargs):
        result = write(obj, path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and match(str(path)):
            if half:
                cut_in_half(path)
            kill()
        return result

    return wrapped


class AtStep(TrainerCallback):
    def __init__(self, step: int, on_begin=None, on_end=None):
        self.step, self.on_begin, self.on_end = step, on_begin, on_end

    def on_step_begin(self, args, state, control, **kwargs):
        if self.on_begin and state.global_step == self.step - 1:
            self.on_begin()

    def on_step_end(self, args, state, control, **kwargs):
        if self.on_end and state.global_step == self.step:
            self.on_end()


def _weights(point: str, staged: str, step: int, callbacks: list) -> None:
    """Mid model.safetensors of the checkpoint."""
    save = fault_on_write(safetensors.torch.save_file, lambda p: staged in p and p.endswith("model.safetensors"))
    transformers.modeling_utils.safe_save_file = save


def _optimizer(point: str, staged: str, step: int, callbacks: list) -> None:
    """Mid optimizer.pt."""
    torch.save = fault_on_write(torch.save, lambda p: staged in p and p.endswith("optimizer.pt"))


def _trainer_state(point: str, staged: str, step: int, callbacks: list) -> None:
    """Mid trainer_state.json, the last file HF writes."""
    real = TrainerState.save_to_json
    TrainerState.save_to_json = fault_on_write(real, lambda p: staged in p)


def _manifest(point: str, staged: str, step: int, callbacks: list) -> None:
    """Everything written, the manifest half-written and not renamed."""
    real_replace = os.replace

    def replace(source, destination, *args, **kwargs):
        if str(destination).endswith(f"{staged}{MANIFEST}"):
            cut_in_half(source)
            kill()
        return real_replace(source, destination, *args, **kwargs)

    os.replace = replace


def _rename(point: str, staged: str, step: int, callbacks: list) -> None:
    """Complete and manifested, killed just before the rename into place."""
    real_replace = os.replace

    def replace(source, destination, *args, **kwargs):
        if str(source).endswith(staged.rstrip("/")):
            kill()
        return real_replace(source, destination, *args, **kwargs)

    os.replace = replace


def _rotation(point: str, staged: str, step: int, callbacks: list) -> None:
    """Half of an old checkpoint deleted by rotation."""
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(TRASH_PREFIX) and Path(path).is_dir():
            files = sorted(Path(path).iterdir())
            for victim in files[: len(files) // 2]:
                victim.unlink()
            kill()
        return real_rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree


def _final_save(point: str, staged: str, step: int, callbacks: list) -> None:
    """The run's own folder half replaced after the last step."""
    real_replace = os.replace

    def replace(source, destination, *args, **kwargs):
        if ".saving-" in str(source) and Path(destination).name == "model.safetensors":
            kill()
        return real_replace(source, destination, *args, **kwargs)

    os.replace = replace


def _enospc(point: str, staged: str, step: int, callbacks: list) -> None:
    """The disk fills up in the middle of a checkpoint."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if staged in str(path) and str(path).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *args, **kwargs)

    torch.save = save


def _between_steps(point: str, staged: str, step: int, callbacks: list) -> None:
    """Killed after step `step`, between two steps."""
    callbacks.append(AtStep(step, on_end=kill))


def _signal(point: str, staged: str, step: int, callbacks: list) -> None:
    """SIGTERM or SIGINT (Ctrl-C) at the start of step `step`."""
    signum = signal.SIGTERM if point == "sigterm" else signal.SIGINT
    callbacks.append(AtStep(step, on_begin=lambda: os.kill(os.getpid(), signum)))


def late(report):
    def delayed(*args, **kwargs):
        time.sleep(LAST_LINE_DELAY_S)
        return report(*args, **kwargs)

    return delayed


def _sigterm_rank_1(point: str, staged: str, step: int, callbacks: list) -> None:
    """Under torchrun: only rank 1 is told; every rank must stop with it, and rank 0 reports after rank 1 exited."""
    if os.environ.get("RANK") == "1":
        callbacks.append(AtStep(step, on_begin=lambda: os.kill(os.getpid(), signal.SIGTERM)))
    else:
        train_script.interruption = late(train_script.interruption)


def _late_lost_rank_line(point: str, staged: str, step: int, callbacks: list) -> None:
    """Under torchrun: a rank names a lost peer only after the launcher has signalled it (no fault of its own)."""
    Watchdog.report = late(Watchdog.report)  # type: ignore[method-assign]


def _second_signal(point: str, staged: str, step: int, callbacks: list) -> None:
    """SIGTERM during the step, then Ctrl-C during its checkpoint save."""
    callbacks.append(AtStep(step, on_begin=lambda: os.kill(os.getpid(), signal.SIGTERM)))
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if staged in str(path) and str(path).endswith("optimizer.pt"):
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(obj, path, *args, **kwargs)

    torch.save = save


FAULTS = {
    "weights": _weights,
    "optimizer": _optimizer,
    "trainer_state": _trainer_state,
    "manifest": _manifest,
    "rename": _rename,
    "rotation": _rotation,
    "final_save": _final_save,
    "enospc": _enospc,
    "between_steps": _between_steps,
    "sigterm": _signal,
    "sigint": _signal,
    "sigterm_rank_1": _sigterm_rank_1,
    "late_lost_rank_line": _late_lost_rank_line,
    "second_signal": _second_signal,
}


def install(point: str, step: int) -> None:
    if point not in FAULTS:
        raise SystemExit(f"unknown fault point {point}")
    callbacks: list = []
    FAULTS[point](point, f"{STAGING_PREFIX}checkpoint-{step}/checkpoint-{step}/", step, callbacks)

    base = train_script.DFlash2Trainer

    class FaultyTrainer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for callback in callbacks:
                self.add_callback(callback)

    train_script.DFlash2Trainer = FaultyTrainer


if __name__ == "__main__":
    install(sys.argv[1], int(sys.argv[2]))
    run(train_command.main, sys.argv[3:])
