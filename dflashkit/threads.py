"""`--threads`: torch's intra-op threads for every command that runs models, and a default a user can predict
(docs/design.md, "Threads and ISA levels")."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dflashkit import machine
from dflashkit.errors import DFlashError

def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once)."""
    cpus = usable_cpus()
    topology = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
    try:
        cores = {Path(topology.format(c)).read_text().strip() for c in cpus}
    except OSError:
        return len(cpus)  # no topology information: count logical CPUs
    return max(1, len(cores))


def cpu_times(cpus: list[int]) -> tuple[int, int]:
    """(busy, total) jiffies summed over `cpus` from /proc/stat; (0, 0) where there is none."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return 0, 0
    wanted = {f"cpu{c}" for c in cpus}
    rows = [[int(x) for x in vals[:8]] for name, *vals in map(str.split, lines) if name in wanted]
    total = sum(map(sum, rows))
    return total - sum(v[3] + v[4] for v in rows), total  # busy: less idle and iowait


def busy_cores(sample_s: float = 0.2) -> int:
    """Cores that other work kept busy over the last `sample_s` (this process sleeps meanwhile), rounded."""
    cpus = usable_cpus()
    b0, t0 = cpu_times(cpus)
    time.sleep(sample_s)
    b1, t1 = cpu_times(cpus)
    return round(len(cpus) * (b1 - b0) / (t1 - t0)) if t1 > t0 else 0


def under_torchrun() -> bool:
    return machine.current().local_world is not None


def default_threads() -> int:
    """Physical cores // local processes under torchrun (it sets OMP_NUM_THREADS=1), else OMP_NUM_THREADS or cores."""
    m = machine.current()
    if m.local_world is not None:
        return max(1, physical_cores() // max(1, m.local_world))
    return m.omp_threads if m.omp_threads and m.omp_threads > 0 else physical_cores()


def load_warning(threads: int, sample_s: float = 0.2) -> str | None:
    """One line when other work keeps cores busy that these threads would compete for, else None."""
    busy, cores = busy_cores(sample_s), len(usable_cpus())
    if busy == 0 or threads + busy <= cores:
        return None
    return (f"threads: {threads}, while other work keeps {busy} of {cores} CPUs busy: each side may run many times "
            f"slower; --threads {max(1, cores - busy)} shares them (the default is the physical cores, "
            f"{default_threads()})")


MOST = 4  # threads per usable CPU: more only oversubscribe (thousands crawl or cannot start)


def add_threads_option(parser) -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N", help=(
        "torch CPU threads for this process (default: OMP_NUM_THREADS if set, else the physical cores, "
        f"{physical_cores()} here; under torchrun divided by the processes it starts on this machine)"))


def apply_threads(args_or_n=None) -> int:
    """Set torch's threads from parsed args, an int, or None (the default); returns them. Outside torchrun the
    default only lowers the count, so an in-process caller that chose fewer keeps its choice."""
    n = getattr(args_or_n, "threads", args_or_n)
    import torch

    if n is None:
        n = default_threads() if under_torchrun() else min(default_threads(), torch.get_num_threads())
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DFlashError(f"--threads {n!r}: use a positive number of threads")
    if n > MOST * len(usable_cpus()):
        raise DFlashError(f"--threads {n}: this process may use {len(usable_cpus())} CPUs; use at most "
                          f"{MOST * len(usable_cpus())} (the default is the physical cores, {default_threads()})")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
