"""Compiled linears (target/compiled.py): swapped in for decoding only, row-invariant, and speculative decoding on
them equals plain greedy decoding on them token for token."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode.bench import run_bench
from dflashkit.decode.speculative import DFlashProposer, generate
from dflashkit.drafter.checkpoint import new_drafter
from dflashkit.errors import DFlashError
from dflashkit.targets import compiled
from dflashkit.targets.compiled import CompiledUnit, choose_kernels, compiled_linears
from dflashkit.targets.invariant import row_invariant
from tiny_targets import make_tiny_target
from dflashkit.targets.model import load_target
from helpers import Oracle, greedy_reference

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group(name="compiled")]  # one compile (~30 s)


@pytest.fixture(scope="module")
def compiled_target(tmp_path_factory):
    """Two decoder layers (a random drafter reads the first, allowed here: the test is of the kernels, not of
    what a drafter learns): every compiled half is compiled once per layer."""
    folder = make_tiny_target("llama", tmp_path_factory.mktemp("compiled") / "llama", num_layers=2)
    return load_target(folder, device="cpu", dtype="float32", kernels="compiled")


def test_auto_compiles_only_large_float32_cpu_targets_and_compiled_refuses_others(tiny_dirs, tiny_targets):
    llama = tiny_targets["llama"]
    assert choose_kernels(llama.model, "auto") == "eager"  # a tiny model: the compile would cost more than it saves
    assert choose_kernels(llama.model, "compiled") == "compiled" and llama.kernels == "eager"
    with pytest.raises(DFlashError, match="--kernels 'fast'"):
        choose_kernels(llama.model, "fast")
    bf16 = load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16")
    with pytest.raises(DFlashError, match="only a float32 CPU target"):
        choose_kernels(bf16.model, "compiled")
    with pytest.raises(DFlashError, match="Llama-style layers"):
        choose_kernels(tiny_targets["qwen3_5"].model, "compiled")


def _each_row_alone(fn, *rows):
    """fn over all rows, and over each row alone, concatenated (fn returns one tensor or a tuple of them). The rows
    go in as the model's forward passes them: compiled._rows marks them dynamic."""
    def parts(out):
        return out if isinstance(out, tuple) else (out,)
    together = parts(fn(*map(compiled._rows, rows)))
    alone = [parts(fn(*(compiled._rows(r[i:i + 1]) for r in rows))) for i in range(rows[0].shape[0])]
    return together, tuple(torch.cat(col) for col in zip(*alone))


