"""Which backend runs a method (`--engine auto|hf|static`): `hf`, transformers' own forward (the reference, every
family), or `static`, our compiled step (decode/static.py: Llama-type targets). Methods are written once over
either (decode/speculative.py). Which one is faster depends on the CPU (on a bf16 Xeon static was 1.6x hf, on a
float32-only Zen 3 0.9x), so `auto` measures both on this machine once (a one-token step and an 8-node verify,
about 10 s, plus the static step's compile) and caches the answer per CPU, target, dtype and threads; where static
refuses a target, auto says why and runs hf."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from dflashkit.decode.methods import ENGINES, STATIC_KINDS, TREE_KINDS, parse_method
from dflashkit.errors import DFlashError
from dflashkit.fileio import sha256_json
from dflashkit import levels
from dflashkit.threads import cpu_times, usable_cpus

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
            state["auto"] = {"plain": "hf", "speculative": "hf", "why": why}
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


def load_sample() -> tuple:
    """What measured_load compares against: the 1-minute load average, /proc/stat's busy and total jiffies of the
    usable CPUs, and the jiffies this process and its descendants ran, now."""
    return os.getloadavg()[0], cpu_times(usable_cpus()), _tree_jiffies()


def _tree_jiffies() -> int:
    """CPU jiffies of this process and its descendants, live or reaped (inductor's compile workers, llama-bench)."""
    kids, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            f = stat.read_text().rsplit(")", 1)[1].split()
            kids.setdefault(int(f[1]), []).append(pid := int(stat.parent.name))
            cpu[pid] = sum(map(int, f[11:15]))  # utime, stime, cutime, cstime
    todo, total = [os.getpid()], 0
    while todo:
        total += cpu.get(pid := todo.pop(), 0)
        todo += kids.get(pid, [])
    return total


def measured_load(start: tuple, threads: int) -> dict:
    """The machine's load over a measurement begun at `start` (load_sample) on `threads` threads: the 1-minute load
    average at its start and end, the usable CPUs, and `others`, the CPUs other processes kept busy meanwhile
    (/proc/stat's busy jiffies of the usable CPUs less those of this process and its descendants; where /proc has
    nothing, the load average at the start). Loaded: `others` > usable CPUs - `threads` (at least 0) + 0.5, i.e.
    other work took CPUs the measurement's threads needed (a cost model measured beside a benchmark on 2 CPUs ran
    3x slow). Not the load average itself: it counts this process's own work before the measurement too (after a
    bench's runs, about its threads), so every cost model measured there would be called loaded. A loaded answer
    is cached marked so, used for the run, and measured again by the next run."""
    (load0, (b0, t0), j0), cpus = start, len(usable_cpus())
    (b1, t1), j1 = cpu_times(usable_cpus()), _tree_jiffies()
    others = max(0.0, cpus * (b1 - b0 - (j1 - j0)) / (t1 - t0) if t1 > t0 else load0)
    return {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2), "cpus": cpus, "threads": threads,
            "others": round(others, 2), "loaded": others > max(0, cpus - threads) + 0.5}


def loaded(record: dict) -> bool:
    return bool((record.get("load") or {}).get("loaded"))


def load_note(load: dict | None) -> str:
    """'load 0.4 on 2 CPUs' (the load average at the start; other work's CPUs where it was loaded)."""
    if not load:
        return "load not recorded"
    return (f"load {load['start']:.1f} on {load['cpus']} CPUs" + (f", loaded: other work kept {load['others']:.1f} "
            f"busy beside {load['threads']} threads of ours" if load.get("loaded") else ""))


def say_loaded(what: str, path, load: dict, fix: str, log=None) -> None:
    if load["loaded"]:
        _say(log, f"{what} was measured under load ({load_note(load)}): {path} is marked loaded and measured again "
                  f"by the next run; {fix} when the machine is quiet")


def probe_note(found: dict, more: str = "") -> str:
    """A report's header: 'engine auto -> static (probe 2026-12-07 03:10, load 0.4 on 2 CPUs)'."""
    pick = found["plain"] if found["plain"] == found["speculative"] else \
        f"plain on {found['plain']}, speculative on {found['speculative']}"
    why = found.get("why") or (f"probe {found.get('measured_at', '')[:16] or 'at an unrecorded time'}, "
                               + load_note(found.get("load")))
    return f"engine auto -> {pick} ({why}{more})"


def probe(target, state: dict, log=None, repeats: int = 9) -> dict:
    """Time both backends on this machine (cached under $DFLASHKIT_HOME/engine-probe): the one-token step (what
    plain decoding runs) and one-token + 8-node verify (what a speculative round spends on the target). `state`'s
    "reprobe" (--reprobe) times them again; so does an answer measured under load (measured_load)."""
    from dflashkit.decode.cost import measure_cost_curve
    from dflashkit.decode.static import decoder_for
    from dflashkit.fileio import write_json
    from dflashkit.targets.invariant import kernels_for

    path, record = probe_path(target)
    found = None if state.get("reprobe") else cached_probe(path, log)
    if found and not loaded(found):
        _say(log, probe_note(found, f", on {found['cpu']}; {path}; --reprobe measures again"))
        return found
    _say(log, "engine auto: timing the hf and static backends on this machine (once; cached)"
         + (f"; {path} was measured under load" if found else ""))
    t0, start = time.perf_counter(), load_sample()
    with kernels_for(target):
        curve = measure_cost_curve(target, ns=(1, 8), repeats=repeats)
    d = decoder_for(target, state, 512, state.get("proposer"), trees=True, log=log)  # the run's own decoder
    hf, static = {"1": curve(1), "8": curve(8)}, {"1": d.step_s[1], "8": d.step_s[8]}
    pick = lambda k: "static" if sum(static[x] for x in k) < sum(hf[x] for x in k) else "hf"
    found = {**record, "hf_s": hf, "static_s": static, "plain": pick(("1",)), "speculative": pick(("1", "8")),
             "probe_s": round(time.perf_counter() - t0, 1), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
             "load": measured_load(start, record["threads"])}
    try:
        write_json(path, found)
    except OSError as e:  # the answer is good for this run: say so and go on
        _say(log, f"engine auto: could not cache the answer in {path} ({e.strerror or e}); the next run times again")
    _say(log, f"engine auto: plain on {found['plain']} (one token: hf {1e3 * hf['1']:.1f} ms, static "
              f"{1e3 * static['1']:.1f}), speculative on {found['speculative']} (8-node verify: hf "
              f"{1e3 * hf['8']:.1f} ms, static {1e3 * static['8']:.1f})")
    say_loaded("engine auto: the probe", path, found["load"], "or rerun with --reprobe", log)
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
