"""Sampling options (issue 36): every option a command parses reaches decoding and its results, and the
rejection rule is exact at every draft position and at the bonus, for chain and DFlash2 selector drafts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from dflashkit.decode.sampling import Sampling
from dflashkit.errors import DFlashError
from helpers import chi_square

pytestmark = pytest.mark.usefixtures("one_thread")

# a value off the default for every Sampling field, and the flag that sets it
OFF_DEFAULT = {"temperature": 0.7, "acceptance": "rejection", "draft_temperature": 0.3, "draft_mix": 0.25, "seed": 11}


@pytest.fixture(scope="module")
def drafter_dir(tiny_dirs, tiny_targets, tmp_path_factory):
    from dflashkit.drafter.checkpoint import new_drafter, save_drafter

    target = tiny_targets["llama"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sampling") / "d"
    save_drafter(new_drafter(target, num_layers=1, block_size=4).eval(), path, target_identity=target.identity())
    return path


def test_sampling_checks_its_fields():
    assert Sampling().record() == {"temperature": 0.0, "acceptance": None, "draft_temperature": None,
                                   "draft_mix": None, "seed": 0}
    s = Sampling(0.7, "rejection", None, 0.5)
    assert s.q_temperature == 0.7 and s.record()["draft_temperature"] == 0.7 and "draft mix 0.5" in s.describe()
    assert Sampling(0.7, "match", 0.2, 0.5).q_temperature == 0.0  # match drafts greedily whatever q's settings
    for bad, flag in (({"temperature": -1}, "--temperature"), ({"acceptance": "maybe"}, "--acceptance"),
                      ({"draft_temperature": -0.1}, "--draft-temperature"), ({"draft_mix": 1.5}, "--draft-mix"),
                      ({"temperature": float("nan")}, "--temperature")):
        with pytest.raises(DFlashError, match=flag):
            Sampling(**bad)
    with pytest.raises(Exception):
        Sampling().temperature = 1.0  # frozen: one value from the CLI to the loop


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_every_parsed_sampling_option_reaches_the_chain(command, tiny_dirs, drafter_dir, tmp_path, monkeypatch):
    """Each Sampling field, set off its default by its flag, arrives unchanged where the chain draws its drafts.
    bench once validated --draft-mix and --draft-temperature and then dropped them."""
    import dflashkit.decode.speculative as spec
    from dflashkit.cli import main

    assert set(OFF_DEFAULT) == {f.name for f in fields(Sampling)}, "a new Sampling field needs a value here"
    assert all(getattr(Sampling(), k) != v for k, v in OFF_DEFAULT.items())
    seen = []

    class Reached(Exception):
        pass

    def capture(proposer, features, anchor, start, sampling, generator):
        seen.append(sampling)
        raise Reached

    monkeypatch.setattr(spec, "draft_block", capture)
    flags = [x for k, v in OFF_DEFAULT.items() for x in ("--" + k.replace("_", "-"), str(v))]
    args = [command, "--target", str(tiny_dirs["llama"]), "--drafter", str(drafter_dir), "--max-new-tokens", "4",
            "--num-prompts", "1", *flags]
    args += ["--method", "chain", "--prompt", "hi"] if command == "generate" else ["--methods", "chain",
                                                                                   "--out", str(tmp_path)]
    with pytest.raises(Reached):
        main(args)
    assert seen and seen[0] == Sampling(**OFF_DEFAULT), seen


@pytest.mark.slow  # two small benches (cost curve, warm-up, decode): about 10 s
def test_bench_draft_mix_changes_rejection_decoding_and_is_recorded(tiny_dirs, drafter_dir, tmp_path):
    """bench --acceptance rejection: --draft-mix 0 (greedy drafts, q at T 0.05) and --draft-mix 1 (drafts from q
    at T) decode differently, and results.json and report.md say which ran."""
    from dflashkit.cli import main

    base = ["bench", "--target", str(tiny_dirs["llama"]), "--drafter", str(drafter_dir), "--methods", "chain",
            "--num-prompts", "2", "--max-new-tokens", "24", "--temperature", "0.7", "--acceptance", "rejection"]
    out = {}
    for mix in ("0", "1"):
        extra = ["--draft-temperature", "0.05"] if mix == "0" else []
        assert main(base + ["--draft-mix", mix, *extra, "--out", str(tmp_path / mix)]) == 0
        res = json.loads((tmp_path / mix / "results.json").read_text())
        out[mix] = [(r["tokens"], r["accepted"]) for r in res["runs"] if r["method"] == "chain"]
        c = res["config"]
        assert (c["temperature"], c["acceptance"], c["draft_mix"]) == (0.7, "rejection", float(mix))
        assert c["draft_temperature"] == (0.05 if mix == "0" else 0.7)
        assert f"draft mix {mix}" in (tmp_path / mix / "report.md").read_text()
        sha = hashlib.sha256((drafter_dir / "model.safetensors").read_bytes()).hexdigest()
        assert c["drafter"] == {"path": str(drafter_dir), "sha256": sha}  # which drafter the results are of
        assert f"drafter `{drafter_dir}` (weights sha256 {sha[:12]})" in (tmp_path / mix / "report.md").read_text()
    assert out["0"] != out["1"]


# ---- the rejection rule itself, position by position ---------------------------------------------------------

V, L, N = 6, 4, 200_000  # vocabulary, drafts per block, chains decided at once


def target_and_draft_logits():
    """A target p per position 0..L (the bonus is p_L), all different, and drafter logits near log p: drafts are
    accepted often enough that every position, the bonus included, gets thousands of samples."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(1.2 * torch.randn(L + 1, V, generator=gen), -1)
    draft_logits = p[:L].log() + 0.8 * torch.randn(L, V, generator=gen)
    return p, draft_logits, gen


