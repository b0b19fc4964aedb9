//! What the runtime relies on from the broker, pinned on the version under test. CI runs this
//! against RabbitMQ 3.10 and 4.0 (`.ci/run`); a broker whose behaviour moves fails here first,
//! rather than losing a message in production (decision 0005).

use std::time::Duration;

use futures_util::future::join_all;

use lapin::{
    BasicProperties, Channel, Connection,
    message::BasicGetMessage,
    options::{BasicConsumeOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions},
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

/// `basic.get` without ack, then `basic.nack(requeue = true)`: what a peeking tool (the
/// management UI's "Get messages" with its default) does.
async fn peek_and_requeue(channel: &Channel, queue: &str) -> Option<BasicGetMessage> {
    let message = get(channel, queue, GONE_AFTER).await?;
    message.delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.expect("nack");
    Some(message)
}

/// `basic.get` without ack on a fresh channel, then close the channel: the broker takes the
/// delivery back, as after a crash or a lost connection.
async fn peek_and_close(connection: &Connection, queue: &str) -> Option<BasicGetMessage> {
    let channel = connection.create_channel().await.expect("channel");
    let message = get(&channel, queue, GONE_AFTER).await;
    channel.close(200, "bye".into()).await.expect("close");
    message
}

/// In a fresh quorum queue declared with `arguments`, put one message and fetch-and-requeue it
/// until it is gone or has been returned 25 times; how many returns it took.
async fn returns_kept(env: &TestEnv, queue: &str, arguments: &[(&str, AMQPValue)]) -> u32 {
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, queue, arguments).await;
    put(&connection, queue, FieldTable::default()).await;
    let mut returns = 0;
    while returns < 25 && peek_and_requeue(&channel, queue).await.is_some() {
        returns += 1;
    }
    let _ = connection.close(200, "bye".into()).await;
    returns
}

fn text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => format!("{other:?}"),
    }
}

#[tokio::test]
async fn a_parked_message_survives_100_requeues_and_100_channel_closes_with_its_headers() {
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    // The parking queue exactly as the runtime declares it.
    let endpoint = Endpoint::new("pinned.endpoint");
    topology::declare_endpoint(&channel, &endpoint, &RetryPolicy::new(vec![Duration::from_secs(1)], 3))
        .await
        .expect("declare endpoint");
    let parking = endpoint.parking_queue();
    let mut headers = FieldTable::default();
    headers.insert(envelope::HEADER_LAST_ERROR.into(), envelope::string_value("demo fault"));
    headers.insert(envelope::HEADER_ENDPOINT.into(), envelope::string_value(endpoint.name));
    headers.insert(envelope::HEADER_RETRY_COUNT.into(), AMQPValue::LongLongInt(4));
    put(&connection, &parking, headers).await;

    for cycle in 1..=100 {
        assert!(peek_and_requeue(&channel, &parking).await.is_some(), "gone at requeue {cycle}");
    }
    for cycle in 1..=100 {
        assert!(peek_and_close(&connection, &parking).await.is_some(), "gone at channel close {cycle}");
    }

    let kept = peek_and_requeue(&channel, &parking).await.expect("still parked after 200 returns");
    let properties = &kept.delivery.properties;
    assert_eq!(properties.message_id().as_ref().map(|id| id.as_str()), Some("pinned-1"));
    let headers = properties.headers().clone().expect("headers").inner().clone();
    assert_eq!(headers.get(envelope::HEADER_LAST_ERROR).map(text).as_deref(), Some("demo fault"));
    assert_eq!(headers.get(envelope::HEADER_ENDPOINT).map(text).as_deref(), Some(endpoint.name));
    assert_eq!(env.queue_depth(&parking).await, Some(1));
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn without_an_explicit_limit_4x_drops_a_message_at_its_21st_return_and_3x_keeps_it() {
    let env = TestEnv::new().await;
    let returns = returns_kept(&env, "no-limit", &[]).await;
    match env.broker_major().await {
        // Why parking and the intake declare KEEP_DELIVERY_LIMIT explicitly.
        4.. => assert_eq!(returns, 21, "4.x: a default delivery limit of 20, then dropped (no dead-letter target)"),
        _ => assert_eq!(returns, 25, "3.x: no default delivery limit"),
    }
}

#[tokio::test]
async fn delivery_limit_minus_one_is_unlimited_on_4x_but_drops_at_the_first_return_on_3x() {
    let env = TestEnv::new().await;
    let returns = returns_kept(&env, "minus-one", &[("x-delivery-limit", AMQPValue::LongLongInt(-1))]).await;
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
    assert_eq!(returns_kept(&env, "keep", &[("x-delivery-limit", keep)]).await, 25);
}

#[tokio::test]
async fn unacked_returns_count_towards_the_limit_come_back_redelivered_and_dead_letter_with_the_reason() {
    let env = TestEnv::new().await;
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    declare(&channel, "limited.dead", &[]).await;
    let limited = [
        ("x-delivery-limit", AMQPValue::LongLongInt(2)),
        ("x-dead-letter-exchange", AMQPValue::LongString("".into())),
        ("x-dead-letter-routing-key", AMQPValue::LongString("limited.dead".into())),
        ("x-dead-letter-strategy", AMQPValue::LongString("at-least-once".into())),
        ("x-overflow", AMQPValue::LongString("reject-publish".into())),
    ];
    declare(&channel, "limited", &limited).await;
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

    let first = peek_and_requeue(&channel, "counted").await.expect("delivered");
    let table = first.delivery.properties.headers().clone().expect("headers");
    let count = envelope::header_u32(&table, "x-delivery-count");
    match major {
        4.. => assert_eq!(count, Some(7), "4.x: the published header, untouched"),
        _ => assert_eq!(count, Some(0), "3.x: the broker's own count"),
    }
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

/// The broker sends a `basic.return` before the ack of the message it returns, but acks of other
/// messages may come in between, and an ack may cover several messages (`multiple`): which
/// confirm "carries" a return is not the broker's to say. Unroutable messages pipelined among
/// messages to a quorum queue (whose confirms come later) must each be reported as returned, and
/// only they: a return pinned on a neighbour would fail a delivered message and pass a lost one.
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
