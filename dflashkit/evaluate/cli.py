"""`dflashkit eval`, `dflashkit compare` and `dflashkit parity`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dflashkit.threads import add_threads_option


def register(sub) -> None:
    p = sub.add_parser("eval", help="score a drafter offline on cached target states (streak, DDTree, per position)")
    p.add_argument("--drafter", required=True, help="drafter checkpoint folder (dflashkit or z-lab format)")
    p.add_argument("--cache", required=True, help="cache folder written by `dflashkit extract`")
    p.add_argument("--target", help="target model (default: the one named in the cache manifest)")
    p.add_argument("--num-prompts", type=int, help="the first N prompts of the cache (default: all)")
    p.add_argument("--allow-partial", action="store_true", help="proceed when the cache holds fewer prompts than asked")
    p.add_argument("--max-blocks", type=int, help="at most N blocks per prompt (default: all)")
    p.add_argument("--trees", default="budget:4,budget:8",
                   help="comma-separated tree specs: budget:B (DDTree, shown as ddtree-B), paths:K, width:K")
    p.add_argument("--anchors", choices=["stride", "walk"], default="stride",
                   help="stride: every block_size tokens (comparable across drafters); walk: next = anchor + streak + 1")
    p.add_argument("--out", help="run folder to write (default: runs/eval-DRAFTER-CACHE-TIME)")
    p.add_argument("--show-matches", action="store_true", help="print each block's match string")
    p.add_argument("--allow-skipped", action="store_true",
                   help="load a drafter with tensors its config has no place for (the load report names the model run)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--force", action="store_true", help="replace an existing run folder")
    p.add_argument("--engine", default=None, help="also predict decoding speed on this backend or peer (auto, hf, "
                   "static, llama.cpp or vllm) from the run's acceptance and its cost model (measured once, cached)")
    add_threads_option(p)
    p.set_defaults(func="dflashkit.measure.cli:cmd_eval")  # it prices the run: measure, a layer above this one

    c = sub.add_parser("compare", help="eval runs side by side per prompt and overall, with differences and ratios")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run folders; the first is the reference for ratios")
    c.add_argument("--out", help="output folder for tables and plots (default: beside the first run)")
    c.add_argument("--force", action="store_true",
                   help="compare runs with different caches, prompts, anchors or block settings (the table says so)")
    c.set_defaults(func=cmd_compare)

    q = sub.add_parser("parity", help="two bench or generate outputs token for token: per prompt equal or the first "
                       "divergence, with the text and the target's top-2 margin there")
    q.add_argument("run_a", metavar="RUN_A", help="a bench folder or a `generate --out` file")
    q.add_argument("run_b", metavar="RUN_B", help="the same, from any engine")
    q.add_argument("--method", help="RUN_A's method to compare (default: the one it holds, or every shared one)")
    q.add_argument("--against", help="RUN_B's method to compare with (default: --method)")
    q.add_argument("--target", help="tokenizer for the text (default: the target folder the runs recorded)")
    q.add_argument("--out", help="folder for parity.json and parity.md (default: print only)")
    q.add_argument("--json", action="store_true", help="print the result as JSON instead of Markdown")
    q.set_defaults(func=cmd_parity)


def run_eval_command(args, replays=None) -> dict:
    """What `dflashkit eval` does; returns the run's result, which measure/cli.cmd_eval prices with --engine
    (`replays(target)`: hybrid-auto replayed at each engine's prices, for evaluate's walk)."""
    from tqdm import tqdm

    from dflashkit.cache import open_cache
    from dflashkit.cache.store import check_target
    from dflashkit.errors import DFlashError
    from dflashkit.evaluate import offline, runs
    from dflashkit.targets.model import load_target

    trees = offline.parse_trees(args.trees)  # bad settings fail before anything loads
    offline.check_mode(args.anchors, args.max_blocks)
    ckpt = Path(args.drafter)
    run_dir = Path(args.out or f"runs/eval-{ckpt.resolve().name}-{Path(args.cache).resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists() and any(run_dir.iterdir()) and not args.force:
        raise DFlashError(f"--out {run_dir} exists and is not empty; choose another name or pass --force to replace it")
    cache = open_cache(args.cache, num_prompts=args.num_prompts, allow_partial=args.allow_partial,
                       partial_hint="--allow-partial")
    target_ref = args.target or cache.target.get("path") or cache.target.get("name")
    if not args.target and not Path(str(target_ref)).exists():
        target_ref = cache.target.get("name")  # the registry name, when the recorded folder has moved
    served = cache.target.get("weights") or "float"  # features extracted at a quantized format: the same model here
    served = served.removeprefix("file ")  # ... or from a GGUF file of the target (--weights FILE.gguf)
    target = load_target(target_ref, device=args.device, weights=served)
    check_target(cache.path, cache.manifest, target.identity())  # weights included: a fine-tune is another target
    return runs.run_eval(ckpt, target, cache, run_dir, anchors=args.anchors, trees=trees, max_blocks=args.max_blocks,
                         show_matches=args.show_matches, say=tqdm.write, allow_skipped=args.allow_skipped,
                         replays=replays(target) if replays else None)


def cmd_compare(args) -> int:
    from dflashkit.evaluate.compare import compare_runs, default_out

    out = Path(args.out) if args.out else default_out(args.runs)
    print(compare_runs(args.runs, out=out, force=args.force)["markdown"])
    print(f"written to {out}")
    return 0


def cmd_parity(args) -> int:
    """Exit 1 when a prompt parts other than at a numerics near-tie (docs/design.md section 11: a failed check)."""
    from dflashkit.evaluate.compare import parity_markdown, run_parity, write_parity

    res = run_parity(args.run_a, args.run_b, args.method, args.against, args.target)
    print(json.dumps(res, indent=1) if args.json else parity_markdown(res))
    if args.out:
        print("wrote " + ", ".join(str(p) for p in write_parity(res, args.out)))
    return 0 if res["ok"] else 1
