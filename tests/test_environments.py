"""Content-addressed, layered environments (issue 22): specs and digests, each repository
kind, OCI whiteouts, real builds with uv in bubblewrap, the per-node cache (shared builds,
remembered failures, LRU eviction with pins), the NATS layer store and `kiln env build`."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from kiln.envpool.environments import (
    EnvironmentBuildError,
    EnvironmentCache,
    NatsLayerStore,
    environment_bwrap_args,
    plan_layers,
)
from kiln.envpool.environments.unpack import materialize_repository, unpack_oci
from kiln.shared.environments import EnvironmentSpec, load_environments

BWRAP = shutil.which("bwrap")
needs_bwrap = pytest.mark.skipif(BWRAP is None, reason="bubblewrap is not installed")
BIN = bytes(range(256)) * 4


def make_repo(folder: Path, test_body: str = "assert 1 + 1 == 2") -> Path:
    """A tiny installable project: a package importing iniconfig, a test, a binary file and
    an executable script."""
    (folder / "src" / "tinypkg").mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tinypkg"\nversion = "0.1"\ndependencies = ["iniconfig"]\n'
        '[project.optional-dependencies]\ntest = ["pytest"]\n'
    )
    (folder / "src" / "tinypkg" / "__init__.py").write_text("import iniconfig\n\ndef answer():\n    return 42\n")
    (folder / "tests").mkdir()
    (folder / "tests" / "test_tiny.py").write_text(
        f"import tinypkg\n\ndef test_answer():\n    assert tinypkg.answer() == 42\n    {test_body}\n"
    )
    (folder / "data.bin").write_bytes(BIN)
    (folder / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (folder / "run.sh").chmod(0o755)
    return folder


def python_spec(repo: Path, **kw) -> EnvironmentSpec:
    return EnvironmentSpec.model_validate(
        {
            "name": "tiny",
            "repository": {"kind": "dir", "path": str(repo)},
            "python": {"install_project": True, "extras": ["test"]},
            **kw,
        }
    )


def run_in(built, command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(environment_bwrap_args(built, command), capture_output=True, text=True, timeout=120)


def check_tree(ws: Path) -> None:
    assert (ws / "data.bin").read_bytes() == BIN
    assert stat.S_IMODE((ws / "run.sh").stat().st_mode) & 0o111 == 0o111
    assert stat.S_IMODE((ws / "pyproject.toml").stat().st_mode) & 0o111 == 0


# -- specs and digests ------------------------------------------------------------------------


def test_digest_is_stable_and_follows_every_input(tmp_path):
    repo = make_repo(tmp_path / "repo")
    a, b = python_spec(repo), python_spec(repo).model_copy(update={"name": "other"})
    assert a.digest() == b.digest() == python_spec(repo).digest()
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    assert python_spec(copy).digest() == a.digest(), "the digest is of content, not of paths"
    (copy / "data.bin").write_bytes(BIN + b"!")
    assert python_spec(copy).digest() != a.digest()
    (copy / "data.bin").write_bytes(BIN)
    (copy / "run.sh").chmod(0o644)
    assert python_spec(copy).digest() != a.digest(), "modes are content"
    assert python_spec(repo, setup=["true"]).digest() != a.digest()
    with pytest.raises(Exception):
        EnvironmentSpec.model_validate({"name": "x", "bogus": 1})


def test_spec_file_resolves_relative_paths(tmp_path):
    make_repo(tmp_path / "repo")
    (tmp_path / "envs.toml").write_text(
        '[[environments]]\nname = "a"\nrepository = { kind = "dir", path = "repo" }\n'
        '[environments.python]\npackages = ["iniconfig"]\n'
    )
    (spec,) = load_environments(tmp_path / "envs.toml")
    assert spec.repository.path == str(tmp_path / "repo")
    assert spec.python.packages == ["iniconfig"]


# -- repository kinds and OCI -----------------------------------------------------------------


def test_repository_kinds_keep_bytes_and_modes(tmp_path):
    repo = make_repo(tmp_path / "repo")
    spec = lambda r: EnvironmentSpec.model_validate({"name": "r", "repository": r}).repository  # noqa: E731

    materialize_repository(spec({"kind": "dir", "path": str(repo)}), tmp_path / "out-dir")
    check_tree(tmp_path / "out-dir")

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "one"], check=True)
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "data.bin").write_bytes(b"changed")
    subprocess.run([*git, "-C", str(repo), "commit", "-qam", "two"], check=True)
    g = spec({"kind": "git", "url": str(repo), "commit": first})
    materialize_repository(g, tmp_path / "out-git")
    check_tree(tmp_path / "out-git")
    assert not (tmp_path / "out-git" / ".git").exists()
    assert EnvironmentSpec(name="g", repository=g).input_hashes()["repository"] == f"git:{first}"
    head = EnvironmentSpec(name="g", repository=spec({"kind": "git", "url": str(repo), "commit": "HEAD"}))
    assert head.digest() != EnvironmentSpec(name="g", repository=g).digest()

    (repo / "data.bin").write_bytes(BIN)

    def foreign(m):  # an sdist's files belong to whoever packed it: never kept in a repository
        m.uid, m.gid = 1001, 127
        return None if ".git" in m.name else m

    with tarfile.open(tmp_path / "r.tar.gz", "w:gz") as tf:
        tf.add(str(repo), arcname="proj-1.0", filter=foreign)
    materialize_repository(
        spec({"kind": "archive", "path": str(tmp_path / "r.tar.gz"), "strip_components": 1}), tmp_path / "out-tar"
    )
    check_tree(tmp_path / "out-tar")
    owners = {p.lstat().st_uid for p in (tmp_path / "out-tar").rglob("*")}
    assert owners == {os.geteuid()}, owners  # the builder's: what a sandbox's idmapped view makes its own
    with zipfile.ZipFile(tmp_path / "r.zip", "w") as zf:
        for p in repo.rglob("*"):
            if p.is_file() and ".git" not in p.parts:
                info = zipfile.ZipInfo(str(p.relative_to(repo)))
                info.external_attr = (stat.S_IFREG | stat.S_IMODE(p.stat().st_mode)) << 16
                zf.writestr(info, p.read_bytes())
    materialize_repository(spec({"kind": "archive", "path": str(tmp_path / "r.zip")}), tmp_path / "out-zip")
    check_tree(tmp_path / "out-zip")

    materialize_repository(spec({"kind": "sdist", "name": "iniconfig", "version": "2.0.0"}), tmp_path / "out-sdist")
    assert (tmp_path / "out-sdist" / "pyproject.toml").exists()
    assert (tmp_path / "out-sdist" / "src" / "iniconfig" / "__init__.py").exists()


def _tar_bytes(entries: list[tuple[str, bytes | None, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_oci(path: Path) -> Path:
    import hashlib

    l1 = _tar_bytes(
        [
            ("etc/", None, 0o755),
            ("etc/gone.conf", b"old", 0o644),
            ("etc/keep.conf", b"keep", 0o644),
            ("opt/app/", None, 0o755),
            ("opt/app/old.txt", b"old", 0o644),
            ("usr/bin/", None, 0o755),
            ("usr/bin/tool", BIN, 0o755),
        ]
    )
    l2 = _tar_bytes(
        [("etc/.wh.gone.conf", b"", 0o644), ("opt/app/.wh..wh..opq", b"", 0o644), ("opt/app/new.txt", b"new", 0o600)]
    )
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return d

    import gzip

    layers = [
        {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": add(gzip.compress(l1))},
        {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": add(l2)},
    ]
    manifest = add(json.dumps({"schemaVersion": 2, "config": {"digest": add(b"{}")}, "layers": layers}).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [{"digest": manifest, "mediaType": "application/vnd.oci.image.manifest.v1+json"}],
    }
    with tarfile.open(path, "w") as tf:
        for name, data in [
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            ("index.json", json.dumps(index).encode()),
        ] + [(f"blobs/sha256/{d.split(':')[1]}", b) for d, b in blobs.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_oci_archive_unpacks_with_whiteouts(tmp_path):
    root = tmp_path / "rootfs"
    unpack_oci(make_oci(tmp_path / "img.tar"), root)
    assert not (root / "etc" / "gone.conf").exists()
    assert (root / "etc" / "keep.conf").read_text() == "keep"
    assert sorted(p.name for p in (root / "opt" / "app").iterdir()) == ["new.txt"]
    assert stat.S_IMODE((root / "opt" / "app" / "new.txt").stat().st_mode) == 0o600
    assert (root / "usr" / "bin" / "tool").read_bytes() == BIN
    assert os.access(root / "usr" / "bin" / "tool", os.X_OK)


# -- builds -----------------------------------------------------------------------------------


@needs_bwrap
async def test_python_environment_builds_once_and_runs_the_repos_tests(tmp_path):
    repo = make_repo(tmp_path / "repo")
    cache = EnvironmentCache(tmp_path / "envs", budget_bytes=10 << 30)
    spec = python_spec(repo)
    first, second = await asyncio.gather(cache.get(spec), cache.get(spec))
    assert first == second and cache.builds == 1, "concurrent gets share one build"
    assert first.path == ("/opt/kiln/venv/bin",) and first.env == {"VIRTUAL_ENV": "/opt/kiln/venv"}
    assert first.host_base and [la.name for la in first.layers] == ["python", "repository"]
    assert first.size_bytes > 0
    assert not list((tmp_path / "envs" / "layers").glob("*.partial-*"))
    check_tree(first.layer("repository").path / "workspace")

    out = run_in(first, ["python", "-c", "import iniconfig, tinypkg, sys; print(sys.prefix, tinypkg.__file__)"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["/opt/kiln/venv", "/workspace/src/tinypkg/__init__.py"]
    out = run_in(first, ["pytest", "-q", "-p", "no:cacheprovider", "tests"])
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    for layer in first.layers:  # only in-sandbox paths: no trace of where it was built
        for trace in (str(tmp_path), "/opt/kiln/.node"):
            hits = subprocess.run(["grep", "-rlI", "--", trace, str(layer.path)], capture_output=True, text=True).stdout
            assert not hits, (trace, hits)
    site = next((first.layer("python").path / "opt/kiln/venv/lib").glob("python3*/site-packages"))
    assert (site / "iniconfig" / "__init__.py").stat().st_nlink > 1, "installed files are hard links into uv's cache"

    again = await cache.get(spec.model_copy(update={"name": "renamed"}))
    assert cache.builds == 1 and again.name == "renamed" and again.digest == first.digest
    fresh = EnvironmentCache(tmp_path / "envs", budget_bytes=10 << 30)  # another process on the node
    assert (await fresh.get(spec)).digest == first.digest and fresh.builds == 0


@needs_bwrap
async def test_failed_builds_name_environment_and_step_and_are_remembered(tmp_path):
    repo = make_repo(tmp_path / "repo")
    cache = EnvironmentCache(tmp_path / "envs", budget_bytes=10 << 30)
    bad_req = EnvironmentSpec.model_validate(
        {"name": "unresolvable", "python": {"packages": ["kiln-no-such-package-xyz==0.0.1"]}}
    )
    with pytest.raises(EnvironmentBuildError) as e:
        await cache.get(bad_req)
    assert e.value.environment == "unresolvable" and e.value.step == "python"
    assert "kiln-no-such-package-xyz" in str(e.value)
    with pytest.raises(EnvironmentBuildError):
        await cache.get(bad_req)
    assert cache.builds == 0

    bad_setup = EnvironmentSpec.model_validate(
        {
            "name": "setupfail",
            "repository": {"kind": "dir", "path": str(repo)},
            "setup": ["echo compiling", "echo broken >&2; exit 3"],
        }
    )
    with pytest.raises(EnvironmentBuildError) as e:
        await cache.get(bad_setup)
    assert e.value.step == "setup" and "exited 3" in str(e.value) and "broken" in str(e.value)

    (tmp_path / "corrupt.tar.gz").write_bytes(b"\x1f\x8b\x08\x00garbage" * 10)
    corrupt = EnvironmentSpec.model_validate(
        {"name": "corrupt", "repository": {"kind": "archive", "path": str(tmp_path / "corrupt.tar.gz")}}
    )
    with pytest.raises(EnvironmentBuildError) as e:
        await cache.get(corrupt)
    assert e.value.environment == "corrupt" and e.value.step == "repository"
    assert not list((tmp_path / "envs" / "layers").iterdir()), "a failed build leaves no layer"

    gone = EnvironmentSpec.model_validate(
        {"name": "gone", "repository": {"kind": "dir", "path": str(tmp_path / "nope")}}
    )
    with pytest.raises(EnvironmentBuildError) as e:
        await cache.get(gone)
    assert e.value.step == "repository" and "nope" in str(e.value)

    ok = EnvironmentSpec.model_validate(
        {"name": "setupok", "repository": {"kind": "dir", "path": str(repo)}, "setup": ["sh run.sh > built.txt"]}
    )
    built = await cache.get(ok)
    assert (built.layer("repository").path / "workspace" / "built.txt").read_text() == "hi\n"


async def test_lru_eviction_never_evicts_a_pinned_environment(tmp_path):
    cache = EnvironmentCache(tmp_path / "envs", budget_bytes=1)
    specs = []
    for i in range(3):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "f.bin").write_bytes(os.urandom(64 << 10))
        specs.append(EnvironmentSpec.model_validate({"name": f"e{i}", "repository": {"kind": "dir", "path": str(d)}}))
    e0 = await cache.get(specs[0])
    cache.pin(e0.digest)
    e1 = await cache.get(specs[1])  # over budget: e0 is pinned, e1 is the one just built
    assert e0.layers[0].path.is_dir() and e1.layers[0].path.is_dir()
    e2 = await cache.get(specs[2])
    assert not e1.layers[0].path.exists(), "the least recently used unpinned one goes"
    assert e0.layers[0].path.is_dir() and e2.layers[0].path.is_dir()
    cache.unpin(e0.digest)
    cache.budget_bytes = 100 << 10
    assert cache.evict() == [e0.digest]
    assert [e.digest for e in cache.environments()] == [e2.digest]
    assert cache.builds == 3
    await cache.get(specs[1])
    assert cache.builds == 4, "an evicted environment is built again"


@needs_bwrap
async def test_layer_store_round_trip_over_nats(tmp_path, bus):
    repo = make_repo(tmp_path / "repo")
    store = NatsLayerStore(bus.js)
    spec = python_spec(repo)
    a = EnvironmentCache(tmp_path / "node-a", budget_bytes=10 << 30, store=store)
    built = await a.get(spec)
    assert a.builds == 1
    await a.published()  # stored in the background: the first sandbox does not wait for it
    for layer in built.layers:
        assert await store.has(layer.digest)
    b = EnvironmentCache(tmp_path / "node-b", budget_bytes=10 << 30, store=NatsLayerStore(bus.js))
    fetched = await b.get(spec)
    assert b.builds == 0 and b.fetches == len(built.layers)
    assert fetched.digest == built.digest
    check_tree(fetched.layer("repository").path / "workspace")
    out = run_in(fetched, ["pytest", "-q", "-p", "no:cacheprovider", "tests"])
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    assert not await store.fetch("0" * 64, tmp_path / "nothing")


@needs_bwrap
async def test_oci_base_environment_runs_in_its_rootfs(tmp_path):
    """A base built from an image archive: the layer is a whole root filesystem (the
    image is just a busybox-less tree here, so only its files are checked)."""
    spec = EnvironmentSpec.model_validate(
        {"name": "img", "base": {"kind": "oci", "archive": str(make_oci(tmp_path / "i.tar"))}}
    )
    cache = EnvironmentCache(tmp_path / "envs", budget_bytes=10 << 30)
    built = await cache.get(spec)
    assert not built.host_base and [la.name for la in built.layers] == ["base", "repository"]
    root = built.layer("base").path
    assert (root / "usr/bin/tool").read_bytes() == BIN and not (root / "etc/gone.conf").exists()
    assert (root / "workspace").is_dir() and (root / "opt/kiln").is_dir()
    assert plan_layers(spec, spec.input_hashes()).base == built.layer("base").digest


# -- the CLI ----------------------------------------------------------------------------------


@needs_bwrap
def test_kiln_env_build_prints_digests_and_fails_clearly(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (tmp_path / "envs.toml").write_text(
        '[[environments]]\nname = "plain"\nrepository = { kind = "dir", path = "repo" }\n'
        '[[environments]]\nname = "broken"\nrepository = { kind = "dir", path = "repo" }\nsetup = ["exit 7"]\n'
    )
    cmd = [
        sys.executable,
        "-m",
        "kiln.ops.cli",
        "env",
        "build",
        str(tmp_path / "envs.toml"),
        "--root",
        str(tmp_path / "root"),
    ]
    out = subprocess.run(cmd + ["--name", "plain"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    digest = EnvironmentSpec.model_validate(
        {"name": "plain", "repository": {"kind": "dir", "path": str(repo)}}
    ).digest()
    assert "plain" in out.stdout and digest[:12] in out.stdout and "built in" in out.stdout
    out = subprocess.run(cmd + ["--name", "plain"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "cached" in out.stdout, out.stdout + out.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "environment 'broken': setup step failed" in out.stderr and "exited 7" in out.stderr


@pytest.mark.slow
@needs_bwrap
async def test_debian_base_with_python(tmp_path):
    """mmdebstrap (installed with apt-get when missing) builds a bookworm root filesystem
    with python3; a uv venv is made from its interpreter and runs inside it."""
    spec = EnvironmentSpec.model_validate(
        {
            "name": "deb",
            "base": {"kind": "debian", "suite": "bookworm", "packages": ["python3"]},
            "python": {"interpreter": "python3", "packages": ["iniconfig"]},
        }
    )
    cache = EnvironmentCache(tmp_path / "envs", budget_bytes=10 << 30)
    built = await cache.get(spec)
    assert not built.host_base
    out = run_in(built, ["python", "-c", "import iniconfig, sys; print(sys.version_info[:2], sys.prefix)"])
    assert out.returncode == 0, out.stderr
    assert "/opt/kiln/venv" in out.stdout
