"""Hub repo ids checked where they are accepted, with huggingface_hub's own validator.

An id lands in the model card's heading, its copy-paste shell commands and its Python snippet, and
in Hub API URLs: a value holding a newline, `---` or `$(...)` is refused here, in one line naming the
field, instead of reaching any of them. This module imports nothing heavy: trainer.training.arguments uses it.
"""

from __future__ import annotations

import os
from typing import Any

from huggingface_hub.utils import HFValidationError, validate_repo_id

from trainer.fileio import looks_like_local_path

NOT_HUB_PREFIXES = ("pypi:",)


def check_hub_id(value: Any, field: str) -> str:
    """`value` when it is a valid Hub repo id (`name` or `namespace/name`); else a ValueError naming
    `field`, the value (repr: a newline stays visible) and the validator's rule."""
    try:
        validate_repo_id(value)
    except HFValidationError as error:  # a ValueError whose message repeats the raw value, newlines included
        rule = str(error).replace(f": '{value}'", "").replace(" Use `repo_type` argument if needed.", "")
        rule = " ".join(rule.split()).rstrip(".")
        raise ValueError(f"{field}: {value!r} is not a valid Hub repo id ({rule})") from None
    return value


def is_hub_id_like(value: str) -> bool:
    """True when `value` would be looked up on the Hub: not a local path that exists or looks like
    one, not `pypi:<dist>`, not a URL."""
    return not (
        value.startswith(NOT_HUB_PREFIXES)
        or "://" in value
        or looks_like_local_path(value)
        or os.path.exists(os.path.expanduser(value))
    )


def check_hub_id_if_remote(value: str | None, field: str) -> str | None:
    """`check_hub_id` on a value that names a local path or a Hub id, only when it is not local."""
    if value is not None and is_hub_id_like(value):
        check_hub_id(value, field)
    return value
