"""Sliding-window targets online (issue 37): every method equals plain greedy decoding well past the window.

The target KV keeps every position of a sliding layer so that a rejected draft can be cropped off, and the window
lives in the mask: transformers' own for prefill, plain steps, chains and per-path trees, the tree mask's windowed
twin for a flattened tree. Oracle drafts (with planted mistakes) make rounds accept part of a block, so the
rollback runs every few tokens; blocks of 12 > window 8 put the window inside the verified block and tree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflashkit.measure.curve import CostCurve
from dflashkit.decode.speculative import DFlashProposer, generate
from dflashkit.decode.hf import crop_kv, new_target_kv, verify_mask
from dflashkit.drafter.checkpoint import new_drafter
from dflashkit.errors import DFlashError
from families import greedy_reference
from tiny_targets import KINDS, _tokenizer, make_tiny_target, tiny_config
from dflashkit.targets.model import load_target
from dflashkit.tree import Tree, attention_mask, build_tree
from helpers import Oracle

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ("ar", "chain", "ddtree-4", "ddtree-16", "ngram", "hybrid-4", "hybrid-auto")
DRAFTERLESS = ("ar", "ngram")  # the proposer goes unused: the same run whichever is given, so run once
NEW = 40  # the fixtures' window is 8: prompt (21 tokens) + 40 new ones run 7 windows long
COST = CostCurve([1, 2, 4, 8, 16], [0.010, 0.011, 0.012, 0.014, 0.018])  # hybrid-auto's cost curve, made up


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sliding")


def sliding_folder(cfg, out):
    """A tiny target folder from a config, as make_tiny_target writes its fixtures."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return out


TINY = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def qwen3_sliding():
    """Qwen3 with use_sliding_window: layer_types, full attention first (a mask per layer type)."""
    from transformers import Qwen3Config

    return Qwen3Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)


def mistral_sliding():
    """Mistral: a window on every layer and no layer_types (the model builds one mask for all of them)."""
    from transformers import MistralConfig

    return MistralConfig(**TINY, sliding_window=8)


def check_every_method(t):
    """Every online method, with a random drafter and with oracles of block 4 and 12, equals greedy decoding."""
    window = t.config.sliding_window
    assert window <= 16
    ids = t.chat_ids([{"role": "user", "content": "hi"}])
    ref = greedy_reference(t, ids, NEW)
    assert len(ref) == NEW and len(ids) + NEW >= 3 * window  # no early stop: the run goes past the window
    torch.manual_seed(0)
    drafter = new_drafter(t, num_layers=1, block_size=4, target_layer_ids=t.default_layer_ids(1)).eval()
    wrong = {len(ids) + k for k in (3, 7, 8, 13, 20, 26)}  # planted mistakes: part of a block is accepted
    proposers = {"random": DFlashProposer(t, drafter)}
    for B in (4, 12):
        proposers[f"oracle-{B}"] = Oracle(ids + ref + [0] * B, B, t.vocab_size, wrong, t.default_layer_ids(1))
    for name, proposer in proposers.items():
        for method in METHODS if name == "random" else [m for m in METHODS if m not in DRAFTERLESS]:
            g = generate(t, ids, method, proposer, max_new_tokens=NEW, cost=COST)
            assert g.tokens == ref, (t.name, name, method, g.accepted)
            if name == "oracle-12" and method == "chain":  # rolled back often, accepted past the window
                assert min(g.accepted) < 12 and max(g.accepted) > window, g.accepted


@pytest.mark.slow  # 11 s of make test-fast's 60 on 2 cores; make test runs it
@pytest.mark.parametrize("kind", ["gpt_oss", "gemma4", "gemma4_e"])
def test_sliding_families_decode_every_method_exactly_past_the_window(root, kind):
    check_every_method(load_target(make_tiny_target(kind, root / kind), device="cpu", dtype="float32"))


@pytest.mark.parametrize("make", [qwen3_sliding, mistral_sliding], ids=["qwen3-layer-types", "mistral-one-mask"])
def test_sliding_layouts_decode_exactly(root, make):
    """Both ways a model takes its masks: one per layer type (a dict on the verify), or one for all layers."""
    cfg = make()
    t = load_target(sliding_folder(cfg, root / cfg.model_type), device="cpu", dtype="float32")
    check_every_method(t)


