"""Compiled linears (target/compiled.py): swapped in for decoding only, row-invariant, and speculative decoding on
them equals plain greedy decoding on them token for token."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode.bench import run_bench
from dflashkit.decode.speculative import DFlashProposer, generate
from dflashkit.drafter.checkpoint import new_drafter
from dflashkit.errors import DFlashError
from dflashkit.target.compiled import CompiledUnit, choose_kernels, compiled_linears
from dflashkit.target.invariant import row_invariant
from dflashkit.target.model import load_target
from helpers import Oracle, greedy_reference

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # compiling takes about 30 s


@pytest.fixture(scope="module")
def compiled_target(tiny_dirs):
    return load_target(tiny_dirs["llama"], device="cpu", dtype="float32", kernels="compiled")


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


def test_units_are_swapped_in_for_decoding_only_and_compute_every_row_as_if_alone(compiled_target):
    model = compiled_target.model
    first = model.model.layers[0].self_attn
    with row_invariant(model) as switched:
        assert switched and isinstance(first.q_proj, CompiledUnit) and isinstance(model.lm_head, CompiledUnit)
        with compiled_linears(model):  # nested: a no-op
            assert isinstance(first.q_proj, CompiledUnit)
        x = torch.randn(7, compiled_target.hidden_size, generator=torch.Generator().manual_seed(0))
        rows = first.q_proj(x)
        alone = torch.cat([first.q_proj(x[i:i + 1]) for i in range(7)])
        mlp = model.model.layers[0].mlp
        assert torch.equal(rows, alone)  # bitwise: one compiled kernel for every number of rows
        assert torch.equal(mlp(x), torch.cat([mlp(x[i:i + 1]) for i in range(7)]))
        torch.testing.assert_close(rows, torch.nn.functional.linear(x, first.q_proj.inner.weight), atol=1e-5, rtol=1e-5)
    assert type(first.q_proj) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    assert not any("inner" in k for k in model.state_dict())


def test_speculative_decoding_on_compiled_kernels_equals_plain_greedy_decoding_on_them(compiled_target):
    target = compiled_target
    torch.manual_seed(0)
    proposer = DFlashProposer(target, new_drafter(target, num_layers=1, block_size=6).eval())
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
