"""Markdown pieces the measured documents are made of: sections between markers, filled
templates, tables; a figure that was not measured reads "not measured" wherever it lands.

`benchmarks.results_doc` puts them together; the engines benchmark writes its section with them.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.fileio import write_file_atomically

NOT_MEASURED = "not measured"
MIB = 2**20


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


def fill(template: str, values: Mapping[str, Any]) -> str:
    """`template` with `{name}` fields replaced by `values` (already formatted strings or numbers
    with a format spec); a None value reads "not measured", a missing name is an error."""
    names = {field for _, field, _, _ in string.Formatter().parse(template) if field}
    missing = names - set(values)
    if missing:
        raise KeyError(f"template fields without a value: {sorted(missing)}")
    formatter = string.Formatter()
    out = []
    for literal, field, spec, conversion in formatter.parse(template):
        out.append(literal)
        if field is None:
            continue
        value = values[field]
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


def table(header: list[str], rows: list[list[str | None]], align: list[str] | None = None) -> list[str]:
    """A Markdown table; None cells read "not measured"."""
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(NOT_MEASURED if cell is None else cell for cell in row) + " |")
    return lines


def ratio_phrase(a: float, b: float) -> str:
    return "above" if a > b else "below" if a < b else "equal to"
