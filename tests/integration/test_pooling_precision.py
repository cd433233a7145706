"""Exact pooling in every precision: the objective's sums are float32 whatever the draft runs in (fp32,
CPU bf16 autocast, bf16 weights, accelerate's bf16 FSDP2 policy), a narrower sum is refused at once,
sums kept over a logging interval are float64, and a bf16 FSDP2 run on 2 gloo ranks logs exactly the
pooled float32 sums its objective formed."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.e2e.test_distributed import REPO, torchrun
from tests.support.drafts import objective_batch, tiny_draft
from trainer.objective.blocks import AnchorDraw
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import ObjectiveResult, draft_objective
from trainer.objective.metrics import add_terms, check_pooled, flatten_terms, pooled_sums, ratios
from trainer.training.precision import leave_draft_outputs_uncast

CONFIGS = {
    "ce+selector+kd": ObjectiveConfig(num_anchors=4, selector_alpha=0.5, kd_weight=0.5),
    "dpace+insert": ObjectiveConfig(num_anchors=4, loss_type="dpace", selector_alpha=1.0, selector_gold="insert"),
}


def _objective(model, config: ObjectiveConfig, dtype: torch.dtype = torch.float32, forward_module=None):
    input_ids, loss_mask, target_hidden, embedding, head, final = objective_batch(3, final_hidden=True)
    return draft_objective(
        model,
        input_ids,
        loss_mask,
        target_hidden.to(dtype),
        embedding,
        head,
        config,
        AnchorDraw(0, 0),
        forward_module=forward_module,
        target_final_hidden=final if config.distills else None,
    )


def _all_sums(result: ObjectiveResult) -> dict[str, torch.Tensor]:
    return {"numerator": result.numerator, "denominator": result.denominator, **pooled_sums(result.terms)}


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("precision", ["float32", "cpu autocast bf16", "bf16 weights"])
def test_every_pooled_sum_of_the_objective_is_float32(precision, config_name):
    config = CONFIGS[config_name]
    model = tiny_draft()
    if precision == "bf16 weights":
        result = _objective(model.to(torch.bfloat16), config, torch.bfloat16)
    elif precision == "cpu autocast bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = _objective(model, config)
    else:
        result = _objective(model, config)
    sums = _all_sums(result)
    assert len(sums) >= 2 + 2 * 10  # numerator, denominator and every metric pair
    assert {name: value.dtype for name, value in sums.items() if value.dtype != torch.float32} == {}


def test_a_sum_narrower_than_float32_is_refused_at_once_naming_it():
    good = {"accuracy": (torch.tensor(3.0), torch.tensor(4.0))}
    add_terms({}, good)
    bad = {"accuracy": (torch.tensor(3.0), torch.tensor(4.0, dtype=torch.bfloat16))}
    for refuse in (lambda: add_terms({}, bad), lambda: flatten_terms(bad), lambda: check_pooled(pooled_sums(bad))):
        with pytest.raises(ValueError, match=r"^pooled sum 'accuracy denominator' of the objective is torch.bfloat16"):
            refuse()


def test_float64_sums_keep_counts_past_2_24_that_float32_would_round():
    """What a logging interval or a whole evaluation accumulates: 2^24 + 1 is not a float32."""
    wide = torch.tensor(2.0**24, dtype=torch.float64)
    one = torch.tensor(1.0)  # a micro-batch's float32 pair, added into the float64 sums
    total = add_terms(add_terms({}, {"accuracy": (wide, wide)}), {"accuracy": (one, one)})
    names, pairs = flatten_terms(total)
    assert pairs.dtype == torch.float64 and pairs[:, 0].tolist() == [2.0**24 + 1, 2.0**24 + 1]
    assert ratios(names, pairs) == {"accuracy": 1.0}
    assert (wide.float() + one).item() == 2.0**24  # why float64: in float32 the slot is lost


def test_the_trainer_keeps_metric_sums_in_float64_between_logs(tmp_path):
    """A logging interval or an evaluation can count past 2^24 supervised slots: float64 from the first
    micro-batch, all-reduced as float64 in `log()`."""
    from modeling_dflash2 import DFlash2DraftModel
    from tests.support.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_target
    from trainer.data.dataset import DFlashCollator
    from trainer.training.arguments import DFlashTrainingArguments
    from trainer.training.trainer import DFlash2Trainer

    target = tiny_target()
    args = DFlashTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, num_anchors=4)
    trainer = DFlash2Trainer(model=DFlash2DraftModel(tiny_draft_config_for(target)), args=args, target=target)
    rows = tiny_chat_dataset(target, 2)
    batch = DFlashCollator(target.tokenizer.pad_token_id)([rows[0], rows[1]])
    trainer.model.eval()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, batch)
        trainer.compute_loss(trainer.model, batch)
    sums = pooled_sums(trainer.metrics.sums["eval"])
    assert sums and {value.dtype for value in sums.values()} == {torch.float64}
    names, pairs = flatten_terms(trainer.metrics.sums["eval"])
    assert pairs.dtype == torch.float64
    logged = {}
    trainer.callback_handler.on_log = lambda args, state, control, logs: logged.update(logs) or control
    trainer.log({"eval_loss": 0.0})
    assert logged["eval_loss"] == ratios(names, pairs)["loss"] and trainer.metrics.sums["eval"] == {}


@pytest.fixture
def one_rank_group(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _accelerate_bf16_fsdp2_policy():
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what accelerate's state does for `mixed_precision: bf16`
    return plugin


def _sharded(model, policy):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def test_accelerates_bf16_fsdp2_policy_casts_the_objective_and_is_refused_at_once(one_rank_group):
    """The mechanism: accelerate's FSDP2 policy has output_dtype bf16, applied to the draft's root
    forward, which returns the objective; the guard stops it at the first step."""
    plugin = _accelerate_bf16_fsdp2_policy()
    assert plugin.mixed_precision_policy.output_dtype == torch.bfloat16
    model = tiny_draft()
    with pytest.raises(ValueError, match=r"^pooled sum 'numerator' of the objective is torch.bfloat16"):
        _objective(model, CONFIGS["ce+selector+kd"], forward_module=_sharded(model, plugin.mixed_precision_policy))


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_with_the_output_cast_dropped_fsdp2_bf16_equals_the_bf16_draft_bit_for_bit(one_rank_group, config_name):
    """`leave_draft_outputs_uncast` keeps bf16 parameters and reductions, drops only the output cast: the
    FSDP2 objective then equals the same draft's in bf16 without FSDP, every sum float32."""
    plugin = _accelerate_bf16_fsdp2_policy()
    leave_draft_outputs_uncast(plugin)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.bfloat16, None)
    config = CONFIGS[config_name]
    model = tiny_draft()
    plain = _objective(copy.deepcopy(model).to(torch.bfloat16), config, torch.bfloat16)
    sharded = _objective(model, config, forward_module=_sharded(model, policy))
    for name, value in _all_sums(sharded).items():
        assert value.dtype == torch.float32, name
        assert torch.equal(value, _all_sums(plain)[name]), name


