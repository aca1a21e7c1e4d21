"""dflashkit: train, evaluate and compare DFlash block-diffusion speculative drafters.

    from dflashkit import load_target, new_drafter, load_drafter, save_drafter, DraftHead

Names load lazily, so that `import dflashkit` stays cheap and the CLI starts without torch."""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "load_target": "dflashkit.targets.model",
    **{name: "dflashkit.drafter.checkpoint" for name in ("new_drafter", "load_drafter", "save_drafter")},
    "DraftHead": "dflashkit.drafter.head",
    **{name: "dflashkit.decode.speculative" for name in ("DFlashProposer", "generate")},
    "new_session": "dflashkit.measure.probe",
}
__all__ = ["__version__", *_EXPORTS]

__getattr__ = lazy_exports(__name__, _EXPORTS)
