"""Issue 14: integrity gaps that could silently give a wrong number (target identity, RoPE scaling,
sliding-window targets, z-lab config loading, threads, test hygiene, user-facing text)."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.cache import extract, open_cache
from dflashkit.cli import build_parser, main
from dflashkit.drafter.checkpoint import load_drafter, new_drafter, save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import DFlashError
from dflashkit.prompts import load_prompts
from dflashkit.targets import model as target_model, registry
from tiny_targets import make_tiny_target
from dflashkit.targets.model import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
TESTS = Path(__file__).parent


# ---- 1. target identity covers the weights ---------------------------------------------------------------

def _copy_with_one_weight_changed(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    state = load_file(f)
    name = sorted(k for k in state if k.endswith("mlp.down_proj.weight"))[0]
    state[name] = state[name].clone()
    state[name][0, 0] += 0.5
    save_file(state, f, metadata={"format": "pt"})
    return dst


def test_identity_covers_the_weights_and_a_cache_of_one_is_refused_for_the_other(tmp_path, machine_env, capsys):
    machine_env(DFLASHKIT_HOME=tmp_path / "home")
    a_dir = make_tiny_target("llama", tmp_path / "base")
    b_dir = _copy_with_one_weight_changed(a_dir, tmp_path / "finetune")
    a, b = load_target(a_dir, device="cpu"), load_target(b_dir, device="cpu")
    ia, ib = a.identity(), b.identity()
    assert json.loads(json.dumps(ia)) == ia  # a plain JSON-able dict (the demo fingerprints it)
    assert ia["config_hash"] == ib["config_hash"] and ia["weights_hash"] != ib["weights_hash"]
    assert {k: v for k, v in ia.items() if k not in ("path", "name", "weights_hash")} == \
        {k: v for k, v in ib.items() if k not in ("path", "name", "weights_hash")}

    cache = extract(a, load_prompts("coding-10").subset(1), tmp_path / "cache", layer_ids=[1, 2], max_new_tokens=3,
                    progress=False)
    assert json.loads((cache / "manifest.json").read_text())["target"]["weights_hash"] == ia["weights_hash"]
    with pytest.raises(DFlashError) as e:
        open_cache(cache, expect_target=ib)
    msg = str(e.value)
    assert ia["weights_hash"] in msg and ib["weights_hash"] in msg and "differ in weights_hash" in msg
    assert "dflashkit extract --target" in msg
    assert len(open_cache(cache, expect_target=ia)) == 1
    # the eval CLI loads the target the user names and refuses it the same way
    code = main(["eval", "--drafter", str(tmp_path / "nope"), "--cache", str(cache), "--target", str(b_dir),
                 "--out", str(tmp_path / "ev")])
    assert code == 2 and "differ in weights_hash" in capsys.readouterr().err

    # a drafter's contract records the identity; another target with the same shape is refused
    torch.manual_seed(0)
    save_drafter(new_drafter(a, num_layers=1, target_layer_ids=[1, 2], block_size=4), tmp_path / "d", target_identity=ia)
    assert load_drafter(tmp_path / "d", target=a).config.target_layer_ids == [1, 2]
    with pytest.raises(DFlashError, match=rf"drafter .*made with target base \(weights {ia['weights_hash']}.*"
                                          rf"target in use finetune \(weights {ib['weights_hash']}"):
        load_drafter(tmp_path / "d", target=b)
    assert load_drafter(tmp_path / "d", target=b, same_target=False).config.block_size == 4  # a deliberate warm start


def test_weights_hash_is_remembered_by_path_size_and_mtime(tmp_path, monkeypatch, machine_env):
    machine_env(DFLASHKIT_HOME=tmp_path / "home")
    monkeypatch.setattr(registry, "MEMO_MIN_BYTES", 0)  # memoise even the tiny fixture's weights
    folder = make_tiny_target("llama", tmp_path / "t")
    first = registry.weights_hash(folder)
    assert list((tmp_path / "home" / "weight-hashes").glob("*.json"))

    def no_read(path, *a, **k):
        raise AssertionError(f"{path} was hashed again")

    monkeypatch.setattr(registry, "sha256_file", no_read)
    assert registry.weights_hash(folder) == first  # a second call reads no weights
    # a changed file (size or mtime) is hashed again
    monkeypatch.undo()
    machine_env(DFLASHKIT_HOME=tmp_path / "home")
    monkeypatch.setattr(registry, "MEMO_MIN_BYTES", 0)
    _copy_with_one_weight_changed(folder, tmp_path / "u")
    shutil.copy2(tmp_path / "u" / "model.safetensors", folder / "model.safetensors")
    assert registry.weights_hash(folder) != first


def test_a_small_file_rewritten_within_one_timestamp_tick_gets_a_new_identity(tmp_path, monkeypatch, machine_env):
    """The stale-memo reproduction: two same-size rewrites in place, the timestamps forced equal (as happens
    within one tick), must not return the first content's hash."""
    machine_env(DFLASHKIT_HOME=tmp_path / "home")
    folder = tmp_path / "w"
    folder.mkdir()
    f = folder / "model.safetensors"
    f.write_bytes(b"A" * 1000)
    st = f.stat()
    first = target_model.weights_hash(folder)
    with open(f, "r+b") as fh:  # same inode, same size
        fh.write(b"B" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    assert target_model.weights_hash(folder) != first


# ---- 2. RoPE scaling matches transformers ----------------------------------------------------------------

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]},
}


