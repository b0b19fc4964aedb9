-- The relay parks a row after RELAY_MAX_ATTEMPTS publishes that closed its channel (the broker
-- refuses the row itself). `attempts` also counts the polite failures (returned as unroutable,
-- nacked), which are the topology's or the broker's state and are retried for as long as they
-- take, so the threshold needs a count of its own: a row returned nine times and then refused once
-- was parked at its first refusal.
alter table outbox add column refusals integer not null default 0;
