#!/usr/bin/env bash
# One broker user per service, and one for the deploy step that declares the topology, each limited
# to its own queues and to the exchanges it binds to or publishes to (docs/operations.md, "Deploying against managed Postgres and RabbitMQ").
#
#   ops/rabbitmq/users.sh apply MANAGEMENT_URL VHOST    create or update the users and permissions
#   ops/rabbitmq/users.sh permissions                  print the table below
#   ops/rabbitmq/users.sh definitions                  the compose demo's definitions file
#                                                      (ops/rabbitmq/definitions.json)
#
# MANAGEMENT_URL is the management API as an administrator, e.g. https://admin:pw@mq:15671 (add
# `--cacert FILE` through CURL_CA_FILE if its certificate is not in the system's store). Each
# user's password is read from the file named by <USER>_PASSWORD_FILE (orders-api ->
# ORDERS_API_PASSWORD_FILE), else from <USER>_PASSWORD; a user with neither is refused. USER_PREFIX
# (empty by default) goes in front of every user name (the tests give each test its own users).
#
# What the regular expressions allow (RabbitMQ's configure / write / read, on queue and exchange
# names). `topology` is the deploy step's (`msgctl topology apply`, decision 0030): the only user
# that may declare, and so delete, the shared exchanges (`orders`, `inventory`, `billing`,
# `jobs`), and it declares every endpoint's queues and bindings before any service starts. Each
# consumer declares, binds, consumes and deletes only its endpoint's queues (`NAME` and `NAME.*`:
# work, wait tiers, parking, dead-lettered intake, probe, and its own direct exchange
# `NAME.direct`), binds its queues to the shared exchanges it reads, and publishes to `jobs` (job
# events) and to its direct exchange (retries and parking go to its own queues through it). A
# service looks the shared exchanges up with passive declares and waits, not ready, until the
# deploy step has declared them. RabbitMQ 3.10 answers a passive declare to anyone; 4.3 (and 4.2.6
# on) only to a user with some permission on the name, which each user has on what it looks up.
# Nobody may write to the default exchange (`amq.default`), on which RabbitMQ cannot tell one
# queue from another, so no consumer's user can put a message into another service's queue. The
# relay publishes to the shop's exchanges, and configures and reads nothing; its write on the
# endpoints' work queues is for its lookups of them (without read on an exchange it can bind
# nothing to them). The operator's `msgctl` reads parking queues, puts redriven
# messages back through each endpoint's direct exchange and publishes their job events; it and
# orders-api (the live page's parking depths) have the `management` tag, to list queues.
#
# Topic permissions narrow what each user may publish to the `jobs` topic exchange, by routing
# key: a consumer reports its own retries and parkings (`job.retry_scheduled`, `job.quarantined`),
# only the operator's `msgctl` ends or reopens a job (`job.abandoned`, `job.redriven`: the orders
# service cancels and compensates the order of a `job.abandoned`), and the relay only the
# `job.quarantined` of an outbox row it parks. The deploy step publishes none.
# Without them any service's user could end any order. RabbitMQ checks topic permissions on topic
# exchanges only, and a user with none on an exchange may publish any key there: each user of the
# table below has one on `jobs`. RabbitMQ 4.x takes a topic permission only on an exchange that
# exists, so `apply` and the demo's definitions declare each such exchange first, as the deploy step
# declares it (topic, durable). The demo's definitions declare all four shared exchanges, so that
# the demo's broker boots with them.
set -euo pipefail

# user                configure                                    write                                  read
permissions() {
    cat <<'TABLE'
topology           ^(orders|inventory|billing|jobs|(orders\.status|inventory\.order-placed|billing\.inventory-reserved)(\..*)?)$  ^(orders\.status|inventory\.order-placed|billing\.inventory-reserved)(\..*)?$  ^(orders|inventory|billing|jobs|(orders\.status|inventory\.order-placed|billing\.inventory-reserved)(\..*)?)$
orders-api         ^orders\.status(\..*)?$  ^(orders\.status(\..*)?|jobs)$  ^(orders\.status(\..*)?|orders|inventory|billing|jobs)$
inventory-worker   ^inventory\.order-placed(\..*)?$  ^(inventory\.order-placed(\..*)?|jobs)$  ^(inventory\.order-placed(\..*)?|orders|jobs)$
billing-worker     ^billing\.inventory-reserved(\..*)?$  ^(billing\.inventory-reserved(\..*)?|jobs)$  ^(billing\.inventory-reserved(\..*)?|orders|inventory|jobs)$
relay              ^$  ^(orders|inventory|billing|jobs|orders\.status|inventory\.order-placed|billing\.inventory-reserved)$  ^$
msgctl             ^$  ^(.*\.direct|jobs)$  ^.*\.parking$
TABLE
}

