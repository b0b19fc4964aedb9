//! `msgctl parked …` and the live page's console: what is in `<endpoint>.parking`, what the
//! consumer's inbox says of each message, and sending it back or away.
//!
//! Every command reads the whole parking queue unacked (`basic.get`, in queue order), acts on the
//! selected messages one at a time, and returns every message it did not ack with one
//! `basic.nack(multiple, requeue)`, which puts them back in their order (pinned on RabbitMQ 3.10
//! and 4.0 by `tests/msgctl.rs`). A redriven message is acked only after the broker confirmed its
//! copy in the work queue: killed in between, it is in both (the inbox absorbs the second), never
//! in neither.

use std::{
    collections::{BTreeMap, HashSet},
    sync::{Mutex, PoisonError},
    time::Duration,
};

use chrono::{DateTime, Utc};
use lapin::{
    Channel, Connection,
    message::Delivery,
    options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions},
    types::AMQPValue,
    types::FieldTable,
};
use messaging::{
    contracts::{JobAbandoned, JobEvent, JobRedriven},
    envelope,
    publisher::{PublishError, Publisher},
    runtime::{
        broker,
        config::{BrokerNodes, SecretUrl},
        duration::{format_duration, parse_duration},
        failpoint, http,
    },
    topology,
};
use regex::Regex;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::Failure;

/// Failpoint: a redriven message's copy and its `job.redriven` are confirmed, the parked message
/// not yet acked.
pub const AFTER_REDRIVE_PUBLISH: &str = "msgctl.after-redrive-publish";

/// Failpoint: a redriven message's copy is confirmed in the work queue, its `job.redriven` not yet
/// sent.
pub const BETWEEN_REDRIVE_SENDS: &str = "msgctl.between-redrive-sends";

/// `msgctl parked`'s commands.
#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// List parked messages: message id, type, job id, attempts, parked at, reason.
    List {
        /// Which messages.
        #[command(flatten)]
        filter: Filter,
        /// One JSON object per message, one per line.
        #[arg(long)]
        json: bool,
    },
    /// One parked message: its properties, headers and body.
    Show {
        /// Its message id.
        message_id: Uuid,
        /// The endpoint whose parking holds it; repeat for several. Default: every endpoint.
        #[arg(long)]
        endpoint: Vec<String>,
    },
    /// Send the selected messages back to their endpoint's work queue, attempts reset, with a
    /// `redrive-count` header, and a `job.redriven` event for their job; each leaves parking once
    /// its copy is confirmed. Messages parked before the inbox's horizon are refused unless --force.
    Redrive {
        /// Which messages.
        #[command(flatten)]
        filter: Filter,
        /// Say what would be redriven and what each message's consumer's inbox says of it
        /// (`already applied: will be skipped`, `will apply`, `inbox row gone: needs --force`);
        /// change nothing. The inboxes are read through INBOX_DATABASE_URL.
        #[arg(long)]
        dry_run: bool,
        /// Redrive messages parked longer ago than INBOX_RETENTION too: their inbox rows may be
        /// gone, so one already applied could be applied again.
        #[arg(long)]
        force: bool,
    },
    /// Delete the selected parked messages for good. A message of a job is abandoned as by
    /// `abandon`: its job's owner ends the job and undoes what its steps did. Refused, ending
    /// nothing, if it selects an undo (`order.ended`, `inventory.released`, `invoice.voided`),
    /// unless --including-undos.
    Purge {
        /// Which messages.
        #[command(flatten)]
        filter: Filter,
        /// Yes, delete them.
        #[arg(long)]
        yes: bool,
        /// Delete the undo messages selected too. Only for an undo no redrive can ever apply (its
        /// order lost by a failover, `docs/operations.md`): deleted, it leaves its job
        /// `compensating` for good.
        #[arg(long)]
        including_undos: bool,
    },
    /// End a quarantined job for good: for each of its parked messages, send a confirmed
    /// `job.abandoned` (its owner cancels the job and undoes what its steps did), then delete the
    /// message. Nothing is deleted unless the event was taken. Refused, ending nothing, if the job
    /// has an undo parked (`order.ended`, `inventory.released`, `invoice.voided`): redrive it.
    Abandon {
        /// The job (`GET /jobs/{id}`, or `list`'s job id).
        #[arg(long)]
        job: Uuid,
        /// The endpoint whose parking holds its messages; repeat for several. Default: every
        /// endpoint.
        #[arg(long)]
        endpoint: Vec<String>,
        /// Why, for the job's record.
        #[arg(long, default_value = "abandoned with msgctl")]
        note: String,
    },
}

