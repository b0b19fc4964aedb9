-- Demo catalog: CRASH-1 makes the worker handling it exit (DEMO_FAULTS=1), every time.
insert into stock (sku, available) values ('CRASH-1', 1000) on conflict (sku) do nothing;
