"""The family matrix (issue 37): for each tiny fixture family, does each stage work, or how is it refused?

Every stage is checked against transformers itself in float32: features against a plain forward's hidden states,
online decoding against greedy decoding written out. A stage either passes, is refused with a DFlashError (the
reason is recorded), or fails (an AssertionError or crash: a bug). `family_matrix` returns one row per family, from
which a README table can be written; it writes nothing but the fixtures under `root`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflashkit.errors import DFlashError
from dflashkit.rng import seeded

STAGES = ("load", "layer_ids", "features", "ar", "chain")
PROMPT = "the quick brown fox jumps over"
NEW_TOKENS = 12


def greedy_reference(target, ids: list[int], n: int) -> list[int]:
    """Greedy decoding written out: the whole sequence again each step, no cache, stop tokens included."""
    seq, out = list(ids), []
    for _ in range(n):
        t = int(target.model(torch.tensor([seq], device=target.device)).logits[0, -1].argmax())
        out.append(t)
        seq.append(t)
        if t in target.stop_token_ids:
            break
    return out


def _features_match(target, ids: list[int]) -> None:
    """Layer l's feature is HF hidden_states[l + 1]; the last layer's, through the final norm, is the last one."""
    L = target.num_layers
    feats = target.features([ids], list(range(L)))[0].split(target.hidden_size, dim=-1)
    hs = target.model(torch.tensor([ids], device=target.device), output_hidden_states=True).hidden_states
    for l in range(L - 1):
        assert torch.allclose(feats[l], hs[l + 1][0], atol=1e-5), f"layer {l}: feature != hidden_states[{l + 1}]"
    assert torch.allclose(target.final_norm(feats[-1]), hs[L][0], atol=1e-5), "final norm of the last layer"


@torch.no_grad()
def check_family(kind: str, root: str | Path) -> dict[str, str]:
    """{stage: "pass" | "refused: <reason>" | "skipped: <stage> did not pass"} for one fixture family."""
    from dflashkit.decode.speculative import DFlashProposer, generate
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.target.fixtures import make_tiny_target
    from dflashkit.target.model import load_target

    row, state = {}, {}

    def load():
        state["target"] = load_target(make_tiny_target(kind, Path(root) / kind), device="cpu", dtype="float32")

    def layer_ids():
        t = state["target"]
        state["ids"] = t.check_layer_ids(t.default_layer_ids(1))
        state["prompt"] = t.chat_ids([{"role": "user", "content": PROMPT}])
        state["ref"] = greedy_reference(t, state["prompt"], NEW_TOKENS)

    def features():
        _features_match(state["target"], state["prompt"])

    def ar():
        got = generate(state["target"], state["prompt"], "ar", max_new_tokens=NEW_TOKENS).tokens
        assert got == state["ref"], f"ar {got} != greedy {state['ref']}"

    def chain():
        t = state["target"]
        with seeded(0):
            drafter = new_drafter(t, num_layers=1, block_size=4, target_layer_ids=state["ids"]).eval()
        got = generate(t, state["prompt"], "chain", DFlashProposer(t, drafter), max_new_tokens=NEW_TOKENS).tokens
        assert got == state["ref"], f"chain {got} != greedy {state['ref']}"

    needs = {"layer_ids": "load", "features": "layer_ids", "ar": "layer_ids", "chain": "layer_ids"}
    for stage, fn in zip(STAGES, (load, layer_ids, features, ar, chain)):
        if stage in needs and row[needs[stage]] != "pass":
            row[stage] = f"skipped: {needs[stage]} did not pass"
            continue
        try:
            fn()
            row[stage] = "pass"
        except DFlashError as e:
            row[stage] = f"refused: {e}"
    return row


def family_matrix(root: str | Path, kinds=None) -> list[dict]:
    """One row per family: {"family": kind, stage: outcome, ...}, the fixtures built under `root`."""
    from dflashkit.target.fixtures import ALL_KINDS

    return [{"family": k, **check_family(k, root)} for k in (kinds or ALL_KINDS)]


def matrix_markdown(rows: list[dict]) -> str:
    """The README table: pass, or the refusal's first clause."""
    def cell(v: str) -> str:
        return v if v == "pass" else v.split(":")[0]
    lines = ["| family | " + " | ".join(STAGES) + " |", "|---" * (len(STAGES) + 1) + "|"]
    lines += ["| " + r["family"] + " | " + " | ".join(cell(r[s]) for s in STAGES) + " |" for r in rows]
    return "\n".join(lines)
