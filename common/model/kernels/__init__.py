"""Triton kernels of the fast path: paged-decode attention (attention.py), varlen causal prefill
attention (varlen_attention.py) and its paged-context form (context_attention.py, launching
context_kernels.py), the fused RoPE + KV store by slot mapping, RMSNorm with the residual add, the
per-head RMSNorm of q and k, and SiLU·up (fused.py).

Every kernel computes what a function of the torch path computes (`common.model.llama`,
`common.model.paged`), which stays the reference; tests compare the two on random inputs. Triton
ships with the CUDA build of torch; on a CPU machine, `pip install triton` and `TRITON_INTERPRET=1`
run these kernels in Triton's interpreter (slow, for tests only).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_usable(device: torch.device) -> bool:
    """True when the Triton kernels can run on `device`: CUDA with Triton, or the interpreter.

    `PDKV_KERNELS=0` turns them off everywhere (the torch path then runs on the GPU too).
    """
    if os.environ.get("PDKV_KERNELS", "1") == "0":
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False  # decided without importing triton (slow to import, absent in CI)
    return triton_importable()
