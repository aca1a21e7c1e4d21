"""The training loop, top to bottom (SPEC.md section 7).

    setup (processes, target, data, drafter, optimiser, resume)
    for each optimiser step:
        the step's sequences <- a per-epoch permutation; anchors <- re-sampled per (epoch, sequence)
        normaliser <- sum of slot weights over the whole global batch (all micro-batches, all processes)
        for each micro-batch: features (cache or target) -> optional noise on the drafter inputs only ->
            drafter.forward_blocks (strict mask) -> chunked lm_head loss -> backward
        clip, AdamW, cosine schedule; log; checkpoint / evaluate every N steps; stop on Ctrl-C, SIGTERM, max_minutes

Multi-process: launched by torchrun (WORLD_SIZE/RANK/LOCAL_RANK), DDP or FSDP2 (`fully_shard`), gloo on CPU and
nccl on CUDA. Every source of randomness is derived from (seed, epoch, sequence), so a global batch gives the same
loss whether it runs in one process or is split across several, and a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflashkit.errors import DFlashError
from dflashkit.train.checkpoint import (check_resume_contract, latest_checkpoint, load_train_state, resume_contract,
                                        save_best, save_checkpoint)
from dflashkit.train.config import TrainConfig, default_gamma
from dflashkit.train.data import (add_noise, build_batch, data_kind, draft_vocabulary, epoch_order, mix_seed,
                                  open_source, sample_anchors, usable)
from dflashkit.train.loss import block_loss, slot_weights, step_weight

METRIC_COLUMNS = ["step", "epoch", "loss", "loss_name", "pos1_acc", "slot_acc", "lr", "grad_norm", "blocks",
                  "tokens", "oov_frac", "blocks_per_s", "tokens_per_s", "elapsed_s", "peak_mem_gib"]


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: TrainConfig) -> Dist:
    """One process, or the torchrun group (gloo on CPU, nccl on CUDA)."""
    from dflashkit.target.model import pick_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(0, 1, pick_device(cfg.device))
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def all_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum a small CPU tensor over processes (through the device: nccl reduces CUDA tensors only)."""
    if d.world == 1:
        return x
    import torch.distributed as dist

    y = x.to(d.device)
    dist.all_reduce(y)
    return y.cpu()


def barrier(d: Dist) -> None:
    if d.world > 1:
        import torch.distributed as dist

        dist.barrier()


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
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)


