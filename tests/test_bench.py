"""`cover-vllm bench`: one command writes the table, the documented JSON, markdown and a PNG."""

import dataclasses
import json
import statistics
import time

import pytest

from cover_vllm import LLM
from cover_vllm.benchmarks.latency import run_latency, run_verification_cost
from cover_vllm.benchmarks.machine import mfu_bound
from cover_vllm.benchmarks import throughput
from cover_vllm.benchmarks.throughput import ThroughputSpec, Workload
from cover_vllm.engine.observer import PHASES, StepObserver
from cover_vllm.entrypoints.cli import main
from cover_vllm.strategies import strategy_class
from golden_cases import GOLDEN

RESULT_KEYS = {"dtype", "decoding", "kv_cache", "batch_size", "tokens_per_s", "requests_per_s",
               "nfe_per_token", "speedup_vs_reference", "overhead_fraction", "mfu", "accuracy",
               "tokens_per_step", "latency_mean_s", "latency_p50_s", "latency_p99_s", "remasks",
               "flip_flops", "peak_kv_pages", "gflops_per_token", "flop_ratio_vs_reference",
               "flops_per_token", "prefix_hit_rate"}
SDAR = str(GOLDEN / "sdar" / "model")          # block-causal, block_size 4, no tokenizer


def test_bench_throughput_writes_table_json_markdown_and_plot(tmp_path, capsys):
    paths = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "md", "png")}
    code = main(["bench", "throughput", "--model", "cover-tiny", "--task", "word",
                 "--decoding", "low_confidence,cover", "--kv-cache", "none,dual",
                 "--batch-size", "2", "--num-prompts", "4", "--reference-prompts", "1",
                 "--threads", "1", "--json", str(paths["json"]), "--markdown", str(paths["md"]),
                 "--plot", str(paths["png"]), "--dtype", "float32,bfloat16"])
    assert code == 0
    report = json.loads(paths["json"].read_text())
    peaks = report["machine"]["matmul_gflops"]
    assert report["machine"]["cores"] >= 1 and set(peaks) == {"float32", "bfloat16"}
    assert all(rate > 0 for rate in peaks.values()) and report["machine"]["read_gbps"] > 0
    for dtype, ref in report["reference"].items():
        assert ref["dtype"] == dtype and ref["tokens_per_s"] > 0 and ref["gflops_per_token"] > 0
        assert 0 < ref["mfu"] < 2
        cached = report["cache_reference"][dtype]["dual"]   # Fast-dLLM's dual loop, timed too
        assert cached["tokens_per_s"] > 0 and cached["nfe"] > 0
    rows = report["results"]
    for r in rows:        # the cache rows against the loop of their own mode, the others none
        assert (r["speedup_vs_cache_reference"] is None) == (r["kv_cache"] == "none")
    assert [(r["dtype"], r["decoding"], r["kv_cache"]) for r in rows] == [
        (dtype, decoding, kv) for dtype in ("float32", "bfloat16")
        for decoding in ("low_confidence", "cover") for kv in ("none", "dual")]
    for r in rows:
        # MFU divides the row's FLOP rate by the peak measured in the row's own dtype
        assert r["mfu"] == pytest.approx(
            r["gflops_per_token"] * r["tokens_per_s"] / peaks[r["dtype"]], rel=1e-6)
        assert RESULT_KEYS <= set(r)
        assert r["batch_size"] == 2 and r["tokens_per_s"] > 0 and 0 <= r["accuracy"] <= 1
        assert 0 <= r["overhead_fraction"] < 1 and r["mfu"] > 0
        assert r["speedup_vs_reference"] > 0 and r["flop_ratio_vs_reference"] > 0
        assert r["nfe_per_token"] > 0
        # MFU / MBU is the run's FLOPs per weight byte x read rate / peak: the unclamped bound
        assert 0 < r["mfu_bound"] <= 1 and r["mbu"] > 0
        if r["mfu_bound"] < 1:
            assert r["mfu"] == pytest.approx(r["mbu"] * r["mfu_bound"], rel=1e-6)
        else:
            assert r["mfu"] >= r["mbu"] * (1 - 1e-6)
    # a cached window costs fewer FLOPs per token than the dense full-canvas reference forward
    lowconf_none, lowconf_dual = rows[0], rows[1]
    assert lowconf_dual["gflops_per_token"] < lowconf_none["gflops_per_token"]
    table = capsys.readouterr().out
    assert "| cover | dual | 2 |" in table and "flop_ratio_vs_reference" in table
    markdown = paths["md"].read_text()
    assert "reference loop" in markdown and "dual cache loop" in markdown and "| low_confidence | none | 2 |" in markdown
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_repeats_time_every_row_round_robin_and_report_the_median_run(tmp_path, capsys,
                                                                            monkeypatch):
    path = tmp_path / "bench.json"
    order, measure = [], throughput._measure
    monkeypatch.setattr(throughput, "_measure", lambda llm, work, sp: (
        order.append(str(sp.cache_refresh)), measure(llm, work, sp))[1])
    code = main(["bench", "throughput", "--model", "cover-tiny", "--task", "word",
                 "--decoding", "cover", "--kv-cache", "dual", "--cache-refresh", "block,adaptive",
                 "--batch-size", "2", "--num-prompts", "2", "--reference-prompts", "0",
                 "--threads", "1", "--repeats", "3", "--json", str(path)])
    assert code == 0
    rows = json.loads(path.read_text())["results"]
    assert [r["cache_refresh"] for r in rows] == ["block", "adaptive"]
    for r in rows:
        runs = r["tokens_per_s_runs"]
        assert r["repeats"] == 3 and len(runs) == 3 and all(t > 0 for t in runs)
        assert r["tokens_per_s"] == pytest.approx(statistics.median(runs), rel=1e-9)
        assert r["peak_kv_pages"] > 0
    assert "median of 3:" in capsys.readouterr().out
    assert order == ["block", "adaptive"] * 3          # a drifting machine slows both alike


