"""Measuring decoding, a layer above it: bench, the cost models and their predictions, per-request records, the
engine peers, and `--engine auto`'s probe."""
