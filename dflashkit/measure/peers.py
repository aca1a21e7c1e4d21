"""Engine peers in `bench`: llama.cpp and vLLM decode the same prompts in the bench's rotation (one answer at a time),
plain and with our drafter exported, held to their own plain decoding; partings from our `ar` reported, not failed."""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack, contextmanager
from itertools import accumulate, zip_longest
from pathlib import Path

import torch

from dflashkit.decode.backends import backend_for
from dflashkit.decode.conversation import decode_conversation
from dflashkit.decode.methods import PEER_METHODS
from dflashkit.decode.sampling import GREEDY
from dflashkit.decode.session import Generation
from dflashkit.decode.speculative import draft_block, generate
from dflashkit.drafter.config import engine_block
from dflashkit.errors import DFlashError
from dflashkit.measure.probe import new_session
from dflashkit.tree import common_prefix

TAU_TOLERANCE = 0.05  # engine mean acceptance length vs our chain's tau on the same drafter


def is_engine(method: str) -> bool:
    return method in PEER_METHODS


def plain_of(method: str) -> str:
    return method.removesuffix("-dflash")


def start_engine(method: str, target, drafter, block_size: int, ctx: int, workdir: Path):
    """The engine of `method`, not yet entered; the drafter exported as that engine reads it."""
    from dflashkit.drafter.checkpoint import save_drafter
    from dflashkit.engines.install import require

    dtype, threads = str(target.dtype).removeprefix("torch."), torch.get_num_threads()
    speculative = method.endswith("-dflash")
    if speculative and drafter is None:
        raise DFlashError(f"--methods {method} runs our drafter in the engine: pass --drafter")
    engine = require(plain_of(method))  # "llama.cpp" or "vllm"
    if method.startswith("llama.cpp"):
        from dflashkit.engines.llamacpp import LlamaServer, drafter_gguf, target_gguf

        model = target_gguf(engine, target, dtype)
        draft = drafter_gguf(engine, drafter, target, dtype, workdir / "drafter.gguf") if speculative else None
        return LlamaServer(model, threads, ctx, draft, engine_block("llama.cpp", block_size)[1],
                           log=workdir / f"{method}.log", engine=engine)
    from dflashkit.engines.vllm_client import VllmWorker

    folder = save_drafter(drafter, workdir / "vllm-drafter", format="zlab", dtype=target.dtype,
                          lm_head=target.lm_head.weight) if speculative else None
    return VllmWorker(Path(target.path), dtype, threads, ctx, folder, engine_block("vllm", block_size)[1], engine=engine)


class EnginePeer:
    """One engine method, started on entry and held open through the bench, so that drift hits ours and it alike."""

    def __init__(self, method: str, target, drafter, block_size: int, max_new_tokens: int):
        self.method, self.target, self.max_new_tokens = method, target, max_new_tokens
        self.drafter, self.block_size, self.stops = drafter, block_size, set(target.stop_token_ids)
        # room for every turn of a conversation (prompts and answers): 4,096 or the target's own limit
        self.ctx = min(4096, int(getattr(target.config, "max_position_embeddings", None) or 4096))
        self.fresh()

    def fresh(self) -> None:  # a conversation's own counters: the engine's drafts and what it reported per position
        self.counts = {"drafted": 0, "accepted": 0, "steps": 0}
        self.reported, self.turns = {"per_position": None, "prefill_known": True}, 0

    def __enter__(self) -> "EnginePeer":
        with ExitStack() as stack:  # a failed start removes its work folder; a started one keeps both to __exit__
            work = stack.enter_context(tempfile.TemporaryDirectory(prefix="dflashkit-peer-"))
            t0 = time.perf_counter()
            self.engine = stack.enter_context(start_engine(self.method, self.target, self.drafter, self.block_size,
                                                      self.ctx, Path(work)))
            self.info = {"start_s": time.perf_counter() - t0, "context": self.ctx}
            if self.method.endswith("-dflash"):  # which count the engine was given (docs/design.md section 14)
                name, n = engine_block(plain_of(self.method), self.block_size)
                self.info["block"] = f"block_size {self.block_size} (anchor counted) -> {name} {n}"
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)

    def one(self, ids: list[int]) -> Generation:
        """One turn: the engine's answer, timed end to end (prompt time apart where reported); acceptance summed."""
        a = self.engine.complete(ids, self.max_new_tokens, self.stops)
        for k in self.counts:
            self.counts[k] += getattr(a, k)
        pos, known = self.reported["per_position"], getattr(a, "per_position", None)
        self.reported["per_position"] = (None if known is None or (pos is None and self.turns)
                                         else [x + y for x, y in zip_longest(pos or [], known, fillvalue=0)])
        self.reported["prefill_known"] &= a.prompt_seconds is not None
        self.turns += 1
        prompt = a.prompt_seconds or 0.0
        return Generation(self.method, a.tokens[: self.max_new_tokens], [],
                          {"prefill": prompt, "draft": 0.0, "verify": 0.0, "other": a.seconds - prompt,
                           "total": a.seconds})

    def run(self, pid: str, item) -> dict:
        """One conversation as a bench run record, with the engine's own draft counters."""
        self.fresh()
        c = decode_conversation(self.target, item, self.one)
        g = c.generation
        return {"prompt": pid, "method": self.method, "prompt_tokens": len(c.prompts[0]), "turns": c.lengths,
                "tokens": g.tokens, "accepted": [], "times": g.times, "engine": {**self.counts, **self.reported},
                "turn_prompts": c.prompts}


