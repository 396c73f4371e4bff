"""Inference input paths: MLPerf Inference LoadGen's scenarios (offline, server, single_stream) over loadopt's
preprocessors, with a dynamic batcher in front of the accelerator (docs/serving.md)."""
