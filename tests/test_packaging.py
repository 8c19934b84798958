"""pyproject's dependencies install into the environment a GPU user already has (issue #31):
ranges, not pins, so `pip install cover-vllm` keeps a CUDA image's torch and its transformers 5;
scripts/install.sh pins the CPU torch wheel for CI, not pyproject. And the environment the suite
runs in is one of the environments these ranges allow."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")         # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def _dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r)
            for r in project["dependencies"]}


def test_no_dependency_is_pinned_to_one_release():
    pinned = [str(r) for r in _dependencies().values()
              if any(s.operator in ("==", "===") for s in r.specifier)]
    assert not pinned, f"pinned in pyproject (pin in scripts/install.sh instead): {pinned}"


def test_torch_and_transformers_ranges_take_a_cuda_images_releases():
    deps = _dependencies()
    torch, transformers = deps["torch"].specifier, deps["transformers"].specifier
    for release in ("2.6.0", "2.11.0", "2.13.0", "2.15.0"):
        assert torch.contains(release), (release, str(torch))
    assert not torch.contains("2.5.1")              # int4 CPU kernels: pyproject says why
    for release in ("4.46.0", "4.57.6", "5.0.0", "5.17.0", "5.24.0"):
        assert transformers.contains(release), (release, str(transformers))
    assert not transformers.contains("4.45.2") and not transformers.contains("6.0.0")


def test_install_script_pins_the_cpu_torch_wheel_that_pyproject_allows():
    script = (ROOT / "scripts" / "install.sh").read_text()
    pins = re.findall(r"torch==([\d.]+)", script)
    assert pins and all(_dependencies()["torch"].specifier.contains(p) for p in pins)


@pytest.mark.parametrize("name", ["torch", "transformers", "huggingface-hub", "tokenizers",
                                  "numpy", "xgrammar", "safetensors"])
def test_installed_release_is_one_pyproject_allows(name):
    installed = Version(version(name))             # e.g. 2.13.0+cpu
    assert _dependencies()[name].specifier.contains(installed, prereleases=True), \
        (name, str(installed))
