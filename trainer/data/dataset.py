"""Training data: chat -> tokens + assistant loss mask, target-regenerated responses
(trainer/data/regeneration.py), offline features (trainer/data/feature_store.py).

Every dataset here is map-style (a `datasets.Dataset` or an indexable torch dataset), so Trainer's
resume skips exactly the consumed samples. Samples carry `input_ids` and `loss_mask` (1 on tokens
the draft is trained to predict); offline and streamed datasets add `target_hidden`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow
import pyarrow.parquet
import torch
from datasets.exceptions import DatasetGenerationError
from transformers import PreTrainedTokenizerBase

from trainer.data.chat import tokenize_chat_samples
from trainer.data.endpoint import EndpointSettings
from trainer.data.engine_features import check_engine_layers, prepare_engine_features
from trainer.data.engine_servers import EngineLayout, FeatureEndpointSettings
from trainer.data.feature_store import OfflineDataset, prepare_features, store_dtype, store_fingerprint
from trainer.data.online_features import StreamedFeatures, StreamSource
from trainer.data.regeneration import (
    GenerationSettings,
    answer_points,
    conversation_thinking,
    prompt_conversation,
    regenerate,
)
from trainer.fileio import default_cache_root, require_existing_path
from trainer.models.target import FrozenTarget, TargetTokenizer
from trainer.objective.blocks import valid_anchor_mask

logger = logging.getLogger(__name__)

# Roles chat templates know; anything else (ShareGPT's "human" / "gpt") would render but never be
# supervised as an assistant turn.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
# A chat dataset's optional per-conversation columns: the tools the template offers (a list of
# function schemas, or that list as a JSON string) and the thinking switch (true / false / null).
TOOLS_COLUMN = "tools"
THINKING_COLUMN = "enable_thinking"
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


class ConversationRows(Sequence):
    """The conversations of one dataset column, read a row at a time from the (memory-mapped)
    dataset; a prompt column reads as one-turn conversations. Slicing gives a view, so the
    held-out split and `num_train_samples` never copy the data: regeneration works on datasets
    larger than memory."""

    def __init__(
        self,
        dataset: datasets.Dataset,
        column: str,
        system_prompt: str | None = None,
        prompts: bool = False,
        rows: range | None = None,
    ):
        self.dataset, self.column = dataset.select_columns([column]), column
        self.system_prompt, self.prompts = system_prompt, prompts
        self.rows = range(len(dataset)) if rows is None else rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ConversationRows(self.dataset, self.column, self.system_prompt, self.prompts, self.rows[index])
        value = self.dataset[self.rows[index]][self.column]
        return prompt_conversation(value, self.system_prompt) if self.prompts else value

    def __iter__(self) -> Iterator:
        """In row order, read 1,024 rows at a time (hashing a million conversations)."""
        for value in column_values(self.dataset.select(self.rows), self.column):
            yield prompt_conversation(value, self.system_prompt) if self.prompts else value


def split_held_out(items: Sequence, eval_count: int) -> tuple[Sequence, Sequence]:
    """Hold out the last `eval_count` items (a fixed, reproducible split)."""
    if eval_count <= 0:
        return items, items[:0]
    return items[:-eval_count], items[-eval_count:]


def _truncated(batch: dict[str, list], max_length: int) -> dict[str, list]:
    return {key: [values[:max_length] for values in batch[key]] for key in ("input_ids", "loss_mask")}


def _has_anchor(batch: dict[str, list]) -> list[bool]:
    return [bool(valid_anchor_mask(torch.tensor([mask])).any()) for mask in batch["loss_mask"]]


def truncate_and_filter(
    dataset: datasets.Dataset, max_length: int, name: str = "dataset", num_proc: int | None = None
) -> datasets.Dataset:
    """Truncate to `max_length` and drop samples left without a valid anchor (count logged); `name`
    says which dataset the error is about when none is left. Batched `datasets` maps (cached on
    disk, `num_proc` processes), so a large dataset is never held in memory."""
    dataset = dataset.map(
        _truncated, batched=True, fn_kwargs={"max_length": max_length}, num_proc=num_proc, desc="truncating"
    )
    before = len(dataset)
    dataset = dataset.filter(
        _has_anchor, batched=True, num_proc=num_proc, desc="dropping samples without a valid anchor"
    )
    dropped = before - len(dataset)
    if dropped:
        logger.warning("Dropped %d of %d samples with no two adjacent supervised tokens.", dropped, before)
    if len(dataset) == 0:
        raise ValueError(
            f"{name}: none of the {before} samples has a valid anchor (two adjacent supervised tokens) "
            f"after truncation to max_length={max_length}"
        )
    return dataset


def conversation_tools(value: Any) -> list[dict[str, Any]] | None:
    """A row's `tools`: a list of function schemas, that list as a JSON string, or null."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return value or None


