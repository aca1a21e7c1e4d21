"""Device check: the GPU paths of training, extraction, offline evaluation and decoding, at the paper's settings.

    python benchmarks/gpu_check.py            # one H200: < 8 minutes, no downloads
    python benchmarks/gpu_check.py --smoke    # the same code at tiny size on CPU (a few seconds; run by the tests)

Targets are random-initialised from dflashkit/configs/gpu/*.yaml (Qwen3-8B's shape with 8 layers; a Qwen3.5 hybrid with
8 layers), in bfloat16; random weights cost what trained ones do. Sections (each reports its own failure and the
rest still run; the exit status is 1 if any failed):
  train    drafter steps at the paper settings (5 layers, 512 anchors x block 16, one 3072-token sequence, bf16
           autocast, full-vocabulary CE, AdamW): s/step, blocks/s, MFU (matmul FLOPs estimate), peak memory, per
           attention path (flex vs dense on CUDA, chunked vs dense elsewhere), and their max output/grad difference
  extract  target forward with 5 feature layers under inference mode: tokens/s
  eval     offline evaluation's drafter work (stride blocks, forward_blocks + head, no grad): blocks/s
  decode   chain and DDTree-8 rounds with an oracle proposer (the random drafter runs for its cost, then the logits
           are replaced by ones that peak at the target's greedy continuation, so tau = B) against plain greedy
           decoding under the same kernels: round cost, and the tokens where the output differs from greedy
           (bf16 verification over a block may round differently from one-token steps: counted, not hidden)
  static   plain greedy decoding on the static decoder's compiled step (CUDA graphs on CUDA; eager in --smoke),
           against `ar` on the same target: tokens/s, compile seconds and the tokens where the two differ
           (attention targets only: the static step refuses hybrids by name, reported as skipped)
Writes benchmarks/results/gpu-DATE.md (--out to change).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAPER = dict(num_layers=5, anchors=512, block_size=16, seq_len=3072, steps=3, extract_batch=8, extract_len=2048,
             prompt_len=128, new_tokens=128, budget=8)
SMOKE = dict(num_layers=1, anchors=6, block_size=4, seq_len=48, steps=1, extract_batch=2, extract_len=32,
             prompt_len=12, new_tokens=10, budget=4)
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}  # dense, no sparsity


# ---- targets ------------------------------------------------------------------------------------------------

def build_target(config_file: Path, device, dtype, smoke: bool):
    """A Target around a random model of the config's shape (smoke: the tiny fixture of the same architecture)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny fixtures: test harness
    from tiny_targets import _tokenizer, tiny_config
    from dflashkit.targets.model import Target

    spec = yaml.safe_load(config_file.read_text())
    kind = spec["architecture"]
    if smoke:
        cfg = tiny_config(kind, num_layers=6)
    elif kind == "qwen3":
        from transformers import Qwen3Config
        cfg = Qwen3Config(**spec["config"])
    else:
        from transformers import Qwen3_5TextConfig
        cfg = Qwen3_5TextConfig(**spec["config"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return Target(model, _tokenizer(), config_file.parent, config_file.stem)


# ---- measurements -------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def peak_flops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def train_flops(cfg, T: int, n: int, B: int, vocab: int) -> float:
    """Matmul FLOPs of one drafter training step (forward + backward = 3x forward for trained weights; the frozen
    lm_head only back-propagates into its input: 2x). Attention counts the visible keys only."""
    H, d, h, kv, I, K = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.intermediate_size, cfg.num_features)
    rows = n * B
    per_layer = 2 * rows * (H * h * d * 2 + 3 * H * I) + 2 * (rows + T) * (2 * H * kv * d)  # q,o,mlp | k,v
    visible = rows * B + B * n * (T / 2)  # own block + on average half the context (uniform anchors)
    attn = 4 * visible * d * h
    fc = 2 * T * K * H * H
    return 3 * (cfg.num_hidden_layers * (per_layer + attn) + fc) + 2 * 2 * rows * H * vocab


def check_train(target, S, device, paths) -> list[dict]:
    """Drafter training steps per attention path on the same inputs; each path from the same initial weights."""
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.drafter.head import DraftHead
    from dflashkit.train.loss import block_loss, slot_weights

    B, T, n = S["block_size"], S["seq_len"], S["anchors"]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    drafter0 = new_drafter(target, num_layers=S["num_layers"], block_size=B)
    cfg = drafter0.config
    feats = torch.randn(1, T, cfg.num_features * target.hidden_size, generator=g).to(device, target.dtype)
    anchors = (1 + torch.randperm(T - 2, generator=g)[:n].sort().values)[None].to(device)
    tokens = torch.randint(0, target.vocab_size, (T + B,), generator=g).to(device)
    pos = anchors[0, :, None] + torch.arange(B, device=device)
    labels = tokens[pos][None].clone()
    labels[:, :, 0] = -100
    block_ids = torch.full((n, B), cfg.mask_token_id, device=device)
    block_ids[:, 0] = tokens[anchors[0]]
    with torch.no_grad():
        embeds = target.embed_tokens(block_ids.view(1, -1))
    head, slot_w = DraftHead(target.lm_head.weight), slot_weights(B, 7.0).to(device)
    flops, peak = train_flops(cfg, T, n, B, target.vocab_size), peak_flops(device)
    rows, outs = [], {}
    for kind in paths:
        drafter = new_drafter(target, num_layers=S["num_layers"], block_size=B).to(device, torch.float32).train()
        drafter.load_state_dict(drafter0.state_dict())
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
        reset_peak(device)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                hidden = drafter.forward_blocks(feats, embeds, anchors, attention=kind)
            loss, _ = block_loss(hidden, labels, slot_w, head, "ce", float(labels.numel()))
            loss.backward()
            return hidden.detach().float(), {k: p.grad.detach().float().clone() for k, p in drafter.named_parameters()}

        t0 = time.perf_counter()
        outs[kind] = step()  # warm-up (compiles flex) and the comparison point: same weights for every path
        sync(device)
        first = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        times = []
        for _ in range(S["steps"]):
            t0 = time.perf_counter()
            step()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            times.append(time.perf_counter() - t0)
        s = min(times)
        row = {"target": target.name, "attention": kind, "s_per_step": s, "first_step_s": first, "blocks_per_s": n / s,
               "tflops": flops / s / 1e12, "mfu": flops / s / peak if peak else None, "peak_gib": peak_gib(device)}
        rows.append(row)
    ref = outs.get("dense")
    for row in rows:
        if ref is not None and row["attention"] != "dense":
            row["max_out_diff"] = (outs[row["attention"]][0] - ref[0]).abs().max().item()
            row["max_grad_diff"] = max((outs[row["attention"]][1][k] - ref[1][k]).abs().max().item() for k in ref[1])
    return rows


def check_extract(target, S, device) -> dict:
    b, T = S["extract_batch"], S["extract_len"]
    ids = torch.randint(0, target.vocab_size, (b, T), device=device)
    layers = target.default_layer_ids(5 if target.num_layers >= 8 else 3)
    reset_peak(device)
    with torch.inference_mode():
        target.forward(ids, layer_ids=layers, use_cache=False, compute_logits=False)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = target.forward(ids, layer_ids=layers, use_cache=False, compute_logits=False)
        sync(device)
    s = time.perf_counter() - t0
    assert torch.isfinite(out.features).all(), "non-finite target features"
    return {"target": target.name, "batch": f"{b} x {T}", "layers": layers, "tokens_per_s": b * T / s,
            "peak_gib": peak_gib(device)}


def check_eval(target, S, device) -> dict:
    """Stride blocks over one sequence: forward_blocks (auto attention) + the head's argmax, no grad."""
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.drafter.head import DraftHead

    B, T = S["block_size"], S["seq_len"]
    drafter = new_drafter(target, num_layers=S["num_layers"], block_size=B).to(device, target.dtype).eval()
    head = DraftHead(target.lm_head.weight)
    anchors = torch.arange(1, T - B, B, device=device)[None]
    feats = torch.randn(1, T, drafter.config.num_features * target.hidden_size, device=device, dtype=target.dtype)
    ids = torch.full((anchors.shape[1], B), drafter.config.mask_token_id, device=device)
    times = []
    with torch.no_grad():
        emb = target.embed_tokens(ids.view(1, -1))
        for _ in range(2):  # the first call compiles
            t0 = time.perf_counter()
            h = drafter.forward_blocks(feats, emb, anchors)
            drafted = head.logits(h[0].view(-1, B, h.shape[-1])[:, 1:]).argmax(-1)
            sync(device)
            times.append(time.perf_counter() - t0)
    assert drafted.shape == (anchors.shape[1], B - 1)
    return {"target": target.name, "blocks": anchors.shape[1], "blocks_per_s": anchors.shape[1] / times[-1]}


class OracleProposer:
    """A Proposer whose drafts are the target's greedy continuation (tau = B); the real drafter still runs each round,
    so a round costs what it will with a trained drafter."""

    def __init__(self, inner, reference: list[int], vocab: int):
        self.inner, self.reference, self.vocab = inner, reference, vocab
        self.block_size, self.layer_ids = inner.block_size, inner.layer_ids

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def propose(self, features, anchor, start: int):
        real = self.inner.propose(features, anchor, start)  # [B-1, V'] paid for, then replaced
        logits = torch.zeros(self.block_size - 1, self.vocab, device=real.device)
        want = self.reference[start + 1:start + self.block_size]
        logits[torch.arange(len(want)), torch.tensor(want, dtype=torch.long)] = 20.0
        return logits

    def to_tokens(self, idx):
        return idx


def check_decode(target, S, device) -> list[dict]:
    from dflashkit.decode.hf import HfBackend
    from dflashkit.decode.speculative import DFlashProposer, generate_ar, generate_chain, generate_tree
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.tree import TreeDrafts

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, target.vocab_size, (S["prompt_len"],), generator=g).tolist()
    N = S["new_tokens"]
    drafter = new_drafter(target, num_layers=S["num_layers"], block_size=S["block_size"]).to(device, target.dtype).eval()
    generate_ar(HfBackend(target), prompt, 4)  # warm-up
    ar = generate_ar(HfBackend(target), prompt, N)
    oracle = OracleProposer(DFlashProposer(target, drafter), prompt + ar.tokens, target.vocab_size)
    rows = []
    for name, run in (("ar", lambda: ar),
                      ("chain", lambda: generate_chain(HfBackend(target), oracle, prompt, N)),
                      (f"ddtree-{S['budget']}", lambda: generate_tree(HfBackend(target), TreeDrafts(oracle, S["budget"]), prompt, N))):
        gen = run()
        rounds = max(1, gen.rounds)
        diff = [i for i, (a, b) in enumerate(zip(gen.tokens, ar.tokens)) if a != b]
        rows.append({"target": target.name, "method": name, "tokens": len(gen.tokens), "rounds": gen.rounds,
                     "tau": gen.tau, "ms_per_round": 1e3 * (gen.times["total"] - gen.times["prefill"]) / rounds,
                     "draft_ms": 1e3 * gen.times["draft"] / rounds, "verify_ms": 1e3 * gen.times["verify"] / rounds,
                     "tokens_per_s": len(gen.tokens) / max(1e-9, gen.times["total"]),
                     "mismatches": len(diff) + abs(len(gen.tokens) - len(ar.tokens)),
                     "first_mismatch": diff[0] if diff else None})
    return rows


