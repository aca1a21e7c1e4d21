"""Drafter training: the recipe against straightforward references, the guards (final layers, noise, leaking
masks, loss names), exact resume, checkpoints, data generation and export (torchrun: test_torchrun.py)."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

import dflashkit.drafter.model as drafter_model
from dflashkit.cli import main
from dflashkit.drafter.checkpoint import load_drafter, new_drafter
from dflashkit.drafter.head import DraftHead
from dflashkit.errors import DFlashError
from dflashkit.train.config import TrainConfig, default_gamma, load_config
from dflashkit.cache.sequences import read_sequences
from dflashkit.train.data import MemorySource, OnlineSource, Sequence, build_batch, sample_anchors
from dflashkit.train.loop import micro_inputs, train
from dflashkit.train.loss import ChunkedHeadLoss, block_loss, slot_weights, step_weight
from helpers import stock_bf16

LAYERS = [1, 2, 3]
SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "import os\nprint(os.getcwd())\n",
    "x = [c.upper() for c in 'hello']\n",
    "def is_even(n):\n    return n % 2 == 0\n",
    "while True:\n    break\n",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tiny_targets):
    return tiny_targets["llama"]


def make_seq(target, i: int, text: str) -> Sequence:
    """A chat prompt + a code snippet as the response (diverse tokens, unlike a tiny random target's output)."""
    prompt = target.chat_ids([{"role": "user", "content": f"task {i}: write some python"}])
    resp = target.tokenizer(text)["input_ids"] + target.stop_token_ids[:1]
    return Sequence(f"s{i}", torch.tensor(prompt + resp), len(prompt))


@pytest.fixture(scope="module")
def data(llama):
    """8 sequences with their features (LAYERS) and last-layer states, as MemorySource inputs."""
    seqs = [make_seq(llama, i, s) for i, s in enumerate(SNIPPETS)]
    feats, last = [], []
    for s in seqs:
        out = llama.forward(s.tokens[None], layer_ids=LAYERS + [llama.num_layers - 1], use_cache=False)
        feats.append(out.features[0, :, : 3 * llama.hidden_size])
        last.append(out.features[0, :, 3 * llama.hidden_size:])
    return seqs, feats, last


def source(data, **kw):
    seqs, feats, last = data
    return MemorySource(seqs, feats, LAYERS, last=last, **kw)


def cfg_for(tmp_path, name="run", **kw) -> TrainConfig:
    base = dict(out=str(tmp_path / name), num_layers=1, target_layer_ids=LAYERS, block_size=8, batch_size=2,
                anchors_per_seq=8, steps=6, lr=3e-3, progress=False, save_every=1000, dtype="float32")
    base.update(kw)
    return load_config(None, base)


def read_csv_column(path: Path, col: str) -> list[str]:
    import csv

    with open(path, newline="") as f:
        return [r[col] for r in csv.DictReader(f)]


# ---- configuration ----------------------------------------------------------------------------------------

def test_config_file_overrides_and_errors(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1.0e-3\nblock_size: 8\ntarget_layer_ids: [1, 2]\ndraft_vocab: 300\n")
    cfg = load_config(f, ["lr=2e-3", "loss=kl", "steps=5"])
    got = (cfg.lr, cfg.block_size, cfg.target_layer_ids, cfg.loss, cfg.steps, cfg.draft_vocab)
    assert got == (2e-3, 8, [1, 2], "kl", 5, 300)
    assert cfg.epochs == 6 and cfg.warmup_ratio == 0.04 and cfg.grad_clip == 1.0  # untouched defaults
    with pytest.raises(DFlashError, match=r"unknown setting 'lerning_rate'"):
        load_config(None, ["lerning_rate=1"])
    with pytest.raises(DFlashError, match=r"c2.yaml: unknown setting 'blok_size' \(did you mean block_size"):
        (tmp_path / "c2.yaml").write_text("blok_size: 8\n")
        load_config(tmp_path / "c2.yaml")
    with pytest.raises(DFlashError, match=r"lr='fast' has the wrong type"):
        load_config(None, ["lr=fast"])
    with pytest.raises(DFlashError, match=r"loss='mse' is not one of: ce, kl"):
        load_config(None, ["loss=mse"])
    with pytest.raises(DFlashError, match=r"write overrides as key=value"):
        load_config(None, ["lr"])
    assert main(["train", "--config", str(f), "--print-config", "seed=7"]) == 0
    printed = capsys.readouterr().out
    shown = yaml.safe_load(printed)  # the printout is valid YAML that round-trips
    assert set(shown) == set(TrainConfig().to_dict()) and shown["seed"] == 7 and shown["lr"] == 1e-3
    assert main(["train", "nope=1"]) == 2 and "unknown setting 'nope'" in capsys.readouterr().err


def test_slot_weights_and_gamma_defaults():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    w = slot_weights(8, 4.0)
    assert w[0] == 0 and w[1] == 1 and torch.allclose(w[7], torch.tensor(torch.e ** (-6 / 4)))


# ---- the loss ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [(1.0, None), (0.5, 3.0)], ids=["plain", "multiplier+softcap"])
@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_chunked_head_loss_matches_full_logits(kind, scaling):
    torch.manual_seed(0)
    N, H, V = 37, 16, 50
    W = torch.randn(V, H)
    vocab = torch.tensor(sorted(torch.randperm(V)[:30].tolist()))
    head = DraftHead(W, vocab, scaling)
    h = torch.randn(N, H, requires_grad=True)
    tokens = torch.randint(0, V, (N,))
    tokens[3] = -100
    idx = head.to_index(tokens)
    assert (idx < 0).sum() > 1  # some labels fall outside the draft vocabulary
    w = torch.rand(N)
    tgt = torch.randn(N, H)
    loss, correct, _ = ChunkedHeadLoss.apply(h, head.weight, idx, w, tgt if kind == "kl" else None, 8, kind, scaling)
    loss.backward()
    # reference: all logits at once, autograd; the drafter's logits are x * m, then c * tanh(x / c)
    h2 = h.detach().clone().requires_grad_(True)
    m, c = scaling
    x = (h2 @ head.weight.T) * m
    logq = (c * torch.tanh(x / c) if c else x).log_softmax(-1)
    if kind == "ce":
        per = F.nll_loss(logq, idx, ignore_index=-100, reduction="none")
    else:
        logp = (tgt @ head.weight.T).log_softmax(-1)
        per = (logp.exp() * (logp - logq)).sum(-1)
    ref = (w * per).sum()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(h.grad, h2.grad, atol=1e-6)
    assert torch.equal(correct, logq.argmax(-1) == idx)


def test_selector_loss_matches_a_straightforward_reference():
    """DFlash2's candidate loss: top-k of the drafter's logits, the true token injected at rank k when missing,
    scores as the selector computes them with the true previous token, gamma-weighted CE; loss and gradients
    (drafter states, codebooks, projection) equal a plain autograd computation written here."""
    from dflashkit.drafter.config import DrafterConfig
    from dflashkit.drafter.model import CandidateSelector
    from dflashkit.train.loss import block_loss, predecessors

    torch.manual_seed(0)
    b, n, B, H, V, k = 2, 3, 5, 16, 40, 4
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=32,
                        num_hidden_layers=1, target_layer_ids=[1], num_target_layers=4, mask_token_id=39,
                        vocab_size=V, block_size=B, arch="dflash2", conv_group_size=8, selector_rank=6, selector_top_k=k)
    sel = CandidateSelector(cfg)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 1.0)
    head = DraftHead(torch.randn(V, H), None, (0.7, 5.0))
    labels = torch.randint(0, V, (b, n, B))
    labels[..., 0] = -100
    labels[1, 2, 3:] = -100  # past the sequence end
    block_ids = torch.full((b, n, B), 39)
    block_ids[..., 0] = torch.randint(0, V, (b, n))
    hidden = torch.randn(b, n * B, H, requires_grad=True)
    w = slot_weights(B, 2.0)
    norm = float((w[None, None] * (labels >= 0)).sum())
    base, _ = block_loss(hidden, labels, w, head, "ce", norm)
    loss, st = block_loss(hidden, labels, w, head, "ce", norm, selector=sel, pred=predecessors(block_ids, labels),
                          alpha=0.5)
    loss.backward()
    grads = [hidden.grad.clone()] + [p.grad.clone() for p in sel.parameters()]
    # reference
    for p in sel.parameters():
        p.grad = None
    h = hidden.detach().clone().requires_grad_(True)
    logits = 5.0 * torch.tanh(0.7 * (h @ head.weight.T) / 5.0)  # [b, n*B, V]
    total, ce_total, hits, rows = 0.0, 0.0, 0, 0
    for bi in range(b):
        for j in range(n):
            for slot in range(1, B):
                label = int(labels[bi, j, slot])
                if label < 0:
                    continue
                row = logits[bi, j * B + slot]
                prev = int(block_ids[bi, j, 0]) if slot == 1 else int(labels[bi, j, slot - 1])
                cands = row.detach().topk(k).indices.tolist()
                if label not in cands:
                    cands[-1] = label
                ctx = sel.predecessor_codebook[prev] * sel.hidden_projection(h[bi, j * B + slot])
                scores = torch.stack([row[c] + ctx @ sel.successor_codebook[c] for c in cands])
                total = total + w[slot] * F.cross_entropy(scores[None], torch.tensor([cands.index(label)]))
                ce_total = ce_total + w[slot] * -row.log_softmax(-1)[label]
                hits += int(scores.argmax()) == cands.index(label)
                rows += 1
    ref = (ce_total + 0.5 * total) / norm
    ref.backward()
    torch.testing.assert_close(base, ce_total / norm)
    torch.testing.assert_close(loss, ref)
    for got, want in zip(grads, [h.grad] + [p.grad for p in sel.parameters()]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert (st["selector_slots"], st["selector_correct"]) == (rows, hits) and 0 < hits < rows


def test_anchors_are_response_positions_resampled_each_epoch(llama):
    s = make_seq(llama, 0, SNIPPETS[2])
    a0 = sample_anchors(s, 8, epoch=0, seed=0, index=3)
    assert len(a0) == 8 and a0.min() >= s.prompt_len and a0.max() <= s.length - 2 and torch.equal(a0, a0.sort().values)
    assert torch.equal(a0, sample_anchors(s, 8, epoch=0, seed=0, index=3))  # deterministic
    assert not torch.equal(a0, sample_anchors(s, 8, epoch=1, seed=0, index=3))  # re-sampled every epoch
    every = sample_anchors(s, 10_000, epoch=0, seed=0, index=3)
    assert every.tolist() == list(range(s.prompt_len, s.length - 1))  # all of them when fewer than asked


def test_batch_labels_and_loss_equal_a_per_block_reference(llama, data):
    """block_loss(forward_blocks) == the straightforward recipe: each block alone through the drafter's
    single-block call (context < anchor), labels read off the tokens, gamma-weighted CE normalised by weights."""
    seqs, feats, _ = data
    B, gamma, mask = 8, 4.0, llama.mask_token_id
    torch.manual_seed(0)
    drafter = new_drafter(llama, num_layers=1, target_layer_ids=LAYERS, block_size=B)
    picked = [seqs[0], seqs[5]]
    anchors = [torch.tensor([picked[0].prompt_len, picked[0].length - 3]), torch.tensor([picked[1].length - 2])]
    batch = build_batch(picked, anchors, B, mask)
    # labels by hand: slot 0 none; past the end none; the padding block of sequence 2 none
    s0 = picked[0]
    a = int(anchors[0][1])
    assert batch.labels[0, 1].tolist() == [-100, int(s0.tokens[a + 1]), int(s0.tokens[a + 2])] + [-100] * 5
    assert batch.block_ids[0, 1].tolist() == [int(s0.tokens[a])] + [mask] * 7
    assert (batch.labels[1, 1] == -100).all() and not batch.valid[1, 1]
    head = DraftHead(llama.lm_head.weight, None)
    slot_w = slot_weights(B, gamma)
    fb = torch.nn.utils.rnn.pad_sequence([feats[0], feats[5]], batch_first=True)
    hidden = drafter.forward_blocks(fb, llama.embed_tokens(batch.block_ids.reshape(2, -1)), batch.anchors, batch.valid)
    norm = step_weight(batch.labels, head, slot_w, "ce")
    loss, st = block_loss(hidden, batch.labels, slot_w, head, "ce", norm, chunk=5)
    num = den = 0.0
    for s, f, anc in zip(picked, [feats[0], feats[5]], anchors):
        for a in anc.tolist():
            ids = torch.tensor([int(s.tokens[a])] + [mask] * (B - 1))
            h = drafter(f[None, :a], llama.embed_tokens(ids)[None], torch.arange(a + B)[None])[0]
            logits = llama.lm_head(h).float()
            for k in range(1, B):
                if a + k < s.length:
                    wk = torch.exp(torch.tensor(-(k - 1) / gamma))
                    num += wk * F.cross_entropy(logits[k], s.tokens[a + k])
                    den += wk
    assert abs(norm - float(den)) < 1e-5 and torch.allclose(loss, num / den, atol=1e-5)
    assert st["pos1"] == 3 and st["slots"] == 7 + 2 + 1


def test_kl_target_states_give_the_targets_own_logits(tiny_targets):
    for kind in ("llama", "qwen3"):
        t = tiny_targets[kind]
        ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
        out = t.forward(ids, layer_ids=[t.num_layers - 1], use_cache=False)
        mine = t.lm_head(t.final_norm(out.features))
        assert torch.allclose(mine, out.logits, atol=1e-5), kind


# ---- guards -----------------------------------------------------------------------------------------------

def test_noise_touches_drafter_inputs_only(llama, data, tmp_path):
    """Features for the drafter change; labels and the target's states/distribution are byte-identical, for a
    memory source and for the online source (target in the loop)."""
    seqs = data[0]
    seq_file = tmp_path / "seqs.jsonl"
    header = {"format": "dflashkit-sequences/1", "target": llama.identity()}
    rows = [{"id": s.id, "prompt_ids": s.tokens[: s.prompt_len].tolist(), "completion_ids": s.tokens[s.prompt_len:].tolist()}
            for s in seqs]
    seq_file.write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))
    head = DraftHead(llama.lm_head.weight, None)
    for src in (source(data), OnlineSource(seq_file, llama, None, 2048)):
        idx = [1, 4]
        batch = build_batch([src.seqs[i] for i in idx], [sample_anchors(src.seqs[i], 8, 0, 0, i) for i in idx], 8,
                            llama.mask_token_id)
        labels = batch.labels.clone()
        clean = micro_inputs(src, idx, batch, llama, LAYERS, True, 0.0, [1, 2])
        noisy = micro_inputs(src, idx, batch, llama, LAYERS, True, 0.5, [1, 2])
        assert not torch.allclose(clean[0], noisy[0])  # the drafter's features are noised
        assert torch.equal(clean[1], noisy[1])  # block embeddings untouched
        assert torch.equal(clean[2], noisy[2])  # target states: byte-identical
        assert torch.equal(head.logits(clean[2]), head.logits(noisy[2]))  # target logits: byte-identical
        assert torch.equal(batch.labels, labels)  # labels untouched
        ref = src.batch(idx, llama, LAYERS, False)[0]
        assert torch.equal(ref, clean[0])  # and the source itself was not modified in place


