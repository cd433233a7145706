"""Files the project writes for users: never half-written, never lost."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def default_cache_root() -> Path:
    """Where converted targets, generated datasets and features are cached (`DFLASH2_CACHE` overrides)."""
    override = os.environ.get("DFLASH2_CACHE")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash2-hub"


def digest(payload: Any) -> str:
    """A short stable hash of a JSON-serialisable payload (cache keys)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def write_directory_atomically(directory: Path, write: Callable[[Path], None]) -> None:
    """Fill a temporary sibling with `write`, then rename it into place: readers see the whole
    directory or nothing, and an interrupted write leaves no partial result behind."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        write(temporary)
        if directory.exists():  # another process finished the same cache entry first
            shutil.rmtree(temporary)
            return
        os.replace(temporary, directory)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