def check_static(target, S, device, smoke: bool) -> dict:
    from dflashkit.decode.hf import HfBackend
    from dflashkit.decode.speculative import generate_ar
    from dflashkit.decode.static import StaticBackend, StaticDecoder, geometry_of
    from dflashkit.errors import DFlashError

    try:
        geometry_of(target)
    except DFlashError as e:
        return {"target": target.name, "method": "ar", "engine": "static", "skipped": str(e)[:120]}
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, target.vocab_size, (S["prompt_len"],), generator=g).tolist()
    N = S["new_tokens"]
    d = StaticDecoder(target, 512, compile=not smoke)
    d.warm(timed=1)
    generate_ar(StaticBackend(d), prompt, 4)
    gen, ar = generate_ar(StaticBackend(d), prompt, N), generate_ar(HfBackend(target), prompt, N)
    diff = [i for i, (a, b) in enumerate(zip(gen.tokens, ar.tokens)) if a != b]
    return {"target": target.name, "method": "ar", "engine": "static", "kernels": d.kernels, "compile_s": sum(d.compile_s.values()),
            "ms_per_token": 1e3 * d.step_s[1], "tokens_per_s": len(gen.tokens) / max(1e-9, gen.times["total"]),
            "ar_tokens_per_s": len(ar.tokens) / max(1e-9, ar.times["total"]),
            "mismatches_vs_ar": len(diff) + abs(len(gen.tokens) - len(ar.tokens)), "first_mismatch": diff[0] if diff else None}


