"""DiffusionGemma's paged route (`encode_paged` / `decode_paged`) against its dense `forward`
and the golden logits, and tensor parallelism (TP=2 == TP=1) on the golden forward cases,
unquantized, int8 and w8a8 (with the memory plan of a w8a8 rank).

The paged batches here are laid out the way an engine would: every sequence owns scattered
pages of a shared pool, prompts are encoded in chunks, sequences of different lengths share a
call, and a finished canvas is encoded incrementally before the next one is denoised.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cover_vllm.distributed.comm import GroupComm
from cover_vllm.distributed.tensor_parallel import TensorParallel, param_slices
from cover_vllm.layers.common import pack_projections
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.diffusion_gemma_paged import DecodeBatch, EncodeBatch, KVTable
from cover_vllm.models.gemma4_config import FULL, SLIDING
from cover_vllm.models.loader import build_model, load_model, materialize, weight_source
from cover_vllm.models.quantization import load_quantized, quantize_model
from cover_vllm.models.spec import ModelSpec
from golden_cases import GOLDEN
from test_diffusion_gemma import DIR, golden_calls
from test_tensor_parallel import _in_threads

PAGE = 4            # tokens per page: prompts and canvases straddle page boundaries
RING = 32           # slots of a sequence's sliding-layer ring (>= window - 1 + longest chunk)
POOL = 64 * PAGE    # full layers' slots (sliding ones too, unless in rings)
PAGED_TOL = 3e-5    # paged vs dense: the same math in another summation order (measured
                    # up to 1.3e-5 on logits up to 22)


class Pages:
    """A pool of PAGE-token pages handed out in a shuffled order, a page table per sequence;
    with `ring`, sliding layers keep each sequence's K/V in a ring of RING slots instead (slot
    = ring start + position mod RING: only the last window - 1 positions are ever read)."""

    def __init__(self, num_pages: int = 64, seed: int = 0, ring: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_pages, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}
        self.first: dict[str, int] = {}          # first encoded position (a padded row's > 0)
        self.ring, self.rings = ring, {}         # sequence -> its ring's first slot

    def slots(self, seq: str, positions: list[int], kind: str = FULL) -> torch.Tensor:
        if kind == SLIDING and self.ring:
            base = self.rings.setdefault(seq, len(self.rings) * RING)
            return torch.tensor([base + p % RING for p in positions])
        table = self.tables.setdefault(seq, [])
        while len(table) * PAGE <= max(positions, default=-1):
            table.append(self.free.pop())
        return torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in positions])

    def keys(self, window: int, seqs: list[str], ends: list[int],
             chunk_starts: list[int]) -> dict[str, KVTable]:
        """Each layer kind's table of every sequence's keys before `ends`: all encoded positions
        for full layers; for sliding layers in a ring only the last window - 1 before the
        chunk (the rest has been overwritten), else all of them (masked by position)."""
        out = {}
        for kind in (SLIDING, FULL):
            spans = [range(max(self.first[seq], start - (window - 1))
                           if kind == SLIDING and self.ring else self.first[seq], end)
                     for seq, end, start in zip(seqs, ends, chunk_starts)]
            width = max(len(span) for span in spans)
            slots = torch.zeros(len(seqs), width, dtype=torch.long)
            positions = torch.full((len(seqs), width), -1, dtype=torch.long)
            for i, (seq, span) in enumerate(zip(seqs, spans)):
                slots[i, :len(span)] = self.slots(seq, list(span), kind)
                positions[i, :len(span)] = torch.tensor(list(span), dtype=torch.long)
            out[kind] = KVTable(slots, positions)
        return out


def allocate(model, ring: bool):
    """Pools for the tests: 64 pages; sliding layers in 8 rings of RING slots with `ring`."""
    return model.allocate_kv(POOL, 8 * RING if ring else None)


def encode(model, kv, pages: Pages, chunks: list[tuple[str, list[int], int]]) -> None:
    """One encoder call over (sequence, token ids, first position) chunks."""
    seqs = [seq for seq, _, _ in chunks]
    starts = [start for _, _, start in chunks]
    positions = [list(range(start, start + len(ids))) for _, ids, start in chunks]
    for seq, start in zip(seqs, starts):
        pages.first.setdefault(seq, start)
    model.encode_paged(EncodeBatch(
        input_ids=torch.tensor([t for _, ids, _ in chunks for t in ids]),
        positions=torch.tensor([p for pos in positions for p in pos]),
        seq_lens=[len(ids) for _, ids, _ in chunks],
        write_slots={kind: torch.cat([pages.slots(seq, pos, kind)
                                      for seq, pos in zip(seqs, positions)])
                     for kind in (SLIDING, FULL)},
        keys=pages.keys(model.window, seqs, [p[-1] + 1 for p in positions], starts)), kv)


def decode(model, kv, pages: Pages, seqs: list[str], encoded: list[int],
           canvases: torch.Tensor, sc: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, C, V] of canvases right after each sequence's `encoded` positions."""
    positions = torch.stack([torch.arange(n, n + canvases.shape[1]) for n in encoded])
    keys = pages.keys(model.window, seqs, encoded, encoded)
    return model.decode_paged(DecodeBatch(canvases, positions, keys, sc), kv)


