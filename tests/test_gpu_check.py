"""benchmarks/gpu_check.py --smoke: the device check's code runs on every `make test`, so it cannot rot."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def load_gpu_check():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows_of(md: str, section: str) -> list[dict]:
    """The markdown table under `## section` as dicts."""
    block = md.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    lines = [l for l in block.splitlines() if l.startswith("|") and not l.startswith("|---")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in l.strip("|").split("|")))) for l in lines[1:]]


def test_smoke_runs_every_section_and_reports_honestly(tmp_path):
    gc = load_gpu_check()
    out = tmp_path / "gpu.md"
    assert gc.main(["--out", str(out)], smoke=True) == 0
    md = out.read_text()
    assert "## Failures\n\nnone" in md
    train = rows_of(md, "Drafter training")
    assert {(r["target"], r["attention"]) for r in train} == {
        (t, a) for t in ("qwen3-8b-8layers", "qwen3.5-hybrid-8layers") for a in ("chunked", "dense")}
    for r in train:
        if r["attention"] == "chunked":  # float32 on CPU: the block-sparse path equals the dense one
            assert float(r["max_out_diff"]) < 1e-5 and float(r["max_grad_diff"]) < 1e-5
    assert len(rows_of(md, "Feature extraction")) == 2 and len(rows_of(md, "Offline evaluation")) == 2
    decode = rows_of(md, "Online decoding")
    assert {r["method"] for r in decode} == {"ar", "chain", "ddtree-4"}
    for r in decode:  # float32: lossless, and the oracle is accepted in full (B = 4; the last round is capped)
        assert r["mismatches"] == "0" and r["tokens"] == "10"
        if r["method"] != "ar":
            assert float(r["tau"]) > 3
    static = {r["target"]: r for r in rows_of(md, "Plain decoding on the static decoder")}
    assert static["qwen3-8b-8layers"]["mismatches_vs_ar"] == "0"  # float32: the static step is ar's greedy output
    assert "model_type = 'qwen3_5_text': only dense-attention" in static["qwen3.5-hybrid-8layers"]["skipped"]


def test_oracle_proposer_peaks_at_the_reference():
    import torch

    gc = load_gpu_check()

    class Inner:
        block_size, layer_ids = 4, [1]

        def reset(self, prompt_ids):
            pass

        def propose(self, features, anchor, start):
            return torch.zeros(3, 10)

    ref = [5, 6, 7, 8, 9, 1]
    oracle = gc.OracleProposer(Inner(), ref, 10)
    assert oracle.propose(None, torch.tensor([7]), 2).argmax(-1).tolist() == [8, 9, 1]
    assert oracle.propose(None, torch.tensor([9]), 4).shape == (3, 10)  # past the reference: no peak, no error
