"""Fused elementwise kernels: RoPE + KV store by slot mapping, RMSNorm (with the residual add), the
per-head RMSNorm of q and k (Qwen3), and SiLU(gate)·up. Each rounds where the torch path rounds (fp32 inside, the model's dtype at the
points where `common.model.llama` casts), so only the order of a reduction differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base, heads, offs, cos, sin, mask, HALF: tl.constexpr):
    """Rotate heads [H] of one token in place (each head's halves at base + head * 2*HALF)."""
    ptr = base + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty
    r1 = (x1 * cos - x2 * sin).to(dtype)
    r2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(ptr, r1, mask=mask)
    tl.store(ptr + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _rope_store(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    kv_ptr,
    layer,
    max_pos,
    stride_qkv,
    stride_kb,
    stride_kl,
    stride_kkv,
    stride_kt,
    stride_kh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STORE: tl.constexpr,
):
    tok = tl.program_id(0)  # one token: all its q heads, then its k heads (+ the store)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs = tl.arange(0, HALF)
    # a position outside the tables reads nothing (cos 1, sin 0: q and k pass unrotated)
    inside = offs < tl.where((pos >= 0) & (pos < max_pos), HALF, 0)
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=inside, other=1.0)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=inside, other=0.0)[None, :]
    base = qkv_ptr + tok.to(tl.int64) * stride_qkv
    qh = tl.arange(0, HEADS_PAD)
    _rotate_heads(base, qh, offs, cos, sin, (qh < NUM_HEADS)[:, None], HALF)
    kh = tl.arange(0, KV_HEADS_PAD)
    kmask = (kh < NUM_KV_HEADS)[:, None]
    k_base = base + NUM_HEADS * (2 * HALF)
    r1, r2 = _rotate_heads(k_base, kh, offs, cos, sin, kmask, HALF)
    if STORE:
        slot = tl.load(slots_ptr + tok)
        if slot >= 0:
            dst = (
                kv_ptr
                + (slot // BLOCK_SIZE) * stride_kb
                + layer * stride_kl
                + (slot % BLOCK_SIZE) * stride_kt
                + kh[:, None] * stride_kh
                + offs[None, :]
            )
            out_t = kv_ptr.dtype.element_ty
            tl.store(dst, r1.to(out_t), mask=kmask)
            tl.store(dst + HALF, r2.to(out_t), mask=kmask)
            v_src = k_base + NUM_KV_HEADS * (2 * HALF) + kh[:, None] * (2 * HALF) + offs[None, :]
            v1 = tl.load(v_src, mask=kmask, other=0.0)
            v2 = tl.load(v_src + HALF, mask=kmask, other=0.0)
            tl.store(dst + stride_kkv, v1.to(out_t), mask=kmask)
            tl.store(dst + stride_kkv + HALF, v2.to(out_t), mask=kmask)


def rope_and_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv: torch.Tensor | None = None,
    layer: int = 0,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """Rotate q and k of `qkv` [N, (Hq + 2*Hkv) * D] in place at `positions` [N], and when `kv` is
    given write each token's rotated k and its v into `kv` at `slot_mapping[t]` of `layer`.

    `cos`/`sin` [max_pos, D/2] fp32 are the tables of `LlamaModel._rope`; a position outside
    [0, max_pos) reads nothing from them and leaves its token unrotated (the daemons refuse
    requests that would reach one); a negative slot writes nothing (a padded graph row).
    """
    n = qkv.shape[0]
    half = cos.shape[1]
    store = kv is not None
    kvt = kv if store else qkv
    strides = kv.stride()[:5] if store else (0, 0, 0, 0, 0)
    _rope_store[(n,)](
        qkv,
        positions,
        cos,
        sin,
        slot_mapping if store else positions,
        kvt,
        layer,
        cos.shape[0],
        qkv.stride(0),
        *strides,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        BLOCK_SIZE=kv.shape[3] if store else 1,
        STORE=store,
        num_warps=2 if num_heads * half <= 1024 else 4,
    )


@triton.jit
def _add_rms_norm(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    eps,
    hidden,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * hidden + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * hidden + offs, mask=mask, other=0.0)).to(
            dtype
        )
        tl.store(res_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    y = (xf * rstd).to(dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * hidden + offs, (w.to(tl.float32) * y.to(tl.float32)).to(dtype), mask=mask
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`llama.rms_norm(x)`, or with `residual`: residual += x (in place, rounded to its dtype)
    and return rms_norm(residual). Rows [N, hidden], contiguous."""
    n, hidden = x.shape
    out = torch.empty_like(x)
    _add_rms_norm[(n,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        eps,
        hidden,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=4 if hidden <= 4096 else 8,
    )
    return out


@triton.jit
def _head_rms_norm(
    qkv_ptr, w_ptr, eps, stride_qkv, first, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr
):
    tok = tl.program_id(0).to(tl.int64)
    head = first + tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HEAD_DIM
    ptr = qkv_ptr + tok * stride_qkv + head * HEAD_DIM + offs
    dtype = qkv_ptr.dtype.element_ty
    xf = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HEAD_DIM + eps)
    y = (xf * rstd).to(dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(ptr, (w.to(tl.float32) * y.to(tl.float32)).to(dtype), mask=mask)


def qk_head_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """`llama.rms_norm` of each q head (weight `q_weight` [D]) and each k head (`k_weight`) of
    `qkv` [N, (Hq + 2*Hkv) * D], in place; v is left alone. Rows may be strided, heads not."""
    n = qkv.shape[0]
    d = q_weight.shape[0]
    for first, heads, weight in ((0, num_heads, q_weight), (num_heads, num_kv_heads, k_weight)):
        _head_rms_norm[(n, heads)](
            qkv,
            weight,
            eps,
            qkv.stride(0),
            first,
            HEAD_DIM=d,
            BLOCK=triton.next_power_of_2(d),
            num_warps=1 if d <= 256 else 4,
        )


@triton.jit
def _silu_mul(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dtype = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + offs, (act * u).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of `gate_up` [N, 2*I] ([gate | up], contiguous) -> [N, I]."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
