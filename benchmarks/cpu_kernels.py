"""The target's small-M linear products on this CPU: eager vs compiled kernel choices, per number of rows M.

    python benchmarks/cpu_kernels.py [--dtype float32] [--ms 1,2,4,8,16,32]
                                     [--choices eager,inductor,max-autotune,dynamic]
                                     [--inductor cpp.enable_concat_linear=true ...]

A verify of M tokens runs every decoder linear of the target on M rows; on a CPU without native bf16 those
products, not attention, are most of a round. Per choice and M: median ms over all decoder linears (in layer
order, the weights streamed from memory as in decoding), its ratio to M = 1, the compile seconds, whether the
output equals eager bit for bit, and whether each row (the first 32 of a larger M) equals the same row computed
alone (M = 1): the row
invariance that keeps speculative decoding token-exact. Choices: eager (F.linear, the stock kernels), inductor
(torch.compile with freezing, no autotuning: compiles fast) max-autotune (inductor's CPP GEMM templates,
autotuned per shape) and dynamic (the same templates compiled once for every M: dynamic shapes with size-oblivious
guards, so M = 1 is not specialised; inductor's Jinja templates memoised, which halves the compile).
--inductor KEY=VALUE sets an inductor config value first (e.g. cpp.gemm_thread_factors=1,1,2): the knobs of its
CPP GEMM template. Each row also says what share of this machine's float32 GEMM peak it reaches (a large square
product on the stock kernels, timed here): a verify of M rows does 2 x M x weights FLOPs, which bounds its cost
from below once M is large enough for the product to be compute-bound.
Writes benchmarks/results/cpu-DATE-kernels[-TAG].{md,json}, naming the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name, write_results  # noqa: E402
from dflashkit.report import markdown_table  # noqa: E402

from dflashkit.targets.model import load_target  # noqa: E402


class DecoderLinears(torch.nn.Module):
    """Every linear of the target's decoder layers, applied in order as one verify applies them."""

    def __init__(self, model):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(torch.nn.ModuleList([a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                    m.down_proj]))

    def forward(self, x):
        outs = []
        for q, k, v, o, gate, up, down in self.layers:
            outs += [o(q(x)), k(x), v(x), down(torch.nn.functional.silu(gate(x)) * up(x))]
        return outs


def timed(fn, x, repeats: int) -> float:
    for _ in range(2):
        fn(x)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


