"""Extraction and caches: consistent files, exact features, resume, strict coverage, verify, diff, CLI."""

import json

import pytest
import torch
from safetensors import safe_open

from dflashkit.cache import extract, open_cache
from dflashkit.cache import store
from dflashkit.cache.diff import diff_caches
from dflashkit.cli import main
from dflashkit.errors import DFlashError
from dflashkit.fileio import sha256_file
from dflashkit.prompts import load_prompts

LAYERS = [1, 2, 3]
CODING = load_prompts("coding-10")


@pytest.fixture(scope="module")
def short_suite(tmp_path_factory):
    """Five short prompts (fast on tiny targets), one given as chat messages."""
    f = tmp_path_factory.mktemp("prompts") / "short.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"write a function number {i} " + "x" * (3 * i)} for i in range(4)]
    rows.append({"id": "chat", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum a list"}]})
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_prompts(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_targets):
    """runs/a: 3 coding prompts, runs/b: all 10 (same tiny llama), runs/c: 10 from another target."""
    root = tmp_path_factory.mktemp("runs")
    extract(tiny_targets["llama"], CODING.subset(3), root / "a", layer_ids=LAYERS, max_new_tokens=4, progress=False)
    extract(tiny_targets["llama"], CODING, root / "b", layer_ids=LAYERS, max_new_tokens=4, progress=False)
    extract(tiny_targets["qwen3"], CODING.subset(2), root / "c", layer_ids=LAYERS, max_new_tokens=4, progress=False)
    return root


def _raise_at(exc, event: str, pid: str | None = None):
    """A callback that simulates a kill: raises `exc` at the first matching event."""
    def cb(ev, p):
        if ev == event and pid in (None, p):
            raise exc
    return cb


def _greedy_reference(target, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, full forward per token, no cache and no batching."""
    ids = list(prompt)
    for _ in range(n):
        nxt = int(target.model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt in target.stop_token_ids:
            break
    return ids[len(prompt):]


def test_extract_writes_consistent_files(tmp_path, tiny_targets, short_suite):
    t = tiny_targets["llama"]
    out = extract(t, short_suite, tmp_path / "c", layer_ids=LAYERS, max_new_tokens=8, batch_size=3, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == store.FORMAT and m["status"] == "complete"
    assert m["target"] == t.identity() and m["layer_ids"] == LAYERS
    assert m["suite"] == {"name": short_suite.name, "content_hash": short_suite.content_hash, "num_prompts": 5,
                          "prompt_ids": short_suite.ids()}
    assert m["dtype"] == "float32" and m["device"] == "cpu" and m["linear_attention"]["backend"] == "none"
    assert m["generation"]["max_new_tokens"] == 8 and m["generation"]["enable_thinking"] is False
    assert [e["id"] for e in m["prompts"]] == short_suite.ids()
    comps = json.loads((out / "completions.json").read_text())
    assert [c["id"] for c in comps] == short_suite.ids()
    for e, c, item in zip(m["prompts"], comps, short_suite.items):
        f = out / e["file"]
        assert sha256_file(f) == e["sha256"] and f.stat().st_size == e["bytes"]
        assert c["prompt_ids"] == t.chat_ids(item.messages) and e["prompt_len"] == len(c["prompt_ids"])
        with safe_open(str(f), framework="pt") as sf:
            assert sorted(sf.keys()) == ["layer_1", "layer_2", "layer_3", "tokens"]
            assert sf.get_tensor("tokens").tolist() == c["prompt_ids"] + c["completion_ids"]
            assert sf.get_tensor("layer_2").shape == (e["num_tokens"], t.hidden_size)
        # batched, left-padded generation equals plain greedy decoding token for token
        assert c["completion_ids"] == _greedy_reference(t, c["prompt_ids"], 8)
        assert c["completion_text"] == t.decode(c["completion_ids"])
    assert m["totals"]["tokens"] == sum(e["num_tokens"] for e in m["prompts"])
    assert not list(out.glob(".completions*"))  # the per-run completion logs are gone once complete
    assert store.verify_cache(out) == ([], {"prompts": 5, "tokens": m["totals"]["tokens"], "complete": True,
                                           "suite_prompts": 5})


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_features_equal_target_forward(tmp_path, tiny_targets, short_suite, kind):
    t = tiny_targets[kind]
    out = extract(t, short_suite, tmp_path / kind, layer_ids=LAYERS, max_new_tokens=6, batch_size=4, progress=False)
    cache = open_cache(out, expect_target=t.identity())
    assert len(cache) == 5 and cache.prompt_ids == short_suite.ids() and cache.shortfall is None
    H = t.hidden_size
    for rec in cache:
        ref = t.forward(rec.tokens[None], layer_ids=LAYERS, use_cache=False).features[0]
        torch.testing.assert_close(rec.features(), ref, rtol=1e-5, atol=1e-5)
        two = rec.features([3, 1])  # any subset, in the order asked for
        torch.testing.assert_close(two, torch.cat([ref[:, 2 * H:], ref[:, :H]], -1), rtol=1e-5, atol=1e-5)
        assert rec.features().dtype == torch.float32 and rec.tokens.dtype == torch.long
        assert rec.tokens.shape[0] == rec.prompt_len + len(json.loads((out / "completions.json").read_text())
                                                           [cache.prompt_ids.index(rec.id)]["completion_ids"])
    # layer selection for a drafter: only these, in this order
    sel = open_cache(out, layer_ids=[2, 1])
    assert sel.layer_ids == LAYERS and sel.record("p0").features().shape[1] == 2 * H


def test_sampled_answers_are_extra_prompts_with_their_own_features(tmp_path, tiny_targets, short_suite):
    t = tiny_targets["llama"]
    greedy = extract(t, short_suite, tmp_path / "greedy", layer_ids=LAYERS, max_new_tokens=6, progress=False)
    out = extract(t, short_suite, tmp_path / "s", layer_ids=LAYERS, max_new_tokens=6, batch_size=4, progress=False,
                  samples=2, temperature=1.5, seed=3)
    m = json.loads((out / "manifest.json").read_text())
    ids = short_suite.ids()
    assert m["suite"]["prompt_ids"] == ids + [f"{p}~s{k}" for k in (1, 2) for p in ids]
    assert m["generation"]["samples"] == 2 and m["generation"]["sample_temperature"] == 1.5
    comps = {c["id"]: c for c in json.loads((out / "completions.json").read_text())}
    ref = {c["id"]: c for c in json.loads((greedy / "completions.json").read_text())}
    for p in ids:  # the greedy answers are unchanged; the sampled ones ask the same prompt and mostly differ
        assert comps[p]["completion_ids"] == ref[p]["completion_ids"]
        assert comps[f"{p}~s1"]["prompt_ids"] == comps[p]["prompt_ids"]
    assert sum(comps[f"{p}~s{k}"]["completion_ids"] != ref[p]["completion_ids"] for p in ids for k in (1, 2)) >= 5
    cache = open_cache(out, expect_target=t.identity())
    for rec in cache:  # a sampled answer's features are the target's over its own tokens
        want = t.forward(rec.tokens[None], layer_ids=LAYERS, use_cache=False).features[0]
        torch.testing.assert_close(rec.features(), want, rtol=1e-5, atol=1e-5)
    # sampled answers added to an existing cache's greedy ones: those are reused, only the samples are generated
    more = extract(t, short_suite, tmp_path / "more", layer_ids=LAYERS, max_new_tokens=6, progress=False,
                   completions_from=greedy, samples=1, temperature=1.5, seed=3)
    added = {c["id"]: c["completion_ids"] for c in json.loads((more / "completions.json").read_text())}
    assert sorted(added) == sorted(ids + [f"{p}~s1" for p in ids])
    assert all(added[p] == ref[p]["completion_ids"] for p in ids)
    with pytest.raises(DFlashError, match="samples"):  # other settings into the same folder are refused
        extract(t, short_suite, out, layer_ids=LAYERS, max_new_tokens=6, progress=False, samples=1, temperature=1.5)
    with pytest.raises(DFlashError, match="temperature"):
        extract(t, short_suite, tmp_path / "bad", layer_ids=LAYERS, max_new_tokens=6, progress=False, samples=1,
                temperature=0)


def test_resume_after_interruption_equals_clean_run(tmp_path, tiny_targets, short_suite):
    t = tiny_targets["qwen3_5"]
    kw = dict(layer_ids=LAYERS, max_new_tokens=6, batch_size=2, progress=False)
    clean = extract(t, short_suite, tmp_path / "clean", **kw)

    class Kill(Exception):
        pass

    def kill_after(event, k):
        seen = []

        def cb(ev, pid):
            seen.append(pid) if ev == event else None
            if len(seen) == k:
                raise Kill
        return cb

    out = tmp_path / "resumed"
    with pytest.raises(Kill):  # killed during generation, after 3 prompts' files and completions were persisted
        extract(t, short_suite, out, callback=kill_after("completion", 3), **kw)
    assert len(list(out.glob("*.safetensors"))) == 3
    lost = sorted(out.glob("*.safetensors"))[0]
    lost.write_bytes(lost.read_bytes()[:100])  # e.g. copied off a full disk: its completion is still in the log
    with pytest.raises(Kill):  # killed again as the next batch writes its first file (its completion not yet logged)
        extract(t, short_suite, out, callback=kill_after("features", 1), **kw)
    assert json.loads((out / "manifest.json").read_text())["status"] == "in-progress"
    assert len(list(out.glob("*.safetensors"))) == 3 and not lost.exists()
    with pytest.raises(DFlashError, match=r"has 3 of the 5 requested prompts .*stopped after 3 of the suite's 5 .*resume"):
        open_cache(out)
    part = open_cache(out, allow_partial=True)
    assert len(part) == 3 and part.shortfall["present"] == 3 and part.shortfall["requested"] == 5
    assert part.prompt_ids == [p for p in short_suite.ids() if p not in part.shortfall["missing"]]
    assert store.verify_cache(out)[0][0].endswith("rerun the same `dflashkit extract` command to resume it")

    events = []
    extract(t, short_suite, out, callback=lambda ev, pid: events.append(ev), **kw)
    # one prompt generated (with its features), the lost file recaptured from its logged completion; nothing else
    assert events == ["features", "completion", "features"]
    a, b = open_cache(clean), open_cache(out)
    assert a.manifest["totals"] == {**b.manifest["totals"], "bytes": a.manifest["totals"]["bytes"]}
    assert json.loads((clean / "completions.json").read_text()) == json.loads((out / "completions.json").read_text())
    for ra, rb in zip(a, b):
        assert torch.equal(ra.tokens, rb.tokens) and ra.prompt_len == rb.prompt_len
        torch.testing.assert_close(ra.features(), rb.features(), rtol=1e-5, atol=1e-5)
    assert store.verify_cache(out)[0] == []

    # a rerun with the same settings does nothing; other settings are refused
    before = (out / "manifest.json").read_bytes(), (out / "manifest.json").stat().st_mtime_ns
    extract(t, short_suite, out, callback=lambda *a: pytest.fail("rerun did work"), **kw)
    assert ((out / "manifest.json").read_bytes(), (out / "manifest.json").stat().st_mtime_ns) == before
    with pytest.raises(DFlashError, match=r"different settings \(max_new_tokens 7 now vs 6 in the cache\)"):
        extract(t, short_suite, out, **{**kw, "max_new_tokens": 7})
    with pytest.raises(DFlashError, match=r"layer_ids \[1, 2\] now vs \[1, 2, 3\]"):
        extract(t, short_suite, out, **{**kw, "layer_ids": [1, 2]})


def test_resume_replaces_a_truncated_file(tmp_path, tiny_targets, short_suite):
    t = tiny_targets["llama"]
    kw = dict(layer_ids=LAYERS, max_new_tokens=4, progress=False)
    out = tmp_path / "c"
    with pytest.raises(RuntimeError):
        extract(t, short_suite, out, callback=_raise_at(RuntimeError, "features", "p3"), **kw)
    f = next(out.glob("000000-*.safetensors"))
    f.write_bytes(f.read_bytes()[:100])  # e.g. copied off a full disk
    extract(t, short_suite, out, **kw)
    assert store.verify_cache(out)[0] == []


def test_full_disk_is_a_clear_error_and_resumes(tmp_path, tiny_targets, short_suite, monkeypatch):
    import errno
    from contextlib import contextmanager

    from dflashkit.cache import extraction

    real, calls = extraction.atomic_path, []

    @contextmanager
    def filling_disk(path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        with real(path) as tmp:
            yield tmp

    monkeypatch.setattr(extraction, "atomic_path", filling_disk)
    t, out = tiny_targets["llama"], tmp_path / "full"
    with pytest.raises(DFlashError, match=r"disk full while writing .*rerun the same command: finished prompts are kept"):
        extract(t, short_suite, out, max_new_tokens=3, progress=False)  # default layers: [1, 2, 2, 2, 3] -> stored once
    assert len(list(out.glob("*.safetensors"))) == 2
    monkeypatch.setattr(extraction, "atomic_path", real)
    cache = open_cache(extract(t, short_suite, out, max_new_tokens=3, progress=False))
    assert len(cache) == 5 and cache.layer_ids == [1, 2, 3]
    assert cache.record("p1").features(t.default_layer_ids(5)).shape[1] == 5 * t.hidden_size


def test_partial_coverage_is_an_error_naming_nearby_caches(runs, tiny_targets):
    a, b, c = runs / "a", runs / "b", runs / "c"
    with pytest.raises(DFlashError) as e:
        open_cache(a, num_prompts=10)
    msg = str(e.value)
    assert msg.startswith(f"cache {a} has 3 of the 10 requested prompts (fizzbuzz, binary_search, linked_list_reverse); "
                          f"caches nearby: {b} (10 prompts, same target), {c} (2 prompts, target qwen3)")
    # the Python API names its own argument only; the CLI names its flag only (issue 14, item 7)
    assert "pass allow_partial=True to proceed" in msg and "--allow-partial" not in msg
    with pytest.raises(DFlashError) as e:
        open_cache(a, num_prompts=10, partial_hint="--allow-partial")
    assert "pass --allow-partial to proceed" in str(e.value) and "allow_partial=True" not in str(e.value)
    d = runs / "d"  # an unfinished extraction beside them is listed as such
    with pytest.raises(KeyboardInterrupt):
        extract(tiny_targets["llama"], CODING.subset(4), d, layer_ids=LAYERS, max_new_tokens=4, progress=False,
                callback=_raise_at(KeyboardInterrupt, "features"))
    with pytest.raises(DFlashError, match=f"{d} \\(1 of 4 prompts so far, same target, incomplete\\)"):
        open_cache(a, num_prompts=10)
    import shutil
    shutil.rmtree(d)
    cache = open_cache(a, num_prompts=10, allow_partial=True)
    assert cache.prompt_ids == ["fizzbuzz", "binary_search", "linked_list_reverse"]
    assert cache.shortfall["requested"] == 10 and cache.shortfall["present"] == 3 and cache.shortfall["missing_count"] == 7
    # a cache of the full suite serves fewer prompts, the first ones in suite order, without a shortfall
    few = open_cache(b, num_prompts=4)
    assert few.prompt_ids == CODING.ids()[:4] and few.shortfall is None and len(list(few)) == 4
    assert len(open_cache(a)) == 3  # all of its own suite: complete


def test_mismatches_are_errors(runs, tiny_targets):
    b = runs / "b"
    with pytest.raises(DFlashError, match=r"holds target layers \[1, 2, 3\] but layers \[4\] were asked for"):
        open_cache(b, layer_ids=[1, 4])
    with pytest.raises(DFlashError, match=r"cache .*b was made with target llama \(weights [0-9a-f]{16}, config .*not with "
                                          r"the target in use qwen3 .*extract a cache with this target"):
        open_cache(b, expect_target=tiny_targets["qwen3"].identity())
    with pytest.raises(DFlashError, match="holds hidden size 64 .* has hidden size 576"):
        open_cache(b, expect_target={**tiny_targets["llama"].identity(), "hidden_size": 576})
    assert len(open_cache(b, expect_target=tiny_targets["llama"].identity())) == 10
    with pytest.raises(DFlashError, match="not a dflashkit cache"):
        open_cache(runs / "nope")


def test_verify_catches_corruption_and_manifest_disagreement(tmp_path, runs):
    import shutil

    def fresh(name):
        d = tmp_path / name
        shutil.copytree(runs / "a", d)
        return d, sorted(d.glob("*.safetensors"))

    d, files = fresh("truncated")
    files[0].write_bytes(files[0].read_bytes()[:-200])
    problems, _ = store.verify_cache(d)
    assert any("truncated" in p for p in problems) and any("sha256 differs" in p for p in problems)
    with pytest.raises(DFlashError, match="truncated or corrupt"):
        open_cache(d).record("fizzbuzz").features()

    d, files = fresh("flipped")
    raw = bytearray(files[1].read_bytes())
    raw[-7] ^= 0xFF  # one feature byte: shapes still fine, only the hash can tell
    files[1].write_bytes(bytes(raw))
    problems, _ = store.verify_cache(d)
    assert problems == [f"{files[1]}: sha256 differs from the manifest: the file is corrupt or was changed"]

    d, files = fresh("manifest")
    m = json.loads((d / "manifest.json").read_text())
    m["prompts"] = m["prompts"][:2]
    (d / "manifest.json").write_text(json.dumps(m))
    problems, _ = store.verify_cache(d)
    assert any("lists 2 prompt entries but its suite has 3" in p for p in problems)
    assert any(p == f"{files[2]}: not listed in {d / 'manifest.json'}" for p in problems)

    d, files = fresh("missing")
    files[2].unlink()
    assert any("missing (listed for prompt 'linked_list_reverse')" in p for p in store.verify_cache(d)[0])
    with pytest.raises(DFlashError, match="missing, though .* lists it"):
        open_cache(d)


def test_sharded_layout(tmp_path, tiny_targets, short_suite, monkeypatch):
    monkeypatch.setattr(store, "SHARD_THRESHOLD", 3)
    monkeypatch.setattr(store, "SHARD_SIZE", 2)
    out = extract(tiny_targets["llama"], short_suite, tmp_path / "s", layer_ids=LAYERS, max_new_tokens=3, progress=False)
    assert sorted(p.parent.name for p in out.rglob("*.safetensors")) == ["shard-0000"] * 2 + ["shard-0001"] * 2 + ["shard-0002"]
    cache = open_cache(out)
    assert cache.manifest["layout"]["sharded"] and len(cache) == 5 and cache.record("chat").features().shape[1] == 192
    assert store.verify_cache(out)[0] == []


def _reference_diff(ca, cb, pids, layers, H):
    """Straightforward per-token statistics, written out independently of dflashkit.cache.diff."""
    out = {}
    for k, l in enumerate(layers):
        A = torch.cat([ca.record(p).features([l]) for p in pids]).double()
        B = torch.cat([cb.record(p).features([l]) for p in pids]).double()
        cos = [float(A[i] @ B[i] / (A[i].norm() * B[i].norm())) for i in range(A.shape[0])]
        out[l] = {"cos_mean": sum(cos) / len(cos), "cos_min": min(cos), "mean_abs": float((A - B).abs().mean()),
                  "max_abs": float((A - B).abs().max()), "rel_err": float((A - B).norm() / A.norm()), "tokens": A.shape[0]}
    return out


def test_diff_two_linear_attention_backends(tmp_path, tiny_targets, short_suite, capsys):
    t = tiny_targets["qwen3_5"]
    kw = dict(layer_ids=LAYERS, max_new_tokens=6, progress=False)
    a = extract(t, short_suite, tmp_path / "torch", linear_attention="torch", **kw)
    b = extract(t, short_suite, tmp_path / "recurrent", linear_attention="torch-recurrent", **kw)
    assert open_cache(b).manifest["linear_attention"] == {"requested": "torch-recurrent", "backend": "torch-recurrent"}
    r = diff_caches(a, b)
    assert r["settings_differ"] == {"linear_attention": ("torch", "torch-recurrent")}
    assert r["compared"] == short_suite.ids() and r["skipped"] == {}
    ref = _reference_diff(open_cache(a), open_cache(b), r["compared"], LAYERS, t.hidden_size)
    for l in LAYERS:
        for key, v in ref[l].items():
            assert r["layers"][l][key] == pytest.approx(v, rel=1e-6, abs=1e-12), (l, key)
    # the chunked and the token-by-token recurrences agree closely but not bit for bit on CPU
    assert 0 < r["layers"][1]["max_abs"] < 1e-4 and r["layers"][3]["cos_min"] > 0.99999

    # prompts whose tokens differ are skipped, each with its reason
    import shutil
    from safetensors.torch import load_file, save_file

    d = tmp_path / "edited"
    shutil.copytree(b, d)
    m = json.loads((d / "manifest.json").read_text())
    e = m["prompts"][0]
    tensors = load_file(d / e["file"])
    last = int(tensors["tokens"][-1])
    tensors["tokens"][-1] = last + 1
    save_file(tensors, d / e["file"], metadata={"prompt_id": "p0", "prompt_len": str(e["prompt_len"])})
    (d / "manifest.json").write_text(json.dumps(m))
    r = diff_caches(a, d)
    pos = e["num_tokens"] - 1
    assert r["skipped"] == {"p0": f"token sequences differ from position {pos} ({last} vs {last + 1})"}
    assert r["compared"] == short_suite.ids()[1:] and r["layers"][1]["tokens"] == ref[1]["tokens"] - e["num_tokens"]
    c = extract(t, short_suite.subset(3), tmp_path / "short", **{**kw, "max_new_tokens": 2})
    with pytest.raises(DFlashError, match=r"share no prompt with identical tokens \(p0: token sequences differ in length"):
        diff_caches(a, c)

    assert main(["cache", "diff", str(a), str(b), "--min-cosine", "0.999"]) == 0
    out = capsys.readouterr().out
    assert "settings that differ: linear_attention 'torch' vs 'torch-recurrent'" in out and "PASS" in out
    assert main(["cache", "diff", str(a), str(b), "--min-cosine", "1.5", "--out", str(tmp_path / "d.json")]) == 1
    assert json.loads((tmp_path / "d.json").read_text())["below"] == LAYERS
    capsys.readouterr()
    assert main(["cache", "diff", str(a), str(b), "--min-cosine", "1.5", "--json"]) == 1  # JSON on stdout
    assert json.loads(capsys.readouterr().out)["below"] == LAYERS


def test_cli_exit_codes(tmp_path, tiny_dirs, runs, capsys):
    out = tmp_path / "cli"
    args = ["extract", "--target", str(tiny_dirs["llama"]), "--prompts", "coding-10", "--num-prompts", "2",
            "--out", str(out), "--target-layers", "1,2", "--max-new-tokens", "3", "--quiet"]
    assert main(args) == 0
    assert main(args) == 0  # complete: nothing to do
    assert main(args[:-2] + ["4", "--quiet"]) == 2  # other settings: refused
    assert "different settings (max_new_tokens 4 now vs 3 in the cache)" in capsys.readouterr().err
    assert main(["extract", "--target", str(tiny_dirs["llama"]), "--prompts", str(tmp_path / "none.jsonl"),
                 "--out", str(tmp_path / "x")]) == 2
    assert main(["cache", "verify", str(out)]) == 0
    assert main(["cache", "inspect", str(out)]) == 0
    assert "layer ids        [1, 2]" in capsys.readouterr().out
    assert main(["cache", "ls", str(runs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [l.split()[0] for l in lines] == [str(runs / n) for n in "abc"]
    assert "10 prompts" in lines[1] and "layers [1, 2, 3]" in lines[1] and "target llama" in lines[1]
    f = next(out.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-10])
    assert main(["cache", "verify", str(out)]) == 1
    assert main(["cache", "verify", str(tmp_path)]) == 2
    assert main(["cache", "diff", str(runs / "a"), str(runs / "c")]) == 2  # different targets share no tokens
    assert "share no prompt with identical tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_extract_matches_forward(tmp_path, smollm2):
    out = extract(smollm2, CODING.subset(1), tmp_path / "s", max_new_tokens=5, progress=False)
    cache = open_cache(out, num_prompts=1, expect_target=smollm2.identity(), layer_ids=[1, 8, 14, 20, 27])
    assert cache.layer_ids == [1, 8, 14, 20, 27]  # the z-lab default for 30 layers
    rec = cache.record("fizzbuzz")
    ref = smollm2.forward(rec.tokens[None], layer_ids=cache.layer_ids, use_cache=False, compute_logits=False)
    torch.testing.assert_close(rec.features(), ref.features[0], rtol=1e-4, atol=1e-4)
    # greedy with the KV cache, one token at a time, as the reference for the batched generation
    prompt = rec.tokens[: rec.prompt_len][None]
    out = smollm2.model(prompt, use_cache=True)
    comp = [int(out.logits[0, -1].argmax())]
    while len(comp) < 5 and comp[-1] not in smollm2.stop_token_ids:
        out = smollm2.model(torch.tensor([[comp[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        comp.append(int(out.logits[0, -1].argmax()))
    assert rec.tokens[rec.prompt_len:].tolist() == comp


def test_progress_bars_rate_a_whole_batch_finishing_at_once_over_the_whole_run():
    """A batch of 32 prompts lands in one instant: a moving-average rate read that as 51 s per prompt and printed an
    ETA of an hour for a two-minute stage. The bar's rate is the run's average instead."""
    from dflashkit.cache.extraction import _bar

    bar = _bar(96, "generate", enabled=True)
    bar.update(32)
    assert bar.smoothing == 0
    bar.close()
