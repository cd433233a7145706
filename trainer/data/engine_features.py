"""Target hidden states from vLLM servers (`feature_endpoint`) stored before training (`offline:
true`): the offline feature store is built from what the serving engine computes (`online_features`
streams them instead).

The server runs the target with vLLM's `extract_hidden_states` speculative method and a
hidden-states connector (`engine_feature_command` prints the command): every request's prompt
hidden states at the configured layers are written by the server to `<request>.safetensors`
(`hidden_states` [tokens, layers, H], `token_ids`) under its `shared_storage_path`, and the reply
names the file (`kv_transfer_params.hidden_states_path`). This client sends each sample's token ids
as a one-token completion, reads the file (which must be visible here at the same path: the same
machine or a shared filesystem) and stores the features exactly as in-process capture would: the
same store layout, index, statistics and cache entry, so `train.py` finds the store under the
same key.

Nothing a server names is trusted: the recipe names the folder the server writes to
(`feature_storage_path`), and a file is read and removed only when the reply names a
`.safetensors` file directly in it (paths resolved) and it is a regular file (never through a
symbolic link, never a FIFO or device that would block); any other reply is one error line.

vLLM's layer ids are the draft's `target_layer_ids` + 1 (the input of layer id + 1 is the output
of layer id, i.e. transformers' `hidden_states[id + 1]`), sorted and de-duplicated; the store keeps
the draft's order. Two things vLLM cannot give are refused in one line: the last layer (vLLM
returns it before the final norm, in-process capture after it) and the final-normed hidden states
distillation needs.

A finished request's file is written at the engine's *next* step, so the last requests of a run
would wait forever on an idle server: after a short wait the client sends a one-token "nudge"
request to make it step, and every wait has a deadline (`feature_file_timeout`). Requests run
`feature_concurrency` at a time per server (one or several: `engine_servers`, the least loaded
first, a dead one dropped) with the regeneration client's retries and deadlines; finished
shards are kept in `<entry>.partial/` and journaled, so a capture killed with SIGKILL resumes with
only the unfinished shard asked again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm

from trainer.data.endpoint import EndpointError, run_workers
from trainer.data.engine_servers import (
    EngineLayout,
    EngineServers,
    FeatureEndpointSettings,
    engine_layer_ids,
    probe_inputs,
)
from trainer.data.feature_store import (
    FEATURE_INDEX,
    ShardWriter,
    feature_store_path,
    remove_interrupted_captures,
    store_fingerprint,
)
from trainer.fileio import check_safetensors_file, fsync_path, reporting_disk_full, write_file_atomically
from trainer.locks import lock_cache_entry
from trainer.models.target import FrozenTarget, TargetTokenizer

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.jsonl"  # one line per finished shard of an unfinished store
ENGINE_SHARD_SAMPLES = 64  # samples per shard: what a killed capture asks again at most


STOCK_CONNECTOR = {"kv_connector": "ExampleHiddenStatesConnector"}


def engine_feature_arguments(
    layer_ids: Sequence[int], storage: str | Path, connector: dict[str, str] | None = None
) -> list[str]:
    """vLLM's two flags that make a server write the hidden states of `layer_ids` (the draft's
    target_layer_ids) under `storage`: extract_hidden_states, and the hidden-states connector
    (`connector` replaces the stock one, e.g. the CPU variant of the engine tests)."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(layer_ids)}},
    }
    transfer = {
        **(connector or STOCK_CONNECTOR),
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


def engine_feature_command(
    target: str, layer_ids: Sequence[int], storage: str, tensor_parallel: int = 1, served_name: str | None = None
) -> list[str]:
    """The `vllm serve` command of a GPU node serving the target's hidden states for `layer_ids`."""
    command = ["vllm", "serve", target]
    if served_name:
        command += ["--served-model-name", served_name]
    if tensor_parallel > 1:
        command += ["--tensor-parallel-size", str(tensor_parallel)]
    return [*command, *engine_feature_arguments(layer_ids, storage)]


def check_engine_layers(layer_ids: Sequence[int], num_layers: int, final_hidden: bool) -> None:
    """Refuse, in one line, what a vLLM feature endpoint cannot return as in-process capture does."""
    if final_hidden:
        raise ValueError(
            "feature_endpoint: distillation (loss_type kd, or kd_weight > 0) needs the target's final-normed "
            "hidden states, which vLLM's extract_hidden_states does not return: capture in process "
            "(unset feature_endpoint) or train with loss_type ce"
        )
    last = num_layers - 1
    if last in [int(layer_id) for layer_id in layer_ids]:
        raise ValueError(
            f"feature_endpoint: target_layer_ids {list(layer_ids)} includes the target's last layer ({last}), "
            "which vLLM returns before the final norm and in-process capture after it: choose earlier layers, "
            "or capture in process (unset feature_endpoint)"
        )


def prepare_engine_features(
    settings: FeatureEndpointSettings,
    target: FrozenTarget | TargetTokenizer,
    dataset: datasets.Dataset,
    layer_ids: Sequence[int],
    cache_root: Path,
    dtype: torch.dtype = torch.float32,
    shard_samples: int = ENGINE_SHARD_SAMPLES,
) -> Path:
    """The feature store of `dataset` (as `prepare_features` would write it), built through a vLLM
    server. An existing store is reused; an unfinished one is resumed; one process writes it."""
    check_engine_layers(layer_ids, target.num_layers, final_hidden=False)
    path = feature_store_path(target, dataset, layer_ids, cache_root, dtype)
    if (path / FEATURE_INDEX).exists():
        logger.info("Reusing offline target features from %s", path)
        return path
    with lock_cache_entry(path, "feature store"):
        if (path / FEATURE_INDEX).exists():
            logger.info("Reusing offline target features from %s (captured by another process)", path)
            return path
        remove_interrupted_captures(path)  # an in-process capture of this entry that was killed
        staging = path.with_name(path.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        shards = _recovered_shards(staging)
        done = {sample for shard in shards for sample in shard["samples"]}
        progress_file = staging / PROGRESS_FILE

        kept = f"the finished shards are kept in {staging}: free space, then rerun to resume"

        def journal(shard: dict[str, Any]) -> None:
            with reporting_disk_full("feature store", path, kept), progress_file.open("a") as file:
                file.write(json.dumps(shard) + "\n")
                file.flush()
                os.fsync(file.fileno())

        writer = ShardWriter(staging, path, len(dataset), shard_samples, shards, journal, kept)
        rows = [row for row in range(len(dataset)) if row not in done]
        logger.info(
            "Capturing target hidden states through %s: asking %d of %d samples",
            ", ".join(endpoint.url for endpoint in settings.endpoints),
            len(rows),
            len(dataset),
        )
        try:
            asyncio.run(_capture_through_engine(settings, target, dataset, rows, layer_ids, dtype, writer))
        except EndpointError as error:
            writer.flush()  # the samples already read are kept too
            raise EndpointError(
                f"{error}; {writer.captured} of {len(dataset)} samples are captured and kept in {staging}: "
                "rerun to resume"
            ) from None
        writer.flush()
        index = writer.index(store_fingerprint(target, layer_ids, dtype, False))
        with reporting_disk_full("feature store", path, kept):
            write_file_atomically(staging / FEATURE_INDEX, lambda temporary: temporary.write_text(json.dumps(index)))
        progress_file.unlink()
        fsync_path(staging)
        os.replace(staging, path)
    return path


def _recovered_shards(staging: Path) -> list[dict[str, Any]]:
    """The journaled shards of an unfinished store whose files are whole; anything else in the
    folder (a shard written but not journaled, a torn journal line) is removed and asked again."""
    progress_file = staging / PROGRESS_FILE
    shards: list[dict[str, Any]] = []
    lines = progress_file.read_text().splitlines() if progress_file.exists() else []
    for line in lines:
        try:
            shard = json.loads(line)
            header = check_safetensors_file(staging / shard["file"])
            if not all(f"sample_{sample}" in header for sample in shard["samples"]):
                raise ValueError("a journaled sample is missing from its shard")
        except (ValueError, KeyError, TypeError, OSError):
            continue
        shards.append(shard)
    if len(shards) != len(lines):
        logger.warning(
            "%s: %d of %d journaled shards are damaged and asked again", staging, len(lines) - len(shards), len(lines)
        )
    if shards or lines:
        logger.info("Resuming the feature capture in %s: %d shards already captured", staging, len(shards))
    keep = {shard["file"] for shard in shards}
    for leftover in staging.iterdir():
        if leftover.name not in keep:
            leftover.unlink()
    text = "".join(json.dumps(shard) + "\n" for shard in shards)
    write_file_atomically(progress_file, lambda temporary: temporary.write_text(text))
    return shards


async def _capture_through_engine(
    settings: FeatureEndpointSettings,
    target: FrozenTarget | TargetTokenizer,
    dataset: datasets.Dataset,
    rows: list[int],
    layer_ids: Sequence[int],
    dtype: torch.dtype,
    writer: ShardWriter,
) -> None:
    pending = iter(rows)
    total = len(dataset)
    layout = EngineLayout(tuple(int(layer_id) for layer_id in layer_ids), target.hidden_size)
    async with EngineServers(settings, layout) as servers:
        tokenizer = target.require_tokenizer()
        await servers.check(tokenizer, *probe_inputs(tokenizer))
        progress = tqdm(
            total=total,
            initial=total - len(rows),
            desc=f"capturing target hidden states through {', '.join(servers.urls)}",
        )

        async def capture(row: int) -> None:
            ids = [int(token) for token in dataset[row]["input_ids"]]
            features = await servers.features(ids, f"sample {row}")
            writer.add(row, features.to(dtype), token_ids=ids)
            progress.update(1)

        async def worker() -> None:
            for row in pending:
                await capture(row)

        try:
            await run_workers(worker, sum(endpoint.concurrency for endpoint in settings.endpoints))
        finally:
            progress.close()
