"""`python -m loadopt` (and `torchrun -m loadopt bench CONFIG`): the `loadopt` command."""

from loadopt.cli import main

if __name__ == "__main__":
    main()
