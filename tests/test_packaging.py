"""Installed (non-editable) packages carry their data: the images of docker-compose
install wheels, where a file missing from package-data is a start-up crash."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_shared_wheel_has_suite_and_migrations(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO / "shared"),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("kiln_shared-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "kiln/shared/tasks/builtin.jsonl",
        "kiln/shared/db/migrations/env.py",
        "kiln/shared/db/migrations/script.py.mako",
        "kiln/shared/db/migrations/versions/0001_initial_schema.py",
        "kiln/shared/contracts/__init__.py",
        "kiln/shared/contracts/messages.py",
        "kiln/shared/contracts/envpool.py",
    ):
        assert needed in names, f"{needed} is missing from the kiln-shared wheel"
    assert not any(n.startswith("kiln/__init__") for n in names), "kiln must stay a namespace package"
