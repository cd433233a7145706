"""FSDP2 as the GPU recipe runs it, rehearsed on 2 gloo ranks (`trainer.training.cpu_fsdp`), and
several processes launched on this GPU-less machine without `use_cpu` (`trainer.training.distributed`).

The FSDP2 run uses the shipped examples/accelerate/fsdp2.yaml with only num_processes and use_cpu
changed, and the GPU recipes' keys: bf16, target_sharding: fsdp, packing, activation checkpointing,
torch_compile. torch_compile uses the aot_eager backend: dynamo and AOTAutograd trace the FSDP2
layers exactly as on GPUs, while inductor would only add CPU C++ code generation (GPUs generate
Triton) at a minute of compile per run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.training import cpu_fsdp
from trainer.training.cpu_fsdp import FSDP2_ON_CPU_ENV

REPO = Path(__file__).resolve().parents[2]
SHIPPED_FSDP2 = REPO / "examples" / "accelerate" / "fsdp2.yaml"
LAUNCH_TIMEOUT_S = 300  # a resume that hangs (ranks disagreeing on FSDP) fails here, not forever

# bf16 FSDP2 on 2 ranks against one float32 process, per logged training loss (bf16 parameters and
# activations in the draft's layers, bf16 gradient reduction, 4 steps): measured at most 1.8e-4
# relative (3.4e-5 absolute at step 1, 7.5e-4 at step 4); the bound leaves 5x room.
BF16_LOSS_RTOL = 1e-3

# The GPU recipes' keys at tiny width. num_anchors covers every position of a packed row, so no
# anchor is drawn at random: one process and two ranks pool exactly the same anchors.
GPU_RECIPE_KEYS = {
    "bf16": True,
    "target_sharding": "fsdp",
    "packing": True,
    "gradient_checkpointing": True,
    "torch_compile": True,
    "torch_compile_backend": "aot_eager",
    "num_anchors": 64,
    "num_eval_samples": 0,
    "max_steps": 4,
    "save_steps": 2,
}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def launch_environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    for name in ("DFLASH2_DEBUG", FSDP2_ON_CPU_ENV, "ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK"):
        if name not in extra:
            env.pop(name, None)
    return env


def shipped_config_on_cpu(directory: Path, **changes) -> Path:
    """examples/accelerate/fsdp2.yaml with only the named keys changed (num_processes, use_cpu)."""
    shipped = yaml.safe_load(SHIPPED_FSDP2.read_text())
    assert set(changes) <= {"num_processes", "use_cpu"}
    config = {**shipped, **changes}
    path = directory / f"accelerate-{'-'.join(f'{k}{v}' for k, v in sorted(changes.items()))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def accelerate_launch(config: Path, *args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", "0", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def succeeded(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def training_losses(output: Path) -> dict[int, float]:
    state = json.loads((output / "trainer_state.json").read_text())
    return {log["step"]: log["loss"] for log in state["log_history"] if "loss" in log}


def write_recipe(root: Path, name: str, **changes) -> Path:
    recipe = yaml.safe_load((root / "recipe.yaml").read_text())
    recipe.update(changes, output_dir=str(root / name))
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


# -- the rules, without launching -----------------------------------------------------------------


def fake_args(device: str = "cpu", world_size: int = 2, fsdp_plugin_args: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), world_size=world_size, fsdp_plugin_args=fsdp_plugin_args)


def test_who_asks_for_fsdp_and_the_one_line_when_a_cpu_run_falls_back():
    recipe_fsdp = fake_args(fsdp_plugin_args={"fsdp_version": 2})
    assert cpu_fsdp.fsdp_source(recipe_fsdp, {}) == "the recipe's fsdp keys"
    assert cpu_fsdp.fsdp_source(fake_args(), {"ACCELERATE_USE_FSDP": "true"}) == "the accelerate config"
    assert cpu_fsdp.fsdp_source(fake_args(), {"ACCELERATE_USE_FSDP": "false"}) is None
    launched = {"ACCELERATE_USE_FSDP": "true"}
    assert cpu_fsdp.fallback_warning(fake_args(), launched) == (
        "FSDP (from the accelerate config) does not run on CPU in accelerate: this run trains as DDP on 2 CPU "
        "ranks; `dflash2 rehearse RECIPE --ranks 2` rehearses FSDP2 on CPU ranks (DFLASH2_FSDP2_ON_CPU=1)"
    )
    assert "trains as one process" in cpu_fsdp.fallback_warning(fake_args(world_size=1), launched)
    # a GPU run shards for real; a run nobody asked to shard has nothing to say
    assert cpu_fsdp.fallback_warning(fake_args(device="cuda"), launched) is None
    assert cpu_fsdp.fallback_warning(fake_args(), {}) is None
    # asked for, but this process has no process group to shard over: it falls back, and says so
    assert not cpu_fsdp.should_force(fake_args(), {**launched, FSDP2_ON_CPU_ENV: "1"})
    assert cpu_fsdp.fallback_warning(fake_args(), {**launched, FSDP2_ON_CPU_ENV: "1"}) is not None
    assert cpu_fsdp.fsdp2_on_cpu_requested({FSDP2_ON_CPU_ENV: "1"})
    assert not cpu_fsdp.fsdp2_on_cpu_requested({FSDP2_ON_CPU_ENV: "0"})


@pytest.fixture
def cpu_accelerator():
    """accelerate's state for one CPU process (as on a CPU rank: FSDP asked, none set); reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield Accelerator(cpu=True, mixed_precision="bf16")
    AcceleratorState._reset_state(reset_partial_state=True)


