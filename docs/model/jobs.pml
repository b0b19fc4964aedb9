/*
 * A job across the shop's chain, for spin: inventory's step, billing's step, the status
 * consumer that moves the job and its order, and an operator redriving parked messages with
 * msgctl. `protocol.pml` checks one hop below this (outbox → relay → broker → inbox: each message
 * applied at most once, or parked); this model takes that as given and checks what a job makes of
 * it: every event the status consumer receives is applied once, in any order.
 *
 *   spin -a jobs.pml && gcc -O2 -DSAFETY -o pan pan.c && ./pan
 *
 * A step's delivery may be applied (inventory reserves or refuses, billing invoices), fail
 * (a retry, or parking on the last attempt), or be parked unhandled by the crash bound or the
 * broker's delivery limit, which may come after its commit when the process died before the ack.
 * A crash between a delivery's outputs and its ack leaves the delivery to come again.
 *
 * Seeded bugs, one per -D flag (scripts/check-model asserts that spin finds each):
 *   REDRIVE_EVENT_FIRST  msgctl sends job.redriven before the copy (as it did): a redrive killed
 *                        in between leaves the job in progress and its message in parking
 *   ORDER_FAILED_FINAL   an order that failed stays failed when its step's result arrives after
 *                        all (as it did), while its job takes the result
 *   JOB_WIDE_REDRIVES    one redrive count per job instead of per step (as it was): a stale
 *                        park re-quarantines a job whose message was redriven since
 *   REDRIVEN_UNNUMBERED  job.redriven reopens a quarantined job whatever its count
 *   RETRY_UNPARKS        a step's retry event moves a quarantined job to retry_wait (a move the
 *                        table of moves forbids: only a redrive or an end moves it on)
 *
 * Every move the status consumer makes is one the code's table allows (job_moves.pml, generated
 * from orders-api's moves::MOVES), which production checks too (migration 0014's trigger).
 */

#define INV 0
#define BILL 1
#define MAX_ATTEMPTS 2
#ifndef FAILURES
#define FAILURES 2   /* handler failures */
#endif
#ifndef LIMITS
#define LIMITS 1     /* deliveries parked unhandled: the crash bound, the broker's delivery limit */
#endif
#ifndef CRASHES
#define CRASHES 1    /* crashes between a delivery's outputs and its ack, or in msgctl */
#endif
#ifndef REDRIVES
#define REDRIVES 2   /* the operator's redrives */
#endif
#define RD (REDRIVES + 1)   /* redrive counts 0 .. REDRIVES */

/* A live copy of step s's message at attempt a (1-based) with redrive count r; a parked one. */
#define LIVE(s, a, r) (((s) * MAX_ATTEMPTS + (a) - 1) * RD + (r))
#define PARK(s, r) ((s) * RD + (r))

/* Job states and order statuses, as in orders-api's jobs.rs and order.rs (the last three states
 * are saga.pml's: this model decides no declined or cancelled end). */
mtype:job = { queued, published, retry_wait, succeeded, rejected, quarantined, compensating, declined, cancelled };
#include "job_moves.pml"
mtype:order = { accepted, reserved, invoiced, refused_order, failed };

/* The services' databases: what each step applied. */
bool applied[2];
bool refused;

/* The broker: copies in work and wait queues, copies in parking. */
byte live[2 * MAX_ATTEMPTS * RD];
byte parked[2 * RD];

/* Events on their way to the status consumer (each applied once, in any order). */
bool mark_ev;                 /* the relay's mark of order.placed (the outbox trigger) */
byte reserved_ev, rejected_ev, invoiced_ev;
byte retry_ev[2];
byte quar_ev[2 * RD];         /* job.quarantined of step s with redrive count r */
byte redriven_ev[2 * RD];     /* job.redriven of step s with redrive count r */

/* The orders database: the job and its order. */
mtype:job state = queued;
mtype:order order = accepted;
byte retry_step = 2;          /* 2: none */
byte redrives[2];             /* per step: the highest redrive count seen (job_steps) */
bool held[2];                 /* per step: its message is parked, as far as the job knows */
byte job_redrives;            /* JOB_WIDE_REDRIVES: one count for the whole job, as it was */

byte failures, limits, crashes, redrives_done;

#define FINAL (state == succeeded || state == rejected)
#define TERMINAL (FINAL || state == quarantined)

/* Park a copy of step s (redrive count r) and tell the status consumer. */
inline park(s, r) { parked[PARK(s, r)]++; quar_ev[PARK(s, r)]++ }

