"""The model's forward passes through the Triton kernels (`common.model.kernels`).

Same arithmetic as `LlamaModel._run_layers` with the torch path's attention, in ten launches a
layer: RMSNorm fused with the residual add, the qkv matmul (with its bias, Qwen2), RoPE fused with
the KV store, attention (paged decode or varlen causal prefill), the o matmul, RMSNorm, gate_up,
SiLU·up, down; a model with `qk_norm` (Qwen3) adds two launches, the per-head RMSNorm of q and k
in place before RoPE. A layer with a sliding window (`config.window(layer)`) hands it to its
attention kernel as a plain argument, so a captured graph keeps each layer's. Nothing here
synchronizes with the host or depends on host values other than shapes, so a decode forward can be
captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from common.model.kernels.attention import paged_decode_attention
from common.model.kernels.context_attention import varlen_context_attention
from common.model.kernels.fused import qk_head_norm, rms_norm, rope_and_store, silu_mul
from common.model.kernels.varlen_attention import varlen_causal_attention

# common.model.llama.LlamaModel, which calls into this module: typed loosely here so that the two
# modules do not import each other (tests/test_layers.py)
LlamaModel = Any


def rope_tables(model: LlamaModel) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, D/2] fp32 on the model's device, as `LlamaModel._rope` computes
    them (cached on the model)."""
    tables = getattr(model, "_rope_tables", None)
    if tables is None:
        n = model.config.max_position_embeddings
        freqs = torch.arange(n, device=model.device).float()[:, None] * model._inv_freq[None, :]
        tables = (freqs.cos().contiguous(), freqs.sin().contiguous())
        model._rope_tables = tables
    return tables


def _layers(
    model: LlamaModel, tokens, positions, slots, kv, attend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every layer over tokens [N] -> (residual stream, last MLP output), not yet summed."""
    c, w = model.config, model.weights
    cos, sin = rope_tables(model)
    n = tokens.shape[0]
    residual = F.embedding(tokens, w.embed)
    delta = None
    for index, lw in enumerate(w.layers):
        if delta is None:
            x = rms_norm(residual, lw.input_norm, c.rms_norm_eps)
        else:
            x = rms_norm(delta, lw.input_norm, c.rms_norm_eps, residual)
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)
        if lw.q_norm is not None:
            qk_head_norm(qkv, lw.q_norm, lw.k_norm, c.rms_norm_eps, c.num_heads, c.num_kv_heads)
        rope_and_store(qkv, positions, cos, sin, c.num_heads, c.num_kv_heads, kv, index, slots)
        q, k, v = qkv.split([model._q_size, model._kv_size, model._kv_size], -1)
        attn = attend(
            q.view(n, c.num_heads, c.head_dim),
            k.view(n, c.num_kv_heads, c.head_dim),
            v.view(n, c.num_kv_heads, c.head_dim),
            index,
        )
        o = F.linear(attn.reshape(n, model._q_size), lw.o)
        x = rms_norm(o, lw.post_norm, c.rms_norm_eps, residual)
        delta = F.linear(silu_mul(F.linear(x, lw.gate_up)), lw.down)
    return residual, delta


def _final_logits(model: LlamaModel, residual, delta, rows=None) -> torch.Tensor:
    if rows is not None:
        residual, delta = residual[rows].contiguous(), delta[rows].contiguous()
    x = rms_norm(delta, model.weights.norm, model.config.rms_norm_eps, residual)
    return F.linear(x, model.weights.lm_head).float()


def decode_forward(
    model: LlamaModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv: torch.Tensor,
) -> torch.Tensor:
    """`LlamaModel.decode_step` by kernels -> logits [B, vocab] fp32. All inputs on the device;
    a row with slot -1 and length 0 (a padded graph slot) writes nothing and reads nothing."""

    def attend(q, k, v, layer):
        window = model.config.window(layer)
        return paged_decode_attention(q, kv, layer, block_tables, seq_lens, window=window)

    residual, delta = _layers(model, tokens, positions, slot_mapping, kv, attend)
    return _final_logits(model, residual, delta)


def prefill_forward(
    model: LlamaModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    kv: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`LlamaModel.prefill_batch` by kernels -> logits [R, vocab] of the token rows `rows`
    (default: each sequence's last token)."""
    single = cu_seqlens.numel() == 2 and tokens.device.type == "cuda"

    def attend(q, k, v, layer):
        window = model.config.window(layer)
        if single and not window:  # one sequence: torch's flash kernel is as fast, no varlen
            return model._causal_attention(q, k, v)
        return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, window=window)

    residual, delta = _layers(model, tokens, positions, slot_mapping, kv, attend)
    return _final_logits(model, residual, delta, cu_seqlens[1:] - 1 if rows is None else rows)


def prefill_context_forward(
    model: LlamaModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen: int,
    kv: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`LlamaModel.prefill_batch` with `starts` (a cached or earlier-chunk context) by kernels ->
    logits [R, vocab] of the token rows `rows` (default: each sequence's last token). The new
    tokens' K/V is stored first (RoPE + store), then attention reads every key from the pool."""

    def attend(q, k, v, layer):
        args = (cu_seqlens, starts, block_tables, max_seqlen)
        window = model.config.window(layer)
        return varlen_context_attention(q, kv, layer, *args, window=window)

    residual, delta = _layers(model, tokens, positions, slot_mapping, kv, attend)
    return _final_logits(model, residual, delta, cu_seqlens[1:] - 1 if rows is None else rows)
