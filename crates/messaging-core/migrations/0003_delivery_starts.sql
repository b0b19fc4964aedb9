-- The crash ledger of the consumer runtime (decision 0005): starts of a redelivered message's
-- handler that never finished in a live process. A row exists only while a redelivered message is
-- being handled, or after the process handling it died; a message whose count passes MAX_CRASHES
-- is parked instead of being handled again.
create table delivery_starts (
    endpoint         text        not null,
    message_id       uuid        not null,
    starts           integer     not null default 1,
    first_started_at timestamptz not null default now(),
    last_started_at  timestamptz not null default now(),
    primary key (endpoint, message_id)
);
