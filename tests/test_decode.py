"""Online speculative decoding: lossless against plain greedy decoding, oracle acceptance, sampling distribution."""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.measure.bench import check_lossless, parse_methods, run_bench, write_bench
from dflashkit.decode.sampling import Sampling
from dflashkit.decode.speculative import DFlashProposer, generate
from dflashkit.drafter.checkpoint import new_drafter, save_drafter
from dflashkit.errors import DFlashError
from helpers import KINDS, Oracle, SpreadOracle, chi_square, greedy_reference, sampling_setup

TEXTS = ["hello world", "def add(a, b):", "Write a haiku about the sea, then explain it."]


pytestmark = pytest.mark.usefixtures("one_thread")


def check_feature_stream(target, oracle, ids, tokens):
    """The features handed to the drafter each round equal the target's features of exactly the newly committed
    positions (prompt first, then each round's accepted tokens): what a full forward computes."""
    full = target.forward(torch.tensor([ids + tokens]), layer_ids=oracle.layer_ids).features[0]
    prev = 0
    for start, feats in oracle.calls:
        assert feats.shape[1] == start - prev, (start, prev, feats.shape)
        torch.testing.assert_close(feats[0], full[prev:start], atol=2e-4, rtol=1e-3)
        prev = start


@pytest.fixture(scope="module")
def drafters(tiny_targets):
    torch.manual_seed(0)
    return {k: new_drafter(t, num_layers=1, block_size=6).eval() for k, t in tiny_targets.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_lossless_greedy_on_tiny_targets(tiny_targets, drafters, kind):
    """T=0: chain and DDTree equal plain greedy decoding token for token, with a random drafter and with an
    oracle that makes planted mistakes (partial blocks, accepted paths through non-first siblings)."""
    target = tiny_targets[kind]
    random_drafter = DFlashProposer(target, drafters[kind])
    for i, text in enumerate(TEXTS[:1] if kind == "qwen3_5" else TEXTS):  # the hybrid target is 2-3x as slow
        ids = target.chat_ids([{"role": "user", "content": text}])
        ref = greedy_reference(target, ids, 20, set(target.stop_token_ids))
        seq = ids + ref + greedy_reference(target, ids + ref, 8)
        oracle = Oracle(seq, 6, target.vocab_size, wrong={len(ids) + k for k in (3, 5, 9, 10, 16)})
        for method in ("ar", "chain", "ddtree-3", "ddtree-12"):
            if method in ("chain", "ddtree-12") and i < 2:
                assert generate(target, ids, method, random_drafter, max_new_tokens=20).tokens == ref, (kind, text, method)
            g = generate(target, ids, method, oracle, max_new_tokens=20)
            assert g.tokens == ref, (kind, text, method)
            if method != "ar":
                check_feature_stream(target, oracle, ids, g.tokens)
        if kind == "llama":
            assert generate(target, ids, "prompt-lookup", max_new_tokens=20).tokens == ref


@pytest.mark.parametrize("kind", KINDS)
def test_dflash2_lossless_greedy(tiny_targets, kind):
    """A DFlash2 drafter (convolutions off identity, selector path as the chain's drafts) in chain, DDTree and
    hybrid decoding equals plain greedy decoding, hybrid-attention target included."""
    target = tiny_targets[kind]
    torch.manual_seed(1)
    d = new_drafter(target, num_layers=2, block_size=6, arch="dflash2", conv_kernel_size=2, conv_group_size=16,
                    selector_rank=16, selector_top_k=4).eval()
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "_conv." in name or "candidate_selector" in name:
                p.normal_(0, 0.3)
    proposers = [DFlashProposer(target, d), DFlashProposer(target, d, selector_trees=True)]
    for text in TEXTS[:1] if kind == "qwen3_5" else TEXTS[:2]:  # the hybrid target is 2-3x as slow
        ids = target.chat_ids([{"role": "user", "content": text}])
        ref = greedy_reference(target, ids, 16, set(target.stop_token_ids))
        for method, proposer in (("chain", proposers[0]), ("ddtree-6", proposers[0]), ("ddtree-6", proposers[1]),
                                 ("hybrid-4", proposers[1])):
            assert generate(target, ids, method, proposer, max_new_tokens=16).tokens == ref, (kind, text, method)


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_acceptance(tiny_targets, kind):
    """An oracle drafter: chain commits full blocks (tau = B); DDTree reaches depth min(budget, B-1) + 1."""
    target = tiny_targets[kind]
    ids = target.chat_ids([{"role": "user", "content": TEXTS[1]}])
    B = 6
    ref = greedy_reference(target, ids, 1 + 3 * B + B)
    oracle = Oracle(ids + ref, B, target.vocab_size)
    g = generate(target, ids, "chain", oracle, max_new_tokens=1 + 3 * B)
    assert g.accepted == [B, B, B] and g.tokens == ref[: 1 + 3 * B]
    for budget in (1, 2, 4, 5, 16):
        depth = min(budget, B - 1) + 1
        g = generate(target, ids, "ddtree", oracle, budget=budget, max_new_tokens=1 + 3 * depth)
        assert g.accepted == [depth] * 3, (budget, g.accepted)
        assert g.tokens == ref[: 1 + 3 * depth]


@pytest.mark.parametrize("kind", KINDS)
def test_max_new_tokens_and_stop_token_mid_block(tiny_targets, monkeypatch, kind):
    """Cut exactly where plain decoding stops, when the cut falls inside an accepted block."""
    target = tiny_targets[kind]
    ids = target.chat_ids([{"role": "user", "content": TEXTS[0]}])
    B = 6
    ref = greedy_reference(target, ids, 30)
    oracle = Oracle(ids + ref + [0] * B, B, target.vocab_size)
    for method in ("chain", "ddtree-8"):
        g = generate(target, ids, method, oracle, max_new_tokens=1 + B + 3)  # round 2 accepts B, 3 are kept
        assert g.tokens == ref[: 1 + B + 3] and g.accepted == [B, B]
    # a stop token first produced in the middle of round 2's block
    k = next(k for k in range(B + 2, 2 * B) if ref[k] not in ref[:k])
    monkeypatch.setattr(target, "stop_token_ids", [ref[k]])
    want = greedy_reference(target, ids, 30, {ref[k]})
    assert want == ref[: k + 1]
    for method in ("ar", "chain", "ddtree-8"):
        g = generate(target, ids, method, oracle, max_new_tokens=30)
        assert g.tokens == want, method


@pytest.mark.slow  # hundreds of seeded decodes for a chi-square test
def test_sampling_matches_target_softmax(tiny_targets):
    """T>0: the first and second new tokens over many seeded runs follow the target's own distribution. The
    second token is the first one the verify step decides; the oracle's greedy drafts get accepted often, so a
    loop that accepted drafts too easily would over-produce them."""
    target = tiny_targets["llama"]
    T, n, B = 0.2, 120, 4
    ids, oracle, p1, p2, p2_given = sampling_setup(target, "def f(x):", T, B)
    ref = oracle.seq[len(ids):]
    # the test has power: a loop that accepted a draft when it is the target's argmax (not its sample) fails it
    greedy_accept = p2_given.clone()
    greedy_accept[:, ref[1]] = 0
    greedy_accept[p2_given.argmax(-1) == ref[1], :] = 0
    greedy_accept[p2_given.argmax(-1) == ref[1], ref[1]] = 1
    greedy_accept = p1 @ (greedy_accept / greedy_accept.sum(-1, keepdim=True))
    fake = torch.multinomial(greedy_accept, n, replacement=True, generator=torch.Generator().manual_seed(1)).tolist()
    stat, crit = chi_square({t: fake.count(t) for t in set(fake)}, p2, n)
    assert stat > crit, (stat, crit)
    spread = SpreadOracle(ids + ref, B, target.vocab_size)
    d2 = dflash2_oracle(target, oracle)
    schemes = (("chain", "match", oracle, None, 1.0), ("chain", "rejection", d2, None, 1.0),
               ("chain", "rejection", d2, None, 0.5),  # the selector given the mixed path's own predecessors
               ("chain", "rejection", oracle, 3.0, 0.5),  # a diffuse q over the vocabulary, half kept greedy
               ("chain", "rejection", spread, None, 1.0), ("ddtree-4", "match", oracle, None, 1.0))
    for method, acceptance, proposer, t_draft, mix in schemes:
        gen = torch.Generator().manual_seed(0)
        sampling = Sampling(T, acceptance, t_draft, mix)
        runs = [generate(target, ids, method, proposer, max_new_tokens=2, sampling=sampling, generator=gen)
                for _ in range(n)]
        assert sum(r.accepted[0] > 1 for r in runs) > n // 10, "the test needs accepted drafts to mean anything"
        for pos, probs in ((0, p1), (1, p2)):
            toks = [r.tokens[pos] for r in runs]
            stat, crit = chi_square({t: toks.count(t) for t in set(toks)}, probs, n)
            assert stat < crit, (method, acceptance, mix, pos, stat, crit)


def test_mixed_drafts_follow_the_q_they_report():
    """mix_greedy: picks drawn from q' = mix * q + (1 - mix) * onehot(argmax q), which it returns; mix 0 is the
    argmax, mix 1 returns the sample and q untouched and draws nothing more from the generator."""
    from dflashkit.drafter.model import mix_greedy

    q = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 2, -1)
    rows = q.repeat(5000, 1)
    gen = torch.Generator().manual_seed(1)
    picks, mixed = mix_greedy(rows, torch.multinomial(rows, 1, generator=gen)[:, 0], 0.3, gen)
    want = 0.3 * q + 0.7 * torch.nn.functional.one_hot(q.argmax(-1), 6)
    torch.testing.assert_close(mixed[:4], want)
    freq = torch.stack([torch.bincount(picks[i::4], minlength=6) / 5000 for i in range(4)])
    assert (freq - want).abs().max() < 0.03, (freq, want)
    assert torch.equal(mix_greedy(q, torch.zeros(4, dtype=torch.long), 0.0, gen)[0], q.argmax(-1))
    state = gen.get_state()
    sample = torch.tensor([5, 4, 3, 2])
    same, untouched = mix_greedy(q, sample, 1.0, gen)
    assert same is sample and untouched is q and torch.equal(gen.get_state(), state)


