"""What each supported Hugging Face `architectures` name means beyond the Llama shape: one entry each.

Every architecture here is a Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU);
they differ only in the few switches an `Architecture` declares. `LlamaConfig.from_hf` looks the
name up here and nowhere else tests which architecture it holds: the model and the loader read the
resulting config fields (`qkv_bias`, `qk_norm`), never the name.

Sliding-window attention is not implemented (neither the torch path nor the kernels mask by
window), so a checkpoint whose window is shorter than the positions a request can reach is
refused at start; a window that covers every position is plain causal attention and loads.
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
    piece pdkv does not compute (each names what it would add). `window_switch`: the config.json
    boolean that must be true for `sliding_window` to apply (None: it applies whenever set).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    refused_flags: tuple[tuple[str, str], ...] = ()
    window_switch: str | None = None


_O_BIAS = ("attention_bias", "a bias on q/k/v and o")

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        refused_flags=(_O_BIAS, ("mlp_bias", "a bias on the MLP projections"))
    ),
    "MistralForCausalLM": Architecture(),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, window_switch="use_sliding_window"),
    "Qwen3ForCausalLM": Architecture(
        qk_norm=True, refused_flags=(_O_BIAS,), window_switch="use_sliding_window"
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
    window = _sliding_window(arch, raw)
    reach = int(raw.get("max_position_embeddings", 4096))
    if window is not None and int(window) < reach:
        raise ModelError(
            f"config.json sets sliding_window={window}, below max_position_embeddings={reach}: "
            "pdkv has no sliding-window attention (use a checkpoint without sliding_window)"
        )


def _sliding_window(arch: Architecture, raw: dict[str, Any]) -> int | None:
    """The window some layer of this checkpoint applies, or None when every layer is causal."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    if (types := raw.get("layer_types")) is not None:  # transformers 5 writes it out
        return window if "sliding_attention" in types else None
    if arch.window_switch is None:
        return window
    if not raw.get(arch.window_switch):
        return None
    # Qwen: layers from max_window_layers on slide (transformers' own rule)
    first = int(raw.get("max_window_layers", 0))
    return window if first < int(raw.get("num_hidden_layers", 0)) else None
