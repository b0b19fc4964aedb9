# One image with every binary; compose picks the binary per service.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
    && mkdir /out \
    && cp target/release/orders-api target/release/relay target/release/inventory-worker target/release/billing-worker /out/

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 shop
COPY --from=build /out/ /usr/local/bin/
USER shop
