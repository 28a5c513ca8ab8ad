"""Materializing inputs as trees: repositories (dir, git, archive, sdist) and OCI image
archives (layer by layer, honouring whiteouts). Plain Python (tarfile, zipfile) and git;
every member path is checked to stay inside its destination."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

from kiln.shared.environments import (
    ArchiveRepository,
    DirRepository,
    GitRepository,
    SdistRepository,
    file_sha256,
)


def index_url() -> str:
    """The package index sdists come from (PEP 691 JSON simple API): the node's uv/pip index
    setting, else PyPI."""
    for k in ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(k):
            return os.environ[k].rstrip("/")
    return "https://pypi.org/simple"


class UnpackError(RuntimeError):
    pass


def _member_path(name: str, strip: int = 0) -> PurePosixPath | None:
    """A member's relative path after stripping, None when nothing is left; refuses
    absolute paths and ``..``."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if parts and parts[0] == "/":
        parts = parts[1:]
    if ".." in parts:
        raise UnpackError(f"member {name!r} leaves the destination")
    parts = parts[strip:]
    return PurePosixPath(*parts) if parts else None


def _target(dest: Path, rel: PurePosixPath) -> Path:
    """``dest/rel`` with no symlink among its parents (nothing is written through a link)."""
    cur = dest
    for part in rel.parts[:-1]:
        cur = cur / part
        if cur.is_symlink():
            raise UnpackError(f"{rel} would be written through the symlink {cur.relative_to(dest)}")
    return dest / rel


def _remove(p: Path) -> None:
    if p.is_symlink() or not p.is_dir():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p)


def extract_tar(tf: tarfile.TarFile, dest: Path, strip: int = 0, whiteouts: bool = False, owners: bool = False) -> None:
    """Extract regular files, folders, symlinks and hard links with their modes (and with
    ``owners``, as root, their owners: a root filesystem's; a repository's files are the
    builder's, root's, which is what a sandbox's idmapped view makes its own).
    ``whiteouts``: OCI semantics, ``.wh.NAME`` deletes NAME from the layers below and
    ``.wh..wh..opq`` empties its folder of them (both applied before this layer's files)."""
    members = tf.getmembers()
    if whiteouts:
        keep = []
        for m in members:
            rel = _member_path(m.name, strip)
            if rel is None or not rel.name.startswith(".wh."):
                keep.append(m)
                continue
            parent = _target(dest, rel).parent
            if rel.name == ".wh..wh..opq":
                if parent.is_dir() and not parent.is_symlink():
                    for child in list(parent.iterdir()):
                        _remove(child)
            else:
                victim = parent / rel.name[len(".wh.") :]
                if victim.exists() or victim.is_symlink():
                    _remove(victim)
        members = keep
    as_root = owners and os.geteuid() == 0
    dirs: list[tuple[Path, tarfile.TarInfo]] = []
    for m in members:
        rel = _member_path(m.name, strip)
        if rel is None:
            continue
        t = _target(dest, rel)
        t.parent.mkdir(parents=True, exist_ok=True)
        if m.isdir():
            if t.is_symlink() or (t.exists() and not t.is_dir()):
                _remove(t)
            t.mkdir(exist_ok=True)
            dirs.append((t, m))
            continue
        if t.exists() or t.is_symlink():
            _remove(t)
        if m.issym():
            os.symlink(m.linkname, t)
        elif m.islnk():
            src = _member_path(m.linkname, strip)
            if src is None:
                raise UnpackError(f"hard link {m.name!r} to nothing")
            os.link(_target(dest, src), t)
            continue
        elif m.isreg():
            with tf.extractfile(m) as src, open(t, "wb") as out:  # type: ignore[union-attr]
                shutil.copyfileobj(src, out, 1 << 20)
            os.chmod(t, m.mode & 0o7777)
        else:
            continue  # device nodes and fifos: a sandbox gets its own /dev
        if as_root:
            try:
                os.lchown(t, m.uid, m.gid)
            except OSError:
                pass
        if not m.issym():
            os.utime(t, (m.mtime, m.mtime))
    for t, m in reversed(dirs):  # modes last: a read-only folder must be filled first
        if as_root:
            try:
                os.lchown(t, m.uid, m.gid)
            except OSError:
                pass
        os.chmod(t, (m.mode & 0o7777) | 0o700)


def extract_zip(path: Path, dest: Path, strip: int = 0) -> None:
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            rel = _member_path(info.filename, strip)
            if rel is None:
                continue
            t = _target(dest, rel)
            mode = (info.external_attr >> 16) & 0o7777
            if info.is_dir():
                t.mkdir(parents=True, exist_ok=True)
                continue
            t.parent.mkdir(parents=True, exist_ok=True)
            if stat.S_ISLNK(info.external_attr >> 16):
                os.symlink(zf.read(info).decode(), t)
                continue
            with zf.open(info) as src, open(t, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            if mode:
                os.chmod(t, mode)


def extract_archive(path: Path, dest: Path, strip: int = 0) -> None:
    """A tar (any compression tarfile reads) or zip archive into ``dest``."""
    try:
        if zipfile.is_zipfile(path):
            extract_zip(path, dest, strip)
            return
        with tarfile.open(path, "r:*") as tf:
            extract_tar(tf, dest, strip)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, UnicodeDecodeError) as e:
        raise UnpackError(f"cannot unpack {path.name}: {type(e).__name__}: {e}") from e


