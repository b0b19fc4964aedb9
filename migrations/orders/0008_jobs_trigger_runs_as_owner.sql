-- The relay marks outbox rows as a role of its own that may touch the outbox alone
-- (ops/postgres/roles.sql). The statement trigger of 0007 then updated `jobs` with the relay's
-- rights and failed ("permission denied for table jobs"), so the relay's marks were rolled back and
-- every row went out again and again. The trigger runs as its owner instead, the schema's owner,
-- who owns `jobs`; its search_path is pinned, as every SECURITY DEFINER function's must be.
alter function outbox_marks_jobs_published() security definer set search_path = public, pg_temp;
