//! The transactional outbox: messages are inserted in the caller's transaction, next to the
//! business change they announce, and published later by the relay. A message therefore exists
//! if and only if the change committed. The insert trigger (migration `0001_messaging.sql`) wakes
//! the relay with `NOTIFY outbox` at commit.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, QueryBuilder, types::Json};
use uuid::Uuid;

use crate::{contracts::Contract, envelope::Headers};

/// The `LISTEN` channel the outbox trigger notifies.
pub const NOTIFY_CHANNEL: &str = "outbox";

/// Insert `body` as a message of contract `C`, belonging to job `correlation_id`, in the caller's
/// transaction; it is labelled with `C::VERSION`. Returns its message id, which stays the same
/// across every republish (the consumers' inbox key). The id is a UUIDv7 so ids sort by creation
/// time, which keeps the inbox's primary key index append-mostly.
pub async fn enqueue<C: Contract>(
    conn: &mut PgConnection,
    body: &C,
    correlation_id: Option<Uuid>,
) -> sqlx::Result<Uuid> {
    Outgoing::of(body, correlation_id).enqueue(conn).await
}

/// The size in bytes of the body the relay will publish for `body`: the payload column is `jsonb`,
/// and the relay sends it as Postgres prints it (`payload::text`), which puts a space after every
/// `:` and `,`, so the body on the wire is longer than `serde_json::to_vec`'s. For a limit checked
/// before a message is written (the broker's `max_message_size`). Exact for strings, integers,
/// booleans and nulls, which is what the shop's bodies hold; a float may print with other digits
/// (jsonb keeps a `numeric`: `1e3` prints as `1000`), so leave a margin if yours carry floats.
pub fn published_size(body: &impl serde::Serialize) -> serde_json::Result<usize> {
    let mut written = Vec::new();
    body.serialize(&mut serde_json::Serializer::with_formatter(&mut written, JsonbText))?;
    Ok(written.len())
}

/// JSON as Postgres prints a `jsonb` value: `", "` between items and `": "` after a key.
struct JsonbText;

impl serde_json::ser::Formatter for JsonbText {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// The outbox columns a new message fills, in [`Outgoing`]'s order.
const COLUMNS: &str = "message_id, message_type, exchange, routing_key, payload, headers";

/// The columns of a message's deliver-at time ([`Outgoing::at`]), after [`COLUMNS`].
const SCHEDULE: &str = "available_at, scheduled";

/// A statement that writes a service's effect and, only if the effect wrote a row, the message
/// that announces it: one round trip, and never the one without the other. `effect` writes one
/// data-modifying statement with `returning` that writes at most one row (typically `insert …
/// on conflict do nothing returning id`) into a [`QueryBuilder`]: its text with `push`, each value
/// with `push_bind`, which numbers it. The message's values follow, numbered the same way: no
/// parameter is counted by hand (decision 0026), so the text `effect` pushes holds no `$n` of its
/// own. The statement's `rows_affected` is 1 if the effect wrote its row (and the message was
/// written), 0 if not. An error if the message's body or headers cannot be serialized.
///
/// ```
/// use messaging_core::{contracts::Contract, outbox::{self, Outgoing}};
/// # #[derive(serde::Serialize)] struct Shipped { order_id: uuid::Uuid }
/// # impl Contract for Shipped { const TYPE: &'static str = "shipped"; const EXCHANGE: &'static str = "shop"; }
///
/// # async fn ship(tx: &mut sqlx::PgConnection, id: uuid::Uuid, order_id: uuid::Uuid) -> sqlx::Result<()> {
/// let shipped = Shipped { order_id };
/// let written = outbox::with_effect(
///     |effect| {
///         effect.push("insert into shipments (id, order_id) values (");
///         effect.separated(", ").push_bind(id).push_bind(order_id);
///         effect.push(") on conflict do nothing returning id");
///     },
///     Outgoing::of(&shipped, None),
/// )?
/// .build()
/// .execute(tx)
/// .await?;
/// // 0: the shipment existed already, and nothing was announced again.
/// let new = written.rows_affected() == 1;
/// # Ok(()) }
/// ```
pub fn with_effect<C: Contract>(
    effect: impl FnOnce(&mut QueryBuilder<Postgres>),
    message: Outgoing<'_, C>,
) -> sqlx::Result<QueryBuilder<Postgres>> {
    let mut statement = QueryBuilder::new("with effect as (");
    effect(&mut statement);
    statement.push(format_args!(") insert into outbox ({COLUMNS}, {SCHEDULE}) select "));
    message.push_values(&mut statement)?;
    statement.push(" from effect limit 1");
    Ok(statement)
}

/// The outbox rows a statement of the caller's writes for many messages of one contract at once,
/// selected from a relation of its own (`from`, e.g. a CTE and its `order by`): `insert into
/// outbox (…) select … from …`. The per-row columns are expressions over that relation (column
/// names, never values); the contract's type and exchange are bound. For one message beside one
/// effect, [`with_effect`] binds its values too.
#[derive(Debug, Clone, Copy)]
pub struct Selected<'a> {
    /// The message ids (a new UUIDv7 each).
    pub message_id: &'a str,
    /// The bodies, `jsonb`.
    pub payload: &'a str,
    /// The headers ([`Headers`]), `jsonb`.
    pub headers: &'a str,
    /// When each is due, `timestamptz` ([`Outgoing::at`]); `None`: at once.
    pub deliver_at: Option<&'a str>,
}

