"""The family matrix (issue 37): for each tiny fixture family, does each stage work, or how is it refused?

Every stage is checked against transformers itself in float32: features against a plain forward's hidden states,
online decoding against greedy decoding written out. A stage either passes, is refused with a DFlashError (the
reason is recorded), or fails (an AssertionError or crash: a bug). `family_matrix` returns one row per family, from
which a README table can be written; it writes nothing but the fixtures under `root`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from dflashkit.errors import DFlashError
from dflashkit.rng import seeded


class NotComparable(Exception):
    """A stage whose yardstick cannot judge this family (the reference loop is itself inexact there)."""

STAGES = ("load", "layer_ids", "features", "extract", "train", "eval", "ar", "chain", "ddtree", "ngram", "hybrid",
          "hybrid-auto", "export", "zlab-loop")
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


ONLINE = {"ar": "ar", "chain": "chain", "ddtree": "ddtree-4", "ngram": "ngram", "hybrid": "hybrid-4",
          "hybrid-auto": "hybrid-auto"}


@torch.no_grad()
def check_family(kind: str, root: str | Path) -> dict[str, str]:
    """{stage: "pass" | "refused: <reason>" | "skipped: <stage> did not pass"} for one fixture family."""
    from tiny_targets import make_tiny_target
    from dflashkit.targets.model import load_target

    row, state = {}, {}

    def load():
        state["target"] = load_target(make_tiny_target(kind, Path(root) / kind), device="cpu", dtype="float32")

    stages = {"load": load, "layer_ids": lambda: _layer_ids(state), "features": lambda: _features_match(
        state["target"], state["prompt"]), **{s: functools.partial(_online, state, m) for s, m in ONLINE.items()},
        "export": lambda: _export(state, Path(root) / f"{kind}-export"),
        "zlab-loop": lambda: _zlab_loop(state, Path(root) / f"{kind}-zlab"),
        "extract": lambda: _extract(state, Path(root) / f"{kind}-cache"),
        "train": lambda: _train_step(state, Path(root) / f"{kind}-train"), "eval": lambda: _offline(state)}
    for stage in STAGES:
        need = {"load": None, "layer_ids": "load", "train": "extract", "eval": "train",
                "zlab-loop": "chain"}.get(stage, "layer_ids")
        if need and row[need] != "pass":
            row[stage] = f"skipped: {need} did not pass"
            continue
        try:
            stages[stage]()
            row[stage] = "pass"
        except DFlashError as e:
            row[stage] = f"refused: {e}"
        except NotComparable as e:
            row[stage] = f"n/a: {e}"
    return row


def _layer_ids(state: dict) -> None:
    """The default layer ids, a prompt, its greedy reference, and a random drafter on those layers."""
    from dflashkit.drafter.checkpoint import new_drafter

    t = state["target"]
    state["ids"] = t.check_layer_ids(t.default_layer_ids(1))
    state["prompt"] = t.chat_ids([{"role": "user", "content": PROMPT}])
    state["ref"] = greedy_reference(t, state["prompt"], NEW_TOKENS)
    with seeded(0):
        state["drafter"] = new_drafter(t, num_layers=1, block_size=4, target_layer_ids=state["ids"]).eval()


def _extract(state: dict, folder: Path) -> None:
    """A one-prompt cache: its stored features are a clean forward's over prompt + answer."""
    from dflashkit.cache import extract, open_cache
    from dflashkit.prompts import load_prompts

    t = state["target"]
    path = extract(t, load_prompts("coding-10").subset(1), folder, layer_ids=state["ids"], max_new_tokens=8,
                   progress=False)
    rec = next(iter(open_cache(path)))
    clean = t.features([rec.tokens.tolist()], state["ids"])[0]
    assert torch.allclose(rec.features(state["ids"]).float(), clean.float(), atol=1e-4), "cached features"
    state["cache"] = path


def _train_step(state: dict, out: Path) -> None:
    """Two training steps on that cache; the checkpoint loads back against the target."""
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.train import train
    from dflashkit.train.config import load_config

    cfg = load_config(None, dict(data=str(state["cache"]), out=str(out), steps=2, num_layers=1, block_size=4,
                                 target_layer_ids=state["ids"], batch_size=1, anchors_per_seq=4, progress=False,
                                 dtype="float32", device="cpu", draft_vocab="none", save_every=1000))
    with torch.enable_grad():  # check_family runs under no_grad
        summary = train(cfg, target=state["target"])
    state["trained"] = load_drafter(summary["checkpoint"], target=state["target"])


