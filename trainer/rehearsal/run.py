"""`Rehearsal`: a recipe run on this machine the way its GPU run will (`dflash2 rehearse`): the
architectures at a tiny width, the recipe's own data and keys, CPU ranks launched with `accelerate
launch`, and one line per check.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from trainer.rehearsal import checks as check_functions
from trainer.rehearsal.architecture import (
    stand_in_target_config,
    stand_in_tokenizer,
    target_tokenizer,
    tiny_draft_values,
    tiny_target,
    tiny_target_config,
)
from trainer.rehearsal.checks import Checks, NotChecked
from trainer.rehearsal.data import rehearsal_dataset
from trainer.rehearsal.hub import go_offline, hub_reachable
from trainer.rehearsal.launch import launch
from trainer.rehearsal.limits import NOT_CHECKED_ON_CPU, gpu_only_keys
from trainer.rehearsal.recipe import REHEARSAL_STEPS, rewrite_accelerate, rewrite_recipe, write_yaml

MARKER = ".dflash2-rehearsal"
DEFAULT_TIMEOUT_S = 600.0
FLEX_ROWS = 4
# float32 outputs of the same masks through two kernels: rounding only
FLEX_TOLERANCE = 1e-4


def default_accelerate_config() -> Path | None:
    """The config `accelerate launch` itself uses without --config_file, if there is one."""
    from accelerate.commands.config import default_config_file

    return Path(default_config_file) if Path(default_config_file).is_file() else None


def prepare_workspace(folder: Path) -> Path:
    """An empty workspace: a new folder, or an earlier rehearsal's (marked), emptied."""
    if folder.exists():
        if not folder.is_dir():
            raise NotADirectoryError(f"--output {folder} is a file")
        if any(folder.iterdir()) and not (folder / MARKER).exists():
            raise FileExistsError(f"--output {folder} holds files of something other than a rehearsal; choose another")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("a dflash2 rehearse workspace: replaced by the next rehearsal here\n")
    return folder.resolve()


