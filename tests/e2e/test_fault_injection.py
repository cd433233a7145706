"""Fault injection: a tiny run killed or signalled in and around its checkpoint saves, then resumed.

Every scenario runs `python -m trainer train` in a fresh process (tests/support/faults/train_with_fault.py), hits
it at one point, then runs the same command with `--resume_from_checkpoint true` in another fresh process
to the same max_steps (tests/support/faults/forked_runs.py forks both from one process that imported
the libraries once). The resumed run must end bit-equal to an uninterrupted one: same final weights, same
logged losses (CPU, float32, one thread, same seed: nothing in the step is nondeterministic, so
any difference would be a resume bug, not noise).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.locks import RUN_LOCK_NAME
from trainer.training.checkpoints import checkpoint_problems, list_checkpoints

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "support" / "faults" / "train_with_fault.py"
FORKED_RUNS = REPO / "tests" / "support" / "faults" / "forked_runs.py"
TRAIN = ("-m", "trainer", "train")  # `dflash2 train`, from the checkout
RUN = {"max_steps": 6, "save_steps": 2, "save_total_limit": 2, "num_eval_samples": 0, "logging_steps": 1}
KILLED = -signal.SIGKILL

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Scenario:
    point: str
    step: int
    status: int  # of the faulted run
    resumes_from: int  # the checkpoint step the resumed run must pick
    message: str = ""  # expected in the faulted run's stderr


SCENARIOS = [
    Scenario("weights", 4, KILLED, 2),
    Scenario("optimizer", 4, KILLED, 2),
    Scenario("trainer_state", 4, KILLED, 2),
    Scenario("manifest", 4, KILLED, 2),
    Scenario("rename", 4, KILLED, 4),  # complete but not renamed: recovered, not thrown away
    Scenario("rotation", 6, KILLED, 6),
    Scenario("final_save", 6, KILLED, 6),
    Scenario("between_steps", 5, KILLED, 4),
    Scenario(
        "sigterm",
        3,
        128 + signal.SIGTERM,
        3,
        "interrupted: stopped by SIGTERM after step 3: saved a complete checkpoint at ",
    ),
    Scenario("sigint", 5, 128 + signal.SIGINT, 5, "interrupted: stopped by SIGINT after step 5"),
    Scenario("second_signal", 3, 128 + signal.SIGINT, 2, "received SIGINT again: exiting now"),
    Scenario("enospc", 4, 2, 2, "error: no space left on device while writing the checkpoint of step 4 "),
]
# A packed run (packing: true): its rows, their order across the epoch boundary at step 5 and its
# anchors replay exactly too.
PACKED_SCENARIOS = [Scenario("between_steps", 5, KILLED, 4), Scenario("optimizer", 4, KILLED, 2)]
PACKED = "packed-"


def python(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def outcome(output: Path) -> tuple[dict[str, torch.Tensor], list[tuple[int, float]]]:
    weights = load_file(output / "model.safetensors")
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    return weights, [(log["step"], log["loss"]) for log in history if "loss" in log]


def plan(root: Path, recipe: Path, scenario: Scenario | None) -> dict:
    """The uninterrupted reference (no scenario), or a faulted run followed by its resume."""
    if scenario is None:
        return {"cwd": str(root), "runs": [[*TRAIN, str(recipe)]]}
    faulted = [str(FAULTS), scenario.point, str(scenario.step), str(recipe)]
    return {"cwd": str(root), "runs": [faulted, [*TRAIN, str(recipe), "--resume_from_checkpoint", "true"]]}


def ran(root: Path, index: int) -> subprocess.CompletedProcess:
    """What forked_runs.py recorded of a scenario's run `index`."""
    read = lambda suffix: (root / f"run-{index}.{suffix}").read_text()  # noqa: E731
    return subprocess.CompletedProcess([], int(read("rc")), read("out"), read("err"))


