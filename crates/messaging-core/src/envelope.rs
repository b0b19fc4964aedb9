//! The envelope: what every message carries besides its body, and how it maps onto AMQP properties
//! (`docs/architecture.md`). Outgoing messages are built from outbox rows or contracts; incoming
//! deliveries are decoded here once, before any handler sees them.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use lapin::{
    BasicProperties,
    message::Delivery,
    types::{AMQPValue, FieldTable, LongString, ShortString},
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// `content_type` of every message we publish.
pub const CONTENT_TYPE_JSON: &str = "application/json";
/// Header: schema major version of the body (integer).
pub const HEADER_VERSION: &str = "version";
/// Header: W3C trace context.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// Header: how many times the message has been retried. Ours, not the broker's `x-death`, which
/// RabbitMQ 3.13+/4.x no longer counts for client re-publishes.
pub const HEADER_RETRY_COUNT: &str = "retry-count";
/// Header on parked messages: why it was parked.
pub const HEADER_LAST_ERROR: &str = "last-error";
/// Header on parked messages: the endpoint that gave up on it.
pub const HEADER_ENDPOINT: &str = "endpoint";
/// Header on parked messages: when it was parked (RFC 3339).
pub const HEADER_PARKED_AT: &str = "parked-at";
/// Header: how many times an operator sent the message back from parking (`msgctl`).
pub const HEADER_REDRIVE_COUNT: &str = "redrive-count";
/// Header: the key whose messages an ordered endpoint applies in order (decision 0017).
pub const HEADER_ORDERING_KEY: &str = "ordering-key";
/// Header: the message's place among its key's messages, from 1, given by the outbox at insert.
pub const HEADER_ORDERING_SEQ: &str = "ordering-seq";
/// Header: for each message type, the place of the key's latest earlier message of that type (a
/// table of type → place), given by the outbox at insert: an ordered endpoint waits only for the
/// earlier messages of the types it takes (decision 0024).
pub const HEADER_ORDERING_EARLIER: &str = "ordering-earlier";
/// Header: how many times an ordered endpoint has sent the message back to wait for an earlier
/// message of its key.
pub const HEADER_DEFERRALS: &str = "deferrals";

/// AMQP `delivery_mode` for persistent messages.
const PERSISTENT: u8 = 2;

/// Metadata that travels with a message: stored in the outbox `headers` column as JSON and
/// written into AMQP properties and headers on publish.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Headers {
    /// The job this message belongs to (AMQP `correlation_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<Uuid>,
    /// W3C trace context, passed along unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// Schema major version of the body.
    #[serde(default = "default_version")]
    pub version: u32,
    /// The key whose messages an ordered endpoint applies in order ([`Headers::ordered_by`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordering_key: Option<String>,
    /// The message's place among its key's messages: written by the outbox's insert trigger
    /// (migration `0102_ordering_keys.sql`), never by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordering_seq: Option<i64>,
    /// For each message type, the place of the key's latest earlier message of that type: written
    /// by the outbox's insert trigger (migration `0106_ordering_gaps.sql`), never by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordering_earlier: Option<BTreeMap<String, i64>>,
}

fn default_version() -> u32 {
    1
}

impl Headers {
    /// Headers for a message of contract `C` belonging to job `correlation_id`: the version is
    /// the contract's, never chosen by hand.
    /// It carries the current trace context ([`crate::trace::current`]) if there is one: a message
    /// written while handling a delivery or a request continues its trace.
    pub fn of<C: crate::contracts::Contract>(correlation_id: Option<Uuid>) -> Self {
        let traceparent = crate::trace::current().map(|context| context.traceparent());
        Self { traceparent, ..Self::raw(correlation_id, C::VERSION) }
    }

    /// Headers for a message that is no contract of this code (tests and tools that forge one),
    /// claiming `version`.
    pub fn raw(correlation_id: Option<Uuid>, version: u32) -> Self {
        Self {
            correlation_id,
            traceparent: None,
            version,
            ordering_key: None,
            ordering_seq: None,
            ordering_earlier: None,
        }
    }

    /// The same headers, for a message of `key`: an endpoint that applies its messages in order
    /// (`Endpoint::ordered_by_key`) applies the messages of one key in the order their outbox
    /// rows committed. The outbox numbers them at insert.
    pub fn ordered_by(self, key: impl Into<String>) -> Self {
        Self { ordering_key: Some(key.into()), ..self }
    }

