"""Every document the code, tests, recipes and docs name is a file of this repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from modeling_dflash2.checkpoint_dflash2 import REMOTE_CODE_FILES

REPO = Path(__file__).resolve().parents[2]
MARKDOWN = "md"
DOCUMENT_NAME = re.compile(rf"[A-Za-z0-9_.-]*\.{MARKDOWN}")  # `git grep -o` of the same pattern


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return listed.stdout.splitlines()


def test_every_named_document_exists_in_the_repository():
    files = tracked_files()
    basenames = {Path(name).name for name in files}
    missing = {}
    for name in files:
        path = REPO / name
        if not path.is_file() or path.suffix in {".gz", ".png", ".safetensors"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        unknown = sorted({hit for hit in DOCUMENT_NAME.findall(text) if hit not in basenames})
        if unknown:
            missing[name] = unknown
    assert missing == {}


def test_the_guide_links_resolve():
    guide = REPO / "docs" / "your-own-target.md"
    for link in re.findall(r"\]\(([^)#]+)\)", guide.read_text()):
        assert (guide.parent / link).is_file(), link


def test_the_licence_file_is_the_one_setup_cfg_and_the_shipped_code_declare():
    """setup.cfg says Apache-2.0; LICENSE must be that licence and each shipped modeling file say so."""
    assert "license = Apache-2.0" in (REPO / "setup.cfg").read_text()
    licence = (REPO / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    shipped = sorted((REPO / "modeling_dflash2").glob("*.py"))
    assert {module.name for module in shipped} == {"__init__.py", *REMOTE_CODE_FILES}
    for module in shipped:
        assert module.read_text().startswith("# SPDX-License-Identifier: Apache-2.0\n"), module.name
