"""The training loop (docs/design.md, "The training loop in detail"): `train()`, then its helpers in call order."""

from __future__ import annotations

import contextlib
import csv
import math
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from dflashkit.cache import open_cache
from dflashkit.distributed import Dist, all_sum, barrier, init_distributed
from dflashkit.drafter.checkpoint import load_drafter, new_drafter, warm_start_from_target
from dflashkit.drafter.config import DFLASH2_KEYS
from dflashkit.drafter.head import DraftHead, scaling_of
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import DFlashError
from dflashkit.evaluate.offline import evaluate
from dflashkit.fileio import write_json, write_text
from dflashkit.report import line_plot, markdown_table
from dflashkit.rng import seeded
from dflashkit.targets.model import load_target, pick_dtype
from dflashkit.train.checkpoint import (check_resume_contract, latest_checkpoint, load_train_state, resume_contract,
                                       save_best, save_checkpoint)
from dflashkit.train.config import TrainConfig, default_gamma
from dflashkit.train.data import (add_noise, build_batch, data_kind, draft_vocabulary, epoch_order, mix_seed,
                                 open_source, sample_anchors, usable)
from dflashkit.train.loss import block_loss, predecessors, slot_weights, step_weight


def train(cfg: TrainConfig, target=None, source=None, on_step=None) -> dict:
    """Train a drafter as configured; returns a summary (also `out`/summary.json); on_step(step, row) after each step."""
    cfg.check()
    r = prepare(cfg, init_distributed(cfg.device), target, source)
    describe(r)
    metrics = MetricsLog(r.out, r.start) if r.d.master else None
    clock = Clock(r.elapsed_before)
    step, history, reason = r.start, [], ""
    with StopFlag() as stop:
        bar = progress_bar(r)
        while step < r.total:
            tick = time.perf_counter()
            epoch, micro = global_batch(r, step)
            counts = forward_backward(r, micro, epoch)
            lr, grad_norm = optimizer_step(r, step, clock)
            step += 1
            clock.last_step = time.perf_counter() - tick
            row = metrics_row(r, counts, step, epoch, lr, grad_norm, clock)
            history.append(row)
            if metrics:
                metrics.step(row)
            bar.set_postfix_str(f"step {step}/{r.total} {cfg.loss} {row['loss']:.3f} acc1 {row['pos1_acc']:.3f} "
                                f"{row['blocks_per_s']:.0f} blk/s", refresh=False)
            bar.update(min(round(row["elapsed_s"]), bar.total) - bar.n if cfg.max_minutes else 1)
            if on_step is not None:
                on_step(step, row)
            if reason := stop_reason(r, stop, clock):
                break
            if step % cfg.save_every == 0 and step < r.total:
                save(r, step, clock, finished=False, reason="periodic")
            if r.eval_cache is not None and cfg.eval_every and step % cfg.eval_every == 0 and step < r.total:
                evaluate_now(r, step, metrics)
        bar.close()
        finished = step >= r.total
        path = save(r, step, clock, finished=finished, reason="done" if finished else reason)
        final_eval = evaluate_now(r, step, metrics) if r.eval_cache is not None else None

    summary = {"finished": finished, "stop_reason": "done" if finished else reason, "steps": step,
               "total_steps": r.total, "checkpoint": str(path.resolve()) if path else None, "loss_name": cfg.loss,
               "gamma": r.gamma, "draft_vocab_size": None if r.vocab is None else len(r.vocab), "processes": r.d.world,
               "elapsed_s": clock.elapsed(), "eval": final_eval, "best": r.best,
               "losses": [row["loss"] for row in history], "history": history}
    if r.d.master:
        write_summary(r.out, summary, cfg)
        r.log(f"{'finished' if finished else 'stopped: ' + reason} at step {step}/{r.total}; checkpoint {path}")
    return summary


