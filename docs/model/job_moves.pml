/* Generated from orders-api's moves.rs (moves::MOVES) by
 *   UPDATE_MODEL=1 cargo test -p orders-api moves
 * and checked by that test: do not edit. Every move of a job's state the code makes;
 * jobs.pml asserts that each of its own is one of them. */
#define JOB_MOVE(f, t) ( \
    (f == queued && t == published) || \
    (f == queued && t == retry_wait) || \
    (f == queued && t == succeeded) || \
    (f == queued && t == rejected) || \
    (f == queued && t == quarantined) || \
    (f == queued && t == compensating) || \
    (f == published && t == retry_wait) || \
    (f == published && t == succeeded) || \
    (f == published && t == rejected) || \
    (f == published && t == quarantined) || \
    (f == published && t == compensating) || \
    (f == retry_wait && t == published) || \
    (f == retry_wait && t == succeeded) || \
    (f == retry_wait && t == rejected) || \
    (f == retry_wait && t == quarantined) || \
    (f == retry_wait && t == compensating) || \
    (f == quarantined && t == published) || \
    (f == quarantined && t == succeeded) || \
    (f == quarantined && t == rejected) || \
    (f == quarantined && t == compensating) || \
    (f == compensating && t == declined) || \
    (f == compensating && t == cancelled) || \
    false)
