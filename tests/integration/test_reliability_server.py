"""Issue 31 (Deliver 2, and 7 for regeneration): nothing a server names is trusted, every wait on a
server ends by the configured deadline, cached answers are keyed by the model the server reports,
a data file's error names the file and line, and an interrupted journal append leaves nothing torn.

A fake vLLM feature server (below) writes real safetensors files and names them in its replies;
a hostile one names other paths. The regeneration faults use the loopback server of the tests."""

from __future__ import annotations

import asyncio
import email.utils
import fcntl
import json
import os
import re
import time
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import save_file

from benchmarks.openai_loopback import LoopbackOpenAI
from tests.support.fake_vllm_features import FakeFeatureServer
from tests.support.tiny_target import tiny_target
from trainer.data import response_journal
from trainer.data.endpoint import EndpointClient, EndpointError, EndpointSettings
from trainer.data.engine_features import prepare_engine_features
from trainer.data.engine_files import read_hidden_states
from trainer.data.engine_servers import FeatureEndpointSettings
from trainer.data.feature_store import FEATURE_INDEX
from trainer.data.regeneration import GenerationSettings, prompt_conversation, regenerate
from trainer.data.response_journal import ResponseJournal

LAYER_IDS = [0, 1]  # vLLM's ids 1 and 2: two layers per file
CONVERSATIONS = [prompt_conversation("hello"), prompt_conversation("tell me about the weather today")]
SETTINGS = GenerationSettings(max_new_tokens=4, batch_size=1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def token_rows(count: int = 3) -> datasets.Dataset:
    rows = [[5 + index, 6, 7, 8 + index] for index in range(count)]
    return datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(row) for row in rows]})


def feature_settings(server, storage: Path) -> FeatureEndpointSettings:
    endpoint = EndpointSettings(url=server.url, keys="feature", concurrency=1, timeout=5, max_retries=0)
    return FeatureEndpointSettings(endpoint, file_timeout=2.0, storage=storage)


def test_engine_files_in_the_storage_folder_are_read_and_removed(target, tmp_path: Path):
    storage = tmp_path / "storage"
    storage.mkdir()
    with FakeFeatureServer(storage, 2, target.hidden_size) as server:
        store = prepare_engine_features(
            feature_settings(server, storage), target, token_rows(), LAYER_IDS, tmp_path / "cache"
        )
    assert (store / FEATURE_INDEX).exists()
    assert sorted(path.name for path in storage.iterdir()) == []  # every file and lock consumed
    assert len(server.written) == 1 + 3  # the probe and three samples


@pytest.mark.parametrize("case", ["outside", "dot-dot", "relative", "not-safetensors"])
def test_a_reply_naming_a_file_outside_the_storage_folder_removes_nothing(target, tmp_path: Path, case):
    """The probe of issue 31: a reply naming …/victim/poetry deleted the user's poetry.lock."""
    storage, victim = tmp_path / "storage", tmp_path / "victim"
    storage.mkdir()
    victim.mkdir()
    for name in ("poetry", "poetry.lock", "poetry.safetensors", "poetry.safetensors.lock"):
        (victim / name).write_text("the user's")
    (storage / "notes").write_text("the server's other file")
    named = {
        "outside": str(victim / "poetry"),
        "dot-dot": f"{storage}/../victim/poetry.safetensors",
        "relative": "poetry.safetensors",
        "not-safetensors": str(storage / "notes"),
    }[case]
    server = FakeFeatureServer(storage, 2, target.hidden_size, hostile=lambda path, kind: named)
    with server, pytest.raises(EndpointError) as error:
        prepare_engine_features(feature_settings(server, storage), target, token_rows(), LAYER_IDS, tmp_path / "cache")
    message = str(error.value)
    assert "\n" not in message
    assert f"named the hidden-state file {named!r}" in message
    assert f"not a .safetensors file directly in feature_storage_path {storage}" in message
    assert sorted(path.name for path in victim.iterdir()) == [
        "poetry",
        "poetry.lock",
        "poetry.safetensors",
        "poetry.safetensors.lock",
    ]
    assert (storage / "notes").read_text() == "the server's other file"


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_a_named_file_that_is_not_a_regular_file_is_refused_at_once(target, tmp_path: Path, kind):
    """Inside the folder, but a link to the user's file, a folder, or a FIFO (which would block a
    reader forever): one line, quickly, and the link's target is untouched."""
    storage, victim = tmp_path / "storage", tmp_path / "victim.safetensors"
    storage.mkdir()
    victim.write_text("the user's")
    odd = storage / "odd.safetensors"
    if kind == "symlink":
        odd.symlink_to(victim)
    elif kind == "folder":
        odd.mkdir()
    else:
        os.mkfifo(odd)
    Path(f"{odd}.lock").touch()

    def hostile(path: str, request: str) -> str:
        return str(odd) if request == "sample" else path

    started = time.monotonic()
    server = FakeFeatureServer(storage, 2, target.hidden_size, hostile=hostile)
    with server, pytest.raises(EndpointError) as error:
        prepare_engine_features(feature_settings(server, storage), target, token_rows(), LAYER_IDS, tmp_path / "cache")
    assert time.monotonic() - started < 10
    what = {"symlink": "a symbolic link", "folder": "a folder", "fifo": "a special file"}[kind]
    assert f"{odd} is {what}, not a regular file" in str(error.value)
    assert "\n" not in str(error.value)
    assert victim.read_text() == "the user's"


