//! Ordering per key (decisions 0017, 0024): an endpoint ordered by key applies each key's messages
//! in the order their outbox rows committed, through the relay and two consumer instances (one
//! batching, one not), while some messages fail twice before they succeed (as FLAKY-1 does): a
//! message that arrives before its key's earlier one is applied waits, and other keys keep
//! flowing. It waits only for the types it takes, a message parked before its turn gives up its
//! place, and a second copy of an applied message changes nothing.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use clap::Parser;
use messaging::{
    consumer::{self, Batching},
    contracts::Contract,
    envelope::Incoming,
    handler::{Handler, HandlerError},
    outbox::Outgoing,
    runtime::{health::Health, shutdown},
    topology::{Endpoint, RetryPolicy},
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use testkit::{TestEnv, eventually, shop::Options};

/// One step of a key's sequence.
#[derive(Debug, Serialize, Deserialize)]
struct Step {
    key: String,
    /// Its place in the key's sequence as the test wrote it, from 1.
    round: i64,
    /// Fails its first two attempts.
    flaky: bool,
    /// Fails every attempt, for good.
    #[serde(default)]
    poison: bool,
}

impl Contract for Step {
    const TYPE: &'static str = "test.step";
    const EXCHANGE: &'static str = "orders";
}

/// A message of a key's that the ordered endpoint does not take (another endpoint does).
#[derive(Debug, Serialize, Deserialize)]
struct Aside {
    key: String,
}

impl Contract for Aside {
    const TYPE: &'static str = "test.aside";
    const EXCHANGE: &'static str = "orders";
}

const KEYS: usize = 20;
const ROUNDS: i64 = 10;

/// Applies a step by appending it to `applied`, after failing a flaky step's first two attempts.
struct Apply;

impl Handler for Apply {
    async fn handle(&self, message: &Incoming, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let step: Step = message.json()?;
        if step.poison {
            return Err(HandlerError::Permanent("poison".into()));
        }
        if step.flaky && message.attempt() < 3 {
            return Err(HandlerError::Transient("flaky".into()));
        }
        let place = message.ordering.as_ref().map(|ordering| ordering.seq);
        sqlx::query("insert into applied (key, round, place) values ($1, $2, $3)")
            .bind(&step.key)
            .bind(step.round)
            .bind(place)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// A database with an `applied` table and the ordered endpoint's queues; the endpoint and its
/// retry policy.
async fn prepare(env: &TestEnv) -> (PgPool, Endpoint, RetryPolicy) {
    let pool: PgPool = env.messaging_pool("ordered").await;
    sqlx::query(
        "create table applied (n bigserial primary key, key text not null, round bigint not null, place bigint)",
    )
    .execute(&pool)
    .await
    .expect("applied");
    let endpoint = Endpoint::new("test.ordered").consume::<Step>().ordered_by_key();
    let policy = RetryPolicy::new(vec![Duration::from_millis(50), Duration::from_millis(200)], 5);
    env.declare_endpoint(&endpoint, &policy).await;
    (pool, endpoint, policy)
}

/// Write `step` to the outbox, in a transaction of its own, under its key.
async fn enqueue(pool: &PgPool, step: &Step) {
    enqueue_version(pool, step, Step::VERSION).await;
}

/// [`enqueue`], under major version `version` of its contract: 2 is one the endpoint cannot read,
/// so its consumer parks it as it arrives.
async fn enqueue_version(pool: &PgPool, step: &Step, version: u32) {
    let mut outgoing = Outgoing::of(step, None).ordered_by(&step.key);
    outgoing.headers.0.version = version;
    let mut tx = pool.begin().await.expect("begin");
    outgoing.enqueue(&mut tx).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

/// The relay, in this process, on the test's database.
fn start_relay(env: &TestEnv, listener: tokio::net::TcpListener, trigger: &shutdown::ShutdownTrigger) -> Relay {
    let mut args = vec!["relay".to_owned()];
    args.extend(Options::relay_flags(&env.database_url("ordered"), &env.amqp_url()));
    tokio::spawn(relay::run(relay::Config::parse_from(args), listener, trigger.subscribe()))
}

type Relay = tokio::task::JoinHandle<Result<(), messaging::service::BoxError>>;

/// Rounds applied so far, by key, in the order they were applied; each at the place the outbox
/// numbered it, which `place_of` gives from its round.
async fn applied_at(pool: &PgPool, place_of: impl Fn(i64) -> i64) -> BTreeMap<String, Vec<i64>> {
    let rows: Vec<(String, i64, Option<i64>)> =
        sqlx::query_as("select key, round, place from applied order by n").fetch_all(pool).await.expect("applied");
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (key, round, place) in rows {
        assert_eq!(place, Some(place_of(round)), "{key}: the outbox numbers a key's rows in commit order");
        by_key.entry(key).or_default().push(round);
    }
    by_key
}

/// Rounds applied so far, by key, where only steps were written: round n at place n.
async fn applied(pool: &PgPool) -> BTreeMap<String, Vec<i64>> {
    applied_at(pool, |round| round).await
}

/// Each key's next place at the ordered endpoint, and how many given-up places it still keeps.
async fn positions(pool: &PgPool) -> (Vec<i64>, i64) {
    let next = sqlx::query_scalar("select next from inbox_key_positions where endpoint = 'test.ordered' order by key")
        .fetch_all(pool)
        .await
        .expect("positions");
    let given_up = sqlx::query_scalar("select count(*) from inbox_key_given_up").fetch_one(pool).await.expect("count");
    (next, given_up)
}

/// `messages_handled_total` of the ordered endpoint for `outcome`, from the consumers' metrics.
fn handled(health: &Health, outcome: &str) -> u64 {
    let metrics = health.metrics.render();
    let series = format!("messages_handled_total{{endpoint=\"test.ordered\",outcome=\"{outcome}\"}} ");
    let line = metrics.lines().find(|line| line.starts_with(&series)).unwrap_or_else(|| panic!("{series}"));
    line[series.len()..].parse().expect("a count")
}

#[tokio::test]
async fn each_key_is_applied_in_its_outbox_order_through_two_consumers_and_retries() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    let (trigger, stop) = shutdown::channel();
    let mut tasks = Vec::new();
    let health = Health::default();
    let batching = Batching { max_size: 8, max_wait: Duration::from_millis(20) };
    for batch in [batching, Batching::OFF] {
        let settings = env.consumer_settings(endpoint.clone(), policy.clone(), 16, batch);
        let consumer = consumer::run(settings, Arc::new(Apply), pool.clone(), health.clone(), stop.clone());
        tasks.push(tokio::spawn(consumer));
    }

    // Interleaved: round 1 of every key, then round 2, ...; each row in its own transaction. About
    // one step in five is flaky, so its key's later steps arrive while it waits for its retry.
    let mut rng = fastrand::Rng::with_seed(23);
    let mut flaky = 0;
    for round in 1..=ROUNDS {
        for key in 0..KEYS {
            let step = Step { key: format!("k{key}"), round, flaky: rng.u8(0..5) == 0, poison: false };
            flaky += usize::from(step.flaky);
            enqueue(&pool, &step).await;
        }
    }
    assert!(flaky > 10, "{flaky} flaky steps: enough to make keys wait");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let relay = start_relay(&env, listener, &trigger);

    let total = KEYS as i64 * ROUNDS;
    eventually("every step to be applied", Duration::from_secs(120), || async {
        let applied: i64 = sqlx::query_scalar("select count(*) from applied").fetch_one(&pool).await.ok()?;
        (applied == total).then_some(())
    })
    .await;

    // Each key's steps, in the order they were applied: 1, 2, ... ROUNDS, each once, each at the
    // place the outbox gave it.
    let by_key = applied(&pool).await;
    assert_eq!(by_key.len(), KEYS);
    let in_order: Vec<i64> = (1..=ROUNDS).collect();
    for (key, rounds) in &by_key {
        assert_eq!(rounds, &in_order, "{key} applied out of its order");
    }
    assert_eq!(positions(&pool).await, (vec![ROUNDS + 1; KEYS], 0), "every key moved past its last step");

    // Later steps did wait for the flaky ones (otherwise this test proved nothing), and nothing
    // was parked.
    assert!(handled(&health, "deferred") > 0, "no step waited for an earlier one of its key");
    assert_eq!(handled(&health, "retried"), 2 * flaky as u64, "each flaky step failed twice");
    assert_eq!(handled(&health, "parked"), 0);
    assert_eq!(env.queue_depth(&endpoint.parking_queue()).await, Some(0), "nothing parked");

    trigger.trigger();
    for task in tasks {
        task.await.expect("consumer");
    }
    relay.await.expect("relay task").expect("relay");
}

/// One consumer of the ordered endpoint, not batching, and the relay, running.
struct Running {
    health: Health,
    trigger: shutdown::ShutdownTrigger,
    consumer: tokio::task::JoinHandle<()>,
    relay: Relay,
}

impl Running {
    /// Start them on the test's database.
    async fn start(env: &TestEnv, pool: &PgPool, endpoint: &Endpoint, policy: &RetryPolicy) -> Self {
        let (trigger, stop) = shutdown::channel();
        let health = Health::default();
        let settings = env.consumer_settings(endpoint.clone(), policy.clone(), 16, Batching::OFF);
        let consumer = tokio::spawn(consumer::run(settings, Arc::new(Apply), pool.clone(), health.clone(), stop));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let relay = start_relay(env, listener, &trigger);
        Self { health, trigger, consumer, relay }
    }

    /// Stop both; each must stop cleanly.
    async fn stop(self) {
        self.trigger.trigger();
        self.consumer.await.expect("consumer");
        self.relay.await.expect("relay task").expect("relay");
    }
}

/// A parked message gives up its place: its key's later messages are applied, and the key moves
/// past it.
#[tokio::test]
async fn a_parked_message_lets_its_key_go_on() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    for round in 1..=4 {
        let step = Step { key: "k".into(), round, flaky: false, poison: round == 2 };
        enqueue(&pool, &step).await;
    }
    let running = Running::start(&env, &pool, &endpoint, &policy).await;
    eventually("the steps after the poison one to be applied", Duration::from_secs(60), || async {
        (applied(&pool).await.get("k") == Some(&vec![1, 3, 4])).then_some(())
    })
    .await;
    assert_eq!(handled(&running.health, "parked"), 1);
    assert_eq!(positions(&pool).await, (vec![5], 0));
    running.stop().await;
}

/// A second copy of a message already applied (as a relay that crashed between the broker's
/// confirm and its mark publishes one) is a duplicate: its inbox row and its turn are one
/// statement, which takes no turn for a copy, so it is neither applied again nor sent to wait, and
/// its key stays where it is.
#[tokio::test]
async fn a_second_copy_of_an_applied_message_is_a_duplicate_and_leaves_its_key() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    for round in 1..=3 {
        enqueue(&pool, &Step { key: "k".into(), round, flaky: false, poison: false }).await;
    }
    let running = Running::start(&env, &pool, &endpoint, &policy).await;
    eventually("the steps to be applied", Duration::from_secs(60), || async {
        (applied(&pool).await.get("k") == Some(&vec![1, 2, 3])).then_some(())
    })
    .await;
    eventually("the steps to be marked published", Duration::from_secs(30), || async {
        let unpublished: i64 =
            sqlx::query_scalar("select count(*) from outbox where published_at is null").fetch_one(&pool).await.ok()?;
        (unpublished == 0).then_some(())
    })
    .await;
    // Rounds delivered together may have waited for each other: counted from here on.
    let (deferred, duplicates) = (handled(&running.health, "deferred"), handled(&running.health, "duplicate"));
    // The last step's row unpublished again: the relay sends a second copy of it.
    sqlx::query("update outbox set published_at = null where id = (select max(id) from outbox)")
        .execute(&pool)
        .await
        .expect("unpublish");
    eventually("the copy to be handled as a duplicate", Duration::from_secs(30), || async {
        (handled(&running.health, "duplicate") == duplicates + 1).then_some(())
    })
    .await;
    assert_eq!(applied(&pool).await.get("k"), Some(&vec![1, 2, 3]), "the copy was applied again");
    assert_eq!(positions(&pool).await, (vec![4], 0), "the copy moved its key");
    assert_eq!(handled(&running.health, "deferred"), deferred, "the copy was sent to wait");
    running.stop().await;
}

/// The outbox numbers a key's messages across every type, but the endpoint takes steps only: each
/// step waits for the key's latest earlier step, never for the asides between them, which another
/// endpoint takes. (Before decision 0024, step 2, at place 3, waited for place 2 for ever.)
#[tokio::test]
async fn an_endpoint_waits_only_for_the_types_it_takes() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    // The asides' own endpoint, so that they are routed; nothing consumes it.
    let elsewhere = Endpoint::new("test.aside").consume::<Aside>();
    env.declare_endpoint(&elsewhere, &policy).await;
    const STEPS: i64 = 5;
    for round in 1..=STEPS {
        for key in ["a", "b", "c"] {
            // Round 2 is flaky: the later steps of its key arrive while it waits for its retry.
            let step = Step { key: key.into(), round, flaky: round == 2, poison: false };
            enqueue(&pool, &step).await;
            let mut tx = pool.begin().await.expect("begin");
            Outgoing::of(&Aside { key: key.into() }, None).ordered_by(key).enqueue(&mut tx).await.expect("aside");
            tx.commit().await.expect("commit");
        }
    }
    let running = Running::start(&env, &pool, &endpoint, &policy).await;

    // Step n of a key took place 2n - 1, the asides the even places.
    let in_order: Vec<i64> = (1..=STEPS).collect();
    eventually("every step, in its order", Duration::from_secs(60), || async {
        let by_key = applied_at(&pool, |round| 2 * round - 1).await;
        (by_key.len() == 3 && by_key.values().all(|rounds| rounds.len() == in_order.len())).then_some(by_key)
    })
    .await
    .values()
    .for_each(|rounds| assert_eq!(rounds, &in_order));
    assert_eq!(positions(&pool).await, (vec![2 * STEPS; 3], 0), "every key moved past its last step");
    assert!(handled(&running.health, "deferred") > 0, "no step waited for its flaky one");
    assert_eq!(handled(&running.health, "parked"), 0);
    assert_eq!(env.queue_depth(elsewhere.name).await, Some(3 * STEPS as u32), "the asides were sent");
    running.stop().await;
}

