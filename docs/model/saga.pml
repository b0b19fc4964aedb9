/*
 * An order's end and its compensations (decision 0023), for spin: the orders service decides
 * each order's end once and announces it with order.ended; inventory settles or releases its
 * reservation, billing voids its invoice, each behind a fence on the order's id; the customer
 * cancels, the deadline fires, billing declines or fails for good, an operator abandons or
 * redrives the parked message, and a late copy of inventory.reserved arrives, all at any moment
 * and every message in any order (no ordering per key). order.ended is routed by its end: billing
 * receives only the ends it undoes. The deadline is a row in the orders service's outbox: the
 * relay may claim it, publish it (more than once, if it dies before its commit) and deliver it at
 * any moment, and the end withdraws it in the transaction that decides the end, unless the relay
 * holds it (FOR UPDATE SKIP LOCKED: the end does not wait for the relay). `protocol.pml` checks one hop below this
 * (each message applied at most once, or parked) and `jobs.pml` the job's retries and redrives;
 * this model takes both as given.
 *
 *   spin -a saga.pml && gcc -O2 -DSAFETY -o pan pan.c && ./pan
 *
 * Checked: an end, once decided, never changes; stock is conserved at every step; billing never
 * receives an invoiced order's end (as the model routes it: what it checks is that nothing in the
 * saga needs billing to); a deadline reaches an order that has ended only if the relay held or had
 * published it when the end was decided; and once nothing can move, every order has ended (or
 * waits in parking for an operator), an ended order's deadline is gone from the outbox unless the
 * relay had it out when the order ended, an ended order holds no reservation, an invoice stands
 * exactly for an order that ended invoiced, and every compensation has been answered. The relay
 * and the deadline's delivery may stop at any point (the deadline not yet due when the check
 * ends), so that the outbox's content at the end is checked, not merely drained.
 *
 * Seeded bugs, one per -D flag (scripts/check-model asserts that spin finds each):
 *   RELEASE_WITHOUT_INBOX  inventory's release neither goes through the inbox nor checks that
 *                          the reservation is still held: a second copy of order.ended gives the
 *                          stock back twice
 *   INVOICE_CANCELLED      the status consumer takes invoice.created whatever the order's end
 *   DEADLINE_CANCELS_ANY   the deadline cancels the order whatever its end, invoiced included
 *   NO_FENCE               a release (a void) that finds nothing writes no fence: a late
 *                          order.placed (inventory.reserved) then takes stock (invoices)
 *   DEADLINE_KEPT          the end does not withdraw the deadline: it is published and delivered
 *                          after the end, for nothing
 *   BILL_EVERY_END         billing binds every end (order.ended.#), as before the routing by end
 */

#ifndef COPIES
#define COPIES 1      /* late copies: of inventory.reserved (a redrive, a second producer), of order.ended */
#endif

mtype:end = { none, invoiced, rejected, declined, cancelled };
mtype:res = { nores, held, settled, released };
mtype:inv = { noinv, standing, void };

/* The orders database: the order's end, and the compensations' answers. */
mtype:end ended = none;
bool quarantined_job, released_ans, voided_ans;

/* Inventory's database: the reservation and one unit of stock. */
mtype:res res = nores;
byte avail = 1, held_q, settled_q;

/* Billing's database: the invoice. */
mtype:inv inv = noinv;

/* Queues, as counts of messages waiting (each taken in any order). */
byte inv_placed;              /* order.placed, to inventory */
byte inv_ended[6];            /* order.ended of each end, to inventory */
byte bill_reserved;           /* inventory.reserved, to billing */
byte bill_ended[6];           /* order.ended of each end, to billing */
byte bill_parked;             /* inventory.reserved parked in billing (it failed for good) */
/* Events to the status consumer. */
byte ev_rejected, ev_invoiced, ev_declined, ev_released, ev_voided, ev_quarantined, ev_abandoned;

bool cancel_left = true, redrive_left = true, abandon_left = true;
byte copies;

/* The deadline: its outbox row (waiting for the relay, held by the relay's open transaction, or
 * gone: published and marked, or withdrawn), the copies published and not yet delivered, whether
 * the status consumer's inbox has one, and whether the relay held or had published it when the
 * order's end was decided. */
mtype:row = { row_waiting, row_held, row_gone };
mtype:row dl_row = row_waiting;
byte dl_queued;
bool dl_published, dl_applied, dl_out_at_end;
#ifndef RELAY_CRASHES
#define RELAY_CRASHES 1
#endif
byte relay_crashes;