/// Which parked messages a command acts on.
#[derive(Debug, Clone, clap::Args)]
pub struct Filter {
    /// The endpoint (work queue name, e.g. `billing.inventory-reserved`); repeat for several.
    /// Default: every endpoint with a parking queue in the vhost (found through the management
    /// API).
    #[arg(long)]
    endpoint: Vec<String>,
    /// Only messages of this type (e.g. `order.placed`).
    #[arg(long = "type")]
    message_type: Option<String>,
    /// Only messages whose parking reason matches this regular expression.
    #[arg(long)]
    reason: Option<Regex>,
    /// Only messages parked within this long (e.g. 30m, 2h, 7d).
    #[arg(long, value_parser = parse_duration)]
    since: Option<Duration>,
    /// At most this many messages (the first ones in parking order).
    #[arg(long)]
    limit: Option<usize>,
    /// Only messages of this job (their correlation id).
    #[arg(long)]
    job: Option<Uuid>,
    /// Only these messages (their message id); repeat for several.
    #[arg(long = "message-id")]
    message_ids: Vec<Uuid>,
}

/// A parked message, as `list` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// The endpoint whose parking queue holds it.
    pub endpoint: String,
    /// Its id (the inbox key), when it has a readable one.
    pub message_id: Option<Uuid>,
    /// Its type (`order.placed`), when it has one.
    #[serde(rename = "type")]
    pub message_type: Option<String>,
    /// Its job (correlation id).
    pub job_id: Option<Uuid>,
    /// Attempts made before it was parked.
    pub attempts: u32,
    /// How many times it was redriven before.
    pub redrive_count: u32,
    /// When it was parked.
    pub parked_at: Option<DateTime<Utc>>,
    /// Why.
    pub reason: String,
}

/// What a parked message carries, as `show` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Details {
    /// Its headers, as text.
    pub headers: BTreeMap<String, String>,
    /// Its body: pretty JSON, or its bytes as text.
    pub body: String,
}

/// What a redrive of a message would do, from its consumer's inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Its consumer's inbox has it: applied already; a copy is skipped.
    AlreadyApplied,
    /// Its consumer's inbox has it not, and would still have it had it been applied: a copy applies.
    WillApply,
    /// Parked longer ago than the inbox's retention: its row may be gone, so a copy could apply a
    /// second time. A redrive refuses it without `--force`.
    InboxRowGone,
    /// Its inbox was not read: no database was given, or one did not answer (it may be the one
    /// holding the row).
    InboxNotRead,
}

impl Verdict {
    /// In words.
    pub fn describe(self) -> &'static str {
        match self {
            Self::AlreadyApplied => "already applied: will be skipped",
            Self::WillApply => "will apply",
            Self::InboxRowGone => "inbox row gone: needs --force",
            Self::InboxNotRead => "inbox not read",
        }
    }
}

/// The consumers' databases, read for their inbox rows (`INBOX_DATABASE_URL`: a role that may
/// read `inbox`). Which database an endpoint's inbox is in need not be known: a row names its
/// endpoint.
#[derive(Debug, Clone, Default)]
pub struct Inboxes {
    pools: Vec<PgPool>,
}

