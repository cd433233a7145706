"""Teacher-forced acceptance at the anchors real decoding visits equals the real acceptance."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_dflash2 import DFlash2DraftModel
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_draft_config_for, tiny_tokenizer
from trainer.evaluation.tau_gap import (
    decode_and_force,
    decoding_anchors,
    render_table,
    served_lengths,
    tau_gap_report,
    teacher_forced_acceptance,
)
from trainer.models.target import FrozenTarget
from trainer.objective.blocks import sample_anchors
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import draft_objective

STOP = 2  # the tiny tokenizer's <|im_end|>
# greedy answers of the tiny target below mix repeats (easy) and changes (hard); the last one
# ends in the stop token
PROMPTS = [[1, 9, 14, 22, 7], [1, 5, 6, 7, 8], [1, 40, 12]]
MAX_NEW_TOKENS = 18


def untied_target() -> FrozenTarget:
    """A tiny target whose greedy answers are neither constant nor random (an untied head, so it
    does not just repeat its input)."""
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=STOP,
        bos_token_id=None,
    )
    torch.manual_seed(1)
    return FrozenTarget(randomize(LlamaForCausalLM(config), seed=1, scale=0.3).float(), tokenizer)


def train_briefly(draft: DFlash2DraftModel, target: FrozenTarget, steps: int = 25) -> DFlash2DraftModel:
    """A few steps of the training objective on the target's own answers: a draft that accepts
    some blocks in full and rejects others early, so acceptance lengths vary."""
    answers = [
        target.model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0] for p in PROMPTS
    ]
    width = max(answer.numel() for answer in answers)
    input_ids = torch.zeros(len(answers), width, dtype=torch.long)
    loss_mask = torch.zeros_like(input_ids)
    for row, (answer, prompt) in enumerate(zip(answers, PROMPTS, strict=True)):
        input_ids[row, : answer.numel()] = answer
        loss_mask[row, len(prompt) : answer.numel()] = 1
    features = target.capture(input_ids, None, draft.target_layer_ids)
    anchors = sample_anchors(loss_mask, width, draw=None)
    optimizer = torch.optim.Adam(draft.parameters(), lr=2e-2)
    config = ObjectiveConfig()
    for _ in range(steps):
        result = draft_objective(
            draft,
            input_ids,
            loss_mask,
            features,
            target.embedding_weight,
            target.lm_head,
            config,
            draw=None,
            anchors=anchors,
        )
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
    return draft.eval()


@pytest.fixture(scope="module")
def pair() -> tuple[FrozenTarget, DFlash2DraftModel]:
    target = untied_target()
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=2, scale=0.2)
    return target, train_briefly(draft, target)


def test_decoding_anchors_by_hand():
    # prompt of 5 tokens: the first anchor is the first generated token (position 5); steps that
    # produce 3, 1 and 4 tokens move it to 8, then 9; the last step's length moves it past the end
    assert decoding_anchors(5, [3, 1, 4]) == [5, 8, 9]
    assert decoding_anchors(2, [1]) == [2]
    assert decoding_anchors(7, []) == []


def test_served_lengths_cut_at_the_end_of_the_sequence():
    # a sequence of 12 tokens: from anchor 9 only positions 10 and 11 remain, so a teacher-forced
    # 4 (3 accepted + bonus) is reported as 2; earlier anchors keep their length
    assert served_lengths([4, 1, 4], [3, 7, 9], 12) == [4, 1, 2]


@pytest.mark.parametrize("path", ["selector", "unary"])
def test_teacher_forced_acceptance_at_real_anchors_is_the_real_acceptance(pair, path):
    target, draft = pair
    real, shifted_differs, whole_steps = [], False, 0
    for prompt in PROMPTS:
        record = decode_and_force(target, draft, prompt, MAX_NEW_TOKENS, [STOP], path)
        anchors = record["anchors"]
        # a whole block (not the last step, not shortened by max_new_tokens) has exactly its length
        whole = record["whole_step"]
        whole_steps += sum(whole)
        assert [n for n, w in zip(record["teacher_forced"], whole, strict=True) if w] == [
            n for n, w in zip(record["real"], whole, strict=True) if w
        ]
        # the last step may be cut by max_new_tokens or the stop token, exactly as decoding cuts it
        assert record["served"] == record["real"]
        assert record["per_anchor_sums_equal_objective"]
        real += record["real"]
        # teeth: one position later than decoding's anchors, the lengths are not the real ones
        moved = [anchor + 1 for anchor in anchors[:-1]]
        off = teacher_forced_acceptance(draft, target, torch.tensor(record["sequence"]), len(prompt), moved)
        shifted_differs |= off.lengths("walk" if path == "selector" else "unary") != record["real"][:-1]
    assert shifted_differs
    assert whole_steps >= len(real) / 2  # the exact comparison covers most steps
    assert 1 in real or 2 in real  # some blocks are rejected early ...
    assert draft.block_size in real  # ... and some accepted in full: the lengths vary
    assert record["sequence"][-1] == STOP  # the last prompt's answer was cut by the stop token


def test_every_anchor_covers_each_valid_position_once(pair):
    target, draft = pair
    sequence = target.model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    forced = teacher_forced_acceptance(draft, target, sequence[0], len(PROMPTS[0]), None)
    # generated positions 5..14: anchors need a supervised successor, so 5..13
    assert forced.anchors == list(range(5, 14))
    assert forced.pooled["tau_walk"] == (float(sum(forced.walk)), 9.0)
    assert forced.pooled["tau_unary"] == (float(sum(forced.unary)), 9.0)


def test_report_pools_the_paths_and_renders_a_table(pair):
    target, draft = pair
    summary = {"trained": {"eval_tau_walk": 3.5, "eval_tau_unary": 3.25}}
    report = tau_gap_report(target, draft, PROMPTS, MAX_NEW_TOKENS, [STOP], training_summary=summary)
    assert report["paths_decoded_the_same_sequences"]
    assert report["training_eval"] == {"walk": 3.5, "unary": 3.25}
    for entry in report["paths"].values():
        assert entry["same_acceptance_fraction"] == 1.0 == entry["same_acceptance_fraction_whole_steps"]
        assert entry["teacher_forced_tau_at_real_anchors_cut_like_decoding"] == pytest.approx(entry["real_tau"])
        real = [n for record in entry["per_prompt"] for n in record["real"]]
        assert entry["real_tau"] == pytest.approx(sum(real) / len(real)) and entry["steps"] == len(real)
        every = sum(len(record["every_anchor"]) for record in entry["per_prompt"])
        assert entry["all_anchor_count"] == every
    table = render_table(report).splitlines()
    assert len(table) == 4 and table[2].startswith("| selector (walk) |") and table[3].endswith("| 3.250 |")


def test_cli_writes_the_report_into_the_training_run(pair, tmp_path, capsys, monkeypatch):
    from trainer.commands import tau_gap

    target, draft = pair
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    (tmp_path / "draft" / "dflash2_recipe.json").write_text(json.dumps({"format": "dflash2-hub recipe"}))  # a run
    final_evaluation = {"step": 4, "eval_loss": 1.0, "eval_tau_walk": 2.5}  # the run's record of its last evaluation
    state = {"global_step": 4, "log_history": [final_evaluation]}
    (tmp_path / "draft" / "trainer_state.json").write_text(json.dumps(state))
    report = tau_gap.main(
        [
            *("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")),
            *("--max-samples", "2", "--max-new-tokens", "6", "--paths", "selector"),
        ]
    )
    written = json.loads((tmp_path / "draft" / "speculative" / "tau_gap.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert set(written["paths"]) == {"selector"} and written["prompts"] == 2
    assert written["training_eval"] == {"walk": 2.5}
    assert "| selector (walk) |" in capsys.readouterr().out
    # an exported or downloaded draft is never written into: its report goes under outputs/evaluate
    for run_file in ("dflash2_recipe.json", "trainer_state.json"):  # an export holds neither
        (tmp_path / "draft" / run_file).unlink()
    monkeypatch.chdir(tmp_path)
    before = sorted(path.name for path in (tmp_path / "draft").rglob("*"))
    exported = tau_gap.main(
        [
            *("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")),
            *("--max-samples", "1", "--max-new-tokens", "4", "--paths", "selector"),
        ]
    )
    assert sorted(path.name for path in (tmp_path / "draft").rglob("*")) == before
    assert "training_eval" not in exported  # no training record: no training evaluation shown
    assert (tmp_path / "outputs" / "evaluate" / "draft" / "tau_gap.json").is_file()