def _drafter_cfg(rope_scaling, **kw) -> DrafterConfig:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                num_hidden_layers=1, target_layer_ids=[1], num_target_layers=6, mask_token_id=3, vocab_size=272,
                rope_theta=1_000_000.0, rope_scaling=rope_scaling, max_position_embeddings=32768)
    base.update(kw)
    return DrafterConfig(**base)


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_equals_transformers_rotary_embedding(kind):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = _drafter_cfg(ROPES[kind])
    d = DFlashDrafter(cfg)
    hf = Qwen3Config(**cfg.to_zlab())  # what z-lab's model builds from the exported config.json
    ref = Qwen3RotaryEmbedding(hf)
    for top in (300, 20000):  # longrope switches to its long factors past 4096 positions
        pos = torch.arange(top - 40, top)[None]
        want_cos, want_sin = ref(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = d._rope(pos)
        assert (cos - want_cos).abs().max() < 1e-6 and (sin - want_sin).abs().max() < 1e-6, kind
    if kind == "yarn":  # the attention factor is applied: cos^2 + sin^2 is its square, not 1
        assert abs(float((cos ** 2 + sin ** 2).mean()) - ref.attention_scaling ** 2) < 1e-5 and ref.attention_scaling > 1.1


def test_dynamic_rope_is_refused():
    with pytest.raises(DFlashError, match="dynamic RoPE"):
        DFlashDrafter(_drafter_cfg({"rope_type": "dynamic", "factor": 2.0}))


# ---- 3. sliding-window targets: online loops refuse them, extraction stays -----------------------------------

@pytest.fixture(scope="module")
def sliding_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    folder = make_tiny_target("qwen3", root / "qwen3-sw")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=2)
    cfg.pop("layer_types", None)  # derived by transformers: sliding on layers 2..5
    (folder / "config.json").write_text(json.dumps(cfg))
    return load_target(folder, device="cpu")


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_sliding_window_target_decodes_online_as_greedy_past_its_window(sliding_target, method):
    """Once refused (its cache could not roll back a rejected draft), now exact: 24 tokens past a window of 8."""
    from dflashkit.decode.speculative import DFlashProposer, generate
    from families import greedy_reference

    t = sliding_target
    assert t.config.layer_types.count("sliding_attention") == 4
    torch.manual_seed(0)
    proposer = DFlashProposer(t, new_drafter(t, num_layers=1, target_layer_ids=[1], block_size=4))
    ids = t.chat_ids([{"role": "user", "content": "def f(x): return x + 1"}])
    ref = greedy_reference(t, ids, 24)
    assert generate(t, ids, method, proposer, max_new_tokens=24).tokens == ref