impl Inboxes {
    /// Read-only pools that connect when first used, one connection each
    /// ([`shop_books::read_only`], as the books are read).
    pub fn connect_lazy(urls: &[SecretUrl]) -> Result<Self, Failure> {
        let pools = urls
            .iter()
            .map(|url| {
                shop_books::read_only(url.expose(), INBOX_QUERY_DEADLINE)
                    .map_err(|error| Failure::Described(format!("inbox database {url}: {error}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { pools })
    }

    /// The consumers' inboxes, through pools of the caller's.
    pub fn of_pools(pools: Vec<PgPool>) -> Self {
        Self { pools }
    }

    /// What redriving each of `parked` would do, in their order: whether its consumer's inbox
    /// has it, and if not whether it would still have it (parked within `retention`). One query
    /// per database and endpoint, each given [`INBOX_QUERY_DEADLINE`]; a database that does not
    /// answer in time is not read.
    pub async fn verdicts(&self, parked: &[&Summary], retention: Duration) -> Vec<Verdict> {
        let mut by_endpoint: BTreeMap<&str, Vec<Uuid>> = BTreeMap::new();
        for message in parked {
            if let Some(id) = message.message_id {
                by_endpoint.entry(message.endpoint.as_str()).or_default().push(id);
            }
        }
        // Which database holds an endpoint's inbox is not known here: an endpoint counts as read
        // only if every database answered (one that did not may be the one that has the row).
        let (mut applied, mut unread, mut silent) = (HashSet::new(), HashSet::new(), HashSet::new());
        for (endpoint, ids) in &by_endpoint {
            if self.pools.is_empty() {
                unread.insert(*endpoint);
            }
            for (n, pool) in self.pools.iter().enumerate() {
                // A database that did not answer is not asked again in this call: each endpoint
                // would wait for it in turn.
                if silent.contains(&n) {
                    unread.insert(*endpoint);
                    continue;
                }
                let query = sqlx::query_scalar::<_, Uuid>(
                    "select message_id from inbox where endpoint = $1 and message_id = any($2)",
                )
                .bind(endpoint)
                .bind(ids)
                .fetch_all(pool);
                match tokio::time::timeout(INBOX_QUERY_DEADLINE, query).await {
                    Ok(Ok(found)) => applied.extend(found.into_iter().map(|id| (*endpoint, id))),
                    _ => {
                        unread.insert(*endpoint);
                        silent.insert(n);
                    }
                }
            }
        }
        let now = Utc::now();
        let verdict = |message: &Summary| match message.message_id {
            None => Verdict::InboxNotRead,
            Some(id) if applied.contains(&(message.endpoint.as_str(), id)) => Verdict::AlreadyApplied,
            Some(_) if unread.contains(message.endpoint.as_str()) => Verdict::InboxNotRead,
            Some(_) if older_than(message.parked_at, retention, now) => Verdict::InboxRowGone,
            Some(_) => Verdict::WillApply,
        };
        parked.iter().map(|message| verdict(message)).collect()
    }
}

/// How long one inbox query may take ([`Inboxes::verdicts`]).
pub const INBOX_QUERY_DEADLINE: Duration = Duration::from_secs(5);

/// What a command did, or would do, with one parked message.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Done {
    /// `redriven`, `would redrive`, `refused`, `purged`, `abandoned`.
    pub action: String,
    /// The message.
    pub message: Summary,
    /// For a redrive, what its consumer's inbox says.
    pub verdict: Option<Verdict>,
    /// Why it was refused.
    pub note: Option<String>,
}

/// What a command did, message by message, in order.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct Report {
    /// Each message acted on (or, in a dry run, that would be).
    pub done: Vec<Done>,
    /// Print each line as it is added (the command line: a command killed part way has said
    /// what it did).
    #[serde(skip)]
    echo: bool,
}

impl Report {
    /// A report that prints each message's line ([`Done::line`]) as it is added.
    pub fn printing() -> Self {
        Self { echo: true, ..Self::default() }
    }

    fn add(&mut self, action: &str, parked: &Parked, verdict: Option<Verdict>, note: Option<String>) {
        let done = Done { action: action.to_owned(), message: parked.summary.clone(), verdict, note };
        if self.echo {
            println!("{}", done.line());
        }
        self.done.push(done);
    }

    /// How many messages had `action`.
    pub fn count(&self, action: &str) -> usize {
        self.done.iter().filter(|done| done.action == action).count()
    }
}

impl Done {
    /// What was done, to which message, and why (the command line's line).
    pub fn line(&self) -> String {
        let verdict = self.verdict.map(|verdict| format!("  [{}]", verdict.describe())).unwrap_or_default();
        let note = self.note.as_ref().map(|note| format!(": {note}")).unwrap_or_default();
        format!("{} {}  {}{verdict}{note}", self.action, self.message.endpoint, self.message.line())
    }
}

impl Summary {
    fn line(&self) -> String {
        let or_dash = |value: Option<String>| value.unwrap_or_else(|| "-".into());
        format!(
            "{}  {}  job {}  attempts {}  parked {}  {}",
            or_dash(self.message_id.map(|id| id.to_string())),
            or_dash(self.message_type.clone()),
            or_dash(self.job_id.map(|id| id.to_string())),
            self.attempts,
            or_dash(self.parked_at.map(|at| at.to_rfc3339())),
            self.reason
        )
    }
}

/// A parked message, read from its delivery.
#[derive(Debug)]
struct Parked {
    delivery: Delivery,
    /// What it is, read from its properties and headers once.
    summary: Summary,
}

impl Parked {
    /// A message of `endpoint`'s parking queue.
    fn read(delivery: Delivery, endpoint: &str) -> Self {
        let properties = &delivery.properties;
        let headers = properties.headers().clone().unwrap_or_default();
        let text = |key: &str| envelope::header_text(&headers, key);
        let summary = Summary {
            endpoint: endpoint.to_owned(),
            message_id: envelope::message_id(properties),
            message_type: properties.kind().as_ref().map(ToString::to_string),
            job_id: envelope::correlation_id(properties),
            attempts: envelope::header_u32(&headers, envelope::HEADER_RETRY_COUNT).unwrap_or(0) + 1,
            reason: text(envelope::HEADER_LAST_ERROR).unwrap_or_default(),
            parked_at: text(envelope::HEADER_PARKED_AT)
                .and_then(|at| DateTime::parse_from_rfc3339(&at).ok())
                .map(|at| at.with_timezone(&Utc)),
            redrive_count: envelope::header_u32(&headers, envelope::HEADER_REDRIVE_COUNT).unwrap_or(0),
        };
        Self { delivery, summary }
    }

    /// Its headers as text, and its body (pretty JSON, or the bytes as text).
    fn details(&self) -> Details {
        let properties = &self.delivery.properties;
        let mut headers = BTreeMap::new();
        if let Some(table) = properties.headers() {
            for (key, value) in table.inner() {
                headers.insert(key.to_string(), shown(value));
            }
        }
        let body = &self.delivery.data;
        let body = match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(json) => serde_json::to_string_pretty(&json).unwrap_or_default(),
            Err(_) => format!("({} bytes, not JSON) {}", body.len(), String::from_utf8_lossy(body)),
        };
        Details { headers, body }
    }

    /// Whether it undoes an order's steps ([`shop::is_undo`]): never purged nor abandoned.
    fn is_undo(&self) -> bool {
        self.summary.message_type.as_deref().is_some_and(shop::is_undo)
    }

    fn line(&self) -> String {
        self.summary.line()
    }
}

/// A header's value as people read it.
fn shown(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(text) => String::from_utf8_lossy(text.as_bytes()).into_owned(),
        AMQPValue::ShortString(text) => text.to_string(),
        AMQPValue::Boolean(flag) => flag.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::FieldTable(table) => {
            let entries: Vec<String> =
                table.inner().iter().map(|(key, value)| format!("{key}: {}", shown(value))).collect();
            format!("{{{}}}", entries.join(", "))
        }
        AMQPValue::FieldArray(array) => {
            let items: Vec<String> = array.as_slice().iter().map(shown).collect();
            format!("[{}]", items.join(", "))
        }
        other => format!("{other:?}"),
    }
}

/// How long before `now` a message was parked at `parked_at`, if known.
fn age(parked_at: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Option<Duration> {
    parked_at.map(|at| now.signed_duration_since(at).to_std().unwrap_or_default())
}

/// Whether a message parked at `parked_at` was parked longer than `span` before `now` (or at an
/// unknown time).
fn older_than(parked_at: Option<DateTime<Utc>>, span: Duration, now: DateTime<Utc>) -> bool {
    age(parked_at, now).is_none_or(|age| age > span)
}

impl Filter {
    /// Every message of `job` at `endpoint`.
    fn of_job(job: Uuid, endpoint: Vec<String>) -> Self {
        Self { job: Some(job), ..Self::of_endpoints(endpoint) }
    }

    /// Every message at each of `endpoints`.
    pub fn of_endpoints(endpoints: Vec<String>) -> Self {
        Self {
            endpoint: endpoints,
            message_type: None,
            reason: None,
            since: None,
            limit: None,
            job: None,
            message_ids: Vec::new(),
        }
    }

    /// The messages `message_ids` at `endpoint` (the console's selection).
    pub fn of_messages(endpoint: String, message_ids: Vec<Uuid>) -> Self {
        Self { message_ids, ..Self::of_endpoints(vec![endpoint]) }
    }

    fn matches(&self, parked: &Summary, now: DateTime<Utc>) -> bool {
        self.message_type.as_ref().is_none_or(|wanted| parked.message_type.as_ref() == Some(wanted))
            && (self.message_ids.is_empty() || parked.message_id.is_some_and(|id| self.message_ids.contains(&id)))
            && self.job.is_none_or(|job| parked.job_id == Some(job))
            && self.reason.as_ref().is_none_or(|reason| reason.is_match(&parked.reason))
            && self.since.is_none_or(|since| {
                parked.parked_at.is_some_and(|at| now.signed_duration_since(at).to_std().unwrap_or_default() <= since)
            })
    }
}

/// One endpoint's parking queue, read whole and held unacked.
struct Held {
    endpoint: String,
    channel: Channel,
    messages: Vec<Parked>,
    /// Delivery tags acked so far.
    acked: Mutex<HashSet<u64>>,
}

impl Held {
    async fn read(connection: &Connection, endpoint: &str) -> Result<Self, Failure> {
        let queue = format!("{endpoint}.parking");
        // A passive declare on a channel of its own: a missing queue closes that channel only.
        let probe = connection.create_channel().await?;
        if let Err(error) = probe.queue_declare(queue.as_str().into(), passive(), FieldTable::default()).await {
            return Err(Failure::Described(format!(
                "unknown endpoint `{endpoint}`: the broker has no queue `{queue}` ({error})"
            )));
        }
        let _ = probe.close(200, "bye".into()).await;
        let channel = connection.create_channel().await?;
        let mut messages = Vec::new();
        while let Some(message) = channel.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false }).await? {
            messages.push(Parked::read(message.delivery, endpoint));
        }
        Ok(Self { endpoint: endpoint.to_owned(), channel, messages, acked: Mutex::default() })
    }

