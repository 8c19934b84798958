"""The bench on the device the model runs on (issue #42): peaks probed there and MFU above 100 %
reported as the bug it is; CUDA-event forward time (the CUDA pieces run here with fake events);
`--count-ops`; `enforce_eager` accepted by every entry point."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.benchmarks import machine
from cover_vllm.benchmarks.report import format_table
from cover_vllm.benchmarks.step_ops import count_row_ops, decide_ms_per_step
from cover_vllm.engine import timing
from cover_vllm.engine.observer import StepRecord, StepTimes
from cover_vllm.engine.timing import StepClock
from cover_vllm.entrypoints.cli import build_parser, main


def test_a_share_above_the_peak_is_reported_with_both_numbers_and_never_clamped(caplog):
    with caplog.at_level(logging.WARNING, logger="cover_vllm"):
        assert machine.utilization(50.0, 200.0, "bs=1 MFU") == 0.25
        assert not caplog.records
        assert machine.utilization(3237.0, 100.0, "bs=1 MFU") == pytest.approx(32.37)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "bs=1 MFU 3237.0% > 100%" in said and "3237" in said and "100" in said


def test_probes_run_on_the_models_device():
    assert machine.probe_device("meta") == torch.device("cpu")      # shapes only: no rates
    assert machine.probe_device("cuda:1") == torch.device("cuda:1")
    assert machine.gemm_size("cpu") == machine.PEAK_GEMM_SIZE
    assert machine.gemm_size("cuda") == machine.CUDA_GEMM_SIZE
    info = machine.machine_info(read_rate=False, device="meta")
    assert info["device"] == "cpu" and info["gemm_size"] == machine.PEAK_GEMM_SIZE


class _FakeEvent:
    """torch.cuda.Event's timing surface: `record` stamps a fake device clock (ms)."""

    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.stamp, self.streams, self.synced = None, [], False

    def record(self, stream=None):
        self.streams.append(stream)
        _FakeEvent.clock_ms += 7.5
        self.stamp = _FakeEvent.clock_ms

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end) -> float:
        assert end.synced, "read only after the end event completed"
        return end.stamp - self.stamp


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream:{device}")


def test_cuda_timers_read_the_device_clock(fake_cuda):
    assert machine.cuda_seconds(lambda: None) == pytest.approx(7.5e-3)
    clock = StepClock(torch.device("cuda", 1))
    clock.start_device()
    clock.stop_device()
    assert clock.device_s() == pytest.approx(7.5e-3)
    assert [e.streams for e in clock._events] == [["stream:cuda:1"]] * 2
    # off CUDA, or with nobody observing, nothing is recorded
    for device in (torch.device("cpu"), None):
        clock = StepClock(device)
        clock.start_device()
        clock.stop_device()
        assert clock.device_s() is None


def test_cuda_times_the_decide_phase_with_events(fake_cuda):
    clock = StepClock.observed(torch.device("cuda", 1), [object()], vocab=50)
    with clock.deciding():
        pass
    assert clock.decide_s() == pytest.approx(7.5e-3)
    # a CPU engine times it op by op only when an observer asks; unobserved, never
    cpu = torch.device("cpu")
    for observers in ([object()], []):
        clock = StepClock.observed(cpu, observers, vocab=50)
        with clock.deciding():
            torch.randn(2, 50).softmax(-1)
        assert clock.decide_s() is None


def test_the_best_of_repeated_device_timings(monkeypatch):
    took = iter([5.0, 0.3, 0.2, 0.4])                  # the first is the warm-up
    monkeypatch.setattr(machine, "cuda_seconds", lambda fn: next(took))
    assert machine._best_seconds(lambda: None, 0.8, torch.device("cuda")) == 0.2


@pytest.fixture(scope="module")
def tiny():
    return LLM("cover-tiny", decoding="low_confidence", num_threads=1, max_num_seqs=2)


def test_steps_carry_device_time_only_where_events_ran(tiny, monkeypatch):
    params = SamplingParams(max_tokens=8, block_length=8, decoding="low_confidence")
    tiny.engine.step_times = []
    tiny.generate(["1+1="], params, use_tqdm=False)
    rows, tiny.engine.step_times = tiny.engine.step_times, None
    assert rows and all(r["device_forward"] is None for r in rows)          # a CPU engine
    monkeypatch.setattr(timing.StepClock, "device_s", lambda self: 0.004)   # as CUDA would
    tiny.engine.step_times = []
    tiny.generate(["1+1="], params, use_tqdm=False)
    rows, tiny.engine.step_times = tiny.engine.step_times, None
    assert rows and all(r["device_forward"] == 0.004 for r in rows)


def test_cpu_steps_time_the_decoders_work_on_the_logits(tiny):
    """On a CPU engine the strategy phase's ops on the logits are timed (`decide_device`), a
    part of that phase, when an observer asks for it, and `host_s` leaves them out; the
    bench's untimed pass reads their mean."""
    params = SamplingParams(max_tokens=8, block_length=8, decoding="low_confidence")
    tiny.engine.step_times = []
    tiny.generate(["1+1="], params, use_tqdm=False)
    rows, tiny.engine.step_times = tiny.engine.step_times, None
    assert rows and all(r["decide_device"] is None for r in rows)       # not asked for
    times = StepTimes(times_logits=True)
    tiny.engine.add_observer(times)
    tiny.generate(["1+1="], params, use_tqdm=False)
    tiny.engine.remove_observer(times)
    rows = times.rows
    assert rows and all(0 < r["decide_device"] <= r["strategy"] for r in rows)
    assert 0 < decide_ms_per_step(tiny, ["1+1="], params) < 1e3 * sum(r["strategy"]
                                                                       for r in rows)
    record = StepRecord(**rows[0])
    assert record.host_s == pytest.approx(sum(rows[0][p] for p in ("schedule", "prepare",
                                                                   "strategy", "update"))
                                          - rows[0]["decide_device"])


