"""Issue 31, feature stores: a shard whose values keep their statistics (negated, rows reversed) is
refused by its sha256; a store joined to other token data is named by its stored token ids; a
capture killed mid-way leaves nothing the next capture keeps; an unknown dtype is one line."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import feature_store_helpers
from tests.support.feature_store_helpers import read_all, refusal, store, token_dataset
from trainer.data.feature_store import (
    FEATURE_INDEX,
    FeatureStoreError,
    OfflineDataset,
    ShardWriter,
    feature_store_path,
    store_fingerprint,
    tensor_statistics,
)
from trainer.locks import entry_lock_file, lock_cache_entry

REPO = Path(__file__).resolve().parents[2]


def file_sha256(path: Path) -> str:
    """The file's sha256 read whole: a second, plain implementation to check the stores against."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# the module-scoped fixtures shared with the other feature-store tests
target = feature_store_helpers.target
tokens = feature_store_helpers.tokens


def test_a_negated_shard_with_reversed_rows_is_refused_by_its_sha256(target, tokens, tmp_path):
    """Negating values and reversing token rows keep every RMS and max |x|: only the digest sees it."""
    path = store(target, tokens, tmp_path, final_hidden=True)
    shard = path / "shard-00000.safetensors"
    tensors = load_file(shard)
    for name in ("sample_0", "sample_1", "final_0", "final_1"):
        changed = -tensors[name].flip(0)
        assert tensor_statistics(changed) == pytest.approx(tensor_statistics(tensors[name]))
        tensors[name] = changed.contiguous()
    save_file(tensors, shard)
    dataset = OfflineDataset(tokens, path, store_fingerprint(target, [2, 1], torch.float32, True))
    dataset[2]  # the other shards are whole
    message = refusal(dataset, 1)
    assert re.fullmatch(
        rf"feature store {re.escape(str(path))}: {re.escape(str(shard))} has sha256 [0-9a-f]{{16}}\.\.\., but "
        rf"[0-9a-f]{{16}}\.\.\. when it was written \(its content changed after capture\): "
        rf"delete {re.escape(str(path))} to capture again",
        message,
    ), message
    assert refusal(OfflineDataset(tokens, path), 0) == message  # any sample of the shard, any reader


def test_the_sha256_is_of_the_file_written_and_a_damaged_sample_is_still_named(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path)
    index = json.loads((path / FEATURE_INDEX).read_text())
    assert index["format"] == 3
    for shard in index["shards"]:
        assert shard["sha256"] == file_sha256(path / shard["file"])
    shard = path / "shard-00001.safetensors"
    tensors = load_file(shard)
    tensors["sample_3"] = tensors["sample_3"] * 3
    save_file(tensors, shard)
    # sample 2 is read first, but the digest check finds and names the sample to blame
    message = refusal(OfflineDataset(tokens, path), 2)
    assert message.startswith(f"feature store {path}: {shard} sample 3: sample_3 has RMS "), message


def test_a_store_joined_to_other_token_ids_names_the_sample_and_position(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path)
    assert torch.equal(
        load_file(path / "shard-00000.safetensors")["tokens_1"], torch.tensor(tokens[1]["input_ids"])
    )  # the ids the features were computed from
    vocabulary = target.tokenizer.vocab_size

    def changed(sample, index):
        ids = list(sample["input_ids"])
        if index == 3:
            ids[4] = (ids[4] + 1) % vocabulary
        return {"input_ids": ids}

    other = tokens.map(changed, with_indices=True)
    dataset = OfflineDataset(other, path)
    dataset[2]
    assert refusal(dataset, 3) == (
        f"feature store {path}: {path / 'shard-00001.safetensors'} sample 3: the token ids stored with its "
        f"features differ from the dataset's at position 4 ({len(other[3]['input_ids'])} stored, "
        f"{len(other[3]['input_ids'])} in the dataset): it was captured for other data: delete {path} to capture again"
    )


def test_a_store_from_before_digests_is_read_with_a_warning(target, tokens, tmp_path, caplog):
    path = store(target, tokens, tmp_path)
    index = json.loads((path / FEATURE_INDEX).read_text())
    for shard in index["shards"]:
        del shard["sha256"]
    index["format"] = 2
    (path / FEATURE_INDEX).write_text(json.dumps(index))
    read_all(OfflineDataset(tokens, path))
    assert "written before stores recorded a sha256 per shard" in caplog.text
    index["shards"][0]["sha256"] = "abc"
    (path / FEATURE_INDEX).write_text(json.dumps(index))
    with pytest.raises(FeatureStoreError, match=r"is not a valid feature index \(ValueError: shard shard-00000"):
        OfflineDataset(tokens, path)


def test_shards_journaled_before_digests_are_hashed_when_resumed(tmp_path):
    """An engine capture resumed from a journal of the previous format still records every sha256."""
    journal: list[dict] = []
    writer = ShardWriter(tmp_path, tmp_path, 4, 2, on_shard=journal.append)
    for sample in range(2):
        writer.add(sample, torch.full((3, 4), float(sample + 1)), token_ids=[1, 2, 3])
    old = [{key: value for key, value in shard.items() if key != "sha256"} for shard in journal]
    resumed = ShardWriter(tmp_path, tmp_path, 4, 2, old)
    assert resumed.shards[0]["sha256"] == journal[0]["sha256"] == file_sha256(tmp_path / "shard-00000.safetensors")
    with pytest.raises(ValueError, match=r"^sample 2: 3 feature rows for 2 token ids$"):
        resumed.add(2, torch.ones(3, 4), token_ids=[1, 2])


