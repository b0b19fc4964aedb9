/*
 * The delivery protocol as built, for spin: the API's transaction, two relays, the broker, and a
 * batching consumer with its inbox, retries, parking, crash ledger and dead-letter intake. Every
 * process may crash at every step
 * where a crash loses something it has not made durable; crashes, broker returns and handler
 * failures are drawn from small budgets so that spin explores every interleaving of them and
 * still ends. `docs/model/README.md` says what is modelled, what is not, and how CI runs it.
 *
 *   spin -a protocol.pml && gcc -O2 -DSAFETY -o pan pan.c && ./pan -m100000
 *
 * -DLEDGER adds the crash ledger and the broker's delivery limit: a returned delivery comes back
 * flagged redelivered and runs alone through the ledger, or is dead-lettered into the intake and
 * parked from there. Without it, a returned delivery is taken again like any other, batched or
 * not: more interleavings than the code allows, in far fewer states.
 *
 * Seeded protocol bugs, one per -D flag (scripts/check-model asserts that spin finds each):
 *   ACK_BEFORE_COMMIT      the consumer acks a batch before its transaction commits
 *   MARK_BEFORE_CONFIRM    the relay marks a row published before the broker confirms it
 *   INBOX_OUTSIDE_TXN      the inbox row commits in a transaction of its own, before the effect
 *   RETURN_AS_CONFIRM      the relay takes a returned (unroutable) publish for a confirm: the bug
 *                          of decision 0010, a return pinned on another publish's confirm
 */

#define N 2              /* orders; the claim and TAKE below are written for two */
#define MAX_ATTEMPTS 2   /* MAX_ATTEMPTS: attempt 2 is the last; its failure parks */
/* The budgets, overridable with -D (scripts/check-model runs three configurations). Parking needs
 * four failures of one message: in its batch and alone, at each of its two attempts. */
#ifndef CRASHES
#define CRASHES 2        /* crashes of any process, in all */
#endif
#ifndef RETURNS
#define RETURNS 1        /* publishes the broker returns (nothing bound yet, say) */
#endif
#ifndef FAILURES
#define FAILURES 2       /* transient handler failures */
#endif
#ifndef LIMITS
#define LIMITS 1         /* returns that reach the broker's delivery limit: dead-lettered */
#endif

/* A copy of order o's message at attempt a (1-based) is slot o * MAX_ATTEMPTS + a - 1. */
#define SLOT(o, a) ((o) * MAX_ATTEMPTS + (a) - 1)
#define ORDER(s) ((s) / MAX_ATTEMPTS)
#define ATTEMPT(s) ((s) % MAX_ATTEMPTS + 1)
#define SLOTS (N * MAX_ATTEMPTS)

/* Postgres: the orders database (the outbox) and the consumer's database (inbox, effect). */
bool accepted[N];      /* the API's transaction committed: order, job and outbox row */
bool published[N];     /* the relay's mark committed (outbox.published_at) */
bool locked[N];        /* an open relay transaction holds the row (FOR UPDATE SKIP LOCKED) */
bool inbox[N];         /* the consumer's inbox row for the message */
byte effect[N];        /* times the effect was applied: the guarantee is at most once */

/* RabbitMQ: copies per slot in the work queue (fresh, and returned unacked, which the broker
 * flags `redelivered`), in its wait queues, in the dead-letter intake, in parking. */
byte ready[SLOTS];
byte redelivered[SLOTS];
byte waiting[SLOTS];
byte intake[SLOTS];
byte parked[N];

/* The crash ledger (`delivery_starts`): starts of a redelivered message, alone, not finished. */
#define MAX_CRASHES 1
byte starts[N];

byte crashes, returns, failures, limits;

inline may_crash() { crashes < CRASHES -> crashes++ }

#define CLAIMABLE(i) (accepted[i] && !published[i] && !locked[i])

