"""vLLM as a peer: `vllm_worker.py` run by the engine's own Python, one `LLM` per process (plain or DFlash), answering
token ids with vLLM's own speculative counters."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from dflashkit.drafter.config import check_engine_block
from dflashkit.engines.install import Vllm, require
from dflashkit.engines.llamacpp import EngineAnswer
from dflashkit.errors import DFlashError

WORKER = Path(__file__).with_name("vllm_worker.py")
REPLY = "@@dflashkit "


class VllmWorker:
    """One vLLM engine for the `with` block: `drafter` (a z-lab folder) makes it speculative with B-1 drafts."""

    def __init__(self, model: Path, dtype: str, threads: int, max_model_len: int, drafter: Path | None = None,
                 num_speculative_tokens: int = 0, engine: Vllm | None = None):
        if drafter is not None:  # before any start: vLLM counts drafts, the folder's block_size the anchor too
            cfg = json.loads((Path(drafter) / "config.json").read_text())
            block = (cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size", 16))
            check_engine_block("vllm", num_speculative_tokens, int(block), str(Path(drafter) / "config.json"))
        self.engine = engine or require("vllm")
        self.cfg = {"model": str(model), "dtype": dtype, "max_model_len": max_model_len,
                    "speculative": None if drafter is None else
                    {"method": "dflash", "model": str(drafter), "num_speculative_tokens": num_speculative_tokens}}
        self.threads, self.lines = threads, deque(maxlen=40)

    def __enter__(self) -> "VllmWorker":
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2",
               "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "PYTHONPATH": ""}
        self.proc = subprocess.Popen([str(self.engine.python), str(WORKER), json.dumps(self.cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        self.replies = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._reply(900, "starting")
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self.replies.put(json.loads(line[len(REPLY):]))
            else:
                self.lines.append(line.rstrip())

    def _reply(self, timeout: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(queue.Empty):
                return self.replies.get(timeout=1.0)
            if (code := self.proc.poll()) is not None or time.monotonic() > deadline:
                self.__exit__()
                raise DFlashError(f"vLLM {'exited with ' + str(code) if code is not None else 'timed out'} while "
                                  f"{doing} ({json.dumps(self.cfg)}); its last output:\n" + "\n".join(self.lines))

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def complete(self, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> EngineAnswer:
        print(json.dumps({"ids": ids, "max_tokens": max_new_tokens}), file=self.proc.stdin, flush=True)
        return answer_of(self._reply(3600, "answering"), (self.cfg["speculative"] or {}).get("num_speculative_tokens", 0))


def answer_of(reply: dict, num_speculative_tokens: int) -> EngineAnswer:
    """A worker's reply as an EngineAnswer: vLLM's counters (a draft is num_speculative_tokens), no prompt time."""
    return EngineAnswer(reply["tokens"], reply["seconds"], None, reply["drafts"] * int(num_speculative_tokens),
                        reply["accepted"], reply["drafts"], per_position=reply.get("per_position"))
