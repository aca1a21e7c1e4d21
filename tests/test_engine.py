"""One decode engine over two backends (issue 49): every method name runs through `generate()` on hf and on static
and records which ran, greedy outputs equal plain decoding on either, trees are verified whole (never cut to a
compiled width), `auto` picks by a measured, cached probe and falls back to hf where static refuses a target, and
the compiled static program (not only its eager twin) decodes as transformers does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dflashkit.decode.backends import backend_for
from dflashkit.decode.session import DecodeSession
from dflashkit.measure import probe as engines
from dflashkit.measure.probe import new_session
from dflashkit.measure.curve import CostCurve
from dflashkit.decode.methods import parse_method
from dflashkit.decode.speculative import generate
from dflashkit.errors import DFlashError
from tiny_targets import make_tiny_target
from dflashkit.targets.model import load_target
from helpers import Oracle, eager_decoders

pytestmark = pytest.mark.usefixtures("one_thread")
METHODS = ("ar", "chain", "ddtree", "ddtree-4", "ddtree-auto", "ngram", "hybrid", "hybrid-4", "hybrid-auto",
           "prompt-lookup", "prompt-lookup-5", "hf-generate")
TRANSFORMERS_LOOPS = ("prompt-lookup", "prompt-lookup-5", "hf-generate")


def prompt(t):
    return t.chat_ids([{"role": "user", "content": "def add(a, b): return a + b  # and more text"}])


def oracle_for(t, ids, n, layers=(1, 2), B=4):
    plain = generate(t, ids, "ar", max_new_tokens=n).tokens
    wrong = {len(ids) + k for k in (3, 7, 8, 13)}
    return plain, Oracle(ids + plain + [0] * 2 * B, B, t.vocab_size, wrong, list(layers))


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_every_method_name_runs_through_generate_on_each_backend(tiny_targets, monkeypatch, backend):
    """Each name of METHODS_HELP on each backend: the tokens are plain greedy decoding's, the Generation records the
    backend that ran; transformers' own loops run on hf and are refused on static with the reason."""
    eager_decoders(monkeypatch)
    t = tiny_targets["llama"]
    ids = prompt(t)
    plain, oracle = oracle_for(t, ids, 24)
    session = DecodeSession(t, trees=True)
    for method in METHODS:
        if backend == "static" and method in TRANSFORMERS_LOOPS:
            with pytest.raises(DFlashError, match=f"method '{method}' is transformers' own loop.*--engine hf"):
                generate(t, ids, method, oracle, max_new_tokens=24, engine=backend, session=session)
            continue
        g = generate(t, ids, method, oracle, max_new_tokens=24, engine=backend, session=session,
                     cost=CostCurve([1, 32], [0.01, 0.02]))
        assert g.tokens == plain, method
        assert g.engine == ("hf" if method in TRANSFORMERS_LOOPS else backend), method


def test_an_old_static_name_says_how_to_spell_it_now():
    for old, new in (("ar-static", "--method ar --engine static"), ("hybrid-auto-static", "--method hybrid-auto "
                                                                   "--engine static"), ("chain-hf", "--method chain --engine hf")):
        with pytest.raises(ValueError, match=re.escape(f"the backend is its own option now; use {new}")):
            parse_method(old)
    source = (Path(backend_for.__code__.co_filename).parent / "methods.py").read_text()
    assert "-static" not in source  # one vocabulary: no method name carries a backend


@pytest.mark.parametrize("method,most", [("ddtree-8", 9), ("ddtree-16", 17), ("ngram", 11), ("hybrid-8", 19)])
def test_the_static_backend_verifies_every_node_a_tree_method_builds(tiny_targets, monkeypatch, method, most):
    """The nodes verified per round, counted at the backend: the budget asked (+ the root, + the n-gram branch),
    on static as on hf. The old decoder verified at most 8 (its widest compiled width) and dropped the rest."""
    from dflashkit.decode import hf, static

    eager_decoders(monkeypatch)
    t = tiny_targets["llama"]
    ids = prompt(t) * 2  # repeated text: the n-gram lookup finds continuations
    _, oracle = oracle_for(t, ids, 30)
    seen = {"hf": [], "static": []}
    for name, cls in (("hf", hf.HfBackend), ("static", static.StaticBackend)):
        real = cls.verify
        monkeypatch.setattr(cls, "verify", lambda self, tokens, tree=None, real=real, name=name:
                            seen[name].append(len(tokens)) or real(self, tokens, tree))
    out = {e: generate(t, ids, method, oracle, max_new_tokens=30, engine=e).tokens for e in seen}
    assert out["hf"] == out["static"]
    assert max(seen["static"]) == max(seen["hf"]) and max(seen["static"]) <= most
    if method.startswith("ddtree"):
        assert max(seen["static"]) == most  # a full budget-N DDTree every drafted round


