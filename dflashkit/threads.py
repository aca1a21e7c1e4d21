"""`--threads`: torch's intra-op threads for every command that runs models.

torch starts one thread per logical CPU. Two processes doing that on one machine (two torchrun ranks, or two
commands run side by side) oversubscribe the cores, and spinning threads then make each process 10-140x
slower than with one thread each. The default is therefore the physical cores this process may use, divided
by the processes torchrun starts on this machine (LOCAL_WORLD_SIZE), less the cores other work keeps busy right
now (a 0.2 s look at /proc/stat): beside one busy process on 2 cores, the static decoder made 27.8 tok/s on two
threads and 57.1 on one, against 86.7 quiet (SmolLM2 bf16, Zen 5). Outside torchrun an explicit
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


def _cpu_times(cpus: list[int]) -> tuple[int, int]:
    """(busy, total) jiffies summed over `cpus` from /proc/stat; (0, 0) where there is none."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return 0, 0
    busy = total = 0
    wanted = {f"cpu{c}" for c in cpus}
    for line in lines:
        name, *vals = line.split()
        if name in wanted:
            v = [int(x) for x in vals[:8]]
            total += sum(v)
            busy += sum(v) - v[3] - v[4]  # less idle and iowait
    return busy, total


def busy_cores(sample_s: float = 0.2) -> int:
    """Cores that other work kept busy over the last `sample_s` (this process sleeps meanwhile), rounded."""
    import time

    cpus = _usable_cpus()
    b0, t0 = _cpu_times(cpus)
    time.sleep(sample_s)
    b1, t1 = _cpu_times(cpus)
    if t1 <= t0:
        return 0
    return round(len(cpus) * (b1 - b0) / (t1 - t0))


def local_processes() -> int:
    """Processes sharing this machine under torchrun (1 otherwise)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def under_torchrun() -> bool:
    return "LOCAL_WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def default_threads(busy: int | None = None) -> int:
    """Under torchrun: physical cores // processes on this machine (torchrun itself sets OMP_NUM_THREADS=1, so
    that variable is ignored there). Otherwise OMP_NUM_THREADS when set, else the physical cores less the
    `busy` ones (measured when None)."""
    if under_torchrun():
        return max(1, physical_cores() // local_processes())
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, physical_cores() - (busy_cores() if busy is None else busy))


def add_threads_option(parser) -> None:
    """Add `--threads N` to an argparse (sub)parser."""
    parser.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="torch CPU threads for this process (default: OMP_NUM_THREADS if set, else the physical cores less "
             "those other work keeps busy, or divided by the processes torchrun starts on this machine)",
    )


def apply_threads(args_or_n=None) -> int:
    """Set torch's intra-op threads from parsed args (their `.threads`), an int, or None (the default).

    An explicit number is set as given. The default is set as is under torchrun; otherwise it only ever lowers
    the count, so an in-process caller that chose fewer threads (a test, a notebook) keeps its choice.
    Returns the number of threads in use."""
    n = getattr(args_or_n, "threads", args_or_n)
    import torch

    if n is None:
        if not under_torchrun() and torch.get_num_threads() == 1:
            return 1  # nothing to lower: no look at the machine's load
        n = default_threads()
        if not under_torchrun():
            n = min(n, torch.get_num_threads())
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DFlashError(f"--threads {n!r}: use a positive number of threads")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
