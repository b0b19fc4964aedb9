//! What the runtime relies on from the broker, pinned on the version under test. CI runs this
//! against RabbitMQ 3.10, 4.0 and 4.3 (`.ci/run`); a broker whose behaviour moves fails here first,
//! rather than losing a message in production (decisions 0005 and 0011).

use std::time::Duration;

use futures_util::future::join_all;

use lapin::{
    BasicProperties, Channel, Connection,
    message::BasicGetMessage,
    options::{
        BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
        QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable},
};
use messaging::{
    envelope,
    publisher::Publisher,
    topology::{self, Endpoint, KEEP_DELIVERY_LIMIT, RetryPolicy},
};
use testkit::{TestEnv, eventually};

const WAIT: Duration = Duration::from_secs(30);
/// How long an empty `basic.get` is retried before a message counts as gone. A return (a nack,
/// a closed channel) reaches a quorum queue asynchronously, so one empty answer proves nothing.
const GONE_AFTER: Duration = Duration::from_secs(2);

/// `basic.get` without ack, retried for up to `patience` while the queue answers empty.
async fn get(channel: &Channel, queue: &str, patience: Duration) -> Option<BasicGetMessage> {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let got = channel.basic_get(queue.into(), BasicGetOptions { no_ack: false }).await.expect("basic.get");
        if got.is_some() || tokio::time::Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn declare(channel: &Channel, name: &str, arguments: &[(&str, AMQPValue)]) {
    let mut table = FieldTable::default();
    table.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    for (key, value) in arguments {
        table.insert((*key).into(), value.clone());
    }
    channel.queue_declare(name.into(), QueueDeclareOptions::durable(), table).await.expect("declare");
}

/// Publish (confirmed) one message with `headers` to `queue` by name.
async fn put(connection: &Connection, queue: &str, headers: FieldTable) {
    let publisher = Publisher::open(connection).await.expect("publisher");
    let properties = BasicProperties::default().with_message_id("pinned-1".into()).with_headers(headers);
    publisher.publish("", queue, b"{}", properties).await.expect("confirmed");
    publisher.close().await;
}

/// How a delivery goes back to its queue. RabbitMQ 4.3 counts them differently against the
/// delivery limit; 3.10 and 4.0 count all three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GiveBack {
    /// `basic.nack(requeue = true)`: what a peeking tool does (msgctl, the management UI).
    Nack,
    /// `basic.reject(requeue = true)`.
    Reject,
    /// The channel closes with the delivery unacked: a crash, a lost connection, a shutdown.
    Close,
}

impl GiveBack {
    const ALL: [GiveBack; 3] = [GiveBack::Nack, GiveBack::Reject, GiveBack::Close];
}

/// `basic.get` without ack on a fresh channel, then give the delivery back `how`.
async fn peek_and_give_back(connection: &Connection, queue: &str, how: GiveBack) -> Option<BasicGetMessage> {
    let channel = connection.create_channel().await.expect("channel");
    let message = get(&channel, queue, GONE_AFTER).await;
    if let Some(message) = &message {
        let acker = &message.delivery.acker;
        match how {
            GiveBack::Nack => {
                acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.expect("nack");
            }
            GiveBack::Reject => {
                acker.reject(BasicRejectOptions { requeue: true }).await.expect("reject");
            }
            GiveBack::Close => {}
        }
    }
    channel.close(200, "bye".into()).await.expect("close");
    message
}

/// In a fresh quorum queue declared with `arguments`, put one message and fetch and give it back
/// `how` until it is gone or has been returned 25 times; how many returns it took.
async fn returns_kept(env: &TestEnv, queue: &str, arguments: &[(&str, AMQPValue)], how: GiveBack) -> u32 {
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, queue, arguments).await;
    put(&connection, queue, FieldTable::default()).await;
    let mut returns = 0;
    while returns < 25 && peek_and_give_back(&connection, queue, how).await.is_some() {
        returns += 1;
    }
    let _ = connection.close(200, "bye".into()).await;
    returns
}

