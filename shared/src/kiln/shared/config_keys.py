"""Renamed configuration keys: one table (``RENAMED``), applied wherever settings come from.

Invariants:

- every key renamed by a settings change is in ``RENAMED`` (old dotted path -> new one) and
  nowhere else; each section's rows of docs/configuration.md (``deprecated_keys``) and its
  migration table are generated from it. The weights transport's flat keys, whose values
  also change meaning, keep their own translation (``kiln.shared.weights.transport.config``)
  and warn with the same ``DeprecatedKeyWarning``;
- an old key still loads, for one release, with a ``DeprecatedKeyWarning``: from the
  experiment file, ``--set``, constructor arguments and its environment variable
  (``KILN_LEARNER__SFT_STEPS`` is read as ``KILN_LEARNER__WARM_START__STEPS``);
- keys are renamed in each source before the sources are merged, so precedence (``--set``
  over the environment over the file) holds whichever spelling each source uses; one
  source giving a key both ways is an error, never a silent choice;
- an old scalar key whose new place is a field of a table (``learner.launcher = "ray"`` ->
  ``learner.launcher.kind``) is moved only while it holds a scalar: a table there is
  already the new spelling.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


class DeprecatedKeyWarning(FutureWarning):
    """An old config key that still works for one release (a ``FutureWarning``, so
    operators see it by default, not only test runs)."""


RENAMED: dict[str, str] = {
    # the listen addresses: one ListenAddress (host, port, token) each
    "telemetry.metrics_host": "telemetry.metrics.host",
    "telemetry.metrics_port": "telemetry.metrics.port",
    "telemetry.metrics_token": "telemetry.metrics.token",
    "weights.http_host": "weights.http.host",
    "weights.http_port": "weights.http.port",
    "weights.http_token": "weights.http.token",
    "envpool.http_host": "envpool.http.host",
    "envpool.http_port": "envpool.http.port",
    "envpool.http_token": "envpool.http.token",
    # the learner by concern
    "learner.dp_shard": "learner.parallelism.dp_shard",
    "learner.ep": "learner.parallelism.ep",
    "learner.ep_dispatch": "learner.parallelism.ep_dispatch",
    "learner.precision": "learner.precision.mode",
    "learner.precision_kernel": "learner.precision.kernel",
    "learner.keep_high_precision": "learner.precision.keep_high_precision",
    "learner.launcher": "learner.launcher.kind",
    "learner.ray_address": "learner.launcher.address",
    "learner.ray_cpus_per_rank": "learner.launcher.cpus_per_rank",
    "learner.ray_gpus_per_rank": "learner.launcher.gpus_per_rank",
    "learner.ray_strategy": "learner.launcher.strategy",
    "learner.rendezvous_host": "learner.launcher.rendezvous_host",
    "learner.rendezvous_port": "learner.launcher.rendezvous_port",
    "learner.sft_steps": "learner.warm_start.steps",
    "learner.sft_stop_match": "learner.warm_start.stop_match",
    "learner.sft_wrong_target_rate": "learner.warm_start.wrong_target_rate",
    "learner.sft_prose_fix_rate": "learner.warm_start.prose_fix_rate",
    "learner.sft_lr": "learner.warm_start.lr",
    "learner.sft_batch": "learner.warm_start.batch",
    "learner.lr_warmup_steps": "learner.schedule.warmup_steps",
    "learner.lr_decay_to": "learner.schedule.decay_to",
    "learner.checkpoint_dir": "learner.checkpoint.dir",
    "learner.checkpoint_keep": "learner.checkpoint.keep",
    "learner.checkpoint_async": "learner.checkpoint.asynchronous",
    "learner.resume": "learner.checkpoint.resume",
    # env-pool's environments, the layer store a union
    "envpool.environments_root": "envpool.environments.root",
    "envpool.environments_budget_bytes": "envpool.environments.budget_bytes",
    "envpool.environments_store": "envpool.environments.store.kind",
    "envpool.environments_s3_bucket": "envpool.environments.store.bucket",
    "envpool.environments_s3_prefix": "envpool.environments.store.prefix",
    "envpool.environments_s3_endpoint_url": "envpool.environments.store.endpoint_url",
    "envpool.environments_s3_region": "envpool.environments.store.region",
}


def renamed_in(section: str) -> dict[str, str]:
    """``{old key: "`new key`"}`` of one section, relative to it (``describe`` lists them)."""
    n = len(section) + 1
    return {old[n:]: f"`{new[n:]}`" for old, new in RENAMED.items() if old.startswith(section + ".")}


def _table(section: str | None) -> list[tuple[list[str], list[str]]]:
    if section is None:
        return [(old.split("."), new.split(".")) for old, new in RENAMED.items()]
    n = len(section) + 1
    return [(old[n:].split("."), new[n:].split(".")) for old, new in RENAMED.items() if old.startswith(section + ".")]


def _copy(d: Any) -> Any:
    # only the dicts are copied: the caller's data is never changed
    return {k: _copy(v) for k, v in d.items()} if isinstance(d, dict) else d


def migrate(data: Any, section: str | None = None, source: str = "") -> Any:
    """``data`` (the whole config, or one section's dict when ``section`` names it) with
    every old key of ``RENAMED`` moved to its new place, warning once for them all."""
    if not isinstance(data, dict):
        return data
    table = _table(section)
    out = _copy(data)
    moves = []
    for old, new in table:
        parent = out
        for k in old[:-1]:
            parent = parent.get(k) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        value = parent[old[-1]]
        if new[: len(old)] == old and not isinstance(value, (str, int, float, bool, list)):
            continue  # a table where the old scalar was: the new spelling
        moves.append((old, new, parent.pop(old[-1])))
    prefix = f"{section}." if section else ""
    for old, new, value in moves:
        node = out
        for k in new[:-1]:
            if node.get(k) is None:
                node[k] = {}
            if not isinstance(node[k], dict):
                raise ValueError(
                    f"{prefix}{'.'.join(old)} (old key) and {prefix}{'.'.join(new)} are both set: give one"
                )
            node = node[k]
        if new[-1] in node:
            raise ValueError(f"{prefix}{'.'.join(old)} (old key) and {prefix}{'.'.join(new)} are both set: give one")
        node[new[-1]] = value
    if moves:
        names = ", ".join(f"{prefix}{'.'.join(o)} -> {prefix}{'.'.join(n)}" for o, n, _ in moves)
        warnings.warn(
            f"deprecated config keys{' in ' + source if source else ''}: {names} (see docs/configuration.md)",
            DeprecatedKeyWarning,
            stacklevel=3,
        )
    return out


def migrate_env(env: Mapping[str, str | None], prefix: str, delimiter: str) -> dict[str, str | None]:
    """Environment variables with every old key's name changed to its new one
    (``KILN_LEARNER__SFT_STEPS`` -> ``KILN_LEARNER__WARM_START__STEPS``); ``env`` holds
    the names as the settings read them (lower-cased unless case-sensitive)."""
    lower = all(k == k.lower() for k in env)
    out = dict(env)
    renamed = []
    for old, new in RENAMED.items():
        o = prefix + delimiter.join(old.split("."))
        n = prefix + delimiter.join(new.split("."))
        if lower:
            o, n = o.lower(), n.lower()
        if o not in out:
            continue
        value = out[o]
        if n.startswith(o + delimiter) and (value or "").lstrip().startswith("{"):
            continue  # a JSON table where the old scalar was: the new spelling
        if n in out:
            raise ValueError(f"{o.upper()} (old name) and {n.upper()} are both set: give one")
        out[n] = out.pop(o)
        renamed.append(f"{o.upper()} -> {n.upper()}")
    if renamed:
        warnings.warn(
            f"deprecated config environment variables: {', '.join(renamed)} (see docs/configuration.md)",
            DeprecatedKeyWarning,
            stacklevel=3,
        )
    return out


def migration_markdown() -> list[str]:
    """docs/configuration.md's key migration table (old key -> new key)."""
    from kiln.shared.weights.transport.config import DEPRECATED_KEYS

    out = [
        "## Renamed keys",
        "",
        "Old keys still load for one release, from the experiment file, `--set` and their",
        "environment variables (`KILN_LEARNER__SFT_STEPS` is read as `KILN_LEARNER__WARM_START__STEPS`),",
        "with a `DeprecatedKeyWarning`; `kiln config show` prints the new ones.",
        "",
        "| old key | new key |",
        "|---|---|",
    ]
    out += [f"| `{old}` | `{new}` |" for old, new in RENAMED.items()]
    out += [f"| `weights.{old}` | {' '.join(new.split())} |" for old, new in DEPRECATED_KEYS.items()]
    return out + [""]
