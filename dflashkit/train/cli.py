"""`dflashkit train` and `dflashkit data generate`; several GPUs run the same command under torchrun, e.g.
`torchrun --nproc_per_node 8 -m dflashkit.cli train --config paper distributed=fsdp`."""

from __future__ import annotations

from dflashkit.decode.methods import PRICED
from dflashkit.targets.formats import add_weights_option
from dflashkit.threads import add_threads_option


def register(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (YAML config + key=value overrides; torchrun for multi-GPU)")
    p.add_argument("--config", help="YAML file of settings, or a shipped one by name (`dflashkit config list`); defaults "
                                       "apply to keys it omits")
    p.add_argument("--print-config", action="store_true", help="print every setting with its value and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override settings, e.g. lr=3e-4 steps=100")
    add_threads_option(p)
    p.set_defaults(func=cmd_train, on_interrupt="interrupted; the run folder holds its last checkpoint, and the same "
                   "command resumes from it")

    d = sub.add_parser("data", help="training data: regenerate responses with the target")
    dsub = d.add_subparsers(dest="data_command", required=True)
    g = dsub.add_parser("generate", help="greedy target responses to every turn of a prompt suite -> sequences JSONL "
                        "(resumable)")
    g.add_argument("--target", default="smollm2-135m", help="registry name or local Hugging Face folder")
    g.add_argument("--prompts", required=True,
                   help="built-in suite (e.g. train-mix) or JSONL files: ours, OpenAI chat, ShareGPT, z-lab turns, "
                   "Spec-Bench (several joined by commas); every assistant turn is the target's own")
    g.add_argument("--use-file-responses", action="store_true",
                   help="train on the file's own assistant answers instead of the target's (recorded in the header; "
                   "the field measured about 10%% lower tau than with regenerated responses)")
    g.add_argument("--out", required=True, help="sequences JSONL to write (appended batch by batch; a rerun resumes)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")
    g.add_argument("--per-category", type=int, default=None, metavar="N", help="only the first N of each category")
    g.add_argument("--device", default="auto")
    g.add_argument("--engine", default="hf", choices=("auto",) + PRICED,
                   help="what answers: hf (transformers, batched) or, one prompt at a time, what you serve on (static, "
                   "llama.cpp, vllm): in bf16 each writes its own text, and an eval on it predicts that engine")
    add_weights_option(g)
    add_threads_option(g)
    g.set_defaults(func=cmd_generate, on_interrupt="interrupted; the answers finished so far are in --out, and the "
                   "same command resumes from there")


def cmd_train(args) -> int:
    from dflashkit.train.config import format_config, load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(format_config(cfg), end="")
        return 0
    from dflashkit.train.loop import train

    summary = train(cfg)
    if summary["finished"] or summary["stop_reason"].startswith("max_minutes"):
        return 0  # a time budget is a planned stop; the checkpoint and summary say it is unfinished
    return 130  # Ctrl-C / SIGTERM: saved, and a rerun resumes


def cmd_generate(args) -> int:
    from dflashkit.cache.sequences import generate_sequences, read_sequences
    from dflashkit.measure.peers import plain_answers
    from dflashkit.errors import DFlashError
    from dflashkit.prompts import select_prompts
    from dflashkit.targets.model import load_target

    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise DFlashError("--max-new-tokens and --batch-size must be at least 1")
    suite = select_prompts(args.prompts, per_category=args.per_category)  # before the target loads: errors are fast
    target = load_target(args.target, device=args.device, weights=args.weights)
    with plain_answers(target, "hf" if args.use_file_responses else args.engine, args.max_new_tokens) as by:
        out = generate_sequences(target, suite, args.out, args.max_new_tokens, args.batch_size, args.num_prompts,
                                 use_file_responses=args.use_file_responses, answered_by=by)
    head, recs = read_sequences(out)
    tokens, stopped = sum(len(r["completion_ids"]) for r in recs), sum(bool(r.get("stopped")) for r in recs)
    who = "the file's own answers" if head.get("responses") == "file" else f"the target's own answers on {head['engine']}"
    print(f"{out}: {len(recs)} sequences (one per turn), {tokens} response tokens ({who}), {stopped} ended with a "
          "stop token")
    return 0
