-- The relay's mark of a batch (one UPDATE of the outbox) moved the batch's jobs in its join's order,
-- while the status consumer's batches lock their jobs in id order (orders-api's `jobs::lock_all`):
-- a relay batch and a status batch that shared two jobs could each hold one and wait for the
-- other, a deadlock that Postgres breaks after `deadlock_timeout` (a second) by failing one of
-- them. The trigger now locks its jobs in id order first, in the same statement, and moves them by
-- the same rule as migration 0007. CREATE OR REPLACE resets what it does not restate, so it
-- restates 0008's SECURITY DEFINER and search_path.
create or replace function outbox_marks_jobs_published() returns trigger
    language plpgsql security definer set search_path = public, pg_temp as $$
begin
    update jobs
       set state = case when jobs.state = 'queued' then 'published' else jobs.state end,
           published_at = coalesce(jobs.published_at, newly.published_at),
           updated_at = now()
      from (select jobs.id, marked.published_at
              from marked
              join unmarked on unmarked.id = marked.id
              join jobs on jobs.order_placed_message_id = marked.message_id
             where marked.published_at is not null
               and unmarked.published_at is null
             order by jobs.id
               for update of jobs) newly
     where jobs.id = newly.id;
    return null;
end;
$$;
