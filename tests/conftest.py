import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Ray cluster in the tests runs with token auth, like `make up`. Ray reads this when imported.
os.environ.setdefault("RAY_AUTH_MODE", "token")


@pytest.fixture(scope="session")
def ray_head():
    """A real local Ray cluster shared by every integration test of the session."""
    from _cluster import RayHead

    head = RayHead(num_cpus=8)
    yield head
    head.stop()
