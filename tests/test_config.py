"""Configuration: experiment files with includes, environment and CLI overrides in the
documented order, every field documented, and `kiln config show` printing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from kiln.ops.local_run import LocalRunConfig
from kiln.rollout.config import RolloutConfig
from kiln.shared.config import load_config, parse_overrides
from kiln.shared.registry import discover


def test_precedence_file_env_override(tmp_path, monkeypatch):
    (tmp_path / "base.toml").write_text('[rollout]\nmax_turns = 2\nmax_new_tokens = 10\n[run]\nname = "base"\n')
    exp = tmp_path / "exp.toml"
    exp.write_text('include = ["base.toml"]\n[rollout]\nmax_turns = 3\n[learner]\nlr = 1.0\n')
    cfg = load_config(RolloutConfig, exp)
    assert (cfg.rollout.max_turns, cfg.rollout.max_new_tokens, cfg.run.name) == (3, 10, "base")
    monkeypatch.setenv("KILN_ROLLOUT__MAX_NEW_TOKENS", "20")
    monkeypatch.setenv("KILN_RUN__NAME", "from-env")
    cfg = load_config(RolloutConfig, exp)
    assert (cfg.rollout.max_new_tokens, cfg.run.name) == (20, "from-env")
    cfg = load_config(RolloutConfig, exp, ["rollout.max_new_tokens=30", "nats.ack_wait_s={reward-workers = 2.5}"])
    assert cfg.rollout.max_new_tokens == 30 and cfg.nats.ack_wait_s == {"reward-workers": 2.5}
    monkeypatch.setenv("KILN_CONFIG", str(exp))
    assert load_config(RolloutConfig).rollout.max_turns == 3


def test_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\nmax_turnz = 3\n")
    with pytest.raises(ValidationError, match="max_turnz"):
        load_config(RolloutConfig, bad)
    loop = tmp_path / "loop.toml"
    loop.write_text('include = ["loop.toml"]\n')
    with pytest.raises(ValueError, match="include cycle"):
        load_config(RolloutConfig, loop)
    with pytest.raises(FileNotFoundError):
        load_config(RolloutConfig, tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="section.key=value"):
        parse_overrides(["no-equals-sign"])
    with pytest.raises(ValidationError, match=r"unknown tools \['read_fle'\]; the tools are read_file, edit_file"):
        load_config(RolloutConfig, None, ['tasks.tools=["read_fle"]'])


def _fields(model: type[BaseModel], prefix=""):
    for name, f in model.model_fields.items():
        yield f"{prefix}{name}", f
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from _fields(f.annotation, f"{prefix}{name}.")


@pytest.mark.parametrize("name", ["kiln run", *discover()])
def test_every_field_is_documented(name):
    cls = LocalRunConfig if name == "kiln run" else discover()[name].config_class()
    undocumented = [n for n, f in _fields(cls) if not (f.description or "").strip()]
    assert not undocumented, f"{name}: fields without a docstring: {undocumented}"


def test_config_show_prints_resolved_values(tmp_path):
    exp = tmp_path / "exp.toml"
    exp.write_text("[rollout]\nmax_turns = 7\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.ops.cli",
            "config",
            "show",
            "--service",
            "rollout",
            "--config",
            str(exp),
            "--set",
            "algorithm.steps=9",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "# ---- rollout ----" in out and "max_turns = 7" in out and "steps = 9" in out
    bad = subprocess.run(
        [sys.executable, "-m", "kiln.ops.cli", "config", "show", "--service", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown service" in bad.stderr


PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_resolves_for_every_service(preset):
    """Sections forbid unknown keys, so loading a preset with every service's config
    class checks each key it sets; a top-level table no service reads is a typo."""
    from kiln.shared.config import load_toml

    classes = [info.config_class() for info in discover().values()] + [LocalRunConfig]
    for cls in classes:
        load_config(cls, preset)
    known = {name for cls in classes for name in cls.model_fields}
    unread = set(load_toml(preset)) - known
    assert not unread, f"{preset.name}: no service reads the tables {sorted(unread)}"


def test_april_overlaps_only_where_the_staleness_bound_leaves_room():
    from kiln.shared.config import AlgorithmSettings

    assert AlgorithmSettings(mode="april", max_staleness=2).april_overlaps
    # At bound 1 the over-provisioned groups begun during a step would train two versions old.
    assert not AlgorithmSettings(mode="april", max_staleness=1).april_overlaps
    assert not AlgorithmSettings(mode="async", max_staleness=3).april_overlaps


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_presets_use_no_deprecated_key(preset):
    import warnings

    from kiln.shared.weights.transport import DeprecatedKeyWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedKeyWarning)
        load_config(RolloutConfig, preset)


def test_the_old_flat_weight_keys_map_onto_the_transport_union(tmp_path, monkeypatch):
    """``weights.fetch`` / ``broadcast_*`` / ``cache_dir`` load with a warning and mean what
    they meant; mixing them with ``[weights.transport]`` merges; a broadcast key on a files
    transport is an error unless it holds the old default (so old ``kiln config show`` output loads)."""
    from kiln.shared.config import WeightsSettings
    from kiln.shared.weights.transport import (
        DeprecatedKeyWarning,
        FilesTransport,
        HttpTransport,
        TorchBroadcastTransport,
        VllmNcclTransport,
    )

    def load(**flat) -> WeightsSettings:
        with pytest.warns(DeprecatedKeyWarning, match="weights.fetch|weights.broadcast|weights.cache_dir"):
            return WeightsSettings(**flat)

    group = {"broadcast_init_method": "tcp://w:29600", "broadcast_world_size": 3, "broadcast_rank": 2}
    assert load(fetch="http", cache_dir="/c").transport == HttpTransport(kind="http", cache_dir="/c")
    t = load(fetch="broadcast", broadcast_backend="gloo", **group).transport
    assert t == TorchBroadcastTransport(
        kind="torch-broadcast", backend="gloo", init_method="tcp://w:29600", world_size=3, rank=2
    )
    t = load(fetch="broadcast", **group).transport
    assert isinstance(t, TorchBroadcastTransport) and t.backend == "nccl"
    t = load(fetch="broadcast", broadcast_backend="vllm-nccl", **group).transport
    assert t == VllmNcclTransport(kind="vllm-nccl", init_method="tcp://w:29600", world_size=3, rank=2)
    old_show = {
        "fetch": "fs",
        "broadcast_init_method": "",
        "broadcast_world_size": 0,
        "broadcast_rank": 0,
        "broadcast_backend": "nccl",
        "cache_dir": "",
    }
    assert load(**old_show).transport == FilesTransport()
    with pytest.raises(ValidationError, match="applies only to weights.fetch = 'broadcast'"):
        load(fetch="fs", broadcast_init_method="tcp://w:1")
    with pytest.raises(ValidationError, match="tcp://host:port"):
        WeightsSettings(transport={"kind": "vllm-nccl", "init_method": "env://", "world_size": 2})
    with pytest.raises(ValidationError, match="backend"):  # each variant carries only its own keys
        WeightsSettings(transport={"kind": "vllm-nccl", "init_method": "tcp://w:1", "world_size": 2, "backend": "gloo"})
    # An old key on top of the new table (an env var, a --set) merges into it.
    exp = tmp_path / "exp.toml"
    exp.write_text('[weights.transport]\nkind = "torch-broadcast"\ninit_method = "tcp://w:1"\nworld_size = 2\n')
    with pytest.warns(DeprecatedKeyWarning):
        t = load_config(RolloutConfig, exp, ["weights.broadcast_rank=1"]).weights.transport
    assert (t.kind, t.rank, t.init_method) == ("torch-broadcast", 1, "tcp://w:1")
    monkeypatch.setenv("KILN_WEIGHTS__FETCH", "http")
    with pytest.warns(DeprecatedKeyWarning):
        assert load_config(RolloutConfig, exp).weights.transport == HttpTransport(kind="http")


def test_rendered_toml_reads_back_any_string():
    """The run's config.toml is what every service reads: a value holding a newline, quotes,
    backslashes, control characters or DEL must read back as written."""
    import tomllib

    from kiln.shared.config import render_toml

    nasty = 'line one\nline "two"\t\\ end\x01\x7f é'
    data = {"a": nasty, "section": {"b": [nasty, "plain"], "c": 3, "d": True}}
    assert tomllib.loads(render_toml(data)) == data


def test_renamed_keys_still_load_from_every_source(tmp_path, monkeypatch):
    """``kiln.shared.config_keys.RENAMED``: old flat keys load (with a warning) from the
    file, the environment and ``--set``, and mean what the new keys mean."""
    from kiln.learner.config import LearnerConfig
    from kiln.shared.config_keys import DeprecatedKeyWarning

    exp = tmp_path / "old.toml"
    exp.write_text('[learner]\nsft_steps = 7\nlauncher = "ray"\nray_address = "h:1"\nprecision = "bf16"\n')
    monkeypatch.setenv("KILN_LEARNER__CHECKPOINT_KEEP", "5")
    monkeypatch.setenv("KILN_TELEMETRY__METRICS_PORT", "9")
    with pytest.warns(DeprecatedKeyWarning):
        cfg = load_config(LearnerConfig, exp, ["learner.lr_decay_to=0.5"])
    lc = cfg.learner
    assert (lc.warm_start.steps, lc.launcher.kind, lc.launcher.address, lc.precision.mode) == (7, "ray", "h:1", "bf16")
    assert (lc.checkpoint.keep, lc.schedule.decay_to, cfg.telemetry.metrics.port) == (5, 0.5, 9)
    # the environment's new spelling still wins over the file's old one
    monkeypatch.setenv("KILN_LEARNER__WARM_START__STEPS", "3")
    with pytest.warns(DeprecatedKeyWarning):
        assert load_config(LearnerConfig, exp).learner.warm_start.steps == 3
    with pytest.raises(ValueError, match="both set"):
        load_config(LearnerConfig, None, ["learner.sft_steps=1", "learner.warm_start.steps=2"])


def test_a_loss_the_learner_refuses_is_refused_at_load():
    with pytest.raises(ValidationError, match="clip_eps"):
        load_config(RolloutConfig, None, ["algorithm.clip_eps=1.5"])