def _tokenized(
    batch: dict[str, list], tokenizer, column: str, enable_thinking: bool | None, thinking_share: float | None
) -> dict[str, list]:
    """Every conversation's samples (`tokenize_chat_samples`: one, or one per rewrite group when
    the template rewrites history), so a batch can come back with more rows than it had."""
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], THINKING_COLUMN: []}
    recorded = enable_thinking is not None or thinking_share is not None or THINKING_COLUMN in batch
    for index, messages in enumerate(batch[column]):
        own = batch[THINKING_COLUMN][index] if THINKING_COLUMN in batch else None
        thinking = conversation_thinking(messages, enable_thinking, thinking_share, own)
        tools = conversation_tools(batch[TOOLS_COLUMN][index]) if TOOLS_COLUMN in batch else None
        for sample in tokenize_chat_samples(tokenizer, messages, thinking, tools):
            rows["input_ids"].append(sample["input_ids"])
            rows["loss_mask"].append(sample["loss_mask"])
            rows[THINKING_COLUMN].append(thinking)
    if not recorded:  # no switch anywhere: the tokens alone, as before thinking could be mixed
        del rows[THINKING_COLUMN]
    return rows


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: datasets.Dataset,
    messages_column: str = "messages",
    enable_thinking: bool | None = None,
    num_proc: int | None = None,
    thinking_share: float | None = None,
) -> datasets.Dataset:
    """Token ids and loss masks of every conversation (several rows for one whose template rewrites
    its history), with the thinking switch each was rendered with when one is set anywhere
    (`enable_thinking`: a per-row column of the data, else `thinking_share`, else `enable_thinking`).
    A batched `datasets.map`, cached on disk under its fingerprint (a rerun reuses it) and spread
    over `num_proc` processes."""
    if messages_column not in conversations.column_names:
        raise ValueError(f"chat dataset has no '{messages_column}' column (columns: {conversations.column_names}).")
    return conversations.map(
        _tokenized,
        batched=True,
        fn_kwargs={
            "tokenizer": tokenizer,
            "column": messages_column,
            "enable_thinking": enable_thinking,
            "thinking_share": thinking_share,
        },
        remove_columns=conversations.column_names,
        num_proc=num_proc,
        desc="applying the chat template",
    )


# ---------------------------------------------------------------------------------------------
# Collation
# ---------------------------------------------------------------------------------------------


FEATURE_KEYS = ("target_hidden", "target_final_hidden")
THINKING_GROUPS = ("no_thinking", "thinking")  # a batch's `thinking` row values index these; -1: not recorded


def thinking_group(enable_thinking: bool | None) -> int:
    return -1 if enable_thinking is None else THINKING_GROUPS.index("thinking" if enable_thinking else "no_thinking")


