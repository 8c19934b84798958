"""Tensor parallelism: sharded forwards and decoding equal tensor_parallel_size=1; failures.

Logit parity is max|TP2 - TP1| <= 1e-5 * max(1, max|TP1|): a row-parallel all-reduce sums the
same products in a different order than one matmul, so fp32 results differ in the last bits
(measured: 0.9e-5 to 1.9e-5 absolute on logits of magnitude ~20, i.e. ~1e-6 of the scale). Token
parity is exact on these prompts; a decision that sits within ~1e-6 of a threshold could flip
on others (it does for COVER on prompt [11, 12, 13], at a 0.9 draft threshold).
"""

import gc
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from cover_vllm import LLM, SamplingParams
from cover_vllm.config import EngineConfig
from cover_vllm.distributed.comm import GroupComm
from cover_vllm.distributed.tensor_parallel import TensorParallel
from cover_vllm.executor import ExecutorError, WorkerDiedError
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.output import CanvasInput, SchedulerOutput, WorkItem
from cover_vllm.strategies import STRATEGIES
from cover_vllm.worker.worker import Worker
from golden_cases import GOLDEN, check_batched, load_cases

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [40, 41, 42, 43]}]
BACKENDS = ["mp", pytest.param("ray", marks=pytest.mark.ray)]
BLOCK_FAMILIES = {"llada2": 8, "sdar": 4}      # golden block-causal model -> its golden block


def _params(name: str) -> SamplingParams:
    return SamplingParams(max_tokens=16, block_length=8, temperature=0.0, ignore_eos=True,
                          decoding=name, seed=1)


def _golden_batch(family: str, want_stats: bool = False) -> tuple[SchedulerOutput, int]:
    """The golden forward rows as one paged batch (as tests/test_paged_forward.py lays it out);
    a block-causal family's rows are whole canvases under its golden block mask."""
    golden = load_file(str(GOLDEN / family / "forward.safetensors"))
    shift = 1 if family == "dream" else 0
    ids, block = golden["input_ids"], BLOCK_FAMILIES.get(family)
    if block is None:
        mask = golden["attention_mask"].bool()
        rows = [ids[0], ids[1], ids[2][mask[2]]]
    else:
        rows = list(ids)
    items = [WorkItem(f"r{i}", 0, [CanvasInput(r, torch.arange(r.numel()) + 64 * i)],
                      view_start=shift, view_end=int(r.numel()), want_stats=want_stats,
                      causal_block=block)
             for i, r in enumerate(rows)]
    return SchedulerOutput(items), shift


def _model_dir(family: str) -> str:
    return str(GOLDEN / family / "model")


def _config(family: str, **kw) -> EngineConfig:
    return EngineConfig(model=_model_dir(family), decoding="low_confidence", kv_cache="none",
                        num_threads=1, **kw)


def _in_threads(fn, n: int) -> list:
    results, errors = [None] * n, []

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as exc:        # surfaced below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    """Equal up to fp32 summation order: max error relative to the tensor's scale (min 1)."""
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert err <= tol, f"max error {err:.2e} of the scale > {tol:.0e}"


# ---- the sharding transform, two ranks as threads of this process (no Ray, no processes) -----
@contextmanager
def thread_ranks(family: str):
    """(config, spec, the unsharded Worker, two TP ranks as Workers in this process)."""
    config = _config(family)
    resolved = resolve_model(config.model)
    spec = ModelSpec.from_config(resolved.config)
    full = Worker(config, resolved, spec)
    comms = [GroupComm(r, 2, timeout_s=30) for r in range(2)]
    ranks = [Worker(config, resolved, spec, TensorParallel(r, 2, comms[r])) for r in range(2)]
    port = comms[0].serve_store("127.0.0.1")
    _in_threads(lambda r: comms[r].connect("127.0.0.1", port), 2)
    try:
        yield config, spec, full, ranks
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("family", ["llada", pytest.param("dream", marks=pytest.mark.slow),
                                    pytest.param("llada_moe", marks=pytest.mark.slow),
                                    "sdar", "llada2"])
def test_sharded_forward_matches_unsharded_in_threads(family):
    with thread_ranks(family) as (_, _, full, ranks):
        out, _ = _golden_batch(family, want_stats=True)
        want = full.execute_model(out)
        got = _in_threads(lambda r: ranks[r].execute_model(out), 2)
        heads = full.model.dims.num_kv_heads
        assert ranks[0].cache.k[0].shape[1] == heads // 2 and ranks[0].num_pages == full.num_pages
        for i in range(len(out.items)):
            _close(got[0].logits[i], want.logits[i])
            assert torch.equal(got[0].logits[i], got[1].logits[i])   # replicated head
            _close(got[0].drift[i], want.drift[i])                     # stats averaged over ranks
            _close(got[0].attn_in[i], want.attn_in[i])
        _assert_halved(full.model, ranks[0].model)


