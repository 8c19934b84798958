"""Shared fixtures: the golden LLaDA checkpoint behind a small engine."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))   # test helpers (golden_cases) import by name
torch.set_num_threads(1)                           # small models: one thread is fastest and stable

from golden_cases import GOLDEN  # noqa: E402

LLADA_DIR = str(GOLDEN / "llada" / "model")
DREAM_DIR = str(GOLDEN / "dream" / "model")


@pytest.fixture(scope="session")
def llada_dir() -> str:
    return LLADA_DIR


@pytest.fixture(scope="session")
def dream_dir() -> str:
    return DREAM_DIR


@pytest.fixture(scope="session")
def ray_session():
    """One small local Ray instance for every `ray` test (skips them when ray is missing)."""
    ray = pytest.importorskip("ray")
    from cover_vllm.executor.ray_ranks import ensure_ray

    started = ensure_ray(num_cpus=2)
    yield ray
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client for the module's `server` fixture (a started server)."""
    from serve_helpers import openai_client

    return openai_client(server)
