"""Bounds on a draft config, checked from its config.json alone before any model is built or run.

A config.json is a few KiB that decides how much memory and time the next step takes: a checkpoint
saying `hidden_size: 1000000000` is allocated before any other check, and one saying
`block_size: 1000000` makes the export's round-trip forward (rule 20 of docs/contract.md) run for
minutes inside attention. Export, publish and warm start therefore read the config first, refuse
absurd sizes (naming the field, its value and the bound) and refuse a draft whose estimated memory
exceeds what the machine has available, all in milliseconds and before anything is allocated.

The bounds are generous (several times the largest released models), so they only ever stop a
config that no real draft has; memory is the finer check.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, cast

from modeling_dflash2.configuration_dflash2 import FIELD_BOUNDS, Bound, is_int
from trainer.fileio import format_bytes, read_json_object
from trainer.models.tensor_layout import expected_tensors

# config.json of a draft is ~2 KiB; reading (and JSON-parsing) a file larger than this is refused.
MAX_CONFIG_BYTES = 1 << 20
# The widths every draft config states (the rest of the bounds table is checked when present).
REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
FLOAT32_BYTES = 4


class InsufficientMemoryError(ValueError):
    """The draft a config describes would not fit in this machine's memory: a user error (exit 2),
    raised before any allocation, unlike the MemoryError an allocation raises."""


def _bounded(name: str, value: Any, bound: Bound) -> str | None:
    if not is_int(value):
        return f"{name} must be an integer, got {value!r}"
    if not bound.low <= value <= bound.cap:
        return f"{name} is {value}, outside [{bound.low}, {bound.cap}] ({bound.why})"
    return None


def _size_violations(config: dict[str, Any], dfc: dict[str, Any]) -> list[str]:
    """Every field of the bounds table (`FIELD_BOUNDS`) outside its range: required widths always,
    the others when present; a DFlash v1 config may keep block_size at the top level."""
    found: list[str | None] = []
    for name, bound in FIELD_BOUNDS.items():
        if bound.cap is None:
            continue  # a rule the config enforces, with no size to cap
        nested = name.removeprefix("dflash_config.")
        values = dfc if nested != name else config
        if (nested in values and values[nested] is not None) or name in REQUIRED_FIELDS:
            found.append(_bounded(name, values.get(nested), bound))
    if "block_size" in config:  # a DFlash v1 config keeps it at the top level
        found.append(_bounded("block_size", config["block_size"], FIELD_BOUNDS["dflash_config.block_size"]))
    if "block_size" not in dfc and "block_size" not in config:
        found.append("dflash_config.block_size is missing")
    return [failure for failure in found if failure is not None]


def bounds_violations(config: dict[str, Any]) -> list[str]:
    """Every size of `config` outside its bound, as 'field ...' strings (empty when all hold).

    Reads a training or public config.json, DFlash2 or v1 (whose block_size may sit at the top level)."""
    dfc = config.get("dflash_config")
    if not isinstance(dfc, dict):
        return [f"dflash_config must be an object, got {dfc!r}"]
    found = _size_violations(config, dfc)
    if found:
        return found
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    failures: list[str] = []
    if config.get("head_dim") is None and hidden % heads:
        failures.append(f"num_attention_heads {heads} must divide hidden_size {hidden} (no head_dim is given)")
    if heads % kv_heads:
        failures.append(f"num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
    if hidden % dfc.get("conv_group_size", 1):
        failures.append(f"dflash_config.conv_group_size {dfc['conv_group_size']} must divide hidden_size {hidden}")
    ids = dfc.get("target_layer_ids")
    depth = cast(int, config.get("num_target_layers") or FIELD_BOUNDS["num_target_layers"].cap)  # cap is set
    if not isinstance(ids, list) or not 1 <= len(ids) <= depth or not all(is_int(i) and 0 <= i < depth for i in ids):
        shown = ids if not isinstance(ids, list) or len(ids) <= 16 else f"a list of {len(ids)}"
        failures.append(f"dflash_config.target_layer_ids must be 1 to {depth} ids in [0, {depth}), got {shown!r}")
    return failures


def parameter_count(config: dict[str, Any]) -> int:
    """The draft's parameters, from the contract's tensor list (a v1 config has no conv or selector)."""
    # DFlash v1 (or a config missing them, or writing them as null): the DFlash2 modules hold nothing
    absent = {"conv_kernel_size": 0, "conv_group_size": config["hidden_size"], "selector_rank": 0}
    dfc = {**absent, **{key: value for key, value in config["dflash_config"].items() if value is not None}}
    return sum(math.prod(shape) for shape in expected_tensors({**config, "dflash_config": dfc}).values())


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable, lowered by a cgroup (container) limit;
    None when neither can be read (the memory check is then skipped)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        if limit is not None and usage is not None and limit < 1 << 60:
            headroom = max(limit - usage, 0)
            available = headroom if available is None else min(available, headroom)
            break
    return available


def check_memory(needed: int, source: str, purpose: str, detail: str) -> None:
    """Refuse `purpose` when `needed` bytes exceed the memory available, in one line."""
    available = available_memory()
    if available is not None and needed > available:
        raise InsufficientMemoryError(
            f"{source}: {purpose} needs about {format_bytes(needed)} ({detail}), more than the "
            f"{format_bytes(available)} of memory available"
        )


def check_draft_config(
    config: dict[str, Any], source: str, *, purpose: str, bytes_per_parameter: float, detail: str
) -> int:
    """Bounds, then the memory `purpose` needs (parameters x `bytes_per_parameter`); returns the
    parameter count. `source` names the config in the one-line error."""
    failures = bounds_violations(config)
    if failures:
        raise ValueError(f"{source}: " + "; ".join(failures))
    count = parameter_count(config)
    needed = math.ceil(count * bytes_per_parameter)
    check_memory(needed, source, purpose, f"{count:,} parameters x {bytes_per_parameter:g} bytes: {detail}")
    return count


def checkpoint_config_file(spec: str | os.PathLike, **hub_kwargs: Any) -> Path | None:
    """The config.json a checkpoint (dir or Hub id) loads from, fetching that file alone from the Hub
    (as `from_pretrained` would first); None when a local directory has none."""
    subfolder = hub_kwargs.get("subfolder") or ""
    local = Path(os.path.expanduser(spec)) / subfolder
    if local.is_dir():
        path = local / "config.json"
        return path if path.is_file() else None
    from transformers.utils import cached_file

    keys = ("revision", "cache_dir", "token", "local_files_only", "subfolder", "force_download")
    resolved = cached_file(str(spec), "config.json", **{key: hub_kwargs[key] for key in keys if key in hub_kwargs})
    return Path(resolved) if resolved else None


def check_checkpoint_config(
    spec: str | os.PathLike, what: str, *, purpose: str, bytes_per_parameter: float, detail: str, **hub_kwargs: Any
) -> None:
    """`check_draft_config` on a checkpoint's config.json, read alone before anything is built."""
    path = checkpoint_config_file(spec, **hub_kwargs)
    if path is not None:
        check_draft_config(
            read_json_object(path, what, MAX_CONFIG_BYTES),
            f"{what} {path}",
            purpose=purpose,
            bytes_per_parameter=bytes_per_parameter,
            detail=detail,
        )
