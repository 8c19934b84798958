"""Benchmark reports: the terminal/markdown table, the pieces of a row's log line, and the PNG
(accuracy vs tokens/s, accuracy vs model FLOPs per token, NFE/token)."""

from __future__ import annotations

from cover_vllm.benchmarks.machine import PEAK_GEMM_SIZE

COLUMNS = [("dtype", "{}"), ("decoding", "{}"), ("kv_cache", "{}"), ("batch_size", "{}"), ("cache_refresh", "{}"),
           ("num_prompts", "{}"),
           ("tokens_per_s", "{:.1f}"), ("speedup_vs_reference", "{:.2f}x"),
           ("speedup_vs_cache_reference", "{:.2f}x"),
           ("requests_per_s", "{:.2f}"), ("accuracy", "{:.1%}"), ("nfe_per_token", "{:.3f}"),
           ("tokens_per_step", "{:.2f}"), ("latency_mean_s", "{:.2f}"),
           ("latency_p50_s", "{:.2f}"), ("latency_p99_s", "{:.2f}"), ("remasks", "{:.2f}"),
           ("flip_flops", "{:.2f}"), ("peak_kv_pages", "{}"), ("overhead_fraction", "{:.1%}"),
           ("mfu", "{:.1%}"), ("mfu_bound", "{:.1%}"), ("mbu", "{:.1%}"),
           ("flop_ratio_vs_reference", "{:.2f}x"), ("refreshes", "{:.2f}"),
           ("flops_per_token", "{:.4g}"), ("prefix_hit_rate", "{:.1%}"),
           ("forward_ms_per_step", "{:.2f}"), ("decide_ms_per_step", "{:.2f}"),
           ("host_ms_per_step", "{:.2f}"), ("host_bytes_per_step", "{:.0f}"),
           ("canvas_steps", "{:.1f}"), ("accepted_per_step", "{:.2f}"),
           ("encoder_flop_share", "{:.1%}"), ("device_ms_per_step", "{:.2f}"),
           ("device_ops_per_step", "{:.0f}"), ("launches_per_step", "{:.0f}"),
           ("host_ops_per_step", "{:.0f}"), ("forward_ops_per_step", "{:.0f}")]
# shown only when some row has them: CUDA's device time, --count-ops' counts
OPTIONAL = {"device_ms_per_step", "device_ops_per_step", "launches_per_step",
            "host_ops_per_step", "forward_ops_per_step"}


def ratio_text(row) -> str:
    """' (Ax the dense loop, Bx the dual cache loop)' of a ThroughputRow, the parts it has."""
    parts = ([] if row.speedup_vs_reference is None else
             [f"{row.speedup_vs_reference:.2f}x the dense loop"])
    if row.speedup_vs_cache_reference is not None:
        parts.append(f"{row.speedup_vs_cache_reference:.2f}x the {row.kv_cache} cache loop")
    return f" ({', '.join(parts)})" if parts else ""


def rates_text(row) -> str:
    """'MFU m (bound b, MBU u)' of a ThroughputRow."""
    if row.mfu is None:
        return "MFU - (shapes only)"
    return f"MFU {row.mfu:.0%} (bound {row.mfu_bound:.0%}, MBU {row.mbu:.0%})"


def step_text(row) -> str:
    """'forward F, decide D, host H ms/step': a step's time in its three parts (the decide is
    the decoders' work on the logits' device; host, what is left: engine/timing.py)."""
    decide = "-" if row.decide_ms_per_step is None else f"{row.decide_ms_per_step:.1f}"
    return (f"forward {row.forward_ms_per_step:.1f}, decide {decide}, host "
            f"{row.host_ms_per_step:.1f} ms/step")


def device_text(row) -> str:
    """', device D ms/step' (CUDA) and ', ops/step: ...' (--count-ops) when measured."""
    text = "" if row.device_ms_per_step is None else \
        f", device {row.device_ms_per_step:.1f} ms/step"
    if row.host_ops_per_step is not None:
        device = ("-" if row.device_ops_per_step is None else
                  f"{row.device_ops_per_step:.0f} ({row.launches_per_step:.0f} launches)")
        text += (f", ops/step: {device} device, {row.host_ops_per_step:.0f} host, "
                 f"{row.forward_ops_per_step:.0f} in the forward")
    return text


