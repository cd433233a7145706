"""bf16 on CPU: a recipe's `bf16: true` runs under accelerate's CPU autocast (it used to be switched to
float32 here). One training step matches float32 within a stated tolerance on everything the step
runs (the fused LM head + cross-entropy, the selector, the convs, distillation), and a bf16 tiny run
trains, checkpoints, resumes to exactly the uninterrupted run and exports a draft AutoModel loads."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import TrainerCallback

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_target
from trainer.commands import train
from trainer.data.dataset import DFlashCollator
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.trainer import DFlash2Trainer

# One step from the same weights and batch, bf16 autocast vs float32. Measured (torch 2.13, this CPU):
# loss 1.4e-6 relative (the head's logits and the losses are float32 either way), gradient cosine
# >= 0.99990 and norm within 6.8e-3 relative for every tensor (worst: the attention conv's kernel).
# Stated tolerances, with headroom for other CPUs' bf16 kernels (bf16 rounds at 2^-9 = 2e-3):
LOSS_RTOL = 1e-3
GRADIENT_COSINE = 0.999
GRADIENT_NORM_RTOL = 0.02


class GradientSnapshot(TrainerCallback):
    """The step's gradients as the optimizer will see them (no clipping: max_grad_norm 0)."""

    def __init__(self) -> None:
        self.gradients: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def one_step(tmp_path: Path, bf16: bool) -> tuple[DFlash2Trainer, dict[str, torch.Tensor], float]:
    target = tiny_target()
    config = tiny_draft_config_for(target)
    assert config.conv_kernel_size > 1 and config.selector_top_k > 1  # convs and selector run
    torch.manual_seed(0)
    draft = randomize(DFlash2DraftModel(config), seed=1, scale=0.1)
    args = DFlashTrainingArguments(
        output_dir=str(tmp_path / ("bf16" if bf16 else "fp32")),
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_grad_norm=0.0,
        num_anchors=8,
        kd_weight=0.5,
        selector_alpha=1.0,
        selector_warmup_ratio=0.0,
        selector_ramp_ratio=0.0,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    snapshot = GradientSnapshot()
    trainer = DFlash2Trainer(
        model=draft,
        args=args,
        target=target,
        train_dataset=tiny_chat_dataset(target, 8),
        data_collator=DFlashCollator(target.tokenizer.pad_token_id),
        callbacks=[snapshot],
    )
    trainer.train()
    loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    return trainer, snapshot.gradients, loss


def test_a_bf16_training_step_on_cpu_matches_float32_within_tolerance(tmp_path):
    fp32, fp32_gradients, fp32_loss = one_step(tmp_path, bf16=False)
    bf16, bf16_gradients, bf16_loss = one_step(tmp_path, bf16=True)
    assert (fp32.accelerator.native_amp, bf16.accelerator.native_amp) == (False, True)
    assert bf16.args.bf16 and bf16.accelerator.mixed_precision == "bf16"  # not switched off on CPU
    assert bf16_loss != fp32_loss  # bf16 really ran
    assert bf16_loss == pytest.approx(fp32_loss, rel=LOSS_RTOL)
    names = set(fp32_gradients)
    assert names == set(bf16_gradients)
    assert any("conv" in name for name in names) and any("candidate_selector" in name for name in names)
    for name in names:
        a, b = fp32_gradients[name].flatten(), bf16_gradients[name].flatten()
        if a.norm() == 0:
            continue
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= GRADIENT_COSINE, name
        assert b.norm().item() == pytest.approx(a.norm().item(), rel=GRADIENT_NORM_RTOL), name
    metrics = {key for log in bf16.state.log_history for key in log}
    assert {"loss_selector", "kd_divergence", "tau_walk"} <= metrics


# -- a bf16 tiny run: train, checkpoint, resume exactly, export ------------------------------------------


def outcome(output: Path) -> tuple[dict[str, torch.Tensor], list[tuple[int, float]]]:
    weights = load_file(output / "model.safetensors")
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    return weights, [(log["step"], log["loss"]) for log in history if "loss" in log]


def test_a_bf16_tiny_run_trains_checkpoints_resumes_exactly_and_exports(tmp_path, caplog):
    from transformers import AutoModel

    from trainer.commands import export as export_command

    recipe = write_tiny_run(tmp_path, bf16=True, num_eval_samples=0, kd_weight=0.5)
    train.main([str(recipe)])
    output = tmp_path / "output"
    recorded = json.loads((output / "dflash2_recipe.json").read_text())["training_arguments"]
    assert recorded["bf16"] is True  # what ran (a CPU run used to record false here)
    weights, losses = outcome(output)
    assert [step for step, _ in losses] == [1, 2, 3, 4]

    # interrupted after checkpoint-2: a copy of the run without what came after it, resumed
    resumed_output = tmp_path / "resumed"
    shutil.copytree(output / "checkpoint-2", resumed_output / "checkpoint-2")
    values = yaml.safe_load(recipe.read_text())
    values["output_dir"] = str(resumed_output)
    resumed_recipe = tmp_path / "resumed.yaml"
    resumed_recipe.write_text(yaml.safe_dump(values))
    with caplog.at_level(logging.INFO, logger="trainer.training.checkpointing"):
        train.main([str(resumed_recipe), "--resume_from_checkpoint", "true"])
    assert f"Resuming from {resumed_output / 'checkpoint-2'}" in caplog.messages
    resumed_weights, resumed_losses = outcome(resumed_output)
    assert resumed_losses == losses  # steps 1-2 from the checkpoint's state, steps 3-4 retrained: bit-equal
    assert resumed_weights.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(resumed_weights[name], tensor), name

    exported = tmp_path / "export"
    export_command.main([str(output), str(exported), "--target", str(tmp_path / "target")])
    model = AutoModel.from_pretrained(exported, trust_remote_code=True)
    assert type(model).__name__ == "DFlash2DraftModel"
    saved = load_file(exported / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
