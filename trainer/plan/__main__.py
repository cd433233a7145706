"""`python -m trainer.plan RECIPE ...`: the memory planner (the same as `dflash2 plan`)."""

from trainer.cli import run
from trainer.plan.cli import main

if __name__ == "__main__":
    run(main)
