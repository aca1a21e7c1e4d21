"""The family matrix (issue 37): every fixture family loads by structure, its features are HF's hidden states, and
online ar and chain equal greedy decoding in float32, sliding-window families (gpt-oss, Gemma 4) included."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dflashkit.errors import DFlashError
from families import GDN_INEXACT, STAGES, family_matrix, greedy_reference, matrix_markdown, with_matrix
from tiny_targets import ALL_KINDS, FAMILIES, make_tiny_target
from dflashkit.targets.model import load_target

# slow: the matrix builds every family's tiny target (23 s of setup on 2 cores); `make test` runs it, test-fast not
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group(name="families"), pytest.mark.slow]
DOC = Path(__file__).resolve().parents[1] / "docs" / "targets.md"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def matrix(root):
    """matrix(kind): that family's row, built on first use, so that each worker builds only the families it runs."""
    rows = {}
    return lambda kind: rows.get(kind) or rows.setdefault(kind, family_matrix(root, [kind])[0])


HYBRIDS = ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next")  # Gated DeltaNet layers beside attention


def expected_row(kind: str) -> dict:
    """What every stage must say for this family: pass, but z-lab's loop, which is itself inexact on hybrids."""
    return dict.fromkeys(STAGES, "pass") | ({"zlab-loop": f"n/a: {GDN_INEXACT}"} if kind in HYBRIDS else {})


# the families in two groups, one a worker: the matrix is most of this module's time
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.xdist_group(name=f"families-{i % 2}"))
                                  for i, k in enumerate(ALL_KINDS)])
def test_family_matrix(matrix, kind):
    row = {k: v for k, v in matrix(kind).items() if k != "family"}
    assert row == expected_row(kind), (kind, row)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_the_reference_crop_keeps_rejected_drafts_in_the_recurrent_state(root, kind):
    """Why the matrix cannot hold hybrids to z-lab's loop: after its verify-then-crop, the next logits are not a
    clean forward's. When this fails, transformers rolls the state back and the hybrids' cell should be compared."""
    ref = pytest.importorskip("dflash.model", reason="make test installs dflash==0.1.0 (--no-deps)")
    import torch
    from transformers import DynamicCache

    t = load_target(make_tiny_target(kind, root / kind), device="cpu", dtype="float32")
    ids = t.chat_ids([{"role": "user", "content": "hi"}])
    n, cache = len(ids), DynamicCache(config=t.model.config)
    cache.activate_past_recording()
    first = int(t.model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1].argmax())
    verify = t.model(torch.tensor([[first, 5, 6, 7]]), position_ids=torch.arange(n, n + 4)[None],
                     past_key_values=cache, use_cache=True)  # three drafts, all rejected
    ref._crop_to(cache, n + 1)
    nxt = int(verify.logits[0, 0].argmax())
    after = t.model(torch.tensor([[nxt]]), position_ids=torch.tensor([[n + 1]]), past_key_values=cache,
                    use_cache=True).logits[0, -1]
    clean = t.model(torch.tensor([ids + [first, nxt]])).logits[0, -1]
    assert cache.get_seq_length() == n + 2  # the attention layers were rolled back ...
    assert (after - clean).abs().max() > 1e-3  # ... the recurrent state was not


def test_drafter_inputs_are_the_unscaled_embedding_rows(root):
    """Gemma's embedding module scales by sqrt(hidden); z-lab's loop feeds drafters the table's rows unscaled."""
    import torch

    t = load_target(make_tiny_target("gemma4", root / "gemma4"), device="cpu", dtype="float32")
    ids = torch.tensor([3, 7, 11])
    torch.testing.assert_close(t.embed(ids), t.embed_tokens.weight[ids], rtol=0, atol=0)
    assert not torch.allclose(t.embed_tokens(ids), t.embed(ids))  # the module's own output is scaled