def _assert_halved(full: torch.nn.Module, rank: torch.nn.Module) -> None:
    """Every parameter of a rank is its whole-model one or half of it, and every projection
    (attention, MLP, each routed and shared expert) is half: the experts are sharded by the
    declared plan, not replicated; routers, norms, embeddings and the head stay whole."""
    whole = dict(full.named_parameters())
    halved = set()
    for name, p in rank.named_parameters():
        if p.numel() * 2 == whole[name].numel():
            halved.add(name)
        else:
            assert p.shape == whole[name].shape, name
    projections = {n for n in whole if n.endswith("_proj.weight") or ".query_key_value." in n
                   or ".dense.weight" in n}
    assert projections and projections <= halved, sorted(projections - halved)
    experts = [n for n in whole if ".experts." in n]
    assert all(n in halved for n in experts)
    assert not any(".gate.weight" in n or "norm" in n or "embed" in n for n in halved)


def test_bad_tensor_parallel_sizes_raise_before_any_process():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the number of "
                                         "attention heads"):
        LLM(_model_dir("llada"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the number of kv "
                                         "heads"):
        LLM(_model_dir("dream"), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM(_model_dir("llada"), tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        EngineConfig(model="x", distributed_timeout_s=0)


# ---- whole engines: rank 0 in this process, rank 1 a process ("mp") or a Ray actor ----------
@pytest.fixture(scope="module")
def reference():
    return {f: LLM(_model_dir(f), num_threads=1) for f in ("llada", "dream")}


TP_ENGINES = [pytest.param((b, f), id=f"{b}-{f}", marks=[pytest.mark.ray] if b == "ray" else [])
              for b in ("mp", "ray") for f in ("llada", "dream")]


@pytest.fixture(scope="module", params=TP_ENGINES)
def tp_llm(request):
    backend, family = request.param
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = LLM(_model_dir(family), tensor_parallel_size=2, distributed_executor_backend=backend,
              num_threads=1)
    yield family, llm
    pids = list(llm.engine.executor.ranks.pids)
    llm.shutdown()
    _assert_gone(pids)


def _assert_gone(pids: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), f"worker processes {pids} outlived shutdown"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow   # worker processes
def test_tp2_paged_forward_logits_match_tp1(tp_llm, reference):
    family, llm = tp_llm
    out, _ = _golden_batch(family)
    got = llm.engine.executor.execute_model(out).logits
    want = reference[family].engine.executor.execute_model(out).logits
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.slow   # worker processes
def test_tp2_tokens_match_tp1_for_every_strategy(tp_llm, reference):
    family, llm = tp_llm
    mismatched = []
    for name in STRATEGIES:
        want = [o.outputs[0].token_ids for o in reference[family].generate(
            PROMPTS, _params(name), use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(name),
                                                            use_tqdm=False)]
        if got != want:
            mismatched.append(name)
    assert not mismatched, f"TP=2 tokens differ from TP=1 for {mismatched} on {family}"


# ---- block-causal families (LLaDA2.x MoE, SDAR): TP=2 (mp) == TP=1 == the official code ----
BLOCK_DECODERS = {"llada2": ("llada2_generate", "llada21_generate"),
                  "sdar": ("sdar_block_diffusion_generate", "sdar_block_diffusion_generate_argmax")}


@pytest.fixture(scope="module", params=sorted(BLOCK_FAMILIES))
def block_tp(request):
    """(family, TP=1 LLM, TP=2 LLM) over a golden block-causal checkpoint, exact per-block KV
    reuse on (the default)."""
    family = request.param
    single = LLM(_model_dir(family), num_threads=1)
    sharded = LLM(_model_dir(family), tensor_parallel_size=2, num_threads=1)
    yield family, single, sharded
    pids = list(sharded.engine.executor.ranks.pids)
    sharded.shutdown()
    _assert_gone(pids)


@pytest.mark.slow   # worker processes
def test_tp2_block_families_golden_cases_match_tp1(block_tp):
    """Every golden generate case of the family (llada2 / llada2_edit / sdar decoders) in one
    call: TP=2 tokens, NFE and finish reasons equal the official ones and TP=1's."""
    family, single, sharded = block_tp
    cases = load_cases(family, BLOCK_DECODERS[family])
    got, want = check_batched(sharded, cases), check_batched(single, cases)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.metrics.nfe for o in got] == [o.metrics.nfe for o in want]


@pytest.mark.slow   # worker processes
def test_tp2_revocable_decoders_inside_blocks_match_tp1(block_tp):
    """COVER (and WINO, Saber, ASRD) inside the current block: TP=2 tokens and NFE == TP=1."""
    family, single, sharded = block_tp
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j + 3) % 290 for j in range(n)]}
               for i, n in enumerate((5, 13, 21))]
    mismatched = []
    for name in ("cover", "wino", "saber", "asrd"):
        params = SamplingParams(max_tokens=20, block_length=BLOCK_FAMILIES[family],
                                temperature=0.0, ignore_eos=True, decoding=name, seed=1)
        want = single.generate(prompts, params, use_tqdm=False)
        got = sharded.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 20 for o in got)
        if ([(o.outputs[0].token_ids, o.metrics.nfe) for o in got]
                != [(o.outputs[0].token_ids, o.metrics.nfe) for o in want]):
            mismatched.append(name)
    assert not mismatched, f"TP=2 differs from TP=1 for {mismatched} on {family}"


