"""trainer.data.feature_store: a damaged, foreign or half-written feature store is one error naming the
shard, the sample and the cache entry; one process writes an entry; a full disk keeps nothing."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import feature_store_helpers
from tests.support.feature_store_helpers import read_all, refusal, store, token_dataset
from trainer.data import feature_store
from trainer.data.feature_store import (
    FEATURE_INDEX,
    FeatureStoreError,
    OfflineDataset,
    feature_store_path,
    prepare_features,
    store_fingerprint,
)
from trainer.fileio import DiskFullError
from trainer.locks import FolderInUseError, entry_lock_file, lock_cache_entry
from trainer.models.target import TargetSource, _load_gguf_through_cache

REPO = Path(__file__).resolve().parents[2]
# the module-scoped fixtures shared with the other feature-store tests
target = feature_store_helpers.target
tokens = feature_store_helpers.tokens


def rewrite_shard(path: Path, name: str, change) -> Path:
    """Replace tensor `name` of shard `path` by `change(tensor)` (a valid safetensors file again)."""
    tensors = load_file(path)
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, path)
    return path


def test_the_store_records_its_fingerprint_and_per_sample_statistics(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path, final_hidden=True)
    index = json.loads((path / FEATURE_INDEX).read_text())
    assert index["store"] == {
        "target": target.fingerprint(),
        "layer_ids": [2, 1],
        "dtype": "float32",
        "hidden_size": 32,
        "final_hidden": True,
    }
    first = index["shards"][0]
    assert first["samples"] == [0, 1] and first["tokens"] == [len(tokens[0]["input_ids"]), len(tokens[1]["input_ids"])]
    hidden = load_file(path / first["file"])["sample_1"]
    rms, max_abs, final_rms, final_max = first["statistics"][1]
    assert rms == pytest.approx(float(hidden.double().square().mean().sqrt()), rel=1e-6)
    assert max_abs == float(hidden.abs().max()) and final_rms > 0 and final_max > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_whole_store_reads_without_alarm_in_every_dtype(target, tokens, tmp_path, dtype):
    path = store(target, tokens, tmp_path, dtype=dtype, final_hidden=True)
    dataset = OfflineDataset(tokens, path, store_fingerprint(target, [2, 1], dtype, True))
    read_all(dataset)
    assert dataset[3]["target_hidden"].dtype == dtype and bool(dataset._checked.all())


@pytest.mark.parametrize(
    ("name", "change", "problem"),
    [
        (
            "sample_1",
            torch.zeros_like,
            r"sample_1 has RMS 0 and max \|x\| 0, but [\d.]+ and [\d.]+ when it was captured",
        ),
        (
            "sample_1",
            lambda t: t * 1e6,
            r"sample_1 has RMS [\d.e+]+ and max \|x\| [\d.e+]+, but [\d.]+ and [\d.]+ when",
        ),
        ("final_1", lambda t: t * 1e6, r"final_1 has RMS [\d.e+]+ and max \|x\| [\d.e+]+, but [\d.]+ and [\d.]+ when"),
        ("sample_1", lambda t: t.index_fill(0, torch.tensor([2]), float("nan")), r"sample_1 holds non-finite values"),
        ("final_1", lambda t: t.index_fill(0, torch.tensor([0]), float("inf")), r"final_1 holds non-finite values"),
        ("sample_1", lambda t: t.half(), r"sample_1 is stored as F16, the store holds float32"),
        ("sample_1", lambda t: t[:-1], r"sample_1 has shape \[\d+, 64\], expected \[\d+, 64\]"),
        ("sample_1", lambda t: t[:, :32], r"sample_1 has shape \[\d+, 32\], expected \[\d+, 64\]"),
    ],
    ids=["zeros", "scaled", "scaled final", "nan", "inf final", "float16", "fewer rows", "narrower"],
)
def test_a_damaged_shard_names_the_shard_the_sample_and_the_entry(target, tokens, tmp_path, name, change, problem):
    path = store(target, tokens, tmp_path, final_hidden=True)
    shard = rewrite_shard(path / "shard-00000.safetensors", name, change)
    dataset = OfflineDataset(tokens, path, store_fingerprint(target, [2, 1], torch.float32, True))
    dataset[3]  # other shards are not affected
    message = refusal(dataset, 1)
    pattern = f"feature store {re.escape(str(path))}: {re.escape(str(shard))} sample 1: {problem}.*"
    assert re.fullmatch(pattern + f": delete {re.escape(str(path))} to capture again", message), message


def test_a_missing_tensor_is_named(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path)
    shard = path / "shard-00001.safetensors"
    tensors = load_file(shard)
    del tensors["sample_3"]
    save_file(tensors, shard)
    assert refusal(OfflineDataset(tokens, path), 2) == (
        f"feature store {path}: {shard} sample 3: tensor sample_3 is missing: delete {path} to capture again"
    )


def test_a_truncated_shard_is_named_before_it_is_opened(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path)
    shard = path / "shard-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    message = refusal(OfflineDataset(tokens, path), 4)
    assert message.startswith(f"feature store {path}: {shard} is truncated or corrupt: header says ")
    assert message.endswith(f": delete {path} to capture again")


def test_a_store_for_another_run_is_refused_when_opened(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path)
    expected = store_fingerprint(target, [2, 1], torch.float32, False)
    OfflineDataset(tokens, path, expected)
    wrong = expected | {"layer_ids": [1, 2], "hidden_size": 64, "dtype": "bfloat16"}
    with pytest.raises(FeatureStoreError) as caught:
        OfflineDataset(tokens, path, wrong)
    assert str(caught.value) == (
        f"feature store {path}: it was captured for layer_ids [2, 1] (this run: [1, 2]), dtype float32 "
        f"(this run: bfloat16), hidden_size 32 (this run: 64): delete {path} to capture again"
    )


def test_a_store_from_before_the_checks_is_still_read_and_its_zeros_are_caught(target, tokens, tmp_path, caplog):
    path = store(target, tokens, tmp_path)
    index = json.loads((path / FEATURE_INDEX).read_text())
    for key in ("format", "store"):
        del index[key]
    index["shards"] = [{"file": shard["file"], "samples": shard["samples"]} for shard in index["shards"]]
    (path / FEATURE_INDEX).write_text(json.dumps(index))
    read_all(OfflineDataset(tokens, path, store_fingerprint(target, [2, 1], torch.float32, False)))
    assert "written before stores recorded their statistics" in caplog.text
    shard = rewrite_shard(path / "shard-00000.safetensors", "sample_0", torch.zeros_like)
    assert refusal(OfflineDataset(tokens, path), 0) == (
        f"feature store {path}: {shard} sample 0: sample_0 is all zeros: delete {path} to capture again"
    )


def test_disk_full_during_capture_says_how_much_was_captured_and_keeps_nothing(target, tokens, tmp_path, monkeypatch):
    real_write = feature_store.write_shard
    calls = []

    def write_shard(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, tensors)

    monkeypatch.setattr(feature_store, "write_shard", write_shard)
    with pytest.raises(DiskFullError) as caught:
        store(target, tokens, tmp_path)
    path = feature_store_path(target, tokens, [2, 1], tmp_path)
    assert re.fullmatch(
        rf"no space left on device while writing feature store {re.escape(str(path))} \([\d.]+ \w+ free\); "
        r"2 of 5 samples captured \([\d.]+ KiB written, about [\d.]+ KiB needed for all\); nothing partial is kept",
        str(caught.value),
    ), caught.value
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock"]  # no partial store


@pytest.mark.slow
def test_a_real_full_disk_during_capture(target, tmp_path):
    """A 256 KiB tmpfs as cache_dir: the capture of ~600 KiB of features runs out of space."""
    cache = tmp_path / "small"
    cache.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(cache)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.decode().strip() or 'mount failed'}")
    try:
        tokens = token_dataset(target, count=40)
        with pytest.raises(DiskFullError) as caught:
            prepare_features(target, tokens, [2, 1], cache, batch_size=4, shard_samples=4, final_hidden=True)
        path = feature_store_path(target, tokens, [2, 1], cache, final_hidden=True)
        assert str(caught.value).startswith(f"no space left on device while writing feature store {path} (")
        assert re.search(
            r"; \d+ of 40 samples captured \(.* written, about .* needed for all\); nothing partial", str(caught.value)
        )
        assert [p.name for p in (cache / "features").iterdir()] == [f".{path.name}.lock"]
    finally:
        subprocess.run(["umount", str(cache)], check=False)


HOLDER = """
import sys, time
import datasets
from tests.support.tiny_target import tiny_conversations, tiny_target
from trainer.data.chat import tokenize_chat
from trainer.data.feature_store import prepare_features

