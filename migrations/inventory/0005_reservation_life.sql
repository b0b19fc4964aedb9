-- A reservation has a life (issue 41, decision 0023): `held` while its order runs, then `settled`
-- once the order is invoiced (the stock is sold) or `released` once it ended otherwise (the stock
-- is back). A release that finds no reservation writes one already `released`, with no lines: a
-- fence under the unique order_id, so that a late order.placed reserves nothing.
alter table reservations
    add column state    text        not null default 'held' check (state in ('held', 'settled', 'released')),
    add column ended_at timestamptz;

-- `reserved` is the stock held by reservations; `settled`, what settled reservations took. So
-- available + reserved + settled is what the SKU started with, or was restocked to.
alter table stock add column settled integer not null default 0 check (settled >= 0);

-- Demo catalog (DEMO_FAULTS=1): billing declines DECLINE-1, and fails on BILLPOISON-1 every time,
-- after inventory has reserved it.
insert into stock (sku, available) values ('DECLINE-1', 1000), ('BILLPOISON-1', 1000) on conflict (sku) do nothing;

-- For the books' check (shop::books): the held reservations, the running orders' (few).
create index reservations_held on reservations (created_at) where state = 'held';
