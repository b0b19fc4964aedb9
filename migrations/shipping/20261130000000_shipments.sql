-- One shipment per order: a second invoice.created for the same order cannot ship twice.
create table shipments (
    id          uuid        primary key,
    order_id    uuid        not null unique,
    job_id      uuid,
    created_at  timestamptz not null default now()
);
