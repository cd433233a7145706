"""Training data: chat -> tokens + assistant loss mask, target-regenerated responses, offline features.

Every dataset here is map-style (a `datasets.Dataset` or an indexable torch dataset), so Trainer's
resume skips exactly the consumed samples. Samples carry `input_ids` and `loss_mask` (1 on tokens
the draft is trained to predict); offline datasets add `target_hidden`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow
import pyarrow.parquet
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from trainer.blocks import valid_anchor_mask
from trainer.fileio import default_cache_root, digest, require_existing_path, write_directory_atomically
from trainer.target import FrozenTarget

logger = logging.getLogger(__name__)

# Roles chat templates know; anything else (ShareGPT's "human" / "gpt") would render but never be
# supervised as an assistant turn.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
# Bytes of a JSON / JSONL file that carry no row (whitespace and empty containers), and its BOM.
JSON_WHITESPACE = b" \t\r\n"
JSON_STRUCTURE = JSON_WHITESPACE + b"[]{},"
UTF8_BOM = b"\xef\xbb\xbf"


# ---------------------------------------------------------------------------------------------
# Prompt sources
# ---------------------------------------------------------------------------------------------


def chitchat_prompts() -> list[str]:
    """First message of each of the 7,168 conversations of PyPI `chitchat-dataset` (MIT), in file order."""
    try:
        import chitchat_dataset
    except ImportError as error:
        raise ValueError("dataset 'chitchat' needs the PyPI package chitchat-dataset.") from error
    prompts = []
    for conversation in chitchat_dataset.ConversationDataset():
        first = next(iter(conversation), "").strip()
        if first:
            prompts.append(first)
    return prompts


def split_prompts(prompts: list[str], eval_count: int) -> tuple[list[str], list[str]]:
    """Hold out the last `eval_count` prompts (a fixed, reproducible split)."""
    if eval_count <= 0:
        return prompts, []
    return prompts[:-eval_count], prompts[-eval_count:]


# ---------------------------------------------------------------------------------------------
# Chat templating and loss masks
# ---------------------------------------------------------------------------------------------


def template_kwargs(tokenizer: PreTrainedTokenizerBase, enable_thinking: bool | None) -> dict[str, Any]:
    """`enable_thinking` is passed only to templates that have the switch; asking for it on a
    template without one is an error rather than a silent no-op."""
    if enable_thinking is None:
        return {}
    if "enable_thinking" not in (tokenizer.chat_template or ""):
        raise ValueError("enable_thinking is set but this tokenizer's chat template has no thinking switch.")
    return {"enable_thinking": enable_thinking}


def _render(tokenizer, messages, add_generation_prompt: bool, extra: dict[str, Any]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True, **extra
        )["input_ids"]
    )


def end_of_turn_ids(tokenizer) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    enable_thinking: bool | None = None,
) -> dict[str, list[int]]:
    """Token ids of a conversation and a loss mask that is 1 exactly on assistant tokens.

    Templates with `{% generation %}` markers report the assistant tokens themselves; otherwise
    each assistant turn is located by incremental templating: the tokens added between
    `template(messages[:i], add_generation_prompt=True)` and `template(messages[:i+1])`, up to and
    including the end-of-turn token.
    """
    extra = template_kwargs(tokenizer, enable_thinking)
    if "{% generation %}" in (tokenizer.chat_template or "") or "{%- generation %}" in (tokenizer.chat_template or ""):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **extra
        )
        return {"input_ids": list(rendered["input_ids"]), "loss_mask": list(rendered["assistant_masks"])}
    input_ids = _render(tokenizer, messages, False, extra)
    loss_mask = [0] * len(input_ids)
    end_of_turn = end_of_turn_ids(tokenizer)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:index], True, extra)
        through = _render(tokenizer, messages[: index + 1], False, extra)
        if through[: len(prefix)] != prefix or input_ids[: len(through)] != through:
            raise ValueError(
                f"Cannot locate assistant turn {index} by incremental templating: the chat template renders "
                "earlier turns differently once later ones exist. Use a template with {% generation %} markers."
            )
        end = len(through)
        for position in range(len(prefix), len(through)):
            if through[position] in end_of_turn:
                end = position + 1
                break
        loss_mask[len(prefix) : end] = [1] * (end - len(prefix))
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def truncate_and_filter(dataset: datasets.Dataset, max_length: int, name: str = "dataset") -> datasets.Dataset:
    """Truncate to `max_length` and drop samples left without a valid anchor (count logged); `name`
    says which dataset the error is about when none is left."""

    def truncate(sample):
        return {"input_ids": sample["input_ids"][:max_length], "loss_mask": sample["loss_mask"][:max_length]}

    dataset = dataset.map(truncate, desc="truncating")
    before = len(dataset)

    def has_anchor(sample) -> bool:
        return bool(valid_anchor_mask(torch.tensor([sample["loss_mask"]])).any())

    dataset = dataset.filter(has_anchor, desc="dropping samples without a valid anchor")
    dropped = before - len(dataset)
    if dropped:
        logger.warning("Dropped %d of %d samples with no two adjacent supervised tokens.", dropped, before)
    if len(dataset) == 0:
        raise ValueError(
            f"{name}: none of the {before} samples has a valid anchor (two adjacent supervised tokens) "
            f"after truncation to max_length={max_length}"
        )
    return dataset


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: datasets.Dataset,
    messages_column: str = "messages",
    enable_thinking: bool | None = None,
) -> datasets.Dataset:
    if messages_column not in conversations.column_names:
        raise ValueError(f"chat dataset has no '{messages_column}' column (columns: {conversations.column_names}).")
    return conversations.map(
        lambda sample: tokenize_chat(tokenizer, sample[messages_column], enable_thinking),
        remove_columns=conversations.column_names,
        desc="applying the chat template",
    )


# ---------------------------------------------------------------------------------------------
# Responses regenerated by the target (on-policy data)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    max_prompt_length: int = 1024
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 16
    seed: int = 0
    enable_thinking: bool | None = None


def prompt_conversation(prompt: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": prompt}]


def conversation_prefix(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The messages before the first assistant turn: what the target is asked to answer."""
    prefix = []
    for message in messages:
        if message["role"] == "assistant":
            break
        prefix.append({"role": message["role"], "content": message["content"]})
    if not prefix:
        raise ValueError("a conversation starts with an assistant turn: nothing to regenerate from")
    return prefix


