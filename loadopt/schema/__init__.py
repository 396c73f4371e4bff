"""The results files' schema as pydantic models: the documents (`results`), and the sections they share."""