    /// The messages `filter` selects, in parking order, at most `limit`.
    fn selected(&self, filter: &Filter) -> Vec<usize> {
        let now = Utc::now();
        let chosen = self.messages.iter().enumerate().filter(|(_, parked)| filter.matches(&parked.summary, now));
        chosen.map(|(index, _)| index).take(filter.limit.unwrap_or(usize::MAX)).collect()
    }

    async fn ack(&self, index: usize) -> Result<(), Failure> {
        let tag = self.messages[index].delivery.delivery_tag;
        self.channel.basic_ack(tag, BasicAckOptions::default()).await?;
        self.acked.lock().unwrap_or_else(PoisonError::into_inner).insert(tag);
        Ok(())
    }

    /// Put back every message not acked, in its order: one nack of them all, up to the last one.
    async fn give_back(self) -> Result<(), Failure> {
        let acked = self.acked.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let last =
            self.messages.iter().map(|parked| parked.delivery.delivery_tag).filter(|tag| !acked.contains(tag)).max();
        if let Some(last) = last {
            let options = BasicNackOptions { multiple: true, requeue: true };
            self.channel.basic_nack(last, options).await?;
        }
        let _ = self.channel.close(200, "bye".into()).await;
        Ok(())
    }
}

fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() }
}

/// Where the broker is: AMQP for the messages, the management API to find the parking queues.
#[derive(Debug, Clone)]
pub struct Broker {
    /// The broker's nodes, one AMQP URL each (its path is the vhost).
    pub amqp_url: BrokerNodes,
    /// The management API, if not the AMQP URL's host on port 15672.
    pub management_url: Option<SecretUrl>,
}

