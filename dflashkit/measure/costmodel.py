"""A cost model per engine, probed once and cached per machine, so that an offline acceptance prices a drafter before
it is served (docs/design.md, "The cost model in detail")."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dflashkit.decode import static
from dflashkit.decode.backends import static_refusal
from dflashkit.decode.methods import PRICED
from dflashkit.decode.speculative import generate
from dflashkit.errors import DFlashError
from dflashkit.fileio import home, read_json, sha256_json, write_json
from dflashkit.measure import peers
from dflashkit.measure.curve import CostCurve, tree_cost_curve
from dflashkit.measure.probe import (engine_version, load_note, load_sample, loaded, machine_key, measured_load,
                                     new_session, say_loaded)
from dflashkit.report import fmt, line_plot, markdown_table

PROBE_NS = (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64)  # chain blocks 4/8/16, DDTree-b verifies b+1
FORMAT = "dflashkit-cost-model/1"
FIX = "delete the file to measure again (`dflashkit cost ... --force`)"
PROBE_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."
PROBE_TOKENS, PEER_TOKENS = 48, 256  # our loops' probe decode; an engine peer's (peer_round_ms)
# tokens of context before a timed forward: about a bench answer's mean (a much longer one overprices the one-token
# step, as attention reads the KV in use)
DEPTH = 200


@dataclass
class CostModel:
    """Milliseconds, per round of a loop: `forward(n)` of the target over n new tokens, `draft_ms` one drafter call
    (None: measured without a drafter), `overhead(loop)` the loop's own work (ar, chain or tree)."""

    engine: str
    ns: list[int]
    forward_ms: list[float]
    draft_ms: float | None
    overhead_ms: dict
    rounding: str = "linear"  # linear between measured n (linear beyond); "up": the smallest measured n >= n
    record: dict = field(default_factory=dict)  # what it was measured on, and when
    path: Path | None = None
    paths: dict | None = None  # {"ns", "ms"}: where a branching tree is verified one path a row (measure/curve.py)

    def forward(self, n: int) -> float:
        """ms of one target forward over n tokens; infinite past an engine's widest verify ('up')."""
        if self.rounding == "up":
            i = bisect_left(self.ns, n)
            return self.forward_ms[i] if i < len(self.ns) else float("inf")
        return CostCurve(self.ns, self.forward_ms)(n)

    def forward_paths(self, n: int) -> float:
        """ms of a tree verify over n = leaves x (depth + 1) tokens one path a row; forward(n) where trees are flat."""
        return CostCurve(self.paths["ns"], self.paths["ms"])(n) if self.paths else self.forward(n)

    def overhead(self, loop: str) -> float:
        """A loop's own ms per round; a loop the probe could not run (no drafter) is priced as plain decoding's."""
        return float(self.overhead_ms.get(loop, self.overhead_ms["ar"]))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "engine": self.engine, "forward": {"ns": self.ns, "ms": self.forward_ms,
                "rounding": self.rounding}, "paths": self.paths, "draft_ms": self.draft_ms,
                "overhead_ms": self.overhead_ms, "record": self.record}

    @classmethod
    def from_dict(cls, d: dict, where: str = "cost model") -> "CostModel":
        """Checks every field it reads: a missing or malformed one is one line naming it and the fix."""
        def need(obj, key, kinds, name):
            if not isinstance(obj, dict) or key not in obj:
                raise DFlashError(f"{where}: field {name!r} is missing; {FIX}")
            if not isinstance(obj[key], kinds):
                raise DFlashError(f"{where}: field {name!r} is {obj[key]!r}, not a {kinds}; {FIX}")
            return obj[key]

        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise DFlashError(f"{where}: field 'format' is {d.get('format') if isinstance(d, dict) else d!r}, not "
                              f"{FORMAT!r} (another version's or another file); {FIX}")
        fwd = need(d, "forward", dict, "forward")
        ns, ms = need(fwd, "ns", list, "forward.ns"), need(fwd, "ms", list, "forward.ms")
        if not ns or len(ns) != len(ms) or ns != sorted(set(ns)):
            raise DFlashError(f"{where}: fields 'forward.ns' and 'forward.ms' must be one time per increasing n; {FIX}")
        overhead = need(d, "overhead_ms", dict, "overhead_ms")
        need(overhead, "ar", (int, float), "overhead_ms.ar")
        return cls(need(d, "engine", str, "engine"), [int(n) for n in ns], [float(t) for t in ms],
                   need(d, "draft_ms", (int, float, type(None)), "draft_ms"), overhead,
                   fwd.get("rounding", "linear"), d.get("record") or {}, paths=d.get("paths"))