@torch.no_grad()
def _generate_batch(target: FrozenTarget, prompts: list[list[int]], settings: GenerationSettings, batch_index: int):
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding, once per batch
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    sampling = settings.temperature > 0
    generator_kwargs: dict[str, Any] = {"do_sample": sampling}
    if sampling:
        torch.manual_seed(settings.seed * 1_000_003 + batch_index)
        generator_kwargs.update(temperature=settings.temperature, top_p=settings.top_p)
    else:
        generator_kwargs.update(temperature=None, top_p=None, top_k=None)
    end_of_turn = sorted(end_of_turn_ids(tokenizer))
    output = target.model.generate(
        input_ids=input_ids.to(target.device),
        attention_mask=attention_mask.to(target.device),
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=end_of_turn,
        pad_token_id=pad_id,
        **generator_kwargs,
    )
    responses = []
    for row in output[:, width:].tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in end_of_turn), len(row))
        responses.append(row[:cut])
    return responses


def regenerate(
    target: FrozenTarget,
    prompts: list[list[dict[str, str]]],
    settings: GenerationSettings,
    cache_root: Path,
    name: str = "dataset",
) -> datasets.Dataset:
    """Prompt conversations -> answered by the target itself, as token ids (on-policy data).

    `input_ids` = templated prompt + the generated tokens (through the end-of-turn token);
    `loss_mask` is 1 on the generated tokens. Cached with `save_to_disk` under a key of the target,
    the prompts, the settings and the chat template; a cached result is reused as is. `name` says
    which dataset the error is about when no prompt fits `max_prompt_length`.
    """
    tokenizer = target.tokenizer
    key = digest(
        {
            "target": target.fingerprint(),
            "prompts": hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest(),
            "settings": asdict(settings),
            "template": tokenizer.chat_template,
        }
    )
    path = cache_root / "generated" / key
    if (path / "dataset_info.json").exists():
        logger.info("Reusing %d target-generated responses from %s", len(prompts), path)
        return datasets.load_from_disk(str(path))
    extra = template_kwargs(tokenizer, settings.enable_thinking)
    prompt_ids = [_render(tokenizer, messages, True, extra) for messages in prompts]
    kept = [index for index, ids in enumerate(prompt_ids) if len(ids) <= settings.max_prompt_length]
    if not kept:
        raise ValueError(
            f"{name}: none of the {len(prompts)} prompts fits in max_prompt_length={settings.max_prompt_length} tokens"
        )
    if len(kept) < len(prompts):
        logger.warning(
            "Skipping %d of %d prompts longer than max_prompt_length=%d tokens.",
            len(prompts) - len(kept),
            len(prompts),
            settings.max_prompt_length,
        )
        prompts, prompt_ids = [prompts[i] for i in kept], [prompt_ids[i] for i in kept]
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "prompt": [], "response": []}
    batches = range(0, len(prompts), settings.batch_size)
    for batch_index, start in enumerate(tqdm(batches, desc="generating responses with the target")):
        chunk = prompt_ids[start : start + settings.batch_size]
        generated = _generate_batch(target, chunk, settings, batch_index)
        for prompt, tokens, messages in zip(chunk, generated, prompts[start:], strict=False):
            rows["input_ids"].append(prompt + tokens)
            rows["loss_mask"].append([0] * len(prompt) + [1] * len(tokens))
            rows["prompt"].append(messages[-1]["content"])
            rows["response"].append(tokenizer.decode(tokens, skip_special_tokens=True))
    dataset = datasets.Dataset.from_dict(rows)
    write_directory_atomically(path, lambda directory: dataset.save_to_disk(str(directory)))
    return datasets.load_from_disk(str(path))


