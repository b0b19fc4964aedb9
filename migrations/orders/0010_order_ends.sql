-- Every order ends (issue 41, decision 0023): invoiced, rejected, declined (billing refused) or
-- cancelled (by the customer, its deadline or an operator). The orders service decides the end in
-- one transaction and writes order.ended; while inventory and billing undo what they did, the job
-- is `compensating`, heading for `ending`, and each answer is stamped when it arrives.
alter table jobs drop constraint jobs_state_check;
alter table jobs add constraint jobs_state_check check (state in (
    'queued', 'published', 'retry_wait', 'succeeded', 'rejected', 'quarantined',
    'compensating', 'declined', 'cancelled'));
alter table jobs
    add column ending      text check (ending in ('declined', 'cancelled')),
    -- inventory.released and invoice.voided, the two answers a compensation waits for.
    add column released_at timestamptz,
    add column voided_at   timestamptz;
-- For the books' check (shop::books): the orders that ended otherwise than invoiced (few).
create index orders_ended_otherwise on orders (updated_at) where status in ('rejected', 'declined', 'cancelled');
create index jobs_compensating on jobs (updated_at) where state = 'compensating';
