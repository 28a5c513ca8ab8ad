"""The ``torch-broadcast`` transport: policy versions to a fleet of in-process engines
with torch.distributed.

For GPU fleets inside one cluster: the weights service is rank 0 of a process group
whose other ranks are the rollout engines; a new version goes out as one collective
broadcast per tensor (NCCL on GPUs: device to device, no disk, no object store). The
same code runs over gloo on CPUs, which is how it is tested without a GPU.

Wire format, per version: a fixed-size int64 header length, the JSON header (version,
run id, and each tensor's name, dtype, shape), then every tensor in header order.
Invariant: a receiver returns a version only once every tensor of it has arrived, and
it checks each tensor's sha256 against the header, so a torn or mixed-up transfer is an
error, never a served version.

``TorchBroadcastSender`` (weights service) sends every version once the group formed
(receivers read a header per version, so none is skipped); ``TorchBroadcastFeed``
(engine worker) receives in a thread, loads the tensors with ``load_state``, and reads a
version's files when its tensors have not come ``fallback_s`` after the event.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.shared.contracts import WeightsManifest, WeightsPublished
from kiln.shared.weights.transport.base import WeightFeed, WeightSender, folder_tensors
from kiln.shared.weights.transport.config import TorchBroadcastTransport

log = logging.getLogger("kiln.weights.broadcast")

_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)
}


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
            s.backend,
            init_method=s.init_method,
            world_size=s.world_size,
            rank=s.rank,
            timeout=timedelta(seconds=s.timeout_s),
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
                [
                    n,
                    str(tensors[n].dtype).removeprefix("torch."),
                    list(tensors[n].shape),
                    _sha(tensors[n]) if self.s.verify else "",
                ]
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


class TorchBroadcastSender(WeightSender):
    """Rank 0 of the engines' group (needs torch: ``kiln-weights[broadcast]``). The group
    forms in the background, so the service serves before every engine joined."""

    def __init__(self, t: TorchBroadcastTransport):
        self.world_size = t.world_size
        settings = BroadcastSettings(t.init_method, t.world_size, 0, t.backend)
        self.group = asyncio.ensure_future(asyncio.to_thread(BroadcastGroup, settings))
        self.lock = asyncio.Lock()

    def will_send(self) -> bool:
        return True

    async def send(self, run_id: str, version: int, folder: Path, manifest: WeightsManifest) -> None:
        group = await self.group
        async with self.lock:
            tensors = await folder_tensors(folder, manifest)
            sent = await asyncio.to_thread(group.send, run_id, version, tensors)
        log.info("broadcast version %d to %d engines (%d bytes)", version, self.world_size - 1, sent)


class TorchBroadcastFeed(WeightFeed):
    def __init__(self, *a, transport: TorchBroadcastTransport, **kw):
        super().__init__(*a, **kw)
        self.t = transport
        self._fallbacks: set[asyncio.Task] = set()

    async def start(self, stop: asyncio.Event) -> None:
        """Join the weights service's group; a thread, since the collectives block."""
        loop = asyncio.get_running_loop()
        t = self.t

        def run() -> None:
            group = BroadcastGroup(BroadcastSettings(t.init_method, t.world_size, t.rank, t.backend))
            while not stop.is_set():
                try:
                    run_id, version, tensors = group.receive()
                except Exception as e:  # the sender went away: the run is over or being restarted
                    log.warning("weights broadcast stopped: %s", e)
                    return
                if run_id == self.run_id:
                    asyncio.run_coroutine_threadsafe(self.on_tensors(version, tensors), loop).result()

        threading.Thread(target=run, name="weights-broadcast", daemon=True).start()

    async def _deliver(self, msg: WeightsPublished) -> None:
        if self.tokenizer is not None and msg.broadcast:
            # After the first version (config, tokenizer) tensors arrive by broadcast; the
            # files are the fallback if they have not come in time.
            task = asyncio.create_task(self._fallback(msg))
            self._fallbacks.add(task)
            task.add_done_callback(self._fallbacks.discard)
            return
        await self._load_files(msg)

    async def _fallback(self, msg: WeightsPublished) -> None:
        await asyncio.sleep(self.t.fallback_s)
        if msg.version > self.version:
            log.warning("version %d did not arrive by broadcast; reading its files", msg.version)
            await self._load_files(msg)

    async def on_tensors(self, version: int, tensors: dict) -> None:
        """A version received over the group (its tensors' sha256 already checked)."""
        async with self._loading:
            if self.tokenizer is None or version <= self.version:
                return  # the first version comes as files (it carries config and tokenizer)
            with self._span(version):
                await self.engine.load_state(version, tensors)
            self.on_served(version, "broadcast")
            log.info("serving policy version %d (broadcast)", version)
        await self._notify()
