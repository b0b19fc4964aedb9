-- Prices and the invoices made from them.

create table prices (
    sku               text   primary key,
    unit_price_cents  bigint not null check (unit_price_cents >= 0)
);

-- One invoice per order: a second inventory.reserved for the same order cannot bill twice.
create table invoices (
    id           uuid        primary key,
    order_id     uuid        not null unique,
    job_id       uuid,
    total_cents  bigint      not null,
    lines        jsonb       not null,
    created_at   timestamptz not null default now()
);

-- Demo catalog: the same SKUs as inventory.
insert into prices (sku, unit_price_cents) values
    ('SKU-1', 1299), ('SKU-2', 2500), ('SKU-3', 499), ('SKU-4', 10000), ('SKU-5', 75),
    ('FLAKY-1', 1000), ('POISON-1', 1000);
