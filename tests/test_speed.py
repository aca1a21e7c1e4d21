"""The pieces that make decoding fast: n-gram lookup, hybrid trees, cost-aware pruning, row-invariant bf16 kernels,
the cost curve. Speed itself is measured by `dflashkit bench` / benchmarks/, never here; these tests check that
each piece is exact (lossless) and does what it claims."""

from __future__ import annotations

import pytest
import torch

from dflashkit.measure.curve import CostCurve, measure_cost_curve
from dflashkit.decode.methods import needs_drafter, parse_method
from dflashkit.ngram import NgramLookup
from dflashkit.decode.sampling import Sampling
from dflashkit.decode.hf import HfBackend
from dflashkit.decode.speculative import generate, generate_tree
from dflashkit.tree import TreeDrafts
from torch.overrides import _get_current_function_mode_stack

from dflashkit.targets.invariant import RowInvariantKernels, invariant_linear, invariant_sdpa, kernels_for
from dflashkit.tree import Tree, accepted_path, add_branch, build_tree, prune_by_cost
from helpers import KINDS, Oracle, chi_square, greedy_reference, sampling_setup, stock_bf16

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- n-gram lookup -------------------------------------------------------------------------------------------

def brute_lookup(tokens, max_ngram, max_tokens):
    """The continuation of the latest earlier occurrence of the longest matching suffix, written out."""
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # an occurrence ending at `end` with a successor
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + max_tokens], n
    return [], 0


@pytest.mark.parametrize("seed", range(5))
def test_ngram_lookup_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6, (120,), generator=g).tolist()
    look = NgramLookup(max_ngram=3, max_tokens=5)
    look.reset(tokens[:10])
    for i in range(10, len(tokens)):
        want = brute_lookup(tokens[:i], 3, 5)
        assert look.propose_all(1) == ([want] if want[1] else []), i
        look.extend(tokens[i : i + 1])


def test_ngram_acceptance_statistics():
    look = NgramLookup(prior=(1.0, 2.0))
    assert look.probs(2, 3) == pytest.approx([0.5, 0.25, 0.125])
    for _ in range(8):
        look.observe(match=2, length=4, accepted=4)
    look.observe(match=2, length=4, accepted=1)  # depth 2 tried and failed; depths 3-4 never tried
    p = look.probs(2, 4)
    assert p[0] == pytest.approx(10 / 11) and p[1] == pytest.approx(p[0] * 9 / 11)
    assert p[2] == pytest.approx(p[1] * 9 / 10)
    assert look.probs(1, 1) == [0.5]  # other match lengths keep their own statistics


# ---- trees ---------------------------------------------------------------------------------------------------

def root_paths(tree: Tree) -> list[tuple[int, ...]]:
    out = []
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_merged_tree_holds_each_branch_exactly_once(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 5, generator=g) * 2
    tree = build_tree(logits, 10, root_token=99)
    first = max(root_paths(tree), key=len)  # a branch that is already in the tree
    for branch in (list(first), list(first[:2]) + [4, 4, 4], [3, 3, 3, 3]):
        merged, nodes = add_branch(tree, branch)
        paths = root_paths(merged)
        assert len(paths) == len(set(paths)), "a prefix appears twice"
        assert set(root_paths(tree)) <= set(paths)
        assert set(paths) - set(root_paths(tree)) == {tuple(branch[:k]) for k in range(1, len(branch) + 1)} - set(
            root_paths(tree))
        assert accepted_path(merged, branch) == nodes and len(nodes) == len(branch)
        assert all(int(merged.parents[c]) < c for c in range(1, len(merged)))  # parents precede children
        assert int(merged.tokens[0]) == 99