/// What one delivery says of its returns: (`x-delivery-count`, `x-acquired-count`).
type Counts = (Option<u32>, Option<u32>);

/// The arguments of a quorum queue that dead-letters into `target` after `limit` counted returns.
fn limited_to(limit: i64, target: &str) -> [(&'static str, AMQPValue); 5] {
    [
        ("x-delivery-limit", AMQPValue::LongLongInt(limit)),
        ("x-dead-letter-exchange", AMQPValue::LongString("".into())),
        ("x-dead-letter-routing-key", AMQPValue::LongString(target.into())),
        ("x-dead-letter-strategy", AMQPValue::LongString("at-least-once".into())),
        ("x-overflow", AMQPValue::LongString("reject-publish".into())),
    ]
}

fn text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => format!("{other:?}"),
    }
}

#[tokio::test]
async fn a_parked_message_survives_100_nacks_100_rejects_and_100_channel_closes_with_its_headers() {
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    // The parking queue exactly as the runtime declares it.
    let endpoint = Endpoint::new("pinned.endpoint");
    topology::declare_endpoint(&connection, &endpoint, &RetryPolicy::new(vec![Duration::from_secs(1)], 3))
        .await
        .expect("declare endpoint");
    let parking = endpoint.parking_queue();
    let mut headers = FieldTable::default();
    headers.insert(envelope::HEADER_LAST_ERROR.into(), envelope::string_value("demo fault"));
    headers.insert(envelope::HEADER_ENDPOINT.into(), envelope::string_value(endpoint.name));
    headers.insert(envelope::HEADER_RETRY_COUNT.into(), AMQPValue::LongLongInt(4));
    put(&connection, &parking, headers).await;

    for cycle in 1..=100 {
        assert!(peek_and_give_back(&connection, &parking, GiveBack::Nack).await.is_some(), "gone at nack {cycle}");
    }
    for cycle in 1..=100 {
        assert!(peek_and_give_back(&connection, &parking, GiveBack::Reject).await.is_some(), "gone at reject {cycle}");
    }
    for cycle in 1..=100 {
        assert!(peek_and_give_back(&connection, &parking, GiveBack::Close).await.is_some(), "gone at close {cycle}");
    }

    let kept = peek_and_give_back(&connection, &parking, GiveBack::Nack).await.expect("still parked after 300 returns");
    let properties = &kept.delivery.properties;
    assert_eq!(properties.message_id().as_ref().map(|id| id.as_str()), Some("pinned-1"));
    let headers = properties.headers().clone().expect("headers").inner().clone();
    assert_eq!(headers.get(envelope::HEADER_LAST_ERROR).map(text).as_deref(), Some("demo fault"));
    assert_eq!(headers.get(envelope::HEADER_ENDPOINT).map(text).as_deref(), Some(endpoint.name));
    assert_eq!(env.queue_depth(&parking).await, Some(1));
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn without_an_explicit_limit_4_0_drops_a_message_at_its_21st_return_4_3_unless_nacked_and_3x_keeps_it() {
    // Why parking and the intake declare KEEP_DELIVERY_LIMIT explicitly: 4.x gives every quorum
    // queue a default limit of 20, and with no dead-letter target a message past it is dropped.
    let env = TestEnv::new().await;
    let line = env.broker_line().await;
    for how in GiveBack::ALL {
        let returns = returns_kept(&env, &format!("no-limit-{how:?}"), &[], how).await;
        let expected = match (line, how) {
            ((3, _), _) => 25,
            // Measured on 4.0.5: every return counts.
            ((4, ..=2), _) => 21,
            // 4.3: a nack no longer counts (only x-acquired-count grows); a reject or a lost
            // channel still does.
            (_, GiveBack::Nack) => 25,
            (_, GiveBack::Reject | GiveBack::Close) => 21,
        };
        assert_eq!(returns, expected, "{line:?}, given back by {how:?}");
    }
}

#[tokio::test]
async fn nack_reject_and_a_lost_channel_against_the_delivery_limit_and_the_counts_each_delivery_carries() {
    // What each way of giving a delivery back spends of a limit of 2, and what the broker tells
    // the consumer about it (x-delivery-count, and from 4.3 x-acquired-count). Decision 0011 reads
    // this table: a crash of the consumer (Close) is counted on every version, so the broker's
    // limit stays the last resort against crash loops on 4.3 too.
    let env = TestEnv::new().await;
    let line = env.broker_line().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    for how in GiveBack::ALL {
        let queue = format!("limited-{how:?}");
        let dead = format!("{queue}.dead");
        declare(&channel, &dead, &[]).await;
        declare(&channel, &queue, &limited_to(2, &dead)).await;
        put(&connection, &queue, FieldTable::default()).await;
        let mut counts: Vec<Counts> = Vec::new();
        // Up to six deliveries.
        while counts.len() < 6 {
            let Some(message) = peek_and_give_back(&connection, &queue, how).await else { break };
            let headers = message.delivery.properties.headers().clone().unwrap_or_default();
            counts.push((
                envelope::header_u32(&headers, "x-delivery-count"),
                envelope::header_u32(&headers, "x-acquired-count"),
            ));
        }
        let dead_lettered = get(&channel, &dead, GONE_AFTER).await.is_some();
        let expected: (&[Counts], bool) = match (line, how) {
            // 3.10 stamps its own count on every delivery, from 0.
            ((3, _), _) => (&[(Some(0), None), (Some(1), None), (Some(2), None)], true),
            ((4, ..=2), _) => (&[(None, None), (Some(1), None), (Some(2), None)], true),
            (_, GiveBack::Nack) => (
                &[(None, None), (None, Some(1)), (None, Some(2)), (None, Some(3)), (None, Some(4)), (None, Some(5))],
                false,
            ),
            (_, GiveBack::Reject | GiveBack::Close) => (&[(None, None), (Some(1), Some(1)), (Some(2), Some(2))], true),
        };
        assert_eq!((counts.as_slice(), dead_lettered), expected, "{line:?}, given back by {how:?}");
    }
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn delivery_limit_minus_one_is_unlimited_on_4x_but_drops_at_the_first_return_on_3x() {
    let env = TestEnv::new().await;
    // Rejected, so that every version counts the returns (a nack does not on 4.3).
    let returns =
        returns_kept(&env, "minus-one", &[("x-delivery-limit", AMQPValue::LongLongInt(-1))], GiveBack::Reject).await;
    match env.broker_major().await {
        4.. => assert_eq!(returns, 25, "4.x: -1 is unlimited"),
        // Why KEEP_DELIVERY_LIMIT is the largest positive value, not -1.
        _ => assert_eq!(returns, 1, "3.x: -1 means the first return already exceeds the limit"),
    }
}

#[tokio::test]
async fn the_keep_limit_is_accepted_and_keeps_messages_on_every_version() {
    let env = TestEnv::new().await;
    let keep = AMQPValue::LongLongInt(i64::from(KEEP_DELIVERY_LIMIT));
    for how in GiveBack::ALL {
        let queue = format!("keep-{how:?}");
        assert_eq!(returns_kept(&env, &queue, &[("x-delivery-limit", keep.clone())], how).await, 25, "{how:?}");
    }
}

#[tokio::test]
async fn unacked_returns_count_towards_the_limit_come_back_redelivered_and_dead_letter_with_the_reason() {
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, "limited.dead", &[]).await;
    declare(&channel, "limited", &limited_to(2, "limited.dead")).await;
    put(&connection, "limited", FieldTable::default()).await;

    // A consumer that takes the delivery and dies with its channel, again and again, never
    // handling it: each return still counts, and each redelivery is flagged.
    let mut deliveries = Vec::new();
    loop {
        let consumer_channel = connection.create_channel().await.expect("channel");
        let mut consumer = consumer_channel
            .basic_consume("limited".into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .expect("consume");
        use futures_util::StreamExt;
        let next = tokio::time::timeout(Duration::from_millis(500), consumer.next()).await;
        consumer_channel.close(200, "bye".into()).await.expect("close");
        match next {
            Ok(Some(Ok(delivery))) => deliveries.push(delivery.redelivered),
            _ => break,
        }
        assert!(deliveries.len() <= 10, "the limit of 2 was not enforced");
    }
    assert_eq!(deliveries, [false, true, true], "delivered once, then redelivered up to the limit of 2 returns");

    let dead = eventually("the dead letter", WAIT, || async {
        channel.basic_get("limited.dead".into(), BasicGetOptions { no_ack: true }).await.expect("basic.get")
    })
    .await;
    let reason = envelope::broker_death(&dead.delivery.properties).expect("x-first-death-* headers");
    assert_eq!(reason, "dead-lettered by the broker from `limited` (delivery_limit)");
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn x_delivery_count_is_set_by_3x_on_every_delivery_and_passed_through_as_published_by_4x() {
    // Why copies must drop the broker's headers on 4.x (a copied count would be read as the
    // copy's own), and why tests read them through `TestEnv::published_broker_headers`.
    let env = TestEnv::new().await;
    let major = env.broker_major().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, "counted", &[]).await;
    let mut headers = FieldTable::default();
    headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(7));
    put(&connection, "counted", headers).await;

    let first = peek_and_give_back(&connection, "counted", GiveBack::Nack).await.expect("delivered");
    let table = first.delivery.properties.headers().clone().expect("headers");
    let count = envelope::header_u32(&table, "x-delivery-count");
    match major {
        4.. => assert_eq!(count, Some(7), "4.x: the published header, untouched"),
        _ => assert_eq!(count, Some(0), "3.x: the broker's own count"),
    }
}

#[tokio::test]
async fn queues_declared_before_the_endpoint_s_direct_exchange_are_kept_and_still_dead_letter() {
    // Decision 0021: queues dead-letter through the endpoint's own direct exchange; the work and
    // wait queues of an earlier release dead-letter through the default exchange, and the broker
    // refuses to change that. The endpoint's declaration keeps them as they are, binds them, and
    // a copy sent through the direct exchange still comes back from the wait queue.
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    let endpoint = Endpoint::new("earlier.endpoint");
    let tier = Duration::from_secs(1);
    let wait = endpoint.wait_queue(tier);
    let mut earlier_wait = limited_to(i64::from(KEEP_DELIVERY_LIMIT), endpoint.name).to_vec();
    earlier_wait[0] = ("x-message-ttl", AMQPValue::LongLongInt(1000));
    declare(&channel, &wait, &earlier_wait).await;
    let earlier_work = limited_to(i64::from(endpoint.delivery_limit), &endpoint.dead_lettered_queue());
    declare(&channel, endpoint.name, &earlier_work).await;

    topology::declare_endpoint(&connection, &endpoint, &RetryPolicy::new(vec![tier], 3))
        .await
        .expect("an earlier release's queues are kept");
    let publisher = Publisher::open(&connection).await.expect("publisher");
    let properties = BasicProperties::default().with_message_id("earlier-1".into());
    publisher.publish(&endpoint.direct_exchange(), &wait, b"{}", properties).await.expect("routed to the wait queue");
    eventually("the copy back in the work queue", WAIT, || async {
        (env.queue_depth(endpoint.name).await == Some(1)).then_some(())
    })
    .await;
    assert_eq!(env.queue_depth(&wait).await, Some(0));
}

#[tokio::test]
async fn a_queue_redeclared_with_other_arguments_is_refused() {
    // Why changing DELIVERY_LIMIT or the dead-letter target of an existing queue needs the move
    // described in decision 0005: the broker refuses the declaration and closes the channel.
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, "declared", &[("x-delivery-limit", AMQPValue::LongLongInt(20))]).await;
    let mut other = FieldTable::default();
    other.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    other.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(1000));
    let refused = channel.queue_declare("declared".into(), QueueDeclareOptions::durable(), other).await;
    let error = refused.expect_err("an inequivalent redeclaration is refused").to_string();
    assert!(error.contains("PRECONDITION_FAILED") || error.contains("inequivalent"), "{error}");
}

