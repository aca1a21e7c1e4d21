"""Training recipes and GPU-check target shapes shipped with the package: `--config NAME` finds them by name,
`dflashkit config list|show|cp` prints or copies them (torchtune-style), so an installed dflashkit needs no checkout."""

from __future__ import annotations

from pathlib import Path

from dflashkit.errors import DFlashError

ROOT = Path(__file__).parent


def shipped() -> dict[str, Path]:
    """name (file stem, gpu/ ones prefixed) -> file."""
    return {str(p.relative_to(ROOT).with_suffix("")): p for p in sorted(ROOT.rglob("*.yaml"))}


def find_config(name_or_path) -> Path:
    """A YAML file as given, else a shipped config by name (`smollm2-cpu`, `paper`, `gpu/qwen3-8b-8layers`)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    by_name = shipped()
    key = str(name_or_path).removesuffix(".yaml").removeprefix("configs/")
    if key in by_name:
        return by_name[key]
    raise DFlashError(f"{name_or_path}: config file not found; pass a YAML file or a shipped config "
                      f"({', '.join(by_name)}; `dflashkit config list`), or omit --config")
