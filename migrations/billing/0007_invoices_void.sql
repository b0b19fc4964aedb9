-- no-transaction
-- The books' check of invoiced orders whose invoice was voided anyway (shop::books,
-- `invoiced_but_void`, issue 56) reads the void invoices of its window: few (one per order that
-- ended otherwise after reaching billing), among every invoice ever made. Built without blocking
-- writes to a large table (CONCURRENTLY, so outside a transaction); an interrupted build leaves an
-- invalid index, which `drop index concurrently invoices_void` clears for the next start.
create index concurrently if not exists invoices_void on invoices (voided_at) where state = 'void';
