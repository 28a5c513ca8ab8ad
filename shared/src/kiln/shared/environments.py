"""Environment specs: what a sandbox's filesystem is built from (project issue 22).

An environment is a content-addressed stack of read-only layers that env-pool builds once
per node and mounts under every sandbox of a task that names it:

- a **base** (``host``: the host's ``/usr`` as today's sandboxes; ``debian``: a root
  filesystem made with ``mmdebstrap``; ``oci``: an OCI/docker image archive);
- a **python** virtual environment at ``/opt/kiln/venv`` (built with ``uv``);
- the **repository** at ``/workspace``;
- ``setup`` commands run last, in the build sandbox.

This module only describes and hashes environments (no building: that is
``kiln.envpool.environments``). ``EnvironmentSpec.digest`` is the identity of an
environment: the canonical JSON of the spec (without its name and without local paths)
plus the content hashes of its inputs, so two equal specs over equal inputs share one
build and changing any input file makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

WORKSPACE = "/workspace"
"""Where the repository layer's tree appears inside the sandbox."""
VENV = "/opt/kiln/venv"
"""Where the python layer's virtual environment appears inside the sandbox."""


_MOMENT = re.compile(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}(\.\d+)?Z)?")


class EnvironmentInputError(ValueError):
    """An input of a spec cannot be read or resolved; ``input`` is ``base`` or ``repository``."""

    def __init__(self, input: str, reason: str):
        self.input = input
        super().__init__(reason)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HostBase(_Spec):
    kind: Literal["host"] = "host"
    """The host's ``/usr`` (and the few ``/etc`` files today's sandboxes bind), read-only."""


class DebianBase(_Spec):
    kind: Literal["debian"] = "debian"
    """A Debian root filesystem built with ``mmdebstrap --variant=minbase``."""
    suite: str = "bookworm"
    """Debian suite (``bookworm``, ``trixie``, ...)."""
    packages: list[str] = Field(default_factory=list)
    """Extra packages to include (e.g. ``python3``, ``git``, ``build-essential``)."""
    mirror: str | None = None
    """Debian mirror URL; None = mmdebstrap's default (deb.debian.org)."""


class OciBase(_Spec):
    kind: Literal["oci"] = "oci"
    """An OCI image archive (``skopeo copy ... oci-archive:`` or ``docker save``), unpacked
    layer by layer honouring whiteouts."""
    archive: str
    """Path of the archive (relative paths: to the spec file's folder)."""


BaseSpec = Annotated[HostBase | DebianBase | OciBase, Field(discriminator="kind")]


class PythonSpec(_Spec):
    interpreter: str = "python3.11"
    """Interpreter the venv is made from: a name on the base's PATH or an absolute path in it."""
    install_project: bool = False
    """Editable install of the repository (``uv pip install -e /workspace[extras]``)."""
    extras: list[str] = Field(default_factory=list)
    """Extras of the editable install."""
    requirements_files: list[str] = Field(default_factory=list)
    """Requirements files to install, as paths inside the repository."""
    packages: list[str] = Field(default_factory=list)
    """Explicit requirement strings (``pytest>=8``, ``attrs==23.2.0``)."""
    exclude_newer: str | None = None
    """Resolve as of this moment: uv's ``--exclude-newer`` (an RFC 3339 UTC timestamp
    ``2024-03-01T12:00:00Z`` or a date ``2024-03-01``), so a repository of that era gets
    the test tools of its era; None = the newest releases."""

    @field_validator("exclude_newer")
    @classmethod
    def _moment(cls, v: str | None) -> str | None:
        if v is not None and not _MOMENT.fullmatch(v):
            raise ValueError(
                f"exclude_newer {v!r} is neither a date (2024-03-01) nor a UTC timestamp (2024-03-01T12:00:00Z)"
            )
        return v

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # Without a cut-off the spec dumps (and hashes) as it did before the field existed:
        # every python layer digest of such a spec stays what it was.
        d = handler(self)
        if isinstance(d, dict) and d.get("exclude_newer") is None:
            d.pop("exclude_newer", None)
        return d


class DirRepository(_Spec):
    kind: Literal["dir"] = "dir"
    """A local folder, copied as it is (without ``.git``)."""
    path: str
    """The folder (relative paths: to the spec file's folder)."""


class GitRepository(_Spec):
    kind: Literal["git"] = "git"
    """One commit of a git repository (a local checkout/mirror, or a URL git can clone);
    the layer holds the checkout without ``.git``."""
    url: str
    """Local path or URL of the repository (relative paths: to the spec file's folder)."""
    commit: str
    """Commit id (or any revision git resolves; a full 40-hex id needs no look-up)."""


class ArchiveRepository(_Spec):
    kind: Literal["archive"] = "archive"
    """A tar (plain, gz, bz2, xz) or zip archive, unpacked."""
    path: str
    """The archive (relative paths: to the spec file's folder)."""
    strip_components: int = Field(default=0, ge=0)
    """Leading path components dropped from every member (like ``tar --strip-components``)."""


class SdistRepository(_Spec):
    kind: Literal["sdist"] = "sdist"
    """A source distribution from the package index, unpacked without its top folder."""
    name: str
    """Distribution name on the index."""
    version: str
    """Exact version."""


RepositorySpec = Annotated[
    DirRepository | GitRepository | ArchiveRepository | SdistRepository, Field(discriminator="kind")
]


