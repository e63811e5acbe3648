"""The model side of pdkv: a Llama-family decoder over a paged KV pool, its loader and tokenizers,
the sampler, and the single-process reference generator (the correctness anchor).

Pool layout: `kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (see `paged`).
"""

from __future__ import annotations

from common.model.config import LlamaConfig
from common.model.llama import LlamaModel
from common.model.loader import load_model, tiny_model
from common.model.paged import gather_kv, kv_shape, paged_attention, scatter_kv, slots_for
from common.model.reference import generate, generate_batch
from common.model.sampling import (
    SamplingParams,
    SamplingParamsError,
    finish_reason,
    make_generator,
    sample,
    sample_batch,
)
from common.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "LlamaConfig",
    "LlamaModel",
    "SamplingParams",
    "SamplingParamsError",
    "Tokenizer",
    "finish_reason",
    "gather_kv",
    "generate",
    "generate_batch",
    "kv_shape",
    "load_model",
    "make_generator",
    "paged_attention",
    "sample",
    "sample_batch",
    "scatter_kv",
    "slots_for",
    "tiny_model",
]
