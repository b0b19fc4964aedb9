-- An outbox row the broker will never take (a body over its `max_message_size`, an exchange the
-- relay's user may not write) closes the relay's channel each time it is sent. The relay finds it,
-- counts its attempts, and after RELAY_MAX_ATTEMPTS parks it here: the claim skips a parked row,
-- so the rows behind it flow, until an operator re-arms it (`msgctl outbox retry`).
alter table outbox add column parked_at timestamptz;