    /// The AMQP properties of a message with these headers.
    pub fn properties(&self, message_id: Uuid, message_type: &str, timestamp: DateTime<Utc>) -> BasicProperties {
        let mut table = FieldTable::default();
        table.insert(HEADER_VERSION.into(), AMQPValue::LongLongInt(i64::from(self.version)));
        if let Some(traceparent) = &self.traceparent {
            table.insert(HEADER_TRACEPARENT.into(), AMQPValue::LongString(traceparent.as_str().into()));
        }
        if let (Some(key), Some(seq)) = (&self.ordering_key, self.ordering_seq) {
            table.insert(HEADER_ORDERING_KEY.into(), AMQPValue::LongString(key.as_str().into()));
            table.insert(HEADER_ORDERING_SEQ.into(), AMQPValue::LongLongInt(seq));
            if let Some(earlier) = &self.ordering_earlier {
                let mut places = FieldTable::default();
                for (message_type, place) in earlier {
                    places.insert(message_type.as_str().into(), AMQPValue::LongLongInt(*place));
                }
                table.insert(HEADER_ORDERING_EARLIER.into(), AMQPValue::FieldTable(places));
            }
        }
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(message_id.to_string()))
            .with_type(ShortString::from(message_type))
            .with_content_type(CONTENT_TYPE_JSON.into())
            .with_delivery_mode(PERSISTENT)
            .with_timestamp(u64::try_from(timestamp.timestamp()).unwrap_or(0))
            .with_headers(table);
        match self.correlation_id {
            Some(id) => properties.with_correlation_id(ShortString::from(id.to_string())),
            None => properties,
        }
    }
}

/// A job event's body and AMQP properties as published: a new message id, the job as correlation
/// id, and the current trace context.
pub fn job_event<E: crate::contracts::JobEvent>(event: &E) -> serde_json::Result<(Vec<u8>, BasicProperties)> {
    let properties = Headers::of::<E>(Some(event.job_id())).properties(Uuid::now_v7(), E::TYPE, Utc::now());
    Ok((serde_json::to_vec(event)?, properties))
}

/// Why a delivery cannot be handed to a handler. Such a message is parked at once: no retry can
/// make it readable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// No `message_id`, or not a UUID: the inbox cannot deduplicate it.
    #[error("missing or malformed message_id")]
    MessageId,
    /// No `type` property.
    #[error("missing message type")]
    MissingType,
    /// A type this endpoint does not consume.
    #[error("unknown message type `{0}`")]
    UnknownType(String),
    /// A schema major version this endpoint does not understand.
    #[error("unsupported version {version} of `{message_type}`")]
    UnsupportedVersion {
        /// The message type.
        message_type: String,
        /// The version it claims.
        version: u32,
    },
    /// The body is not JSON of the expected shape.
    #[error("unreadable body: {0}")]
    Body(String),
}

/// A decoded delivery: the envelope fields a handler and the runtime need, and the raw body.
#[derive(Debug, Clone)]
pub struct Incoming {
    /// Stable id of the message across every republish: the inbox key.
    pub message_id: Uuid,
    /// e.g. `user.registered`.
    pub message_type: String,
    /// Schema major version.
    pub version: u32,
    /// The job the message belongs to, if any.
    pub correlation_id: Option<Uuid>,
    /// How many times this message has been retried before this delivery.
    pub retry_count: u32,
    /// Its key and its place among that key's messages, if it was written with one.
    pub ordering: Option<Ordering>,
    /// The JSON body.
    pub body: Vec<u8>,
}

/// A message's key and place among its key's messages (from 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ordering {
    /// The key.
    pub key: String,
    /// Its place, from 1.
    pub seq: i64,
    /// For each message type, the place of the key's latest earlier message of that type; `None`
    /// for a message numbered before the outbox kept them (migration `0106_ordering_gaps.sql`).
    pub earlier: Option<BTreeMap<String, i64>>,
}

