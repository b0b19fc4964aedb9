-- Messages with a deliver-at time (`Outgoing::at`: an order's deadline, decision 0023) wait
-- unpublished until it comes, possibly for hours. In the index of unpublished rows, which the
-- relay's claim walks in id order, every one of them would be walked past on every claim: they
-- are `scheduled`, and wait in an index of their own, by due time.
--
-- Upgrading: the index of unpublished rows is rebuilt, which reads the whole table once and
-- blocks writes to it meanwhile (about a second per million rows kept here).
alter table outbox add column scheduled boolean not null default false;
create index outbox_scheduled on outbox (available_at) where published_at is null and scheduled;
drop index outbox_unpublished;
create index outbox_unpublished on outbox (id) where published_at is null and not scheduled;