def test_logits_op_timer_counts_only_ops_on_the_logits():
    """Only ops with a [..., vocab] argument or result count as work on the logits."""
    with timing.LogitsOpTimer(vocab=50) as timer:
        torch.ones(4, 3).sum()
        torch.ones(50, 4).sum(0)                        # [4]
    assert timer.seconds == 0
    with timing.LogitsOpTimer(vocab=50) as timer:
        torch.randn(4, 50).softmax(-1)
    assert timer.seconds > 0
    # the CPU argmax reads the rows as chunks [n, V / c, c]: that is work on the logits too
    # (2026-11-27: it was counted as host time, 0.7 ms of a batch-16 llada-50m step)
    assert timing._touches(torch.empty(4, 5, 10), 50) and timing._touches(torch.empty(50), 50)
    assert not timing._touches(torch.empty(5, 10), 50)             # [n, W], n * W = vocab
    assert not timing._touches(torch.empty(4, 5, 5), 50)
    from cover_vllm.strategies.sampling import GREEDY_CHUNK, greedy

    class Recording(timing.LogitsOpTimer):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.seconds
            out = super().__torch_dispatch__(func, types, args, kwargs)
            counted.append((func.overloadpacket.__name__, self.seconds > before))
            return out

    counted = []
    with Recording(vocab=8 * GREEDY_CHUNK):
        greedy(torch.randn(64, 8 * GREEDY_CHUNK))
    assert ("amax", True) in counted and ("gather", True) in counted


def test_ops_per_step_of_a_cpu_engine(tiny):
    params = SamplingParams(max_tokens=8, block_length=8, decoding="low_confidence",
                            ignore_eos=True)
    counts = count_row_ops(tiny, [{"prompt_token_ids": [5, 6, 7]}] * 2, params)
    assert counts["counted_steps"] >= 8 // 2       # at most 2 tokens a step of 2 requests
    assert counts["device_ops_per_step"] is None   # no device apart from the host
    assert counts["launches_per_step"] is None
    assert 0 < counts["forward_ops_per_step"] < counts["host_ops_per_step"]
    assert "execute_model" not in vars(tiny.engine.executor)   # the wrapper is gone


def _bench(tmp_path, device: str, *extra: str) -> list[dict]:
    path = tmp_path / f"{device}.json"
    assert main(["bench", "throughput", "--model", "llada-50m", "--device", device,
                 "--decoding", "low_confidence", "--kv-cache", "dual", "--batch-size", "2",
                 "--input-len", "8", "--output-len", "8", "--block-length", "8",
                 "--reference-prompts", "0", "--threads", "1", "--dtype", "float32",
                 "--count-ops", "--json", str(path), *extra]) == 0
    return json.loads(path.read_text())["results"]


def test_count_ops_rows_on_cpu_and_meta(tmp_path, capsys):
    (cpu,) = _bench(tmp_path, "cpu")
    (meta,) = _bench(tmp_path, "meta", "--enforce-eager")
    assert cpu["device_ops_per_step"] is None and cpu["host_ops_per_step"] > 0
    assert cpu["device_ms_per_step"] is None                    # CUDA only
    assert 0 < cpu["mfu"] <= 1.0
    # on meta the forward's ops are the device's: a dozen or more per layer
    assert meta["device_ops_per_step"] >= 10 * 4 and meta["forward_ops_per_step"] > 0
    assert 0 < meta["launches_per_step"] < meta["device_ops_per_step"]     # views: no kernel
    out = capsys.readouterr().out
    assert "device_ops_per_step" in out and "ops/step: - device" in out
    assert "device_ms_per_step" not in out                      # absent everywhere: hidden


def test_the_table_shows_device_time_where_a_row_has_it():
    row = {"dtype": "bfloat16", "decoding": "cover", "device_ms_per_step": 4.25}
    table = format_table([row, {**row, "device_ms_per_step": None}])
    assert "device_ms_per_step" in table and "| 4.25 |" in table
    assert "host_ops_per_step" not in table


@pytest.mark.parametrize("argv", [["generate", "cover-tiny", "--prompt", "x"],
                                  ["serve", "cover-tiny"], ["bench", "throughput"],
                                  ["bench", "latency"], ["bench", "scale", "--model", "x"]])
def test_every_entry_point_takes_enforce_eager(argv):
    parser = build_parser()
    assert parser.parse_args([*argv, "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(argv).enforce_eager is False


def test_enforce_eager_says_what_it_does():
    from cover_vllm.config import EngineConfig

    assert LLM("cover-tiny", enforce_eager=True, num_threads=1).engine.config.enforce_eager
    said = EngineConfig.__dataclass_fields__["enforce_eager"].metadata["help"]
    assert "CUDA graphs" in said and "True runs it eagerly" in said and "off CUDA" in said
