"""`python -m trainer COMMAND ...`: the same as the `dflash2` console script (`trainer.commands`)."""

from trainer.commands import main

if __name__ == "__main__":
    main()
