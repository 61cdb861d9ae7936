"""Fixtures shared by the test modules."""

import pytest

from autotp.models import build_model


@pytest.fixture(scope="session")
def meta_llama():
    """Llama-3.1-8B on the meta device: real shapes, no storage. Do not shard it in place."""
    return build_model("llama")
