"""The family matrix (issue 37): every fixture family loads by structure, its features are HF's hidden states, and
online ar and chain equal greedy decoding in float32, sliding-window families (gpt-oss, Gemma 4) included."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dflashkit.errors import DFlashError
from dflashkit.families import STAGES, family_matrix, greedy_reference, matrix_markdown, with_matrix
from dflashkit.target.fixtures import ALL_KINDS, FAMILIES, make_tiny_target
from dflashkit.target.model import cpu_has_bf16_matmul, load_target

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group(name="families")]
DOC = Path(__file__).resolve().parents[1] / "docs" / "targets.md"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def matrix(root):
    return {r["family"]: r for r in family_matrix(root)}


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_family_matrix(matrix, kind):
    row = {k: v for k, v in matrix[kind].items() if k != "family"}
    assert row == dict.fromkeys(STAGES, "pass"), (kind, row)


def test_the_supported_targets_table_is_the_matrix(matrix):
    """docs/targets.md holds the table this matrix writes (`python -m dflashkit.families --write docs/targets.md`)."""
    doc = DOC.read_text()
    assert with_matrix(doc, list(matrix.values())) == doc, "docs/targets.md is stale: regenerate it"


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


@pytest.mark.skipif(not cpu_has_bf16_matmul(),
                    reason="bf16 decoding is checked on CPUs with native bf16 dot products")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bf16_online_methods_equal_bf16_plain_decoding(root, kind):
    """On a bf16 CPU decoding runs row-invariant kernels, so every method equals bf16 plain decoding (ours)."""
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
