"""Two processes on CPU (gloo): a tiny recipe end to end under DDP, accelerate's FSDP2 path, clean teardown."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modeling_dflash2.checkpoint_dflash2 import REMOTE_CODE_FILES
from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.evaluation.report import run_summary
from trainer.locks import RUN_LOCK_NAME
from trainer.training.checkpoints import MANIFEST, checkpoint_problems
from trainer.training.distributed import LEAKED_WRAPPER_WARNING, close_process_group, live_ddp_wrappers
from trainer.training.watchdog import LOST_RANK_STATUS

REPO = Path(__file__).resolve().parents[2]
DRAFT_FILES = {"config.json", "model.safetensors", *REMOTE_CODE_FILES}
FAULTS = REPO / "tests" / "support" / "faults" / "train_with_fault.py"
AUTO_MAP = {"AutoConfig": "configuration_dflash2.DFlash2Config", "AutoModel": "modeling_dflash2.DFlash2DraftModel"}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def torchrun(*args: str, cwd: Path, expect_success: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if not expect_success:
        return result
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert LEAKED_WRAPPER_WARNING not in result.stderr
    return result


def assert_draft_directory(directory: Path, extra: set[str] = frozenset()) -> None:
    files = {p.name for p in directory.iterdir() if not p.name.startswith("checkpoint-")}
    assert files >= DRAFT_FILES, files
    assert not any(name.endswith(".py") and name not in DRAFT_FILES for name in files), files
    allowed = {
        "training_args.bin",
        "trainer_state.json",
        "runs",
        "dflash2_recipe.json",
        RUN_LOCK_NAME,
    }
    assert files - DRAFT_FILES <= extra | allowed, files
    config = json.loads((directory / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["DFlash2DraftModel"]


def assert_complete(checkpoint: Path, written_by_all_ranks: set[str]) -> None:
    """The manifest lists what every rank wrote, and nothing staged is left beside the checkpoint."""
    assert checkpoint_problems(checkpoint) == []
    listed = set(json.loads((checkpoint / MANIFEST).read_text())["files"])
    assert written_by_all_ranks <= listed, listed
    assert not [p.name for p in checkpoint.parent.iterdir() if p.name.startswith(".") and p.name != RUN_LOCK_NAME]


def test_ddp_two_processes_tiny_recipe_end_to_end(tmp_path):
    recipe = write_tiny_run(tmp_path)
    torchrun("-m", "trainer", "train", str(recipe), cwd=tmp_path)
    output = tmp_path / "output"
    resume_files = {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"}
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        assert_draft_directory(output / checkpoint, extra=resume_files | {MANIFEST})
        assert_complete(output / checkpoint, {"rng_state_0.pth", "rng_state_1.pth"})
    assert_draft_directory(output)
    state = json.loads((output / "checkpoint-4" / "trainer_state.json").read_text())
    train_logs = [log for log in state["log_history"] if "loss" in log and "eval_loss" not in log]
    assert len(train_logs) == 4 and all("tau_walk" in log and "coverage" in log for log in train_logs)
    assert run_summary(output)["trained"]["eval_tau_walk"] >= 1.0


def test_fsdp2_wrapping_path_trains_and_saves_a_clean_draft(tmp_path):
    torchrun(str(REPO / "tests" / "support" / "distributed" / "fsdp2_cpu.py"), str(tmp_path), cwd=tmp_path)
    output = tmp_path / "output"
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        directory = output / checkpoint
        assert (directory / "pytorch_model_fsdp_0").is_dir()  # the FSDP2 resume files exist: FSDP really ran
        assert_draft_directory(
            directory,
            extra={
                "pytorch_model_fsdp_0",
                "optimizer_0",
                "scheduler.pt",
                "trainer_state.json",
                "rng_state_0.pth",
                "rng_state_1.pth",
                MANIFEST,
            },
        )
        assert_complete(directory, {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "rng_state_1.pth"})
    assert_draft_directory(output)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert "eval_tau_walk" in metrics and "eval_coverage" in metrics
    from transformers import AutoModel

    model = AutoModel.from_pretrained(output, trust_remote_code=True)
    assert type(model).__name__ == "DFlash2DraftModel"
    saved = load_file(output / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint(tmp_path):
    recipe = write_tiny_run(tmp_path, max_steps=6, num_eval_samples=0)
    result = torchrun(str(FAULTS), "sigterm_rank_1", "3", str(recipe), cwd=tmp_path, expect_success=False)
    assert result.returncode != 0
    output = tmp_path / "output"
    said = [line for line in result.stderr.splitlines() if line.startswith("interrupted:")]
    # only rank 0 speaks, and it never got the signal: it stopped because rank 1 did; it speaks after
    # rank 1 exited, so the launcher's SIGTERM came first and must not have cut the line
    assert said == [
        f"interrupted: stopped by SIGTERM after step 3: saved a complete checkpoint at {output / 'checkpoint-3'}; "
        "run the same command with --resume_from_checkpoint true to continue"
    ]
    assert sorted(p.name for p in output.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-3",
    ]
    assert_complete(output / "checkpoint-3", {"rng_state_0.pth", "rng_state_1.pth"})
    state = json.loads((output / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3


class RecordingAccelerator:
    """The two Accelerator calls close_process_group makes, recorded; it holds the wrapper like accelerate."""

    def __init__(self, models: list) -> None:
        self._models = models
        self.barriers = 0

    def wait_for_everyone(self) -> None:
        self.barriers += 1
        torch.distributed.barrier()

    def free_memory(self) -> None:
        self._models = []


@pytest.fixture
def single_rank_ddp(tmp_path):
    """A real one-rank gloo group and a DDP-wrapped module; the group is always gone afterwards."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    module = torch.nn.Linear(3, 2)
    objects = [module, torch.nn.parallel.DistributedDataParallel(module)]
    objects[1](torch.ones(1, 3)).sum().backward()  # a finished allreduce, as after training
    yield objects  # a list the test empties: this frame must not keep the wrapper alive
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_close_process_group_frees_the_wrapper_before_destroying_the_group(single_rank_ddp, caplog):
    wrapper, module = single_rank_ddp.pop(), single_rank_ddp.pop()
    accelerator = RecordingAccelerator([wrapper])
    trainer = type("TrainerLike", (), {})()
    trainer.model, trainer.model_wrapped, trainer.accelerator = module, wrapper, accelerator
    del wrapper
    assert live_ddp_wrappers() == 1
    with caplog.at_level(logging.WARNING, logger="trainer.training.distributed"):
        close_process_group(trainer)
    assert accelerator.barriers == 1 and accelerator._models == []
    assert trainer.model_wrapped is module
    assert live_ddp_wrappers() == 0
    assert not torch.distributed.is_initialized()
    assert LEAKED_WRAPPER_WARNING not in caplog.text
    close_process_group(trainer)  # no group: nothing to do, no error


