"""Method names: what `--method`/`--methods` accept (no torch import, so the CLI parser stays fast)."""

from __future__ import annotations

import re

AUTO_BUDGET = 32  # the most drafter nodes a cost-aware tree considers
METHODS_HELP = ("ar, chain, ddtree, ddtree-N (budget N), ddtree-auto, ngram, hybrid, hybrid-N, hybrid-auto (each on "
                "either backend: --engine), prompt-lookup, prompt-lookup-N (N lookup tokens), hf-generate, "
                "transformers-dflash (transformers' own DFlash loop with the drafter), or the engine peers (bench "
                "only) llama.cpp, llama.cpp-dflash, vllm, vllm-dflash")
# The one list of each: the backends our loops run on, the peers (other programs) bench runs beside them
BACKENDS = ("hf", "static", "hf-stock")
PEERS = ("llama.cpp", "vllm")
PEER_METHODS = tuple(m for p in PEERS for m in (p, f"{p}-dflash"))
ENGINES = ("auto",) + BACKENDS  # what --engine takes for our methods (auto: the faster of hf and static here)
PRICED = ("hf", "static") + PEERS  # what has a cost model (`dflashkit cost`, `eval --engine`, `data generate`)
ENGINE_HELP = ("the backend our methods run on: hf (transformers' forward, every family), static (our compiled step, "
               "Llama-type targets), auto (the faster on this machine, measured once and cached; hf where static "
               "refuses the target), or hf-stock (hf on torch's own kernels: the speed baseline where bf16 decoding "
               "switches to row-invariant ones; not lossless there)")
TREE_KINDS = ("ddtree", "ngram", "hybrid")
STATIC_KINDS = ("ar", "chain") + TREE_KINDS  # what the static backend runs (transformers' loops run on hf)


def parse_method(name: str) -> tuple[str, int | str | None]:
    """A method name -> (kind, N, 'auto' or None); see METHODS_HELP."""
    if name.strip() in PEER_METHODS:
        return name.strip(), None
    m = re.fullmatch(r"(ar|chain|ddtree|ngram|hybrid|prompt-lookup|hf-generate|transformers-dflash)(?:-([0-9]+|auto))?",
                     name.strip())
    sized = {"ddtree": r"[0-9]+|auto", "hybrid": r"[0-9]+|auto", "prompt-lookup": r"[0-9]+"}
    engine = next((e for e in ENGINES if name.strip().endswith(f"-{e}")), None)
    if m is None and engine is not None:  # the old spelling of a method on a backend
        base = name.strip()[: -len(engine) - 1]
        raise ValueError(f"method {name!r}: the backend is its own option now; use --method {base} --engine {engine}")
    if m is None or m.group(2) == "0" or (m.group(2) is not None and
                                          not re.fullmatch(sized.get(m.group(1), "(?!)"), m.group(2))):
        raise ValueError(f"unknown method {name!r}; use {METHODS_HELP}")
    n = m.group(2)
    return m.group(1), None if n is None else (n if n == "auto" else int(n))


def needs_drafter(method: str) -> bool:
    return parse_method(method)[0] in ("chain", "ddtree", "hybrid", "llama.cpp-dflash", "vllm-dflash",
                                       "transformers-dflash")


DEFAULT_METHODS = "ar,chain,ddtree-8,ddtree-auto,ngram,hybrid-8,hybrid-auto,prompt-lookup,hf-generate"
