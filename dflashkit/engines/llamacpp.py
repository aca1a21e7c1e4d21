"""llama.cpp as a peer: the target (and drafter) converted to GGUF once, `llama-server` driven over loopback HTTP
on token ids, its own timings and draft counters reported as llama.cpp reports them."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflashkit.drafter.config import check_engine_block
from dflashkit.drafter.gguf import add_token_map, check_gguf, gguf_keys
from dflashkit.engines.install import LlamaCpp, engines_home, require, run_step
from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_path, sha256_json

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8_0": "q8_0"}


@dataclass
class EngineAnswer:
    """One answer of an engine: new token ids (the stop token kept, as ours), seconds, and draft counters."""

    tokens: list[int]
    seconds: float
    prompt_seconds: float | None  # None: the engine does not report its prompt time apart
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verify steps (rounds) that carried a draft
    extra: dict = field(default_factory=dict)
    per_position: list[int] | None = None  # rounds that accepted a draft at position k = 1.., where reported


def gguf_dir() -> Path:
    return engines_home() / "gguf"


def convert(engine: LlamaCpp, hf_dir: Path, dtype: str, out: Path, target_dir: Path | None = None) -> Path:
    """llama.cpp's own converter, once per (folder content, dtype): `target_dir` for a DFlash drafter (its tokenizer
    and head come from the target)."""
    if out.is_file():
        return out
    cmd = [*engine.converter, hf_dir, "--outtype", GGUF_TYPES[dtype]]
    if target_dir is not None:
        cmd += ["--target-model-dir", target_dir]
    with atomic_path(out) as tmp:
        run_step([*cmd, "--outfile", tmp], f"converting {hf_dir} with llama.cpp's converter")
    return out


def target_gguf(engine: LlamaCpp, target, dtype: str) -> Path:
    """The target's weights as llama.cpp runs them, in the format ours run (a GGUF target's own file, q8_0, bf16,
    f16, else `dtype`), cached by the target's identity."""
    from dflashkit.targets.formats import base, gguf_source, is_file

    weights = base(getattr(target, "weights", "float"))  # -int8: the same file (llama.cpp's own dots are int8)
    if weights == "gguf":
        return gguf_source(target.path)
    if is_file(weights):
        return Path(weights)
    if weights in ("q4_0", "q4_1"):
        raise DFlashError(f"llama.cpp beside --weights {weights}: its converter writes q8_0, bf16 and f16 only; bench a GGUF "
                          "target's own file (--weights gguf: a file llama-quantize wrote, passed as --target FILE.gguf, "
                          "or the default's) or q8_0")
    dtype = {"q8_0": "q8_0", "bf16": "bfloat16", "f16": "float16"}.get(weights, dtype)  # its converter's rounding
    key = sha256_json(target.identity())[:16]
    return convert(engine, Path(target.path), dtype, gguf_dir() / f"{target.name}-{key}-{GGUF_TYPES[dtype]}.gguf")


class LlamaServer:
    """`llama-server` with one model (and a DFlash drafter), on a free loopback port, for the `with` block."""

    def __init__(self, model: Path, threads: int, ctx: int, drafter: Path | None = None, draft_max: int = 0,
                 log: Path | None = None, engine: LlamaCpp | None = None):
        if drafter is not None:  # before any start: --spec-draft-n-max counts drafts, dflash.block_size the anchor too
            keys = gguf_keys(Path(drafter))
            check_engine_block("llama.cpp", draft_max, int(keys[f"{keys['general.architecture']}.block_size"]),
                               str(drafter))
        self.engine = engine or require("llama.cpp")
        with socket.socket() as s:  # a free loopback port
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log or (gguf_dir() / f"server-{self.port}.log")
        self.cmd = [str(self.engine.binary("llama-server")), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                    "-c", str(ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"]
        if drafter is not None:
            self.cmd += ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_max),
                         "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(threads),
                         "-tbd", str(threads)]

    def __enter__(self) -> "LlamaServer":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while self.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(urllib.error.URLError, ConnectionError, json.JSONDecodeError):  # still loading
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return self
            time.sleep(0.2)
        code = self.proc.poll()
        self.__exit__()
        why = "did not become ready in 600 s" if code is None else f"exited with {code} while loading"
        raise DFlashError(f"llama-server {why} ({' '.join(self.cmd)}); its log {self.log}:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-n:])

    def complete(self, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> EngineAnswer:
        """Greedy continuation of `ids`, no prompt cache (each answer prefills its whole prompt, as ours do)."""
        body = json.dumps({"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                           "cache_prompt": False, "return_tokens": True, "stream": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                res = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise DFlashError(f"llama-server refused a completion ({e.code}: {e.read()[:300]!r}); its log "
                              f"{self.log}:\n{self.log_tail()}") from None
        return answer_of(res, time.perf_counter() - t0, stop_ids)


def answer_of(res: dict, seconds: float, stop_ids: set[int]) -> EngineAnswer:
    """A `/completion` response as an EngineAnswer (the stop token put back); verify steps are the generated tokens
    after the first that accepted drafts do not account for. The server counts totals only."""
    tokens = list(res.get("tokens") or [])
    if res.get("stop_type") == "eos" and not (tokens and tokens[-1] in stop_ids):
        tokens.append(min(stop_ids))  # ours keep the stop token; the server drops it from the answer
    t = res.get("timings") or {}
    accepted = int(t.get("draft_n_accepted") or 0)
    steps = max(0, int(t.get("predicted_n") or len(tokens)) - 1 - accepted) if t.get("draft_n") else 0
    prompt = None if t.get("prompt_ms") is None else float(t["prompt_ms"]) / 1000
    return EngineAnswer(tokens, seconds, prompt, int(t.get("draft_n") or 0), accepted, steps,
                        {"stop_type": res.get("stop_type")})


def drafter_gguf(engine: LlamaCpp, drafter, target, dtype: str, out: Path, token_map: bool = True) -> Path:
    """A DFlash/DFlash2 drafter as llama.cpp runs it: a z-lab folder without the token map (llama.cpp's converter
    refuses d2t) -> the converter -> plus the draft vocabulary's token map where it has one (and `token_map`)."""
    import torch

    from dflashkit.drafter.checkpoint import save_drafter

    vocab = (getattr(drafter, "contract", None) or {}).get("draft_vocab") if token_map else None
    with tempfile.TemporaryDirectory(prefix="dflashkit-gguf-") as tmp:
        folder = save_drafter(drafter, Path(tmp) / "zlab", format="zlab", dtype=getattr(torch, dtype))
        plain = convert(engine, folder, dtype, Path(tmp) / "plain.gguf", target_dir=Path(target.path))
        if vocab:
            add_token_map(plain, out, vocab, target.lm_head.weight.detach().float().cpu().numpy())
        else:
            with atomic_path(out) as dst:
                shutil.copyfile(plain, dst)
    check_gguf(out, drafter.config, vocab, json.loads((Path(target.path) / "config.json").read_text()))
    return out