# ---------------------------------------------------------------------------------------------
# Offline features: run the target once, train from disk
# ---------------------------------------------------------------------------------------------


FEATURE_INDEX = "features.json"


def token_fingerprint(dataset: datasets.Dataset) -> str:
    """Hash of every sample's token ids (stable across processes, unlike in-memory dataset fingerprints)."""
    hasher = hashlib.sha256()
    for ids in dataset["input_ids"]:
        hasher.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        hasher.update(b"|")
    return hasher.hexdigest()


def prepare_features(
    target: FrozenTarget,
    dataset: datasets.Dataset,
    layer_ids: Sequence[int],
    cache_root: Path,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
    shard_samples: int = 256,
    final_hidden: bool = False,
) -> Path:
    """Capture `hidden_states[id + 1]` for every sample once; store safetensors shards on disk.
    With `final_hidden` (distillation) each sample also stores the target's final hidden states,
    one more H-wide feature per token, from the same forward.

    Keyed by the target, the token ids, the layer ids and whether final states are stored; an
    existing store is reused.
    """
    fields = {"target": target.fingerprint(), "data": token_fingerprint(dataset), "layers": list(layer_ids)}
    fields["dtype"] = str(dtype)
    if final_hidden:  # (absent otherwise, so the stores written before it keep their keys)
        fields["final_hidden"] = True
    key = digest(fields)
    path = cache_root / "features" / key
    if (path / FEATURE_INDEX).exists():
        logger.info("Reusing offline target features from %s", path)
        return path

    def write(directory: Path) -> None:
        shards, shard, shard_index = [], {}, 0
        for start in tqdm(range(0, len(dataset), batch_size), desc="capturing target hidden states"):
            batch = dataset[start : start + batch_size]["input_ids"]
            lengths = [len(ids) for ids in batch]
            input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(batch):  # right padding: a causal target ignores what follows
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
            captured = target.capture(
                input_ids.to(target.device), attention_mask.to(target.device), layer_ids, final_hidden=final_hidden
            )
            hidden, final = captured if final_hidden else (captured, None)
            for row, length in enumerate(lengths):
                shard[f"sample_{start + row}"] = hidden[row, :length].to("cpu", dtype).contiguous()
                if final is not None:
                    shard[f"final_{start + row}"] = final[row, :length].to("cpu", dtype).contiguous()
            samples = sorted(int(key.split("_")[1]) for key in shard if key.startswith("sample_"))
            if len(samples) >= shard_samples or start + batch_size >= len(dataset):
                name = f"shard-{shard_index:05d}.safetensors"
                save_file(shard, directory / name)
                shards.append({"file": name, "samples": samples})
                shard, shard_index = {}, shard_index + 1
        (directory / FEATURE_INDEX).write_text(
            json.dumps(
                {
                    "num_samples": len(dataset),
                    "layer_ids": list(layer_ids),
                    "final_hidden": final_hidden,
                    "shards": shards,
                }
            )
        )

    write_directory_atomically(path, write)
    return path


