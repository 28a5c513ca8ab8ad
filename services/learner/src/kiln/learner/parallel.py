"""Expert parallelism and FSDP2 for the MoE policy on a ``(dp_shard, ep)`` DeviceMesh.

World = ``dp_shard * ep`` ranks, every rank trains on its own slice of the batch.
Experts are split over ``ep``: rank ``(d, e)`` owns experts ``[e*E/ep, (e+1)*E/ep)``
and receives, through an all-to-all, every token of its ``ep`` group routed to them
(uneven splits: the per-expert counts are exchanged first), then sends the outputs
back with a second all-to-all. Expert weights are FSDP2-sharded over ``dp_shard``
(a size-1 mesh when ``dp_shard = 1`` keeps them out of the dense sharding); every other
parameter is FSDP2-sharded over all ranks. gloo on CPU, NCCL on GPU.

Invariants:
- the result of a step equals the single-process step on the whole batch up to float
  summation order: each rank's loss is its tokens' share of the global token-level mean
  (normalised by the global token count) times the world size, because FSDP averages
  gradients over its mesh (gloo has no pre-multiplied sum to make it add); expert
  gradients, already summed over the ``ep`` group by the all-to-all's backward and
  averaged over ``dp_shard``, are divided by ``ep``; the load-balancing loss is built
  from router statistics all-reduced over the world (and counted once); the gradient
  norm for clipping is the norm over every shard of every rank;
- every tensor a collective moves lives on the training device (where the parameter
  shards live): NCCL refuses CPU tensors, so a statistic built by a bare
  ``torch.tensor(...)`` would crash the first GPU step. ``tests/test_parallel.py`` runs
  a step with the default device set to ``meta`` and collectives that refuse tensors off
  the training device, as NCCL does;
- ``full_state_dict`` returns the same names and full tensors as the unsharded model on
  every rank, so checkpoint staging and comparisons see one model.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.distributed.nn.functional import all_to_all_single as differentiable_all_to_all
from torch.distributed.tensor import DTensor

from kiln.learner.grpo import LossConfig, policy_loss
from kiln.shared.model import sequence_logprobs
from kiln.shared.model.moe import balancing_loss


@dataclass(frozen=True)
class ParallelDims:
    dp_shard: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_shard * self.ep


@dataclass
class Meshes:
    dims: ParallelDims
    mesh: DeviceMesh
    """The 2-D ``(dp_shard, ep)`` mesh."""
    world: DeviceMesh
    """All ranks, 1-D: the dense parameters' FSDP mesh."""

    @property
    def ep_group(self):
        return self.mesh.get_group("ep")


def init_distributed(dims: ParallelDims) -> Meshes:
    """Join the process group torchrun (or the Ray launcher) set up and build the meshes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if dist.get_world_size() != dims.world:
        raise ValueError(f"world size {dist.get_world_size()} != dp_shard {dims.dp_shard} x ep {dims.ep}")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device, (dims.dp_shard, dims.ep), mesh_dim_names=("dp_shard", "ep"))
    world = init_device_mesh(device, (dims.world,), mesh_dim_names=("world",))
    return Meshes(dims, mesh, world)


class _MXFP8Dispatch(torch.autograd.Function):
    """All-to-all of activations as MXFP8 (E4M3 elements + E8M0 scales packed in one
    uint8 buffer: every backend moves bytes); the gradient travels back in the
    activations' own precision (straight through the quantizer)."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):
        from kiln.learner import mx

        ctx.splits, ctx.group, ctx.k = (recv_splits, send_splits), group, x.shape[1]
        buf = mx.pack(*mx.quantize(x.contiguous()))
        out = buf.new_empty((sum(recv_splits), buf.shape[1]))
        dist.all_to_all_single(out, buf, recv_splits, send_splits, group=group)
        return mx.dequantize(*mx.unpack(out, ctx.k), dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), ctx.k))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


