-- One job's story (issue 57, `GET /jobs/{id}/events`): every step the orders database learns of,
-- in the order it learns them. Written in the transaction of what it records (the status
-- consumer's event, a cancel), so a row exists exactly when its step was applied, and never
-- updated. Being accepted and published are read from the job's own row (`created_at`,
-- `published_at`), so the hot path of `POST /orders` and the relay's mark write nothing here, and a
-- job from before this migration still shows both.
create table job_events (
    id          bigint      generated always as identity primary key,
    job_id      uuid        not null references jobs (id),
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