def dflash2_oracle(target, oracle):
    """A real DFlash2 drafter's draft path (selector sampling over its top-k, q scattered to the vocabulary) fed
    the oracle's logits as its unary scores, so that its drafts are often right and the chi-square test has power."""
    torch.manual_seed(0)
    d = new_drafter(target, num_layers=1, block_size=oracle.block_size, arch="dflash2", conv_group_size=16,
                    selector_rank=8, selector_top_k=4).eval()
    proposer = DFlashProposer(target, d)
    real = proposer.propose

    def propose(features, anchor, start):
        real(features, anchor, start)  # the drafter's states for the selector
        return oracle.propose(features, anchor, start)

    proposer.propose = propose
    return proposer


@pytest.mark.slow
def test_smollm2_coding_prompts_lossless(smollm2):
    """The real target on a coding prompt: chain and DDTree equal plain greedy decoding."""
    from dflashkit.prompts import load_prompts
    from dflashkit.targets.generation import iter_generate_greedy

    target = smollm2
    torch.manual_seed(0)
    drafter = DFlashProposer(target, new_drafter(target, num_layers=1, block_size=8).eval())
    suite = load_prompts("coding-10").items[:1]
    for item in suite:
        ids = target.chat_ids(item.messages)
        ref = dict(iter_generate_greedy(target, [ids], 10, batch_size=1))[0]
        seq = ids + ref + [0] * 8
        oracle = Oracle(seq, 8, target.vocab_size, wrong={len(ids) + 3, len(ids) + 8}, layer_ids=(1, 15))
        if item is suite[0]:
            assert generate(target, ids, "chain", drafter, max_new_tokens=10).tokens == ref
        for method in ("chain", "ddtree-4"):
            g = generate(target, ids, method, oracle, max_new_tokens=10)
            assert g.tokens == ref, (item.id, method)
            assert g.tau > 2
        check_feature_stream(target, oracle, ids, g.tokens)


