"""Markdown pieces the measured documents are made of: sections between markers, filled
templates, tables; a figure that was not measured reads "not measured" wherever it lands.

The sentences live in the Markdown files of benchmarks/templates/, so a writer edits prose there
and the renderers only compute the values. `benchmarks.results_doc` puts the sections together; the engines
benchmark writes its section with these pieces too.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from trainer.fileio import write_file_atomically

NOT_MEASURED = "not measured"
MIB = 2**20
TEMPLATES = Path(__file__).with_name("templates")
MARKDOWN = "md"  # a template's suffix
PART = re.compile(r"^<!-- ([a-z0-9-]+) -->$", re.M)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def section(text: str, name: str) -> str:
    """What lies between the markers `name` of `text`, without the newlines next to them."""
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the document needs one {begin} followed by one {end}")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with the section `name` replaced by `body`, everything outside the markers kept."""
    section(text, name)  # the markers are there, once each
    begin, end = markers(name)
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def write_text_atomically(path: Path, text: str) -> None:
    write_file_atomically(path, lambda temporary: temporary.write_text(text))


@cache
def template_parts(name: str) -> dict[str, str]:
    """The named parts of the template `name` in benchmarks/templates/: a line `<!-- part -->`
    starts each, and the newlines that end a part are not part of it (a template file reads best
    with blank lines between its parts)."""
    path = TEMPLATES / f"{name}.{MARKDOWN}"
    pieces = PART.split(path.read_text())
    if pieces[0].strip():
        raise ValueError(f"{path}: text before the first <!-- part --> line")
    parts = dict(zip(pieces[1::2], (piece.removeprefix("\n").rstrip("\n") for piece in pieces[2::2]), strict=True))
    if len(parts) != len(pieces) // 2:
        raise ValueError(f"{path}: a part name appears twice")
    return parts


def render(name: str, part: str, values: Mapping[str, Any] | None = None) -> str:
    """Part `part` of template `name`, filled from `values`. A block left empty (a sentence whose
    figures are absent) leaves no run of blank lines behind, nor one at either end."""
    parts = template_parts(name)
    if part not in parts:
        raise KeyError(f"{TEMPLATES / name}.{MARKDOWN} has no part {part!r}")
    return re.sub(r"\n{3,}", "\n\n", fill(parts[part], values or {})).strip("\n")


def fill(template: str, values: Mapping[str, Any]) -> str:
    """`template` with `{name}` fields (also `{name[key]}`) replaced by `values`, each with its
    format spec; a None value reads "not measured", a missing name is an error."""
    formatter = string.Formatter()
    fields = [field for _, field, _, _ in formatter.parse(template) if field]
    missing = {re.split(r"[.\[]", field, maxsplit=1)[0] for field in fields} - set(values)
    if missing:
        raise KeyError(f"template fields without a value: {sorted(missing)}")
    out = []
    for literal, field, spec, conversion in formatter.parse(template):
        out.append(literal)
        if field is None:
            continue
        value = formatter.get_field(field, (), values)[0]
        if value is None:
            out.append(NOT_MEASURED)
        else:
            out.append(formatter.format_field(formatter.convert_field(value, conversion), spec or ""))
    return "".join(out)


def number(value: float | None, digits: int = 2) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def duration(seconds: float | None) -> str | None:
    """`75.4` -> "1 min 15 s"; under a minute, "42.0 s"."""
    if seconds is None:
        return None
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def table_rows(rows: list[list[str | None]]) -> str:
    """The body lines of a Markdown table, one per row; None cells read "not measured"."""
    return "\n".join("| " + " | ".join(NOT_MEASURED if cell is None else cell for cell in row) + " |" for row in rows)


def ratio_phrase(a: float, b: float) -> str:
    """Where `a` stands against `b`, in the words of the common template."""
    return render("common", "above" if a > b else "below" if a < b else "equal-to")
