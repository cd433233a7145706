"""The measured documents, written from the results JSON: `python -m benchmarks.results_doc`.

Every generated part of docs/results.md and docs/performance.md lies between a pair of markers
(`<!-- NAME:begin -->` ... `<!-- NAME:end -->`) and is rewritten from its JSON under
benchmarks/results/: demo.json (`python -m benchmarks.demo`), engines.json (`make bench-engines`),
cpu.json (`make bench`), packing.json (`make bench-packing`, also written by `make bench`),
long_context.json (`make bench-long-context`) and compare.json (a copy of `make compare`'s
outputs/compare/comparison.json).
The sentences are templates under benchmarks/templates/, filled from the JSON by
benchmarks.demo_doc, benchmarks.cpu_doc, benchmarks.long_context_doc and benchmarks.engines.render
with the pieces in benchmarks.doc_parts. The
comparisons in them (which path is ahead, whether a target was reached) are computed, never
asserted. A section whose JSON does not exist is left as it stands. `--check` rewrites nothing and
exits 1, naming the document, when a committed document differs from what the JSON gives (a test
runs the same check).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import cpu_doc, demo_doc, long_context_doc
from benchmarks.doc_parts import replace_section, section, write_text_atomically
from benchmarks.engines import render as engines_render
from trainer.commands.runner import command_parser, run

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RESULTS_DOC = REPO / "docs" / "results.md"
PERFORMANCE_DOC = REPO / "docs" / "performance.md"


@dataclass(frozen=True)
class Section:
    """One generated part of a document: its marker name, its JSON and the renderer."""

    name: str
    results: str  # file name under benchmarks/results/
    render: Callable[[dict[str, Any]], str]


DOCUMENTS: dict[Path, tuple[Section, ...]] = {
    RESULTS_DOC: (
        Section("demo", "demo.json", demo_doc.render_demo),
        Section("acceptance", "demo.json", demo_doc.render_acceptance),
        Section("compare", "compare.json", demo_doc.render_compare),
        Section("engines", "engines.json", engines_render.render),
        Section(long_context_doc.NAME, "long_context.json", long_context_doc.render),
    ),
    PERFORMANCE_DOC: (
        Section("cpu-machine", "cpu.json", cpu_doc.render_cpu_machine),
        Section("cpu-train-step", "cpu.json", cpu_doc.render_train_step),
        Section("cpu-op-counts", "cpu.json", cpu_doc.render_op_counts),
        Section("cpu-compile", "cpu.json", cpu_doc.render_compile),
        Section("cpu-capture", "cpu.json", cpu_doc.render_capture),
        Section("cpu-planner", "cpu.json", cpu_doc.render_planner),
        Section("cpu-spec-decode", "cpu.json", cpu_doc.render_spec_decode),
        Section("cpu-loss-memory", "cpu.json", cpu_doc.render_loss_memory),
        Section("cpu-targets", "cpu.json", cpu_doc.render_targets),
        Section("packing", "packing.json", cpu_doc.render_packing),
    ),
}


def rendered(text: str, sections: tuple[Section, ...], results: Path = RESULTS) -> str:
    """`text` with every section whose JSON exists rewritten from it; the others left as they are."""
    for part in sections:
        path = results / part.results
        if path.exists():
            text = replace_section(text, part.name, part.render(json.loads(path.read_text())))
        else:
            section(text, part.name)  # the markers must be there even when the JSON is not
    return text


def stale_documents(documents: dict[Path, tuple[Section, ...]], results: Path) -> list[Path]:
    return [
        doc for doc, sections in documents.items() if doc.read_text() != rendered(doc.read_text(), sections, results)
    ]


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> list[Path]:
    """Rewrite the stale documents (or, with --check, name them and exit 1); the documents rewritten."""
    parser = command_parser("python -m benchmarks.results_doc", __doc__)
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a document is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_documents(DOCUMENTS, RESULTS)
        for doc in stale:
            print(f"{shown(doc)} differs from what {shown(RESULTS)} gives: run python -m benchmarks.results_doc")
        if stale:
            raise SystemExit(1)
        return []
    changed = []
    for doc, sections in DOCUMENTS.items():
        text = doc.read_text()
        new = rendered(text, sections, RESULTS)
        if new != text:
            write_text_atomically(doc, new)
            changed.append(doc)
        print(f"{shown(doc)}: {'rewritten' if new != text else 'unchanged'}")
    return changed


if __name__ == "__main__":
    run(main)
