"""Golden logits of the block-diffusion families (LLaDA2.x, SDAR): each model, loaded by
cover_vllm's own loader, matches the official code in fp32 with the official masks and without;
block-causality, the 2-D key-mask path, and `make-checkpoint` of their shapes.

Fixtures are the in-repo copy of ../shared/golden/{llada2,sdar} (its README, "Block-diffusion
families", describes them).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cover_vllm.models.configs import LLADA2_MINI, SDAR_4B
from cover_vllm.models.loader import load_model
from cover_vllm.models.query_masks import block_causal_allowed

from golden_cases import GOLDEN

LOGIT_TOL = 1e-4
FAMILIES = ["llada2", "sdar"]
MASK_KEY = {"llada2": "attention_mask_4d", "sdar": "attention_mask_3d"}


@pytest.fixture(scope="module")
def models() -> dict:
    return {f: load_model(GOLDEN / f / "model") for f in FAMILIES}


@pytest.fixture(scope="module")
def golden() -> dict:
    return {f: load_file(str(GOLDEN / f / "forward.safetensors")) for f in FAMILIES}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_reads_golden_config(family, models):
    spec = models[family].spec
    assert spec.family == family
    assert (spec.vocab_size, spec.mask_token_id, spec.eos_token_ids) == (300, 299, (298,))
    assert spec.logit_shift == 0 and spec.attention.is_block_causal
    block = {"llada2": 32, "sdar": 4}[family]     # LLaDA2: generate's default; SDAR: config
    assert spec.attention.block_size == spec.default_block_length == block


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_with_the_official_mask_match_golden(family, models, golden):
    g = golden[family]
    out = models[family](g["input_ids"], attention_mask=g[MASK_KEY[family]],
                         position_ids=g["position_ids"])
    assert out.shape == g["logits"].shape
    assert _max_diff(out, g["logits"]) <= LOGIT_TOL


@torch.no_grad()
def test_llada2_without_mask_is_bidirectional_and_matches_golden(models, golden):
    g = golden["llada2"]
    out = models["llada2"](g["input_ids"])
    assert _max_diff(out, g["logits_nomask"]) <= LOGIT_TOL
    assert _max_diff(out, g["logits"]) > 1e-2          # the official mask does change logits


@torch.no_grad()
def test_sdar_full_attention_and_default_mask(models, golden):
    """An all-ones mask is the official flash-attention branch (`logits_full_attention`); no
    mask means the block-causal mask of config.json's block_size (the official model crashes)."""
    g, model = golden["sdar"], models["sdar"]
    ones = torch.ones(1, 40, 40, dtype=torch.long)
    assert _max_diff(model(g["input_ids"], attention_mask=ones),
                     g["logits_full_attention"]) <= LOGIT_TOL
    assert _max_diff(model(g["input_ids"]), g["logits"]) <= LOGIT_TOL
    assert torch.equal(block_causal_allowed(40, 4)[None].long(), g["attention_mask_3d"])


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_mask_layouts_are_equivalent(family, models, golden):
    """3-D and 4-D, bool and 0/1, one row or one per batch row: the same logits."""
    g, model = golden[family], models[family]
    m = g[MASK_KEY[family]].reshape(1, 40, 40)
    want = model(g["input_ids"], attention_mask=m)
    for variant in (m[:, None], m.bool(), m.float(), m.expand(3, 40, 40),
                    m[:, None].expand(3, 1, 40, 40)):
        assert torch.equal(model(g["input_ids"], attention_mask=variant), want)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_block_causal_prefix_invariance(family, models, golden):
    """Under the block mask, the logits of the first k blocks do not depend on later tokens
    (up to fp32 rounding of attention over a different key count: 1.2-1.4e-5 seen)."""
    g, model = golden[family], models[family]
    ids, block = g["input_ids"], 8 if family == "llada2" else 4    # the golden mask's block
    full = model(ids, attention_mask=block_causal_allowed(40, block)[None])
    for cut in (block, 2 * block, 24):
        prefix = model(ids[:, :cut], attention_mask=block_causal_allowed(cut, block)[None])
        assert _max_diff(prefix, full[:, :cut]) <= 5e-5
    changed = ids.clone()
    changed[:, 24:] = 299                                 # later blocks -> [MASK]
    other = model(changed, attention_mask=block_causal_allowed(40, block)[None])
    assert _max_diff(other[:, :24], full[:, :24]) <= 5e-5
    assert _max_diff(other[:, 24:], full[:, 24:]) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_two_d_key_mask(family, models, golden):
    """A 2-D [B, L] mask hides keys from every query, on top of the model's own visibility
    (LLaDA2: none; SDAR: its block-causal mask); an all-ones one is no mask."""
    g, model = golden[family], models[family]
    ids = g["input_ids"]
    assert torch.equal(model(ids, attention_mask=torch.ones(3, 40, dtype=torch.long)), model(ids))
    keys = torch.ones(3, 40, dtype=torch.long)
    keys[2, :5] = 0                                       # row 2: five left pads
    base = (torch.ones(40, 40, dtype=torch.bool) if family == "llada2"
            else block_causal_allowed(40, 4))
    explicit = base[None, None] & keys.bool()[:, None, None, :]
    got = model(ids, attention_mask=keys)
    real = slice(8, None)             # SDAR: rows of blocks 0-1 see only pads or few keys
    assert torch.equal(got[:, real], model(ids, attention_mask=explicit)[:, real])
    assert _max_diff(got[:2], model(ids)[:2]) == 0.0      # rows 0-1 unchanged
    assert _max_diff(got[2, real], model(ids)[2, real]) > 1e-3


