"""Export a trained draft to a publishable folder in the public DFlash2 layout (docs/contract.md).

SGLang silently ignores unknown tensors and vLLM rejects extra ones, so this exporter is the only
place the checkpoint contract is enforced: every rule of docs/contract.md is checked before anything
is written, the folder is written to a temporary sibling, reloaded strictly and compared against
the in-memory draft (rule 20), and only then renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file

import modeling_dflash2
from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from modeling_dflash2.checkpoint_dflash2 import REMOTE_CODE_FILES
from trainer.fileio import (
    check_checkpoint_weights,
    read_json_object,
    replace_directory,
    reporting_disk_full,
    require_existing_path,
    write_directory_atomically,
)
from trainer.models.config_bounds import (
    FLOAT32_BYTES,
    MAX_CONFIG_BYTES,
    check_checkpoint_config,
    check_draft_config,
)
from trainer.models.loading import from_pretrained_safetensors, load_draft
from trainer.publishing.contract import (
    ExportValidationError,
    TargetDimensions,
    check_exportable_architecture,
    contract_violations,
    public_config,
)

logger = logging.getLogger(__name__)

PROVENANCE_FILE = "dflash2_provenance.json"
RECIPE_FILE = "dflash2_recipe.json"
PLOT_FILE = "acceptance_per_position.png"
SECRET_KEYS = ("hub_token", "push_to_hub_token", "token", "hf_token")
# Read limits of a run's records: a recipe is a few KiB; trainer_state.json logs every logging step.
RECIPE_LIMIT = 16 * MAX_CONFIG_BYTES
STATE_LIMIT = 256 * MAX_CONFIG_BYTES


def shipped_remote_code(filename: str) -> Path:
    """The modeling file this version ships, which every export carries byte for byte (rule: the
    remote code a `trust_remote_code` user runs is exactly this package's)."""
    return Path(modeling_dflash2.__file__).parent / filename


def export_bytes_per_parameter(dtype: torch.dtype, loaded: bool) -> float:
    """Peak bytes per parameter of an export: the draft as loaded (at most fp32, unless already in
    memory), its cast copy, and rule 20's reloaded folder and fp32 reference with its cast weights."""
    size = torch.empty((), dtype=dtype).element_size()
    return (0 if loaded else FLOAT32_BYTES) + FLOAT32_BYTES + 3 * size


EXPORT_MEMORY = "the draft as loaded, its cast copy, and the round trip's reloaded folder and fp32 reference"


def check_export_config(config: dict[str, Any], source: str, dtype: torch.dtype, loaded: bool) -> None:
    """Bounds and memory of an export, from the config alone: before loading, and before the round trip."""
    check_exportable_architecture(config, source)  # rule 22: a DFlash v1 draft, before anything is loaded
    check_draft_config(
        config,
        source,
        purpose="exporting this draft",
        bytes_per_parameter=export_bytes_per_parameter(dtype, loaded),
        detail=EXPORT_MEMORY,
    )


def load_trained_draft(
    checkpoint: str | os.PathLike, config: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16
) -> DFlash2DraftModel:
    """A training checkpoint as a plain DFlash2DraftModel: a full draft directory, a PEFT adapter
    directory (merged into its base), or a bare `model.safetensors` (e.g. from `accelerate
    merge-weights` of a sharded FSDP checkpoint) plus the draft `config`. A missing directory or
    a truncated safetensors file is refused first, naming it; so is a config whose sizes are absurd
    or whose export (in `dtype`) would not fit in memory, before any model is built."""
    checkpoint = Path(require_existing_path(checkpoint, "checkpoint", local_only=True))
    check_checkpoint_weights(checkpoint)
    if (checkpoint / "adapter_config.json").exists():
        from peft import PeftModel

        adapter = read_json_object(checkpoint / "adapter_config.json", "adapter config", MAX_CONFIG_BYTES)
        base = adapter.get("base_model_name_or_path")
        if not isinstance(base, str):
            raise ValueError(f"{checkpoint / 'adapter_config.json'} names no base_model_name_or_path")
        check_checkpoint_config(
            base,
            "adapter base",
            purpose="exporting this draft",
            bytes_per_parameter=export_bytes_per_parameter(dtype, loaded=False),
            detail=EXPORT_MEMORY,
        )
        return PeftModel.from_pretrained(load_draft(base), str(checkpoint)).merge_and_unload()
    if (checkpoint / "config.json").exists():
        config_file = checkpoint / "config.json"
        check_export_config(
            read_json_object(config_file, "checkpoint", MAX_CONFIG_BYTES), f"checkpoint {config_file}", dtype, False
        )
        return cast(DFlash2DraftModel, load_draft(checkpoint))  # (load_draft asserts the class, by name)
    if config is None:
        raise ValueError(f"{checkpoint} has no config.json: pass the draft config (--config) to export it.")
    check_export_config(
        read_json_object(config, "draft config", MAX_CONFIG_BYTES), f"draft config {config}", dtype, False
    )
    draft_config = DFlash2Config.from_json_file(config)
    return from_pretrained_safetensors(DFlash2DraftModel, checkpoint, "checkpoint", config=draft_config)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def remove_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: remove_secrets(v)
            for k, v in value.items()
            if not (k in SECRET_KEYS or (k.endswith("_token") and isinstance(v, str)))
        }
    if isinstance(value, (list, tuple)):
        return [remove_secrets(v) for v in value]
    return value