# ---- setup ---------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything the loop reads, built and checked by `prepare` before the first step."""
    cfg: TrainConfig
    d: Dist
    out: Path
    target: object
    source: object
    layer_ids: list[int]
    pool: list[int]  # indices of the sequences with something to anchor on
    gamma: float
    per_step: int  # sequences per optimiser step, over all micro-batches and processes
    steps_per_epoch: int
    total: int
    eval_cache: object | None
    vocab: list[int] | None
    drafter: nn.Module
    model: nn.Module  # the drafter as the training call sees it: BlockModel, under DDP/FSDP when distributed
    head: object
    slot_w: torch.Tensor
    opt: torch.optim.Optimizer
    contract: dict
    extra: dict  # what every saved drafter records about its training
    compute_dtype: torch.dtype
    start: int = 0
    elapsed_before: float = 0.0
    best: dict | None = None
    resumed_from: Path | None = None

    def log(self, line: str) -> None:
        if self.d.master:
            print(line)


def initial_drafter(cfg: TrainConfig, target, init, layer_ids, resuming: bool, master: bool):
    """The drafter's first weights: init=, a warm start from the target's top layers, or random."""
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.mask_token_id
    shape = {} if cfg.arch == "dflash" else {"arch": cfg.arch, **{k: getattr(cfg, k) for k in DFLASH2_KEYS}}
    with seeded(cfg.seed):
        drafter = init if init is not None else new_drafter(
            target, num_layers=cfg.num_layers, target_layer_ids=layer_ids, allow_final_layers=cfg.allow_final_layers,
            block_size=cfg.block_size, mask_token_id=mask_id, **shape)
    if drafter.config.mask_token_id != mask_id:
        raise DFlashError(f"init={cfg.init}: mask_token_id {drafter.config.mask_token_id} != {mask_id}; set mask_token_id")
    if cfg.warm_start and not resuming:
        if init is not None:
            raise DFlashError(f"warm_start and init={cfg.init} both set the drafter's first weights; keep one")
        lines = warm_start_from_target(drafter, target)
        if master:
            print("warm start: " + "; ".join(lines))
    return drafter


def prepare(cfg: TrainConfig, d: Dist, target, source) -> Run:
    """Load and check everything before the first step, so a wrong path or setting fails now, not an hour in."""
    if source is None:
        data_kind(cfg.data)  # a wrong path fails now, not after the target has loaded
    if target is None:
        target = load_target(cfg.target, device=str(d.device), dtype=cfg.dtype)  # frozen: bf16 whenever autocast is
    init = load_init(cfg, target)
    layer_ids = feature_layers(cfg, target, init)
    if source is None:
        source = open_source(cfg.data, target, cfg.num_sequences, cfg.max_seq_len)
    source.check(target, layer_ids, cfg.loss == "kl")
    pool = usable(source.seqs)
    if not pool:
        raise DFlashError(f"{source.description}: no sequence has a response of 2+ tokens to anchor on")
    per_step = cfg.batch_size * cfg.grad_accum * d.world
    steps_per_epoch = len(pool) // per_step
    if steps_per_epoch == 0:
        raise DFlashError(f"{source.description}: {len(pool)} usable sequences, fewer than one global batch of {per_step} "
                          f"(batch_size {cfg.batch_size} x grad_accum {cfg.grad_accum} x {d.world} processes); "
                          "lower batch_size or add data")
    total = cfg.steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    # opened (and checked) on every process: they all join the evaluation's gather
    eval_cache = open_cache(cfg.eval_cache, num_prompts=cfg.eval_prompts, expect_target=target.identity(),
                            layer_ids=layer_ids) if cfg.eval_cache else None

    ckpt = latest_checkpoint(cfg.out) if cfg.resume else None
    resume = load_train_state(ckpt) if ckpt else None
    vocab = resume["draft_vocab"] if resume else draft_vocabulary(cfg.draft_vocab, [source.seqs[i] for i in pool], target)
    gamma = float(cfg.gamma) if cfg.gamma is not None else default_gamma(cfg.block_size)
    drafter = initial_drafter(cfg, target, init, layer_ids, resuming=bool(resume), master=d.master)
    identity = target.identity()
    contract = resume_contract(drafter, cfg.loss, cfg.draft_vocab, gamma, identity)
    if resume:
        check_resume_contract(resume["contract"], contract, ckpt)
    drafter = drafter.to(d.device, torch.float32).train()
    model = wrap(drafter, cfg, d)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    r = Run(cfg=cfg, d=d, out=Path(cfg.out), target=target, source=source, layer_ids=layer_ids, pool=pool, gamma=gamma,
            per_step=per_step, steps_per_epoch=steps_per_epoch, total=total, eval_cache=eval_cache, vocab=vocab,
            drafter=drafter, model=model, head=DraftHead(target.lm_head.weight, vocab, scaling_of(drafter.config)),
            slot_w=slot_weights(cfg.block_size, gamma).to(d.device), opt=opt, contract=contract,
            extra=dict(target_identity=identity, loss=cfg.loss, gamma=gamma, draft_vocab=vocab, train_config=cfg.to_dict()),
            compute_dtype=pick_dtype(cfg.dtype, d.device))  # master weights and loss: float32
    if resume:
        restore(r, ckpt, resume)
    return r


