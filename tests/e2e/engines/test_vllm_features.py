"""Offline features from a real vLLM server (`feature_endpoint`): the store equals in-process
capture, under the same cache key; the layer mapping (+1, order, duplicates) holds; a capture killed
with SIGKILL resumes asking only what it lacks; and `prepare.py` then `train.py` train from the
engine's store with the losses of in-process features.

On this CPU the server uses the CPU variant of vLLM's stock hidden-states connector (the copy out
of the KV cache made on the CPU, benchmarks/engines/vllm_cpu_plugin); everything else is stock.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch

from tests.e2e.engines.conftest import DRAFT_CONFIG, LAYER_IDS, REPO, SERVED_NAME, TARGET
from trainer.data.chat import render
from trainer.data.dataset import chitchat_prompts
from trainer.data.endpoint import EndpointError, EndpointSettings
from trainer.data.engine_features import PROGRESS_FILE, prepare_engine_features
from trainer.data.engine_servers import FeatureEndpointSettings
from trainer.data.feature_store import FEATURE_INDEX, OfflineDataset, prepare_features, store_fingerprint
from trainer.models.target import TargetTokenizer

# Relative error (Frobenius, per sample) between vLLM's and transformers' fp32 hidden states: the
# same weights through other kernels (measured here: about 4e-7 to 4e-6).
TOLERANCE = 1e-5


def token_samples(tokenizer, count: int, offset: int = 0) -> datasets.Dataset:
    """Templated chat prompts with an answer, of varied lengths."""
    rows = []
    short = [prompt for prompt in chitchat_prompts() if len(prompt) < 120]  # some run to 1700 tokens
    for index, prompt in enumerate(short[offset : offset + count]):
        ids = render(tokenizer, [{"role": "user", "content": prompt}], True, {})
        answer = tokenizer.encode(" It is a fine question." * (1 + index % 4), add_special_tokens=False)
        rows.append(ids + answer)
    return datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(ids) for ids in rows]})


def settings_for(server, **overrides) -> FeatureEndpointSettings:
    endpoint = EndpointSettings(url=server.url, model=SERVED_NAME, keys="feature", **overrides)
    return FeatureEndpointSettings(endpoint, file_timeout=60, storage=server.storage)


def relative_errors(tokens, engine_store: Path, local_store: Path, expected) -> list[float]:
    engine, local = OfflineDataset(tokens, engine_store, expected), OfflineDataset(tokens, local_store, expected)
    errors = []
    for index in range(len(tokens)):
        reference = local[index]["target_hidden"]
        assert engine[index]["target_hidden"].shape == reference.shape
        errors.append(float((engine[index]["target_hidden"] - reference).norm() / reference.norm()))
    return errors


@pytest.mark.parametrize("layer_ids", [LAYER_IDS, [LAYER_IDS[2], LAYER_IDS[0], LAYER_IDS[1], LAYER_IDS[0]]])
def test_engine_store_equals_in_process_capture(feature_server, smollm2, tmp_path: Path, layer_ids):
    """Also for the draft's layers out of order and repeated: vLLM returns each needed layer once,
    sorted (ids + 1); the store keeps the draft's order."""
    tokens = token_samples(smollm2.tokenizer, 16)
    before = set(feature_server.storage.glob("*.safetensors"))
    engine = prepare_engine_features(
        settings_for(feature_server, concurrency=4), TargetTokenizer.load(TARGET), tokens, layer_ids, tmp_path / "a"
    )
    local = prepare_features(smollm2, tokens, layer_ids, tmp_path / "b")
    assert engine.name == local.name  # the same cache entry: training finds either
    engine_index, local_index = (json.loads((store / FEATURE_INDEX).read_text()) for store in (engine, local))
    assert engine_index["store"] == local_index["store"]
    errors = relative_errors(tokens, engine, local, store_fingerprint(smollm2, layer_ids, torch.float32, False))
    print(f"engine features, layers {layer_ids}: max relative error {max(errors):.2e} over {len(errors)} samples")
    assert max(errors) < TOLERANCE, errors
    # the server's files are consumed: at most the last nudge's one-token file is left
    assert len(set(feature_server.storage.glob("*.safetensors")) - before) <= 1


def test_server_with_other_layers_is_refused_in_one_line(feature_server, smollm2, tmp_path: Path):
    tokens = token_samples(smollm2.tokenizer, 2)
    with pytest.raises(EndpointError) as error:
        prepare_engine_features(settings_for(feature_server), TargetTokenizer.load(TARGET), tokens, [1, 14], tmp_path)
    message = str(error.value)
    assert "the server returns 3 layers, the draft needs 2" in message and "\n" not in message


