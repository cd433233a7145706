"""Where recipe paths point: the working directory first, else the repository root.

Lives in the installed `trainer` package so every `dflash2` command (and the examples/ scripts over
them) resolves paths the same way from a fresh clone, where `examples/` is not importable (it is
not installed, and PYTHONPATH is unset).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "examples" / "recipes" / "smollm2-135m-chitchat.yaml"


def resolve_path(path: str, what: str = "draft_config") -> Path:
    """A recipe file: as given (relative to the working directory), else relative to the repository root."""
    candidate = Path(path).expanduser()
    for found in (candidate, REPO / candidate):
        if found.is_file():
            return found
    raise FileNotFoundError(f"{what}: {path} does not exist (looked in the working directory and in {REPO})")
