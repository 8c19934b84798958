"""W8A8's input rotation (issue 35, layers/quantization/format.py rotate_columns /
rotate_input): the block rule that keeps TP splits whole, R orthogonal and the product
unchanged, every kernel with a rotation equal to the exact integer product of the rotated input,
bf16's rotation within its rounding, the default and the opt-out, and a TP split through a block refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cover_vllm.layers.quantization import format as quant_format
from cover_vllm.layers.quantization.format import (QuantConfig, quantize_activations,
                                                   rotate_columns, rotate_input, rotation_block,
                                                   rotation_matrix)
from cover_vllm.layers.quantization.w8a8_kernels import reference
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.loader import build_model
from cover_vllm.models.quantization import quantize_model
from cover_vllm.models.spec import ModelSpec
from test_w8a8 import KERNELS, _kernel, _weights


def test_rotation_blocks_stay_whole_on_every_split_up_to_8_ranks():
    """b: the largest power of two <= 128 dividing K / 8 (1: no rotation)."""
    widths = {4096: 128, 12288: 128, 3584: 64, 1024: 128, 384: 16, 128: 16, 64: 8, 96: 4,
              100: 1, 227: 1}
    assert {k: rotation_block(k) for k in widths} == widths
    for k, b in widths.items():
        assert all((k // tp) % b == 0 for tp in (1, 2, 4, 8) if k % tp == 0)


@pytest.mark.parametrize("b", [2, 16, 128])
def test_rotation_is_orthogonal_and_leaves_the_product_unchanged(b):
    """R R^T = I (fp32 rounding), the same R on every call and device string, and
    (x R)(W R)^T = x W^T: rotating both sides changes the product only by fp32's rounding.
    A row whose max is one outlier channel comes out with its max spread over the block."""
    r = rotation_matrix(b)
    assert torch.allclose(r @ r.t(), torch.eye(b), atol=1e-6)
    assert torch.equal(r, rotation_matrix(b, "cpu"))
    assert torch.allclose(r.abs(), torch.full((b, b), b ** -0.5))
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 4 * b, generator=gen), torch.randn(7, 4 * b, generator=gen)
    got = F.linear(rotate_columns(x, b), rotate_columns(w, b))
    assert (got - F.linear(x, w)).abs().max() <= 1e-5 * F.linear(x, w).abs().max()
    spike = torch.zeros(1, 4 * b)
    spike[0, 3] = 10.0
    assert rotate_columns(spike, b).abs().max() == pytest.approx(10.0 / b ** 0.5)
    assert rotate_columns(x, 1) is x


def test_another_rotation_seed_draws_other_signs_of_the_same_kind(monkeypatch):
    """scripts/w8a8_flips.py --rotation-seeds: a seed other than the shipped 0 gives another
    orthogonal R (other signs, the same |entries|), and the shipped R comes back with 0."""
    shipped = rotation_matrix(16)
    monkeypatch.setattr(quant_format, "ROTATION_SEED", 3)
    other = rotation_matrix(16)
    assert not torch.equal(other, shipped) and torch.equal(other.abs(), shipped.abs())
    assert torch.allclose(other @ other.t(), torch.eye(16), atol=1e-6)
    monkeypatch.setattr(quant_format, "ROTATION_SEED", 0)
    assert torch.equal(rotation_matrix(16), shipped)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_rotated_kernel_is_the_integer_product_of_the_rotated_input(name, dtype):
    """A kernel with a rotation block rotates its input (`rotate_input`: fp32, or bf16 with
    the 1 / sqrt(b) in the row scale) and then is `reference` of that, bit for bit; its output
    keeps the input's dtype and shape."""
    _, q, scale, gen = _weights(96, 512, seed=7)
    x = torch.randn(3, 5, 512, generator=gen).to(dtype)
    got = _kernel(name)(q, scale, None, None, 64)(x)
    rotated, factor = rotate_input(x.reshape(15, 512), 64)
    assert rotated.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    want = reference(rotated, q, scale, x_factor=factor).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want.view(3, 5, 96))


def test_a_bf16_input_rotates_in_bf16_within_its_rounding():
    """bf16: y = x (D H_b) in bf16 with f = 1 / sqrt(b) is x R up to one bf16 rounding of
    each value (2^-9 relative; within 2^-8 of the row's max, half an int8 step of the codes
    that follow); the codes differ from the fp32 rotation's by one step on 1.9 % of the
    values (those within bf16's rounding of a code boundary)."""
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(64, 1024, generator=gen) * torch.logspace(-1, 1, 1024)).to(torch.bfloat16)
    y, factor = rotate_input(x, 128)
    exact = rotate_columns(x, 128)
    assert y.dtype == torch.bfloat16 and factor == 128 ** -0.5
    err = (y.float() * factor - exact).abs()
    row_max = exact.abs().amax(-1, keepdim=True)
    assert (err <= 2 ** -8 * row_max).all()            # the int8 step: row_max / 127
    codes, _ = quantize_activations(y)
    want, _ = quantize_activations(exact)
    moved = (codes.int() - want.int()).abs()
    assert moved.max() <= 1 and moved.float().mean() < 0.025          # measured 1.9 %


def test_rotation_is_w8a8s_default_and_configurable():
    """quantize_model gives every W8A8 Linear its block (from the whole input width, before
    TP); rotation=False keeps plain per-row codes; weight-only formats never rotate."""
    assert QuantConfig("w8a8").rotates_inputs and not QuantConfig("int8").rotates_inputs
    assert not QuantConfig("w8a8", rotation=False).rotates_inputs
    with pytest.raises(ValueError, match="rotation=True.*'int8' quantizes none"):
        QuantConfig("int8", rotation=True)
    spec = ModelSpec.from_config(resolve_model("cover-tiny").config)
    for config, down in ((QuantConfig("w8a8"), 16), (QuantConfig("w8a8", rotation=False), 1),
                         (QuantConfig("int8"), 1)):
        model = build_model(spec, torch.float32, "meta")
        quantize_model(model, config)
        block = model.model.transformer.blocks[0].ff_out.rotation_block
        assert block == down


def test_a_tp_split_through_a_rotation_block_is_refused():
    """A rank whose input columns start inside a block cannot rotate them as TP=1 does:
    refused when its weight is checked, on the meta device already (before any read)."""
    from cover_vllm.layers.base import Slice
    from cover_vllm.models.quantization import _load_linear

    spec = ModelSpec.from_config(resolve_model("cover-tiny").config)
    model = build_model(spec, torch.float32, "meta")
    quantize_model(model, "w8a8")
    down = model.model.transformer.blocks[0].ff_out

    class Source:
        def shape(self, name):
            return (128, 384)
    with pytest.raises(ValueError, match=r"ff_out.weight: this rank's input columns "
                                         r"\(\(8, 128\),\) split w8a8's rotation blocks of 16"):
        _load_linear(down, Source(), "model.transformer.blocks.0.ff_out.weight",
                     Slice(1, 8, 128, 384))