class DFlashCollator:
    """Right-pads `input_ids` (pad id), `loss_mask` (0), and the stored target features
    `target_hidden` and `target_final_hidden` (0); adds `attention_mask` for rows of one sample,
    and `thinking` [b] (`thinking_group`) when the samples record their thinking switch, so an
    evaluation reports thinking on and off apart.

    Packed rows (`trainer.data.packing`) carry `position_ids` and get no `attention_mask`: their
    padding is one more document (positions from 0 again) that no other document sees, which is
    how transformers' packed-sequence masks keep documents apart (they apply only without a 2-D mask).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(sample["input_ids"]) for sample in samples]
        width = max(lengths)
        packed = "position_ids" in samples[0]
        batch = {
            "input_ids": torch.full((len(samples), width), self.pad_token_id, dtype=torch.long),
            "loss_mask": torch.zeros(len(samples), width, dtype=torch.long),
        }
        if packed:
            batch["position_ids"] = torch.zeros(len(samples), width, dtype=torch.long)
        else:
            batch["attention_mask"] = torch.zeros(len(samples), width, dtype=torch.long)
        features = [key for key in FEATURE_KEYS if key in samples[0]]
        for key in features:
            first = torch.as_tensor(samples[0][key])
            batch[key] = torch.zeros(len(samples), width, first.shape[-1], dtype=first.dtype)
        if THINKING_COLUMN in samples[0] and not packed:
            batch["thinking"] = torch.tensor([thinking_group(sample[THINKING_COLUMN]) for sample in samples])
        for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
            batch["input_ids"][row, :length] = torch.as_tensor(sample["input_ids"])
            batch["loss_mask"][row, :length] = torch.as_tensor(sample["loss_mask"])
            if packed:
                batch["position_ids"][row, :length] = torch.as_tensor(sample["position_ids"])
                batch["position_ids"][row, length:] = torch.arange(width - length)
            else:
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


def message_problem(message: Any, index: int) -> str | None:
    """Why message `index` cannot be rendered, or None: a known role, string content (an assistant
    turn that calls tools may have none), tool calls as a list of {name, arguments} functions."""
    if not isinstance(message, dict):
        return f"message {index} is a {type(message).__name__}, not a {{role, content}} mapping"
    role, content = message.get("role"), message.get("content")
    if role is None:
        return f"message {index} has no 'role'"
    if role not in KNOWN_ROLES:
        return f"message {index} has unknown role {role!r} (known: {', '.join(KNOWN_ROLES)})"
    calls = message.get("tool_calls")
    if calls is not None:
        problem = tool_calls_problem(calls, role, index)
        if problem is not None or content is None:
            return problem
    for key in ("reasoning_content", "reasoning"):
        if message.get(key) is not None and not isinstance(message[key], str):
            return f"message {index} has a {type(message[key]).__name__} '{key}', not a string"
    if content is None:
        return f"message {index} has no 'content'"
    if not isinstance(content, str):
        return f"message {index} has a {type(content).__name__} 'content', not a string"
    return None


def tool_calls_problem(calls: Any, role: str, index: int) -> str | None:
    """Why message `index`'s 'tool_calls' cannot be rendered, or None: only an assistant calls tools,
    each call a {name, arguments} function (or a {function: {...}} wrapper)."""
    if role != "assistant":
        return f"message {index} has 'tool_calls' but role {role!r} (only assistant turns call tools)"
    if not isinstance(calls, list) or not calls:
        return f"message {index} has 'tool_calls' that is not a non-empty list"
    for number, call in enumerate(calls):
        function = (call.get("function") or call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return f"message {index} tool call {number} has no function 'name'"
        if not isinstance(function.get("arguments"), str | dict):
            return f"message {index} tool call {number} has no 'arguments' (a JSON object or its string)"
    return None


def conversation_problem(messages: Any, column: str) -> str | None:
    """Why a chat template cannot render this row's conversation, or None."""
    if messages is None:
        return f"'{column}' is null"
    if not isinstance(messages, list) or not messages:
        return f"'{column}' must be a non-empty list of {{role, content}} messages"
    for index, message in enumerate(messages):
        problem = message_problem(message, index)
        if problem:
            return problem
    return None


