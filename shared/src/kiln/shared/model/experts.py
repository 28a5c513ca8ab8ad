"""Routed experts as grouped GEMMs.

``GroupedExperts`` holds every expert's SwiGLU weights stacked (``w_gate``/``w_up``:
(E, I, D), ``w_down``: (E, D, I)) and runs tokens already sorted by expert, expert
``e``'s tokens contiguous, through three grouped GEMMs. The GEMM is the pluggable
attribute ``gemm(x (M, K), w_t (E, K, N), offs int32 (E,) cumulative end offsets) ->
(M, N)``: a precision recipe swaps in an MXFP8 one, expert parallelism wraps the module
whole (so every parameter here is stacked by expert, dim 0). Routing, the token
permutation and any shared expert stay in ``SparseMoE``.

Invariants: every ``gemm`` computes, for each group ``e``, ``x[offs[e-1]:offs[e]] @
w_t[e]`` (groups may be empty); ``default_gemm`` gives the same numbers as
``loop_gemm`` (bit for bit on CPU) and picks ``torch._grouped_mm`` only where a probe
showed that it runs forward and backward for that device type and dtype; the probe
builds its own autograd graph, invisible to an enclosing activation checkpoint (so a
layer's first pass and its recomputation save the same tensors).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def loop_gemm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The reference grouped GEMM: one matmul per group (correct on every device)."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w_t[e])
        start = end
    return torch.cat(out) if out else x.new_zeros((0, w_t.shape[-1]))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``torch._grouped_mm``'s
    backward rejects expanded (stride-0) gradients such as the one ``y.sum()`` makes."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm_gemm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (one kernel for all groups) behind the ``gemm`` signature."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, w_t, offs=offs))


_SUPPORTED: dict[tuple[str, torch.dtype], bool] = {}


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here and matches the loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    # Callers may sit in no_grad or inference mode; the probe needs autograd. The first
    # call usually comes from inside a forward, maybe one that activation checkpointing
    # wraps: identity saved-tensor hooks keep the probe's own graph out of the
    # checkpoint's bookkeeping, which would otherwise count the probe's saved tensors in
    # the first pass but not in the recomputation (the probe is cached by then) and fail
    # with torch's CheckpointError.
    with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
        x = torch.randn(12, 16, generator=g).to(device, dtype).requires_grad_()
        w = torch.randn(3, 16, 16, generator=g).to(device, dtype).requires_grad_()
        offs = torch.tensor([5, 5, 12], dtype=torch.int32, device=device)  # an empty group too
        try:
            y = grouped_mm_gemm(x, w, offs)
            y.sum().backward()
        except (RuntimeError, NotImplementedError) as e:  # unsupported device/dtype/arch
            log.info("torch._grouped_mm unavailable for %s/%s (%s): experts use the loop GEMM", device.type, dtype, e)
            return False
        ref = loop_gemm(x.detach(), w.detach(), offs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(y.detach().float(), ref.float(), atol=tol, rtol=tol))


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Probed once per (device type, dtype) and cached."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = _probe(device, dtype)
        log.info("experts GEMM on %s/%s: %s", device.type, dtype, gemm_backend(device, dtype))
    return _SUPPORTED[key]


def gemm_backend(device: torch.device | str, dtype: torch.dtype, k: int = 16, n: int = 16) -> str:
    """Which GEMM ``default_gemm`` runs for these operands: ``grouped_mm`` or ``loop``."""
    return "grouped_mm" if _aligned(k, n, dtype) and grouped_mm_supported(device, dtype) else "loop"


def _aligned(k: int, n: int, dtype: torch.dtype) -> bool:
    # torch._grouped_mm needs every row stride to be a multiple of 16 bytes.
    size = torch.empty((), dtype=dtype).element_size()
    return (k * size) % 16 == 0 and (n * size) % 16 == 0


def default_gemm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` where it runs (e.g. CPU, torch 2.13: fp32/bf16/fp16 with
    16-byte-aligned rows), else ``loop_gemm``; both give the same numbers."""
    k, n = w_t.shape[-2], w_t.shape[-1]
    if _aligned(k, n, x.dtype) and x.dtype == w_t.dtype and grouped_mm_supported(x.device, x.dtype):
        return grouped_mm_gemm(x.contiguous(), w_t, offs)
    return loop_gemm(x, w_t, offs)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gemm = default_gemm

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """``x`` (M, D) sorted by expert, ``counts`` (E,) tokens per expert -> (M, D)."""
        offs = torch.cumsum(torch.as_tensor(counts, device=x.device), 0).to(torch.int32)
        h = F.silu(self.gemm(x, self.w_gate.transpose(-2, -1), offs)) * self.gemm(x, self.w_up.transpose(-2, -1), offs)
        return self.gemm(h, self.w_down.transpose(-2, -1), offs)
