-- Inbox retention deletes rows by age (INBOX_RETENTION). A BRIN index: rows arrive in time order,
-- so block ranges follow received_at; it stays a few pages however large the inbox grows, and
-- costs the hot insert path almost nothing, where a b-tree would add a second index write to every
-- message handled.
create index inbox_received_at on inbox using brin (received_at);
