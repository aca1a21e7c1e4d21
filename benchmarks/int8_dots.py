"""The integer dots (--weights ...-int8) through the level's maddubs against VNNI's vpdpbusd, side by side in one
process, on the embedded default's shapes and formats (SmolLM2-135M: 30 layers of q4_1, head 49152 x 576 in q8_0,
random weights quantized by GGUF's reference quantizer).

    python benchmarks/int8_dots.py [--rows 1,4,8,16] [--out benchmarks/results/cpu-DATE-int8-dots]

Per level whose VNNI this CPU has (v4: avx512_vnni, v3: avx_vnni) and row count: median ms of a forward's linears
(every layer's, then the head) for each operator, the two alternating, and maddubs / VNNI. The outputs are checked
equal bit for bit before timing: the sums are integers, so the instruction cannot change them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quantize

from common import cpu_name, write_results
from dflashkit import levels
from dflashkit.decode import native
from dflashkit.decode.static import QUANT_CODES, quant_order

HIDDEN, FFN, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]


def matrix(outs: int, k: int, fmt: str, rng) -> torch.Tensor:
    raw = quantize((rng.standard_normal((outs, k)) * 0.05).astype(np.float32), GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(quant_order(fmt, raw, dots=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    layer = [(matrix(o, k, "q4_1", rng), "q4_1", o, k) for o, k in LAYER]  # one layer's, read LAYERS times
    head = (matrix(VOCAB, HIDDEN, "q8_0", rng), "q8_0", VOCAB, HIDDEN)
    rows_out = []
    here = [lv for lv, flag in levels.VNNI.items() if flag in levels.cpu()[1] and levels.runs_here(lv)]
    for level in here:
        lib = native.ops(level)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {HIDDEN: torch.randn(rows, HIDDEN), FFN: torch.randn(rows, FFN)}

            def forward(op) -> list[torch.Tensor]:
                for _ in range(LAYERS):
                    ys = [op(xs[k], w, QUANT_CODES[fmt], outs) for w, fmt, outs, k in layer]
                w, fmt, outs, k = head
                return [*ys, op(xs[k], w, QUANT_CODES[fmt], outs)]

            assert all(map(torch.equal, forward(lib.linear_int8), forward(lib.linear_vnni)))
            times = {"maddubs": [], "vnni": []}
            for _ in range(args.repeats):
                for name, op in (("maddubs", lib.linear_int8), ("vnni", lib.linear_vnni)):
                    t = time.perf_counter()
                    forward(op)
                    times[name].append(1e3 * (time.perf_counter() - t))
            a, b = statistics.median(times["maddubs"]), statistics.median(times["vnni"])
            rows_out.append({"level": level, "vnni": levels.VNNI[level], "rows": rows, "maddubs_ms": a, "vnni_ms": b})
            print(f"{level} ({levels.VNNI[level]}) rows {rows}: maddubs {a:.2f} ms, VNNI {b:.2f} ms, {a / b:.2f}x",
                  flush=True)
    if not here:
        raise SystemExit(f"this CPU ({cpu_name()}) has neither avx512_vnni nor avx_vnni: nothing to compare")
    md = ["# Integer dots: maddubs vs VNNI, a forward's linears of SmolLM2-135M (q4_1 layers, q8_0 head)", "",
          f"Machine: {cpu_name()}; outputs equal bit for bit.", "",
          "| level | VNNI | rows | maddubs ms | VNNI ms | maddubs / VNNI |", "|---|---|---|---|---|---|",
          *(f"| {r['level']} | {r['vnni']} | {r['rows']} | {r['maddubs_ms']:.2f} | {r['vnni_ms']:.2f} | "
            f"{r['maddubs_ms'] / r['vnni_ms']:.2f}x |" for r in rows_out)]
    print("\n".join(md))
    if args.out:
        write_results(args.out, md, {"machine": cpu_name(), "threads": torch.get_num_threads(), "rows": rows_out})


if __name__ == "__main__":
    main()