def load_model(path) -> CostModel:
    return replace(CostModel.from_dict(read_json(path, fix=FIX), str(path)), path=Path(path))


def drafter_shape(proposer) -> dict | None:
    """What a drafter call's price depends on: its geometry and block, not its weights."""
    if proposer is None or not hasattr(proposer, "drafter"):
        return None
    c = proposer.drafter.config
    return {"arch": c.arch, "layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size, "block_size": proposer.block_size,
            "vocab": proposer.head.size}


def check_model_engine(engine: str) -> None:
    if engine not in PRICED:
        raise DFlashError(f"--engine {engine!r}: no cost model for it; use one of auto, {', '.join(PRICED)}")


def cost_model(engine: str, target, proposer=None, session=None, force: bool = False, log=None,
               measure: bool = True) -> CostModel:
    """The cached cost model of `engine` here for `target` (and `proposer`'s drafter), measured now where none is,
    with `force`, or where the cached one was measured under load; not `measure`: a missing one is an error."""
    check_model_engine(engine)
    record = {**machine_key(target)[1], "engine": engine, "engine_version": engine_version(engine),
              "device": str(target.device), "drafter": drafter_shape(proposer), "depth": DEPTH, "probe": 3}
    path = home() / "cost-model" / f"{engine}-{sha256_json(record)[:16]}.json"
    model = load_model(path) if path.is_file() and not force else None
    if model is not None and not (measure and loaded(model.record)):
        return model
    if not measure:
        raise DFlashError(f"no {engine} cost model cached for this machine, target, dtype and threads ({path}); measure "
                          f"it once: `dflashkit cost --target {target.name} --engine {engine}"
                          + (" --drafter DIR`" if proposer is not None else "`"))
    (log or (lambda m: None))(f"cost model: measuring {engine} on this machine (cached in {path})"
                              + (" again: it was measured under load" if model else ""))
    t0, start = time.perf_counter(), load_sample()
    model = PROBES[engine](target, proposer, session or new_session(target, proposer, log=log))
    model.record = {**record, "probe_s": round(time.perf_counter() - t0, 1),
                    "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "load": measured_load(start, record["threads"])}
    write_json(path, model.to_dict())
    model.path = path
    say_loaded(f"cost model: {engine}", path, model.record["load"], "or `dflashkit cost --force`", log)
    return model


def probe_loops(target, proposer, engine: str, session) -> tuple[float | None, dict]:
    """(ms of one drafter call, {loop: ms per round of its own work}) from a short decode of each loop on `engine`."""
    ids = target.chat_ids([{"role": "user", "content": PROBE_PROMPT}])
    loops = {"ar": "ar", "chain": "chain", "tree": "ddtree-8"} if proposer is not None else {"ar": "ar", "tree": "ngram"}
    draft, overhead = None, {}
    for loop, method in loops.items():
        for n in (8, PROBE_TOKENS):  # the first warms the loop's shapes
            g = generate(target, ids, method, proposer, max_new_tokens=n, engine=engine, session=session)
        rounds = max(1, g.rounds)
        overhead[loop] = 1000 * g.times["other"] / rounds
        if loop == "chain":
            draft = 1000 * g.times["draft"] / rounds
    return draft, overhead


def hf_curves(target, proposer, repeats: int) -> tuple[dict, dict | None]:
    """ms of hf's forward over n tokens after DEPTH ({n: ms}), and of its verifies one path a row (or None)."""
    c = tree_cost_curve(target, proposer.block_size if proposer else 4, ns=PROBE_NS, context=DEPTH, repeats=repeats)
    ms = lambda curve: {n: 1000 * t for n, t in zip(curve.ns, curve.seconds)}
    return ms(c), c.paths and ms(c.paths)


def static_widths(decoder, timed: int) -> dict[int, float]:
    """ms of the static step per compiled width after DEPTH slots (a verify of n runs on the smallest width >= n)."""
    return {w: 1000 * t for w, t in sorted(decoder.time_widths(depth=DEPTH, timed=timed).items())}


def probe_hf(target, proposer, session) -> CostModel:
    (forward, paths), (draft, overhead) = hf_curves(target, proposer, 5), probe_loops(target, proposer, "hf", session)
    return CostModel("hf", list(forward), list(forward.values()), draft, overhead,
                     paths=paths and {"ns": list(paths), "ms": list(paths.values())})


def probe_static(target, proposer, session) -> CostModel:
    if why := static_refusal(target):
        raise DFlashError(why)
    times = static_widths(static.decoder_for(session, 512, proposer, trees=True), 7)
    draft, overhead = probe_loops(target, proposer, "static", session)
    return CostModel("static", list(times), list(times.values()), draft, overhead, rounding="up")


def peer_round_ms(method: str, target, drafter, block_size: int) -> float:
    """ms per round of an engine peer started for the probe (engine_round_ms)."""
    with peers.EnginePeer(method, target, drafter, block_size, 8) as peer:
        peer.one(target.chat_ids([{"role": "user", "content": PROBE_PROMPT}]))  # warm-up
        return engine_round_ms(peer.engine, target, drafter is not None)


def engine_round_ms(engine, target, speculative: bool) -> float:
    """ms per round of an open engine on the probe prompt: PEER_TOKENS less a 1-token answer (the prefill cancels)."""
    ids, stops = target.chat_ids([{"role": "user", "content": PROBE_PROMPT}]), set(target.stop_token_ids)
    one, full = engine.complete(ids, 1, stops), engine.complete(ids, PEER_TOKENS, stops)
    rounds = full.steps - one.steps if speculative else len(full.tokens) - len(one.tokens)
    return 1000 * (full.seconds - one.seconds) / max(1, rounds)


def probe_llama_cpp(target, proposer, session) -> CostModel:
    """The forward curve from llama-bench (n tokens after DEPTH of context); the loop's work per token is the server's
    plain round less its one-token forward; the drafter's call, its speculative round less the verify and that work."""
    from dflashkit.engines.install import require
    from dflashkit.engines.llamacpp import target_gguf

    engine = require("llama.cpp")
    gguf = target_gguf(engine, target, str(target.dtype).removeprefix("torch."))
    cmd = [str(engine.binary("llama-bench")), "-m", str(gguf), "-t", str(torch.get_num_threads()), "-n", "0", "-r",
           "5", "-o", "json", "-d", str(DEPTH), "-p", ",".join(map(str, PROBE_NS))]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise DFlashError(f"llama-bench failed ({' '.join(cmd)}): {res.stderr.strip()[-300:]}")
    ms = {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in json.loads(res.stdout) if r.get("n_prompt")}
    model = CostModel("llama.cpp", sorted(ms), [ms[n] for n in sorted(ms)], None, {})
    model.overhead_ms = {"ar": max(0.0, peer_round_ms("llama.cpp", target, None, 0) - model.forward(1))}
    if proposer is not None:
        B = proposer.block_size
        spec = peer_round_ms("llama.cpp-dflash", target, proposer.drafter, B)
        model.draft_ms = max(0.0, spec - model.forward(B) - model.overhead("ar"))
    return model


def probe_vllm(target, proposer, session) -> CostModel:
    """vLLM's forward is not reachable apart from its loop: its plain round stands for forward(1) and, with a
    drafter, its speculative round for forward(B) (drafter and loop included, so both are 0 here)."""
    ns, ms = [1], [peer_round_ms("vllm", target, None, 0)]
    if proposer is not None:
        ns.append(proposer.block_size)
        ms.append(peer_round_ms("vllm-dflash", target, proposer.drafter, proposer.block_size))
    return CostModel("vllm", ns, ms, 0.0 if proposer is not None else None, {"ar": 0.0, "chain": 0.0}, rounding="up")


PROBES = {"hf": probe_hf, "static": probe_static, "llama.cpp": probe_llama_cpp, "vllm": probe_vllm}
SAMPLED = ("hf", "static", "llama.cpp")  # vLLM's forward is its loop: no quick sample


def forward_sample(engine: str, target, proposer, session, peer=None, speculative: bool = False) -> dict | None:
    """One quick sample of `engine`'s cost before a bench's run (a shared host drifts within minutes); None for vLLM."""
    if engine == "static":
        return {"forward": static_widths(session.static, 3) if session.static is not None else {}}
    if engine == "hf":
        return dict(zip(("forward", "paths"), hf_curves(target, proposer, 1)))
    if engine == "llama.cpp" and peer is not None:
        return {"rounds": {"chain" if speculative else "ar": engine_round_ms(peer.engine, target, speculative)}}
    return None


def in_window(model: CostModel, samples: list[dict]) -> CostModel:
    """`model` over the minutes its samples (forward_sample) were taken in: each curve the samples' median. The drafter
    call and the loops' work stay as measured, except from an engine's own timed rounds (less the forwards)."""
    curves, out = {}, model
    fwd = [s for s in samples if s and s.get("forward")]
    for key in ("forward", "paths"):
        got = [s[key] for s in fwd if s.get(key)]
        ns = sorted(set(got[0]).intersection(*got[1:])) if got and len(got) == len(fwd) else []
        curves[key] = {"ns": ns, "ms": [statistics.median(g[n] for g in got) for n in ns]} if ns else None
    if f := curves["forward"]:
        level = statistics.median(t / model.forward(n) for n, t in zip(f["ns"], f["ms"]) if model.forward(n) < math.inf)
        out = replace(model, ns=f["ns"], forward_ms=f["ms"], paths=curves["paths"] or model.paths,
                      record={**model.record, "window": {"samples": len(fwd), "level": level}})
    timed = [s["rounds"] for s in samples if s and s.get("rounds")]
    if not (rounds := {loop: statistics.median(r[loop] for r in timed if loop in r) for loop in ("ar", "chain")
                       if any(loop in r for r in timed)}):
        return out
    out = replace(out, record={**out.record, "window": {"samples": len(timed), **out.record.get("window", {}),
                                                        "rounds": rounds}})
    if "ar" in rounds:
        out.overhead_ms = {**out.overhead_ms, "ar": max(0.0, rounds["ar"] - out.forward(1))}
    if "chain" in rounds and (B := (out.record.get("drafter") or {}).get("block_size")):
        out.draft_ms = max(0.0, rounds["chain"] - out.forward(B) - out.overhead("chain"))
    return out


def cost_markdown(model: CostModel, ns=(1, 2, 4, 8, 9, 16, 17, 32, 33, 64)) -> list[str]:
    one = model.forward(1)
    rows = [[n, model.forward(n), model.forward(n) / one] for n in ns]
    r = model.record
    where = f"{r.get('cpu', '?')}, {r.get('dtype', '?')}, {r.get('threads', '?')} threads, {r.get('engine_version', '')}"
    return [f"## Cost model: {model.engine} ({where})", "",
            markdown_table(["n tokens", "ms", "ratio to n=1"], rows, digits=3),
            f"Drafter call: {fmt(model.draft_ms, 2)} ms; the loop's own work per round: "
            + ", ".join(f"{k} {fmt(v, 2)} ms" for k, v in model.overhead_ms.items())
            + (f". Measured {r['measured']} in {r.get('probe_s')} s ({load_note(r.get('load'))})" if r.get("measured")
               else "")
            + (f"; cached in {model.path}" if model.path else "") + ".", ""]


def cost_plot(path, models: list[CostModel], title: str) -> Path:
    """ms of a forward over n = 1..64 tokens, one line per engine (a static width past its widest is left off)."""
    series = {}
    for m in models:
        ns = [n for n in range(1, 65) if m.forward(n) != float("inf")]
        series[m.engine] = (ns, [m.forward(n) for n in ns])
        if m.paths:
            series[f"{m.engine}, a tree one path a row"] = (m.paths["ns"], m.paths["ms"])
    return line_plot(path, series, title, "tokens in one forward", "ms")
