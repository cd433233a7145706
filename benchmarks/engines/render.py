"""benchmarks/results/engines.json -> its section of docs/results.md (between the engines markers).

The sentences are benchmarks/templates/engines.md; this module only computes the values (table
cells, ratios, which of the two "hidden" sentences holds). The docs' numbers come from the JSON
only: the throughput run calls `write_docs` itself, and `python -m benchmarks.results_doc` (or
`python -m benchmarks.engines.render`) rewrites the section from the committed JSON. The markers
and templates are handled by benchmarks.doc_parts, the one implementation for every measured
document; tests check that the docs equal what the JSON renders to.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from benchmarks import doc_parts
from benchmarks.doc_parts import duration, number, table_rows

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "engines.json"
DOCS = REPO / "docs" / "results.md"
NAME = "engines"
TEMPLATE = "engines"  # benchmarks/templates/engines.md: the sentences
BEGIN, END = doc_parts.markers(NAME)


def part(name: str, values: dict[str, Any] | None = None) -> str:
    return doc_parts.render(TEMPLATE, name, values)


def run_rows(runs: dict[str, dict[str, Any]]) -> str:
    """One table row per way of running: seconds, tokens and tokens/s."""
    return table_rows(
        [
            [name, number(run["seconds"], 1), str(run["tokens"]), number(run["tokens_per_second"], 1)]
            for name, run in runs.items()
        ]
    )


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


def training_part(training: dict[str, Any] | None) -> str:
    """One epoch of training from each source of features (benchmarks/engines/streamed.py)."""
    if not training:
        return ""
    rows = [
        [
            name,
            number(run["train_seconds"], 1),
            number(run["supervised_tokens_per_second"], 1),
            mebibytes(run["peak_rss_bytes"]),
            mebibytes(run["peak_server_file_bytes"]) if "peak_server_file_bytes" in run else "–",
            mebibytes(run["disk_bound_bytes"]) if "disk_bound_bytes" in run else "–",
        ]
        for name, run in training["runs"].items()
    ]
    depth = training["prefetch_that_hides_the_engine"]
    hidden = part("hidden" if depth is not None else "not-hidden", {"share": training["hide_share"], "depth": depth})
    values = {
        "training": training,
        "rows": table_rows(rows),
        "hidden": hidden,
        "answer_ms": training["engine_seconds_per_micro_batch"] * 1000,
        "step_ms": training["step_seconds_without_waiting"] * 1000,
    }
    return part("training", values)


def memory_part(memory: dict[str, Any] | None) -> str:
    """What a training process holds of the target, whole or embedding and LM head alone."""
    if not memory:
        return ""
    large = memory["deepseek_v3"]
    values = {
        "small": memory["smollm2"],
        "large": large,
        "full_gib": large["full_mib"] / 1024,
        "head_gib": large["head_only_mib"] / 1024,
    }
    return part("memory", values)


def render(result: dict[str, Any]) -> str:
    """The Markdown of one engines.json (the lines between the markers)."""
    regeneration, features, servers = result["regeneration"], result["features"], result["servers"]
    temperature = regeneration["temperature"]
    sampling = part("greedy") if temperature == 0 else part("temperature", {"temperature": temperature})
    startups = (
        part("startup", {"name": name, "duration": duration(server["startup_seconds"])})
        for name, server in servers.items()
    )
    values = {
        "measured": part("measured", result),
        "note": part("note", {"note": result["note"]}) if result.get("note") else "",
        "regeneration": part(
            "regeneration",
            {
                "regeneration": regeneration,
                "sampling": sampling,
                "rows": run_rows(regeneration["runs"]),
                "ratio": speed_ratio(regeneration["runs"]),
            },
        ),
        "features": part(
            "features",
            {"features": features, "rows": run_rows(features["runs"]), "ratio": speed_ratio(features["runs"])},
        ),
        "training": training_part(result.get("training")),
        "memory": memory_part(result.get("target_memory")),
        "servers": part(
            "servers",
            {
                "startups": ", ".join(startups),
                "total": duration(result["total_seconds"]),
                "commands": "\n".join(command_line(server) for server in servers.values()),
            },
        ),
    }
    return part("engines", values)


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
