"""forward_blocks' attention paths at the paper's training shape: dense mask vs chunked (vs flex on CUDA).

    python benchmarks/bench_attention.py [--anchors 512] [--seq-len 3072] [--num-layers 2] [--repeats 3] [--head]

Issue #15's bar: a 2-layer drafter shaped like SmolLM2-135M (hidden 576, 9/3 heads, head dim 64, MLP 1536, 5 target
layers fed), forward + backward over 512 anchors x block 16 on one 3072-token sequence, float32, the machine's
threads. Every path runs in a fresh subprocess, so its peak memory (ru_maxrss of that process, minus the same
process's peak before the first step, i.e. after building the model and inputs) is its own; inside it one untimed
warm-up step, then --repeats timed steps (the median counts). --head adds the training loss over the full
49,152-token lm_head (chunked CE, as a training step with draft_vocab none pays). The outputs and gradients of
the paths are compared (max abs diff vs dense) from one extra step each, saved by the children.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(args, device):
    from dflashkit.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    H, K, B = 576, 5, 16
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                        num_hidden_layers=args.num_layers, target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30,
                        mask_token_id=0, vocab_size=49152, block_size=B, rope_theta=100000.0)
    drafter = DFlashDrafter(cfg).to(device)
    T, n = args.seq_len, args.anchors
    anchors = (torch.randperm(T - 2)[:n].sort().values + 1)[None].to(device)  # like sample_anchors: sorted, distinct
    feats = torch.randn(1, T, K * H, device=device)
    emb = torch.randn(1, n * B, H, device=device) * 0.02
    lm_head = torch.randn(49152, H, device=device) * 0.02 if args.head else None
    labels = torch.randint(0, 49152, (1, n, B), device=device)
    labels[:, :, 0] = -100
    return drafter, feats, emb, anchors, lm_head, labels


def one_step(kind, drafter, feats, emb, anchors, lm_head, labels):
    from dflashkit.drafter.head import DraftHead
    from dflashkit.train.loss import block_loss, slot_weights

    drafter.zero_grad(set_to_none=True)
    out = drafter.forward_blocks(feats, emb, anchors, attention=kind)
    if lm_head is None:
        loss = (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum() / out.shape[1]
    else:
        w = slot_weights(labels.shape[-1], 7.0).to(out.device)
        loss, _ = block_loss(out, labels, w, DraftHead(lm_head), "ce", float(labels.numel()))
    loss.backward()
    return out


def child(args) -> None:
    """One path in this process: timings and peak memory as one JSON line on stdout."""
    device = torch.device(args.device)
    drafter, feats, emb, anchors, lm_head, labels = build(args, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated() / 2**20
    out = one_step(args.child, drafter, feats, emb, anchors, lm_head, labels)  # warm-up (and compile, for flex)
    sync()
    if args.save:
        torch.save({"out": out.detach().cpu(), **{n: p.grad.cpu() for n, p in drafter.named_parameters()}}, args.save)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        one_step(args.child, drafter, feats, emb, anchors, lm_head, labels)
        sync()
        times.append(time.perf_counter() - t0)
    res = {"path": args.child, "median_s": statistics.median(times), "times_s": times,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "peak_rss_over_setup_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss,
           "threads": torch.get_num_threads()}
    if device.type == "cuda":
        res["peak_gpu_over_setup_mib"] = torch.cuda.max_memory_allocated() / 2**20 - base_gpu
    print(json.dumps(res), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--head", action="store_true", help="add the full-vocabulary lm_head CE loss (a whole training step)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--paths", default=None, help="comma list (default: dense,chunked and flex on CUDA)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    paths = args.paths.split(",") if args.paths else ["dense", "chunked"] + (["flex"] if args.device == "cuda" else [])
    print(f"{args.num_layers}-layer drafter (hidden 576, 9/3 heads), {args.anchors} anchors x 16 on {args.seq_len} tokens, "
          f"forward + backward{' + full-vocabulary CE' if args.head else ''}, float32, {args.device}, "
          f"{torch.get_num_threads()} threads; each path in a fresh process", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in paths:
            cmd = [sys.executable, __file__, "--child", kind, "--save", str(Path(tmp) / f"{kind}.pt"),
                   "--anchors", str(args.anchors), "--seq-len", str(args.seq_len), "--num-layers", str(args.num_layers),
                   "--repeats", str(args.repeats), "--device", args.device] + (["--head"] if args.head else [])
            run = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            if run.returncode != 0:
                print(f"{kind}: FAILED\n{run.stderr[-3000:]}")
                continue
            results[kind] = json.loads(run.stdout.strip().splitlines()[-1])
            r = results[kind]
            mem = f"peak RSS {r['peak_rss_mib']:.0f} MiB (+{r['peak_rss_over_setup_mib']:.0f} over setup)"
            if "peak_gpu_over_setup_mib" in r:
                mem += f", GPU +{r['peak_gpu_over_setup_mib']:.0f} MiB"
            print(f"{kind:8s} {r['median_s']:7.2f} s/step (median of {args.repeats}: "
                  f"{', '.join(f'{t:.2f}' for t in r['times_s'])}), {mem}", flush=True)
        if "dense" in results:
            ref = torch.load(Path(tmp) / "dense.pt")
            for kind in results:
                if kind == "dense":
                    continue
                got = torch.load(Path(tmp) / f"{kind}.pt")
                diff = {k: (got[k].float() - ref[k].float()).abs().max().item() for k in ref}
                worst = max((k for k in diff if k != "out"), key=diff.get)
                print(f"{kind:8s} vs dense: output max |diff| {diff['out']:.2e}, gradients max |diff| {diff[worst]:.2e} "
                      f"({worst}); speed-up {results['dense']['median_s'] / results[kind]['median_s']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