def test_auto_runs_hf_where_static_refuses_the_target_and_says_why(tmp_path):
    t = load_target(make_tiny_target("gpt_oss", tmp_path / "g"), device="cpu", dtype="float32")
    said = []
    assert backend_for(new_session(t, log=said.append), "auto", "hybrid-auto") == "hf"
    assert said == [f"engine auto: hf (target {t.name}: config.json field model_type = 'gpt_oss': only dense-attention "
                    "Llama-type targets (llama, qwen2, qwen3, mistral) run in the static step; use --engine hf for "
                    "this target)"]
    with pytest.raises(DFlashError, match="model_type = 'gpt_oss'"):
        backend_for(new_session(t), "static", "ar")
    assert backend_for(new_session(t), "auto", "prompt-lookup") == "hf"
    with pytest.raises(DFlashError, match="--engine 'fast': use one of auto, hf, static"):
        backend_for(new_session(t), "fast", "ar")


def test_auto_runs_hf_where_the_kernels_cannot_be_built_and_says_why(tiny_targets, monkeypatch):
    """Issue 68: a machine without a C++ compiler cannot build the static backend's kernels: auto says so in one
    line and runs hf; asking for static is refused with the same reason."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    said = []
    assert backend_for(new_session(tiny_targets["llama"], log=said.append), "auto", "chain") == "hf"
    assert said == ["engine auto: hf (no C++ compiler (c++) here to build the static backend's kernels: install g++, "
                    "or use --engine hf)"]
    with pytest.raises(DFlashError, match="no C..? compiler"):
        backend_for(new_session(tiny_targets["llama"]), "static", "ar")


def test_a_damaged_probe_answer_is_timed_again_with_one_line(tiny_targets, tmp_path, monkeypatch, machine_env):
    """Issue 72: garbage, {}, an empty file or a backend that does not exist in engine-probe/<key>.json broke every
    --engine auto run with a traceback (or blamed a flag never passed): now one line names the file and the backends
    are timed again; an answer that cannot be written is used for the run, with one line."""
    from types import SimpleNamespace

    from dflashkit.decode import static
    from dflashkit.measure import curve as cost
    from dflashkit import fileio

    machine_env(DFLASHKIT_HOME=tmp_path)
    monkeypatch.setattr(cost, "measure_cost_curve", lambda *a, **k: (lambda n: 0.01 if n == 1 else 0.02))
    monkeypatch.setattr(static, "decoder_for", lambda *a, **k: SimpleNamespace(step_s={1: 0.005, 8: 0.03}))
    t = tiny_targets["llama"]
    path = engines.probe_path(t)[0]
    path.parent.mkdir(parents=True)
    for damage in ("garbage", "{}", "", '{"plain": "gpu", "speculative": "hf", "cpu": "x"}', "[1, 2]"):
        path.write_text(damage)
        said = []
        found = engines.real_probe(new_session(t, log=said.append))
        assert said[0].startswith(f"engine auto: {path} is damaged (field ") and "timing the backends again" in said[0]
        assert found["plain"] == "static" and found["speculative"] == "hf" and json.loads(path.read_text()) == found
    said = []
    assert engines.real_probe(new_session(t, log=said.append)) == found and "--reprobe measures again" in said[-1]
    path.unlink()
    monkeypatch.setattr(fileio, "write_json", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    said = []
    assert engines.real_probe(new_session(t, log=said.append))["plain"] == "static"
    assert said[-2] == f"engine auto: could not cache the answer in {path} (Permission denied); the next run times again"


def test_a_new_build_of_our_kernels_is_timed_again(tiny_targets, monkeypatch):
    """auto's cached answer names the kernels it timed: after a change to native.cpp (or its flags) the probe runs
    again instead of reading an answer about the old kernels."""
    from dflashkit.decode import native

    t = tiny_targets["llama"]
    path, record = engines.probe_path(t)
    assert "kernels native-" in record["static"] and engines.probe_path(t)[0] == path
    monkeypatch.setattr(native, "library_path", lambda *a: path.with_name("native-v3-0123456789abcdef.so"))
    assert engines.probe_path(t)[0] != path


def fake_backends(monkeypatch, machine_env, home) -> list:
    """auto's probe on timings given here (hf the faster), under $DFLASHKIT_HOME `home`: the list counts its runs."""
    from types import SimpleNamespace

    from dflashkit.decode import static
    from dflashkit.measure import curve as cost

    calls = []
    machine_env(DFLASHKIT_HOME=home)
    monkeypatch.setattr(cost, "measure_cost_curve", lambda *a, **k: calls.append(1) or (lambda n: 0.001))
    monkeypatch.setattr(static, "decoder_for", lambda *a, **k: SimpleNamespace(step_s={1: 0.005, 8: 0.03}))
    return calls


