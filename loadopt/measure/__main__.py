"""`python -m loadopt.measure [--out DIR] [--every N] train.py ARGS`: `loadopt measure train.py ARGS`."""

import sys


def main(argv: list[str] | None = None) -> int:
    """`python -m loadopt.measure ARGS`: `loadopt measure ARGS`; returns the exit status."""
    from loadopt.cli import app

    args = sys.argv[1:] if argv is None else argv
    try:
        app(["measure", *args], prog_name="python -m loadopt")
    except SystemExit as exc:  # the command ends with the script's exit status, a usage error with 2
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
