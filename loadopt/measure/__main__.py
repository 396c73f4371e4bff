"""`python -m loadopt.measure [--out DIR] [--every N] train.py ARGS`: `loadopt measure train.py ARGS`."""

from loadopt.measure.script import main

if __name__ == "__main__":
    raise SystemExit(main())