def played_result(root: Path, scenario: Scenario | None) -> dict:
    if scenario is None:
        return {"faulted": ran(root, 0), "output": root / "output"}
    survivors = json.loads((root / "survivors-1.json").read_text())
    return {"faulted": ran(root, 0), "survivors": survivors, "resumed": ran(root, 1), "output": root / "output"}


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> dict[str, dict]:
    """The uninterrupted reference and every scenario, two processes at a time (one thread each),
    each run a fresh process forked from one that imported torch, transformers and the trainer
    (tests/support/faults/forked_runs.py: the imports are most of a tiny run's cost).
    The runs' files are written first, one after another: building the tiny target seeds torch's
    global generator."""
    root = tmp_path_factory.mktemp("faults")
    jobs = {"reference": None, **{s.point: s for s in SCENARIOS}}
    jobs.update({f"{PACKED}reference": None, **{f"{PACKED}{s.point}": s for s in PACKED_SCENARIOS}})
    recipes = {name: write_tiny_run(root / name, **RUN, packing=name.startswith(PACKED)) for name in jobs}
    plan_file = root / "plan.json"
    plan_file.write_text(json.dumps({name: plan(root / name, recipes[name], jobs[name]) for name in jobs}))
    server = python(str(FORKED_RUNS), str(plan_file), "2", cwd=root, timeout=1800)
    assert server.returncode == 0, server.stderr[-3000:]
    return {name: played_result(root / name, jobs[name]) for name in jobs}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.point for s in SCENARIOS])
def test_a_faulted_run_resumes_to_exactly_the_uninterrupted_result(played, scenario):
    check_resumed_exactly(played["reference"], played[scenario.point], scenario)


@pytest.mark.parametrize("scenario", PACKED_SCENARIOS, ids=[s.point for s in PACKED_SCENARIOS])
def test_a_faulted_packed_run_resumes_to_exactly_the_uninterrupted_packed_result(played, scenario):
    check_resumed_exactly(played[f"{PACKED}reference"], played[f"{PACKED}{scenario.point}"], scenario)


def test_the_packed_run_trains_on_packed_rows(played):
    """Fewer rows than samples: the packed run's six steps cover more epochs (20 samples, 2 per row)."""

    def final_epoch(result: dict) -> float:
        return json.loads((result["output"] / "trainer_state.json").read_text())["epoch"]

    assert final_epoch(played[f"{PACKED}reference"]) > 1.5 * final_epoch(played["reference"])


def check_resumed_exactly(reference: dict, result: dict, scenario: Scenario) -> None:
    assert reference["faulted"].returncode == 0, reference["faulted"].stderr[-3000:]
    faulted, resumed = result["faulted"], result["resumed"]
    assert faulted.returncode == scenario.status, faulted.stderr[-3000:]
    assert scenario.message in faulted.stderr
    # every directory left under a final checkpoint name is complete: no kill leaves a partial one
    assert all(problems == [] for problems in result["survivors"].values()), result["survivors"]

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {result['output'] / f'checkpoint-{scenario.resumes_from}'}" in resumed.stderr
    # (the run's lock file stays by design: trainer.locks)
    leftovers = [p.name for p in result["output"].iterdir() if p.name.startswith(".") and p.name != RUN_LOCK_NAME]
    assert leftovers == []
    kept = list_checkpoints(result["output"])
    assert kept[-1].name == "checkpoint-6" and len(kept) == RUN["save_total_limit"]
    assert all(checkpoint_problems(path) == [] for path in kept)

    expected_weights, expected_losses = outcome(reference["output"])
    weights, losses = outcome(result["output"])
    assert losses == expected_losses and len(losses) == RUN["max_steps"]
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_sigterm_saves_the_step_in_progress_and_prints_one_line(played):
    faulted = played["sigterm"]["faulted"]
    lines = [line for line in faulted.stderr.splitlines() if line.startswith(("interrupted:", "received"))]
    assert lines[0].startswith("received SIGTERM: finishing the current step")
    assert lines[1].startswith("interrupted: stopped by SIGTERM after step 3")
    assert "Traceback" not in faulted.stderr
    assert played["sigterm"]["survivors"] == {"checkpoint-2": [], "checkpoint-3": []}


