"""OCP Microscaling (MX) FP8 quantization: MXFP8 E4M3 with E8M0 block scales.

Blocks of 32 consecutive elements along the last dimension share one scale ``2^s``
stored as E8M0 (``s + 127`` in a uint8; 255 is NaN); each element is stored as
float8_e4m3fn, saturating at +-448 (OCP MX v1.0, section 6.3). The scale modes are
torchao's ``ScaleCalculationMode`` (``torchao.prototype.mx_formats.config``); ``amax`` is
the block's absolute maximum:

- ``rceil`` (torchao's training recipe, cuBLAS / Blackwell hardware):
  ``s = ceil(log2(amax / 448))``, so no element overflows; elements are ``x * 2^-s``; a
  zero block gets ``s = -127`` and is stored unscaled, an infinite ``amax`` gets 254, a
  NaN one 255;
- ``floor`` (the OCP spec's reference): ``s = floor(log2(amax)) - 8`` (8 = the exponent
  of E4M3's largest power of two), elements ``x / 2^s`` clamped to +-448, so the top
  of a block may saturate;
- ``ceil``: ``floor`` with ``log2(amax)`` rounded up (never saturates);
- ``even``: ``floor`` of ``amax`` first rounded to E4M3's 3 mantissa bits.

In the floor-family modes an infinite ``amax`` gives ``s = 120`` (its elements become
+-448 or NaN, as torchao's do) and a NaN ``amax`` the NaN scale 255.

Invariants: the result is torchao's ``to_mx(x, float8_e4m3fn, 32, mode)`` bit for bit
(scales and element bytes) for float32 and bfloat16 inputs, NaN, infinity, zeros and
subnormals included (``tests/test_mxfp8.py``); the exponent arithmetic is done on the
float32 bit patterns (integer ops, no ``log2``), so it is exact and device-independent.
Consumers: the FP8 payloads of expert-parallel all-to-all (``pack`` makes one uint8
buffer a collective moves on any backend; ``dequantize`` takes the elements as
float8_e4m3fn or as their uint8 view) and ``bench/mxfp8.py``.
"""

from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8
E8M0_NAN = 255
MODES = ("rceil", "floor", "ceil", "even")


def quantize(x: torch.Tensor, mode: str = "rceil", block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn, the shape of ``x``; scales uint8 E8M0, ``x.shape[:-1] +
    (n_blocks,)``). ``elements.view(torch.uint8)`` is the byte view for collectives."""
    if mode not in MODES:
        raise ValueError(f"unknown MX scale mode {mode!r}; expected one of {MODES}")
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block}")
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // block, block)
    amax = blocks.abs().amax(-1, keepdim=True).float()  # NaN-propagating, like the spec's max
    data = blocks.float()
    if mode == "rceil":
        e, scaled = _rceil(data, amax)
    else:
        e, scaled = _floor_family(data, amax, mode)
    elements = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(shape)
    return elements, e.to(torch.uint8).squeeze(-1)


def _rceil(data: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    descale = amax / E4M3_MAX
    bits = descale.view(torch.int32)
    field = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # ceil(log2 d) from the bit pattern: the exponent, plus one if any mantissa bit is
    # set; for subnormal d the result is below -126, i.e. -127 after the clamp, except
    # d in (2^-127, 2^-126), which rounds up to -126.
    ceil_log2 = torch.where(field > 0, field - 127 + (mant > 0).int(), torch.where(mant > (1 << 22), -126, -127))
    e = (ceil_log2.clamp(-127, 127) + 127).to(torch.int32)
    e = torch.where(field == 255, torch.where(mant == 0, 254, E8M0_NAN), e).to(torch.int32)  # inf 254, NaN 255
    # The reciprocal scale 2^(127 - e) as a float32 bit pattern; e = 0 (a zero or
    # vanishing block) is stored unscaled, and an infinite amax scales by 2^-127 (the
    # subnormal 0x00400000), which is what torchao's RCEIL path computes.
    rcp = ((254 - e).clamp(min=1) << 23).view(torch.float32)
    rcp = torch.where(e == 0, 1.0, torch.where(e == 254, (torch.ones_like(e) << 22).view(torch.float32), rcp))
    return e, data * torch.where(e == E8M0_NAN, descale, rcp)  # a NaN block stays NaN


def _floor_family(data: torch.Tensor, amax: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    bits = amax.view(torch.int32)
    if mode == "even":
        # Round amax to E4M3's 3 mantissa bits (half up on the bit pattern), then floor.
        bits = (bits + (1 << (23 - 3 - 1))) & -(1 << 23)  # keep sign and exponent
    field = (bits >> 23) & 0xFF
    if mode == "ceil":
        field = field + ((bits & 0x7FFFFF) > 0).int()
    s = (field - 127 - E4M3_MAX_POW2).clamp(-127, 128)
    e = torch.where(torch.isnan(amax), E8M0_NAN, s + 127).to(torch.int32)  # (where() widens to int64)
    # The scale 2^s as a float32 bit pattern, never below the smallest normal float
    # (torchao's choice, so that a zero block divides by a normal number).
    scale = (e << 23).view(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    return e, data / scale


def dequantize(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK):
    """Inverse of ``quantize`` up to the FP8 rounding; ``elements`` may be the uint8 view.
    The E8M0 NaN scale (255) gives NaN for the whole block."""
    if elements.dtype == torch.uint8:
        elements = elements.view(torch.float8_e4m3fn)
    shape = elements.shape
    e = scales.to(torch.int32).unsqueeze(-1)
    scale = torch.where(e == E8M0_NAN, torch.nan, torch.exp2(e.float() - 127))
    blocks = elements.reshape(*shape[:-1], shape[-1] // block, block).float() * scale
    return blocks.reshape(shape).to(dtype)


def pack(elements: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One (rows, K + K/32) uint8 buffer: each row's elements then its scales, for
    collectives on backends without FP8 types (gloo)."""
    rows = elements.reshape(-1, elements.shape[-1]).view(torch.uint8)
    return torch.cat((rows, scales.reshape(rows.shape[0], -1)), dim=1)


def unpack(buf: torch.Tensor, k: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: (elements float8_e4m3fn (rows, k), scales uint8 (rows, k/32))."""
    return buf[:, :k].contiguous().view(torch.float8_e4m3fn), buf[:, k : k + k // block].contiguous()