class OfflineDataset(torch.utils.data.Dataset):
    """Token samples joined with their stored target features (memory-mapped on access)."""

    def __init__(self, tokens: datasets.Dataset, features: Path):
        index = json.loads((features / FEATURE_INDEX).read_text())
        if index["num_samples"] != len(tokens):
            raise ValueError(f"feature store {features} has {index['num_samples']} samples, dataset {len(tokens)}.")
        self.tokens = tokens
        self.features = features
        self.shard_of = {sample: shard["file"] for shard in index["shards"] for sample in shard["samples"]}
        self.final_hidden = bool(index.get("final_hidden", False))
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.tokens[index])
        shard = self.shard_of[index]
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.features / shard, "pt")
        hidden = self._handles[shard].get_tensor(f"sample_{index}")
        if hidden.shape[0] != len(sample["input_ids"]):
            raise ValueError(f"sample {index}: {hidden.shape[0]} feature rows for {len(sample['input_ids'])} tokens.")
        sample["target_hidden"] = hidden
        if self.final_hidden:
            sample["target_final_hidden"] = self._handles[shard].get_tensor(f"final_{index}")
        return sample

    def __getstate__(self):  # dataloader workers open their own handles
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


# ---------------------------------------------------------------------------------------------
# Collation
# ---------------------------------------------------------------------------------------------


FEATURE_KEYS = ("target_hidden", "target_final_hidden")


class DFlashCollator:
    """Right-pads `input_ids` (pad id), `loss_mask` (0), `attention_mask`, and the stored target
    features `target_hidden` and `target_final_hidden` (0)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(sample["input_ids"]) for sample in samples]
        width = max(lengths)
        batch = {
            "input_ids": torch.full((len(samples), width), self.pad_token_id, dtype=torch.long),
            "loss_mask": torch.zeros(len(samples), width, dtype=torch.long),
            "attention_mask": torch.zeros(len(samples), width, dtype=torch.long),
        }
        features = [key for key in FEATURE_KEYS if key in samples[0]]
        for key in features:
            first = torch.as_tensor(samples[0][key])
            batch[key] = torch.zeros(len(samples), width, first.shape[-1], dtype=first.dtype)
        for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
            batch["input_ids"][row, :length] = torch.as_tensor(sample["input_ids"])
            batch["loss_mask"][row, :length] = torch.as_tensor(sample["loss_mask"])
            batch["attention_mask"][row, :length] = 1
            for key in features:
                batch[key][row, :length] = torch.as_tensor(sample[key])
        return batch


# ---------------------------------------------------------------------------------------------
# Checks on user data, before a library or a chat template sees it
# ---------------------------------------------------------------------------------------------


def check_json_file(path: Path, name: str) -> None:
    """Refuse a JSON / JSONL file that is not UTF-8, holds no row, or does not open with an object
    or array: pyarrow reports bad bytes without a line, an empty file surfaces as a bare
    StopIteration, and a top-level `null` crashes the reader. One pass over the lines in binary (a
    newline byte never occurs inside a UTF-8 sequence); the column counts bytes from 1."""
    has_rows, first_line, first_byte = False, 0, b""
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"dataset {name}: line {number} is not valid UTF-8 "
                    f"(byte 0x{line[error.start]:02x} at column {error.start + 1})"
                ) from None
            if not first_line and line.strip():
                first_line, first_byte = number, line.lstrip(UTF8_BOM + JSON_WHITESPACE)[:1]
            has_rows = has_rows or bool(line.strip(JSON_STRUCTURE))
    if not has_rows:
        raise ValueError(f"dataset {name} has no rows")
    if first_byte not in (b"{", b"["):
        raise ValueError(f"dataset {name}: line {first_line} does not start a JSON object or array")


def check_parquet_file(path: Path, name: str) -> None:
    """Refuse an unreadable or empty Parquet file from its footer alone (datasets reports an empty one
    as 'Instruction "train" corresponds to no data!')."""
    try:
        rows = pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except (pyarrow.ArrowException, OSError) as error:
        raise ValueError(f"dataset {name} is not a readable Parquet file: {error}") from None
    if rows == 0:
        raise ValueError(f"dataset {name} has no rows")


def column_values(dataset: datasets.Dataset, column: str) -> Iterator[Any]:
    """One column's values in row order, read in batches (flat memory on large datasets)."""
    for batch in dataset.select_columns([column]).iter(batch_size=1024):
        yield from batch[column]


