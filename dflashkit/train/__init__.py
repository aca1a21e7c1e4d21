"""Drafter training: the paper's recipe (docs/design.md section 7) with guards against silent failures.

    from dflashkit.train import load_config, train
    summary = train(load_config("smollm2-cpu", ["steps=100"]))
"""

from dflashkit.train.config import TrainConfig, default_gamma, load_config


def train(cfg, target=None, source=None, on_step=None):
    from dflashkit.train.loop import train as _train

    return _train(cfg, target=target, source=source, on_step=on_step)


__all__ = ["TrainConfig", "default_gamma", "load_config", "train"]