class ExpertParallel(nn.Module):
    """This rank's slice of a grouped-experts module, fed by all-to-all.

    ``forward(x, counts)`` has the signature of the wrapped module: ``x`` holds this
    rank's tokens sorted by global expert, ``counts`` how many go to each global expert.
    ``dispatch = "mxfp8"`` sends the tokens to the experts as MXFP8 (a quarter of fp32's
    bytes; the combine and all gradients stay in the activations' precision).
    """

    def __init__(self, experts: nn.Module, num_experts: int, ep_rank: int, ep_size: int, group, dispatch: str = "hp"):
        super().__init__()
        if dispatch not in ("hp", "mxfp8"):
            raise ValueError(f"unknown dispatch {dispatch!r}; expected hp or mxfp8")
        self.dispatch = dispatch
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over ep={ep_size}")
        self.num_experts, self.ep_size, self.group = num_experts, ep_size, group
        self.local_experts = num_experts // ep_size
        lo, hi = ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts
        local = copy.deepcopy(experts)  # same code and hooks (e.g. an MXFP8 gemm), own parameters
        for name, p in experts.named_parameters(recurse=False):
            if p.shape[0] != num_experts:
                raise ValueError(f"expert parameter {name} {tuple(p.shape)} is not stacked by expert")
            setattr(local, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
        self.local = local
        self.first_expert = lo

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        dev = x.device
        counts = torch.as_tensor(counts, dtype=torch.long, device=dev).reshape(self.ep_size, self.local_experts)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv.view(-1), counts.reshape(-1).contiguous(), group=self.group)
        send_splits, recv_splits = counts.sum(1).tolist(), recv.sum(1).tolist()
        if self.dispatch == "mxfp8":
            got = _MXFP8Dispatch.apply(x, recv_splits, send_splits, self.group)
        else:
            got = differentiable_all_to_all(
                x.new_empty((sum(recv_splits), x.shape[1])), x.contiguous(), recv_splits, send_splits, group=self.group
            )
        # ``got`` is ordered (source rank, local expert); the experts want expert-major.
        seg = recv.reshape(-1)
        starts = torch.cumsum(seg, 0) - seg
        order = torch.arange(self.ep_size * self.local_experts, device="cpu")  # host-side bookkeeping
        order = order.view(self.ep_size, self.local_experts).T.reshape(-1)
        spans = [torch.arange(int(starts[j]), int(starts[j] + seg[j]), device=dev) for j in order.tolist()]
        gather = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long, device=dev)
        out = self.local(got[gather], recv.sum(0))
        back = torch.zeros_like(out).index_copy(0, gather, out)
        return differentiable_all_to_all(
            x.new_empty((sum(send_splits), out.shape[1])), back, send_splits, recv_splits, group=self.group
        )


def _moe_blocks(model: nn.Module):
    for layer in model.layers:
        yield layer, layer.mlp


def shard_experts(model: nn.Module, meshes: Meshes, dispatch: str = "hp") -> None:
    """Replace every MoE layer's experts by this rank's ``ExpertParallel`` slice."""
    ep_rank = meshes.mesh.get_local_rank("ep")
    for _, moe in _moe_blocks(model):
        moe.experts = ExpertParallel(
            moe.experts, model.config.num_experts, ep_rank, meshes.dims.ep, meshes.ep_group, dispatch=dispatch
        )


def apply_fsdp(model: nn.Module, meshes: Meshes, reshard_after_forward: bool = True) -> None:
    """FSDP2: experts over ``dp_shard``, each decoder layer and the root over all ranks."""
    dp = meshes.mesh["dp_shard"]
    for layer, moe in _moe_blocks(model):
        fully_shard(moe.experts, mesh=dp, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, mesh=meshes.world, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=meshes.world, reshard_after_forward=reshard_after_forward)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".experts.local." in n]


def parallelize(model: nn.Module, meshes: Meshes, dispatch: str = "hp") -> nn.Module:
    shard_experts(model, meshes, dispatch)
    apply_fsdp(model, meshes)
    return model


def global_load_balancing_loss(
    model: nn.Module, router_logits: list[torch.Tensor], token_mask: torch.Tensor
) -> torch.Tensor:
    """The model's Switch load-balancing loss over the whole world's tokens, divided by
    the world size (every rank adds it, the gradient sum counts it once)."""
    frac, prob, n = model.routing_sums(router_logits, token_mask)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(frac)  # selections carry no gradient
        dist.all_reduce(n)
        prob = differentiable_all_reduce(prob)
    return balancing_loss(model.config.num_experts, frac, prob, n) / world


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def training_device(model: nn.Module) -> torch.device:
    """Where this rank's parameter shards live: every collective's tensors go there."""
    return _local(next(model.parameters())).device


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global L2 norm over every rank's shards (params live on two meshes)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=_local(params[0]).device)  # every rank reduces, grads or not
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sq)
    norm = sq.sqrt().to(torch.float32)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters under the plain model's names (collective: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if ".experts.local." in name:
            moe_experts = name.split(".local.")[0]
            group = dict(model.named_modules())[moe_experts].group
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts)
            name = name.replace(".experts.local.", ".experts.")
        out[name] = t.detach().clone()
    return out


