"""benchmarks/results/engines.json -> its section of docs/results.md (between the engines markers).

The docs' numbers come from the JSON only: the throughput run calls `write_docs` itself, and
`python -m benchmarks.results_doc` (or `python -m benchmarks.engines.render`) rewrites the section
from the committed JSON. The markers are handled by benchmarks.doc_parts, the one implementation
for every measured document; tests check that the docs equal what the JSON renders to.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from benchmarks import doc_parts
from benchmarks.doc_parts import duration

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "engines.json"
DOCS = REPO / "docs" / "results.md"
NAME = "engines"
BEGIN, END = doc_parts.markers(NAME)


def runs_table(heading: str, runs: dict[str, dict[str, Any]], tokens_label: str) -> list[str]:
    lines = [f"| {heading} | seconds | {tokens_label} | tokens/s |", "|---|---:|---:|---:|"]
    for name, run in runs.items():
        lines.append(f"| {name} | {run['seconds']:.1f} | {run['tokens']} | {run['tokens_per_second']:.1f} |")
    return lines


def speed_ratio(runs: dict[str, dict[str, Any]]) -> float:
    """Tokens/s of the second way over the first (vLLM over in process): the one figure of a run
    that holds across machines' absolute speeds, computed here so the JSON and docs agree."""
    first, second = list(runs.values())
    return second["tokens_per_second"] / first["tokens_per_second"]


def command_line(server: dict[str, Any]) -> str:
    """The server's exact command, its environment first, as a shell would take it."""
    environment = [f"{key}={shlex.quote(str(value))}" for key, value in server["environment"].items()]
    return " ".join([*environment, shlex.join(server["command"])])


def mebibytes(count: float) -> str:
    return f"{count / 2**20:,.1f}"


def training_lines(training: dict[str, Any] | None) -> list[str]:
    """One epoch of training from each source of features (benchmarks/engines/streamed.py)."""
    if not training:
        return []
    lines = [
        f"| training: one epoch, {training['supervised_tokens']} supervised tokens, micro-batch "
        f"{training['micro_batch']} | train seconds | supervised tokens/s | trainer peak RSS (MiB) | "
        "peak server files (MiB) | their bound (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in training["runs"].items():
        disk = mebibytes(run["peak_server_file_bytes"]) if "peak_server_file_bytes" in run else "–"
        bound = mebibytes(run["disk_bound_bytes"]) if "disk_bound_bytes" in run else "–"
        lines.append(
            f"| {name} | {run['train_seconds']:.1f} | {run['supervised_tokens_per_second']:.1f} | "
            f"{mebibytes(run['peak_rss_bytes'])} | {disk} | {bound} |"
        )
    depth = training["prefetch_that_hides_the_engine"]
    share = f"{training['hide_share']:.0%}"
    hidden = (
        f"streaming reaches {share} of the offline store's supervised tokens/s from feature_prefetch {depth} on"
        if depth is not None
        else f"no feature_prefetch tried reaches {share} of the offline store's supervised tokens/s here, where the "
        "server computes on the same two cores as the training"
    )
    latency, step = training["engine_seconds_per_micro_batch"], training["step_seconds_without_waiting"]
    return [
        *lines,
        "",
        f"The offline store took {training['store_seconds']:.1f} s to write through vLLM before its run; {hidden}. "
        "Server files on disk stay within feature_prefetch micro-batches (the bound, float32 here). The idle "
        f"server answers a micro-batch in {latency * 1000:.0f} ms and a step with its features at hand takes "
        f"{step * 1000:.0f} ms, so where the server has its own devices (the two-node layout of docs/scale.md) "
        f"feature_prefetch {training['prefetch_to_hide_latency']} covers one answer per step "
        "(⌈answer / step⌉; keep one more for jitter).",
        "",
    ]


def memory_lines(memory: dict[str, Any] | None) -> list[str]:
    """What a training process holds of the target, whole or embedding and LM head alone."""
    if not memory:
        return []
    small, large = memory["smollm2"], memory["deepseek_v3"]
    full, head = small["full"], small["head_only"]
    return [
        f"A training process's memory for the target ({small['dtype']}): loading `{small['target']}` whole, a "
        f"fresh process peaks at {full['peak_rss_mib']:,.0f} MiB resident ({full['held_parameter_mib']:,.0f} MiB of "
        f"parameters); as its embedding and LM head alone (`TargetHead`, streamed features) at "
        f"{head['peak_rss_mib']:,.0f} MiB ({head['held_parameter_mib']:,.0f} MiB), of which "
        f"{head['after_imports_rss_mib']:,.0f} MiB is Python, torch and transformers before any load. For "
        f"`{large['config']}` ({large['dtype']}, counted on the meta device): {large['full_mib'] / 1024:,.0f} GiB "
        f"whole against {large['head_only_mib'] / 1024:,.1f} GiB of embedding and LM head "
        f"({large['head_only_fraction']:.2%}).",
        "",
    ]


def render(result: dict[str, Any]) -> str:
    """The Markdown of one engines.json (the lines between the markers)."""
    machine, regeneration, features = result["machine"], result["regeneration"], result["features"]
    servers = result["servers"]
    greedy = "greedy" if regeneration["temperature"] == 0 else f"temperature {regeneration['temperature']}"
    lines = [
        f"Measured by `make bench-engines` on {machine['cores']} {machine['cpu']} cores (torch {machine['torch']}, "
        f"{machine['torch_threads']} threads; {machine['vllm']}), target `{result['target']}` in float32, "
        f"{result['concurrency']} sequences at a time both ways; ratios compare the two ways within this one run.",
        "",
        *runs_table(
            f"regeneration: {regeneration['prompts']} prompts, {regeneration['max_new_tokens']} new tokens, {greedy}",
            regeneration["runs"],
            "generated tokens",
        ),
        "",
        f"vLLM / in process: {speed_ratio(regeneration['runs']):.2f}× generated tokens/s; "
        f"{regeneration['rows_with_equal_tokens']} of {regeneration['prompts']} answers token for token the same.",
        "",
        *runs_table(
            f"features: {features['samples']} samples, layers {features['layer_ids']}", features["runs"], "tokens"
        ),
        "",
        f"vLLM / in process: {speed_ratio(features['runs']):.2f}× tokens/s; largest relative difference "
        f"of a sample's hidden states: {features['max_relative_error']:.1e}.",
        "",
        *training_lines(result.get("training")),
        *memory_lines(result.get("target_memory")),
        "Server start-up (not in the timings above): "
        + ", ".join(f"{name} {duration(server['startup_seconds'])}" for name, server in servers.items())
        + f"; the whole run {duration(result['total_seconds'])}. The servers' commands:",
        "",
        "```bash",
        *(command_line(server) for server in servers.values()),
        "```",
    ]
    if result.get("note"):  # what the reader must know about this run (e.g. a loaded machine)
        lines[1:1] = ["", f"Note: {result['note']}"]
    return "\n".join(lines)


def section(text: str) -> str:
    """What lies between the engines markers of `text` (a document), without the newlines next to them."""
    return doc_parts.section(text, NAME)


def write_docs(result: dict[str, Any], docs: Path = DOCS) -> str:
    """Replace the section of `docs` with `render(result)` (temp file + rename); the section."""
    body = render(result)
    doc_parts.write_text_atomically(docs, doc_parts.replace_section(docs.read_text(), NAME, body))
    return body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    print(write_docs(json.loads(args.results.read_text()), args.docs))


if __name__ == "__main__":
    main()
