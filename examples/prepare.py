"""Build a recipe's datasets ahead of training: `dflash2 prepare`, as a script.

python examples/prepare.py my-recipe.yaml [--regenerate-only]

The work is `trainer.data.prepare.main`, the same function `dflash2 prepare` runs.
"""

from trainer.cli import run
from trainer.data.prepare import main

if __name__ == "__main__":
    run(main)