@pytest.mark.slow  # a whole bench or compare folder, figures included
def test_bench_reports_and_flags_mismatches(tiny_targets, drafters, tmp_path, monkeypatch):
    target = tiny_targets["qwen3"]
    ids = [(t, target.chat_ids([{"role": "user", "content": t}])) for t in TEXTS[:2]]
    methods = parse_methods("chain,ddtree-4,ngram,hybrid-auto,prompt-lookup,hf-generate")
    assert methods == ["ar", "chain", "ddtree-4", "ngram", "hybrid-auto", "prompt-lookup", "hf-generate"]
    res = run_bench(target, drafters["qwen3"], ids, methods, max_new_tokens=12, progress=False)
    assert res["mismatches"] == []
    cost = res["cost"]
    assert cost["ns"] == [1, 2, 4, 8, 9, 16, 32] and cost["ratio"][0] == 1.0 and cost["floor_ms"] > 0
    assert res["methods"]["hf-generate"]["speedup_vs_hf_generate"] == pytest.approx(1.0)
    for m, s in res["methods"].items():
        assert s["new_tokens"] == sum(len(r["tokens"]) for r in res["runs"] if r["method"] == m)
        if m in ("chain", "ddtree-4", "ngram", "hybrid-auto"):
            assert abs(sum(s["accepted_hist"]) - 1) < 1e-9
            r = s["ms_per_round"]
            t_ar = res["methods"]["ar"]["ms_per_round"]["total"]
            assert s["ceiling"] == pytest.approx(s["tau"] * t_ar / (r["draft"] + r["verify"]))
            assert abs(sum(s["split"].values()) - 1) < 1e-6
    files = write_bench(res, tmp_path / "bench")
    assert {p.name for p in files} == {"results.json", "report.md", "requests.jsonl", "speedup.png", "accepted.png", "cost.png",
                                      "predicted.png"}
    assert json.loads((tmp_path / "bench" / "results.json").read_text())["config"]["methods"] == methods
    # a speculative output that differs from plain decoding is a loud failure
    import dflashkit.measure.bench as bench

    real = bench.generate

    def broken(target, ids, method, *a, **k):
        g = real(target, ids, method, *a, **k)
        if method == "chain":
            g.tokens[-1] = (g.tokens[-1] + 1) % target.vocab_size
        return g

    monkeypatch.setattr(bench, "generate", broken)
    res = run_bench(target, drafters["qwen3"], ids, ["ar", "chain"], max_new_tokens=6, progress=False, warmup=False)
    assert [(x["method"], x["first_difference"]) for x in res["mismatches"]] == [("chain", 5), ("chain", 5)]
    assert "LOSSLESS CHECK FAILED" in bench.bench_markdown(res)
    assert check_lossless([{"prompt": "a", "method": "ar", "tokens": [1, 2]},
                           {"prompt": "a", "method": "x", "tokens": [1, 2, 3]}])[0]["first_difference"] == 2


