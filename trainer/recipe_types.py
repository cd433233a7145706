"""Recipe and command-line values converted to their dataclass field's type, or refused with a one-line error.

The argument dataclasses check no types, and YAML 1.1 (PyYAML) reads `1e-3` as a string and an unquoted `no` as
false, so an unconverted value fails far from the recipe (a TypeError inside torch's Adam) or silently (the string
"false" is truthy). Each value is converted by its field's resolved type hint: int, float, bool, str, enums,
`Literal`, `list[...]`, `dict[...]` and unions of them (`X | None` included).

Each field's range is declared once as a `Rule` (`at_least`, `above`, `between`, `one_of`) in a table beside the
fields (`trainer.training.arguments.RULES`, `trainer.objective.config.OBJECTIVE_RULES`) and checked by `check_rule`,
both where a recipe value is converted (naming the key the user wrote) and in the dataclasses' `__post_init__`
(`check_fields`), so `max_length: -3` or `gradient_accumulation_steps: 0` stop before any work. Error messages quote
a value through `quote`: at most a short prefix, and never a URL's credentials.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, Union

TRUE_WORDS = frozenset({"true", "yes", "on", "1", "t", "y"})
FALSE_WORDS = frozenset({"false", "no", "off", "0", "f", "n"})
QUOTE_HINT = " (YAML reads an unquoted no/off/false or yes/on/true as a boolean: quote the word)"
INT_LIMIT = Decimal(2) ** 63
NONE_TYPE = type(None)
# the environment variable an endpoint client reads its API key from: never a recipe value
API_KEY_VARIABLE = "DFLASH2_ENDPOINT_API_KEY"
QUOTE_LIMIT = 80  # characters of a value an error message quotes
# A URL's user information (`scheme://user:password@`): never echoed, recorded or logged.
URL_CREDENTIALS = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#]+@")  # up to the last @ of the authority


class _Mismatch(Exception):
    """A value does not fit a type; the caller words the error with the field's whole type."""


def field_types(classes: typing.Iterable[type]) -> dict[str, Any]:
    """Resolved type hints of the init fields of dataclasses (strings under `from __future__ import annotations`)."""
    hints: dict[str, Any] = {}
    for cls in classes:
        resolved = typing.get_type_hints(cls)
        hints.update({f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.init})
    return hints


def field_choices(classes: typing.Iterable[type]) -> dict[str, tuple[Any, ...]]:
    """The `choices` HfArgumentParser enforces on the command line (log_level, ddp_backend...), by field name."""
    return {
        f.name: tuple(f.metadata["choices"])
        for cls in classes
        for f in dataclasses.fields(cls)
        if f.init and "choices" in f.metadata
    }


def convert(value: Any, hint: Any, label: str, choices: tuple[Any, ...] = ()) -> Any:
    """`value` as type `hint` (and one of `choices` if any); otherwise a ValueError naming `label` (the field), the
    value and the type."""
    try:
        converted = _convert(value, hint)
    except _Mismatch:
        quote_hint = QUOTE_HINT if isinstance(value, bool) and _takes_words(hint) else ""
        raise ValueError(f"{label}: {quote(value)} is not {describe(hint)}{quote_hint}") from None
    if choices and converted is not None and converted not in choices:
        raise ValueError(f"{label}: {quote(value)} is not one of {', '.join(map(repr, choices))}")
    return converted


def redacted(text: str) -> str:
    """`text` with the user information of every URL in it replaced by `***`."""
    return URL_CREDENTIALS.sub(r"\1***@", text)