impl Selected<'_> {
    /// Push the `insert` statement of messages of contract `C`, selecting from `from` (which may
    /// carry `where` and `order by`: the rows are published in the order they are inserted). Each
    /// row's routing key is `C::TYPE`: not for a contract routed by body
    /// ([`Contract::ROUTED_BY_BODY`]), refused at compile time.
    pub fn push_insert<C: Contract>(&self, statement: &mut QueryBuilder<Postgres>, from: &str) {
        const { assert!(!C::ROUTED_BY_BODY, "rows of a contract routed by body each need their own key") };
        let Self { message_id, payload, headers, deliver_at } = self;
        let columns = if deliver_at.is_some() { format!("{COLUMNS}, {SCHEDULE}") } else { COLUMNS.to_owned() };
        statement.push(format_args!("insert into outbox ({columns}) select {message_id}, "));
        statement.separated(", ").push_bind(C::TYPE).push_bind(C::EXCHANGE).push_bind(C::TYPE);
        statement.push(format_args!(", {payload}, {headers}"));
        if let Some(at) = deliver_at {
            statement.push(format_args!(", {at}, true"));
        }
        statement.push(format_args!(" from {from}"));
    }
}

/// A message as its outbox row will hold it: what [`enqueue`] inserts, and what [`with_effect`]
/// writes beside an effect. The headers carry the current trace context
/// ([`crate::trace::current`]).
#[derive(Debug)]
pub struct Outgoing<'a, C> {
    /// A new UUIDv7.
    pub message_id: Uuid,
    /// `C::TYPE`.
    pub message_type: &'static str,
    /// `C::EXCHANGE`.
    pub exchange: &'static str,
    /// The routing key: [`Contract::routing_key`], `C::TYPE` unless the contract routes by body.
    pub routing_key: &'static str,
    /// The body.
    pub payload: Json<&'a C>,
    /// Correlation id, traceparent, version.
    pub headers: Json<Headers>,
    /// When it is due ([`Outgoing::at`]); `None`: at once.
    pub deliver_at: Option<DateTime<Utc>>,
}

impl<'a, C: Contract> Outgoing<'a, C> {
    /// `body` as a message of contract `C` belonging to job `correlation_id`.
    pub fn of(body: &'a C, correlation_id: Option<Uuid>) -> Self {
        Self::identified(body, Uuid::now_v7(), Headers::of::<C>(correlation_id))
    }

    /// `body` under a message id and headers made before (the orders API makes them once, for
    /// the row it writes alone or in a group commit's statement).
    pub fn identified(body: &'a C, message_id: Uuid, headers: Headers) -> Self {
        Self {
            message_id,
            message_type: C::TYPE,
            exchange: C::EXCHANGE,
            routing_key: body.routing_key(),
            payload: Json(body),
            headers: Json(headers),
            deliver_at: None,
        }
    }