def test_prune_by_cost_extremes_and_optimum():
    tree = build_tree(torch.tensor([[3.0, 1.0, 0.0], [2.0, 2.0, 0.0], [4.0, 0.0, 0.0]]), 8)
    probs = tree.log_probs.double().exp().tolist()
    expensive = lambda n: 1.0 + 100.0 * (n - 1)  # noqa: E731
    free = lambda n: 1.0  # noqa: E731
    assert len(prune_by_cost(tree, probs, expensive)) == 1  # root only: 0 extra nodes
    assert len(prune_by_cost(tree, probs, free)) == len(tree)  # the full budget
    linear = lambda n: 1.0 + 0.3 * (n - 1)  # noqa: E731
    kept = prune_by_cost(tree, probs, linear)
    # brute force over every prefix-closed subset size in probability order gives the same rate
    order = sorted(probs[1:], reverse=True)
    best = max((1 + sum(order[:k])) / linear(k + 1) for k in range(len(order) + 1))
    got = (1 + sum(kept.log_probs[1:].double().exp().tolist())) / linear(len(kept))
    assert got == pytest.approx(best)
    assert set(root_paths(kept)) <= set(root_paths(tree))


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve([1, 2, 4], [1.0, 1.5, 2.0])
    assert c(1) == 1.0 and c(3) == pytest.approx(1.75) and c(6) == pytest.approx(2.5)
    assert CostCurve.from_dict(c.to_dict()).seconds == pytest.approx(c.seconds)


def test_measure_cost_curve_runs_on_a_tiny_target(tiny_targets):
    c = measure_cost_curve(tiny_targets["llama"], ns=(1, 2, 4), context=16, repeats=1)
    assert c.ns == [1, 2, 4] and all(t > 0 for t in c.seconds)


def test_a_paths_curve_times_verifies_one_path_a_row(tiny_targets):
    """The hf probe's curve of branching trees verified one path a row: n // width rows of `width` tokens that
    share the root (leaves x (depth + 1) = n), the target KV left as it was after each."""
    from dflashkit.measure.curve import fan
    from dflashkit.tree import path_tokens

    tree = fan(3, 4, torch.arange(20))
    assert len(tree) == 1 + 3 * 3 and path_tokens(tree) == 12 and tree.parents.tolist() == [-1, 0, 1, 2, 0, 4, 5, 0, 7, 8]
    assert tree.depths.tolist() == [0, 1, 2, 3] * 1 + [1, 2, 3] * 2
    c = measure_cost_curve(tiny_targets["llama"], ns=(4, 8, 12), context=16, repeats=1, paths=4)
    assert c.ns == [4, 8, 12] and all(t > 0 for t in c.seconds)


def test_method_names():
    assert parse_method("hybrid-auto") == ("hybrid", "auto") and parse_method("ngram") == ("ngram", None)
    assert parse_method("hybrid-12") == ("hybrid", 12) and parse_method("hf-generate") == ("hf-generate", None)
    for bad in ("ngram-3", "chain-auto", "prompt-lookup-auto", "ar-2", "hybrid-0", "tree"):
        with pytest.raises(ValueError, match="unknown method"):
            parse_method(bad)
    assert needs_drafter("hybrid-8") and not needs_drafter("ngram")


# ---- lossless: n-gram and hybrid equal greedy --------------------------------------------------------------

REPEATING = ["def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add(", "one two three one two three one"]


@pytest.mark.parametrize("kind", KINDS)
def test_ngram_and_hybrid_lossless_greedy(tiny_targets, kind):
    """T=0: ngram, hybrid (fixed and cost-aware) equal plain greedy token for token; the oracle plants mistakes so
    that drafter and n-gram branches both get accepted and rejected."""
    target = tiny_targets[kind]
    flat = CostCurve([1, 32], [1.0, 1.0])
    for text in REPEATING:
        ids = target.chat_ids([{"role": "user", "content": text}])
        ref = greedy_reference(target, ids, 24, set(target.stop_token_ids))
        oracle = Oracle(ids + ref + [0] * 8, 6, target.vocab_size, wrong={len(ids) + k for k in (2, 6, 7, 13)})
        for method in ("ngram", "hybrid-3", "hybrid-auto", "ddtree-auto"):
            g = generate(target, ids, method, oracle, max_new_tokens=24, cost=flat)
            assert g.tokens == ref, (kind, text, method)
            assert sum(g.accepted) >= len(g.tokens) - 1


