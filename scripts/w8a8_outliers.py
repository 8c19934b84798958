"""Where W8A8 loses accuracy: per projection, the inputs' outliers and the output error of
per-row int8 activations, beside int8 weight-only; then the logits with each kind of
projection kept weight-only.

    .venv/bin/python scripts/w8a8_outliers.py [--model cover-tiny|golden:llada|...]

Inputs: cover-tiny's 120 task prompts with masked answers (40 per task, the prompts of
tests/test_quantization.py `test_cover_tiny_logits_int8_against_fp32`), or a golden model's
forward inputs (../shared/golden/<family>/forward.safetensors). Every projection's input is
recorded from the fp32 model (FusedLinears calls), and for each projection:

* row crest: max|x_row| / rms(x_row) (the int8 step is max/127: a crest of c leaves ~127/c
  levels for a typical value), median and max over rows;
* channel outliers: the largest channel's max |x| over the median channel's;
* relative output error ||y - y_fp32|| / ||y_fp32|| of int8 weights alone (weight-only), of
  int8 weights x per-row int8 activations (W8A8 without the input rotation) and of W8A8 as
  shipped (input and weight columns rotated first, layers/quantization/format.py
  `rotate_columns`), on the same inputs.

Then the logits against fp32 (max / mean |d|, argmax agreement on the real positions) for
int8, w8a8, w8a8 without the rotation, and (unrotated) w8a8 with one kind of projection (qkv,
out, gate_up, down, head) kept weight-only. `--smoothquant` (LLaDA models, e.g. cover-tiny) adds SmoothQuant-style migration
on the MLP down projections (Xiao et al. 2023, eq. 4: s_c = max|X_c|^a / max|W_c|^(1-a), the
down input's channel c divided by s_c, folded exactly into up_proj's row c, and down's column
c multiplied by it), with s from the recorded inputs (calibrated) or from the weights alone
(a proxy: |gamma * gate_c| * |gamma * up_c|, gamma the ff_norm weight).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from cover_vllm.layers.common import FusedLinears, projection_groups
from cover_vllm.layers.quantization.format import (QuantConfig, quantize_rows, rotate_columns,
                                                   rotation_block)
from cover_vllm.layers.quantization.w8a8_kernels import reference
from cover_vllm.models.loader import load_model
from cover_vllm.models.quantization import load_quantized_model

GOLDEN = "/work/shared/golden"


def inputs(model: str):
    """(model path, dense forward kwargs, [B, L] bool of the real positions)."""
    if model.startswith("golden:"):
        family = model.split(":", 1)[1]
        golden = load_file(f"{GOLDEN}/{family}/forward.safetensors")
        mask = golden["attention_mask"]
        return f"{GOLDEN}/{family}/model", {"input_ids": golden["input_ids"],
                                             "attention_mask": mask}, mask.bool()
    from cover_vllm.models.builtin import resolve_model_dir
    from cover_vllm.tasks import chat_prompt_ids, get_task
    from cover_vllm.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_dir(model))
    rows = [chat_prompt_ids(tok, ex.prompt) + [2] * task.max_tokens
            for task in map(get_task, ("sudoku4", "arith", "word")) for ex in task.eval_split(40)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [2] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return model, {"input_ids": ids, "attention_mask": mask}, mask.bool()


def roles(model: torch.nn.Module) -> dict[int, str]:
    """id(FusedLinears) -> the attribute its owner keeps it under (qkv, out, gate_up, ...)."""
    out = {}
    for module in model.modules():
        for attr, value in vars(module).items():
            if isinstance(value, FusedLinears):
                out[id(value)] = "head" if attr == "head" else attr
    return out


def record(model: torch.nn.Module, kwargs: dict) -> dict[int, list[torch.Tensor]]:
    seen: dict[int, list[torch.Tensor]] = defaultdict(list)
    real = FusedLinears.__call__

    def keep(group, x) -> None:
        seen[id(group)].append(x.detach().reshape(-1, x.shape[-1]).clone())

    def spy(self, x):
        keep(self, x)
        return real(self, x)
    hooks = []                                   # a lone Linear is called as a module
    for group in projection_groups(model):
        if len(group.linears) == 1:
            hooks.append(group.linears[0].register_forward_pre_hook(
                lambda mod, args, g=group: keep(g, args[0])))
    FusedLinears.__call__ = spy
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        FusedLinears.__call__ = real
        for hook in hooks:
            hook.remove()
    return seen


def layer_table(model: torch.nn.Module, seen: dict, role: dict[int, str]) -> None:
    print("| # | projection | rows | crest median / max | rotated crest median | channel outlier "
          "| weight-only err | W8A8 unrotated err | W8A8 err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, group in enumerate(projection_groups(model)):
        if id(group) not in seen:
            continue
        x = torch.cat(seen[id(group)])
        x = x[x.abs().amax(-1) > 0]                       # padded / unused rows
        w = torch.cat([lin.weight for lin in group.linears]).float()
        y = F.linear(x, w)
        t = quantize_rows(w, QuantConfig("int8"), torch.float32)
        wo = F.linear(x, t["qweight"].float() * t["weight_scale"][:, None])
        a8 = reference(x, t["qweight"], t["weight_scale"])
        b = rotation_block(x.shape[1])
        xr = rotate_columns(x, b)
        tr = quantize_rows(rotate_columns(w, b), QuantConfig("int8"), torch.float32)
        rot = reference(xr, tr["qweight"], tr["weight_scale"])
        crest = lambda z: z.abs().amax(-1) / z.pow(2).mean(-1).sqrt()
        ch = x.abs().amax(0)
        err = lambda z: float((z - y).norm() / y.norm())
        print(f"| {i} | {role.get(id(group), '?')} | {x.shape[0]} | {crest(x).median():.1f} / "
              f"{crest(x).max():.1f} | {crest(xr).median():.1f} | {ch.max() / ch.median():.1f} | "
              f"{err(wo):.2e} | {err(a8):.2e} | {err(rot):.2e} |")


def keep_weight_only(model: torch.nn.Module, role: dict[int, str], kind: str) -> None:
    """Run every `kind` group of a w8a8 model (unpacked) as int8 weight-only."""
    int8 = QuantConfig("int8")
    for group in projection_groups(model):
        if role.get(id(group)) == kind and group.quant is not None:
            group.quant.config = int8
            for lin in group.linears:
                lin.quant_config = int8


def compare(name: str, got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> None:
    diff = (got - want).abs()[real]
    agree = (got.argmax(-1) == want.argmax(-1))[real].float().mean()
    print(f"| {name} | {diff.max():.3f} | {diff.mean():.4f} | {agree:.2%} |")


def write_smoothed(path: str, seen: list[torch.Tensor], alpha: float, proxy: bool,
                   out: str) -> None:
    """Write to `out` the fp32 checkpoint of `path` with its down projections smoothed (module
    doc); `seen`: each block's recorded down inputs (calibrated scales)."""
    import os
    import shutil

    from safetensors.torch import save_file

    fp32 = load_model(path).eval()
    for block, seen_down in zip(fp32.model.transformer.blocks, seen):
        w_down = block.ff_out.weight.data                               # [d, M]
        if proxy:
            gamma = block.ff_norm.weight[None]
            x_max = (block.ff_proj.weight * gamma).norm(dim=1) * (block.up_proj.weight
                                                                  * gamma).norm(dim=1)
        else:
            x_max = seen_down.abs().amax(0)
        s = x_max.clamp_min(1e-8) ** alpha / w_down.abs().amax(0).clamp_min(1e-8) ** (1 - alpha)
        s = s / s.median()
        block.up_proj.weight.data /= s[:, None]
        block.ff_out.weight.data *= s[None, :]
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(path):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(path, name)):
            shutil.copy(os.path.join(path, name), out)
    save_file({k: v.contiguous() for k, v in fp32.state_dict().items()},
              os.path.join(out, "model.safetensors"))