    /// The same message, published no earlier than `when` (a deadline, a reminder): the relay
    /// claims a row only once it is due, within its poll interval (1 s) of it. Such a row waits in
    /// an index of its own, so it slows no claim while it waits, however long. A scheduled message
    /// should carry no ordering key: at an endpoint that takes its type, the key's later messages
    /// would wait for it.
    pub fn at(self, when: DateTime<Utc>) -> Self {
        Self { deliver_at: Some(when), ..self }
    }

    /// The same message, of ordering key `key`: an endpoint ordered by key applies the messages
    /// of one key in the order their rows commit ([`Headers::ordered_by`]).
    pub fn ordered_by(self, key: impl Into<String>) -> Self {
        Self { headers: Json(self.headers.0.ordered_by(key)), ..self }
    }

    /// Insert it in the caller's transaction (what [`enqueue`] does with a message it makes);
    /// returns its message id.
    pub async fn enqueue(self, conn: &mut PgConnection) -> sqlx::Result<Uuid> {
        let message_id = self.message_id;
        let mut statement = QueryBuilder::new(format!("insert into outbox ({COLUMNS}, {SCHEDULE}) values ("));
        self.push_values(&mut statement)?;
        statement.push(")");
        statement.build().execute(conn).await?;
        Ok(message_id)
    }

    /// Push its values, bound, in the outbox columns' order ([`COLUMNS`]), then its deliver-at
    /// time's ([`SCHEDULE`]: null means now). Its body and headers are serialized first, where a
    /// failure is an error: the builder panics on a value it cannot encode.
    fn push_values(self, statement: &mut QueryBuilder<Postgres>) -> sqlx::Result<()> {
        let (payload, headers) = (serialized(self.payload.0)?, serialized(&self.headers.0)?);
        let mut values = statement.separated(", ");
        values
            .push_bind(self.message_id)
            .push_bind(self.message_type)
            .push_bind(self.exchange)
            .push_bind(self.routing_key)
            .push_bind(payload)
            .push_bind(headers);
        statement.push(", coalesce(").push_bind(self.deliver_at).push("::timestamptz, now()), ");
        statement.push_bind(self.deliver_at).push("::timestamptz is not null");
        Ok(())
    }
}

/// `value` as JSON text, to be bound as `jsonb`: serialized here, where a failure is an error.
fn serialized(value: &impl serde::Serialize) -> sqlx::Result<Json<Box<serde_json::value::RawValue>>> {
    serde_json::value::to_raw_value(value).map(Json).map_err(|error| sqlx::Error::Encode(Box::new(error)))
}

/// The outbox's state for `/metrics`, read with queries whose cost does not grow with the rows
/// already published: each walks a partial index of unpublished rows (`outbox_unpublished`,
/// `outbox_scheduled`), so an outbox that keeps 50 million published rows for its retention costs
/// what an empty one does. (`count(*)` over the table took over the scrape's 2 s there, and the
/// age gauge, the one the paging alert reads, vanished exactly when it mattered.)
#[derive(Debug, Clone, Copy, PartialEq, sqlx::FromRow)]
pub struct OutboxGauges {
    /// Rows waiting to be published (parked rows, and scheduled rows not yet due, aside), counted
    /// up to [`COUNT_CAP`] of each kind.
    pub unpublished: i64,
    /// Rows parked (the relay's `park`), counted among the first [`COUNT_CAP`] unpublished rows of each kind.
    pub parked: i64,
    /// Scheduled rows ([`Outgoing::at`]) not yet due, counted up to [`COUNT_CAP`]: they wait by
    /// design, and count in neither the backlog nor its age.
    pub scheduled: i64,
    /// How long the oldest row waiting to be published (parked rows aside) has waited, in
    /// seconds (0 when none waits): a scheduled row waits from its due time.
    pub oldest_unpublished_age_seconds: f64,
}

/// The most unpublished rows [`gauges`] counts: a backlog larger than that reads as this many (the
/// age gauge says how far behind it is). Counting it costs about a millisecond per 10,000 rows.
pub const COUNT_CAP: i64 = 100_000;

