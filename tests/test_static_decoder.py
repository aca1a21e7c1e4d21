"""The static decoder (issue 38): the Llama step written out over a static KV cache. Its logits are transformers'
own (float32), its greedy output is our `ar`'s, a target it cannot run is refused by name, and `bench` runs it as
the static backend (`--engine static`), recording how it compares with hf. The compiled steps are timed by benchmarks, not here: these
tests run the same step eagerly (compiling costs a minute)."""

from __future__ import annotations

import copy

import pytest
import torch

from dflashkit.measure import bench
from dflashkit.decode.session import DecodeSession
from dflashkit.decode.speculative import generate, generate_ar, generate_chain, generate_tree
from dflashkit.decode import native, static
from dflashkit.decode.static import (StaticDecoder, attend_mm, attend_native, attend_reduce, StaticBackend,
                                     linear_native, linear_reduce, linear_tiles, panel_order,
                                     tile_order)
from dflashkit.errors import DFlashError
from tiny_targets import make_tiny_target
from dflashkit.targets.model import load_target
from helpers import eager_decoders, exercised_levels

pytestmark = pytest.mark.usefixtures("one_thread")
AMX = native.tiles_run_here()
needs_amx = pytest.mark.skipif(not AMX, reason="the tile kernels need a CPU with AMX (amx_bf16)")
# Every ISA level this machine runs (v3 and portable on any x86-64, v4 with AVX-512), and v3 built with Zen 1-3's
# tuning planted (GCC's avoid-fma-max-bits: single-chain loops left unfused where fusion is merely allowed): the
# exactness tests hold on each, so a green run here is green on the CPUs of those levels
BUILDS = [pytest.param((lv, None), id=lv) for lv in exercised_levels()] + \
    ([pytest.param(("v3", "znver3"), id="v3-znver3")] if "v3" in exercised_levels() else [])


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
    got = generate_ar(StaticBackend(StaticDecoder(t, 128, compile=False)), ids, 40)
    assert got.tokens == want and (got.method, got.engine) == ("ar", "static")


def verify_against_steps(d, ids):
    d.prefill(ids[:-4])
    logits, _ = d.verify(torch.tensor(ids[-4:]), len(ids) - 4)
    return logits, torch.stack([d.forward(ids[i:i + 1], i) for i in range(len(ids) - 4, len(ids))])


