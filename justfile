# Everyday commands. `just --list` shows them.

export DATABASE_URL := env_var_or_default("DATABASE_URL", "postgres://postgres@127.0.0.1:5432")
export AMQP_URL := env_var_or_default("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672")

# Run the whole suite against the servers named by DATABASE_URL and AMQP_URL.
test:
    cargo test --workspace

# Formatting and lints, as CI runs them.
lint:
    cargo fmt --all --check
    cargo clippy --workspace --all-targets -- -D warnings

# The soak: 5,000 orders while services are killed and connections cut; prints the ledger.
chaos orders="5000" kills="24" cuts="12":
    cargo build --bins
    cargo run -p testkit --bin chaos -- --orders {{orders}} --kills {{kills}} --cuts {{cuts}}

# The soak on the three-node cluster of .ci/rabbitmq-cluster (started here; needs root for its
# network namespaces): two instances of every service, and each node fault (the leader of a work
# queue killed, a node stopped, a node partitioned) `faults` times besides the service faults;
# `outages` times two nodes of three killed (one back after 10 to 20 s) and a memory alarm held.
# Prints the ledger and how long each kind of fault took to ride out.
chaos-cluster orders="20000" faults="20" rate="7" outages="5":
    cargo build --bins
    bash .ci/rabbitmq-cluster start
    eval "$(bash .ci/rabbitmq-cluster env)" && cargo run -p testkit --bin chaos -- --orders {{orders}} --rate {{rate}} \
        --instances 2 --kills 24 --cuts 12 --node-kills {{faults}} --node-stops {{faults}} --partitions {{faults}} \
        --quorum-losses {{outages}} --alarms {{outages}}

# The benchmark: the servers' limits and every stage, in one run, on release builds.
bench *args:
    cargo build --release --bins
    cargo run --release -p bench -- {{args}}

# The benchmark against RabbitMQ 4.3 on three nodes (.ci/rabbitmq-cluster: each quorum queue
# replicated to all three), Postgres as above; `just bench-rabbitmq43` is the same broker on one
# node (.ci/rabbitmq4), to compare with. Both start their brokers as root (network namespaces,
# chroots).
bench-cluster *args:
    cargo build --release --bins
    bash .ci/rabbitmq-cluster start
    eval "$(bash .ci/rabbitmq-cluster env)" && cargo run --release -p bench -- {{args}}

bench-rabbitmq43 *args:
    cargo build --release --bins
    bash .ci/rabbitmq4 4.3 start
    eval "$(bash .ci/rabbitmq4 4.3 env)" && cargo run --release -p bench -- {{args}}

# 1,000 clients sending their headers a byte a second against the API, beside ordinary orders.
slow-clients clients="1000":
    cargo build --release --bins
    cargo run --release -p bench --bin slow_clients -- --clients {{clients}}

# Restart the local RabbitMQ mid-burst (disturbs anything else using it).
broker-restart:
    cargo build --bins
    cargo test -p testkit --test broker_restart -- --ignored

# The earlier releases of ops/releases.tsv (built once, .ci/releases) upgraded to this build
# under load, and the migrations' locks on tables of a million rows.
upgrade:
    cargo build --bins
    RELEASES_DIR=$(bash .ci/releases) cargo test -p testkit --test upgrade -- --ignored --nocapture --test-threads=1

# Inventory's database read-only past the alerts' setting (about six minutes): a real Prometheus
# (Debian's `prometheus`, or PROMETHEUS) with ops/prometheus/alerts.yml pages, and resolves after.
stall-alerts:
    cargo build --bins
    cargo test -p testkit --test stall_alerts -- --ignored --nocapture

# What CI runs (starts the local servers if they are down).
ci:
    bash .ci/run

# Every service locally against existing servers, with the demo faults on; Ctrl-C stops them all.
dev:
    #!/usr/bin/env bash
    set -euo pipefail
    # A workspace build: the test kit's features are on (the demo's faults, decision 0025). The
    # binaries are run as built, not each through `cargo run -p X`, which would build X alone,
    # without them.
    cargo build --bins
    bin="${CARGO_TARGET_DIR:-target}/debug"
    base="${DATABASE_URL%/}"
    trap 'kill 0' EXIT INT TERM
    # The demo's key and tokens (ops/demo-tokens.env: `-H "Authorization: Bearer $DEMO_TOKEN"`), and
    # the books read with your own user, as there is no `books` role here.
    source ops/demo-tokens.env
    DATABASE_URL="$base/orders" AMQP_URL="$AMQP_URL/%2f" HTTP_ADDR=127.0.0.1:8080 AUTH_JWT_KEY="$DEMO_AUTH_JWT_KEY" \
        BOOKS_INVENTORY_URL="$base/inventory" BOOKS_BILLING_URL="$base/billing" "$bin/orders-api" &
    DATABASE_URL="$base/inventory" AMQP_URL="$AMQP_URL/%2f" HTTP_ADDR=127.0.0.1:8081 DEMO_FAULTS=1 DEMO_CATALOGUE=1 "$bin/inventory-worker" &
    DATABASE_URL="$base/billing" AMQP_URL="$AMQP_URL/%2f" HTTP_ADDR=127.0.0.1:8082 DEMO_FAULTS=1 DEMO_CATALOGUE=1 "$bin/billing-worker" &
    DATABASE_URL="$base/orders,$base/inventory,$base/billing" AMQP_URL="$AMQP_URL/%2f" HTTP_ADDR=127.0.0.1:8083 "$bin/relay" &
    wait

# The live demo in containers: Postgres, RabbitMQ with its management UI, every service,
# Prometheus; then open http://127.0.0.1:8080/. `docker compose down -v` ends it.
demo:
    docker compose up --build --wait

# The demo, checked: `up --build --wait`, the walk-through, the page in Chromium, Prometheus's
# rules and queries; always ends with `docker compose down -v`. `just demo-check --mirror` is how
# CI runs it without a registry: every image pulled through a local mirror of stand-ins.
demo-check *flags:
    bash scripts/demo {{flags}}

# Place a demo order against a running API (`just order SKU-1 2`), as the demo's customer.
order sku="SKU-1" quantity="1":
    . ops/demo-tokens.env && curl -si -X POST 127.0.0.1:8080/orders -H 'Content-Type: application/json' \
        -H "Authorization: Bearer $DEMO_TOKEN" \
        -d '{"customerId":"demo","lines":[{"sku":"{{sku}}","quantity":{{quantity}}}]}'
