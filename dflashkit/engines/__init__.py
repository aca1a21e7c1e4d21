"""Other engines as bench peers and oracles: llama.cpp and vLLM, each installed outside our venv (their pins never
touch ours) and driven as a subprocess on token ids, so their outputs compare with ours token for token."""
