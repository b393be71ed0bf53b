"""The trained tiny K3-architecture model shipped inside the package: the default of ``serve`` and
``generate``, and the model on which quality (quantisation, cached-vs-uncached, speculation) is
measured. Trained by tools/train_tiny.py; model card in data/tiny/README.md."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_MODELS = {"tiny": DATA_DIR / "tiny", "tiny-mxfp4": DATA_DIR / "tiny-mxfp4"}
DEFAULT_MODEL = "tiny"


def resolve_model(model: str | Path | None) -> Path:
    """A checkpoint directory for ``--model``: an existing path as given, a bundled model's name
    ("tiny", "tiny-mxfp4"), or the default bundled model when nothing is given."""
    if model is not None and Path(model).exists():
        return Path(model)
    if model is not None and str(model) not in BUNDLED_MODELS:
        raise FileNotFoundError(f"no model directory {str(model)!r}, and no bundled model of that name "
                                f"(bundled: {', '.join(BUNDLED_MODELS)})")
    path = BUNDLED_MODELS[str(model or DEFAULT_MODEL)]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the bundled model {path.name!r} is missing from this install ({path}); "
                                "reinstall k3serve or pass --model DIR")
    return path
