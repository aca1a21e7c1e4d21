"""Do two backends hand the drafter the same hidden states? Features against float32, and acceptance on one text.

    python benchmarks/backend_features.py --bench RUN [--drafter DIR] [--dtype bfloat16] [--tag TAG]

RUN is a bench folder whose results.json holds plain decoding on both backends (`ar@hf` and `ar`, the static
backend's): their answers are the texts. For each answer, the prompt + answer goes through each backend's prefill
(hf under the kernels decoding runs, static through its compiled step) in --dtype and, as the reference, through
transformers' float32 forward; per drafter layer, the relative error of each backend's features against float32.
Then the drafter walks each text as chain decoding at T=0 would (anchor, B-1 drafts, the leading ones equal to the
text accepted, the next anchor after them), fed one backend's features or the other's: equal acceptance on one text
means the backends hand the drafter the same thing, and a tau gap between the backends online is their texts'.
Writes benchmarks/results/cpu-DATE-backend-features[-TAG].{md,json}, naming the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch

from common import cpu_name, write_results
from dflashkit.decode.speculative import DFlashProposer
from dflashkit.decode.hf import HfBackend
from dflashkit.decode.session import DecodeSession
from dflashkit.decode.static import StaticBackend, decoder_for
from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.report import markdown_table
from dflashkit.targets.model import load_target

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {"hf": "ar@hf", "static": "ar"}  # whose answers, by the bench row of each backend's plain decoding


def features(target, proposer, decoder, ids: list[int]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"hf": HfBackend(target).prefill(ids, proposer.layer_ids)[1].float(),
                "static": StaticBackend(decoder).prefill(ids, proposer.layer_ids)[1].float()}


def walk(proposer, feats: torch.Tensor, ids: list[int], start: int) -> list[int]:
    """Tokens committed per round of chain decoding at T=0 along `ids` from `start` (the first answer token)."""
    B, rounds, pos = proposer.block_size, [], start
    proposer.reset(ids[:start])
    new = feats[:, :start]
    while pos + B < len(ids):
        drafts, _ = proposer.draft(new, torch.tensor([ids[pos]]), pos)
        kept = next((k for k in range(B - 1) if int(drafts[k]) != ids[pos + 1 + k]), B - 1)
        rounds.append(kept + 1)
        new, pos = feats[:, pos : pos + kept + 1], pos + kept + 1
    return rounds


def relative(a: torch.Tensor, ref: torch.Tensor, layers: int) -> list[float]:
    F = ref.shape[-1] // layers
    return [float((a[..., i * F:(i + 1) * F] - ref[..., i * F:(i + 1) * F]).norm() / ref[..., i * F:(i + 1) * F].norm())
            for i in range(layers)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True, help="a bench folder with ar@hf and ar (static) rows")
    ap.add_argument("--drafter", default="runs/demo/train/best", help="relative to the working folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    res = json.loads((Path(args.bench) / "results.json").read_text())
    runs = {b: [r for r in res["runs"] if r["method"] == m] for b, m in TEXTS.items()}
    if not all(runs.values()):
        sys.exit(f"{args.bench}/results.json: needs rows {' and '.join(TEXTS.values())} (bench --engine static,hf)")
    target = load_target(res["config"]["target"], device="cpu", dtype=args.dtype)
    reference = load_target(res["config"]["target"], device="cpu", dtype="float32")
    drafter = load_drafter(args.drafter, target=target, device=target.device, dtype=target.dtype)
    proposer = DFlashProposer(target, drafter)
    decoder = decoder_for(DecodeSession(target, trees=True), 2048, proposer, trees=True)
    layers = len(proposer.layer_ids)
    errors, taus = {b: [] for b in TEXTS}, {(text, b): [] for text in TEXTS for b in TEXTS}
    for text, rows in runs.items():
        for r in rows:
            ids, start = r["prompt_ids"] + r["tokens"], len(r["prompt_ids"])
            feats = features(target, proposer, decoder, ids)
            if text == "hf":  # the feature error on one text is enough
                with torch.no_grad():
                    ref = HfBackend(reference).prefill(ids, proposer.layer_ids)[1].float()
                for b in TEXTS:
                    errors[b].append(relative(feats[b], ref, layers))
            for b in TEXTS:
                taus[(text, b)] += walk(proposer, feats[b], ids, start)
            print(f"{text} {r['prompt']}: done", file=sys.stderr)
    mean_err = {b: [sum(e[i] for e in errors[b]) / len(errors[b]) for i in range(layers)] for b in TEXTS}
    tau = {f"{text} text, {b} features": (sum(t) / len(t), len(t)) for (text, b), t in taus.items()}
    where = f"{cpu_name()}, {args.dtype}, {res['config']['target']}, drafter {args.drafter}"
    md = [f"# Backend features: {where}", "", f"Texts: the plain answers of `{args.bench}` ({len(runs['hf'])} prompts).", "",
          "## Features against transformers' float32 forward (relative error, mean over the prompts)", "",
          markdown_table(["backend"] + [f"layer {i}" for i in proposer.layer_ids],
                         [[b, *(f"{e:.2e}" for e in errs)] for b, errs in mean_err.items()]),
          "## Chain acceptance at T=0 along one text (tau: tokens committed per round)", "",
          markdown_table(["text, features", "tau", "rounds"],
                         [[k, v, n] for k, (v, n) in tau.items()], digits=4)]
    stem = ROOT / "benchmarks" / "results" / f"cpu-{date.today()}-backend-features{'-' + args.tag if args.tag else ''}"
    write_results(stem, md, {"machine": where, "bench": args.bench, "feature_error": mean_err, "tau": tau})
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
