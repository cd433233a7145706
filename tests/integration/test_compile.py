"""`torch_compile: true`: the draft's decoder layers compiled in place (inductor on CPU): the same
losses as eager, unchanged parameter names, and one recompilation for varying packed lengths."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from modeling_dflash2 import DFlash2DecoderLayer, DFlash2DraftModel
from tests.integration.test_trainer import dataset, make_trainer, target  # noqa: F401  (fixtures)
from trainer.data.packing import PackedDataset
from trainer.models.compile import compile_decoder_layers


def test_compiled_training_logs_the_eager_losses_and_keeps_parameter_names(target, dataset, tmp_path):  # noqa: F811
    """Compiled layers must actually run: the counters see their graphs."""
    torch._dynamo.reset()
    counters.clear()
    eager = make_trainer(target, dataset, tmp_path / "eager", max_steps=3)
    eager.train()
    compiled = make_trainer(target, dataset, tmp_path / "compiled", max_steps=3, torch_compile=True)
    layers = [module for module in compiled.model.modules() if isinstance(module, DFlash2DecoderLayer)]
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    compiled.train()
    eager_losses = [log["loss"] for log in eager.state.log_history if "loss" in log]
    compiled_losses = [log["loss"] for log in compiled.state.log_history if "loss" in log]
    assert len(compiled_losses) == 3
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    assert set(compiled.model.state_dict()) == set(eager.model.state_dict())  # no `_orig_mod.` prefixes
    # the tiny chat rows have different packed lengths: at most one recompilation (to a dynamic
    # length) per distinct graph, however many steps follow
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_compile_needs_decoder_layers():
    with pytest.raises(ValueError, match="no DFlash decoder layer"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


def test_compile_reaches_layers_inside_a_wrapper():
    from tests.support.drafts import tiny_config

    wrapper = torch.nn.Sequential(DFlash2DraftModel(tiny_config()))
    assert compile_decoder_layers(wrapper) == tiny_config().num_hidden_layers


def test_compiled_packed_training_logs_the_eager_losses_without_recompiling_per_batch(target, dataset, tmp_path):  # noqa: F811
    """Packed rows vary in block slots as well as in length: still at most one recompilation, to dynamic shapes."""
    rows = PackedDataset.pack(dataset, 48, seed=0)
    torch._dynamo.reset()
    counters.clear()
    eager = make_trainer(target, rows, tmp_path / "eager", max_steps=4)
    eager.train()
    compiled = make_trainer(target, rows, tmp_path / "compiled", max_steps=4, torch_compile=True)
    compiled.train()
    eager_losses = [log["loss"] for log in eager.state.log_history if "loss" in log]
    compiled_losses = [log["loss"] for log in compiled.state.log_history if "loss" in log]
    assert len(compiled_losses) == 4 and compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