def tools_problem(value: Any) -> str | None:
    """Why a row's `tools` cannot be offered to the template, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as error:
            return f"'{TOOLS_COLUMN}' is a string that is not JSON ({error})"
    if not isinstance(value, list):
        return f"'{TOOLS_COLUMN}' is a {type(value).__name__}, not a list of function schemas"
    for index, tool in enumerate(value):
        function = (tool.get("function") or tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"'{TOOLS_COLUMN}' item {index} is not a function schema with a 'name'"
    return None


def check_conversations(conversations: Iterable[Any], name: str, column: str) -> None:
    """Refuse the first conversation a template cannot render, naming its row (from 0) and field:
    the template itself fails with a jinja UndefinedError that names neither."""
    for row, messages in enumerate(conversations):
        problem = conversation_problem(messages, column)
        if problem:
            raise ValueError(f"dataset {name} row {row}: {problem}")


def check_chat_columns(raw: datasets.Dataset, name: str) -> None:
    """Refuse the first row whose `tools` or `enable_thinking` column cannot be used, naming it."""
    if TOOLS_COLUMN in raw.column_names:
        for row, value in enumerate(column_values(raw, TOOLS_COLUMN)):
            problem = tools_problem(value)
            if problem:
                raise ValueError(f"dataset {name} row {row}: {problem}")
    if THINKING_COLUMN in raw.column_names:
        for row, value in enumerate(column_values(raw, THINKING_COLUMN)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"dataset {name} row {row}: '{THINKING_COLUMN}' is {value!r}, not true, false or null")


def check_prompts(prompts: Iterable[Any], name: str, column: str) -> None:
    """Refuse the first prompt that is not a string, naming its row (from 0) and field."""
    for row, prompt in enumerate(prompts):
        if prompt is None:
            raise ValueError(f"dataset {name} row {row}: '{column}' is null")
        if not isinstance(prompt, str):
            raise ValueError(f"dataset {name} row {row}: '{column}' is a {type(prompt).__name__}, not a string")


def check_answerable(conversations: Iterable[Sequence[dict[str, str]]], name: str) -> None:
    """Refuse the first conversation the target cannot answer (it opens with an assistant turn),
    naming its row."""
    for row, messages in enumerate(conversations):
        try:
            answer_points(messages)
            if any(message.get("tool_calls") or message["role"] == "tool" for message in messages):
                raise ValueError(
                    "a conversation with tool calls cannot be regenerated (the tools are not run here): "
                    "set regenerate: false to train on it as written"
                )
        except ValueError as error:
            raise ValueError(f"dataset {name} row {row}: {error}") from None


def check_sample_counts(args) -> None:
    """Refuse sample counts that cannot mean anything, before any data is loaded."""
    if args.thinking_share is not None and args.enable_thinking is not None:
        raise ValueError(
            f"thinking_share={args.thinking_share} and enable_thinking={args.enable_thinking} are both set: "
            "thinking_share mixes thinking on and off, so unset enable_thinking"
        )
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
    except (DatasetGenerationError, pyarrow.ArrowException) as error:
        raise ValueError(data_file_problem(path, name, kind, error)) from None


def data_file_problem(path: Path, name: str, kind: str, error: BaseException) -> str:
    """One line on why `datasets` (pyarrow) could not read the data file `path`: its own message
    says neither file nor line (and its row numbers count from the start of a 10 MB block), so a
    JSON file's first line Python cannot parse, or whose field changes type, is looked up here."""
    cause = error.__cause__ or error.__context__ or error
    reason = " ".join(str(cause).split())[:300] or type(cause).__name__
    if kind == "parquet":
        return f"dataset {name} is not a readable Parquet file: {reason}"
    located = json_file_problem(path)
    if located:
        return f"dataset {name}: {located}"
    return f"dataset {name} cannot be read as JSON ({reason})"


JSON_KINDS = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}


def json_file_problem(path: Path) -> str | None:
    """Where a JSON / JSONL file goes wrong for a columnar reader, as "line N: ...": the first line
    that is not JSON (the whole file as one document when it is an array or object spread over
    lines), or the first row whose top-level field has another JSON type than on an earlier row.
    None when neither is found."""
    with path.open("rb") as file:
        head = file.read(4096).lstrip(UTF8_BOM + JSON_WHITESPACE)
    if head.startswith(b"["):
        try:
            json.loads(path.read_bytes().decode("utf-8-sig"))
        except ValueError as error:
            if isinstance(error, json.JSONDecodeError):
                return f"line {error.lineno} is not valid JSON ({error.msg} at column {error.colno})"
            return f"not valid JSON ({error})"
        return None
    first_kind: dict[str, tuple[str, int]] = {}
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            text = line.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            if not text:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                return f"line {number} is not valid JSON ({error.msg} at column {error.colno})"
            if not isinstance(row, dict):
                continue
            for field, value in row.items():
                kind = JSON_KINDS.get(type(value))
                if kind is None:  # null: compatible with every type
                    continue
                seen = first_kind.setdefault(field, (kind, number))
                if seen[0] != kind:
                    return f"line {number}: field {field!r} is {kind}, but {seen[0]} on line {seen[1]}"
    return None


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


