"""The examples in every autotp docstring run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import autotp

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(autotp.__path__, "autotp.")
    if info.name != "autotp.__main__"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_pass(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
