-- Stock levels and the reservations made against them.

create table stock (
    sku        text    primary key,
    available  integer not null check (available >= 0),
    reserved   integer not null default 0 check (reserved >= 0)
);

-- One reservation per order: a second order.placed for the same order (even under another
-- message id) cannot reserve twice.
create table reservations (
    id          uuid        primary key,
    order_id    uuid        not null unique,
    job_id      uuid,
    lines       jsonb       not null,
    created_at  timestamptz not null default now()
);

-- Demo catalog: SKU-1..5 with stock, FLAKY-1 and POISON-1 for DEMO_FAULTS.
insert into stock (sku, available) values
    ('SKU-1', 1000), ('SKU-2', 1000), ('SKU-3', 500), ('SKU-4', 100), ('SKU-5', 10),
    ('FLAKY-1', 1000), ('POISON-1', 1000);