# ---- the report ---------------------------------------------------------------------------------------------

def fmt(v):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def table(rows: list[dict]) -> str:
    if not rows:
        return "(none)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None, smoke: bool | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (what `make test` runs)")
    p.add_argument("--out", default=None, help="report file (default benchmarks/results/gpu-DATE.md)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--configs", nargs="*", default=None, help="target configs (default: dflashkit/configs/gpu/*.yaml)")
    args = p.parse_args(argv)
    smoke = args.smoke if smoke is None else smoke
    S = SMOKE if smoke else PAPER
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not smoke else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    paths = ["flex", "dense"] if device.type == "cuda" else ["chunked", "dense"]
    configs = [Path(c) for c in args.configs] if args.configs else sorted((ROOT / "dflashkit" / "configs" / "gpu").glob("*.yaml"))
    today = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"gpu-{today}{'-smoke' if smoke else ''}.md"
    t_start = time.perf_counter()
    results = {"train": [], "extract": [], "eval": [], "decode": [], "static": []}
    failures = []
    for cf in configs:
        try:
            target = build_target(cf, device, dtype, smoke)
        except Exception as e:  # a target that cannot be built fails its sections, not the others
            failures.append(f"{cf.stem}: build: {type(e).__name__}: {e}")
            continue
        print(f"{target.name}: {target.num_layers} layers, hidden {target.hidden_size}, vocabulary {target.vocab_size}, "
              f"{'hybrid' if target.is_hybrid else 'attention'}, {dtype} on {device}", flush=True)
        for section, fn in (("train", lambda target=target: check_train(target, S, device, paths)),
                            ("extract", lambda target=target: check_extract(target, S, device)),
                            ("eval", lambda target=target: check_eval(target, S, device)),
                            ("decode", lambda target=target: check_decode(target, S, device)),
                            ("static", lambda target=target: check_static(target, S, device, smoke))):
            t0 = time.perf_counter()
            try:
                res = fn()
            except Exception as e:
                failures.append(f"{target.name}: {section}: {type(e).__name__}: {e}")
                traceback.print_exc()
                if smoke:
                    raise
                continue
            results[section] += res if isinstance(res, list) else [res]
            print(f"  {section:8s} {time.perf_counter() - t0:6.1f}s", flush=True)
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    total = time.perf_counter() - t_start
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    s = S
    md = [f"# Device check {today}{' (smoke)' if smoke else ''}\n",
          f"{where}, torch {torch.__version__}, {total:.0f} s in all. Targets: random-initialised "
          f"{', '.join(c.stem for c in configs)} ({dtype}).\n",
          f"## Drafter training\n\n{s['num_layers']} layers, {s['anchors']} anchors x block {s['block_size']}, one "
          f"{s['seq_len']}-token sequence per step, bf16 autocast on CUDA, full-vocabulary CE, AdamW; best of "
          f"{s['steps']} steps after one warm-up (first_step_s: the warm-up, compile included). MFU: estimated "
          "matmul FLOPs (visible attention only) / the GPU's dense bf16 peak. max_*_diff: against the dense path, "
          "same weights and inputs.\n", table(results["train"]),
          f"\n## Feature extraction\n\nTarget forward, inference mode, {s['extract_batch']} x {s['extract_len']} "
          "tokens.\n", table(results["extract"]),
          "\n## Offline evaluation (drafter side)\n\nStride blocks over one sequence, forward_blocks + lm_head argmax.\n",
          table(results["eval"]),
          f"\n## Online decoding with an oracle proposer\n\nPrompt {s['prompt_len']} random tokens, {s['new_tokens']} "
          "new tokens, greedy. The oracle's drafts are plain greedy's own output (tau = B where verification agrees); "
          "ms_per_round excludes the prefill. mismatches: tokens that differ from plain greedy under the same "
          "kernels (bf16 rounding of a block forward vs one-token steps; 0 expected in float32).\n",
          table(results["decode"]),
          "\n## Plain decoding on the static decoder\n\nThe compiled one-token step (inductor; CUDA graphs on CUDA) on a "
          "512-slot static KV cache, against `ar` on the same target and prompt. mismatches_vs_ar: in bf16 the two "
          "use different kernels, so a near-tie may part them (counted, not hidden).\n",
          table(results["static"]),
          "\n## Failures\n\n" + ("\n".join(f"- {f}" for f in failures) if failures else "none") + "\n"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md))
    print(f"wrote {out} ({total:.0f} s); {len(failures)} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
