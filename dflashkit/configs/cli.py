"""`dflashkit config list|show|cp`: the shipped recipes, to read or to copy and edit."""

from __future__ import annotations

from pathlib import Path

from dflashkit.configs import find_config, shipped
from dflashkit.errors import DFlashError
from dflashkit.fileio import write_text


def register(sub) -> None:
    p = sub.add_parser("config", help="list, print or copy the training recipes shipped with dflashkit")
    csub = p.add_subparsers(dest="config_command", required=True)
    csub.add_parser("list", help="the shipped configs").set_defaults(func=cmd_list)
    s = csub.add_parser("show", help="print one shipped config")
    s.add_argument("name")
    s.set_defaults(func=cmd_show)
    c = csub.add_parser("cp", help="copy a shipped config to a file you can edit")
    c.add_argument("name")
    c.add_argument("out")
    c.add_argument("--force", action="store_true", help="replace an existing file")
    c.set_defaults(func=cmd_cp)


def cmd_list(args) -> int:
    for name, path in shipped().items():
        first = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        print(f"{name:28s} {first}")
    return 0


def cmd_show(args) -> int:
    print(find_config(args.name).read_text(), end="")
    return 0


def cmd_cp(args) -> int:
    out = Path(args.out)
    if out.exists() and not args.force:
        raise DFlashError(f"{out} exists; choose another name or pass --force to replace it")
    write_text(out, find_config(args.name).read_text())
    print(out)
    return 0