def test_hybrid_adds_the_ngram_branch_to_the_drafter_tree(tiny_targets):
    """A prompt that repeats the target's own continuation: n-gram alone accepts long runs; a drafter that is
    always wrong at depth 1 adds nothing, and hybrid still accepts what n-gram accepts (the branch is there)."""
    target = tiny_targets["llama"]
    ids0 = target.chat_ids([{"role": "user", "content": "hello"}])
    ref0 = greedy_reference(target, ids0, 12)
    ids = ids0 + ref0 + ids0  # the target's greedy answer to ids0 now appears in its prompt
    ref = greedy_reference(target, ids, 12)
    wrong = Oracle(ids + ref + [0] * 8, 6, target.vocab_size, wrong=set(range(len(ids), len(ids) + 40)))
    ng = generate(target, ids, "ngram", max_new_tokens=12)
    hy = generate(target, ids, "hybrid-2", wrong, max_new_tokens=12)
    assert ng.tokens == hy.tokens == ref
    if ref[:12] == ref0[:12]:  # the tiny target repeats itself: the n-gram branch is fully accepted
        assert max(ng.accepted) > 3 and max(hy.accepted) >= max(ng.accepted)


@pytest.mark.slow  # hundreds of seeded decodes for a chi-square test
def test_ngram_and_hybrid_sample_the_target_distribution(tiny_targets):
    """T>0: the first two new tokens follow the target's own distribution under n-gram and hybrid verification."""
    target = tiny_targets["llama"]
    T, n, B = 0.2, 150, 4
    ids, oracle, p1, p2, _ = sampling_setup(target, "def f(x): def f(x):", T, B)
    for method in ("ngram", "hybrid-3"):
        gen = torch.Generator().manual_seed(0)
        runs = [generate(target, ids, method, oracle, max_new_tokens=2, sampling=Sampling(T), generator=gen)
                for _ in range(n)]
        if method == "hybrid-3":
            assert sum(r.accepted[0] > 1 for r in runs) > n // 10, "the test needs accepted drafts to mean anything"
        for pos, probs in ((0, p1), (1, p2)):
            toks = [r.tokens[pos] for r in runs]
            stat, crit = chi_square({t: toks.count(t) for t in set(toks)}, probs, n)
            assert stat < crit, (method, pos, stat, crit)


# ---- bf16: row-invariant kernels -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_llama(tiny_dirs):
    from dflashkit.targets.model import load_target

    return load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16")


def _block_vs_one_by_one(model, cfg) -> int:
    """How many of 24 tokens get different logits verified in one block than decoded one at a time."""
    from transformers import DynamicCache

    from dflashkit.decode.hf import crop_kv

    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    differ = 0
    with torch.no_grad():
        kv = DynamicCache(config=cfg)
        model(ids[:, :40], past_key_values=kv)
        block = model(ids[:, 40:], past_key_values=kv, position_ids=torch.arange(40, 64)[None]).logits[0]
        crop_kv(kv, 40)
        for i in range(40, 64):
            one = model(ids[:, i : i + 1], past_key_values=kv, position_ids=torch.tensor([[i]])).logits[0, 0]
            differ += not torch.equal(one, block[i - 40])
    return differ


def test_row_invariant_kernels_give_each_token_the_same_logits_alone_or_in_a_block():
    """bf16 at SmolLM2's width (a one-row GEMV rounds differently from the GEMM of a block): plain kernels give
    different logits for a token verified in a block than decoded alone; row-invariant kernels bit-identical ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=2048, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    plain = _block_vs_one_by_one(model, cfg)
    with RowInvariantKernels():
        assert _block_vs_one_by_one(model, cfg) == 0
    if plain == 0:
        pytest.skip("this CPU's bf16 kernels are row-invariant already; nothing to compare against")


def test_row_invariant_linear_gives_a_row_the_same_output_in_calls_of_1_to_200_rows():
    """At SmolLM2's MLP width in bf16: a row alone, and a row at any place of calls of up to 200 rows (a hybrid
    tree verifies paths x depth rows at once). On an AMX CPU F.linear rounds differently from 33 rows on."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 1536, bias=False).bfloat16()
    x = torch.randn(200, 576).bfloat16()
    with torch.no_grad():
        alone = torch.cat([invariant_linear(x[i:i + 1], lin.weight) for i in range(200)])
        for m in (2, 7, 32, 33, 64, 65, 200):
            assert torch.equal(invariant_linear(x[:m], lin.weight), alone[:m]), m
            with RowInvariantKernels():  # what a model's own nn.Linear computes inside the kernels
                assert torch.equal(lin(x[:m].reshape(1, m, 576))[0], alone[:m]), m


