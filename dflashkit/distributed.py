"""One process, or the group torchrun starts (WORLD_SIZE, RANK, LOCAL_RANK): the few collectives that
extraction and training need, written once. With one process every helper is a no-op, so callers never branch."""

from __future__ import annotations

import atexit
import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist  # `import torch` has loaded it already

from dflashkit import machine
from dflashkit.targets.model import pick_device


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> Dist:
    """Join the torchrun group when there is one: nccl on CUDA (cuda:LOCAL_RANK), gloo otherwise."""
    m = machine.current()
    if m.world == 1:
        return Dist(0, 1, pick_device(device))
    cuda = device != "cpu" and torch.cuda.is_available()
    here = torch.device("cuda", m.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(here)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        # torch allows one group per process; left to the interpreter's teardown, gloo's threads can outlive it and
        # abort the process at exit ("terminate called without an active exception"), so it ends before that
        atexit.register(_end_group)
    return Dist(dist.get_rank(), dist.get_world_size(), here)


def _end_group() -> None:
    """End the group once every rank reached exit (or a minute passed): ending it under another rank aborts that one."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(RuntimeError):  # a rank already gone: end ours regardless
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        else:
            dist.barrier()
    dist.destroy_process_group()


def all_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum a small CPU tensor over processes (through the device: nccl reduces CUDA tensors only)."""
    if d.world == 1:
        return x
    y = x.to(d.device)
    dist.all_reduce(y)
    return y.cpu()


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def from_master(obj, d: Dist):
    """Rank 0's `obj` on every process (a decision all of them must share)."""
    box = [obj]
    if d.world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_all(obj, d: Dist) -> list:
    if d.world == 1:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out
