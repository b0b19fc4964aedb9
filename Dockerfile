# One image with the four service binaries and `msgctl`; compose picks the binary per service
# (`command`), `docker compose run --rm msgctl …` operates parking and the outboxes with the
# operator's accounts, and `docker run reliable-orders:local` starts the API. Needs BuildKit (`RUN --mount`): compose v2
# uses it; for `docker build`, set DOCKER_BUILDKIT=1.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# Only what the image ships: not the test kit, the bench or the soak (a cold build of everything
# takes 2.5 times as long). FEATURES: none by default, a production build; the demo's compose file
# passes `shop-demo/demo-faults`, the demo's fault SKUs (decision 0025). No build of the image has the
# fault suite's failpoints.
ARG FEATURES=""
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p orders-api -p relay -p inventory-worker -p billing-worker -p msgctl --bins \
        --features "$FEATURES" \
    && mkdir /out \
    && cp target/release/orders-api target/release/relay target/release/inventory-worker target/release/billing-worker \
       target/release/msgctl /out/

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 shop
# The system's CA certificates, which TLS to managed Postgres, RabbitMQ and collectors trusts
# besides any CA file a URL names (docs/operations.md); the build image has Debian's bundle.
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/ /usr/local/bin/
USER shop
CMD ["orders-api"]
