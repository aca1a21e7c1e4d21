"""`dflashkit drafter info|init|export` (export's work is dflashkit/export.py: it needs the engines and evaluate)."""

from __future__ import annotations

from dflashkit.targets.cli import target_layers_arg
from dflashkit.threads import add_threads_option

DTYPES = ("bfloat16", "float32")
FORMATS = ("zlab", "gguf", "transformers")


def register(sub) -> None:
    p = sub.add_parser("drafter", help="inspect, create and export drafter checkpoints")
    dsub = p.add_subparsers(dest="drafter_command", required=True)
    i = dsub.add_parser("info", help="config, parameter count, expected target and the load report")
    i.add_argument("path")
    i.add_argument("--target", help="also check the drafter against this target")
    i.add_argument("--allow-skipped", action="store_true",
                   help="load a drafter with tensors its config has no place for (the load report names the model run)")
    add_threads_option(i)
    i.set_defaults(func=cmd_info)
    n = dsub.add_parser("init", help="write a fresh randomly initialised drafter for a target")
    n.add_argument("--target", default="smollm2-135m")
    n.add_argument("--num-layers", type=int, default=5, help="drafter decoder layers (released drafters: 5)")
    n.add_argument("--target-layers", type=target_layers_arg, default="auto", metavar="IDS",
                   help="target layer ids the drafter reads: auto (z-lab's rule for --num-layers) or ids like 1,8,14")
    n.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="dflash, or dflash2: grouped dynamic convolutions + a candidate selector (z-lab, 2026)")
    n.add_argument("--block-size", type=int, default=None, help="default 16 for dflash, 8 for dflash2 (as z-lab ships)")
    n.add_argument("--format", choices=["dflashkit", "zlab"], default="dflashkit")
    n.add_argument("--allow-final-layers", action="store_true", help="permit feeding the last two target layers")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--out", required=True)
    add_threads_option(n)
    n.set_defaults(func=cmd_init)
    e = dsub.add_parser("export", help="write a trained drafter as engines serve it: z-lab folder (vLLM, SGLang), GGUF "
                        "(llama.cpp) or transformers' own DFlash drafter")
    e.add_argument("--drafter", required=True, help="a drafter folder, a checkpoint, or a training run folder (its latest)")
    e.add_argument("--out", required=True, help="output folder (zlab, transformers) or .gguf file (gguf)")
    e.add_argument("--format", choices=FORMATS, default="zlab",
                   help="zlab: config.json + model.safetensors (vLLM, SGLang); gguf: llama.cpp's DFlash layout, "
                        "through its own converter (needs `dflashkit engines install llama.cpp`); transformers: a "
                        "folder AutoModel.from_pretrained loads as transformers' DFlash drafter, for "
                        "generate(..., assistant_model=drafter, speculation_type='dflash')")
    e.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype (hub drafters: bfloat16)")
    e.add_argument("--target", help="the target (registry name or folder; default: the one the drafter was trained "
                                    "for). Its head gives the token map's rows and, for gguf, its tokenizer")
    e.add_argument("--full-vocab", action="store_true",
                   help="leave out the draft vocabulary's token map: engines draft over every target token")
    e.add_argument("--cache", help="a feature cache (`dflashkit extract`) to measure tau as trained and as exported on")
    e.add_argument("--num-prompts", type=int, default=None, help="score only the cache's first N prompts")
    e.set_defaults(func="dflashkit.export:cmd_export")  # it needs the engines and evaluate, stages above this one


def cmd_info(args) -> int:
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.targets.model import load_target

    target = load_target(args.target, device="cpu") if args.target else None
    d = load_drafter(args.path, target=target, allow_skipped=args.allow_skipped)
    print("\n".join(d.load_report))  # its Architecture line states the block, attention kinds, scaling, DFlash2 parts
    c = d.config
    n = sum(p.numel() for p in d.parameters())
    print(f"parameters       {n / 1e6:.2f}M ({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"{c.num_attention_heads}/{c.num_key_value_heads} heads, head_dim {c.head_dim}, mlp {c.intermediate_size})")
    print(f"target layers    {c.target_layer_ids} of {c.num_target_layers}")
    print(f"mask token id    {c.mask_token_id}")
    print(f"rope             theta {c.rope_theta} scaling {c.rope_scaling}")
    if "sliding_attention" in c.layer_types:
        print(f"sliding window   {c.sliding_window} on layers {[i for i, t in enumerate(c.layer_types) if t == 'sliding_attention']}")
    if con := d.contract:
        tgt = con.get("target") or {}
        print(f"expected target  {tgt.get('name')} ({tgt.get('architecture')}, weights {tgt.get('weights_hash') or 'not recorded'}, "
              f"config {tgt.get('config_hash')}) {tgt.get('path', '')}")
        for key in ("loss", "gamma", "trained_steps"):
            if key in con:
                print(f"{key:16s} {con[key]}")
        if con.get("draft_vocab"):
            print(f"draft vocab      {len(con['draft_vocab'])} tokens")
    else:
        print("expected target  not recorded (z-lab format): any target with hidden size "
              f"{c.hidden_size} and {c.num_target_layers} layers")
    if target is not None:
        print(f"target check     OK against {target.name}")
    return 0


def cmd_init(args) -> int:
    from dflashkit.drafter.checkpoint import new_drafter, save_drafter
    from dflashkit.rng import seeded
    from dflashkit.targets.model import load_target

    target = load_target(args.target, device="cpu")
    block = args.block_size or (8 if args.arch == "dflash2" else 16)
    with seeded(args.seed):
        d = new_drafter(target, num_layers=args.num_layers, target_layer_ids=args.target_layers,
                        allow_final_layers=args.allow_final_layers, block_size=block, arch=args.arch)
    save_drafter(d, args.out, format=args.format, target_identity=target.identity())
    n = sum(p.numel() for p in d.parameters())
    print(f"wrote {args.out}: {args.arch}, {args.num_layers} layers, block {block}, {n / 1e6:.2f}M parameters, "
          f"target layers {d.config.target_layer_ids}")
    return 0
