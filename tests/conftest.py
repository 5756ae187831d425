"""Session-wide fixtures, the order modules run in, one compute thread per test process, and no
hardware entry measured on this machine.

Two test processes share the cores with the gloo processes of their multi-process tests
(each on one thread, as `meshplan run`'s workers are): a test process on as many threads as
cores would oversubscribe them, its threads spinning while they wait for a core.
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (by gloo_pool)
# hardware entries `meshplan estimate --calibrate` measured on this machine are not the tests':
# every test prices with the shipped table, as on a fresh machine (a test that calibrates writes
# into a folder of its own)
os.environ["MESHPLAN_CONFIG"] = tempfile.mkdtemp(prefix="meshplan-config-")

from collections.abc import Iterator

import capture_cache
import gloo_pool
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _end_kept_processes() -> Iterator[None]:
    """The gloo processes that modules share (`gloo_pool`) end with the session."""
    yield
    gloo_pool.close_all()


@pytest.fixture(scope="session", autouse=True)
def _captures_remembered() -> Iterator[None]:
    """A model exported again at the same shapes takes the first export's graph (`capture_cache`)."""
    with capture_cache.remembered():
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow (multi-process) tests first, each module's tests together and in order.

    `pytest -n 2 --dist loadfile` hands out whole modules in this order as workers free up: the
    long ones started first, the many short ones fill in after, instead of one long module
    running alone at the end. The longest of them (`LONGEST`: the documents' commands, collected
    last) go first of all."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    first_seen = {module: i for i, module in reversed(list(enumerate(item.module for item in items)))}

    def longest(item: pytest.Item) -> int:
        name = Path(str(item.fspath)).name
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)

    items.sort(key=lambda item: (item.module not in slow, longest(item), first_seen[item.module]))


# the modules that take longest (minutes each on the 2-core machine), longest first
LONGEST = ("test_docs.py", "test_docs_run.py", "test_run_nodes.py")