def test_forcing_says_fsdp2_in_every_accelerate_state_and_survives_a_fresh_accelerator_state(cpu_accelerator):
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    cpu_fsdp.force_fsdp2(cpu_accelerator.state, plugin)
    # accelerate code builds AcceleratorState() anew, which copies PartialState's fields over its own:
    # forcing AcceleratorState alone was undone there (and the ranks' resume paths disagreed)
    fresh = AcceleratorState()
    assert PartialState().distributed_type == fresh.distributed_type == DistributedType.FSDP
    assert fresh.is_fsdp2 and cpu_accelerator.is_fsdp2 and fresh.fsdp_plugin is plugin
    # the mixed-precision policy is set from the run's precision, as accelerate's GPU path sets it
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16


def test_forcing_refuses_fsdp1_in_one_line(cpu_accelerator):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with pytest.raises(
        ValueError, match=r"^DFLASH2_FSDP2_ON_CPU=1 rehearses FSDP2, but this run asks for FSDP version 1"
    ):
        cpu_fsdp.force_fsdp2(cpu_accelerator.state, FullyShardedDataParallelPlugin(fsdp_version=1))


# -- launched ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shipped_fsdp2_config_on_two_gloo_ranks_trains_resumes_exactly_and_exports(tmp_path):
    """Train, stop by SIGTERM after a checkpoint, resume: steps and weights equal the uninterrupted
    run's; the export loads with AutoModel; the losses follow one float32 process's."""
    write_tiny_run(tmp_path, **GPU_RECIPE_KEYS)
    config = shipped_config_on_cpu(tmp_path, num_processes=2, use_cpu=True)
    env = launch_environment(**{FSDP2_ON_CPU_ENV: "1"})
    train = ("-m", "trainer", "train")  # `accelerate launch -m trainer train RECIPE`, as the docs show

    whole = write_recipe(tmp_path, "whole")
    result = succeeded(accelerate_launch(config, *train, str(whole), cwd=tmp_path, env=env))
    assert "does not run on CPU" not in result.stderr  # FSDP2 ran: no fallback line
    assert "runs as float32" not in result.stderr  # bf16 ran
    assert (tmp_path / "whole" / "checkpoint-2" / "pytorch_model_fsdp.bin").is_file()  # FULL_STATE_DICT, FSDP

    cut = write_recipe(tmp_path, "cut")
    faults = str(REPO / "tests" / "support" / "faults" / "train_with_fault.py")
    stopped = accelerate_launch(config, faults, "sigterm_rank_1", "3", str(cut), cwd=tmp_path, env=env)
    assert stopped.returncode != 0 and "interrupted: stopped by SIGTERM after step 3" in stopped.stderr, stopped.stderr
    resumed = accelerate_launch(config, *train, str(cut), "--resume_from_checkpoint", "true", cwd=tmp_path, env=env)
    succeeded(resumed)

    uninterrupted, after_resume = tmp_path / "whole", tmp_path / "cut"
    assert json.loads((after_resume / "trainer_state.json").read_text())["global_step"] == 4
    assert training_losses(after_resume) == training_losses(uninterrupted)  # steps 1-3 before, 4 after the stop
    expected, got = load_file(uninterrupted / "model.safetensors"), load_file(after_resume / "model.safetensors")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)

    from transformers import AutoModel

    model = AutoModel.from_pretrained(after_resume, trust_remote_code=True)
    assert type(model).__name__ == "DFlash2DraftModel"
    assert all(torch.equal(tensor, got[name]) for name, tensor in model.state_dict().items())

    one = write_recipe(
        tmp_path, "one", bf16=False, target_sharding="none", torch_compile=False, per_device_train_batch_size=4
    )
    single = subprocess.run(
        [sys.executable, *train, str(one)], cwd=tmp_path, env=launch_environment(), capture_output=True, text=True
    )
    succeeded(single)
    reference, rehearsed = training_losses(tmp_path / "one"), training_losses(uninterrupted)
    assert sorted(reference) == sorted(rehearsed) == [1, 2, 3, 4]
    for step, loss in reference.items():
        assert rehearsed[step] == pytest.approx(loss, rel=BF16_LOSS_RTOL), (step, reference, rehearsed)


