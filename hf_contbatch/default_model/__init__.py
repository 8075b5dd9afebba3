"""The embedded default model: a small Llama trained on the Python docs (see README.md here)."""

from pathlib import Path


def default_model_path() -> str:
    """Path of the checkpoint folder shipped inside the package (loads offline)."""
    return str(Path(__file__).resolve().parent)
