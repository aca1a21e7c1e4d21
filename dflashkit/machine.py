"""Machine choices as values: where caches live, the threads a user asked for, torchrun's group. The process entry
(`dflashkit.cli.use_environment`) reads them from the environment once; library code asks `current()` and reads
no environment variable (docs/design.md section 12). A Python caller gets the defaults, or sets its own (`use`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    home: str | Path = "~/.cache/dflashkit"  # $DFLASHKIT_HOME: prepared targets, built kernels, probes
    engines: str | Path | None = None  # $DFLASHKIT_ENGINES; None: home/engines
    omp_threads: int | None = None  # $OMP_NUM_THREADS: the default thread count outside torchrun
    local_world: int | None = None  # torchrun's processes on this machine (LOCAL_WORLD_SIZE); None: no torchrun
    world: int = 1  # torchrun's WORLD_SIZE
    local_rank: int = 0  # torchrun's LOCAL_RANK: this process's GPU


_current = Machine()


def current() -> Machine:
    return _current


def use(machine: Machine) -> Machine:
    """Make `machine` this process's; returns the one before, for an in-process caller to restore."""
    global _current
    before, _current = _current, machine
    return before
