"""Train a DFlash2 draft: `dflash2 train`, as a script for launchers.

python examples/train.py                        # the embedded default recipe (what `make demo` trains)
python examples/train.py my-recipe.yaml --max_steps 2000
accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/train.py my-recipe.yaml

A launcher starts a script file on every rank, so this file stays; the work is
`trainer.training.run.main`, the same function `dflash2 train` runs.
"""

from trainer.cli import run
from trainer.training.run import main

if __name__ == "__main__":
    run(main)