def chain_drafts(draft_logits, mix, gen):
    from dflashkit.decode.speculative import sample_drafts

    rows = draft_logits.repeat(N, 1)  # [N * L, V]: each row drawn on its own, as a chain's positions are
    tokens, q = sample_drafts(rows, 1.0, gen, lambda idx: idx, V, mix)
    return tokens.view(N, L), q.view(N, L, V)


def selector_drafts(draft_logits, mix, gen):
    """DFlash2: top-4 of 6 candidates, rescored given the token drawn before (q depends on the path so far)."""
    from dflashkit.decode.speculative import selector_drafts as drafts
    from dflashkit.drafter.model import CandidateSelector

    torch.manual_seed(0)
    selector = CandidateSelector(SimpleNamespace(selector_top_k=4, vocab_size=V, selector_rank=4, hidden_size=8))
    with torch.no_grad():
        for param in selector.parameters():
            param.normal_(0, 0.5)
        hidden = torch.randn(1, L, 8).expand(N, -1, -1)
        return drafts(selector, hidden, draft_logits.expand(N, -1, -1), torch.zeros(N, dtype=torch.long), 1.0,
                      gen, None, V, mix)


@pytest.mark.parametrize("mix", [1.0, 0.5])
@pytest.mark.parametrize("drafts_of", [chain_drafts, selector_drafts], ids=["chain", "dflash2"])
def test_rejection_rule_is_exact_at_every_position(drafts_of, mix):
    """Among chains that reach position i (i drafts accepted before it), the token there (draft i if accepted, else
    the residual's sample; at i = L the bonus) follows the target's p_i. Wrong residuals (q of another position),
    a bonus from p_{L-1}, or a mixed draft reported with its unmixed q all fail this at some position."""
    from dflashkit.decode.speculative import rejection_accept

    p, draft_logits, gen = target_and_draft_logits()
    tokens, q = drafts_of(draft_logits, mix, gen)
    a, nxt = rejection_accept(tokens, q, p.log().expand(N, -1, -1), 1.0, gen)
    emitted = torch.cat([tokens, torch.full((N, 1), -1)], dim=1)
    emitted[torch.arange(N), a] = nxt[:, 0]  # position a holds the next token; beyond it nothing this round
    for i in range(L + 1):
        reached = emitted[a >= i, i]
        assert len(reached) > 2000, (i, len(reached), "too few samples for the test to have power")
        counts = torch.bincount(reached, minlength=V).tolist()
        stat, crit = chi_square(dict(enumerate(counts)), p[i], len(reached))
        assert stat < crit, (i, stat, crit, counts, (p[i] * len(reached)).round().tolist())
