"""Which backend runs a method (`--engine auto|hf|static`): `hf`, transformers' own forward (the reference, every
family), or `static`, our compiled step (decode/static.py: Llama-type targets). Methods are written once over
either (decode/speculative.py). Which one is faster depends on the CPU (on a bf16 Xeon static was 1.6x hf, on a
float32-only Zen 3 0.9x), so `auto` measures both on this machine once (a one-token step and an 8-node verify,
about 10 s, plus the static step's compile) and caches the answer per CPU, target, dtype and threads; where static
refuses a target, auto says why and runs hf."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from dflashkit.decode.methods import ENGINES, STATIC_KINDS, TREE_KINDS, parse_method
from dflashkit.errors import DFlashError
from dflashkit.fileio import sha256_json
from dflashkit import levels

BACKENDS = ("hf", "static")  # what a probe may answer


def static_refusal(target) -> str | None:
    """Why the static backend cannot run `target` (its message names the config field), or None."""
    from dflashkit.decode.static import geometry_of

    if target.device.type != "cpu":
        return f"target {target.name} is on {target.device}: the static backend's trees run on CPU kernels"
    if shutil.which("c++") is None:
        return "no C++ compiler (c++) here to build the static backend's kernels: install g++, or use --engine hf"
    try:
        geometry_of(target)
    except DFlashError as e:
        return str(e)
    return None


def resolve(engine: str, target, method: str, state: dict, log=None) -> str:
    """`engine` for `method` on `target`, with `auto` made concrete (cached in `state` for the run)."""
    kind = parse_method(method)[0]
    if engine not in ENGINES:
        raise DFlashError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "static" and kind not in STATIC_KINDS:
        raise DFlashError(f"method {method!r} is transformers' own loop (or an engine peer): it runs on --engine hf; "
                          f"the static backend runs {', '.join(STATIC_KINDS)}")
    if engine != "auto":
        if engine == "static" and (why := static_refusal(target)):
            raise DFlashError(why)
        return engine
    if kind not in STATIC_KINDS:
        return "hf"
    if "auto" not in state:
        if (why := static_refusal(target)) is not None:
            _say(log, f"engine auto: hf ({why})")
            state["auto"] = {"plain": "hf", "speculative": "hf"}
        else:
            state["auto"] = probe(target, state, log)
    return state["auto"]["plain" if kind == "ar" else "speculative"]


def _say(log, message: str) -> None:
    (log or (lambda m: print(m, file=sys.stderr)))(message)


def machine_key(target) -> tuple[str, dict]:
    """What a probe's answer depends on: the CPU (model and its vector flags), the target's weights, dtype, threads
    and torch's version."""
    name, flags = levels.cpu()
    vector = sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    if levels.narrower():  # a level narrower than this CPU's (--isa) is another machine to time
        vector = sorted(set(vector) & levels.LEVELS[levels.chosen()].needs) + [f"isa={levels.chosen()}"]
    ident = target.identity()
    record = {"cpu": name, "flags": vector, "target": ident.get("weights_hash") or ident.get("name"),
              "dtype": str(target.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "torch": torch.__version__}
    return sha256_json(record)[:16], record


def probe_path(target):
    """Where auto's answer for `target` here is cached, and what it depends on: the machine and these kernels (a
    new build of ours, whose library names its source, flags and CPU, is timed again)."""
    from dflashkit.decode.costmodel import engine_version
    from dflashkit.fileio import home

    record = {**machine_key(target)[1], "static": engine_version("static")}
    return home() / "engine-probe" / f"{sha256_json(record)[:16]}.json", record


def cached_probe(path: Path, log=None) -> dict | None:
    """A probe's cached answer, or None (then timed again) where the file is missing or damaged, with one line
    naming the file: garbage, a missing field or a backend that does not exist would otherwise end every --engine
    auto run with a traceback, or with an error about a flag the user never passed."""
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text())
        bad = next((k for k in ("plain", "speculative") if not isinstance(found, dict) or found.get(k) not in BACKENDS),
                   None)
        if bad is None and not isinstance(found.get("cpu"), str):
            bad = "cpu"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        bad = f"unreadable: {e}"
    if bad is None:
        return found
    _say(log, f"engine auto: {path} is damaged (field {bad!r}); timing the backends again")
    return None


