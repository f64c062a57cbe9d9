"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_model(monkeypatch):
    """spirit.load fails the test: bad input must be refused before a model is loaded."""
    import spirit

    def refuse(*args, **kwargs):
        raise AssertionError("bad input must be refused before a model is loaded")

    monkeypatch.setattr(spirit, "load", refuse)