def conversations_or_prompts(raw: datasets.Dataset, args) -> tuple[datasets.Dataset | None, Sequence | None]:
    """(chat dataset, None) to tokenize as is, or (None, conversations) for the target to answer,
    read lazily from `raw`; every row is validated first (streaming), so a bad one is named instead
    of failing in a template."""
    name, messages_column, prompt_column = args.dataset, args.messages_column, args.prompt_column
    if messages_column in raw.column_names:
        check_conversations(column_values(raw, messages_column), name, messages_column)
        check_chat_columns(raw, name)
        if not args.regenerate:
            return raw, None
        if TOOLS_COLUMN in raw.column_names or THINKING_COLUMN in raw.column_names:
            column = TOOLS_COLUMN if TOOLS_COLUMN in raw.column_names else THINKING_COLUMN
            raise ValueError(
                f"dataset {name} has a '{column}' column, which regeneration does not read (the target cannot run "
                "the tools; thinking is mixed with thinking_share): set regenerate: false to train on it as written"
            )
        check_answerable(column_values(raw, messages_column), name)
        return None, ConversationRows(raw, messages_column)
    if prompt_column in raw.column_names:
        if not args.regenerate:
            raise ValueError(f"dataset {name} has prompts only ('{prompt_column}'): regenerate must be true")
        check_prompts(column_values(raw, prompt_column), name, prompt_column)
        return None, ConversationRows(raw, prompt_column, args.system_prompt, prompts=True)
    raise ValueError(
        f"dataset {name} needs a '{messages_column}' or a '{prompt_column}' column; it has {raw.column_names}"
    )


def endpoint_settings(args) -> EndpointSettings | None:
    """Where the target answers: through `regenerate_endpoint` when set, else in process (None)."""
    if not args.regenerate_endpoint:
        if args.regenerate_model:
            raise ValueError("regenerate_model is set but regenerate_endpoint is not: set the endpoint's URL")
        return None
    if not args.regenerate:
        raise ValueError("regenerate_endpoint is set but regenerate is false: nothing would be regenerated")
    return EndpointSettings(
        url=args.regenerate_endpoint,
        model=args.regenerate_model,
        concurrency=args.regenerate_concurrency,
        timeout=args.regenerate_timeout,
        max_retries=args.regenerate_max_retries,
        chat_template_kwargs={} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking},
    )


def feature_endpoint_settings(args) -> FeatureEndpointSettings | None:
    """Where the features come from: the vLLM servers of `feature_endpoint` when set (stored first
    with `offline: true`, else streamed while training), else the target in process (None)."""
    if not args.feature_endpoint:
        if args.feature_model:
            raise ValueError("feature_model is set but feature_endpoint is not: set the endpoint's URL")
        return None
    endpoints = [
        EndpointSettings(
            url=url,
            model=args.feature_model,
            concurrency=args.feature_concurrency,
            timeout=args.feature_timeout,
            max_retries=args.feature_max_retries,
            keys="feature",
        )
        for url in args.feature_endpoint
    ]
    return FeatureEndpointSettings(endpoints, file_timeout=args.feature_file_timeout, storage=args.feature_storage_path)


def cache_root_of(args) -> Path:
    return Path(args.cache_dir) if args.cache_dir else default_cache_root()


def generation_settings(args) -> GenerationSettings:
    return GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        max_prompt_length=args.max_prompt_length,
        temperature=args.generation_temperature,
        top_p=args.generation_top_p,
        batch_size=args.generation_batch_size,
        enable_thinking=args.enable_thinking,
        thinking_share=args.thinking_share,
    )


