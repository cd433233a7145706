"""Preemption: SIGTERM / SIGINT finish the current optimizer step, save a checkpoint and stop.

Cluster schedulers (SLURM `--signal`, Kubernetes) send SIGTERM some time before they kill a job,
and people press Ctrl-C. The handler only records the signal; at the end of the optimizer step in
progress the callback asks the Trainer to save and stop. Ranks agree through a one-scalar
all-reduce, so a signal that reached one rank stops them all at the same step. A second signal
exits at once. A copy of the same signal within `DUPLICATE_WINDOW_S` is not a second signal: SLURM
signals every process of a step and torchrun forwards its own SIGTERM to the workers as well.

Once a rank's run has stopped (on a signal, or on an error in a multi-rank job) only its report is
left, and a signal then is usually the launcher ending the job because another rank exited first.
`hold_until_exit` keeps that signal from cutting the report short: it is recorded silently, and the
rank exits on its own once its line is out, on a second signal, or `ENDING_GRACE_S` later.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_WINDOW_S = 1.0
ENDING_GRACE_S = 10.0  # below torchrun's 30 s before it sends SIGKILL


def exit_status(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (143, 130)."""
    return 128 + signum


def is_copy(signum: int, first: int | None, first_at: float, now: float) -> bool:
    """The first signal again within DUPLICATE_WINDOW_S: delivered twice (scheduler and launcher), not a
    second request."""
    return signum == first and now - first_at < DUPLICATE_WINDOW_S


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving a complete checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, resume: str = "true", overwrite: bool = False):
        """`checkpoint`: one that exists now (the run's caller checks); `resume`: the flag value that
        continues from it (`true` when it is the newest complete one, else its path); `overwrite`: the
        run was started with overwrite_output_dir, which the resume must drop."""
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        saved = f"saved a complete checkpoint at {checkpoint}" if checkpoint else "no checkpoint could be saved"
        without = " and --overwrite_output_dir false" if overwrite else ""
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}: {saved}; "
            f"run the same command with --resume_from_checkpoint {resume}{without} to continue"
        )

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)


class PreemptionCallback(TrainerCallback):
    """Records SIGTERM / SIGINT while installed; turns them into save-and-stop at a step's end."""

    def __init__(self, process_index: int = 0) -> None:
        self.process_index = process_index
        self.signum: int | None = None
        self.received_at = 0.0
        self.stopped_at_step: int | None = None
        self._previous: dict[int, Any] = {}
        self.ending_signal: int | None = None  # a signal received while holding until exit
        self.ending_received_at = 0.0

    # -- the handler -----------------------------------------------------------------------------

    def install(self) -> None:
        """Take over the signals (main thread only; elsewhere Python cannot install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Not in the main thread: SIGTERM/SIGINT will not save a checkpoint before exiting.")
            return
        for signum in HANDLED_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def hold_until_exit(self) -> None:
        """Only this process's report is left: from here a signal waits for it (see the module docstring).

        The handlers are swapped without passing through the default, which would kill the process."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in HANDLED_SIGNALS:
            previous = signal.signal(signum, self._handle_while_ending)
            self._previous.setdefault(signum, previous)

    def after_training(self, *, failed: bool, world_size: int) -> None:
        """When `train` ends: a rank of a multi-rank job whose run stopped (a signal or an error) holds
        until exit; otherwise the handlers from before `train` come back."""
        if world_size > 1 and (failed or self.stopped_at_step is not None):
            self.hold_until_exit()
        else:
            self.uninstall()

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.received_at = signum, now
            self._say(
                f"received {signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
                "(send the signal again to exit at once)"
            )
            return
        if is_copy(signum, self.signum, self.received_at, now):
            return
        self._say(f"received {signal.Signals(signum).name} again: exiting now; the last complete checkpoint stays")
        os._exit(exit_status(signum))

    def _handle_while_ending(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.ending_signal is None:
            self.ending_signal, self.ending_received_at = signum, now
            deadline = threading.Timer(ENDING_GRACE_S, os._exit, [exit_status(signum)])
            deadline.daemon = True
            deadline.start()
            return
        if is_copy(signum, self.ending_signal, self.ending_received_at, now):
            return
        os._exit(exit_status(signum))

    def _say(self, message: str) -> None:
        if self.process_index == 0:
            print(message, file=sys.stderr, flush=True)

    # -- the callback ----------------------------------------------------------------------------

    def on_step_end(self, args, state, control, **kwargs):
        signum = self._agreed_signal(args)
        if signum:
            self.signum = self.signum or signum
            self.stopped_at_step = state.global_step
            control.should_save = True
            control.should_evaluate = False  # the grace period is for the save, not an evaluation
            control.should_training_stop = True
        return control

    def _agreed_signal(self, args) -> int:
        """The signal any rank received (0: none); a collective only when there are several ranks."""
        local = self.signum or 0
        if args.world_size <= 1 or not torch.distributed.is_initialized():
            return local
        flag = torch.tensor([local], dtype=torch.int32, device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())