impl Ordering {
    /// The place of the key's latest earlier message among those of a type `takes` says yes to
    /// (0 if none): the one message an endpoint taking those types must apply before this one. A
    /// message without `earlier` follows the place just before its own.
    ///
    /// ```
    /// use messaging_core::envelope::Ordering;
    ///
    /// let earlier = [("order.placed".to_owned(), 1), ("order.deadline".to_owned(), 2)].into();
    /// let ended = Ordering { key: "order-7".into(), seq: 3, earlier: Some(earlier) };
    /// // An endpoint that never takes `order.deadline` does not wait for place 2.
    /// assert_eq!(ended.follows(|message_type| message_type != "order.deadline"), 1);
    /// assert_eq!(ended.follows(|_| true), 2);
    /// ```
    pub fn follows(&self, takes: impl Fn(&str) -> bool) -> i64 {
        match &self.earlier {
            Some(earlier) => earlier
                .iter()
                .filter(|(message_type, _)| takes(message_type))
                .map(|(_, place)| *place)
                .max()
                .unwrap_or(0),
            None => self.seq - 1,
        }
    }
}

impl Incoming {
    /// Decode the envelope of a delivery. Body parsing is left to [`Incoming::json`].
    pub fn decode(delivery: &Delivery) -> Result<Self, Unreadable> {
        let properties = &delivery.properties;
        let message_id = message_id(properties).ok_or(Unreadable::MessageId)?;
        let message_type =
            properties.kind().as_ref().map(|kind| kind.as_str().to_owned()).ok_or(Unreadable::MissingType)?;
        let headers = properties.headers().as_ref();
        let version = headers.and_then(|h| header_u32(h, HEADER_VERSION)).unwrap_or(1);
        Ok(Self {
            message_id,
            message_type,
            version,
            correlation_id: correlation_id(properties),
            retry_count: retry_count(delivery),
            ordering: headers.and_then(ordering),
            body: delivery.data.clone(),
        })
    }

    /// The attempt this delivery is: 1 for the first, `retry_count + 1` in general.
    pub fn attempt(&self) -> u32 {
        self.retry_count.saturating_add(1)
    }

    /// Parse the body as `T`.
    pub fn json<'a, T: Deserialize<'a>>(&'a self) -> Result<T, Unreadable> {
        serde_json::from_slice(&self.body).map_err(|e| Unreadable::Body(e.to_string()))
    }
}

/// The ordering key and place a message's headers carry, if both are there.
pub fn ordering(headers: &FieldTable) -> Option<Ordering> {
    let key = header_text(headers, HEADER_ORDERING_KEY)?;
    let seq = header_i64(headers, HEADER_ORDERING_SEQ)?;
    let earlier = match headers.inner().get(HEADER_ORDERING_EARLIER) {
        Some(AMQPValue::FieldTable(places)) => Some(
            places
                .inner()
                .iter()
                .filter_map(|(message_type, place)| Some((message_type.as_str().to_owned(), integer(place)?)))
                .collect(),
        ),
        _ => None,
    };
    Some(Ordering { key, seq, earlier })
}

/// The `message_id` property as a UUID, if present and well-formed.
pub fn message_id(properties: &BasicProperties) -> Option<Uuid> {
    properties.message_id().as_ref().and_then(|id| Uuid::parse_str(id.as_str()).ok())
}

/// The `correlation_id` property (the job id) as a UUID, if present and well-formed.
pub fn correlation_id(properties: &BasicProperties) -> Option<Uuid> {
    properties.correlation_id().as_ref().and_then(|id| Uuid::parse_str(id.as_str()).ok())
}

/// The `traceparent` header of a message, if any.
pub fn traceparent(properties: &BasicProperties) -> Option<String> {
    header_text(properties.headers().as_ref()?, HEADER_TRACEPARENT)
}

/// A text header (an AMQP long string), if present.
pub fn header_text(table: &FieldTable, key: &str) -> Option<String> {
    match table.inner().get(key)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into_owned()),
        _ => None,
    }
}

/// Our `retry-count` header of a delivery (0 when absent).
pub fn retry_count(delivery: &Delivery) -> u32 {
    delivery.properties.headers().as_ref().and_then(|h| header_u32(h, HEADER_RETRY_COUNT)).unwrap_or(0)
}

/// An integer header, whatever integer width the publisher chose.
pub fn header_u32(table: &FieldTable, key: &str) -> Option<u32> {
    u32::try_from(header_i64(table, key)?).ok()
}

/// An integer header as `i64`, whatever integer width the publisher chose.
pub fn header_i64(table: &FieldTable, key: &str) -> Option<i64> {
    integer(table.inner().get(key)?)
}