def smoothed(path: str, seen: list[torch.Tensor], alpha: float, proxy: bool) -> torch.nn.Module:
    """A w8a8 model of `path` whose down projections were smoothed (module doc)."""
    import shutil
    import tempfile

    out = tempfile.mkdtemp()
    try:
        write_smoothed(path, seen, alpha, proxy, out)
        return load_quantized_model(out, QuantConfig("w8a8", rotation=False))
    finally:
        shutil.rmtree(out)


def down_inputs(model: str) -> tuple[str, list[torch.Tensor]]:
    """(checkpoint directory, each block's recorded down-projection inputs) of a LLaDA model."""
    from cover_vllm.models.builtin import resolve_model_dir

    path, kwargs, _ = inputs(model)
    fp32 = load_model(path).eval()
    seen = record(fp32, kwargs)
    directory = str(resolve_model_dir(path)) if not path.startswith("/") else path
    return directory, [torch.cat(seen[id(b.down)]) for b in fp32.model.transformer.blocks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cover-tiny")
    p.add_argument("--smoothquant", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    path, kwargs, real = inputs(args.model)
    fp32 = load_model(path).eval()
    role = roles(fp32)
    seen = record(fp32, kwargs)
    layer_table(fp32, seen, role)
    with torch.no_grad():
        want = fp32(**kwargs)
        print("\n| logits vs fp32 | max abs d | mean abs d | argmax agreement |")
        print("|---|---|---|---|")
        compare("int8 weight-only", load_quantized_model(path, "int8")(**kwargs), want, real)
        compare("w8a8", load_quantized_model(path, "w8a8")(**kwargs), want, real)
        plain = QuantConfig("w8a8", rotation=False)
        compare("w8a8 without the rotation", load_quantized_model(path, plain)(**kwargs), want,
                real)
        compare("w8a8 without the rotation, embedding in fp32", load_quantized_model(
            path, QuantConfig("w8a8", embedding=False, rotation=False))(**kwargs), want, real)
        for kind in sorted(set(role.values())):
            model = load_quantized_model(path, plain, pack=False)
            keep_weight_only(model, roles(model), kind)
            compare(f"w8a8 (unrotated), {kind} weight-only", model(**kwargs), want, real)
        if args.smoothquant:
            directory, downs = down_inputs(args.model)
            for alpha in (0.5, 0.8):
                for proxy in (False, True):
                    model = smoothed(directory, downs, alpha, proxy)
                    compare(f"w8a8 (unrotated), down smoothed a={alpha} "
                            f"({'weight proxy' if proxy else 'calibrated'})", model(**kwargs),
                            want, real)


if __name__ == "__main__":
    main()