def test_a_second_signal_exits_at_once_without_the_checkpoint_it_interrupted(played):
    survivors = played["second_signal"]["survivors"]
    assert survivors == {"checkpoint-2": []}  # checkpoint-3 was being written: it never became visible


def error_lines(stderr: str) -> list[str]:
    """The `error:` lines (a progress bar may share the line: it ends with a carriage return, not a newline)."""
    return [line[line.index("error: ") :] for line in stderr.splitlines() if "error: " in line]


def test_a_diverged_run_saves_nothing_and_a_resume_with_another_rate_is_refused(tmp_path):
    """learning_rate 10000 makes the gradients NaN after a few steps (step 4 or 5, by the CPU's
    kernels): before, the NaN checkpoint was written as a complete checkpoint and rotated the finite
    one away, and a resume with another learning rate went on with the old one."""
    recipe = write_tiny_run(
        tmp_path, learning_rate=10000, max_steps=8, save_steps=2, save_total_limit=1, num_eval_samples=0
    )
    output = tmp_path / "output"
    diverged = python(*TRAIN, str(recipe), cwd=tmp_path)
    assert diverged.returncode == 2, diverged.stderr[-3000:]
    lines = error_lines(diverged.stderr)
    step = int(re.search(r"at step (\d+):", lines[0]).group(1)) if lines else 0
    assert 3 <= step <= 8, lines
    good = output / f"checkpoint-{2 * ((step - 1) // 2)}"  # the last save step before the NaN one
    assert lines == [
        f"error: non-finite gradient norm (nan) at step {step}: no checkpoint saved; the last good checkpoint is {good}"
    ]
    assert "Traceback" not in diverged.stderr
    assert {p.name: checkpoint_problems(p) for p in list_checkpoints(output)} == {good.name: []}
    assert not (output / "model.safetensors").exists()

    same = python(*TRAIN, str(recipe), "--resume_from_checkpoint", "true", "--learning_rate", "0.005", cwd=tmp_path)
    assert same.returncode == 2
    refused = error_lines(same.stderr)
    assert len(refused) == 1 and refused[0].startswith(
        f"error: resume from {good} refused: the run changed learning_rate 10000.0 → 0.005 ("
    )


@pytest.fixture
def small_disk(tmp_path, request):
    """A small tmpfs (`request.param`): one checkpoint of the tiny run (about 320 KiB) fits, two do not."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


# 480k fills up at a plain file write (an OSError), 600k inside torch.save of optimizer.pt (torch's own
# "unexpected pos" RuntimeError, recognised by probing the filesystem)
@pytest.mark.parametrize("small_disk", ["480k", "600k"], indirect=True)
def test_a_really_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last_one(tmp_path, small_disk):
    output = small_disk / "output"
    recipe = write_tiny_run(tmp_path, output_dir=str(output), save_total_limit=1, num_eval_samples=0)
    full = python(*TRAIN, str(recipe), cwd=tmp_path)
    assert full.returncode == 2, full.stderr[-3000:]
    [last] = error_lines(full.stderr)
    assert last.startswith(
        f"error: no space left on device while writing the checkpoint of step 4 {output}/checkpoint-4 ("
    )
    assert last.endswith(
        f"free); the last good checkpoint is {output / 'checkpoint-2'} (kept; nothing was rotated away)"
    )
    assert "Traceback" not in full.stderr
    assert {p.name: checkpoint_problems(p) for p in list_checkpoints(output)} == {"checkpoint-2": []}
    assert not [p.name for p in output.iterdir() if p.name.startswith(".staging")]  # the failed save is gone
    assert shutil.disk_usage(small_disk).free > 100 * 1024