def test_close_process_group_warns_when_a_wrapper_is_still_referenced(single_rank_ddp, caplog):
    module, wrapper = single_rank_ddp
    trainer = type("TrainerLike", (), {})()
    trainer.model, trainer.model_wrapped, trainer.accelerator = module, wrapper, RecordingAccelerator([wrapper])
    with caplog.at_level(logging.WARNING, logger="trainer.training.distributed"):
        close_process_group(trainer)  # `wrapper` is still held by this test
    assert LEAKED_WRAPPER_WARNING in caplog.text
    assert not torch.distributed.is_initialized()


def test_fsdp_target_sharding_halves_the_decoder_layers_per_rank_and_trains_identically(tmp_path):
    torchrun(str(REPO / "tests" / "support" / "distributed" / "target_sharding_cpu.py"), str(tmp_path), cwd=tmp_path)
    results = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        whole, sharded = result["none"], result["fsdp"]
        assert not whole["sharded"] and sharded["sharded"]
        assert whole["local_bytes"] == whole["whole_bytes"] == sharded["whole_bytes"] > 0
        # each rank holds its half of every decoder layer, also after the forwards (resharded after each)
        assert abs(sharded["local_bytes"] / sharded["whole_bytes"] - 0.5) < 0.03
        assert sharded["captures"] == whole["captures"] > 0  # online capture ran through the sharded target
        losses = {mode: logged_losses(result[mode]["log_history"]) for mode in result}
        assert [key for key, _ in losses["fsdp"]] == ["eval_loss", "loss", "loss", "loss", "train_loss", "eval_loss"]
        assert [key for key, _ in losses["none"]] == [key for key, _ in losses["fsdp"]]
        assert [value for _, value in losses["fsdp"]] == pytest.approx([value for _, value in losses["none"]], rel=1e-6)
    assert results[0]["fsdp"]["captures"] == results[1]["fsdp"]["captures"]
    assert (tmp_path / "output-fsdp" / "model.safetensors").is_file()