target = tiny_target()
conversations = datasets.Dataset.from_dict({"messages": tiny_conversations(5)})
tokens = conversations.map(lambda s: tokenize_chat(target.tokenizer, s["messages"]), remove_columns=["messages"])
capture = target.capture

def slow_capture(*args, **kwargs):
    time.sleep(1.0)
    return capture(*args, **kwargs)

target.capture = slow_capture
prepare_features(target, tokens, [2, 1], sys.argv[1], batch_size=2, shard_samples=2)
"""


def wait_for_holder(lock_file: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while f'"pid": {process.pid}' not in (lock_file.read_text() if lock_file.exists() else ""):
        assert process.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.05)


@pytest.mark.slow
def test_one_writer_per_feature_store(target, tokens, tmp_path, monkeypatch):
    """Another run is refused, naming the entry and the holder; a rank of the holder's own job waits
    for it and reuses what it wrote."""
    job = uuid.uuid4().hex
    environment = {**os.environ, "TORCHELASTIC_RUN_ID": job, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(tmp_path)], cwd=REPO, env=environment)
    try:
        path = feature_store_path(target, tokens, [2, 1], tmp_path)
        wait_for_holder(entry_lock_file(path), holder)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        with pytest.raises(FolderInUseError) as caught:
            store(target, tokens, tmp_path)
        assert re.fullmatch(
            rf"feature store {re.escape(str(path))} is in use by another run \(pid {holder.pid} on .+, since .+\): "
            r"wait for it to finish, or give this run another cache_dir",
            str(caught.value),
        ), caught.value
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
        monkeypatch.setattr(target, "capture", lambda *a, **k: pytest.fail("captured twice"))
        assert store(target, tokens, tmp_path) == path  # waited, then reused
        assert holder.wait(timeout=120) == 0
    finally:
        holder.kill()
        holder.wait()
    read_all(OfflineDataset(tokens, path))


LOCK_HOLDER = """
import sys, time
from trainer.locks import lock_cache_entry
with lock_cache_entry(sys.argv[1], "converted target"):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.slow
def test_one_writer_per_converted_target(tmp_path, monkeypatch):
    """A second conversion of the same GGUF is refused before anything is loaded."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    source = TargetSource(str(tmp_path), "model.gguf")
    converted = tmp_path / "cache" / "targets" / source.fingerprint()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LOCK_HOLDER), str(converted)],
        cwd=REPO,
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(FolderInUseError) as caught:
            _load_gguf_through_cache(source, torch.float32, tmp_path / "cache")
        assert re.fullmatch(
            rf"converted target {re.escape(str(converted))} is in use by another run \(pid {holder.pid} on .+\): "
            r"wait for it to finish, or give this run another cache_dir",
            str(caught.value),
        ), caught.value
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with lock_cache_entry(converted, "converted target"):  # released with its holder
        pass


@pytest.mark.slow
def test_a_damaged_shard_read_in_a_dataloader_worker_is_still_one_line(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path)
    shard = rewrite_shard(path / "shard-00001.safetensors", "sample_2", lambda t: t * 1e6)
    dataset = OfflineDataset(tokens, path)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    with pytest.raises(FeatureStoreError) as caught:
        list(loader)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"feature store {path}: {shard} sample 2: sample_2 has RMS")


def test_a_damaged_index_is_named(target, tokens, tmp_path):
    path = store(target, tokens, tmp_path)
    index_path = path / FEATURE_INDEX
    index = json.loads(index_path.read_text())
    shard = index["shards"][1]
    shard.update(samples=[2], tokens=shard["tokens"][:1], statistics=shard["statistics"][:1])  # sample 3 unlisted
    index_path.write_text(json.dumps(index))
    with pytest.raises(FeatureStoreError) as caught:
        OfflineDataset(tokens, path)
    assert str(caught.value) == (
        f"feature store {path}: {index_path} lists 4 distinct samples, not 0..4: delete {path} to capture again"
    )
    index_path.write_text(json.dumps(index)[:-20])
    with pytest.raises(
        FeatureStoreError,
        match=rf"^feature store .+: {re.escape(str(index_path))} is not a valid feature index \(JSONDecodeError: ",
    ):
        OfflineDataset(tokens, path)
