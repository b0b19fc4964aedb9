//! `msgctl parked …`: what is in `<endpoint>.parking`, and sending it back or away.
//!
//! Every command reads the whole parking queue unacked (`basic.get`, in queue order), acts on the
//! selected messages one at a time, and returns every message it did not ack with one
//! `basic.nack(multiple, requeue)`, which puts them back in their order (pinned on RabbitMQ 3.10
//! and 4.0 by `tests/msgctl.rs`). A redriven message is acked only after the broker confirmed its
//! copy in the work queue: killed in between, it is in both (the inbox absorbs the second), never
//! in neither.

use std::{cell::RefCell, collections::HashSet, time::Duration};

use chrono::{DateTime, Utc};
use lapin::{
    BasicProperties, Channel, Connection,
    message::Delivery,
    options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions},
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
use uuid::Uuid;

use crate::Failure;

/// Failpoint: a redriven message's copy and its `job.redriven` are confirmed, the parked message
/// not yet acked.
pub const AFTER_REDRIVE_PUBLISH: &str = "msgctl.after-redrive-publish";

/// Failpoint: a redriven message's copy is confirmed in the work queue, its `job.redriven` not yet
/// sent.
pub const BETWEEN_REDRIVE_SENDS: &str = "msgctl.between-redrive-sends";

#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// List parked messages: message id, type, job id, attempts, parked at, reason.
    List {
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
        #[command(flatten)]
        filter: Filter,
        /// Say what would be redriven; change nothing.
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
}

/// A parked message, read from its delivery.
#[derive(Debug)]
struct Parked {
    delivery: Delivery,
    message_id: Option<Uuid>,
    message_type: Option<String>,
    job_id: Option<Uuid>,
    attempts: u32,
    reason: String,
    parked_at: Option<DateTime<Utc>>,
    redrive_count: u32,
}

impl Parked {
    fn read(delivery: Delivery) -> Self {
        let properties = &delivery.properties;
        let headers = properties.headers().clone().unwrap_or_default();
        let text = |key: &str| envelope::header_text(&headers, key);
        Self {
            message_id: envelope::message_id(properties),
            message_type: properties.kind().as_ref().map(ToString::to_string),
            job_id: envelope::correlation_id(properties),
            attempts: envelope::header_u32(&headers, envelope::HEADER_RETRY_COUNT).unwrap_or(0) + 1,
            reason: text(envelope::HEADER_LAST_ERROR).unwrap_or_default(),
            parked_at: text(envelope::HEADER_PARKED_AT)
                .and_then(|at| DateTime::parse_from_rfc3339(&at).ok())
                .map(|at| at.with_timezone(&Utc)),
            redrive_count: envelope::header_u32(&headers, envelope::HEADER_REDRIVE_COUNT).unwrap_or(0),
            delivery,
        }
    }

    fn json(&self, endpoint: &str) -> serde_json::Value {
        serde_json::json!({
            "endpoint": endpoint,
            "messageId": self.message_id,
            "type": self.message_type,
            "jobId": self.job_id,
            "attempts": self.attempts,
            "redriveCount": self.redrive_count,
            "parkedAt": self.parked_at.map(|at| at.to_rfc3339()),
            "reason": self.reason,
        })
    }

    /// Whether it undoes an order's steps ([`shop::is_undo`]): never purged nor abandoned.
    fn is_undo(&self) -> bool {
        self.message_type.as_deref().is_some_and(shop::is_undo)
    }

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

impl Filter {
    /// Every message of `job` at `endpoint`.
    fn of_job(job: Uuid, endpoint: Vec<String>) -> Self {
        Self { endpoint, message_type: None, reason: None, since: None, limit: None, job: Some(job) }
    }

    fn matches(&self, parked: &Parked, now: DateTime<Utc>) -> bool {
        self.message_type.as_ref().is_none_or(|wanted| parked.message_type.as_ref() == Some(wanted))
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
    acked: RefCell<HashSet<u64>>,
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
            messages.push(Parked::read(message.delivery));
        }
        Ok(Self { endpoint: endpoint.to_owned(), channel, messages, acked: RefCell::default() })
    }

    /// The messages `filter` selects, in parking order, at most `limit`.
    fn selected(&self, filter: &Filter) -> Vec<usize> {
        let now = Utc::now();
        let chosen = self.messages.iter().enumerate().filter(|(_, parked)| filter.matches(parked, now));
        chosen.map(|(index, _)| index).take(filter.limit.unwrap_or(usize::MAX)).collect()
    }

    async fn ack(&self, index: usize) -> Result<(), Failure> {
        let tag = self.messages[index].delivery.delivery_tag;
        self.channel.basic_ack(tag, BasicAckOptions::default()).await?;
        self.acked.borrow_mut().insert(tag);
        Ok(())
    }

