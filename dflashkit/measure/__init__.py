"""Measuring decoding, a layer above it: bench, cost models and predictions, records, engine peers, auto's probe."""
