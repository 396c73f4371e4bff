"""The dataset kinds a config can name (ImageFolder, WebDataset, Parquet, records, tokens, synthetic), one per
module."""
