"""trainer.data.dataset: chat templating and loss masks, regenerated responses, offline features, collation."""

from __future__ import annotations

import dataclasses
import json

import datasets
import pytest
import torch
import yaml

from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.tiny_target import tiny_conversations, tiny_target
from trainer.data import dataset as data_module
from trainer.data import regeneration as regeneration_module
from trainer.data.chat import tokenize_chat
from trainer.data.dataset import DFlashCollator, build_datasets, truncate_and_filter
from trainer.data.feature_store import OfflineDataset, prepare_features
from trainer.data.regeneration import GenerationSettings, prompt_conversation, regenerate
from trainer.training.arguments import DataArguments

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
    with pytest.raises(ValueError, match=r"^chat\.jsonl: none of the 1 samples has a valid anchor"):
        truncate_and_filter(dataset.select([1]), max_length=4, name="chat.jsonl")


@pytest.mark.slow
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
    monkeypatch.setattr(regeneration_module, "_generate_batch", lambda *a, **k: pytest.fail("regenerated"))
    again = regenerate(target, prompts, settings, tmp_path)
    assert again["input_ids"] == dataset["input_ids"]
    # a different setting is a different cache entry
    with pytest.raises(pytest.fail.Exception):
        regenerate(target, prompts, GenerationSettings(max_new_tokens=5, batch_size=2), tmp_path)


@pytest.mark.slow
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


@pytest.mark.slow
def test_offline_store_with_final_hidden_states_for_distillation(target, tmp_path):
    """One more H-wide feature per token, from the same capture, under its own cache key (a store
    without it is never mistaken for one with it)."""
    conversations = datasets.Dataset.from_dict({"messages": tiny_conversations(3)})
    tokens = conversations.map(lambda s: tokenize_chat(target.tokenizer, s["messages"]), remove_columns=["messages"])
    plain = prepare_features(target, tokens, [2, 1], tmp_path, batch_size=2)
    path = prepare_features(target, tokens, [2, 1], tmp_path, batch_size=2, shard_samples=2, final_hidden=True)
    assert path != plain and "target_final_hidden" not in OfflineDataset(tokens, plain)[0]
    offline = OfflineDataset(tokens, path)
    for i in range(3):
        ids = torch.tensor([tokens[i]["input_ids"]])
        features, final = target.capture(ids, None, [2, 1], final_hidden=True)
        torch.testing.assert_close(offline[i]["target_hidden"], features[0])
        torch.testing.assert_close(offline[i]["target_final_hidden"], final[0])
    batch = DFlashCollator(pad_token_id=0)([offline[0], offline[1]])
    width = batch["input_ids"].shape[1]
    assert batch["target_final_hidden"].shape == (2, width, final.shape[-1])
    length = len(tokens[1]["input_ids"])
    assert torch.equal(batch["target_final_hidden"][1, :length], offline[1]["target_final_hidden"])
    assert not batch["target_final_hidden"][1, length:].any()


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


def test_an_offline_store_is_checked_against_the_run_that_opens_it(target, tmp_path):
    """The store found under the run's key must also say it holds what the run needs (here its
    recorded width was edited): build_datasets hands the run's fingerprint to OfflineDataset."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": m}) for m in tiny_conversations(4)))
    args = DataArguments(dataset=str(chat), regenerate=False, num_eval_samples=0, offline=True, cache_dir=str(tmp_path))
    build_datasets(args, target, [1, 2])
    (index_path,) = (tmp_path / "features").glob("*/features.json")
    index = json.loads(index_path.read_text())
    index["store"]["hidden_size"] = 48
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError) as caught:
        build_datasets(args, target, [1, 2])
    store = index_path.parent
    assert str(caught.value) == (
        f"feature store {store}: it was captured for hidden_size 48 (this run: 32): delete {store} to capture again"
    )


def test_chitchat_prompts_are_the_first_messages():
    prompts = data_module.chitchat_prompts()
    assert len(prompts) > 7000
    assert prompts[0] == "Hello How are you doing today?"


# ---------------------------------------------------------------------------------------------
# User data that cannot be trained on is refused with one line naming the file, row and field
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny setup of the multi-process tests: a target, draft config, chat.jsonl and recipe."""
    root = tmp_path_factory.mktemp("tiny_run")
    write_tiny_run(root)
    return root


def recipe_data_arguments(root, **overrides) -> DataArguments:
    """The tiny recipe's data arguments, as train.py reads them, with `overrides`."""
    recipe = yaml.safe_load((root / "recipe.yaml").read_text())
    names = {field.name for field in dataclasses.fields(DataArguments)}
    return DataArguments(**{key: value for key, value in recipe.items() if key in names} | overrides)


def refusal(args, target, error=ValueError) -> str:
    """The message `build_datasets` refuses `args` with."""
    with pytest.raises(error) as caught:
        build_datasets(args, target, [1, 2])
    return str(caught.value)


def write_rows(path, rows) -> str:
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return str(path)


