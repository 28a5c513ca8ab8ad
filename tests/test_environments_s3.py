"""Environment layers shared between nodes through S3 (issue 22): ``S3LayerStore`` round trip
between two caches, a corrupted object refused before unpacking, a missing digest, the
settings and the store the node picks from them.

The S3 endpoint is moto's server mode (``ThreadedMotoServer``) on 127.0.0.1: an HTTP server
that speaks the S3 REST API. The client under test is the real boto3 over HTTP (signing,
head/put/get, the transfer manager's uploads and downloads), with credentials from the
standard AWS chain (environment variables), as a node would use against AWS, MinIO or Ceph."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3", reason="boto3 is env-pool's [s3] extra (scripts/setup.sh installs it)")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is in requirements-dev.txt")

from pydantic import ValidationError  # noqa: E402
from test_environments import check_tree, make_repo  # noqa: E402

from kiln.envpool.config import EnvPoolSettings  # noqa: E402
from kiln.envpool.environments import EnvironmentCache, LayerIntegrityError, S3LayerStore  # noqa: E402
from kiln.envpool.environments.s3 import SHA256_KEY  # noqa: E402
from kiln.shared.environments import EnvironmentSpec  # noqa: E402

BUCKET = "kiln-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, tmp_path, monkeypatch):
    """Credentials through the standard chain (environment), no host AWS files; a fresh bucket."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for obj in client.list_objects_v2(Bucket=BUCKET).get("Contents", []) if _exists(client) else []:
        client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    if not _exists(client):
        client.create_bucket(Bucket=BUCKET)
    return client


def _exists(client) -> bool:
    return any(b["Name"] == BUCKET for b in client.list_buckets().get("Buckets", []))


def store(endpoint: str, prefix: str = "kiln/environments") -> S3LayerStore:
    return S3LayerStore(BUCKET, prefix, endpoint_url=endpoint, region="us-east-1")


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: kind, permission bits, bytes or link target."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes())
    return out


def dir_spec(tmp_path: Path) -> EnvironmentSpec:
    repo = make_repo(tmp_path / "repo")
    (repo / "nested" / "deeper").mkdir(parents=True)
    (repo / "nested" / "deeper" / "big.bin").write_bytes(os.urandom(1 << 20))  # incompressible
    (repo / "nested" / "empty").mkdir()
    (repo / "link").symlink_to("nested/deeper/big.bin")
    return EnvironmentSpec.model_validate({"name": "dir-env", "repository": {"kind": "dir", "path": str(repo)}})


async def test_layers_round_trip_through_s3(tmp_path, s3, s3_endpoint):
    spec = dir_spec(tmp_path)
    a = EnvironmentCache(tmp_path / "node-a", budget_bytes=10 << 30, store=store(s3_endpoint))
    built = await a.get(spec)
    assert a.builds == 1
    await a.published()  # stored in the background: the first sandbox does not wait for it
    sa = store(s3_endpoint)
    for layer in built.layers:
        assert await sa.has(layer.digest)
        head = s3.head_object(Bucket=BUCKET, Key=f"kiln/environments/{layer.digest}.tar.gz")
        assert len(head["Metadata"][SHA256_KEY]) == 64

    b = EnvironmentCache(tmp_path / "node-b", budget_bytes=10 << 30, store=store(s3_endpoint))
    fetched = await b.get(spec)
    assert b.builds == 0 and b.fetches == len(built.layers)
    assert fetched.digest == built.digest
    for la, lb in zip(built.layers, fetched.layers):
        assert la.digest == lb.digest and la.path != lb.path
        assert tree(lb.path) == tree(la.path)
    check_tree(fetched.layer("repository").path / "workspace")

    # put is a no-op when the layer is there: the object is not written again
    key = f"kiln/environments/{built.layers[0].digest}.tar.gz"
    etag = s3.head_object(Bucket=BUCKET, Key=key)["ETag"]
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"placeholder", Metadata={SHA256_KEY: "0" * 64})
    await sa.put(built.layers[0].digest, built.layers[0].path)
    assert s3.head_object(Bucket=BUCKET, Key=key)["ETag"] != etag, "not overwritten by a second put"
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"placeholder"


async def test_multipart_upload_and_download(tmp_path, s3, s3_endpoint):
    """A layer above the transfer manager's 8 MiB threshold goes up and down in parts."""
    layer = tmp_path / "layer"
    layer.mkdir()
    (layer / "big.bin").write_bytes(os.urandom(12 << 20))
    st = store(s3_endpoint, prefix="/multi/")
    await st.put("a" * 64, layer)
    head = s3.head_object(Bucket=BUCKET, Key=f"multi/{'a' * 64}.tar.gz")
    assert "-" in head["ETag"], "a multipart upload's ETag names its parts"
    assert await st.fetch("a" * 64, tmp_path / "out")
    assert tree(tmp_path / "out") == tree(layer)


async def test_corrupted_object_is_an_error_naming_the_digest(tmp_path, s3, s3_endpoint):
    spec = dir_spec(tmp_path)
    a = EnvironmentCache(tmp_path / "node-a", budget_bytes=10 << 30, store=store(s3_endpoint))
    built = await a.get(spec)
    await a.published()
    digest = built.layers[0].digest
    key = f"kiln/environments/{digest}.tar.gz"
    meta = s3.head_object(Bucket=BUCKET, Key=key)["Metadata"]
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"not the layer that was stored", Metadata=meta)

    st = store(s3_endpoint)
    with pytest.raises(LayerIntegrityError, match=f"layer {digest}: .*sha256") as e:
        await st.fetch(digest, tmp_path / "dest")
    assert "stored as " + meta[SHA256_KEY] in str(e.value)
    assert not (tmp_path / "dest").exists(), "nothing unpacked"

    s3.put_object(Bucket=BUCKET, Key=key, Body=b"no checksum at all")
    with pytest.raises(LayerIntegrityError, match=f"layer {digest}: .*no {SHA256_KEY} checksum"):
        await st.fetch(digest, tmp_path / "dest")

    # the cache does not take a corrupted layer for a fetched one: it builds it instead
    b = EnvironmentCache(tmp_path / "node-b", budget_bytes=10 << 30, store=st)
    rebuilt = await b.get(spec)
    assert b.fetches == 0 and b.builds == 1
    assert tree(rebuilt.layers[0].path) == tree(built.layers[0].path)


async def test_missing_digest_is_false(tmp_path, s3, s3_endpoint):
    st = store(s3_endpoint)
    assert not await st.has("0" * 64)
    assert await st.fetch("0" * 64, tmp_path / "nothing") is False
    assert not (tmp_path / "nothing").exists()


def test_settings_pick_the_store(s3, s3_endpoint):
    from kiln.envpool.environments import NatsLayerStore
    from kiln.envpool.main import layer_store

    with pytest.raises(ValidationError, match='store.kind = "s3" needs envpool.environments.store.bucket'):
        EnvPoolSettings(environments={"store": {"kind": "s3"}})
    s = EnvPoolSettings(
        environments={"store": {"kind": "s3", "bucket": BUCKET, "endpoint_url": s3_endpoint, "prefix": "p/"}}
    )
    picked = layer_store(s, js=None)
    assert isinstance(picked, S3LayerStore) and picked.key("d") == "p/d.tar.gz"
    assert picked.client.meta.endpoint_url == s3_endpoint
    assert isinstance(layer_store(EnvPoolSettings(), js=object()), NatsLayerStore)
    assert layer_store(EnvPoolSettings(environments={"store": {"kind": "none"}}), js=None) is None
    with pytest.raises(ValueError, match="needs a bucket"):
        S3LayerStore("")
