"""`drafter export`: the token map written where the engine reads it, tau as trained and as exported, and the
DFlash GGUF's draft vocabulary added to llama.cpp's converter layout (recorded from build 11434)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cache import extract, open_cache
from dflashkit.cli import main
from dflashkit.drafter.checkpoint import load_drafter, new_drafter, save_drafter
from dflashkit.errors import DFlashError
from dflashkit.evaluate.offline import evaluate
from dflashkit.export import export_drafter
from dflashkit.prompts import load_prompts

LAYERS = [1, 3]
LAYOUT = Path(__file__).parent / "data" / "llama_cpp_dflash_layout.json"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_targets):
    """The tiny llama, a 2-prompt cache and one random drafter saved with and without a draft vocabulary that
    leaves out half the tokens the target answers with (so the two vocabularies score differently)."""
    t = tiny_targets["llama"]
    root = tmp_path_factory.mktemp("export")
    cache = extract(t, load_prompts("coding-10").subset(2), root / "cache", layer_ids=LAYERS, max_new_tokens=24,
                    progress=False)
    answered = sorted({int(x) for rec in open_cache(cache) for x in rec.tokens[rec.prompt_len:]})
    vocab = sorted(set(range(3, 200)) - set(answered[::2]))
    torch.manual_seed(0)
    d = new_drafter(t, num_layers=1, target_layer_ids=LAYERS, block_size=4).eval()
    save_drafter(d, root / "mapped", target_identity=t.identity(), draft_vocab=vocab)
    save_drafter(d, root / "full", target_identity=t.identity())
    return t, root, cache, vocab


def test_zlab_export_keeps_the_token_map_and_reads_it_back(setup, capsys):
    t, root, _, vocab = setup
    assert main(["drafter", "export", "--drafter", str(root / "mapped"), "--out", str(root / "z"),
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"the {len(vocab)}-token draft vocabulary, kept as the token map d2t" in out
    state = load_file(root / "z" / "model.safetensors")
    ids = torch.tensor(vocab)
    assert torch.equal(state["d2t"], ids - torch.arange(len(ids)))  # EAGLE-3's offsets, what vLLM reads
    assert torch.equal(state["lm_head.weight"], t.lm_head.weight.detach()[ids])
    assert json.loads((root / "z" / "config.json").read_text())["draft_vocab_size"] == len(vocab)
    back = load_drafter(root / "z")
    assert back.contract["draft_vocab"] == vocab
    assert "Draft vocabulary: %d tokens" % len(vocab) in "\n".join(back.load_report)


def test_full_vocab_export_drops_the_map(setup, capsys):
    t, root, _, vocab = setup
    assert main(["drafter", "export", "--drafter", str(root / "mapped"), "--out", str(root / "zf"),
                 "--full-vocab"]) == 0
    out = capsys.readouterr().out
    assert f"trained over {len(vocab)} tokens, exported over all {t.lm_head.weight.shape[0]}" in out
    assert "tau as exported: not measured; pass --cache" in out
    assert "d2t" not in load_file(root / "zf" / "model.safetensors")
    assert load_drafter(root / "zf").contract is None


def test_export_states_tau_as_trained_and_as_exported(setup):
    """As exported over the full vocabulary = the same weights evaluated with no draft vocabulary at all."""
    t, root, cache, vocab = setup
    res = export_drafter(root / "mapped", root / "zt", dtype="float32", full_vocab=True, cache=str(cache))
    mapped = evaluate(load_drafter(root / "mapped"), t, open_cache(cache), trees=())["overall"]
    full = evaluate(load_drafter(root / "full"), t, open_cache(cache), trees=())["overall"]
    assert res["tau"]["as_trained"] == pytest.approx(mapped["tau"])
    assert res["tau"]["as_exported"] == pytest.approx(full["tau"])
    assert mapped["as_exported"]["tau"] == pytest.approx(full["tau"])
    assert mapped["tau"] != pytest.approx(full["tau"])  # the fixture's vocabulary matters, or this test is empty
    assert any(line.startswith("tau (offline, 2 prompts") for line in res["lines"])
    kept = export_drafter(root / "mapped", root / "zk", dtype="float32", cache=str(cache))
    assert kept["tau"]["as_exported"] == kept["tau"]["as_trained"] == pytest.approx(mapped["tau"])


def test_export_measures_tau_on_the_format_its_cache_was_extracted_at(setup, capsys):
    """A cache of the target as served (q8_0 here): the export's tau is the drafter on those features, and it says
    at which format, beside the one the drafter trained at."""
    from dflashkit.targets.model import load_target

    t, root, _, _ = setup
    q = load_target(t.path, device="cpu", dtype="float32", weights="q8_0")
    cache = extract(q, load_prompts("coding-10").subset(2), root / "cache-q8_0", layer_ids=LAYERS, max_new_tokens=24,
                    progress=False)
    res = export_drafter(root / "full", root / "zq", dtype="float32", cache=str(cache))
    want = evaluate(load_drafter(root / "full"), q, open_cache(cache), trees=())["overall"]["tau"]
    assert (res["measured_at"], res["trained_at"], res["tau"]["as_trained"]) == ("q8_0", "float", pytest.approx(want))
    assert "the target's features at q8_0; the drafter trained at float" in "\n".join(res["lines"])
    assert "for its tau on the target as served pass --cache" in "\n".join(
        export_drafter(root / "full", root / "zn", dtype="float32")["lines"])


def test_export_errors_name_the_fix(setup, tmp_path, machine_env):
    t, root, _, _ = setup
    with pytest.raises(DFlashError, match=r"name it \*\.gguf"):
        export_drafter(root / "mapped", tmp_path / "d", fmt="gguf")
    machine_env(DFLASHKIT_ENGINES=tmp_path / "no-engines")
    with pytest.raises(DFlashError, match=r"dflashkit (--isa \S+ )?engines install llama.cpp"):
        export_drafter(root / "mapped", tmp_path / "d.gguf", fmt="gguf")
    export_drafter(root / "mapped", tmp_path / "z", dtype="float32")
    with pytest.raises(DFlashError, match="records no target.*pass --target"):  # a z-lab folder names no target
        export_drafter(tmp_path / "z", tmp_path / "z2")
    export_drafter(tmp_path / "z", tmp_path / "z2", target_ref=str(t.path))


# ---- the GGUF: llama.cpp's converter layout + the token map ------------------------------------------------------


def synthetic_converter_gguf(path: Path, layout: dict) -> dict:
    """A GGUF with the recorded converter output's keys and tensor names/shapes/types, random data."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "dflash")
    for key, (value, vtype, sub) in layout["kv"].items():
        w.add_key_value(key, value, gguf.GGUFValueType[vtype], sub_type=gguf.GGUFValueType[sub] if sub else None)
    data = {}
    for name, shape, ttype in layout["tensors"]:
        x = rng.standard_normal(list(reversed(shape))).astype(np.float32)  # gguf shapes are listed fastest first
        if ttype == "BF16":
            raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, x)
        data[name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return data


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_token_map_is_added_to_the_converter_layout_tensor_by_tensor(arch, tmp_path):
    import gguf

    from dflashkit.drafter.gguf import add_token_map, read_token_map

    layout = json.loads(LAYOUT.read_text())[arch]
    src = tmp_path / "plain.gguf"
    synthetic_converter_gguf(src, layout)
    hidden = layout["hidden_size"]
    vocab = [5, 9, 2, 400, 17]
    head = np.random.default_rng(1).standard_normal((layout["vocab_size"], hidden)).astype(np.float32)
    add_token_map(src, tmp_path / "mapped.gguf", vocab, head)
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(tmp_path / "mapped.gguf"))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(tb) == set(ta) | {"d2t", "output.weight"}
    for name, t in ta.items():
        if name == "output.weight":
            continue
        assert tb[name].tensor_type == t.tensor_type and list(tb[name].shape) == list(t.shape), name
        assert np.array_equal(np.asarray(tb[name].data), np.asarray(t.data)), name
    fields = {k for k in a.fields if not k.startswith("GGUF.")}
    assert fields == {k for k in b.fields if not k.startswith("GGUF.")}
    for k in fields:
        assert [bytes(p) for p in a.fields[k].parts] == [bytes(p) for p in b.fields[k].parts], k
    assert read_token_map(tmp_path / "mapped.gguf") == vocab and read_token_map(src) is None
    out = tb["output.weight"]
    assert list(out.shape) == [hidden, len(vocab)]
    rows = np.asarray(out.data)
    if out.tensor_type == gguf.GGMLQuantizationType.BF16:
        rows = gguf.quants.dequantize(rows, out.tensor_type)
    np.testing.assert_allclose(rows.reshape(len(vocab), hidden), head[vocab], rtol=1e-2, atol=1e-2)


def test_token_map_refuses_what_is_not_a_dflash_gguf(tmp_path):
    import gguf

    from dflashkit.drafter.gguf import add_token_map

    w = gguf.GGUFWriter(str(tmp_path / "l.gguf"), "llama")
    w.add_tensor("fc.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DFlashError, match="is 'llama', not dflash"):
        add_token_map(tmp_path / "l.gguf", tmp_path / "o.gguf", [1], np.zeros((4, 2), np.float32))
    assert not (tmp_path / "o.gguf").exists()