    /// Put back every message not acked, in its order: one nack of them all, up to the last one.
    async fn give_back(self) -> Result<(), Failure> {
        let acked = self.acked.borrow().clone();
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
#[derive(Debug)]
pub struct Broker {
    /// The broker's nodes, one AMQP URL each (its path is the vhost).
    pub amqp_url: BrokerNodes,
    /// The management API, if not the AMQP URL's host on port 15672.
    pub management_url: Option<SecretUrl>,
}

pub async fn run(action: Action, broker: &Broker, inbox_retention: Duration) -> Result<(), Failure> {
    let nodes = &broker.amqp_url;
    let (connection, node) = broker::connect_any(nodes, 0, "msgctl")
        .await
        .map_err(|error| Failure::Described(format!("cannot reach the broker at {nodes}: {error}")))?;
    // The management API is asked on the node that answered.
    let node = nodes.url(node);
    let outcome = async {
        match action {
            Action::List { mut filter, json } => {
                filter.endpoint = endpoints(broker, node, filter.endpoint).await?;
                list(&connection, &filter, json).await
            }
            Action::Show { message_id, endpoint } => {
                show(&connection, message_id, &endpoints(broker, node, endpoint).await?).await
            }
            Action::Redrive { mut filter, dry_run, force } => {
                filter.endpoint = endpoints(broker, node, filter.endpoint).await?;
                let horizon = if force { None } else { Some(inbox_retention) };
                redrive(&connection, &filter, dry_run, horizon).await
            }
            Action::Purge { mut filter, yes, including_undos } => {
                filter.endpoint = endpoints(broker, node, filter.endpoint).await?;
                end_parked(&connection, &filter, Ending::Purge { yes, including_undos }).await
            }
            Action::Abandon { job, endpoint, note } => {
                let filter = Filter::of_job(job, endpoints(broker, node, endpoint).await?);
                end_parked(&connection, &filter, Ending::Abandon { note: &note }).await
            }
        }
    }
    .await;
    let _ = connection.close(200, "bye".into()).await;
    outcome
}

/// The endpoints named, or else every endpoint that has a parking queue (`<endpoint>.parking`) in
/// the AMQP URL's vhost, by name. AMQP cannot list queues: the management API can (the one given,
/// or that of `node`, the broker node msgctl is connected to).
async fn endpoints(broker: &Broker, node: &SecretUrl, named: Vec<String>) -> Result<Vec<String>, Failure> {
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

async fn list(connection: &Connection, filter: &Filter, json: bool) -> Result<(), Failure> {
    let mut total = 0;
    for endpoint in &filter.endpoint {
        let held = Held::read(connection, endpoint).await?;
        for index in held.selected(filter) {
            let parked = &held.messages[index];
            if json {
                println!("{}", parked.json(endpoint));
            } else {
                println!("{endpoint}  {}", parked.line());
            }
            total += 1;
        }
        held.give_back().await?;
    }
    if !json {
        println!("{total} parked message(s) selected");
    }
    Ok(())
}

async fn show(connection: &Connection, message_id: Uuid, endpoints: &[String]) -> Result<(), Failure> {
    for endpoint in endpoints {
        let held = Held::read(connection, endpoint).await?;
        let found = held.messages.iter().find(|parked| parked.message_id == Some(message_id));
        if let Some(parked) = found {
            println!("endpoint: {endpoint}");
            print_properties(&parked.delivery.properties);
            let body = &parked.delivery.data;
            match serde_json::from_slice::<serde_json::Value>(body) {
                Ok(json) => println!("body:\n{}", serde_json::to_string_pretty(&json)?),
                Err(_) => println!("body ({} bytes, not JSON):\n{}", body.len(), String::from_utf8_lossy(body)),
            }
        }
        let shown = found.is_some();
        held.give_back().await?;
        if shown {
            return Ok(());
        }
    }
    Err(Failure::Described(format!("no parked message {message_id} in {}", endpoints.join(", "))))
}

fn print_properties(properties: &BasicProperties) {
    let text = |value: &Option<lapin::types::ShortString>| value.as_ref().map_or("-".into(), ToString::to_string);
    println!("message id: {}", text(properties.message_id()));
    println!("type: {}", text(properties.kind()));
    println!("correlation id (job): {}", text(properties.correlation_id()));
    println!("headers:");
    if let Some(headers) = properties.headers() {
        for (key, value) in headers.inner() {
            let value = envelope::header_text(headers, key.as_str()).unwrap_or_else(|| format!("{value:?}"));
            println!("  {key}: {value}");
        }
    }
}

/// Redrive, refusing messages parked before `horizon` ago (`None`: `--force`).
async fn redrive(
    connection: &Connection,
    filter: &Filter,
    dry_run: bool,
    horizon: Option<Duration>,
) -> Result<(), Failure> {
    let publisher = Publisher::open(connection).await?;
    let (mut redriven, mut refused) = (0, 0);
    for endpoint in &filter.endpoint {
        let held = Held::read(connection, endpoint).await?;
        let outcome = redrive_held(&held, filter, dry_run, horizon, &publisher, (&mut redriven, &mut refused)).await;
        // Whatever happened, the rest goes back in its order.
        held.give_back().await?;
        outcome?;
    }
    publisher.close().await;
    let verb = if dry_run { "would be redriven" } else { "redriven" };
    println!("{redriven} message(s) {verb}, {refused} refused");
    match (redriven, refused) {
        (_, refused) if refused > 0 => Err(Failure::Described(format!("{refused} message(s) refused (see above)"))),
        (0, _) => Err(Failure::Described("nothing selected".into())),
        _ => Ok(()),
    }
}

async fn redrive_held(
    held: &Held,
    filter: &Filter,
    dry_run: bool,
    horizon: Option<Duration>,
    publisher: &Publisher,
    (redriven, refused): (&mut usize, &mut usize),
) -> Result<(), Failure> {
    let now = Utc::now();
    for index in held.selected(filter) {
        let parked = &held.messages[index];
        if let Some(horizon) = horizon {
            let age = parked.parked_at.map(|at| now.signed_duration_since(at).to_std().unwrap_or_default());
            if age.is_none_or(|age| age > horizon) {
                let when = age.map_or("at an unknown time".into(), |age| format!("{} ago", format_duration(age)));
                println!(
                    "refused {}: parked {when}, beyond the inbox retention of {} (INBOX_RETENTION): its inbox row may \
                     be gone, so it could be applied twice; --force redrives it anyway",
                    parked.line(),
                    format_duration(horizon)
                );
                *refused += 1;
                continue;
            }
        }
        if dry_run {
            println!("would redrive {}  {}", held.endpoint, parked.line());
            *redriven += 1;
            continue;
        }
        let redrive_count = parked.redrive_count + 1;
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
        if let (Some(job_id), Some(message_id)) = (parked.job_id, parked.message_id) {
            let event = JobRedriven { job_id, endpoint: held.endpoint.clone(), message_id, redrive_count };
            send_job_event(publisher, &event, Unroutable::Warn).await?;
        }
        failpoint::hit(AFTER_REDRIVE_PUBLISH).await;
        held.ack(index).await?;
        println!("redriven {}  {}", held.endpoint, parked.line());
        *redriven += 1;
    }
    Ok(())
}

/// Publish a job event (confirmed). One that reaches no queue (no status consumer bound) is a
/// warning or a failure, as `unroutable` says.
pub(crate) async fn send_job_event<C: JobEvent>(
    publisher: &Publisher,
    event: &C,
    unroutable: Unroutable,
) -> Result<(), Failure> {
    let (body, properties) = envelope::job_event(event)?;
    match publisher.publish(C::EXCHANGE, C::TYPE, &body, properties).await {
        Ok(()) => Ok(()),
        Err(PublishError::Returned(reason)) if unroutable == Unroutable::Warn => {
            eprintln!("msgctl: warning: {} for job {} went nowhere ({reason})", C::TYPE, event.job_id());
            Ok(())
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
enum Ending<'a> {
    /// Delete them (only with `yes`; an undo only with `including_undos`); a message of a job
    /// abandons the job first.
    Purge { yes: bool, including_undos: bool },
    /// Abandon the job of each (with the operator's note), then delete it.
    Abandon { note: &'a str },
}

impl Ending<'_> {
    /// What is said of each message ended.
    fn verb(self) -> &'static str {
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

/// End the messages `filter` selects, endpoint by endpoint, as `ending` says. Refused, with
/// nothing ended, if it selects an undo ([`refuse_undos`]); an undo parked after that check is
/// kept, and the command fails saying so once the rest is ended.
async fn end_parked(connection: &Connection, filter: &Filter, ending: Ending<'_>) -> Result<(), Failure> {
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
        let outcome = end_held(&held, &selected, ending, &publisher, &mut kept).await;
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
        (0, Ending::Purge { .. }) => Err(Failure::Described("nothing selected".into())),
        (0, Ending::Abandon { .. }) => Err(Failure::Described("no parked message of this job".into())),
        (ended, ending) => {
            println!("{ended} message(s) {}", ending.verb());
            Ok(())
        }
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
pub(crate) enum Unroutable {
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
) -> Result<usize, Failure> {
    let note = match ending {
        Ending::Purge { .. } => "purged with msgctl",
        Ending::Abandon { note } => note,
    };
    let mut ended = 0;
    for &index in selected {
        let parked = &held.messages[index];
        // A parked job event is only deleted: abandoning it would send another job event of the
        // same job, which the owner parks in turn if it cannot apply it, and so on.
        let job_event = parked.message_type.as_deref().is_some_and(messaging::contracts::is_job_event);
        if parked.is_undo() && !ending.ends_undos() {
            // Parked between `refuse_undos`' read and this one: kept, as it would have been refused.
            kept.push(format!("{}  {}", held.endpoint, parked.line()));
            continue;
        }
        if let (Some(job_id), Some(message_id), false) = (parked.job_id, parked.message_id, job_event) {
            let event = JobAbandoned { job_id, endpoint: held.endpoint.clone(), message_id, reason: note.to_owned() };
            send_job_event(publisher, &event, ending.unroutable()).await?;
        } else if let Ending::Abandon { .. } = ending {
            continue;
        }
        held.ack(index).await?;
        println!("{} {}  {}", ending.verb(), held.endpoint, parked.line());
        ended += 1;
    }
    Ok(ended)
}