impl Broker {
    /// A connection to a node that answers, and that node's URL.
    pub async fn connect(&self, name: &str) -> Result<(Connection, &SecretUrl), Failure> {
        let nodes = &self.amqp_url;
        let (connection, node) = broker::connect_any(nodes, 0, name)
            .await
            .map_err(|error| Failure::Described(format!("cannot reach the broker at {nodes}: {error}")))?;
        Ok((connection, nodes.url(node)))
    }
}

/// Run `msgctl parked <action>`, printing what it does; a redrive reads the inboxes of
/// `inbox_urls` ([`Inboxes`]).
pub async fn run(
    action: Action,
    broker: &Broker,
    inbox_urls: &[SecretUrl],
    inbox_retention: Duration,
) -> Result<(), Failure> {
    let (connection, node) = broker.connect("msgctl").await?;
    // The management API is asked on the node that answered.
    let outcome = async {
        match action {
            Action::List { mut filter, json } => {
                filter.endpoint = endpoints(broker, node, filter.endpoint).await?;
                let listed = list(&connection, &filter).await?;
                for (summary, _) in &listed {
                    if json {
                        println!("{}", serde_json::to_string(summary)?);
                    } else {
                        println!("{}  {}", summary.endpoint, summary.line());
                    }
                }
                if !json {
                    println!("{} parked message(s) selected", listed.len());
                }
                Ok(())
            }
            Action::Show { message_id, endpoint } => {
                let (summary, details) =
                    show(&connection, message_id, &endpoints(broker, node, endpoint).await?).await?;
                println!("endpoint: {}", summary.endpoint);
                println!("message id: {message_id}");
                println!("type: {}", summary.message_type.as_deref().unwrap_or("-"));
                println!("correlation id (job): {}", summary.job_id.map_or("-".into(), |id| id.to_string()));
                println!("headers:");
                for (key, value) in &details.headers {
                    println!("  {key}: {value}");
                }
                println!("body:\n{}", details.body);
                Ok(())
            }
            Action::Redrive { mut filter, dry_run, force } => {
                filter.endpoint = endpoints(broker, node, filter.endpoint).await?;
                let how = Redrive { dry_run, force, inbox_retention };
                let inboxes = Inboxes::connect_lazy(inbox_urls)?;
                let mut report = Report::printing();
                redrive(&connection, &filter, how, &inboxes, &mut report).await?;
                let (redriven, refused) = (report.count(how.verb()), report.count(REFUSED));
                println!(
                    "{redriven} message(s) {}, {refused} refused",
                    if dry_run { "would be redriven" } else { "redriven" }
                );
                match (redriven, refused) {
                    (_, refused) if refused > 0 => {
                        Err(Failure::Described(format!("{refused} message(s) refused (see above)")))
                    }
                    _ => Ok(()),
                }
            }
            Action::Purge { mut filter, yes, including_undos } => {
                filter.endpoint = endpoints(broker, node, filter.endpoint).await?;
                let mut report = Report::printing();
                let ending = Ending::Purge { yes, including_undos, note: "purged with msgctl" };
                end_parked(&connection, &filter, ending, &mut report).await?;
                println!("{} message(s) {}", report.done.len(), ending.verb());
                Ok(())
            }
            Action::Abandon { job, endpoint, note } => {
                let filter = Filter::of_job(job, endpoints(broker, node, endpoint).await?);
                let mut report = Report::printing();
                let ending = Ending::Abandon { note: &note };
                end_parked(&connection, &filter, ending, &mut report).await?;
                println!("{} message(s) {}", report.done.len(), ending.verb());
                Ok(())
            }
        }
    }
    .await;
    let _ = connection.close(200, "bye".into()).await;
    outcome
}

