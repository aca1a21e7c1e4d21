"""The package as users install it: the built wheel in a fresh venv outside the repository runs `dflashkit config`
and a reduced demo (its recipe, prompts and engine worker shipped inside the package; nothing read from a checkout)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dflashkit.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_config_list_show_and_cp(tmp_path, capsys):
    assert main(["config", "list"]) == 0
    listed = capsys.readouterr().out
    assert "smollm2-cpu" in listed and "gpu/qwen3-8b-8layers" in listed
    assert main(["config", "show", "smollm2-cpu"]) == 0
    assert "block_size" in capsys.readouterr().out
    assert main(["config", "cp", "paper", str(tmp_path / "mine.yaml")]) == 0
    assert main(["config", "cp", "paper", str(tmp_path / "mine.yaml")]) == 2  # no silent overwrite
    assert "exists" in capsys.readouterr().err
    assert main(["config", "show", "nope"]) == 2
    assert "shipped config (" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.e2e
def test_the_built_wheel_runs_a_reduced_demo_outside_the_repository(tmp_path, tiny_dirs):
    uv = Path(sys.executable).with_name("uv")
    subprocess.run([str(uv), "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(REPO)], check=True,
                   capture_output=True)
    wheel = next((tmp_path / "dist").glob("dflashkit-*.whl"))
    with zipfile.ZipFile(wheel) as whl:  # the test harness (tiny fixtures, the family matrix) stays out of the wheel
        shipped = whl.namelist()
    harness = [n for n in shipped if n.endswith(("tiny_targets.py", "families.py", "fixtures.py")) or "tests/" in n]
    assert not harness, harness
    assert any(n.startswith("dflashkit/targets/") for n in shipped), "the target stage is missing from the wheel"
    assert "dflashkit/decode/native.cpp" in shipped, "the static backend's kernels (built on first use) are missing"
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # torch and the rest from this environment (a path entry: its .pth files, our editable install among them, stay
    # unprocessed), dflashkit from the wheel only
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(uv), "pip", "install", "-q", "--no-deps", "--python", str(py), str(wheel)], check=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = f"""
import dflashkit, json
from dflashkit.demo import DemoConfig, run_demo
assert {str(REPO)!r} not in dflashkit.__file__, dflashkit.__file__
from dflashkit.decode import native
assert native.library_path().name.startswith("native-")  # the kernels' source is read from the installed package
# engine hf: auto would time both backends and compile the static step in this fresh process (a minute on 2 cores
# wherever the kernels changed since the last probe), as tests/test_demo.py says; the static backend is tested there
cfg = DemoConfig(out="run", target={str(tiny_dirs["llama"])!r}, device="cpu", dtype="float32", minutes=1,
                 train_prompts=4, train_max_new_tokens=16, gen_batch_size=4, eval_prompts=1, eval_max_new_tokens=16,
                 bench_prompts=1, bench_max_new_tokens=12, holdout_max_new_tokens=8, progress=False, plain_peers="none",
                 engine="hf", train={{"steps": 2, "target_layer_ids": [1, 2, 3], "anchors_per_seq": 4, "batch_size": 2}})
run_demo(cfg)
print(json.dumps({{"file": dflashkit.__file__}}))
"""
    res = subprocess.run([str(py), "-c", code], cwd=work, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "site-packages" in json.loads(res.stdout.strip().splitlines()[-1])["file"]
    assert (work / "run" / "report.md").is_file() and not json.loads((work / "run" / "bench" / "results.json")
                                                                        .read_text())["mismatches"]
    shown = subprocess.run([str(venv / "bin" / "dflashkit"), "config", "show", "smollm2-cpu"], cwd=work,
                           capture_output=True, text=True, check=True).stdout
    assert "block_size" in shown
