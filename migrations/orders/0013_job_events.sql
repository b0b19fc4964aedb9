-- One job's story (issue 57, `GET /jobs/{id}/events`): every step the orders database learns of,
-- in the order it learns them. Written in the transaction of what it records (the status
-- consumer's event, an end decided by a cancel or an event, the relay's mark of `order.placed`:
-- the trigger below), so a row exists exactly when its step was applied, and never updated. Being
-- accepted is read from the job's own row (`created_at`): `POST /orders` writes nothing more, and
-- a job from before this migration still shows it.
create table job_events (
    id          bigint      generated always as identity primary key,
    -- No foreign key: its check would take a KEY SHARE lock on the job's row before the status
    -- consumer's FOR UPDATE of it, and two events of one job applied at once would deadlock. Rows
    -- are written only for a job that exists (`story::record`), and jobs are never deleted.
    job_id      uuid        not null,
    at          timestamptz not null default clock_timestamp(),
    -- What happened (`orders_api::story::Kind`).
    kind        text        not null,
    -- The step's endpoint (`inventory.order-placed`, `outbox:…`), where it is one step's.
    endpoint    text,
    -- The attempt that failed or was parked.
    attempt     integer,
    -- A retry's next attempt is due then (the wait tier it went to).
    due_at      timestamptz,
    -- The reason, error or result, for people.
    detail      text,
    -- The trace of the work that recorded it (W3C, 32 hex digits): the order's own, or a cancel's.
    trace_id    text,
    -- The message applied, where a message was.
    message_id  uuid
);
create index job_events_job on job_events (job_id, id);

-- The order's trace (W3C, 32 hex digits), from the `traceparent` its `order.placed` was written
-- with: the timeline links to it, and its first two steps carry it. Null for a job from before
-- this migration. Adding a nullable column without a default rewrites nothing.
alter table jobs add column trace_id text;

-- The relay's mark records the job's `published` step, once: a row is marked published once, and
-- a republished copy (a confirm whose mark was lost) finds it marked. Otherwise as in 0011.
create or replace function outbox_marks_jobs_published() returns trigger
    language plpgsql security definer set search_path = public, pg_temp as $$
begin
    with just as (
        select message_id, max(published_at) as published_at
          from (select message_id, published_at from marked where published_at is not null
                union all
                select message_id, null::timestamptz from unmarked where published_at is null) as sides
         group by message_id
        having count(*) = 2
    ), moved as (
        update jobs
           set state = case when jobs.state = 'queued' then 'published' else jobs.state end,
               published_at = coalesce(jobs.published_at, just.published_at),
               updated_at = now()
          from just
         where jobs.order_placed_message_id = just.message_id
        returning jobs.id, jobs.trace_id, just.message_id, just.published_at
    )
    insert into job_events (job_id, kind, at, trace_id, message_id)
    select id, 'published', published_at, trace_id, message_id from moved;
    return null;
end;
$$;