# -- repositories ---------------------------------------------------------------------------


def copy_dir(src: Path, dest: Path) -> None:
    if not src.is_dir():
        raise UnpackError(f"{src} is not a folder")
    shutil.copytree(
        src, dest, symlinks=True, dirs_exist_ok=True, ignore=lambda d, names: [".git"] if Path(d) == src else []
    )


def git_checkout(url: str, commit: str, dest: Path) -> None:
    def git(*args: str, cwd: Path | None = None) -> None:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise UnpackError(f"git {args[0]} failed: {(out.stderr or out.stdout)[-2000:]}")

    dest.mkdir(parents=True, exist_ok=True)
    git("clone", "--quiet", "--no-checkout", url, str(dest))
    git("-c", "advice.detachedHead=false", "checkout", "--quiet", commit, cwd=dest)
    git("submodule", "update", "--init", "--recursive", "--quiet", cwd=dest)
    shutil.rmtree(dest / ".git")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download_sdist(name: str, version: str, folder: Path) -> Path:
    """The sdist of ``name==version`` from the index's JSON simple API, its sha256 checked."""
    url = f"{index_url()}/{_canon(name)}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            meta = json.load(r)
    except Exception as e:  # noqa: BLE001 - any failure is the build's reason
        raise UnpackError(f"sdist {name}=={version}: {url}: {e}") from e
    files = []
    for f in meta.get("files", []):
        fn = f["filename"]
        stem = next((fn[: -len(x)] for x in (".tar.gz", ".zip") if fn.endswith(x)), None)
        if stem and "-" in stem:
            n, v = stem.rsplit("-", 1)
            if _canon(n) == _canon(name) and v == version:
                files.append(f)
    if not files:
        raise UnpackError(f"{name}=={version} has no sdist on {url}")
    f = files[0]
    out = folder / f["filename"]
    h = hashlib.sha256()
    with urllib.request.urlopen(urllib.parse.urljoin(url, f["url"]), timeout=300) as r, open(out, "wb") as w:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            w.write(chunk)
    want = f.get("hashes", {}).get("sha256")
    if want and h.hexdigest() != want:
        raise UnpackError(f"{f['filename']}: sha256 {h.hexdigest()} != index's {want}")
    return out


def materialize_repository(repo, dest: Path) -> None:
    """Write the repository's files into ``dest`` (the layer's ``workspace`` folder)."""
    dest.mkdir(parents=True, exist_ok=True)
    if repo is None:
        return
    if isinstance(repo, DirRepository):
        copy_dir(Path(repo.path), dest)
    elif isinstance(repo, GitRepository):
        dest.rmdir()
        git_checkout(repo.url, repo.commit, dest)
    elif isinstance(repo, ArchiveRepository):
        extract_archive(Path(repo.path), dest, repo.strip_components)
    elif isinstance(repo, SdistRepository):
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            extract_archive(download_sdist(repo.name, repo.version, Path(tmp)), dest, strip=1)
    else:  # pragma: no cover - the spec's union is closed
        raise UnpackError(f"unknown repository kind {repo!r}")


# -- OCI image archives ---------------------------------------------------------------------


def _oci_layers(tf: tarfile.TarFile) -> list[str]:
    """Member names of the image's layer blobs, lowest first (OCI layout or docker save)."""
    names = set(tf.getnames())

    def read_json(member: str):
        f = tf.extractfile(member)
        if f is None:
            raise UnpackError(f"{member} is not a file")
        return json.load(f)

    def blob(digest: str) -> str:
        algo, _, hexd = digest.partition(":")
        return f"blobs/{algo}/{hexd}"

    if "index.json" in names:
        index = read_json("index.json")
        desc = index["manifests"][0]
        manifest = read_json(blob(desc["digest"]))
        while "manifests" in manifest:  # an image index (multi-platform): take the first
            manifest = read_json(blob(manifest["manifests"][0]["digest"]))
        return [blob(layer["digest"]) for layer in manifest["layers"]]
    if "manifest.json" in names:
        return list(read_json("manifest.json")[0]["Layers"])
    raise UnpackError("neither index.json (OCI layout) nor manifest.json (docker save) in the archive")


def unpack_oci(archive: Path, dest: Path) -> None:
    """An OCI image archive's root filesystem into ``dest``: each layer (tar, tar+gzip) in
    order, ``.wh.`` whiteouts and opaque folders applied."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:*") as outer:
            for name in _oci_layers(outer):
                blob = outer.extractfile(name)
                if blob is None:
                    raise UnpackError(f"layer {name} missing from the archive")
                with tempfile.TemporaryFile(dir=dest.parent) as tmp:
                    shutil.copyfileobj(blob, tmp, 1 << 20)
                    tmp.seek(0)
                    with tarfile.open(fileobj=tmp, mode="r:*") as layer:
                        extract_tar(layer, dest, whiteouts=True, owners=True)
    except (tarfile.TarError, KeyError, IndexError, ValueError, EOFError, OSError) as e:
        raise UnpackError(f"cannot unpack image {archive.name}: {type(e).__name__}: {e}") from e


__all__ = ["UnpackError", "extract_archive", "materialize_repository", "unpack_oci", "file_sha256"]