def test_leave_draft_outputs_uncast_leaves_other_plugins_alone():
    from accelerate.utils import FullyShardedDataParallelPlugin

    leave_draft_outputs_uncast(None)
    no_policy = FullyShardedDataParallelPlugin(fsdp_version=2)
    leave_draft_outputs_uncast(no_policy)
    assert no_policy.mixed_precision_policy is None


# -- bf16 FSDP2 on 2 gloo ranks: what is logged is the pooled float32 sums the objective formed ----------


def _pooled_by_log(root: Path) -> tuple[list[dict], dict[int, dict[str, list[float]]], list[dict]]:
    """(log_history, {log index: {name: [numerator, denominator] summed over micro-batches and ranks in
    float64}}, every capture)."""
    history = json.loads((root / "output" / "trainer_state.json").read_text())["log_history"]
    captures = [c for rank in (0, 1) for c in json.loads((root / f"captures_{rank}.json").read_text())]
    pooled: dict[int, dict[str, list[float]]] = defaultdict(dict)
    for capture in captures:
        index = next(
            i
            for i, log in enumerate(history)
            if i >= capture["log_index"] and ("loss" if capture["mode"] == "train" else "eval_loss") in log
        )
        for name, (numerators, denominators) in capture["terms"].items():
            for slot, pair in enumerate(zip(numerators, denominators, strict=True)):
                key = name if len(numerators) == 1 else f"{name}_{slot + 1}"
                total = pooled[index].setdefault(key, [0.0, 0.0])
                total[0] += pair[0]
                total[1] += pair[1]
    return history, pooled, captures


def test_bf16_fsdp2_on_two_ranks_logs_exactly_the_pooled_float32_sums(tmp_path):
    torchrun(str(REPO / "tests" / "support" / "distributed" / "pooling_bf16_cpu.py"), str(tmp_path), cwd=tmp_path)
    history, pooled, captures = _pooled_by_log(tmp_path)
    assert {c["sharded"] for c in captures} == {True}  # FSDP2, not DDP
    assert {c["hidden_dtype"] for c in captures} == {"torch.bfloat16"}  # the draft really ran in bf16
    assert {d for c in captures for d in c["dtypes"]} == {"torch.float32"}
    for capture in captures:  # what left the FSDP2-wrapped forward is what the objective formed
        returned = capture["returned"]
        assert returned["numerator"] == ["torch.float32", capture["numerator"]]
        assert returned["denominator"] == ["torch.float32", capture["denominator"]]
    train = [c for c in captures if c["mode"] == "train"]
    assert len(train) == 2 * 2 * 2  # 2 steps x 2 micro-batches x 2 ranks
    for step_start in {c["log_index"] for c in train}:  # the loss's global denominator: every micro-batch, rank
        step = [c for c in train if c["log_index"] == step_start]
        assert len({c["step_denominator"] for c in step}) == 1  # every rank divides by the same one
        assert step[0]["step_denominator"] == pytest.approx(sum(c["denominator"] for c in step), rel=1e-7)
    logged = 0
    for index, sums in pooled.items():
        prefix = "eval_" if "eval_loss" in history[index] else ""
        expected = {f"{prefix}{name}": n / d for name, (n, d) in sums.items() if d > 0}
        got = {key: value for key, value in history[index].items() if key in expected}
        assert got == expected, index  # exact: float32 sums pooled in float64, nothing rounded on the way
        assert {"loss", "loss_base", "loss_selector", "kd_divergence", "tau_walk", "coverage"} <= {
            key.removeprefix(prefix) for key in got
        }
        logged += 1
    assert logged == 5  # eval at step 0, steps 1 and 2, eval at step 2, the final evaluation