def policy_gradient_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    shard: dict[str, torch.Tensor],
    *,
    global_tokens: float,
    loss: LossConfig,
    temperature: float,
    max_grad_norm: float,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    micro_batch: int = 0,
) -> dict[str, float]:
    """One optimizer step on this rank's ``shard`` (ids, attn, mask, behaviour, adv: the
    tensors ``Policy.train_step`` builds) with the ``loss`` variant, normalised by the
    batch's ``global_tokens``; single-process when no process group exists. Returns the
    batch's statistics (summed over ranks), the same on every rank.

    ``micro_batch`` > 0 runs the forward and backward ``micro_batch`` rows at a time and
    accumulates the gradients before the one optimizer step: the policy loss is exactly
    the same token-level mean (each chunk weighted by its share of the batch's tokens);
    the load-balancing loss is computed per chunk and averaged by rows (its f x P
    product over a chunk rather than the whole batch: 0.4% apart in ``test_grpo``)."""
    model.train()
    rows = shard["ids"].shape[0]
    size = micro_batch if 0 < micro_batch < rows else rows
    world = dist.get_world_size() if dist.is_initialized() else 1
    optimizer.zero_grad(set_to_none=True)
    pg_total, aux_total = 0.0, 0.0
    acc = dict.fromkeys(("tokens", "ratio_mean", "clip_frac", "kl", "tis_capped_frac", "seq_masked_frac"), 0.0)
    for lo in range(0, rows, size):
        part = {k: v[lo : lo + size] for k, v in shard.items()}
        prox = prox_logp[lo : lo + size] if prox_logp is not None else None
        ref = ref_logp[lo : lo + size] if ref_logp is not None else None
        logp, routers = sequence_logprobs(model, part["ids"], part["attn"], temperature)
        pg, st = policy_loss(logp, part["behaviour"], part["adv"], part["mask"], loss, prox_logp=prox, ref_logp=ref)
        pg = pg * (st["tokens"] / max(global_tokens, 1.0))  # this chunk's share of the global mean
        aux = global_load_balancing_loss(model, routers, part["attn"]) * (part["ids"].shape[0] / rows)
        (world * (pg + model.config.router_aux_loss_coef * aux)).backward()
        pg_total += float(pg.detach())
        aux_total += float(aux.detach())
        for k in acc:
            acc[k] += st.get(k, 0.0) * (st["tokens"] if k != "tokens" else 1.0)
    n = acc["tokens"]
    stats = {k: (v / n if n else 0.0) for k, v in acc.items() if k != "tokens"} | {"tokens": n}
    ep = next((m.ep_size for m in model.modules() if isinstance(m, ExpertParallel)), 1)
    if ep > 1:  # summed over the ep group by the all-to-all, averaged over dp by FSDP
        for p in expert_parameters(model):
            if p.grad is not None:
                p.grad.div_(ep)
    norm = clip_grad_norm_(list(model.parameters()), max_grad_norm)
    optimizer.step()
    sums = torch.tensor(
        [
            pg_total,
            stats["ratio_mean"] * n,
            stats["clip_frac"] * n,
            stats.get("kl", 0.0) * n,
            stats.get("tis_capped_frac", 0.0) * n,
            stats.get("seq_masked_frac", 0.0) * n,
        ],
        device=training_device(model),
    )
    if world > 1:
        dist.all_reduce(sums)
    total = max(global_tokens, 1.0)
    return {
        "loss": float(sums[0]),
        "ratio_mean": float(sums[1]) / total,
        "clip_frac": float(sums[2]) / total,
        "kl": float(sums[3]) / total,
        "tis_capped_frac": float(sums[4]) / total,
        "seq_masked_frac": float(sums[5]) / total,
        "aux_loss": aux_total * world,
        "grad_norm": float(norm),
        "tokens": global_tokens,
    }