def test_a_probe_measured_under_load_says_so_and_is_timed_again(tiny_targets, tmp_path, monkeypatch, machine_env):
    """Issue 72: an answer timed while other work kept the CPUs busy was cached like any other. Now its load is
    recorded, one line names the file and the fix, and the next run times it again (then reads a quiet one)."""
    import os

    calls, t, said = fake_backends(monkeypatch, machine_env, tmp_path), tiny_targets["llama"], []
    path, threads, cpus = engines.probe_path(t)[0], torch.get_num_threads(), len(engines.usable_cpus())
    monkeypatch.setattr(os, "getloadavg", lambda: (cpus + 3.0, 1.0, 1.0))  # no /proc/stat here (conftest)
    found = engines.real_probe(new_session(t, log=said.append))
    assert found["load"] == {"start": cpus + 3.0, "end": cpus + 3.0, "cpus": cpus, "threads": threads,
                             "others": cpus + 3.0, "loaded": True} == json.loads(path.read_text())["load"]
    assert said[-1] == (f"engine auto: the probe was measured under load (load {cpus + 3:.1f} on {cpus} CPUs, loaded: "
                        f"other work kept {cpus + 3:.1f} busy beside {threads} threads of ours): {path} is marked "
                        "loaded and measured again by the next run; or rerun with --reprobe when the machine is quiet")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.25, 1.0, 1.0))
    assert engines.real_probe(new_session(t, log=said.append))["load"]["loaded"] is False and len(calls) == 2
    assert said[-2].endswith(f"; {path} was measured under load")
    engines.real_probe(new_session(t, log=said.append))
    assert len(calls) == 2 and said[-1].startswith(f"engine auto -> hf (probe {found['measured_at'][:10]}")
    assert f"load 0.2 on {cpus} CPUs, on " in said[-1]


def test_the_load_is_other_work_s_cpus_not_our_own(monkeypatch):
    """/proc/stat's busy jiffies less this process tree's: our own threads (or the work just before, which the
    load average still counts) never make a measurement loaded; other work that takes the CPUs ours need does."""
    tree_jiffies = engines._tree_jiffies
    monkeypatch.setattr(engines, "usable_cpus", lambda: [0, 1])
    for busy, ours, threads, others, loaded in ((200, 200, 2, 0.0, False), (200, 100, 1, 1.0, False),
                                                (190, 95, 1, 0.95, False), (200, 100, 2, 1.0, True),
                                                (200, 10, 1, 1.9, True)):
        counters = iter([(1000, 5000), (1000 + busy, 5200)])  # 1 s of 2 CPUs: 200 jiffies
        tree = iter([300, 300 + ours])
        monkeypatch.setattr(engines, "cpu_times", lambda cpus: next(counters))
        monkeypatch.setattr(engines, "_tree_jiffies", lambda: next(tree))
        load = engines.measured_load(engines.load_sample(), threads)
        assert (load["others"], load["loaded"]) == (others, loaded), (busy, ours, threads)
    assert tree_jiffies() > 0  # this process has run