def conversation_problem(messages: Any, column: str) -> str | None:
    """Why a chat template cannot render this row's conversation, or None."""
    if messages is None:
        return f"'{column}' is null"
    if not isinstance(messages, list) or not messages:
        return f"'{column}' must be a non-empty list of {{role, content}} messages"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} is a {type(message).__name__}, not a {{role, content}} mapping"
        role, content = message.get("role"), message.get("content")
        if role is None:
            return f"message {index} has no 'role'"
        if role not in KNOWN_ROLES:
            return f"message {index} has unknown role {role!r} (known: {', '.join(KNOWN_ROLES)})"
        if content is None:
            return f"message {index} has no 'content'"
        if not isinstance(content, str):
            return f"message {index} has a {type(content).__name__} 'content', not a string"
    return None


def check_conversations(conversations: Iterable[Any], name: str, column: str) -> None:
    """Refuse the first conversation a template cannot render, naming its row (from 0) and field:
    the template itself fails with a jinja UndefinedError that names neither."""
    for row, messages in enumerate(conversations):
        problem = conversation_problem(messages, column)
        if problem:
            raise ValueError(f"dataset {name} row {row}: {problem}")


def check_prompts(prompts: Iterable[Any], name: str, column: str) -> None:
    """Refuse the first prompt that is not a string, naming its row (from 0) and field."""
    for row, prompt in enumerate(prompts):
        if prompt is None:
            raise ValueError(f"dataset {name} row {row}: '{column}' is null")
        if not isinstance(prompt, str):
            raise ValueError(f"dataset {name} row {row}: '{column}' is a {type(prompt).__name__}, not a string")


def conversation_prefixes(conversations: Iterable[Sequence[dict[str, str]]], name: str) -> list[list[dict[str, str]]]:
    """`conversation_prefix` of every row, naming the row that has none."""
    prefixes = []
    for row, messages in enumerate(conversations):
        try:
            prefixes.append(conversation_prefix(messages))
        except ValueError as error:
            raise ValueError(f"dataset {name} row {row}: {error}") from None
    return prefixes


def check_sample_counts(args) -> None:
    """Refuse sample counts that cannot mean anything, before any data is loaded."""
    if args.num_eval_samples < 0:
        raise ValueError(f"num_eval_samples={args.num_eval_samples} must be >= 0")
    if args.num_train_samples is not None and args.num_train_samples <= 0:
        raise ValueError(
            f"num_train_samples={args.num_train_samples} must be positive (unset it to train on every sample)"
        )


def check_held_out(num_eval_samples: int, count: int, name: str) -> None:
    """Refuse a hold-out that leaves nothing to train on (it would surface later, from the empty
    training set, as 'no sample has a valid anchor')."""
    if num_eval_samples >= count:
        raise ValueError(
            f"num_eval_samples={num_eval_samples} holds out every one of the {count} samples of {name}: "
            f"set it below {count}"
        )


# ---------------------------------------------------------------------------------------------
# From arguments to datasets
# ---------------------------------------------------------------------------------------------


def load_data_file(path: Path, name: str) -> datasets.Dataset:
    """A JSON / JSONL / Parquet file, checked first so that its problems are named (Parquet is
    binary: it is not checked for UTF-8)."""
    kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"dataset file {name}: expected .json, .jsonl or .parquet")
    check = check_json_file if kind == "json" else check_parquet_file
    check(path, name)
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    except StopIteration as error:  # datasets' JSON reader on a file that yields no table
        raise ValueError(f"dataset {name} has no rows") from error


def load_raw_dataset(spec: str, split: str) -> datasets.Dataset:
    """A `save_to_disk` directory, a JSON / JSONL / Parquet file, or a Hub dataset id. A missing
    local path, a JSON file that is not UTF-8 and a dataset without rows are refused, naming `spec`."""
    resolved = require_existing_path(spec, "dataset")
    path = Path(resolved)
    if path.is_dir() and (path / "dataset_info.json").exists():
        dataset = datasets.load_from_disk(resolved)
    elif path.is_file():
        dataset = load_data_file(path, spec)
    else:
        dataset = datasets.load_dataset(resolved, split=split)
    if len(dataset) == 0:
        raise ValueError(f"dataset {spec} has no rows")
    return dataset