def test_an_unknown_dtype_is_one_line(target, tokens, tmp_path):
    expected = r"^offline_dtype: int8 is not a dtype a feature store holds \(one of float32, bfloat16, float16\)$"
    with pytest.raises(ValueError, match=expected):
        store(target, tokens, tmp_path, dtype=torch.int8)
    with pytest.raises(ValueError, match=expected):
        ShardWriter(tmp_path, tmp_path, 1, 1).add(0, torch.ones(2, 2, dtype=torch.int8))
    assert not (tmp_path / "features").exists()  # refused before anything was written


CAPTURE = """
import sys, time
import datasets
from tests.support.tiny_target import tiny_conversations, tiny_target
from trainer.data.chat import tokenize_chat
from trainer.data.feature_store import prepare_features

target = tiny_target()
conversations = datasets.Dataset.from_dict({"messages": tiny_conversations(9)})
tokens = conversations.map(lambda s: tokenize_chat(target.tokenizer, s["messages"]), remove_columns=["messages"])
capture = target.capture
calls = []

def slow_capture(*args, **kwargs):
    calls.append(1)
    if len(calls) > 2:
        time.sleep(60)  # the test kills it here, after two shards are written
    return capture(*args, **kwargs)

target.capture = slow_capture
prepare_features(target, tokens, [2, 1], sys.argv[1], batch_size=2, shard_samples=2)
"""


def staging_folders(entry: Path) -> list[Path]:
    return [path for path in entry.parent.glob(f".{entry.name}.*") if path.is_dir()]


@pytest.mark.slow
def test_a_killed_capture_is_removed_by_the_next_capture_of_its_entry(target, tmp_path, caplog):
    """A capture SIGKILLed mid-way leaves its temporary folder; the next capture in the cache removes
    it (under the entry's lock) and writes a store equal to a clean capture. It removes another
    entry's dead folder too, but never one whose entry is locked by a live writer."""
    cache = tmp_path / "cache"
    tokens = token_dataset(target, 9)
    entry = feature_store_path(target, tokens, [2, 1], cache)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    environment.pop("TORCHELASTIC_RUN_ID", None)
    capture = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CAPTURE), str(cache)], cwd=REPO, env=environment)
    try:
        deadline = time.monotonic() + 180
        while not any((folder / "shard-00001.safetensors").exists() for folder in staging_folders(entry)):
            assert capture.poll() is None and time.monotonic() < deadline, "the capture never wrote two shards"
            time.sleep(0.05)
    finally:
        capture.send_signal(signal.SIGKILL)
        capture.wait()
    [leftover] = staging_folders(entry)
    assert not entry.exists() and sorted(p.name for p in leftover.iterdir()) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    dead, live = (cache / "features" / f".{digit * 20}.abcdefgh" for digit in "01")  # other entries' folders
    for folder in (dead, live):
        folder.mkdir()
        (folder / "shard-00000.safetensors").write_bytes(b"another entry")
    writer = lock_cache_entry(cache / "features" / ("1" * 20), "feature store").acquire()  # a live writer of one
    try:
        assert store(target, tokens, cache) == entry
    finally:
        writer.release()
    assert staging_folders(entry) == []
    assert f"Removing {leftover} (" in caplog.text and "partial feature store of an interrupted capture" in caplog.text
    assert f"Removing {dead} (" in caplog.text
    assert sorted(p.name for p in entry.parent.iterdir()) == sorted(
        [
            entry.name,
            live.name,
            *(entry_lock_file(cache / "features" / name).name for name in (entry.name, "0" * 20, "1" * 20)),
        ]
    )
    clean = store(target, tokens, tmp_path / "clean")
    assert sorted(p.name for p in entry.iterdir()) == sorted(p.name for p in clean.iterdir())
    for file in clean.iterdir():
        assert (entry / file.name).read_bytes() == file.read_bytes(), file.name
    read_all(OfflineDataset(tokens, entry, store_fingerprint(target, [2, 1], torch.float32, False)))


def test_an_engine_capture_stores_token_ids_and_digests_and_removes_a_killed_in_process_capture(
    target, tokens, tmp_path, monkeypatch
):
    """Engine captures write through the same ShardWriter: shard digests and token ids are recorded
    there too; the partial store of a killed in-process capture of the entry (say, out of memory,
    before switching to a feature_endpoint) is removed. The server is replaced by the tiny target."""
    from trainer.data import engine_features
    from trainer.data.endpoint import EndpointSettings

    async def capture_through_engine(*arguments):
        writer = next(argument for argument in arguments if isinstance(argument, ShardWriter))
        for row in next(argument for argument in arguments if isinstance(argument, list)):
            ids = tokens[row]["input_ids"]
            hidden = target.capture(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), [2, 1])
            writer.add(row, hidden[0], token_ids=ids)

    monkeypatch.setattr(engine_features, "_capture_through_engine", capture_through_engine)
    entry = feature_store_path(target, tokens, [2, 1], tmp_path)
    leftover = entry.with_name(f".{entry.name}.k1lled00")
    leftover.mkdir(parents=True)
    (leftover / "shard-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "storage").mkdir()
    settings = engine_features.FeatureEndpointSettings(
        EndpointSettings(url="http://127.0.0.1:9/v1", keys="feature"), storage=tmp_path / "storage"
    )
    path = engine_features.prepare_engine_features(settings, target, tokens, [2, 1], tmp_path, shard_samples=2)
    assert path == entry and not leftover.exists()
    index = json.loads((path / FEATURE_INDEX).read_text())
    assert [shard["sha256"] for shard in index["shards"]] == [
        file_sha256(path / shard["file"]) for shard in index["shards"]
    ]
    assert torch.equal(load_file(path / "shard-00001.safetensors")["tokens_3"], torch.tensor(tokens[3]["input_ids"]))
    read_all(OfflineDataset(tokens, path, store_fingerprint(target, [2, 1], torch.float32, False)))