@pytest.mark.slow
def test_final_layers_refused_unless_allowed(llama, data, tmp_path):
    with pytest.raises(DFlashError, match=r"target_layer_ids: .*include the last two decoder layers .*allow_final_layers"):
        train(cfg_for(tmp_path, target_layer_ids=[1, 4]), target=llama, source=source(data))
    seqs, feats, last = data
    ids = [1, llama.num_layers - 1]
    f2 = [torch.cat([f[:, :64], l], -1) for f, l in zip(feats, last)]
    out = train(cfg_for(tmp_path, target_layer_ids=ids, allow_final_layers=True, steps=1), target=llama,
                source=MemorySource(seqs, f2, ids))
    assert out["finished"]


@pytest.mark.slow
def test_leak_through_an_inclusive_mask_is_learned_the_strict_mask_stays_at_chance(llama, tmp_path, monkeypatch):
    """Random tokens from 8 symbols; the feature at position p encodes token p+1. Only the anchor's own feature
    (position a, seen only with an inclusive mask) reveals slot 1's label: with the real strict mask, held-out
    position-1 accuracy must stay at chance (1/8); with an inclusive mask the same training reaches ~1."""
    g = torch.Generator().manual_seed(0)
    symbols = torch.arange(10, 18)
    table = torch.randn(llama.vocab_size, llama.hidden_size, generator=g)

    def make(n, T=40, P=6):
        seqs, feats = [], []
        for i in range(n):
            toks = symbols[torch.randint(0, 8, (T,), generator=g)]
            f = torch.zeros(T, llama.hidden_size)
            f[:-1] = table[toks[1:]]
            seqs.append(Sequence(f"r{i}", toks, P))
            feats.append(f)
        return seqs, feats

    train_data, held_out = make(64), make(16)
    strict = drafter_model.build_block_mask

    def inclusive(anchors, ctx_len, block_size, valid=None):
        return strict(anchors + 1, ctx_len, block_size, valid)  # context <= anchor: the bug

    def pos1_accuracy(ckpt):
        dr = load_drafter(ckpt, target=llama)
        head = DraftHead.for_drafter(llama, dr)
        hit = total = 0
        with torch.no_grad():
            for s, f in zip(*held_out):
                A = torch.arange(s.prompt_len, s.length - 1)
                ids = torch.full((len(A), 4), llama.mask_token_id)
                ids[:, 0] = s.tokens[A]
                h = dr.forward_blocks(f[None], llama.embed_tokens(ids.view(1, -1)), A[None]).view(len(A), 4, -1)
                hit += int((head.to_tokens(head.logits(h[:, 1]).argmax(-1)) == s.tokens[A + 1]).sum())
                total += len(A)
        return hit / total

    acc = {}
    for name, mask_fn in (("strict", strict), ("inclusive", inclusive)):
        monkeypatch.setattr(drafter_model, "build_block_mask", mask_fn)
        cfg = cfg_for(tmp_path, name, target_layer_ids=[1], block_size=4, batch_size=8, anchors_per_seq=16, steps=80)
        out = train(cfg, target=llama, source=MemorySource(*train_data, [1]))
        acc[name] = pos1_accuracy(out["checkpoint"])
    assert acc["inclusive"] > 0.9, acc  # the test can fail: the leak is learnable
    assert acc["strict"] < 0.25, acc  # chance is 0.125


