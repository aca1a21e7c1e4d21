"""dflashkit: train, evaluate and compare DFlash block-diffusion speculative drafters."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so that `import dflashkit` stays cheap and the CLI starts fast.
    if name in ("load_drafter", "save_drafter"):
        from dflashkit.drafter import checkpoint

        return getattr(checkpoint, name)
    if name in ("load_target",):
        from dflashkit.target import model

        return getattr(model, name)
    raise AttributeError(name)
