"""The benchmark code, smoke-run on the tiny config (the benchmarks themselves are `make bench`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import run, setups
from benchmarks.flops import step_flops
from benchmarks.loss_memory import MODES
from benchmarks.naive import naive_step
from benchmarks.op_count import count_step_ops
from benchmarks.train_step import optimized_step
from modeling_dflash2 import DFlash2Config
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import embed_draft_ids
from trainer.objective.masks import attention_masks


def test_flop_count_of_the_draft_layers_matches_torch_flop_counter():
    setup = setups.tiny_setup()
    batch = setups.synthetic_batch(setup)
    draft = setups.make_draft(setup)
    counted = step_flops(setup, batch)
    blocks = batch.blocks
    with FlopCounterMode(display=False) as counter:
        draft(
            position_ids=blocks.model_position_ids(),
            noise_embedding=embed_draft_ids(batch.embedding, blocks.draft_ids, 1.0),
            target_hidden=batch.target_hidden,
            attention_mask=attention_masks(blocks, draft.dflash),
        )
    totals = counter.get_flop_counts()["Global"]
    matmuls = sum(count for op, count in totals.items() if "attention" not in str(op))
    assert matmuls == counted.fc_forward + counted.linear_forward - _conv_application(setup, batch)
    assert counted.attention_forward > 0 and counted.model > 2 * counted.lm_head_forward


def _conv_application(setup, batch) -> int:
    """Elementwise tap products the count includes but FlopCounterMode (matmuls only) does not."""
    config = setup.config
    queries = batch.blocks.draft_ids.numel()
    return config.num_hidden_layers * 2 * 2 * config.conv_kernel_size * 2 * queries * config.hidden_size


def test_naive_reference_computes_the_same_loss():
    setup = setups.tiny_setup()
    batch = setups.synthetic_batch(setup)
    draft = setups.make_draft(setup)
    config = ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)
    loss = optimized_step(draft, batch, config)
    fast_grads = {name: p.grad.clone() for name, p in draft.named_parameters()}
    draft.zero_grad()
    assert abs(float(naive_step(draft, batch, config)) - float(loss)) < 1e-5
    for name, parameter in draft.named_parameters():
        torch.testing.assert_close(parameter.grad, fast_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_quick_run_writes_results(tmp_path, capsys):
    output = tmp_path / "quick.json"
    results = run.main(["--quick", "--device", "cpu", "--output", str(output)])
    saved = json.loads(output.read_text())
    step = saved["train_step"][0]
    assert step["losses_agree"] is True and 0 < step["mfu"] <= 1.5
    assert saved["matmul_peak_gflop_per_second"] > 0
    modes = {(m["anchors"], m["mode"]) for m in saved["loss_head_memory"]}
    assert modes == {(anchors, mode) for anchors in (8, 16) for mode in MODES}
    assert "| anchors |" in capsys.readouterr().out and results["train_step"][0]["setup"].startswith("tiny")
    counts = saved["op_counts"]
    for name in ("dflash2", "dflash_v1"):
        c = counts[name]
        assert c["draft_forward"] + c["objective"] + c["backward"] == c["total"] > 0
    assert counts["dflash2"]["objective"] > counts["dflash_v1"]["objective"]  # the selector's term and walk


def test_dflash2_step_at_the_demo_shape_launches_at_most_3000_aten_ops():
    """The lean-step budget (one op is at least one kernel launch on a GPU): forward, objective and
    backward of the SmolLM2 step, selector on, counted with torch.profiler on one thread."""
    counts = count_step_ops(setups.smollm2_setup())
    assert counts["total"] <= 3000, counts
    assert counts["backward"] > 0 and counts["objective"] > 0 and counts["draft_forward"] > 0


def test_flop_count_of_a_v1_draft_and_of_distillation():
    """v1: the same draft without the two convs per layer and the selector; distillation: one more
    LM-head forward (the teacher's logits), no gradient."""
    setup = setups.tiny_setup()
    batch = setups.synthetic_batch(setup)
    dflash2 = step_flops(setup, batch)
    config = setup.config.to_dict()
    config["architectures"] = ["DFlashDraftModel"]
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        config["dflash_config"].pop(name)
    v1 = step_flops(dataclasses.replace(setup, name="tiny v1", config=DFlash2Config(**config)), batch)
    assert v1.selector_forward == 0 and v1.lm_head_forward == dflash2.lm_head_forward
    assert dflash2.linear_forward - v1.linear_forward == _conv_flops(setup, batch)
    distilling = step_flops(setup, batch, distills=True)
    assert distilling.model - dflash2.model == dflash2.lm_head_forward > 0


def _conv_flops(setup, batch) -> int:
    """Two convs per layer: the kernel projection (H -> 2 sides x k x G) and the k-tap application."""
    config = setup.config
    queries, hidden, kernel = batch.blocks.draft_ids.numel(), config.hidden_size, config.conv_kernel_size
    groups = hidden // config.conv_group_size
    per_conv = 2 * queries * hidden * 2 * kernel * groups + 2 * kernel * 2 * queries * hidden
    return config.num_hidden_layers * 2 * per_conv


def test_regeneration_benchmark_times_each_way_and_checks_the_tokens():
    from benchmarks.regeneration import bench_regeneration, table
    from tests.support.tiny_target import tiny_target

    result = bench_regeneration(tiny_target(), ["hello", "how are you", "tell me about music"], 5, concurrency=2)
    assert set(result["runs"]) == {"in process, batch 16", "in process, batch 1", "endpoint, 2 in flight"}
    assert result["endpoint_equals_in_process_batch_1"] is True
    for figures in result["runs"].values():
        assert 0 < figures["answer_tokens"] <= 3 * 5 and figures["tokens_per_second"] > 0
    batch_1, endpoint = result["runs"]["in process, batch 1"], result["runs"]["endpoint, 2 in flight"]
    assert result["endpoint_over_batch_1"] == pytest.approx(
        endpoint["tokens_per_second"] / batch_1["tokens_per_second"]
    )
    assert "| endpoint, 2 in flight |" in table(result)


@pytest.mark.parametrize("module", ["loss_memory", "op_count", "compile_step"])
def test_benchmark_commands_print_usage_for_help(module, capsys):
    """`python -m benchmarks.<module> --help` prints the usage and exits 0 (it crashed or was ignored)."""
    import importlib

    from trainer.commands.runner import run as run_command

    with pytest.raises(SystemExit) as stop:
        run_command(importlib.import_module(f"benchmarks.{module}").main, ["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks.{module}")


def test_loss_memory_command_measures_one_point_and_refuses_bad_arguments(capsys):
    from benchmarks import loss_memory
    from trainer.commands.runner import run as run_command

    [result] = loss_memory.main(["tiny", "8", "chunked"])
    assert json.loads(capsys.readouterr().out) == result
    assert result["anchors"] == 8 and result["mode"] == "chunked" and result["peak_bytes"] > 0
    # more points, each in its own forked child: one line each, in order
    results = loss_memory.main(["tiny", "16", "chunked", "--then", "16:unchunked"])
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == results
    assert [(point["anchors"], point["mode"]) for point in results] == [(16, "chunked"), (16, "unchunked")]
    assert all(point["peak_bytes"] > 0 for point in results)
    for argv, message in (
        (["tiny", "0", "chunked"], "error: anchors must be at least 1"),
        (["tiny", "8", "chunked", "--then", "8:fast"], "error: --then: '8:fast' is not ANCHORS:MODE with MODE one of"),
    ):
        with pytest.raises(SystemExit) as stop:
            run_command(loss_memory.main, argv)
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().startswith(message)


def test_op_count_command_takes_its_setup(capsys):
    from benchmarks import op_count

    counts = op_count.main(["--setup", "tiny"])
    assert json.loads(capsys.readouterr().out) == counts
    assert counts == op_count.op_counts(setups.tiny_setup())


def test_packing_flop_count_worked_by_hand_and_against_the_capture_count():
    from benchmarks.capture import TargetShape, layer_flops_per_token
    from benchmarks.packing import batch_target_flops, orders

    tiny = TargetShape(hidden=4, intermediate=8, layers=3, heads=2, kv_heads=1, head_dim=2, vocab=10)
    # per position: q 32, k and v 32, o 32, SwiGLU 192 = 288; per causal pair 2*2*heads*head_dim = 16.
    # padded rows of 3 and 1 tokens, width 3: 6 positions, 2 * (1+2+3) pairs -> 6*288 + 12*16 = 1920 a layer.
    assert batch_target_flops([[3], [1]], tiny, 2, packed=False) == 2 * 1920
    # packed rows [2, 1] and [1] (+ a 2-token padding tail): pairs 3+1 and 1+3 -> 6*288 + 8*16 = 1856.
    assert batch_target_flops([[2, 1], [1]], tiny, 2, packed=True) == 2 * 1856
    # one unpadded row is benchmarks.capture's per-token count times its tokens
    assert batch_target_flops([[7]], tiny, 3, packed=False) == 7 * 3 * layer_flops_per_token(tiny, 7)
    lengths = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 2]
    for name, batches in orders(lengths, 4, 10, seed=3).items():
        assert sorted(i for batch in batches for row in batch for i in row) == list(range(len(lengths))), name
        assert all(len(batch) <= 4 for batch in batches) and all(
            sum(lengths[i] for i in row) <= 10 for b in batches for row in b
        )


def test_packing_cut_conversations_tokenize_as_the_whole_one_truncated():
    """The benchmark templates a long conversation only up to max_length; the tokens and loss mask are
    those of the whole conversation, truncated."""
    from benchmarks.packing import TARGET, as_chat, chitchat_conversations, tokenize_truncated
    from trainer.data.chat import tokenize_chat
    from trainer.models.target import FrozenTarget

    tokenizer = FrozenTarget.load(TARGET).tokenizer
    long = [c for c in chitchat_conversations() if 40 <= len(c) <= 60][:3]
    for conversation in long:
        whole = tokenize_chat(tokenizer, as_chat(conversation))
        assert len(whole["input_ids"]) > 300
        for max_length in (64, 300):
            cut = tokenize_truncated(tokenizer, conversation, max_length)
            assert cut == {key: values[:max_length] for key, values in whole.items()}


def test_packing_quick_run_pads_less_and_computes_less_with_the_same_losses(capsys):
    """`python -m benchmarks.packing --quick --json`: real chitchat lengths; packing pads at most 5%."""
    from benchmarks import packing

    result = packing.main(["--quick", "--json"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    padding, gflop = result["padding_fraction"], result["target_gflop_per_supervised_token"]
    for key in ("padding_fraction", "target_gflop_per_supervised_token", "supervised_tokens_per_second"):
        assert set(result[key]) == {"padded", "grouped", "packed"} and all(v > 0 for v in result[key].values())
    assert padding["packed"] <= 0.05 and padding["packed"] < padding["grouped"] < padding["padded"]
    assert gflop["packed"] < gflop["padded"] and gflop["grouped"] < gflop["padded"]
    assert result["packed_vs_separate_max_abs_loss_diff"] < 1e-4
    assert len(set(result["packed_vs_separate"]["document_lengths"])) == 3
    lengths = result["lengths"]
    assert lengths["count"] > 50 and lengths["median"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"]
    assert "chitchat" in lengths["source"] and "SmolLM2" in lengths["source"]
    assert "| packed |" in packing.table(result)
    for name in ("padded", "grouped", "packed"):  # dense masks score at least every visible pair
        pairs = result["training"][name]["draft_attention_pairs_per_supervised_token"]
        assert pairs["dense"] >= pairs["visible"] > 0 and result["training"][name]["blocks_per_supervised_token"] > 0
