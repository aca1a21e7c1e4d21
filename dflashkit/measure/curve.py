"""What a target forward costs as a function of the tokens it verifies, and the memory-bound floor."""

from __future__ import annotations

import functools
import statistics
from bisect import bisect_left
from dataclasses import dataclass

import torch

from dflashkit.decode.hf import HfBackend, crop_kv, new_target_kv, verify_tree_by_paths
from dflashkit.decode.session import Timer
from dflashkit.targets.invariant import kernels_for
from dflashkit.tree import Tree

DEFAULT_NS = (1, 2, 4, 8, 16, 32)


@dataclass
class CostCurve:
    ns: list[int]  # tokens per forward, increasing
    seconds: list[float]  # median time of one forward over n new tokens
    paths: CostCurve | None = None  # where trees are verified one path a row: such a verify over n = rows x width

    def __call__(self, n: int) -> float:
        """Seconds for a forward over n tokens: piecewise linear between measured points, linear beyond."""
        ns, ts = self.ns, self.seconds
        if n <= ns[0]:
            return ts[0]
        i = min(max(bisect_left(ns, n), 1), len(ns) - 1)
        return ts[i - 1] + (ts[i] - ts[i - 1]) * (n - ns[i - 1]) / (ns[i] - ns[i - 1])

    def to_dict(self) -> dict:
        return {"ns": self.ns, "ms": [1000 * t for t in self.seconds], "ratio": [t / self.seconds[0] for t in self.seconds]}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(list(d["ns"]), [t / 1000 for t in d["ms"]])


def _seconds(device, run) -> float:
    timer = Timer(device)  # CUDA synchronized, so that asynchronous kernels count
    with timer("run"):
        run()
    return timer.times["run"]


def fan(rows: int, width: int, tokens: torch.Tensor) -> Tree:
    """`rows` root-to-leaf paths of `width` tokens that share the root: what a verify one path per row runs."""
    par = [-1] + [0 if j == 0 else r * (width - 1) + j for r in range(rows) for j in range(width - 1)]
    depths = [0] + [j + 1 for _ in range(rows) for j in range(width - 1)]
    return Tree.of(tokens[: len(par)].tolist(), depths, par, [0.0] * len(par))


@torch.no_grad()
def measure_cost_curve(target, ns=DEFAULT_NS, context: int = 400, repeats: int = 7, extra: tuple[int, ...] = (),
                       paths: int = 0) -> CostCurve:
    """Median time of one forward over n new tokens after `context` tokens in the target KV, n in ns (+ extra points);
    `paths` > 0: n // paths root-to-leaf paths of `paths` tokens, one per batch row (the KV copied to each row)."""
    ns = sorted(set(ns) | set(extra))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, context + max(ns)), generator=gen).to(target.device)
    kv = new_target_kv(target)
    target.forward(ids[:, :context], past_key_values=kv, logits_to_keep=1)
    times = {n: [] for n in ns}
    forward = lambda n: (verify_tree_by_paths(target, kv, fan(n // paths, paths, ids[0, context:]), context) if paths
                         else target.forward(ids[:, context : context + n], past_key_values=kv))  # at context + i
    for r in range(repeats + 1):  # the first pass warms up every shape
        for n in ns:
            s = _seconds(target.device, lambda: forward(n))
            if r:
                times[n].append(s)
            crop_kv(kv, context)
    return CostCurve(ns, [statistics.median(times[n]) for n in ns])


def tree_cost_curve(target, block: int, **kwargs) -> CostCurve:
    """The curve -auto trees are cut on, under the kernels hf decodes on: a forward over n tokens and, where hf
    verifies branching trees one path a row (each row a copy of the KV), such verifies of 1..16 paths of `block` tokens."""
    with kernels_for(target):
        curve = measure_cost_curve(target, **kwargs)
        if HfBackend(target).by_paths:
            p = measure_cost_curve(target, [block * r for r in (1, 2, 4, 8, 16)], kwargs.get("context", 400), 3, paths=block)
            curve.paths = CostCurve([1] + p.ns, [curve(1)] + p.seconds)
    return curve


@functools.lru_cache(maxsize=None)
def measure_bandwidth(device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum over a buffer far larger than the caches), once per device."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    times = [_seconds(device, x.sum) for _ in range(repeats + 1)]
    return x.numel() * 4 / statistics.median(times[1:])


def cost_report(target, curve: CostCurve) -> dict:
    """The curve plus the memory-bound floor of a one-token forward: its weight bytes (tied ones once, quantized
    matrices as the kernels read their blocks) / bandwidth."""
    from dflashkit.decode.static import kernel_bytes
    from dflashkit.targets.formats import stored

    (count, nbytes), bw = stored(target, kernel_bytes), measure_bandwidth(target.device)
    floor = nbytes / bw
    return {**curve.to_dict(), "weights": count, "weight_bytes": nbytes, "bandwidth_gb_s": bw / 1e9,
            "floor_ms": 1000 * floor,
            "one_token_vs_floor": curve.seconds[0] / floor}