@pytest.mark.slow
def test_two_ranks_launched_without_use_cpu_on_a_machine_without_gpu_train_as_cpu_ranks(tmp_path):
    """The shipped config with only num_processes changed, a recipe without use_cpu: both ranks used
    to believe they were alone and fight over the output_dir lock."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: accelerate sets the ranks up on it")
    recipe = write_tiny_run(tmp_path, use_cpu=False, num_eval_samples=0, max_steps=2)
    config = shipped_config_on_cpu(tmp_path, num_processes=2)
    result = succeeded(
        accelerate_launch(config, "-m", "trainer", "train", str(recipe), cwd=tmp_path, env=launch_environment())
    )
    adopted = [line for line in result.stderr.splitlines() if "launched without use_cpu" in line]
    assert adopted == [
        "2 processes were launched without use_cpu and accelerate finds no GPU: they train as 2 CPU ranks (gloo), "
        "as use_cpu: true would; set use_cpu: true in the recipe to say so"
    ]
    fallback = [line for line in result.stderr.splitlines() if "does not run on CPU" in line]
    assert len(fallback) == 1 and fallback[0].endswith(
        "this run trains as DDP on 2 CPU ranks; " + cpu_fsdp.REHEARSE_HINT
    )
    checkpoint = tmp_path / "output" / "checkpoint-2"
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()  # 2 ranks


def rank_error_run(tmp_path: Path, mode: str) -> tuple[list[str], subprocess.CompletedProcess]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(REPO / "tests" / "support" / "distributed" / "rank_error_cli.py"), mode]
    result = subprocess.run(command, cwd=tmp_path, env=launch_environment(), capture_output=True, text=True, timeout=60)
    return [line for line in result.stderr.splitlines() if line.startswith("error:")], result


@pytest.mark.slow
def test_an_error_every_rank_meets_is_said_once_by_rank_0(tmp_path):
    said, result = rank_error_run(tmp_path, "all")
    assert result.returncode != 0
    assert said == ["error: learning_rate: -1 is below 0"]


@pytest.mark.slow
def test_an_error_of_rank_1_alone_reaches_the_user_in_its_own_line(tmp_path):
    said, result = rank_error_run(tmp_path, "rank1")
    assert result.returncode != 0
    assert said == ["error: rank 1: dataset: shard 7 is missing on this host"]


def test_adopting_cpu_ranks_leaves_a_single_process_and_a_launch_accelerate_set_up_alone(monkeypatch, caplog):
    from accelerate.utils import DistributedType

    from trainer.training.distributed import adopt_cpu_ranks

    for world, kind in (("1", DistributedType.NO), ("2", DistributedType.MULTI_CPU), ("2", DistributedType.MULTI_GPU)):
        monkeypatch.setenv("WORLD_SIZE", world)
        args = SimpleNamespace(distributed_state=SimpleNamespace(distributed_type=kind), use_cpu=False)
        with caplog.at_level(logging.WARNING):
            assert adopt_cpu_ranks(args) is False
        assert args.use_cpu is False
    assert caplog.text == "" and "ACCELERATE_USE_CPU" not in os.environ
