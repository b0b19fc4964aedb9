-- What an upgrade from a release before the saga (issue 41, decision 0023) leaves to do (issue 56,
-- row 3). Before it, no order was announced at its end and none had a deadline, and inventory's
-- 0005 made every reservation `held`. So each order placed before this database took 0010 (the
-- saga's migration) and not rejected (inventory took nothing for it) is owed something:
--   `ended`     invoiced: its `order.ended` (invoiced), for inventory to settle its reservation;
--   `deadline`  not ended yet (in flight, or parked and never redriven): an `order.deadline`,
--               `ORDER_DEADLINE` from when it is sent, which ends it (cancelled, its stock given
--               back) unless it ends first.
-- The orders service sends them at start-up, a batch at a time, deleting each row in the
-- transaction that writes its message (upgrade.rs). On a database created at or after 0010 the
-- table stays empty. Where the database went through a release of the saga first, an order
-- placed before 0010 and invoiced after it was announced then, and is announced once more:
-- inventory settles only a held reservation, and every consumer of `order.ended` keys its effect
-- by the order (shipping's unique `order_id`). This reads orders and jobs and writes only its own
-- table: no write waits for it.
create table upgrade_backlog (
    order_id uuid primary key,
    job_id   uuid not null,
    owed     text not null check (owed in ('ended', 'deadline'))
);

insert into upgrade_backlog (order_id, job_id, owed)
select distinct on (o.id) o.id, j.id, case when o.status = 'invoiced' then 'ended' else 'deadline' end
  from orders o
  join jobs j on j.order_id = o.id
 where o.created_at < (select installed_on from _sqlx_migrations where version = 10)
   and o.status not in ('rejected', 'declined', 'cancelled')
 order by o.id, j.created_at desc;
