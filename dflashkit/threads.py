"""`--threads`: torch's intra-op threads for every command that runs models.

torch starts one thread per logical CPU. Two processes doing that on one machine (two torchrun ranks, or two
commands run side by side) oversubscribe the cores, and spinning threads then make each process 10-140x
slower than with one thread each. The default is therefore the physical cores this process may use, divided
by the processes torchrun starts on this machine (LOCAL_WORLD_SIZE); outside torchrun an explicit
OMP_NUM_THREADS wins over that default, and `--threads N` always wins.

Wiring: `add_threads_option(parser)` on a subcommand's parser; `dflashkit.cli.main` calls `apply_threads(args)`
before the command runs (call it yourself when parsing arguments elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path

from dflashkit.errors import DFlashError


def _usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once)."""
    cpus = _usable_cpus()
    cores = set()
    for c in cpus:
        f = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            cores.add(f.read_text().strip())
        except OSError:
            return len(cpus)  # no topology information: count logical CPUs
    return max(1, len(cores))


def local_processes() -> int:
    """Processes sharing this machine under torchrun (1 otherwise)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def under_torchrun() -> bool:
    return "LOCAL_WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def default_threads() -> int:
    """Under torchrun: physical cores // processes on this machine (torchrun itself sets OMP_NUM_THREADS=1, so
    that variable is ignored there). Otherwise OMP_NUM_THREADS when set, else the physical cores."""
    if not under_torchrun():
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env.isdigit() and int(env) > 0:
            return int(env)
    return max(1, physical_cores() // local_processes())


def add_threads_option(parser) -> None:
    """Add `--threads N` to an argparse (sub)parser."""
    parser.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="torch CPU threads for this process (default: OMP_NUM_THREADS if set, else the physical cores divided "
             "by the processes torchrun starts on this machine); use 1 when other jobs share the machine",
    )


def apply_threads(args_or_n=None) -> int:
    """Set torch's intra-op threads from parsed args (their `.threads`), an int, or None (the default).

    An explicit number is set as given. The default is set as is under torchrun; otherwise it only ever lowers
    the count, so an in-process caller that chose fewer threads (a test, a notebook) keeps its choice.
    Returns the number of threads in use."""
    n = getattr(args_or_n, "threads", args_or_n)
    import torch

    if n is None:
        n = default_threads()
        if not under_torchrun():
            n = min(n, torch.get_num_threads())
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DFlashError(f"--threads {n!r}: use a positive number of threads")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
