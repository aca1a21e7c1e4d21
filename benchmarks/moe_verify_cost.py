"""Why speculative decoding gains less on MoE targets: the verify cost curve of an MoE target against a dense one
with the same active parameters per token (issue 37).

Two random targets built from configs: Qwen3-MoE (16 experts, top-2) and dense Qwen3 whose MLP width equals two
experts, so that one token reads the same weights in both. A k-token verify wakes up to k x top-k experts in the MoE
target, so its cost grows with k where the dense target's grows little. The script prints both curves (bench's
`measure_cost_curve`) side by side from one run.
"""

from __future__ import annotations

import argparse
import tempfile
import sys
import time
from pathlib import Path

import torch

from dflashkit.measure.curve import measure_cost_curve
from dflashkit.fileio import write_json, write_text
from dflashkit.report import markdown_table


def build(kind: str, folder: Path, hidden: int, layers: int, experts: int, top_k: int, expert_width: int):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny fixtures: test harness
    from tiny_targets import _tokenizer

    common = dict(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=hidden // 8, max_position_embeddings=4096, tie_word_embeddings=False)
    cfg = (Qwen3MoeConfig(**common, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
                          intermediate_size=expert_width, decoder_sparse_step=1, norm_topk_prob=True)
           if kind == "moe" else Qwen3Config(**common, intermediate_size=expert_width * top_k))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=f"benchmarks/results/cpu-{time.strftime('%Y-%m-%d')}-moe-verify-cost")
    args = ap.parse_args()
    from dflashkit.targets.model import load_target

    shape = dict(hidden=512, layers=6, experts=16, top_k=2, expert_width=768)
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense", "moe"):
            t = load_target(build(kind, Path(tmp) / kind, **shape), device="cpu", dtype=args.dtype)
            c = measure_cost_curve(t, extra=(9,))
            curves[kind] = {"ns": c.ns, "ms": [1e3 * s for s in c.seconds], "ratio": [s / c.seconds[0] for s in c.seconds]}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    rows = [[n, curves["dense"]["ms"][i], curves["dense"]["ratio"][i], curves["moe"]["ms"][i], curves["moe"]["ratio"][i]]
            for i, n in enumerate(curves["dense"]["ns"])]
    md = "\n".join([
        "# Verify cost: MoE vs dense target", "",
        f"Random Qwen3-MoE ({shape['experts']} experts, top-{shape['top_k']}, expert width {shape['expert_width']}) vs "
        f"dense Qwen3 (MLP width {shape['expert_width'] * shape['top_k']}: the same weights per token), hidden "
        f"{shape['hidden']}, {shape['layers']} layers, {args.dtype}, {torch.get_num_threads()} threads, {cpu}. One "
        "forward over n new tokens after a 400-token KV cache (median of 7), bench's measure_cost_curve.", "",
        markdown_table(["n tokens", "dense ms", "dense ratio", "MoE ms", "MoE ratio"], rows, digits=3), "",
        "A speculative round that verifies n tokens must commit more than the ratio to pay: on the MoE target each "
        "extra token can wake experts no other token in the round uses."])
    write_json(Path(args.out + ".json"), {"shape": shape, "dtype": args.dtype, "cpu": cpu, "curves": curves})
    write_text(Path(args.out + ".md"), md + "\n")
    print(md)


if __name__ == "__main__":
    main()
