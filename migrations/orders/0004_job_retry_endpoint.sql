-- Which endpoint a job in `retry_wait` waits on, so that the step's later success moves the job on
-- (and a late retry event from a step that has already succeeded cannot move it back).
alter table jobs add column retry_endpoint text;