def training_record(checkpoint: Path) -> dict[str, Any]:
    """The recipe and the last logged metrics found in a checkpoint, read from JSON only; a record
    that is not a JSON object (damaged, or someone else's) is refused in one line naming the file.

    `training_args.bin` (HF's pickle of the arguments) is never read: unpickling a checkpoint that
    came from someone else would run whatever code it holds.
    """
    record: dict[str, Any] = {}
    recipe_file = checkpoint / RECIPE_FILE
    if recipe_file.exists():
        recipe = read_json_object(recipe_file, "recorded recipe", RECIPE_LIMIT)
        record.update(remove_secrets({k: v for k, v in recipe.items() if k != "format"}))
    elif (checkpoint / "training_args.bin").exists():
        logger.warning("%s has no %s; its training_args.bin is a pickle and is not read.", checkpoint, RECIPE_FILE)
    state_file = checkpoint / "trainer_state.json"
    if state_file.exists():
        state = read_json_object(state_file, "trainer state", STATE_LIMIT)
        history = state.get("log_history", [])
        if not isinstance(history, list):
            raise ValueError(f"trainer state {state_file}: log_history must be a list, got {type(history).__name__}")
        record["global_step"] = state.get("global_step")
        evaluations = [log for log in history if isinstance(log, dict) and "eval_loss" in log]
        if evaluations:
            record["evaluation"] = evaluations[-1]
    return record


