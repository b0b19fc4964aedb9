#!/bin/sh
# The compose demo's Postgres, at its first start (/docker-entrypoint-initdb.d): each service's
# database and roles, made by the script a DBA runs (ops/postgres/roles.sql). The demo's server
# trusts every connection, so no password is set; a real deployment sets them (docs/operations.md).
set -e
for service in orders inventory billing; do
    psql -v ON_ERROR_STOP=1 -q -U postgres -d postgres -v service="$service" -v relay=relay -f /shop/roles.sql
done