/// [`gauges`]' counts: rows waiting and rows parked, among the first `$1` unpublished; then rows
/// due, parked and not yet due among the first `$1` scheduled.
pub const COUNT_UNPUBLISHED: &str = "with waiting as (
            select parked_at from outbox where published_at is null and not scheduled order by id limit $1
         ), timed as (
            select parked_at, available_at from outbox where published_at is null and scheduled
             order by available_at limit $1
         )
         select (select count(*) from waiting where parked_at is null)
                  + (select count(*) from timed where parked_at is null and available_at <= now()),
                (select count(*) from waiting where parked_at is not null)
                  + (select count(*) from timed where parked_at is not null),
                (select count(*) from timed where parked_at is null and available_at > now())";

/// [`gauges`]' age: that of the first row waiting to be published, a scheduled one counted from
/// its due time.
pub const OLDEST_UNPUBLISHED: &str = "select extract(epoch from now() - least(
        (select created_at from outbox where published_at is null and not scheduled and parked_at is null
          order by id limit 1),
        (select available_at from outbox
          where published_at is null and scheduled and parked_at is null and available_at <= now()
          order by available_at limit 1)))::float8";

/// Read [`OutboxGauges`]: index scans of the unpublished rows, bounded by [`COUNT_CAP`].
pub async fn gauges(pool: &PgPool) -> sqlx::Result<OutboxGauges> {
    let (unpublished, parked, scheduled): (i64, i64, i64) =
        sqlx::query_as(COUNT_UNPUBLISHED).bind(COUNT_CAP).fetch_one(pool).await?;
    let oldest: Option<f64> = sqlx::query_scalar(OLDEST_UNPUBLISHED).fetch_one(pool).await?;
    Ok(OutboxGauges { unpublished, parked, scheduled, oldest_unpublished_age_seconds: oldest.unwrap_or(0.0).max(0.0) })
}

#[cfg(test)]
mod tests {
    use super::{Outgoing, Selected, with_effect};
    use crate::contracts::Contract;

    #[derive(serde::Serialize)]
    struct Shipped {}

    impl Contract for Shipped {
        const TYPE: &'static str = "shipped";
        const EXCHANGE: &'static str = "shop";
    }

    #[test]
    fn the_message_s_values_follow_the_effect_s_own_whatever_its_text_holds() {
        // A `$` in a literal or a dollar-quoted string is text, not a parameter.
        let mut statement = with_effect(
            |effect| {
                effect.push("insert into t (a, b, c) values (").push_bind(1_i32).push(", '$3', $$ $9 $$) returning a");
            },
            Outgoing::of(&Shipped {}, None),
        )
        .expect("serializable");
        let sql = statement.sql();
        assert_eq!(
            sql.as_str(),
            "with effect as (insert into t (a, b, c) values ($1, '$3', $$ $9 $$) returning a) insert into outbox \
             (message_id, message_type, exchange, routing_key, payload, headers, available_at, scheduled) select $2, \
             $3, $4, $5, $6, $7, coalesce($8::timestamptz, now()), $9::timestamptz is not null from effect limit 1"
        );
        let _ = statement.build();
    }

    #[test]
    fn selected_rows_name_every_column_in_the_outbox_s_order() {
        let columns = Selected { message_id: "m", payload: "p", headers: "h", deliver_at: None };
        let mut statement = sqlx::QueryBuilder::new("with go as (select 1 as n) ");
        columns.push_insert::<Shipped>(&mut statement, "go order by n");
        assert_eq!(
            statement.sql().as_str(),
            "with go as (select 1 as n) insert into outbox (message_id, message_type, exchange, routing_key, \
             payload, headers) select m, $1, $2, $3, p, h from go order by n"
        );
        let scheduled = Selected { deliver_at: Some("at"), ..columns };
        let mut statement = sqlx::QueryBuilder::new("");
        scheduled.push_insert::<Shipped>(&mut statement, "go");
        assert_eq!(
            statement.sql().as_str(),
            "insert into outbox (message_id, message_type, exchange, routing_key, payload, headers, available_at, \
             scheduled) select m, $1, $2, $3, p, h, at, true from go"
        );
    }
}
