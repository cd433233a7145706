"""The parts of engine feature capture that need no server (tests/e2e/engines runs them against a real
vLLM): the layer mapping, the refusals, the checks on a server's file, the bounded wait for it, and
the recovery of an unfinished store."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shlex
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.data.endpoint import EndpointError, run_workers
from trainer.data.engine_features import (
    PROGRESS_FILE,
    _recovered_shards,
    check_engine_layers,
    engine_feature_arguments,
    engine_feature_command,
)
from trainer.data.engine_files import engine_features, read_hidden_states
from trainer.data.engine_servers import engine_layer_ids
from trainer.data.feature_store import ShardWriter

REPO = Path(__file__).resolve().parents[3]


def test_vllm_layer_ids_are_the_draft_ids_plus_one_sorted_once():
    assert engine_layer_ids([27, 1, 14, 1]) == [2, 15, 28]


def test_features_come_back_in_the_drafts_order():
    # three layers as vLLM sends them (ids 2, 15, 28), each filled with its own id
    hidden = torch.stack([torch.full((5, 4), float(layer)) for layer in (2, 15, 28)], dim=1)
    ids = [7, 8, 9, 10, 11]
    tensors = {"hidden_states": hidden, "token_ids": torch.tensor(ids)}
    layer_ids = [27, 1, 14, 1]
    aux = engine_layer_ids(layer_ids)
    order = [aux.index(layer + 1) for layer in layer_ids]
    features = engine_features(tensors, ids, order, 4, "file")
    assert features.shape == (5, 16)
    assert features[0].tolist() == [28.0] * 4 + [2.0] * 4 + [15.0] * 4 + [2.0] * 4


@pytest.mark.parametrize(
    ("tensors", "problem"),
    [
        ({"hidden_states": torch.zeros(3, 2, 4)}, "expected tensors hidden_states and token_ids"),
        ({"hidden_states": torch.zeros(3, 2, 4), "token_ids": torch.tensor([1, 2, 4])}, "are not the 3 token ids"),
        ({"hidden_states": torch.zeros(3, 2, 5), "token_ids": torch.tensor([1, 2, 3])}, "expected [3, 2, 4]"),
        ({"hidden_states": torch.zeros(3, 3, 4), "token_ids": torch.tensor([1, 2, 3])}, "returns 3 layers, the draft"),
        (
            {"hidden_states": torch.full((3, 2, 4), float("nan")), "token_ids": torch.tensor([1, 2, 3])},
            "non-finite",
        ),
    ],
)
def test_a_server_file_that_does_not_match_the_request_is_one_error(tensors, problem):
    with pytest.raises(EndpointError, match=re.escape(problem)):
        engine_features(tensors, [1, 2, 3], [0, 1], 4, "file")


def test_what_vllm_cannot_return_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"distillation .* final-normed") as kd:
        check_engine_layers([1, 14], 30, final_hidden=True)
    with pytest.raises(ValueError, match=r"includes the target's last layer \(29\)") as last:
        check_engine_layers([1, 29], 30, final_hidden=False)
    assert "\n" not in str(kd.value) + str(last.value)
    check_engine_layers([1, 28], 30, final_hidden=False)  # the layer before the last is fine


def test_the_documented_gpu_commands_are_the_ones_the_code_builds():
    docs = (REPO / "docs" / "your-own-target.md").read_text()
    for config, target, parallel in (("qwen3-8b", "Qwen/Qwen3-8B", 1), ("qwen3.6-27b", "Qwen/Qwen3.6-27B", 4)):
        layer_ids = json.loads((REPO / "hub_configs" / f"{config}-dflash2.json").read_text())["dflash_config"][
            "target_layer_ids"
        ]
        command = shlex.join(engine_feature_command(target, layer_ids, "/shared/hidden-states", parallel))
        assert command in docs


def test_the_cpu_connector_replaces_only_the_connector():
    stock = engine_feature_arguments([1, 14], "/s")
    cpu = engine_feature_arguments([1, 14], "/s", {"kv_connector": "X", "kv_connector_module_path": "m"})
    assert stock[:2] == cpu[:2]  # the same extract_hidden_states config
    stock_transfer, cpu_transfer = json.loads(stock[3]), json.loads(cpu[3])
    assert stock_transfer == {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/s"},
    }
    assert cpu_transfer == {
        "kv_connector": "X",
        "kv_connector_module_path": "m",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/s"},
    }


class CountingNudger:
    def __init__(self, on_nudge=None):
        self.count, self.on_nudge = 0, on_nudge

    async def nudge(self) -> None:
        self.count += 1
        if self.on_nudge:
            self.on_nudge()


def test_a_file_written_at_the_next_step_is_read_once_the_server_is_nudged(tmp_path: Path):
    """vLLM writes a finished request's file at its next step: an idle server never would."""
    path = str(tmp_path / "request.safetensors")
    lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the server holds the lock until the file is written
    tensors = {"hidden_states": torch.ones(2, 1, 4), "token_ids": torch.tensor([5, 6])}

    def step() -> None:  # what the nudge's step does on the server
        save_file(tensors, path)
        os.close(lock)

    nudger = CountingNudger(step)
    read = asyncio.run(read_hidden_states(path, 10.0, nudger, "feature_endpoint"))
    assert nudger.count == 1
    assert torch.equal(read["hidden_states"], tensors["hidden_states"])


