"""A kernel the interpreter runs and a GPU compile rejects: ``tl.dot`` over K = 8 (NVIDIA's MMA needs K >= 16).
(An 8-row tile, the example of the issue, compiles with Triton 3.9, which pads M.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

K = 8


@triton.jit
def short_k_dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rows, ks, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
    b = tl.load(b_ptr + ks[:, None] * N + cols[None, :])
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], tl.dot(a, b))


def short_k_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    short_k_dot_kernel[(1,)](a, b, out, M=a.shape[0], K=a.shape[1], N=b.shape[1])
    return out


if __name__ == "__main__":  # under TRITON_INTERPRET=1: runs, and agrees with torch
    a, b = torch.randn(16, K, dtype=torch.float16), torch.randn(K, 16, dtype=torch.float16)
    print(torch.allclose(short_k_dot(a, b), a.float() @ b.float(), atol=1e-2))
