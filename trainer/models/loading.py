"""Loading drafts for the rest of the project, with the class asserted.

With the published `model_type: "qwen3"`, `AutoModel.from_pretrained(draft)` without
`trust_remote_code=True` silently returns a randomly initialised `Qwen3Model`. Every draft this
project loads therefore goes through `load_draft`, which checks the class it got.

Weights are read from safetensors only (`from_pretrained_safetensors`): a pickle (`pytorch_model.bin`)
from a user's folder or the Hub is never unpickled, not even by torch's weights-only unpickler.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from transformers import AutoModel

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from trainer.fileio import check_local_checkpoint

DRAFT_CLASSES = {cls.draft_architecture: cls for cls in (DFlashDraftModel, DFlash2DraftModel)}
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder", "force_download")
# How transformers says a Hub repo has no safetensors weights when `use_safetensors=True`.
NO_SAFETENSORS_ON_HUB = "cannot be loaded with `safetensors`"


def from_pretrained_safetensors(loader: Any, spec: str | os.PathLike, what: str, **kwargs: Any) -> Any:
    """`loader.from_pretrained(spec, use_safetensors=True, ...)`: never a pickle. A local folder with
    only pickle weights is refused before this (`check_checkpoint_weights`, naming the conversion);
    a Hub repo without safetensors is refused here in one line naming `what`. `loader` is any class
    with `from_pretrained` (a model class, an Auto class, PeftModel), hence Any."""
    try:
        return loader.from_pretrained(spec, use_safetensors=True, **kwargs)
    except OSError as error:
        if NO_SAFETENSORS_ON_HUB not in str(error):
            raise
        raise OSError(
            f"{what} {spec} has no safetensors weights (model.safetensors or its index), and pickle weights "
            "(pytorch_model.bin) are never loaded: use a revision with safetensors, or download it, convert "
            "pytorch_model.bin to model.safetensors where you trust it, and pass the local folder"
        ) from None


def assert_draft_class(model: Any, expected: Iterable[str] = ("DFlash2DraftModel",)) -> None:
    """Raise unless `model` is one of the `expected` draft classes (by name: remote-code copies of
    the same class are different Python objects)."""
    expected = tuple(expected)
    name = type(model).__name__
    if name not in expected:
        hint = ""
        if name.startswith("Qwen3"):
            hint = (
                " A qwen3-typed draft config loaded without trust_remote_code=True gives a random native "
                "Qwen3 model; load with trust_remote_code=True or through load_draft()."
            )
        raise TypeError(f"Expected a draft of class {' or '.join(expected)}, got {name}.{hint}")


def load_draft(
    path_or_repo_id: str | os.PathLike,
    *,
    expected: Iterable[str] = ("DFlash2DraftModel",),
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> DFlashDraftModel:
    """Load a DFlash / DFlash2 draft from a directory or Hub id and assert its class.

    By default the class comes from this installed package (chosen by the config's
    `architectures`); `trust_remote_code=True` runs the modeling files shipped in the checkpoint
    instead, as a user without this package would. A local path must exist and its safetensors be
    whole (checked from their headers), so either mistake is reported naming the file; weights are
    read from safetensors only.
    """
    path_or_repo_id = check_local_checkpoint(path_or_repo_id, "draft", kwargs.get("subfolder"))
    if trust_remote_code:
        model = from_pretrained_safetensors(AutoModel, path_or_repo_id, "draft", trust_remote_code=True, **kwargs)
    else:
        hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
        config = DFlash2Config.from_pretrained(path_or_repo_id, **hub_kwargs)
        draft_class = DRAFT_CLASSES[config.dflash_settings.architecture]
        model = from_pretrained_safetensors(draft_class, path_or_repo_id, "draft", config=config, **kwargs)
    assert_draft_class(model, expected)
    return model