def conversations_or_prompts(raw: datasets.Dataset, args) -> tuple[datasets.Dataset | None, list | None]:
    """(chat dataset, None) to tokenize as is, or (None, prompt conversations) for the target to
    answer; every row is validated first, so a bad one is named instead of failing in a template."""
    name, messages_column, prompt_column = args.dataset, args.messages_column, args.prompt_column
    if messages_column in raw.column_names and not args.regenerate:
        check_conversations(column_values(raw, messages_column), name, messages_column)
        return raw, None
    if messages_column in raw.column_names:
        conversations = list(column_values(raw, messages_column))
        check_conversations(conversations, name, messages_column)
        return None, conversation_prefixes(conversations, name)
    if prompt_column in raw.column_names:
        if not args.regenerate:
            raise ValueError(f"dataset {name} has prompts only ('{prompt_column}'): regenerate must be true")
        prompts = list(column_values(raw, prompt_column))
        check_prompts(prompts, name, prompt_column)
        return None, [prompt_conversation(prompt, args.system_prompt) for prompt in prompts]
    raise ValueError(
        f"dataset {name} needs a '{messages_column}' or a '{prompt_column}' column; it has {raw.column_names}"
    )


def build_datasets(args, target: FrozenTarget, layer_ids: Sequence[int], final_hidden: bool = False):
    """(train, eval or None) tokenized datasets, or offline datasets with stored target features
    (with the target's final hidden states too when `final_hidden`, for distillation).

    `args` is a `DataArguments`. Prompt-only sources (and chat sources with `regenerate`) are
    answered by the target; the last `num_eval_samples` prompts/conversations are held out.
    """
    check_sample_counts(args)
    cache_root = Path(args.cache_dir) if args.cache_dir else default_cache_root()
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        max_prompt_length=args.max_prompt_length,
        temperature=args.generation_temperature,
        top_p=args.generation_top_p,
        batch_size=args.generation_batch_size,
        enable_thinking=args.enable_thinking,
    )
    if args.dataset == "chitchat":
        if not args.regenerate:
            raise ValueError("dataset 'chitchat' holds prompts only: regenerate must be true")
        prompts = [prompt_conversation(p, args.system_prompt) for p in chitchat_prompts()]
        conversations = None
    else:
        conversations, prompts = conversations_or_prompts(load_raw_dataset(args.dataset, args.dataset_split), args)
    check_held_out(args.num_eval_samples, len(prompts if prompts is not None else conversations), args.dataset)
    train_name, eval_name = f"dataset {args.dataset} (train)", f"dataset {args.dataset} (eval)"

    def held_out(items):
        train, evaluation = split_prompts(list(items), args.num_eval_samples)
        return train[: args.num_train_samples] if args.num_train_samples else train, evaluation

    if prompts is not None:
        train_prompts, eval_prompts = held_out(prompts)
        train = regenerate(target, train_prompts, settings, cache_root, train_name)
        evaluation = regenerate(target, eval_prompts, settings, cache_root, eval_name) if eval_prompts else None
    else:
        train_rows, eval_rows = held_out(range(len(conversations)))
        tokenized = tokenize_conversations(target.tokenizer, conversations, args.messages_column, args.enable_thinking)
        train = tokenized.select(train_rows)
        evaluation = tokenized.select(eval_rows) if eval_rows else None
    train = truncate_and_filter(train.select_columns(["input_ids", "loss_mask"]), args.max_length, train_name)
    if evaluation is not None:
        evaluation = truncate_and_filter(
            evaluation.select_columns(["input_ids", "loss_mask"]), args.max_length, eval_name
        )
    if args.offline:
        dtype = getattr(torch, args.offline_dtype)

        def offline(tokens: datasets.Dataset) -> OfflineDataset:
            store = prepare_features(target, tokens, layer_ids, cache_root, dtype, final_hidden=final_hidden)
            return OfflineDataset(tokens, store)

        train = offline(train)
        if evaluation is not None:
            evaluation = offline(evaluation)
    return train, evaluation
