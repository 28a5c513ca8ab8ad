"""Print the Secrets the manifests of deploy/k8s read, with fresh random values:

    python deploy/k8s/make_secrets.py --database-url 'postgresql://kiln:PW@db.example:5432/kiln' \\
        | kubectl -n kiln create -f -

- ``kiln-nats-<user>`` (keys ``user``, ``password``): one NATS credential per service,
  as ``kiln run`` makes for a local run (``kiln.shared.bus.auth``); each kiln pod reads its
  own as ``KILN_NATS__USER``/``KILN_NATS__PASSWORD``, the NATS server reads them all
  (nats-values.yaml), and ``launcher`` is the operator's (``kiln`` commands);
- ``kiln-metrics``, ``kiln-weights-http``, ``kiln-dashboard`` (key ``token``): bearer
  tokens of the metrics endpoints (and env-pool's operator API), of the weights HTTP API,
  of the dashboard;
- ``kiln-database`` (key ``url``): the PostgreSQL URL, given, not generated;
- ``kiln-ray`` (key ``auth_token``, KubeRay's name): the Ray cluster's auth token (``ray/``).

``kubectl create`` refuses to overwrite: a second run would change credentials the
running NATS servers and pods still hold. Only the standard library: no kiln needed.
"""

from __future__ import annotations

import argparse
import json
import secrets

NATS_USERS = ("launcher", "env-pool", "weights", "reward", "rollout", "learner")
"""``kiln.shared.bus.auth``'s admin user and every service's (tests/test_k8s.py checks)."""
TOKENS = ("kiln-metrics", "kiln-weights-http", "kiln-dashboard")


def _secret(name: str, data: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": "kiln", "labels": {"app.kubernetes.io/part-of": "kiln"}},
        "stringData": data,
    }


def generate(database_url: str) -> list[dict]:
    out = [_secret(f"kiln-nats-{u}", {"user": u, "password": secrets.token_urlsafe(24)}) for u in NATS_USERS]
    out += [_secret(name, {"token": secrets.token_hex(32)}) for name in TOKENS]  # hex: fine in any header or tool
    # KubeRay's authOptions.secretName reads the token under this key.
    out.append(_secret("kiln-ray", {"auth_token": secrets.token_hex(32)}))
    out.append(_secret("kiln-database", {"url": database_url}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", required=True, help="postgresql://USER:PASSWORD@HOST:5432/DB")
    args = p.parse_args()
    # JSON documents are YAML; kubectl reads the stream.
    print("\n---\n".join(json.dumps(s, indent=2) for s in generate(args.database_url)))


if __name__ == "__main__":
    main()
