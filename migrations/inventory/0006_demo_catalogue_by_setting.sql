-- The demo's catalogue is no longer the service's to seed (issue 42, decision 0025): the worker
-- writes it at start-up when DEMO_CATALOGUE is on (shop::demo::CATALOGUE). Remove the rows the
-- earlier migrations seeded that are as they were seeded, so that a deployment that is not a demo
-- has no products but its own. A SKU that a reservation names, or whose stock was changed
-- (restocked, reserved, sold), stays: its numbers are someone's.
--
-- Billing's 0006 decides for its prices apart, from its own invoices: a SKU reserved but never
-- invoiced keeps its stock here and may lose its price there. A database that served the demo
-- runs with DEMO_CATALOGUE on, which writes such a price again; without it, billing parks the
-- order with "no price", a job quarantined, not a silent stall.
delete from stock s
 using (values ('SKU-1', 1000), ('SKU-2', 1000), ('SKU-3', 500), ('SKU-4', 100), ('SKU-5', 10),
               ('FLAKY-1', 1000), ('POISON-1', 1000), ('CRASH-1', 1000), ('DECLINE-1', 1000),
               ('BILLPOISON-1', 1000)) as seeded (sku, available)
 where s.sku = seeded.sku
   and s.available = seeded.available
   and s.reserved = 0
   and s.settled = 0
   and not exists (select 1 from reservations r, jsonb_array_elements(r.lines) line where line->>'sku' = s.sku);
