"""One forward for every device (issue #42): inside the model forward no op's output size or
result depends on tensor values (`unique`, `nonzero`, boolean indexing, `.item()`, ...), so
nothing in it waits for the host and a CUDA graph could capture it. Each family's engine steps
run on the meta device (shapes only) with the model's forward under `NoDataDependentOps`, a
dispatch mode that fails on such an op touching a device tensor; COVER runs in every override
mode. The mode itself is shown to catch each kind of op."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cover_vllm import LLM, SamplingParams
from cover_vllm.attention.sdpa import OVERRIDE_MODES, SDPABackend

# ops whose output size (or a host value) depends on the data: a device would have to finish and
# tell the host before the next op could be launched
DATA_DEPENDENT = {"nonzero", "nonzero_numpy", "argwhere", "unique", "_unique", "_unique2",
                  "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                  "_local_scalar_dense", "masked_select", "is_nonzero", "equal", "item",
                  "bincount"}


class DataDependentOp(AssertionError):
    pass


class NoDataDependentOps(TorchDispatchMode):
    """Fails on a data-dependent op with a tensor off the CPU among its inputs or outputs;
    `seen` counts every op it let through."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type != "cpu" for t in flat):
            name = func.overloadpacket.__name__
            if name in DATA_DEPENDENT or _bool_index(name, args) or _sized_by_values(
                    func, name, args, kwargs):
                raise DataDependentOp(f"{func} in the model forward")
        self.seen += 1
        return func(*args, **kwargs)


def _bool_index(name: str, args) -> bool:
    """x[mask] / x[mask] = y: the selected count depends on the mask's values."""
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_") or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


def _sized_by_values(func, name: str, args, kwargs) -> bool:
    """repeat_interleave with tensor repeats and no output_size: sum(repeats) rows."""
    return (name == "repeat_interleave" and isinstance(args[0], torch.Tensor)
            and func._overloadname == "Tensor" and kwargs.get("output_size") is None
            and (len(args) < 3 or args[-1] is None))


@pytest.mark.parametrize("op", ["unique", "nonzero", "item", "bool_index", "bool_put",
                                "masked_select", "repeat_interleave", "bool"])
def test_the_mode_catches_every_kind_of_data_dependent_op(op):
    x = torch.zeros(6, 3, device="meta")
    mask = torch.zeros(6, dtype=torch.bool, device="meta")
    run = {"unique": lambda: torch.unique(x),
           "nonzero": lambda: x.nonzero(),
           "item": lambda: x[0, 0].item(),
           "bool": lambda: bool(x[0, 0]),
           "bool_index": lambda: x[mask],
           "bool_put": lambda: x.index_put_((mask,), torch.ones(3, device="meta")),
           "masked_select": lambda: x.masked_select(mask[:, None]),
           "repeat_interleave": lambda: x.repeat_interleave(
               torch.ones(6, dtype=torch.long, device="meta"), dim=0)}[op]
    with pytest.raises(DataDependentOp), NoDataDependentOps():
        run()


def test_the_mode_lets_sized_ops_and_host_work_through():
    x = torch.zeros(6, 3, device="meta")
    with NoDataDependentOps() as mode:
        x.index_select(0, torch.arange(2, device="meta")).repeat_interleave(2, dim=0)
        x[torch.tensor([1, 2])]
        torch.unique(torch.tensor([3, 1, 3])).tolist()      # host only: no device waits
    assert mode.seen >= 4


def _watch(model, names: tuple[str, ...], counts: list[int]) -> None:
    """Run each of `model`'s forward methods `names` under NoDataDependentOps."""
    for name in names:
        forward = getattr(model, name)

        @functools.wraps(forward)
        def watched(*args, _forward=forward, **kwargs):
            with NoDataDependentOps() as mode:
                out = _forward(*args, **kwargs)
            counts.append(mode.seen)
            return out

        setattr(model, name, watched)


def _run(llm: LLM, params: SamplingParams, batch: int) -> None:
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"sync-{i}", {"prompt_token_ids": [5 + i % 7] * (40 + i)}, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert steps < 200, "the dry run does not end"


def _meta_llm(model: str, **kwargs) -> LLM:
    return LLM(model, load_format="dummy", device="meta", num_threads=1,
               kv_cache_memory_bytes=4 << 30, max_num_seqs=4, **kwargs)


@pytest.fixture(scope="module")
def llada2_short(tmp_path_factory) -> str:
    """LLaDA2.0-mini's shape with 4 layers (1 dense, 3 MoE): the 20-layer bf16 model exceeds
    this host's memory plan, and quantized experts have no stacked path."""
    import json

    from cover_vllm.models.configs import LLADA2_MINI
    path = tmp_path_factory.mktemp("llada2-short")
    (path / "config.json").write_text(json.dumps({**LLADA2_MINI, "num_hidden_layers": 4}))
    return str(path)


