"""DiffusionGemma (models/diffusion_gemma.py): the golden forward logits of transformers 5.24,
both config.json forms, text only, the released 26B-A4B shape (memory refusal in bf16, int4
plan, FLOPs with active experts), and weight-only quantization of its stacked experts (also
under w8a8, whose other projections run int8 activations).

Fixtures: tests/fixtures/golden/diffusion_gemma (the model and forward.safetensors of
../shared/golden/diffusion_gemma; README "DiffusionGemma").
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cover_vllm import LLM
from cover_vllm.flops import FlopModel
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.gemma4_config import flatten_config, layer_shapes
from cover_vllm.models.loader import build_model, load_model
from cover_vllm.models.quantization import load_quantized_model, quantize_model
from cover_vllm.models.spec import ModelSpec
from cover_vllm.worker.memory import GiB, weight_bytes
from dg_reference import LOGIT_TOL
from golden_cases import GOLDEN

DIR = GOLDEN / "diffusion_gemma"


def golden_calls(g: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """forward.safetensors' six logits tensors -> the transformers arguments that made them."""
    canvas = {"decoder_input_ids": g["decoder_input_ids"]}
    return {
        "logits": {"input_ids": g["input_ids"], **canvas},
        "logits_sc": {"input_ids": g["input_ids"], **canvas,
                      "self_conditioning_logits": g["self_conditioning_logits"]},
        "logits_padded": {"input_ids": g["input_ids_padded"], **canvas,
                          "attention_mask": g["attention_mask"],
                          "decoder_attention_mask": g["decoder_attention_mask"]},
        "logits_short": {"input_ids": g["input_ids_short"], **canvas},
        "logits_long": {"input_ids": g["input_ids_long"], **canvas},
        "logits_2": {"input_ids": g["input_ids_2"],
                     "decoder_input_ids": g["decoder_input_ids_2"]},
    }


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(str(DIR / "forward.safetensors"))


@pytest.fixture(scope="module")
def model():
    return load_model(DIR / "model")


@pytest.mark.parametrize("name", list(golden_calls(dict.fromkeys(
    ["input_ids", "decoder_input_ids", "self_conditioning_logits", "input_ids_padded",
     "attention_mask", "decoder_attention_mask", "input_ids_short", "input_ids_long",
     "input_ids_2", "decoder_input_ids_2"]))))
def test_golden_logits(model, golden, name):
    with torch.no_grad():
        got = model(**golden_calls(golden)[name])
    assert got.dtype == torch.float32 and got.shape == golden[name].shape == (3, 16, 300)
    assert (got - golden[name]).abs().max().item() <= LOGIT_TOL


def test_the_inputs_matter(model, golden):
    """Guards against silently ignored arguments: self-conditioning moves logits (by up to
    15.6 in the golden set), padding changes only the padded rows, the window matters."""
    calls = golden_calls(golden)
    with torch.no_grad():
        plain, sc = model(**calls["logits"]), model(**calls["logits_sc"])
        padded = model(**calls["logits_padded"])
        no_dec_mask = model(**{k: v for k, v in calls["logits_padded"].items()
                               if k != "decoder_attention_mask"})
    assert (sc - plain).abs().max() > 1.0
    torch.testing.assert_close(padded[0], plain[0], atol=1e-5, rtol=0)    # row 0: no pads
    assert (padded[1:] - plain[1:]).abs().max() > 1e-2
    assert (no_dec_mask[1:] - padded[1:]).abs().max() > 1e-3   # the decoder saw the pad keys


def test_spec_reads_the_nested_config(model):
    spec = model.spec
    assert (spec.family, spec.vocab_size, spec.mask_token_id) == ("diffusion_gemma", 300, None)
    assert (spec.eos_token_ids, spec.pad_token_id, spec.default_block_length) == ((1, 106), 0, 16)
    assert (spec.max_model_len, spec.hidden_size, spec.hf_config["torch_dtype"]) == (
        4096, 64, "float32")
    shapes = [(s.sliding, s.num_kv_heads, s.head_dim, s.rotated_pairs, s.k_eq_v)
              for s in layer_shapes(spec.hf_config)]
    assert shapes == [(True, 2, 16, 8, False)] * 2 + [(False, 1, 32, 4, True)]
    full = model.model.decoder.layers[2].self_attn
    assert full.v_proj is None and tuple(full.q_proj.weight.shape) == (128, 64)