/// A step that the endpoint cannot read (a newer major version) is parked on arrival, while the
/// key still waits for the flaky step before it: its place is written down, and when the flaky
/// step is applied the key steps over it to the steps after it. (Before decision 0024 the key
/// stopped at the unreadable step's place for ever.)
#[tokio::test]
async fn a_message_parked_before_its_turn_gives_up_its_place() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    for round in 1..=4 {
        let step = Step { key: "k".into(), round, flaky: round == 1, poison: false };
        enqueue_version(&pool, &step, if round == 2 { 2 } else { Step::VERSION }).await;
    }
    let running = Running::start(&env, &pool, &endpoint, &policy).await;
    eventually("the steps around the unreadable one to be applied", Duration::from_secs(60), || async {
        (applied(&pool).await.get("k") == Some(&vec![1, 3, 4])).then_some(())
    })
    .await;
    assert_eq!(handled(&running.health, "parked"), 1);
    assert_eq!(env.queue_depth(&endpoint.parking_queue()).await, Some(1));
    assert_eq!(handled(&running.health, "retried"), 2, "step 1 failed twice before it was applied");
    assert_eq!(positions(&pool).await, (vec![5], 0), "the key stepped over place 2");
    // Step 2 was parked before its turn (not after step 1, which would prove nothing here): its
    // place was written down, then taken when the key passed step 1. The statistics collector
    // counts the row's insert (it reports within about a second).
    eventually("place 2 written down as given up", Duration::from_secs(10), || async {
        let inserted: i64 = sqlx::query_scalar(
            "select coalesce(sum(n_tup_ins), 0)::bigint from pg_stat_user_tables where relname = 'inbox_key_given_up'",
        )
        .fetch_one(&pool)
        .await
        .ok()?;
        (inserted >= 1).then_some(())
    })
    .await;
    running.stop().await;
}

