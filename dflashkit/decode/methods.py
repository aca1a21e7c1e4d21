"""Method names: what `--method`/`--methods` accept (no torch import, so the CLI parser stays fast)."""

from __future__ import annotations

import re

AUTO_BUDGET = 32  # the most drafter nodes a cost-aware tree considers
METHODS_HELP = ("ar, ar-static and chain-static (on the static compiled decoder), chain, ddtree, ddtree-N (budget N), ddtree-auto, "
                "ngram, hybrid, hybrid-N, hybrid-auto (each of these trees also on the static decoder: NAME-static), "
                "prompt-lookup, prompt-lookup-N (N lookup tokens), hf-generate, or the engine peers (bench only) llama.cpp, "
                "llama.cpp-dflash, vllm, vllm-dflash")
ENGINE_METHODS = ("llama.cpp", "llama.cpp-dflash", "vllm", "vllm-dflash")
STATIC_AR, STATIC_CHAIN = "ar-static", "chain-static"


STATIC_SUFFIX = "-static"
TREE_KINDS = ("ddtree", "ngram", "hybrid")


def static_tree(name: str) -> str | None:
    """'hybrid-auto-static' -> 'hybrid-auto' (a tree method on the static decoder's steps); None for any other."""
    base = name.strip().removesuffix(STATIC_SUFFIX)
    try:
        return base if base != name.strip() and parse_method(base)[0] in TREE_KINDS else None
    except ValueError:
        return None


def is_static(name: str) -> bool:
    """Runs on the static decoder's compiled steps: ar-static, chain-static, NAME-static trees."""
    return name.strip() in (STATIC_AR, STATIC_CHAIN) or static_tree(name) is not None


def parse_method(name: str) -> tuple[str, int | str | None]:
    """A method name -> (kind, N, 'auto' or None); see METHODS_HELP. A static tree parses as its tree."""
    if name.strip() in ENGINE_METHODS + (STATIC_AR, STATIC_CHAIN):
        return name.strip(), None
    if (tree := static_tree(name)) is not None:
        return parse_method(tree)
    m = re.fullmatch(r"(ar|chain|ddtree|ngram|hybrid|prompt-lookup|hf-generate)(?:-([0-9]+|auto))?", name.strip())
    sized = {"ddtree": r"[0-9]+|auto", "hybrid": r"[0-9]+|auto", "prompt-lookup": r"[0-9]+"}
    if m is None or m.group(2) == "0" or (m.group(2) is not None and
                                          not re.fullmatch(sized.get(m.group(1), "(?!)"), m.group(2))):
        raise ValueError(f"unknown method {name!r}; use {METHODS_HELP}")
    n = m.group(2)
    return m.group(1), None if n is None else (n if n == "auto" else int(n))


def needs_drafter(method: str) -> bool:
    """chain, ddtree, hybrid and the -dflash engine peers run the drafter; ar, ngram and the other loops do not."""
    return parse_method(method)[0] in ("chain", "ddtree", "hybrid", "llama.cpp-dflash", "vllm-dflash", STATIC_CHAIN)


DEFAULT_METHODS = "ar,chain,ddtree-8,ddtree-auto,ngram,hybrid-8,hybrid-auto,prompt-lookup,hf-generate"
