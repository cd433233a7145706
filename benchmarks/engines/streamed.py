"""Training from engine features against the other two ways, on the real target (part of `make
bench-engines`): one epoch of `dflash2 train` over the same token samples with the features
(1) captured in process by the whole target, (2) read from an offline store the vLLM server wrote
beforehand, and (3) streamed from the vLLM server while training at several `feature_prefetch`
depths. Each run is a fresh process (`dflash2 train` through `trainer.commands.train.main`) with its
own cache; what is compared is the trainer's own `train_runtime` (the epoch, data waits included,
start-up excluded) as supervised tokens per second, the peak RSS of the trainer's main process
(`process_memory.peak_rss_kib`), and for the streamed runs the peak bytes of server files on disk (the storage folder
sampled every 5 ms) against the bound `online_features.streamed_disk_bound` states.

The in-process and offline-store runs happen while no server shares the two cores; the streamed
runs share them with the server, as a single machine must.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from benchmarks.engines.vllm_server import REPO, SERVED_NAME, TARGET

PREFETCH_DEPTHS = (1, 2, 4)
MICRO_BATCH = 4
MAX_LENGTH = 128
CONVERSATIONS = 48
HIDE_SHARE = 0.9  # a depth hides the engine once its tokens/s reach this share of the offline store's
# run `dflash2 train` in a fresh process and print its main process's peak RSS (KiB) last
TRAIN_AND_MEASURE = (
    "import json, sys\n"
    "from benchmarks.process_memory import peak_rss_kib\n"
    "from trainer.commands import train\n"
    "train.main(sys.argv[1:])\n"
    "print(json.dumps({'peak_rss_kib': peak_rss_kib()}))\n"
)


def write_conversations(path: Path) -> None:
    """Short chitchat openings with answers of varied length (the engine tests' recipe data)."""
    from trainer.data.dataset import chitchat_prompts

    lines = []
    for index, prompt in enumerate([prompt for prompt in chitchat_prompts() if len(prompt) < 120][:CONVERSATIONS]):
        answer = " ".join(["A short and friendly answer."] * (1 + index % 3))
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        )
    path.write_text("\n".join(lines) + "\n")


def recipe(root: Path, name: str, **keys: Any) -> Path:
    values = {
        "target": TARGET,
        "draft_config": str(REPO / "hub_configs" / "smollm2-135m-dflash2.json"),
        "dataset": str(root / "conversations.jsonl"),
        "regenerate": False,
        "max_length": MAX_LENGTH,
        "offline": False,
        "cache_dir": str(root / f"cache-{name}"),
        "output_dir": str(root / f"run-{name}"),
        "num_train_epochs": 1,
        "per_device_train_batch_size": MICRO_BATCH,
        "learning_rate": 0.001,
        "num_anchors": 16,
        "kd_weight": 0.0,
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "no",
        "spec_eval_prompts": 0,
        "report_to": [],
        "seed": 0,
        **keys,
    }
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(values))
    return path


def supervised_tokens(recipe_path: Path) -> tuple[int, int]:
    """(supervised tokens, tokens) of the recipe's training samples, as training truncates them."""
    from trainer.data.dataset import token_datasets
    from trainer.models.target import TargetTokenizer
    from trainer.training.arguments import parse_arguments

    _, data_args, _ = parse_arguments([str(recipe_path)], None)
    train, _ = token_datasets(data_args, TargetTokenizer.load(TARGET))
    return sum(sum(mask) for mask in train["loss_mask"]), sum(len(ids) for ids in train["input_ids"])


