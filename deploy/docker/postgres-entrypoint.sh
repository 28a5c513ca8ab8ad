#!/bin/sh
# The official postgres image's contract, as far as kiln's compose file uses it:
# POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB create the cluster, the role and the
# database on the first start (an empty PGDATA volume); later starts reuse them. Local
# socket connections are trusted (pg_isready, the init below), TCP needs the password.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
as_pg() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pw="$(mktemp)"
    printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}" >"$pw"
    chown postgres "$pw"
    as_pg initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pw" --auth-local=trust \
        --auth-host=scram-sha-256 -E UTF8 --no-locale >/dev/null
    rm -f "$pw"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    as_pg pg_ctl -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
    if [ "$POSTGRES_DB" != postgres ]; then as_pg createdb -U "$POSTGRES_USER" "$POSTGRES_DB"; fi
    as_pg pg_ctl -D "$PGDATA" -w -m fast stop >/dev/null
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" -c listen_addresses='*' "$@"