def _offline(state: dict) -> None:
    from dflashkit.cache import open_cache
    from dflashkit.evaluate.offline import evaluate

    o = evaluate(state["trained"], state["target"], open_cache(state["cache"]), trees=("budget:4",))["overall"]
    assert o["prompts"] == 1 and 1.0 <= o["tau"] <= 4.0, o


def _online(state: dict, method: str) -> None:
    from dflashkit.decode.speculative import DFlashProposer, generate, new_lookup

    t = state["target"]
    proposer = None if method in ("ar", "ngram") else DFlashProposer(t, state["drafter"])
    from dflashkit.measure.curve import CostCurve

    ngram = new_lookup(method) if method.startswith(("ngram", "hybrid")) else None
    cost = CostCurve([1, 2, 4, 8, 16, 32], [0.010, 0.011, 0.012, 0.015, 0.020, 0.030])  # a CPU-like verify curve
    got = generate(t, state["prompt"], method, proposer, max_new_tokens=NEW_TOKENS, ngram=ngram, cost=cost).tokens
    assert got == state["ref"], f"{method} {got} != greedy {state['ref']}"


def _export(state: dict, folder: Path) -> None:
    """The z-lab export loads back against the target and drafts what the drafter drafts."""
    from dflashkit.decode.speculative import DFlashProposer, generate
    from dflashkit.drafter.checkpoint import load_drafter, save_drafter

    t = state["target"]
    save_drafter(state["drafter"], folder, format="zlab")
    back = load_drafter(folder, target=t)
    a = generate(t, state["prompt"], "chain", DFlashProposer(t, state["drafter"]), max_new_tokens=NEW_TOKENS)
    b = generate(t, state["prompt"], "chain", DFlashProposer(t, back), max_new_tokens=NEW_TOKENS)
    assert a.tokens == b.tokens and a.accepted == b.accepted, "the exported drafter drafts differently"


GDN_INEXACT = ("z-lab's loop crops the cache after a rejected draft, which rolls back attention and convolution states "
               "but not a Gated DeltaNet layer's recurrent state, so its output departs from greedy decoding; "
               "our loops are checked against greedy decoding instead")


def _zlab_loop(state: dict, folder: Path) -> None:
    """z-lab's `dflash_generate` (dflash==0.1.0) and our chain, each loading the drafter a z-lab class wrote, agree on
    the tokens, every round's drafts and the acceptance per round (the rounds with a full block)."""
    try:
        import dflash.model as ref
    except ImportError:
        raise NotComparable("dflash==0.1.0 is not installed (`make test` installs it)") from None
    t = state["target"]
    if t.is_hybrid:
        raise NotComparable(GDN_INEXACT)
    import time

    from transformers import Qwen3Config

    from dflashkit.decode.speculative import DFlashProposer, generate
    from dflashkit.drafter.checkpoint import load_drafter

    cfg = Qwen3Config(hidden_size=t.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=2 * t.hidden_size, num_hidden_layers=1, vocab_size=t.vocab_size,
                      max_position_embeddings=512, num_target_layers=t.num_layers, block_size=4,
                      dflash_config={"mask_token_id": t.vocab_size - 1, "target_layer_ids": state["ids"]})
    with seeded(1):
        model = ref.DFlashDraftModel(cfg).float().eval()
        for p in model.parameters():  # norms near 1, projections small: drafts that depend on every input
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if p.dim() == 1 else torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    theirs = ref.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    drafts_theirs, real_logits = [], theirs.compute_logits
    theirs.compute_logits = lambda *a: drafts_theirs.append(real_logits(*a)) or drafts_theirs[-1]
    timer, ref._cuda_time = ref._cuda_time, time.perf_counter  # the reference times with CUDA syncs only
    try:
        want = ref.dflash_generate(theirs, t.model, torch.tensor([state["prompt"]]), 2 * NEW_TOKENS, None,
                                   return_stats=True)
    finally:
        ref._cuda_time = timer
    proposer = DFlashProposer(t, load_drafter(folder, target=t))
    drafts_ours, real_draft = [], proposer.draft
    proposer.draft = lambda *a: drafts_ours.append(real_draft(*a)) or drafts_ours[-1]
    got = generate(t, state["prompt"], "chain", proposer, max_new_tokens=2 * NEW_TOKENS, stop_ids=[])
    assert got.tokens == want.output_ids[0, len(state["prompt"]):].tolist(), "tokens differ from z-lab's loop"
    full = [i for i, d in enumerate(drafts_theirs) if d.shape[1] == 3]
    assert len(full) > NEW_TOKENS // 2, "too few full rounds to compare"
    for i in full:
        assert drafts_ours[i][0].tolist() == drafts_theirs[i][0].argmax(-1).tolist(), f"round {i}: drafts differ"
    assert got.accepted[:len(full)] == want.acceptance_lengths[:len(full)], "acceptance differs"