/* Take any one copy out of `queue` (blocks while it is empty): the broker does not order copies
 * of one message, nor messages that went through different wait queues. An explicit choice, not
 * `select`: select would commit to an empty slot and block there. A macro, because an inline
 * cannot take an array. Written for four slots. */
#define TAKE(queue, s) \
    if \
    :: queue[0] > 0 -> s = 0 \
    :: queue[1] > 0 -> s = 1 \
    :: queue[2] > 0 -> s = 2 \
    :: queue[3] > 0 -> s = 3 \
    fi; \
    queue[s]--

/* The API: each order is accepted (one transaction: order, job, outbox row) or refused, in
 * which case nothing was written and nothing is owed. */
proctype Api() {
    byte o;
    for (o : 0 .. N - 1) {
        if
        :: accepted[o] = true
        :: skip
        fi
    }
}

/* A relay: claim the oldest unpublished row nobody holds, publish it (mandatory, confirmed),
 * mark it if confirmed, commit. A crash anywhere before the commit rolls the claim back. */
proctype Relay() {
    byte o;
    bool confirmed;
end:
    do
    :: atomic {
           (CLAIMABLE(0) || CLAIMABLE(1)) ->
           if
           :: CLAIMABLE(0) -> o = 0
           :: else -> o = 1
           fi;
           locked[o] = true
       }
#ifdef MARK_BEFORE_CONFIRM
       published[o] = true;
       if
       :: may_crash(); locked[o] = false; goto next
       :: skip
       fi;
#endif
       if
       :: returns < RETURNS -> returns++; confirmed = false
       :: ready[SLOT(o, 1)]++; confirmed = true
       fi;
#ifdef RETURN_AS_CONFIRM
       confirmed = true;
#endif
       if
       :: may_crash(); locked[o] = false; goto next   /* published, not marked: sent again */
       :: skip
       fi;
       atomic {
           if
           :: confirmed -> published[o] = true
           :: else -> skip   /* record_failure: stays unpublished, claimed again after backoff */
           fi;
           locked[o] = false
       }
next:
       skip
    od
}

/* The broker: a wait queue's TTL expires and dead-letters the copy back to the work queue. */
proctype Broker() {
    byte s;
end:
    do
    :: atomic { TAKE(waiting, s); ready[s]++ }
    od
}

/* The consumer: take one or two ready deliveries (in any order: the broker does not order copies
 * of one message, nor queues among themselves), apply them in one transaction with their inbox
 * rows, then ack. If a handler fails, the batch rolls back and each delivery is applied alone:
 * a transient failure sends a copy to the next wait queue (confirmed) and acks; on the last
 * attempt it parks (confirmed) and acks. A crash returns every unacked delivery to the queue,
 * flagged redelivered, or, at the broker's delivery limit, dead-letters it into the intake. A
 * redelivery runs alone through the crash ledger; what the intake holds is parked. */