def test_capture_killed_with_sigkill_resumes_asking_only_what_it_lacks(
    feature_server, smollm2, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    samples, shard = 40, 4
    script = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from tests.e2e.engines.test_vllm_features import settings_for_url, token_samples
from trainer.data.engine_features import prepare_engine_features
from trainer.models.target import TargetTokenizer
target = TargetTokenizer.load({TARGET!r})
settings = settings_for_url({feature_server.url!r}, {str(feature_server.storage)!r})
prepare_engine_features(settings, target, token_samples(target.tokenizer, {samples}),
                        {LAYER_IDS!r}, Path({str(tmp_path)!r}), shard_samples={shard})
"""
    capture = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline, progress = time.monotonic() + 300, None
    while time.monotonic() < deadline and capture.poll() is None:
        found = (
            list((tmp_path / "features").glob(f"*.partial/{PROGRESS_FILE}")) if (tmp_path / "features").exists() else []
        )
        if found and len(found[0].read_text().splitlines()) >= 3:
            progress = found[0]
            break
        time.sleep(0.02)
    assert progress is not None, capture.communicate(timeout=60)
    os.kill(capture.pid, signal.SIGKILL)
    capture.wait(timeout=60)
    journaled = [json.loads(line) for line in progress.read_text().splitlines()]
    kept = {entry["file"]: (progress.parent / entry["file"]).stat().st_mtime_ns for entry in journaled}
    done = sum(len(entry["samples"]) for entry in journaled)
    assert 3 * shard <= done < samples

    tokens = token_samples(smollm2.tokenizer, samples)
    with caplog.at_level(logging.INFO, logger="trainer.data.engine_features"):
        store = prepare_engine_features(
            settings_for(feature_server), TargetTokenizer.load(TARGET), tokens, LAYER_IDS, tmp_path, shard_samples=shard
        )
    assert f"asking {samples - done} of {samples} samples" in caplog.text
    for name, mtime in kept.items():  # the shards written before the kill are the store's, untouched
        assert (store / name).stat().st_mtime_ns == mtime
    local = prepare_features(smollm2, tokens, LAYER_IDS, tmp_path / "local")
    errors = relative_errors(tokens, store, local, store_fingerprint(smollm2, LAYER_IDS, torch.float32, False))
    assert max(errors) < TOLERANCE


def settings_for_url(url: str, storage: str) -> FeatureEndpointSettings:
    """(for the killed capture's process) one request at a time, so the kill lands between shards."""
    endpoint = EndpointSettings(url=url, model=SERVED_NAME, keys="feature", concurrency=1)
    return FeatureEndpointSettings(endpoint, file_timeout=60, storage=storage)


def training_recipe(tmp_path: Path, name: str, **keys) -> Path:
    conversations = tmp_path / "conversations.jsonl"
    if not conversations.exists():
        lines = []
        for index, prompt in enumerate([prompt for prompt in chitchat_prompts() if len(prompt) < 120][:24]):
            answer = " ".join(["A short and friendly answer."] * (1 + index % 3))
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            lines.append(json.dumps({"messages": messages}))
        conversations.write_text("\n".join(lines) + "\n")
    recipe = {
        "target": TARGET,
        "draft_config": str(DRAFT_CONFIG),
        "dataset": str(conversations),
        "regenerate": False,
        "max_length": 128,
        "offline": True,
        "cache_dir": str(tmp_path / f"cache-{name}"),
        "output_dir": str(tmp_path / f"run-{name}"),
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "learning_rate": 0.001,
        "num_anchors": 16,
        "kd_weight": 0.0,
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_steps": 1000,
        "spec_eval_prompts": 0,
        "report_to": [],
        "seed": 0,
        **keys,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(recipe))
    return path


def run_command(name: str, recipe: Path) -> str:
    """`python -m trainer NAME RECIPE` (`dflash2 NAME`) from the repository, PYTHONPATH unset; its stdout."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-m", "trainer", name, str(recipe)], cwd=REPO, env=environment, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def training_losses(recipe: Path) -> list[float]:
    state = json.loads((Path(json.loads(recipe.read_text())["output_dir"]) / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def test_prepare_then_train_from_engine_features_matches_in_process(feature_server, tmp_path: Path):
    engine = training_recipe(
        tmp_path,
        "engine",
        feature_endpoint=feature_server.url,
        feature_model=SERVED_NAME,
        feature_storage_path=str(feature_server.storage),
    )
    assert "prepared 24 training" in run_command("prepare", engine)
    stores = list((tmp_path / "cache-engine" / "features").glob(f"*/{FEATURE_INDEX}"))
    assert len(stores) == 1  # written by prepare through vLLM; train.py below reuses it
    run_command("train", engine)
    local = training_recipe(tmp_path, "local")
    run_command("train", local)  # captures in process
    engine_losses, local_losses = training_losses(engine), training_losses(local)
    assert len(engine_losses) == len(local_losses) == 4
    # features equal to ~1e-6 relative give the same losses to well within 1e-4
    worst = max(abs(a - b) / abs(b) for a, b in zip(engine_losses, local_losses, strict=True))
    print(f"losses from engine features {engine_losses}, in process {local_losses}: max relative {worst:.2e}")
    assert engine_losses == pytest.approx(local_losses, rel=1e-4), (engine_losses, local_losses)