@pytest.mark.parametrize("doc", [DOC, DOC.parents[1] / "README.md"], ids=["docs/targets.md", "README.md"])
def test_the_supported_targets_tables_are_the_matrix(doc):
    """docs/targets.md and the README hold the tables this matrix writes
    (`python tests/families.py --write docs/targets.md README.md`): the expected rows, which test_family_matrix holds
    each family's built row to."""
    text = doc.read_text()
    rows = [{"family": k, **expected_row(k)} for k in ALL_KINDS]
    assert with_matrix(text, rows) == text, f"{doc.name} is stale: regenerate it"


def test_a_document_without_markers_is_refused():
    with pytest.raises(ValueError, match="no table markers"):
        with_matrix("# nothing here\n", [])


def test_matrix_rows_make_a_table():
    rows = [{"family": "a", **dict.fromkeys(STAGES, "pass")},
            {"family": "b", **dict.fromkeys(STAGES, "pass"), "ar": "refused: target b (b) has chunked attention"}]
    table = matrix_markdown(rows).splitlines()
    assert table[0] == "| family | examples | " + " | ".join(STAGES) + " |"
    cells = ["pass"] * len(STAGES)
    cells[STAGES.index("ar")] = "refused"
    assert table[3] == "| b |  | " + " | ".join(cells) + " |"


def test_families_decode_more_than_a_stop_token(root):
    """The greedy references the matrix compares with are real continuations, not an immediate stop."""
    for kind in FAMILIES:
        t = load_target(make_tiny_target(kind, root / kind), device="cpu", dtype="float32")
        assert len(greedy_reference(t, t.chat_ids([{"role": "user", "content": "hi"}]), 6)) == 6, kind


def test_vl_checkpoint_loads_as_its_language_model(root):
    t = load_target(make_tiny_target("qwen3_5_vl", root / "qwen3_5_vl"), device="cpu", dtype="float32")
    assert type(t.model).__name__ == "Qwen3_5ForCausalLM" and not any("visual" in k for k in t.model.state_dict())
    assert t.num_layers == 5 and t.hidden_size == 64 and t.is_hybrid


@pytest.mark.parametrize("edit", ["renamed", "missing"])
def test_vl_checkpoint_with_a_broken_language_model_weight_is_refused(root, tmp_path, edit):
    folder = tmp_path / "vl"
    shutil.copytree(make_tiny_target("qwen3_5_vl", root / "qwen3_5_vl"), folder)
    weights = folder / "model.safetensors"
    sd = load_file(weights)
    name = "model.language_model.layers.1.mlp.up_proj.weight"
    tensor = sd.pop(name)
    if edit == "renamed":
        sd[name.replace("up_proj", "up_projection")] = tensor
    save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(DFlashError) as e:
        load_target(folder, device="cpu", dtype="float32")
    msg = str(e.value)
    assert str(folder) in msg and "model.layers.1.mlp.up_proj.weight" in msg and "missing" in msg
    if edit == "renamed":
        assert "model.layers.1.mlp.up_projection.weight" in msg and "dropped" in msg


@pytest.mark.xdist_group(name="families-bf16")  # its own group: the other worker runs it beside the matrix
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bf16_online_methods_equal_bf16_plain_decoding(root, kind):
    """Decoding runs row-invariant kernels in bf16, so every method equals bf16 plain decoding (ours): on every CPU,
    emulated where it has no native bf16 dot products (slower, and what a user without them runs too)."""
    import torch

    from dflashkit.decode.speculative import DFlashProposer, generate, new_lookup
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.rng import seeded

    t = load_target(make_tiny_target(kind, root / kind), device="cpu", dtype="bfloat16")
    ids = t.chat_ids([{"role": "user", "content": "the quick brown fox jumps over"}])
    with seeded(0):
        d = new_drafter(t, num_layers=1, block_size=4, target_layer_ids=t.default_layer_ids(1)).to(torch.bfloat16)
    ref = generate(t, ids, "ar", max_new_tokens=16).tokens
    p = DFlashProposer(t, d.eval())
    for method in ("chain", "ddtree-4", "ngram", "hybrid-4"):
        got = generate(t, ids, method, None if method == "ngram" else p, max_new_tokens=16,
                       ngram=new_lookup(method) if method in ("ngram", "hybrid-4") else None).tokens
        assert got == ref, (kind, method)