/// The endpoints named, or else every endpoint that has a parking queue (`<endpoint>.parking`) in
/// the AMQP URL's vhost, by name. AMQP cannot list queues: the management API can (the one given,
/// or that of `node`, the broker node connected to).
pub async fn endpoints(broker: &Broker, node: &SecretUrl, named: Vec<String>) -> Result<Vec<String>, Failure> {
    if !named.is_empty() {
        return Ok(named);
    }
    let management = match &broker.management_url {
        Some(url) => url.clone(),
        None => http::management_url_of(node.expose())
            .map(SecretUrl::new)
            .ok_or_else(|| Failure::Described(format!("{node}: no host to find the management API on")))?,
    };
    let path = format!("{}?columns=name", broker.amqp_url.management_queues_path());
    let unreachable = |why: String| {
        Failure::Described(format!(
            "cannot list the parking queues through the management API at {management} ({why}): name them with \
             --endpoint, or set RABBITMQ_MANAGEMENT_URL"
        ))
    };
    let response = http::request("GET", &http::join(management.expose(), &path), &[], None)
        .await
        .map_err(|error| unreachable(error.to_string()))?;
    if response.status != 200 {
        return Err(unreachable(format!("HTTP {}", response.status)));
    }
    let queues: Vec<serde_json::Value> =
        serde_json::from_slice(&response.body).map_err(|error| unreachable(format!("not a queue list: {error}")))?;
    let mut found: Vec<String> =
        queues.iter().filter_map(|queue| queue["name"].as_str()?.strip_suffix(".parking").map(str::to_owned)).collect();
    found.sort();
    if found.is_empty() {
        return Err(Failure::Described(format!(
            "no parking queue (`<endpoint>.parking`) in vhost `{}`",
            broker.amqp_url.vhost()
        )));
    }
    Ok(found)
}

/// The messages `filter` selects, endpoint by endpoint, in parking order, with what they carry.
pub async fn list(connection: &Connection, filter: &Filter) -> Result<Vec<(Summary, Details)>, Failure> {
    let mut listed = Vec::new();
    for endpoint in &filter.endpoint {
        let held = Held::read(connection, endpoint).await?;
        for index in held.selected(filter) {
            let parked = &held.messages[index];
            listed.push((parked.summary.clone(), parked.details()));
        }
        held.give_back().await?;
    }
    Ok(listed)
}

/// The parked message `message_id`, found in the first of `endpoints` that holds it.
pub async fn show(
    connection: &Connection,
    message_id: Uuid,
    endpoints: &[String],
) -> Result<(Summary, Details), Failure> {
    for endpoint in endpoints {
        let held = Held::read(connection, endpoint).await?;
        let found = held.messages.iter().find(|parked| parked.summary.message_id == Some(message_id));
        let shown = found.map(|parked| (parked.summary.clone(), parked.details()));
        held.give_back().await?;
        if let Some(shown) = shown {
            return Ok(shown);
        }
    }
    Err(Failure::Described(format!("no parked message {message_id} in {}", endpoints.join(", "))))
}

/// What [`Report`] says of a message a redrive refused.
pub const REFUSED: &str = "refused";

/// How to redrive.
#[derive(Debug, Clone, Copy)]
pub struct Redrive {
    /// Say what would be redriven, and what each message's inbox says; change nothing.
    pub dry_run: bool,
    /// Redrive messages parked longer ago than `inbox_retention` too.
    pub force: bool,
    /// The consumers' INBOX_RETENTION: a message parked longer ago may have been applied and
    /// forgotten.
    pub inbox_retention: Duration,
}

impl Redrive {
    /// What [`Report`] says of a message redriven (or that would be).
    pub fn verb(self) -> &'static str {
        if self.dry_run { "would redrive" } else { "redriven" }
    }
}

/// Redrive what `filter` selects, as `how` says, judging each message against `inboxes`; what was
/// done goes to `report`, also when it fails part way.
pub async fn redrive(
    connection: &Connection,
    filter: &Filter,
    how: Redrive,
    inboxes: &Inboxes,
    report: &mut Report,
) -> Result<(), Failure> {
    let publisher = Publisher::open(connection).await?;
    for endpoint in &filter.endpoint {
        let held = Held::read(connection, endpoint).await?;
        let outcome = redrive_held(&held, filter, how, inboxes, &publisher, report).await;
        // Whatever happened, the rest goes back in its order.
        held.give_back().await?;
        outcome?;
    }
    publisher.close().await;
    if report.done.is_empty() {
        return Err(Failure::NothingSelected("nothing selected".into()));
    }
    Ok(())
}

