"""`torch_compile: true` on a training step: eager vs the draft's layers compiled in place.

Same weights and batches for both; the packed context length varies from batch to batch as in a
real run, so the graphs compiled after the first step show how often a new length recompiles
(once per layer, to a dynamic length, then never). Reports the first (compiling) step, the steady-state s/step of both,
the speed-up and the largest loss difference.

python -m benchmarks.compile_step [--setup smollm2|large|tiny] [--device cpu] [--repeats 3] prints them as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch
from torch._dynamo.utils import counters

from benchmarks import setups
from benchmarks.train_step import optimized_step, synchronize
from trainer.commands.runner import command_parser, run
from trainer.models.compile import compile_decoder_layers
from trainer.objective.config import ObjectiveConfig

LENGTH_OFFSETS = (0, -8, 8, -16, 0, 4)  # packed lengths around the setup's, as batches vary


def bench_compile(setup: setups.StepSetup | None = None, device: str = "cpu", repeats: int = 3) -> dict:
    setup = setup or setups.smollm2_setup()
    config = ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)
    eager = setups.make_draft(setup, device).train()
    compiled = setups.make_draft(setup, device).train()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_decoder_layers(compiled)
    batches = [
        setups.synthetic_batch(dataclasses.replace(setup, length=setup.length + offset), device, seed=index)
        for index, offset in enumerate(LENGTH_OFFSETS)
    ]
    start = time.perf_counter()
    optimized_step(compiled, batches[0], config)
    synchronize(device)
    first_step = time.perf_counter() - start
    first_graphs = int(counters["stats"]["unique_graphs"])
    loss_difference = 0.0
    for batch in batches:  # every length once: compilation happens here, not in the timing below
        loss_difference = max(
            loss_difference,
            abs(float(optimized_step(compiled, batch, config)) - float(optimized_step(eager, batch, config))),
        )
    graphs = int(counters["stats"]["unique_graphs"])
    eager_times, compiled_times = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        for model, times in ((eager, eager_times), (compiled, compiled_times)):
            for batch in batches[:2]:
                start = time.perf_counter()
                optimized_step(model, batch, config)
                synchronize(device)
                times.append(time.perf_counter() - start)
    eager_seconds, compiled_seconds = statistics.median(eager_times), statistics.median(compiled_times)
    return {
        "setup": setup.describe(),
        "device": device,
        "lengths": [batch.input_ids.shape[1] for batch in batches],
        "first_compiled_step_seconds": first_step,
        "eager_seconds_per_step": eager_seconds,
        "compiled_seconds_per_step": compiled_seconds,
        "speedup": eager_seconds / compiled_seconds,
        "compiled_graphs": graphs,
        "recompilations": graphs - first_graphs,
        "max_loss_difference": loss_difference,
    }


SETUPS = {"smollm2": setups.smollm2_setup, "large": setups.large_setup, "tiny": setups.tiny_setup}


def main(argv: list[str] | None = None) -> dict:
    parser = command_parser("python -m benchmarks.compile_step", __doc__)
    parser.add_argument("--setup", choices=tuple(SETUPS), default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of two steps per model")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    result = bench_compile(SETUPS[args.setup](), args.device, args.repeats)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run(main)
