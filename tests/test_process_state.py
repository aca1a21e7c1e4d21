"""Only cli.main changes process state (docs/design.md section 12): no library module sets an environment
variable, transformers' verbosity, torch's global seed or runs pip, and the seeded blocks restore the caller's
random state."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import dflashkit
from dflashkit.rng import seeded

ROOT = Path(dflashkit.__file__).parent
FORBIDDEN = {
    "sets an environment variable": r"os\.environ\[[^\]]+\]\s*=|os\.environ\.(setdefault|update)\(|os\.putenv",
    "sets transformers' logging": r"set_verbosity|disable_progress_bar",
    "seeds torch for good": r"(?<![\w.])torch\.manual_seed\(|torch\.random\.manual_seed\(",
    "runs pip": r"[\"']pip[\"']",
}
# the allowed places, each with its reason in docs/design.md section 12
ALLOWED = {"cli.py", "rng.py", "targets/cli.py", "drafter/cli.py", "measure/cli.py", "engines/install.py"}


def test_no_library_module_changes_process_state():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        for what, pattern in FORBIDDEN.items():
            for m in re.finditer(pattern, text):
                if rel not in ALLOWED:
                    line = text.count("\n", 0, m.start()) + 1
                    bad.append(f"dflashkit/{rel}:{line} {what}")
    assert not bad, "\n".join(bad)


def test_pattern_catches_what_it_names():
    assert re.search(FORBIDDEN["seeds torch for good"], "    torch.manual_seed(0)")
    assert not re.search(FORBIDDEN["seeds torch for good"], "torch.Generator().manual_seed(0)")
    assert re.search(FORBIDDEN["sets an environment variable"], 'os.environ["A"] = "1"')


def test_seeded_restores_the_callers_random_state():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    with seeded(7):
        a = torch.rand(3)
    assert torch.equal(torch.random.get_rng_state(), before)
    with seeded(7):
        assert torch.equal(torch.rand(3), a)


def test_fixtures_and_training_leave_the_random_state_alone(tmp_path, tiny_targets):
    from tiny_targets import make_tiny_target
    from dflashkit.train.config import load_config
    from dflashkit.train.loop import initial_drafter

    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    make_tiny_target("llama", tmp_path / "t")
    t = tiny_targets["llama"]
    cfg = load_config(None, dict(out=str(tmp_path / "run"), num_layers=1, target_layer_ids=[1, 3], block_size=4))
    initial_drafter(cfg, t, None, [1, 3], resuming=False, master=True)
    assert torch.equal(torch.random.get_rng_state(), before)
