"""Routed experts as grouped GEMMs.

``GroupedExperts`` holds every expert's SwiGLU weights stacked (``w_gate``/``w_up``:
(E, I, D), ``w_down``: (E, D, I)) and runs tokens already sorted by expert, expert
``e``'s tokens contiguous, through three grouped GEMMs. The GEMM is the pluggable
attribute ``gemm(x (M, K), w_t (E, K, N), offs int32 (E,) cumulative end offsets) ->
(M, N)``: a precision recipe swaps in an MXFP8 one, expert parallelism wraps the module
whole. Routing and the token permutation stay in ``SparseMoE``.

Invariant: every ``gemm`` computes, for each group ``e``, ``x[offs[e-1]:offs[e]] @
w_t[e]``, and groups may be empty.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def loop_gemm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The reference grouped GEMM: one matmul per group (correct on every device)."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w_t[e])
        start = end
    return torch.cat(out) if out else x.new_zeros((0, w_t.shape[-1]))


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gemm = loop_gemm

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        offs = torch.cumsum(torch.as_tensor(counts, device=x.device), 0).to(torch.int32)
        h = F.silu(self.gemm(x, self.w_gate.transpose(-2, -1), offs)) * self.gemm(x, self.w_up.transpose(-2, -1), offs)
        return self.gemm(h, self.w_down.transpose(-2, -1), offs)
