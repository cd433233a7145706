"""`python -m trainer COMMAND ...`: the same as the `dflash2` console script (`trainer.commands`), and
what a launcher starts on every rank: `accelerate launch -m trainer train RECIPE`."""

from trainer.commands import main

if __name__ == "__main__":
    main()
