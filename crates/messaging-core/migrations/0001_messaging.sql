-- Outbox and inbox: the messaging tables every service database carries (identical in each).

-- Messages written in the same transaction as the business change, published later by the relay.
create table outbox (
    id            bigint generated always as identity primary key, -- publication order
    message_id    uuid        not null unique,                     -- stable across every republish
    message_type  text        not null,
    exchange      text        not null,
    routing_key   text        not null,
    payload       jsonb       not null,
    headers       jsonb       not null default '{}'::jsonb,        -- correlation id, traceparent, version
    created_at    timestamptz not null default now(),
    published_at  timestamptz,
    attempts      integer     not null default 0,
    last_error    text,
    -- A returned or nacked row is not retried before this time (backoff).
    available_at  timestamptz not null default now()
);

-- The relay only ever scans unpublished rows; this index stays small however large the table grows.
create index outbox_unpublished on outbox (id) where published_at is null;
-- Retention deletes published rows by age.
create index outbox_published_at on outbox (published_at) where published_at is not null;

-- Every insert wakes the relay. A statement-level trigger fires once per insert statement, and
-- Postgres folds identical notifications of one transaction into one, delivered at commit.
create function outbox_notify() returns trigger language plpgsql as $$
begin
    perform pg_notify('outbox', '');
    return null;
end;
$$;

create trigger outbox_notify after insert on outbox
    for each statement execute function outbox_notify();

-- Messages already processed by this database's consumers: inserted in the same transaction as the
-- effect, so "processed" and "effect applied" commit or roll back together.
create table inbox (
    message_id    uuid        primary key,
    message_type  text        not null,
    endpoint      text        not null,
    received_at   timestamptz not null default now()
);
