"""Snapshot tests: ``cdc_config`` defaults to ``snapshot.mode: initial``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def cdc_config(cdc_config: Callable[..., Path]) -> Callable[..., Path]:
    """``cdc_config(snapshot={...}, **overrides)``: the shared one, snapshot mode initial."""

    def make(snapshot: dict[str, Any] | None = None, **overrides: Any) -> Path:
        extra = dict(overrides.pop("extra", {}) or {})
        extra["snapshot"] = {"mode": "initial", **(snapshot or {})}
        return cdc_config(extra=extra, **overrides)

    return make