# ---- failures -------------------------------------------------------------------------------
@pytest.mark.slow   # worker processes
@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_worker_fails_in_flight_requests_within_seconds(backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = LLM(_model_dir("llada"), tensor_parallel_size=2, distributed_executor_backend=backend,
              num_threads=1, distributed_timeout_s=30)
    executor = llm.engine.executor
    (pid,) = executor.ranks.pids
    real, calls = executor.execute_model, []

    def execute_then_kill(out):           # the third forward of a generation loses rank 1
        calls.append(1)
        if len(calls) == 3:
            os.kill(pid, signal.SIGKILL)
            _assert_gone([pid])
        return real(out)
    executor.execute_model = execute_then_kill
    params = SamplingParams(max_tokens=32, block_length=8, ignore_eos=True,
                            decoding="low_confidence", seed=0)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) died"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert time.monotonic() - start < 15.0
    assert not llm.engine.has_unfinished_requests()            # in-flight requests dropped
    with pytest.raises(WorkerDiedError):                       # and the LLM keeps saying so
        llm.engine.check_health()
    with pytest.raises(ExecutorError):
        llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()


@pytest.mark.slow   # worker processes
def test_hung_worker_times_out_instead_of_hanging():
    llm = LLM(_model_dir("llada"), tensor_parallel_size=2, num_threads=1,
              distributed_timeout_s=2)
    (pid,) = llm.engine.executor.ranks.pids
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(ExecutorError, match="no remote rank reported a failure"):
            llm.generate(PROMPTS, _params("low_confidence"), use_tqdm=False)
        assert time.monotonic() - start < 20.0
    finally:
        llm.shutdown()                     # kills the stopped rank
    _assert_gone([pid])


@pytest.mark.slow   # worker processes
def test_deleting_the_llm_stops_its_worker_processes():
    llm = LLM(_model_dir("dream"), tensor_parallel_size=2, num_threads=1)   # default: "mp"
    pids = list(llm.engine.executor.ranks.pids)
    assert pids and all(_alive(p) for p in pids)
    del llm
    gc.collect()
    _assert_gone(pids)


@pytest.mark.slow   # worker processes
def test_tp2_matches_tp1_on_cover_tiny_tasks():
    """The shipped model on real task prompts: every strategy, TP=2 (mp) == TP=1, text too."""
    from cover_vllm import SamplingParams
    from cover_vllm.tasks import chat_prompt_ids, get_task

    single = LLM("cover-tiny", num_threads=1)
    sharded = LLM("cover-tiny", tensor_parallel_size=2, distributed_executor_backend="mp",
                  num_threads=1)
    try:
        for task_name in ("sudoku4", "arith", "word"):
            task = get_task(task_name)
            prompts = [{"prompt_token_ids": chat_prompt_ids(single.tokenizer, ex.prompt)}
                       for ex in task.eval_split(3)]
            for name in STRATEGIES:
                p = SamplingParams(max_tokens=task.max_tokens, block_length=task.block_length,
                                   decoding=name, seed=0)
                want = [o.outputs[0].text for o in single.generate(prompts, p, use_tqdm=False)]
                got = [o.outputs[0].text for o in sharded.generate(prompts, p, use_tqdm=False)]
                assert got == want, f"{name} on {task_name}"
    finally:
        sharded.shutdown()


def test_ranks_are_sent_a_page_table_once_and_rebuild_every_step():
    """executor/step_delta.py: after a request's first step its page tables are left out of the
    message; the rank's decoded step equals the driver's, as requests come, change and go."""
    import pickle

    from cover_vllm.executor.step_delta import StepDecoder, StepEncoder
    from cover_vllm.scheduler.output import CanvasInput, SchedulerOutput, WorkItem

    def item(rid: str, slots: torch.Tensor, cfg: bool = False) -> WorkItem:
        canvas = [CanvasInput(torch.randint(0, 9, (4,)), slots)]
        if cfg:
            canvas.append(CanvasInput(torch.randint(0, 9, (4,)), slots + 100))
        return WorkItem(rid, 2, canvas, 2, 6)

    a, b = torch.arange(300), torch.arange(300, 600)
    steps = [[item("a", a)], [item("a", a.clone()), item("b", b, cfg=True)],
             [item("b", b, cfg=True)], [item("a", a), item("b", b + 1, cfg=True)]]
    encoder, decoder = StepEncoder(), StepDecoder()
    sizes = []
    for items in steps:
        out = SchedulerOutput(items)
        message = encoder.encode(out)
        sizes.append(len(pickle.dumps(message)))
        got = decoder.decode(pickle.loads(pickle.dumps(message)))
        for want, have in zip(out.items, got.items):
            assert len(want.canvases) == len(have.canvases)
            for cw, ch in zip(want.canvases, have.canvases):
                assert torch.equal(cw.key_slots, ch.key_slots)
                assert torch.equal(cw.input_ids, ch.input_ids)
    # step 3 carries no page table ("b" is known); step 4 resends "a" (it left at step 3) and
    # "b" (its pages changed)
    assert sizes[2] < sizes[0] / 2 and sizes[3] > sizes[1]