#define DECIDED (ended != none)
#define UNDONE(e) ((e) == declined || (e) == cancelled)

/* In the transaction that decides the end: the deadline's row is deleted unless the relay holds
 * it (skipped, not waited for) or has published it. */
inline withdraw_deadline() {
    dl_out_at_end = (dl_row == row_held || dl_published);
#ifndef DEADLINE_KEPT
    if :: dl_row == row_waiting -> dl_row = row_gone :: else -> skip fi
#endif
}

/* order.ended under order.ended.<end>: inventory binds every end, billing the ends it undoes. */
inline announce(e) {
    inv_ended[e]++;
#ifdef BILL_EVERY_END
    bill_ended[e]++
#else
    if :: UNDONE(e) -> bill_ended[e]++ :: else -> skip fi
#endif
}

/* The orders service decides the end, if none: one transaction, order.ended in its outbox. */
inline decide(e) {
    if
    :: ended == none ->
       ended = e;
       announce(e);
       withdraw_deadline()
    :: else -> skip
    fi
}

/* Stock moves with the reservation: one unit, conserved. */
#define CONSERVED (avail + held_q + settled_q == 1 && held_q == (res == held) && settled_q == (res == settled))

proctype Inventory() {
    mtype:end e;
end:
    do
    :: atomic {
           inv_placed > 0 -> inv_placed--;
           if
           :: res == nores ->   /* reserve (the insert on the unique order_id) */
              if
              :: res = held; avail--; held_q++; bill_reserved++
              :: ev_rejected++   /* no stock: refused, nothing written */
              fi
           :: else -> skip   /* reserved before, or fenced: nothing */
           fi;
           assert(CONSERVED)
       }
    :: atomic {
           (inv_ended[invoiced] + inv_ended[declined] + inv_ended[cancelled] > 0) ->
           if
           :: inv_ended[invoiced] > 0 -> e = invoiced
           :: inv_ended[declined] > 0 -> e = declined
           :: inv_ended[cancelled] > 0 -> e = cancelled
           fi;
           inv_ended[e]--;
           if
           :: e == invoiced ->
              if :: res == held -> res = settled; held_q--; settled_q++ :: else -> skip fi
           :: else ->
#ifdef RELEASE_WITHOUT_INBOX
              if
              :: res == held || res == released -> res = released; avail++; if :: held_q > 0 -> held_q-- :: else -> skip fi
#else
              if
              :: res == held -> res = released; avail++; held_q--
#endif
#ifdef NO_FENCE
              :: res == nores -> skip
#else
              :: res == nores -> res = released   /* the fence */
#endif
              :: else -> skip
              fi;
              ev_released++
           fi;
           assert(avail <= 1);
           assert(CONSERVED)
       }
    od
}

proctype Billing() {
    mtype:end e;
end:
    do
    :: atomic {
           bill_reserved > 0 -> bill_reserved--;
           if
           :: ev_declined++                   /* declined (DECLINE, or past the deadline) */
           :: bill_parked++; ev_quarantined++ /* fails on every attempt: parked (BILLPOISON) */
           :: if                              /* priced: the insert on the unique order_id */
              :: inv == noinv -> inv = standing; ev_invoiced++
              :: else -> skip                 /* invoiced before, or fenced */
              fi
           fi
       }
    :: atomic {
           (bill_ended[invoiced] + bill_ended[declined] + bill_ended[cancelled] > 0) ->
           if
           :: bill_ended[invoiced] > 0 -> e = invoiced
           :: bill_ended[declined] > 0 -> e = declined
           :: bill_ended[cancelled] > 0 -> e = cancelled
           fi;
           bill_ended[e]--;
           /* Billing never receives an invoiced order's end. */
           assert(e != invoiced);
           if
           :: UNDONE(e) ->
              if
              :: inv == standing -> inv = void
#ifdef NO_FENCE
              :: inv == noinv -> skip
#else
              :: inv == noinv -> inv = void   /* the fence */
#endif
              :: else -> skip
              fi;
              ev_voided++
           :: else -> skip
           fi
       }
    od
}

