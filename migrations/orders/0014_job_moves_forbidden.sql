-- The job model checked in production (issue 60): every move of a job's state outside the moves
-- the code makes and the model checks (orders-api's `moves::MOVES`, `docs/model/job_moves.pml`)
-- is counted as it is written, whoever writes it: the service, the relay's outbox trigger, an
-- operator by hand. The service exports the counts as `job_moves_forbidden_total{from,to}`.
--
-- The moves allowed. A test (testkit/tests/status.rs) compares this function with `moves::allowed`
-- for every pair of states; a later change of the table replaces it in a migration of its own.
-- Plain SQL, neither strict nor security definer, so that the trigger's WHEN inlines it: a move
-- allowed costs a comparison, no call.
create function job_move_allowed(from_state text, to_state text) returns boolean
language sql immutable parallel safe as $$
    select (from_state, to_state) in (
        ('queued', 'published'), ('queued', 'retry_wait'), ('queued', 'rejected'),
        ('queued', 'quarantined'), ('queued', 'succeeded'), ('queued', 'compensating'),
        ('published', 'retry_wait'), ('published', 'succeeded'), ('published', 'rejected'),
        ('published', 'quarantined'), ('published', 'compensating'),
        ('retry_wait', 'published'), ('retry_wait', 'succeeded'), ('retry_wait', 'rejected'),
        ('retry_wait', 'quarantined'), ('retry_wait', 'compensating'),
        ('quarantined', 'published'), ('quarantined', 'succeeded'), ('quarantined', 'rejected'),
        ('quarantined', 'compensating'),
        ('compensating', 'declined'), ('compensating', 'cancelled')
    )
$$;

-- One row per forbidden move seen: how often, and the last job that made it.
create table job_moves_forbidden (
    from_state  text        not null,
    to_state    text        not null,
    moves       bigint      not null,
    last_job_id uuid        not null,
    last_at     timestamptz not null,
    primary key (from_state, to_state)
);

-- Runs as its owner (the schema's), so that a move made by any role is counted; its search_path
-- is pinned, as every SECURITY DEFINER function's must be.
create function job_move_forbidden_counted() returns trigger
language plpgsql security definer set search_path = public, pg_temp as $$
begin
    insert into job_moves_forbidden as counted (from_state, to_state, moves, last_job_id, last_at)
    values (old.state, new.state, 1, new.id, now())
    on conflict (from_state, to_state) do update
        set moves = counted.moves + 1, last_job_id = excluded.last_job_id, last_at = excluded.last_at;
    return null;
end
$$;

create trigger job_moves_forbidden after update of state on jobs for each row
    when (old.state is distinct from new.state and not job_move_allowed(old.state, new.state))
    execute function job_move_forbidden_counted();
