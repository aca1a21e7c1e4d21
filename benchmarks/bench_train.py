"""Drafter training throughput on this machine: a 5-layer SmolLM2 drafter, full vocabulary vs draft vocabulary,
offline features (what a cache gives) vs online (the target runs in the loop), in one run.

    python benchmarks/bench_train.py [--steps 3] [--rounds 2] [--num-prompts 16] [--max-new-tokens 160] [--smoke-steps 200]

Data: SmolLM2's greedy responses to the first --num-prompts train-mix prompts (`dflashkit data generate`, kept in
--out and reused by a rerun), features of
layers [1, 8, 14, 20, 27] computed once. Settings: docs/design.md section 10's calibration (block 16, 32 anchors per
sequence, 4 sequences per step, gamma-7 CE, AdamW). Each configuration runs through `dflashkit.train.train`: one
warm-up step, then --steps timed steps, in --rounds rounds that interleave the configurations (the machine is
shared: load changes then hit all of them alike). s/step = the lowest per-round median; blocks/s (anchored blocks
trained) and target tokens/s (tokens of the sequences consumed, prompt + response) follow from it. The draft vocabulary of
1,874 tokens is the size docs/design.md section 10 measured on 384 coding responses (here: the tokens seen in these
responses, filled up with the lowest other ids; cost depends on the size only).
Then the smoke gate on the real target: a 2-layer drafter overfits one completion (64 response tokens, block 16)
and must draft every stride block entirely (streak 15), scored by the offline evaluator.
Writes bench_train.json and bench_train.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflashkit.cli import use_environment
from dflashkit.fileio import write_json, write_text
from dflashkit.report import markdown_table
from dflashkit.targets.model import load_target
from dflashkit.train.config import load_config
from dflashkit.cache.sequences import generate_sequences  # noqa: E402
from dflashkit.train.data import MemorySource, OnlineSource, Sequence
from dflashkit.train.loop import train

LAYERS = [1, 8, 14, 20, 27]
DRAFT_VOCAB = 1874


def smoke_gate(target, seq, feats, tmp: Path, steps: int, block_size: int = 16, response: int = 64,
               lr: float = 3e-3) -> dict:
    """Overfit one completion; every stride block whose labels all exist must then be drafted entirely."""
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.drafter.head import DraftHead
    from dflashkit.evaluate.offline import evaluate_sequence

    T = min(seq.length, seq.prompt_len + response)
    one = Sequence(seq.id, seq.tokens[:T], seq.prompt_len)
    cfg = load_config(None, dict(target=target.name, out=str(tmp / "smoke"), num_layers=2, target_layer_ids=LAYERS,
                                 block_size=block_size, anchors_per_seq=response, batch_size=1, steps=steps, lr=lr,
                                 progress=False, save_every=10_000))
    t0 = time.perf_counter()
    out = train(cfg, target=target, source=MemorySource([one], [feats[:T]], LAYERS))
    seconds = time.perf_counter() - t0
    if not out["finished"]:
        raise SystemExit(f"smoke gate stopped early: {out['stop_reason']}")
    dr = load_drafter(out["checkpoint"], target=target)
    recs = evaluate_sequence(dr, DraftHead.for_drafter(target, dr), target.embed_tokens, one.tokens, feats[:T],
                             one.prompt_len, anchors="stride")
    full = [r["streak"] for r in recs if r["n_labels"] == block_size - 1]
    print(f"smoke gate: streaks {full} after {steps} steps ({seconds:.0f}s), final loss {out['losses'][-1]:.4f}",
          flush=True)
    return {"steps": steps, "seconds": seconds, "block_size": block_size, "num_layers": 2,
            "response_tokens": T - one.prompt_len, "streaks": full, "final_loss": out["losses"][-1],
            "passed": bool(full) and all(x == block_size - 1 for x in full)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round (after 1 warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all configurations; the best round counts")
    p.add_argument("--num-layers", type=int, default=5)
    p.add_argument("--skip-online", action="store_true")
    p.add_argument("--smoke-steps", type=int, default=200, help="steps of the one-completion overfit (0: skip it)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice); on a shared "
                   "machine 1 thread is far more stable than 2 threads that wait on each other")
    p.add_argument("--out", default="runs/bench-train")
    args = p.parse_args(argv)
    use_environment()  # $DFLASHKIT_HOME and the rest, as the `dflashkit` command reads them
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target, device="cpu")
    print(f"target {target.name} ({target.dtype}), {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}",
          flush=True)
    out_dir = Path(args.out)
    t0 = time.perf_counter()  # `data generate` itself: resumable, so a rerun reuses the responses
    seq_file = generate_sequences(target, "train-mix", out_dir / "seqs.jsonl", args.max_new_tokens,
                                  batch_size=args.num_prompts, num_prompts=args.num_prompts, progress=False)
    gen_s = time.perf_counter() - t0
    seqs = OnlineSource(seq_file, target, args.num_prompts, 4096).seqs
    t0 = time.perf_counter()
    feats = [target.forward(s.tokens[None], layer_ids=LAYERS, use_cache=False, compute_logits=False).features[0]
             for s in seqs]
    feat_s = time.perf_counter() - t0
    resp = sum(s.length - s.prompt_len for s in seqs)
    print(f"data: {len(seqs)} sequences, {resp} response tokens ({seq_file}, {gen_s:.0f}s), features in {feat_s:.0f}s",
          flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    seen = sorted({t for s in seqs for t in s.tokens[s.prompt_len:].tolist()})
    fill = [i for i in range(target.vocab_size) if i not in set(seen)][: max(0, DRAFT_VOCAB - len(seen))]
    (tmp / "vocab.json").write_text(json.dumps(sorted(seen + fill)))

    runs = [("offline", "full vocabulary (49,152)", "none"),
            ("offline", f"draft vocabulary ({DRAFT_VOCAB})", str(tmp / "vocab.json")),
            ("offline", f"draft vocabulary (auto: {len(seen)} seen + specials)", "auto")]
    if not args.skip_online:
        runs.append(("online", f"draft vocabulary ({DRAFT_VOCAB})", str(tmp / "vocab.json")))
    timed = {k: [] for k in range(len(runs))}  # config -> per-round lists of step records
    for rnd in range(args.rounds):  # rounds interleave the configurations, so a load change hits them alike
        for k, (mode, label, vocab) in enumerate(runs):
            cfg = load_config(None, dict(
                target=args.target, out=str(tmp / f"run{k}-{rnd}"), num_layers=args.num_layers, target_layer_ids=LAYERS,
                block_size=16, anchors_per_seq=32, batch_size=4, steps=args.steps + 1, draft_vocab=vocab,
                progress=False, save_every=10_000, data=str(seq_file) if mode == "online" else "",
                num_sequences=args.num_prompts if mode == "online" else None))
            src = MemorySource(seqs, feats, LAYERS) if mode == "offline" else None
            out = train(cfg, target=target, source=src)
            if not out["finished"]:  # Ctrl-C/SIGTERM stopped the run cleanly: stop the benchmark too
                print(f"stopped: {out['stop_reason']}")
                return 130
            timed[k].append(out["history"][1:])
            med = statistics.median(r["blocks"] / r["blocks_per_s"] for r in out["history"][1:])
            print(f"round {rnd}: {mode:8s} {label:45s} {med:6.2f} s/step (load {os.getloadavg()[0]:.1f})", flush=True)
    results = []
    for k, (mode, label, vocab) in enumerate(runs):
        per_round = [statistics.median(r["blocks"] / r["blocks_per_s"] for r in rows) for rows in timed[k]]
        rows = [r for rows in timed[k] for r in rows]
        step_s = min(per_round)  # the least disturbed round
        blocks = statistics.median(r["blocks"] for r in rows)
        tokens = statistics.median(r["tokens"] for r in rows)
        results.append({"mode": mode, "vocabulary": label, "seconds_per_step": step_s, "round_medians": per_round,
                        "blocks_per_step": blocks, "tokens_per_step": tokens, "blocks_per_s": blocks / step_s,
                        "tokens_per_s": tokens / step_s})

    smoke = None if args.smoke_steps == 0 else smoke_gate(target, seqs[0], feats[0], tmp, args.smoke_steps)

    full = results[0]["seconds_per_step"]
    rows = [[r["mode"], r["vocabulary"], r["seconds_per_step"], r["blocks_per_s"], r["tokens_per_s"],
             full / r["seconds_per_step"]] for r in results]
    table = markdown_table(["features", "lm_head", "s/step", "blocks/s", "target tokens/s", "speed vs full"], rows, 2)
    meta = {"target": target.name, "threads": torch.get_num_threads(), "load_avg_end": os.getloadavg()[0],
            "num_layers": args.num_layers, "layer_ids": LAYERS, "block_size": 16, "anchors_per_seq": 32,
            "sequences_per_step": 4, "data": {"sequences": len(seqs), "response_tokens": resp,
                                              "generation_s": gen_s, "features_s": feat_s}}
    write_json(out_dir / "bench_train.json", {"settings": meta, "results": results, "smoke_gate": smoke})
    text = (f"# Training throughput: {args.num_layers}-layer drafter on {target.name}, CPU, "
            f"{torch.get_num_threads()} threads\n\n"
            f"Block 16, 32 anchors x 4 sequences per step (128 blocks), gamma-7 CE, AdamW; s/step = best of "
            f"{args.rounds} interleaved rounds of the median of {args.steps} steps after one warm-up. Target tokens = "
            f"prompt + response tokens of the sequences consumed.\n\n"
            + table + f"\nData: {len(seqs)} train-mix sequences, {resp} response tokens; load average at the end "
            f"{meta['load_avg_end']:.1f}.\n")
    if smoke:
        text += (f"\nSmoke gate on {target.name}: overfitting one completion ({smoke['response_tokens']} response tokens) "
                 f"with a {smoke['num_layers']}-layer drafter, block {smoke['block_size']}, {smoke['steps']} steps "
                 f"({smoke['seconds']:.0f}s): stride-block streaks {smoke['streaks']} (max {smoke['block_size'] - 1}): "
                 f"{'PASS' if smoke['passed'] else 'FAIL'}.\n")
    write_text(out_dir / "bench_train.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
