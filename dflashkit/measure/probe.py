"""`--engine auto`'s answer, measured: both backends timed on this machine once, cached per CPU, target, dtype and
threads with the load it was measured under; and that load, sampled alike for every measurement of ours."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from dflashkit import __version__, levels
from dflashkit.decode import native
from dflashkit.decode.session import DecodeSession
from dflashkit.engines.install import LLAMA_CPP_BUILD, VLLM_VERSION
from dflashkit.fileio import home, sha256_json
from dflashkit.targets.invariant import kernels_for
from dflashkit.threads import cpu_times, usable_cpus

BACKENDS = ("hf", "static")  # what a probe may answer


def engine_version(engine: str) -> str:
    """What a re-measure is due on: our code, torch and the kernels for the backends, the build for a peer."""
    if engine == "llama.cpp":
        return f"llama.cpp build {LLAMA_CPP_BUILD}" + (f" (level {levels.chosen()})" if levels.narrower() else "")
    if engine == "vllm":
        return f"vllm {VLLM_VERSION}"
    import transformers

    return (f"dflashkit {__version__}, torch {torch.__version__}, transformers {transformers.__version__}"
            + (f", kernels {native.library_path().stem}" if engine == "static" else ""))


def _say(log, message: str) -> None:
    (log or (lambda m: print(m, file=sys.stderr)))(message)


def machine_key(target) -> tuple[str, dict]:
    """What a probe's answer depends on: the CPU and its vector flags, the target's weights, dtype, threads, torch."""
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
    """Where auto's answer for `target` here is cached, and what it depends on: the machine and these kernels."""
    record = {**machine_key(target)[1], "static": engine_version("static")}
    return home() / "engine-probe" / f"{sha256_json(record)[:16]}.json", record


def cached_probe(path: Path, log=None) -> dict | None:
    """A probe's cached answer, or None (timed again, one line says why) where the file is missing or damaged."""
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
    """What measured_load compares against: the load average, the CPUs' and our process tree's jiffies, now."""
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
    """`others`: the CPUs other processes kept busy since `start` (the load average counts our own earlier work too).
    Loaded: they took CPUs our `threads` needed; such an answer serves the run, is cached marked so, measured again."""
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


def probe(session: DecodeSession, repeats: int = 9) -> dict:
    """Time both backends here (cached): the one-token step (plain decoding) and one-token + 8-node verify (a
    speculative round's target). `reprobe` times them again, as does an answer measured under load."""
    from dflashkit.measure.curve import measure_cost_curve
    from dflashkit.decode.static import decoder_for
    from dflashkit.fileio import write_json  # looked up now: a test makes it fail

    target, log = session.target, session.log
    path, record = probe_path(target)
    found = None if session.reprobe else cached_probe(path, log)
    if found and not loaded(found):
        _say(log, probe_note(found, f", on {found['cpu']}; {path}; --reprobe measures again"))
        return found
    _say(log, "engine auto: timing the hf and static backends on this machine (once; cached)"
         + (f"; {path} was measured under load" if found else ""))
    t0, start = time.perf_counter(), load_sample()
    with kernels_for(target):
        curve = measure_cost_curve(target, ns=(1, 8), repeats=repeats)
    d = decoder_for(session, 512, session.proposer, trees=True)  # the run's own decoder
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


def new_session(target, proposer=None, reprobe: bool = False, log=None, trees: bool = False) -> DecodeSession:
    """A run's decode session whose `--engine auto` is answered by `probe` (looked up at call time: tests replace it)."""
    return DecodeSession(target, proposer, trees=trees, reprobe=reprobe, log=log, probe=lambda s: probe(s))