def test_a_file_larger_than_its_request_can_be_is_refused_unread(tmp_path: Path):
    path = tmp_path / "request.safetensors"
    save_file(
        {"hidden_states": torch.zeros(4, 2, 8), "token_ids": torch.arange(4), "padding": torch.zeros(1 << 18)}, path
    )
    Path(f"{path}.lock").touch()
    with pytest.raises(EndpointError, match=r"request\.safetensors holds \d+ bytes, more than the 4096 its request"):
        asyncio.run(asyncio.wait_for(read_hidden_states(str(path), 5.0, HangingNudger(), "f", max_bytes=4096), 20))


def test_feature_endpoint_without_a_storage_folder_is_refused_naming_the_key():
    endpoint = EndpointSettings(url="http://h/v1", keys="feature")
    with pytest.raises(ValueError, match="feature_endpoint needs feature_storage_path: the folder the server writes"):
        FeatureEndpointSettings(endpoint)


# ---------------------------------------------------------------------------------------------
# Waits on a server end by the deadline; messages say what is true of a file that has not come
# ---------------------------------------------------------------------------------------------


def retried_answer(settings: EndpointSettings, bound: float = 30.0):
    """One chat answer through the client (retries and all), cut off by the test at `bound` s."""

    async def ask():
        async with EndpointClient(settings) as client:
            client.model = "tiny-target"
            return await client.answer(CONVERSATIONS[0], max_tokens=2, temperature=0.0, top_p=1.0, seed=None)

    return asyncio.run(asyncio.wait_for(ask(), bound))


@pytest.mark.parametrize("header", ["100000", "http-date"])
def test_a_retry_after_is_honoured_within_the_deadline_and_ends_the_call_past_it(target, header):
    """Issue 31: `Retry-After: 100000` with regenerate_timeout 5 and one retry slept on (killed at
    150 s). The call's deadline is 2 attempts of 5 s and the 0.01 s backoff between them."""
    with LoopbackOpenAI(target) as server:
        server.busy_for, server.retry_after = 1, "0.5"  # fits: honoured, then answered
        started = time.monotonic()
        answer = retried_answer(EndpointSettings(url=server.url, timeout=5, max_retries=1, backoff=0.01))
        assert time.monotonic() - started >= 0.5 and answer.text and server.requests == 2
    with LoopbackOpenAI(target) as server:
        server.busy_for = 10
        server.retry_after = (
            email.utils.formatdate(time.time() + 100000, usegmt=True) if header == "http-date" else header
        )
        settings = EndpointSettings(url=server.url, timeout=5, max_retries=1, backoff=0.01)
        started = time.monotonic()
        with pytest.raises(EndpointError) as error:
            retried_answer(settings)
    assert time.monotonic() - started < 5
    message = str(error.value)
    assert "still failing after 1 attempts (HTTP 429" in message
    asked = re.search(r"; it asks to retry after ([0-9.]+) s, past this call's deadline of 10.01 s", message)
    assert asked and float(asked.group(1)) > 99_000, message
    assert "\n" not in message


class HangingNudger:
    """A nudge whose request never comes back (a server that accepts and never answers)."""

    async def nudge(self) -> None:
        await asyncio.sleep(1000)


def held_lock(path: str) -> int:
    descriptor = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    return descriptor


def test_the_wait_for_a_file_ends_by_feature_file_timeout_even_while_a_nudge_hangs(tmp_path: Path):
    path = str(tmp_path / "request.safetensors")
    lock = held_lock(path)
    started = time.monotonic()
    try:
        with pytest.raises(EndpointError, match=r"not written within feature_file_timeout=0\.5 s"):
            asyncio.run(asyncio.wait_for(read_hidden_states(path, 0.5, HangingNudger(), "feature_endpoint"), 20))
    finally:
        os.close(lock)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("state", "truth"),
    [
        ("locked, not written", "it does not exist yet, and its lock file is still locked by the server"),
        ("locked, written", "it exists but is still locked by the server"),
        ("released, not written", "its lock is released but the file does not exist: the server did not write it"),
        ("written, no lock", "it exists but has no lock file"),
        ("nothing", "neither it nor its lock file exists on this machine"),
    ],
)
def test_a_file_that_has_not_come_is_described_as_it_is(tmp_path: Path, state, truth):
    """Issue 31: "exists but is still locked" was said of a file that neither existed nor was locked."""
    path = str(tmp_path / "request.safetensors")
    lock = held_lock(path) if state.startswith("locked") else None
    if state.startswith("released"):
        Path(path + ".lock").touch()
    if state.endswith(", written") or state == "written, no lock":
        Path(path).write_bytes(b"half a file")
    try:
        with pytest.raises(EndpointError) as error:
            asyncio.run(asyncio.wait_for(read_hidden_states(path, 0.3, HangingNudger(), "feature_endpoint"), 20))
    finally:
        if lock is not None:
            os.close(lock)
    assert f"was not written within feature_file_timeout=0.3 s ({truth}" in str(error.value)


