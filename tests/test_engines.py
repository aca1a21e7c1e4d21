"""Engine peers in bench. Fast: the bench plumbing with a stand-in engine (our own decoding behind the engine
interface), the checks on synthetic runs, the install errors. Marked `engines` (`make test-engines`, run where
`dflashkit engines install` has been): llama.cpp and vLLM themselves, lossless and with the tau our chain predicts."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import dflashkit.measure.peers as peers
from dflashkit.measure.bench import PLAIN, bench_markdown, parse_methods, run_bench
from dflashkit.decode.speculative import DFlashProposer, generate
from dflashkit.drafter.checkpoint import new_drafter
from dflashkit.engines.install import find, require
from dflashkit.engines.llamacpp import EngineAnswer
from dflashkit.errors import DFlashError
from helpers import ENGINE_TEXTS, Oracle, drafter_and_prompts

TEXTS = ENGINE_TEXTS


def test_dflash_peers_bring_their_plain_engine_and_our_chain():
    assert parse_methods("llama.cpp-dflash") == ["ar", "llama.cpp-dflash", "llama.cpp", "chain"]
    assert parse_methods("chain,vllm,vllm-dflash") == ["ar", "chain", "vllm", "vllm-dflash"]
    with pytest.raises(DFlashError, match="names a method twice"):
        parse_methods("vllm,vllm")


@pytest.mark.parametrize("isa", [None, "portable"])
def test_missing_engine_names_its_install_command(tmp_path, monkeypatch, machine_env, isa):
    """The command as this level runs it: at a level narrower than the CPU's, llama.cpp's own build is installed
    with the setting."""
    from dflashkit import levels

    machine_env(DFLASHKIT_ENGINES=tmp_path)
    monkeypatch.setattr(levels, "_chosen", isa)
    assert find("vllm") is None and find("llama.cpp") is None
    for name in ("vllm", "llama.cpp"):
        prefix = "--isa portable " if isa and levels.narrower() and name == "llama.cpp" else ""
        with pytest.raises(DFlashError, match=re.escape(f"`dflashkit {prefix}engines install {name}`")):
            require(name)



def test_a_cuda_vllm_install_asks_pip_for_packages_only(tmp_path, monkeypatch, machine_env):
    """With CUDA, vLLM's venv takes the CUDA torch vllm pins: the venv is created without a pip call of nothing
    (pip refuses one, which failed the install), then vllm is installed."""
    from dflashkit.engines import install

    machine_env(DFLASHKIT_ENGINES=tmp_path)
    calls = []
    monkeypatch.setattr(install, "run_step", lambda cmd, what: calls.append([str(c) for c in cmd]))
    install.install_vllm(cuda=True)
    pips = [c[c.index("install") + 1:] for c in calls if c[1:4] == ["-m", "pip", "install"]]
    assert pips == [["-q", f"vllm=={install.VLLM_VERSION}"]]

def runs_of(method, tokens_by_prompt, engine=None):
    return [{"prompt": p, "method": method, "tokens": t, **({"engine": engine} if engine else {})}
            for p, t in tokens_by_prompt.items()]


def test_check_engines_compares_with_the_engines_own_plain_output_and_reports_parting_from_ours():
    runs = (runs_of("ar", {"a": [1, 2, 3], "b": [4, 5, 6]}) + runs_of("vllm", {"a": [1, 2, 3], "b": [4, 9, 9]})
            + runs_of("vllm-dflash", {"a": [1, 2, 3], "b": [4, 9, 8]}))
    bad, parting = peers.check_engines(runs)
    assert bad == [{"prompt": "b", "method": "vllm-dflash", "against": "vllm", "first_difference": 2,
                    "lengths": [3, 3]}]  # lossless is judged against the engine's own plain decoding
    assert parting["vllm"] == {"equal": 1, "prompts": 2, "parts_at": {"b": 1}}  # reported, not failed


def test_forced_chain_rounds_are_what_our_chain_accepts_on_that_answer(tiny_targets):
    """Our chain loop with planted mistakes: the rounds recomputed from its answer alone (as from an engine's)
    equal the loop's own, the last round excepted (the loop may accept drafts past the cut)."""
    t = tiny_targets["llama"]
    ids = t.chat_ids([{"role": "user", "content": TEXTS[0]}])
    ref = generate(t, ids, "ar", max_new_tokens=40).tokens
    oracle = Oracle(ids + ref + [0] * 8, 4, t.vocab_size, wrong={len(ids) + 3, len(ids) + 9, len(ids) + 10})
    g = generate(t, ids, "chain", oracle, max_new_tokens=40)
    rounds = peers.forced_chain_rounds(t, oracle, ids, g.tokens)
    assert g.tokens == ref and rounds[:-1] == g.accepted[:-1] and sum(rounds) == len(ref) - 1
    assert 1 in rounds and 4 in rounds  # planted mistakes and whole blocks: the walk is not trivial


def test_engine_tau_and_the_tolerance_against_our_chain():
    runs = [{"engine": {"accepted": 6, "steps": 4}}, {"engine": {"accepted": 2, "steps": 4}}]
    assert peers.engine_tau(runs) == pytest.approx(2.0)
    assert peers.engine_tau([{"engine": {"accepted": 0, "steps": 0}}]) is None
    checks = peers.check_tau({"chain": {"tau": 2.0}, "vllm-dflash": {"tau": 2.09}, "llama.cpp-dflash": {"tau": 2.11}})
    assert [(c["method"], c["ok"]) for c in checks] == [("vllm-dflash", True), ("llama.cpp-dflash", False)]


class StandIn:
    """Our own decoding behind the engine interface (complete -> EngineAnswer), counted as engines count:
    drafted = B-1 per round, accepted = drafts kept, steps = rounds. `off`: the tau it claims is off by that much."""

    def __init__(self, target, proposer, off=0.0, corrupt=False):
        self.target, self.proposer, self.off, self.corrupt = target, proposer, off, corrupt

    def complete(self, ids, max_new_tokens, stop_ids):
        g = generate(self.target, ids, "chain" if self.proposer else "ar", self.proposer, max_new_tokens=max_new_tokens)
        tokens = list(g.tokens)
        if self.corrupt and self.proposer:
            tokens[-1] = (tokens[-1] + 1) % self.target.vocab_size
        # as llama.cpp counts: the drafts kept within the answer (its first token comes from the prompt's forward)
        acc = len(g.tokens) - 1 - g.rounds + round(self.off * g.rounds) if self.proposer else 0
        return EngineAnswer(tokens, g.times["total"], g.times["prefill"], (self.proposer.block_size - 1) * g.rounds
                            if self.proposer else 0, acc, g.rounds if self.proposer else 0)


def stand_in(monkeypatch, **kw):
    @contextmanager
    def start(method, target, drafter, block_size, ctx, workdir):
        yield StandIn(target, DFlashProposer(target, drafter, block_size) if method.endswith("-dflash") else None, **kw)

    monkeypatch.setattr(peers, "start_engine", start)


@pytest.fixture(scope="module")
def setup(tiny_targets):
    return drafter_and_prompts(tiny_targets["llama"])


def test_bench_with_engine_peers_states_speedups_against_the_fastest_plain(setup, monkeypatch):
    t, d, prompts = setup
    stand_in(monkeypatch)
    res = run_bench(t, d, prompts, parse_methods("llama.cpp-dflash"), max_new_tokens=10, progress=False, warmup=False, predict=False)
    s = res["methods"]
    assert res["mismatches"] == [] and s["llama.cpp"]["ar_parting"] == {"equal": 2, "prompts": 2, "parts_at": {}}
    assert s["llama.cpp-dflash"]["predicted_tau"] == pytest.approx(s["llama.cpp-dflash"]["tau"])
    assert [c["ok"] for c in res["tau_checks"]] == [True]
    fastest = max((m for m in s if m in PLAIN), key=lambda m: s[m]["tokens_per_s"])
    for m in s:
        assert s[m]["speedup_vs_fastest_plain"] == pytest.approx(s[m]["tokens_per_s"] / s[fastest]["tokens_per_s"])
    md = bench_markdown(res)
    assert "## Engine peers" in md and f"vs fastest plain ({fastest})" in md and "within the 5% tolerance" in md
    # the engines run in the rotation beside ours, prompt by prompt (host drift hits all alike), not after them
    order = [(r["prompt"], r["method"]) for r in res["runs"]]
    assert [p for p, _ in order] == sorted((p for p, _ in order), key=[x for x, _ in prompts].index)
    assert {m for p, m in order if p == prompts[0][0]} == set(s)


def test_bench_fails_an_engine_that_is_not_lossless_or_accepts_other_than_predicted(setup, monkeypatch):
    t, d, prompts = setup
    stand_in(monkeypatch, off=0.5, corrupt=True)
    res = run_bench(t, d, prompts, parse_methods("vllm-dflash"), max_new_tokens=10, progress=False, warmup=False, predict=False)
    assert [(x["method"], x["against"]) for x in res["mismatches"]] == [("vllm-dflash", "vllm")] * 2
    assert [c["ok"] for c in res["tau_checks"]] == [False]
    md = bench_markdown(res)
    assert "LOSSLESS CHECK FAILED" in md and "**BEYOND**" in md


def test_in_bf16_an_engines_own_parting_is_reported_not_failed(tiny_dirs, monkeypatch):
    """Engines verify a block on other kernels than their one-token step: in bf16 a near-tie may flip there, which
    says nothing about our drafter or export; in float32 (the test above) it fails the bench."""
    from dflashkit.targets.model import load_target

    t = load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16")
    torch.manual_seed(0)
    d = new_drafter(t, num_layers=1, target_layer_ids=[1, 3], block_size=4).eval()
    prompts = [(x, t.chat_ids([{"role": "user", "content": x}])) for x in TEXTS]
    stand_in(monkeypatch, corrupt=True)
    res = run_bench(t, d, prompts, parse_methods("llama.cpp-dflash"), max_new_tokens=8, progress=False, warmup=False, predict=False)
    assert res["mismatches"] == [] and len(res["engine_divergences"]) == 2
    md = bench_markdown(res)
    assert "reported, not failed" in md and "0/2 (first parting 7)" in md


def test_engine_peers_refuse_sampling(setup, monkeypatch):
    from dflashkit.decode.sampling import Sampling

    t, d, prompts = setup
    stand_in(monkeypatch)
    with pytest.raises(DFlashError, match="greedy only"):
        run_bench(t, d, prompts, ["ar", "vllm"], max_new_tokens=4, sampling=Sampling(temperature=0.5), progress=False)


# ---- the engines themselves (installed by `dflashkit engines install`) --------------------------------------------

LAYOUT = Path(__file__).parent / "data" / "llama_cpp_dflash_layout.json"
needs_llama = pytest.mark.skipif(find("llama.cpp") is None, reason="llama.cpp not installed: "
                                 "`dflashkit engines install llama.cpp`")
needs_vllm = pytest.mark.skipif(find("vllm") is None, reason="vLLM not installed: `dflashkit engines install vllm`")


@pytest.fixture(scope="module")
def real(smollm2):
    """The real target and a random drafter over a draft vocabulary of the tokens its answers use (and more)."""
    t = smollm2
    prompts = [(x, t.chat_ids([{"role": "user", "content": x}])) for x in TEXTS]
    torch.manual_seed(0)
    d = new_drafter(t, num_layers=1, block_size=4).eval()
    d.contract = {"draft_vocab": list(range(0, 4000))}
    return t, d, prompts


def converter_layout(path: Path, keep: int = 8) -> dict:
    """What a test needs of a converter output: keys (arrays cut to `keep` items) and tensor names/shapes/types."""
    import gguf

    from dflashkit.drafter.gguf import SKIP_KEYS, _value

    r = gguf.GGUFReader(str(path))
    kv = {}
    for key, f in r.fields.items():
        if key in SKIP_KEYS:
            continue
        value, sub = _value(f)
        kv[key] = [value[:keep] if isinstance(value, list) else value, f.types[0].name, sub.name if sub else None]
    return {"kv": kv, "tensors": [[t.name, [int(x) for x in t.shape], t.tensor_type.name] for t in r.tensors]}


@pytest.mark.engines
@needs_llama
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_gguf_export_is_the_converters_layout_plus_the_token_map(real, arch, tmp_path):
    """The converter's output for a drafter as recorded in tests/data (regenerate: DFLASHKIT_RECORD_LAYOUT=1),
    and our export equal to it tensor by tensor apart from the head rows and d2t."""
    import os

    import gguf

    from dflashkit.engines.llamacpp import drafter_gguf

    t, _, _ = real
    torch.manual_seed(0)
    d = new_drafter(t, num_layers=1, block_size=4, arch=arch).eval()
    d.contract = {"draft_vocab": list(range(100, 612))}
    engine = require("llama.cpp")
    plain = drafter_gguf(engine, d, t, "bfloat16", tmp_path / "plain.gguf", token_map=False)
    mapped = drafter_gguf(engine, d, t, "bfloat16", tmp_path / "mapped.gguf")
    layout = {**converter_layout(plain), "hidden_size": t.config.hidden_size, "vocab_size": t.vocab_size}
    recorded = json.loads(LAYOUT.read_text()) if LAYOUT.is_file() else {}
    if os.environ.get("DFLASHKIT_RECORD_LAYOUT"):
        recorded[arch] = layout
        LAYOUT.write_text(json.dumps(recorded, indent=1) + "\n")
    assert recorded[arch]["tensors"] == layout["tensors"]
    assert {k: v[1:] for k, v in recorded[arch]["kv"].items()} == {k: v[1:] for k, v in layout["kv"].items()}
    a = {x.name: x for x in gguf.GGUFReader(str(plain)).tensors}
    b = {x.name: x for x in gguf.GGUFReader(str(mapped)).tensors}
    assert set(b) == set(a) | {"d2t", "output.weight"}
    for name in a:
        if name != "output.weight":
            assert bytes(a[name].data) == bytes(b[name].data), name
    assert b["d2t"].data.tolist() == list(range(100, 612))


def engine_bench(real, methods):
    t, d, prompts = real
    return run_bench(t, d, prompts, parse_methods(methods), max_new_tokens=24, progress=False)


def assert_engine_agrees(res, engine):
    assert res["mismatches"] == [], res["mismatches"]
    s = res["methods"]
    assert s[f"{engine}-dflash"]["tau"] is not None and s[engine]["ar_parting"]["prompts"] == 2
    assert all(c["ok"] for c in res["tau_checks"]), res["tau_checks"]


@pytest.mark.engines
@needs_llama
def test_llama_cpp_peer_is_lossless_and_accepts_what_our_chain_predicts(real):
    assert_engine_agrees(engine_bench(real, "llama.cpp-dflash"), "llama.cpp")


@pytest.mark.engines
@needs_vllm
def test_vllm_peer_is_lossless_and_accepts_what_our_chain_predicts(real):
    assert_engine_agrees(engine_bench(real, "vllm-dflash"), "vllm")


@pytest.mark.engines
@needs_llama
def test_a_file_llama_quantize_wrote_decodes_as_its_float_copy_beside_llama_cpp_on_it(real, tmp_path):
    """Q4_K_M, as users download it, written by the installed llama-quantize from the target's float32 GGUF and
    passed as --target FILE.gguf: --weights gguf reads its q5_0, q8_0, q4_K and q6_K blocks, greedy decoding on them
    equals its float32 copy's, and bench runs llama.cpp on that very file."""
    import subprocess

    from dflashkit.decode.speculative import generate_ar
    from dflashkit.decode.static import StaticBackend, StaticDecoder
    from dflashkit.engines.llamacpp import target_gguf
    from dflashkit.targets.formats import gguf_source
    from dflashkit.targets.model import load_target

    t, _, prompts = real
    engine, out = require("llama.cpp"), tmp_path / "SmolLM2-Q4_K_M.gguf"
    subprocess.run([engine.binary("llama-quantize"), target_gguf(engine, t, "float32"), out, "Q4_K_M", "2"],
                   check=True, capture_output=True)
    q = load_target(str(out), device="cpu", dtype="float32", weights="gguf")
    f = load_target(str(out), device="cpu", dtype="float32", weights="float")
    assert {b.format for b in q.blocks.values()} == {"q5_0", "q8_0", "q4_k", "q6_k"} and gguf_source(q.path) == out
    ids = prompts[0][1]
    tokens = [generate_ar(StaticBackend(StaticDecoder(x, 256, compile=False)), ids, 24).tokens for x in (q, f)]
    assert tokens[0] == tokens[1]
    res = run_bench(q, None, prompts[:1], parse_methods("llama.cpp"), max_new_tokens=16, progress=False)
    assert res["methods"]["llama.cpp"]["tokens_per_s"] > 0 and "q4_k" in res["config"]["weights"]
