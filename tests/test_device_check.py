"""An unusable --device is one line, exit 2, from LLM, every CLI command and the bench; an
unknown device names `device` and the allowed values (issue #52)."""

from __future__ import annotations

import pytest
import torch

from cover_vllm import LLM
from cover_vllm.benchmarks.throughput import ThroughputSpec, run_throughput
from cover_vllm.device_check import check_device
from cover_vllm.entrypoints.cli import main

NO_CUDA = not torch.cuda.is_available()
CPU_BUILD = torch.version.cuda is None
CUDA_LINE = f"CUDA is not available in this torch build (torch {torch.__version__})"
COMMANDS = [
    ["generate", "cover-tiny", "--prompt", "hi", "--device", "cuda"],
    ["serve", "cover-tiny", "--device", "cuda", "--port", "0"],
    ["bench", "throughput", "--model", "cover-tiny", "--device", "cuda", "--count-ops",
     "--batch-size", "1", "--num-prompts", "1", "--reference-prompts", "0"],
    ["bench", "latency", "--model", "cover-tiny", "--device", "cuda"],
    ["eval", "--model", "cover-tiny", "--task", "arith", "--num", "1", "--device", "cuda"],
]


@pytest.mark.skipif(not CPU_BUILD, reason="needs a torch build without CUDA")
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_cuda_on_a_cpu_torch_is_one_line_and_exit_2(argv, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"cover-vllm: error: {CUDA_LINE}", err


@pytest.mark.skipif(not CPU_BUILD, reason="needs a torch build without CUDA")
def test_cuda_on_a_cpu_torch_offline_and_in_the_bench() -> None:
    with pytest.raises(ValueError, match=r"^CUDA is not available in this torch build \(torch "):
        LLM("cover-tiny", device="cuda")
    spec = ThroughputSpec(model="cover-tiny", decodings=("low_confidence",), device="cuda",
                          count_ops=True)
    with pytest.raises(ValueError, match="CUDA is not available in this torch build"):
        run_throughput(spec, log=lambda *a: None)


@pytest.mark.parametrize("device", ["tpu", "mps", "xla", "nonsense", 3])
def test_unknown_devices_name_the_field_and_the_allowed_values(device) -> None:
    with pytest.raises(ValueError, match=r"^device.*choose one of cpu, cuda, cuda:N, meta"):
        LLM("cover-tiny", device=device)


def test_usable_devices_pass() -> None:
    check_device("cpu")
    check_device("meta")
    check_device(torch.device("cpu"))
    if not NO_CUDA:
        check_device("cuda")
        with pytest.raises(ValueError, match="does not exist"):
            check_device(f"cuda:{torch.cuda.device_count()}")
