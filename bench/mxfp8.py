"""MXFP8 quantize throughput: kiln's quantizer against torchao's ``to_mx`` reference.

    .venv/bin/python bench/mxfp8.py            # CPU: quantize GB/s, ours vs torchao
    .venv/bin/python bench/mxfp8.py --gpu      # on a CUDA machine (see below)

CPU: both quantizers on the same 4096 x 4096 tensor (fp32 and bf16; RCEIL and FLOOR
scales), best of ``--repeat`` runs after a warm-up, GB/s of input read; the two results
are also checked to be bit-identical.

``--gpu`` (written for a lent H200/B200; needs CUDA torch and torchao): (1) quantize
GB/s of ours, torchao's ``to_mx`` and (SM100+) torchao's Triton kernel against the
device's measured copy bandwidth (a device-to-device clone of the same tensor); (2) one
MoE layer of the Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8, 16k
tokens) forward + backward in bf16 against MXFP8 (``kiln.learner.precision``, kernel
``auto``), median step time. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import time

import torch

from kiln.learner import mx


def best(fn, repeat: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def cpu(repeat: int, n: int) -> None:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"CPU, {n} x {n}, {torch.get_num_threads()} threads, best of {repeat}\n")
    print("| input | scale mode | kiln `mx.quantize` GB/s | torchao `to_mx` GB/s | kiln / torchao | bit-identical |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype)
        gb = x.numel() * x.element_size() / 1e9
        for mode, ao_mode in (("rceil", ScaleCalculationMode.RCEIL), ("floor", ScaleCalculationMode.FLOOR)):
            ours = best(lambda: mx.quantize(x, mode), repeat)
            ref = best(lambda: to_mx(x, torch.float8_e4m3fn, 32, ao_mode), repeat)
            e, s = mx.quantize(x, mode)
            rs, re = to_mx(x, torch.float8_e4m3fn, 32, ao_mode)
            same = torch.equal(e.view(torch.uint8), re.view(torch.uint8)) and torch.equal(s.reshape(-1), rs.view(torch.uint8).reshape(-1))
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {mode} | {gb / ours:.2f} | {gb / ref:.2f} | {ref / ours:.2f}x | {same} |")


def gpu(repeat: int) -> None:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    from kiln.learner.precision import apply_precision
    from kiln.shared.model.moe import MoEConfig, SparseMoE

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    x = torch.randn(16384, 7168, device=dev, dtype=torch.bfloat16)
    gb = x.numel() * x.element_size() / 1e9
    copy = best(lambda: x.clone(), repeat, sync)
    rows = [("device copy (read + write)", 2 * gb / copy)]
    rows.append(("kiln mx.quantize (rceil)", gb / best(lambda: mx.quantize(x, "rceil"), repeat, sync)))
    rows.append(("torchao to_mx (rceil)", gb / best(lambda: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL), repeat, sync)))
    if torch.cuda.get_device_capability() >= (10, 0):
        from torchao.prototype.mx_formats.kernels import triton_to_mxfp8_dim0

        rows.append(("torchao triton_to_mxfp8_dim0", gb / best(lambda: triton_to_mxfp8_dim0(x, inner_block_size=32), repeat, sync)))
    print(f"{torch.cuda.get_device_name()}: quantize 16384 x 7168 bf16\n\n| op | GB/s |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:,.0f} |")

    cfg = MoEConfig(vocab_size=1, hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    tokens = torch.randn(16384, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    print("\n| MoE layer (2048 hidden, 128 x 768 experts, top-8, 16k tokens) | fwd + bwd ms |\n|---|---|")
    for recipe in ("bf16", "mxfp8"):
        layer = SparseMoE(cfg).to(dev)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        layer.to(torch.bfloat16)
        if recipe == "mxfp8":
            apply_precision(layer, "mxfp8", kernel="auto", keep_high_precision=("gate",))

        def step():
            y, _ = layer(tokens)
            y.float().square().mean().backward()

        t = best(step, repeat, sync)
        print(f"| {recipe} | {t * 1e3:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--n", type=int, default=4096)
    a = ap.parse_args()
    gpu(a.repeat) if a.gpu else cpu(a.repeat, a.n)


if __name__ == "__main__":
    main()
