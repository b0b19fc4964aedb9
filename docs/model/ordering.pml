/*
 * Ordering per key at one endpoint (decisions 0017, 0024), for spin: the N messages of one key,
 * numbered 1..N by the outbox across every type, of which the endpoint takes some (every choice
 * of which is checked). Each taken message arrives any number of times in any order, waits while
 * its turn has not come, is parked at any moment (on arrival, or after failing), before or after
 * its turn, and is redriven. The key's moves are the two SQL functions of migration
 * 0106_ordering_gaps.sql, each one atomic step (the key's row is locked until commit).
 * `protocol.pml` checks the hop below (each message applied at most once, or parked); this model
 * takes it as given.
 *
 *   spin -a ordering.pml && gcc -O2 -DSAFETY -o pan pan.c && ./pan
 *
 * Checked: a message applied in its turn comes after every earlier message of the types taken,
 * unless that one was parked; a message applied late was parked; and once nothing can move and
 * the operator has stopped redriving, no taken message still waits (each is applied, or parked).
 *
 * With -DHOLD, the endpoint's parking holds the key (issue 60, decision 0034): a parked message
 * keeps its place, and the key's later messages wait behind it; the operator
 * redrives it (it then takes its turn) or abandons it (msgctl: its place is given up then, as a
 * parked message's is in the default mode). Checked: every message applied is applied in its
 * turn, after every earlier message taken (applied, or abandoned): the key's applied order is its
 * sent order; none is ever applied late; and once nothing can move, a message waits only behind
 * an earlier one still parked, which the operator has neither redriven nor abandoned. One parked
 * copy per message: the code can park two (a park whose ack is lost); decision 0034 says what the
 * build must do so that this view stays exact.
 *
 * Seeded bugs, one per -D flag (scripts/check-model asserts that spin finds each):
 *   FOLLOWS_PREVIOUS  a message follows the place just before its own, whatever its type
 *                     (decision 0017's first hole): a message after one of a type the endpoint
 *                     does not take waits for ever
 *   GIVE_UP_ONLY_NEXT a parked message moves the key only if its turn had come, and writes
 *                     nothing down otherwise (0017's second hole): parked before its turn, it
 *                     stops its key for good
 *   HOLD_GIVES_UP     (with HOLD) parking gives up the place all the same: a later message is
 *                     applied before the parked one, redriven, is applied late
 *   ABANDON_KEEPS     (with HOLD) an abandon deletes the parked message and keeps its place: the
 *                     key waits for good
 */

#ifndef N
#define N 5           /* the key's messages, of every type */
#endif
#ifndef PARKS
#define PARKS 2       /* parkings, each of any waiting message */
#endif
#ifndef REDRIVES
#define REDRIVES 2    /* redrives of a parked message */
#endif

#define WAITING   0
#define APPLIED   1
#define PARKED    2
#define ABANDONED 3   /* HOLD: an operator gave the parked message up (msgctl parked abandon) */

bool taken[N + 1];     /* message i is of a type the endpoint takes */
byte follows[N + 1];   /* the latest earlier place of a taken type, 0 if none (ordering-earlier) */
byte state[N + 1];
bool ever_parked[N + 1];

/* The endpoint's database: inbox_key_positions.next and inbox_key_given_up (follows -> seq). */
byte next = 1;
byte given_up[N + 1];

byte parks, redrives;

/* inbox_key_move_past: past place s, and on past every place given up right after it. */
inline move_past(s) {
    passed = s;
    do
    :: given_up[passed] != 0 -> t = given_up[passed]; given_up[passed] = 0; passed = t
    :: else -> break
    od;
    next = passed + 1
}

/* inbox_give_up_place: message i's place, given up (the key moves past it now, or when it gets
 * there, or it is past it already). */
inline give_up(i) {
    if
    :: next > follows[i] && next <= i -> move_past(i)
    :: next <= follows[i] ->
#ifndef GIVE_UP_ONLY_NEXT
        assert(given_up[follows[i]] == 0 || given_up[follows[i]] == i);
        given_up[follows[i]] = i
#else
        skip
#endif
    :: else -> skip
    fi
}

proctype Message(byte i) {
    byte passed, t, j;
end:
    do
    /* inbox_take_turn: its turn has come (the key is past the place it follows), or its own
     * place is passed (late). Otherwise it rolls back and waits: not a move. */
    :: atomic {
        state[i] == WAITING && next > follows[i] ->
        if
        :: next > i ->
            assert(ever_parked[i]);   /* only a parked message is passed */
#ifdef HOLD
            assert(false);            /* holding: none is passed but an abandoned one, never applied */
#endif
            state[i] = APPLIED
        :: else ->
            j = 1;
            do
#ifdef HOLD
            :: j < i -> assert(!taken[j] || state[j] == APPLIED || state[j] == ABANDONED); j++
#else
            :: j < i -> assert(!taken[j] || state[j] == APPLIED || ever_parked[j]); j++
#endif
            :: else -> break
            od;
            move_past(i);
            state[i] = APPLIED
        fi
       }
    /* inbox_give_up_place: parked, before or in or after its turn. */
    :: atomic {
        state[i] == WAITING && parks < PARKS ->
        parks++;
#if !defined(HOLD) || defined(HOLD_GIVES_UP)
        give_up(i);
#endif
        state[i] = PARKED;
        ever_parked[i] = true
       }
    od
}

/* An operator redrives parked messages (msgctl: a copy goes back to the work queue), until they
 * stop: the key must not wait for them to act. Holding, the operator may also abandon a parked
 * message, which gives its place up; a message it leaves parked holds the key's later ones. */
proctype Operator() {
    byte k, passed, t;
    do
    :: atomic {
        redrives < REDRIVES ->
        select(k : 1 .. N);
        if
        :: state[k] == PARKED -> redrives++; state[k] = WAITING
        :: else -> skip
        fi
       }
#ifdef HOLD
    :: atomic {
        select(k : 1 .. N);
        if
        :: state[k] == PARKED ->
            state[k] = ABANDONED;
#ifndef ABANDON_KEEPS
            give_up(k)
#else
            skip
#endif
        :: else -> skip
        fi
       }
#endif
    :: break
    od
}

init {
    byte i, latest;
    bool held;
    /* Every choice of which types the endpoint takes; the outbox's map, as the trigger writes it. */
    atomic {
        i = 1;
        do
        :: i <= N ->
            if
            :: taken[i] = true
            :: taken[i] = false
            fi;
#ifdef FOLLOWS_PREVIOUS
            follows[i] = i - 1;
#else
            follows[i] = latest;
#endif
            if
            :: taken[i] -> latest = i
            :: else -> skip
            fi;
            i++
        :: else -> break
        od;
        i = 1;
        do
        :: i <= N -> if :: taken[i] -> run Message(i) :: else -> skip fi; i++
        :: else -> break
        od;
        run Operator()
    }
    /* Nothing can move, the operator gone too: no taken message still waits (holding: none
     * waits but behind an earlier message still parked, which the operator has not acted on). */
    timeout ->
    i = 1;
    do
    :: i <= N ->
#ifdef HOLD
        latest = 1;   /* reused: whether an earlier taken message is still parked */
        held = false;
        do
        :: latest < i -> held = held || (taken[latest] && state[latest] == PARKED); latest++
        :: else -> break
        od;
        assert(!taken[i] || state[i] != WAITING || held);
#else
        assert(!taken[i] || state[i] != WAITING);
#endif
        i++
    :: else -> break
    od
}
