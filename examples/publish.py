"""Publish an export folder to the Hub: `dflash2 publish`, as a script.

python examples/publish.py FOLDER REPO_ID [--private]

The work is `trainer.publishing.publish_command.main`, the same function `dflash2 publish` runs.
"""

from trainer.cli import run
from trainer.publishing.publish_command import main

if __name__ == "__main__":
    run(main)