def test_an_old_probe_without_its_load_still_reads(tiny_targets, tmp_path, monkeypatch, machine_env):
    calls, t, said = fake_backends(monkeypatch, machine_env, tmp_path), tiny_targets["llama"], []
    path, record = engines.probe_path(t)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**record, "plain": "static", "speculative": "hf", "measured_at": "2026-12-01 10:00:00"}))
    assert engines.real_probe(new_session(t, log=said.append))["plain"] == "static" and calls == []
    assert said == [f"engine auto -> plain on static, speculative on hf (probe 2026-12-01 10:00, load not recorded, on "
                    f"{record['cpu']}; {path}; --reprobe measures again)"]


def test_reprobe_measures_again_and_reports_say_when_and_under_what_load(tiny_dirs, tiny_targets, tmp_path,
                                                                         monkeypatch, capsys, machine_env):
    """Issue 70: `--reprobe` on generate and bench times the backends again, replacing the cached answer; bench's
    header names auto's choice, the probe's time and its load."""
    from dflashkit.cli import main
    from dflashkit.measure.bench import bench_markdown, run_bench

    calls = fake_backends(monkeypatch, machine_env, tmp_path)
    monkeypatch.setattr(engines, "probe", engines.real_probe)
    argv = ["generate", "--target", str(tiny_dirs["llama"]), "--prompt", "hi", "--method", "ar", "--max-new-tokens", "2"]
    for flags, runs in (([], 1), ([], 1), (["--reprobe"], 2)):
        assert main(argv + flags) == 0 and len(calls) == runs
    assert "--reprobe measures again" in capsys.readouterr().err
    t = tiny_targets["llama"]
    bench = lambda **kw: run_bench(t, None, [("p", t.chat_ids([{"role": "user", "content": "hi"}]))], ["ar"],
                                   max_new_tokens=2, progress=False, warmup=False, predict=False, engine="auto",
                                   cost=CostCurve([1, 32], [0.01, 0.02]), **kw)
    res = bench(reprobe=True)
    assert len(calls) == 3 and res["config"]["backends"] == {"ar": "hf"}
    when = json.loads(engines.probe_path(t)[0].read_text())["measured_at"][:16]
    assert f"threads; engine auto -> hf (probe {when}, load 0.0 on " in bench_markdown(res)
    bench()
    assert len(calls) == 3


