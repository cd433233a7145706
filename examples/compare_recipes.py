"""The equal-budget recipe comparison (`make compare`): `dflash2 compare`, as a script.

python examples/compare_recipes.py --recipes dflash2-ce dflash2-kd --seeds 0

The work is `trainer.evaluation.compare.main`, the same function `dflash2 compare` runs.
"""

from trainer.cli import run
from trainer.evaluation.compare import main

if __name__ == "__main__":
    run(main)