/// An integer value as `i64`, whatever integer width the publisher chose.
fn integer(value: &AMQPValue) -> Option<i64> {
    Some(match value {
        AMQPValue::ShortShortInt(v) => i64::from(*v),
        AMQPValue::ShortShortUInt(v) => i64::from(*v),
        AMQPValue::ShortInt(v) => i64::from(*v),
        AMQPValue::ShortUInt(v) => i64::from(*v),
        AMQPValue::LongInt(v) => i64::from(*v),
        AMQPValue::LongUInt(v) => i64::from(*v),
        AMQPValue::LongLongInt(v) => *v,
        AMQPValue::Timestamp(v) => i64::try_from(*v).ok()?,
        AMQPValue::LongString(v) => std::str::from_utf8(v.as_bytes()).ok()?.parse().ok()?,
        _ => return None,
    })
}

/// A copy of `properties` for a message the runtime publishes again (a retry or a parked copy):
/// the original AMQP properties (`message_id`, type, correlation id, ...) and our own headers, with
/// `extra` set on top (replacing any of the same name).
///
/// Headers starting with `x-` belong to the broker (`x-death`, `x-delivery-count`,
/// `x-first-death-*`...) and are never copied: on 3.x a republished `x-death` can make a replayed
/// message look like a dead-letter cycle, and 4.0.0-4.0.4 fail to upgrade queues holding such
/// messages. What they said is carried in our own headers instead (`last-error`).
pub fn with_headers(properties: &BasicProperties, extra: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut table = own_headers(properties, &[]);
    for (key, value) in extra {
        table.insert(ShortString::from(*key), value.clone());
    }
    properties.clone().with_headers(table)
}

/// The headers of `properties` that are ours (not the broker's `x-*`), less those in `except`.
fn own_headers(properties: &BasicProperties, except: &[&str]) -> FieldTable {
    let mut table = FieldTable::default();
    if let Some(original) = properties.headers() {
        for (key, value) in original.inner() {
            if !key.as_str().starts_with("x-") && !except.contains(&key.as_str()) {
                table.insert(key.clone(), value.clone());
            }
        }
    }
    table
}

/// The properties of a parked message sent back to its work queue (`msgctl parked redrive`): as
/// parked, without the parking headers and the retry count (its attempts start again at 1), and
/// with `redrive-count` set to `redrive_count`.
pub fn redriven(properties: &BasicProperties, redrive_count: u32) -> BasicProperties {
    let parking = [HEADER_LAST_ERROR, HEADER_ENDPOINT, HEADER_PARKED_AT, HEADER_RETRY_COUNT];
    let mut table = own_headers(properties, &parking);
    table.insert(HEADER_REDRIVE_COUNT.into(), AMQPValue::LongLongInt(i64::from(redrive_count)));
    properties.clone().with_headers(table)
}

/// Why the broker dead-lettered a message, from the headers it adds (`x-first-death-reason`,
/// `x-first-death-queue`, and the `count` of the first `x-death` entry), pinned on 3.10 and 4.0 by
/// `tests/broker_semantics.rs`. `None` if the message carries no such headers.
pub fn broker_death(properties: &BasicProperties) -> Option<String> {
    let headers = properties.headers().as_ref()?;
    let text = |key: &str| header_text(headers, key);
    let reason = text("x-first-death-reason")?;
    let queue = text("x-first-death-queue").unwrap_or_else(|| "?".into());
    let count = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(deaths)) => deaths.as_slice().first().and_then(|first| match first {
            AMQPValue::FieldTable(death) => header_u32(death, "count"),
            _ => None,
        }),
        _ => None,
    };
    Some(match count {
        Some(count) if count > 1 => format!("dead-lettered by the broker from `{queue}` ({reason}, {count} times)"),
        _ => format!("dead-lettered by the broker from `{queue}` ({reason})"),
    })
}