def test_row_invariant_attention_gives_a_query_the_same_output_alone_or_in_a_block():
    """At SmolLM2's head shapes, every key length from 30 to 300: a query verified in a block of 4 (with the
    block's extra keys masked) gets bit for bit what it gets alone with exactly its keys. A bf16 matmul fails
    this on AMX CPUs (a query's scores round differently with 52 keys than with 53); the float64 path holds."""
    torch.manual_seed(0)
    h, kvh, d, W = 9, 3, 64, 4
    differ = []
    for T in range(30, 300):
        q = torch.randn(1, h, W, d).bfloat16()
        k, v = torch.randn(1, kvh, T + W, d).bfloat16(), torch.randn(1, kvh, T + W, d).bfloat16()
        mask = torch.zeros(1, 1, W, T + W)
        for i in range(W):
            mask[..., i, T + i + 1:] = torch.finfo(torch.bfloat16).min
        block = invariant_sdpa(q, k, v, mask.bfloat16(), scale=d ** -0.5, enable_gqa=True)
        for j in range(W):
            one = invariant_sdpa(q[:, :, j:j + 1], k[:, :, :T + j + 1], v[:, :, :T + j + 1], None, scale=d ** -0.5,
                                 enable_gqa=True)
            if not torch.equal(one[0, :, 0], block[0, :, j]):
                differ.append((T, j))
    assert differ == []


@pytest.fixture(scope="module")
def smollm2_bf16():
    from dflashkit.targets.model import load_target

    return load_target("smollm2-135m", device="cpu", dtype="bfloat16")


@pytest.mark.slow
def test_smollm2_bf16_tokens_get_the_same_logits_alone_or_in_a_block(smollm2_bf16):
    """The real target, 96 answer tokens verified in blocks of 4 against one by one (on an AMX CPU the bf16
    attention matmuls parted here at position 51 before they ran in float64). The answer is greedy decoding on the
    row-invariant kernels (what `ar` runs), its one-by-one logits those the comparison reads: one pass, not two."""
    from transformers import DynamicCache

    t = smollm2_bf16
    m = t.model
    ids = t.chat_ids([{"role": "user", "content": "Write a Python function that reverses a linked list."}])
    with torch.no_grad(), RowInvariantKernels():
        one, block = DynamicCache(config=m.config), DynamicCache(config=m.config)
        nxt = m(torch.tensor([ids]), past_key_values=one, use_cache=True).logits[0, -1]
        m(torch.tensor([ids]), past_key_values=block, use_cache=True)
        seq, alone = [], []  # alone[i]: the logits of seq[i] decoded one token at a time
        while len(seq) < 96 and (not seq or seq[-1] not in t.stop_token_ids):
            seq.append(int(nxt.argmax()))
            nxt = m(torch.tensor([[seq[-1]]]), past_key_values=one, use_cache=True).logits[0, -1]
            alone.append(nxt)
        differ = []
        for s in range(0, len(seq) - 3, 4):
            logits = m(torch.tensor([seq[s:s + 4]]), past_key_values=block, use_cache=True).logits[0]
            differ += [len(ids) + s + j for j in range(4) if not torch.equal(alone[s + j], logits[j])]
    assert differ == []


