"""Shared pytest configuration: the ``gpu`` marker and the session-wide distributed worker pools."""

import os

import pytest

from tests.dist_pool import DistPool
from tests.launch_env import LAUNCH_ENV


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")


def pytest_collection_modifyitems(config, items):
    # ``launch``: a test that runs in the worker pool (set here, from its fixtures) or starts processes of
    # its own (its module says so: ``pytestmark = pytest.mark.launch``); ``-m "not launch and not slow"``
    # is the developers' fast loop (unit, ops, architecture and docs checks), the full suite is CI's.
    for item in items:
        if {"dist_pool", "gpu_pool"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launch)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only consulted when gpu tests were collected; is_available() creates no CUDA context

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _launch_env_as_found():
    """A test whose Trainer launched in this process (Lightning's launcher sets ``MASTER_PORT`` and the like
    in ``os.environ``) leaves those variables as it found them, for the tests after it."""
    before = {k: os.environ.get(k) for k in LAUNCH_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def host_kernel():
    """The host Adam kernel (``tests/host_kernel.py``: skips only where it cannot match torch here)."""
    from tests.host_kernel import require

    return require()


@pytest.fixture(scope="session")
def dist_pool():
    """``dist_pool(world_size) -> DistPool``; one pool per world size for the whole session."""
    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def gpu_pool():
    """``gpu_pool(world_size) -> DistPool`` of NCCL workers, one GPU each; skips without enough GPUs."""
    import torch

    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if torch.cuda.device_count() < world_size:
            pytest.skip(f"needs {world_size} CUDA GPUs, found {torch.cuda.device_count()}")
        if world_size not in pools:
            pools[world_size] = DistPool(world_size, timeout=300.0, backend="nccl")
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