def test_tree_mask_window_is_plain_decodings_window():
    """Along every root-to-leaf path the windowed tree mask is transformers' own sliding-window mask of that path's
    sequence (past positions, then the path's nodes); nodes off the path stay hidden."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    torch.manual_seed(0)
    logits = torch.randn(11, 5)
    logits[:, 0] += 4  # a confident drafter: a deep main path with branches off it
    tree = build_tree(logits, 24)
    past, window = 6, 4
    assert int(tree.depths.max()) > window  # the window cuts inside the tree too
    seen = attention_mask(tree, past, torch.float32, "cpu", window=window)[0, 0] == 0
    parents = tree.parents.tolist()
    for leaf in set(range(len(tree))) - set(parents):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        cols = list(range(past)) + [past + node for node in path]
        want = sdpa_mask(1, q_length=len(path), kv_length=past + len(path), q_offset=past, allow_is_causal_skip=False,
                         mask_function=sliding_window_causal_mask_function(window))[0, 0]
        assert torch.equal(seen[path][:, cols], want), path
        assert seen[path].sum() == want.sum()  # nothing visible outside the path


def test_verify_mask_per_layout():
    """A non-sliding target keeps its one ancestor mask; sliding ones get the windowed mask where it applies."""
    tree = Tree(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1]), torch.tensor([-1, 0, 0]), torch.zeros(3))
    full = attention_mask(tree, 20, torch.float32, "cpu")
    windowed = attention_mask(tree, 20, torch.float32, "cpu", window=8)
    fake = lambda cfg: SimpleNamespace(config=cfg, dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(verify_mask(fake(tiny_config("llama")), tree, 20), full)
    masks = verify_mask(fake(qwen3_sliding()), tree, 20, window=8)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(masks["full_attention"], full) and torch.equal(masks["sliding_attention"], windowed)
    assert torch.equal(verify_mask(fake(mistral_sliding()), tree, 20, window=8), windowed)


def test_target_kv_keeps_every_position_of_sliding_layers(root):
    """The old refusal is gone: sliding layers become full ones, still marked sliding, that crop_kv can cut."""
    from transformers import DynamicCache

    t = load_target(make_tiny_target("gpt_oss", root / "gpt_oss"), device="cpu", dtype="float32")
    kv = new_target_kv(t)
    assert kv.is_sliding == DynamicCache(config=t.config).is_sliding == [True, False, True, False, True]
    n = 3 * t.config.sliding_window + 5
    t.forward(torch.arange(3, 3 + n)[None], past_key_values=kv)
    assert [layer.keys.shape[2] for layer in kv.layers] == [n] * 5
    crop_kv(kv, n - 7)
    assert [layer.keys.shape[2] for layer in kv.layers] == [n - 7] * 5 and kv.get_seq_length() == n - 7


@pytest.mark.parametrize("kind", KINDS)
def test_target_kv_of_non_sliding_targets_is_unchanged(kind):
    from transformers import DynamicCache

    cfg = tiny_config(kind)
    kv = new_target_kv(SimpleNamespace(config=cfg, name=kind))
    assert [type(x) for x in kv.layers] == [type(x) for x in DynamicCache(config=cfg).layers]
    assert not any(kv.is_sliding)


def test_chunked_attention_is_still_refused():
    from transformers import Llama4TextConfig

    cfg = Llama4TextConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
                           attention_chunk_size=8)
    with pytest.raises(DFlashError, match=r"llama4 .*chunked .*layers \[0, 1, 2\]"):
        new_target_kv(SimpleNamespace(config=cfg, name="llama4"))


def test_row_invariant_attention_keeps_sinks_and_softcap():
    """Inside the row-invariant kernels gpt-oss's attention sinks and Gemma 2's soft-capping run as their own eager
    code does (in float64, rounded once), and a bf16 query's output no longer depends on the keys masked beside it."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    from dflashkit.targets.invariant import RowInvariantKernels

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, sinks=torch.randn(4), training=False, head_dim=8)
    for q_len in (1, 3):
        q, k, v = torch.randn(1, 4, q_len, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
        mask = torch.zeros(1, 1, q_len, 9).masked_fill_(torch.rand(1, 1, q_len, 9) < 0.3, torch.finfo(torch.float32).min)
        for eager, extra in ((gpt_oss_eager, {}), (gemma2_eager, {"softcap": 2.0})):
            want = eager(module, q, k, v, mask, scaling=0.5, **extra)[0]
            with RowInvariantKernels():
                got = eager(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16(), scaling=0.5, **extra)[0]
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)  # bf16 inputs, rounded once
    # one query alone with its keys, and the same query beside three more with theirs masked: the same bf16 output
    q, k, v = torch.randn(1, 4, 4, 8).bfloat16(), torch.randn(1, 2, 12, 8).bfloat16(), torch.randn(1, 2, 12, 8).bfloat16()
    mask = torch.zeros(1, 1, 4, 12)
    for i in range(4):
        mask[..., i, 9 + i:] = torch.finfo(torch.bfloat16).min
    module.sinks = module.sinks.bfloat16()
    for eager, extra in ((gpt_oss_eager, {}), (gemma2_eager, {"softcap": 2.0})):
        with RowInvariantKernels():
            block = eager(module, q, k, v, mask.bfloat16(), scaling=0.5, **extra)[0]
            for i in range(4):
                alone = eager(module, q[:, :, i : i + 1], k[:, :, : 9 + i], v[:, :, : 9 + i], None, scaling=0.5, **extra)[0]
                assert torch.equal(alone[0, 0], block[0, i]), (eager.__module__, i)