/// A park the broker does not confirm (its parking queue full by policy: the copy is nacked)
/// keeps the message's place: its key's later messages wait for it, instead of passing a message
/// parked nowhere. Once the queue takes it, it is parked and they go on (issue 56, row 9; until
/// then the place was given up before the copy was published, and rounds 3 and 4 passed at once).
#[tokio::test]
async fn a_park_the_broker_does_not_confirm_keeps_its_place() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    let refusing = testkit::http::join(env.management_url(), &format!("/api/policies/{}/refuse-parking", env.vhost()));
    let definition = serde_json::json!({
        "pattern": format!("^{}$", endpoint.parking_queue().replace('.', "\\.")),
        "definition": {"max-length": 0, "overflow": "reject-publish"},
        "apply-to": "queues",
        "priority": 10,
    });
    let set = testkit::http::request("PUT", &refusing, &[], Some(&definition.to_string())).await.expect("policy");
    assert!(set.status < 300, "the policy: {}", String::from_utf8_lossy(&set.body));
    // A quorum queue refuses a publish once it is over its length: one message puts it there.
    let connection = env.amqp().await;
    let publisher = messaging::publisher::Publisher::open(&connection).await.expect("publisher");
    let properties = lapin::BasicProperties::default().with_delivery_mode(2);
    publisher.publish("", &endpoint.parking_queue(), b"{}", properties).await.expect("the filler confirmed");
    for round in 1..=4 {
        let step = Step { key: "k".into(), round, flaky: false, poison: round == 2 };
        enqueue(&pool, &step).await;
    }
    let running = Running::start(&env, &pool, &endpoint, &policy).await;
    eventually("round 1 to be applied", Duration::from_secs(60), || async {
        (applied(&pool).await.get("k") == Some(&vec![1])).then_some(())
    })
    .await;
    // Round 2's park is refused again and again; rounds 3 and 4 wait their turn meanwhile.
    let watched = tokio::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(3) {
        assert_eq!(applied(&pool).await.get("k"), Some(&vec![1]), "a later round passed a message parked nowhere");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let removed = testkit::http::request("DELETE", &refusing, &[], None).await.expect("policy");
    assert!(removed.status < 300, "the policy: {}", String::from_utf8_lossy(&removed.body));
    eventually("the rounds after the parked one to be applied", Duration::from_secs(60), || async {
        (applied(&pool).await.get("k") == Some(&vec![1, 3, 4])).then_some(())
    })
    .await;
    assert!(handled(&running.health, "parked") >= 1);
    let _ = connection.close(200, "bye".into()).await;
    running.stop().await;
}