def test_sliding_window_target_still_extracts(sliding_target, tmp_path):
    out = extract(sliding_target, load_prompts("coding-10").subset(1), tmp_path / "c", layer_ids=[1, 2],
                  max_new_tokens=3, progress=False)
    assert len(open_cache(out, expect_target=sliding_target.identity())) == 1


# ---- 4. z-lab config loading --------------------------------------------------------------------------------

def _zlab(**kw) -> dict:
    cfg = _drafter_cfg(None, num_hidden_layers=3).to_zlab()
    cfg.update(kw)
    return cfg


def test_missing_layer_types_are_derived_as_transformers_does():
    from transformers import Qwen3Config

    for kw in (dict(use_sliding_window=True, sliding_window=64, max_window_layers=1),
               dict(use_sliding_window=False, sliding_window=64, max_window_layers=1),
               dict(use_sliding_window=True, sliding_window=64, max_window_layers=5)):
        raw = _zlab(**kw)
        raw.pop("layer_types")
        cfg, notes = DrafterConfig.from_zlab(raw)
        hf = Qwen3Config(**raw)
        assert cfg.layer_types == hf.layer_types, kw
        assert cfg.sliding_window == (hf.sliding_window if "sliding_attention" in hf.layer_types else None)
    assert cfg.layer_types == ["full_attention"] * 3
    raw = _zlab(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    raw.pop("layer_types")
    cfg, notes = DrafterConfig.from_zlab(raw)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"] and cfg.sliding_window == 64
    assert any("layer_types missing" in n for n in notes)


def test_attention_bias_is_refused_not_skipped():
    with pytest.raises(DFlashError, match="attention_bias is true.*refused"):
        DrafterConfig.from_zlab(_zlab(attention_bias=True))
    assert DrafterConfig.from_zlab(_zlab(attention_bias=False))[0].hidden_size == 64


# ---- 5. threads ---------------------------------------------------------------------------------------------

MODEL_COMMANDS = [["extract", "--prompts", "coding-10", "--out", "x"], ["eval", "--drafter", "d", "--cache", "c"],
                  ["train"], ["data", "generate", "--prompts", "p", "--out", "o"], ["target", "info", "t"],
                  ["target", "prepare"], ["drafter", "init", "--out", "o"], ["drafter", "info", "d"]]


@pytest.mark.parametrize("argv", MODEL_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_model_commands_take_threads(argv):
    assert build_parser().parse_args(argv + ["--threads", "3"]).threads == 3
    assert build_parser().parse_args(argv).threads is None


def test_default_threads(monkeypatch, machine_env):
    from dflashkit import threads

    monkeypatch.setattr(threads, "physical_cores", lambda: 8)
    monkeypatch.setattr(threads, "usable_cpus", lambda: list(range(8)))
    machine_env(OMP_NUM_THREADS=None, LOCAL_WORLD_SIZE=None, TORCHELASTIC_RUN_ID=None)
    monkeypatch.setattr(threads, "busy_cores", lambda s: 2)
    assert threads.default_threads() == 8  # predictable: the load moves a warning, never the number
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)
    warning = threads.load_warning(8)
    assert "2 of 8 CPUs busy" in warning and "--threads 6" in warning
    assert warning.endswith("(the default is the physical cores, 4)")  # the real default, not the count asked
    monkeypatch.setattr(threads, "physical_cores", lambda: 8)
    assert threads.load_warning(6) is None
    monkeypatch.setattr(threads, "busy_cores", lambda s: 0)
    assert threads.load_warning(8) is None
    machine_env(OMP_NUM_THREADS=3)
    assert threads.default_threads() == 3
    machine_env(LOCAL_WORLD_SIZE=2, OMP_NUM_THREADS=1)  # torchrun: cores divided by its processes (it sets OMP to 1)
    assert threads.default_threads() == 4 and threads.under_torchrun()
    machine_env(LOCAL_WORLD_SIZE=16)
    assert threads.default_threads() == 1


def test_busy_cores_sees_a_spinning_process():
    """Measured, not assumed: one process spinning on this machine shows as (at least) one busy core."""
    import subprocess
    import sys

    from dflashkit import threads

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        assert threads.busy_cores(0.3) >= 1
    finally:
        spin.kill()
        spin.wait()


def test_the_entry_point_reads_the_environment_and_hands_values_down(monkeypatch, tmp_path, machine_env):
    """Issue 70: `main` reads $DFLASHKIT_HOME, $DFLASHKIT_ENGINES, OMP_NUM_THREADS and torchrun's variables once, for
    library code to take as values (dflashkit/machine.py); an in-process caller keeps its own machine."""
    from dflashkit import distributed, machine, threads
    from dflashkit.cli import use_environment
    from dflashkit.engines.install import engines_home
    from dflashkit.fileio import home

    seen = []
    monkeypatch.setattr("dflashkit.targets.cli.cmd_info", lambda args: seen.append(
        (home(), engines_home(), threads.default_threads(), distributed.init_distributed("cpu").world)) or 0)
    machine_env(DFLASHKIT_HOME=tmp_path / "h", OMP_NUM_THREADS=1, DFLASHKIT_ENGINES=None, LOCAL_WORLD_SIZE=None,
                TORCHELASTIC_RUN_ID=None, WORLD_SIZE=None)
    mine = machine.Machine(home=tmp_path / "mine", omp_threads=2)
    machine.use(mine)  # a Python caller's own (machine_env restores the test's after it)
    assert main(["target", "info", "x"]) == 0 and machine.current() == mine
    assert seen == [(tmp_path / "h", tmp_path / "h" / "engines", 1, 1)]
    machine_env(DFLASHKIT_ENGINES="~/engines")
    assert main(["target", "info", "x"]) == 0 and seen[-1][1] == Path("~/engines").expanduser()
    use_environment({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1"})
    m = machine.current()
    assert (m.local_world, m.world, m.local_rank, m.omp_threads, m.home) == (2, 4, 1, 1, machine.Machine.home)
    use_environment({"TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "none"})
    assert machine.current().local_world == 1 and machine.current().omp_threads is None


def test_threads_option_is_applied_and_restored(monkeypatch):
    from dflashkit import threads

    seen = []
    monkeypatch.setattr("dflashkit.targets.cli.cmd_info", lambda args: seen.append(torch.get_num_threads()) or 0)
    before = torch.get_num_threads()
    assert main(["target", "info", "x", "--threads", "2"]) == 0
    assert seen == [2] and torch.get_num_threads() == before  # in-process callers get their setting back
    assert main(["target", "info", "x"]) == 0
    assert seen[-1] <= before  # the default never raises a count the caller lowered
    assert threads.physical_cores() >= 1
    with pytest.raises(DFlashError, match="--threads 0"):
        threads.apply_threads(0)


def test_threads_beyond_what_the_cpus_can_run_are_refused_in_one_line(monkeypatch, capsys):
    """Issue 72: --threads 100000 ended in "can't start new thread" and a segfault; 4096 ran at 0.4 tok/s."""
    from dflashkit import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    before = torch.get_num_threads()
    assert threads.apply_threads(8) == 8
    torch.set_num_threads(before)
    assert main(["target", "info", "x", "--threads", "100000"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --threads 100000: this process may use 2 CPUs; use at most 8 (the default is the physical cores, 2)"]
    assert torch.get_num_threads() == before


# ---- 6. test hygiene ----------------------------------------------------------------------------------------

def _marks(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for dec in fn.decorator_list:
        node = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


def test_every_smollm2_training_and_demo_test_is_marked_slow():
    unmarked = []
    for f in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(f.read_text())
        module_slow = any("slow" in ast.unparse(n) for n in tree.body
                          if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
                loads = any(isinstance(c, ast.Call) and getattr(c.func, "id", getattr(c.func, "attr", "")) == "load_target"
                            and c.args and getattr(c.args[0], "value", None) == "smollm2-135m" for c in ast.walk(fn))
                trains = any(isinstance(c, ast.Call) and getattr(c.func, "id", "") in ("train", "run_demo") for c in ast.walk(fn))
                uses = "smollm2" in [a.arg for a in fn.args.args] or loads or trains
                if uses and "slow" not in _marks(fn) and not module_slow:
                    unmarked.append(f"{f.name}::{fn.name}")
    assert not unmarked, f"tests load the real SmolLM2, train or run the demo without @pytest.mark.slow: {unmarked}"


def test_make_test_fast_skips_the_slow_tests():
    make = (TESTS.parent / "Makefile").read_text()
    fast = make[make.index("\ntest-fast:"):].split("\n\n")[0]
    assert '-m "not slow' in fast
    full = make[make.index("\ntest:"):].split("\n\n")[0]
    assert "not slow" not in full
    # the end-to-end tests run apart from `make test`, and CI runs them
    assert "not e2e" in full and '-m "e2e' in make[make.index("\ntest-e2e:"):].split("\n\n")[0]
    ci = (TESTS.parent / ".ci" / "run").read_text().splitlines()
    assert ci.index("make test") < ci.index("make test-e2e")


# ---- 7. user-facing text ------------------------------------------------------------------------------------

def test_target_prepare_prints_only_the_path_on_stdout(monkeypatch, capsys, tmp_path):
    from dflashkit.targets import registry

    monkeypatch.setattr(registry, "prepare", lambda name, force=False: tmp_path / name)
    assert main(["target", "prepare", "smollm2-135m"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'smollm2-135m'}\n" and "ready in" in err


def test_eval_cli_names_its_flag_not_the_python_argument(tmp_path, tiny_targets, capsys):
    cache = extract(tiny_targets["llama"], load_prompts("coding-10").subset(1), tmp_path / "c", layer_ids=[1, 2],
                    max_new_tokens=2, progress=False)
    assert main(["eval", "--drafter", str(tmp_path / "d"), "--cache", str(cache), "--num-prompts", "3",
                 "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert "pass --allow-partial to proceed" in err and "allow_partial=True" not in err


@pytest.mark.parametrize("argv", [["drafter", "export", "--drafter", "nowhere"],
                                  ["bench", "--target", "nowhere", "--methods", "ar"],
                                  ["extract", "--target", "nowhere", "--prompts", "coding-10", "--out"]])
def test_an_output_path_under_a_file_fails_before_any_work_in_one_line(tmp_path, capsys, argv):
    """Issue 54: `--out FILE/sub` used to end in FileExistsError's traceback, bench's only after the whole run. Now
    every command refuses it before it starts (the target and drafter named here do not exist: they would be the
    first thing any work reads), rc 2, one line naming the path and the fix."""
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / "file" / "sub")
    argv = argv + [out] if argv[-1] == "--out" else argv + ["--out", out]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err == f"error: --out {out}: {tmp_path / 'file'} is a file, not a folder, so nothing can be written " \
                  "under it; choose another --out"


def test_a_bench_that_cannot_write_at_the_end_keeps_its_results(tmp_path, capsys):
    from dflashkit.measure.bench import write_bench

    (tmp_path / "file").write_text("x")
    result = {"config": {"target": "t"}, "methods": {}, "runs": []}
    with pytest.raises(KeyError):  # the plots need a whole result; the JSON comes first, and it must survive
        write_bench(result, tmp_path / "file" / "sub")
    err = capsys.readouterr().err
    rescue = Path(err.split("the results are in ")[1].split(" instead")[0])
    assert json.loads((rescue / "results.json").read_text()) == result
