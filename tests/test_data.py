"""trainer.data: chat templating and loss masks, regenerated responses, offline features, collation."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from tests.tiny_target import tiny_conversations, tiny_target
from trainer import data as data_module
from trainer.arguments import DataArguments
from trainer.data import (
    DFlashCollator,
    GenerationSettings,
    OfflineDataset,
    build_datasets,
    prepare_features,
    prompt_conversation,
    regenerate,
    tokenize_chat,
    truncate_and_filter,
)

TWO_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello how are you"},
    {"role": "user", "content": "fine"},
    {"role": "assistant", "content": "good"},
]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens(ids)


def test_loss_mask_covers_exactly_the_assistant_turns(target):
    tokenizer = target.tokenizer
    sample = tokenize_chat(tokenizer, TWO_TURNS)
    tokens = _tokens(tokenizer, sample["input_ids"])
    supervised = [t for t, m in zip(tokens, sample["loss_mask"], strict=True) if m]
    assert supervised == ["hello", "how", "are", "you", "<|im_end|>", "good", "<|im_end|>"]
    assert tokens[:3] == ["<|im_start|>", "user", "hi"]


def test_generation_markers_are_used_when_the_template_has_them(target):
    tokenizer = tiny_target().tokenizer
    tokenizer.chat_template = (
        "{% for message in messages %}{{ '<|im_start|> ' + message['role'] + ' ' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + ' <|im_end|>' }}"
        "{% endgeneration %}{{ ' ' }}{% else %}{{ message['content'] + ' <|im_end|> ' }}{% endif %}{% endfor %}"
    )
    sample = tokenize_chat(tokenizer, TWO_TURNS)
    incremental = tokenize_chat(target.tokenizer, TWO_TURNS)
    assert sample == incremental


def test_thinking_switch(target):
    with pytest.raises(ValueError, match="no thinking switch"):
        tokenize_chat(target.tokenizer, TWO_TURNS, enable_thinking=False)
    tokenizer = tiny_target().tokenizer
    tokenizer.chat_template = "{% if enable_thinking %}{{ 'why ' }}{% endif %}" + tokenizer.chat_template
    on = tokenize_chat(tokenizer, TWO_TURNS[:2], enable_thinking=True)
    off = tokenize_chat(tokenizer, TWO_TURNS[:2], enable_thinking=False)
    assert _tokens(tokenizer, on["input_ids"])[0] == "why" and len(on["input_ids"]) == len(off["input_ids"]) + 1


def test_template_that_rewrites_history_is_refused():
    tokenizer = tiny_target().tokenizer
    tokenizer.chat_template = (
        "{% for message in messages %}{% if loop.last %}{{ 'yes ' }}{% endif %}"
        "{{ '<|im_start|> ' + message['role'] + ' ' + message['content'] + ' <|im_end|> ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}"
    )
    with pytest.raises(ValueError, match="incremental templating"):
        tokenize_chat(tokenizer, TWO_TURNS)


def test_truncate_and_filter_drops_samples_without_anchor(caplog):
    dataset = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8, 9]], "loss_mask": [[0, 0, 1, 1], [0, 1, 0, 1], [1] * 5]}
    )
    result = truncate_and_filter(dataset, max_length=3)
    assert result["input_ids"] == [[5, 6, 7]]
    assert "Dropped 2 of 3 samples" in caplog.text
    with pytest.raises(ValueError, match="No sample has a valid anchor"):
        truncate_and_filter(dataset.select([1]), max_length=4)


def test_regenerated_responses_are_the_targets_own_greedy_tokens(target, tmp_path, monkeypatch):
    prompts = [prompt_conversation(p) for p in ["hi how are you", "tell me about the weather today", "hello"]]
    settings = GenerationSettings(max_new_tokens=6, batch_size=2)
    dataset = regenerate(target, prompts, settings, tmp_path)
    tokenizer = target.tokenizer
    for row, messages in enumerate(prompts):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        expected = target.model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=[tokenizer.eos_token_id]
        )[0, len(prompt) :].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        assert dataset[row]["input_ids"] == prompt + expected
        assert dataset[row]["loss_mask"] == [0] * len(prompt) + [1] * len(expected)
    # cached: a second call must not generate again
    monkeypatch.setattr(data_module, "_generate_batch", lambda *a, **k: pytest.fail("regenerated"))
    again = regenerate(target, prompts, settings, tmp_path)
    assert again["input_ids"] == dataset["input_ids"]
    # a different setting is a different cache entry
    with pytest.raises(pytest.fail.Exception):
        regenerate(target, prompts, GenerationSettings(max_new_tokens=5, batch_size=2), tmp_path)


def test_sampled_regeneration_is_seeded_and_differs_from_greedy(target, tmp_path):
    prompts = [prompt_conversation(p) for p in ["hi", "hello how are you", "tell me about music"]]
    sampled = GenerationSettings(max_new_tokens=8, temperature=1.5, batch_size=2, seed=7)
    first = regenerate(target, prompts, sampled, tmp_path / "a")["input_ids"]
    assert regenerate(target, prompts, sampled, tmp_path / "b")["input_ids"] == first
    greedy = regenerate(target, prompts, GenerationSettings(max_new_tokens=8, batch_size=2), tmp_path / "c")
    assert greedy["input_ids"] != first


def test_long_prompts_are_skipped(target, tmp_path, caplog):
    prompts = [prompt_conversation("hi"), prompt_conversation(" ".join(["hello"] * 50))]
    dataset = regenerate(target, prompts, GenerationSettings(max_new_tokens=2, max_prompt_length=20), tmp_path)
    assert len(dataset) == 1 and dataset[0]["prompt"] == "hi"
    assert "Skipping 1 of 2 prompts" in caplog.text


def test_offline_features_equal_online_capture_and_are_reused(target, tmp_path, monkeypatch):
    conversations = datasets.Dataset.from_dict({"messages": tiny_conversations(5)})
    tokens = conversations.map(lambda s: tokenize_chat(target.tokenizer, s["messages"]), remove_columns=["messages"])
    path = prepare_features(target, tokens, [2, 1], tmp_path, batch_size=2, shard_samples=2)
    index = json.loads((path / "features.json").read_text())
    assert index["num_samples"] == 5 and len(index["shards"]) == 3
    offline = OfflineDataset(tokens, path)
    for i in range(5):
        ids = torch.tensor([tokens[i]["input_ids"]])
        torch.testing.assert_close(offline[i]["target_hidden"], target.capture(ids, None, [2, 1])[0])
    monkeypatch.setattr(target, "capture", lambda *a, **k: pytest.fail("recaptured"))
    assert prepare_features(target, tokens, [2, 1], tmp_path, batch_size=2) == path


def test_collator_pads_every_field():
    samples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "target_hidden": torch.ones(3, 2)},
        {"input_ids": [8], "loss_mask": [1], "target_hidden": torch.full((1, 2), 2.0)},
    ]
    batch = DFlashCollator(pad_token_id=0)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["target_hidden"][1].tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]


def test_build_datasets_from_chat_and_prompt_files(target, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": m}) for m in tiny_conversations(6)))
    args = DataArguments(
        dataset=str(chat), regenerate=False, num_eval_samples=2, max_length=12, cache_dir=str(tmp_path)
    )
    train, evaluation = build_datasets(args, target, [1, 2])
    assert len(train) == 4 and len(evaluation) == 2
    assert all(len(ids) <= 12 for ids in train["input_ids"])
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": "hi how are you"}, {"prompt": "hello"}, {"prompt": "tell me"}]))
    args = DataArguments(
        dataset=str(prompts), max_new_tokens=4, num_eval_samples=1, offline=True, cache_dir=str(tmp_path)
    )
    train, evaluation = build_datasets(args, target, [1, 2])
    assert isinstance(train, OfflineDataset) and len(train) + len(evaluation) <= 3
    assert train[0]["target_hidden"].shape == (len(train[0]["input_ids"]), 64)
    with pytest.raises(ValueError, match="regenerate must be true"):
        build_datasets(DataArguments(dataset=str(prompts), regenerate=False, cache_dir=str(tmp_path)), target, [1])


def test_chitchat_prompts_are_the_first_messages():
    prompts = data_module.chitchat_prompts()
    assert len(prompts) > 7000
    assert prompts[0] == "Hello How are you doing today?"
