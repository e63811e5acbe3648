"""What each supported Hugging Face `architectures` name means beyond the Llama shape: one entry each.

Every architecture here is a Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU);
they differ only in the few switches an `Architecture` declares. `LlamaConfig.from_hf` looks the
name up here and nowhere else tests which architecture it holds: the model and the loader read the
resulting config fields (`qkv_bias`, `qk_norm`), never the name.

Sliding-window attention follows transformers' own rule per architecture (`layer_windows`): a
layer that slides with window W lets the query at position i see the keys at positions j with
0 <= i - j < W (transformers' `sliding_window_overlay`, `kv_idx > q_idx - sliding_window`). A
window no position can outgrow (W >= max_position_embeddings) is plain causal attention and is
dropped, so such a checkpoint runs the unmasked kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import ModelError


@dataclass(frozen=True)
class Architecture:
    """The switches of one architecture.

    `qkv_bias`: q/k/v projections carry a bias (o does not). `qk_norm`: a per-head RMSNorm of
    weight [head_dim] on q and k before RoPE. `refused_flags`: config.json booleans that turn on a
    piece pdkv does not compute (each names what it would add). `sliding`: the architecture
    reads `sliding_window` (Llama's ignores it, as transformers' does); `window_switch`: the
    config.json boolean that must be true for it to apply (None: it applies whenever set).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    refused_flags: tuple[tuple[str, str], ...] = ()
    sliding: bool = False
    window_switch: str | None = None


_O_BIAS = ("attention_bias", "a bias on q/k/v and o")
_QWEN_SWITCH = "use_sliding_window"
_LAYER_TYPES = ("full_attention", "sliding_attention")

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        refused_flags=(_O_BIAS, ("mlp_bias", "a bias on the MLP projections"))
    ),
    "MistralForCausalLM": Architecture(sliding=True),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, sliding=True, window_switch=_QWEN_SWITCH),
    "Qwen3ForCausalLM": Architecture(
        qk_norm=True, refused_flags=(_O_BIAS,), sliding=True, window_switch=_QWEN_SWITCH
    ),
}


def architecture_of(raw: dict[str, Any]) -> tuple[str, Architecture]:
    """(name, Architecture) of a config.json dict; ModelError naming the supported ones if none."""
    archs = raw.get("architectures") or []
    for name in archs:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    raise ModelError(
        f"config.json architectures is {archs!r}; pdkv implements only "
        f"{', '.join(ARCHITECTURES)} (pick a checkpoint of one of those)"
    )


def refuse_unsupported(name: str, arch: Architecture, raw: dict[str, Any]) -> None:
    """ModelError, one line naming the field, for what `arch` switches on that pdkv lacks."""
    for flag, what in arch.refused_flags:
        if raw.get(flag):
            raise ModelError(
                f"config.json sets {flag}=true ({what}); pdkv's {name} does not compute it"
            )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"config.json hidden_act is {act!r}; pdkv implements only 'silu' (SwiGLU)")


def layer_windows(arch: Architecture, raw: dict[str, Any]) -> tuple[int, ...]:
    """The attention window of each layer of a config.json dict (0: full causal attention), or
    () when no layer slides; transformers' rule for the architecture, exactly:

    - not `sliding` (Llama): no layer slides, whatever config.json says;
    - no `window_switch` (Mistral): every layer slides when `sliding_window` is set
      (MistralModel reads only `sliding_window`, never `layer_types`);
    - a switch (Qwen2, Qwen3): nothing slides unless it is true; then the layers `layer_types`
      marks "sliding_attention" slide, or where config.json has no `layer_types`, the layers
      from `max_window_layers` (default 28, as transformers') on.

    ModelError, one line, for a window below 1 or a `layer_types` of the wrong length or with a
    type other than full or sliding attention."""
    window = raw.get("sliding_window")
    if not arch.sliding or window is None:
        return ()
    if arch.window_switch is not None and not raw.get(arch.window_switch):
        return ()
    window, layers = int(window), int(raw.get("num_hidden_layers", 0))
    if window < 1:
        raise ModelError(f"config.json sets sliding_window={window}; a window holds at least 1")
    if window >= int(raw.get("max_position_embeddings", 4096)):
        return ()  # no position reaches past it: causal attention
    if arch.window_switch is None:
        return (window,) * layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ModelError(
            f"config.json layer_types has {len(types)} entries for {layers} hidden layers"
        )
    if odd := sorted(set(types) - set(_LAYER_TYPES)):
        raise ModelError(
            f"config.json layer_types holds {', '.join(map(repr, odd))}; pdkv computes only "
            f"{' and '.join(_LAYER_TYPES)}"
        )
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()
