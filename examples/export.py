"""Export a checkpoint to a publishable folder: `dflash2 export`, as a script.

python examples/export.py CHECKPOINT OUTPUT --target TARGET [--push-to-hub REPO]

The work is `trainer.publishing.export_command.main`, the same function `dflash2 export` runs.
"""

from trainer.cli import run
from trainer.publishing.export_command import main

if __name__ == "__main__":
    run(main)
