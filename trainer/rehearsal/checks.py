"""The rehearsal's checks, each ending as one printed line: `ok (...)`, `FAILED: <why>` or
`not checked here: <why>`.

Each check function returns its detail or raises: a `ValueError` / `OSError` (the project's user
errors, already one line) is the failure's line; a `NotChecked` says why it could not run here.
Anything else is a bug in the rehearsal and keeps its traceback.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from trainer.console import describe

OK, FAILED, NOT_CHECKED = "ok", "FAILED", "not checked here"
# how close the resumed run must come to the uninterrupted one (same ranks, same gloo reductions: the
# same floating-point operations in the same order, so equal in practice)
RESUME_TOLERANCE = 1e-6


class NotChecked(Exception):
    """A check that cannot run on this machine (the message says why)."""


@dataclass
class Check:
    name: str
    status: str
    detail: str

    def line(self) -> str:
        if self.status == OK:
            return f"check {self.name}: ok" + (f" ({self.detail})" if self.detail else "")
        return f"check {self.name}: {self.status}: {self.detail}"


class Checks:
    """The checks run so far, printed as they finish."""

    def __init__(self, echo: Callable[[str], None] = print):
        self.done: list[Check] = []
        self.echo = echo

    def run(self, name: str, function: Callable[[], str], *, needs: tuple[str, ...] = ()) -> bool:
        """Run one check unless a check it needs did not pass; True when it passed."""
        failed = [check.name for check in self.done if check.name in needs and check.status != OK]
        if failed:
            return self.add(name, NOT_CHECKED, f"needs {', '.join(failed)}, which did not pass")
        try:
            detail = function()
        except NotChecked as why:
            return self.add(name, NOT_CHECKED, str(why))
        except (ValueError, OSError, yaml.YAMLError, FloatingPointError) as error:
            return self.add(name, FAILED, " ".join(describe(error).split()))
        return self.add(name, OK, detail)

    def add(self, name: str, status: str, detail: str) -> bool:
        check = Check(name, status, detail)
        self.done.append(check)
        self.echo(check.line())
        return status == OK

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.done if check.status == FAILED]


# ---------------------------------------------------------------------------------------------
# What the checks read back from a finished run
# ---------------------------------------------------------------------------------------------


def step_losses(run: Path) -> dict[int, float]:
    """The training loss logged at each optimizer step (trainer_state.json of the finished run)."""
    state = run / "trainer_state.json"
    if not state.is_file():
        raise ValueError(f"{run} has no trainer_state.json: the run did not finish")
    history = json.loads(state.read_text())["log_history"]
    return {int(entry["step"]): float(entry["loss"]) for entry in history if "loss" in entry}


def two_finite_steps(run: Path, steps: int) -> str:
    losses = step_losses(run)
    missing = [step for step in range(1, steps + 1) if step not in losses]
    if missing:
        raise ValueError(f"no loss logged at step(s) {missing} (logged: {sorted(losses)})")
    bad = {step: loss for step, loss in losses.items() if not math.isfinite(loss)}
    if bad:
        raise FloatingPointError(f"non-finite loss at step(s) {sorted(bad)}: {bad}")
    return "losses " + ", ".join(f"{losses[step]:.4f}" for step in range(1, steps + 1))


def run_layout(checkpoint: Path, log: str, fsdp_asked: bool, ranks: int, precision: str) -> str:
    """How the launch really trained: FSDP2 (its checkpoint is accelerate's FSDP one), DDP or one
    process, and the precision (a launch that dropped it says so in a `precision:` warning)."""
    fsdp = any(checkpoint.glob("pytorch_model_fsdp*"))
    if fsdp_asked and not fsdp:
        raise ValueError(
            f"the accelerate config asks for FSDP, but {checkpoint.name} is not an FSDP checkpoint: the run "
            "trained without FSDP (accelerate's CPU fallback), so the sharded path was not rehearsed"
        )
    layout = "FSDP2" if fsdp else ("DDP" if ranks > 1 else "one process")
    dropped = [line.split("precision: ", 1)[1] for line in log.splitlines() if "precision: " in line]
    ran = precision if not dropped else f"{precision} asked, but {dropped[0].strip()}"
    return f"{layout} on {ranks} gloo rank(s), {ran}"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def same_run(first: Path, second: Path, step: int) -> str:
    """The resumed run's loss at `step` and its final weights against the uninterrupted run's."""
    a, b = step_losses(first), step_losses(second)
    if step not in b:
        raise ValueError(f"the resumed run logged no loss at step {step} (logged: {sorted(b)})")
    loss_gap = abs(a[step] - b[step])
    ours, theirs = weights(first), weights(second)
    if ours.keys() != theirs.keys():
        raise ValueError(f"the resumed run saved other tensors: {sorted(ours.keys() ^ theirs.keys())[:4]}")
    weight_gap = max(float((ours[name].double() - theirs[name].double()).abs().max()) for name in ours)
    detail = f"step-{step} loss {b[step]:.6f} vs {a[step]:.6f} uninterrupted, weights max |diff| {weight_gap:.1e}"
    if not (loss_gap <= RESUME_TOLERANCE * max(1.0, abs(a[step])) and weight_gap <= RESUME_TOLERANCE):
        raise ValueError(f"resuming from step {step - 1} does not reproduce the uninterrupted run: {detail}")
    return detail


def layer_summary(config: Any) -> str:
    """'36 layers' or '64 layers: 48 linear_attention + 16 full_attention'."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None) or []
    counts = Counter(types)
    kinds = " + ".join(f"{count} {kind}" for kind, count in counts.items()) if len(counts) > 1 else ""
    return f"{text.num_hidden_layers} layers" + (f": {kinds}" if kinds else "")