/// A string header value.
pub fn string_value(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_through_amqp_properties() {
        let job = Uuid::new_v4();
        let id = Uuid::new_v4();
        let mut headers = Headers::raw(Some(job), 2);
        headers.traceparent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
        let properties = headers.properties(id, "user.registered", Utc::now());
        assert_eq!(properties.message_id().as_ref().map(|s| s.as_str()), Some(id.to_string().as_str()));
        assert_eq!(properties.correlation_id().as_ref().map(|s| s.as_str()), Some(job.to_string().as_str()));
        assert_eq!(properties.delivery_mode(), &Some(PERSISTENT));
        let table = properties.headers().clone().expect("headers");
        assert_eq!(header_u32(&table, HEADER_VERSION), Some(2));
        let retried = with_headers(&properties, &[(HEADER_RETRY_COUNT, AMQPValue::LongLongInt(3))]);
        let table = retried.headers().clone().expect("headers");
        assert_eq!(header_u32(&table, HEADER_RETRY_COUNT), Some(3));
        assert_eq!(header_u32(&table, HEADER_VERSION), Some(2), "existing headers are kept");
    }

    #[test]
    fn an_ordered_message_carries_its_key_and_place_once_the_outbox_numbered_it() {
        let headers = Headers::raw(None, 1).ordered_by("order-7");
        let unnumbered = headers.properties(Uuid::new_v4(), "t", Utc::now()).headers().clone().expect("headers");
        assert_eq!(ordering(&unnumbered), None, "no place, no ordering: the outbox's trigger gives it");
        // As the relay reads it back from the outbox row.
        let stored: Headers = serde_json::from_str(
            r#"{"ordering_key":"order-7","ordering_seq":3,"ordering_earlier":{"order.placed":1,"order.deadline":2}}"#,
        )
        .expect("json");
        let table = stored.properties(Uuid::new_v4(), "t", Utc::now()).headers().clone().expect("headers");
        let earlier = [("order.placed".to_owned(), 1), ("order.deadline".to_owned(), 2)].into();
        assert_eq!(ordering(&table), Some(Ordering { key: "order-7".into(), seq: 3, earlier: Some(earlier) }));
        // Numbered before the outbox kept the earlier places: it follows the place before its own.
        let older: Headers = serde_json::from_str(r#"{"ordering_key":"order-7","ordering_seq":3}"#).expect("json");
        let table = older.properties(Uuid::new_v4(), "t", Utc::now()).headers().clone().expect("headers");
        let older = ordering(&table).expect("ordering");
        assert_eq!((older.follows(|_| false), older.earlier), (2, None));
        assert_eq!(serde_json::to_value(&headers).expect("json")["ordering_key"], "order-7");
    }

    #[test]
    fn a_contracts_version_labels_its_messages() {
        #[derive(Serialize)]
        struct MovedOn;
        impl crate::contracts::Contract for MovedOn {
            const TYPE: &'static str = "thing.moved-on";
            const EXCHANGE: &'static str = "things";
            const VERSION: u32 = 2;
        }
        let properties = Headers::of::<MovedOn>(None).properties(Uuid::now_v7(), "thing.moved-on", Utc::now());
        let table = properties.headers().clone().expect("headers");
        assert_eq!(header_u32(&table, HEADER_VERSION), Some(2));
    }

    #[test]
    fn copies_keep_our_headers_and_drop_the_brokers() {
        let mut table = FieldTable::default();
        table.insert(HEADER_VERSION.into(), AMQPValue::LongLongInt(1));
        table.insert("x-delivery-count".into(), AMQPValue::LongLongInt(7));
        table.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        table.insert("x-first-death-reason".into(), string_value("delivery_limit"));
        let properties = BasicProperties::default().with_message_id("m-1".into()).with_headers(table);
        let copy = with_headers(&properties, &[(HEADER_RETRY_COUNT, AMQPValue::LongLongInt(1))]);
        let headers = copy.headers().clone().expect("headers");
        let mut keys: Vec<_> = headers.inner().keys().map(|key| key.as_str().to_owned()).collect();
        keys.sort();
        assert_eq!(keys, [HEADER_RETRY_COUNT, HEADER_VERSION]);
        assert_eq!(copy.message_id(), properties.message_id(), "AMQP properties are kept");
    }

    #[test]
    fn broker_death_reads_the_first_death() {
        let mut death = FieldTable::default();
        death.insert("count".into(), AMQPValue::LongLongInt(1));
        death.insert("reason".into(), string_value("delivery_limit"));
        let mut table = FieldTable::default();
        table.insert("x-death".into(), AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()));
        table.insert("x-first-death-reason".into(), string_value("delivery_limit"));
        table.insert("x-first-death-queue".into(), string_value("accounts.user-registered"));
        let properties = BasicProperties::default().with_headers(table);
        assert_eq!(
            broker_death(&properties).as_deref(),
            Some("dead-lettered by the broker from `accounts.user-registered` (delivery_limit)")
        );
        assert_eq!(broker_death(&BasicProperties::default()), None);
    }

    #[test]
    fn outbox_headers_json_defaults_version_to_one() {
        let headers: Headers = serde_json::from_str("{}").expect("json");
        assert_eq!(headers, Headers::raw(None, 1));
    }
}
