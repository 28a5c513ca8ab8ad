"""MXFP8 quantize throughput: kiln's quantizer against torchao's ``to_mx`` reference.

    .venv/bin/python bench/mxfp8.py            # CPU: quantize GB/s, ours vs torchao
    .venv/bin/python bench/mxfp8.py --gpu      # on a CUDA machine (see below)

CPU: both quantizers on the same 4096 x 4096 tensor (fp32 and bf16; RCEIL and FLOOR
scales), best of ``--repeat`` runs after a warm-up, GB/s of input read; the two results
are also checked to be bit-identical.

``--gpu`` (written for a lent H200/B200; needs CUDA torch and torchao): (1) quantize
GB/s of ours (eager and ``torch.compile``d), torchao's ``to_mx`` and torchao's Triton
``triton_to_mxfp8_dim0`` against the device's measured copy bandwidth (a
device-to-device clone of the same tensor; the last column counts the bytes each op
moves: bf16 in, 1 byte per element + 1 per 32 out); (2) one MoE layer of the
Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8, 16k tokens) forward +
backward, median of ``--repeat``: bf16, FP8 rowwise experts and MXFP8 experts (torchao's
``auto`` kernels on SM100+; on Hopper only the emulated path exists, reported as such,
its time being a correctness path, not a speed). Optional rows that a device cannot run
print ``n/a`` and the error instead of ending the script, so one lent run fills the
whole table.
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
            same = torch.equal(e.view(torch.uint8), re.view(torch.uint8)) and torch.equal(
                s.reshape(-1), rs.view(torch.uint8).reshape(-1)
            )
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {mode} | {gb / ours:.2f} | {gb / ref:.2f} | {ref / ours:.2f}x | {same} |")


def _optional(fn):
    """Run one optional measurement; a device that lacks the kernel yields its error."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a bench row, reported in the table
        return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"


def gpu(repeat: int) -> None:
    import statistics

    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    from kiln.learner.precision import apply_precision
    from kiln.shared.model.moe import MoEConfig, SparseMoE

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    cap = torch.cuda.get_device_capability()
    x = torch.randn(16384, 7168, device=dev, dtype=torch.bfloat16)
    gb = x.numel() * x.element_size() / 1e9
    moved = gb + x.numel() * (1 + 1 / 32) / 1e9  # bf16 read, E4M3 + E8M0 written
    copy = best(lambda: x.clone(), repeat, sync)
    copy_bw = 2 * gb / copy
    compiled = torch.compile(mx.quantize)

    def triton_dim0():
        from torchao.prototype.mx_formats.kernels import triton_to_mxfp8_dim0

        return best(lambda: triton_to_mxfp8_dim0(x, inner_block_size=32), repeat, sync)

    rows = {
        "kiln mx.quantize (rceil, eager)": best(lambda: mx.quantize(x, "rceil"), repeat, sync),
        "kiln mx.quantize (rceil, torch.compile)": _optional(lambda: best(lambda: compiled(x, "rceil"), repeat, sync)),
        "torchao to_mx (rceil, eager)": best(
            lambda: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL), repeat, sync
        ),
        "torchao triton_to_mxfp8_dim0 (rceil)": _optional(triton_dim0),
    }
    print(f"{torch.cuda.get_device_name()} (SM{cap[0]}{cap[1]}): quantize 16384 x 7168 bf16, best of {repeat}\n")
    print(f"device copy (clone): {copy_bw:,.0f} GB/s (read + write)\n")
    print("| op | input GB/s | bytes moved / copy bandwidth |\n|---|---|---|")
    for name, t in rows.items():
        if isinstance(t, str):
            print(f"| {name} | {t} | |")
        else:
            print(f"| {name} | {gb / t:,.0f} | {moved / t / copy_bw:.0%} |")

    cfg = MoEConfig(vocab_size=1, hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    tokens = torch.randn(16384, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    mx_kernel = "auto" if cap >= (10, 0) else "emulated"
    recipes = {
        "bf16": ("bf16", None),
        "fp8 rowwise experts": ("fp8_rowwise", None),
        f"mxfp8 experts ({mx_kernel})": ("mxfp8", mx_kernel),
    }
    print(
        "\n| MoE layer (2048 hidden, 128 x 768 experts, top-8, 16k tokens) | fwd + bwd ms (median) | precision |\n|---|---|---|"
    )
    for label, (recipe, kernel) in recipes.items():
        layer = SparseMoE(cfg).to(dev)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        layer.to(torch.bfloat16)
        summary = {"experts": "bf16"}
        if recipe != "bf16":
            summary = apply_precision(layer, recipe, kernel=kernel or "emulated", keep_high_precision=("gate",))

        def step():
            y, _ = layer(tokens)
            y.float().square().mean().backward()

        def timed():
            step()
            times = []
            for _ in range(repeat):
                sync()
                t = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - t)
            return f"{statistics.median(times) * 1e3:.2f}"

        print(f"| {label} | {_optional(timed)} | {summary['experts']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--n", type=int, default=4096)
    a = ap.parse_args()
    gpu(a.repeat) if a.gpu else cpu(a.repeat, a.n)


if __name__ == "__main__":
    main()
