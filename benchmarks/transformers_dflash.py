"""transformers' own DFlash loop with a drafter exported by `dflashkit drafter export --format transformers`, run the
way a transformers user runs it (AutoModel / AutoModelForCausalLM, `generate(..., speculation_type="dflash")`, no
dflashkit code in the loop): its tokens against the target's plain greedy `generate`, its tokens per target forward
and its speed, prompt by prompt, the two alternating in one process.

    python benchmarks/transformers_dflash.py --target smollm2-135m --drafter runs/tf-export --num-prompts 3 \\
        --max-new-tokens 128 --out benchmarks/results/cpu-DATE-transformers-dflash
"""

from __future__ import annotations

import argparse
import time

import torch

from common import cpu_name, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m", help="registry name or a target folder")
    ap.add_argument("--drafter", required=True, help="a folder written by `drafter export --format transformers`")
    ap.add_argument("--prompts", default="coding-10")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from dflashkit.prompts import select_prompts
    from dflashkit.targets.registry import resolve

    folder = resolve(args.target)[1]
    tok = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    forwards = []
    target.register_forward_pre_hook(lambda *_: forwards.append(1))
    rows, md = [], []
    for item in select_prompts(args.prompts, args.num_prompts).items:
        ids = tok.apply_chat_template([dict(m) for m in item.messages], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        runs = {}
        for name, extra in (("greedy", {}), ("dflash", {"assistant_model": drafter, "speculation_type": "dflash"})):
            forwards.clear()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=args.max_new_tokens, **extra)
            runs[name] = (out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0, len(forwards))
        (g, tg, _), (d, td, fd) = runs["greedy"], runs["dflash"]
        rows.append({"prompt": item.id, "equal": g == d, "new_tokens": len(d), "target_forwards": fd,
                     "tokens_per_forward": len(d) / max(1, fd - 1), "greedy_s": tg, "dflash_s": td})
        print(rows[-1], flush=True)
    n = sum(r["new_tokens"] for r in rows)
    per_forward = n / sum(r["target_forwards"] - 1 for r in rows)
    speed = {k: n / sum(r[f"{k}_s"] for r in rows) for k in ("greedy", "dflash")}
    md += ["# transformers' own DFlash loop with an exported dflashkit drafter", "",
           f"CPU: {cpu_name()}; {torch.get_num_threads()} threads; float32; target {args.target}; drafter "
           f"{args.drafter}; {args.prompts} x {len(rows)}, {args.max_new_tokens} new tokens.", "",
           "| prompt | equal to greedy | new tokens | target forwards | tokens per forward |", "|---|---|---|---|---|",
           *(f"| {r['prompt']} | {r['equal']} | {r['new_tokens']} | {r['target_forwards']} | "
             f"{r['tokens_per_forward']:.3f} |" for r in rows), "",
           f"Tokens per target forward (after the prefill): {per_forward:.3f}; tokens/s greedy {speed['greedy']:.1f}, "
           f"dflash {speed['dflash']:.1f} ({speed['dflash'] / speed['greedy']:.2f}x); every output equal to greedy: "
           f"{all(r['equal'] for r in rows)}."]
    write_results(args.out, md, {"cpu": cpu_name(), "rows": rows, "tokens_per_forward": per_forward, "speed": speed})
    print("\n".join(md))


if __name__ == "__main__":
    main()
