"""The results files' schema as pydantic models: the documents, and the sections they share. The documents'
names are importable from here too (`from loadopt.schema import Recipe`, as plugins do)."""

from loadopt.schema.documents import (
    SCHEMA_VERSION,
    ConfigDump,
    Decision,
    Knobs,
    Recipe,
    ResultsFile,
    Run,
    RunStatus,
    SchemaError,
    decision_text,
    parse_decision,
    parse_results,
    read_results,
    read_results_file,
    results_text,
)

__all__ = ["SCHEMA_VERSION", "ConfigDump", "Decision", "Knobs", "Recipe", "ResultsFile", "Run", "RunStatus",
           "SchemaError", "decision_text", "parse_decision", "parse_results", "read_results", "read_results_file",
           "results_text"]