def test_cli_generate_json_and_errors(tiny_dirs, tiny_targets, drafters, tmp_path, capsys):
    from dflashkit.cli import main

    target = tiny_targets["qwen3"]
    save_drafter(drafters["qwen3"], tmp_path / "d", target_identity=target.identity())
    base = ["generate", "--target", str(tiny_dirs["qwen3"]), "--prompt", "hello", "--max-new-tokens", "9"]
    assert main(base + ["--drafter", str(tmp_path / "d"), "--method", "ddtree", "--budget", "4", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)[0]
    ids = target.chat_ids([{"role": "user", "content": "hello"}])
    assert rec["tokens"] == greedy_reference(target, ids, 9, set(target.stop_token_ids))
    assert rec["method"] == "ddtree-4" and sum(rec["accepted"]) >= len(rec["tokens"]) - 1
    assert set(rec["times"]) == {"prefill", "draft", "verify", "other", "total"}
    assert main(base + ["--method", "chain"]) == 2
    assert "--drafter is required" in capsys.readouterr().err
    assert main(base + ["--method", "beam"]) == 2
    assert "unknown method 'beam'" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_dirs["qwen3"]), "--prompts", str(tmp_path / "none.jsonl"),
                 "--method", "ar"]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    with pytest.raises(DFlashError, match="names a method twice"):
        parse_methods("chain,chain")


