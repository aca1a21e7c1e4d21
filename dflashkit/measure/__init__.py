"""Measuring decoding, a layer above it: the speed benchmark (bench), the cost models and the predictions they make,
per-request records, the engine peers (llama.cpp, vLLM) run beside ours, and `--engine auto`'s probe."""
