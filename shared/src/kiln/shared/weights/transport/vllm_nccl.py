"""The ``vllm-nccl`` transport: policy versions straight into vLLM engines over NCCL
(``weights.transport.kind = "vllm-nccl"``), through vLLM's weight-transfer engine API.

The weights service is rank 0 of an NCCL group whose other ranks are the engines' vLLM
workers (joined with ``AsyncLLM.init_weight_transfer_engine``); a version goes out as
vLLM's packed broadcast, and each engine loads it with ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` between ``pause_generation(mode="keep")``
and ``resume_generation``: no disk, no host copy, in-flight requests continue under the
new weights.

Invariants:

- sender and receivers agree on the tensors and their order because both derive them
  from the version's manifest (``update_info``): sorted names, the stored dtype and
  shape; a receiver never guesses;
- the weights service broadcasts a version only when its group had formed before it
  published that version, and says so in ``WeightsPublished.broadcast``: an engine posts
  its receive exactly for those versions and fetches files for the others (so an engine
  and the sender can never wait on each other's different collectives);
- the first version always comes as files (it starts the engine with config and
  tokenizer); the engine joins the group after that.

This path needs CUDA on both sides (vLLM's ``PyNcclCommunicator``); it is exercised by
``tests/test_vllm_transfer.py`` where two GPUs are lent and skipped otherwise. The
torch.distributed path (``torch_broadcast.py``) is the one tested on CPUs.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from kiln.shared.contracts import WeightsManifest, WeightsPublished
from kiln.shared.weights.transport.base import InPlaceTransferEngine, WeightFeed, WeightSender, folder_tensors
from kiln.shared.weights.transport.config import VllmNcclTransport, rendezvous

log = logging.getLogger("kiln.weights.vllm")

# safetensors dtype tags -> torch attribute names (what vLLM's update info carries)
_TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def update_info(manifest: WeightsManifest) -> dict:
    """The per-version payload of ``AsyncLLM.update_weights`` (vLLM's NCCL update info),
    in the order the sender broadcasts: tensor names sorted."""
    names = sorted(manifest.tensors)
    unknown = sorted({manifest.tensors[n].dtype for n in names} - set(_TORCH_DTYPES))
    if unknown:
        raise ValueError(f"version {manifest.version} has dtypes vLLM's transfer cannot carry: {unknown}")
    return {
        "names": names,
        "dtype_names": [_TORCH_DTYPES[manifest.tensors[n].dtype] for n in names],
        "shapes": [list(manifest.tensors[n].shape) for n in names],
    }


def worker_init_info(init_method: str, rank: int, world_size: int) -> dict:
    """The payload of ``AsyncLLM.init_weight_transfer_engine`` for the engine at ``rank``
    (its vLLM worker ranks start there; one worker per engine at tensor parallel 1)."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    host, port = rendezvous(init_method)
    return worker_init_payload(
        NCCLWeightTransferInitInfo(
            master_address=host, master_port=port, rank_offset=rank, world_size=world_size, packed=True
        )
    )


class VllmTransferSender:
    """Rank 0 of the group (the weights service, on a GPU). Construction blocks until
    every engine has joined: run it in a thread."""

    def __init__(self, init_method: str, world_size: int):
        import torch
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        host, port = rendezvous(init_method)
        self.world_size = world_size
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = stateless_init_process_group(host, port, 0, world_size, self.device)

    def send(self, manifest: WeightsManifest, tensors: dict) -> int:
        """Broadcast one version's tensors (in ``update_info`` order); returns the bytes sent."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        names = update_info(manifest)["names"]
        if set(names) != set(tensors):
            raise ValueError(f"version {manifest.version}: the files' tensors do not match its manifest")
        sent = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
        packed_nccl_broadcast_producer(
            iterator=((n, tensors[n].to(self.device, non_blocking=True)) for n in names),
            group=self.group,
            src=0,
            post_iter_func=lambda item: item[1],
        )
        return sent


class VllmNcclSender(WeightSender):
    """The weights service's end: the group forms in the background (every engine joins
    after its first version), and only versions announced after that are sent."""

    def __init__(self, t: VllmNcclTransport):
        self.world_size = t.world_size
        self.group = asyncio.ensure_future(asyncio.to_thread(VllmTransferSender, t.init_method, t.world_size))
        self.lock = asyncio.Lock()

    def will_send(self) -> bool:
        """Receivers post a receive per marked version, so only once every engine has
        joined (a group that failed to form never sends)."""
        return self.group.done() and self.group.exception() is None

    async def send(self, run_id: str, version: int, folder: Path, manifest: WeightsManifest) -> None:
        group = await self.group
        async with self.lock:
            tensors = await folder_tensors(folder, manifest)
            sent = await asyncio.to_thread(group.send, manifest, tensors)
        log.info("broadcast version %d to %d engines (%d bytes)", version, self.world_size - 1, sent)


class VllmNcclFeed(WeightFeed):
    engine: InPlaceTransferEngine

    def __init__(self, *a, transport: VllmNcclTransport, **kw):
        super().__init__(*a, **kw)
        if not isinstance(self.engine, InPlaceTransferEngine):
            raise TypeError(f"{type(self.engine).__name__} does not accept in-place transfers (vllm-nccl)")
        self.t = transport
        self._joined: asyncio.Task | None = None
        """Joining the weights service's NCCL group (started after the first version)."""

    def _first_folder_loaded(self) -> None:
        """After the first version (the engine runs), join the sender's group in the
        background; until every engine has joined, versions come as files."""
        info = worker_init_info(self.t.init_method, self.t.rank, self.t.world_size)
        self._joined = asyncio.create_task(self.engine.join_transfer(info))

    async def _deliver(self, msg: WeightsPublished) -> None:
        if self._joined is not None and msg.broadcast:
            await self._receive(msg)
        else:
            await self._load_files(msg)

    async def _receive(self, msg: WeightsPublished) -> None:
        try:
            # The sender's group formed with us in it, so our join is returning; one that
            # does not (a restarted engine cannot join a group that formed without it) reads files.
            await asyncio.wait_for(asyncio.shield(self._joined), self.t.fallback_s)
        except TimeoutError:
            log.warning("not in the weights service's NCCL group; reading version %d from its files", msg.version)
            await self._load_files(msg)
            return
        async with self._loading:
            with self._span(msg.version):
                await self.engine.receive_transfer(msg.version, update_info(msg.manifest))
            self.on_served(msg.version, "vllm-nccl")
            log.info("serving policy version %d (vllm-nccl)", msg.version)
        await self._notify()
