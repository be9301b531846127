"""Models shipped with shardnet (trained by tools/train_default_model.py)."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = "tiny-llama"
DEFAULT_DRAFT = "tiny-llama-draft"


def default_model_path() -> Path:
    return HERE / DEFAULT_MODEL


def default_draft_path() -> Path:
    return HERE / DEFAULT_DRAFT