def token_datasets(args, target: FrozenTarget | TargetTokenizer) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, eval or None) token datasets (`input_ids`, `loss_mask`), truncated and filtered.

    `args` is a `DataArguments`. Prompt-only sources (and chat sources with `regenerate`) are
    answered by the target, in process or through `regenerate_endpoint`; the last
    `num_eval_samples` prompts/conversations are held out. Through an endpoint the target's
    tokenizer is enough (`TargetTokenizer`).
    """
    check_sample_counts(args)
    cache_root = cache_root_of(args)
    settings, endpoint = generation_settings(args), endpoint_settings(args)
    conversations: Sequence  # the prompts or conversations the target answers (empty for a chat dataset)
    if args.dataset == "chitchat":
        if not args.regenerate:
            raise ValueError("dataset 'chitchat' holds prompts only: regenerate must be true")
        conversations, chat = [prompt_conversation(p, args.system_prompt) for p in chitchat_prompts()], None
    else:
        chat, prompts = conversations_or_prompts(load_raw_dataset(args.dataset, args.dataset_split), args)
        conversations = [] if prompts is None else prompts  # None with a chat dataset, which is tokenized as is
    check_held_out(args.num_eval_samples, len(conversations if chat is None else chat), args.dataset)
    train_name, eval_name = f"dataset {args.dataset} (train)", f"dataset {args.dataset} (eval)"

    def held_out(items: Sequence) -> tuple[Sequence, Sequence]:
        train, evaluation = split_held_out(items, args.num_eval_samples)
        return train[: args.num_train_samples] if args.num_train_samples else train, evaluation

    if chat is None:
        train_conversations, eval_conversations = held_out(conversations)
        train = regenerate(target, train_conversations, settings, cache_root, train_name, endpoint)
        evaluation = None
        if len(eval_conversations):
            evaluation = regenerate(target, eval_conversations, settings, cache_root, eval_name, endpoint)
    else:  # only the rows used are tokenized

        def tokenized(rows: Sequence[int]) -> datasets.Dataset:
            return tokenize_conversations(
                target.require_tokenizer(),
                chat.select(rows),
                args.messages_column,
                args.enable_thinking,
                args.dataset_num_proc,
                args.thinking_share,
            )

        train_rows, eval_rows = held_out(range(len(chat)))
        train = tokenized(train_rows)
        evaluation = tokenized(eval_rows) if len(eval_rows) else None

    def usable(dataset: datasets.Dataset, name: str) -> datasets.Dataset:
        """The token columns, and which thinking switch each sample was rendered with (when recorded)."""
        kept = ["input_ids", "loss_mask"] + [THINKING_COLUMN] * (THINKING_COLUMN in dataset.column_names)
        columns = dataset.select_columns(kept)
        return truncate_and_filter(columns, args.max_length, name, args.dataset_num_proc)

    return usable(train, train_name), None if evaluation is None else usable(evaluation, eval_name)


def build_datasets(args, target: FrozenTarget | TargetTokenizer, layer_ids: Sequence[int], final_hidden: bool = False):
    """(train, eval or None) tokenized datasets (`token_datasets`), or datasets joined with the
    target's features: stored offline (with the target's final hidden states too when
    `final_hidden`, for distillation), captured in process or, with `feature_endpoint`, through vLLM
    servers (where the target's tokenizer is enough: `TargetTokenizer`); or, with `feature_endpoint`
    and `offline: false`, streamed from the servers while training (`StreamedFeatures`, in the dtype
    of the target's embedding)."""
    engine = feature_endpoint_settings(args)
    if engine is not None:
        check_engine_layers(layer_ids, target.num_layers, final_hidden)
    train, evaluation = token_datasets(args, target)
    if engine is not None and not args.offline:
        layout = EngineLayout(tuple(int(layer_id) for layer_id in layer_ids), target.hidden_size)
        if not isinstance(target, FrozenTarget):  # the features stream in the dtype of its loaded embedding
            raise ValueError("feature_endpoint with offline: false streams while training, which loads the target")
        source = StreamSource.open(engine, target.require_tokenizer(), layout, target.embedding_weight.dtype)
        return StreamedFeatures(train, source), None if evaluation is None else StreamedFeatures(evaluation, source)
    if args.offline:
        dtype = store_dtype(args.offline_dtype)

        def offline(tokens: datasets.Dataset) -> OfflineDataset:
            if engine is not None:
                store = prepare_engine_features(engine, target, tokens, layer_ids, cache_root_of(args), dtype)
            elif not isinstance(target, FrozenTarget):  # captured in process: the weights run here
                raise ValueError("offline features without feature_endpoint are captured by the loaded target")
            else:
                store = prepare_features(
                    target, tokens, layer_ids, cache_root_of(args), dtype, final_hidden=final_hidden
                )
            return OfflineDataset(tokens, store, store_fingerprint(target, layer_ids, dtype, final_hidden))

        train = offline(train)
        if evaluation is not None:
            evaluation = offline(evaluation)
    return train, evaluation