def released_form(config: dict, global_head_dim: int | None = 32,
                  global_kv: int | None = 1) -> dict:
    """The golden config.json rewritten the way the released checkpoint has it: no
    `per_layer_config`, the full layers' sizes in `global_head_dim` and
    `num_global_key_value_heads`."""
    text = {k: v for k, v in config["text_config"].items() if k != "per_layer_config"}
    if global_head_dim is not None:
        text["global_head_dim"] = global_head_dim
    if global_kv is not None:
        text["num_global_key_value_heads"] = global_kv
    return {**config, "text_config": text}


def test_the_released_config_form_loads_the_same_model(tmp_path, model, golden):
    config = json.loads((DIR / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(released_form(config)))
    shutil.copy(DIR / "model" / "model.safetensors", tmp_path)
    other = load_model(tmp_path)
    call = golden_calls(golden)["logits_long"]
    with torch.no_grad():
        assert torch.equal(other(**call), model(**call))
    # the defaults: global_head_dim 512, kv heads those of the sliding layers
    flat = flatten_config(released_form(config, None, None))
    assert [(s.head_dim, s.num_kv_heads) for s in layer_shapes(flat)] == [(16, 2)] * 2 + [
        (512, 2)]


def test_text_only_the_vision_tower_is_never_loaded(model, golden):
    from cover_vllm.models.weights import CheckpointWeights

    names = CheckpointWeights(DIR / "model").names()
    vision = {n for n in names if ".vision_tower." in n or ".embed_vision." in n}
    assert len(vision) == 16
    assert set(dict(model.named_parameters())) == names - vision
    with pytest.raises(ValueError, match="text-only.*pixel_values"):
        model(**golden_calls(golden)["logits"], pixel_values=torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(input_ids=golden["input_ids"])


def test_unsupported_settings_are_refused():
    config = json.loads((DIR / "model" / "config.json").read_text())
    for key, value in (("use_bidirectional_attention", "all"), ("hidden_activation", "silu"),
                       ("rope_parameters", {"full_attention": {"rope_type": "yarn"}})):
        bad = {**config, "text_config": {**config["text_config"], key: value}}
        with pytest.raises(ValueError, match=key.split("_")[0]):
            build_model(ModelSpec.from_config(bad), torch.float32, "meta")


# ---- the released shape ------------------------------------------------------------------
RELEASED = "diffusion-gemma-26b-a4b"


def released_meta():
    spec = ModelSpec.from_config(resolve_model(RELEASED).config)
    return spec, build_model(spec, torch.bfloat16, "meta")


def test_released_shape_sizes_and_active_flops():
    spec, meta = released_meta()
    assert (spec.vocab_size, spec.default_block_length, spec.eos_token_ids) == (
        262144, 256, (1, 106))
    total = sum(p.numel() for p in meta.parameters())
    assert 25.2e9 < total < 25.4e9                              # text weights: 25.3 B
    assert [s.head_dim for s in meta.shapes].count(512) == 5
    flops = FlopModel.of(meta, meta.dims)
    active = flops.params_per_token + 262144 * 2816             # + the embedding row
    assert 3.7e9 < active < 3.9e9                               # "3.8 B active"
    assert meta.decoder_row_flops() == 2 * 262144 * 2816 + 2 * 3 * 2816 * 2112


def test_released_shape_is_refused_in_bf16_and_planned_in_int4(monkeypatch):
    """On a 24 GiB host (this project's): bf16 weights (47 GiB) are refused before anything is
    allocated, with the numbers; int4 (groups of 64) plans ~14 GiB of weights."""
    monkeypatch.setattr("cover_vllm.worker.memory.host_memory_bytes", lambda: 24 * GiB)
    with pytest.raises(ValueError, match=r"diffusion_gemma weights need 4[67]\.\d\d GiB.*"
                                         r"allows 21\.60 GiB; use quantization \(quantization='w8a8'"):
        LLM(RELEASED, load_format="dummy", dtype="bfloat16")
    _, meta = released_meta()
    quantize_model(meta, "int4")
    assert meta.model.decoder.layers[0].experts.quant_config.group_size == 64
    nbytes, _ = weight_bytes(meta, 1)
    assert 13.5 * GiB < nbytes < 15 * GiB


# ---- weight-only quantization of the stacked experts -------------------------------------
@pytest.mark.parametrize("quantization, bound", [("int8", 0.15), ("int4:32", 2.5)])
def test_quantized_golden_logits_against_fp32(model, golden, quantization, bound):
    """fp32 activations, quantized projections and experts, against the fp32 model on the
    golden long prompt: measured mean |d| 0.107 (int8, argmax agreement 94 %) and 1.57 (int4
    in groups of 32 on weights of std 0.2: 65 %); the packed kernels equal the dequantizing
    reference (2-3e-5)."""
    call = golden_calls(golden)["logits_long"]
    quant = load_quantized_model(DIR / "model", quantization)
    reference = load_quantized_model(DIR / "model", quantization, pack=False)
    experts = quant.model.decoder.layers[0].experts
    assert "gate_up_proj" not in dict(experts.named_parameters()) and experts._kernels
    with torch.no_grad():
        got, slow, want = quant(**call), reference(**call), model(**call)
    assert (got - slow).abs().max() < 1e-4
    assert (got - want).abs().mean() < bound
    if quantization == "int8":
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_w8a8_keeps_the_stacked_experts_weight_only_int8(model, golden):
    """w8a8: attention, MLP and self-conditioning projections run W8A8 (oneDNN's kernel, or
    its fallback), the stacked experts int8 weight-only (models/quantization.py); golden
    long prompt against fp32: measured max |d| 6.61, mean 0.347, argmax agreement 91.7 %
    (int8: 0.676 / 0.107 / 93.8 %; w8a8 without the input rotation: 10.00 / 0.383 / 85.4 %).
    The activation codes move the router's top-2 choice on a few rows, and a flipped expert
    moves a whole row's logits; bounded just above."""
    from cover_vllm.layers.common import projection_groups
    from cover_vllm.layers.quantization.w8a8_kernels import IntMMKernel, OnednnKernel

    call = golden_calls(golden)["logits_long"]
    quant = load_quantized_model(DIR / "model", "w8a8")
    experts = quant.model.decoder.layers[0].experts
    assert experts.quant_config.method == "int8" and experts._kernels
    groups = [g for g in projection_groups(quant) if g.quant is not None]
    assert len(groups) == 14 and all(g.quant.config.method == "w8a8" for g in groups)
    assert all(isinstance(g.quant.kernel, (OnednnKernel, IntMMKernel)) for g in groups)
    with torch.no_grad():
        got, want = quant(**call), model(**call)
    diff = (got - want).abs()
    assert diff.max() <= 6.7 and diff.mean() <= 0.35
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.91


@pytest.mark.parametrize("quantization", ["int8", "int4:32"])
def test_bf16_expert_kernels_equal_the_reference(quantization):
    """bf16: each expert's packed kernel (int8 tiles, torch's CPU int4 pack) against the
    dequantized weights (measured relative error 3.5e-3 / 7.7e-3: bf16 rounding)."""
    packed, slow = (load_quantized_model(DIR / "model", quantization, dtype="bfloat16",
                                         pack=pack).model.decoder.layers[2].experts
                    for pack in (True, False))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    chosen, weights = torch.randint(0, 4, (40, 2), generator=gen), torch.rand(40, 2, generator=gen)
    with torch.no_grad():
        got, want = packed(x, weights, chosen).float(), slow(x, weights, chosen).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_int4_groups_follow_the_family_unless_given():
    _, meta = released_meta()
    with pytest.raises(ValueError, match=r"'int4:128'.*experts.down_proj has 704 input"):
        quantize_model(meta, "int4:128")


@pytest.mark.parametrize("quantization", [None, "int8", "int4:32"])
def test_experts_device_path_equals_the_cpu_loop(quantization):
    """StackedExperts off the CPU (a GPU, the meta device) runs `grouped`: two grouped GEMMs
    over the expert-sorted rows with the group ends found on the device (no host sync). On the
    CPU (fp32) it gives the per-expert loop's output."""
    model = (load_quantized_model(DIR / "model", quantization, pack=False) if quantization
             else load_model(DIR / "model"))
    experts = model.model.decoder.layers[1].experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=gen)
    weights = torch.rand(37, 2, generator=gen)
    # experts 1..3 only: expert 0 gets no row (an empty group)
    chosen = torch.stack([torch.randperm(3, generator=gen)[:2] + 1 for _ in range(37)])
    with torch.no_grad():
        loop, grouped = experts(x, weights, chosen), experts.grouped(x, weights, chosen)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=0)
