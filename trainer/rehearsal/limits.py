"""What a CPU rehearsal cannot show, in one place: `dflash2 rehearse` prints it after its checks and
`make gpu-check`'s dry run lists it as what the GPU run must cover (`benchmarks/gpu_check.py`).

Each entry names what is not checked on CPU, why, and where a GPU checks it. The recipe keys whose
effect only a GPU shows are matched here too (`gpu_only_keys`): a rehearsal lists them, never hides
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limit:
    """One thing only a GPU shows: what, why not here, and which GPU check covers it."""

    name: str
    why: str
    on_gpu: str

    def line(self) -> str:
        return f"{self.name}: {self.why} (on a GPU: {self.on_gpu})"


CUDA_TESTS = "make gpu-check, tests/integration/test_cuda.py"
NOT_CHECKED_ON_CPU: tuple[Limit, ...] = (
    Limit(
        "NCCL collectives",
        "CPU ranks talk over gloo; NCCL's all-gather / reduce-scatter of FSDP2 and the sharded target, its "
        "timeouts and its memory never run here",
        f"{CUDA_TESTS} (FSDP2 save/load round trip)",
    ),
    Limit(
        "flex_attention backward",
        "torch has no CPU backward for flex_attention, so training with it runs only on a GPU (its forward is "
        "checked here against sdpa)",
        f"{CUDA_TESTS} (flex_attention == dense masks, training step)",
    ),
    Limit(
        "CUDA kernels",
        "bf16 autocast kernels, the compiled flex kernels and torch.compile's GPU code generation are CUDA code",
        f"{CUDA_TESTS} (bf16 autocast step), make gpu-check's benchmark phases",
    ),
    Limit(
        "real speed",
        "steps per second, tokens per second and MFU depend on the GPU",
        "make gpu-check's benchmark phases (s/step, tok/s, MFU)",
    ),
    Limit(
        "real memory",
        "the rehearsal runs tiny widths; the memory of the real sizes is planned (the memory plan check), not measured",
        "make gpu-check's benchmark phases (allocator peak against the planner)",
    ),
)


@dataclass(frozen=True)
class GpuOnlyKey:
    """A recipe key whose value only a GPU run exercises, and what the rehearsal does instead."""

    key: str
    value: Any
    why: str


def _words(value: Any) -> str:
    return str(getattr(value, "value", value)).lower()


def gpu_only_keys(recipe: dict[str, Any]) -> list[GpuOnlyKey]:
    """The recipe's keys (as read from its YAML) whose value only fails or matters on a GPU."""
    found = []
    if recipe.get("attn_implementation") == "flex_attention":
        found.append(
            GpuOnlyKey(
                "attn_implementation",
                "flex_attention",
                "training with flex_attention needs its backward, which torch has only on CUDA: the rehearsal "
                "trains with sdpa and checks flex's forward against sdpa",
            )
        )
    if recipe.get("tf32"):
        found.append(GpuOnlyKey("tf32", recipe["tf32"], "TF32 matmuls exist only on Ampere or newer GPUs"))
    if recipe.get("fp16"):
        found.append(GpuOnlyKey("fp16", recipe["fp16"], "fp16 mixed precision with its loss scaler needs a CUDA GPU"))
    optim = _words(recipe.get("optim", ""))
    if any(word in optim for word in ("bnb", "8bit", "apex")):
        found.append(GpuOnlyKey("optim", recipe["optim"], "this optimizer's kernels are CUDA code"))
    return found
