"""Which backend runs a method (`--engine auto|hf|static`); which is faster depends on the CPU, so `auto` is measured."""

from __future__ import annotations

import shutil

from dflashkit.decode import static
from dflashkit.decode.hf import HfBackend
from dflashkit.decode.methods import ENGINES, STATIC_KINDS, TREE_KINDS, parse_method
from dflashkit.decode.session import Backend, DecodeSession
from dflashkit.errors import DFlashError


def static_refusal(target) -> str | None:
    """Why the static backend cannot run `target` (its message names the config field), or None."""
    if target.device.type != "cpu":
        return f"target {target.name} is on {target.device}: the static backend's trees run on CPU kernels"
    if shutil.which("c++") is None:
        return "no C++ compiler (c++) here to build the static backend's kernels: install g++, or use --engine hf"
    try:
        static.geometry_of(target)
    except DFlashError as e:
        return str(e)
    return None


def backend_for(session: DecodeSession, engine: str, method: str) -> str:
    """`engine` for `method` on the session's target, with `auto` made concrete (kept in the session for the run)."""
    kind, target = parse_method(method)[0], session.target
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
    if session.auto is None:
        if (why := static_refusal(target)) is not None:
            session.say(f"engine auto: hf ({why})")
            session.auto = {"plain": "hf", "speculative": "hf", "why": why}
        elif session.probe is None:
            raise DFlashError("--engine auto is answered by timing both backends: run it from the CLI, or open the "
                              "session with dflashkit.measure.probe.new_session(target), or name hf or static")
        else:
            session.auto = session.probe(session)
    return session.auto["plain" if kind == "ar" else "speculative"]


def open_backend(session: DecodeSession, engine: str, method: str, length: int, proposer=None, cost=None) -> Backend:
    """The backend that runs `method` (engine resolved); static's decoder is the session's, rebuilt where too short."""
    if engine in ("hf", "hf-stock"):
        return HfBackend(session.target, cost, stock=engine == "hf-stock")
    trees = parse_method(method)[0] in TREE_KINDS or session.trees
    return static.StaticBackend(static.decoder_for(session, length, proposer, trees=trees), proposer)
