"""`dflashkit extract` and `dflashkit cache ls|inspect|verify|diff`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflashkit.targets.cli import target_layers_arg
from dflashkit.targets.formats import DOTS, add_weights_option, base
from dflashkit.threads import add_threads_option


def register(sub) -> None:
    p = sub.add_parser("extract", help="generate the target's completions and cache its hidden states (resumable)")
    p.add_argument("--target", default="smollm2-135m", help="registry name or local Hugging Face folder")
    p.add_argument("--prompts", required=True,
                   help="built-in suite (coding-10, train-mix) or JSONL files: ours, OpenAI chat, ShareGPT, z-lab turns, "
                   "Spec-Bench (several joined by commas); every turn of a multi-turn row is answered by the target, "
                   "after its own earlier answers (kept in OUT.turns.jsonl)")
    p.add_argument("--out", required=True, help="cache folder (created; an unfinished one is resumed)")
    p.add_argument("--target-layers", type=target_layers_arg, default="auto", metavar="IDS",
                   help="target layer ids to cache: auto (5 layers, z-lab rule) or ids like 1,8,14")
    p.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts of the suite")
    p.add_argument("--per-category", type=int, default=None, metavar="N", help="only the first N of each category")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch (and per capture forward)")
    p.add_argument("--samples", type=int, default=0, metavar="K",
                   help="also K answers per prompt sampled at --temperature (prompts ID~s1..ID~sK): more training data "
                   "from the same prompts once their greedy answers are used")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of --samples (default 0.8)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on CPUs with native bf16 dot products, else float32), float32, "
                   "bfloat16, float16")
    add_weights_option(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--linear-attention", default="auto", choices=["auto", "torch", "torch-recurrent", "fla"],
                   help="gated-delta-rule backend of hybrid targets (recorded in the manifest)")
    p.add_argument("--thinking", action="store_true", help="enable_thinking=True in chat templates that have it")
    p.add_argument("--completions-from", default=None, metavar="CACHE",
                   help="reuse another cache's completions (compare backends on the same tokens), or a sequences "
                   "JSONL's from `dflashkit data generate`, instead of generating")
    p.add_argument("--allow-final-layers", action="store_true", help="permit the last two decoder layers")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_threads_option(p)
    p.set_defaults(func=cmd_extract, on_interrupt="interrupted; every finished prompt is in the cache folder, and the "
                   "same command resumes from there")

    c = sub.add_parser("cache", help="list, inspect, verify and compare caches of target hidden states")
    csub = c.add_subparsers(dest="cache_command", required=True)
    q = csub.add_parser("ls", help="find caches under folders: one line each")
    q.add_argument("dirs", nargs="*", default=["."])
    q.set_defaults(func=cmd_ls)
    q = csub.add_parser("inspect", help="what a cache holds and how it was made")
    q.add_argument("dir")
    q.add_argument("--json", action="store_true", help="print the manifest as JSON")
    q.set_defaults(func=cmd_inspect)
    q = csub.add_parser("verify", help="every file present, hashes and shapes agree with the manifest (exit 1 if not)")
    q.add_argument("dir")
    q.set_defaults(func=cmd_verify)
    q = csub.add_parser("diff", help="per-layer cosine / abs / relative error between two caches")
    q.add_argument("a")
    q.add_argument("b")
    q.add_argument("--min-cosine", type=float, default=None,
                   help="exit 1 when any layer has a token whose cosine similarity is below this")
    q.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    q.add_argument("--out", default=None, metavar="FILE", help="also write the result as JSON to FILE")
    q.add_argument("--md", dest="md_out", default=None, metavar="FILE", help="also write the report as Markdown")
    q.set_defaults(func=cmd_diff)


def cmd_extract(args) -> int:
    from dflashkit.cache.extraction import extract
    from dflashkit.distributed import init_distributed
    from dflashkit.errors import DFlashError
    from dflashkit.prompts import select_prompts
    from dflashkit.targets.model import load_target

    if args.weights.endswith(DOTS):
        raise DFlashError(f"--weights {args.weights}: extraction captures features through transformers, which "
                          f"computes {base(args.weights)}'s values in float32; the integer dots run in the static "
                          f"backend's decoding (generate, bench). Extract at --weights {base(args.weights)}")
    suite = select_prompts(args.prompts, args.num_prompts, args.per_category)
    d = init_distributed(args.device)  # under torchrun: one GPU per rank (cuda:LOCAL_RANK), or the CPU
    target = load_target(args.target, device=str(d.device), dtype=args.dtype, weights=args.weights)
    extract(target, suite, args.out, layer_ids=args.target_layers, max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, linear_attention=args.linear_attention, progress=not args.quiet,
            enable_thinking=args.thinking, completions_from=args.completions_from,
            allow_final_layers=args.allow_final_layers, samples=args.samples, temperature=args.temperature)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def cmd_ls(args) -> int:
    from dflashkit.cache.store import cache_size, find_caches, read_manifest
    from dflashkit.errors import DFlashError

    if missing := [d for d in args.dirs if not Path(d).is_dir()]:
        raise DFlashError(f"{missing[0]}: no such folder")
    found = find_caches(args.dirs)
    for path in found:
        try:
            m = read_manifest(path)
        except DFlashError as e:
            print(f"{path}  unreadable: {e}")
            continue
        if m.get("status") == "complete":
            n, tokens, state = len(m["prompts"]), m["totals"]["tokens"], ""
        else:
            n, tokens = sum(1 for _ in path.rglob("*.safetensors")), "?"
            state = f"  INCOMPLETE ({n} of {m['suite']['num_prompts']} prompt files)"
        print(f"{path}  {n} prompts  {tokens} tokens  layers {m['layer_ids']}  target {m['target'].get('name')}  "
              f"{m.get('dtype')}  {_size(cache_size(path))}{state}")
    if not found:
        print(f"no caches under {', '.join(args.dirs)}", file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    from dflashkit.cache.store import cache_size, read_manifest

    m = read_manifest(args.dir)
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    t, g, s = m["target"], m["generation"], m["suite"]
    complete = m.get("status") == "complete"
    rows = [
        ("status", m.get("status") + ("" if complete else " (rerun the same `dflashkit extract` command to resume)")),
        ("target", f"{t.get('name')} {t.get('architecture')} ({t.get('num_layers')} layers, hidden {t.get('hidden_size')}, "
                   f"config {t.get('config_hash')})"),
        ("target path", t.get("path")),
        ("layer ids", m["layer_ids"]),
        ("dtype / device", f"{m.get('dtype')} / {m.get('device')}"),
        ("attention", f"{m.get('attention')}; linear attention {m['linear_attention']['backend']} "
                      f"(asked {m['linear_attention']['requested']})"),
        ("generation", f"greedy, max_new_tokens {g['max_new_tokens']}, batch {g['batch_size']}, "
                       f"thinking {g['enable_thinking']}"
                       + (f", completions from {g['completions_from']}" if g.get("completions_from") else "")),
        ("suite", f"{s['name']} ({s['num_prompts']} prompts, content {s['content_hash'][:16]})"),
        ("layout", "sharded" if m["layout"]["sharded"] else "flat"),
        ("created", f"{m.get('created')} by dflashkit {m.get('tool_version')}, world size {m.get('world_size')}"),
        ("size", _size(cache_size(args.dir))),
    ]
    if complete:
        tot = m["totals"]
        rows.append(("contents", f"{tot['prompts']} prompts, {tot['tokens']} tokens ({tot['completion_tokens']} generated)"))
    for k, v in rows:
        print(f"{k:16s} {v}")
    if complete:
        print()
        for e in m["prompts"][:20]:
            print(f"  {e['id']:32s} prompt {e['prompt_len']:5d}  completion {e['completion_len']:5d}  {e['file']}")
        if len(m["prompts"]) > 20:
            print(f"  ... {len(m['prompts']) - 20} more")
    return 0


def cmd_verify(args) -> int:
    from dflashkit.cache.store import verify_cache

    problems, summary = verify_cache(args.dir, progress=True)
    for p in problems:
        print(f"PROBLEM {p}")
    if problems:
        print(f"{args.dir}: {len(problems)} problems; re-extract the cache (an unfinished one resumes with the same command)")
        return 1
    print(f"{args.dir}: OK ({summary['prompts']} prompts, {summary['tokens']} tokens; files, hashes and shapes agree "
          "with the manifest)")
    return 0


def cmd_diff(args) -> int:
    from dflashkit.cache.diff import diff_caches, format_diff
    from dflashkit.fileio import write_json, write_text

    r = diff_caches(args.a, args.b, min_cosine=args.min_cosine, progress=True)
    text = format_diff(r)
    result = {**r, "layers": {str(k): v for k, v in r["layers"].items()}}
    print(json.dumps(result, indent=2) + "\n" if args.json else text, end="")
    if args.out:
        write_json(args.out, result)
    if args.md_out:
        write_text(args.md_out, text)
    return 1 if r["below"] else 0
