-- The demo's catalogue is no longer the service's to seed (issue 42, decision 0025): the worker
-- writes it at start-up when DEMO_CATALOGUE is on (shop::demo::CATALOGUE). Remove the prices the
-- earlier migrations seeded that are as they were seeded and that no invoice names, so that a
-- deployment that is not a demo has no products but its own. (Inventory's 0006 decides for its
-- stock apart; see there.)
delete from prices p
 using (values ('SKU-1', 1299), ('SKU-2', 2500), ('SKU-3', 499), ('SKU-4', 10000), ('SKU-5', 75),
               ('FLAKY-1', 1000), ('POISON-1', 1000), ('CRASH-1', 1000), ('DECLINE-1', 1000),
               ('BILLPOISON-1', 1000)) as seeded (sku, unit_price_cents)
 where p.sku = seeded.sku
   and p.unit_price_cents = seeded.unit_price_cents
   and not exists (select 1 from invoices i, jsonb_array_elements(i.lines) line where line->>'sku' = p.sku);
