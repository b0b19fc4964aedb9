-- no-transaction
-- The books' check of invoiced orders whose stock was given back anyway (shop::books,
-- `invoiced_but_released`, issue 56) reads the released reservations of its window: few (one per
-- order that ended otherwise), among every reservation ever made. Built without blocking writes to
-- a large table (CONCURRENTLY, so outside a transaction); an interrupted build leaves an invalid
-- index, which `drop index concurrently reservations_released` clears for the next start.
create index concurrently if not exists reservations_released on reservations (ended_at) where state = 'released';