def test_bf16_speculative_equals_bf16_greedy(bf16_llama):
    t = bf16_llama
    oracle = Oracle([], 6, t.vocab_size)
    for text in REPEATING:
        ids = t.chat_ids([{"role": "user", "content": text}])
        ref = generate(t, ids, "ar", max_new_tokens=30).tokens
        oracle.seq = ids + ref + [0] * 8
        oracle.wrong = {len(ids) + 4}
        for method in ("ngram", "hybrid-4", "ddtree-8", "chain"):
            assert generate(t, ids, method, oracle, max_new_tokens=30).tokens == ref, method


def active_kernels() -> set[str]:
    return {type(m).__name__ for m in _get_current_function_mode_stack()}


def test_float32_models_are_left_alone(tiny_targets, bf16_llama):
    assert not isinstance(kernels_for(tiny_targets["qwen3"]), RowInvariantKernels)
    assert isinstance(kernels_for(bf16_llama), RowInvariantKernels)
    assert not isinstance(kernels_for(bf16_llama, stock=True), RowInvariantKernels)


@stock_bf16  # extraction runs the stock kernels
def test_kernel_switch_is_scoped_extract_decode_extract_bit_for_bit(bf16_llama, tmp_path):
    """Decoding runs a bf16 CPU target on row-invariant kernels around its own forwards only, changing nothing on
    the model: features extracted after decoding equal those extracted before, bit for bit, and no module, class
    or config differs."""
    from dflashkit.cache import extract, open_cache
    from dflashkit.prompts import load_prompts

    t = bf16_llama
    before_attn = t.model.config._attn_implementation
    classes = [type(m) for m in t.model.modules()]
    suite = load_prompts("coding-10").subset(2)

    def features(name):
        path = extract(t, suite, tmp_path / name, layer_ids=[1, 3], max_new_tokens=6, progress=False)
        return [rec.features([1, 3]).clone() for rec in open_cache(path, expect_target=t.identity())]

    first = features("a")
    ids = t.chat_ids([{"role": "user", "content": REPEATING[0]}])
    seen = []
    real = t.model.forward

    def spy(*a, **k):  # decoding does run on the row-invariant kernels
        seen.append(frozenset(active_kernels()))
        return real(*a, **k)

    t.model.forward = spy
    try:
        generate(t, ids, "ngram", max_new_tokens=8)
    finally:
        del t.model.forward
    assert set(seen) == {frozenset({"RowInvariantKernels"})}
    assert t.model.config._attn_implementation == before_attn and not active_kernels()
    assert [type(m) for m in t.model.modules()] == classes
    second = features("b")
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_tree_drafts_without_any_proposer_is_plain_decoding(tiny_targets):
    t = tiny_targets["qwen3"]
    ids = t.chat_ids([{"role": "user", "content": "x"}])
    g = generate_tree(HfBackend(t), TreeDrafts(), ids, max_new_tokens=6)
    assert g.tokens == greedy_reference(t, ids, 6) and g.accepted == [1] * 5


def test_prune_by_paths_counts_rows_times_width():
    """Verified one root-to-leaf path per row, two branches cost 2 x width tokens: a steep curve keeps one branch
    where the flattened count (nodes + 1) would keep both."""
    tree = Tree(torch.tensor([9, 1, 2, 3, 4]), torch.tensor([0, 1, 2, 1, 2]), torch.tensor([-1, 0, 1, 0, 3]),
                torch.zeros(5))
    probs = [1.0, 0.9, 0.8, 0.5, 0.45]
    cost = lambda n: 1.0 + 0.5 * max(0, n - 5)  # noqa: E731  (flat up to 5 tokens, then steep)
    flat = prune_by_cost(tree, probs, cost)
    rows = prune_by_cost(tree, probs, cost, path_cost=cost)
    assert len(flat) == 5 and root_paths(rows) == [(1,), (1, 2)]


class CountingOracle(Oracle):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.drafts = 0

    def propose(self, features, anchor, start):
        self.drafts += 1
        return super().propose(features, anchor, start)


