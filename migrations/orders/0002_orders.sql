-- Orders, their lines, the jobs clients poll, and idempotency keys.

create table orders (
    id           uuid        primary key,
    customer_id  text        not null,
    -- accepted -> reserved -> invoiced | rejected | failed
    status       text        not null default 'accepted',
    created_at   timestamptz not null default now(),
    updated_at   timestamptz not null default now()
);

create table order_lines (
    order_id  uuid    not null references orders (id),
    line_no   integer not null,
    sku       text    not null,
    quantity  integer not null check (quantity between 1 and 1000),
    primary key (order_id, line_no)
);

create table jobs (
    id            uuid        primary key,
    order_id      uuid        not null references orders (id),
    state         text        not null default 'queued'
                  check (state in ('queued', 'published', 'retry_wait', 'succeeded', 'rejected', 'quarantined')),
    attempt       integer     not null default 1,
    result_key    text,
    last_error    text,
    published_at  timestamptz,
    created_at    timestamptz not null default now(),
    updated_at    timestamptz not null default now()
);
create index jobs_order_id on jobs (order_id);

create table idempotency_keys (
    key         text        primary key,
    -- The parsed request, compared as jsonb (key order and whitespace do not matter).
    request     jsonb       not null,
    job_id      uuid        not null references jobs (id),
    order_id    uuid        not null references orders (id),
    created_at  timestamptz not null default now()
);

-- The relay is generic: it only marks outbox rows. The job learns that its order.placed left the
-- building from this trigger, in the relay's own transaction.
create function outbox_marks_job_published() returns trigger language plpgsql as $$
begin
    if new.message_type = 'order.placed' and new.published_at is not null and old.published_at is null then
        update jobs
           set state = case when state = 'queued' then 'published' else state end,
               published_at = coalesce(published_at, new.published_at),
               updated_at = now()
         where id = (new.headers ->> 'correlation_id')::uuid;
    end if;
    return null;
end;
$$;

create trigger outbox_marks_job_published after update of published_at on outbox
    for each row execute function outbox_marks_job_published();
