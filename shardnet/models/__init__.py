"""Models shipped with shardnet (trained by tools/train_default_model.py)."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = "tiny-llama"
DEFAULT_DRAFT = "tiny-llama-draft"


def default_model_path() -> Path:
    return HERE / DEFAULT_MODEL


def default_draft_path() -> Path:
    return HERE / DEFAULT_DRAFT


def shipped_draft_for(path: Path | None) -> Path | None:
    """The shipped draft when ``path`` is the shipped model's directory, else None."""
    if path is not None and Path(path).resolve() == default_model_path().resolve() and default_draft_path().is_dir():
        return default_draft_path()
    return None
