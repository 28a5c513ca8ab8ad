"""`kiln run` supervises its services: the smoke preset, run as a user runs it, survives a
SIGKILL of reward and one of nats-server in the middle of the run (each restarted), and
ends with every group accounted for; a service that keeps dying fails the run with the
reason and its log's tail instead of looping forever."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KILN = [sys.executable, "-m", "kiln.ops.cli"]


def pids_with(*needles: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if all(n in cmd for n in needles):
                out.append(int(p.name))
    return out


class Output:
    """The run's output as it comes; ``wait(pattern)`` blocks until a line matches."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<eof>")
            self.cond.notify_all()

    def wait(self, pattern: str, timeout: float = 300) -> re.Match:
        with self.cond:
            found = None

            def seen():
                nonlocal found
                found = next((m for m in (re.search(pattern, x) for x in self.lines) if m), None)
                return found is not None or "<eof>" in self.lines

            self.cond.wait_for(seen, timeout)
            assert found, f"no line matching {pattern!r}:\n{''.join(self.lines)}"
            return found


@contextlib.contextmanager
def smoke_run(tmp_path: Path, *sets: str):
    """``kiln run`` of the smoke preset for 4 steps (plus ``--set``s), as a user runs it:
    yields (its output, its results folder) and, when the body is done, waits for the
    run to finish and succeed; an unfinished run is interrupted. Afterwards
    ``assert_every_group_accounted`` reads the output."""
    args = [a for kv in ("algorithm.steps=4", *sets) for a in ("--set", kv)]
    proc = subprocess.Popen(
        [*KILN, "run", "--config", str(REPO / "configs" / "smoke.toml"), "--set", f"run.root={tmp_path}", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = Output(proc)
    try:
        yield out, out.wait(r"results in (\S+)").group(1)
        out.wait(r"run \S+ finished: 5 policy versions stored")
        assert proc.wait(120) == 0, "".join(out.lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)


def assert_every_group_accounted(out: Output) -> None:
    """Every group trained, or dropped with its reason (a sandbox request that timed out
    while the bus was down is an infra error, masked, not lost); no failure, no traceback."""
    text = "".join(out.lines)
    groups = re.search(r"policy versions stored \(0\.\.4\), groups: (.*?)(;|$)", text, re.M).group(1)
    assert "trained" in groups and all(re.fullmatch(r"\d+ (trained|dropped \(\w+\))", g) for g in groups.split(", ")), (
        text
    )
    assert "FAILED" not in text and "Traceback" not in text


@pytest.mark.timeout(600)
def test_a_run_survives_killed_services_and_nats(tmp_path):
    with smoke_run(tmp_path, "local.restart_backoff_s=0.2") as (out, run_dir):
        out.wait(r"version 1/4:")
        (reward,) = pids_with("--instance reward-0", run_dir)
        os.kill(reward, signal.SIGKILL)
        out.wait(r"reward-0 exited with code -9; restarting it")
        out.wait(r"version 2/4:")
        (nats,) = pids_with("nats-server", f"{run_dir}/nats")
        os.kill(nats, signal.SIGKILL)
        out.wait(r"nats-server exited with code -9; restarting it")
    assert re.search(r"; 1 service restarts", "".join(out.lines))
    assert_every_group_accounted(out)


@pytest.mark.timeout(300)
def test_a_crash_looping_service_fails_the_run_with_its_reason(tmp_path):
    # reward cannot start at all (its suite names a test command kiln refuses): it exits
    # at once, again and again, until the launcher gives up.
    suite = tmp_path / "bad.jsonl"
    suite.write_text(
        '{"id": "t", "problem_statement": "x", "files": {"a.py": "x"}, "test_command": "bash run.sh", '
        '"fail_to_pass": ["a.T.t"]}\n'
    )
    proc = subprocess.run(
        [
            *KILN,
            "run",
            "--config",
            str(REPO / "configs" / "smoke.toml"),
            "--set",
            f"run.root={tmp_path}",
            "--set",
            f"tasks.suite='{suite}'",
            "--set",
            "local.max_restarts=2",
            "--set",
            "local.restart_backoff_s=0.1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert re.search(r"FAILED: reward-0 crash-loops: it exited 3 times within 300s", text), text
    assert "cannot be scored" in text  # the tail of its log says why