# The static step of one geometry, layers and width is compiled once per process (static.compiled_step), so the tests
# that compile it share one worker: the probe times the decoder the next test compiles in float32 (a drafter on layers
# [1, 2], block 4, trees), and the path-by-path test's static run is the bf16 one's


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.xdist_group(name="compiled-static")
def test_auto_measures_both_backends_once_and_reads_the_cache_after(tiny_targets, native_kernels, tmp_path, monkeypatch,
                                                                   machine_env):
    """The real probe on the compiled static step: timed once, written with the CPU named, then read back (no
    second measurement) by a later run; plain and speculative each get the faster backend of the probe."""
    machine_env(DFLASHKIT_HOME=tmp_path)
    t = tiny_targets["llama"]
    said = []
    proposer = Oracle([], 4, t.vocab_size, layer_ids=[1, 2])  # as bench's: the run's drafter, if any
    found = engines.real_probe(new_session(t, proposer, log=said.append), repeats=3)
    files = list((tmp_path / "engine-probe").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == found
    for kind, widths in (("plain", ("1",)), ("speculative", ("1", "8"))):
        faster = min(("hf", "static"), key=lambda e: sum(found[f"{e}_s"][w] for w in widths))
        assert found[kind] == faster
    assert found["cpu"] and found["threads"] == torch.get_num_threads() and found["dtype"] == "float32"
    from dflashkit.decode import static

    monkeypatch.setattr(static, "decoder_for", None)  # a second measurement would fail here (probe imports it)
    assert engines.real_probe(new_session(t, log=said.append)) == found
    assert said[-1].startswith("engine auto -> ") and str(files[0]) in said[-1]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.xdist_group(name="compiled-static")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_compiled_static_program_decodes_as_hf(tiny_dirs, dtype):
    """What users run: the steps compiled by inductor with our kernels (every test above runs them eagerly): the
    dot kernels, or in bf16 on a CPU with AMX the tile kernels.
    Plain decoding equals hf's tokens in float32 (in bf16 the two backends' kernels round differently, so there
    the compiled step is held to its own eager twin bit for bit), and chain and trees equal static plain decoding."""
    from dflashkit.decode import static
    from dflashkit.decode.static import StaticDecoder

    t = load_target(tiny_dirs["llama"], device="cpu", dtype=dtype)
    ids = prompt(t)
    _, oracle = oracle_for(t, ids, 40)
    session = DecodeSession(t, static=StaticDecoder(t, 2048, layer_ids=[1, 2], verify_width=4, trees=True))
    session.static.warm(timed=1)
    assert session.static.kernels == static.cpu_kernels(t, static.geometry_of(t))
    plain = generate(t, ids, "ar", max_new_tokens=40, engine="static", session=session).tokens
    if dtype == "float32":
        assert plain == generate(t, ids, "ar", max_new_tokens=40).tokens
    else:
        eager = DecodeSession(t, static=StaticDecoder(t, 2048, layer_ids=[1, 2], verify_width=4, trees=True,
                                                      compile=False))
        assert plain == generate(t, ids, "ar", max_new_tokens=40, engine="static", session=eager).tokens
    for method in ("chain", "ddtree-8", "hybrid-auto", "ngram"):
        g = generate(t, ids, method, oracle, max_new_tokens=40, engine="static", session=session)
        assert g.tokens == plain and g.engine == "static", method
    assert set(session.static.compile_s) == {1, 32, 4, 8, 16, 24}


@pytest.mark.slow
@pytest.mark.e2e
def test_the_compiled_program_on_v3_with_zens_tuning_verifies_as_it_steps(tiny_dirs):
    """Issue 68: the compiled step on a level other than this CPU's own, its kernels built with Zen 1-3's tuning
    planted: a 4-token verify's rows are its one-token steps bit for bit, and chain decodes as plain decoding does."""
    from dflashkit import levels
    from dflashkit.decode.static import StaticBackend, StaticDecoder
    from dflashkit.decode.speculative import generate_ar, generate_chain

    if not levels.runs_here("v3"):
        pytest.skip("x86-64-v3 needs an x86 CPU with AVX2 and FMA")
    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32")
    ids = prompt(t)
    d = StaticDecoder(t, 256, kernels="native", layer_ids=[1, 2], verify_width=4, level="v3", tune="znver3")
    d.prefill(ids[:-4])
    rows, _ = d.verify(torch.tensor(ids[-4:]), len(ids) - 4)
    steps = torch.stack([d.forward(ids[i:i + 1], i) for i in range(len(ids) - 4, len(ids))])
    assert torch.equal(rows, steps)
    _, oracle = oracle_for(t, ids, 30)
    plain = generate_ar(StaticBackend(d), ids, 30).tokens
    assert generate_chain(StaticBackend(d), oracle, ids, 30).tokens == plain


def test_a_narrower_level_is_one_setting_for_our_kernels_and_the_llama_cpp_peer(monkeypatch, tmp_path, machine_env):
    """Issues 53 and 68: `--isa v3` on a wider CPU builds our kernels for x86-64-v3, tells torch to take its AVX2
    kernels, gives llama.cpp a build of its own (GGML_NATIVE off, AVX-512 off, same source), keys the probes apart,
    drops native bf16 and is what bench reports."""
    from dflashkit import levels
    from dflashkit.decode import native
    from dflashkit.engines.install import CMAKE_FLAGS, LlamaCpp, find, llama_isa
    from dflashkit.targets.model import cpu_has_bf16_matmul

    if levels.best() != "v4":
        pytest.skip("a narrower level than this CPU's needs an AVX-512 CPU")
    monkeypatch.setattr(levels, "_chosen", None)
    assert levels.chosen() == "v4" and levels.torch_environment("v4") == {} and llama_isa() == "native"
    native_key = engines.machine_key(load_target(make_tiny_target("llama", tmp_path / "t"), device="cpu"))[0]
    plain = LlamaCpp(tmp_path)
    assert plain.cmake == CMAKE_FLAGS and plain.build.name == "llama.cpp-11434-build"

    monkeypatch.setattr(levels, "_chosen", "v3")  # what `--isa v3` chooses before torch loads
    assert levels.torch_environment("v3")["ATEN_CPU_CAPABILITY"] == "avx2" and not cpu_has_bf16_matmul()
    assert "-march=x86-64-v3" in native.cflags() and native.instruction_set().startswith("level v3 (this CPU runs v4)")
    avx2 = LlamaCpp(tmp_path, llama_isa())
    assert "-DGGML_AVX512=OFF" in avx2.cmake and "-DGGML_NATIVE=ON" not in avx2.cmake and "-DGGML_NATIVE=OFF" in avx2.cmake
    assert avx2.build != plain.build and avx2.stamp != plain.stamp and avx2.src == plain.src
    machine_env(DFLASHKIT_ENGINES=tmp_path)
    (tmp_path / plain.stamp.name).write_text("{}")  # the native build alone is not the v3 one
    assert find("llama.cpp") is None
    v3_key = engines.machine_key(load_target(make_tiny_target("llama", tmp_path / "t"), device="cpu"))[0]
    assert v3_key != native_key
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT"):  # not under `make test ISA=v3`
        with pytest.raises(DFlashError, match="torch already loaded its .* kernels; set ATEN_CPU_CAPABILITY=avx2"):
            levels.choose("v3")  # in a process whose torch took its AVX-512 kernels


@pytest.mark.e2e
@pytest.mark.xdist_group(name="compiled-static")
def test_a_tree_verified_path_by_path_records_the_tokens_it_ran(tiny_dirs):
    """Issue 50: hf in bf16 verifies a branching tree one root-to-leaf path per batch row (row-invariant kernels), so
    a round runs leaves x (depth + 1) tokens, not the tree's nodes; the round's width says so, as the cost model
    prices it (recorded as nodes, ddtree-8 on hf was predicted 57% fast). The static backend verifies flat."""
    from dflashkit.tree import Tree, path_tokens

    tree = Tree(torch.tensor([1, 5, 9, 7, 11, 3]), torch.tensor([0, 1, 1, 2, 3, 3]), torch.tensor([-1, 0, 0, 2, 3, 3]),
                torch.zeros(6))
    assert path_tokens(tree) == 3 * 4  # leaves 5, 11 and 3; depth 3
    t = load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16")
    ids = prompt(t)
    plain, oracle = oracle_for(t, ids, 30)
    paths = generate(t, ids, "ddtree-8", oracle, max_new_tokens=30)
    flat = generate(t, ids, "ddtree-8", oracle, max_new_tokens=30, engine="static")
    assert paths.tokens == plain and paths.engine == "hf" and max(paths.widths) > 9
    assert flat.engine == "static" and max(flat.widths) <= 9


@pytest.mark.slow  # compiles (5 s with inductor's cache, 40 s without on 2 cores): dealt out early by conftest
@pytest.mark.e2e
def test_the_compiled_drafter_drafts_as_the_eager_one_and_compiles_only_in_its_warm_up(tiny_targets):
    """What the static backend runs (decoder_for compiles the proposer's drafter, its session calls it): over a
    decode's calls (the prompt's, then one or several new positions) its logits equal the eager drafter's up to
    float rounding, and after compiled()'s warm-up no call compiles again (a recompile each round would cost more
    than it saves). Outside the static backend's session the proposer drafts eager (issue 70: hf rows did not)."""
    from contextlib import ExitStack

    from dflashkit.decode.speculative import DFlashProposer
    from helpers import drafter_and_prompts

    t, d, _ = drafter_and_prompts(tiny_targets["llama"])
    eager, compiled = DFlashProposer(t, d), DFlashProposer(t, d)
    call = compiled.compiled()
    assert compiled.call is d and compiled.compiled() is call
    stack = ExitStack()
    stack.enter_context(compiled.calling(call))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 80, d.fc.weight.shape[1], generator=g)
    for p in (eager, compiled):
        p.reset(None)
    start = 0
    for n in (19, 1, 3, 2, 4, 1, 33, 2):  # 33: a hybrid's draft after rounds without one
        new = feats[:, start:start + n]  # a view (a backend's commit hands a tensor of its own): one layout anyway
        want, got = (p.propose(new, torch.tensor([5 + n]), start + n) for p in (eager, compiled))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        start += n
    assert compiled.call is call and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    stack.close()
    assert compiled.call is d