# ---------------------------------------------------------------------------------------------
# Cached answers are keyed by the model the server reports
# ---------------------------------------------------------------------------------------------


def fast(server: LoopbackOpenAI, **overrides) -> EndpointSettings:
    values = {"url": server.url, "concurrency": 2, "backoff": 0.01, "max_backoff": 0.05, "max_retries": 2}
    return EndpointSettings(**{**values, **overrides})


def test_a_server_switched_to_another_model_is_asked_again(target, tmp_path: Path):
    """Issue 31: with regenerate_model unset, model-A's cached answers were reused from model-B."""
    with LoopbackOpenAI(target, model_name="model-a") as first:
        regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(first))
    with LoopbackOpenAI(target, model_name="model-b") as second:
        regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(second))
    assert second.completions == 1 + len(CONVERSATIONS)  # the probe, then every conversation
    with LoopbackOpenAI(target, model_name="model-b") as renamed_weights:
        renamed_weights.model_root = "/models/other-weights"  # the same name, other weights
        regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(renamed_weights))
    assert renamed_weights.completions == 1 + len(CONVERSATIONS)
    with LoopbackOpenAI(target, model_name="model-b") as again:
        again.model_root = "/models/other-weights"
        regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(again))
    assert again.completions == 0  # the same served model: its answers are reused
    entries = [path for path in (tmp_path / "generated").iterdir() if (path / "dataset_info.json").exists()]
    assert len(entries) == 3


def test_answers_are_reused_once_the_server_is_gone(target, tmp_path: Path, caplog):
    """docs/regeneration.md: prepare --regenerate-only, then train: "the server may be gone"."""
    with LoopbackOpenAI(target, model_name="model-a") as server:
        answered = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
        gone = fast(server, max_retries=8, backoff=5.0)  # retries would take minutes
    started = time.monotonic()
    reused = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=gone)
    assert time.monotonic() - started < 10
    assert reused["input_ids"] == answered["input_ids"]
    assert "reusing the answers served model 'model-a'" in caplog.text


# ---------------------------------------------------------------------------------------------
# Data files: pyarrow's errors name the file and the line
# ---------------------------------------------------------------------------------------------


def test_a_data_file_pyarrow_cannot_read_is_named_with_its_line(tmp_path: Path):
    from trainer.data.dataset import load_data_file

    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    broken = tmp_path / "broken.jsonl"
    broken.write_text(f'{good}\n{good}\n{{"messages": [}}\n{good}\n')
    with pytest.raises(ValueError, match=r"^dataset broken\.jsonl: line 3 is not valid JSON \(Expecting value"):
        load_data_file(broken, "broken.jsonl")

    # a field that changes type after the first block pyarrow infers the schema from (10 MB)
    typed = tmp_path / "typed.jsonl"
    with typed.open("w") as file:
        for index in range(100_000):
            file.write(json.dumps({"a": index, "b": "y" * 100}) + "\n")
        file.write(json.dumps({"a": "abc", "b": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"^dataset typed\.jsonl: line 100001: field 'a' is a string, but a number"):
        load_data_file(typed, "typed.jsonl")

    import pyarrow
    import pyarrow.parquet

    parquet = tmp_path / "damaged.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"a": [f"row {i}" for i in range(5000)]}), parquet, compression="NONE")
    data = bytearray(parquet.read_bytes())
    data[100:2000] = b"\xab" * 1900  # the data pages; the footer stays readable
    parquet.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"^dataset damaged\.parquet is not a readable Parquet file: "):
        load_data_file(parquet, "damaged.parquet")


# ---------------------------------------------------------------------------------------------
# An interrupted journal append leaves nothing torn
# ---------------------------------------------------------------------------------------------


def test_ctrl_c_in_the_middle_of_a_journal_append_leaves_no_half_record(tmp_path: Path, monkeypatch, caplog):
    path = tmp_path / "answers.journal.jsonl"
    record = {"row": 1, "turns": [{"text": "hello there", "ids": [5, 6, 7]}]}
    with ResponseJournal(path, 4, 50) as journal:
        journal.append({"row": 0, "turns": [{"text": "hi", "ids": [5]}]})
        whole = path.read_bytes()
        real = response_journal.os.write

        def interrupted(descriptor: int, data) -> int:
            real(descriptor, bytes(data[:10]))  # part of the record reaches the file, then Ctrl-C
            raise KeyboardInterrupt

        with monkeypatch.context() as patched:
            patched.setattr(response_journal.os, "write", interrupted)
            with pytest.raises(KeyboardInterrupt):
                journal.append(record)
        assert path.read_bytes() == whole  # cut back to the last whole record
        journal.append(record)  # the same run (or the next) appends after it
    with ResponseJournal(path, 4, 50) as reopened:
        assert sorted(reopened.offsets) == [0, 1]
    assert "dropped" not in caplog.text
