"""Recipe files: where their paths point (the working directory first, else the repository root) and how a
YAML recipe is read (`read_recipe`: a safe loader without aliases or duplicate keys, every error naming the file).

Lives in the installed `trainer` package so every `dflash2` command (and the examples/ scripts over
them) resolves paths the same way from a fresh clone, where `examples/` is not importable (it is
not installed, and PYTHONPATH is unset).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trainer.recipe_types import QUOTE_LIMIT, quote, redacted

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "examples" / "recipes" / "smollm2-135m-chitchat.yaml"


def resolve_path(path: str, what: str = "draft_config") -> Path:
    """A recipe file: as given (relative to the working directory), else relative to the repository root."""
    candidate = Path(path).expanduser()
    for found in (candidate, REPO / candidate):
        if found.is_file():
            return found
    raise FileNotFoundError(f"{what}: {path} does not exist (looked in the working directory and in {REPO})")


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few dozen lines; a bigger file is not one


class RecipeYAMLError(yaml.MarkedYAMLError):
    """YAML a recipe may not use (an anchor, an alias, a merge key, a key given twice), at its mark."""

    def __init__(self, problem: str, mark: yaml.Mark):
        super().__init__(problem=problem, problem_mark=mark)


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader without the features that make a recipe mean something other than it reads.

    Anchors and aliases are refused (nested aliases expand exponentially: a 355-byte recipe grew to
    gigabytes), as are merge keys (`<<`), and a key given twice in one mapping is refused with both
    lines instead of silently keeping the last value.
    """

    def compose_node(self, parent, index):
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            what = "aliases (*" if isinstance(event, yaml.AliasEvent) else "anchors (&"
            problem = f"YAML {what}{anchor[:40]}) are not allowed in a recipe: write the value out"
            raise RecipeYAMLError(problem, event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first_lines: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise RecipeYAMLError(
                    "YAML merge keys (<<) are not allowed in a recipe: write the keys out", key_node.start_mark
                )
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = first_lines.get(key)
            except TypeError:
                continue  # an unhashable key: PyYAML's own error names it below
            if first is not None:
                problem = f"key {quote(key)} is given twice (first on line {first}): keep one"
                raise RecipeYAMLError(problem, key_node.start_mark)
            first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def _decoded(path: Path, data: bytes, what: str = "recipe") -> str:
    """The recipe's text; bytes that are not UTF-8 are named by line and column (in bytes, from 1)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ValueError(
            f"{what} {path}: line {line} is not valid UTF-8 (byte 0x{data[error.start]:02x} at column {column})"
        ) from None


def read_recipe(path: str | Path, what: str = "recipe") -> dict[str, Any]:
    """A YAML recipe as a mapping; every problem is one line naming the file as `what` (and the line and column
    where the parser knows them). Other YAML settings files (an accelerate config) are read the same way."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a folder, not a file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    size = path.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise ValueError(f"{what} {path} is {size} bytes; a recipe is at most {MAX_RECIPE_BYTES} bytes")
    try:
        text = _decoded(path, path.read_bytes(), what)
    except OSError as error:
        raise OSError(f"{what} {path} cannot be read: {error.strerror or error}") from None
    try:
        recipe = yaml.load(text, Loader=RecipeLoader) or {}  # RecipeLoader is a SafeLoader
    except yaml.YAMLError as error:
        raise ValueError(f"{what} {path}{_yaml_problem(error)}") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"{what} {path} must be a YAML mapping of argument names to values")
    return recipe


def _yaml_problem(error: yaml.YAMLError) -> str:
    """': <problem> (line L, column C)', or ' is not valid YAML: ...' for a syntax error."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if isinstance(error, RecipeYAMLError):
        return f": {problem}{where}"
    problem = redacted(problem if len(problem) <= QUOTE_LIMIT else f"{problem[:QUOTE_LIMIT]}…")
    return f" is not valid YAML: {problem}{where}"
