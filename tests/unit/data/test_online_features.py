"""Streamed engine features (`feature_endpoint`, `offline: false`) against fake vLLM servers, for
what a real server cannot be made to do on cue (tests/e2e/engines runs the real one): the features in
the draft's order, the files on disk bounded by the prefetch window, requests spread by load, a
server dying mid-run, every server gone, the storage-folder rule, and one-line errors from the
data-loader processes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from tests.support.fake_vllm_features import FakeFeatureServer
from tests.support.tiny_target import tiny_tokenizer
from trainer.console import describe
from trainer.data.endpoint import EndpointError, EndpointSettings
from trainer.data.engine_servers import EngineLayout, FeatureEndpointSettings
from trainer.data.online_features import (
    StreamedFeatures,
    StreamSource,
    configure_streamed_run,
    streamed_disk_bound,
    streams_engine_features,
)
from trainer.data.packing import PackedDataset

HIDDEN = 4
LAYER_IDS = (1, 0)  # the draft's order; vLLM returns layers 1 and 2 (ids + 1), sorted


def hidden_of(ids: list[int]) -> torch.Tensor:
    """[tokens, 2 layers, H]: a pure function of the token ids (the layer and channel in the value)."""
    tokens = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    return tokens + 100 * torch.arange(2.0)[None, :, None] + torch.arange(HIDDEN)[None, None, :] / 1000


def expected_features(ids: list[int]) -> torch.Tensor:
    """What the draft must see: layer id 1 (vLLM's 2, second in the file), then layer id 0."""
    hidden = hidden_of(ids)
    return torch.cat([hidden[:, 1], hidden[:, 0]], dim=-1)


def token_rows(count: int) -> datasets.Dataset:
    rows = [[5 + index % 40, 6, 7 + index % 3, 8 + index, 9] for index in range(count)]
    return datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(row) for row in rows]})


def settings(servers: list[FakeFeatureServer], storage: Path, **endpoint) -> FeatureEndpointSettings:
    options = {"concurrency": 8, "timeout": 5.0, "max_retries": 1, "backoff": 0.05, **endpoint}
    endpoints = [EndpointSettings(url=server.url, keys="feature", **options) for server in servers]
    return FeatureEndpointSettings(endpoints, file_timeout=3.0, storage=str(storage))


def streamed(servers: list[FakeFeatureServer], storage: Path, count: int, **endpoint) -> StreamedFeatures:
    source = StreamSource.open(
        settings(servers, storage, **endpoint), tiny_tokenizer(), EngineLayout(LAYER_IDS, HIDDEN), torch.float32
    )
    return StreamedFeatures(token_rows(count), source)


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    folder = tmp_path / "storage"
    folder.mkdir()
    return folder


def server(storage: Path, **options) -> FakeFeatureServer:
    return FakeFeatureServer(storage, 2, HIDDEN, hidden_of=hidden_of, **options)


def test_streamed_items_are_the_servers_features_in_the_drafts_order_and_the_files_go(storage: Path):
    with server(storage) as one:
        dataset = streamed([one], storage, 6)
        items = dataset.__getitems__([4, 0, 2])
        single = dataset[5]
    for index, item in zip([4, 0, 2], items, strict=True):
        ids = token_rows(6)[index]["input_ids"]
        assert item["input_ids"] == ids
        assert torch.equal(item["target_hidden"], expected_features(ids))
    assert torch.equal(single["target_hidden"], expected_features(token_rows(6)[5]["input_ids"]))
    assert sorted(path.name for path in storage.iterdir()) == []  # every file and lock read and removed


def test_the_files_on_disk_stay_within_the_prefetch_window(storage: Path):
    """Two data-loader processes with a prefetch factor of 1 (feature_prefetch: 2), micro-batches of
    3: at most 2 x 3 server files exist at once, over a dataset of 30 samples."""
    with server(storage) as one:
        dataset = streamed([one], storage, 30)
        loader = torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=2, prefetch_factor=1, collate_fn=list)
        batches = list(loader)
    assert [item["input_ids"] for batch in batches for item in batch] == token_rows(30)["input_ids"]  # in order
    assert all(
        torch.equal(item["target_hidden"], expected_features(item["input_ids"])) for batch in batches for item in batch
    )
    assert len(one.samples) == 30
    assert 1 <= one.most_files <= 2 * 3
    assert sorted(path.name for path in storage.iterdir()) == []


