-- The demo's catalogue is no longer the service's to seed (issue 42, decision 0025): the worker
-- writes it at start-up when DEMO_CATALOGUE is on (shop::demo::CATALOGUE). Remove the prices the
-- earlier migrations seeded that no invoice names, so that a deployment that is not a demo has no
-- products but its own.
delete from prices p
 where p.sku in ('SKU-1', 'SKU-2', 'SKU-3', 'SKU-4', 'SKU-5', 'FLAKY-1', 'POISON-1', 'CRASH-1', 'DECLINE-1',
                 'BILLPOISON-1')
   and not exists (select 1 from invoices i, jsonb_array_elements(i.lines) line where line->>'sku' = p.sku);
