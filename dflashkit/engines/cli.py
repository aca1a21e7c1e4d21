"""`dflashkit engines install|status`."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("engines", help="install and list the engines bench compares against (llama.cpp, vLLM)")
    esub = p.add_subparsers(dest="engines_command", required=True)
    i = esub.add_parser("install", help="build/install one engine into the engines cache (outside this venv)")
    i.add_argument("engine", choices=("llama.cpp", "vllm"))
    i.add_argument("--jobs", type=int, default=None, help="llama.cpp build jobs (default: every CPU)")
    i.add_argument("--cuda", action="store_true", help="vllm: the CUDA build (default: CUDA when nvidia-smi is found)")
    i.set_defaults(func=cmd_install)
    s = esub.add_parser("status", help="which engines are installed, where, and the command for the others")
    s.set_defaults(func=cmd_status)


def cmd_install(args) -> int:
    from dflashkit.engines import install  # urllib and subprocess plumbing: not at the parser's start

    if args.engine == "llama.cpp":
        install.install_llama_cpp(jobs=args.jobs)
    else:
        install.install_vllm(cuda=args.cuda or None)
    return 0


def cmd_status(args) -> int:
    from dflashkit.engines import install

    print("\n".join([f"engines cache: {install.engines_home()} ($DFLASHKIT_ENGINES)", *install.describe()]))
    return 0