def test_the_disk_bound_is_prefetch_times_a_micro_batch_of_files():
    # 4 micro-batches ahead, 8192 tokens each, 5 engine layers of 4096, bf16: 4 * 8192 * 5 * 4096 * 2 bytes
    layout = EngineLayout((1, 9, 17, 25, 33), 4096)
    assert streamed_disk_bound(4, 8192, layout, 2) == 1_342_177_280


def test_requests_are_spread_over_the_servers_by_load(tmp_path: Path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    with server(first) as one, server(second) as two:
        endpoints = [EndpointSettings(url=fake.url, keys="feature", concurrency=8) for fake in (one, two)]
        source = StreamSource.open(
            FeatureEndpointSettings(endpoints, file_timeout=3.0, storage=[str(first), str(second)]),
            tiny_tokenizer(),
            EngineLayout(LAYER_IDS, HIDDEN),
            torch.float32,
        )
        dataset = StreamedFeatures(token_rows(16), source)
        for start in (0, 8):
            items = dataset.__getitems__(list(range(start, start + 8)))
            assert all(torch.equal(item["target_hidden"], expected_features(item["input_ids"])) for item in items)
    # eight asked at once: the least-loaded server each time, so four each
    assert (len(one.samples), len(two.samples)) == (8, 8)


def test_a_server_that_dies_mid_run_is_dropped_once_and_its_samples_asked_of_another(
    storage: Path, caplog: pytest.LogCaptureFixture
):
    with server(storage, die_after=3) as dying, server(storage) as healthy:
        dataset = streamed([dying, healthy], storage, 24)
        with caplog.at_level(logging.WARNING, logger="trainer.data.engine_servers"):
            items = [item for start in range(0, 24, 4) for item in dataset.__getitems__(list(range(start, start + 4)))]
    assert [item["input_ids"] for item in items] == token_rows(24)["input_ids"]
    assert all(torch.equal(item["target_hidden"], expected_features(item["input_ids"])) for item in items)
    warnings = [record.getMessage() for record in caplog.records if "is dropped" in record.getMessage()]
    assert len(warnings) == 1 and dying.url in warnings[0], warnings
    held = dying.samples[2:]  # the requests it died holding (the third and any sent meanwhile)...
    assert held and all(sample in healthy.samples for sample in held)  # ...were answered by the other
    assert sorted(path.name for path in storage.iterdir()) == []


def test_every_server_gone_is_one_line_naming_them_within_the_deadline(storage: Path):
    with server(storage, die_after=1) as first, server(storage, die_after=1) as second:
        dataset = streamed([first, second], storage, 4, timeout=1.0, max_retries=2, backoff=0.1)
        started = time.monotonic()
        with pytest.raises(EndpointError) as error:
            dataset.__getitems__([0, 1])
    took = time.monotonic() - started
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("feature_endpoint: no server answers any more, past every deadline: ")
    assert first.url in message and second.url in message
    assert "still failing after 3 attempts" in message  # the last one was asked up to its deadline
    assert took < 20


def test_a_reply_naming_a_file_outside_the_storage_folder_is_refused_and_nothing_removed(tmp_path: Path):
    storage, victim = tmp_path / "storage", tmp_path / "victim"
    storage.mkdir()
    victim.mkdir()
    (victim / "poetry.safetensors").write_text("the user's")
    named = str(victim / "poetry.safetensors")
    with FakeFeatureServer(storage, 2, HIDDEN, hostile=lambda path, kind: named if kind == "sample" else path) as fake:
        dataset = streamed([fake], storage, 2)
        with pytest.raises(EndpointError, match=r"which is not a \.safetensors file directly in feature_storage_path"):
            dataset[0]
    assert (victim / "poetry.safetensors").read_text() == "the user's"


def test_a_fifo_named_inside_the_folder_is_refused_at_once(tmp_path: Path):
    storage = tmp_path / "storage"
    storage.mkdir()
    fifo = storage / "odd.safetensors"
    os.mkfifo(fifo)
    Path(f"{fifo}.lock").touch()
    with FakeFeatureServer(
        storage, 2, HIDDEN, hostile=lambda path, kind: str(fifo) if kind == "sample" else path
    ) as fake:
        dataset = streamed([fake], storage, 2)
        started = time.monotonic()
        with pytest.raises(EndpointError, match="is a special file, not a regular file"):
            dataset[0]
    assert time.monotonic() - started < 5


def test_a_probe_file_with_other_layers_is_refused_before_training(storage: Path):
    fake = FakeFeatureServer(storage, 3, HIDDEN)  # three layers where the draft needs two
    with fake, pytest.raises(EndpointError, match="the server returns 3 layers, the draft needs 2"):
        streamed([fake], storage, 2)


def test_an_error_in_a_data_loader_process_is_one_line(tmp_path: Path):
    storage = tmp_path / "storage"
    storage.mkdir()
    with FakeFeatureServer(
        storage, 2, HIDDEN, hostile=lambda path, kind: "/etc/passwd" if kind == "sample" else path
    ) as fake:
        loader = torch.utils.data.DataLoader(streamed([fake], storage, 4), batch_size=2, num_workers=1, collate_fn=list)
        with pytest.raises(EndpointError) as error:
            next(iter(loader))
    assert "\n" in str(error.value)  # PyTorch's re-raise carries the worker's traceback...
    line = describe(error.value)
    assert "\n" not in line  # ...the command prints the worker's own line
    assert line.startswith("feature_endpoint named the hidden-state file '/etc/passwd'")


def test_packed_rows_ask_all_their_documents_at_once(storage: Path):
    with server(storage) as one:
        dataset = streamed([one], storage, 8)
        packed = PackedDataset(dataset, [[3, 0], [5], [1, 7, 2]])
        rows = packed.__getitems__([2, 0])
    for row, documents in zip(rows, [[1, 7, 2], [3, 0]], strict=True):
        ids = [token for document in documents for token in token_rows(8)[document]["input_ids"]]
        assert row["input_ids"].tolist() == ids
        expected = torch.cat([expected_features(token_rows(8)[document]["input_ids"]) for document in documents])
        assert torch.equal(row["target_hidden"], expected)
        lengths = [len(token_rows(8)[document]["input_ids"]) for document in documents]
        assert row["position_ids"].tolist() == [p for length in lengths for p in range(length)]
    assert set(one.samples) == {tuple(token_rows(8)[document]["input_ids"]) for document in (1, 7, 2, 3, 0)}


def recipe_args(**overrides):
    data = SimpleNamespace(feature_endpoint=["http://a/v1"], offline=False, feature_prefetch=3)
    model = SimpleNamespace(target_sharding="none")
    training = SimpleNamespace(spec_eval_prompts=0, dataloader_num_workers=0, dataloader_prefetch_factor=None)
    for key, value in overrides.items():
        for space in (data, model, training):
            if hasattr(space, key):
                setattr(space, key, value)
    return model, data, training


def test_a_streamed_run_loads_with_feature_prefetch_processes_of_one_micro_batch_each():
    model, data, training = recipe_args()
    assert streams_engine_features(data)
    configure_streamed_run(model, data, training)
    assert (training.dataloader_num_workers, training.dataloader_prefetch_factor) == (3, 1)
    assert not streams_engine_features(recipe_args(offline=True)[1])
    assert not streams_engine_features(recipe_args(feature_endpoint=None)[1])


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"spec_eval_prompts": 4}, "spec_eval_prompts: 4, but real speculative decoding runs the whole target"),
        ({"target_sharding": "fsdp"}, "target_sharding: fsdp, but a run streaming engine features"),
        ({"dataloader_num_workers": 2}, "dataloader_num_workers: 2, but streamed engine features"),
    ],
)
def test_what_a_streamed_run_cannot_do_is_refused_in_one_line(overrides, problem):
    with pytest.raises(ValueError, match=problem) as error:
        configure_streamed_run(*recipe_args(**overrides))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("storage", "problem"),
    [
        (["/a", "/b"], "feature_storage_path: 2 folders for 3 feature_endpoint servers"),
        (None, "feature_endpoint needs feature_storage_path"),
    ],
)
def test_storage_folders_must_be_one_or_one_per_server(storage, problem):
    endpoints = [EndpointSettings(url=f"http://h{index}/v1", keys="feature") for index in range(3)]
    with pytest.raises(ValueError, match=problem):
        FeatureEndpointSettings(endpoints, storage=storage)
    same = [EndpointSettings(url="http://h/v1", keys="feature")] * 2
    with pytest.raises(ValueError, match="lists a server twice"):
        FeatureEndpointSettings(same, storage="/a")
    assert FeatureEndpointSettings(endpoints, storage="/s").storages == ("/s", "/s", "/s")
