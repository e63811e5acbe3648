"""load_model: the built-in tiny model, or a Hugging Face safetensors checkpoint of an architecture in
`common.model.architectures` (Llama, Mistral, Qwen2, Qwen3).

The tiny model's weights are a pure function of (config, seed), drawn on the CPU in fp32 and then
moved, so every process and every device builds the same model without a download. Its lm_head is
scaled so logits spread wide (std ~8): greedy argmax then does not flip under the rounding
differences between batch sizes or devices.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import structlog
import torch

from common.errors import ModelError
from common.model.config import BYTE_VOCAB, LlamaConfig
from common.model.llama import LayerWeights, LlamaModel, LlamaWeights
from common.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from common.model_dir import model_dir_problem

log = structlog.get_logger(__name__)

TINY_SEED = 0
TINY_LOGIT_STD = 8.0
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(
    dtype: torch.dtype | str | None, device: torch.device, *, tiny: bool
) -> torch.dtype:
    """The weight dtype: as given, else fp32 for the tiny model or on CPU, bf16 for a checkpoint on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.float32 if tiny or device.type == "cpu" else torch.bfloat16
    try:
        return _DTYPE_NAMES[dtype.lower()]
    except KeyError:
        raise ModelError(
            f"dtype {dtype!r} is not one pdkv's model runs in: use float32, bfloat16 or float16 "
            "(or fp32, bf16, fp16, half)"
        ) from None


def load_model(
    model_dir: str | Path | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    seed: int = TINY_SEED,
    allow_byte_tokenizer: bool = False,
) -> tuple[LlamaModel, Tokenizer]:
    """(model, tokenizer) for `model_dir`, or the tiny built-in model (seeded by `seed`) for None.

    A checkpoint directory needs config.json (a supported architecture), *.safetensors
    (one file or shards) and tokenizer.json; without tokenizer.json it loads only with
    `allow_byte_tokenizer` (then the byte tokenizer, whose text is garbage for a real model).
    Raises ModelError for anything missing, unreadable or unsupported, naming it.
    """
    device = torch.device(device)
    if model_dir is None:
        model = tiny_model(seed=seed, device=device, dtype=dtype)
        c = model.config
        tokenizer: Tokenizer = ByteTokenizer(
            bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id
        )
    else:
        path = Path(model_dir)
        config = read_config(path)
        dtype = resolve_dtype(dtype, device, tiny=False)
        weights, files = read_checkpoint(path, config, device=device, dtype=dtype)
        model = LlamaModel(
            config, weights, fingerprint=_checkpoint_fingerprint(path, config, files)
        )
        tokenizer = _checkpoint_tokenizer(path, config, allow_bytes=allow_byte_tokenizer)
    log.info("model_loaded", model=model.fingerprint, device=str(device), dtype=str(model.dtype))
    return model, tokenizer


def tiny_model(
    config: LlamaConfig | None = None,
    *,
    seed: int = TINY_SEED,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
) -> LlamaModel:
    """The built-in model (`LlamaConfig.tiny()` unless a config is given, e.g. a wider one for
    benchmarks) with weights drawn from `seed`; its fingerprint names the seed and config digest."""
    config = config or LlamaConfig.tiny()
    device = torch.device(device)
    weights = _cast(tiny_weights(config, seed), device, resolve_dtype(dtype, device, tiny=True))
    return LlamaModel(config, weights, fingerprint=f"tiny-seed{seed}-{config.digest()}")


