-- A job learns that its order.placed was published from the outbox row's own message id, which
-- the API records on the job in the same transaction, instead of from a field inside the row's
-- JSON headers (renaming that serde field silently stopped jobs from becoming `published`).
alter table jobs add column order_placed_message_id uuid;

-- Jobs written before this migration: their outbox row names them in its headers.
update jobs j
   set order_placed_message_id = o.message_id
  from outbox o
 where o.message_type = 'order.placed'
   and (o.headers ->> 'correlation_id')::uuid = j.id
   and j.order_placed_message_id is null;

create unique index jobs_order_placed_message_id on jobs (order_placed_message_id);

create or replace function outbox_marks_job_published() returns trigger language plpgsql as $$
begin
    if new.published_at is not null and old.published_at is null then
        update jobs
           set state = case when state = 'queued' then 'published' else state end,
               published_at = coalesce(published_at, new.published_at),
               updated_at = now()
         where order_placed_message_id = new.message_id;
    end if;
    return null;
end;
$$;
