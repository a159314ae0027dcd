"""Reading the few HF config fields whose rules are shared by every family."""

from __future__ import annotations

from typing import Any


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_window(config: Any, index: int) -> int | None:
    """The sliding window of layer `index` by HF's rules: `layer_types` where the config has
    them, else `sliding_window` for every layer (unless `use_sliding_window` is false)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if window and layer_types[index] == "sliding_attention" else None
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)
