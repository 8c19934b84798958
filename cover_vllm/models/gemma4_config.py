"""DiffusionGemma's config.json, read once: the flat key set the engine reads, and each layer's
attention shape (sliding or full, heads, head size, RoPE), from either form the checkpoints use.

config.json nests the text model under `text_config` (next to `vision_config`, which this
engine never reads: it serves text only). `flatten_config` lifts the text keys to the top so
`ModelSpec` and the model read one dict; the wrapper's own keys (`model_type`, `canvas_length`,
token ids, `dtype`) win over the text config's copies.

The full-attention layers' head size and kv heads come in two forms (../shared/golden/README.md
"The checkpoint"): `per_layer_config` {"<layer>": {"head_dim", "num_key_value_heads"}} as
transformers 5.24 writes it, or the released checkpoint's `global_head_dim` (default 512 when
absent) and `num_global_key_value_heads` (default: `num_key_value_heads`). Both give the same
per-layer shapes; `per_layer_config` wins when both are present.
"""

from __future__ import annotations

from typing import Any

from cover_vllm.layers.gemma4_shape import FULL, SLIDING, LayerShape

Config = dict[str, Any]

DEFAULT_GLOBAL_HEAD_DIM = 512          # the configuration class's default (README)
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                       "partial_rotary_factor": 0.25}}
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor"}
_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}


def flatten_config(config: Config) -> Config:
    """config.json -> one flat dict: `text_config`'s keys at the top level, the wrapper's keys
    (not None) over them, `vision_config` dropped, `dtype` also as `torch_dtype` (transformers 5
    writes `dtype`), and the canvas as the default block length. A flat dict is returned as is."""
    text = config.get("text_config")
    if text is None:
        return dict(config)
    flat = {k: v for k, v in text.items() if k != "model_type"}
    flat.update({k: v for k, v in config.items()
                 if v is not None and k not in ("text_config", "vision_config")})
    dtype = flat.get("torch_dtype") or flat.get("dtype")
    if dtype is not None:
        flat["torch_dtype"] = dtype
    if "canvas_length" in flat:
        flat.setdefault("default_block_length", flat["canvas_length"])
    return flat


def layer_types(cfg: Config) -> list[str]:
    """`layer_types`, or Gemma's pattern (every `sliding_window_pattern`-th layer full, 6 by
    default) with the last layer full; ValueError on an unknown type or a wrong length."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("sliding_window_pattern") or 6
        types = [FULL if (i + 1) % every == 0 or i == n - 1 else SLIDING for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"diffusion_gemma layer_types={types!r}: expected {n} entries, each "
                         f"{SLIDING!r} or {FULL!r}")
    return list(types)


def _rope(cfg: Config, kind: str, head_dim: int) -> tuple[float, int]:
    """(theta, rotated frequency slots) of a layer kind. `default`: all head_dim / 2 slots;
    `proportional`: the first int(partial_rotary_factor * head_dim // 2) slots turn (with
    exponents over the whole head_dim), the rest have frequency 0."""
    params = (cfg.get("rope_parameters") or {}).get(kind) or DEFAULT_ROPE[kind]
    unknown = set(params) - _ROPE_KEYS - ({"factor"} if params.get("factor") == 1.0 else set())
    rope_type = params.get("rope_type", "default")
    if unknown or rope_type not in ("default", "proportional"):
        raise ValueError(f"diffusion_gemma rope_parameters[{kind!r}]={params!r} is not "
                         "supported: rope_type 'default' or 'proportional' with rope_theta and "
                         "partial_rotary_factor only (a scaling factor of 1.0 at most)")
    theta = float(params.get("rope_theta", DEFAULT_ROPE[kind]["rope_theta"]))
    if rope_type == "default":
        return theta, head_dim // 2
    factor = float(params.get("partial_rotary_factor", 1.0))
    return theta, int(factor * head_dim // 2)


def _full_layer_overrides(cfg: Config, index: int) -> dict[str, int]:
    """head_dim / num_key_value_heads of full layer `index`: its `per_layer_config` entry, else
    the released form's global keys."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:
        entry = per_layer.get(str(index), per_layer.get(index, {}))
        unknown = set(entry) - _PER_LAYER_KEYS
        if unknown:
            raise ValueError(f"diffusion_gemma per_layer_config[{index!r}] has keys "
                             f"{sorted(unknown)}; only {sorted(_PER_LAYER_KEYS)} are supported")
        return dict(entry)
    kv = cfg.get("num_global_key_value_heads")
    head_dim = cfg.get("global_head_dim")
    return {"head_dim": DEFAULT_GLOBAL_HEAD_DIM if head_dim is None else head_dim,
            **({} if kv is None else {"num_key_value_heads": kv})}


def layer_shapes(cfg: Config) -> list[LayerShape]:
    """Every layer's attention shape from a flat config (`flatten_config`)."""
    heads = cfg["num_attention_heads"]
    base_kv = cfg.get("num_key_value_heads") or heads
    base_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_layer = cfg.get("per_layer_config") or {}
    shapes = []
    for i, kind in enumerate(layer_types(cfg)):
        sliding = kind == SLIDING
        if sliding:
            override = per_layer.get(str(i), per_layer.get(i, {}))
        else:
            override = _full_layer_overrides(cfg, i)
        head_dim = int(override.get("head_dim", base_dim))
        theta, pairs = _rope(cfg, kind, head_dim)
        shapes.append(LayerShape(sliding, heads, int(override.get("num_key_value_heads", base_kv)),
                                 head_dim, theta, pairs, k_eq_v=not sliding))
    for s in shapes:
        if s.num_heads % s.num_kv_heads:
            raise ValueError(f"diffusion_gemma: {s.num_kv_heads} kv heads do not divide "
                             f"{s.num_heads} attention heads")
    return shapes


_UNSUPPORTED = {            # key -> values the released checkpoint has (others: ValueError)
    "hidden_activation": ("gelu_pytorch_tanh", None), "attention_bias": (False, None),
    "hidden_size_per_layer_input": (0, None), "num_kv_shared_layers": (0, None),
    "use_double_wide_mlp": (False, None), "attention_k_eq_v": (True, None),
    "enable_moe_block": (True, None), "attn_logit_softcapping": (None,),
}


def check_config(cfg: Config) -> None:
    """ValueError for settings this implementation does not reproduce (flat config)."""
    for key, allowed in _UNSUPPORTED.items():
        if cfg.get(key) not in allowed:
            raise ValueError(f"diffusion_gemma {key}={cfg[key]!r} is not supported (the released "
                             f"checkpoint has {allowed[0]!r})")
    if cfg.get("use_bidirectional_attention") not in ("vision", None):
        raise ValueError(f"diffusion_gemma use_bidirectional_attention="
                         f"{cfg['use_bidirectional_attention']!r} is not supported: text is "
                         "causal in the encoder ('vision', as released, or null)")
    if not cfg.get("num_experts") or not cfg.get("top_k_experts"):
        raise ValueError("diffusion_gemma needs num_experts and top_k_experts (a MoE block "
                         "in every layer)")
    layer_shapes(cfg)
