"""A run owns its output_dir for good (issue 31, deliver 1).

A second run on a folder holding another run's results is refused in one line unless it resumes
or overwrites (and overwriting removes exactly the run's files, never half of one); an output_dir
that is, holds or lies inside what the run reads is refused; a signal's message names a checkpoint
that exists; `make demo` keeps the previous demo; reports never replace another draft's report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.faults.train_with_fault import AtStep
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.commands import train
from trainer.commands.runner import run
from trainer.evaluation import report as report_module
from trainer.locks import RUN_LOCK_NAME, lock_run_folder
from trainer.training import output_dir as output_dir_module
from trainer.training import run as training_run
from trainer.training.checkpoints import checkpoint_problems, clean_leftovers, list_checkpoints, write_manifest
from trainer.training.output_dir import OutputDirInUseError, check_fresh_start, check_output_dir, remove_run

REPO = Path(__file__).resolve().parents[2]
RUN = {"num_eval_samples": 0, "max_steps": 4, "save_steps": 2, "disable_tqdm": True}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A tiny run trained to step 4 (checkpoint-2, checkpoint-4 and the final draft), kept pristine."""
    root = tmp_path_factory.mktemp("finished")
    train.main([str(write_tiny_run(root, **RUN))])
    return root


def copy_of(finished: Path, where: Path) -> Path:
    """The finished run's files (target, data, recipe, output) under `where`, recipe paths rewritten."""
    shutil.copytree(finished, where, dirs_exist_ok=True, ignore=shutil.ignore_patterns(RUN_LOCK_NAME))
    recipe = yaml.safe_load((where / "recipe.yaml").read_text())
    recipe.update(
        {key: value.replace(str(finished), str(where)) for key, value in recipe.items() if isinstance(value, str)}
    )
    (where / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return where / "recipe.yaml"


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(argv: list[str], capsys) -> str:
    """Run `dflash2 train argv`: it must exit 2 with exactly one `error:` line, which is returned."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run(train.main, argv)
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error: " in line]
    assert len(errors) == 1, errors
    return errors[0][errors[0].index("error: ") :]


# -- row 1: another run on a folder with results --------------------------------------------------


def test_a_second_run_on_a_finished_run_is_refused_and_the_first_stays_whole(finished, tmp_path, capsys):
    """Before: rc 0, the second run replaced model.safetensors and checkpoint-4 and rotation took its own
    checkpoint-2. Now a different recipe, and the same recipe again, are both refused before anything
    loads, naming the folder, what it holds and the two ways on."""
    recipe = copy_of(finished, tmp_path)
    output = tmp_path / "output"
    before = tree(output)
    for flags in (["--learning_rate", "0.02", "--save_total_limit", "1"], []):
        error = refused([str(recipe), *flags], capsys)
        assert error == (
            f"error: output_dir {output} holds another run's results (checkpoint-2, checkpoint-4, config.json, "
            "dflash2_recipe.json, … 3 more): continue it with --resume_from_checkpoint true, replace them with "
            "--overwrite_output_dir true, or choose another output_dir"
        )
    after = tree(output)
    assert {name: data for name, data in after.items() if name != RUN_LOCK_NAME} == {
        name: data for name, data in before.items() if name != RUN_LOCK_NAME
    }


def test_overwrite_replaces_exactly_the_earlier_run_and_resume_continues_it(finished, tmp_path, capsys):
    recipe = copy_of(finished, tmp_path)
    output = tmp_path / "output"
    (output / "notes.txt").write_text("mine")  # not a run's file: overwriting keeps it
    error = refused([str(recipe), "--resume_from_checkpoint", "true", "--overwrite_output_dir", "true"], capsys)
    assert error.startswith("error: resume_from_checkpoint true and overwrite_output_dir: true contradict each other")

    train.main([str(recipe), "--overwrite_output_dir", "true", "--learning_rate", "0.02", "--max_steps", "2"])
    assert [path.name for path in list_checkpoints(output)] == ["checkpoint-2"]  # the first run's checkpoint-4 went
    recorded = json.loads((output / "checkpoint-2" / "dflash2_recipe.json").read_text())
    assert recorded["training_arguments"]["learning_rate"] == 0.02
    assert json.loads((output / "trainer_state.json").read_text())["global_step"] == 2
    assert (output / "notes.txt").read_text() == "mine"
    assert not [path.name for path in output.iterdir() if path.name.startswith(".deleting-")]

    # the run now in the folder is continued by a resume (same recipe), never refused
    train.main([str(recipe), "--learning_rate", "0.02", "--resume_from_checkpoint", "true"])
    assert [path.name for path in list_checkpoints(output)][-1] == "checkpoint-4"


@pytest.mark.parametrize(
    ("layout", "resume", "overwrite", "error"),
    [
        ({}, None, False, None),  # a new folder
        ({".dflash2-run.lock": "", "runs/x": "", ".staging-checkpoint-2/checkpoint-2/a": ""}, None, False, None),
        ({"checkpoint-2/a": ""}, None, True, None),
        ({"checkpoint-2/a": ""}, "true", False, None),
        ({"checkpoint-2/a": ""}, "{output}/checkpoint-2", False, None),
        ({"model.safetensors": ""}, None, False, "holds another run's results (model.safetensors): continue it"),
        ({"model.safetensors": ""}, True, False, "holds another run's results (model.safetensors) but no checkpoint-N"),
        ({"checkpoint-2/a": ""}, "{elsewhere}/checkpoint-2", False, "lies outside it"),
        ({"checkpoint-2/a": ""}, "{elsewhere}/checkpoint-2", True, None),
        ({}, "true", True, "contradict each other"),
        ({}, "{output}/checkpoint-2", True, "contradict each other"),
    ],
)
def test_what_a_folder_with_results_allows(tmp_path, layout, resume, overwrite, error):
    output = tmp_path / "output"
    for name, text in layout.items():
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        (output / name).write_text(text)
    if isinstance(resume, str):
        resume = resume.format(output=output, elsewhere=tmp_path / "elsewhere")
    if error is None:
        check_output_dir(output, resume, overwrite)
    else:
        with pytest.raises((OutputDirInUseError, ValueError), match=error.replace("(", r"\(").replace(")", r"\)")):
            check_output_dir(output, resume, overwrite)


def test_resume_true_with_results_but_no_complete_checkpoint_does_not_start_over(tmp_path):
    """`true` starts at step 0 in a result-free folder (a job's first launch), never over results."""
    check_fresh_start(tmp_path / "new")
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(OutputDirInUseError, match="but no complete checkpoint to resume from"):
        check_fresh_start(tmp_path)


def test_overwrite_renames_everything_aside_before_deleting(tmp_path, monkeypatch):
    """Killed after the renames and before the delete, nothing is left half-deleted under its own
    name: the run's files are all inside one .deleting- folder, which the next start removes."""
    output = tmp_path / "output"
    for name in ("checkpoint-2/model.safetensors", "model.safetensors", "runs/events", "speculative/heldout/r.json"):
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        (output / name).write_text("x")
    (output / "mine.txt").write_text("kept")
    with lock_run_folder(output):

        def killed(path, *args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(output_dir_module.shutil, "rmtree", killed)
        with pytest.raises(KeyboardInterrupt):
            remove_run(output)
        names = sorted(path.name for path in output.iterdir())
        assert names[0].startswith(".deleting-overwritten-")
        assert names[1:] == [RUN_LOCK_NAME, "mine.txt"]
        assert sorted(path.name for path in (output / names[0]).iterdir()) == [
            "checkpoint-2",
            "model.safetensors",
            "runs",
            "speculative",
        ]
        monkeypatch.undo()
        clean_leftovers(output)
        assert sorted(path.name for path in output.iterdir()) == [RUN_LOCK_NAME, "mine.txt"]


# -- row 2: the signal's message names a checkpoint that exists -----------------------------------


def test_a_signal_names_the_checkpoint_it_saved_and_that_checkpoint_exists(tmp_path, capsys, monkeypatch):
    """A resume from checkpoint-2 of a folder that also holds checkpoint-4, save_total_limit 1, SIGTERM
    at step 3: before, rotation deleted the checkpoint-3 just saved (and checkpoint-2), the message
    named checkpoint-3 anyway and its resume was refused. Now checkpoint-3 is kept and named, with
    the resume flag that continues from it (true would pick checkpoint-4)."""
    recipe = write_tiny_run(tmp_path, **RUN)
    train.main([str(recipe)])
    output = tmp_path / "output"

    class Signalled(training_run.DFlash2Trainer):  # SIGTERM while step 3 is computed, as a scheduler sends it
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(AtStep(3, on_begin=lambda: os.kill(os.getpid(), signal.SIGTERM)))

    monkeypatch.setattr(training_run, "DFlash2Trainer", Signalled)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    flags = ["--resume_from_checkpoint", str(output / "checkpoint-2"), "--save_total_limit", "1"]
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as stop:
            run(train.main, [str(recipe), *flags])
    finally:  # the run keeps its handlers until the process exits: this process goes on
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert stop.value.code == 128 + signal.SIGTERM
    [said] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("interrupted:")]
    checkpoint = output / "checkpoint-3"
    assert said == (
        f"interrupted: stopped by SIGTERM after step 3: saved a complete checkpoint at {checkpoint}; "
        f"run the same command with --resume_from_checkpoint {checkpoint} to continue"
    )
    assert checkpoint.is_dir() and checkpoint_problems(checkpoint) == []
    # the suggested resume is taken
    monkeypatch.undo()
    train.main([str(recipe), "--resume_from_checkpoint", str(checkpoint), "--save_total_limit", "1"])
    assert json.loads((output / "trainer_state.json").read_text())["global_step"] == 4


def test_the_message_falls_back_to_the_newest_checkpoint_when_the_saved_one_is_gone(tmp_path):
    class Stub:
        class args:
            output_dir = str(tmp_path)
            overwrite_output_dir = True

        class preemption:
            signum, stopped_at_step = signal.SIGTERM, 1

        last_checkpoint = tmp_path / "checkpoint-1"  # rotated away by someone else

    newest = tmp_path / "checkpoint-4"
    newest.mkdir()
    (newest / "trainer_state.json").write_text("{}")
    write_manifest(newest, 4)
    message = str(training_run.interruption(Stub))
    assert message == (
        f"stopped by SIGTERM after step 1: saved a complete checkpoint at {newest}; run the same command with "
        "--resume_from_checkpoint true and --overwrite_output_dir false to continue"
    )


# -- row 3: output_dir against what the run reads ----------------------------------------------------


@pytest.mark.parametrize(
    ("output", "relation", "source"),
    [
        ("target", "is", "target"),
        ("target/sub", "lies inside", "target"),
        (".", "holds", "target"),
        ("chat.jsonl", "is", "dataset"),
        ("cache", "is", "cache_dir"),
        ("cache/runs/a", "lies inside", "cache_dir"),
        ("source", "is", "init_from checkpoint"),
        ("linked", "is", "target"),  # a symlink to the target
    ],
)
def test_an_output_dir_over_what_the_run_reads_is_refused(
    finished, tmp_path, capsys, monkeypatch, output, relation, source
):
    """Before: `--output_dir` the target's folder exited 0 with the target's config.json and
    model.safetensors replaced by the draft's."""
    recipe = copy_of(finished, tmp_path)
    shutil.rmtree(tmp_path / "output")
    DFlash2DraftModel(tiny_draft_config_for(tiny_target())).save_pretrained(tmp_path / "source")
    (tmp_path / "linked").symlink_to(tmp_path / "target")
    monkeypatch.chdir(tmp_path)  # relative output_dirs resolve against the working directory
    before = tree(tmp_path / "target")
    error = refused(
        [str(recipe), "--output_dir", output, "--init_from", str(tmp_path / "source"), "--cache_dir", "cache"], capsys
    )
    named = {"target": tmp_path / "target", "dataset": tmp_path / "chat.jsonl", "cache_dir": tmp_path / "cache"}
    named["init_from checkpoint"] = tmp_path / "source"
    assert error.startswith(f"error: output_dir {output} {relation} the {source} ")
    assert str(named[source]) in error and error.endswith("choose an output_dir of its own")
    assert tree(tmp_path / "target") == before
    assert not (tmp_path / output / RUN_LOCK_NAME).exists()


# -- row 4: make demo keeps the previous demo ---------------------------------------------------------


def make_keep_previous(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "-C", str(REPO), "demo-keep-previous", f"RUN={run_dir}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_moves_the_previous_demo_aside_and_says_where(tmp_path):
    run_dir = tmp_path / "outputs" / "smollm2-135m-dflash2"
    fresh = make_keep_previous(run_dir)  # a fresh machine: nothing to keep
    assert fresh.returncode == 0 and fresh.stdout == "", fresh.stderr
    for folder in (run_dir, Path(f"{run_dir}-export")):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_text(folder.name)
    kept = make_keep_previous(run_dir)
    assert kept.returncode == 0, kept.stderr
    lines = kept.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("make demo: kept the previous ") for line in lines)
    assert not run_dir.exists() and not Path(f"{run_dir}-export").exists()
    moved = sorted((path.name for path in run_dir.parent.iterdir()), key=lambda name: name.split(".previous-"))
    assert [name.split(".previous-")[0] for name in moved] == ["smollm2-135m-dflash2", "smollm2-135m-dflash2-export"]
    assert (run_dir.parent / moved[0] / "model.safetensors").read_text() == "smollm2-135m-dflash2"
    assert f"as {run_dir.parent / moved[0]}" in lines[0]
    # a demo still training there is never moved from under it
    run_dir.mkdir()
    with lock_run_folder(run_dir):
        busy = make_keep_previous(run_dir)
    assert busy.returncode != 0 and f"{run_dir} is in use by a running training" in busy.stderr
    assert run_dir.is_dir()


# -- row 5: a report never replaces another draft's report -------------------------------------------


def two_drafts_of_one_name(tmp_path: Path) -> tuple[Path, Path]:
    drafts = []
    for parent in ("a", "b"):
        folder = tmp_path / parent / "my-export"
        DFlash2DraftModel(tiny_draft_config_for(tiny_target())).save_pretrained(folder)
        drafts.append(folder)
    return drafts[0], drafts[1]


def test_two_drafts_of_one_folder_name_get_their_own_reports(tmp_path, monkeypatch, capsys):
    """Before: both reports went to outputs/evaluate/my-export/custom, the second over the first."""
    from trainer.commands import evaluate

    monkeypatch.chdir(tmp_path)
    target = tiny_target()
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.txt").write_text("hi how are you\n")
    first, second = two_drafts_of_one_name(tmp_path)
    common = ["--target", str(tmp_path / "target"), "--prompts", "prompts.txt", "--max-new-tokens", "4"]
    common += ["--paths", "unary"]
    evaluate.main([*common, "--draft", str(first)])
    first_report = tmp_path / "outputs" / "evaluate" / "my-export" / "custom" / "speculative_report.json"
    written = first_report.read_bytes()
    assert json.loads(written)["draft"]["name"] == "my-export"
    evaluate.main([*common, "--draft", str(second)])
    assert first_report.read_bytes() == written
    [other] = [p for p in (tmp_path / "outputs" / "evaluate").iterdir() if p.name.startswith("my-export-")]
    assert (other / "custom" / "speculative_report.json").is_file()
    evaluate.main([*common, "--draft", str(first)])  # the same draft again: its own report, updated in place
    assert sorted(p.name for p in (tmp_path / "outputs" / "evaluate").iterdir()) == ["my-export", other.name]
    written = first_report.read_bytes()

    # --output onto the other draft's report: refused before any model loads, the report kept
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run(evaluate.main, [*common, "--draft", str(second), "--output", str(first_report.parent)])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"error: {first_report} is the report of another draft (my-export): it is kept; "
        "choose another --output for the report of my-export"
    )
    assert first_report.read_bytes() == written


def test_a_report_naming_no_draft_is_replaced_only_inside_the_drafts_own_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "speculative" / "heldout").mkdir(parents=True)
    (run_dir / "dflash2_recipe.json").write_text("{}")
    legacy = run_dir / "speculative" / "heldout" / "speculative_report.json"
    legacy.write_text(json.dumps({"benchmark": "heldout"}))
    identity = report_module.check_report_path(legacy, run_dir)
    assert identity["name"] == "run" and len(identity["digest"]) == 20
    with pytest.raises(FileExistsError, match="is a report that names no draft: it is kept"):
        report_module.check_report_path(legacy, tmp_path / "another")
    # a run moved (make demo's .previous-…) keeps its reports, recorded under its old path: still its own
    moved = tmp_path / "run.previous"
    legacy.write_text(json.dumps({"benchmark": "heldout", "draft": identity}))
    run_dir.rename(moved)
    moved_report = moved / "speculative" / "heldout" / "speculative_report.json"
    assert report_module.check_report_path(moved_report, moved)["digest"] != identity["digest"]
    with pytest.raises(FileExistsError, match=r"is the report of another draft \(run\): it is kept"):
        report_module.check_report_path(moved_report, tmp_path / "another")