/* A step's worker: take any live copy and settle it. */
proctype Step(byte s) {
    byte a, r, i;
end:
    do
    :: atomic {
           /* Any live copy: an explicit choice, as `select` would commit to an empty one.
            * Written for MAX_ATTEMPTS 2 and REDRIVES 2, as are the choices below. */
           if
           :: live[LIVE(s, 1, 0)] > 0 -> a = 1; r = 0
           :: live[LIVE(s, 2, 0)] > 0 -> a = 2; r = 0
           :: live[LIVE(s, 1, 1)] > 0 -> a = 1; r = 1
           :: live[LIVE(s, 2, 1)] > 0 -> a = 2; r = 1
           :: live[LIVE(s, 1, 2)] > 0 -> a = 1; r = 2
           :: live[LIVE(s, 2, 2)] > 0 -> a = 2; r = 2
           fi;
           live[LIVE(s, a, r)]--;
           if
           /* The crash bound or the broker's limit parks it unhandled, applied or not. */
           :: limits < LIMITS -> limits++; park(s, r)
           :: applied[s] -> skip   /* the inbox skips a copy already applied */
           :: !applied[s] ->
              if
              :: applied[s] = true;
                 if
                 :: s == INV -> refused = true; rejected_ev++
                 :: s == INV -> reserved_ev++; live[LIVE(BILL, 1, 0)]++
                 :: s == BILL -> invoiced_ev++
                 fi;
                 if
                 :: crashes < CRASHES -> crashes++; live[LIVE(s, a, r)]++   /* died before the ack */
                 :: skip
                 fi
              :: failures < FAILURES -> failures++;
                 if
                 :: a < MAX_ATTEMPTS -> live[LIVE(s, a + 1, r)]++; retry_ev[s]++
                 :: else -> park(s, r)
                 fi;
                 if
                 :: crashes < CRASHES -> crashes++; live[LIVE(s, a, r)]++   /* died before the ack */
                 :: skip
                 fi
              fi
           fi
       }
    od
}

#define ANY_PARKED (parked[PARK(INV, 0)] + parked[PARK(INV, 1)] + parked[PARK(BILL, 0)] + parked[PARK(BILL, 1)] > 0)

/* The operator: `msgctl parked redrive` on any parked copy. The copy goes back with its redrive
 * count + 1 and its attempts start over; job.redriven tells the status consumer; then the parked
 * copy is acked. msgctl may die between any two of these, and the broker may refuse the copy
 * (the queue gone), in which case msgctl says so and the message stays parked. */
proctype Operator() {
    byte s, r;
    bool sent;   /* this redrive's copy is confirmed in the work queue */
end:
    do
    :: atomic {
           redrives_done < REDRIVES && ANY_PARKED ->
           if
           :: parked[PARK(INV, 0)] > 0 -> s = INV; r = 0
           :: parked[PARK(INV, 1)] > 0 -> s = INV; r = 1
           :: parked[PARK(BILL, 0)] > 0 -> s = BILL; r = 0
           :: parked[PARK(BILL, 1)] > 0 -> s = BILL; r = 1
           fi;
           redrives_done++;
           sent = false
       };
#ifdef REDRIVE_EVENT_FIRST
       redriven_ev[PARK(s, r + 1)]++;
       if
       :: crashes < CRASHES -> crashes++; goto next
       :: skip
       fi;
       if
       :: live[LIVE(s, 1, r + 1)]++; sent = true
       :: quar_ev[PARK(s, r + 1)]++; goto next   /* refused: the job is told it is parked again */
       fi;
#else
       if
       :: live[LIVE(s, 1, r + 1)]++; sent = true
       :: goto next   /* refused: nothing was sent, the message stays parked */
       fi;
       if
       :: crashes < CRASHES -> crashes++; goto next
       :: skip
       fi;
       redriven_ev[PARK(s, r + 1)]++;
#endif
       if
       :: crashes < CRASHES -> crashes++; goto next   /* the parked copy comes back to parking */
       :: skip
       fi;
       /* Parking keeps what it holds: a message leaves it only once its copy is confirmed. */
       assert(sent);
       parked[PARK(s, r)]--;
next:
       skip
    :: break   /* or leaves the rest parked */
    od
}

/* The orders database's moves, as jobs.rs writes them. */
inline order_to(to) {
    if
    :: to == reserved && order == accepted -> order = to
#ifdef ORDER_FAILED_FINAL
    :: (to == invoiced || to == refused_order) && (order == accepted || order == reserved) -> order = to
#else
    :: (to == invoiced || to == refused_order) && (order == accepted || order == reserved || order == failed) -> order = to
#endif
    :: to == failed && (order == accepted || order == reserved) -> order = to
    :: to == accepted && order == failed -> order = to
    :: else -> skip
    fi
}

/* Whether any of a step-and-count array's six entries is set. */
#define ANY_OF(events) (events[0] + events[1] + events[2] + events[3] + events[4] + events[5] > 0)

#define PENDING (mark_ev || reserved_ev + rejected_ev + invoiced_ev + retry_ev[INV] + retry_ev[BILL] > 0 \
                 || ANY_OF(quar_ev) || ANY_OF(redriven_ev))