@pytest.mark.parametrize("model,decoding,quantization", [
    ("llada-8b", "low_confidence", None), ("llada-8b", "threshold", None),
    ("llada-8b", "wino", None), ("llada-8b", "low_confidence", "w8a8"),
    ("dream-7b", "low_confidence", None), ("llada-moe-7b", "low_confidence", None),
    ("llada2", "low_confidence", None), ("sdar-8b", "low_confidence", None),
    ("sdar-8b", "cover", "int4")])
def test_every_family_forward_is_free_of_data_dependent_ops(model, decoding, quantization,
                                                           request):
    """The sparse MoE blocks (LLaDA-MoE, LLaDA2.x) run their stacked experts as grouped GEMMs
    off the CPU (layers/expert_stack.py)."""
    if model == "llada2":
        model = request.getfixturevalue("llada2_short")
    llm = _meta_llm(model, quantization=quantization)
    counts: list[int] = []
    _watch(llm.engine.executor.runner.model, ("forward_tokens",), counts)
    _run(llm, SamplingParams(max_tokens=32, block_length=32, ignore_eos=True,
                             decoding=decoding), batch=3)
    assert counts and min(counts) > 0, "the forward was not watched"


@pytest.mark.parametrize("override", [m for m in OVERRIDE_MODES])
def test_cover_override_rows_are_free_of_data_dependent_ops(override):
    """COVER's override rows in every mode, at batch 1 and 3 (rows with several seeds)."""
    llm = _meta_llm("llada-8b")
    runner = llm.engine.executor.runner
    runner.backend = SDPABackend(override=override)
    counts: list[int] = []
    _watch(runner.model, ("forward_tokens",), counts)
    for batch in (1, 3):
        _run(llm, SamplingParams(max_tokens=32, block_length=32, ignore_eos=True,
                                 decoding="cover"), batch)
    assert counts and min(counts) > 0


def test_diffusion_gemma_forward_is_free_of_data_dependent_ops():
    llm = _meta_llm("diffusion-gemma-26b-a4b", quantization="int4")
    counts: list[int] = []
    _watch(llm.engine.executor.runner.model, ("encode_paged", "decode_paged"), counts)
    _run(llm, SamplingParams(max_tokens=256, decoding_params={"max_denoising_steps": 2}), 2)
    assert len(counts) >= 2 and min(counts) > 0


class NoHostTensors(TorchDispatchMode):
    """Fails on an op that reads a host tensor into device work: a copy to the device (a graph
    would replay the capture's bytes) or a host scalar (a graph would bake its value in)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type != "cpu" for t in flat + outs) and any(
                t.device.type == "cpu" for t in flat):
            raise DataDependentOp(f"{func} reads a host tensor in the captured forward")
        return out


def test_the_mode_catches_host_tensors_in_device_work():
    x = torch.zeros(6, 3, device="meta")
    for run in (lambda: torch.arange(3).to("meta"), lambda: x * torch.tensor(2.0),
                lambda: x.index_select(0, torch.tensor([1]))):
        with pytest.raises(DataDependentOp), NoHostTensors():
            run()
    with NoHostTensors():
        x[:2] * 2.0 + x.index_select(0, torch.arange(2, device="meta"))


@pytest.mark.parametrize("model,decoding", [
    ("llada-8b", "low_confidence"), ("llada-8b", "wino"), ("dream-7b", "threshold"),
    ("sdar-8b", "low_confidence"), ("llada-8b", "cover")])
def test_the_captured_forward_reads_nothing_from_the_host(model, decoding, monkeypatch):
    """What a CUDA graph captures (worker/cuda_graphs.py: `embed` + `forward_tokens` over the
    static buffers, padded) run on the meta device with the graph path forced: no host tensor
    enters it, no value leaves it, and every replay repeats its capture's ops."""
    import cover_vllm.worker.worker as worker_module
    from cover_vllm.worker.graph_backends import Rerun

    monkeypatch.setattr(worker_module, "capture_backend_for", lambda config, device: Rerun())
    llm = _meta_llm(model)
    graphs = llm.engine.executor.runner.graphs
    forward = graphs.forward

    def watched(*args):
        with NoDataDependentOps(), NoHostTensors():
            return forward(*args)

    graphs.forward = watched
    params = {"cover": {"w_influence": 0.0, "w_drift": 0.0}}.get(decoding, {})
    for _ in range(2):                  # the second run replays the first one's graphs
        _run(llm, SamplingParams(max_tokens=32, block_length=32, ignore_eos=True,
                                 decoding=decoding, decoding_params=params), batch=3)
    assert graphs.counts.replays > graphs.counts.captures > 0
