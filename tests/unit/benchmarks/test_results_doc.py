"""The measured documents are written from the results JSON: the committed docs equal what the
renderer gives, templates fill exactly, and `benchmarks.demo` collects a run folder and refuses a
warm cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cpu_doc, demo, demo_doc, doc_parts, results_doc
from trainer.commands.runner import run


def test_committed_documents_are_what_the_committed_json_renders():
    """Edit the JSON or the renderer, then `python -m benchmarks.results_doc`; never the numbers by hand."""
    assert results_doc.stale_documents(results_doc.DOCUMENTS, results_doc.RESULTS) == []


def test_fill_formats_values_and_reads_none_as_not_measured():
    assert doc_parts.fill(
        "τ {tau:.2f} over {steps} steps, {missing}", {"tau": 2.0654, "steps": 92, "missing": None}
    ) == ("τ 2.07 over 92 steps, not measured")
    with pytest.raises(KeyError, match="absent"):
        doc_parts.fill("{absent}", {})


def test_fill_reads_keys_of_a_mapping_and_names_the_missing_root():
    assert doc_parts.fill("{run[steps]} steps, {run[tau]:.1f}", {"run": {"steps": 4, "tau": None}}) == (
        "4 steps, not measured"
    )
    with pytest.raises(KeyError, match="run"):
        doc_parts.fill("{run[steps]}", {})


def test_template_parts_split_at_their_part_lines(tmp_path: Path, monkeypatch):
    def write(name: str, text: str) -> None:
        (tmp_path / f"{name}.{doc_parts.MARKDOWN}").write_text(text)

    write("t", "<!-- one -->\nA {x}.\n\n| a |\n\n<!-- two -->\n\nB\n")
    write("twice", "<!-- one -->\nA\n<!-- one -->\nB\n")
    write("loose", "stray\n<!-- one -->\nA\n")
    monkeypatch.setattr(doc_parts, "TEMPLATES", tmp_path)
    doc_parts.template_parts.cache_clear()
    try:
        assert doc_parts.template_parts("t") == {"one": "A {x}.\n\n| a |", "two": "\nB"}
        assert doc_parts.render("t", "one", {"x": 1}) == "A 1.\n\n| a |"
        with pytest.raises(KeyError, match="no part 'three'"):
            doc_parts.render("t", "three")
        with pytest.raises(ValueError, match="appears twice"):
            doc_parts.template_parts("twice")
        with pytest.raises(ValueError, match="before the first"):
            doc_parts.template_parts("loose")
    finally:
        doc_parts.template_parts.cache_clear()


def test_an_empty_block_leaves_no_blank_lines_behind(tmp_path: Path, monkeypatch):
    (tmp_path / f"t.{doc_parts.MARKDOWN}").write_text("<!-- page -->\n{a}\n\n{b}\n\n{c}\n")
    monkeypatch.setattr(doc_parts, "TEMPLATES", tmp_path)
    doc_parts.template_parts.cache_clear()
    try:
        assert doc_parts.render("t", "page", {"a": "A", "b": "", "c": "C"}) == "A\n\nC"
        assert doc_parts.render("t", "page", {"a": "A", "b": "B", "c": ""}) == "A\n\nB"
    finally:
        doc_parts.template_parts.cache_clear()


def test_every_template_part_is_one_a_renderer_asks_for():
    """A part no code renders is prose that never reaches a document."""
    sources = {
        "common": "doc_parts.py",
        "cpu": "cpu_doc.py",
        "demo": "demo_doc.py",
        "engines": "engines/render.py",
        "long_context": "long_context_doc.py",
    }
    benchmarks = Path(doc_parts.__file__).parent
    assert sorted(path.stem for path in doc_parts.TEMPLATES.glob(f"*.{doc_parts.MARKDOWN}")) == sorted(sources)
    for name, source in sources.items():
        code = (benchmarks / source).read_text()
        unused = [
            part
            for part in doc_parts.template_parts(name)
            if f'"{part}"' not in code and f'"{part.split("-", 1)[0]}-' not in code and part not in code
        ]
        assert unused == [], f"template {name}: parts no renderer uses: {unused}"


def test_replace_section_rewrites_only_between_its_markers():
    text = "head\n<!-- a:begin -->\nold\n<!-- a:end -->\nmiddle <!-- b:begin -->x<!-- b:end --> tail\n"
    new = doc_parts.replace_section(text, "a", "new body")
    assert new == "head\n<!-- a:begin -->\nnew body\n<!-- a:end -->\nmiddle <!-- b:begin -->x<!-- b:end --> tail\n"
    assert doc_parts.section(new, "a") == "new body" and doc_parts.section(new, "b") == "x"
    with pytest.raises(ValueError, match="c:begin"):
        doc_parts.replace_section(text, "c", "body")


def tiny_demo() -> dict:
    """A demo.json small enough to work every sentence out by hand."""
    path = {"steps": 4, "tokens": 8, "per_position_acceptance": [0.5, 0.25, 0.0], "matches_target": True}
    return {
        "ran_commands": True,
        "cache": "empty",
        "commands": [{"command": ".venv/bin/python examples/train.py", "seconds": 75.4}],
        "date": "2026-01-02",
        "commit": "abc1234",
        "dirty": False,
        "machine": {
            "cores": 2,
            "cpu": "x86_64",
            "torch": "2.13.0",
            "torch_threads": 2,
            "device": "cpu",
            "dtype": "float32",
        },
        "training": {
            "steps": 10,
            "train_runtime_seconds": 30.0,
            "seconds_per_step": 3.0,
            "evaluations": [{"step": 0, "seconds": 2.0}, {"step": 10, "seconds": 4.0}],
            "eval_spec_tau": [{"step": 0, "tau": 1.0}, {"step": 10, "tau": 1.5}],
            "spec_eval_prompts": 3,
            "batch_size": 4,
            "num_anchors": 16,
            "kd_weight": 0.5,
            "train_samples": 256,
            "dtype": "float32",
            "block_size": 8,
        },
        "teacher_forced": {"trained": {"loss": 3.0, "tau_walk": 3.0}},
        "speculative": {
            "heldout": {
                "benchmark": "heldout",
                "prompts": 2,
                "max_new_tokens": 8,
                "temperature": 0.0,
                "target_tokens_per_second": 10.0,
                "lossless": True,
                "paths": {
                    "untrained/unary": {**path, "mean_tau": 1.0, "tokens_per_second": 4.0, "speedup": 0.4},
                    "trained/selector": {**path, "mean_tau": 2.5, "tokens_per_second": 12.0, "speedup": 1.2},
                    "trained/unary": {**path, "mean_tau": 2.0, "tokens_per_second": 9.0, "speedup": 0.9},
                },
            },
            "humaneval": None,
        },
        "tau_gap": {
            "prompts": 2,
            "max_new_tokens": 8,
            "training_eval": {"walk": 3.0, "unary": 2.5},
            "paths": {
                name: {
                    "mode": mode,
                    "real_tau": real,
                    "teacher_forced_tau_at_real_anchors": real,
                    "teacher_forced_tau_at_real_anchors_cut_like_decoding": real,
                    "steps": 4,
                    "same_steps": 3,
                    "whole_steps": 3,
                    "same_whole_steps": 3,
                    "teacher_forced_tau_all_anchors": every,
                    "all_anchor_count": 10,
                }
                for name, mode, real, every in (("selector", "walk", 2.0, 2.5), ("unary", "unary", 1.5, 2.25))
            },
        },
        "tau_gap_all_prompts": None,
    }


def test_demo_sentences_on_hand_made_figures():
    figures = tiny_demo()
    assert demo_doc.provenance(figures) == (
        "Measured by `python -m benchmarks.demo` (the Makefile's `make demo` commands, then the τ-gap commands, each "
        "timed) on 2026-01-02 at commit abc1234, on 2 x86_64 CPU cores, torch 2.13.0 (2 threads), float32, from an "
        "empty `DFLASH2_CACHE`, so the first command's time includes the target's conversion, its answers and the "
        "feature capture."
    )
    assert demo_doc.command_rows(figures) == [
        "| command | time |",
        "|---|---:|",
        "| `examples/train.py` | 1 min 15 s |",
        "| all of them | 1 min 15 s |",
    ]
    assert demo_doc.command_label(".venv/bin/dflash2 train --x 1") == "dflash2 train --x 1"
    assert demo_doc.training_sentence(figures) == (
        "By the trainer's own clock, training took 30.0 s for 10 steps, 3.00 s per step with its 2 teacher-forced "
        "evaluations (about 3 s each) and the real-decoding `eval_spec_tau` inside (batch 4, 16 anchors per row, 256 "
        "training prompts). The recipe trains half cross-entropy, half distillation (`kd_weight: 0.5`)."
    )
    assert demo_doc.spec_tau_sentence(figures) == (
        "During training `eval_spec_tau` (3 held-out prompts decoded for real) went 1.00 → 1.50 at steps 0 and 10 "
        "(3 prompts: a noisy figure)."
    )
    assert demo_doc.real_against_forced(figures) == (
        "Real τ of the selector walk (2.50) is below the teacher-forced one (3.00)."
    )
    gap = figures["tau_gap"]
    # (c) - (a): 2.5 - 2.0 and 2.25 - 1.5; (d) - (c): 3.0 - 2.5 and 2.5 - 2.25
    assert demo_doc.decomposition_sentence(gap) == (
        "Of the gap between (d) and (a) (selector / unary), the anchors decoding visits account for (c) − (a) = "
        "0.50 / 0.75 and the decoded prompts differing from the training evaluation's for (d) − (c) = 0.50 / 0.25."
    )
    assert demo_doc.columns_sentence(gap) == "The selector walk is above the unary argmax in every τ row, (a) to (d)."
    gap["paths"]["unary"]["teacher_forced_tau_all_anchors"] = 2.75
    assert (
        demo_doc.columns_sentence(gap)
        == "The selector walk is above the unary argmax in the τ rows (a), (b), (d) only."
    )
    assert demo_doc.agreement_sentence(gap).endswith(
        "(selector: 3 of 4 steps, 3 of 3 whole blocks; unary: 3 of 4 steps, 3 of 3 whole blocks): every whole block "
        "agrees, so the 2 differing step(s) are last blocks cut short by the token budget."
    )
    # the untrained draft runs at 0.4x: a step costs 1 / 0.4 = 2.5 target steps; the selector path is 1.2x
    assert demo_doc.cost_sentence(figures).startswith(
        "Faster than the target alone: held-out chat trained draft, selector walk (1.20×): with a 135M-parameter "
        "target on 2 CPU cores, one step (a draft pass plus the target verifying a block of 8) costs about 2.5 "
        "single-token target steps (the untrained draft, τ 1.00, runs at 0.40×)"
    )
    acceptance = demo_doc.render_acceptance(figures)
    assert "| held-out chat | trained draft, selector walk | 2.500 | 12.0 | 1.20× | 0.50 / 0.25 / 0.00 |" in acceptance
    assert acceptance.endswith("In domain, the selector walk is above the unary argmax by 0.50 τ (2.50 vs 2.00).")


def test_missing_figures_read_not_measured():
    figures = {**tiny_demo(), "commands": None, "ran_commands": False, "tau_gap": None}
    text = demo_doc.render_demo(figures)
    assert "| the demo's commands | not measured |" in text
    assert "| (a)–(d), the τ-gap table | not measured | not measured |" in text
    assert "(`--max-samples 30 --max-new-tokens 48`): not measured." in text
    assert demo_doc.provenance(figures).startswith("Collected by `python -m benchmarks.demo --collect-only`")
    assert "| τ unary argmax | not measured | not measured |" in demo_doc.render_demo(figures)


def test_compare_section_from_a_comparison_json():
    def row(tau: float, spread: float, gflop: float) -> dict:
        figures = {key: {"mean": tau, "spread": spread} for key in ("heldout_tau", "heldout_tau_unary")}
        figures.update({key: {"mean": 1.0, "spread": 0.0} for key in ("humaneval_tau", "teacher_forced_tau")})
        return {"seeds": [0, 1], **figures, "seconds_per_step": {"mean": 1.0, "spread": 0.1}, "gflop_per_step": gflop}

    text = demo_doc.render_compare(
        {"recipes": {"dflash2-ce": row(2.2, 0.05, 80.0), "dflash2-ce+kd": row(2.0, 0.05, 100.0)}}
    )
    assert (
        "| dflash2-ce | 2 | 2.200 ± 0.050 | 2.200 ± 0.050 | 1.000 ± 0.000 | 1.000 ± 0.000 | 1.000 ± 0.100 | 80.0 |"
        in text
    )
    # 2.2 - 2.0 = +0.200 > 0.05 + 0.05; +10.0% of 2.0; 80 / 100 - 1 = -20.0% FLOPs
    verdict = "- dflash2-ce beats dflash2-ce+kd beyond the seed spread on held-out τ"
    assert f"{verdict} (+0.200 against a combined spread of 0.100)" in text
    assert text.endswith("- dflash2-ce: held-out τ 2.200, +0.200 (+10.0%), -20.0% FLOPs per step against dflash2-ce+kd")


def test_check_names_the_stale_document_and_exits_1(tmp_path: Path, monkeypatch, capsys):
    doc = tmp_path / "stale.txt"  # (a page name ending in the doc suffix would have to exist in the repo)
    doc.write_text("intro\n<!-- s:begin -->\nhand-typed 9.99\n<!-- s:end -->\n")
    (tmp_path / "s.json").write_text(json.dumps({"tau": 2.5}))
    sections = (results_doc.Section("s", "s.json", lambda r: doc_parts.fill("τ {tau:.1f}", r)),)
    monkeypatch.setattr(results_doc, "DOCUMENTS", {doc: sections})
    monkeypatch.setattr(results_doc, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as stop:
        run(results_doc.main, ["--check"])
    assert stop.value.code == 1
    assert capsys.readouterr().out.strip().splitlines() == [
        f"{doc} differs from what {tmp_path} gives: run python -m benchmarks.results_doc"
    ]
    assert results_doc.main([]) == [doc]
    assert doc.read_text() == "intro\n<!-- s:begin -->\nτ 2.5\n<!-- s:end -->\n"


def fake_run(folder: Path) -> Path:
    """What a demo run leaves, with numbers small enough to check by hand."""
    run_dir = folder / "run"
    (run_dir / "speculative" / "heldout").mkdir(parents=True)
    metrics = {"eval_loss": 3.0, "eval_accuracy": 0.4, "eval_tau_unary": 2.5, "eval_tau_walk": 3.0}
    history = [
        {"step": 0, "eval_loss": 50.0, "eval_runtime": 2.0},
        {"step": 0, "eval_spec_tau": 1.0},
        {"step": 5, "loss": 4.0},
        {"step": 10, "eval_loss": 3.0, "eval_runtime": 4.0},
        {"step": 10, "eval_spec_tau": 1.5},
        {"step": 10, "train_runtime": 30.0},
        {"step": 10, **metrics, "eval_runtime": 3.0},  # the summary's evaluation after training
        {"step": 0, "eval_spec_tau": 1.0},
    ]
    (run_dir / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": history}))
    recipe = {
        "training_arguments": {"per_device_train_batch_size": 4, "num_anchors": 16, "kd_weight": 0.5, "bf16": False},
        "data_arguments": {"num_train_samples": 256},
    }
    (run_dir / "dflash2_recipe.json").write_text(json.dumps(recipe))
    (run_dir / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 8}}))
    path = {"mean_tau": 2.0, "steps": 4, "tokens": 8, "tokens_per_second": 9.0, "speedup": 0.9, "tau_histogram": [1]}
    report = {"benchmark": "heldout", "prompts": 2, "max_new_tokens": 8, "temperature": 0.0}
    report |= {"target_tokens_per_second": 10.0, "lossless": True, "paths": {"trained/unary": path}}
    (run_dir / "speculative" / "heldout" / "speculative_report.json").write_text(json.dumps(report))
    gap_path = {
        "mode": "unary",
        "real_tau": 2.0,
        "teacher_forced_tau_at_real_anchors": 2.0,
        "teacher_forced_tau_at_real_anchors_cut_like_decoding": 2.0,
        "steps": 4,
        "same_acceptance_fraction": 0.75,
        "whole_steps": 3,
        "same_acceptance_fraction_whole_steps": 1.0,
        "teacher_forced_tau_all_anchors": 2.25,
        "all_anchor_count": 10,
        "per_prompt": [{"sequence": [1, 2, 3]}],
    }
    gap = {"prompts": 2, "max_new_tokens": 8, "paths": {"unary": gap_path}, "training_eval": {"unary": 2.5}}
    (run_dir / "speculative" / "tau_gap.json").write_text(json.dumps(gap))
    return run_dir


def test_collect_only_builds_demo_json_from_a_run_folder(tmp_path: Path, capsys):
    run_dir = fake_run(tmp_path)
    output = tmp_path / "demo.json"
    demo.main(["--collect-only", "--run", str(run_dir), "--output", str(output)])
    result = json.loads(output.read_text())
    assert result["ran_commands"] is False and result["commands"] is None and result["cache"] is None
    training = result["training"]
    assert training["train_runtime_seconds"] == 30.0 and training["seconds_per_step"] == 3.0  # 30 s / 10 steps
    # the evaluations inside training only: not the summary's after it
    assert training["evaluations"] == [{"step": 0, "seconds": 2.0}, {"step": 10, "seconds": 4.0}]
    assert training["eval_spec_tau"] == [{"step": 0, "tau": 1.0}, {"step": 10, "tau": 1.5}]
    assert (training["batch_size"], training["num_anchors"], training["kd_weight"], training["block_size"]) == (
        4,
        16,
        0.5,
        8,
    )
    assert training["dtype"] == result["machine"]["dtype"] == "float32"
    assert result["teacher_forced"]["trained"] == {
        "loss": 3.0,
        "accuracy": 0.4,
        "tau_unary": 2.5,
        "tau_walk": 3.0,
        "tau_oracle": None,
        "coverage": None,
    }
    heldout = result["speculative"]["heldout"]
    assert heldout["target_tokens_per_second"] == 10.0 and "tau_histogram" not in heldout["paths"]["trained/unary"]
    assert heldout["paths"]["trained/unary"]["speedup"] == 0.9 and result["speculative"]["humaneval"] is None
    unary = result["tau_gap"]["paths"]["unary"]
    assert (unary["same_steps"], unary["same_whole_steps"]) == (3, 3)  # 0.75 of 4 steps, all 3 whole blocks
    assert "per_prompt" not in unary and result["tau_gap"]["training_eval"] == {"unary": 2.5}
    assert result["tau_gap_all_prompts"] is None
    assert result["machine"]["cores"] >= 1 and result["date"]
    # what the renderer makes of it: nothing missing crashes it
    assert "not measured" in demo_doc.render_demo(result)


def test_the_demo_refuses_a_cache_that_is_not_empty(tmp_path: Path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "targets").mkdir()
    monkeypatch.setenv("DFLASH2_CACHE", str(cache))
    with pytest.raises(SystemExit) as stop:
        run(demo.main, ["--run", str(tmp_path / "run")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: DFLASH2_CACHE={cache} is not an empty directory: empty it, or pass --reuse-cache"]
    monkeypatch.delenv("DFLASH2_CACHE")
    with pytest.raises(SystemExit) as stop:
        run(demo.main, ["--run", str(tmp_path / "run")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: DFLASH2_CACHE is not set")
    assert demo.check_cache({"DFLASH2_CACHE": str(tmp_path / "absent")}, False) == "empty"
    assert demo.check_cache({"DFLASH2_CACHE": str(tmp_path / "run")}, False) == "empty"
    assert demo.check_cache({}, True) == "reused"


def test_the_demo_refuses_an_existing_run_folder(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as stop:
        run(demo.main, ["--run", str(fake_run(tmp_path))])
    assert stop.value.code == 2
    assert "exists: move it away first" in capsys.readouterr().err


def test_makefile_commands_join_continuations_and_expand_variables(tmp_path: Path):
    makefile = tmp_path / "Makefile"
    makefile.write_text(
        "BIN := .venv/bin\nRUN := outputs/run\n\nother:\n\techo no\n\n"
        "demo: setup\n\t$(BIN)/python train.py\n"
        "\t@$(BIN)/python evaluate.py --draft $(RUN) \\\n\t\t--max 8\n\nnext:\n\techo no\n"
    )
    assert demo.makefile_commands(makefile) == [
        ".venv/bin/python train.py",
        ".venv/bin/python evaluate.py --draft outputs/run --max 8",
    ]
    with pytest.raises(ValueError, match="no 'absent' target"):
        demo.makefile_commands(makefile, "absent")
    # the real Makefile's demo target: commands, every variable expanded
    commands = demo.makefile_commands()
    assert commands and all("$(" not in command for command in commands)


def test_a_demo_run_times_the_makefile_commands_then_the_tau_gap_and_collects(tmp_path: Path, monkeypatch):
    """The wiring of a real run, with the commands themselves replaced (a demo takes ten minutes)."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    ran: list[str] = []

    tree = {"commit": "before0", "dirty": False}

    def pretend(command: str) -> dict:
        if not ran:  # the first command (training) leaves the run folder
            fake_run(tmp_path)
        tree.update(commit="after00", dirty=True)  # the working tree moves on while the demo runs
        ran.append(command)
        return {"command": command, "seconds": 2.5}

    monkeypatch.setattr(demo, "timed", pretend)
    monkeypatch.setattr(demo, "git_commit", lambda: dict(tree))
    output = tmp_path / "demo.json"
    result = demo.main(["--run", str(tmp_path / "run"), "--output", str(output)])
    relative = demo.os.path.relpath(tmp_path / "run", demo.REPO)
    assert ran == [*demo.makefile_commands(), *demo.tau_gap_commands(".venv/bin/dflash2", relative)]
    assert ran[-1].endswith(f"--max-samples 30 --max-new-tokens 48 --output {relative}/speculative/tau_gap_30x48.json")
    assert json.loads(output.read_text()) == result
    assert result["ran_commands"] is True and result["cache"] == "empty"
    assert [entry["seconds"] for entry in result["commands"]] == [2.5] * len(ran)
    assert json.loads((tmp_path / "run" / demo.TIMINGS_FILE).read_text())["commands"] == result["commands"]
    assert demo_doc.command_rows(result)[-1] == f"| all of them | {2.5 * len(ran):.1f} s |"
    # the tree as the commands found it, not as it was when they finished (someone committed meanwhile)
    assert (result["commit"], result["dirty"]) == ("before0", False)


