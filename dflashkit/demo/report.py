"""The demo's report: what each stage wrote, read once into typed results, then the tables, the quality bar and
the measurements that say what limits the result.

The results are read from the files the stages wrote (not passed in memory), so a rerun that skipped every stage
still reports the numbers of the run that built them.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflashkit.fileio import read_json, write_json, write_text

BAR = {"best_speedup": 1.6, "vs_fastest_plain": 1.5, "ahead_of_prompt_lookup": 0.3, "ddtree8_tau": 2.0, "verify9_ratio": 1.25}
BASELINES = ("ar", "ar-stock", "hf-generate", "ar@hf", "ar@static", "llama.cpp", "vllm")  # plain decoders; prompt-lookup
#                                                                                  (transformers') is a baseline too
DRAFTERS = ("trained", "first-checkpoint", "untrained")
ANCHORS = ("stride", "walk")


def _load(p: Path) -> dict:
    """A stage's JSON output, {} when the stage has not written it (a corrupt file is a clear error)."""
    return read_json(p, fix="rerun `dflashkit demo` to rebuild it") if p.is_file() else {}


# ---- typed results -----------------------------------------------------------------------------------------------
@dataclass
class Method:
    """One decoding method's row of a bench (decode/bench.py)."""
    name: str
    tau: float | None = None
    tokens_per_s: float | None = None
    speedup_vs_ar: float | None = None
    speedup_vs_prompt_lookup: float | None = None
    speedup_vs_fastest_plain: float | None = None  # against the fastest plain decoder in the bench (fastest_plain)
    fastest_plain: str | None = None
    ceiling: float | None = None
    new_tokens: int = 0
    ms_per_round: dict = field(default_factory=dict)  # draft, verify, other, total

    @property
    def speedup(self) -> float:
        return self.speedup_vs_ar or 0.0


@dataclass
class Bench:
    """One suite's online decoding results: every method, the cost curve, and any output that differed from greedy."""
    methods: dict[str, Method] = field(default_factory=dict)
    cost: dict | None = None
    mismatches: list = field(default_factory=list)
    ran: bool = False
    config: dict = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path) -> "Bench":
        raw = _load(folder / "results.json")
        methods = {m: Method(m, **{k: s.get(k) for k in ("tau", "tokens_per_s", "speedup_vs_ar",
                                                          "speedup_vs_prompt_lookup", "speedup_vs_fastest_plain",
                                                          "fastest_plain", "ceiling")},
                             new_tokens=s.get("new_tokens") or 0, ms_per_round=s.get("ms_per_round") or {})
                   for m, s in raw.get("methods", {}).items()}
        return cls(methods, raw.get("cost"), raw.get("mismatches") or [], bool(raw), raw.get("config") or {})

    def ran_on(self) -> str:
        """Backends, threads and the static kernels' instruction set, as the bench recorded them."""
        c = self.config
        parts = [f"backends {', '.join(c['backends'])}" if c.get("backends") else "",
                 f"{c['threads']} threads" if c.get("threads") else "",
                 f"static kernels built for {c['static_kernels']}" if c.get("static_kernels") else ""]
        return "; ".join(p for p in parts if p)

    @property
    def lossless(self) -> bool:
        return self.ran and not self.mismatches

    def best(self) -> Method:
        """The fastest of our speculative methods (not the baselines)."""
        ours = [m for n, m in self.methods.items() if n not in BASELINES and not n.startswith("prompt-lookup")]
        return max(ours, key=lambda m: m.speedup, default=Method("none"))

    @property
    def fastest_plain(self) -> str:
        """The plain decoder every speedup was also set against (bench names it on each row)."""
        return next((m.fastest_plain for m in self.methods.values() if m.fastest_plain), "ar")

    def prompt_lookup(self) -> float:
        return next((m.speedup for n, m in self.methods.items() if n.startswith("prompt-lookup")), 0.0)

    def get(self, name: str) -> Method:
        return self.methods.get(name) or Method(name)

    def verify_ratio(self, n: int) -> float | None:
        """Cost of an n-token target forward over a 1-token one, from the measured cost curve."""
        return dict(zip((self.cost or {}).get("ns", []), (self.cost or {}).get("ratio", []))).get(n)