def test_the_tiny_recipe_builds(tiny_run, target):
    train, evaluation = build_datasets(recipe_data_arguments(tiny_run), target, [1, 2])
    assert len(train) == 20 and len(evaluation) == 4


@pytest.mark.parametrize(("name", "content"), [("chat.jsonl", ""), ("chat.jsonl", "\n \n"), ("chat.json", "[]")])
def test_an_empty_dataset_file_is_named(tiny_run, target, tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    args = recipe_data_arguments(tiny_run, dataset=str(path))
    assert refusal(args, target) == f"dataset {path} has no rows"


def test_an_empty_parquet_file_is_named(tiny_run, target, tmp_path):
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_dict({"messages": tiny_conversations(1)}).select([]).to_parquet(str(path))
    assert refusal(recipe_data_arguments(tiny_run, dataset=str(path)), target) == f"dataset {path} has no rows"


def test_a_top_level_json_scalar_is_named(tiny_run, target, tmp_path):
    path = tmp_path / "chat.json"
    path.write_text("\nnull\n")  # crashes the datasets JSON reader
    args = recipe_data_arguments(tiny_run, dataset=str(path))
    assert refusal(args, target) == f"dataset {path}: line 2 does not start a JSON object or array"


def test_a_dataset_whose_rows_are_all_filtered_is_named(tiny_run, target, tmp_path):
    user_only = [{"messages": messages[:1]} for messages in tiny_conversations(24)]
    path = write_rows(tmp_path / "chat.jsonl", user_only)
    assert refusal(recipe_data_arguments(tiny_run, dataset=path), target) == (
        f"dataset {path} (train): none of the 20 samples has a valid anchor (two adjacent supervised tokens) "
        "after truncation to max_length=48"
    )
    long_prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": "hello how are you"}] * 3)
    args = recipe_data_arguments(
        tiny_run, dataset=long_prompts, regenerate=True, num_eval_samples=0, max_prompt_length=4
    )
    assert refusal(args, target) == (
        f"dataset {long_prompts} (train): none of the 3 prompts fits in max_prompt_length=4 tokens"
    )


def test_sample_counts_that_leave_nothing_are_refused_up_front(tiny_run, target, monkeypatch):
    monkeypatch.setattr(data_module, "tokenize_conversations", lambda *a, **k: pytest.fail("tokenized"))
    chat = str(tiny_run / "chat.jsonl")
    for count in (24, 50):
        args = recipe_data_arguments(tiny_run, num_eval_samples=count)
        assert refusal(args, target) == (
            f"num_eval_samples={count} holds out every one of the 24 samples of {chat}: set it below 24"
        )
    assert refusal(recipe_data_arguments(tiny_run, num_eval_samples=-1), target) == "num_eval_samples=-1 must be >= 0"
    assert refusal(recipe_data_arguments(tiny_run, num_train_samples=0), target) == (
        "num_train_samples=0 must be positive (unset it to train on every sample)"
    )


@pytest.mark.parametrize(("name", "line"), [("chat.jsonl", 2), ("chat.json", 3)])
def test_non_utf8_json_is_named_by_line_and_column(tiny_run, target, tmp_path, name, line):
    rows = [json.dumps({"messages": messages}).encode() for messages in tiny_conversations(3)]
    rows[1] = rows[1].replace(b'"user"', b'"\xe9ser"')  # Latin-1, not UTF-8
    column = rows[1].index(b"\xe9") + 1
    path = tmp_path / name
    path.write_bytes(b"\n".join(rows) if name.endswith(".jsonl") else b"[\n" + b",\n".join(rows) + b"\n]")
    args = recipe_data_arguments(tiny_run, dataset=str(path), num_eval_samples=0)
    assert refusal(args, target) == f"dataset {path}: line {line} is not valid UTF-8 (byte 0xe9 at column {column})"


def test_parquet_is_not_checked_for_utf8(tiny_run, target, tmp_path):
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_dict({"messages": tiny_conversations(24)}).to_parquet(str(path))
    with pytest.raises(UnicodeDecodeError):
        path.read_bytes().decode("utf-8")  # a binary format
    train, evaluation = build_datasets(recipe_data_arguments(tiny_run, dataset=str(path)), target, [1, 2])
    assert len(train) == 20 and len(evaluation) == 4


def _break_message(row: int, index: int, edit):
    conversations = tiny_conversations(24)
    edit(conversations[row][index])
    return [{"messages": messages} for messages in conversations]


@pytest.mark.parametrize("regenerate", [False, True])
@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        (_break_message(3, 1, lambda m: m.pop("content")), "row 3: message 1 has no 'content'"),
        (_break_message(5, 0, lambda m: m.update(content=None)), "row 5: message 0 has no 'content'"),
        (_break_message(2, 0, lambda m: m.update(content=7)), "row 2: message 0 has a int 'content', not a string"),
        (_break_message(0, 1, lambda m: m.pop("role")), "row 0: message 1 has no 'role'"),
        (
            _break_message(7, 0, lambda m: m.update(role="human")),
            "row 7: message 0 has unknown role 'human' (known: system, developer, user, assistant, tool, ipython, "
            "function)",
        ),
        ([{"messages": m} for m in tiny_conversations(23)] + [{"messages": None}], "row 23: 'messages' is null"),
    ],
)
def test_a_row_a_template_cannot_render_is_named(tiny_run, target, tmp_path, rows, problem, regenerate):
    path = write_rows(tmp_path / "chat.jsonl", rows)
    args = recipe_data_arguments(tiny_run, dataset=path, regenerate=regenerate)
    assert refusal(args, target) == f"dataset {path} {problem}"