def tiny_packing(packed_padding: float) -> dict:
    """A packing.json small enough to check the section by hand."""
    orders = ("padded", "grouped", "packed")
    training = {
        name: {
            "seconds_per_step": 2.0,
            "supervised_tokens_per_micro_batch": 100.0 * (i + 1),
            "supervised_tokens_per_micro_batch_all": 90.0 * (i + 1),
            "blocks_per_supervised_token": 0.125,
            "draft_attention_pairs_per_supervised_token": {"dense": 4000.0 * (i + 1), "visible": 250.0},
        }
        for i, name in enumerate(orders)
    }
    return {
        "lengths": {
            "count": 50,
            "conversations_sampled": 80,
            "conversations_in_dataset": 7168,
            "truncated_to": 4096,
            "median": 300,
            "p90": 1500.0,
            "p99": 4000.0,
            "max": 4096,
            "mean": 600.4,
        },
        "settings": {
            "seed": 0,
            "micro_batch": 4,
            "max_length": 4096,
            "threads": 2,
            "train_max_length": 512,
            "train_steps": 6,
            "warmup_steps": 1,
            "target_flops": {"layers_run": 34, "layer_ids": [1, 33]},
        },
        "training": {"samples": 40, **training},
        "micro_batches": {"padded": 13, "grouped": 13, "packed": 8},
        "padding_fraction": {"padded": 0.5, "grouped": 0.1, "packed": packed_padding},
        "target_gflop_per_supervised_token": {"padded": 80.0, "grouped": 40.0, "packed": 35.0},
        "supervised_tokens_per_second": {"padded": 50.0, "grouped": 55.0, "packed": 60.0},
        "packed_vs_separate": {"anchors": 12, "document_lengths": [96, 45, 41], "max_abs_loss_diff": 3e-5},
        "seconds": 200.0,
    }


def test_packing_section_computes_whether_the_padding_target_was_reached():
    text = cpu_doc.render_packing(tiny_packing(0.009))
    assert "| `packing: true` | 8 | 0.9% | 35.0 | 2.00 | 300 (270) | 60 | 1.20× | 0.125 | 12000 (250) |" in text
    assert "| random order, padded | 13 | 50.0% | 80.0 | 2.00 | 100 (90) | 50 | 1.00× | 0.125 | 4000 (250) |" in text
    assert "1.5× the grouped order's attention pairs per supervised token" in text
    assert "Packed padding ≤ 5%: reached (0.9%)" in text and "difference 3e-05" in text
    assert "ran 1.20× the padded order's supervised tokens/s and 1.09× the grouped order's (above it;" in text
    assert "The same 12 anchors in three documents of 96, 45, 41 tokens" in text
    assert "decoder layers 0–33" in text and "median 300 tokens, p90 1500" in text
    assert "Packed padding ≤ 5%: **not reached** (6.0%)" in cpu_doc.render_packing(tiny_packing(0.06))
