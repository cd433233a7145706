"""Target features streamed from vLLM servers while training (`feature_endpoint` with `offline:
false`): no feature store; the training processes hold only the target's embedding and LM head.

`StreamedFeatures` is a map-style dataset over the token samples whose items carry `target_hidden`
asked of the servers when the item is fetched (`engine_servers.request_features`: the requests,
checks, layer mapping and deadlines of the offline store). The window ahead is PyTorch's own
data-loader prefetch: the run uses `feature_prefetch` data-loader processes with a prefetch factor
of 1 (`configure_streamed_run`), so while one micro-batch trains, the next `feature_prefetch`
are being asked; each process asks its micro-batch's samples at once (`__getitems__`) and removes
every server file as soon as it is read. The server files on disk at any moment are therefore at
most `feature_prefetch` micro-batches' worth (`streamed_disk_bound`), whatever the dataset's size.

The order is the trainer's sampler's, so a resumed run skips exactly the consumed micro-batches and
asks the same samples in the same order; the features are a pure function of a sample's token ids.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from trainer.data.engine_servers import EngineLayout, EngineServers, FeatureEndpointSettings, ServerBoard, probe_inputs

logger = logging.getLogger(__name__)


def streams_engine_features(data_args) -> bool:
    """Whether a run's features come from `feature_endpoint` while it trains (`offline: false`): the
    training processes then never run, nor load, the target's decoder layers."""
    return bool(data_args.feature_endpoint) and not data_args.offline


@dataclass(frozen=True)
class StreamSource:
    """What every data-loader process needs to ask the servers without probing them again: the
    settings, the layout, the served model names and nudge prompt found by the probe, the shared
    board of loads and drops, and the dtype the features are handed to training in."""

    settings: FeatureEndpointSettings
    layout: EngineLayout
    models: tuple[str, ...]
    nudge_prompt: tuple[int, ...]
    board: ServerBoard
    dtype: torch.dtype

    @classmethod
    def open(
        cls, settings: FeatureEndpointSettings, tokenizer: Any, layout: EngineLayout, dtype: torch.dtype
    ) -> StreamSource:
        """Probe every server once (it serves the target, writes where the recipe says, with the
        draft's layers), before any training starts."""
        probe, nudge = probe_inputs(tokenizer)
        board = ServerBoard(len(settings.endpoints))

        async def check() -> list[str]:
            async with EngineServers(settings, layout, board) as servers:
                return await servers.check(tokenizer, probe, nudge)

        models = asyncio.run(check())
        logger.info(
            "Streaming target features from %s (%d layers at width %d)",
            ", ".join(endpoint.url for endpoint in settings.endpoints),
            len(layout.engine_ids),
            layout.hidden_size,
        )
        return cls(settings, layout, tuple(models), tuple(nudge), board, dtype)


class _ProcessClient:
    """One process's event loop and pool (clients cannot cross a fork)."""

    def __init__(self, source: StreamSource):
        self.loop = asyncio.new_event_loop()
        self.servers = EngineServers(
            source.settings, source.layout, source.board, list(source.models), list(source.nudge_prompt)
        )

    def features(self, samples: Sequence[list[int]], names: Sequence[str]) -> list[torch.Tensor]:
        async def ask() -> list[torch.Tensor]:
            tasks = [
                asyncio.ensure_future(self.servers.features(ids, name))
                for ids, name in zip(samples, names, strict=True)
            ]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:  # the first failure ends the others (nothing is left running in the loop)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        try:
            return self.loop.run_until_complete(ask())
        finally:
            self.servers.remove_nudge_files()


class StreamedFeatures(torch.utils.data.Dataset):
    """Token samples joined with their target features, asked of the servers on access. `tokens`
    is the token dataset (what packing, length grouping and a resume read)."""

    def __init__(self, tokens: datasets.Dataset, source: StreamSource):
        self.tokens, self.source = tokens, source
        self._client: tuple[int, _ProcessClient] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The samples at `indices`, their features asked of the servers together."""
        samples = [dict(self.tokens[int(index)]) for index in indices]
        ids = [[int(token) for token in sample["input_ids"]] for sample in samples]
        features = self._process_client().features(ids, [f"sample {int(index)}" for index in indices])
        for sample, hidden in zip(samples, features, strict=True):
            sample["target_hidden"] = hidden.to(self.source.dtype)
        return samples

    def _process_client(self) -> _ProcessClient:
        if self._client is None or self._client[0] != os.getpid():
            self._client = (os.getpid(), _ProcessClient(self.source))
        return self._client[1]

    def __getstate__(self) -> dict[str, Any]:  # a spawned data-loader process makes its own client
        return {**self.__dict__, "_client": None}


def streamed_disk_bound(prefetch: int, micro_batch_tokens: int, layout: EngineLayout, element_bytes: int) -> int:
    """The most bytes of server files on disk at once while streaming: every micro-batch being
    asked (`prefetch` of them) with all its samples' files written and none read yet."""
    return prefetch * micro_batch_tokens * len(layout.engine_ids) * layout.hidden_size * element_bytes


def configure_streamed_run(model_args, data_args, training_args) -> None:
    """Refuse what a run without the target's decoder layers cannot do, then set up the data loader
    that streams: `feature_prefetch` processes, each asking one micro-batch, with a prefetch factor
    of 1 (the window is exactly `feature_prefetch` micro-batches). A recipe that sets its own
    data-loader processes is refused: the window would not be the one it names."""
    if training_args.spec_eval_prompts > 0:
        raise ValueError(
            f"spec_eval_prompts: {training_args.spec_eval_prompts}, but real speculative decoding runs the whole "
            "target, which a run streaming engine features (feature_endpoint, offline: false) does not load: set "
            "spec_eval_prompts: 0 and decode the saved draft with `dflash2 evaluate` where the target fits"
        )
    if model_args.target_sharding != "none":
        raise ValueError(
            f"target_sharding: {model_args.target_sharding}, but a run streaming engine features (feature_endpoint, "
            "offline: false) loads no decoder layers to shard (only the embedding and LM head): set "
            "target_sharding: none"
        )
    workers = training_args.dataloader_num_workers
    if workers not in (0, data_args.feature_prefetch):
        raise ValueError(
            f"dataloader_num_workers: {workers}, but streamed engine features (feature_endpoint, offline: false) "
            f"fetch with feature_prefetch={data_args.feature_prefetch} data-loader processes: unset "
            "dataloader_num_workers and size the window with feature_prefetch"
        )
    training_args.dataloader_num_workers = data_args.feature_prefetch
    training_args.dataloader_prefetch_factor = 1
