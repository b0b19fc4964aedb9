-- The demo's catalogue is no longer the service's to seed (issue 42, decision 0025): the worker
-- writes it at start-up when DEMO_CATALOGUE is on (shop::demo::CATALOGUE). Remove the rows the
-- earlier migrations seeded that nothing has used, so that a deployment that is not a demo has no
-- products but its own. A SKU that was ever reserved, settled or named by a reservation stays: its
-- numbers are the books' (available + reserved + settled).
delete from stock s
 where s.sku in ('SKU-1', 'SKU-2', 'SKU-3', 'SKU-4', 'SKU-5', 'FLAKY-1', 'POISON-1', 'CRASH-1', 'DECLINE-1',
                 'BILLPOISON-1')
   and s.reserved = 0
   and s.settled = 0
   and not exists (select 1 from reservations r, jsonb_array_elements(r.lines) line where line->>'sku' = s.sku);