def load_init(cfg: TrainConfig, target):
    """The drafter of init=..., or None; a config that disagrees with its shape is an error, not silently ignored."""
    if not cfg.init:
        return None
    init = load_drafter(cfg.init, target=target)
    ic = init.config
    theirs = {"target_layer_ids": ic.target_layer_ids, "block_size": ic.block_size, "num_layers": ic.num_hidden_layers,
              "arch": ic.arch}
    for key, value in theirs.items():
        if getattr(cfg, key) is not None and getattr(cfg, key) != value:
            raise DFlashError(f"init={cfg.init}: the drafter has {key}={value}, the config says {getattr(cfg, key)}; "
                              f"set {key}: {value}")
    return init


def feature_layers(cfg: TrainConfig, target, init) -> list[int]:
    """The target layers the drafter reads: init's, the config's, or z-lab's rule for num_target_layers."""
    ids = init.config.target_layer_ids if init is not None else cfg.target_layer_ids
    if ids is None:
        ids = target.default_layer_ids(cfg.num_target_layers or cfg.num_layers)
    try:
        return target.check_layer_ids(ids, allow_final=cfg.allow_final_layers)
    except DFlashError as e:  # name the setting: in a config file the override is `allow_final_layers: true`
        raise DFlashError(f"train config target_layer_ids: {e}") from e