def test_mask_errors_name_the_field(models):
    model, ids = models["llada2"], torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="additive"):
        model(ids, attention_mask=torch.zeros(1, 1, 6, 6).masked_fill(torch.eye(6) == 0, -1e9))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="attention_mask has 5 dims"):
        model(ids, attention_mask=torch.ones(1, 1, 1, 6, 6))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=torch.arange(5)[None])


TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 300,
        "mask_token_id": 299, "eos_token_id": 298, "pad_token_id": 298, "eot_token_id": None}
SMALL_SHAPES = {
    "llada2": {**LLADA2_MINI, **TINY, "num_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
               "topk_group": 2, "moe_intermediate_size": 16},
    "sdar": {**SDAR_4B, **TINY, "tie_word_embeddings": True},
}
OFFICIAL_NAMES = {
    "llada2": ["model.word_embeddings.weight", "model.layers.0.attention.query_key_value.weight",
               "model.layers.0.attention.query_layernorm.weight",
               "model.layers.0.mlp.up_proj.weight",
               "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias",
               "model.layers.1.mlp.experts.7.down_proj.weight",
               "model.layers.1.mlp.shared_experts.gate_proj.weight", "lm_head.weight"],
    "sdar": ["model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
             "model.layers.1.self_attn.k_norm.weight", "model.layers.1.mlp.down_proj.weight",
             "model.norm.weight"],
}


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_make_checkpoint_writes_official_names_and_the_dummy_weights(family, tmp_path):
    """A small version of each built-in shape, written by `cover-vllm make-checkpoint`: the
    official tensor names and `architectures`; it loads to exactly the dummy-weight model."""
    from cover_vllm.entrypoints.cli import main

    (tmp_path / "shape").mkdir()
    (tmp_path / "shape" / "config.json").write_text(json.dumps(SMALL_SHAPES[family]))
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--shape", str(tmp_path / "shape"), "--dtype", "float32",
                 "--out", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(OFFICIAL_NAMES[family]) <= set(index["weight_map"])
    loaded = load_model(out)
    dummy = load_model(out, load_format="dummy")
    assert loaded.spec.hf_config["architectures"] == [type(loaded).__name__]
    want, got = dummy.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(0, 299, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids), dummy(ids))