def gemm_peak(n: int = 3072, repeats: int = 5) -> float:
    """FLOP/s of a large square float32 product on the stock kernels: the most this CPU's cores compute."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / (timed(lambda x: a @ x, b, repeats) / 1000)


def set_inductor(pairs: list[str]) -> dict:
    """KEY=VALUE (dotted inductor config keys; true/false, integers, or text) set before compiling."""
    import torch._inductor.config as ind

    done = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        *path, last = key.split(".")
        obj = ind
        for part in path:
            obj = getattr(obj, part)
        if not hasattr(obj, last):
            raise SystemExit(f"--inductor {pair}: inductor has no setting {key}")
        value = {"true": True, "false": False}.get(raw.lower(), int(raw) if raw.lstrip("-").isdigit() else raw)
        setattr(obj, last, value)
        done[key] = value
    return done


def build(choice: str, module):
    import torch._inductor.config as ind
    import torch.fx.experimental._config as fx_config

    if choice == "eager":
        return module
    torch._dynamo.reset()
    ind.freezing = True
    torch._dynamo.config.cache_size_limit = 64
    if choice == "inductor":
        return torch.compile(module, dynamic=False)
    ind.max_autotune_gemm_backends = "CPP,ATEN"
    if choice == "max-autotune":
        return torch.compile(module, mode="max-autotune", dynamic=False)
    compiled = torch.compile(module, mode="max-autotune", dynamic=True)

    def run(x):
        with fx_config.patch(backed_size_oblivious=True):
            return compiled(x)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ms", default="1,2,4,8,16,32")
    ap.add_argument("--choices", default="eager,inductor,max-autotune,dynamic")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--results", default="benchmarks/results")
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE", help="inductor config values to set")
    args = ap.parse_args()
    knobs = set_inductor(args.inductor)
    target = load_target(args.target, device="cpu", dtype=args.dtype)
    module = DecoderLinears(target.model).eval()
    hidden = target.hidden_size
    ms = [int(m) for m in args.ms.split(",")]
    g = torch.Generator().manual_seed(0)
    x = {m: torch.randn(m, hidden, generator=g).to(target.dtype) for m in ms}
    flops = 2 * sum(lin.weight.numel() for layer in module.layers for lin in layer)  # per row
    peak = gemm_peak()
    print(f"float32 GEMM peak on this CPU: {peak / 1e9:.0f} GFLOP/s; {flops / 1e6:.0f} MFLOP per row", flush=True)
    rows, out = [], {"machine": cpu_name(), "target": target.name, "dtype": args.dtype, "torch": torch.__version__,
                     "inductor": knobs, "gemm_peak_gflops": peak / 1e9, "flops_per_row": flops, "results": {}}
    with torch.no_grad():
        ref = {m: module(x[m]) for m in ms}
        for choice in args.choices.split(","):
            fn = build(choice, module)
            res = {}
            for m in ms:
                t0 = time.perf_counter()
                y = fn(x[m])  # the first call compiles this shape
                compile_s = time.perf_counter() - t0
                checked = min(m, 32)  # a prefill-sized M: its first rows
                alone = [fn(x[m][i:i + 1]) for i in range(checked)] if m > 1 else [y]
                res[m] = {"ms": timed(fn, x[m], args.repeats), "compile_s": compile_s,
                          "equals_eager": all(torch.equal(a, b) for a, b in zip(y, ref[m])),
                          "row_invariant": all(torch.equal(y[j][i:i + 1], alone[i][j]) for i in range(checked)
                                               for j in range(len(y))),
                          "max_row_diff": max(float((y[j][i:i + 1].float() - alone[i][j].float()).abs().max())
                                              for i in range(checked) for j in range(len(y)))}
                print(f"{choice:>13} M={m:<3} {res[m]['ms']:8.2f} ms  compile {compile_s:6.1f} s  "
                      f"equals eager {res[m]['equals_eager']}  row-invariant {res[m]['row_invariant']} "
                      f"(max diff {res[m]['max_row_diff']:.2e})", flush=True)
            out["results"][choice] = res
            base = res[ms[0]]["ms"]
            rows += [[choice, m, r["ms"], r["ms"] / base, r["ms"] / out["results"]["eager"][m]["ms"]
                      if "eager" in out["results"] else None, r["compile_s"], r["equals_eager"], r["row_invariant"],
                      f"{r['max_row_diff']:.1e}", m * flops / (r["ms"] / 1000) / 1e9,
                      m * flops / (r["ms"] / 1000) / peak]
                     for m, r in res.items()]
    day = time.strftime("%Y-%m-%d")
    stem = Path(args.results) / f"cpu-{day}-kernels"
    md = [f"# Small-M linear products of {target.name} ({args.dtype}) on the CPU ({day})", "",
          f"Machine: {out['machine']}; torch {torch.__version__}. All {len(module.layers)} decoder layers' linears "
          "applied to M rows, median of "
          f"{args.repeats}. Produced by benchmarks/cpu_kernels.py"
          + (f" with inductor settings {knobs}" if knobs else "") + f". Float32 GEMM peak of this CPU (3072^3 on "
          f"the stock kernels): {peak / 1e9:.0f} GFLOP/s.", "",
          markdown_table(["choice", "M", "ms", "vs M=1", "vs eager", "compile s", "equals eager", "row-invariant",
                          "max row diff", "GFLOP/s", "share of peak"],
                         rows, digits=2)]
    if args.tag:
        stem = stem.with_name(f"{stem.name}-{args.tag}")
    write_results(stem, md, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
