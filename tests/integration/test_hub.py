"""Publishing end to end with huggingface_hub's own client against a loopback Hub server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.drafts import randomize
from tests.support.hub_server import LoopbackHub
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.publishing.contract import ExportValidationError, TargetDimensions
from trainer.publishing.export import PROVENANCE_FILE, export_draft
from trainer.publishing.hub import check_export_folder, publish, validate_export_folder

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_TESTtoken_0123456789abcdef"


def run_client(script: str, hub: LoopbackHub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """huggingface_hub reads its endpoint at import: run the client in a fresh process."""
    return _run([sys.executable, "-c", textwrap.dedent(script), *args], hub, tmp_path)


def run_command(name: str, hub: LoopbackHub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """A command in a process of its own, as users run it: `python -m trainer NAME ARGS` (`dflash2 NAME`)."""
    return _run([sys.executable, "-m", "trainer", name, *args], hub, tmp_path)


def _run(command: list[str], hub: LoopbackHub, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_TOKEN=TOKEN,
        HF_HOME=str(tmp_path / "client_home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    return subprocess.run(
        command,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


PUSH = """
import sys
from trainer.publishing.hub import publish
commit = publish(sys.argv[1], sys.argv[2], private=True)
print(commit.oid)
"""

DOWNLOAD_AND_RUN = """
import sys, torch
from huggingface_hub import snapshot_download
from transformers import AutoModel
files = sorted(p.name for p in __import__("pathlib").Path(snapshot_download(sys.argv[1])).iterdir())
print(files)
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.bfloat16).eval()
assert type(model).__name__ == "DFlash2DraftModel", type(model)
inputs = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save(model.compute_logits(model(**inputs["forward"]), inputs["head"]), sys.argv[3])
"""


@pytest.fixture
def exported(tmp_path):
    target = tiny_target()
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=0)
    dims = TargetDimensions("org/tiny-target", target.hidden_size, target.vocab_rows, target.num_layers)
    return draft, export_draft(draft, tmp_path / "export", target=dims)


def _inputs(tmp_path: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "forward": {
            "position_ids": torch.arange(9)[None],
            "noise_embedding": torch.randn(1, 4, 32, generator=generator).to(torch.bfloat16),
            "target_hidden": torch.randn(1, 5, 64, generator=generator).to(torch.bfloat16),
        },
        "head": torch.randn(53, 32, generator=generator).to(torch.bfloat16),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    return tmp_path / "inputs.pt"


def test_push_then_snapshot_download_and_automodel_reproduce_the_logits(tmp_path, exported):
    draft, folder = exported
    with LoopbackHub() as hub:
        result = run_client(PUSH, hub, tmp_path, str(folder), "org/draft")
        assert result.returncode == 0, result.stderr[-3000:]
        repo = hub.state.repos["org/draft"]
        assert repo.private and len(repo.commits) == 1  # one commit for the whole folder
        assert set(repo.files) == {p.name for p in folder.iterdir()}
        result = run_client(DOWNLOAD_AND_RUN, hub, tmp_path, "org/draft", str(_inputs(tmp_path)), "logits.pt")
        assert result.returncode == 0, result.stderr[-3000:]
    inputs = torch.load(tmp_path / "inputs.pt", weights_only=True)
    reference = draft.to(torch.bfloat16).eval()
    with torch.no_grad():
        expected = reference.compute_logits(reference(**inputs["forward"]), inputs["head"])
    assert torch.equal(torch.load(tmp_path / "logits.pt", weights_only=True), expected)
    assert all(auth == f"Bearer {TOKEN}" for auth in hub.state.authorizations)


def test_a_failed_push_leaves_no_partial_revision_and_a_retry_succeeds(tmp_path, exported):
    _, folder = exported
    with LoopbackHub() as hub:
        hub.state.fail_next_commit = True
        failed = run_client(PUSH, hub, tmp_path, str(folder), "org/draft")
        assert failed.returncode != 0
        repo = hub.state.repos["org/draft"]
        assert repo.sha is None and repo.files == {}
        retried = run_client(PUSH, hub, tmp_path, str(folder), "org/draft")
        assert retried.returncode == 0, retried.stderr[-3000:]
        assert set(repo.files) == {p.name for p in folder.iterdir()} and len(repo.commits) == 1


def test_raw_checkpoints_are_never_published(tmp_path):
    draft = DFlash2DraftModel(tiny_draft_config_for(tiny_target()))
    draft.save_pretrained(tmp_path / "checkpoint")
    torch.save({}, tmp_path / "checkpoint" / "optimizer.pt")
    with pytest.raises(ValueError, match="not an export folder"):
        check_export_folder(tmp_path / "checkpoint")
    with pytest.raises(ExportValidationError, match="not an export folder"):
        validate_export_folder(tmp_path / "checkpoint")


def test_export_py_push_failure_keeps_the_export_and_publish_py_retries_it(tmp_path):
    target = tiny_target()
    target.model.save_pretrained(tmp_path / "target")
    randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=0).save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "export"
    export_args = (str(tmp_path / "checkpoint"), str(out), "--target", str(tmp_path / "target"))
    export_args += ("--push-to-hub", "org/draft")
    with LoopbackHub() as hub:
        hub.state.fail_next_commit = 500
        failed = run_command("export", hub, tmp_path, *export_args)
        assert failed.returncode != 0
        message = failed.stderr.strip().splitlines()[-1]
        assert "push to org/draft failed (" in message, message
        assert "500 Internal Server Error" in message
        retry = f"retry with dflash2 publish {out} org/draft"
        assert message.endswith(f"; the export at {out} is complete: {retry}"), message
        validate_export_folder(out)  # complete and valid: the retry needs no re-export
        repo = hub.state.repos["org/draft"]
        assert repo.sha is None and repo.commits == [] and repo.files == {}

        retried = run_command("publish", hub, tmp_path, str(out), "org/draft")
        assert retried.returncode == 0, retried.stderr[-3000:]
        assert len(repo.commits) == 1 and repo.files == {path.name: path.read_bytes() for path in out.iterdir()}
        assert f"published {hub.endpoint}/org/draft/commit/{repo.sha}" in retried.stdout


@pytest.mark.parametrize("failure", [401, "drop"], ids=["unauthorized", "dropped-connection"])
def test_publish_py_failure_names_the_retry_and_the_retry_publishes_one_commit(tmp_path, exported, failure):
    _, folder = exported
    command = (str(folder), "org/draft", "--private", "--commit-message", "Draft v2")
    with LoopbackHub() as hub:
        hub.state.fail_next_commit = failure
        failed = run_command("publish", hub, tmp_path, *command)
        assert failed.returncode != 0
        message = failed.stderr.strip().splitlines()[-1]
        assert "push to org/draft failed (" in message, message
        retry = f"retry with dflash2 publish {folder} org/draft --private --commit-message 'Draft v2'"
        assert message.endswith(retry), message
        repo = hub.state.repos["org/draft"]
        assert repo.sha is None and repo.files == {}

        retried = run_command("publish", hub, tmp_path, *command)
        assert retried.returncode == 0, retried.stderr[-3000:]
        assert repo.private and len(repo.commits) == 1
        assert repo.files == {path.name: path.read_bytes() for path in folder.iterdir()}


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


TAMPERINGS = {
    "extra-file": (lambda f: torch.save({}, f / "optimizer.pt"), "not an export folder"),
    "missing-file": (lambda f: (f / "config.json").unlink(), r"missing \['config.json'\]"),
    "config-not-json": (lambda f: (f / "config.json").write_text("{"), "config.json is not valid JSON"),
    "config-missing-key": (lambda f: _edit_json(f / "config.json", lambda c: c.pop("hidden_size")), "hidden_size"),
    "mask-token-out-of-vocab": (
        lambda f: _edit_json(f / "config.json", lambda c: c["dflash_config"].update(mask_token_id=c["vocab_size"])),
        "rule 9: mask_token_id",
    ),
    "block-size-not-the-trained-one": (
        lambda f: _edit_json(f / "config.json", lambda c: c["dflash_config"].update(block_size=8)),
        "rule 6: block_size 8",
    ),
    "provenance-without-serving": (lambda f: _edit_json(f / PROVENANCE_FILE, lambda p: p.pop("serving")), "rule 21"),
    "declared-dtype-differs": (lambda f: _edit_json(f / "config.json", lambda c: c.update(dtype="float16")), "rule 19"),
    "non-finite-weights": (
        lambda f: _edit_tensors(f / "model.safetensors", lambda t: t["norm.weight"].fill_(float("nan"))),
        r"rule 19: non-finite values in \['norm.weight'\]",
    ),
    "extra-tensor": (
        lambda f: _edit_tensors(f / "model.safetensors", lambda t: t.update(extra=torch.zeros(1).bfloat16())),
        r"rule 16: .*unexpected \['extra'\]",
    ),
    "missing-tensor": (
        lambda f: _edit_tensors(f / "model.safetensors", lambda t: t.pop("norm.weight")),
        r"rule 16: tensor set differs from the contract: missing \['norm.weight'\], unexpected \[\]",
    ),
    "truncated-weights": (lambda f: _truncate(f / "model.safetensors"), "not a readable safetensors file"),
    "absurd-block-size": (
        lambda f: _edit_json(f / "config.json", lambda c: c["dflash_config"].update(block_size=1000000)),
        r"config.json: dflash_config.block_size is 1000000, outside \[2, 64\]",
    ),
    "absurd-width": (
        lambda f: _edit_json(f / "config.json", lambda c: c.update(hidden_size=10**9)),
        r"config.json: hidden_size is 1000000000, outside \[1, 65536\] .*; re-export the draft.$",
    ),
    "config-too-large": (
        lambda f: _edit_json(f / "config.json", lambda c: c.update(padding="x" * (2 << 20))),
        r"export file .*config.json is \d+ bytes, more than the 1048576 bytes such a file holds; not read; re-export",
    ),
}


@pytest.mark.parametrize("tampering", TAMPERINGS)
def test_publishing_revalidates_the_folder_on_disk(exported, tampering):
    _, folder = exported
    validate_export_folder(folder)
    tamper, problem = TAMPERINGS[tampering]
    tamper(folder)
    with pytest.raises(ExportValidationError, match=problem):
        validate_export_folder(folder)


def test_weights_larger_than_memory_are_refused_before_they_are_read(exported, monkeypatch):
    from trainer.models.config_bounds import available_memory

    _, folder = exported
    weights = folder / "model.safetensors"
    os.truncate(weights, 2 * available_memory())  # sparse: no disk is used
    monkeypatch.setattr("trainer.publishing.hub.load_file", lambda path: pytest.fail("the weights were read"))
    with pytest.raises(ValueError, match=r"checking this export before publishing needs about .* memory available$"):
        validate_export_folder(folder)


@pytest.mark.parametrize("repo_id", ["org/x\n---", "$(touch /tmp/x)", "org/`id`", "org/'quoted'", "org/a--b", ""])
def test_publish_refuses_a_malformed_repo_id_before_anything_else(exported, monkeypatch, repo_id):
    _, folder = exported
    monkeypatch.setattr("trainer.publishing.hub.HfApi", lambda **kwargs: pytest.fail("the Hub was contacted"))
    monkeypatch.setattr("trainer.publishing.hub.validate_export_folder", lambda folder: pytest.fail("validated first"))
    with pytest.raises(ValueError) as refused:
        publish(folder, repo_id)
    assert str(refused.value).startswith(f"repo_id: {repo_id!r} is not a valid Hub repo id (")
    assert "\n" not in str(refused.value)


def test_publish_py_refuses_a_tampered_export_before_contacting_the_hub(tmp_path, exported):
    _, folder = exported
    _edit_json(folder / "config.json", lambda c: c["dflash_config"].update(mask_token_id=c["vocab_size"]))
    with LoopbackHub() as hub:
        refused = run_command("publish", hub, tmp_path, str(folder), "org/draft")
        assert refused.returncode != 0
        assert "breaks the public checkpoint contract" in refused.stderr and "rule 9: mask_token_id" in refused.stderr
        assert hub.state.requests == [] and hub.state.repos == {}


def test_publish_py_refuses_an_export_missing_a_tensor_before_contacting_the_hub(tmp_path, exported):
    """A folder whose weights lost a tensor (a hand-edited or half-copied export) would load with
    that module freshly initialized: publish.py names it and uploads nothing."""
    _, folder = exported
    _edit_tensors(folder / "model.safetensors", lambda tensors: tensors.pop("layers.0.mlp_conv.base_kernel"))
    with LoopbackHub() as hub:
        refused = run_command("publish", hub, tmp_path, str(folder), "org/draft")
        assert refused.returncode != 0
        assert "breaks the public checkpoint contract" in refused.stderr, refused.stderr
        missing = "rule 16: tensor set differs from the contract: missing ['layers.0.mlp_conv.base_kernel']"
        assert missing in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert hub.state.requests == [] and hub.state.repos == {}


TRAIN_AND_PUSH = """
import sys
from trainer.commands.train import main
main([sys.argv[1], "--push_to_hub", "true", "--hub_model_id", "org/trained", "--hub_strategy", "every_save",
      "--hub_token", sys.argv[2]])
"""


def test_training_pushes_exports_and_no_file_holds_the_token(tmp_path):
    recipe = write_tiny_run(tmp_path, target_hub_id="org/tiny-target", save_steps=2)
    with LoopbackHub() as hub:
        result = run_client(TRAIN_AND_PUSH, hub, tmp_path, str(recipe), TOKEN)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        repo = hub.state.repos["org/trained"]
        assert len(repo.commits) == 3  # checkpoint-2, checkpoint-4, end of training: one commit each
        check_files = {"config.json", "model.safetensors", "README.md", "dflash2_provenance.json"}
        assert check_files <= set(repo.files) and "optimizer.pt" not in repo.files
        assert b"base_model: org/tiny-target" in repo.files["README.md"]
        pushed = list(repo.files.values())
        assert any(auth == f"Bearer {TOKEN}" for auth in hub.state.authorizations)
    secret = TOKEN.encode()
    assert not any(secret in content for content in pushed)
    written = [path for path in (tmp_path / "output").rglob("*") if path.is_file()]
    assert any(path.name == "training_args.bin" for path in written)
    leaks = [str(path) for path in written if secret in path.read_bytes()]
    assert leaks == []