/// `key`'s row at the ordered endpoint, inserted and not committed: every take of a turn and
/// every give-up on it waits until the returned transaction ends.
async fn hold_key(pool: &PgPool, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query("insert into inbox_key_positions (endpoint, key, next) values ('test.ordered', $1, 1)")
        .bind(key)
        .execute(&mut *holder)
        .await
        .expect("hold the key");
    holder
}

/// A consumer's pool on the test's database whose connections wait at most 1 s for a lock.
async fn impatient_pool(env: &TestEnv) -> PgPool {
    let options: sqlx::postgres::PgConnectOptions = env.database_url("ordered").parse().expect("url");
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.options([("lock_timeout", "1s")]))
        .await
        .expect("the consumer's pool")
}

/// The give-ups of a place waiting for a lock now: each one's backend and when it began.
async fn give_ups_waiting(pool: &PgPool) -> Vec<(i32, chrono::DateTime<chrono::Utc>)> {
    sqlx::query_as(
        "select pid, query_start from pg_stat_activity
          where wait_event_type = 'Lock' and query like '%inbox_give_up_place%'",
    )
    .fetch_all(pool)
    .await
    .expect("pg_stat_activity")
}

/// A park whose give-up the database does not take at once (here a lock on its key held past the
/// consumer's `lock_timeout`; a database down is the same to it) gives up its place once the
/// database answers: the key's later message is applied. Until 2026-12-07 a single failed try
/// left the key waiting at the parked message's place for good (the short soak on TLS found it:
/// a cancelled order's `order.ended` deferred behind its parked `order.placed`).
#[tokio::test]
async fn a_give_up_the_database_refuses_is_tried_again_until_it_is_taken() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    // Round 1 unreadable (an unknown major version): parked as it arrives, before any turn.
    let step = |round| Step { key: "k".into(), round, flaky: false, poison: false };
    enqueue_version(&pool, &step(1), 2).await;
    let holder = hold_key(&pool, "k").await;
    let consumer_pool = impatient_pool(&env).await;
    let running = Running::start(&env, &consumer_pool, &endpoint, &policy).await;
    // A give-up waits for the key, then fails on the lock's timeout: seen waiting, then gone.
    let first = eventually("round 1's give-up to wait for the key", Duration::from_secs(60), || async {
        give_ups_waiting(&pool).await.into_iter().next()
    })
    .await;
    eventually("that try to fail on the lock's timeout", Duration::from_secs(30), || async {
        (!give_ups_waiting(&pool).await.contains(&first)).then_some(())
    })
    .await;
    holder.rollback().await.expect("release the key");
    // Round 2 only now, so that none of its attempts is spent on the held key.
    enqueue(&pool, &step(2)).await;
    eventually("round 2 to be applied after the parked round 1", Duration::from_secs(60), || async {
        (applied(&pool).await.get("k") == Some(&vec![2])).then_some(())
    })
    .await;
    assert_eq!(handled(&running.health, "parked"), 1);
    assert_eq!(env.queue_depth(&endpoint.parking_queue()).await, Some(1));
    assert_eq!(positions(&pool).await, (vec![3], 0));
    running.stop().await;
}