def logged_losses(log_history: list[dict]) -> list[tuple[str, float]]:
    """Every logged loss of a run, in order: training steps, evaluations, the run's mean."""
    keys = ("loss", "eval_loss", "train_loss")
    return [(key, log[key]) for log in log_history for key in keys if key in log]


# -- a rank that stops or dies mid-training (trainer.training.watchdog) --------------------------------------

STALL_TIMEOUT_S = 5


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes (their RANK environment variable)."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True, timeout=30)
    workers = {}
    for pid in map(int, children.stdout.split()):
        with contextlib.suppress(OSError):
            environment = dict(
                item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
            )
            workers[int(environment[b"RANK"])] = pid
    return workers


def alive(pid: int) -> bool:
    """Exists and is no zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def hit_a_rank_mid_training(
    tmp_path: Path, rank: int, signum: int, wait_s: float, fault: str | None = None
) -> tuple[str, float, int]:
    """Run a long tiny recipe under torchrun, send `signum` to worker `rank` once training has logged a
    loss, and wait for every process of the job to end; (output, seconds from the signal to the last
    exit, the launcher's status). `fault`: a point of train_with_fault.py to run with. The worker is
    always continued and the job killed at the end."""
    recipe = write_tiny_run(
        tmp_path, max_steps=5000, save_steps=100000, num_eval_samples=0, rank_stall_timeout=STALL_TIMEOUT_S
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("DFLASH2_DEBUG", None)
    log = tmp_path / "job.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    with log.open("w") as output:
        launcher = subprocess.Popen(
            [*command, *(["-m", "trainer", "train"] if fault is None else [str(FAULTS), fault, "0"]), str(recipe)],
            cwd=tmp_path,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    victim = None
    try:
        deadline = time.monotonic() + 300
        while "'loss'" not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        workers = worker_pids(launcher)
        assert sorted(workers) == [0, 1], workers
        victim = workers[rank]
        os.kill(victim, signum)
        hit = time.monotonic()
        status = launcher.wait(timeout=wait_s)
        while any(alive(pid) for pid in workers.values()) and time.monotonic() < hit + wait_s:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers.values()), log.read_text()[-3000:]
        return log.read_text(), time.monotonic() - hit, status
    finally:
        if victim is not None:
            with contextlib.suppress(OSError):
                os.kill(victim, signal.SIGCONT)
        with contextlib.suppress(OSError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)


def worker_tracebacks(output: str) -> int:
    """Tracebacks other than the launcher's own ChildFailedError report of a failed worker."""
    return output.count("Traceback (most recent call last)") - output.count("errors.ChildFailedError")


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_stall_timeout_with_one_line_naming_it(tmp_path):
    output, seconds, status = hit_a_rank_mid_training(tmp_path, 1, signal.SIGSTOP, wait_s=STALL_TIMEOUT_S + 60)
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1, output[-3000:]
    said = r"^error: rank 1 stopped responding \(no heartbeat for (\d+) s\) (during|after) step \d+: stopping this rank"
    found = re.search(said, lines[0])
    assert found and STALL_TIMEOUT_S <= int(found[1]) <= STALL_TIMEOUT_S + 3, lines
    assert status != 0 and f"exitcode  : {LOST_RANK_STATUS} " in output
    assert worker_tracebacks(output) == 0, output[-3000:]
    assert seconds < STALL_TIMEOUT_S + 10, seconds


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_within_seconds_with_one_line_naming_it(tmp_path):
    # the survivor names rank 0 only after the launcher, seeing rank 0 die, has sent it SIGTERM
    output, seconds, status = hit_a_rank_mid_training(
        tmp_path, 0, signal.SIGKILL, wait_s=60, fault="late_lost_rank_line"
    )
    lines = [line.removeprefix("error: ") for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("rank 0 died (its process is gone"), lines
    assert status != 0 and worker_tracebacks(output) == 0, output[-3000:]
    assert seconds < 10, seconds
