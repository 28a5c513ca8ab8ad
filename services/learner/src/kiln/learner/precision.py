"""Training precision of the policy: fp32, bf16, MXFP8 or FP8 rowwise, per module.

``apply_precision(model, recipe)`` converts a model in place before its optimizer is
built. Recipes:

- ``fp32``: nothing changes;
- ``bf16``: every parameter is stored and trained in bf16 (no fp32 master copy: half
  the memory of fp32 + autocast, at the price of AdamW updates rounded to bf16; the
  MXFP8 run keeps fp32 masters, which is why it tracks fp32 closer than bf16 does);
- ``mxfp8``: the GEMMs of the linear layers (attention projections, the shared expert)
  and of the routed experts run in MXFP8 forward and backward through torchao's
  training ops (``torchao.prototype.moe_training``: OCP MX, 32-element blocks, E8M0
  scales, E4M3 elements, RCEIL scales by default): weights stay in their dtype (the
  master copies), and inputs, weights and output gradients are quantized per GEMM.
  ``kernel="emulated"`` runs torchao's hardware-agnostic path (quantize, dequantize,
  bf16 GEMM: faithful numerics, no speed-up; the CPU path); ``"auto"`` runs torchao's
  CUDA/Triton/CUTLASS kernels, which exist only for SM100+ (B200): on an H100/H200 it
  fails at the first forward (torchao's assertion), use ``fp8_rowwise`` there;
- ``fp8_rowwise``: the Hopper option: ``torchao.float8`` rowwise-scaled FP8 for the
  linear layers, and torchao's FP8 rowwise grouped GEMM for the experts where it runs
  (it needs CUDA and Triton). **On CPU the experts stay in high precision**: a probe
  at conversion time finds out, logs a warning and the summary says so.

Invariants: modules whose qualified name matches a ``keep_high_precision`` pattern
(default: the routers ``*.mlp.gate`` and ``*.shared_expert_gate``, the embeddings and
``lm_head``) are never converted, nor are GEMMs whose dimensions the format cannot
block (MX: multiples of 32; FP8: of 16); the returned summary maps every GEMM module
(``nn.Linear``, ``nn.Embedding``, ``GroupedExperts``) to the precision it runs in, with
the reason when it stayed high precision. Expert GEMMs keep ``GroupedExperts.gemm``'s
contract (any group sizes, empty groups included): token groups are padded inside.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

from kiln.shared.model.experts import GroupedExperts

log = logging.getLogger("kiln.learner.precision")

RECIPES = ("fp32", "bf16", "mxfp8", "fp8_rowwise")
KERNELS = ("emulated", "auto")
KEEP_HIGH_PRECISION = ("*.mlp.gate", "*.shared_expert_gate", "embed_tokens", "lm_head")
MX_BLOCK = 32
FP8_ALIGN = 16  # torch._scaled_mm / _scaled_grouped_mm: dims and token groups


def _kept(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _ao_enums(kernel: str, scale_mode: str):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    pref = {"emulated": KernelPreference.EMULATED, "auto": KernelPreference.AUTO}[kernel]
    return pref, ScaleCalculationMode(scale_mode)


def mxfp8_grouped_gemm(
    x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor, *, kernel: str = "emulated", scale_mode: str = "rceil"
) -> torch.Tensor:
    """``GroupedExperts.gemm`` in MXFP8: torchao's ``_to_mxfp8_then_scaled_grouped_mm``,
    which pads token groups to multiples of 32 itself (zero rows: the scales along the
    token dimension in the weight gradient never straddle two experts)."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

    pref, mode = _ao_enums(kernel, scale_mode)
    # torchao's MXFP8 grouped GEMMs produce bf16 (its emulated path requires it too).
    return _to_mxfp8_then_scaled_grouped_mm(
        x,
        w_t,
        offs=offs,
        out_dtype=torch.bfloat16,
        kernel_preference=pref,
        scale_calculation_mode=mode,
        pad_token_groups_for_grouped_mm=True,
    ).to(x.dtype)