/// A park by the crash bound whose give-up of its place outlives the consumer's session is left
/// unacked and keeps its starts in the crash ledger: redelivered to the next session, it is parked
/// again at once, never handled, and only then is its place given up and its starts forgotten.
/// Until 2026-12-07 the starts were forgotten as if the park had been acked, and the message was
/// handled again, up to the bound, before it was parked a second time.
#[tokio::test]
async fn a_crash_park_left_unacked_at_the_session_s_end_keeps_its_starts_and_is_parked_again() {
    let env = TestEnv::new().await;
    let (pool, endpoint, policy) = prepare(&env).await;
    enqueue(&pool, &Step { key: "k".into(), round: 1, flaky: false, poison: false }).await;
    let message_id: uuid::Uuid =
        sqlx::query_scalar("select message_id from outbox").fetch_one(&pool).await.expect("the row");
    // Started three times (MAX_CRASHES) and never finished: its next start is past the bound.
    sqlx::query("insert into delivery_starts (endpoint, message_id, starts) values ('test.ordered', $1, 3)")
        .bind(message_id)
        .execute(&pool)
        .await
        .expect("the crash ledger");
    let starts = || async {
        sqlx::query_scalar::<_, i32>("select starts from delivery_starts where message_id = $1")
            .bind(message_id)
            .fetch_optional(&pool)
            .await
            .expect("delivery_starts")
    };
    // The relay alone publishes it; taken and given back unacked, it is redelivered, as after a
    // crash.
    let (relay_trigger, _) = shutdown::channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let relay = start_relay(&env, listener, &relay_trigger);
    eventually("the message in the work queue", Duration::from_secs(30), || async {
        (env.queue_depth(endpoint.name).await == Some(1)).then_some(())
    })
    .await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    let got = channel.basic_get(endpoint.name.into(), lapin::options::BasicGetOptions { no_ack: false }).await;
    assert!(got.expect("basic.get").is_some(), "the message");
    channel.close(200, "given back".into()).await.expect("close");

    // The key's row held past the consumer's lock_timeout: the park's give-up waits.
    let holder = hold_key(&pool, "k").await;
    let consumer_pool = impatient_pool(&env).await;
    let session = || {
        let (trigger, stop) = shutdown::channel();
        let settings = env.consumer_settings(endpoint.clone(), policy.clone(), 16, Batching::OFF);
        let task =
            tokio::spawn(consumer::run(settings, Arc::new(Apply), consumer_pool.clone(), Health::default(), stop));
        (trigger, task)
    };
    let (trigger, consumer) = session();
    eventually("the crash park's copy in parking", Duration::from_secs(30), || async {
        (env.queue_depth(&endpoint.parking_queue()).await == Some(1)).then_some(())
    })
    .await;
    eventually("its give-up waiting for the key", Duration::from_secs(30), || async {
        (!give_ups_waiting(&pool).await.is_empty()).then_some(())
    })
    .await;
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(30), consumer).await.expect("the consumer stops").expect("its task");
    assert_eq!(starts().await, Some(4), "a park left unacked keeps its starts");
    eventually("the unacked delivery back in the work queue", Duration::from_secs(30), || async {
        (env.queue_depth(endpoint.name).await == Some(1)).then_some(())
    })
    .await;

    holder.rollback().await.expect("release the key");
    let (trigger, consumer) = session();
    eventually("parked again, its place given up and its starts forgotten", Duration::from_secs(30), || async {
        let parked = env.queue_depth(&endpoint.parking_queue()).await == Some(2);
        (parked && starts().await.is_none() && positions(&pool).await == (vec![2], 0)).then_some(())
    })
    .await;
    assert_eq!(applied(&pool).await.get("k"), None, "never handled");
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(30), consumer).await.expect("the consumer stops").expect("its task");
    relay_trigger.trigger();
    relay.await.expect("relay task").expect("relay");
}