# user               exchange  write                                  read
topic_permissions() {
    cat <<'TABLE'
topology           jobs  ^$  .*
orders-api         jobs  ^job\.(retry_scheduled|quarantined)$  .*
inventory-worker   jobs  ^job\.(retry_scheduled|quarantined)$  .*
billing-worker     jobs  ^job\.(retry_scheduled|quarantined)$  .*
relay              jobs  ^job\.quarantined$  .*
msgctl             jobs  ^job\.(redriven|abandoned)$  .*
TABLE
}

json_string() { python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; }

password_of() { # user
    local var
    var=$(echo "$1" | tr 'a-z-' 'A-Z_')_PASSWORD
    local file_var="${var}_FILE"
    if [ -n "${!file_var:-}" ]; then
        tr -d '\n' <"${!file_var}"
    elif [ -n "${!var:-}" ]; then
        printf '%s' "${!var}"
    else
        echo "users.sh: no password for $1: set $file_var (or $var)" >&2
        return 1
    fi
}

apply() { # management-url vhost
    local api=${1%/} vhost=$2 user configure write read password
    local vhost_path
    vhost_path=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$vhost")
    local curl=(curl -sS --fail-with-body -H 'content-type: application/json')
    [ -z "${CURL_CA_FILE:-}" ] || curl+=(--cacert "$CURL_CA_FILE")
    while read -r user configure write read; do
        password=$(password_of "$user")
        user="${USER_PREFIX:-}$user"
        # The API's user reads parking depths for the live page through the management API.
        local tags=""
        case "${user#"${USER_PREFIX:-}"}" in orders-api | msgctl) tags=management ;; esac
        "${curl[@]}" -X PUT "$api/api/users/$user" \
            -d "{\"password\": $(json_string "$password"), \"tags\": \"$tags\"}" >/dev/null
        "${curl[@]}" -X PUT "$api/api/permissions/$vhost_path/$user" \
            -d "{\"configure\": $(json_string "$configure"), \"write\": $(json_string "$write"), \"read\": $(json_string "$read")}" >/dev/null
        echo "users.sh: $user on vhost $vhost: configure $configure, write $write, read $read"
    done < <(permissions)
    local exchange
    for exchange in $(topic_permissions | awk '{ print $2 }' | sort -u); do
        "${curl[@]}" -X PUT "$api/api/exchanges/$vhost_path/$exchange" \
            -d '{"type": "topic", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}' >/dev/null
    done
    while read -r user exchange write read; do
        user="${USER_PREFIX:-}$user"
        "${curl[@]}" -X PUT "$api/api/topic-permissions/$vhost_path/$user" \
            -d "{\"exchange\": $(json_string "$exchange"), \"write\": $(json_string "$write"), \"read\": $(json_string "$read")}" >/dev/null
        echo "users.sh: $user on exchange $exchange of vhost $vhost: publishes $write"
    done < <(topic_permissions)
}

# The demo's broker, loaded at boot (ops/rabbitmq/20-shop.conf): the vhost, `guest` as the
# administrator for the management UI, and the service users, each with its name as its password
# (orders-api's and msgctl's with the `management` tag, as `apply` gives it).
# The salts are derived from the names so that the file is reproducible: demo passwords only.
definitions() {
    { permissions; echo "--"; topic_permissions; } | python3 -c '
import base64, hashlib, json, sys
def password_hash(user, password):
    salt = hashlib.sha256(user.encode()).digest()[:4]
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()
users = [{"name": "guest", "password_hash": password_hash("guest", "guest"),
          "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["administrator"], "limits": {}}]
permissions = [{"user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}]
lines = sys.stdin.read().splitlines()
split = lines.index("--")
topic_permissions = []
# The shared exchanges, as the deploy step declares them (shop::topology::shop, checked by the tests of msgctl
# tests): the demo broker boots with them, so that services whose users may not declare them start.
exchanges = [{"name": name, "vhost": "/", "type": "topic", "durable": True, "auto_delete": False,
              "internal": False, "arguments": {}} for name in ("orders", "inventory", "billing", "jobs")]
for line in lines[split + 1:]:
    user, exchange, write, read = line.split()
    topic_permissions.append({"user": user, "vhost": "/", "exchange": exchange, "write": write, "read": read})
    if exchange not in [known["name"] for known in exchanges]:
        exchanges.append({"name": exchange, "vhost": "/", "type": "topic", "durable": True, "auto_delete": False,
                          "internal": False, "arguments": {}})
for line in lines[:split]:
    user, configure, write, read = line.split()
    tags = ["management"] if user in ("orders-api", "msgctl") else []
    users.append({"name": user, "password_hash": password_hash(user, user),
                  "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": tags, "limits": {}})
    permissions.append({"user": user, "vhost": "/", "configure": configure, "write": write, "read": read})
print(json.dumps({"vhosts": [{"name": "/"}], "users": users, "permissions": permissions,
                  "exchanges": exchanges, "topic_permissions": topic_permissions}, indent=2))
'
}

case "${1:-}" in
definitions) definitions ;;
apply) apply "${2:?management URL}" "${3:?vhost}" ;;
permissions) permissions ;;
*) echo "usage: $0 apply MANAGEMENT_URL VHOST | permissions | definitions" >&2; exit 2 ;;
esac
