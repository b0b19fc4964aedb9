-- How many times a job's parked message has been redriven (`msgctl parked redrive`), as far as the
-- status consumer knows. Job events are applied concurrently, so a `job.redriven` can be applied
-- after the `job.quarantined` that follows it: this count lets the older event lose.
alter table jobs add column redrives integer not null default 0;