def _versions() -> dict[str, str]:
    import importlib.metadata

    versions = {}
    for package in ("dflash2-hub", "torch", "transformers", "accelerate", "peft", "safetensors", "huggingface-hub"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return versions


def _check_round_trip(directory: Path, model: DFlash2DraftModel, dtype: torch.dtype) -> None:
    """Rule 20: the written folder reloads strictly and reproduces the in-memory draft's outputs."""
    reloaded = from_pretrained_safetensors(DFlash2DraftModel, directory, "export", dtype=dtype).eval()
    reference = DFlash2DraftModel(model.config).to(dtype).eval()  # type: ignore[arg-type]  # (transformers' .to)
    reference.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    generator = torch.Generator().manual_seed(0)
    settings = model.dflash
    hidden, block, context = model.config.hidden_size, settings.block_size, 5
    inputs = {
        "position_ids": torch.arange(context + block)[None],
        "noise_embedding": torch.randn(1, block, hidden, generator=generator).to(dtype),
        "target_hidden": torch.randn(1, context, len(settings.target_layer_ids) * hidden, generator=generator).to(
            dtype
        ),
    }
    head = torch.randn(model.config.vocab_size, hidden, generator=generator).to(dtype)
    with torch.no_grad():
        expected = reference.compute_logits(reference(**inputs), head)
        got = reloaded.compute_logits(reloaded(**inputs), head)
    if not torch.equal(expected, got):
        raise ExportValidationError("rule 20: the reloaded export does not reproduce the draft's logits")


def reports_by_benchmark(
    reports: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
) -> dict[str, dict[str, Any]]:
    """Speculative-decoding reports keyed by benchmark, in the given order; a report from before
    benchmarks existed counts as `heldout`. Two reports on one benchmark are refused: the card
    could show only one of them."""
    from trainer.evaluation.report import report_benchmark

    listed = [reports] if isinstance(reports, Mapping) else list(reports or [])
    keyed: dict[str, dict[str, Any]] = {}
    for report in listed:
        benchmark = report_benchmark(report)
        if benchmark in keyed:
            raise ValueError(f"two evaluation reports are for benchmark {benchmark!r}; give one per benchmark")
        keyed[benchmark] = dict(report)
    return keyed


def export_draft(
    model: DFlash2DraftModel,
    output_dir: str | os.PathLike,
    *,
    target: TargetDimensions | None,
    dtype: torch.dtype = torch.bfloat16,
    expected_block_size: int | None = None,
    overwrite: bool = False,
    source: str | os.PathLike | None = None,
    license: str = "apache-2.0",
    record: dict[str, Any] | None = None,
    evaluation_report: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
) -> Path:
    """Validate, write, reload-check, then atomically place a publishable draft folder.

    `overwrite` replaces only an earlier export, never the `source` checkpoint, a folder holding
    it or a folder inside it. `evaluation_report`: one report of `dflash2 evaluate`, or one per
    benchmark; the card shows each under its benchmark's heading."""
    from trainer.publishing.model_card import render_model_card, save_acceptance_plot

    reports = reports_by_benchmark(evaluation_report)

    output_dir = Path(output_dir)
    check_export_output(output_dir, overwrite, source)
    if type(model).__name__ != "DFlash2DraftModel":
        raise ExportValidationError(f"rule 22: only a DFlash2DraftModel can be exported, got {type(model).__name__}")
    config = public_config(model.config, dtype)
    check_export_config(config, "the draft", dtype, loaded=True)  # before the copies and rule 20's forward
    tensors = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in model.state_dict().items()}
    failures = contract_violations(config, tensors, target, dtype, expected_block_size)
    if failures:
        raise ExportValidationError("the draft breaks the public checkpoint contract:\n  " + "\n  ".join(failures))
    if dtype != torch.bfloat16:
        logger.warning("Exporting in %s: published DFlash2 drafts are bfloat16.", dtype)
    record = remove_secrets(record or {})
    provenance = {
        "format": "dflash2-hub export",
        "target": target.name if target else None,
        "serving": serving_flags(config["dflash_config"]["block_size"]),
        "versions": _versions(),
        **record,
    }
    if reports:
        provenance["speculative_evaluation"] = reports

    def write(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        for filename in REMOTE_CODE_FILES:
            shutil.copyfile(shipped_remote_code(filename), directory / filename)
        (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, default=str) + "\n")
        plot = save_acceptance_plot(directory / PLOT_FILE, record.get("evaluation"), reports)
        plot_file = PLOT_FILE if plot else None
        card = render_model_card(config, target, record, reports, plot_file=plot_file, license=license)
        card.save(directory / "README.md")
        _check_round_trip(directory, model, dtype)

    # A full disk is the documented one line: what was being written, the space left, what is kept.
    kept = f"the earlier export at {output_dir} is kept" if output_dir.exists() else "no partial export is left"
    kept += f", the checkpoint {source} is untouched" if source is not None else ""
    with reporting_disk_full("the export", output_dir, kept):
        if overwrite and output_dir.exists():
            staging = output_dir.with_name(f".{output_dir.name}.new-{uuid.uuid4().hex[:8]}")
            write_directory_atomically(staging, write)
            try:
                replace_directory(staging, output_dir)
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # gone once in place; removed if the swap failed
        else:
            write_directory_atomically(output_dir, write)
    logger.info("Exported %s (%d tensors, %s)", output_dir, len(tensors), dtype)
    return output_dir


def export_folder_problems(folder: Path) -> tuple[set[str], set[str]]:
    """(missing, unexpected) names of `folder` against an export's files (the plot is optional;
    any subfolder is unexpected)."""
    names = {path.name for path in folder.iterdir()}
    files = {name for name in names if (folder / name).is_file()}
    return EXPORT_FILES - files, (names - EXPORT_FILES - {PLOT_FILE}) | (names - files)


def check_export_output(output_dir: Path, overwrite: bool, source: str | os.PathLike | None = None) -> None:
    """Refuse an output that would destroy something the user made: the source checkpoint, a
    folder holding it (e.g. the training run), a folder inside it, or anything but an earlier export."""
    if source is not None:
        source_path, output_path = Path(source).resolve(), output_dir.resolve()
        if output_path == source_path or source_path.is_relative_to(output_path):
            raise ValueError(f"export output {output_dir} is or holds the checkpoint {source}: choose another folder")
        if output_path.is_relative_to(source_path):
            raise ValueError(f"export output {output_dir} lies inside the checkpoint {source}: choose another folder")
    if not output_dir.exists():
        return
    if not overwrite:
        raise FileExistsError(f"export output {output_dir} exists: set overwrite=True (--overwrite) to replace it")
    if not output_dir.is_dir() or export_folder_problems(output_dir)[1]:
        raise ValueError(
            f"export output {output_dir} is not an earlier export (it holds other files); "
            "overwrite replaces only an export: choose another folder"
        )


def serving_flags(block_size: int) -> dict[str, Any]:
    """Rule 21: how the folder must be served (served block == trained block)."""
    return {
        "block_size": block_size,
        "vllm": {"method": "dflash", "num_speculative_tokens": block_size - 1, "note": "V2 model runner"},
        "sglang": {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": block_size},
    }


EXPORT_FILES = {"config.json", "model.safetensors", "README.md", PROVENANCE_FILE, *REMOTE_CODE_FILES}