def tiny_weights(config: LlamaConfig, seed: int) -> LlamaWeights:
    """Deterministic random fp32 CPU weights for `config`; variance-preserving, wide logits."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * std

    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * d
    layers = [
        LayerWeights(
            input_norm=torch.ones(h),
            qkv=normal(qkv_rows, h, h**-0.5),
            o=normal(h, c.num_heads * d, (c.num_heads * d) ** -0.5),
            post_norm=torch.ones(h),
            gate_up=normal(2 * i, h, h**-0.5),
            down=normal(h, i, i**-0.5),
            # drawn after the rest, so a config without them keeps the weights it always had
            qkv_bias=normal(1, qkv_rows, 0.1)[0] if c.qkv_bias else None,
            q_norm=1 + normal(1, d, 0.1)[0] if c.qk_norm else None,
            k_norm=1 + normal(1, d, 0.1)[0] if c.qk_norm else None,
        )
        for _ in range(c.num_layers)
    ]
    embed = normal(c.vocab_size, h, 1.0)
    head = embed if c.tie_word_embeddings else normal(c.vocab_size, h, TINY_LOGIT_STD * h**-0.5)
    return LlamaWeights(embed=embed, layers=layers, norm=torch.ones(h), lm_head=head)


def read_config(model_dir: Path) -> LlamaConfig:
    """LlamaConfig from `model_dir`/config.json; ModelError when absent, malformed or unsupported."""
    if why := model_dir_problem(model_dir):
        raise ModelError(why)
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot parse {path}: {exc}") from exc
    return LlamaConfig.from_hf(raw, name=model_dir.name)


def _hf_names(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> expected shape for a checkpoint of `config` (Hugging Face's Llama names, plus
    the q/k/v biases when `qkv_bias`, the per-head q/k norms when `qk_norm`)."""
    c = config
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    names: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c.vocab_size, h),
    }
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        names |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c.num_heads * d, h),
            p + "self_attn.k_proj.weight": (c.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (c.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, c.num_heads * d),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if c.qkv_bias:
            names |= {
                p + "self_attn.q_proj.bias": (c.num_heads * d,),
                p + "self_attn.k_proj.bias": (c.num_kv_heads * d,),
                p + "self_attn.v_proj.bias": (c.num_kv_heads * d,),
            }
        if c.qk_norm:
            names |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return names


def read_checkpoint(
    model_dir: Path, config: LlamaConfig, *, device: torch.device, dtype: torch.dtype
) -> tuple[LlamaWeights, list[Path]]:
    """Weights from every *.safetensors in `model_dir` (shards merged), and the files read."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir} has no *.safetensors files (pdkv reads safetensors only)")
    expected = _hf_names(config)
    tensors: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key in expected:
                        tensors[key] = fh.get_tensor(key).to(device=device, dtype=dtype)
                    elif not key.endswith(_IGNORED_SUFFIXES):
                        unused.append(key)
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
            raise ModelError(
                f"cannot read {file}: {type(exc).__name__}: {exc} (a truncated or corrupt "
                "download? fetch the checkpoint again)"
            ) from exc
    if config.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")  # type: ignore[assignment]
    _check_tensors(model_dir, expected, tensors)
    if unused:
        log.warning("checkpoint_tensors_unused", count=len(unused), first=unused[:5])
    return _assemble(config, tensors), files


def _check_tensors(
    model_dir: Path, expected: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor | None]
) -> None:
    missing = [name for name in expected if tensors.get(name) is None]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ModelError(f"checkpoint {model_dir} lacks tensors: {shown}")
    for name, shape in expected.items():
        found = tuple(tensors[name].shape)  # type: ignore[union-attr]
        if found != shape:
            raise ModelError(
                f"tensor {name} in {model_dir} has shape {found}, config.json implies {shape}"
            )


def _assemble(config: LlamaConfig, t: dict[str, torch.Tensor]) -> LlamaWeights:
    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        qkv = [t.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        gate_up = [t.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
        bias = [t.pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"] if config.qkv_bias else None
        layers.append(
            LayerWeights(
                input_norm=t[p + "input_layernorm.weight"],
                qkv=torch.cat(qkv, dim=0),
                o=t[p + "self_attn.o_proj.weight"],
                post_norm=t[p + "post_attention_layernorm.weight"],
                gate_up=torch.cat(gate_up, dim=0),
                down=t[p + "mlp.down_proj.weight"],
                qkv_bias=torch.cat(bias) if bias else None,
                q_norm=t.get(p + "self_attn.q_norm.weight"),
                k_norm=t.get(p + "self_attn.k_norm.weight"),
            )
        )
    return LlamaWeights(
        embed=t["model.embed_tokens.weight"],
        layers=layers,
        norm=t["model.norm.weight"],
        lm_head=t["lm_head.weight"],
    )


def _cast(w: LlamaWeights, device: torch.device, dtype: torch.dtype) -> LlamaWeights:
    def mv(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device=device, dtype=dtype)

    embed = mv(w.embed)
    layers = [
        LayerWeights(*(mv(getattr(lw, f)) for f in lw.__dataclass_fields__)) for lw in w.layers
    ]
    head = embed if w.lm_head is w.embed else mv(w.lm_head)
    return LlamaWeights(embed=embed, layers=layers, norm=mv(w.norm), lm_head=head)


def _checkpoint_fingerprint(model_dir: Path, config: LlamaConfig, files: list[Path]) -> str:
    """Identity of a checkpoint: its config digest plus the names and sizes of its weight files."""
    h = hashlib.sha256(config.digest().encode())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return f"{model_dir.name}-{h.hexdigest()[:16]}"


def _checkpoint_tokenizer(model_dir: Path, config: LlamaConfig, *, allow_bytes: bool) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if path.is_file():
        tok = HFTokenizer(path, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
        if tok.vocab_size > config.vocab_size:
            raise ModelError(
                f"{path} has {tok.vocab_size} tokens, more than the model's vocabulary of "
                f"{config.vocab_size} (vocab_size in config.json): its ids past the embedding "
                "would fail requests; use the checkpoint's own tokenizer.json"
            )
        return tok
    if not allow_bytes:
        raise ModelError(
            f"{model_dir} has no tokenizer.json: add the checkpoint's tokenizer.json, or pass "
            "--allow-byte-tokenizer to use UTF-8 bytes as token ids (garbage text for a model "
            "not trained on bytes)"
        )
    if config.vocab_size < BYTE_VOCAB:
        raise ModelError(
            f"{model_dir} has no tokenizer.json and its vocabulary ({config.vocab_size}) is too "
            "small for the byte tokenizer; add the checkpoint's tokenizer.json"
        )
    log.warning("no_tokenizer_json", model_dir=str(model_dir), fallback="bytes")
    kwargs = {
        k: v
        for k, v in (("bos_token_id", config.bos_token_id), ("eos_token_id", config.eos_token_id))
        if v is not None
    }
    return ByteTokenizer(**kwargs)
