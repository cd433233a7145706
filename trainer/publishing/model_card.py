"""The exported draft's model card (README.md) and its per-position acceptance plot."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from trainer.evaluation.report import render_markdown
from trainer.fileio import looks_like_local_path
from trainer.publishing.hub_ids import NOT_HUB_PREFIXES, check_hub_id

THIS_REPO = "<this repo>"  # the placeholder the reader replaces with the draft's repo id
Reports = dict[str, dict[str, Any]]  # speculative-decoding reports keyed by benchmark
TAGS = ["speculative-decoding", "dflash", "dflash2", "draft-model", "block-diffusion"]
EVAL_ROWS = (
    ("eval_tau_walk", "τ, selector walk (teacher-forced acceptance length; what serving proposes)"),
    ("eval_tau_unary", "τ, unary argmax (teacher-forced)"),
    ("eval_tau_oracle", "τ, top-K oracle (ceiling)"),
    ("eval_accuracy", "top-1 accuracy"),
    ("eval_coverage", "top-K coverage"),
    ("eval_selector_lift", "selector lift over unary (covered slots)"),
    ("eval_loss", "loss"),
)


def per_position_series(evaluation: dict[str, Any] | None, reports: Reports) -> dict[str, list[float]]:
    """Curves to plot: teacher-forced per-position accuracy, and the real acceptance of every path
    of every benchmark measured (labelled `benchmark: path`)."""
    series: dict[str, list[float]] = {}
    if evaluation:
        positions = sorted(
            int(key.rsplit("_", 1)[1]) for key in evaluation if key.startswith("eval_accuracy_position_")
        )
        if positions:
            series["teacher-forced accuracy"] = [evaluation[f"eval_accuracy_position_{k}"] for k in positions]
    for benchmark, report in reports.items():
        for path, result in report.get("paths", {}).items():
            if result.get("per_position_acceptance"):
                series[f"{benchmark}: {path}"] = result["per_position_acceptance"]
    return series


def save_acceptance_plot(path: Path, evaluation: dict[str, Any] | None, reports: Reports) -> bool:
    """Write the per-position plot PNG; False when there is nothing measured to plot."""
    series = per_position_series(evaluation, reports)
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    for label, values in series.items():
        axis.plot(range(1, len(values) + 1), values, marker="o", label=label)
    axis.set_xlabel("draft position in the block")
    axis.set_ylabel("rate")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title("Per-position acceptance")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def _evaluation_table(evaluation: dict[str, Any] | None, reports: Reports) -> str:
    """The teacher-forced metrics of training, then one section per benchmark decoded for real."""
    sections = []
    if evaluation:
        lines = ["| held-out metric (teacher-forced) | value |", "|---|---|"]
        lines += [f"| {label} | {evaluation[key]:.4f} |" for key, label in EVAL_ROWS if key in evaluation]
        sections.append("\n".join(lines))
    for benchmark, report in reports.items():
        if report.get("paths"):
            heading = f"### Speculative decoding: {markdown_text(benchmark)}"
            sections.append(f"{heading}\n\n{render_markdown(report).strip()}")
    return "\n\n".join(sections) if sections else "No evaluation was recorded with this checkpoint."


MARKDOWN_SPECIAL = frozenset("\\`*_[]()<>#|~!&$")


def markdown_text(value: Any) -> str:
    """`value` as inert Markdown prose: one line (a newline could start a heading, a list or front
    matter) with every character that opens markup backslash-escaped."""
    text = " ".join(str(value).split())
    return "".join(f"\\{char}" if char in MARKDOWN_SPECIAL else char for char in text)


def markdown_code(value: Any) -> str:
    """`value` as an inline code span, or as escaped prose when a backtick would end the span early."""
    text = " ".join(str(value).split())
    return markdown_text(text) if "`" in text or not text else f"`{text}`"


def _number(value: Any) -> str:
    """A recorded number as `:g`, anything else (a recipe from someone else) as escaped prose."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f"{value:g}" if is_number else markdown_text(value)


def shell_line(*segments: list[str]) -> str:
    """A shell command whose every word is quoted for the shell (shlex), one segment per line."""
    return " \\\n    ".join(shlex.join(segment) for segment in segments)


