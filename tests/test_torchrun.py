"""torchrun on CPU (gloo), one launch of two processes for all of it (each process start imports torch and
transformers): data-parallel extraction, then DDP and FSDP training, each against one process."""

import csv
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dflashkit.cache import extract, open_cache, store
from dflashkit.cache.sequences import generate_sequences
from dflashkit.prompts import load_prompts
from dflashkit.train.config import load_config
from dflashkit.train.loop import train

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
LAYERS = [1, 2, 3]

WORKER = """
import sys
from dflashkit.cli import main
conf, out, target = sys.argv[1:4]
rc = main(["extract", "--target", target, "--prompts", "coding-10", "--num-prompts", "5", "--out", f"{out}/dp",
           "--target-layers", "1,2,3", "--max-new-tokens", "4", "--quiet", "--device", "cpu", "--dtype", "float32"])
assert rc == 0, rc
for mode in ("ddp", "fsdp"):
    rc = main(["train", "--config", conf, f"out={out}/{mode}", f"distributed={mode}", "batch_size=2"])
    assert rc == 0, rc
"""


def losses(path) -> list[float]:
    with open(path, newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def test_torchrun_extraction_ddp_and_fsdp_match_a_single_process(tiny_dirs, tiny_targets, tmp_path):
    """Extraction: 2 processes x half the prompts == 1 process. Training: 2 gloo processes x 2 sequences ==
    1 process x 4 sequences: the same losses and final weights."""
    llama = tiny_targets["llama"]
    single_cache = extract(llama, load_prompts("coding-10").subset(5), tmp_path / "single-cache", layer_ids=LAYERS,
                           max_new_tokens=4, progress=False)
    seqs = generate_sequences(llama, "coding-10", tmp_path / "seqs.jsonl", max_new_tokens=24, batch_size=8,
                              num_prompts=8, progress=False)
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump(dict(target=str(tiny_dirs["llama"]), data=str(seqs), num_layers=1,
                                        target_layer_ids=LAYERS, block_size=8, anchors_per_seq=8, steps=4, lr=3e-3,
                                        noise_std=0.1, progress=False, dtype="float32")))
    single = train(load_config(conf, [f"out={tmp_path}/single", "batch_size=4"]), target=llama)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), str(conf), str(tmp_path), str(tiny_dirs["llama"])],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]

    a, b = open_cache(single_cache), open_cache(tmp_path / "dp")
    assert b.manifest["world_size"] == 2 and b.prompt_ids == a.prompt_ids
    for ra, rb in zip(a, b):
        assert torch.equal(ra.tokens, rb.tokens)
        torch.testing.assert_close(ra.features(), rb.features(), rtol=1e-5, atol=1e-5)
    assert store.verify_cache(tmp_path / "dp")[0] == []

    ref = load_file(tmp_path / "single" / "checkpoints" / "step-00000004" / "model.safetensors")
    for mode in ("ddp", "fsdp"):
        got_losses = losses(tmp_path / mode / "metrics.csv")
        assert len(got_losses) == 4
        assert max(abs(x - y) for x, y in zip(single["losses"], got_losses)) < 1e-5, (mode, single["losses"], got_losses)
        got = load_file(tmp_path / mode / "checkpoints" / "step-00000004" / "model.safetensors")
        assert all(torch.allclose(ref[k], got[k], atol=1e-5) for k in ref), mode