def overfit(drafter, target, cache, steps=20):
    """A few Adam steps on the cache's own blocks: a drafter that is right often but not always, so that the
    walk's rounds differ in length (a random drafter would give tau 1 everywhere and test nothing)."""
    from dflashkit.drafter.head import DraftHead

    head = DraftHead.for_drafter(target, drafter)
    B, mask = drafter.config.block_size, drafter.config.mask_token_id
    data = []
    for rec in cache:
        tokens, feats = rec.tokens, rec.features(drafter.config.target_layer_ids)
        anchors = torch.arange(rec.prompt_len, rec.num_tokens - B + 1)
        block = torch.full((len(anchors), B), mask)
        block[:, 0] = tokens[anchors]
        labels = tokens[anchors[:, None] + torch.arange(1, B)]
        data.append((feats[None], target.embed_tokens(block.view(-1))[None], anchors[None], labels))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        for feats, emb, anchors, labels in data:
            h = drafter.forward_blocks(feats, emb, anchors).view(*labels.shape[:1], -1, emb.shape[-1])[:, 1:]
            loss = torch.nn.functional.cross_entropy(head.logits(h).flatten(0, 1), labels.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return drafter.eval()


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_online_chain_tau_equals_offline_walk(tiny_targets, tmp_path, arch):
    """Online chain decoding at T=0 accepts, round by round, what the offline evaluator's walk predicts from the
    cached target states (docs/design.md section 6), for every round whose block has all its labels in the cache.
    DFlash2: both sides draft the selector's path; its selector-scored trees are reported offline."""
    from dflashkit.cache import extract, open_cache
    from dflashkit.evaluate.offline import evaluate
    from dflashkit.prompts import load_prompts

    target = tiny_targets["qwen3"]
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "def add(a, b):"}\n{"id": "b", "prompt": "hello world"}\n')
    torch.manual_seed(0)
    extra = dict(arch="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4) if arch == "dflash2" else {}
    drafter = new_drafter(target, num_layers=1, block_size=4, **extra)
    path = extract(target, load_prompts(tmp_path / "p.jsonl"), tmp_path / "cache",
                   layer_ids=drafter.config.target_layer_ids, max_new_tokens=40, progress=False)
    cache = open_cache(path, expect_target=target.identity())
    overfit(drafter, target, cache)
    if arch == "dflash2":
        with torch.no_grad():
            for p in drafter.candidate_selector.parameters():
                p.normal_(0, 0.5)
        trees = ["budget:4", "selector:1", "selector:4"]
        offline = evaluate(drafter, target, cache, anchors="walk", trees=trees)
        assert set(offline["overall"]) >= set(trees)
        assert offline["overall"]["selector:1"] <= offline["overall"]["selector:4"]
    else:
        with pytest.raises(DFlashError, match="selector trees need a DFlash2 drafter"):
            evaluate(drafter, target, cache, anchors="stride", trees=["selector:4"])
        offline = evaluate(drafter, target, cache, anchors="walk")
    B, seen = drafter.config.block_size, []
    for rec, summary in zip(cache, offline["per_prompt"]):
        prompt, completion = rec.tokens[: rec.prompt_len].tolist(), rec.tokens[rec.prompt_len:].tolist()
        g = generate(target, prompt, "chain", DFlashProposer(target, drafter), max_new_tokens=len(completion))
        assert g.tokens == completion
        full = sum(b["n_labels"] == B - 1 for b in offline["blocks"] if b["prompt"] == rec.id)
        assert full >= 5
        assert g.accepted[:full] == summary["accepted"][:full], rec.id
        seen += g.accepted[:full]
    assert len(set(seen)) >= 3, f"rounds should differ in length to test anything: {seen}"


def test_rounding_divergences_are_reported_and_large_gaps_fail(tiny_targets, monkeypatch):
    """The lossless check where the kernels give no exactness (CUDA bf16), run on CPU with an injected flip: a token
    whose logit gap to plain decoding's the dtype's rounding explains is a reported divergence, not a failure; a
    large gap still fails, and neither message calls a rounding flip a bug."""
    import dflashkit.measure.bench as bench

    target = tiny_targets["qwen3"]
    prompts = [(TEXTS[0], target.chat_ids([{"role": "user", "content": TEXTS[0]}]))]
    ref = generate(target, prompts[0][1], "ar", max_new_tokens=6).tokens
    k = 3
    with torch.no_grad():
        logits = target.forward(torch.tensor([prompts[0][1] + ref[:k]])).logits[0, -1].float()
    order = logits.argsort(descending=True)
    assert int(order[0]) == ref[k]
    near, far = int(order[1]), int(order[-1])
    gap_near, gap_far = float(logits[order[0]] - logits[near]), float(logits[order[0]] - logits[far])
    monkeypatch.setattr(bench, "exact_kernels", lambda t: False)
    monkeypatch.setattr(bench, "rounding_tolerance", lambda dtype, logit: (gap_near + gap_far) / 2)
    real = bench.generate
    for flip, fails in ((near, False), (far, True)):
        def flipped(target, ids, method, *a, flip=flip, **kw):
            g = real(target, ids, method, *a, **kw)
            if method == "ngram":
                g.tokens[k] = flip
            return g

        monkeypatch.setattr(bench, "generate", flipped)
        res = run_bench(target, None, prompts, ["ar", "ngram"], max_new_tokens=6, progress=False, warmup=False)
        assert bool(res["mismatches"]) == fails and bool(res["divergences"]) != fails
        md = bench.bench_markdown(res)
        assert ("LOSSLESS CHECK FAILED" in md) == fails and ("Rounding divergences" in md) != fails
        assert "bug" not in md
    assert res["mismatches"][0]["gap"] == pytest.approx(gap_far, rel=1e-4)


def test_generate_refuses_a_draft_mix_outside_zero_to_one(tiny_dirs, capsys):
    from dflashkit.cli import main

    assert main(["generate", "--target", str(tiny_dirs["llama"]), "--drafter", "none", "--draft-mix", "1.5",
                 "--prompt", "hi"]) == 2
    assert "draft mix 1.5 (--draft-mix): must be between 0" in capsys.readouterr().err


def test_hybrid_gate_drafts_while_the_drafter_adds_tokens_and_rechecks_when_idle():
    """hybrid-auto's gate: with no n-gram proposal, a drafter that has been adding a token per round is run; one that
    added nothing for twenty drafted rounds sits out, and drafts again on the eighth idle round."""
    from dflashkit.measure.curve import CostCurve
    from dflashkit.ngram import NgramLookup
    from dflashkit.decode.speculative import TreeDrafts

    drafts = TreeDrafts(Oracle([1, 2, 3], 4, 10), 8, NgramLookup(), CostCurve([1, 8], [0.050, 0.060]))
    drafts.t_draft, drafts.fixed = 0.010, 0.004
    assert drafts._worth_drafting([])  # first rounds: the prior (one token) pays for a 10 ms forward

    def drafted_round(added: int, force: bool = False):
        drafts.drafted = force or drafts._worth_drafting([])
        drafts.observe(list(range(added)))
        return drafts.drafted

    assert all(drafted_round(1) for _ in range(20))
    for _ in range(20):
        drafted_round(0, force=True)
    assert not drafts._worth_drafting([])
    idle = [drafted_round(0) for _ in range(9)]
    assert idle == [False] * 8 + [True]


def test_compact_kv_keeps_the_accepted_slots_in_order_and_copies_only_what_moves():
    """After a tree verify, the target KV keeps the positions before the tree and the accepted path's slots, moved
    down in path order; a path that is already in place (a chain, or the root alone) equals the same result."""
    from types import SimpleNamespace

    from dflashkit.decode.hf import compact_kv

    g = torch.Generator().manual_seed(0)
    start = 5
    for keep in ([0], [0, 1, 2], [0, 2, 5], [0, 1, 4, 6], [0, 3]):
        layers = [SimpleNamespace(keys=torch.randn(1, 2, start + 8, 4, generator=g),
                                  values=torch.randn(1, 2, start + 8, 4, generator=g)) for _ in range(3)]
        want = [(torch.cat([t[:, :, :start], t[:, :, [start + k for k in keep]]], dim=2) for t in (l.keys, l.values))
                for l in layers]
        want = [tuple(x.clone() for x in pair) for pair in want]
        compact_kv(SimpleNamespace(layers=layers), start, torch.tensor(keep))
        for layer, (k, v) in zip(layers, want):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v), keep