def code_block(language: str, text: str) -> str:
    """`text` fenced so that nothing inside can close the fence: a quoted shell word may hold a
    newline followed by backticks, so the fence is longer than any backtick run in `text`."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"


def python_string(value: str) -> str:
    """`value` as a Python string literal (JSON's escapes are all valid Python ones)."""
    return json.dumps(value)


def card_base_model(name: str | None) -> str | None:
    """The card's `base_model` metadata: the target's name only when it is a Hub repo id (never a
    local path, a pypi: target or anything the Hub's validator refuses)."""
    if not name or name.startswith(NOT_HUB_PREFIXES) or looks_like_local_path(name):
        return None
    try:
        check_hub_id(name, "base_model")
    except ValueError:
        return None
    return name


def _distillation(training: dict[str, Any]) -> str:
    """`, distillation weight w at temperature T` when the recipe distilled from the target."""
    weight = training.get("kd_weight")
    if weight is None:
        weight = 1.0 if training.get("loss_type") == "kd" else 0.0
    if not weight:
        return ""
    temperature = training.get("kd_temperature", 1.0)
    return f" with distillation from the target (weight {_number(weight)}, temperature {_number(temperature)})"


def render_model_card(
    config: dict[str, Any],
    target: Any,
    record: dict[str, Any],
    reports: Reports,
    plot_file: str | None,
    license: str = "apache-2.0",
) -> ModelCard:
    """The card: metadata, serving commands, training summary and every evaluation (`reports`:
    speculative-decoding reports keyed by benchmark, in the order they were given)."""
    dfc = config["dflash_config"]
    block = dfc["block_size"]
    base = target.name if target is not None else None
    base_model = card_base_model(base)
    # every user- or Hub-supplied value is quoted for where it lands, even after validation
    title = markdown_text(base) if base else "its target"
    target_word = base or "<target>"
    speculative_config = {"method": "dflash", "model": THIS_REPO, "num_speculative_tokens": block - 1}
    vllm = shell_line(
        ["vllm", "serve", target_word],
        ["--speculative-config", json.dumps(speculative_config)],
    )
    sglang = shell_line(
        ["python", "-m", "sglang.launch_server", "--model-path", target_word, "--speculative-algorithm", "DFLASH"],
        ["--speculative-draft-model-path", THIS_REPO, "--speculative-num-draft-tokens", str(block)],
    )
    data = ModelCardData(
        library_name="transformers",
        base_model=base_model,
        license=license,
        pipeline_tag="text-generation",
        tags=TAGS,
    )
    training = record.get("training_arguments", {})
    steps = markdown_text(record.get("global_step", "an unrecorded number of"))
    learning_rate, anchors, selector_alpha = (
        markdown_text(training.get(key, "n/a")) for key in ("learning_rate", "num_anchors", "selector_alpha")
    )
    loss = markdown_code(training.get("loss_type", "n/a"))
    plot = f"\n![per-position acceptance]({plot_file})\n" if plot_file else ""
    causal = str(config["is_causal"]).lower()
    body = f"""
# DFlash2 draft for {title}

A [DFlash2](https://github.com/z-lab/dflash) speculative-decoding draft: it proposes a block of
{block - 1} tokens per step for the target model, which verifies them. It uses the target's embedding and
LM head, so this repository holds only the draft's own weights.

- block size: {block}; mask token id: {dfc["mask_token_id"]}; target layers: {dfc["target_layer_ids"]}
- selector: rank {dfc["selector_rank"]}, top-{dfc["selector_top_k"]}
- convolution: kernel {dfc["conv_kernel_size"]}, group {dfc["conv_group_size"]}
- {config["num_hidden_layers"]} layers, hidden size {config["hidden_size"]}, `is_causal: {causal}`

## Serving

vLLM (V2 model runner):

{code_block("bash", vllm)}

SGLang:

{code_block("bash", sglang)}

Serve with the trained block size B = {block}: vLLM's `num_speculative_tokens` must be exactly B − 1 = {block - 1}
and SGLang's `--speculative-num-draft-tokens` exactly B = {block}, because vLLM takes the draft's
convolution block from 1 + `num_speculative_tokens`, not from the config's `block_size`, so any
other value silently shifts the blocks.

## Speculative decoding in plain transformers

The folder carries its decoding loop (`spec_generate`, z-lab's call), so nothing else is needed:

```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

draft = AutoModel.from_pretrained({python_string(THIS_REPO)}, trust_remote_code=True, dtype="auto").eval()
target = AutoModelForCausalLM.from_pretrained({python_string(target_word)}, dtype="auto").eval()
tokenizer = AutoTokenizer.from_pretrained({python_string(target_word)})
messages = [{{"role": "user", "content": "Hello!"}}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
    "input_ids"
]
output_ids = draft.spec_generate(
    target=target, input_ids=input_ids, max_new_tokens=256, stop_token_ids=[tokenizer.eos_token_id], temperature=0.0
)
```

It returns the ids `[1, prompt + generated]`; greedy output equals the target's own greedy output,
and `temperature`/`top_p`/`top_k` sample from the target's distribution. Without
`trust_remote_code=True`, AutoModel builds a random Qwen3Model instead.

## Training

Trained with dflash2-hub for {steps} steps
(learning rate {learning_rate}, {anchors} anchors per sequence,
loss {loss}{_distillation(training)}, selector α {selector_alpha}).
The full recipe and library versions are in `dflash2_provenance.json`.

## Evaluation

{_evaluation_table(record.get("evaluation"), reports)}
{plot}
τ is the mean acceptance length per block including the target's bonus token.
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
