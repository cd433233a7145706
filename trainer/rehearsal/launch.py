"""Launching the rehearsal's training the way the GPU run is launched: `accelerate launch
--config_file <config> -m trainer train <recipe>`, on N CPU ranks, under a deadline.

The launch's output goes to a log file (no pipe a leftover worker could hold open); at the deadline
the whole process group is killed. When it fails, the line that says why is picked from the log: a
rank's own `error:` line, else the last exception a rank raised, else the log's last line.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.training.cpu_fsdp import FSDP2_ON_CPU_ENV

# an exception line of a Python traceback (not the launcher's own wrapper of a child's failure)
EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_.]*(?:Error|Exception|Interrupt)\b.*)$")
LAUNCHER_NOISE = ("ChildFailedError", "CalledProcessError", "torch.distributed.elastic")


@dataclass
class Launched:
    """How a launch ended: exit status (None: killed at the deadline), its log, and its wall time."""

    returncode: int | None
    log: Path
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def why(self) -> str:
        """One line saying why the launch failed."""
        if self.returncode is None:
            return f"did not finish within its deadline ({self.seconds:.0f} s); the log is {self.log}"
        return f"{failure_line(self.log.read_text(errors='replace'))} (exit {self.returncode}; log {self.log})"


def failure_line(text: str) -> str:
    """The line of a failed launch's output that says why."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("error: ") or re.match(r"^\[rank\d+\]:\s*error: ", line):
            return line
    exceptions = [
        match.group(1)
        for line in lines
        if (match := EXCEPTION.match(line)) and not any(noise in line for noise in LAUNCHER_NOISE)
    ]
    if exceptions:
        return exceptions[-1]
    return lines[-1] if lines else "no output"


def launch_command(accelerate_config: Path, recipe: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config),
        "-m",
        "trainer",
        "train",
        str(recipe),
        *extra,
    ]


def launch(
    accelerate_config: Path, recipe: Path, extra: list[str], log: Path, deadline_s: float, fsdp: bool
) -> Launched:
    """Run the training launch until it ends or `deadline_s` passes (then kill its process group)."""
    environment = dict(os.environ)
    if fsdp:
        environment[FSDP2_ON_CPU_ENV] = "1"
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(
            launch_command(accelerate_config, recipe, extra),
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode: int | None = process.wait(timeout=max(deadline_s, 1.0))
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # a finished launcher's leftover workers too
            process.wait()
    return Launched(returncode, log, time.perf_counter() - started)
