"""Session-wide fixtures."""

from collections.abc import Iterator

import gloo_pool
import pytest


@pytest.fixture(scope="session", autouse=True)
def _end_kept_processes() -> Iterator[None]:
    """The gloo processes that modules share (`gloo_pool`) end with the session."""
    yield
    gloo_pool.close_all()
