"""Issue 31, "No pickles": every load path reads safetensors only, and a folder holding only pickle
weights is one line that says how to convert it; the export's recorded JSON and a full disk are
one line naming the file."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from modeling_dflash2 import DFlash2DraftModel
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from tests.unit.models.test_warm_start import zlab_dflash2_dir
from trainer.commands import export as export_command
from trainer.commands.runner import run
from trainer.fileio import DiskFullError
from trainer.models.loading import load_draft
from trainer.models.target import FrozenTarget
from trainer.models.warm_start import warm_start
from trainer.publishing.contract import TargetDimensions
from trainer.publishing.export import RECIPE_FILE, export_draft, load_trained_draft, training_record

REPO = Path(__file__).resolve().parents[2]
PICKLE_ONLY = "holds only pickle weights"


class Exploit:
    """A pickle that would create a file when unpickled without restriction."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture
def recipe_config(target):
    return tiny_draft_config_for(target)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything reaches torch's or Python's unpickler."""

    def refuse(*args, **kwargs):
        pytest.fail("a pickle was loaded")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


def to_pickle(directory: Path, weights: str = "model.safetensors", pickled: str = "pytorch_model.bin") -> None:
    """Replace a folder's safetensors by the same tensors as a torch.save pickle."""
    torch.save(load_file(directory / weights), directory / pickled)
    (directory / weights).unlink()


def assert_conversion_line(message: str, directory: Path, pickled: str = "pytorch_model.bin") -> None:
    assert "\n" not in message
    assert message.startswith(f"{directory} {PICKLE_ONLY} ({pickled})"), message
    assert "python -c " in message and "save_file(" in message and "weights_only=True" in message
    assert "weights_only=False" not in message


def run_conversion(message: str) -> None:
    """Run the command the message suggests, as a user would paste it."""
    command = message.split("e.g. ", 1)[1]
    subprocess.run(["bash", "-c", command.replace("python -c", f"{sys.executable} -c", 1)], check=True, timeout=120)


# ---------------------------------------------------------------------------------------------
# Row 1: init_from, export, evaluate's --draft and the target read safetensors only
# ---------------------------------------------------------------------------------------------


def test_init_from_pickle_only_is_refused_with_a_conversion_that_works(tmp_path, recipe_config, monkeypatch):
    source = tmp_path / "zlab"
    expected = zlab_dflash2_dir(source, recipe_config)
    to_pickle(source)
    with monkeypatch.context() as patched:
        patched.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
        with pytest.raises(ValueError) as refused:
            warm_start(source, recipe_config)
    assert_conversion_line(str(refused.value), source)
    run_conversion(str(refused.value))
    model = warm_start(source, recipe_config)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name].float(), msg=name)


def test_a_malicious_pickle_is_never_opened_and_the_line_never_advises_weights_only_false(tmp_path, recipe_config):
    source = tmp_path / "malicious"
    zlab_dflash2_dir(source, recipe_config)
    (source / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    (source / "pytorch_model.bin").write_bytes(pickle.dumps({"layers.0.weight": Exploit(marker)}))
    with pytest.raises(ValueError) as refused:
        warm_start(source, recipe_config)
    assert_conversion_line(str(refused.value), source)
    assert not marker.exists()


def test_evaluate_and_tau_gap_drafts_are_safetensors_only(tmp_path, recipe_config, no_unpickling):
    draft = tmp_path / "draft"
    randomize(DFlash2DraftModel(recipe_config), seed=1).save_pretrained(draft)
    to_pickle(draft)
    for remote_code in (False, True):
        with pytest.raises(ValueError) as refused:
            load_draft(draft, trust_remote_code=remote_code)
        assert_conversion_line(str(refused.value), draft)


def test_export_reads_safetensors_only_whatever_the_checkpoint_layout(tmp_path, recipe_config, no_unpickling):
    draft = randomize(DFlash2DraftModel(recipe_config), seed=2)
    full = tmp_path / "checkpoint-4"
    draft.save_pretrained(full)
    to_pickle(full)
    bare = tmp_path / "merged"
    bare.mkdir()
    (bare / "pytorch_model.bin").write_bytes(b"not even read")
    recipe_config.to_json_file(tmp_path / "draft_config.json")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"):
        (sharded / name).write_bytes(b"not even read")
    (sharded / "pytorch_model.bin.index.json").write_text("{}")
    (sharded / "config.json").write_text((full / "config.json").read_text())
    cases = [
        (full, None, "pytorch_model.bin"),
        (bare, tmp_path / "draft_config.json", "pytorch_model.bin"),
        (sharded, None, "pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin"),
    ]
    for checkpoint, config, pickled in cases:
        with pytest.raises(ValueError) as refused:
            load_trained_draft(checkpoint, config)
        assert_conversion_line(str(refused.value), checkpoint, pickled)


def test_a_lora_adapter_with_pickle_weights_only_is_refused(tmp_path, no_unpickling):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "base")}))
    (adapter / "adapter_model.bin").write_bytes(b"not even read")
    with pytest.raises(ValueError) as refused:
        load_trained_draft(adapter)
    assert_conversion_line(str(refused.value), adapter, "adapter_model.bin")
    assert "adapter_model.safetensors" in str(refused.value)


def test_a_target_folder_with_pickle_weights_only_is_refused(tmp_path, target, no_unpickling):
    folder = tmp_path / "target"
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    to_pickle(folder)
    with pytest.raises(ValueError) as refused:
        FrozenTarget.load(str(folder))
    assert_conversion_line(str(refused.value), folder)