#[tokio::test]
async fn what_4_3_refuses_of_the_features_it_deprecates_and_what_it_still_accepts() {
    // The runtime uses none of these (durable quorum queues, per-consumer prefetch); pinned so
    // that a team reading 4.3's release notes knows what 4.3.6 really does. Measured on 4.3.6: of
    // the removals the notes announce, only classic queue storage v1 is refused; `x-queue-mode`
    // is accepted, and transient non-exclusive queues are still `permitted_by_default`.
    let env = TestEnv::new().await;
    let line = env.broker_line().await;
    let connection = env.amqp().await;
    let declared = |name: &'static str, durable: bool, argument: Option<(&'static str, AMQPValue)>| {
        let connection = &connection;
        async move {
            let channel = connection.create_channel().await.expect("channel");
            let mut arguments = FieldTable::default();
            if let Some((key, value)) = argument {
                arguments.insert(key.into(), value);
            }
            let options = QueueDeclareOptions { durable, ..Default::default() };
            channel.queue_declare(name.into(), options, arguments).await.map(|_| ()).map_err(|e| e.to_string())
        }
    };
    let version_1 = declared("cq-v1", true, Some(("x-queue-version", AMQPValue::LongLongInt(1)))).await;
    if line >= (4, 3) {
        let error = version_1.expect_err("4.3 has no classic queue storage v1");
        assert!(error.contains("PRECONDITION_FAILED") && error.contains("x-queue-version"), "{error}");
    } else {
        version_1.expect("classic queue storage v1 before 4.3");
    }
    declared("lazy", true, Some(("x-queue-mode", AMQPValue::LongString("lazy".into()))))
        .await
        .expect("x-queue-mode is accepted");
    declared("transient", false, None).await.expect("a transient non-exclusive queue is accepted");
    // Global QoS is `denied` in 4.3.6's deprecated features, yet basic.qos(global) is answered and
    // the channel stays open.
    let channel = connection.create_channel().await.expect("channel");
    channel.basic_qos(10, BasicQosOptions { global: true }).await.expect("global basic.qos is answered");
    channel
        .queue_declare(
            "lazy".into(),
            QueueDeclareOptions { passive: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .expect("the channel is still open after a global basic.qos");
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn delayed_retry_arguments_hold_a_rejected_message_back_on_4_3_and_are_silently_ignored_before() {
    // 4.3's native delayed retry (decision 0011 on why the runtime keeps its wait queues): a
    // returned message waits min(x-delayed-retry-min × delivery-count, x-delayed-retry-max) before
    // it is delivered again. Older brokers accept the same arguments and do nothing with them.
    let env = TestEnv::new().await;
    let line = env.broker_line().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    let delayed = [
        ("x-delayed-retry-type", AMQPValue::LongString("all".into())),
        ("x-delayed-retry-min", AMQPValue::LongLongInt(3_000)),
    ];
    declare(&channel, "delayed", &delayed).await;
    put(&connection, "delayed", FieldTable::default()).await;
    peek_and_give_back(&connection, "delayed", GiveBack::Reject).await.expect("first delivery");
    // A lower bound only: a slow machine can make the message later, never earlier.
    let soon = get(&channel, "delayed", Duration::from_millis(1_500)).await;
    if line >= (4, 3) {
        assert!(soon.is_none(), "4.3: a rejected message is held back for x-delayed-retry-min");
        let later = get(&channel, "delayed", WAIT).await;
        assert!(later.is_some_and(|m| m.delivery.redelivered), "4.3: and then delivered again, not dropped");
    } else {
        assert!(soon.is_some(), "{line:?}: the arguments are accepted and ignored; the message is back at once");
    }
    let _ = connection.close(200, "bye".into()).await;
}

/// The broker sends a `basic.return` before the ack of the message it returns, but acks of other
/// messages may come in between, and an ack may cover several messages (`multiple`): which
/// confirm "carries" a return is not the broker's to say. Unroutable messages pipelined among
/// messages to a quorum queue (whose confirms come later) must each be reported as returned, and
/// only they: a return pinned on a neighbour would fail a delivered message and pass a lost one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_waiter_on_a_shared_publisher_gets_its_confirm_when_confirms_come_out_of_order() {
    // A quorum queue confirms after its commit, a classic queue at once: publishes to both,
    // interleaved, are confirmed out of publish order. Many tasks on several threads each send
    // to both and wait, as a consumer's held settlements do (a copy, then its job event). A
    // resolution one task collects must still wake the others it unblocks: lost, a task sleeps
    // until its deadline although its confirm came long ago.
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, "confirms.quorum", &[]).await;
    channel
        .queue_declare("confirms.classic".into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .expect("declare");
    // A deadline far beyond the test's wait: a lost wakeup is then a task that never wakes, not
    // one the deadline's timer wakes to find its confirm there all along (before the mend, rounds
    // took 10 s, a 10 s deadline, rather than a few milliseconds).
    let publisher =
        Publisher::open(&connection).await.expect("publisher").with_confirm_timeout(Duration::from_secs(3600));
    for round in 0..30 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..16 {
            let publisher = publisher.clone();
            tasks.spawn(async move {
                let properties =
                    |k: u8| BasicProperties::default().with_message_id(format!("c-{round}-{i}-{k}").into());
                let quorum = publisher.send("", "confirms.quorum", b"{}", properties(0)).await?;
                let classic = publisher.send("", "confirms.classic", b"{}", properties(1)).await?;
                let (quorum, classic) = tokio::join!(quorum.confirmed(), classic.confirmed());
                quorum.and(classic)
            });
        }
        let joined = tokio::time::timeout(WAIT, async {
            while let Some(joined) = tasks.join_next().await {
                joined.expect("a task").unwrap_or_else(|error| panic!("round {round}: {error}"));
            }
        });
        joined
            .await
            .unwrap_or_else(|_| panic!("round {round}: a confirm the broker sent was not seen within {WAIT:?}"));
    }
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn pipelined_publishes_report_exactly_the_unroutable_ones_as_returned() {
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, "returns.target", &[]).await;
    let publisher = Publisher::open(&connection).await.expect("publisher");
    for round in 0..20 {
        let mut sent = Vec::new();
        for i in 0..50 {
            let unroutable = (i * 7 + round) % 5 == 0;
            let queue = if unroutable { "returns.nowhere" } else { "returns.target" };
            let properties = BasicProperties::default().with_message_id(format!("m-{round}-{i}").into());
            sent.push((unroutable, Some(publisher.send("", queue, b"{}", properties).await.expect("sent"))));
        }
        // Awaited in publish order, in reverse, and all at once: whoever awaits first, each
        // outcome is its own.
        let outcomes: Vec<_> = match round % 3 {
            0 => {
                let mut outcomes = Vec::new();
                for (_, pending) in sent.iter_mut() {
                    outcomes.push(pending.take().expect("pending").confirmed().await);
                }
                outcomes
            }
            1 => {
                let mut outcomes = Vec::new();
                for (_, pending) in sent.iter_mut().rev() {
                    outcomes.push(pending.take().expect("pending").confirmed().await);
                }
                outcomes.reverse();
                outcomes
            }
            _ => join_all(sent.iter_mut().map(|(_, pending)| pending.take().expect("pending").confirmed())).await,
        };
        let mut wrong = Vec::new();
        for (i, ((unroutable, _), outcome)) in sent.iter().zip(outcomes).enumerate() {
            let returned = matches!(outcome, Err(messaging::publisher::PublishError::Returned(_)));
            assert!(returned || outcome.is_ok(), "message {i}: {outcome:?}");
            if returned != *unroutable {
                wrong.push((i, *unroutable));
            }
        }
        assert!(wrong.is_empty(), "round {round}: (message, was unroutable) reported wrongly: {wrong:?}");
    }
    let _ = connection.close(200, "bye".into()).await;
}