/* The world: the customer's cancel, an operator, late copies. */
proctype World() {
end:
    do
    :: atomic { cancel_left -> cancel_left = false;      /* POST /orders/{id}/cancel */
#ifdef INVOICE_CANCELLED
                if :: ended == none -> ended = cancelled; announce(cancelled); withdraw_deadline() :: else -> skip fi
#else
                decide(cancelled)
#endif
       }
    :: atomic { abandon_left && bill_parked > 0 -> abandon_left = false;
                ev_abandoned++;   /* msgctl: job.abandoned, confirmed ... */
                bill_parked--     /* ... then the parked message acked */
       }
    :: atomic { redrive_left && bill_parked > 0 -> redrive_left = false;
                bill_reserved++; bill_parked--   /* msgctl parked redrive */
       }
    :: atomic { copies < COPIES && res != nores -> copies++;
                bill_reserved++   /* a late inventory.reserved: a copy redriven from elsewhere */
       }
    :: atomic { copies < COPIES && DECIDED -> copies++;
                inv_ended[ended]++   /* a second copy of order.ended (the inbox skips it) */
#ifndef RELEASE_WITHOUT_INBOX
                ; inv_ended[ended]--
#endif
       }
    :: break
    od
}

/* The deadline's row, through the relay (claimed, published, marked; or the relay dies after its
 * publish, its lock released and the row unmarked), and its copies to the status consumer, whose
 * inbox applies one. */
proctype Deadline() {
    mtype:end was;
end:
    do
    :: atomic { dl_row == row_waiting -> dl_row = row_held }
    :: atomic { dl_row == row_held -> dl_queued++; dl_published = true;
                if
                :: dl_row = row_gone                                          /* marked, committed */
                :: relay_crashes < RELAY_CRASHES -> relay_crashes++; dl_row = row_waiting  /* died */
                fi
       }
    :: atomic { dl_queued > 0 -> dl_queued--;
                if
                :: !dl_applied -> dl_applied = true;
                   was = ended;
#ifdef DEADLINE_CANCELS_ANY
                   ended = cancelled; announce(cancelled);
#else
                   decide(cancelled);
#endif
                   assert(was == none || ended == was);
                   /* A deadline reaches an ended order only if it was out when the end was decided. */
                   assert(was == none || dl_out_at_end)
                :: else -> skip   /* the inbox: a copy applied before */
                fi
       }
    :: break   /* not due yet, or the relay stopped: what is in the outbox stays */
    od
}

/* The status consumer: every event, in any order, each in its transaction. */
proctype Status() {
    mtype:end was;
end:
    do
    :: atomic {
           (ev_rejected + ev_invoiced + ev_declined + ev_released + ev_voided + ev_quarantined + ev_abandoned > 0) ->
           was = ended;
           if
           :: ev_rejected > 0 -> ev_rejected--;
              if :: ended == none -> ended = rejected; withdraw_deadline() :: else -> skip fi   /* nothing to undo */
           :: ev_invoiced > 0 -> ev_invoiced--;
#ifdef INVOICE_CANCELLED
              ended = invoiced; announce(invoiced); withdraw_deadline()
#else
              decide(invoiced)
#endif
           :: ev_declined > 0 -> ev_declined--; decide(declined)
           :: ev_released > 0 -> ev_released--; released_ans = true
           :: ev_voided > 0 -> ev_voided--; voided_ans = true
           :: ev_quarantined > 0 -> ev_quarantined--;
              if :: ended == none -> quarantined_job = true :: else -> skip fi
           :: ev_abandoned > 0 -> ev_abandoned--; decide(cancelled)
           fi;
           /* An end, once decided, never changes. */
           assert(was == none || ended == was)
       }
    od
}

proctype Quiet() {
    timeout ->
    /* Every order ends, or waits in parking for an operator who has not acted. */
    assert(DECIDED || (quarantined_job && bill_parked > 0));
    /* An ended order's deadline is gone from the outbox, unless the relay had it out at the end. */
    assert(!DECIDED || dl_row == row_gone || dl_out_at_end);
    /* An ended order holds no reservation; an invoiced one's is settled, and no other's. */
    assert(!DECIDED || res != held);
    assert((ended == invoiced) == (res == settled));
    /* An invoice stands exactly for an order that ended invoiced. */
    assert((inv == standing) == (ended == invoiced));
    /* Every compensation was answered. */
    assert(!UNDONE(ended) || (released_ans && voided_ans));
    assert(CONSERVED)
}

init {
    atomic {
        inv_placed = 1;   /* the API accepted the order; the relay published order.placed */
        run Inventory();
        run Billing();
        run World();
        run Deadline();
        run Status();
        run Quiet()
    }
}
