"""Other engines as bench peers and oracles: llama.cpp and vLLM, where users serve drafters.

Each is installed once, by `dflashkit engines install NAME`, into a cache folder outside our venv (their pins,
transformers<5.20 for vLLM, never touch ours) and driven as a subprocess: llama.cpp's `llama-server` over HTTP on
loopback, vLLM through a small worker script run by the engine's own Python. Both take prompt token ids and
return token ids, so their outputs compare with ours token for token.
"""