@pytest.mark.parametrize("kernels", [*(pytest.param(("native", b.values[0]), id=f"native-{b.id}") for b in BUILDS),
                                     ("reduce", (None, None)),
                                     pytest.param(("tiles", ("v4", None)), id="tiles", marks=needs_amx)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verify_row_is_the_one_token_step(tiny_dirs, dtype, kernels):
    """Row invariance, what chain-static's exactness rests on: each row of a 4-token verify equals one-token steps
    over the same tokens, bit for bit, where the step holds the earlier rows' keys in committed slots (eager steps
    here; the compiled program is held to it in test_engine.py). On every level's build, and the planted tuning."""
    kernels, (level, tune) = kernels
    if kernels == "tiles" and dtype == "float32":
        pytest.skip("the tile kernels read bf16 weights")
    t = load_target(tiny_dirs["llama"], device="cpu", dtype=dtype)
    d = StaticDecoder(t, 128, kernels=kernels, compile=False, layer_ids=[1, 2], verify_width=4, level=level, tune=tune)
    logits, steps = verify_against_steps(d, prompt(t))
    torch.testing.assert_close(logits, steps, rtol=0, atol=0)


def test_linear_reduce_is_a_matmul():
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    torch.testing.assert_close(linear_reduce(x, w), (x.double() @ w.double().T).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_linear_is_a_matmul_and_row_invariant(dtype):
    """The C++ linear (weights in panel order) against a float64 product, over inputs in one pass and in several (its
    passes of 128 inputs) and outputs in whole panels and not (the last outs % 16 summed in scalars); and each row of
    a call with 1..17 rows (the one-row path, blocks of rows and their even splits) equals that row alone, bit for
    bit, with the leading dims kept."""
    native.load()
    for k, outs in ((40, 37), (200, 600), (300, 208)):
        x, w = torch.randn(17, k), torch.randn(outs, k).to(dtype)
        y = linear_native(x, panel_order(w))
        torch.testing.assert_close(y, (x.double() @ w.double().T).float(), atol=2e-5, rtol=1e-5)
        for n in range(1, 18):
            assert torch.equal(linear_native(x[:n], panel_order(w)), y[:n]), (k, n)
        assert torch.equal(linear_native(x[None, 2:7], panel_order(w))[0], y[2:7])


def test_panel_order_puts_each_16_outputs_input_major():
    w = torch.arange(40 * 3).reshape(40, 3)  # 2 panels of 16 and 8 outputs left
    flat = panel_order(w).reshape(-1)
    assert flat[:16].tolist() == w[:16, 0].tolist() and flat[16:32].tolist() == w[:16, 1].tolist()
    assert flat[48:64].tolist() == w[16:32, 0].tolist()
    assert flat[96:].tolist() == w[32:].t().reshape(-1).tolist()


def test_the_native_attention_is_softmax_attention_and_each_row_its_own():
    """dflashkit::attend against attention written plainly (float64) over each row's keys: the committed slots, then
    its tree path. head_dim 64 and 128 take the batched scores, 48 the per-key dots; 9 query heads over 3 KV heads.
    And each row of the tree equals that row attended alone, bit for bit: a call's queries share blocks of K and V
    in tasks whose size depends on the rows, not what a row computes."""
    native.load()
    parents = [-1, 0, 0, 1, 1, 2, 5]  # a 7-node tree, parents before children
    chains = []
    for node, parent in enumerate(parents):
        chains.append((chains[parent] if parent >= 0 else []) + [node])
    for hd, start in ((64, 37), (128, 5), (48, 20), (64, 0)):
        kc, vc = torch.randn(1, 3, 60, hd), torch.randn(1, 3, 60, hd)
        q = torch.randn(1, 9, 7, hd)
        path = torch.full((7, 4), -1, dtype=torch.long)
        for r, chain in enumerate(chains):
            path[r, : len(chain)] = start + torch.tensor(chain)
        out = attend_native(q, kc, vc, torch.tensor([start]), path)
        for h in range(9):
            for r, chain in enumerate(chains):
                keys = list(range(start)) + [start + n for n in chain]
                k, v = kc[0, h // 3, keys].double(), vc[0, h // 3, keys].double()
                want = torch.softmax(k @ q[0, h, r].double() / hd ** 0.5, 0) @ v
                torch.testing.assert_close(out[0, h, r].double(), want, atol=1e-5, rtol=1e-5)
        for r in range(7):
            alone = attend_native(q[:, :, r : r + 1], kc, vc, torch.tensor([start]), path[r : r + 1])
            assert torch.equal(alone, out[:, :, r : r + 1]), (hd, r)


@needs_amx
def test_the_tile_linear_is_a_matmul_and_row_invariant():
    """The AMX linear (bf16 weights in tile order, x split into two bf16 parts: 16 significant bits) against a
    float64 product, within 2^-13 of the sum of |x w| (the split's 2^-14 and float32 sums) and far closer than x
    rounded to bf16; each row of a call with 1..20 rows (a block of 16 and the rest) equals that row alone, bit for
    bit; and it refuses shapes that do not tile."""
    native.load()
    for k in (64, 576):
        x, w = torch.randn(20, k) * 3, torch.randn(48, k).bfloat16()
        y = linear_tiles(x, tile_order(w))
        want = x.double() @ w.double().T
        assert ((y.double() - want).abs() <= 2 ** -13 * (x.double().abs() @ w.double().abs().T)).all()
        one_part = x.bfloat16().double() @ w.double().T
        assert (y.double() - want).abs().max() < (one_part - want).abs().max() / 16
        for n in (1, 2, 5, 15, 16, 17):
            assert torch.equal(linear_tiles(x[:n], tile_order(w)), y[:n]), (k, n)
        assert torch.equal(linear_tiles(x[None, 3:9], tile_order(w))[0], y[3:9])
    with pytest.raises(RuntimeError, match="tiles need outputs in 16s and inputs in 32s"):
        linear_tiles(torch.randn(2, 40), torch.randn(16, 40).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        linear_tiles(torch.randn(2, 64), torch.randn(16, 64))


def test_auto_kernels_are_tiles_where_they_run_and_native_elsewhere(tiny_dirs):
    bf16 = load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16")
    f32 = load_target(tiny_dirs["llama"], device="cpu", dtype="float32")
    assert StaticDecoder(bf16, 64, compile=False).kernels == ("tiles" if AMX else "native")
    assert StaticDecoder(f32, 64, compile=False).kernels == "native"
    with pytest.raises(DFlashError, match="kernels 'tiles' need bf16 weights.*use kernels='native'"):
        StaticDecoder(f32, 64, compile=False, kernels="tiles")


def native_outputs(ops) -> dict:
    """A level's linears over float32 and bf16 weights (lengths on and off the 64 lanes, outputs on and off the
    16-wide panels) and attention over a chain's paths, on fixed inputs."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for k in (40, 128, 200, 576):
            x, w = torch.randn(17, k, generator=g), torch.randn(200, k, generator=g).to(dtype)
            out[f"linear-{dtype}-{k}"] = ops.linear(x, panel_order(w))
    for hd in (64, 48):
        q, kc, vc = (torch.randn(1, h, n, hd, generator=g) for h, n in ((6, 3), (2, 40), (2, 40)))
        path = torch.tensor([[20, -1, -1], [20, 21, -1], [20, 21, 22]])
        out[f"attend-{hd}"] = ops.attend(q, kc, vc, torch.tensor([20]), path)
    return out


@pytest.mark.parametrize("build", [b for b in BUILDS if b.id != "v3"])
def test_every_level_computes_the_v3_bits(build):
    """Issue 68: every build sums each dot and each attention row in one order, every product-sum fused by name, so
    v4 (16 lanes), portable (no intrinsics) and v3 with Zen's tuning planted give v3's bits."""
    theirs = native_outputs(native.ops(*build))
    mine = native_outputs(native.ops("v3"))
    assert set(mine) == set(theirs) and len(mine) == 10
    for name, value in mine.items():
        assert torch.equal(value, theirs[name]), name


@pytest.mark.parametrize("build", [b for b in BUILDS if b.id != "v3"])
def test_a_model_level_verify_is_the_same_on_every_level(tiny_dirs, build):
    """The whole step: a 4-token verify's logits and features over the tiny target at v3 and at each other build."""
    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32")
    got = []
    for level, tune in (("v3", None), build):
        d = StaticDecoder(t, 128, kernels="native", compile=False, layer_ids=[1, 2], verify_width=4, level=level,
                          tune=tune)
        ids = prompt(t)
        d.prefill(ids[:-4])
        got.append(d.verify(torch.tensor(ids[-4:]), len(ids) - 4))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_the_native_linear_refuses_what_it_does_not_compute():
    native.load()
    for x, w, says in [(torch.randn(2, 8).double(), torch.randn(4, 8), "x must be float32"),
                       (torch.randn(2, 8), torch.randn(4, 8).half(), "use bfloat16 or float32"),
                       (torch.randn(2, 8), torch.randn(4, 6), "x has 8 inputs, w 6"),
                       (torch.randn(2, 8), torch.randn(8, 4).t(), "contiguous")]:
        with pytest.raises(RuntimeError, match=says):
            linear_native(x, w)


def test_both_attentions_are_softmax_attention_over_the_unmasked_slots():
    """The reductions (decode, verify) and the matrix products (prompt chunks) against attention written plainly:
    grouped heads (6 query heads over 2 KV heads), a causal mask past each query's position."""
    q, k, v = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    pos = torch.tensor([4, 5, 6])
    mask = torch.arange(10)[None, :] <= pos[:, None]
    kk, vv = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    want = torch.stack([torch.stack([(torch.softmax(q[0, h, i] @ kk[0, h, : p + 1].T / 8 ** 0.5, -1)
                                      @ vv[0, h, : p + 1]) for i, p in enumerate(pos.tolist())]) for h in range(6)])
    for attend in (attend_reduce, attend_mm):
        torch.testing.assert_close(attend(q, k, v, mask, 2)[0], want, atol=1e-5, rtol=1e-5)


def test_decoders_of_one_geometry_share_one_compiled_step(tiny_targets, tiny_dirs):
    """A decoder rebuilt longer (or a second one) reuses the compiled step: dynamo keeps 8 entries per function,
    so a copy per decoder failed the third rebuild (nothing compiles here: torch.compile is lazy)."""
    t = tiny_targets["llama"]
    a, b = StaticDecoder(t, 64), StaticDecoder(t, 128, layer_ids=[1], verify_width=4)
    assert a.steps[1] is b.steps[1] and a.steps[32] is not b.steps[32]  # the prompt step: + features
    assert StaticDecoder(t, 512, layer_ids=[1], verify_width=4).steps == b.steps
    other = load_target(tiny_dirs["qwen3"], device="cpu", dtype="float32")
    assert StaticDecoder(other, 64).steps[1] is not a.steps[1]


def test_warm_up_runs_as_decoding_does_without_grad(tiny_targets, monkeypatch):
    """Grad mode is in dynamo's guards: a warm-up with it on compiled every width a second time at its first use."""
    d = StaticDecoder(tiny_targets["llama"], 64, compile=False)
    seen = []
    monkeypatch.setattr(d, "_call", lambda width, *a: seen.append((width, torch.is_grad_enabled())))
    assert torch.is_grad_enabled()
    d.warm()
    assert set(seen) == {(1, False), (32, False)}


def test_biases_the_step_does_not_compute_are_refused(tiny_dirs, tmp_path):
    """Llama with attention_bias puts one on o_proj too, which the step leaves out: refused, not computed wrong."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(tiny_dirs["llama"], tmp_path / "b")
    cfg = AutoConfig.from_pretrained(tmp_path / "b")
    cfg.attention_bias = True
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "b")
    t = load_target(tmp_path / "b", device="cpu", dtype="float32")
    with pytest.raises(DFlashError, match="attention_bias.*o_proj.*--engine hf"):
        StaticDecoder(t, 16, compile=False)


def test_a_run_past_its_length_is_refused(tiny_targets):
    d = StaticDecoder(tiny_targets["llama"], 16, compile=False)
    with pytest.raises(DFlashError, match="past its length 16.*larger max_len"):
        d.forward(list(range(10)), 10)


def test_other_families_are_refused_by_name(tmp_path):
    t = load_target(make_tiny_target("gpt_oss", tmp_path / "g"), device="cpu", dtype="float32")
    with pytest.raises(DFlashError, match=r"model_type = 'gpt_oss'.*dense-attention Llama-type.*--engine hf"):
        StaticDecoder(t, 64, compile=False)


def test_bench_runs_plain_decoding_on_both_engines(tiny_targets, monkeypatch):
    """`--engine static` runs ar on the static backend and brings the reference backend's ar along (ar@hf): timed,
    its parting from hf recorded, every row naming its engine."""
    t = tiny_targets["llama"]
    eager_decoders(monkeypatch)
    ids = [("a", prompt(t)), ("b", prompt(t)[:-3])]
    res = bench.run_bench(t, None, ids, ["ar"], max_new_tokens=10, progress=False, warmup=False, predict=False, engine="static")
    assert list(res["methods"]) == ["ar", "ar@hf"]
    assert res["config"]["backends"] == {"ar": "static", "ar@hf": "hf"}
    s = res["methods"]["ar"]
    assert s["backend"] == "static" and s["tokens_per_s"] > 0
    assert s["ar_parting"] == {"equal": 2, "prompts": 2, "parts_at": {}, "against": "ar@hf"}
    assert res["mismatches"] == [] and {r["backend"] for r in res["runs"]} == {"static", "hf"}
    # a second suite of the run (the demo's held-out one) can leave the reference rows out
    res = bench.run_bench(t, None, ids, ["ar", "ngram"], max_new_tokens=10, progress=False, warmup=False, predict=False,
                          engine="static", references=False)
    assert res["config"]["backends"] == {"ar": "static", "ngram": "static"} and res["mismatches"] == []


def test_cli_generate_runs_ar_and_a_tree_on_the_static_engine(tiny_dirs, monkeypatch, capsys):
    """`dflashkit generate --method ar --engine static` (and ngram) answers as the hf engine does (float32, the
    steps run eagerly), and says which engine ran; an old NAME-static gets one line naming the new spelling."""
    import json

    from dflashkit.cli import main

    eager_decoders(monkeypatch)
    out = {}
    base = ["generate", "--target", str(tiny_dirs["llama"]), "--prompt", "hello there", "--max-new-tokens", "12",
            "--json", "--dtype", "float32"]
    for method, engine in (("ar", "hf"), ("ar", "static"), ("ngram", "static")):
        assert main(base + ["--method", method, "--engine", engine]) == 0
        out[method, engine] = json.loads(capsys.readouterr().out)[0]
    for key in (("ar", "static"), ("ngram", "static")):
        assert out[key]["tokens"] == out["ar", "hf"]["tokens"] and out[key]["engine"] == "static"
    assert out["ar", "hf"]["engine"] == "hf"
    assert main(base + ["--method", "ar-static"]) == 2
    assert "method 'ar-static': the backend is its own option now; use --method ar --engine static" in \
        capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chain_on_the_static_steps_is_ar_static_token_for_token(tiny_dirs, dtype):
    """Greedy chain on the decoder's verify step equals its plain decoding, with a random drafter (a round
    accepts nothing) and an oracle with planted mistakes (rounds accept part of a block): in bf16 too, because a
    verify row is computed exactly as a one-token step."""
    from dflashkit.decode.speculative import DFlashProposer
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.rng import seeded
    from helpers import Oracle

    t = load_target(tiny_dirs["llama"], device="cpu", dtype=dtype)
    ids, layers, B = prompt(t), [1, 2], 4
    plain = generate_ar(StaticBackend(StaticDecoder(t, 128, compile=False)), ids, 40).tokens
    with seeded(0):
        drafter = new_drafter(t, num_layers=1, block_size=B, target_layer_ids=layers).to(t.dtype).eval()
    wrong = {len(ids) + k for k in (3, 7, 8, 13, 20)}
    for proposer in (DFlashProposer(t, drafter), Oracle(ids + plain + [0] * B, B, t.vocab_size, wrong, layers)):
        d = StaticDecoder(t, 128, compile=False, layer_ids=layers, verify_width=B)
        g = generate_chain(StaticBackend(d), proposer, ids, 40)
        assert g.tokens == plain, (type(proposer).__name__, g.accepted)
    assert max(g.accepted) == B and min(g.accepted) < B  # the oracle: full blocks and rejections both ran
    if dtype == "float32":  # and the features it drafts from are the target's own
        _, feats = StaticDecoder(t, 128, compile=False, layer_ids=layers, verify_width=B).prefill(ids)
        want = t.forward(torch.tensor([ids]), layer_ids=layers).features
        torch.testing.assert_close(feats, want, atol=1e-5, rtol=1e-5)


def test_a_static_chain_refuses_a_drafter_it_was_not_built_for(tiny_targets):
    from helpers import Oracle

    t = tiny_targets["llama"]
    d = StaticDecoder(t, 64, compile=False, layer_ids=[1], verify_width=4)
    with pytest.raises(DFlashError, match="built for block 4.*needs block 8"):
        generate_chain(StaticBackend(d), Oracle([1] * 64, 8, t.vocab_size, (), [1]), [1, 2, 3], 4)
    with pytest.raises(DFlashError, match="verifies 2..31 tokens"):
        StaticDecoder(t, 64, compile=False, verify_width=32)


def test_bench_holds_each_static_row_to_plain_decoding_on_its_own_engine(tiny_targets, monkeypatch):
    """chain and a tree on the static engine beside the hf rows (`--engine hf,static`): each is held to ar on its
    own engine; equal outputs pass, and any difference fails naming its reference."""
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.rng import seeded

    t = tiny_targets["llama"]
    with seeded(0):
        drafter = new_drafter(t, num_layers=1, block_size=4, target_layer_ids=[1, 2]).eval()
    eager_decoders(monkeypatch)
    methods = bench.parse_methods("ar,chain,hybrid-auto")
    res = bench.run_bench(t, drafter, [("a", prompt(t))], methods, max_new_tokens=10, progress=False, warmup=False, predict=False,
                          engine="hf,static")
    assert res["config"]["backends"] == {"ar": "hf", "ar@static": "static", "chain": "hf", "chain@static": "static",
                                        "hybrid-auto": "hf", "hybrid-auto@static": "static"}
    assert res["mismatches"] == [] and res["methods"]["chain@static"]["tokens_per_s"] > 0
    runs = [{"prompt": "a", "method": "ar", "tokens": [1, 2, 3]},
            {"prompt": "a", "method": "ar@static", "tokens": [1, 2, 3]},
            {"prompt": "a", "method": "chain@static", "tokens": [1, 2, 4]}]
    rows = {"ar": ("ar", "hf"), "ar@static": ("ar", "static"), "chain@static": ("chain", "static")}
    assert bench.check_lossless(runs, rows) == [{"prompt": "a", "method": "chain@static", "first_difference": 2,
                                                 "lengths": [3, 3], "against": "ar@static"}]


def test_the_collector_is_paused_for_a_decode_loop_and_restored(tiny_targets, monkeypatch):
    """Plain decoding on the static backend runs with Python's collector off (its collections cost 5-6% of a step) and leaves it as it
    found it: on when it was on, off when it was off, and back on after an error inside the loop."""
    import gc


    d = StaticDecoder(tiny_targets["llama"], 128, compile=False)
    seen = []
    step = d.forward
    monkeypatch.setattr(d, "forward", lambda ids, pos: seen.append(gc.isenabled()) or step(ids, pos))
    assert gc.isenabled()
    generate_ar(StaticBackend(d), prompt(tiny_targets["llama"]), 5)
    assert len(seen) > 1 and not any(seen) and gc.isenabled()  # every step of the loop ran with it off
    gc.disable()
    try:
        generate_ar(StaticBackend(d), prompt(tiny_targets["llama"]), 3)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="boom"):
        with static.collector_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


@pytest.mark.parametrize("build", [*(pytest.param(("native", *b.values[0]), id=b.id) for b in BUILDS),
                                   pytest.param(("tiles", "v4", None), id="tiles", marks=needs_amx)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tree_verify_row_is_the_one_token_step_and_commit_makes_it_a_chain(tiny_dirs, dtype, build):
    """A branching tree, flat in one step: each node's logits equal one-token steps along its own root path, bit
    for bit (its ancestors sit at other slots than plain decoding's, but attention reads them in depth order).
    After commit of a path that skips a sibling, the next one-token step equals plain decoding's."""
    from dflashkit.tree import Tree

    t = load_target(tiny_dirs["llama"], device="cpu", dtype=dtype)
    ids = prompt(t)
    start = len(ids) - 1
    toks = torch.tensor([ids[start], 5, 9, 7, 11, 3])  # root; 5, 9 children of the root; 7 under 9; 11, 3 under 7
    tree = Tree(toks, torch.tensor([0, 1, 1, 2, 3, 3]), torch.tensor([-1, 0, 0, 2, 3, 3]), torch.zeros(6))
    kernels, level, tune = build
    if kernels == "tiles" and dtype == "float32":
        pytest.skip("the tile kernels read bf16 weights")
    d = StaticDecoder(t, 128, kernels=kernels, compile=False, layer_ids=[1], trees=True, level=level, tune=tune)
    d.prefill(ids[:-1])
    logits, feats = d.verify_tree(tree, start)
    assert logits.shape[0] == 6 and feats.shape[1] == 6 and d.tree_width(6) == 8
    plain = StaticDecoder(t, 128, kernels=kernels, compile=False, layer_ids=[1], trees=True, level=level, tune=tune)
    for path in ([0, 1], [0, 2, 3, 4], [0, 2, 3, 5]):
        plain.prefill(ids[:-1])
        for depth, node in enumerate(path):
            want = plain.forward([int(toks[node])], start + depth)
            assert torch.equal(logits[node], want), (path, node)
    d.commit(start, [2, 3, 4])  # accepted 9, 7, 11: slots start+2.. -> start+1..
    plain.prefill(ids[:-1])
    for depth, node in enumerate([0, 2, 3, 4]):
        plain.forward([int(toks[node])], start + depth)
    assert torch.equal(d.forward([13], start + 4), plain.forward([13], start + 4))


@pytest.mark.parametrize("method", ["ddtree-8", "hybrid-auto", "ngram"])
def test_trees_on_the_static_steps_are_ar_static_token_for_token(tiny_dirs, method):
    """DDTree, n-gram and their cost-aware merge on the static steps (bf16 weights) equal its plain decoding, with an
    oracle drafter whose planted mistakes DDTree recovers through a sibling."""
    from dflashkit.decode.speculative import tree_drafts
    from helpers import Oracle

    t = load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16")
    ids, layers, B = prompt(t), [1, 2], 4
    plain = generate_ar(StaticBackend(StaticDecoder(t, 128, compile=False)), ids, 40).tokens
    d = StaticDecoder(t, 128, compile=False, layer_ids=layers, trees=True)
    d.warm(timed=1)
    wrong = {len(ids) + k for k in (3, 7, 8, 13, 20)}
    drafts = tree_drafts(method, Oracle(ids + plain + [0] * B, B, t.vocab_size, wrong, layers), cost=d.tree_cost)
    g = generate_tree(StaticBackend(d), drafts, ids, 40, method=method)
    assert g.tokens == plain, g.accepted
    if method != "ngram":
        assert max(g.accepted) >= B  # the oracle's planted mistakes recovered: a whole block in a round


@pytest.mark.slow
def test_a_tree_wider_than_the_static_backend_verifies_is_refused_not_cut(tiny_targets):
    """ddtree-32 needs 33-node verifies, past the widest compiled width (24): refused up front, naming both; the
    old decoder cut such trees silently to its widths."""
    from dflashkit.decode.speculative import tree_drafts
    from helpers import Oracle

    t = tiny_targets["llama"]
    session = DecodeSession(t, static=StaticDecoder(t, 160, compile=False, layer_ids=[1, 2], verify_width=4, trees=True))
    with pytest.raises(DFlashError, match=r"ddtree-32: its trees reach 33 nodes, past the static backend's widest "
                                          r"verify \(24\).*--engine hf"):
        generate(t, prompt(t), "ddtree-32", Oracle([1] * 64, 4, t.vocab_size, (), [1, 2]), engine="static",
                 session=session)
    d = StaticDecoder(t, 64, compile=False)
    with pytest.raises(DFlashError, match="built without tree widths; build it with trees=True"):
        generate_tree(StaticBackend(d), tree_drafts("ngram", None), prompt(t), 20, method="ngram")
    with pytest.raises(DFlashError, match="tree verify needs kernels 'native' or 'tiles'"):
        StaticDecoder(t, 64, compile=False, kernels="reduce", trees=True)


@pytest.mark.parametrize("planted", [False, True])
def test_a_wrong_static_step_fails_a_bf16_bench_with_the_position_named(tiny_dirs, monkeypatch, planted):
    """Issue 54: in bf16 the two backends' tokens may part at a near-tie, so tokens alone let a slightly wrong
    step through. The bench checks the static step's logits against transformers' float32 forward over the same
    weights: one weight scaled by 1.01 fails, naming the position; the honest step passes."""
    t = load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16")
    real = StaticDecoder

    def built(session, n, proposer=None, trees=False):
        if session.static is None:
            d = session.static = real(session.target, 256, compile=False)
            if planted:
                layer, stride, _, _ = static.geometry_of(session.target).layout()
                off, shape = layer["o"]
                d.arena[stride + off: stride + off + shape[0] * shape[1]] *= 1.01  # layer 1's o_proj
        return session.static

    monkeypatch.setattr(static, "decoder_for", built)
    res = bench.run_bench(t, None, [("a", prompt(t))], ["ar"], max_new_tokens=12, progress=False, warmup=False, predict=False,
                          engine="static")
    step = [x for x in res["mismatches"] if "logit_gap" in x]
    if not planted:
        assert step == [] and res["mismatches"] == []
        return
    assert step and step[0]["position"] == 0 and step[0]["logit_gap"] > 1e-3
    assert "the static step's logits" in bench.bench_markdown(res) and "at position 0" in bench.bench_markdown(res)


def test_data_generate_answers_on_the_static_backend_and_a_cache_names_it(tiny_targets, monkeypatch, tmp_path):
    """`data generate --engine static` (plain_answers): every completion is the static backend's plain decoding (transformers'
    batched generation never runs), the header says so, a rerun on hf is refused, and a cache extracted from those
    answers names the backend that wrote them."""
    from dflashkit.cache import extract, open_cache
    from dflashkit.cache.sequences import generate_sequences, read_sequences
    from dflashkit.measure.peers import plain_answers
    from dflashkit.prompts import load_prompts
    from dflashkit.targets import generation

    eager_decoders(monkeypatch)
    t, out = tiny_targets["llama"], tmp_path / "seqs.jsonl"
    suite = load_prompts("coding-10").subset(2)
    with monkeypatch.context() as m:
        m.setattr(generation, "iter_generate_greedy", lambda *a, **k: pytest.fail("answered by transformers"))
        with plain_answers(t, "static", 8) as by:
            generate_sequences(t, suite, out, max_new_tokens=8, progress=False, answered_by=by)
    head, recs = read_sequences(out)
    assert head["engine"] == "static" and len(recs) == 2
    for r in recs:
        want = generate_ar(StaticBackend(StaticDecoder(t, 512, compile=False)), r["prompt_ids"], 8).tokens
        assert r["completion_ids"] == want
    with pytest.raises(DFlashError, match="engine='static', now 'hf'"):
        generate_sequences(t, suite, out, max_new_tokens=8, progress=False)
    cache = extract(t, suite, tmp_path / "cache", layer_ids=[1, 2], max_new_tokens=8, progress=False,
                    completions_from=out)
    assert "(answered on static)" in open_cache(cache).manifest["generation"]["completions_from"]


def test_a_static_bench_shows_static_s_cost_and_times_no_hf_forward(tiny_targets, monkeypatch):
    """Issue 70: a bench's cost section was hf's forward even when every row ran on static. Now it is the backend
    plain decoding ran on: static's own step per compiled width; hf's curve is not measured (no row needs it)."""
    from helpers import eager_decoders

    eager_decoders(monkeypatch)
    monkeypatch.setattr(bench, "tree_cost_curve", lambda *a, **k: pytest.fail("hf's forward was timed"))
    t = tiny_targets["llama"]
    res = bench.run_bench(t, None, [("a", prompt(t))], ["ar", "ngram"], max_new_tokens=8, progress=False,
                          warmup=False, predict=False, engine="static")
    assert res["config"]["backends"] == {"ar": "static", "ngram": "static", "ar@hf": "hf"}
    widths = res["cost"]["ns"]
    assert res["cost"]["backend"] == "static" and widths == sorted(widths) and widths[0] == 1 and len(widths) > 2
    assert "## Cost of one target forward (static backend)" in bench.bench_markdown(res)


def test_the_drafter_compiled_with_the_decoder_drafts_in_its_session_only(tiny_targets):
    """Issue 70: decoder_for compiled the shared proposer's drafter, so hf rows of a run that touched static drafted
    compiled too. The compiled call is the decoder's: the proposer drafts through it in a static session alone, and
    only when it is the same drafter's."""
    from dflashkit.decode.session import Timer
    from dflashkit.decode.speculative import DFlashProposer
    from helpers import drafter_and_prompts

    t, d, _ = drafter_and_prompts(tiny_targets["llama"])
    proposer, other = DFlashProposer(t, d), DFlashProposer(t, copy.deepcopy(d))
    dec = StaticDecoder(t, 64, compile=False)
    compiled = lambda *a, **k: None  # noqa: E731 (stands for the compiled call)
    dec.drafter_call = (d, compiled)
    with StaticBackend(dec, proposer).session(Timer(t.device)):
        assert proposer.call is compiled
    assert proposer.call is d
    with StaticBackend(dec, other).session(Timer(t.device)):
        assert other.call is other.drafter  # another drafter of the same shape keeps its own
