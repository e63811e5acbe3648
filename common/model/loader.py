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
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from common.errors import ModelError
from common.model.arena import WeightsLayout
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
    Raises ModelError for anything missing, unreadable or unsupported, naming it. The weights
    are views of one arena (common.model.arena), loaded in place.
    """
    device = torch.device(device)
    source = ModelSource.find(model_dir, device=device, dtype=dtype, seed=seed)
    arena = source.layout.allocate(device)
    source.fill(arena)
    model = source.model(arena)
    tokenizer = source.tokenizer(allow_bytes=allow_byte_tokenizer)
    log.info("model_loaded", model=model.fingerprint, device=str(device), dtype=str(model.dtype))
    return model, tokenizer


@dataclass(frozen=True)
class ModelSource:
    """A model as known before any weight is read: its config, dtype, fingerprint and arena
    layout (config.json and the safetensors headers only). `fill` reads the weights into an
    arena of `layout`; `model` wraps an arena (filled here or mapped from another process)."""

    config: LlamaConfig
    dtype: torch.dtype
    fingerprint: str
    layout: WeightsLayout
    model_dir: Path | None = None
    files: tuple[Path, ...] = ()
    seed: int = TINY_SEED

    @classmethod
    def find(
        cls,
        model_dir: str | Path | None,
        *,
        device: torch.device,
        dtype: torch.dtype | str | None,
        seed: int = TINY_SEED,
    ) -> ModelSource:
        """The source of `model_dir` (None: the tiny model of `seed`); ModelError as load_model."""
        if model_dir is None:
            config = LlamaConfig.tiny()
            dt = resolve_dtype(dtype, device, tiny=True)
            layout = WeightsLayout.of(config, dt, separate_head=not config.tie_word_embeddings)
            return cls(config, dt, f"tiny-seed{seed}-{config.digest()}", layout, seed=seed)
        path = Path(model_dir)
        config = read_config(path)
        dt = resolve_dtype(dtype, device, tiny=False)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{path} has no *.safetensors files (pdkv reads safetensors only)")
        keys = _keys(files)  # headers only; a corrupt file is refused before anything loads
        own_head = not config.tie_word_embeddings or "lm_head.weight" in keys
        layout = WeightsLayout.of(config, dt, separate_head=own_head)
        fp = _checkpoint_fingerprint(path, config, files)
        return cls(config, dt, fp, layout, path, tuple(files), seed)

    def fill(self, arena: torch.Tensor) -> None:
        """Read the weights into `arena` (a flat uint8 tensor of layout.nbytes, any device)."""
        if self.model_dir is None:
            self.layout.fill(arena, tiny_weights(self.config, self.seed))
        else:
            read_checkpoint(self.model_dir, self.config, self.layout, arena, list(self.files))

    @property
    def files_id(self) -> str:
        """Which files on this host the weights come from (resolved path, device, inode, size,
        mtime of each): two daemons reading the same checkpoint agree, a copy elsewhere or a
        file rewritten since does not. The fingerprint alone names the checkpoint by its config
        and file sizes, which an edited copy can share."""
        h = hashlib.sha256()
        for f in self.files:
            st = f.stat()
            h.update(
                f"{f.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns};".encode()
            )
        return h.hexdigest()[:16]

    def model(self, arena: torch.Tensor) -> LlamaModel:
        return LlamaModel(self.config, self.layout.weights(arena), fingerprint=self.fingerprint)

    def tokenizer(self, *, allow_bytes: bool) -> Tokenizer:
        if self.model_dir is None:
            c = self.config
            return ByteTokenizer(bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
        return _checkpoint_tokenizer(self.model_dir, self.config, allow_bytes=allow_bytes)


def _keys(files: list[Path]) -> set[str]:
    """Every tensor name in `files` (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                names.update(fh.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
            raise _unreadable(file, exc) from exc
    return names


def _unreadable(file: Path, exc: Exception) -> ModelError:
    return ModelError(
        f"cannot read {file}: {type(exc).__name__}: {exc} (a truncated or corrupt "
        "download? fetch the checkpoint again)"
    )


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
    dt = resolve_dtype(dtype, device, tiny=True)
    layout = WeightsLayout.of(config, dt, separate_head=not config.tie_word_embeddings)
    arena = layout.allocate(device)
    layout.fill(arena, tiny_weights(config, seed))
    return LlamaModel(
        config, layout.weights(arena), fingerprint=f"tiny-seed{seed}-{config.digest()}"
    )


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


def _targets(config: LlamaConfig) -> dict[str, tuple[str, int, int]]:
    """Hugging Face tensor name -> (arena slot, first row, end row) it is read into: q/k/v into
    the rows of `qkv` (and `qkv_bias`), gate/up into `gate_up`; -1 rows: the whole slot."""
    c = config
    q, kv, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    out = {
        "model.embed_tokens.weight": ("embed", -1, -1),
        "model.norm.weight": ("norm", -1, -1),
        "lm_head.weight": ("lm_head", -1, -1),
    }
    rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    for n in range(c.num_layers):
        p, s = f"model.layers.{n}.", f"layers.{n}."
        out |= {
            p + "input_layernorm.weight": (s + "input_norm", -1, -1),
            p + "post_attention_layernorm.weight": (s + "post_norm", -1, -1),
            p + "self_attn.o_proj.weight": (s + "o", -1, -1),
            p + "mlp.gate_proj.weight": (s + "gate_up", 0, i),
            p + "mlp.up_proj.weight": (s + "gate_up", i, 2 * i),
            p + "mlp.down_proj.weight": (s + "down", -1, -1),
            p + "self_attn.q_norm.weight": (s + "q_norm", -1, -1),
            p + "self_attn.k_norm.weight": (s + "k_norm", -1, -1),
        }
        for x, (a, b) in rows.items():
            out[p + f"self_attn.{x}_proj.weight"] = (s + "qkv", a, b)
            out[p + f"self_attn.{x}_proj.bias"] = (s + "qkv_bias", a, b)
    return out


def read_checkpoint(
    model_dir: Path,
    config: LlamaConfig,
    layout: WeightsLayout,
    arena: torch.Tensor,
    files: list[Path],
) -> None:
    """Read every tensor of `files` that the model uses into its place in `arena` (one tensor
    at a time: no second copy of the weights is ever held)."""
    from safetensors import safe_open

    expected = _hf_names(config)
    if not layout.separate_head:
        expected.pop("lm_head.weight")
    targets = _targets(config)
    found: set[str] = set()
    unused: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key not in expected:
                        if not key.endswith(_IGNORED_SUFFIXES) and key != "lm_head.weight":
                            unused.append(key)
                        continue
                    tensor = fh.get_tensor(key)
                    _check_shape(model_dir, key, tuple(tensor.shape), expected[key])
                    slot, a, b = targets[key]
                    view = layout.view(arena, slot)
                    (view if a < 0 else view[a:b]).copy_(tensor)
                    found.add(key)
        except ModelError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
            raise _unreadable(file, exc) from exc
    missing = [name for name in expected if name not in found]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ModelError(f"checkpoint {model_dir} lacks tensors: {shown}")
    if unused:
        log.warning("checkpoint_tensors_unused", count=len(unused), first=unused[:5])


def _check_shape(
    model_dir: Path, name: str, found: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    if found != shape:
        raise ModelError(
            f"tensor {name} in {model_dir} has shape {found}, config.json implies {shape}"
        )


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
