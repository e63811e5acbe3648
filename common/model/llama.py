"""A Llama-family decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model reads and writes K/V only through `common.model.paged` on the pool tensor the caller
passes in, so prefill and decode can run in different processes over shared memory. Weights are
held fused (q/k/v in one matrix, gate/up in another) so each layer is four matmuls.

Batch invariance: every operation in `decode_step` is row-wise (per-token matmuls, per-row
attention), so a sequence decoded alone and inside a batch sees the same arithmetic up to the
kernels' own blocking; the tiny model's wide logits keep greedy argmax stable under that rounding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model.config import LlamaConfig
from common.model.kernels import kernels_usable
from common.model.paged import causal_mask, context_attention, paged_attention, scatter_kv


@dataclass
class LayerWeights:
    """One decoder layer; `qkv` rows are [q heads | k heads | v heads], `gate_up` is [gate | up].

    `qkv_bias` is present exactly when the config's `qkv_bias` is set, `q_norm`/`k_norm` exactly
    when its `qk_norm` is (None otherwise).
    """

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(Hq + 2*Hkv) * D, hidden]
    o: torch.Tensor  # [hidden, Hq * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2*Hkv) * D]
    q_norm: torch.Tensor | None = None  # [D], one RMSNorm shared by every q head
    k_norm: torch.Tensor | None = None  # [D], one RMSNorm shared by every k head


@dataclass
class LlamaWeights:
    """All weights; `lm_head` may be the very tensor `embed` (tied embeddings)."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama defines it: normalize in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with linear or llama3 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_type == "linear":
        return inv / config.rope_factor
    if config.rope_type == "llama3":
        factor, old_len = config.rope_factor, config.rope_original_max_position
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Inference-only Llama decoder over an external paged KV pool.

    Attributes: `config`, `device`, `dtype`, `fingerprint` (model identity for the handshake),
    `use_kernels` (run `prefill`, `prefill_batch` and `decode_step` through the Triton kernels of
    `common.model.fastpath`; on by default where they can run, i.e. on CUDA; the torch path is the
    reference). Inputs may live on any device; they are moved to `device`. Logits are in fp32.
    """

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, *, fingerprint: str) -> None:
        self.config = config
        self.weights = weights
        self.fingerprint = fingerprint
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self._inv_freq = rope_inv_freq(config).to(self.device)
        c = config
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim
        self.use_kernels = kernels_usable(self.device)

    def kv_layout_args(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim): the model's part of the pool shape."""
        return self.config.num_layers, self.config.num_kv_heads, self.config.head_dim

    def new_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed pool tensor of this model's layout, dtype and device (for tests, references)."""
        n_layers, heads, dim = self.kv_layout_args()
        shape = (num_blocks, n_layers, 2, block_size, heads, dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def prefill(
        self, tokens: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """Run a prompt at positions 0..T-1 and return the last position's logits [vocab] (fp32).

        Writes every layer's K/V of all T tokens into `kv` at `slot_mapping` [T]; attention is
        causal over the prompt itself (dense, not read back from the pool).
        """
        if self.use_kernels:
            return self.prefill_batch([tokens], [slot_mapping], kv)[0]
        tokens, slots = self._on_device(tokens, slot_mapping)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            scatter_kv(kv, layer, slots, k, v)
            return self._causal_attention(q, k, v, self.config.window(layer))

        h = self._run_layers(tokens, torch.arange(tokens.numel(), device=self.device), attend)
        return self._logits(h[-1:])[0]

    @torch.inference_mode()
    def prefill_batch(
        self,
        prompts: Sequence[torch.Tensor],
        slot_mappings: Sequence[torch.Tensor],
        kv: torch.Tensor,
        every_position: Sequence[bool] = (),
        *,
        starts: Sequence[int] | None = None,
        block_tables: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """`prefill` of several prompts in one forward (varlen: tokens concatenated) -> [R, vocab].

        Prompt s gives the logits of its last token, or of each of its positions when
        `every_position[s]` (prompt logprobs: only then, it costs vocab x length), in order.
        Each prompt attends only to itself, so its logits and K/V are those of `prefill` alone,
        up to the kernels' blocking.

        With `starts`, prompt s holds positions starts[s] .. starts[s]+len-1 of a sequence whose
        first starts[s] positions' K/V are already in `kv` (a cached prefix, earlier chunks), in
        its blocks `block_tables[s]` (which cover the new positions too); its tokens attend to
        those positions as well, read from the pool. The result is that of prefilling the whole
        sequence, up to rounding (`every_position` then gives the rows of the new positions only).
        """
        lengths = [int(p.numel()) for p in prompts]
        offsets = list(starts) if starts is not None else [0] * len(lengths)
        tokens, slots = self._on_device(torch.cat(list(prompts)), torch.cat(list(slot_mappings)))
        positions = torch.cat(
            [torch.arange(a, a + n) for a, n in zip(offsets, lengths, strict=True)]
        )
        positions = positions.to(self.device)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], device=self.device)
        rows = cu[1:] - 1
        if any(every_position):
            bounds = [0, *itertools.accumulate(lengths)]
            rows = torch.tensor(
                [
                    r
                    for s, (a, b) in enumerate(itertools.pairwise(bounds))
                    for r in (
                        range(a, b) if s < len(every_position) and every_position[s] else [b - 1]
                    )
                ],
                device=self.device,
            )
        if any(offsets):
            if block_tables is None:
                raise ValueError("a prefill with a cached context needs the block tables")
            return self._prefill_context(
                tokens, positions, slots, cu, offsets, block_tables, kv, lengths, rows
            )
        if self.use_kernels:
            from common.model.fastpath import prefill_forward

            return prefill_forward(self, tokens, positions, slots, cu, max(lengths), kv, rows)
        bounds = cu.tolist()

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            scatter_kv(kv, layer, slots, k, v)
            window = self.config.window(layer)
            parts = [
                self._causal_attention(q[a:b], k[a:b], v[a:b], window)
                for a, b in itertools.pairwise(bounds)
            ]
            return torch.cat(parts)

        h = self._run_layers(tokens, positions, attend)
        return self._logits(h[rows])

    def _prefill_context(
        self, tokens, positions, slots, cu, starts, block_tables, kv, lengths, rows
    ):  # type: ignore[no-untyped-def]
        """prefill_batch of prompts some of whose K/V is already in the pool (see there)."""
        width = max(len(t) for t in block_tables)
        table = torch.tensor(
            [list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.long
        ).to(self.device)
        if self.use_kernels:
            from common.model.fastpath import prefill_context_forward

            start_t = torch.tensor(starts, dtype=torch.int32, device=self.device)
            args = (cu, start_t, table, max(lengths), kv, rows)
            return prefill_context_forward(self, tokens, positions, slots, *args)
        bounds = cu.tolist()

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            scatter_kv(kv, layer, slots, k, v)  # first: the new tokens read their own K/V back
            window = self.config.window(layer)
            parts = [
                context_attention(q[a:b], kv, layer, table[s], starts[s], window=window)
                for s, (a, b) in enumerate(itertools.pairwise(bounds))
            ]
            return torch.cat(parts)

        h = self._run_layers(tokens, positions, attend)
        return self._logits(h[rows])

    @torch.inference_mode()
    def decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        kv: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per sequence for a batch of sequences of different lengths -> [B, vocab].

        Row b's token sits at `positions[b]`; its K/V is written to `slot_mapping[b]` and then it
        attends over `block_tables[b]` up to `seq_lens[b]` (which counts the new token, so
        seq_lens == positions + 1 for a sequence without gaps). Rows never influence each other.
        """
        tokens, positions, slots, tables, lens = self._on_device(
            tokens, positions, slot_mapping, block_tables, seq_lens
        )
        if self.use_kernels:
            from common.model.fastpath import decode_forward

            return decode_forward(self, tokens, positions, slots, tables, lens, kv)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            scatter_kv(kv, layer, slots, k, v)
            return paged_attention(q, kv, layer, tables, lens, window=self.config.window(layer))

        return self._logits(self._run_layers(tokens, positions, attend))

    @torch.inference_mode()
    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] (fp32) of every position of one sequence, no cache: the test oracle."""
        (tokens,) = self._on_device(tokens)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return self._causal_attention(q, k, v, self.config.window(layer))

        return self._logits(
            self._run_layers(tokens, torch.arange(tokens.numel(), device=self.device), attend)
        )

    # -- internals -------------------------------------------------------------------------------

    def _on_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.as_tensor(t).to(self.device, dtype=torch.long, non_blocking=True) for t in tensors
        )

    def _run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Embed `tokens` [N] and run every layer; `attend(q, k, v, layer)` supplies attention."""
        c = self.config
        cos, sin = self._rope(positions)
        h = F.embedding(tokens, self.weights.embed)
        n = tokens.numel()
        for index, lw in enumerate(self.weights.layers):
            x = rms_norm(h, lw.input_norm, c.rms_norm_eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], -1)
            q, k = q.view(n, c.num_heads, c.head_dim), k.view(n, c.num_kv_heads, c.head_dim)
            if lw.q_norm is not None:  # Qwen3: RMSNorm of each head before RoPE
                q = rms_norm(q, lw.q_norm, c.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, c.rms_norm_eps)
            q, k = self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin)
            v = v.reshape(n, c.num_kv_heads, c.head_dim)
            h = h + F.linear(attend(q, k, v, index).reshape(n, self._q_size), lw.o)
            x = rms_norm(h, lw.post_norm, c.rms_norm_eps)
            gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.down)
        return h

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [N, 1, D]: broadcast over heads
        return emb.cos(), emb.sin()

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)

    def _causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0
    ) -> torch.Tensor:
        """Dense causal attention of one sequence: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D];
        with a sliding `window` W > 0, position i sees only positions above i - W."""
        n = q.shape[0]
        mask = causal_mask(torch.arange(n, device=q.device), n, window) if 0 < window < n else None
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, self.weights.norm, self.config.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()