def probe(target, state: dict, log=None, repeats: int = 9) -> dict:
    """Time both backends on this machine (cached under $DFLASHKIT_HOME/engine-probe): the one-token step (what
    plain decoding runs) and one-token + 8-node verify (what a speculative round spends on the target)."""
    from dflashkit.decode.cost import measure_cost_curve
    from dflashkit.decode.static import decoder_for
    from dflashkit.fileio import write_json
    from dflashkit.targets.invariant import kernels_for

    path, record = probe_path(target)
    if found := cached_probe(path, log):
        when = f" at {found['measured_at']}" if "measured_at" in found else ""
        _say(log, f"engine auto: plain on {found['plain']}, speculative on {found['speculative']} (measured on "
                  f"{found['cpu']}{when}; {path}; remove it to measure again)")
        return found
    _say(log, "engine auto: timing the hf and static backends on this machine (once; cached)")
    t0 = time.perf_counter()
    with kernels_for(target):
        curve = measure_cost_curve(target, ns=(1, 8), repeats=repeats)
    d = decoder_for(target, state, 512, state.get("proposer"), trees=True, log=log)  # the run's own decoder
    hf, static = {"1": curve(1), "8": curve(8)}, {"1": d.step_s[1], "8": d.step_s[8]}
    pick = lambda k: "static" if sum(static[x] for x in k) < sum(hf[x] for x in k) else "hf"
    found = {**record, "hf_s": hf, "static_s": static, "plain": pick(("1",)), "speculative": pick(("1", "8")),
             "probe_s": round(time.perf_counter() - t0, 1), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        write_json(path, found)
    except OSError as e:  # the answer is good for this run: say so and go on
        _say(log, f"engine auto: could not cache the answer in {path} ({e.strerror or e}); the next run times again")
    _say(log, f"engine auto: plain on {found['plain']} (one token: hf {1e3 * hf['1']:.1f} ms, static "
              f"{1e3 * static['1']:.1f}), speculative on {found['speculative']} (8-node verify: hf "
              f"{1e3 * hf['8']:.1f} ms, static {1e3 * static['8']:.1f})")
    return found


def open_backend(engine: str, target, method: str, state: dict, length: int, proposer=None, cost=None, log=None):
    """The backend that runs `method` (engine already resolved): a fresh HfBackend, or `state`'s static decoder
    (built, or rebuilt longer, for `length` positions, the drafter's layers and block, and tree widths)."""
    from dflashkit.decode.speculative import HfBackend

    if engine == "hf":
        return HfBackend(target, cost)
    from dflashkit.decode.static import StaticBackend, decoder_for

    trees = parse_method(method)[0] in TREE_KINDS or state.get("trees", False)
    return StaticBackend(decoder_for(target, state, length, proposer, log=log, trees=trees))


@contextlib.contextmanager
def plain_answers(target, engine: str, max_new_tokens: int, log=None):
    """(the backend, answer(prompt ids, max new tokens) -> (index, greedy completion)...) for `data generate --engine`:
    our plain decoding on static or an engine peer's (its server up while the context is), one prompt at a time; None
    for hf (transformers' batches write its text faster). In bf16 each writes its own text (near-ties)."""
    from dflashkit.decode.methods import ENGINE_METHODS
    from dflashkit.decode.peers import EnginePeer
    from dflashkit.decode.speculative import generate

    if engine in ENGINE_METHODS:
        with EnginePeer(engine, target, None, 0, max_new_tokens) as peer:
            yield engine, lambda ids, n, **_: ((i, peer.one(p).tokens) for i, p in enumerate(ids))
        return
    name = resolve(engine, target, "ar", state := {}, log)
    yield None if name == "hf" else (name, lambda ids, n, **_: (
        (i, generate(target, p, "ar", max_new_tokens=n, engine=name, state=state).tokens) for i, p in enumerate(ids)))