def full_state(model, optimizer=None):
    """Full (unsharded, CPU) state dicts with plain parameter names; collective under DDP/FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=opts), None
    return get_state_dict(model, optimizer, options=opts)


def plain_drafter(drafter_cfg, model_state: dict, vocab):
    """A standalone CPU copy of the drafter from a full state dict (for saving and evaluation)."""
    from dflashkit.drafter.model import DFlashDrafter

    copy = DFlashDrafter(drafter_cfg)
    copy.load_state_dict({k.removeprefix("drafter."): v for k, v in model_state.items()})
    copy.contract = {"draft_vocab": vocab}
    return copy.float().eval()


def lr_at(start: float, end: float, warmup_ratio: float, min_ratio: float) -> float:
    """Learning-rate factor of a step covering schedule progress [start, end] (fractions in 0..1): linear warmup
    over the first warmup_ratio, then cosine down to min_ratio."""
    if warmup_ratio > 0 and end <= warmup_ratio:
        return end / warmup_ratio
    t = min(1.0, max(0.0, (start - warmup_ratio) / max(1e-9, 1 - warmup_ratio)))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class StopFlag:
    """Ctrl-C / SIGTERM ask for a clean stop after the current step (a second Ctrl-C aborts at once)."""

    def __init__(self):
        self.reason = None
        self._old = {}

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


def open_eval_cache(cfg: TrainConfig, target, layer_ids):
    """The eval cache, opened (and checked against the target and layer ids) before any training happens;
    None when no eval cache is set."""
    if not cfg.eval_cache:
        return None
    from dflashkit.cache import open_cache

    return open_cache(cfg.eval_cache, num_prompts=cfg.eval_prompts, expect_target=target.identity(), layer_ids=layer_ids)


def evaluate_offline(drafter, target, cache, cfg: TrainConfig) -> dict:
    """Overall scalar metrics of the offline evaluator (streak, tau, pos1_acc, one per DDTree family)."""
    from dflashkit.evaluate.offline import evaluate

    res = evaluate(drafter.to(target.device), target, cache, trees=tuple(cfg.eval_trees), anchors=cfg.eval_anchors,
                   max_blocks=cfg.eval_max_blocks, progress=False)
    return {k: v for k, v in res["overall"].items() if isinstance(v, (int, float))}


class MetricsLog:
    """metrics.csv (one row per step) and eval.csv; on resume, rows after the checkpoint are dropped."""

    def __init__(self, run: Path, resume_step: int):
        self.path, self.eval_path = run / "metrics.csv", run / "eval.csv"
        for p in (self.path, self.eval_path):
            rows = []
            if p.is_file() and resume_step > 0:
                with open(p, newline="") as f:
                    rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
            if p.is_file():
                p.unlink()
            if rows:
                self._append(p, rows)
        self.tb = None
        try:  # TensorBoard only when its package is installed (it is not a dependency)
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run / "tensorboard"))
        except Exception:
            pass

    @staticmethod
    def _append(path: Path, rows: list[dict]):
        new = not path.is_file()
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerows(rows)

    def step(self, row: dict):
        self._append(self.path, [{k: row.get(k) for k in METRIC_COLUMNS}])
        if self.tb:
            for k in ("loss", "pos1_acc", "slot_acc", "lr", "grad_norm", "tokens_per_s"):
                self.tb.add_scalar(f"train/{k}", row[k], row["step"])

    def eval(self, step: int, metrics: dict):
        self._append(self.eval_path, [{"step": step, **metrics}])
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(f"eval/{k}", v, step)


def micro_inputs(source, idx: list[int], batch, target, layer_ids, need_last: bool, noise_std: float, noise_seeds):
    """(features [b, T, K*H] for the drafter, possibly noised; block embeddings [b, n*B, H]; the target's clean
    final-normed last-layer states [b, T, H] for kl, else None). Noise is applied to a copy, after the target
    states are taken, so labels and target distributions never see it."""
    feats, last = source.batch(idx, target, layer_ids, need_last)
    feats = feats.to(target.device)
    with torch.no_grad():
        last_states = target.final_norm(last.to(target.device, target.dtype)) if need_last else None
        embeds = target.embed_tokens(batch.block_ids.reshape(len(idx), -1))
    if noise_std > 0:
        feats = add_noise(feats, noise_std, target.hidden_size, noise_seeds)
    return feats, embeds, last_states


def autocast_dtype(name: str, device: torch.device) -> torch.dtype:
    """The training compute dtype (master weights and the loss stay float32)."""
    from dflashkit.target.model import pick_dtype

    return pick_dtype(name, device)


def train(cfg: TrainConfig, target=None, source=None, on_step=None) -> dict:
    """Train a drafter as configured; returns a summary (also written to `out`/summary.json).

    target/source: pass already-loaded objects (tests, notebooks); on_step(step, row) is called after every step."""
    from dflashkit.drafter.checkpoint import load_drafter, new_drafter
    from dflashkit.drafter.head import DraftHead
    from dflashkit.target.model import load_target

    cfg.check()
    d = init_distributed(cfg)
    run = Path(cfg.out)
    log = print if d.master else (lambda *a, **k: None)

    # ---- the target and the data --------------------------------------------------------------------------
    if source is None:
        data_kind(cfg.data)  # a wrong path fails now, not after the target has loaded
    if target is None:
        target = load_target(cfg.target, device=str(d.device), dtype=cfg.dtype)  # frozen: bf16 whenever autocast is
    identity = target.identity()
    ids = cfg.target_layer_ids
    init = load_drafter(cfg.init, target=target) if cfg.init else None
    if init is not None:  # its shape wins; a config that says otherwise is an error, not silently ignored
        ic = init.config
        theirs = {"target_layer_ids": ic.target_layer_ids, "block_size": ic.block_size, "num_layers": ic.num_hidden_layers}
        for key, value in theirs.items():
            if getattr(cfg, key) is not None and getattr(cfg, key) != value:
                raise DFlashError(f"init={cfg.init}: the drafter has {key}={value}, the config says {getattr(cfg, key)}; "
                                  f"set {key}: {value}")
        ids = ic.target_layer_ids
    try:
        layer_ids = target.check_layer_ids(ids if ids is not None else target.default_layer_ids(cfg.num_layers),
                                           allow_final=cfg.allow_final_layers)
    except DFlashError as e:  # name the setting: in a config file the override is `allow_final_layers: true`
        raise DFlashError(f"train config target_layer_ids: {e}") from e
    if source is None:
        source = open_source(cfg.data, target, cfg.num_sequences, cfg.max_seq_len)
    need_last = cfg.loss == "kl"
    source.check(target, layer_ids, need_last)
    seqs = source.seqs
    pool = usable(seqs)
    if not pool:
        raise DFlashError(f"{source.description}: no sequence has a response of 2+ tokens to anchor on")
    B = cfg.block_size
    gamma = float(cfg.gamma) if cfg.gamma is not None else default_gamma(B)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.mask_token_id
    G = cfg.batch_size * cfg.grad_accum * d.world  # sequences per optimiser step
    steps_per_epoch = len(pool) // G
    if steps_per_epoch == 0:
        raise DFlashError(f"{source.description}: {len(pool)} usable sequences, fewer than one global batch of {G} "
                          f"(batch_size {cfg.batch_size} x grad_accum {cfg.grad_accum} x {d.world} processes); "
                          "lower batch_size or add data")
    total = cfg.steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    eval_cache = open_eval_cache(cfg, target, layer_ids)  # every process: they all join the evaluation's gather

    # ---- resume? ---------------------------------------------------------------------------------------------
    ckpt = latest_checkpoint(run) if cfg.resume else None
    state = load_train_state(ckpt) if ckpt else None
    vocab = state["draft_vocab"] if state else draft_vocabulary(cfg.draft_vocab, [seqs[i] for i in pool], target)

    # ---- the drafter, its head, the optimiser ----------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    drafter = init if init is not None else new_drafter(
        target, num_layers=cfg.num_layers, target_layer_ids=layer_ids, allow_final_layers=cfg.allow_final_layers,
        block_size=B, mask_token_id=mask_id)
    if drafter.config.mask_token_id != mask_id:
        raise DFlashError(f"init={cfg.init}: mask_token_id {drafter.config.mask_token_id} != {mask_id}; set mask_token_id")
    contract = resume_contract(drafter, cfg, gamma, identity)
    if state:
        check_resume_contract(state["contract"], contract, ckpt)
    drafter = drafter.to(d.device, torch.float32).train()
    head = DraftHead(target.lm_head.weight, vocab)
    slot_w = slot_weights(B, gamma).to(d.device)
    model = wrap(drafter, cfg, d)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    start, elapsed_before, best = 0, 0.0, None
    if state:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        weights = {f"drafter.{k}": v for k, v in load_file(ckpt / "model.safetensors").items()}
        set_state_dict(model, opt, model_state_dict=weights, optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        start, elapsed_before, best = state["step"], state["elapsed_s"], state.get("best")
    dtype = autocast_dtype(cfg.dtype, d.device)
    def autocast():  # bf16 where autocast_dtype chose it: master weights and the loss stay float32
        return torch.autocast(d.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    extra = dict(target_identity=identity, loss=cfg.loss, gamma=gamma, draft_vocab=vocab, train_config=cfg.to_dict())

    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"target   {target.name}: {target.num_layers} layers, hidden {target.hidden_size}; features from layers {layer_ids}")
    log(f"data     {source.description}: {len(pool)} sequences, "
        f"{sum(seqs[i].length - seqs[i].prompt_len for i in pool)} response tokens ({source.kind})")
    log(f"drafter  {drafter.config.num_hidden_layers} layers, {n_params / 1e6:.1f}M parameters, block {B}, mask id {mask_id}; "
        f"draft vocabulary {'full ' + str(target.vocab_size) if vocab is None else len(vocab)} ({cfg.draft_vocab})")
    log(f"loss     {cfg.loss}, gamma {gamma:g}: sum_k w_k*l_k / sum_k w_k over the global batch's supervised slots")
    log(f"steps    {total} ({steps_per_epoch}/epoch), global batch {G} sequences x <= {cfg.anchors_per_seq} anchors, "
        f"{d.world} process(es) on {d.device} ({cfg.distributed if d.world > 1 else 'single'}), "
        f"{str(dtype).removeprefix('torch.')}, attention {cfg.attention}")
    if state:
        log(f"resume   from {ckpt} at step {start}")

    def checkpoint(step: int, finished: bool, reason: str) -> Path | None:
        msd, osd = full_state(model, opt)
        path = None
        if d.master:
            train_state = {"step": step, "epoch": step // steps_per_epoch, "position": step % steps_per_epoch,
                           "optimizer": osd, "contract": contract,
                           "draft_vocab": vocab, "config": cfg.to_dict(), "elapsed_s": elapsed_before + (time.time() - t0),
                           "best": best, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
            path = save_checkpoint(run, plain_drafter(drafter.config, msd, vocab), train_state, extra, cfg.keep_last,
                                   finished, reason)
        barrier(d)
        return path

    def evaluate_now(step: int) -> dict | None:
        nonlocal best
        msd, _ = full_state(model)
        res = None
        if d.master:
            copy = plain_drafter(drafter.config, msd, vocab)
            res = evaluate_offline(copy, target, eval_cache, cfg)
            metrics.eval(step, res)
            log(f"eval     step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float)))
            if best is None or res["tau"] > best["tau"]:
                best = {"step": step, "tau": res["tau"]}
                save_best(run, copy.cpu(), res, step, extra)
        barrier(d)
        return res

    # ---- the loop --------------------------------------------------------------------------------------------
    metrics = MetricsLog(run, start) if d.master else None
    if d.master:
        run.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    timed = bool(cfg.max_minutes)  # a time-boxed run: the bar counts seconds, so its ETA is the real one
    bar = tqdm(total=round(60 * cfg.max_minutes) if timed else total, initial=round(elapsed_before) if timed else start,
               desc="train", unit="s" if timed else "step", disable=not (d.master and cfg.progress), dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}{postfix}]" if timed else None)
    t0 = time.time()
    step, history, reason, order_cache, last_dt = start, [], "", {}, 0.0
    mine = slice(d.rank * cfg.batch_size * cfg.grad_accum, (d.rank + 1) * cfg.batch_size * cfg.grad_accum)
    with StopFlag() as stop:
        while step < total:
            tick = time.perf_counter()
            epoch, pos = divmod(step, steps_per_epoch)
            if epoch not in order_cache:
                order_cache = {epoch: epoch_order(len(pool), epoch, cfg.seed)}
            chosen = [pool[j] for j in order_cache[epoch][pos * G:(pos + 1) * G]][mine]
            if source.kind == "online":  # bucket by length: the target pads each micro-batch to its longest sequence
                chosen.sort(key=lambda i: seqs[i].length)
            micro = [chosen[m * cfg.batch_size:(m + 1) * cfg.batch_size] for m in range(cfg.grad_accum)]
            batches = [build_batch([seqs[i] for i in mb],
                                   [sample_anchors(seqs[i], cfg.anchors_per_seq, epoch, cfg.seed, i) for i in mb],
                                   B, mask_id).to(d.device) for mb in micro]
            norm = all_sum(torch.tensor([sum(step_weight(b.labels, head, slot_w, cfg.loss) for b in batches)],
                                        dtype=torch.float64), d).item()
            norm = max(norm, 1e-12)  # a step without supervised slots contributes zero loss, not NaN
            sums = torch.zeros(9, dtype=torch.float64)  # loss, weight, slots, oov, pos1, pos1_ok, ok, blocks, tokens
            for m, (mb, batch) in enumerate(zip(micro, batches)):
                last_micro = m == cfg.grad_accum - 1
                if d.world > 1 and cfg.distributed == "fsdp":
                    model.set_requires_gradient_sync(last_micro)
                ddp_accumulating = d.world > 1 and cfg.distributed == "ddp" and not last_micro
                sync = model.no_sync() if ddp_accumulating else contextlib.nullcontext()
                feats, embeds, last_states = micro_inputs(source, mb, batch, target, layer_ids, need_last,
                                                          cfg.noise_std, [mix_seed(cfg.seed, epoch, i, 3) for i in mb])
                with sync:
                    with autocast():
                        hidden = model(feats, embeds, batch.anchors, batch.valid)
                    loss, st = block_loss(hidden, batch.labels, slot_w, head, cfg.loss, norm, last_states,
                                          batch.anchors, cfg.head_chunk)
                    (loss * d.world).backward()  # DDP/FSDP average gradients; the loss is already globally normalised
                sums += torch.tensor([loss.item(), st["weight"], st["slots"], st["oov"], st["pos1"], st["pos1_correct"],
                                      st["correct"], int(batch.valid.sum()), int(batch.lengths.sum())], dtype=torch.float64)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
            # the schedule: progress in steps, or (schedule_minutes) whichever of steps and time runs out first
            span = torch.tensor([step / total, (step + 1) / total], dtype=torch.float64)
            if cfg.schedule_minutes:  # rank 0's clock, shared so that every process uses the same rate
                now = elapsed_before + time.time() - t0
                clock = torch.tensor([now, now + last_dt], dtype=torch.float64) / (60 * cfg.schedule_minutes)
                span = torch.maximum(span, clock)
                span = all_sum(span if d.master else torch.zeros(2, dtype=torch.float64), d)
            lr = cfg.lr * lr_at(float(span[0]), float(span[1]), cfg.warmup_ratio, cfg.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            sums = all_sum(sums, d)
            dt = last_dt = time.perf_counter() - tick
            row = {"step": step, "epoch": epoch, "loss": sums[0].item(), "loss_name": cfg.loss,
                   "pos1_acc": sums[5].item() / max(1.0, sums[4].item()),
                   "slot_acc": sums[6].item() / max(1.0, sums[2].item()),
                   "lr": lr, "grad_norm": gnorm, "blocks": int(sums[7]), "tokens": int(sums[8]),
                   "oov_frac": sums[3].item() / max(1.0, sums[2].item()), "blocks_per_s": sums[7].item() / dt,
                   "tokens_per_s": sums[8].item() / dt, "elapsed_s": elapsed_before + time.time() - t0,
                   "peak_mem_gib": torch.cuda.max_memory_allocated(d.device) / 2**30 if d.device.type == "cuda" else None}
            history.append(row)
            if d.master:
                metrics.step(row)
                bar.set_postfix_str(f"step {step}/{total} {cfg.loss} {row['loss']:.3f} acc1 {row['pos1_acc']:.3f} "
                                    f"{row['blocks_per_s']:.0f} blk/s", refresh=False)
                bar.update(min(round(row["elapsed_s"]), bar.total) - bar.n if timed else 1)
            if on_step is not None:
                on_step(step, row)
            # a stop request must be agreed by every process, or the next collective would hang
            over_time = cfg.max_minutes is not None and elapsed_before + time.time() - t0 > 60 * cfg.max_minutes
            flags = all_sum(torch.tensor([float(stop.reason is not None), float(over_time)], dtype=torch.float64), d)
            if flags[0] > 0:
                reason = stop.reason or "interrupted on another process"
            elif flags[1] > 0:
                reason = f"max_minutes={cfg.max_minutes} reached"
            if step % cfg.save_every == 0 and step < total and not reason:
                checkpoint(step, False, "periodic")
            if eval_cache is not None and cfg.eval_every and step % cfg.eval_every == 0 and step < total and not reason:
                evaluate_now(step)
            if reason:
                break
        bar.close()
        finished = step >= total
        path = checkpoint(step, finished, "done" if finished else reason)
        final_eval = evaluate_now(step) if eval_cache is not None else None

    summary = {"finished": finished, "stop_reason": "done" if finished else reason, "steps": step, "total_steps": total,
               "checkpoint": str(path) if path else None, "loss_name": cfg.loss, "gamma": gamma,
               "draft_vocab_size": None if vocab is None else len(vocab), "processes": d.world,
               "elapsed_s": elapsed_before + time.time() - t0, "eval": final_eval, "best": best,
               "losses": [r["loss"] for r in history], "history": history}
    if d.master:
        write_summary(run, summary, cfg)
        log(f"{'finished' if finished else 'stopped: ' + reason} at step {step}/{total}; checkpoint {path}")
    return summary


def write_summary(run: Path, summary: dict, cfg: TrainConfig) -> None:
    from dflashkit.fileio import write_json, write_text
    from dflashkit.report import line_plot, markdown_table

    hist = summary["history"]
    slim = {k: v for k, v in summary.items() if k != "history"}
    write_json(run / "summary.json", {**slim, "config": cfg.to_dict()})
    tail = hist[-10:]
    mean = lambda k: sum(r[k] for r in tail) / len(tail) if tail else None  # noqa: E731
    rows = [["status", "finished" if summary["finished"] else f"STOPPED EARLY ({summary['stop_reason']})"],
            ["steps", f"{summary['steps']} / {summary['total_steps']}"],
            [f"loss ({cfg.loss}), mean of last {len(tail)} steps", mean("loss")],
            ["position-1 accuracy (train, last steps)", mean("pos1_acc")],
            ["target tokens/s (last steps)", mean("tokens_per_s")],
            ["blocks/s (last steps)", mean("blocks_per_s")],
            ["checkpoint", summary["checkpoint"]]]
    for k, v in (summary.get("eval") or {}).items():
        rows.append([f"eval {k}", v])
    write_text(run / "summary.md", f"# Drafter training: {cfg.out}\n\n" + markdown_table(["", "value"], rows))
    if len(hist) > 1:
        steps = [r["step"] for r in hist]
        line_plot(run / "loss.png", {f"loss ({cfg.loss})": (steps, [r["loss"] for r in hist])},
                  "training loss (this run)", "step", "loss")
        line_plot(run / "pos1_acc.png", {"position-1 accuracy": (steps, [r["pos1_acc"] for r in hist])},
                  "training position-1 accuracy (this run)", "step", "accuracy")
