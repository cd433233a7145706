# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""What a DFlash draft checkpoint folder holds, and how strictly it is read.

A folder is `config.json`, `model.safetensors` and the remote code below, with `auto_map` naming
it; `save_pretrained` writes it that way even when FSDP2 has swapped the model's class. Loading
refuses any tensor set that is not this model's (missing, unexpected, mis-shaped, or only part of
the DFlash2 modules), because a server would otherwise serve a half-initialised draft.

This file ships inside every checkpoint: it may import only the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The remote code of a checkpoint: `modeling_dflash2.py` imports the others (relatively), so
# transformers fetches each of them; every one is copied into every checkpoint.
REMOTE_CODE_FILES = (
    "configuration_dflash2.py",
    "modeling_dflash2.py",
    "ops_dflash2.py",
    "generation_dflash2.py",
    "checkpoint_dflash2.py",
)
# z-lab's reference loader holds the codebooks as nn.Embedding and therefore writes `.weight` names;
# the servers and this model use the bare names of the public contract.
CODEBOOK_KEY_MAPPING = {
    r"^candidate_selector\.(predecessor|successor)_codebook\.weight$": r"candidate_selector.\1_codebook",
}


def check_loaded_tensors(model_name: str, info: Mapping[str, Any], dflash2_names: Collection[str]) -> None:
    """Refuse what `from_pretrained(..., output_loading_info=True)` reports as wrong; a checkpoint
    with none of the DFlash2 tensors `dflash2_names` (a DFlash v1 warm start) only warns."""
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = list(info.get("mismatched_keys") or ())
    if unexpected:
        raise ValueError(f"{model_name}: the checkpoint has tensors this model does not define: {sorted(unexpected)}")
    if mismatched:
        raise ValueError(f"{model_name}: tensors with the wrong shape (key, checkpoint, model): {mismatched}")
    dflash2 = set(dflash2_names)
    missing_backbone = missing - dflash2
    if missing_backbone:
        raise ValueError(f"{model_name}: the checkpoint lacks tensors: {sorted(missing_backbone)}")
    missing_dflash2 = missing & dflash2
    if missing_dflash2 and missing_dflash2 != dflash2:
        raise ValueError(
            f"{model_name}: the checkpoint holds only part of the DFlash2 modules; missing: "
            f"{sorted(missing_dflash2)}. A DFlash2 checkpoint must carry every conv and selector tensor."
        )
    if missing_dflash2:
        logger.warning(
            "%s: the checkpoint has no DFlash2 tensors (a DFlash v1 draft?): convs start as identity "
            "and the selector as a unary no-op.",
            model_name,
        )


def write_remote_code(directory: Path, architecture: str, keep_python_files: Collection[Path] = frozenset()) -> None:
    """Copy the remote code into `directory`, remove any other Python file save_pretrained wrote
    there (not those in `keep_python_files`), and point `config.json`'s `auto_map` at the code."""
    source = Path(__file__).resolve().parent
    for stray in set(directory.glob("*.py")) - set(keep_python_files):
        if stray.name not in REMOTE_CODE_FILES:
            stray.unlink()
    for filename in REMOTE_CODE_FILES:
        if (source / filename).resolve() != (directory / filename).resolve():
            shutil.copyfile(source / filename, directory / filename)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config["auto_map"] = {
        "AutoConfig": "configuration_dflash2.DFlash2Config",
        "AutoModel": f"modeling_dflash2.{architecture}",
    }
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".config.", suffix=".json")
    with os.fdopen(handle, "w") as stream:
        stream.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, config_path)