def has_credentials(value: Any) -> bool:
    """Whether a value (a string, or a list or dict holding strings) holds a URL with a user name or password."""
    if isinstance(value, str):
        return URL_CREDENTIALS.search(value) is not None
    if isinstance(value, dict):
        return any(has_credentials(key) or has_credentials(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(has_credentials(item) for item in value)
    return False


def refuse_credentials(value: Any, label: str) -> None:
    """A URL with a user name or password would be written to every checkpoint's recipe, the export's provenance
    (which publish uploads) and the logs: refused in one line naming `label`, without echoing it, pointing to the
    environment variable the endpoint client reads instead."""
    if has_credentials(value):
        raise ValueError(
            f"{label}: a URL with a user name or password (scheme://user:password@host) is refused, as it would be "
            f"recorded in checkpoints, exports and logs: remove the credentials and put an endpoint's key in "
            f"{API_KEY_VARIABLE} (sent as a Bearer token; a Hub token in HF_TOKEN)"
        )


def refuse_argv_credentials(argv: list[str]) -> None:
    """`refuse_credentials` for a whole command line (every command's URL flags at once), naming the flag a value
    belongs to: `--flag value`, `--flag=value`, or a positional argument."""
    label = "a positional argument"
    for arg in argv:
        flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if equals:
            refuse_credentials(value, f"argument {flag}")
        elif arg.startswith("-"):
            label = f"argument {arg}"
        else:
            refuse_credentials(arg, label)


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """A value as an error message shows it: its repr, credentials hidden, cut to `limit` characters + "…"
    (a recipe value can be long: the message stays one short line)."""
    text = redacted(repr(value))
    return text if len(text) <= limit else f"{text[:limit]}…"


# -- declared ranges -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    """A finite number within [low, high] (an end of None is open-ended; `*_open` excludes that end)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what the value means at its edge, e.g. "(0: off)"

    def admits(self, value: Any) -> bool:
        if type(value) not in (int, float) or not math.isfinite(value):
            return False
        above_low = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below_high = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above_low and below_high

    def __str__(self) -> str:
        if self.high is None:
            words = f"{'>' if self.low_open else '>='} {self.low}"
        elif self.low is None:
            words = f"{'<' if self.high_open else '<='} {self.high}"
        else:
            words = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        return f"{words} {self.note}" if self.note else words


@dataclass(frozen=True)
class OneOf:
    """One of a few named values (a dtype, a mode)."""

    values: tuple[Any, ...]

    def admits(self, value: Any) -> bool:
        return any(type(value) is type(choice) and value == choice for choice in self.values)

    def __str__(self) -> str:
        return f"one of {self.values!r}"


Rule = Bounds | OneOf


def at_least(low: float, note: str = "") -> Bounds:
    return Bounds(low=low, note=note)


def above(low: float, note: str = "") -> Bounds:
    return Bounds(low=low, low_open=True, note=note)


def between(low: float, high: float, *, high_open: bool = False, low_open: bool = False, note: str = "") -> Bounds:
    return Bounds(low=low, high=high, low_open=low_open, high_open=high_open, note=note)


def one_of(*values: Any) -> OneOf:
    return OneOf(tuple(values))


def check_rule(value: Any, name: str, rule: Rule | None) -> None:
    """Refuse `value` of field `name` (the key the user wrote) outside its declared rule; None (unset) passes:
    whether a field may be unset is its type's business."""
    if rule is not None and value is not None and not rule.admits(value):
        raise ValueError(f"{name} must be {rule} (got {quote(value)}).")


def check_fields(instance: Any, rules: dict[str, Rule], name_of: Callable[[dataclasses.Field], str] | None = None):
    """Every field of a dataclass instance against `rules` (by field name), named by `name_of` (its recipe key)."""
    for knob in dataclasses.fields(instance):
        if knob.name in rules:
            check_rule(getattr(instance, knob.name), name_of(knob) if name_of else knob.name, rules[knob.name])


def describe(hint: Any) -> str:
    """The type in words, for error messages: `int | None` is 'an int or null'."""
    members = _members(hint)
    if len(members) > 1:
        words = [describe(member) for member in sorted(members, key=lambda member: member is NONE_TYPE)]
        return f"{', '.join(words[:-1])} or {words[-1]}"
    hint = members[0]
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if hint is NONE_TYPE:
        return "null"
    if hint is Any:
        return "a value"
    if origin is Literal:
        return " or ".join(repr(arg) for arg in args)
    if _is_enum(origin):
        return f"one of {', '.join(repr(member.value) for member in origin)}"
    if origin is list:
        return f"a list of {_name(args[0])}" if args else "a list"
    if origin is dict:
        return f"a dict of {_name(args[0])} to {_name(args[1])}" if args else "a dict"
    if origin is bool:
        return "a bool (true/false)"
    name = _name(hint)
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _name(hint: Any) -> str:
    """A bare type name for list elements and dict keys/values."""
    return "any value" if hint is Any else getattr(hint, "__name__", str(hint))


def _members(hint: Any) -> tuple[Any, ...]:
    """A union's members; `str` is dropped beside an enum: TrainingArguments turns such strings into the enum."""
    if typing.get_origin(hint) not in (Union, types.UnionType):
        return (hint,)
    members = typing.get_args(hint)
    if any(_is_enum(member) for member in members):
        members = tuple(member for member in members if member is not str)
    return members


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _takes_words(hint: Any) -> bool:
    """Whether the type takes strings (where a YAML boolean was probably meant as a word, like `optim: no`)."""
    for member in _members(hint):
        origin = typing.get_origin(member)
        if member is str or _is_enum(member) or (origin is list and _takes_words(typing.get_args(member)[0])):
            return True
    return False


def _convert(value: Any, hint: Any) -> Any:
    members = _members(hint)
    if len(members) > 1:
        return _convert_union(value, members)
    hint = members[0]
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if hint is Any:
        return value
    if hint is NONE_TYPE:
        return _check(value, value is None)
    if origin is Literal:
        return _check(value, any(type(value) is type(arg) and value == arg for arg in args))
    if _is_enum(origin):
        return _to_enum(value, origin)
    if origin in SCALARS:
        return SCALARS[origin](value)
    if origin is list:
        return _to_list(value, args[0] if args else Any)
    if origin is dict:
        return _to_dict(value, *(args or (Any, Any)))
    return _check(value, isinstance(origin, type) and isinstance(value, origin))


def _check(value: Any, fits: bool) -> Any:
    if not fits:
        raise _Mismatch
    return value


def _convert_union(value: Any, members: tuple[Any, ...]) -> Any:
    """None for a None value; otherwise members of the value's own kind first, then scalars, then containers."""
    if value is None:
        return _check(None, NONE_TYPE in members)
    candidates = sorted((member for member in members if member is not NONE_TYPE), key=lambda m: _rank(value, m))
    for member in candidates:
        try:
            return _convert(value, member)
        except _Mismatch:
            continue
    raise _Mismatch


def _rank(value: Any, member: Any) -> int:
    origin = typing.get_origin(member) or member
    if origin is Literal:
        same_kind = any(type(value) is type(arg) and value == arg for arg in typing.get_args(member))
    elif origin in (bool, int, float):
        same_kind = type(value) is origin
    elif _is_enum(origin):
        same_kind = isinstance(value, str)
    else:
        same_kind = isinstance(origin, type) and isinstance(value, origin)
    return 0 if same_kind else 2 if origin in (list, dict) else 1


def _to_bool(value: Any) -> bool:
    """true/false, 1/0, and the words HfArgumentParser and YAML use (`"false"` must not be truthy)."""
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    word = value.strip().lower() if isinstance(value, str) else None
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise _Mismatch


def _to_int(value: Any) -> int:
    """Integral numbers only: "1e3" and 2.0 are fine, 2.5 and true (a YAML boolean, not a count) are not."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            number = Decimal(value)
        except InvalidOperation:
            raise _Mismatch from None
        if number.is_finite() and abs(number) < INT_LIMIT and number == number.to_integral_value():
            return int(number)
    raise _Mismatch


def _to_float(value: Any) -> float:
    """Numbers and numeric strings (YAML's "1e-3"); not booleans, and not NaN, which no setting means."""
    if type(value) not in (int, float, str):
        raise _Mismatch
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise _Mismatch from None
    return _check(number, not math.isnan(number))


def _to_str(value: Any) -> str:
    """Strings, and numbers as written (`dataset_split: 1` is "1"); not booleans, lists or dicts."""
    if isinstance(value, str):
        return value
    return str(_check(value, type(value) in (int, float)))


SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _to_enum(value: Any, cls: type[enum.Enum]) -> Any:
    """A member or a member's value, passed through unchanged (TrainingArguments converts it itself)."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, str):
        raise _Mismatch
    try:
        cls(value)
    except ValueError:
        raise _Mismatch from None
    return value


def _to_list(value: Any, item: Any) -> list[Any]:
    """Each element converted; a single scalar is a one-element list, as with HfArgumentParser's `--flag value`."""
    if isinstance(value, dict):
        raise _Mismatch
    return [_convert(element, item) for element in (value if isinstance(value, list) else [value])]


def _to_dict(value: Any, key: Any, item: Any) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _Mismatch
    return {_convert(name, key): _convert(element, item) for name, element in value.items()}
