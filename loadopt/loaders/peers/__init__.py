"""The peer backends: other libraries' input paths (WebDataset, MosaicML Streaming, LitData, FFCV) in their own
loops."""
