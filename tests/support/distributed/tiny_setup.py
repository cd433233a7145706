"""Writes a tiny target, draft config, chat data and recipe to a directory (for multi-process tests)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.support.tiny_target import tiny_conversations, tiny_draft_config_for, tiny_target


def write_tiny_run(root: Path, **recipe_overrides) -> Path:
    """Returns the recipe path; everything it names lives under `root`."""
    target = tiny_target()
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    tiny_draft_config_for(target).to_json_file(root / "draft.json")
    (root / "chat.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in tiny_conversations(24)))
    recipe = {
        "target": str(root / "target"),
        "draft_config": str(root / "draft.json"),
        "dataset": str(root / "chat.jsonl"),
        "regenerate": False,
        "num_eval_samples": 4,
        "max_length": 48,
        "cache_dir": str(root / "cache"),
        "output_dir": str(root / "output"),
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "learning_rate": 0.005,
        "num_anchors": 6,
        "logging_steps": 1,
        "save_steps": 2,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
    }
    recipe.update(recipe_overrides)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path