proctype Consumer() {
    byte held[2];      /* slots of the deliveries held, unacked */
    byte count;        /* how many are held */
    bool fresh[N];     /* this transaction inserted the message's inbox row */
    byte i, o, s;
    bool failed;
    bool alone;        /* holding one redelivery, its start on the crash ledger */
    bool dead;         /* holding one delivery from the dead-letter intake */
end:
    do
    /* What the broker dead-lettered: park it (confirmed), then ack. */
    :: atomic { TAKE(intake, s); held[0] = s; count = 1; dead = true };
       parked[ORDER(s)]++;
       if
       :: may_crash(); goto crashed   /* parked, not acked: back in the intake, parked again */
       :: skip
       fi;
       count = 0;
       dead = false;
       goto next

    /* A redelivery runs alone: its start is committed to the crash ledger before the handler
     * runs; past MAX_CRASHES unfinished starts it is parked unhandled. */
    :: atomic { TAKE(redelivered, s); held[0] = s; count = 1; alone = true };
       o = ORDER(s);
       starts[o]++;
       if
       :: may_crash(); goto crashed   /* the handler took the process down: the start stays */
       :: skip
       fi;
       if
       :: starts[o] > MAX_CRASHES ->
          parked[ORDER(held[0])]++;   /* = parked[o]; spelt apart for scripts/check-model */
          if
          :: may_crash(); goto crashed
          :: skip
          fi;
          count = 0
       :: else -> goto one_by_one   /* settled alone, as after a failed batch */
       fi;
       goto forget

    /* Fresh deliveries: one or two in a batch. */
    :: atomic { TAKE(ready, s); held[0] = s; count = 1 };
       if
       :: atomic { TAKE(ready, s); held[1] = s; count = 2 }
       :: skip
       fi;

       /* The batch's transaction. */
       failed = false;
       for (i : 0 .. count - 1) {
           o = ORDER(held[i]);
           if
           :: inbox[o] || fresh[o] -> skip   /* already processed: no handler runs */
           :: else ->
#ifdef INBOX_OUTSIDE_TXN
              inbox[o] = true;
              if
              :: may_crash(); goto crashed
              :: skip
              fi;
#endif
              if
              :: failures < FAILURES -> failures++; failed = true
              :: fresh[o] = true
              fi
           fi
       }
       if
       :: failed -> goto one_by_one
       :: else -> skip
       fi;
#ifdef ACK_BEFORE_COMMIT
       count = 0;
       if
       :: may_crash(); goto crashed
       :: skip
       fi;
#endif
       if
       :: may_crash(); goto crashed   /* before the commit: rolled back */
       :: skip
       fi;
       atomic {
           for (o : 0 .. N - 1) {
               if
               :: fresh[o] -> inbox[o] = true; effect[o]++; assert(effect[o] <= 1); fresh[o] = false
               :: else -> skip
               fi
           }
       }
       if
       :: may_crash(); goto crashed   /* committed, not acked: redelivered, the inbox skips it */
       :: skip
       fi;
       count = 0;
       goto next;

one_by_one:
       skip;   /* a label on the `for` itself would land past its `o = 0` */
       for (o : 0 .. N - 1) { fresh[o] = false }
       do
       :: count == 0 -> break
       :: count > 0 ->
          s = held[count - 1];
          o = ORDER(s);
          if
          :: inbox[o] -> skip
          :: else ->
             if
             :: failures < FAILURES -> failures++;
                if
                :: ATTEMPT(s) < MAX_ATTEMPTS -> waiting[SLOT(o, ATTEMPT(s) + 1)]++
                :: else -> parked[o]++
                fi
             :: atomic { inbox[o] = true; effect[o]++; assert(effect[o] <= 1) }
             fi
          fi;
          if
          :: may_crash(); goto crashed   /* settled, not acked: redelivered */
          :: skip
          fi;
          count--
       od;
       if
       :: alone -> goto forget
       :: else -> goto next
       fi;

forget:
       /* This process lives: the start was no crash. */
       atomic { starts[ORDER(held[0])] = 0; alone = false };
       goto next;

crashed:
       /* The channel closes: every unacked delivery goes back to the work queue. The open
        * transaction, if any, rolls back. */
       atomic {
           for (i : 0 .. count - 1) {
#ifdef LEDGER
               if
               :: dead -> intake[held[i]]++
               :: !dead && limits < LIMITS -> limits++; intake[held[i]]++   /* the delivery limit */
               :: !dead -> redelivered[held[i]]++
               fi
#else
               ready[held[i]]++   /* taken again like any delivery: a superset of running alone */
#endif
           }
           count = 0;
           alone = false;
           dead = false;
           for (o : 0 .. N - 1) { fresh[o] = false }
       }
next:
       skip
    od
}

/* Once nothing can move: every accepted order's effect is applied, or its message is parked. */
proctype Quiet() {
    byte o;
    timeout ->
    for (o : 0 .. N - 1) {
        assert(!accepted[o] || effect[o] == 1 || parked[o] > 0)
    }
}

init {
    atomic {
        run Api();
        run Relay();
        run Relay();
        run Broker();
        run Consumer();
        run Quiet()
    }
}