@pytest.fixture(scope="module")
def golden():
    return load_file(str(DIR / "forward.safetensors"))


@pytest.fixture(scope="module")
def model():
    return load_model(DIR / "model")


@pytest.mark.parametrize("ring", [False, True], ids=["all_pages", "sliding_ring"])
def test_paged_prompts_of_every_length_in_one_batch(model, golden, ring):
    """Rows of three golden cases (prompts of 5, 13 and 29 tokens; the long one encoded in two
    chunks, the second in the same call as the others) in one encoder and one decoder call;
    sliding layers in scattered pages or in per-sequence rings of 32 slots."""
    rows = [("short", golden["input_ids_short"][0], "logits_short", 0),
            ("mid", golden["input_ids"][1], "logits", 1),
            ("long", golden["input_ids_long"][2], "logits_long", 2)]
    kv, pages = allocate(model, ring), Pages(ring=ring)
    with torch.no_grad():
        encode(model, kv, pages, [("long", rows[2][1][:11].tolist(), 0)])
        encode(model, kv, pages, [("short", rows[0][1].tolist(), 0),
                                  ("mid", rows[1][1].tolist(), 0),
                                  ("long", rows[2][1][11:].tolist(), 11)])
        canvases = golden["decoder_input_ids"][[r[3] for r in rows]]
        got = decode(model, kv, pages, [r[0] for r in rows],
                     [len(r[1]) for r in rows], canvases)
        for i, (_, ids, name, row) in enumerate(rows):
            dense = model(input_ids=ids[None], decoder_input_ids=canvases[i:i + 1])[0]
            assert (got[i] - dense).abs().max() <= PAGED_TOL
            assert (got[i] - golden[name][row]).abs().max() <= 1e-4


@pytest.mark.parametrize("ring", [False, True], ids=["all_pages", "sliding_ring"])
def test_paged_self_conditioning_padding_and_a_second_canvas(model, golden, ring):
    """Self-conditioning logits on the model's device; a left-padded golden row as its real
    tokens at their unshifted positions; the first canvas encoded incrementally, then the
    second denoised after it (the README: 1.2e-5 from the one-shot encoding)."""
    kv, pages = allocate(model, ring), Pages(seed=1, ring=ring)
    ids, canvas = golden["input_ids"], golden["decoder_input_ids"]
    pads = (golden["attention_mask"] == 0).sum(dim=1).tolist()              # 0 / 4 / 9
    with torch.no_grad():
        encode(model, kv, pages, [(f"p{r}", ids[r].tolist(), 0) for r in range(3)] +
               [(f"pad{r}", golden["input_ids_padded"][r, pads[r]:].tolist(), pads[r])
                for r in range(3)])
        plain = [f"p{r}" for r in range(3)]
        sc = golden["self_conditioning_logits"]
        got_sc = decode(model, kv, pages, plain, [13] * 3, canvas, sc)
        assert (got_sc - golden["logits_sc"]).abs().max() <= 1e-4
        got_pad = decode(model, kv, pages, [f"pad{r}" for r in range(3)], [13] * 3, canvas)
        assert (got_pad - golden["logits_padded"]).abs().max() <= 1e-4
        first = golden["input_ids_2"][:, 13:]                 # the argmax of the first canvas
        encode(model, kv, pages, [(f"p{r}", first[r].tolist(), 13) for r in range(3)])
        got_2 = decode(model, kv, pages, plain, [29] * 3, golden["decoder_input_ids_2"])
        assert (got_2 - golden["logits_2"]).abs().max() <= 1e-4


# ---- tensor parallelism ------------------------------------------------------------------
def _rank_model(rank: int, comm: GroupComm | None, quantization: str | None = None):
    """Rank `rank` of 2 (None: the whole model), as a Worker builds it: sharded on meta,
    quantized there, then given storage and filled with its slices of the weights."""
    resolved = resolve_model(str(GOLDEN / "diffusion_gemma" / "model"))
    spec = ModelSpec.from_config(resolved.config)
    model = build_model(spec, torch.float32, "meta")
    source = weight_source(resolved, model)
    slices = None
    if comm is not None:
        slices = param_slices(model, rank, 2)
        TensorParallel(rank, 2, comm).shard(model)
    quantize_model(model, quantization)
    materialize(model, "cpu")
    load_quantized(model, source, slices)
    pack_projections(model)
    return model.eval().requires_grad_(False)


def _connected(n: int = 2) -> list[GroupComm]:
    comms = [GroupComm(r, n, timeout_s=60) for r in range(n)]
    port = comms[0].serve_store("127.0.0.1")
    _in_threads(lambda r: comms[r].connect("127.0.0.1", port), n)
    return comms