async fn redrive_held(
    held: &Held,
    filter: &Filter,
    how: Redrive,
    inboxes: &Inboxes,
    publisher: &Publisher,
    report: &mut Report,
) -> Result<(), Failure> {
    let now = Utc::now();
    let selected = held.selected(filter);
    let summaries: Vec<&Summary> = selected.iter().map(|&index| &held.messages[index].summary).collect();
    let verdicts = inboxes.verdicts(&summaries, how.inbox_retention).await;
    for (index, verdict) in selected.into_iter().zip(verdicts) {
        let parked = &held.messages[index];
        if !how.force && older_than(parked.summary.parked_at, how.inbox_retention, now) {
            let when = age(parked.summary.parked_at, now)
                .map_or("at an unknown time".into(), |age| format!("{} ago", format_duration(age)));
            let note = format!(
                "parked {when}, beyond the inbox retention of {} (INBOX_RETENTION): its inbox row may be gone, so \
                 it could be applied twice; --force redrives it anyway",
                format_duration(how.inbox_retention)
            );
            report.add(REFUSED, parked, Some(verdict), Some(note));
            continue;
        }
        if how.dry_run {
            report.add(how.verb(), parked, Some(verdict), None);
            continue;
        }
        let redrive_count = parked.summary.redrive_count + 1;
        // The copy first, then its job's event. Killed in between, the job stays quarantined until
        // the copy's result ends it; the other way round, a kill in between left the job in
        // progress for good, with no copy on its way (found by docs/model/jobs.pml).
        let properties = envelope::redriven(&parked.delivery.properties, redrive_count);
        // Through the endpoint's own exchange, declared and bound by its consumer at start-up.
        let exchange = topology::direct_exchange_of(&held.endpoint);
        if let Err(error) = publisher.publish(&exchange, &held.endpoint, &parked.delivery.data, properties).await {
            // Nothing was sent: the message stays parked, its job quarantined.
            return Err(Failure::Described(format!(
                "cannot send {} back to `{}` through `{exchange}` (its consumer declares it when it starts): {error}",
                parked.line(),
                held.endpoint
            )));
        }
        failpoint::hit(BETWEEN_REDRIVE_SENDS).await;
        let mut warning = None;
        if let (Some(job_id), Some(message_id)) = (parked.summary.job_id, parked.summary.message_id) {
            let event = JobRedriven { job_id, endpoint: held.endpoint.clone(), message_id, redrive_count };
            warning = send_job_event(publisher, &event, Unroutable::Warn).await?;
        }
        failpoint::hit(AFTER_REDRIVE_PUBLISH).await;
        held.ack(index).await?;
        report.add(how.verb(), parked, Some(verdict), warning);
    }
    Ok(())
}

/// Publish a job event (confirmed). One that reaches no queue (no status consumer bound) is a
/// warning, returned to be said beside the message, or a failure, as `unroutable` says.
pub async fn send_job_event<C: JobEvent>(
    publisher: &Publisher,
    event: &C,
    unroutable: Unroutable,
) -> Result<Option<String>, Failure> {
    let (body, properties) = envelope::job_event(event)?;
    match publisher.publish(C::EXCHANGE, C::TYPE, &body, properties).await {
        Ok(()) => Ok(None),
        Err(PublishError::Returned(reason)) if unroutable == Unroutable::Warn => {
            Ok(Some(format!("warning: its {} went nowhere ({reason}): nothing ends or reopens its job", C::TYPE)))
        }
        Err(error) => {
            let job_id = event.job_id();
            Err(Failure::Described(format!(
                "cannot publish {} for job {job_id}: {error}; its message stays parked",
                C::TYPE
            )))
        }
    }
}

/// How `purge` and `abandon` end the parked messages they select.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending<'a> {
    /// Delete them (only with `yes`; an undo only with `including_undos`); a message of a job
    /// abandons the job first.
    Purge {
        /// Confirmed: without it, nothing is deleted.
        yes: bool,
        /// Undo messages are deleted too, rather than refused.
        including_undos: bool,
        /// Why, for the record of each job abandoned.
        note: &'a str,
    },
    /// Abandon the job of each (with the operator's note), then delete it.
    Abandon {
        /// Why, for the job's record.
        note: &'a str,
    },
}

impl Ending<'_> {
    /// What is said of each message ended.
    pub fn verb(self) -> &'static str {
        match self {
            Self::Purge { .. } => "purged",
            Self::Abandon { .. } => "abandoned",
        }
    }

    /// Whether an undo selected is ended too (`purge --including-undos`), rather than refused.
    fn ends_undos(self) -> bool {
        matches!(self, Self::Purge { including_undos: true, .. })
    }

    /// A purge deletes a message whose `job.abandoned` reaches no queue, saying so; an abandon
    /// keeps it parked, since nothing would end its job.
    fn unroutable(self) -> Unroutable {
        match self {
            Self::Purge { .. } => Unroutable::Warn,
            Self::Abandon { .. } => Unroutable::Refuse,
        }
    }
}