@dataclass
class Offline:
    """Overall offline metrics of one drafter with one anchor schedule (evaluate/offline.py)."""
    prompts: int | None = None
    blocks: int | None = None
    streak: float | None = None
    tau: float | None = None
    pos1_acc: float | None = None
    ddtree4: float | None = None
    ddtree8: float | None = None

    @classmethod
    def read(cls, folder: Path) -> "Offline | None":
        r = _load(folder / "results.json").get("overall")
        if not r:
            return None
        return cls(r.get("prompts"), r.get("blocks"), r.get("streak"), r.get("tau"), r.get("pos1_acc"),
                   r.get("budget:4"), r.get("budget:8"))


@dataclass
class Training:
    """The training run: its summary and its per-step metrics."""
    steps: int
    elapsed_s: float
    loss_name: str
    draft_vocab_size: int | None
    stop_reason: str
    rows: list[dict]  # metrics.csv

    @classmethod
    def read(cls, run: Path) -> "Training | None":
        s = _load(run / "summary.json")
        if not s:
            return None
        metrics = run / "metrics.csv"
        rows = list(csv.DictReader(metrics.open())) if metrics.is_file() else []
        return cls(s.get("steps", 0), s.get("elapsed_s", 0.0), s.get("loss_name", ""), s.get("draft_vocab_size"),
                   s.get("stop_reason", ""), rows)

    @property
    def blocks(self) -> int:
        return sum(int(r["blocks"]) for r in self.rows)

    def fit_pos1(self) -> tuple[float, int]:
        """(mean position-1 accuracy over the last tenth of the steps, how many steps that is)."""
        tail = self.rows[-max(1, len(self.rows) // 10):]
        return sum(float(r["pos1_acc"]) for r in tail) / len(tail), len(tail)


@dataclass
class DataLimits:
    """Facts about the training data against the eval cache (written by the eval stage)."""
    train_sequences: int
    train_response_tokens: int
    train_distinct_tokens: int
    draft_vocab: int | None
    eval_label_tokens: int
    eval_in_draft_vocab: float
    eval_seen_in_training: float


@dataclass
class DemoResults:
    offline: dict[tuple[str, str], Offline]  # (anchors, drafter) -> metrics
    bench: Bench
    holdout: Bench
    training: Training | None
    limits: DataLimits | None

    @classmethod
    def read(cls, root: Path) -> "DemoResults":
        offline = {(a, d): o for a in ANCHORS for d in DRAFTERS
                   if (o := Offline.read(root / "eval" / f"{d}-{a}")) is not None}
        lim = _load(root / "eval" / "limits.json")
        return cls(offline, Bench.read(root / "bench"), Bench.read(root / "bench-holdout"),
                   Training.read(root / "train"), DataLimits(**lim) if lim else None)


# ---- the bar -----------------------------------------------------------------------------------------------------
def quality_checks(res: DemoResults) -> tuple[list[list], str]:
    """The demo's bar, each criterion with its measured value and 'met' / 'missed by ...'."""
    def status(ok: bool, miss: str) -> str:
        return "met" if ok else miss

    bench, holdout = res.bench, res.holdout
    best, pl, ng = bench.best(), bench.prompt_lookup(), bench.get("ngram")
    hybrids = [m for n, m in bench.methods.items() if n.startswith("hybrid")]
    hy = max(hybrids, key=lambda m: m.tokens_per_s or 0, default=Method("hybrid"))
    dd8 = bench.get("ddtree-8").tau or 0.0
    ratio9 = bench.verify_ratio(9)
    hbest, hpl = holdout.best(), holdout.prompt_lookup()
    lossless = bench.lossless and not holdout.mismatches
    need = pl + BAR["ahead_of_prompt_lookup"]
    checks = [
        [f"best speedup >= {BAR['best_speedup']}x ar ({best.name})", best.speedup,
         status(best.speedup >= BAR["best_speedup"], f"missed by {BAR['best_speedup'] - best.speedup:.2f}x")],
        [f"best speedup >= prompt-lookup + {BAR['ahead_of_prompt_lookup']}x ({pl:.2f}x)", best.speedup,
         status(best.speedup >= need, f"missed by {need - best.speedup:.2f}x")],
        [f"{hy.name} tau > ngram tau", hy.tau, status((hy.tau or 0) > (ng.tau or 0), f"ngram tau {ng.tau or 0:.2f}")],
        [f"{hy.name} tokens/s > ngram tokens/s", hy.tokens_per_s,
         status((hy.tokens_per_s or 0) > (ng.tokens_per_s or 0), f"ngram {ng.tokens_per_s or 0:.1f}")],
        [f"drafter-only DDTree-8 online tau >= {BAR['ddtree8_tau']} (stretch)", dd8,
         status(dd8 >= BAR["ddtree8_tau"], f"missed by {BAR['ddtree8_tau'] - dd8:.2f}")],
        [f"9-token verify / 1-token cost <= {BAR['verify9_ratio']}", ratio9,
         status(ratio9 is not None and ratio9 <= BAR["verify9_ratio"], "not measured" if ratio9 is None else
                f"over by {ratio9 - BAR['verify9_ratio']:.2f}")],
        ["every output equals plain greedy decoding", lossless, status(lossless, "FAILED or not run")],
        [f"held-out suite: best speedup ({hbest.name}) vs prompt-lookup {hpl:.2f}x", hbest.speedup,
         status(hbest.speedup > hpl, f"behind by {hpl - hbest.speedup:.2f}x")],
    ]
    fast = best.speedup_vs_fastest_plain or 0.0
    checks.insert(1, [f"best speedup >= {BAR['vs_fastest_plain']}x the fastest plain decoding here "
                      f"({bench.fastest_plain})", fast,
                      status(fast >= BAR["vs_fastest_plain"], f"missed by {BAR['vs_fastest_plain'] - fast:.2f}x")])
    headline = (f"best {best.name} {best.speedup:.2f}x plain decoding, {fast:.2f}x the fastest plain decoding here "
                f"({bench.fastest_plain}; prompt-lookup {pl:.2f}x); held-out {hbest.name} "
                f"{hbest.speedup:.2f}x; ddtree-8 tau {dd8:.2f}")
    return checks, headline


def limits_lines(res: DemoResults) -> list[str]:
    """The measurements that say why the bar is or is not reached: fit vs held-out (data), first checkpoint vs
    final (training time), vocabulary coverage, and what a verify costs against a plain step (break-even tau)."""
    out = []
    trained, first = res.offline.get(("stride", "trained")), res.offline.get(("stride", "first-checkpoint"))
    if res.training and res.training.rows:
        fit, n = res.training.fit_pos1()
        held = trained.pos1_acc if trained else None
        out.append(f"- Data: position-1 accuracy {fit:.3f} on the training data (last {n} steps) against "
                   f"{held if held is None else f'{held:.3f}'} on the held-out eval cache; a wide gap means the drafter "
                   "is bound by the amount and reach of its data, not by its training time.")
        if first and trained and first.tau and trained.tau:
            out.append(f"- Training time: {len(res.training.rows)} steps, {res.training.blocks:,} blocks; offline stride "
                       f"tau {first.tau:.3f} at the first checkpoint -> {trained.tau:.3f} at the end.")
    lim = res.limits
    if lim:
        out.append(f"- Vocabulary: {lim.train_response_tokens:,} response tokens from {lim.train_sequences} prompts, "
                   f"{lim.train_distinct_tokens:,} distinct; the draft vocabulary ({lim.draft_vocab or 'full'}) covers "
                   f"{100 * lim.eval_in_draft_vocab:.1f}% of the eval completions' tokens "
                   f"({100 * lim.eval_seen_in_training:.1f}% occur in the training data).")
    ar = res.bench.get("ar").ms_per_round
    for name in ("ngram", "ddtree-8", "hybrid-auto"):
        ms = res.bench.get(name).ms_per_round
        if ar.get("total") and ms.get("total"):
            even = ms["total"] / ar["total"]
            out.append(f"- Cost of a round ({name}): {ms['total']:.0f} ms (draft {ms['draft']:.0f}, verify "
                       f"{ms['verify']:.0f}) against {ar['total']:.0f} ms per plain token: break-even at tau {even:.2f}, "
                       f"1.3x needs tau {1.3 * even:.2f}.")
    return out or ["(nothing measured yet)"]


def stage_rates(res: DemoResults, timings: dict) -> dict[str, str]:
    """Tokens or blocks per second of each stage, from what the stage wrote and how long it took."""
    out = {}
    sec = {k: t.seconds for k, t in timings.items() if t.seconds}
    if res.limits and sec.get("data"):
        out["data"] = f"{res.limits.train_response_tokens / sec['data']:.0f} target tokens/s (generated + features captured)"
    if res.training and res.training.elapsed_s and res.training.rows:
        out["train"] = f"{res.training.blocks / res.training.elapsed_s:.0f} drafter blocks/s"
    n = sum(m.new_tokens for b in (res.bench, res.holdout) for m in b.methods.values())
    if n and sec.get("bench"):
        out["bench"] = f"{n / sec['bench']:.0f} decoded tokens/s over all methods"
    return out


# ---- the report ----------------------------------------------------------------------------------------------------
def checkout_results() -> Path | None:
    """benchmarks/results of the checkout this package runs from; None when installed from a wheel."""
    found = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return found if found.is_dir() else None



def recipe_lines(results: Path | None) -> list[str]:
    """Why the demo trains this recipe: the top rows of the newest recipe ablation in `results` (a checkout's
    benchmarks/results, from benchmarks/recipe_ablation.py), and the old recipe's row; nothing without one."""
    from dflashkit.report import markdown_table

    found = sorted(Path(results).glob("*-recipe-ablation.json")) if results else []
    if not found:
        return []
    r = read_json(found[-1])
    ranked = sorted(r["rows"], key=lambda x: -x["ddtree8_tau"])
    rows = ranked[:3] + [x for x in ranked[3:] if x["lever"] == "recipe"]
    return [f"Why this recipe: each lever alone and in combination, {r['minutes']:g} training minutes each on "
            f"{r['machine']} (benchmarks/results/{found[-1].name}, top rows and the previous recipe):", "",
            markdown_table(["lever", "overrides", "steps", "walk tau", "pos-1 acc (held out)", "online ddtree-8 tau"],
                           [[x["lever"], " ".join(x["overrides"]) or "-", x["steps"], x["walk_tau"], x["stride_pos1"],
                             x["ddtree8_tau"]] for x in rows]), ""]


def numerics_lines(timings: dict) -> list[str]:
    """The numerics the stages were built with, as their stamps recorded them (a skipped stage keeps those of the run
    that built it): one line when they agree, else one per stage."""
    built = {k: t.about for k, t in timings.items() if t.about}
    if len(set(built.values())) == 1:
        return [next(iter(built.values())), ""]
    return ["Numerics, per stage as it was built:", "", *[f"- {k}: {a}" for k, a in built.items()], ""] if built else []


def built_with(settings: dict) -> str:
    return " / ".join(str(settings[k]) for k in ("dtype", "kernels", "device") if k in settings)


def write_report(root: Path, cfg, device, timings: dict, plan: str = "") -> dict:
    """report.md and report.json from what the stages wrote; returns the checks and the console summary."""
    from dflashkit.decode.bench import cost_markdown
    from dflashkit.decode.predict import predicted_markdown
    from dflashkit.report import markdown_table

    res = DemoResults.read(root)
    lines = ["# dflashkit demo report", "",
             f"Target `{cfg.target}` on `{device}`; training budget {cfg.minutes:g} min; eval suite `{cfg.eval_suite}`.", "",
             *numerics_lines(timings), *([f"Plan: {plan}.", ""] if plan else [])]
    rows = [[a, d, o.prompts, o.blocks, o.streak, o.tau, o.pos1_acc, o.ddtree4, o.ddtree8] for (a, d), o in res.offline.items()]
    lines += ["## Offline evaluation (eval cache, temperature 0)", "",
              "ddtree-4/ddtree-8 = DDTree node-budget trees budget:4/8 (the paper's tree, docs/design.md section 5).", "",
              markdown_table(["anchors", "drafter", "prompts", "blocks", "streak", "tau", "pos-1 acc", "ddtree-4", "ddtree-8"], rows),
              "![per-position acceptance](eval/compare-stride/acceptance.png)", ""]
    brows = [[m.name, m.tau, m.tokens_per_s, m.speedup_vs_ar, m.speedup_vs_fastest_plain, m.speedup_vs_prompt_lookup,
              m.ceiling] for m in res.bench.methods.values()]
    lines += ["## Online speculative decoding (live target, temperature 0)", "",
              "ar on the other backend and llama.cpp (when installed: `make engines`) are plain decoders beside ours, the same "
              "weights, dtype and threads: a speedup holds against the fastest of them too.", "",
              markdown_table(["method", "tau", "tokens/s", "speedup vs AR", f"vs fastest plain ({res.bench.fastest_plain})",
                              "vs prompt-lookup", "ceiling"], brows),
              f"Lossless check: {'every output equals plain greedy decoding' if res.bench.lossless else 'FAILED or not run'}.",
              "", *([f"Ran on: {res.bench.ran_on()}.", ""] if res.bench.ran_on() else []),
              "![speedup](bench/speedup.png)", "", *cost_markdown(res.bench.cost, "bench/cost.png")]
    raw = _load(root / "bench" / "results.json")  # offline acceptance and the cost models, priced beside measured
    if raw.get("methods") and (table := predicted_markdown(raw)):
        lines += [*table, *(["", "![predicted vs measured](bench/predicted.png)"]
                            if (root / "bench" / "predicted.png").exists() else []), ""]
    lines += ["## Held-out suite (never trained on or selected with)", "",
              f"`{cfg.holdout_suite}`: complete a function from its signature and docstring (coding-10 asks for a "
              "function from a description).", "",
              markdown_table(["method", "tau", "tokens/s", "speedup vs AR", "vs prompt-lookup"],
                             [[m.name, m.tau, m.tokens_per_s, m.speedup_vs_ar, m.speedup_vs_prompt_lookup]
                              for m in res.holdout.methods.values()]),
              "![speedup](bench-holdout/speedup.png)", ""]
    checks, headline = quality_checks(res)
    lines += ["## Quality bar", "", markdown_table(["criterion", "measured", "status"], checks)]
    lines += ["## What limits it", "", *limits_lines(res), ""]
    t = res.training
    if t:
        lines += ["## Training", "", f"{t.steps} steps in {t.elapsed_s / 60:.1f} min, loss `{t.loss_name}`, draft "
                  f"vocabulary {t.draft_vocab_size or 'full'}; stopped: {t.stop_reason}.", "", *recipe_lines(checkout_results()),
                  "![loss](train/loss.png)", ""]
    rates = stage_rates(res, timings)
    lines += ["## Stage timings", "", "Seconds each stage took when it was built (a skipped stage reused that output), "
              "the estimate printed before it ran (from the probe of this machine at the start, plan.json), what "
              "it produced per second, and the dtype / kernels / device it was built with.", "",
              markdown_table(["stage", "seconds", "estimated s", "actual / estimate", "skipped", "throughput",
                              "built with"],
                             [[k, v.seconds, v.estimate_s, v.seconds / v.estimate_s if v.estimate_s else None, v.skipped,
                               rates.get(k, ""), built_with(v.settings)] for k, v in timings.items()])]
    write_text(root / "report.md", "\n".join(lines) + "\n")
    write_json(root / "report.json", {"checks": checks, "timings": {k: asdict(v) for k, v in timings.items()},
                                      "config": asdict(cfg)})
    return {"checks": checks, "console": [headline] + [f"  {c[0]}: {c[2]}" for c in checks]}


def data_limits(final_ckpt, data_dir: Path, cache) -> dict:
    """Facts about the data the drafter saw, against the eval cache: how many response tokens, and how much of
    the eval completions its draft vocabulary can express at all (a token outside it is never drafted)."""
    from dflashkit.cache import open_cache
    from dflashkit.drafter.checkpoint import load_drafter

    vocab = (load_drafter(final_ckpt).contract or {}).get("draft_vocab")
    train = open_cache(data_dir)
    train_tokens, seen = 0, set()
    for r in train:
        train_tokens += r.num_tokens - r.prompt_len
        seen.update(r.tokens[r.prompt_len:].tolist())
    eval_tokens = [t for r in cache for t in r.tokens[r.prompt_len + 1:].tolist()]  # labels: tokens after the anchor
    inside = set(vocab) if vocab else None
    return asdict(DataLimits(
        train_sequences=len(train), train_response_tokens=train_tokens, train_distinct_tokens=len(seen),
        draft_vocab=len(vocab) if vocab else None, eval_label_tokens=len(eval_tokens),
        eval_in_draft_vocab=(sum(t in inside for t in eval_tokens) / len(eval_tokens)) if inside and eval_tokens else 1.0,
        eval_seen_in_training=sum(t in seen for t in eval_tokens) / max(1, len(eval_tokens))))
