"""LlamaConfig: the shape of a Llama-family decoder, parsed from a Hugging Face config.json or built in.

`LlamaConfig.tiny()` is the built-in default (byte vocabulary, deterministic random weights from a
fixed seed), so the demo and the tests never download anything. `from_hf()` accepts the config.json
of a checkpoint of every architecture in `common.model.architectures` (Llama, Mistral, Qwen2,
Qwen3), sets the switches that architecture declares (`qkv_bias`, `qk_norm`), and refuses, with a
ModelError that names the field, every feature this implementation does not compute (o/MLP bias,
activations other than SiLU, RoPE variants other than default/linear/llama3), and reads each
layer's sliding window by the architecture's rule (`layer_windows`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from common.errors import ModelError
from common.model.architectures import architecture_of, layer_windows, refuse_unsupported

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Byte tokenizer layout of the tiny model: ids 0..255 are bytes, then the specials.
BYTE_VOCAB = 256
TINY_BOS, TINY_EOS, TINY_PAD = 256, 257, 258


class LlamaConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape and constants of a Llama-family decoder; immutable, JSON round-trippable.

    `eos_token_id` is the primary end-of-sequence id; `extra_eos_token_ids` holds the rest when a
    checkpoint lists several (Llama 3 instruct does). `stop_token_ids` is their union.
    `architecture` is the Hugging Face name the config came from (part of the digest, so two
    architectures never fingerprint alike); `qkv_bias` adds a bias to the q/k/v projections,
    `qk_norm` a per-head RMSNorm on q and k before RoPE. `layer_windows` holds each layer's
    sliding window W (the query at position i sees keys j with 0 <= i - j < W; 0: full causal
    attention), or is empty when no layer slides; `window(layer)` reads it. Being a field, it is
    part of the digest, so a prefill and a decode that window differently never pair.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = ()
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    name: str = "llama"
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelError(
                f"rope type {self.rope_type!r} is not implemented; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )

        if self.layer_windows and (
            len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0
        ):
            raise ModelError(
                f"layer_windows {self.layer_windows} must hold one window >= 0 per layer "
                f"({self.num_layers})"
            )

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Every id that ends a sequence (empty when the config names none)."""
        ids = set(self.extra_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """The built-in model: byte vocabulary (256 bytes + BOS/EOS/PAD + 1 spare), 2 layers, GQA.

        `overrides` replace fields (e.g. a wider model for benchmarks); the weights stay a function
        of the config and the seed given to the loader.
        """
        fields: dict[str, Any] = dict(
            vocab_size=BYTE_VOCAB + 4,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=8192,
            bos_token_id=TINY_BOS,
            eos_token_id=TINY_EOS,
            name="tiny",
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, name: str = "llama") -> LlamaConfig:
        """Parse a Hugging Face config.json dict of a supported architecture; ModelError on what
        is unsupported."""
        arch_name, arch = architecture_of(raw)
        try:
            refuse_unsupported(arch_name, arch, raw)
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_list = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos_list[0] if eos_list else None,
                extra_eos_token_ids=tuple(int(e) for e in eos_list[1:]),
                name=name,
                architecture=arch_name,
                qkv_bias=arch.qkv_bias,
                qk_norm=arch.qk_norm,
                layer_windows=layer_windows(arch, raw),
                **_rope_fields(raw),
            )
        except KeyError as exc:
            raise ModelError(f"config.json lacks required field {exc.args[0]!r}") from None

    def to_wire(self) -> dict[str, Any]:
        """JSON-safe dict of every field (for the handshake and logs)."""
        return msgspec.to_builtins(self)

    def digest(self) -> str:
        """Short sha256 of the canonical JSON of this config (16 hex digits)."""
        blob = msgspec.json.encode(self.to_wire(), order="sorted")
        return hashlib.sha256(blob).hexdigest()[:16]


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either the transformers 5 `rope_parameters` or the older keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"config.json asks for rope type {rope_type!r}; pdkv implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (use a checkpoint without that RoPE scaling)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelError("config.json sets partial_rotary_factor; pdkv rotates the whole head_dim")
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(params["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(params["high_freq_factor"])
        fields["rope_original_max_position"] = int(params["original_max_position_embeddings"])
    return fields