def engine_tau(runs: list[dict]) -> float | None:
    """The engine's own mean acceptance length: 1 + accepted drafts / verify steps that carried a draft."""
    steps = sum(r["engine"]["steps"] for r in runs)
    return 1 + sum(r["engine"]["accepted"] for r in runs) / steps if steps else None


def differences(runs: list[dict], against) -> list[dict]:
    """Each run whose tokens differ from its baseline's `against(label)` (None or itself: none) on the same prompt."""
    by = {(r["prompt"], r["method"]): r["tokens"] for r in runs}
    bad = []
    for r in runs:
        base = against(r["method"])
        got, want = r["tokens"], by.get((r["prompt"], base))
        if base != r["method"] and want is not None and got != want:
            bad.append({"prompt": r["prompt"], "method": r["method"], "first_difference": common_prefix(got, want),
                        "lengths": [len(got), len(want)]} | ({"against": base} if base != "ar" else {}))
    return bad


def check_engines(runs: list[dict]) -> tuple[list[dict], dict]:
    """(mismatches of each engine's speculative output against its own plain one, {method: ar_parting})."""
    engines = dict.fromkeys(r["method"] for r in runs if is_engine(r["method"]))
    parting = {m: p for m in engines if (p := ar_parting(runs, m))["prompts"]}
    return differences(runs, lambda m: plain_of(m) if m in engines else None), parting


def ar_parting(runs: list[dict], method: str, against: str = "ar") -> dict:
    """How many of `method`'s outputs equal `against`'s (our ar), and where each other one parts."""
    theirs = {r["prompt"] for r in runs if r["method"] == against}
    parts = {x["prompt"]: x["first_difference"] for x in differences(runs, lambda m: against if m == method else None)}
    n = sum(r["method"] == method and r["prompt"] in theirs for r in runs)
    return {"equal": n - len(parts), "prompts": n, "parts_at": parts}


@torch.no_grad()
def forced_chain_rounds(target, proposer, prompt_ids: list[int], answer: list[int]) -> list[int]:
    """Accepted drafts + 1 per round of a chain loop with our drafter whose target chose `answer` (an engine's own
    output): the tau our drafter predicts on the tokens the engine verified (tau on two texts differs by percents)."""
    seq, dev = list(prompt_ids) + list(answer), target.device
    feats = target.forward(torch.tensor([seq], device=dev), layer_ids=proposer.layer_ids).features
    proposer.reset(prompt_ids)
    B, done, start, rounds = proposer.block_size, 0, len(prompt_ids), []
    while start < len(seq) - 1:
        drafts = draft_block(proposer, feats[:, done:start], torch.tensor([seq[start]], device=dev), start, GREEDY,
                             None)[0].tolist()
        want = seq[start + 1 : start + B]
        a = next((i for i, (d, w) in enumerate(zip(drafts, want)) if d != w), len(want))
        rounds.append(min(a + 1, len(seq) - 1 - start))  # a last round's bonus past the answer is not committed
        done, start = start, start + a + 1
    return rounds


def predicted_tau(target, proposer, runs: list[dict]) -> float | None:
    """forced_chain_rounds over every turn of an engine's runs, as one mean."""
    rounds = []
    for r in runs:
        for prompt, n, at in zip(r.get("turn_prompts") or [], r["turns"], accumulate(r["turns"], initial=0)):
            rounds += forced_chain_rounds(target, proposer, prompt, r["tokens"][at : at + n])
    return sum(rounds) / len(rounds) if rounds else None


def check_tau(summary: dict) -> list[dict]:
    """Engine mean acceptance length against the tau our drafter predicts on its output, within TAU_TOLERANCE."""
    chain = (summary.get("chain") or {}).get("tau")
    out = []
    for m, s in summary.items():
        ours = s.get("predicted_tau") or chain
        if is_engine(m) and m.endswith("-dflash") and ours and s.get("tau"):
            gap = s["tau"] / ours - 1
            out.append({"method": m, "engine_tau": s["tau"], "predicted_tau": ours, "chain_tau": chain, "gap": gap,
                        "ok": abs(gap) <= TAU_TOLERANCE})
    return out


@contextmanager
def plain_answers(target, engine: str, max_new_tokens: int, log=None):
    """(the backend, answer(prompt ids, max new tokens) -> (index, greedy completion)...) for `data generate --engine`:
    plain decoding on static or an engine peer, one prompt at a time; None for hf (transformers' batches are faster)."""
    if engine in PEER_METHODS:
        with EnginePeer(engine, target, None, 0, max_new_tokens) as peer:
            yield engine, lambda ids, n, **_: ((i, peer.one(p).tokens) for i, p in enumerate(ids))
        return
    name = backend_for(session := new_session(target, log=log), engine, "ar")
    yield None if name == "hf" else (name, lambda ids, n, **_: (
        (i, generate(target, p, "ar", max_new_tokens=n, engine=name, session=session).tokens) for i, p in enumerate(ids)))
