"""OCP Microscaling (MX) FP8 quantization: MXFP8 E4M3 with E8M0 block scales.

Blocks of 32 consecutive elements along the last dimension share one scale ``2^s``
stored as E8M0 (``s + 127`` in a uint8; 255 is NaN); each element is stored as
float8_e4m3fn (saturating at +-448). Two ways to choose ``s`` from the block's absolute
maximum ``amax``, as torchao's ``ScaleCalculationMode`` names them:

- ``rceil`` (cuBLAS / Blackwell hardware): ``s = ceil(log2(amax / 448))``, so no
  element overflows; the elements are ``x * 2^-s``; a zero block gets ``s = -127`` and
  is stored unscaled, an infinite ``amax`` gets 254, a NaN one 255;
- ``floor`` (the OCP spec's reference): ``s = floor(log2(amax)) - 8`` (8 = the largest
  power of two of E4M3), elements ``x / 2^s`` clamped to +-448.

The exponent arithmetic is done on the float32 bit patterns (integer ops), not with
``log2``; ``tests/test_mxfp8.py`` holds it to torchao's ``to_mx`` bit for bit, NaN and
infinity included. Used for the FP8 payloads of expert-parallel all-to-all (``pack``
gives one uint8 buffer the collective can move on any backend) and benchmarked against
torchao's quantizer in ``bench/mxfp8.py``.
"""

from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
_MODES = ("rceil", "floor")


def quantize(x: torch.Tensor, mode: str = "rceil", block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn, shape of ``x``; scales uint8 E8M0, shape[:-1] + (n_blocks,))."""
    if mode not in _MODES:
        raise ValueError(f"unknown MX scale mode {mode!r}; expected one of {_MODES}")
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block}")
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // block, block)
    amax = blocks.abs().amax(-1, keepdim=True).float()  # NaN-propagating, like the spec's max
    data = blocks.float()
    if mode == "rceil":
        descale = amax / E4M3_MAX
        bits = descale.view(torch.int32)
        field = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        # ceil(log2 d) from the bit pattern: the exponent, plus one if any mantissa bit is
        # set; for subnormal d the result is below -126, i.e. -127 after the clamp, except
        # d in (2^-127, 2^-126) which rounds up to -126.
        ceil_log2 = torch.where(field > 0, field - 127 + (mant > 0).int(), torch.where(mant > (1 << 22), -126, -127))
        e = (ceil_log2.clamp(-127, 127) + 127).to(torch.int32)
        e = torch.where(field == 255, torch.where(mant == 0, 254, 255), e).to(torch.int32)  # inf 254, NaN 255
        # Reciprocal scale 2^(127 - e) built as a float32 bit pattern; e = 0 is stored
        # unscaled and an infinite amax scales by 2^-127 (the subnormal 0x00400000).
        rcp = ((254 - e).clamp(min=1) << 23).view(torch.float32)
        rcp = torch.where(e == 0, 1.0, torch.where(e == 254, (torch.ones_like(e) << 22).view(torch.float32), rcp))
        scaled = data * torch.where(e == 255, descale, rcp)  # a NaN block stays NaN
    else:
        field = (amax.view(torch.int32) >> 23) & 0xFF
        s = (field - 127 - 8).clamp(-127, 128)
        e = torch.where(torch.isnan(amax), 255, s + 127).to(torch.int32)  # (where() widens to int64)
        # The scale 2^s as a float32 bit pattern, never below the smallest normal float.
        scale = (e << 23).view(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
        scaled = data / scale
    elements = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(shape)
    return elements, e.to(torch.uint8).squeeze(-1)


def dequantize(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK):
    """Inverse of ``quantize`` (up to the FP8 rounding)."""
    shape = elements.shape
    e = scales.to(torch.int32).unsqueeze(-1)
    scale = torch.where(e == 255, torch.nan, torch.exp2(e.float() - 127))
    blocks = elements.reshape(*shape[:-1], shape[-1] // block, block).float() * scale
    return blocks.reshape(shape).to(dtype)


def pack(elements: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One (rows, K + K/32) uint8 buffer per row: elements then scales, for collectives
    on backends without FP8 types (gloo)."""
    rows = elements.reshape(-1, elements.shape[-1]).view(torch.uint8)
    return torch.cat((rows, scales.reshape(rows.shape[0], -1)), dim=1)


def unpack(buf: torch.Tensor, k: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[:, :k].contiguous().view(torch.float8_e4m3fn), buf[:, k : k + k // block].contiguous()