def family_matrix(root: str | Path, kinds=None) -> list[dict]:
    """One row per family: {"family": kind, stage: outcome, ...}, the fixtures built under `root`."""
    from tiny_targets import ALL_KINDS

    return [{"family": k, **check_family(k, root)} for k in (kinds or ALL_KINDS)]


EXAMPLES = {  # checkpoints of each family that z-lab publishes DFlash drafters for (the fixture is its tiny twin)
    "llama": "Llama-3.1-8B-Instruct", "qwen3": "Qwen3-8B, Qwen3-4B", "qwen3_5": "Qwen3.5 text models",
    "qwen3_moe": "Qwen3-Coder-30B-A3B", "qwen3_5_vl": "Qwen3.5/3.6-27B (Qwen3_5ForConditionalGeneration)",
    "qwen3_5_moe": "Qwen3.5/3.6-35B-A3B", "qwen3_next": "Qwen3-Coder-Next", "gpt_oss": "gpt-oss-20b, gpt-oss-120b",
    "gemma4": "Gemma 4 26B-A4B, 31B (MoE block, shared K=V)",
    "gemma4_e": "Gemma 4 E2B, E4B (per-layer inputs, shared KV)", "deepseek_v3": "Kimi K2.x (DeepSeek-V3: MLA + MoE)",
    "glm4_moe": "GLM-4.5/4.6",
    "minimax_m2": "MiniMax-M2",
}
MARKERS = {  # (begin, end) -> the table written between them
    ("<!-- family matrix: python tests/families.py --write docs/targets.md -->", "<!-- end of matrix -->"):
        "matrix",
    ("<!-- targets: python tests/families.py --write README.md -->", "<!-- end of targets -->"): "summary",
}


def _cell(v: str) -> str:
    return v if v == "pass" else v.split(":")[0]


def matrix_markdown(rows: list[dict]) -> str:
    """The table: pass, or the refusal's first clause, with each family's example checkpoints."""
    lines = ["| family | examples | " + " | ".join(STAGES) + " |", "|---" * (len(STAGES) + 2) + "|"]
    lines += ["| " + r["family"] + " | " + EXAMPLES.get(r["family"], "") + " | " + " | ".join(_cell(r[s]) for s in STAGES)
              + " |" for r in rows]
    return "\n".join(lines)


def summary_markdown(rows: list[dict]) -> str:
    """The README's short form: how many stages pass, and which do not."""
    lines = ["| family | examples | stages passed | not passed |", "|---|---|---|---|"]
    for r in rows:
        other = [f"{s} ({_cell(r[s])})" for s in STAGES if r[s] != "pass"]
        lines.append(f"| {r['family']} | {EXAMPLES.get(r['family'], '')} | {len(STAGES) - len(other)} of {len(STAGES)} "
                     f"| {', '.join(other) or '-'} |")
    return "\n".join(lines)


def with_matrix(doc: str, rows: list[dict]) -> str:
    """`doc` with the text between each pair of markers it holds replaced by that table of `rows`."""
    tables = {"matrix": matrix_markdown, "summary": summary_markdown}
    found = False
    for (begin, end), kind in MARKERS.items():
        if begin in doc:
            head, rest = doc.split(begin, 1)
            doc, found = head + begin + "\n" + tables[kind](rows) + "\n" + end + rest.split(end, 1)[1], True
    if not found:
        raise ValueError("no table markers in the document: add one of " + ", ".join(b for b, _ in MARKERS))
    return doc


if __name__ == "__main__":  # python tests/families.py --write docs/targets.md
    import sys
    import tempfile

    from dflashkit.fileio import write_text

    if sys.argv[1:2] != ["--write"] or len(sys.argv) < 3:
        sys.exit("usage: python tests/families.py --write docs/targets.md README.md")
    with tempfile.TemporaryDirectory() as tmp:
        rows = family_matrix(tmp)
    for doc in map(Path, sys.argv[2:]):
        write_text(doc, with_matrix(doc.read_text(), rows))
        print(f"wrote {doc}")