def test_bench_latency_reports_every_phase(tmp_path, capsys):
    path = tmp_path / "latency.json"
    code = main(["bench", "latency", "--model", "cover-tiny", "--task", "sudoku4",
                 "--decoding", "threshold,cover", "--kv-cache", "dual", "--repeats", "2",
                 "--threads", "1", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    rows = report["results"]
    assert [r["decoding"] for r in rows] == ["threshold", "cover"]
    for r in rows:
        phases = [r[f"{p}_ms"] for p in ("schedule", "prepare", "forward", "strategy", "update")]
        assert all(t >= 0 for t in phases) and r["forward_ms"] > 0
        assert abs(sum(phases) - r["step_ms"]) < 1e-6
    assert rows[0]["vs_first"] == 1.0
    (same_window,) = report["verification"]       # COVER's steps replayed without their seeds
    assert same_window["kv_cache"] == "dual" and same_window["steps"] > 0
    assert same_window["seeds_per_step"] >= 1 and same_window["forward_without_seeds_ms"] > 0
    assert same_window["ratio"] == pytest.approx(
        same_window["forward_ms"] / same_window["forward_without_seeds_ms"])
    # a step adds the strategy's work (seed selection and decision): COVER's own vs threshold's
    assert same_window["strategy_ms"] > 0 and same_window["threshold_strategy_ms"] > 0
    assert same_window["step_ms"] == pytest.approx(
        same_window["forward_ms"] + same_window["strategy_ms"])
    assert same_window["step_ratio"] == pytest.approx(
        same_window["step_ms"] / same_window["step_without_seeds_ms"])
    assert strategy_class("cover").decide.__qualname__ == "Cover.decide"   # recording undone
    out = capsys.readouterr().out
    assert "| cover | dual |" in out and "identical windows" in out


def test_bench_throughput_on_a_block_causal_model_reports_flops_with_and_without_cache(
        tmp_path, capsys):
    """SDAR (golden checkpoint): per-block KV reuse spends fewer FLOPs per token than full
    recomputation; no reference loop (it is LLaDA's full attention); random prompts share no
    prompt block, and the warm-up's are forgotten: a hit rate of 0 where the cache is looked up."""
    path = tmp_path / "bench.json"
    code = main(["bench", "throughput", "--model", SDAR, "--kv-cache", "none,dual",
                 "--input-len", "40", "--output-len", "16", "--batch-size", "2",
                 "--num-prompts", "2", "--threads", "1", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert report["reference"] == {"float32": None}
    none, dual = report["results"]
    assert (none["kv_cache"], dual["kv_cache"]) == ("none", "dual")
    for r in (none, dual):
        assert RESULT_KEYS <= set(r) and r["tokens_per_s"] > 0
        assert r["nfe_per_token"] > 0 and r["flops_per_token"] > 0
    assert dual["flops_per_token"] < none["flops_per_token"]
    assert dual["gflops_per_token"] < none["gflops_per_token"]
    assert none["prefix_hit_rate"] is None and dual["prefix_hit_rate"] == 0.0
    assert "prefix_hit_rate" in capsys.readouterr().out


def test_bench_throughput_on_diffusion_gemma_reports_canvases(tmp_path, capsys):
    """A uniform-state model with its own decoder (the default: none given): a small dummy
    shape, one row per batch size, with decoder steps per canvas, the tokens the entropy bound
    accepted per step and the encoder's share of the FLOPs; and the golden checkpoint, whose
    sharp random weights accept several tokens a step."""
    path = tmp_path / "bench.json"
    code = main(["bench", "throughput", "--model", "diffusion-gemma-mini",
                 "--input-len", "24", "--output-len", "64", "--batch-size", "1,2",
                 "--num-prompts", "2", "--threads", "1", "--decoding-params",
                 '{"max_denoising_steps": 3, "confidence_threshold": 0}', "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert report["reference"] == {"bfloat16": None}
    rows = report["results"]
    assert [(r["decoding"], r["kv_cache"], r["batch_size"]) for r in rows] == [
        ("diffusion_gemma", "-", 1), ("diffusion_gemma", "-", 2)]
    for r in rows:
        assert RESULT_KEYS <= set(r) and r["tokens_per_s"] > 0 and r["mfu"] > 0
        assert r["canvas_steps"] == 3.0 and r["nfe_per_token"] == pytest.approx(3 / 64)
        assert r["accepted_per_step"] >= 1.0          # rank 0 is always accepted
        assert 0 < r["encoder_flop_share"] < 0.5
    code = main(["bench", "throughput", "--model", str(GOLDEN / "diffusion_gemma" / "model"),
                 "--input-len", "12", "--output-len", "32", "--num-prompts", "2",
                 "--threads", "1", "--decoding-params", '{"entropy_bound": 2.0}',
                 "--json", str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())["results"]
    assert row["accepted_per_step"] > 2 and row["canvas_steps"] <= 48
    assert "encoder_flop_share" in capsys.readouterr().out


def test_bench_prefix_hit_rate_counts_the_rows_shared_prompt_blocks(monkeypatch):
    """Three equal prompts, one at a time: the second and third find every full prompt page the
    first computed (2 of 2 pages each: 2/3 overall); the warm-up's pages were forgotten."""

    class SamePrompt(Workload):
        def __init__(self, spec, llm, n):
            super().__init__(spec, llm, n)
            self.prompts = [self.prompts[0]] * n

    monkeypatch.setattr(throughput, "Workload", SamePrompt)
    spec = ThroughputSpec(model=SDAR, kv_caches=("dual",), batch_sizes=(1,), num_prompts=3,
                          input_len=40, output_len=8, threads=1, reference_prompts=0)
    (row,) = throughput.run_throughput(spec, log=lambda *a: None)["results"]
    assert row["prefix_hit_rate"] == pytest.approx(2 / 3)
    assert throughput.prefix_hit_rate([]) is None


def test_bench_latency_runs_on_a_block_causal_model(tmp_path):
    path = tmp_path / "latency.json"
    code = main(["bench", "latency", "--model", str(GOLDEN / "llada2" / "model"),
                 "--decoding", "llada2,cover", "--kv-cache", "dual", "--input-len", "10",
                 "--output-len", "16", "--block-length", "8", "--repeats", "1", "--threads",
                 "1", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert [r["decoding"] for r in report["results"]] == ["llada2", "cover"]
    assert all(r["forward_ms"] > 0 and r["nfe"] > 0 for r in report["results"])
    (same_window,) = report["verification"]
    assert same_window["steps"] > 0 and same_window["forward_without_seeds_ms"] > 0


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "throughput", "--model", "cover-tiny", "--decoding", "greedy"]) == 2
    assert "decoding" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", "cover-tiny", "--kv-cache", "full"]) == 2
    assert "kv_cache" in capsys.readouterr().err


class _Outs(StepObserver):
    """The test's own recording: every step's SchedulerOutput."""

    def __init__(self):
        self.outs = []

    def on_schedule(self, out):
        self.outs.append(out)


def _mean_forward_s(execute, outs, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        for out in outs:
            start = time.perf_counter()
            execute(out)
            times.append(time.perf_counter() - start)
    return statistics.mean(times)


def test_verification_cost_agrees_with_an_independent_measurement():
    """`run_verification_cost`'s step count, seeds per step and forward ratio against the
    test's own recording of the same requests and its own timing of those forwards (with and
    without the seeds' override pairs)."""
    spec = ThroughputSpec(model="cover-tiny", decodings=("cover",), kv_caches=("dual",),
                          task="sudoku4", threads=1)
    (row,) = run_verification_cost(spec, repeats=2, replays=3)
    llm = LLM("cover-tiny", decoding="cover", num_threads=1)
    work = Workload(spec, llm, 2)
    params = work.params(spec, "cover", ("dual", "block"))
    seen = _Outs()
    llm.engine.add_observer(seen)
    for prompt in work.prompts[:2]:
        llm.generate([prompt], params, use_tqdm=False)
    window = [o for o in seen.outs if any(i.override for i in o.items)
              and not any(i.is_refresh for i in o.items)]
    assert row["steps"] == len(window) > 0
    assert row["seeds_per_step"] == pytest.approx(
        statistics.mean(sum(len(i.override) for i in o.items) for o in window))
    plain = [dataclasses.replace(o, items=[dataclasses.replace(i, override=[], want_stats=False)
                                           for i in o.items]) for o in window]
    execute = llm.engine.executor.execute_model
    # timings: the same cost within noise. The two measurements run at different moments of a
    # possibly loaded machine, so the test's own is taken up to three times (a load spike
    # during one of them is not a disagreement)
    ratios = []
    for _ in range(3):
        ratios.append(_mean_forward_s(execute, window) / _mean_forward_s(execute, plain))
        if 0.5 < row["ratio"] / ratios[-1] < 2.0:
            break
    assert 0.5 < row["ratio"] / ratios[-1] < 2.0, (row["ratio"], ratios)


def test_latency_phases_add_up_to_the_wall_clock():
    """The phases `run_latency` reports for a request sum to at most the request's wall-clock
    time measured around `generate`, and to most of it (the rest is outside the engine step)."""
    spec = ThroughputSpec(model="cover-tiny", decodings=("threshold",), kv_caches=("dual",),
                          task="sudoku4", threads=1)
    start = time.perf_counter()
    (row,) = run_latency(spec, repeats=2)
    wall_s = time.perf_counter() - start
    # run_latency's own wall clock covers the load, a warm-up and the 2 timed requests
    assert 0 < row["request_ms"] * 2 / 1e3 < wall_s
    # the same measurement on one run: its recorded phases against its own wall clock (two
    # separate runs are not comparable on a loaded machine)
    llm = LLM("cover-tiny", decoding="threshold", num_threads=1)
    work = Workload(spec, llm, 2)
    params = work.params(spec, "threshold", ("dual", "block"))
    llm.generate(work.prompts[:1], params, use_tqdm=False)            # warm-up
    llm.engine.step_times = []
    start = time.perf_counter()
    for prompt in work.prompts[:2]:
        llm.generate([prompt], params, use_tqdm=False)
    mine_s = time.perf_counter() - start
    steps, llm.engine.step_times = llm.engine.step_times, None
    phases_s = sum(t[p] for t in steps for p in PHASES)
    assert 0.33 < phases_s / mine_s <= 1.0


def test_mfu_bound_is_the_roofline():
    """32 rows through bf16 weights: 32 FLOPs a byte; at 30 GB/s against a 3,000 GFLOP/s peak
    that is 32 % of the peak, and a wide batch is capped at 100 %."""
    params = 1_000_000
    assert mfu_bound(2 * 32 * params, 2 * params, 3000.0, 30.0) == pytest.approx(0.32)
    assert mfu_bound(2 * 512 * params, 2 * params, 3000.0, 30.0) == 1.0


def test_bench_reports_host_time_and_bytes_to_the_host(tmp_path, capsys):
    """Every row reports the host's ms per step (all but the forward) and the bytes a step
    copies to the host: none on a CPU engine, a few kB of decisions on a device ("meta": the
    model's arithmetic is free, so what remains is the host's work)."""
    out = {d: tmp_path / f"{d}.json" for d in ("cpu", "meta")}
    for device in out:
        assert main(["bench", "throughput", "--model", "llada-50m", "--device", device,
                     "--decoding", "cover,low_confidence", "--kv-cache", "dual",
                     "--batch-size", "4", "--input-len", "16", "--output-len", "16",
                     "--block-length", "8", "--reference-prompts", "0", "--threads", "1",
                     "--dtype", "float32", "--json", str(out[device])]) == 0
    printed = capsys.readouterr().out
    assert "host_ms_per_step" in printed and "kB/step to the host" in printed
    cpu, meta = (json.loads(out[d].read_text())["results"] for d in ("cpu", "meta"))
    for r in cpu:
        assert r["host_ms_per_step"] > 0 and r["host_bytes_per_step"] == 0
    for r in meta:
        assert r["host_ms_per_step"] > 0 and r["mfu"] is None
        # the decisions of 4 requests x an 8-slot view: a few kB, where one fp32 logits row
        # of llada-50m's vocabulary is 506 kB (and the view's 32 rows came over before)
        assert 0 < r["host_bytes_per_step"] < 16_000