/* The status consumer: apply any event that has arrived, each in its transaction. */
proctype Status() {
    byte s, r;
    bool was_final;
    mtype:job was;
end:
    do
    :: atomic {
           PENDING ->
           was = state;
           was_final = FINAL;
           if
           :: mark_ev -> mark_ev = false;
              if :: state == queued -> state = published :: else -> skip fi
           :: reserved_ev > 0 -> reserved_ev--;   /* jobs::step_succeeded */
              order_to(reserved);
              if
              :: state == queued || (state == retry_wait && retry_step == INV) -> state = published; retry_step = 2
              :: else -> skip
              fi
           :: rejected_ev > 0 -> rejected_ev--;   /* jobs::ended(Rejected) */
              order_to(refused_order);
              if :: !FINAL -> state = rejected :: else -> skip fi
           :: invoiced_ev > 0 -> invoiced_ev--;   /* jobs::ended(Succeeded) */
              order_to(invoiced);
              if :: !FINAL -> state = succeeded :: else -> skip fi
           :: retry_ev[INV] > 0 || retry_ev[BILL] > 0 ->   /* jobs::retry_scheduled */
              if
              :: retry_ev[INV] > 0 -> s = INV
              :: retry_ev[BILL] > 0 -> s = BILL
              fi;
              retry_ev[s]--;
              if
              :: !TERMINAL && !(s == INV && order != accepted) -> state = retry_wait; retry_step = s
#ifdef RETRY_UNPARKS
              :: state == quarantined -> state = retry_wait; retry_step = s
#endif
              :: else -> skip
              fi
           :: ANY_OF(quar_ev) ->
              if   /* jobs::quarantined */
              :: quar_ev[PARK(INV, 0)] > 0 -> s = INV; r = 0
              :: quar_ev[PARK(INV, 1)] > 0 -> s = INV; r = 1
              :: quar_ev[PARK(INV, 2)] > 0 -> s = INV; r = 2
              :: quar_ev[PARK(BILL, 0)] > 0 -> s = BILL; r = 0
              :: quar_ev[PARK(BILL, 1)] > 0 -> s = BILL; r = 1
              :: quar_ev[PARK(BILL, 2)] > 0 -> s = BILL; r = 2
              fi;
              quar_ev[PARK(s, r)]--;
#ifdef JOB_WIDE_REDRIVES
              if :: job_redrives < r -> job_redrives = r :: else -> skip fi;
#else
              if :: redrives[s] < r -> redrives[s] = r :: else -> skip fi;
              held[s] = true;
#endif
              if :: !TERMINAL -> state = quarantined :: else -> skip fi;
              order_to(failed)
           :: ANY_OF(redriven_ev) ->
              if   /* jobs::redriven */
              :: redriven_ev[PARK(INV, 1)] > 0 -> s = INV; r = 1
              :: redriven_ev[PARK(INV, 2)] > 0 -> s = INV; r = 2
              :: redriven_ev[PARK(BILL, 1)] > 0 -> s = BILL; r = 1
              :: redriven_ev[PARK(BILL, 2)] > 0 -> s = BILL; r = 2
              fi;
              redriven_ev[PARK(s, r)]--;
#ifdef JOB_WIDE_REDRIVES
              if
              :: state == quarantined && job_redrives < r ->
                 job_redrives = r; state = published; retry_step = 2; order_to(accepted)
              :: else -> skip
              fi
#else
              if
#ifdef REDRIVEN_UNNUMBERED
              :: true ->
#else
              :: redrives[s] < r ->
#endif
                 redrives[s] = r; held[s] = false;
                 if   /* in progress again, unless another step's message is still parked */
                 :: state == quarantined && !held[INV] && !held[BILL] ->
                    state = published; retry_step = 2; order_to(accepted)
                 :: else -> skip
                 fi
              :: else -> skip   /* a redrive the job already knows of */
              fi
#endif
           fi;
           /* Monotonic: an outcome never changes; and every move is one the code's table has. */
           assert(!was_final || state == was);
           assert(state == was || JOB_MOVE(was, state))
       }
    od
}

/* Some copy of step s sits in parking while its message was never applied. */
#define HELD_BACK(s) (!applied[s] && (parked[PARK(s, 0)] + parked[PARK(s, 1)] + parked[PARK(s, 2)] > 0))

/* Once nothing can move: the job has ended, as its effects say, and its order with it. */
proctype Quiet() {
    timeout ->
    assert(TERMINAL);                                     /* no job stuck */
    assert((state == succeeded) == applied[BILL]);        /* the job's final state agrees ... */
    assert((state == rejected) == refused);
    assert(state != quarantined || HELD_BACK(INV) || HELD_BACK(BILL));
    assert((state == succeeded) == (order == invoiced));  /* ... and so does its order */
    assert((state == rejected) == (order == refused_order));
    assert((state == quarantined) == (order == failed))
}

init {
    atomic {
        mark_ev = true;   /* the API accepted the order (job queued); the relay will mark it */
        live[LIVE(INV, 1, 0)] = 1;
        run Step(INV);
        run Step(BILL);
        run Operator();
        run Status();
        run Quiet()
    }
}