@pytest.mark.slow
def test_smoke_gate_overfitting_one_completion_reaches_the_full_streak(llama, tmp_path):
    """Mask, labels, positions and loss agree end to end: one prompt's completion, overfit, then every stride
    block of it is drafted entirely (streak B-1 = 7), scored independently of the training code."""
    B = 8
    s = make_seq(llama, 0, "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
    feats = llama.forward(s.tokens[None], layer_ids=[1, 3], use_cache=False).features[0]
    cfg = cfg_for(tmp_path, num_layers=2, target_layer_ids=[1, 3], block_size=B, batch_size=1, anchors_per_seq=64,
                  steps=150)
    out = train(cfg, target=llama, source=MemorySource([s], [feats], [1, 3]))
    dr = load_drafter(out["checkpoint"], target=llama)
    head = DraftHead.for_drafter(llama, dr)
    A = torch.arange(s.prompt_len, s.length - B + 1, B)  # stride anchors with a full block of labels
    ids = torch.full((len(A), B), llama.mask_token_id)
    ids[:, 0] = s.tokens[A]
    with torch.no_grad():
        h = dr.forward_blocks(feats[None], llama.embed_tokens(ids.view(1, -1)), A[None]).view(len(A), B, -1)
    drafted = head.to_tokens(head.logits(h[:, 1:]).argmax(-1))
    labels = s.tokens[A[:, None] + torch.arange(1, B)]
    streaks = (drafted == labels).long().cumprod(1).sum(1)
    assert len(A) >= 4 and streaks.tolist() == [B - 1] * len(A)
    try:  # the offline evaluator agrees, when it is installed
        from dflashkit.evaluate.offline import evaluate_sequence
    except ImportError:
        return
    recs = evaluate_sequence(dr, head, llama.embed_tokens, s.tokens, feats, s.prompt_len, anchors="stride")
    assert [r["streak"] for r in recs if r["n_labels"] == B - 1] == [B - 1] * len(A)


@pytest.mark.slow
def test_dflash2_trains_and_its_selector_path_drafts_the_completion(llama, tmp_path):
    """DFlash2 end to end: overfit one completion with the backbone + selector loss; the checkpoint loads as
    DFlash2, the log reports the selector's accuracy, and the selector's own path (offline evaluator, T=0 walk)
    drafts every stride block in full; online chain decoding with it stays equal to greedy."""
    from dflashkit.decode.speculative import DFlashProposer, generate
    from dflashkit.evaluate.offline import evaluate_sequence

    B = 8
    s = make_seq(llama, 0, "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
    feats = llama.forward(s.tokens[None], layer_ids=[1, 3], use_cache=False).features[0]
    cfg = cfg_for(tmp_path, num_layers=2, target_layer_ids=[1, 3], block_size=B, batch_size=1, anchors_per_seq=64,
                  steps=150, arch="dflash2", selector_rank=16, selector_top_k=4, draft_vocab="none")
    out = train(cfg, target=llama, source=MemorySource([s], [feats], [1, 3]))
    dr = load_drafter(out["checkpoint"], target=llama)
    assert dr.config.arch == "dflash2" and "DFlash2DraftModel" in dr.load_report[1]
    acc = [float(x) for x in read_csv_column(Path(cfg.out) / "metrics.csv", "selector_acc")]
    assert acc[-1] > 0.9 > acc[0]
    head = DraftHead.for_drafter(llama, dr)
    recs = evaluate_sequence(dr, head, llama.embed_tokens, s.tokens, feats, s.prompt_len, anchors="stride")
    full = [r["streak"] for r in recs if r["n_labels"] == B - 1]
    assert len(full) >= 4 and full == [B - 1] * len(full)
    prompt = s.tokens[: s.prompt_len].tolist()
    g = generate(llama, prompt, "chain", DFlashProposer(llama, dr), max_new_tokens=20, stop_ids=[])
    assert g.tokens == generate(llama, prompt, "ar", max_new_tokens=20, stop_ids=[]).tokens


# ---- checkpoints, resume, stopping ------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_after_ctrl_c_repeats_the_uninterrupted_losses(llama, data, tmp_path):
    kw = dict(steps=20, noise_std=0.1, grad_accum=2, batch_size=1, loss="kl")
    straight = train(cfg_for(tmp_path, "straight", **kw), target=llama, source=source(data))

    def ctrl_c_at_10(step, row):
        if step == 10:
            os.kill(os.getpid(), signal.SIGINT)

    first = train(cfg_for(tmp_path, "resumed", **kw), target=llama, source=source(data), on_step=ctrl_c_at_10)
    assert not first["finished"] and first["steps"] == 10 and "SIGINT" in first["stop_reason"]
    latest = json.loads((tmp_path / "resumed" / "latest.json").read_text())
    assert latest == {"step": 10, "checkpoint": "checkpoints/step-00000010", "finished": False,
                      "reason": "interrupted (SIGINT)"}
    second = train(cfg_for(tmp_path, "resumed", **kw), target=llama, source=source(data))
    assert second["finished"] and len(second["losses"]) == 10
    resumed = first["losses"] + second["losses"]
    assert max(abs(x - y) for x, y in zip(straight["losses"], resumed)) < 1e-6, (straight["losses"], resumed)
    assert read_csv_column(tmp_path / "resumed" / "metrics.csv", "step") == [str(i) for i in range(1, 21)]
    a = load_file(tmp_path / "straight" / "checkpoints" / "step-00000020" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoints" / "step-00000020" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
def test_resume_contract_refuses_silent_changes(llama, data, tmp_path):
    train(cfg_for(tmp_path, steps=2), target=llama, source=source(data))
    for change, key in ((dict(gamma=2.0), "gamma"), (dict(loss="kl"), "loss"), (dict(block_size=4), "block_size"),
                        (dict(target_layer_ids=[1, 2]), "target_layer_ids")):
        seqs, feats, last = data
        src = source(data) if key != "target_layer_ids" else MemorySource(seqs, [f[:, :128] for f in feats], [1, 2])
        with pytest.raises(DFlashError, match=rf"trained with {key}=.* set {key} back to resume"):
            train(cfg_for(tmp_path, steps=4, **change), target=llama, source=src)
    assert train(cfg_for(tmp_path, steps=4, lr=1e-3), target=llama, source=source(data))["steps"] == 4  # lr may change


@pytest.mark.slow
def test_checkpoint_retention_loss_name_and_time_budget(llama, data, tmp_path):
    out = train(cfg_for(tmp_path, steps=7, save_every=2, keep_last=2, loss="kl"), target=llama, source=source(data))
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000006", "step-00000007"]
    contract = json.loads((run / "checkpoints" / "step-00000007" / "dflashkit.json").read_text())
    assert contract["loss"] == "kl" and contract["gamma"] == 4.0 and contract["finished"] is True
    assert contract["target"]["config_hash"] == llama.identity()["config_hash"]
    assert contract["train_config"]["loss"] == "kl" and len(contract["draft_vocab"]) < llama.vocab_size
    assert set(read_csv_column(run / "metrics.csv", "loss_name")) == {"kl"}
    assert json.loads((run / "summary.json").read_text())["loss_name"] == "kl" and out["finished"]
    assert load_drafter(run / "checkpoints" / "step-00000007", target=llama).contract["loss"] == "kl"
    # a time budget stops cleanly after the first step, with a checkpoint marked unfinished
    out = train(cfg_for(tmp_path, "budget", steps=50, max_minutes=0.0), target=llama, source=source(data))
    assert not out["finished"] and out["steps"] == 1 and "max_minutes" in out["stop_reason"]
    assert json.loads((tmp_path / "budget" / "latest.json").read_text())["finished"] is False
    assert "STOPPED EARLY" in (tmp_path / "budget" / "summary.md").read_text()


@pytest.mark.slow
def test_cache_source_periodic_eval_best_and_kl_needs_the_last_layer(llama, tmp_path):
    from dflashkit.cache import extract
    from dflashkit.prompts import load_prompts

    suite = load_prompts("coding-10").subset(4)
    cache = extract(llama, suite, tmp_path / "cache", layer_ids=LAYERS, max_new_tokens=12, progress=False)
    out = train(cfg_for(tmp_path, data=str(cache), steps=4, eval_cache=str(cache), eval_every=2), target=llama)
    run = tmp_path / "run"
    assert out["finished"] and read_csv_column(run / "eval.csv", "step") == ["2", "4"]
    best = json.loads((run / "best.json").read_text())
    assert best["metrics"]["tau"] == max(float(x) for x in read_csv_column(run / "eval.csv", "tau"))
    assert load_drafter(run / "best", target=llama).config.target_layer_ids == LAYERS
    with pytest.raises(DFlashError, match=r"loss kl needs the target's distribution.*--target-layers 1,2,3,5"):
        train(cfg_for(tmp_path, "kl", data=str(cache), loss="kl"), target=llama)
    # a cache that also stores the last layer serves kl (that layer is never fed to the drafter)
    full = extract(llama, suite, tmp_path / "cache5", layer_ids=LAYERS + [5], max_new_tokens=12, progress=False,
                   allow_final_layers=True)
    out = train(cfg_for(tmp_path, "kl", data=str(full), loss="kl", steps=2), target=llama)
    assert out["finished"] and load_drafter(out["checkpoint"], target=llama).config.target_layer_ids == LAYERS


@pytest.mark.slow
@stock_bf16  # the drafter's attention under bf16 autocast is torch's
def test_bfloat16_autocast_trains(llama, data, tmp_path):
    out = train(cfg_for(tmp_path, dtype="bfloat16", steps=16), target=llama, source=source(data))
    losses = out["losses"]
    assert out["finished"] and len(losses) == 16 and all(0 < x < 20 for x in losses)
    # it learns: the last epoch's mean loss (4 steps of 2 of the 8 sequences) is well below the first's
    # (about 3.65 -> 3.32 here; with lr=0 the two epochs measure 3.97 and 4.02)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.15, losses
    assert load_file(Path(out["checkpoint"]) / "model.safetensors")["fc.weight"].dtype == torch.float32


@pytest.mark.slow
def test_learning_rate_schedule_by_steps_and_by_time(llama, data, tmp_path, monkeypatch):
    out = train(cfg_for(tmp_path, "steps", steps=50, lr=1e-3, warmup_ratio=0.04), target=llama, source=source(data))
    lrs = [r["lr"] for r in out["history"]]
    assert lrs[:3] == [5e-4, 1e-3, 1e-3]  # linear warmup over 2 steps, then cosine from the peak
    assert abs(lrs[26] - 5e-4) < 1e-5 and lrs[-1] < 2e-6 and all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    # time-boxed: far more steps than fit, yet the cosine reaches its floor when the minutes run out. The loop
    # reads an injected clock that advances 10 ms per reading, so a loaded machine cannot change the outcome.
    import time as real_time
    import types

    import dflashkit.train.loop as loop

    ticks = iter(range(10**9))
    clock = types.SimpleNamespace(**{n: getattr(real_time, n) for n in dir(real_time) if not n.startswith("_")})
    clock.time = lambda: 1e9 + 0.01 * next(ticks)
    monkeypatch.setattr(loop, "time", clock)
    out = train(cfg_for(tmp_path, "time", steps=100_000, schedule_minutes=0.01, max_minutes=0.02), target=llama,
                source=source(data))
    lrs = [r["lr"] for r in out["history"]]
    assert "max_minutes" in out["stop_reason"] and lrs[0] < 0.5 * max(lrs) and max(lrs) > 2e-3 and lrs[-1] == 0.0
    assert 10 < len(lrs) < 200  # about 1.2 s of fake time at a few clock readings per step


# ---- data generation, online training, export -------------------------------------------------------------

@pytest.mark.slow
def test_data_generate_resumes_and_feeds_online_training(tiny_dirs, llama, tmp_path, capsys):
    from dflashkit.targets.generation import iter_generate_greedy

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"write function {i} " * (1 + i % 3)}) + "\n"
                               for i in range(5)))
    out = tmp_path / "seqs.jsonl"
    args = ["data", "generate", "--target", str(tiny_dirs["llama"]), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "10", "--batch-size", "2"]
    assert main(args + ["--num-prompts", "3"]) == 0
    with open(out, "a") as f:
        f.write('{"id": "p9", "prompt_ids": [1, 2')  # a run killed mid-write
    assert main(args) == 0
    header, recs = read_sequences(out)
    assert sorted(r["id"] for r in recs) == [f"p{i}" for i in range(5)]
    assert header["target"]["config_hash"] == llama.identity()["config_hash"]
    ids = [llama.chat_ids([{"role": "user", "content": f"write function {i} " * (1 + i % 3)}]) for i in range(5)]
    ref = dict(iter_generate_greedy(llama, ids, 10, batch_size=1))
    for r in recs:
        i = int(r["id"][1:])
        assert r["prompt_ids"] == ids[i] and r["completion_ids"] == ref[i]
    assert main(args[:-4] + ["--max-new-tokens", "11"]) == 2
    assert "was generated with max_new_tokens=10" in capsys.readouterr().err
    # online source: the target's padded batch forward gives each sequence's own features
    src = OnlineSource(out, llama, None, 2048)
    feats, last = src.batch([0, 3], llama, LAYERS, True)
    for row, i in enumerate([0, 3]):
        s = src.seqs[i]
        ref = llama.forward(s.tokens[None], layer_ids=LAYERS + [5], use_cache=False).features[0]
        assert torch.allclose(feats[row, : s.length], ref[:, :192], atol=1e-5)
        assert torch.allclose(last[row, : s.length], ref[:, 192:], atol=1e-5)
    res = train(cfg_for(tmp_path, data=str(out), loss="kl", steps=3), target=llama)
    assert res["finished"] and all(torch.isfinite(torch.tensor(res["losses"])))
    with pytest.raises(DFlashError, match=r"generated by target llama .* not qwen3"):
        OnlineSource(out, load_target_qwen(tiny_dirs), None, 2048)