def restore(r: Run, ckpt: Path, resume: dict) -> None:
    """Continue a run: weights, optimiser, RNG, step, training time and best-so-far from its latest checkpoint."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    weights = {f"drafter.{k}": v for k, v in load_file(ckpt / "model.safetensors").items()}
    set_state_dict(r.model, r.opt, model_state_dict=weights, optim_state_dict=resume["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(resume["rng"]["torch"])
    random.setstate(resume["rng"]["python"])
    r.start, r.elapsed_before, r.best, r.resumed_from = resume["step"], resume["elapsed_s"], resume.get("best"), ckpt


def describe(r: Run) -> None:
    """What is about to be trained, in six lines: the first thing to check when a run looks wrong."""
    cfg, t, seqs = r.cfg, r.target, r.source.seqs
    n_params = sum(p.numel() for p in r.drafter.parameters())
    vocab = "full " + str(t.vocab_size) if r.vocab is None else len(r.vocab)
    r.log(f"target   {t.name}: {t.num_layers} layers, hidden {t.hidden_size}; features from layers {r.layer_ids}")
    r.log(f"data     {r.source.description}: {len(r.pool)} sequences, "
          f"{sum(seqs[i].length - seqs[i].prompt_len for i in r.pool)} response tokens ({r.source.kind})")
    r.log(f"drafter  {r.drafter.config.num_hidden_layers} layers, {n_params / 1e6:.1f}M parameters, block "
          f"{cfg.block_size}, mask id {r.drafter.config.mask_token_id}; draft vocabulary {vocab} ({cfg.draft_vocab})")
    r.log(f"loss     {cfg.loss}, gamma {r.gamma:g}: sum_k w_k*l_k / sum_k w_k over the global batch's supervised slots")
    r.log(f"steps    {r.total} ({r.steps_per_epoch}/epoch), global batch {r.per_step} sequences x <= "
          f"{cfg.anchors_per_seq} anchors, {r.d.world} process(es) on {r.d.device} "
          f"({cfg.distributed if r.d.world > 1 else 'single'}), {str(r.compute_dtype).removeprefix('torch.')}, "
          f"attention {cfg.attention}")
    if r.resumed_from:
        r.log(f"resume   from {r.resumed_from} at step {r.start}")


class BlockModel(nn.Module):
    """The drafter with forward = forward_blocks, so DDP/FSDP hooks see the training call."""

    def __init__(self, drafter, attention: str = "auto"):
        super().__init__()
        self.drafter, self.attention = drafter, attention

    def forward(self, features, block_embeds, anchors, valid):
        return self.drafter.forward_blocks(features, block_embeds, anchors, valid, attention=self.attention)


def wrap(drafter, cfg: TrainConfig, d: Dist) -> nn.Module:
    model = BlockModel(drafter, cfg.attention)
    if d.world == 1:
        return model
    if cfg.distributed == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(d.device.type, (d.world,))
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)


# ---- one step --------------------------------------------------------------------------------------------------
def global_batch(r: Run, step: int) -> tuple[int, list[tuple[list[int], object]]]:
    """(epoch, this process's micro-batches), from (seed, epoch, sequence) alone so a resume or a split sees the same."""
    cfg = r.cfg
    epoch, pos = divmod(step, r.steps_per_epoch)
    order = epoch_order(len(r.pool), epoch, cfg.seed)
    mine = slice(r.d.rank * cfg.batch_size * cfg.grad_accum, (r.d.rank + 1) * cfg.batch_size * cfg.grad_accum)
    chosen = [r.pool[j] for j in order[pos * r.per_step:(pos + 1) * r.per_step]][mine]
    if r.source.kind == "online":  # bucket by length: the target pads each micro-batch to its longest sequence
        chosen.sort(key=lambda i: r.source.seqs[i].length)
    micro = []
    for m in range(cfg.grad_accum):
        idx = chosen[m * cfg.batch_size:(m + 1) * cfg.batch_size]
        seqs = [r.source.seqs[i] for i in idx]
        anchors = [sample_anchors(r.source.seqs[i], cfg.anchors_per_seq, epoch, cfg.seed, i) for i in idx]
        micro.append((idx, build_batch(seqs, anchors, cfg.block_size, r.drafter.config.mask_token_id).to(r.d.device)))
    return epoch, micro


# what a step counts over its micro-batches, then over processes: slots are the supervised ones, oov those whose label
# is outside the draft vocabulary, pos1 the slot-1 ones, correct: argmax == label; selector_*: DFlash2's selector
STEP_COUNTS = ("loss", "slots", "oov", "pos1", "pos1_correct", "correct", "blocks", "tokens", "selector_slots",
               "selector_correct")


def forward_backward(r: Run, micro: list, epoch: int) -> Counter:
    """Loss and gradients of one optimiser step, normalised by the slot weight of the whole global batch."""
    cfg, d = r.cfg, r.d
    norm = all_sum(torch.tensor([sum(step_weight(b.labels, r.head, r.slot_w, cfg.loss) for _, b in micro)],
                                dtype=torch.float64), d).item()
    norm = max(norm, 1e-12)  # a step without supervised slots contributes zero loss, not NaN
    counts = Counter()
    for m, (idx, batch) in enumerate(micro):
        feats, block_embeds, last_states = micro_inputs(r.source, idx, batch, r.target, r.layer_ids, cfg.loss == "kl",
                                                        cfg.noise_std, [mix_seed(cfg.seed, epoch, i, 3) for i in idx],
                                                        lambda ids: r.drafter.embed_block(r.target.embed, ids))
        with grad_sync(r, last=m == len(micro) - 1):
            # bf16 compute where pick_dtype chose it; master weights and the loss stay float32
            with torch.autocast(d.device.type, dtype=r.compute_dtype, enabled=r.compute_dtype != torch.float32):
                hidden = r.model(feats, block_embeds, batch.anchors, batch.valid)
            selector = getattr(r.drafter, "candidate_selector", None)  # DFlash2
            pred = predecessors(batch.block_ids, batch.labels) if selector is not None else None
            loss, st = block_loss(hidden, batch.labels, r.slot_w, r.head, cfg.loss, norm, last_states, batch.anchors,
                                  cfg.head_chunk, selector, pred, cfg.selector_loss_alpha)
            (loss * d.world).backward()  # DDP/FSDP average gradients; the loss is already globally normalised
        counts.update({**st, "loss": loss.item(), "blocks": int(batch.valid.sum()), "tokens": int(batch.lengths.sum())})
    return counts


def metrics_row(r: Run, counts: Counter, step: int, epoch: int, lr: float, grad_norm: float, clock: "Clock") -> dict:
    """The logged metrics of a step (the columns of metrics.csv): ratios of its counts summed over processes."""
    s = dict(zip(STEP_COUNTS, all_sum(torch.tensor([counts[k] for k in STEP_COUNTS], dtype=torch.float64), r.d).tolist()))
    return {"step": step, "epoch": epoch, "loss": s["loss"], "loss_name": r.cfg.loss,
            "pos1_acc": s["pos1_correct"] / max(1.0, s["pos1"]), "slot_acc": s["correct"] / max(1.0, s["slots"]),
            "lr": lr, "grad_norm": grad_norm, "blocks": int(s["blocks"]), "tokens": int(s["tokens"]),
            "oov_frac": s["oov"] / max(1.0, s["slots"]), "blocks_per_s": s["blocks"] / clock.last_step,
            "tokens_per_s": s["tokens"] / clock.last_step, "elapsed_s": clock.elapsed(),
            "peak_mem_gib": torch.cuda.max_memory_allocated(r.d.device) / 2**30 if r.d.device.type == "cuda" else None,
            "selector_acc": s["selector_correct"] / s["selector_slots"] if s["selector_slots"] else None}


def micro_inputs(source, idx: list[int], batch, target, layer_ids, need_last: bool, noise_std: float, noise_seeds,
                 embed=None):
    """(features [b, T, K*H], noised; block embeddings [b, n*B, H]; kl: the clean final-normed last layer [b, T, H])."""
    feats, last = source.batch(idx, target, layer_ids, need_last)
    feats = feats.to(target.device)
    with torch.no_grad():
        last_states = target.final_norm(last.to(target.device, target.dtype)) if need_last else None
        # the drafter's embed_block applies its input_embedding_scale, as the reference does
        block_embeds = (embed or target.embed)(batch.block_ids.reshape(len(idx), -1))
    if noise_std > 0:
        feats = add_noise(feats, noise_std, target.hidden_size, noise_seeds)
    return feats, block_embeds, last_states


def grad_sync(r: Run, last: bool):
    """Gradients are exchanged between processes only on a step's last micro-batch."""
    if r.d.world > 1 and r.cfg.distributed == "fsdp":
        r.model.set_requires_gradient_sync(last)
    if r.d.world > 1 and r.cfg.distributed == "ddp" and not last:
        return r.model.no_sync()
    return contextlib.nullcontext()


def optimizer_step(r: Run, step: int, clock: "Clock") -> tuple[float, float]:
    """Clip, set the scheduled learning rate, AdamW step; returns (lr, gradient norm before clipping)."""
    norm = torch.nn.utils.clip_grad_norm_(r.model.parameters(), r.cfg.grad_clip if r.cfg.grad_clip > 0 else float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    lr = learning_rate(r, step, clock)
    for group in r.opt.param_groups:
        group["lr"] = lr
    r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    return lr, norm


def learning_rate(r: Run, step: int, clock: "Clock") -> float:
    """Linear warmup over warmup_ratio, then cosine to min_lr_ratio, at progress [step, step + 1] / total; with
    schedule_minutes, whichever of steps and time runs out first (rank 0's clock, so every process agrees)."""
    cfg = r.cfg
    span = torch.tensor([step / r.total, (step + 1) / r.total], dtype=torch.float64)
    if cfg.schedule_minutes:
        now = clock.elapsed()
        by_time = torch.tensor([now, now + clock.last_step], dtype=torch.float64) / (60 * cfg.schedule_minutes)
        span = torch.maximum(span, by_time)
        span = all_sum(span if r.d.master else torch.zeros(2, dtype=torch.float64), r.d)
    (start, end), warmup, floor = span.tolist(), cfg.warmup_ratio, cfg.min_lr_ratio
    if warmup > 0 and end <= warmup:
        return cfg.lr * (end / warmup)
    t = min(1.0, max(0.0, (start - warmup) / max(1e-9, 1 - warmup)))
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


class Clock:
    """Training time, counted across resumes: what max_minutes, schedule_minutes and the logs read."""

    def __init__(self, before: float):
        self.before, self.t0, self.last_step = before, time.time(), 0.0  # last_step: seconds the previous step took

    def elapsed(self) -> float:
        return self.before + time.time() - self.t0


# ---- stopping, saving, evaluating ------------------------------------------------------------------------------
class StopFlag:
    """Ctrl-C / SIGTERM ask for a clean stop after the current step (a second Ctrl-C aborts at once)."""

    def __init__(self):
        self.reason, self._old = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = "interrupted (SIGINT)" if signum == signal.SIGINT else "terminated (SIGTERM)"

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def stop_reason(r: Run, stop: StopFlag, clock: Clock) -> str:
    """Why to stop after this step ('' to go on). Every process must agree, or the next collective would hang."""
    over_time = r.cfg.max_minutes is not None and clock.elapsed() > 60 * r.cfg.max_minutes
    flags = all_sum(torch.tensor([float(stop.reason is not None), float(over_time)], dtype=torch.float64), r.d)
    if flags[0] > 0:
        return stop.reason or "interrupted on another process"
    if flags[1] > 0:
        return f"max_minutes={r.cfg.max_minutes} reached"
    return ""


def save(r: Run, step: int, clock: Clock, finished: bool, reason: str) -> Path | None:
    """checkpoints/step-N with everything a resume needs; collective (every process joins the state gather)."""
    msd, osd = full_state(r.model, r.opt)
    path = None
    if r.d.master:
        resume = {"step": step, "epoch": step // r.steps_per_epoch, "position": step % r.steps_per_epoch,
                  "optimizer": osd, "contract": r.contract, "draft_vocab": r.vocab, "config": r.cfg.to_dict(),
                  "elapsed_s": clock.elapsed(), "best": r.best,
                  "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        path = save_checkpoint(r.out, plain_drafter(r.drafter.config, msd, r.vocab), resume, r.extra, r.cfg.keep_last,
                               finished, reason)
    barrier(r.d)
    return path


def evaluate_now(r: Run, step: int, metrics: "MetricsLog | None") -> dict | None:
    """Offline metrics on the eval cache; the best drafter by tau so far is kept in best/."""
    msd, _ = full_state(r.model)
    res = None
    if r.d.master:
        copy, cfg = plain_drafter(r.drafter.config, msd, r.vocab), r.cfg
        full = evaluate(copy.to(r.target.device), r.target, r.eval_cache, trees=tuple(cfg.eval_trees),
                        anchors=cfg.eval_anchors, max_blocks=cfg.eval_max_blocks, progress=False)
        res = {k: v for k, v in full["overall"].items() if isinstance(v, (int, float))}
        metrics.eval(step, res)
        r.log(f"eval     step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float)))
        if r.best is None or res["tau"] > r.best["tau"]:
            r.best = {"step": step, "tau": res["tau"]}
            save_best(r.out, copy.cpu(), res, step, r.extra)
    barrier(r.d)
    return res


def full_state(model, optimizer=None):
    """Full (unsharded, CPU) state dicts with plain parameter names; collective under DDP/FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=opts), None
    return get_state_dict(model, optimizer, options=opts)


def plain_drafter(drafter_cfg, weights: dict, vocab):
    """A standalone CPU copy of the drafter from a full state dict (for saving and evaluation)."""
    copy = DFlashDrafter(drafter_cfg)
    copy.load_state_dict({k.removeprefix("drafter."): v for k, v in weights.items()})
    copy.contract = {"draft_vocab": vocab}
    return copy.float().eval()


# ---- what the user sees --------------------------------------------------------------------------------------
def progress_bar(r: Run):
    """The tqdm bar (rank 0): steps, or seconds for a time-boxed run so that its ETA is the real one."""
    kw = dict(total=r.total, initial=r.start, unit="step")
    if r.cfg.max_minutes:
        kw = dict(total=round(60 * r.cfg.max_minutes), initial=round(r.elapsed_before), unit="s",
                  bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}{postfix}]")
    return tqdm(**kw, desc="train", disable=not (r.d.master and r.cfg.progress), dynamic_ncols=True)


class MetricsLog:
    """metrics.csv (one row per step) and eval.csv; on resume, rows after the checkpoint are dropped."""

    def __init__(self, run: Path, resume_step: int):
        self.path, self.eval_path = run / "metrics.csv", run / "eval.csv"
        run.mkdir(parents=True, exist_ok=True)
        for p in (self.path, self.eval_path):
            if p.is_file():
                with open(p, newline="") as f:
                    rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step] if resume_step > 0 else []
                p.unlink()
                if rows:
                    self._append(p, rows)
        self.tb = None
        with contextlib.suppress(Exception):  # TensorBoard only when its package is installed (not a dependency)
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run / "tensorboard"))

    @staticmethod
    def _append(path: Path, rows: list[dict]):
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), extrasaction="ignore")
            if f.tell() == 0:  # a new file
                w.writeheader()
            w.writerows(rows)

    def step(self, row: dict):
        self._append(self.path, [row])
        if self.tb:
            for k in ("loss", "pos1_acc", "slot_acc", "lr", "grad_norm", "tokens_per_s"):
                self.tb.add_scalar(f"train/{k}", row[k], row["step"])

    def eval(self, step: int, metrics: dict):
        self._append(self.eval_path, [{"step": step, **metrics}])
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(f"eval/{k}", v, step)


def write_summary(run: Path, summary: dict, cfg: TrainConfig) -> None:
    hist = summary["history"]
    write_json(run / "summary.json", {k: v for k, v in summary.items() if k != "history"} | {"config": cfg.to_dict()})
    tail = hist[-10:]
    mean = lambda k: sum(r[k] for r in tail) / len(tail) if tail else None  # noqa: E731
    rows = [["status", "finished" if summary["finished"] else f"STOPPED EARLY ({summary['stop_reason']})"],
            ["steps", f"{summary['steps']} / {summary['total_steps']}"],
            [f"loss ({cfg.loss}), mean of last {len(tail)} steps", mean("loss")],
            ["position-1 accuracy (train, last steps)", mean("pos1_acc")],
            ["target tokens/s (last steps)", mean("tokens_per_s")],
            ["blocks/s (last steps)", mean("blocks_per_s")],
            ["checkpoint", summary["checkpoint"]]] + [[f"eval {k}", v] for k, v in (summary.get("eval") or {}).items()]
    write_text(run / "summary.md", f"# Drafter training: {cfg.out}\n\n" + markdown_table(["", "value"], rows))
    if len(hist) > 1:
        steps = [r["step"] for r in hist]
        line_plot(run / "loss.png", {f"loss ({cfg.loss})": (steps, [r["loss"] for r in hist])},
                  "training loss (this run)", "step", "loss")
        line_plot(run / "pos1_acc.png", {"position-1 accuracy": (steps, [r["pos1_acc"] for r in hist])},
                  "training position-1 accuracy (this run)", "step", "accuracy")
