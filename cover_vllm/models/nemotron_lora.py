"""Nemotron-Labs-Diffusion's draft adapter: a PEFT LoRA (the checkpoint's `linear_spec_lora/`
subfolder: `adapter_config.json` + `adapter_model.safetensors`) that self-speculation turns on
for its diffusion-mode draft forwards only, off for prefills, commits and verifies (the official
`linear_spec_generate` toggles PEFT's `_disable_adapters` around them).

Batched here: the runner marks which rows of a forward are draft rows (`set_rows`), and each
adapted Linear adds scale·B(A(x)) to those rows only, so drafts and verifies of different
requests share one forward. scale = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`).

Under tensor parallelism (#50) every rank loads the adapter for its shard (`slices`: the
checkpoint slices of its weights, distributed/tensor_parallel.param_slices). A column-parallel
Linear (out rows split) keeps A whole and its rows of B: its output rows are B_r·A·x. A
row-parallel Linear (o_proj: input columns split, outputs summed) gets A's matching columns:
A·x = sum_r A_r·x_r is all-reduced (r numbers a row, the Linear's own `reduce_output`), then
every rank adds the same B·(A·x) to the already reduced output.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

ADAPTER_DIR = "linear_spec_lora"
PREFIX = "base_model.model."


class DraftAdapter:
    """LoRA pairs hooked onto the model's Linears, active on the rows `set_rows` marks."""

    def __init__(self, model: nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 scale: float, slices: dict | None = None):
        self.scale, self.rows = scale, None
        modules = dict(model.named_modules())
        missing = sorted(set(pairs) - set(modules))
        if missing:
            raise ValueError(f"LoRA adapter targets modules the model lacks: {missing[:3]}")
        self.handles = []
        ref = next(model.parameters())
        for name, (a, b) in pairs.items():
            lin = modules[name]
            a, b, reduce = _shard_pair(name, a, b, (slices or {}).get(f"{name}.weight"), lin)
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise ValueError(f"LoRA shapes of {name} ({tuple(a.shape)}, {tuple(b.shape)}) "
                                 f"do not fit its [{lin.out_features}, {lin.in_features}] weight")
            pair = (a.to(ref.device, ref.dtype), b.to(ref.device, ref.dtype))
            self.handles.append(lin.register_forward_hook(self._hook(pair, reduce)))

    def _hook(self, pair, reduce=None):
        a, b = pair

        def add_lora(module, inputs, out):
            if self.rows is None:
                return out
            ax = torch.nn.functional.linear(inputs[0], a)           # [T, r]
            if reduce is not None:                                  # row-parallel: sum_r A_r x_r
                ax = reduce(ax)
            delta = torch.nn.functional.linear(ax, b)
            return out + delta * (self.scale * self.rows[:, None].to(out.dtype))
        return add_lora

    def set_rows(self, rows: torch.Tensor | None) -> None:
        """[T] bool: the rows of the next forward that run the adapter (None: none)."""
        self.rows = rows

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _shard_pair(name: str, a: torch.Tensor, b: torch.Tensor, sl, lin: nn.Module):
    """(A, B, reduce) of one rank (see the module docstring); unchanged without a slice."""
    if sl is None:
        return a, b, None
    if sl.dim == 0:                                     # column-parallel: B's rows of this rank
        return a, sl.take(b), None
    reduce = getattr(lin, "reduce_output", None)
    if reduce is None:
        raise ValueError(f"LoRA on {name}: a row-parallel Linear without an output all-reduce "
                         "is not supported under tensor parallelism")
    return sl.take(a).contiguous(), b, reduce           # row-parallel: A's columns


def load_draft_adapter(model: nn.Module, model_dir: str | Path | None,
                       slices: dict | None = None) -> DraftAdapter | None:
    """The checkpoint's draft adapter attached to `model` (model.draft_adapter), or None when
    `model_dir` has no `linear_spec_lora/` subfolder. `slices`: a tensor-parallel rank's
    (param_slices), so it holds its shard of the adapter."""
    if model_dir is None:
        return None
    folder = Path(model_dir) / ADAPTER_DIR
    if not (folder / "adapter_config.json").is_file():
        return None
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: peft_type={config.get('peft_type')!r}; only LORA adapters")
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    pairs: dict[str, list] = {}
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        for part, index in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if name.endswith(part):
                pairs.setdefault(name[:-len(part)], [None, None])[index] = t
    if not pairs or any(a is None or b is None for a, b in pairs.values()):
        raise ValueError(f"{folder}: adapter_model.safetensors needs lora_A and lora_B weights "
                         "for every target module")
    adapter = DraftAdapter(model, {k: (a, b) for k, (a, b) in pairs.items()}, scale, slices)
    model.draft_adapter = adapter
    return adapter
