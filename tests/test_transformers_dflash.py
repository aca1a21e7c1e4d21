"""Our drafters in transformers' own DFlash (issue 71): `drafter export --format transformers` writes a folder
AutoModel loads as transformers' DFlash drafter; `generate(..., speculation_type="dflash")` with it is a third
reference beside our chain and z-lab's loop (same tokens, same rounds, the same drafts each round); load_drafter
reads such a folder back; what the format cannot carry is refused by name."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode.speculative import DFlashProposer, generate
from dflashkit.drafter.checkpoint import load_drafter, new_drafter, save_drafter
from dflashkit.errors import DFlashError
from dflashkit.export import export_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exported(tiny_targets, tmp_path_factory):
    t = tiny_targets["llama"]
    root = tmp_path_factory.mktemp("tf")
    torch.manual_seed(0)
    d = new_drafter(t, num_layers=2, target_layer_ids=[1, 3], block_size=4).eval()
    save_drafter(d, root / "d", target_identity=t.identity())
    res = export_drafter(root / "d", root / "hf", "transformers", dtype="float32", target_ref=str(t.path))
    return t, d, root, res


def test_the_export_is_transformers_own_drafter_and_reads_back_as_ours(exported):
    from transformers import AutoModel

    t, d, root, res = exported
    m = AutoModel.from_pretrained(root / "hf")
    assert type(m).__name__ == "MuseGlimmerAssistantModel" and m.config.block_size == 4
    assert m.config.target_layer_ids == [1, 3] and m.config.mask_token_id == d.config.mask_token_id
    assert res["format"] == "transformers" and "speculation_type='dflash'" in "\n".join(res["lines"])
    back = load_drafter(root / "hf")
    assert back.load_report[0].startswith("Format: transformers' DFlash drafter")
    mine, theirs = d.state_dict(), back.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert back.config.to_zlab() == d.config.to_zlab()  # every field the drafter runs with


def test_transformers_dflash_loop_drafts_and_accepts_as_our_chain_round_for_round(exported, monkeypatch):
    """A third reference: transformers' DFlash loop and our chain on the hf backend, with the same exported drafter,
    give plain greedy decoding's tokens, the same number of target forwards and the same drafter logits every round
    (the drafter's context, block, positions, RoPE and head agree)."""
    from transformers import AutoModel
    from transformers.generation import candidate_generator as cg

    t, d, root, _ = exported
    ids = t.chat_ids([{"role": "user", "content": "def add(a, b): return a + b  # and more text"}])
    plain = generate(t, ids, "ar", max_new_tokens=30, stop_ids=[]).tokens
    theirs, ours = [], []
    real_candidates = cg.DFlashTokenCandidateGenerator.get_candidates

    def record(self, input_ids, *a, **k):
        out, logits = real_candidates(self, input_ids, *a, **k)
        if logits is not None:
            theirs.append(logits[0].float())
        return out, logits

    monkeypatch.setattr(cg.DFlashTokenCandidateGenerator, "get_candidates", record)
    forwards = []
    hook = t.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        out = t.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               assistant_model=AutoModel.from_pretrained(root / "hf"), speculation_type="dflash",
                               max_new_tokens=30, do_sample=False, eos_token_id=None)
    finally:
        hook.remove()
    proposer = DFlashProposer(t, d)  # the drafter as trained, not the export read back
    real_propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda *a: ours.append(r := real_propose(*a)) or r)
    g = generate(t, ids, "chain", proposer, max_new_tokens=30, stop_ids=[])
    assert out[0, len(ids):].tolist() == plain == g.tokens
    assert len(g.accepted) - 1 <= len(theirs) <= len(ours)
    for mine, other in zip(ours, theirs):  # each round's drafter logits: the drafts and what they were chosen from
        torch.testing.assert_close(other, mine, atol=1e-4, rtol=1e-4)
    assert len(forwards) - 1 >= len(g.accepted)  # one prefill, then a verify a round (the last may be extra)


def test_what_the_format_cannot_carry_is_refused_by_name(tiny_targets, tmp_path):
    t = tiny_targets["llama"]
    d = new_drafter(t, num_layers=1, target_layer_ids=[1, 3], block_size=4,
                    layer_types=["sliding_attention"], sliding_window=8)
    with pytest.raises(DFlashError, match="transformers format: sliding-window layers"):
        save_drafter(d, tmp_path / "s", format="transformers")
    d = new_drafter(t, num_layers=1, target_layer_ids=[1, 3], block_size=4)
    d.contract = {"draft_vocab": list(range(40))}
    with pytest.raises(DFlashError, match="a draft vocabulary: .*--full-vocab"):
        save_drafter(d, tmp_path / "v", format="transformers", lm_head=t.lm_head.weight)


def test_bench_runs_transformers_dflash_beside_our_chain_and_checks_its_tokens(exported):
    """The bench peer: transformers' DFlash loop with our drafter, its tokens held to greedy like every row, its
    tokens per target forward recorded as tau (here equal to our chain's: the same drafter, the same rounds)."""
    from dflashkit.measure.bench import bench_markdown, parse_methods, run_bench
    from dflashkit.measure.records import run_record

    t, d, _, _ = exported
    prompts = [(p, t.chat_ids([{"role": "user", "content": p}])) for p in ("def add(a, b):", "sort a list")]
    res = run_bench(t, d, prompts, parse_methods("ar,chain,hf-generate,transformers-dflash"), max_new_tokens=16,
                    progress=False, warmup=False, predict=False)
    assert res["mismatches"] == [] and set(res["methods"]) >= {"ar", "chain", "hf-generate", "transformers-dflash"}
    tf, chain = res["methods"]["transformers-dflash"], res["methods"]["chain"]
    assert tf["tau"] == pytest.approx(chain["tau"]) and tf["tokens_per_s"] > 0
    rec = run_record(next(r for r in res["runs"] if r["method"] == "transformers-dflash"), 0, {"name": t.name}, "float32")
    assert rec["engine"] == "transformers" and rec["tau"] == pytest.approx(sum(rec["tokens_per_round"]) / rec["rounds"])
    assert "| transformers-dflash |" in bench_markdown(res)
