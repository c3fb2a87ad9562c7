"""The trainer modules' doctests (the project's pytest run collects only tests/, schemas/, streams/)."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["trainer.config", "trainer.data", "trainer.losses", "trainer.metrics",
                                  "trainer.publish", "trainer.synthetic"])
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0