@contextmanager
def peak_folder_bytes(folder: Path, interval: float = 0.005) -> Iterator[dict[str, int]]:
    """The most bytes of `.safetensors` files seen in `folder` while the block runs."""
    seen = {"peak_bytes": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            total = 0
            for path in folder.glob("*.safetensors"):
                with suppress(FileNotFoundError):  # read and removed meanwhile
                    total += path.stat().st_size
            seen["peak_bytes"] = max(seen["peak_bytes"], total)
            time.sleep(interval)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


def run_here(arguments: list[str]) -> str:
    """A Python command of this repository in a fresh process (the engine's packages never mixed in):
    its stdout; a failure raises with its stderr's tail."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, *arguments], cwd=REPO, env=environment, capture_output=True, text=True, timeout=3600
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments[-2:])} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def train(recipe_path: Path) -> dict[str, Any]:
    """One `dflash2 train` in a fresh process: its train_runtime and its peak RSS."""
    output = run_here(["-c", TRAIN_AND_MEASURE, str(recipe_path)])
    peak = json.loads(output.strip().splitlines()[-1])["peak_rss_kib"] * 1024
    state = json.loads((Path(json.loads(recipe_path.read_text())["output_dir"]) / "trainer_state.json").read_text())
    runtime = next(entry["train_runtime"] for entry in reversed(state["log_history"]) if "train_runtime" in entry)
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    return {"train_seconds": runtime, "steps": state["global_step"], "peak_rss_bytes": peak, "losses": losses}


def micro_batch_latency(recipe_path: Path, count: int = 8) -> float:
    """Median seconds the server takes to answer one micro-batch (its samples asked at once, as a
    loader process does) while nothing else runs: what `feature_prefetch` must hide."""
    import statistics

    import torch

    from trainer.data.dataset import feature_endpoint_settings, token_datasets
    from trainer.data.engine_servers import EngineLayout
    from trainer.data.online_features import StreamedFeatures, StreamSource
    from trainer.models.target import TargetTokenizer
    from trainer.training.arguments import parse_arguments

    model_args, data_args, _ = parse_arguments([str(recipe_path)], None)
    target = TargetTokenizer.load(TARGET)
    tokens, _ = token_datasets(data_args, target)
    layer_ids = json.loads(Path(model_args.draft_config).read_text())["dflash_config"]["target_layer_ids"]
    layout = EngineLayout(tuple(layer_ids), target.hidden_size)
    source = StreamSource.open(feature_endpoint_settings(data_args), target.tokenizer, layout, torch.float32)
    dataset = StreamedFeatures(tokens, source)
    seconds = []
    for start in range(0, min(count * MICRO_BATCH, len(tokens)), MICRO_BATCH):
        began = time.perf_counter()
        dataset.__getitems__(list(range(start, min(start + MICRO_BATCH, len(tokens)))))
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def prepare(recipe_path: Path) -> float:
    """`dflash2 prepare` (the offline store, through the server): its wall seconds."""
    started = time.perf_counter()
    run_here(["-m", "trainer", "prepare", str(recipe_path)])
    return time.perf_counter() - started


class StreamedTrainingBench:
    """The three ways, run in the order the cores allow: `before_server`, then `with_server(server)`
    while the feature server is up, then `after_server`; `result()` gathers them."""

    def __init__(self, root: Path, layer_ids: list[int], hidden_size: int):
        self.root, self.layer_ids, self.hidden_size = root, layer_ids, hidden_size
        self.runs: dict[str, dict[str, Any]] = {}
        self.store_seconds: float | None = None
        self.latency: float | None = None
        root.mkdir(parents=True, exist_ok=True)
        write_conversations(root / "conversations.jsonl")
        self.supervised, self.tokens = supervised_tokens(recipe(root, "count"))

    def _record(self, name: str, run: dict[str, Any]) -> None:
        run["supervised_tokens_per_second"] = self.supervised / run["train_seconds"]
        self.runs[name] = run

    def before_server(self) -> None:
        self._record("in process (whole target)", train(recipe(self.root, "in-process")))

    def with_server(self, server: Any) -> None:
        from trainer.data.engine_servers import EngineLayout
        from trainer.data.online_features import streamed_disk_bound

        engine = {
            "feature_endpoint": [server.url],
            "feature_model": SERVED_NAME,
            "feature_storage_path": [str(server.storage)],
        }
        self.store_recipe = recipe(self.root, "offline-store", **{**engine, "offline": True})
        self.store_seconds = prepare(self.store_recipe)
        layout = EngineLayout(tuple(self.layer_ids), self.hidden_size)
        self.latency = micro_batch_latency(recipe(self.root, "latency", **engine))
        for depth in PREFETCH_DEPTHS:
            streamed = recipe(self.root, f"streamed-{depth}", **engine, feature_prefetch=depth)
            with peak_folder_bytes(server.storage) as disk:
                run = train(streamed)
            run["peak_server_file_bytes"] = disk["peak_bytes"]
            # float32 files on this CPU server; a micro-batch is at most MICRO_BATCH samples of MAX_LENGTH tokens
            run["disk_bound_bytes"] = streamed_disk_bound(depth, MICRO_BATCH * MAX_LENGTH, layout, 4)
            run["feature_prefetch"] = depth
            self._record(f"streamed, feature_prefetch {depth}", run)

    def after_server(self) -> None:
        self._record("offline store (written by vLLM)", train(self.store_recipe))

    def result(self) -> dict[str, Any]:
        store = self.runs["offline store (written by vLLM)"]["supervised_tokens_per_second"]
        streamed = [run for run in self.runs.values() if "feature_prefetch" in run]
        hiding = [
            run["feature_prefetch"] for run in streamed if run["supervised_tokens_per_second"] >= HIDE_SHARE * store
        ]
        stored = self.runs["offline store (written by vLLM)"]
        step = stored["train_seconds"] / stored["steps"]  # a training step with its features at hand
        return {
            "engine_seconds_per_micro_batch": self.latency,
            "step_seconds_without_waiting": step,
            # on separate machines (the server's own GPUs), enough micro-batches ahead to cover one answer
            "prefetch_to_hide_latency": max(1, math.ceil(self.latency / step)),
            "samples_tokens": self.tokens,
            "supervised_tokens": self.supervised,
            "micro_batch": MICRO_BATCH,
            "max_length": MAX_LENGTH,
            "store_seconds": self.store_seconds,
            "runs": self.runs,
            "hide_share": HIDE_SHARE,
            "prefetch_that_hides_the_engine": min(hiding) if hiding else None,
        }
