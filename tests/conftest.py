"""Shared fixtures: the golden LLaDA checkpoint behind a small engine."""

import ctypes
import gc
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


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_SUITE_PEAK = [0]   # the process's VmHWM before each reset: the suite's peak is their max


def _rss_log_path() -> str:
    import os

    return os.environ.get("COVER_VLLM_TEST_RSS_FILE", "test_rss.log")


def _rss_logging() -> bool:
    import os

    return os.environ.get("COVER_VLLM_TEST_RSS") == "1"


@pytest.fixture(autouse=True)
def _log_test_rss(request):
    """With COVER_VLLM_TEST_RSS=1: each test's own peak resident memory (VmHWM, reset before
    it) and the RSS it leaves behind, one line per test appended to COVER_VLLM_TEST_RSS_FILE
    (default test_rss.log), for finding the tests that set the suite's peak. The VmHWM read
    before each reset also covers module fixtures' setup and teardown between tests, so the
    session's last line (`pytest_sessionfinish`) is the whole run's peak."""
    if not _rss_logging():
        yield
        return
    from cover_vllm.worker.memory import peak_rss_bytes, rss_bytes

    _SUITE_PEAK[0] = max(_SUITE_PEAK[0], peak_rss_bytes())
    if not _reset_peak_rss():
        yield
        return
    yield
    line = f"{peak_rss_bytes() >> 20}\t{rss_bytes() >> 20}\t{request.node.nodeid}\n"
    with open(_rss_log_path(), "a") as f:
        f.write(line)


def pytest_sessionfinish(session):
    """With COVER_VLLM_TEST_RSS=1: the run's peak RSS (MiB) as the log's last line."""
    if not _rss_logging():
        return
    from cover_vllm.worker.memory import peak_rss_bytes, rss_bytes

    peak = max(_SUITE_PEAK[0], peak_rss_bytes())
    with open(_rss_log_path(), "a") as f:
        f.write(f"{peak >> 20}\t{rss_bytes() >> 20}\tSESSION PEAK (MiB)\n")


GROWTH_TO_COLLECT = 128 << 20    # a test that leaves this much more RSS gets a collection


def _free_memory() -> None:
    """Collect reference cycles (a test's own, e.g. a spy wrapping a worker that points back
    at it) and hand the heap's free pages back to the OS: glibc keeps freed blocks in its
    arenas, so without the trim the suite's RSS only ever grows."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):    # not glibc: nothing to trim
        pass


@pytest.fixture(autouse=True, scope="module")
def _free_memory_after_module():
    """After each module's own fixtures (its engines and servers) are torn down."""
    yield
    _free_memory()


@pytest.fixture(autouse=True)
def _free_memory_after_growth(_log_test_rss):
    """Per test, only when its RSS grew (a collection costs tens of ms on this heap); the RSS
    log then records what is left after it."""
    from cover_vllm.worker.memory import rss_bytes

    before = rss_bytes()
    yield
    if rss_bytes() - before > GROWTH_TO_COLLECT:
        _free_memory()