class Rehearsal:
    """One recipe rehearsed: its inputs, its workspace and its checks."""

    def __init__(self, args: argparse.Namespace):
        from trainer.data.dataset import cache_root_of
        from trainer.plan.facts import read_accelerate_config
        from trainer.recipe_files import read_recipe
        from trainer.training.arguments import parse_arguments

        self.args = args
        overrides = ["--target", args.target] if args.target else []
        self.model_args, self.data_args, self.training_args = parse_arguments([args.recipe, *overrides])
        self.recipe = read_recipe(args.recipe)
        if args.target:
            self.recipe["target"] = args.target
        config_file = Path(args.accelerate_config) if args.accelerate_config else default_accelerate_config()
        self.accelerate_source = config_file
        self.accelerate = read_accelerate_config(str(config_file)) if config_file else None
        name = Path(args.recipe).stem
        folder = Path(args.output) if args.output else cache_root_of(self.data_args) / "rehearsals" / name
        self.workspace = prepare_workspace(folder)
        self.checks = Checks()
        self.target_config: Any = None
        self.target_checked = False
        self.draft_config: Any = None

    # -- the real sizes: config rules and memory plan ---------------------------------------

    def read_target(self) -> None:
        """The target's config as `dflash2 plan` reads it, or a stand-in of the draft's dimensions."""
        from trainer.plan.facts import load_target_config

        try:
            self.target_config = load_target_config(self.model_args)
            self.target_checked = True
            say(f"target: {self.model_args.target}: {architecture_line(self.target_config)}")
        except (OSError, ValueError) as error:
            if self.draft_config is None:
                raise
            self.target_config = stand_in_target_config(self.draft_config)
            folder = self.workspace / "target-config"
            self.target_config.save_pretrained(folder)
            self.model_args.target = str(folder)
            reason = " ".join(str(error).split()).split(". ")[0][:200]
            say(
                f"target: {self.recipe.get('target')}: its config cannot be read here ({reason}); stand-in: a "
                f"{self.target_config.model_type} target of the draft config's dimensions "
                f"({check_functions.layer_summary(self.target_config)}). The target architecture was NOT checked"
            )

    def config_rules(self) -> str:
        from trainer.publishing.contract import TargetDimensions, check_exportable_draft
        from trainer.publishing.draft_gate import load_draft_config

        text = self.target_config.get_text_config()
        dimensions = TargetDimensions(
            str(self.model_args.target), text.hidden_size, text.vocab_size, text.num_hidden_layers
        )
        check_exportable_draft(self.draft_config, "the draft config", dimensions)
        load_draft_config(self.model_args, building=False)  # the bounds training checks too
        against = "the target" if self.target_checked else "the stand-in target"
        return f"the draft would export (DFlash2 contract rules, against {against}'s dimensions)"

    def memory_plan(self) -> str:
        from trainer.plan.facts import GIB, accelerate_world_size
        from trainer.plan.memory import plan_run

        gpus = accelerate_world_size(self.accelerate or {})
        plan = plan_run(
            self.model_args,
            self.data_args,
            self.training_args,
            gpus,
            int(self.args.gpu_memory_gb * GIB),
            self.accelerate,
        )
        verdict = plan.verdict() + ("" if self.target_checked else " (target: the stand-in, the draft's dimensions)")
        if not plan.fits and not self.accelerate:  # the launch is unknown: one GPU is only a guess
            raise NotChecked(
                f"no accelerate config (given, or accelerate's default), so the launch is unknown; planned for "
                f"one GPU it does not fit: {verdict}; pass --accelerate-config as for accelerate launch"
            )
        if not plan.fits:
            raise ValueError(f"the real run does not fit: {verdict}")
        return verdict

    # -- the tiny models, data and recipe ----------------------------------------------------

    def build(self) -> None:
        """The tiny target (and tokenizer), the tiny draft config, the data, and the rewritten recipe."""
        from modeling_dflash2 import DFlash2Config

        tiny_config, target_changes = tiny_target_config(self.target_config)
        dtype = getattr(torch, self.model_args.target_dtype)
        model = tiny_target(tiny_config, dtype, seed=int(self.training_args.seed))
        target_folder = self.workspace / "target"
        model.save_pretrained(target_folder)
        vocab = cast(torch.Tensor, model.get_input_embeddings().weight).shape[0]  # an embedding's Parameter
        say(f"tiny target: {', '.join(target_changes)}; vocab kept ({vocab}); random weights")
        tokenizer, source = target_tokenizer(str(self.recipe.get("target")), offline=not self.online)
        if tokenizer is None:
            tokenizer = stand_in_tokenizer(vocab)
            source = f"stand-in (byte-level, ChatML template, {vocab} tokens): {source}"
        tokenizer.save_pretrained(target_folder)
        say(f"tokenizer: {source}")
        values, draft_changes = tiny_draft_values(self.draft_config, tiny_config.get_text_config().hidden_size)
        DFlash2Config(**values).dflash_settings  # noqa: B018  (the tiny draft config is a valid one)
        draft_file = self.workspace / "draft.json"
        DFlash2Config(**values).to_json_file(draft_file)
        say(f"tiny draft: {', '.join(draft_changes)}; every other draft setting kept")

        world = self.args.ranks
        dataset, note, _ = rehearsal_dataset(self.data_args, 64, self.workspace, self.online)
        say(f"data: {note}")
        endpoint_answers = bool(self.data_args.regenerate_endpoint) and endpoint_reachable(
            self.data_args.regenerate_endpoint
        )
        rewrite = rewrite_recipe(
            self.recipe,
            world=world,
            workspace=self.workspace,
            target=str(target_folder),
            draft_config=str(draft_file),
            dataset=dataset,
            dataset_note=note,
            keep_endpoint=endpoint_answers,
        )
        for line in rewrite.changes:
            say(line)
        for key in gpu_only_keys(self.recipe):
            say(f"gpu only: {key.key}: {key.value}: {key.why}")
        self.rehearsal_recipe = write_yaml(rewrite.values, self.workspace / "recipe.yaml")
        accelerate, changes = rewrite_accelerate(self.accelerate, world)
        for line in changes:
            say(line)
        if self.accelerate_source is None:
            say("accelerate: no config given and no default one: the recipe alone decides precision and sharding")
        self.fsdp = str(accelerate.get("distributed_type", "")).upper() == "FSDP"
        self.accelerate_file = write_yaml(accelerate, self.workspace / "accelerate.yaml")
        say(f"rehearsal recipe: {self.rehearsal_recipe}; accelerate config: {self.accelerate_file}")

    # -- checks on the tiny run ------------------------------------------------------------------

    def rehearsal_arguments(self, *overrides: str):
        from trainer.training.arguments import parse_arguments

        return parse_arguments([str(self.rehearsal_recipe), *overrides])

    def data_check(self) -> str:
        from trainer.data.chat import tokenize_chat_samples
        from trainer.data.dataset import (
            chitchat_prompts,
            column_values,
            conversations_or_prompts,
            load_raw_dataset,
        )
        from trainer.data.regeneration import prompt_conversation
        from trainer.models.target import TargetTokenizer

        _, data_args, _ = self.rehearsal_arguments()
        tokenizer = TargetTokenizer.load(str(self.workspace / "target")).tokenizer
        if data_args.dataset == "chitchat":
            first = prompt_conversation(chitchat_prompts()[0], data_args.system_prompt)
            rows = "chitchat prompts"
        else:
            raw = load_raw_dataset(data_args.dataset, data_args.dataset_split)
            chat, conversations = conversations_or_prompts(raw, data_args)
            first = (  # conversations_or_prompts gives the conversations whenever it gives no chat dataset
                next(column_values(chat, data_args.messages_column))
                if chat is not None
                else cast(Sequence, conversations)[0]
            )
            rows = f"{len(raw)} rows"
        samples = tokenize_chat_samples(tokenizer, first, data_args.enable_thinking)
        supervised_tokens = sum(sum(sample["loss_mask"]) for sample in samples)
        supervised = f"{supervised_tokens} supervised"
        if not supervised_tokens and data_args.regenerate:
            supervised = "a prompt: the target's answer is what gets supervised"
        tokens = sum(len(sample["input_ids"]) for sample in samples)
        shape = f"{tokens} tokens" if len(samples) == 1 else f"{len(samples)} samples of {tokens} tokens"
        return f"{rows}; the chat template renders the first: {shape}, {supervised}"

    def regeneration_check(self) -> str:
        from trainer.data.dataset import token_datasets
        from trainer.models.target import FrozenTarget

        model_args, data_args, _ = self.rehearsal_arguments()
        if not data_args.regenerate:
            raise NotChecked("the recipe does not regenerate (regenerate: false)")
        target = FrozenTarget.load(model_args.target, dtype=getattr(torch, model_args.target_dtype))
        train, evaluation = token_datasets(data_args, target)
        how = (
            f"through {data_args.regenerate_endpoint}"
            if data_args.regenerate_endpoint
            else "in process: the tiny target's generate"
        )
        held = len(evaluation) if evaluation is not None else 0
        return (
            f"{len(train)} train and {held} held-out samples answered {how}, max_new_tokens {data_args.max_new_tokens}"
        )

    def train(self) -> str:
        run = self.workspace / "run"
        self.first = launch(
            self.accelerate_file,
            self.rehearsal_recipe,
            [],
            self.workspace / "train.log",
            self.args.timeout_s,
            self.fsdp,
        )
        if not self.first.ok:
            raise ValueError(f"the training launch failed: {self.first.why()}")
        losses = check_functions.two_finite_steps(run, REHEARSAL_STEPS)
        log = self.first.log.read_text(errors="replace")
        layout = check_functions.run_layout(run / "checkpoint-1", log, self.fsdp, self.args.ranks, self.precision())
        return f"{layout}; {losses}; {self.first.seconds:.0f} s"

    def precision(self) -> str:
        """The precision the run asks for: the recipe's bf16/fp16, else the accelerate config's."""
        if self.training_args.bf16 or self.training_args.fp16:
            return "bf16 (the recipe)" if self.training_args.bf16 else "fp16 (the recipe)"
        mixed = str((self.accelerate or {}).get("mixed_precision", "no"))
        return f"{mixed} (accelerate's mixed_precision)" if mixed in ("bf16", "fp16") else "float32"

    def checkpoint(self) -> str:
        from trainer.training.checkpoints import checkpoint_problems, list_checkpoints

        run = self.workspace / "run"
        found = list_checkpoints(run)
        names = [path.name for path in found]
        for step in range(1, REHEARSAL_STEPS + 1):
            if f"checkpoint-{step}" not in names:
                raise ValueError(f"no checkpoint-{step} in {run} (found {names})")
        problems = [problem for path in found for problem in checkpoint_problems(path)]
        if problems:
            raise ValueError(f"damaged checkpoint: {problems[0]}")
        return f"{', '.join(names)} complete"

    def resume(self) -> str:
        resumed = self.workspace / "run-resumed"
        flags = ["--output_dir", str(resumed), "--resume_from_checkpoint", str(self.workspace / "run" / "checkpoint-1")]
        second = launch(
            self.accelerate_file,
            self.rehearsal_recipe,
            flags,
            self.workspace / "resume.log",
            self.args.timeout_s,
            self.fsdp,
        )
        if not second.ok:
            raise ValueError(f"the resumed launch failed: {second.why()}")
        return check_functions.same_run(self.workspace / "run", resumed, REHEARSAL_STEPS)

    def export(self) -> str:
        # what `dflash2 export RUN EXPORT --target TARGET` does with its defaults (bf16, every rule)
        from trainer.models.target import target_dimensions
        from trainer.publishing.export import check_export_output, export_draft, load_trained_draft, training_record

        run, folder = self.workspace / "run", self.workspace / "export"
        check_export_output(folder, False, source=run)
        draft = load_trained_draft(run, None, torch.bfloat16)
        target = target_dimensions(str(self.workspace / "target"), None, name=None)
        output = export_draft(draft, folder, target=target, source=run, record=training_record(run))
        return f"{output}: the contract's config and tensor rules pass"

    def reload(self) -> str:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(self.workspace / "export", trust_remote_code=True)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        return f"AutoModel.from_pretrained(trust_remote_code=True): {type(model).__name__}, {parameters:,} parameters"

    def flex_forward(self) -> str:
        """The exported draft's forward with flex_attention against sdpa, on the rehearsal's own rows
        (packed when the recipe packs) and the tiny target's features: training's masks for each."""
        if self.recipe.get("attn_implementation") != "flex_attention":
            raise NotChecked("the recipe does not use flex_attention")
        from modeling_dflash2 import DFlash2DraftModel
        from trainer.data.dataset import DFlashCollator, token_datasets
        from trainer.data.packing import PackedDataset
        from trainer.models.draft import flex_forward_gap
        from trainer.models.target import FrozenTarget

        model_args, data_args, training_args = self.rehearsal_arguments()
        target = FrozenTarget.load(model_args.target, dtype=torch.float32)
        train, _ = token_datasets(data_args, target)  # the answers are cached: nothing is generated again
        rows: Any = PackedDataset.pack(train, data_args.max_length, training_args.seed) if data_args.packing else train
        samples = [rows[index] for index in range(min(FLEX_ROWS, len(rows)))]
        tokenizer = target.require_tokenizer()
        batch = DFlashCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)(samples)
        draft = DFlash2DraftModel.from_pretrained(self.workspace / "export", dtype=torch.float32)
        batch["target_hidden"] = target.capture(
            batch["input_ids"],
            batch.get("attention_mask"),
            draft.dflash.target_layer_ids,
            position_ids=batch.get("position_ids"),
        )
        gap = flex_forward_gap(draft, batch, target.embedding_weight)
        what = f"{len(samples)} {'packed ' if data_args.packing else ''}rows, float32"
        if not gap <= FLEX_TOLERANCE:
            raise ValueError(
                f"flex_attention's forward differs from sdpa's by {gap:.2e} ({what}); more than {FLEX_TOLERANCE:g}"
            )
        return f"max |flex - sdpa| {gap:.1e} over the draft's outputs ({what})"

    # -- the whole rehearsal ---------------------------------------------------------------------

    def run(self) -> int:
        if self.prepare():
            self.tiny_run()
        return self.finish()

    def prepare(self) -> bool:
        """Everything before the tiny run: the real sizes' checks (config rules, memory plan) and the
        tiny models, data and recipe. False when the draft config cannot be read (its failed check)."""
        from trainer.publishing.draft_gate import load_draft_config

        self.online = hub_reachable()
        if not self.online:
            go_offline()
            say("hub: offline (HF_HUB_OFFLINE) or unreachable from here: only local files and the cache are read")
        try:
            self.draft_config = load_draft_config(self.model_args, building=False)
        except ValueError as error:
            self.checks.add("config rules", check_functions.FAILED, " ".join(str(error).split()))
            return False
        self.read_target()
        self.checks.run("config rules", self.config_rules)
        self.checks.run("memory plan", self.memory_plan)
        self.build()
        return True

    def tiny_run(self) -> None:
        """The checks on the tiny run: data, regeneration, the launched training steps, and what
        needs them."""
        checks = self.checks
        checks.run("dataset + chat template", self.data_check)
        checks.run("regeneration", self.regeneration_check, needs=("dataset + chat template",))
        self.launched_checks()

    def launched_checks(self) -> None:
        """The launched training steps and what needs them: a failed launch leaves those not checked."""
        checks = self.checks
        checks.run("two optimizer steps", self.train, needs=("dataset + chat template",))
        checks.run("checkpoint", self.checkpoint, needs=("two optimizer steps",))
        checks.run("resume", self.resume, needs=("checkpoint",))
        checks.run("export", self.export, needs=("two optimizer steps",))
        checks.run("reload", self.reload, needs=("export",))
        checks.run("flex_attention forward", self.flex_forward, needs=("export",))

    def finish(self) -> int:
        for limit in NOT_CHECKED_ON_CPU:
            say(f"not checked here: {limit.line()}")
        failed = self.checks.failed
        passed = sum(check.status == check_functions.OK for check in self.checks.done)
        say(f"rehearse: {passed} passed, {len(failed)} failed; workspace {self.workspace}")
        return 1 if failed else 0


def say(line: str) -> None:
    print(line, flush=True)


def architecture_line(config: Any) -> str:
    text = config.get_text_config()
    architectures = ",".join(getattr(config, "architectures", None) or [type(config).__name__])
    heads = f"{text.num_attention_heads}/{getattr(text, 'num_key_value_heads', text.num_attention_heads)} heads"
    return (
        f"{architectures} ({config.model_type}), {check_functions.layer_summary(config)}, {heads}, hidden "
        f"{text.hidden_size}, vocab {text.vocab_size}: its architecture is rehearsed at a tiny width"
    )


def endpoint_reachable(url: str, timeout_s: float = 5.0) -> bool:
    """Whether an OpenAI-compatible endpoint answers `GET <url>/models` within the deadline."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/models", timeout=timeout_s):
            return True
    except (OSError, urllib.error.URLError, ValueError):
        return False
