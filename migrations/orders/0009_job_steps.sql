-- Each step's message of a job as the status consumer knows it: whether it sits in parking (its
-- `job.quarantined` applied, no newer `job.redriven`), and how often it has been redriven.
--
-- 0006 kept one redrive count per job, and a `job.redriven` reopened any quarantined job that
-- count allowed. Redriving a copy already applied (inventory's, parked by the broker after its
-- commit) then reopened a job whose billing message was still parked: the inbox skipped the copy,
-- and nothing moved the job again (found by docs/model/jobs.pml). A redrive now reopens a job
-- only if no other step's message of it is still parked, and is stale only against redrives of
-- its own step. The per-job counts are not carried over: they name no step.
create table job_steps (
    job_id   uuid    not null references jobs (id),
    endpoint text    not null,
    parked   boolean not null,
    redrives integer not null default 0,
    primary key (job_id, endpoint)
);
alter table jobs drop column redrives;
