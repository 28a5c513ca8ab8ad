"""Broadcasting policy versions to a fleet of engines with torch.distributed.

For GPU fleets inside one cluster: the weights service is rank 0 of a process group
whose other ranks are the rollout engines; a new version goes out as one collective
broadcast per tensor (NCCL on GPUs: device to device, no disk, no object store). The
same code runs over gloo on CPUs, which is how it is tested without a GPU.

Wire format, per version: a fixed-size int64 header length, the JSON header (version,
run id, and each tensor's name, dtype, shape), then every tensor in header order.
Invariant: a receiver returns a version only once every tensor of it has arrived, and
it checks each tensor's sha256 against the header, so a torn or mixed-up transfer is an
error, never a served version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)}


@dataclass
class BroadcastSettings:
    init_method: str
    """Rendezvous, e.g. ``tcp://10.0.0.5:29600`` (rank 0's address)."""
    world_size: int
    """1 sender + the number of receiving engines."""
    rank: int
    backend: str = "nccl"
    """``nccl`` (GPUs) or ``gloo`` (CPUs)."""
    timeout_s: float = 600.0
    verify: bool = True
    """Check each tensor's sha256 (it costs a copy to host memory on GPUs)."""


class BroadcastGroup:
    def __init__(self, s: BroadcastSettings):
        from datetime import timedelta

        self.s = s
        self.device = torch.device("cuda", torch.cuda.current_device()) if s.backend == "nccl" else torch.device("cpu")
        dist.init_process_group(
            s.backend, init_method=s.init_method, world_size=s.world_size, rank=s.rank, timeout=timedelta(seconds=s.timeout_s)
        )

    def close(self) -> None:
        dist.destroy_process_group()

    def _header(self, header: dict | None) -> dict:
        if header is not None:
            body = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(self.device)
            size = torch.tensor([body.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        if header is None:
            body = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(body, src=0)
        return header if header is not None else json.loads(bytes(body.cpu().numpy()))

    def send(self, run_id: str, version: int, tensors: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast one version; returns the bytes sent."""
        names = sorted(tensors)
        header = {
            "run_id": run_id,
            "version": version,
            "tensors": [
                [n, str(tensors[n].dtype).removeprefix("torch."), list(tensors[n].shape), _sha(tensors[n]) if self.s.verify else ""]
                for n in names
            ],
        }
        self._header(header)
        sent = 0
        for n in names:
            t = tensors[n].to(self.device).contiguous()
            dist.broadcast(t, src=0)
            sent += t.numel() * t.element_size()
        return sent

    def receive(self) -> tuple[str, int, dict[str, torch.Tensor]]:
        """Other ranks: block until the next version has arrived whole; tensors on CPU."""
        header = self._header(None)
        out = {}
        for name, dtype, shape, digest in header["tensors"]:
            t = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
            dist.broadcast(t, src=0)
            t = t.cpu()
            if self.s.verify and _sha(t) != digest:
                raise ValueError(f"tensor {name} of version {header['version']} arrived corrupted")
            out[name] = t
        return header["run_id"], header["version"], out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