def test_llama_layers_run_as_two_compiled_halves_for_decoding_only_and_every_row_as_if_alone(compiled_target):
    model = compiled_target.model
    layer, g = model.model.layers[0], torch.Generator().manual_seed(0)
    x, a = torch.randn(2, 7, compiled_target.hidden_size, generator=g)  # a layer's input rows, its attention's output
    head_dim = layer.self_attn.head_dim
    cos, sin = torch.randn(7, head_dim, generator=g), torch.randn(7, head_dim, generator=g)
    stock = layer.mlp(layer.post_attention_layernorm(x + layer.self_attn.o_proj(a))) + x + layer.self_attn.o_proj(a)
    with row_invariant(model) as switched:
        fused = compiled._units(model)[0][0]
        assert switched and "forward" in layer.__dict__ and isinstance(model.lm_head, CompiledUnit)
        with compiled_linears(model):  # nested: a no-op
            assert "forward" in layer.__dict__
        assert "forward" in layer.__dict__
        for fn, rows in ((fused.before, (x, cos, sin)), (fused.after, (x, a)), (model.lm_head, (x,))):
            together, alone = _each_row_alone(fn, *rows)
            assert all(torch.equal(t, a) for t, a in zip(together, alone))  # bitwise: one kernel for any rows
        x = compiled._rows(x)
        torch.testing.assert_close(fused.after(x, compiled._rows(a)), stock, atol=1e-5, rtol=1e-5)
        q = layer.self_attn.q_proj(layer.input_layernorm(x)).view(7, -1, head_dim)
        rotated = q * cos[:, None] + torch.cat((-q[..., head_dim // 2:], q[..., :head_dim // 2]), -1) * sin[:, None]
        torch.testing.assert_close(fused.before(x, *map(compiled._rows, (cos, sin)))[0], rotated, atol=1e-5, rtol=1e-5)
    assert "forward" not in layer.__dict__ and type(model.lm_head) is torch.nn.Linear
    assert not any("inner" in k for k in model.state_dict())


def test_other_layouts_get_one_compiled_unit_per_linear_for_any_batch_of_rows(tiny_dirs):
    target = load_target(tiny_dirs["qwen3"], device="cpu", dtype="float32", kernels="compiled")
    first = target.model.model.layers[0].self_attn
    x = torch.randn(2, 3, target.hidden_size, generator=torch.Generator().manual_seed(0))
    with row_invariant(target.model):
        assert isinstance(first.q_proj, CompiledUnit)
        together, alone = _each_row_alone(first.q_proj, x.reshape(6, -1))
        assert torch.equal(together[0], alone[0])
        assert torch.equal(first.q_proj(x), together[0].view(2, 3, -1))  # a batch of sequences: the same rows
        torch.testing.assert_close(first.q_proj(x), torch.nn.functional.linear(x, first.q_proj.inner.weight),
                                   atol=1e-5, rtol=1e-5)
    assert type(first.q_proj) is torch.nn.Linear


def test_speculative_decoding_on_compiled_kernels_equals_plain_greedy_decoding_on_them(compiled_target):
    target = compiled_target
    torch.manual_seed(0)
    proposer = DFlashProposer(target, new_drafter(target, num_layers=1, target_layer_ids=[0], block_size=6,
                                                   allow_final_layers=True).eval())
    for text in ("hello world", "def add(a, b):"):
        ids = target.chat_ids([{"role": "user", "content": text}])
        with row_invariant(target.model):
            ref = greedy_reference(target, ids, 20, set(target.stop_token_ids))
            seq = ids + ref + greedy_reference(target, ids + ref, 8)
        oracle = Oracle(seq, 6, target.vocab_size, wrong={len(ids) + k for k in (3, 5, 9)})
        assert generate(target, ids, "ar", max_new_tokens=20).tokens == ref
        for method in ("chain", "ddtree-8", "ngram", "hybrid-8"):
            assert generate(target, ids, method, proposer, max_new_tokens=20).tokens == ref, (text, method)
        assert generate(target, ids, "ddtree-12", oracle, max_new_tokens=20).tokens == ref


def test_bench_times_the_stock_baseline_too_and_measures_speedups_against_the_faster(compiled_target):
    from dflashkit.prompts import PromptItem

    target = compiled_target
    two_turns = PromptItem("c", ({"role": "user", "content": "count to ten"}, {"role": "user", "content": "and back"}))
    result = run_bench(target, None, [("c", two_turns)], ["ar", "ngram", "prompt-lookup"], max_new_tokens=12,
                       warmup=False, progress=False)
    methods = result["methods"]
    assert set(methods) == {"ar", "ar-stock", "ngram", "prompt-lookup"} and not result["mismatches"]
    assert result["config"]["turns"]["c"] == 2  # every method, the peers on compiled kernels too, answered both
    fastest = max(methods["ar"]["tokens_per_s"], methods["ar-stock"]["tokens_per_s"])
    assert methods["ngram"]["speedup_vs_ar"] == pytest.approx(methods["ngram"]["tokens_per_s"] / fastest)


def test_a_prefill_and_a_verify_on_compiled_kernels_match_the_stock_forward(compiled_target):
    """Two compiled halves and their own attention call restate the layer: a prefill (causal, no mask) and a
    4-token step after it (a mask over the cache) give the stock logits to float32 rounding."""
    from dflashkit.decode.speculative import new_target_kv

    t = compiled_target
    ids = torch.randint(0, t.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))

    def two_calls():
        kv = new_target_kv(t)
        return (t.forward(ids[:, :8], past_key_values=kv).logits,
                t.forward(ids[:, 8:], past_key_values=kv, position_ids=torch.arange(8, 12)[None]).logits)

    stock = two_calls()
    with row_invariant(t.model):
        ours = two_calls()
    for s, o in zip(stock, ours):
        torch.testing.assert_close(o, s, atol=1e-4, rtol=1e-4)
