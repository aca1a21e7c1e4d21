"""The contracts DFlash users have seen broken silently in other tools (docs/design.md section 14): one test per
contract, each building the wrong variant explicitly (a parameter of the code under test, or a file written the wrong
way) and showing it caught, beside the right variant passing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cache import extract, open_cache
from dflashkit.cache.extraction import capture_features
from dflashkit.drafter.checkpoint import load_drafter, new_drafter, save_drafter
from dflashkit.drafter.config import DrafterConfig, check_engine_block, engine_block
from dflashkit.drafter.gguf import check_gguf, read_token_map
from dflashkit.drafter.head import DraftHead
from dflashkit.drafter.model import DFlashDrafter, block_ids, rotary_dim
from dflashkit.errors import DFlashError
from dflashkit.prompts import load_prompts
from dflashkit.targets.generation import iter_generate_with_features
from dflashkit.train.config import load_config
from dflashkit.train.data import MemorySource, Sequence, build_batch
from dflashkit.train.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")
B = 4


@pytest.fixture(scope="module")
def llama(tiny_targets):
    return tiny_targets["llama"]


def drafter_for(target, **overrides) -> DFlashDrafter:
    torch.manual_seed(0)
    return new_drafter(target, num_layers=1, target_layer_ids=[1, 3], block_size=B, **overrides).eval()


def write_gguf(path: Path, cfg: DrafterConfig, target_layers=None, block_size=None, n_rot=None, sections=None,
               d2t=None) -> Path:
    """A DFlash GGUF with the keys llama.cpp's converter writes (ours by default; any one given the wrong way)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "dflash")
    w.add_array("dflash.target_layers", target_layers if target_layers is not None else [i + 1 for i in cfg.target_layer_ids])
    w.add_uint32("dflash.block_size", block_size if block_size is not None else cfg.block_size)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
    w.add_uint32("dflash.rope.dimension_count", n_rot if n_rot is not None else rotary_dim(cfg))
    if sections is not None:
        w.add_array("dflash.rope.dimension_sections", sections)
    w.add_tensor("fc.weight", np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), dtype=np.float32))
    if d2t is not None:
        w.add_tensor("d2t", np.asarray(d2t, dtype=np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refused(fn, *parts) -> str:
    with pytest.raises(DFlashError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg
    return msg


# ---- 1. the seed token in slot 0 ------------------------------------------------------------------------------

def chain_sequences(n: int, perm: torch.Tensor, g, T: int = 32, P: int = 4):
    """Tokens that follow a fixed permutation of 8 symbols from a random start, features all zero: only the token in
    slot 0 tells the drafter where the chain is, so feeding mask there leaves it at chance."""
    seqs, feats = [], []
    for i in range(n):
        t = [int(torch.randint(0, 8, (1,), generator=g))]
        for _ in range(T - 1):
            t.append(int(perm[t[-1]]))
        seqs.append(Sequence(f"c{i}", torch.tensor(t) + 10, P))
        feats.append(torch.zeros(T, 64))
    return seqs, feats


def offline_tau(dr, target, seqs, feats, slot0: str) -> float:
    """Mean accepted length + 1 over every anchor, the blocks built by block_ids(slot0=...) (what train, eval and
    decode all call), scored by a straightforward streak count."""
    head = DraftHead.for_drafter(target, dr)
    taus = []
    with torch.no_grad():
        for s, f in zip(seqs, feats):
            A = torch.arange(s.prompt_len, s.length - B + 1)
            ids = block_ids(s.tokens[A], B, dr.config.mask_token_id, slot0)
            h = dr.forward_blocks(f[None], dr.embed_block(target.embed_tokens, ids.view(1, -1)), A[None])
            drafts = head.to_tokens(head.logits(h.view(len(A), B, -1)[:, 1:]).argmax(-1))
            labels = s.tokens[A[:, None] + torch.arange(1, B)]
            taus += ((drafts == labels).long().cumprod(1).sum(1) + 1).tolist()
    return sum(taus) / len(taus)


@pytest.mark.slow
def test_1_seed_token_in_slot_0(llama, tmp_path):
    """Trained with the seed in slot 0 (train/data.build_batch), the drafter drafts whole blocks; the same weights fed
    mask in slot 0 (block_ids slot0="mask", the engines' bug) run without error at a fraction of the tau. Train, eval
    and decode build the same block; a drafter folder that records another slot 0 is refused at load."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(8, generator=g)
    train_set, held_out = chain_sequences(48, perm, g), chain_sequences(8, perm, g)
    cfg = load_config(None, dict(out=str(tmp_path / "run"), num_layers=1, target_layer_ids=[1], block_size=B,
                                 batch_size=8, anchors_per_seq=16, steps=80, lr=3e-3, progress=False, save_every=1000,
                                 dtype="float32"))
    dr = load_drafter(train(cfg, target=llama, source=MemorySource(*train_set, [1]))["checkpoint"], target=llama)
    seed, mask = offline_tau(dr, llama, *held_out, "seed"), offline_tau(dr, llama, *held_out, "mask")
    assert seed > 3.5 and mask < 1.5, (seed, mask)  # measured: seed 4.00, mask 1.1x (chance ~1.14)

    # train, eval and decode agree on the block: slot 0 the anchor token, the rest mask
    s, f = held_out[0][0], held_out[1][0]
    batch = build_batch([s], [torch.tensor([5, 9])], B, dr.config.mask_token_id)
    assert batch.block_ids[0].tolist() == block_ids(s.tokens[[5, 9]], B, dr.config.mask_token_id).tolist()
    assert batch.block_ids[0, :, 0].tolist() == s.tokens[[5, 9]].tolist()
    from dflashkit.evaluate.offline import block_embeddings

    e = block_embeddings(llama.embed_tokens, s.tokens, [5], B, dr.config.mask_token_id, torch.float32)
    assert torch.equal(e, llama.embed_tokens(block_ids(s.tokens[[5]], B, dr.config.mask_token_id).view(-1)))
    from dflashkit.decode.speculative import DFlashProposer

    a = 9
    decode = DFlashProposer(llama, dr)
    decode.reset([])
    online = decode.propose(f[None, :a], s.tokens[a:a + 1], a)  # the decode path's block and context KV
    h = dr.forward_blocks(f[None], llama.embed_tokens(block_ids(s.tokens[[a]], B, dr.config.mask_token_id)), torch.tensor([[a]]))
    assert torch.allclose(online, decode.head.logits(h[0, 1:]), atol=1e-5)

    # a folder whose contract says mask in slot 0 (as its trainer did) is refused at load, in one line
    save_drafter(dr, tmp_path / "mask-slot0", block_slot0="mask")
    refused(lambda: load_drafter(tmp_path / "mask-slot0"), str(tmp_path / "mask-slot0" / "dflashkit.json"), "block_slot0",
            "retrain with block_slot0 'seed'")
    save_drafter(dr, tmp_path / "ok")
    assert json.loads((tmp_path / "ok" / "dflashkit.json").read_text())["block_slot0"] == "seed"
    assert "block 4 = the last accepted token + 3 mask slots" in load_drafter(tmp_path / "ok").load_report[-2]
    with pytest.raises(DFlashError, match="slot0='anchor'"):
        DFlashProposer(llama, dr, slot0="anchor")


# ---- 2. the tapped-layer offset -------------------------------------------------------------------------------

def test_2_layer_offset(llama, tmp_path):
    """Layer l is decoder layer l's output = output_hidden_states[l + 1]. Parity with Hugging Face's tuple catches a
    shift by one (hidden_states[l] is another tensor); every export writes the ids in the reader's convention (z-lab:
    l, vLLM and llama.cpp tap l + 1), a GGUF written without the + 1 and a cache recorded in the other convention are
    refused at load, in one line."""
    ids = llama.chat_ids([{"role": "user", "content": "count to ten"}])
    ours = capture_features(llama, [ids], [1, 3])[0]
    with torch.no_grad():
        hs = llama.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for l in (1, 3):
        assert (ours[l] - hs[l + 1][0]).abs().max() <= 1e-6
        assert (ours[l] - hs[l][0]).abs().max() > 1e-2  # the +1 bug reads another tensor: parity catches it

    dr = drafter_for(llama)
    save_drafter(dr, tmp_path / "zlab", format="zlab")
    cfg = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]  # z-lab's convention; vLLM adds 1 (eagle3_utils)
    vllm_taps = cfg.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    assert all(torch.equal(hs[t][0], hs[l + 1][0]) for t, l in zip(vllm_taps, [1, 3]))
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3]  # a converter that forgot the + 1
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(cfg))
    refused(lambda: load_drafter(tmp_path / "zlab"), str(tmp_path / "zlab"), "eagle_aux_hidden_state_layer_ids [1, 3] disagrees",
            "remove one")

    right = write_gguf(tmp_path / "right.gguf", dr.config)
    assert "dflash.target_layers [2, 4] (id + 1)" in check_gguf(right, dr.config, None, {})[0]
    wrong = write_gguf(tmp_path / "wrong.gguf", dr.config, target_layers=[1, 3])
    refused(lambda: check_gguf(wrong, dr.config, None, {}), str(wrong), "dflash.target_layers is [1, 3]", "[2, 4]",
            "write target_layer_ids + 1")

    cache = extract(llama, load_prompts("coding-10").subset(1), tmp_path / "cache", layer_ids=[1, 3], max_new_tokens=3,
                    progress=False)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["features"] == {"hidden_states_index": "layer_id + 1", "final_norm": False}
    manifest["features"]["hidden_states_index"] = "layer_id"  # a cache that stored hidden_states[l] as layer l
    (cache / "manifest.json").write_text(json.dumps(manifest))
    refused(lambda: open_cache(cache), str(cache / "manifest.json"), "features.hidden_states_index is 'layer_id'",
            "re-extract")


# ---- 3. partial_rotary_factor ---------------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [0.25, 0.5])
def test_3_partial_rotary_factor(llama, tmp_path, factor):
    """The drafter rotates the first head_dim * factor dims, exactly as transformers' partial-rotary models
    (Qwen3-Next's apply_rotary_pos_emb, the reference here); the factor survives save and load, is written where
    vLLM and llama.cpp read it, and changes the drafter's output (a trainer that ignores it trains another model).
    A GGUF rotating other dims than training is refused."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding, apply_rotary_pos_emb

    dr = drafter_for(llama, partial_rotary_factor=factor)
    ignored = DFlashDrafter(dataclasses.replace(dr.config, partial_rotary_factor=1.0)).eval()  # the wrong variant
    ignored.load_state_dict(dr.state_dict())
    pos = torch.arange(3, 11)[None]
    q, k = torch.randn(2, 1, 4, 8, 16).unbind(0)
    ref = Qwen3NextRotaryEmbedding(Qwen3NextConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                   partial_rotary_factor=factor, rope_theta=dr.config.rope_theta))
    cos, sin = ref(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    from dflashkit.drafter.model import apply_rope

    ours_cos, ours_sin = dr._rope(pos)
    assert rotary_dim(dr.config) == int(16 * factor) == ours_cos.shape[-1]
    assert torch.allclose(apply_rope(q, ours_cos, ours_sin), want_q, atol=1e-6)
    assert torch.allclose(apply_rope(k, ours_cos, ours_sin), want_k, atol=1e-6)
    full_cos, full_sin = ignored._rope(pos)
    assert (apply_rope(q, full_cos, full_sin) - want_q).abs().max() > 1e-2  # ignoring the factor: other positions

    feats = torch.randn(1, 12, 128)
    embeds = torch.randn(1, B, 64)
    with torch.no_grad():
        out, wrong = (m.forward_blocks(feats, embeds, torch.tensor([[9]])) for m in (dr, ignored))
    assert (out - wrong).abs().max() > 1e-3

    save_drafter(dr, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["partial_rotary_factor"] == factor == cfg["rope_parameters"]["partial_rotary_factor"]
    back = load_drafter(tmp_path / "d")
    assert back.config.partial_rotary_factor == factor and f"RoPE on {int(16 * factor)} of 16" in back.load_report[-2]
    with torch.no_grad():
        assert torch.equal(back.forward_blocks(feats, embeds, torch.tensor([[9]])), out)
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    refused(lambda: load_drafter(tmp_path / "d"), str(tmp_path / "d"), "partial_rotary_factor", "disagrees", "set both")

    good = write_gguf(tmp_path / "r.gguf", dr.config)
    check_gguf(good, dr.config, None, {})
    bad = write_gguf(tmp_path / "w.gguf", dr.config, n_rot=16)
    refused(lambda: check_gguf(bad, dr.config, None, {}), "dflash.rope.dimension_count is 16",
            f"rotating {int(16 * factor)} of 16", "re-convert")


# ---- 4. hidden states at batch > 1 ----------------------------------------------------------------------------

def test_4_hidden_states_at_batch_4(llama, tmp_path):
    """Four prompts of mixed lengths in one batch give each prompt's batch-1 features (float32, within 1e-6 of the
    features' scale: the batched products round differently, measured 1.3e-6 on values up to 2.7): right padding
    (capture), left padding (capture and generation). The wrong variant, a left-padded batch whose
    padding is attended (as padded extraction has shipped), is caught by the same comparison. The cache states that the
    last tapped layer is the raw output of the last decoder layer, before the final norm; one stating otherwise is refused."""
    texts = ["hi", "write a sorting function in python", "why", "list three colours of the rainbow please"]
    prompts = [llama.chat_ids([{"role": "user", "content": t}]) for t in texts]
    assert len({len(p) for p in prompts}) == 4
    layers = [1, 3, llama.num_layers - 1]
    alone = [capture_features(llama, [p], layers)[0] for p in prompts]

    def same(one, many):
        return all((one[l] - many[l]).abs().max() <= 1e-6 * max(1.0, float(one[l].abs().max())) for l in layers)

    for padding in ("right", "left"):
        batched = capture_features(llama, prompts, layers, padding=padding)
        assert all(same(one, many) for one, many in zip(alone, batched)), padding
    gen4 = {i: f for i, _, f in iter_generate_with_features(llama, prompts, 4, layers, batch_size=4)}
    for i, p in enumerate(prompts):
        one = next(f for _, _, f in iter_generate_with_features(llama, [p], 4, layers, batch_size=1))
        assert same(one, gen4[i]), i

    T = max(len(p) for p in prompts)  # the wrong variant: left padding that the attention mask does not hide (RoPE
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])  # is relative, so positions alone would not show)
    naive = llama.forward(ids, layer_ids=[1], use_cache=False, compute_logits=False).features
    short = 0  # the shortest prompt has the most padding
    assert (naive[short, T - len(prompts[short]):] - alone[short][1]).abs().max() > 1e-3

    with torch.no_grad():
        hs = llama.model(torch.tensor([prompts[1]]), output_hidden_states=True).hidden_states
    last = alone[1][llama.num_layers - 1]
    assert (last - hs[-1][0]).abs().max() > 1e-2  # HF's last entry is after the final norm ...
    assert (llama.final_norm(last) - hs[-1][0]).abs().max() <= 1e-5  # ... of exactly the tensor we store
    cache = extract(llama, load_prompts("coding-10").subset(1), tmp_path / "cache", layer_ids=[1, llama.num_layers - 1],
                    max_new_tokens=3, progress=False, allow_final_layers=True)
    m = json.loads((cache / "manifest.json").read_text())
    assert m["features"]["final_norm"] is False
    m["features"]["final_norm"] = True
    (cache / "manifest.json").write_text(json.dumps(m))
    refused(lambda: open_cache(cache), str(cache / "manifest.json"), "features.final_norm is True", "re-extract")


# ---- 5. mRoPE sections in GGUF --------------------------------------------------------------------------------

def test_5_mrope_sections_in_gguf(llama, tmp_path):
    """A VL target (rope_parameters.mrope_section) needs the drafter GGUF's rope sections: one without is refused at
    export, with them it passes; a text target needs none."""
    dr = drafter_for(llama)
    vl = {"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [11, 11, 10]}}}
    plain = write_gguf(tmp_path / "plain.gguf", dr.config)
    assert check_gguf(plain, dr.config, None, {"rope_parameters": {"rope_type": "default"}})
    refused(lambda: check_gguf(plain, dr.config, None, vl), str(plain), "dflash.rope.dimension_sections", "mRoPE",
            "z-lab #170")
    sections = write_gguf(tmp_path / "vl.gguf", dr.config, sections=[8, 0, 0, 0])
    assert "mRoPE sections [8, 0, 0, 0]" in check_gguf(sections, dr.config, None, vl)[0]


# ---- 6. block-size semantics ----------------------------------------------------------------------------------

def test_6_block_size_semantics(llama, tmp_path):
    """block_size counts the anchor in z-lab's config, SGLang and llama.cpp's dflash.block_size; vLLM's
    num_speculative_tokens and llama-server's --spec-draft-n-max count the drafts. Each export and peer says which and
    is given block_size - 1 drafts; a setting that counts the other way is refused before the engine starts."""
    dr = drafter_for(llama)
    save_drafter(dr, tmp_path / "zlab", format="zlab")
    cfg = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == B
    assert {e: engine_block(e, B) for e in ("zlab", "sglang", "llama.cpp", "vllm")} == {
        "zlab": ("dflash_config.block_size", 4), "sglang": ("speculative_num_draft_tokens", 4),
        "llama.cpp": ("--spec-draft-n-max", 3), "vllm": ("num_speculative_tokens", 3)}
    from dflashkit.engines.llamacpp import LlamaServer
    from dflashkit.engines.vllm_client import VllmWorker

    fake = SimpleNamespace(binary=lambda name: Path(name), python=Path("python"))
    gguf_file = write_gguf(tmp_path / "d.gguf", dr.config)
    server = LlamaServer(Path("t.gguf"), 1, 256, gguf_file, B - 1, engine=fake)
    assert server.cmd[server.cmd.index("--spec-draft-n-max") + 1] == "3"
    refused(lambda: LlamaServer(Path("t.gguf"), 1, 256, gguf_file, B, engine=fake), str(gguf_file),
            "--spec-draft-n-max is 4 for a drafter of block_size 4", "set it to 3")
    worker = VllmWorker(Path("t"), "float32", 1, 256, tmp_path / "zlab", B - 1, engine=fake)
    assert worker.cfg["speculative"]["num_speculative_tokens"] == 3
    refused(lambda: VllmWorker(Path("t"), "float32", 1, 256, tmp_path / "zlab", B, engine=fake),
            str(tmp_path / "zlab" / "config.json"), "num_speculative_tokens is 4", "not the anchor", "set it to 3")
    refused(lambda: check_gguf(write_gguf(tmp_path / "b.gguf", dr.config, block_size=B - 1), dr.config, None, {}),
            "dflash.block_size is 3", "counts the anchor")
    cfg["block_size"] = B - 1  # a config that counts drafts at the top level, the anchor in dflash_config
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(cfg))
    refused(lambda: load_drafter(tmp_path / "zlab"), str(tmp_path / "zlab" / "config.json"),
            "block_size 3 (top level) disagrees with dflash_config.block_size 4", "anchor included")
    with pytest.raises(DFlashError, match="set it to 3"):
        check_engine_block("vllm", 4, 4, "x")


# ---- 7. the draft vocabulary in every export ------------------------------------------------------------------

def test_7_draft_vocabulary_in_exports(llama, tmp_path):
    """A drafter trained over a draft vocabulary is exported with its token map: the z-lab folder's d2t offsets and
    draft_vocab_size (vLLM), the GGUF's d2t of absolute ids (llama.cpp); a GGUF without the map (the engine would draft
    over the full vocabulary the drafter never trained on) or with another one is refused."""
    dr = drafter_for(llama)
    vocab = sorted(torch.randperm(llama.vocab_size, generator=torch.Generator().manual_seed(1))[:40].tolist())
    dr.contract = {"draft_vocab": vocab}
    save_drafter(dr, tmp_path / "zlab", format="zlab", lm_head=llama.lm_head.weight)
    cfg = json.loads((tmp_path / "zlab" / "config.json").read_text())
    state = load_file(tmp_path / "zlab" / "model.safetensors")
    assert cfg["draft_vocab_size"] == 40
    assert (state["d2t"] + torch.arange(40)).tolist() == vocab  # vLLM's rule: target id = index + d2t[index]
    assert torch.equal(state["lm_head.weight"], llama.lm_head.weight[vocab])
    assert load_drafter(tmp_path / "zlab").contract["draft_vocab"] == vocab

    good = write_gguf(tmp_path / "v.gguf", dr.config, d2t=vocab)
    assert read_token_map(good) == vocab and "d2t 40" in check_gguf(good, dr.config, vocab, {})[0]
    missing = write_gguf(tmp_path / "none.gguf", dr.config)
    refused(lambda: check_gguf(missing, dr.config, vocab, {}), "d2t holds 0 token ids", "40", "drop --full-vocab")
    other = write_gguf(tmp_path / "other.gguf", dr.config, d2t=vocab[::-1])
    refused(lambda: check_gguf(other, dr.config, vocab, {}), "d2t holds 40 token ids")


# ---- the engines: what they run with our exports ---------------------------------------------------------------

def _engine(name: str):
    from dflashkit.engines.install import require

    try:
        return require(name)
    except DFlashError as e:
        pytest.skip(str(e))


@pytest.mark.engines
@pytest.mark.slow
def test_llamacpp_export_passes_its_contracts_and_drafts_block_minus_one(smollm2, tmp_path):
    """llama.cpp's own converter writes what check_gguf demands (items 2, 3, 6, 7: drafter_gguf refuses otherwise),
    and the server, given block_size - 1, drafts that many tokens a round. (The real target: llama.cpp's converter
    knows no tiny random tokenizer, and its CPU attention no tiny head.)"""
    from dflashkit.engines.llamacpp import LlamaServer, drafter_gguf, target_gguf

    engine = _engine("llama.cpp")
    dr = drafter_for(smollm2, partial_rotary_factor=0.5)
    dr.contract = {"draft_vocab": list(range(200))}
    out = drafter_gguf(engine, dr, smollm2, "float32", tmp_path / "d.gguf")
    assert read_token_map(out) == list(range(200))
    with LlamaServer(target_gguf(engine, smollm2, "float32"), 1, 512, out, B - 1, engine=engine) as server:
        a = server.complete(smollm2.chat_ids([{"role": "user", "content": "hello"}]), 24, set(smollm2.stop_token_ids))
    assert a.steps > 0 and a.drafted == (B - 1) * a.steps


@pytest.mark.engines
@pytest.mark.slow
def test_vllm_drafts_block_minus_one_with_our_export(smollm2, tmp_path):
    """vLLM, given num_speculative_tokens = block_size - 1 for our export, drafts that many tokens a round (the real
    target: vLLM's CPU attention refuses a tiny random target's head_dim 16)."""
    from dflashkit.engines.vllm_client import VllmWorker

    engine = _engine("vllm")
    dr = drafter_for(smollm2)
    folder = save_drafter(dr, tmp_path / "zlab", format="zlab", lm_head=smollm2.lm_head.weight)
    with VllmWorker(Path(smollm2.path), "float32", 1, 512, folder, engine_block("vllm", B)[1], engine=engine) as w:
        a = w.complete(smollm2.chat_ids([{"role": "user", "content": "hello"}]), 24, set(smollm2.stop_token_ids))
    assert a.steps > 0 and a.drafted == (B - 1) * a.steps


def test_drafter_info_prints_what_the_contract_records(llama, tmp_path, capsys):
    """`drafter info` shows the steps a dflashkit drafter was trained for, under the key training saves."""
    from dflashkit.cli import main

    save_drafter(drafter_for(llama), tmp_path / "d", trained_steps=1939, loss="ce")
    assert main(["drafter", "info", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "trained_steps    1939" in out and "loss             ce" in out
