-- The trigger of 0007 joined its two transition tables on `id`. PL/pgSQL plans a statement the
-- first time a session runs it and keeps that plan, and a transition table has no statistics: the
-- planner sizes it by the rows of that first firing. After a mark of one row, every later mark on
-- the same connection joined the two tables with a nested loop, in time quadratic in its rows: on
-- the 2-core CI machine one UPDATE of 20,000 rows took 103 s, against 0.3 s on a fresh connection.
-- The relay marks a batch at most, but a bulk UPDATE (an operator's, the bench retiring the rows
-- it left) may run on a pooled connection that marked one row before.
--
-- Now the two tables are never joined to each other. Their rows are grouped by message_id, which
-- is unique in the outbox and never updated: a message published by this statement has two rows,
-- its old one unpublished and its new one published. Whatever size the plan was made for, that grouping is a
-- sort or a hash of the statement's rows, and each job is found by its index. The rule is
-- unchanged: a job whose order.placed has just been published is `published` if it was `queued`,
-- and keeps its first `published_at`. The trigger still runs as its owner (0008).
create or replace function outbox_marks_jobs_published() returns trigger
    language plpgsql security definer set search_path = public, pg_temp as $$
begin
    update jobs
       set state = case when jobs.state = 'queued' then 'published' else jobs.state end,
           published_at = coalesce(jobs.published_at, just.published_at),
           updated_at = now()
      from (select message_id, max(published_at) as published_at
              from (select message_id, published_at from marked where published_at is not null
                    union all
                    select message_id, null::timestamptz from unmarked where published_at is null) as sides
             group by message_id
            having count(*) = 2) as just
     where jobs.order_placed_message_id = just.message_id;
    return null;
end;
$$;