def load_target_qwen(tiny_dirs):
    from dflashkit.targets.model import load_target

    return load_target(tiny_dirs["qwen3"], device="cpu")


@pytest.mark.slow
def test_export_writes_the_zlab_format(llama, data, tmp_path, capsys):
    train(cfg_for(tmp_path, steps=1), target=llama, source=source(data))
    assert main(["drafter", "export", "--drafter", str(tmp_path / "run"), "--out", str(tmp_path / "z"), "--dtype", "float32"]) == 0
    z = tmp_path / "z"
    assert sorted(p.name for p in z.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((z / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == LAYERS
    a = load_file(z / "model.safetensors")
    b = load_file(tmp_path / "run" / "checkpoints" / "step-00000001" / "model.safetensors")
    vocab = load_drafter(tmp_path / "run" / "checkpoints" / "step-00000001").contract.get("draft_vocab")
    mapped = {"d2t", "lm_head.weight"} if vocab else set()  # the draft vocabulary's token map, as vLLM reads it
    assert a.keys() - mapped == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    assert "vocabulary: the " in capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_kl_training_steps_with_a_draft_vocabulary(smollm2, tmp_path):
    """The real target: its last layer through final norm + tied lm_head is its own distribution, the shortcut
    layers are refused, and a few KL steps over a draft vocabulary run and lower the loss."""
    t = smollm2
    ids = t.default_layer_ids(5)
    assert ids == [1, 8, 14, 20, 27]
    seqs = [make_seq(t, i, SNIPPETS[i]) for i in range(2)]
    feats, last = [], []
    for s in seqs:
        out = t.forward(s.tokens[None], layer_ids=ids + [t.num_layers - 1], use_cache=False)
        assert torch.allclose(t.lm_head(t.final_norm(out.features[..., 5 * 576:])), out.logits, atol=1e-4)
        feats.append(out.features[0, :, : 5 * 576])
        last.append(out.features[0, :, 5 * 576:])
    src = MemorySource(seqs, feats, ids, last=last)
    with pytest.raises(DFlashError, match=r"\[28\] include the last two decoder layers"):
        train(cfg_for(tmp_path, target_layer_ids=[1, 28]), target=t, source=src)
    res = train(cfg_for(tmp_path, target_layer_ids=ids, block_size=16, anchors_per_seq=16, steps=4, loss="kl",
                        lr=1e-3), target=t, source=src)
    assert res["finished"] and res["draft_vocab_size"] < 200 and res["losses"][-1] < res["losses"][0]


def test_auto_dtype_uses_bf16_autocast_only_on_cpus_with_native_bf16(monkeypatch):
    from dflashkit.targets import model as target_model

    cpu = torch.device("cpu")
    monkeypatch.setattr(target_model, "cpu_has_bf16_matmul", lambda: True)
    assert target_model.pick_dtype("auto", cpu) == torch.bfloat16
    assert target_model.pick_dtype("float32", cpu) == torch.float32
    monkeypatch.setattr(target_model, "cpu_has_bf16_matmul", lambda: False)
    assert target_model.pick_dtype("auto", cpu) == torch.float32
    assert target_model.pick_dtype("bf16", cpu) == torch.bfloat16
    assert target_model.pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_num_target_layers_picks_that_many_layers_by_zlabs_rule(llama):
    from dflashkit.targets.model import default_layer_ids
    from dflashkit.train.loop import feature_layers

    cfg = load_config(None, {"num_layers": 1, "num_target_layers": 3})
    assert feature_layers(cfg, llama, None) == default_layer_ids(llama.num_layers, 3) == [1, 2, 3]
    assert feature_layers(load_config(None, {"num_layers": 2}), llama, None) == default_layer_ids(llama.num_layers, 2)
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2: what dflashkit/configs/smollm2-cpu.yaml resolves to
    with pytest.raises(DFlashError, match=r"num_target_layers=0 must be at least 1"):
        load_config(None, {"num_target_layers": 0})


@pytest.mark.slow
def test_warm_start_copies_the_targets_top_layers(llama, data, tmp_path, capsys):
    from dflashkit.drafter.checkpoint import load_drafter

    out = train(cfg_for(tmp_path, "warm", num_layers=2, warm_start=True, steps=1, lr=0.0), target=llama,
                source=source(data))
    assert "drafter layer 1 <- target layer" in capsys.readouterr().out
    d = load_drafter(out["checkpoint"], target=llama)
    top = llama.model.model.layers[-2:]
    for mine, theirs in zip(d.layers, top):  # lr 0: the one step leaves the copied weights as they were
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(mine.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight)
        assert torch.equal(mine.input_layernorm.weight, theirs.input_layernorm.weight)
    with pytest.raises(DFlashError, match="warm_start and init=.* both"):
        train(cfg_for(tmp_path, "both", num_layers=2, warm_start=True, init=out["checkpoint"]), target=llama,
              source=source(data))
