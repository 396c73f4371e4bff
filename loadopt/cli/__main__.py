"""`python -m loadopt.cli`: the `loadopt` command (as `python -m loadopt`)."""

from loadopt.cli import main

if __name__ == "__main__":
    main()