def saved_checkpoint(tmp_path: Path, recipe_config) -> Path:
    """A trained-looking draft checkpoint (random weights) at tmp_path/run."""
    checkpoint = tmp_path / "run"
    randomize(DFlash2DraftModel(recipe_config), seed=3).save_pretrained(checkpoint)
    return checkpoint


def export_cli_errors(checkpoint: Path, target, tmp_path: Path, capsys) -> list[str]:
    """`dflash2 export` of `checkpoint` for the tiny target, which must exit 2: its `error:` lines."""
    folder = tmp_path / "target"
    target.model.save_pretrained(folder)
    with pytest.raises(SystemExit) as exit_info:
        run(export_command.main, [str(checkpoint), str(tmp_path / "export"), "--target", str(folder)])
    assert exit_info.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_the_export_cli_refuses_pickle_weights_in_one_line(tmp_path, recipe_config, target, capsys):
    checkpoint = saved_checkpoint(tmp_path, recipe_config)
    to_pickle(checkpoint)
    errors = export_cli_errors(checkpoint, target, tmp_path, capsys)
    assert len(errors) == 1 and errors[0].startswith(f"error: {checkpoint} {PICKLE_ONLY}"), errors
    assert not (tmp_path / "export").exists()


class HubLoader:
    """A `from_pretrained` as transformers answers for a Hub repo holding only pytorch_model.bin."""

    calls: ClassVar[list[dict]] = []

    @classmethod
    def from_pretrained(cls, spec, **kwargs):
        cls.calls.append(kwargs)
        if kwargs.get("use_safetensors") is not True:
            return "unpickled pytorch_model.bin"
        raise OSError(
            f"{spec} does not appear to have a file named model.safetensors or model.safetensors.index.json "
            "and thus cannot be loaded with `safetensors`. Please do not set `use_safetensors=True`."
        )


def test_hub_repos_are_read_as_safetensors_only_and_refused_in_one_line():
    from trainer.models.loading import from_pretrained_safetensors

    with pytest.raises(OSError) as refused:
        from_pretrained_safetensors(HubLoader, "org/pickled", "init_from", dtype=torch.float32)
    assert HubLoader.calls[-1] == {"use_safetensors": True, "dtype": torch.float32}
    message = str(refused.value)
    assert message.startswith("init_from org/pickled has no safetensors weights") and "\n" not in message
    assert "do not set `use_safetensors=True`" not in message


# ---------------------------------------------------------------------------------------------
# Row 3: the export's recorded JSON is an object, or one line naming the file
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (RECIPE_FILE, "[1, 2]", "recorded recipe {path} holds a list, not an object (JSON)"),
        ("trainer_state.json", "[]", "trainer state {path} holds a list, not an object (JSON)"),
        ("trainer_state.json", '{"log_history": {"a": 1}}', "trainer state {path}: log_history must be a list"),
        (RECIPE_FILE, "{", "recorded recipe {path} is not valid JSON"),
    ],
)
def test_a_recorded_json_of_the_wrong_shape_is_named(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError) as refused:
        training_record(tmp_path)
    assert str(refused.value).startswith(message.format(path=tmp_path / name)), refused.value


def test_a_state_log_with_odd_entries_keeps_the_evaluations(tmp_path):
    log = [1, "eval_loss", {"loss": 2.0}, {"eval_loss": 1.5, "step": 4}]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": log}))
    assert training_record(tmp_path) == {"global_step": 4, "evaluation": {"eval_loss": 1.5, "step": 4}}


def test_the_export_cli_names_a_recorded_recipe_that_is_a_list(tmp_path, recipe_config, target, capsys):
    checkpoint = saved_checkpoint(tmp_path, recipe_config)
    (checkpoint / RECIPE_FILE).write_text("[]")
    errors = export_cli_errors(checkpoint, target, tmp_path, capsys)
    assert errors == [f"error: recorded recipe {checkpoint / RECIPE_FILE} holds a list, not an object (JSON)"]


# ---------------------------------------------------------------------------------------------
# Row 4: an export onto a full disk is the documented line
# ---------------------------------------------------------------------------------------------


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "overwrite"])
def test_an_export_onto_a_full_disk_names_what_and_what_is_kept(tmp_path, target, recipe_config, monkeypatch, earlier):
    draft = randomize(DFlash2DraftModel(recipe_config), seed=4)
    dims = TargetDimensions("org/tiny-target", target.hidden_size, target.vocab_rows, target.num_layers)
    output = tmp_path / "export"
    if earlier:
        export_draft(draft, output, target=dims)
    before = {path.name: path.read_bytes() for path in output.iterdir()} if earlier else None
    monkeypatch.setattr("trainer.publishing.export.save_file", _full_disk)
    with pytest.raises(DiskFullError) as full:
        export_draft(draft, output, target=dims, overwrite=earlier, source=tmp_path / "run")
    message = str(full.value)
    kept = f"the earlier export at {output} is kept" if earlier else "no partial export is left"
    assert message.startswith(f"no space left on device while writing the export {output} ("), message
    assert message.endswith(f" free); {kept}, the checkpoint {tmp_path / 'run'} is untouched"), message
    assert full.value.errno == errno.ENOSPC
    assert sorted(path.name for path in tmp_path.iterdir()) == (["export"] if earlier else [])
    if earlier:
        assert {path.name: path.read_bytes() for path in output.iterdir()} == before