def pad_groups(x: torch.Tensor, offs: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad every token group of ``x`` (end offsets ``offs``) to a multiple of
    ``multiple`` rows: (padded x, padded end offsets, index of each row of ``x`` in the
    padded tensor). Differentiable in ``x``; ``y_padded[index]`` undoes it."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    padded = (counts + multiple - 1) // multiple * multiple
    pend = padded.cumsum(0)
    group = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
    index = torch.arange(x.shape[0], device=x.device) - (offs.long() - counts)[group] + (pend - padded)[group]
    total = int(pend[-1]) if len(pend) else 0  # one host sync: the padded size
    x_pad = x.new_zeros((total, x.shape[1])).index_copy(0, index, x)
    return x_pad, pend.to(torch.int32), index


def fp8_rowwise_grouped_gemm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.gemm`` in FP8 rowwise: torchao's
    ``_to_fp8_rowwise_then_scaled_grouped_mm`` (CUDA + Triton), whose own padding option
    is not implemented in 0.18, so the groups are padded to 16 rows here (zero rows
    change no rowwise or per-group scale)."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    x_pad, offs_pad, index = pad_groups(x.contiguous(), offs, FP8_ALIGN)
    y = _to_fp8_rowwise_then_scaled_grouped_mm(
        x_pad, w_t, offs=offs_pad, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )
    return y[index].to(x.dtype)


def _fp8_grouped_gemm_runs(device: torch.device) -> str | None:
    """None if the FP8 rowwise grouped GEMM runs forward and backward on ``device``, else why not."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(2, 32, 32, generator=g).to(device, torch.bfloat16).requires_grad_()
    try:
        with torch.enable_grad():
            y = fp8_rowwise_grouped_gemm(
                x, w.transpose(-2, -1), torch.tensor([8, 40], dtype=torch.int32, device=device)
            )
            y.float().square().sum().backward()
    # torchao reports a missing Triton as NotImplementedError, a missing CUDA
    # capability as RuntimeError/AssertionError: all mean "not here".
    except (NotImplementedError, RuntimeError, AssertionError) as e:
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def _linear_then_bias(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight) + self.bias


def _bias_outside_mxfp8(module: nn.Linear) -> None:
    """torchao 0.18's MXFP8 weight wrapper drops ``F.linear``'s bias (its override reads
    only input and weight), so a biased layer (Qwen2-MoE's q/k/v) would silently lose it:
    keep the bias a plain parameter (same name, same state-dict key) and add it after
    the MXFP8 GEMM, outside torchao."""
    inner = getattr(module.bias, "_data", module.bias)  # torchao wraps every parameter of the module
    module.bias = nn.Parameter(inner.detach().clone(), requires_grad=module.bias.requires_grad)
    module.forward = types.MethodType(_linear_then_bias, module)


def apply_precision(
    model: nn.Module,
    recipe: str,
    *,
    kernel: str = "emulated",
    keep_high_precision: tuple[str, ...] = KEEP_HIGH_PRECISION,
    scale_mode: str = "rceil",
) -> dict[str, str]:
    """Convert ``model`` in place; returns ``{module name: precision}`` for every GEMM
    module. ``kernel`` and ``scale_mode`` (torchao's ``ScaleCalculationMode`` name:
    rceil, floor, ceil, even; torchao's CUDA kernels implement rceil) apply to mxfp8."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown precision recipe {recipe!r}; expected one of {RECIPES}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    gemm_modules = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding | GroupedExperts)}
    summary = {n: str(next(m.parameters()).dtype).removeprefix("torch.") for n, m in gemm_modules.items()}
    if recipe == "fp32":
        return summary
    if recipe == "bf16":
        model.to(torch.bfloat16)
        return dict.fromkeys(summary, "bfloat16")
    dtype = next(model.parameters()).dtype
    align = MX_BLOCK if recipe == "mxfp8" else FP8_ALIGN
    linears, experts = set(), set()
    for n, m in gemm_modules.items():
        if isinstance(m, nn.Embedding):
            continue  # a lookup, not a GEMM
        if _kept(n, keep_high_precision):
            summary[n] += " (kept high precision)"
            continue
        dims = (m.in_features, m.out_features) if isinstance(m, nn.Linear) else tuple(m.w_gate.shape[1:])
        if any(d % align for d in dims):
            summary[n] += f" (dims {dims} not multiples of {align})"
            continue
        (linears if isinstance(m, nn.Linear) else experts).add(n)
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_

        pref, mode = _ao_enums(kernel, scale_mode)
        if linears:
            config = MXFP8TrainingOpConfig(kernel_preference=pref, out_dtype=dtype, scale_calculation_mode=mode)
            quantize_(model, config, filter_fn=lambda m, fqn: fqn in linears)
            for n in linears:
                if gemm_modules[n].bias is not None:
                    _bias_outside_mxfp8(gemm_modules[n])
        for n in experts:
            gemm_modules[n].gemm = functools.partial(mxfp8_grouped_gemm, kernel=kernel, scale_mode=scale_mode)
        summary.update(dict.fromkeys(linears | experts, f"mxfp8 {scale_mode} ({kernel})"))
        return summary
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if linears:
        config = Float8LinearConfig.from_recipe_name("rowwise")
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in linears)
    summary.update(dict.fromkeys(linears, "fp8 rowwise"))
    reason: dict[torch.device, str | None] = {}  # per device: why the FP8 grouped GEMM cannot run
    for n in sorted(experts):
        module = gemm_modules[n]
        device = module.w_gate.device
        if device not in reason:
            reason[device] = _fp8_grouped_gemm_runs(device)
        if reason[device] is None:
            module.gemm = fp8_rowwise_grouped_gemm
            summary[n] = "fp8 rowwise"
        else:
            summary[n] += " (fp8 grouped GEMM unavailable here)"
    for device, why_not in reason.items():
        if why_not is not None:
            log.warning(
                "fp8_rowwise: torchao's FP8 rowwise grouped GEMM does not run on %s (%s): the routed experts stay in %s",
                device,
                why_not,
                dtype,
            )
    return summary
