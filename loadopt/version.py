"""The package's version, one place: `loadopt.__version__` and the results files' library versions read it."""

__version__ = "0.1.0"