def test_tensor_parallel_2_equals_1_on_the_golden_forward(model, golden):
    """TP=2 (ranks as threads): q heads and the sliding layers' 2 kv heads split, the full
    layer's single kv head copied to both ranks, the experts' and MLPs' widths split; all six
    golden forward cases and a paged decode equal TP=1 up to fp32 summation order."""
    comms = _connected()
    try:
        ranks = _in_threads(lambda r: _rank_model(r, comms[r]), 2)
        full_attn, sliding_attn = (ranks[1].model.decoder.layers[i].self_attn for i in (2, 0))
        assert full_attn.local_heads == (2, 1) and sliding_attn.local_heads == (2, 1)
        assert torch.equal(full_attn.k_proj.weight, model.model.decoder.layers[2].self_attn
                           .k_proj.weight)                              # the copied kv head
        experts = ranks[1].model.decoder.layers[0].experts
        assert tuple(experts.gate_up_proj.shape) == (4, 32, 64)
        assert ranks[0].kv_layer_shapes() == [(1, 16), (1, 16), (1, 32)]
        calls = golden_calls(golden)

        def forward(r):
            with torch.no_grad():
                return {name: ranks[r](**call) for name, call in calls.items()}
        got = _in_threads(forward, 2)
        for name in calls:
            assert torch.equal(got[0][name], got[1][name])
            assert (got[0][name] - golden[name]).abs().max() <= 1e-4, name
            with torch.no_grad():
                want = model(**calls[name])
            assert (got[0][name] - want).abs().max() <= 1e-5 * max(1.0, want.abs().max()), name

        def paged(r):
            kv, pages = allocate(ranks[r], True), Pages(ring=True)
            with torch.no_grad():
                encode(ranks[r], kv, pages, [(str(i), golden["input_ids_long"][i].tolist(), 0)
                                             for i in range(3)])
                return decode(ranks[r], kv, pages, ["0", "1", "2"], [29] * 3,
                              golden["decoder_input_ids"])
        logits = _in_threads(paged, 2)
        assert (logits[0] - golden["logits_long"]).abs().max() <= 1e-4
    finally:
        for c in comms:
            c.close()


def _tp2_and_tp1(call: dict, quantization: str):
    """(the TP=1 model, its logits of `call`, the two TP=2 ranks, their logits), quantized."""
    whole = _rank_model(0, None, quantization)
    comms = _connected()
    try:
        ranks = _in_threads(lambda r: _rank_model(r, comms[r], quantization), 2)

        def forward(r):
            with torch.no_grad():
                return ranks[r](**call)
        got = _in_threads(forward, 2)
    finally:
        for c in comms:
            c.close()
    with torch.no_grad():
        want = whole(**call)
    return whole, want, ranks, got


def test_tensor_parallel_int8_equals_tp1_int8(golden):
    """Quantized shards hold exactly TP=1's codes (int8 scales by whole rows, also for the
    experts' down_proj split along its input columns): TP=2 int8 == TP=1 int8 (fp32)."""
    _, want, ranks, got = _tp2_and_tp1(golden_calls(golden)["logits_long"], "int8")
    assert ranks[0].model.decoder.layers[1].experts.down_proj_qweight.shape == (4, 64, 16)
    assert (got[0] - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())


def test_tensor_parallel_w8a8_equals_tp1_and_the_plan_counts_each_rank(golden):
    """w8a8 (experts int8 weight-only): row-parallel ranks quantize their input columns with
    the whole row's scale and sum integer sums, so TP=2 == TP=1 up to the experts' fp32
    partial sums (measured 6.7e-6); the memory plan's bytes per rank are what a rank holds
    (oneDNN's blocks of its shard, whole per-channel scales of row-split weights, the copied
    kv head), exactly."""
    from cover_vllm.layers.common import projection_groups
    from cover_vllm.worker.memory import weight_bytes

    whole, want, ranks, got = _tp2_and_tp1(golden_calls(golden)["logits_long"], "w8a8")
    assert torch.equal(got[0], got[1])
    assert (got[0] - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())

    def held(model) -> int:
        kernels = sum(g.quant.kernel.nbytes() for g in projection_groups(model))
        experts = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                      if ".experts." in n)
        return sum(p.numel() * p.element_size() for p in model.parameters()) + kernels + experts
    meta = build_model(ModelSpec.from_config(resolve_model(str(DIR / "model")).config),
                       torch.float32, "meta")
    quantize_model(meta, "w8a8")
    assert weight_bytes(meta, 1)[0] == held(whole)
    assert weight_bytes(meta, 2) == (held(ranks[0]), 2 * held(ranks[1]))


def test_tensor_parallel_kv_head_rule():
    """kv heads split into whole heads or, fewer than the ranks, copied; otherwise refused."""
    from cover_vllm.distributed.tensor_parallel import check_tensor_parallel

    spec = ModelSpec.from_config(resolve_model(str(DIR / "model")).config)
    meta = build_model(spec, torch.float32, "meta")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the 4 heads"):
        check_tensor_parallel(meta, 3)
    check_tensor_parallel(meta, 4)       # sliding: 2 kv heads copied to 2 ranks each
    released = ModelSpec.from_config(resolve_model("diffusion-gemma-26b-a4b").config)
    check_tensor_parallel(build_model(released, torch.bfloat16, "meta"), 4)
    full_k = param_slices(meta, 1, 4)["model.decoder.layers.2.self_attn.k_proj.weight"]
    assert (full_k.start, full_k.size, full_k.full) == (0, 32, 32)