/// End the messages `filter` selects, endpoint by endpoint, as `ending` says; what was ended goes
/// to `report`, also when it fails part way. Refused, with nothing ended, if it selects an undo
/// (`refuse_undos`); an undo parked after that check is kept, and the command fails saying so
/// once the rest is ended.
pub async fn end_parked(
    connection: &Connection,
    filter: &Filter,
    ending: Ending<'_>,
    report: &mut Report,
) -> Result<(), Failure> {
    if !ending.ends_undos() {
        refuse_undos(connection, filter, ending).await?;
    }
    let publisher = Publisher::open(connection).await?;
    let (mut ended, mut kept) = (0, Vec::new());
    for endpoint in &filter.endpoint {
        let held = Held::read(connection, endpoint).await?;
        let selected = held.selected(filter);
        if matches!(ending, Ending::Purge { yes: false, .. }) {
            held.give_back().await?;
            publisher.close().await;
            return Err(Failure::Described(format!(
                "purge deletes {} parked message(s) of `{endpoint}` for good: add --yes",
                selected.len()
            )));
        }
        let outcome = end_held(&held, &selected, ending, &publisher, &mut kept, report).await;
        held.give_back().await?;
        ended += outcome?;
    }
    publisher.close().await;
    if !kept.is_empty() {
        return Err(Failure::Described(format!(
            "{ended} message(s) {}; {} undo message(s) parked since the check were kept: {}",
            ending.verb(),
            kept.len(),
            kept.join("; ")
        )));
    }
    match (ended, ending) {
        (0, Ending::Purge { .. }) => Err(Failure::NothingSelected("nothing selected".into())),
        (0, Ending::Abandon { .. }) => Err(Failure::NothingSelected(
            "nothing selected: no parked message of a job (a job event is only purged)".into(),
        )),
        _ => Ok(()),
    }
}

/// Refuse to end what `filter` selects if it selects an undo ([`shop::is_undo`]): it comes after
/// its order ended, so nothing would send it again, and the job would stay `compensating` for
/// good. Every endpoint is read (and given back) before anything is ended, so a refusal leaves
/// every message parked. Each undo is named, with what to do instead.
async fn refuse_undos(connection: &Connection, filter: &Filter, ending: Ending<'_>) -> Result<(), Failure> {
    let mut undos = Vec::new();
    for endpoint in &filter.endpoint {
        let held = Held::read(connection, endpoint).await?;
        for index in held.selected(filter) {
            let parked = &held.messages[index];
            if parked.is_undo() {
                undos.push(format!("{endpoint}  {}", parked.line()));
            }
        }
        held.give_back().await?;
    }
    if undos.is_empty() {
        return Ok(());
    }
    let (verb, instead) = match ending {
        Ending::Purge { .. } => (
            "purge",
            "leave them out (--type, --reason, --job), or add --including-undos if no redrive can ever apply them \
             (their order lost by a failover)",
        ),
        Ending::Abandon { .. } => ("abandon", "end the job's other messages with purge --job and --type"),
    };
    Err(Failure::Described(format!(
        "{verb} would end {} undo message(s), which come after their order ended and are sent by nothing else: \
         their jobs would stay compensating and what the orders took stay taken. Nothing was ended. Redrive them \
         once their cause is mended, or {instead}: {}",
        undos.len(),
        undos.join("; ")
    )))
}

/// What to do when a job event reaches no queue (no status consumer is bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unroutable {
    /// Warn, and go on (`redrive`: the copy is sent; `purge`: the message is deleted anyway).
    Warn,
    /// Fail: the message stays parked (`abandon`: nothing would end its job).
    Refuse,
}

/// Delete the `selected` messages of `held` as `ending` says. For each message of a job, a
/// `job.abandoned` is sent and confirmed first, so that the job is ended (and compensated) by its
/// owner: deleted first, a crash in between would leave the job quarantined with nothing parked
/// to act on. An abandon leaves a message without a job parked; an undo is kept, and named in
/// `kept`, unless `ending` [ends undos](Ending::ends_undos). How many were deleted.
async fn end_held(
    held: &Held,
    selected: &[usize],
    ending: Ending<'_>,
    publisher: &Publisher,
    kept: &mut Vec<String>,
    report: &mut Report,
) -> Result<usize, Failure> {
    let (Ending::Purge { note, .. } | Ending::Abandon { note }) = ending;
    let mut ended = 0;
    for &index in selected {
        let parked = &held.messages[index];
        // A parked job event is only deleted: abandoning it would send another job event of the
        // same job, which the owner parks in turn if it cannot apply it, and so on.
        let job_event = parked.summary.message_type.as_deref().is_some_and(messaging::contracts::is_job_event);
        if parked.is_undo() && !ending.ends_undos() {
            // Parked between `refuse_undos`' read and this one: kept, as it would have been refused.
            kept.push(format!("{}  {}", held.endpoint, parked.line()));
            continue;
        }
        let mut warning = None;
        if let (Some(job_id), Some(message_id), false) = (parked.summary.job_id, parked.summary.message_id, job_event) {
            let event = JobAbandoned { job_id, endpoint: held.endpoint.clone(), message_id, reason: note.to_owned() };
            warning = send_job_event(publisher, &event, ending.unroutable()).await?;
        } else if let Ending::Abandon { .. } = ending {
            continue;
        }
        held.ack(index).await?;
        report.add(ending.verb(), parked, None, warning);
        ended += 1;
    }
    Ok(ended)
}
