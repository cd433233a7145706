"""Issue 32, Deliver 5: a recipe whose draft export would refuse stops before the target loads.

The planner's memory check reads the draft config first, but it swallows any error (an estimate that
cannot be made must not stop a run) and `DFLASH2_SKIP_MEMORY_CHECK=1` skips it entirely; the draft
config's own rules must therefore be read on their own, before `FrozenTarget.load`, whatever the
memory check does. A target that would take minutes to load (or a Hub download) is never touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.commands import train
from trainer.commands.runner import run
from trainer.models.target import FrozenTarget
from trainer.plan.fit_check import SKIP_VARIABLE


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rules-at-start")
    write_tiny_run(root)
    return root


def recipe_with_draft(tiny_run: Path, where: Path, **dflash_overrides) -> Path:
    draft = json.loads((tiny_run / "draft.json").read_text())
    draft["dflash_config"].update(dflash_overrides)
    (where / "draft.json").write_text(json.dumps(draft))
    recipe = yaml.safe_load((tiny_run / "recipe.yaml").read_text())
    recipe.update(draft_config=str(where / "draft.json"), output_dir=str(where / "output"))
    (where / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return where / "recipe.yaml"


@pytest.mark.parametrize("skip_memory_check", [False, True])
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"selector_top_k": 1}, "selector_top_k"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ],
)
def test_a_draft_export_would_refuse_stops_before_the_target_loads(
    tiny_run, tmp_path, monkeypatch, capsys, overrides, field, skip_memory_check
):
    if skip_memory_check:
        monkeypatch.setenv(SKIP_VARIABLE, "1")
    loads = []
    monkeypatch.setattr(FrozenTarget, "load", classmethod(lambda cls, *a, **k: loads.append(a) or 1 / 0))
    recipe = recipe_with_draft(tiny_run, tmp_path, **overrides)
    with pytest.raises(SystemExit) as exit_info:
        run(train.main, [str(recipe)])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and field in errors[0], errors
    assert loads == []  # refused on the config alone