def test_hybrid_auto_stops_drafting_when_the_drafter_adds_nothing(tiny_targets):
    """A drafter that is always wrong while the n-gram branch is always right: the cost-aware hybrid soon lets the
    drafter sit out most rounds (and the output still equals greedy, so skipped rounds' features reach it later)."""
    target = tiny_targets["llama"]
    ids0 = target.chat_ids([{"role": "user", "content": "abc"}])
    ref0 = greedy_reference(target, ids0, 40)
    ids = ids0 + ref0 + ids0
    ref = greedy_reference(target, ids, 40)
    wrong = CountingOracle(ids + ref + [0] * 8, 6, target.vocab_size, wrong=set(range(len(ids), len(ids) + 60)))
    cost = CostCurve([1, 64], [1.0, 1.0])
    g = generate(target, ids, "hybrid-auto", wrong, max_new_tokens=40, cost=cost)
    assert g.tokens == ref
    if ref[:30] == ref0[:30]:  # the n-gram branch is right: the drafter should mostly sit out
        assert wrong.drafts < g.rounds, (wrong.drafts, g.rounds)


def wide_bf16_target(tiny_dirs):
    """SmolLM2's width (where bf16 GEMV and GEMM round differently) on the tiny fixture's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflashkit.targets.model import Target

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=272, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.06)
    model = model.to(torch.bfloat16)
    return Target(model, AutoTokenizer.from_pretrained(tiny_dirs["llama"]), tiny_dirs["llama"], "wide-bf16")


@pytest.mark.slow  # bf16 arithmetic is emulated on CPUs without native bf16
def test_bf16_branching_trees_equal_bf16_greedy_at_full_width(tiny_dirs):
    """bf16 at SmolLM2's width: DDTree and hybrid trees (verified one path per row) and n-gram chains equal plain
    bf16 greedy decoding token for token, with planted drafter mistakes so that siblings get accepted."""
    t = wide_bf16_target(tiny_dirs)
    cost = CostCurve([1, 64], [1.0, 1.2])
    for text in REPEATING:
        ids = t.chat_ids([{"role": "user", "content": text}])
        ref = generate(t, ids, "ar", max_new_tokens=40).tokens
        oracle = Oracle(ids + ref + [0] * 8, 6, t.vocab_size, wrong={len(ids) + k for k in (1, 5, 6, 11, 20)})
        for method in ("ngram", "ddtree-6", "hybrid-4", "hybrid-auto", "ddtree-auto"):
            assert generate(t, ids, method, oracle, max_new_tokens=40, cost=cost).tokens == ref, (text, method)


@pytest.fixture(scope="module")
def bf16_hybrid(tiny_dirs):
    from dflashkit.targets.model import load_target

    return load_target(tiny_dirs["qwen3_5"], device="cpu", dtype="bfloat16")


@pytest.mark.slow  # bf16 arithmetic is emulated on CPUs without native bf16
def test_bf16_hybrid_target_speculative_equals_bf16_greedy(bf16_hybrid):
    """Gated DeltaNet layers in bf16: a multi-token verify (chunked rule) rounds differently from one-token steps
    (recurrent rule), so decoding steps them token by token after the prefill; every method then equals plain
    bf16 greedy decoding, an always-right drafter (no re-run ever) included."""
    t = bf16_hybrid
    oracle = Oracle([], 6, t.vocab_size)
    for text in REPEATING[:1] + ["Write a haiku about the sea, then explain it."]:
        ids = t.chat_ids([{"role": "user", "content": text}])
        ref = generate(t, ids, "ar", max_new_tokens=24, stop_ids=[]).tokens
        oracle.seq = ids + ref + [0] * 8
        oracle.wrong = {len(ids) + 4, len(ids) + 16}  # full blocks elsewhere: rounds with and without a re-run
        for method in ("chain", "ddtree-8", "ngram", "hybrid-4"):
            got = generate(t, ids, method, oracle, max_new_tokens=24, stop_ids=[]).tokens
            assert got == ref, (text, method)


def test_stepwise_linear_attention_is_what_one_token_steps_compute(bf16_hybrid):
    """A bf16 CPU target loads its Gated DeltaNet layers stepwise: a cached multi-token call returns, bit for bit,
    what one-token calls return (the prefill, with no state yet, keeps the chunked path)."""
    from transformers import DynamicCache

    from dflashkit.decode.hf import load_linear_states, save_linear_states
    from dflashkit.targets.invariant import _is_linear_attention, stepwise_forward

    t = bf16_hybrid
    layer = next(m for m in t.model.modules() if _is_linear_attention(m))
    x = torch.randn(1, 20, t.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert layer.forward.func is stepwise_forward
    with torch.no_grad():
        kv = DynamicCache(config=t.model.config)
        layer(x[:, :12], cache_params=kv)
        saved = save_linear_states(kv)
        block = layer(x[:, 12:], cache_params=kv)
        load_linear_states(kv, saved)
        steps = torch.cat([layer(x[:, i : i + 1], cache_params=kv) for i in range(12, 20)], dim=1)
    assert torch.equal(block, steps)


@stock_bf16  # ar@hf-stock and prompt lookup run the stock kernels
def test_bench_times_the_baselines_on_stock_kernels(bf16_llama, tiny_targets, monkeypatch):
    """bf16 on a CPU: `ar` (the token reference) and our methods run the row-invariant kernels, while plain decoding
    on the hf-stock backend, prompt lookup and transformers' generate run the model's own; speedups are against the
    faster of ar and ar@hf-stock, and both ar timings are in the results. In float32 nothing differs and no
    ar@hf-stock is added."""
    from dflashkit.measure import bench

    t = bf16_llama
    prompts = [("p", t.chat_ids([{"role": "user", "content": REPEATING[0]}]))]
    kernels, current = {}, []
    real_generate, real_forward = bench.generate, t.model.forward

    def spy_generate(target, ids, method, *a, **k):  # which row is running
        current.append(method + ("@hf-stock" if k.get("engine") == "hf-stock" else ""))
        return real_generate(target, ids, method, *a, **k)

    def spy_forward(*a, **k):  # which kernels its forwards see
        kernels.setdefault(current[-1] if current else "cost curve", set()).add(frozenset(active_kernels()))
        return real_forward(*a, **k)

    from dflashkit.report import parity
    real_top2 = parity.top2_at

    def spy_top2(*a, **k):  # the parity report's margin, read on the baseline's (ar's) kernels after the runs
        current.append("margin")
        return real_top2(*a, **k)

    monkeypatch.setattr(bench, "generate", spy_generate)
    monkeypatch.setattr(t.model, "forward", spy_forward)
    monkeypatch.setattr(parity, "top2_at", spy_top2)
    # predict=False: a cost model measured here (none cached yet, as on a fresh machine) would run forwards of its
    # own after the runs, counted against the last method's kernels
    res = bench.run_bench(t, None, prompts, ["ar", "ngram", "prompt-lookup"], max_new_tokens=8, progress=False,
                          warmup=False, predict=False)
    monkeypatch.undo()
    assert res["config"]["methods"] == ["ar", "ngram", "prompt-lookup", "ar@hf-stock"]
    assert res["config"]["backends"]["ar@hf-stock"] == "hf-stock"
    assert res["mismatches"] == []
    assert kernels["ar"] == kernels["ngram"] == kernels["cost curve"] == {frozenset({"RowInvariantKernels"})}
    assert kernels["ar@hf-stock"] == kernels["prompt-lookup"] == {frozenset()}
    assert res["methods"]["ar"]["tokens_per_s"] and res["methods"]["ar@hf-stock"]["tokens_per_s"]
    ups = sorted(res["methods"][m]["speedup_vs_ar"] for m in ("ar", "ar@hf-stock"))  # against the faster of the two
    assert ups[1] == pytest.approx(1.0) and ups[0] <= 1.0
    f32 = bench.run_bench(tiny_targets["llama"], None, prompts, ["ar", "ngram"], max_new_tokens=4, progress=False,
                          warmup=False)
    assert f32["config"]["methods"] == ["ar", "ngram"]
