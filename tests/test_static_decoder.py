"""The static decoder (issue 38): the Llama step written out over a static KV cache. Its logits are transformers'
own (float32), its greedy output is our `ar`'s, a target it cannot run is refused by name, and `bench` runs it as
`ar-static`, recording how it compares with `ar`. The compiled steps are timed by benchmarks, not here: these
tests run the same step eagerly (compiling costs a minute)."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode import bench
from dflashkit.decode.speculative import generate
from dflashkit.decode.static import StaticDecoder, generate_static_ar, linear_reduce
from dflashkit.errors import DFlashError
from dflashkit.target.fixtures import make_tiny_target
from dflashkit.target.model import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


def prompt(t):
    return t.chat_ids([{"role": "user", "content": "def add(a, b): return a + b  # and more text"}])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_logits_are_transformers_own(tiny_targets, kind):
    """Prompts shorter and longer than the 32-token chunk, then steps of one token: the last position's logits
    (what decoding reads), 1e-5 in float32."""
    t = tiny_targets[kind]
    ids = prompt(t)
    assert len(ids) > 32
    want = t.model(torch.tensor([ids])).logits[0]
    for n in (20, 32, len(ids) - 3):
        d = StaticDecoder(t, 128, compile=False)
        torch.testing.assert_close(d.forward(ids[:n], 0), want[n - 1], atol=1e-5, rtol=1e-5)
        for i in range(n, len(ids)):
            torch.testing.assert_close(d.forward(ids[i:i + 1], i), want[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_output_is_ar(tiny_targets, kind):
    t = tiny_targets[kind]
    ids = prompt(t)
    want = generate(t, ids, "ar", max_new_tokens=40).tokens
    got = generate_static_ar(StaticDecoder(t, 128, compile=False), ids, 40)
    assert got.tokens == want and got.method == "ar-static"


def test_one_token_logits_do_not_depend_on_the_chunk_it_shares(tiny_targets):
    """Row invariance of the step on reduction linears: a token's logits alone equal its row of a wider forward,
    bit for bit (the prompt's chunks use mm by default; here both widths use reductions)."""
    t = tiny_targets["llama"]
    ids = prompt(t)[:20]
    d = StaticDecoder(t, 64, prefill_linear="reduce", compile=False)
    wide = d.forward(ids, 0)
    d.forward(ids[:-1], 0)
    torch.testing.assert_close(d.forward(ids[-1:], len(ids) - 1), wide, rtol=0, atol=0)


def test_linear_reduce_is_a_matmul():
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    torch.testing.assert_close(linear_reduce(x, w), (x.double() @ w.double().T).float(), atol=1e-5, rtol=1e-5)


def test_a_run_past_its_length_is_refused(tiny_targets):
    d = StaticDecoder(tiny_targets["llama"], 16, compile=False)
    with pytest.raises(DFlashError, match="past its length 16.*larger max_len"):
        d.forward(list(range(10)), 10)


def test_other_families_are_refused_by_name(tmp_path):
    t = load_target(make_tiny_target("gpt_oss", tmp_path / "g"), device="cpu", dtype="float32")
    with pytest.raises(DFlashError, match=r"gpt_oss.*dense-attention Llama-type.*use method 'ar'"):
        StaticDecoder(t, 64, compile=False)


def test_bench_runs_ar_static_beside_ar(tiny_targets, monkeypatch):
    """ar-static is a plain baseline in bench: timed, never held to ar's lossless check, its parting recorded."""
    t = tiny_targets["llama"]
    monkeypatch.setattr(bench, "decoder_for", lambda target, state, n: StaticDecoder(target, 128, compile=False))
    ids = [("a", prompt(t)), ("b", prompt(t)[:-3])]
    res = bench.run_bench(t, None, ids, ["ar", "ar-static"], max_new_tokens=10, progress=False, warmup=False)
    s = res["methods"]["ar-static"]
    assert s["tokens_per_s"] > 0 and s["ar_parting"] == {"equal": 2, "prompts": 2, "parts_at": {}}
    assert res["mismatches"] == []


def test_ar_static_is_greedy_only(tiny_targets):
    from dflashkit.decode.sampling import Sampling

    with pytest.raises(DFlashError, match="ar-static decodes greedily.*needs method ar"):
        bench.run_bench(tiny_targets["llama"], None, [("a", [1, 2, 3])], ["ar", "ar-static"], progress=False,
                        sampling=Sampling(temperature=0.7))


def test_cli_generate_runs_ar_static(tiny_dirs, monkeypatch, capsys):
    """`dflashkit generate --method ar-static` answers as `--method ar` does (float32, the step run eagerly)."""
    import json

    import dflashkit.decode.static as static
    from dflashkit.cli import main

    real = static.StaticDecoder
    monkeypatch.setattr(static, "StaticDecoder", lambda t, n, **kw: real(t, n, compile=False))
    out = {}
    for method in ("ar", "ar-static"):
        assert main(["generate", "--target", str(tiny_dirs["llama"]), "--prompt", "hello there", "--method", method,
                     "--max-new-tokens", "12", "--json", "--dtype", "float32"]) == 0
        out[method] = json.loads(capsys.readouterr().out)[0]
    assert out["ar-static"]["tokens"] == out["ar"]["tokens"] and out["ar-static"]["method"] == "ar-static"
