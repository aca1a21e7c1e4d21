"""`dflashkit drafter info|init`."""

from __future__ import annotations

from dflashkit.threads import add_threads_option


def _ints(s: str | None):
    return None if not s else [int(x) for x in s.split(",")]


def register(sub) -> None:
    p = sub.add_parser("drafter", help="inspect or create drafter checkpoints")
    dsub = p.add_subparsers(dest="drafter_command", required=True)
    i = dsub.add_parser("info", help="config, parameter count, expected target and the load report")
    i.add_argument("path")
    i.add_argument("--target", help="also check the drafter against this target")
    add_threads_option(i)
    i.set_defaults(func=cmd_info)
    n = dsub.add_parser("init", help="write a fresh randomly initialised drafter for a target")
    n.add_argument("--target", default="smollm2-135m")
    n.add_argument("--layers", type=int, default=5, help="drafter decoder layers (released drafters: 5)")
    n.add_argument("--target-layers", help="comma-separated target layer ids (default: z-lab's rule)")
    n.add_argument("--block-size", type=int, default=16)
    n.add_argument("--format", choices=["dflashkit", "zlab"], default="dflashkit")
    n.add_argument("--allow-final-layers", action="store_true", help="permit feeding the last two target layers")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--out", required=True)
    add_threads_option(n)
    n.set_defaults(func=cmd_init)


def cmd_info(args) -> int:
    from dflashkit.drafter.checkpoint import load_drafter

    target = None
    if args.target:
        from dflashkit.target.model import load_target

        target = load_target(args.target, device="cpu")
    d = load_drafter(args.path, target=target)
    for line in d.load_report:
        print(line)
    c = d.config
    n = sum(p.numel() for p in d.parameters())
    print(f"parameters       {n / 1e6:.2f}M ({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"{c.num_attention_heads}/{c.num_key_value_heads} heads, head_dim {c.head_dim}, mlp {c.intermediate_size})")
    print(f"block size       {c.block_size} ({c.block_size - 1} draft tokens per pass)")
    print(f"target layers    {c.target_layer_ids} of {c.num_target_layers}")
    print(f"mask token id    {c.mask_token_id}")
    print(f"rope             theta {c.rope_theta} scaling {c.rope_scaling}")
    if "sliding_attention" in c.layer_types:
        print(f"sliding window   {c.sliding_window} on layers {[i for i, t in enumerate(c.layer_types) if t == 'sliding_attention']}")
    con = d.contract
    if con:
        tgt = con.get("target") or {}
        print(f"expected target  {tgt.get('name')} ({tgt.get('architecture')}, weights {tgt.get('weights_hash') or 'not recorded'}, "
              f"config {tgt.get('config_hash')}) {tgt.get('path', '')}")
        for key in ("loss", "gamma", "step"):
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
    import torch

    from dflashkit.drafter.checkpoint import new_drafter, save_drafter
    from dflashkit.target.model import load_target

    torch.manual_seed(args.seed)
    target = load_target(args.target, device="cpu")
    d = new_drafter(target, num_layers=args.layers, target_layer_ids=_ints(args.target_layers),
                    allow_final_layers=args.allow_final_layers, block_size=args.block_size)
    save_drafter(d, args.out, format=args.format, target_identity=target.identity())
    n = sum(p.numel() for p in d.parameters())
    print(f"wrote {args.out}: {args.layers} layers, {n / 1e6:.2f}M parameters, target layers {d.config.target_layer_ids}")
    return 0
