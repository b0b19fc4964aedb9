-- An invoice stands until its order ends otherwise than invoiced, and is then void (issue 41,
-- decision 0023). A void that finds no invoice writes one already void, with no total and no
-- lines: a fence under the unique order_id, so that a late inventory.reserved invoices nothing.
alter table invoices
    add column state     text        not null default 'standing' check (state in ('standing', 'void')),
    add column voided_at timestamptz;

-- Demo catalog (DEMO_FAULTS=1): billing declines DECLINE-1, and fails on BILLPOISON-1 every time.
insert into prices (sku, unit_price_cents) values ('DECLINE-1', 1000), ('BILLPOISON-1', 1000)
    on conflict (sku) do nothing;