def test_a_file_that_never_comes_is_a_bounded_one_line_error(tmp_path: Path):
    path = str(tmp_path / "request.safetensors")
    lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    started = time.monotonic()
    with pytest.raises(EndpointError, match=r"not written within feature_file_timeout=0.5 s .*still locked") as error:
        asyncio.run(read_hidden_states(path, 0.5, CountingNudger(), "feature_endpoint"))
    assert time.monotonic() - started < 5
    os.close(lock)
    assert "\n" not in str(error.value)
    with pytest.raises(EndpointError, match="shared_storage_path at the same path"):  # a folder not seen here
        asyncio.run(read_hidden_states(str(tmp_path / "elsewhere.safetensors"), 0.3, CountingNudger(), "f"))


def test_recovery_keeps_whole_journaled_shards_and_drops_the_rest(tmp_path: Path):
    writer = ShardWriter(tmp_path, tmp_path, 12, 4, on_shard=lambda shard: journal.append(shard))
    journal: list[dict] = []
    for sample in range(8):
        writer.add(sample, torch.full((3, 4), float(sample + 1)))
    lines = [json.dumps(shard) for shard in journal]
    (tmp_path / "shard-00002.safetensors").write_bytes(b"written, never journaled")
    (tmp_path / ".shard-00003.safetensors.partial").write_bytes(b"torn")
    (tmp_path / PROGRESS_FILE).write_text("\n".join(lines) + '\n{"file": "shard-00002.safe')  # torn last line
    shards = _recovered_shards(tmp_path)
    assert [shard["file"] for shard in shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        PROGRESS_FILE,
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert (tmp_path / PROGRESS_FILE).read_text().splitlines() == lines
    resumed = ShardWriter(tmp_path, tmp_path, 12, 4, shards)
    assert resumed.captured == 8
    resumed.add(8, torch.ones(3, 4))
    resumed.flush()
    assert resumed.shards[-1]["file"] == "shard-00002.safetensors"  # numbering continues after the kept shards


def test_the_first_failing_worker_stops_the_others_and_is_raised_alone():
    finished: list[int] = []
    started: list[int] = []

    async def worker() -> None:
        started.append(len(started))
        if started[-1] == 0:
            await asyncio.sleep(0.01)
            raise EndpointError("server gone")
        await asyncio.sleep(10)  # would go on sending through a closed client
        finished.append(started[-1])

    began = time.monotonic()
    with pytest.raises(EndpointError, match=r"^server gone$"):
        asyncio.run(run_workers(worker, 3))
    assert time.monotonic() - began < 2 and len(started) == 3 and finished == []


def recipe_keys(**keys):
    from types import SimpleNamespace

    defaults = {
        "feature_endpoint": None,
        "feature_model": None,
        "offline": True,
        "feature_concurrency": 16,
        "feature_timeout": 600.0,
        "feature_max_retries": 8,
        "feature_file_timeout": 120.0,
        "feature_storage_path": "/shared/hidden-states",
    }
    return SimpleNamespace(**{**defaults, **keys})


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ({"feature_model": "m"}, "feature_model is set but feature_endpoint is not"),
        ({"feature_endpoint": ["http://h/v1", "host:8000"]}, "feature_endpoint must be an http(s) URL"),
        ({"feature_endpoint": ["http://h/v1"], "feature_concurrency": 0}, "feature_concurrency must be >= 1"),
        ({"feature_endpoint": ["http://h/v1"], "feature_file_timeout": 0}, "feature_file_timeout must be > 0"),
        (
            {"feature_endpoint": ["http://a/v1", "http://b/v1"], "feature_storage_path": ["/a", "/b", "/c"]},
            "feature_storage_path: 3 folders for 2 feature_endpoint servers",
        ),
    ],
)
def test_feature_recipe_keys_are_checked_naming_the_key(keys, problem):
    from trainer.data.dataset import feature_endpoint_settings

    with pytest.raises(ValueError, match=re.escape(problem)):
        feature_endpoint_settings(recipe_keys(**keys))


def test_feature_recipe_keys_become_the_clients_settings():
    from trainer.data.dataset import feature_endpoint_settings

    assert feature_endpoint_settings(recipe_keys()) is None
    settings = feature_endpoint_settings(recipe_keys(feature_endpoint=["http://h/v1"], feature_concurrency=3))
    assert (settings.endpoint[0].url, settings.endpoint[0].concurrency, settings.endpoint[0].key("timeout")) == (
        "http://h/v1",
        3,
        "feature_timeout",
    )
    assert settings.file_timeout == 120.0
    assert settings.storages == ("/shared/hidden-states",)
    # offline: false streams from the same settings (one per server, each folder its own)
    streamed = feature_endpoint_settings(
        recipe_keys(offline=False, feature_endpoint=["http://a/v1", "http://b/v1"], feature_storage_path=["/a", "/b"])
    )
    assert [endpoint.url for endpoint in streamed.endpoints] == ["http://a/v1", "http://b/v1"]
    assert streamed.storages == ("/a", "/b")