class EnvironmentSpec(_Spec):
    name: str
    """Name tasks refer to the environment by (not part of the digest)."""
    base: BaseSpec = Field(default_factory=HostBase)
    """Root filesystem under the layers."""
    python: PythonSpec | None = None
    """Virtual environment at ``/opt/kiln/venv``; None = none."""
    repository: RepositorySpec | None = None
    """What ``/workspace`` holds; None = an empty workspace."""
    setup: list[str] = Field(default_factory=list)
    """Shell commands run last in the build sandbox (cwd ``/workspace``, the venv on PATH,
    network on); a failing one fails the build."""

    # -- identity -------------------------------------------------------------------------

    def input_hashes(self) -> dict[str, str]:
        """Content hashes of the spec's inputs: ``base`` (an OCI archive's sha256) and
        ``repository`` (a folder's tree hash, an archive's sha256, a git commit id, or
        ``name==version`` of an sdist)."""
        out: dict[str, str] = {}
        if isinstance(self.base, OciBase):
            try:
                out["base"] = "sha256:" + file_sha256(Path(self.base.archive))
            except OSError as e:
                raise EnvironmentInputError("base", f"image archive: {e}") from e
        try:
            out.update(self._repository_hash())
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            raise EnvironmentInputError("repository", str(e)) from e
        return out

    def _repository_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        r = self.repository
        if isinstance(r, DirRepository):
            out["repository"] = "tree:" + tree_hash(Path(r.path))
        elif isinstance(r, ArchiveRepository):
            out["repository"] = "sha256:" + file_sha256(Path(r.path))
        elif isinstance(r, GitRepository):
            out["repository"] = "git:" + resolve_git_commit(r.url, r.commit)
        elif isinstance(r, SdistRepository):
            out["repository"] = f"sdist:{r.name}=={r.version}"
        return out

    def canonical(self) -> dict[str, Any]:
        """The spec as hashed: no name, no local paths (their content is in the inputs)."""
        d = self.model_dump(mode="json", exclude={"name"})
        if isinstance(self.base, OciBase):
            d["base"].pop("archive")
        if isinstance(self.repository, (DirRepository, ArchiveRepository)):
            d["repository"].pop("path")
        elif isinstance(self.repository, GitRepository):
            d["repository"].pop("url")
        return d

    def digest(self, inputs: Mapping[str, str] | None = None) -> str:
        """sha256 (hex) of the canonical spec and its inputs' content hashes
        (``input_hashes()`` when not given)."""
        if inputs is None:
            inputs = self.input_hashes()
        return sha256_json({"spec": self.canonical(), "inputs": dict(inputs)})


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tree_hash(root: Path, exclude: frozenset[str] = frozenset({".git"})) -> str:
    """Hash of a folder: every path (sorted), its type, permission bits, symlink target and
    bytes. Top-level names in ``exclude`` are skipped."""
    h = hashlib.sha256()
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")

    def walk(d: Path, rel: str) -> None:
        for name in sorted(os.listdir(d)):
            if not rel and name in exclude:
                continue
            p, r = d / name, f"{rel}{name}"
            st = os.lstat(p)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                h.update(f"L {r} {os.readlink(p)}\0".encode())
            elif stat.S_ISDIR(st.st_mode):
                h.update(f"D {r} {mode:o}\0".encode())
                walk(p, r + "/")
            elif stat.S_ISREG(st.st_mode):
                h.update(f"F {r} {mode:o} {file_sha256(p)}\0".encode())
            else:
                h.update(f"O {r} {stat.S_IFMT(st.st_mode):o}\0".encode())

    walk(root, "")
    return h.hexdigest()


_FULL_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def resolve_git_commit(url: str, rev: str) -> str:
    """The commit id ``rev`` names in ``url`` (no look-up for a full id)."""
    if _FULL_SHA.fullmatch(rev):
        return rev
    if Path(url).exists():
        out = subprocess.run(
            ["git", "-C", url, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True
        )
        if out.returncode == 0:
            return out.stdout.strip()
        raise ValueError(f"git: {rev!r} is no commit of {url}: {out.stderr.strip()}")
    out = subprocess.run(["git", "ls-remote", url, rev], capture_output=True, text=True, timeout=120)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()[0]
    raise ValueError(f"git: cannot resolve {rev!r} in {url}: {out.stderr.strip() or 'no such ref'}")


# -- files of specs -------------------------------------------------------------------------


def _absolutize(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    def fix(d: dict[str, Any] | None, key: str) -> None:
        if d and isinstance(d.get(key), str) and "://" not in d[key] and not d[key].startswith("git@"):
            d[key] = str((folder / os.path.expanduser(d[key])).resolve())

    spec = json.loads(json.dumps(spec))
    base, repo = spec.get("base"), spec.get("repository")
    if isinstance(base, dict) and base.get("kind") == "oci":
        fix(base, "archive")
    if isinstance(repo, dict):
        if repo.get("kind") in ("dir", "archive"):
            fix(repo, "path")
        elif repo.get("kind") == "git" and (folder / str(repo.get("url", ""))).exists():
            fix(repo, "url")
    return spec


def parse_environments(data: Mapping[str, Any], folder: Path) -> list[EnvironmentSpec]:
    """``environments = [...]`` of a TOML/JSON document; relative paths resolve in ``folder``."""
    items = data.get("environments", [])
    if not isinstance(items, list):
        raise ValueError("`environments` must be a list of tables ([[environments]])")
    specs = [EnvironmentSpec.model_validate(_absolutize(dict(e), folder)) for e in items]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate environment names in {names}")
    return specs


def load_environments(path: str | Path) -> list[EnvironmentSpec]:
    """Read ``[[environments]]`` specs from a TOML or JSON file."""
    path = Path(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    return parse_environments(data, path.resolve().parent)
