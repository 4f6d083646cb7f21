"""The lifecycle fixtures (real memory store, counting service and snapshot) for the
pooling tests."""

from tests.lifecycle.conftest import life

__all__ = ["life"]
