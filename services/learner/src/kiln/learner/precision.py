"""Training precision of the policy: fp32, bf16, MXFP8 or FP8 rowwise, per module.

``apply_precision(model, recipe)`` converts a model in place before its optimizer is
built. Recipes:

- ``fp32``: nothing changes;
- ``bf16``: every parameter is stored and trained in bf16;
- ``mxfp8``: the GEMMs of the attention projections (``nn.Linear``) and of the routed
  experts run in MXFP8 forward and backward through torchao's training ops
  (``torchao.prototype.moe_training``: OCP MX, 32-element blocks, E8M0 scales, E4M3
  elements, RCEIL scales): weights stay high precision (master copies), inputs,
  weights and gradients are quantized per GEMM. ``kernel="emulated"`` runs torchao's
  hardware-agnostic path (quantize, dequantize, high-precision GEMM: bit-faithful
  numerics at no speed-up; the CPU path); ``"auto"`` picks torchao's CUDA/Triton/CUTLASS
  kernels (SM100+);
- ``fp8_rowwise``: the Hopper option: ``torchao.float8`` rowwise-scaled FP8 for the
  linear layers and torchao's FP8 rowwise grouped GEMM for the experts (which needs
  CUDA: on CPU the experts stay high precision and the summary says so).

Invariant: modules whose qualified name matches a ``keep_high_precision`` pattern
(default: the router ``mlp.gate``, the embeddings and ``lm_head``) are never converted;
the returned summary lists every module and the precision its GEMMs run in.
"""

from __future__ import annotations

import fnmatch
import functools
import logging

import torch
from torch import nn

from kiln.shared.model.experts import GroupedExperts

log = logging.getLogger("kiln.learner.precision")

RECIPES = ("fp32", "bf16", "mxfp8", "fp8_rowwise")
KEEP_HIGH_PRECISION = ("*.mlp.gate", "embed_tokens", "lm_head")


def _kept(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _mxfp8_config(kernel: str, out_dtype: torch.dtype):
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    pref = {"emulated": KernelPreference.EMULATED, "auto": KernelPreference.AUTO}[kernel]
    return MXFP8TrainingOpConfig(
        kernel_preference=pref, out_dtype=out_dtype, scale_calculation_mode=ScaleCalculationMode.RCEIL,
        pad_token_groups_for_grouped_mm=True,
    )  # fmt: skip


def mxfp8_grouped_gemm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor, *, kernel: str = "emulated") -> torch.Tensor:
    """``GroupedExperts.gemm`` in MXFP8 (torchao's ``_to_mxfp8_then_scaled_grouped_mm``;
    token groups are padded to multiples of 32 inside)."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    pref = {"emulated": KernelPreference.EMULATED, "auto": KernelPreference.AUTO}[kernel]
    # The scaled grouped GEMM produces bf16 (torchao's emulated path requires it too).
    return _to_mxfp8_then_scaled_grouped_mm(
        x, w_t, offs=offs, out_dtype=torch.bfloat16, kernel_preference=pref,
        scale_calculation_mode=ScaleCalculationMode.RCEIL, pad_token_groups_for_grouped_mm=True,
    ).to(x.dtype)  # fmt: skip


def apply_precision(
    model: nn.Module,
    recipe: str,
    *,
    kernel: str = "emulated",
    keep_high_precision: tuple[str, ...] = KEEP_HIGH_PRECISION,
) -> dict[str, str]:
    """Convert ``model`` in place; returns ``{module name: precision}`` for every GEMM module."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown precision recipe {recipe!r}; expected one of {RECIPES}")
    if kernel not in ("emulated", "auto"):
        raise ValueError(f"unknown kernel {kernel!r}; expected emulated or auto")
    gemm_modules = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding | GroupedExperts)}
    summary = {n: str(next(m.parameters()).dtype).removeprefix("torch.") for n, m in gemm_modules.items()}
    if recipe == "fp32":
        return summary
    if recipe == "bf16":
        model.to(torch.bfloat16)
        return {n: "bf16" for n in summary}
    convert = {n for n, m in gemm_modules.items() if not isinstance(m, nn.Embedding) and not _kept(n, keep_high_precision)}
    dtype = next(model.parameters()).dtype
    if recipe == "mxfp8":
        from torchao.quantization import quantize_

        linears = {n for n in convert if isinstance(gemm_modules[n], nn.Linear)}
        if linears:
            quantize_(model, _mxfp8_config(kernel, dtype), filter_fn=lambda m, fqn: fqn in linears)
        for n in convert - linears:
            gemm_modules[n].gemm = functools.partial(mxfp8_grouped_gemm, kernel=kernel)
        summary.update({n: f"mxfp8 ({kernel})" for n in convert})
        return summary
    # fp8_rowwise
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = {n for n in convert if isinstance(gemm_modules[n], nn.Linear)}
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name("rowwise"), module_filter_fn=lambda m, fqn: fqn in linears
    )
    summary.update({n: "fp8 rowwise" for n in linears})
    experts = convert - linears
    if experts and torch.cuda.is_available():
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

        for n in experts:
            gemm_modules[n].gemm = lambda x, w_t, offs: _to_fp8_rowwise_then_scaled_grouped_mm(x, w_t, offs=offs, out_dtype=x.dtype)
        summary.update({n: "fp8 rowwise" for n in experts})
    elif experts:
        log.warning("fp8_rowwise: torchao's FP8 grouped GEMM needs CUDA; %d expert modules stay %s", len(experts), dtype)
    return summary