def spread_text(row) -> str:
    """', median of N: lo-hi tok/s' when the row was timed more than once."""
    if row.repeats < 2:
        return ""
    runs = row.tokens_per_s_runs
    return f", median of {row.repeats}: {min(runs):.1f}-{max(runs):.1f} tok/s"


def _cell(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def format_table(rows: list[dict]) -> str:
    columns = [(n, f) for n, f in COLUMNS
               if n not in OPTIONAL or any(row.get(n) is not None for row in rows)]
    lines = ["| " + " | ".join(n for n, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(f, row.get(n)) for n, f in columns) + " |")
    return "\n".join(lines)


def format_markdown(report: dict, command: str) -> str:
    m = report["machine"]
    peaks = ", ".join(f"{name} {rate} GFLOP/s" for name, rate in m["matmul_gflops"].items())
    refs = [(name, ref) for name, ref in report["reference"].items() if ref]
    ref_lines = [f"reference loop ({name}; dense, no cache, batch 1, 1 token/step): "
                 f"{ref['tokens_per_s']:.1f} tok/s over {ref['requests']} request(s), "
                 f"{ref['gflops_per_token']:.3g} GFLOP/token, MFU {ref['mfu']:.1%} "
                 f"(bound {ref['mfu_bound']:.1%})"
                 for name, ref in refs] or ["reference loop: not run"]
    ref_lines += [f"{mode} cache loop ({name}; Fast-dLLM's, batch 1, 1 token/step): "
                  f"{ref['tokens_per_s']:.1f} tok/s over {ref['requests']} request(s), "
                  f"NFE {ref['nfe']:.0f}"
                  for name, modes in report.get("cache_reference", {}).items()
                  for mode, ref in modes.items() if ref]
    if refs:
        ref_lines.append("(`flop_ratio_vs_reference` is the speed-up a row would show at the "
                         "reference's MFU; MFU is against the peak of the row's dtype)")
    return "\n".join([
        f"# cover-vllm bench throughput: {report['model']}", "",
        f"`{command}`", "",
        f"machine: {m['cores']} cores, {m['threads']} torch threads, torch {m['torch']}; "
        f"device {m.get('device', 'cpu')}: measured peak {m.get('gemm_size', PEAK_GEMM_SIZE)}³ "
        f"GEMM: {peaks}; memory {m.get('read_gbps')} GB/s", "",
        "  \n".join(ref_lines), "",
        format_table(report["results"]), ""])


def write_plot(report: dict, path: str) -> None:
    """Left: accuracy (or speed-up when there is no verifier) per combination against tokens/s;
    middle: the same against model FLOPs per token (what a refresh costs); right: NFE/token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['decoding']}\n{r['kv_cache']} {r.get('cache_refresh', '-')} "
              f"bs={r['batch_size']}" for r in rows]
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(19, 5.5))
    has_acc = all(r["accuracy"] is not None for r in rows)
    # marker = decoding, colour = cache mode and refresh policy (and batch size)
    markers = {d: "osD^vP*Xph"[i % 10] for i, d in enumerate(dict.fromkeys(
        r["decoding"] for r in rows))}
    caches = list(dict.fromkeys(label.split("\n")[1] for label in labels))
    colours = {c: plt.get_cmap("tab10" if len(caches) <= 10 else "tab20")(i % 20)
               for i, c in enumerate(caches)}
    for r, label in zip(rows, labels):
        y = 100 * r["accuracy"] if has_acc else r["speedup_vs_reference"] or 0.0
        style = dict(s=60, marker=markers[r["decoding"]], color=colours[label.split("\n")[1]])
        left.scatter(r["tokens_per_s"], y, label=label.replace("\n", " "), **style)
        mid.scatter(r.get("flops_per_token", 0.0) / 1e6, y, **style)
    left.set_xlabel("throughput (output tokens / s)")
    left.set_ylabel("accuracy (%)" if has_acc else "speed-up vs reference loop (x)")
    left.set_title("accuracy vs throughput" if has_acc else "speed-up vs throughput")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="best")
    mid.set_xlabel("model MFLOPs per generated token (window rows + refreshes)")
    mid.set_ylabel(left.get_ylabel())
    mid.set_title("accuracy vs model FLOPs per token (legend: left)")
    mid.grid(alpha=0.3)
    right.bar(range(len(rows)), [r["nfe_per_token"] for r in rows], color="tab:orange")
    right.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    right.set_ylabel("model forwards per generated token (NFE / token)")
    right.set_title("NFE per token")
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"cover-vllm bench throughput: {report['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