def test_a_conversation_with_nothing_to_regenerate_from_is_named(tiny_run, target, tmp_path):
    rows = [{"messages": messages} for messages in tiny_conversations(24)]
    rows[5]["messages"] = rows[5]["messages"][1:]
    path = write_rows(tmp_path / "chat.jsonl", rows)
    assert refusal(recipe_data_arguments(tiny_run, dataset=path, regenerate=True), target) == (
        f"dataset {path} row 5: a conversation starts with an assistant turn: nothing to regenerate from"
    )


@pytest.mark.parametrize(("prompt", "problem"), [(None, "'prompt' is null"), (3, "'prompt' is a int, not a string")])
def test_a_prompt_that_is_not_a_string_is_named(tiny_run, target, tmp_path, prompt, problem):
    path = write_rows(tmp_path / "prompts.jsonl", [{"prompt": "hi"}, {"prompt": prompt}, {"prompt": "hello"}])
    args = recipe_data_arguments(tiny_run, dataset=path, regenerate=True, num_eval_samples=1)
    assert refusal(args, target) == f"dataset {path} row 1: {problem}"


@pytest.mark.parametrize("spec", ["./data/chat.jsonl", "/data/x", "runs/my/data", "chat.jsonl"])
def test_a_missing_local_dataset_is_named(tiny_run, target, tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    args = recipe_data_arguments(tiny_run, dataset=spec)
    assert refusal(args, target, FileNotFoundError) == f"dataset: local path {spec} does not exist"


@pytest.mark.parametrize("spec", ["org/chat", "chat"])
def test_a_hub_dataset_id_still_goes_to_the_hub(tiny_run, target, tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    asked = []

    def from_hub(name, split):
        asked.append((name, split))
        return datasets.Dataset.from_dict({"messages": tiny_conversations(24)})

    monkeypatch.setattr(datasets, "load_dataset", from_hub)
    train, _ = build_datasets(recipe_data_arguments(tiny_run, dataset=spec), target, [1, 2])
    assert asked == [(spec, "train")] and len(train) == 20


def test_tokenising_and_filtering_in_several_processes_equals_one(target, tmp_path):
    """`dataset_num_proc` spreads the batched maps over processes; the samples are the same, in order."""
    conversations = datasets.Dataset.from_dict({"messages": [*tiny_conversations(10), TWO_TURNS[:1]]})
    one = truncate_and_filter(data_module.tokenize_conversations(target.tokenizer, conversations), 20)
    two = truncate_and_filter(
        data_module.tokenize_conversations(target.tokenizer, conversations, num_proc=2), 20, num_proc=2
    )
    assert len(one) == 10  # the user-only conversation has nothing to supervise
    assert one["input_ids"] == two["input_ids"] and one["loss_mask"] == two["loss_mask"]
    assert one[0] == {k: v[:20] for k, v in tokenize_chat(target.tokenizer, conversations[0]["messages"]).items()}


def test_regeneration_reads_a_dataset_lazily(tiny_run, target, tmp_path, monkeypatch):
    """Prompts from a save_to_disk dataset reach regeneration as a lazy view (never a Python list of
    every row), and give the samples a list of the same prompts gives."""
    source = tmp_path / "prompts"
    prompts = ["hello", "how are you", "tell me about music", "good morning", "what is your name"]
    datasets.Dataset.from_dict({"prompt": prompts}).save_to_disk(str(source))
    seen = []
    real = data_module.regenerate

    def spy(target, conversations, *args, **kwargs):
        seen.append(type(conversations))
        return real(target, conversations, *args, **kwargs)

    monkeypatch.setattr(data_module, "regenerate", spy)
    args = recipe_data_arguments(
        tiny_run, dataset=str(source), regenerate=True, num_eval_samples=1, max_new_tokens=4, cache_dir=str(tmp_path)
    )
    train, _ = data_module.token_datasets(args, target)
    assert seen == [data_module.ConversationRows, data_module.ConversationRows]
    settings = data_module.generation_settings(args)
    expected = regenerate(target, [prompt_conversation(p) for p in prompts[:4]], settings, tmp_path / "list")
    assert train["input_ids"] == [ids[:48] for ids in expected["input_ids"]][: len(train)]
