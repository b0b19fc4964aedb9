//! The live page's console for parked messages (issue 57): every parked message, grouped by
//! endpoint and reason, with its headers, body, attempts and job, and what its consumer's inbox
//! says of it; and, for one message or a group, a redrive (with a dry run), an abandon through the
//! saga, or a purge. It runs msgctl's own implementation (`msgctl::parked`), so that the page and
//! the command line cannot differ. Operators only.
//!
//! It acts as the broker user `CONSOLE_AMQP_URL` names: the operator's, msgctl's, which may read
//! every parking queue and send to every endpoint. The API's own user may not, and keeps its least
//! privilege; unset, the console is off and its routes answer 404. One console command runs at a
//! time in a process: each reads a whole parking queue unacked, and a second read meanwhile would
//! find it empty.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    body::Body,
    extract::State,
    http::HeaderMap,
    routing::{get, post},
};
use messaging::runtime::config::{BrokerNodes, SecretUrl};
use msgctl::parked::{self, Details, Done, Ending, Filter, Inboxes, Redrive, Report, Summary, Verdict};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::{
    api::read_json,
    auth::{Auth, Caller},
    problem::ApiError,
};

/// How long a request waits for its console command. A read past it is given up (what it held goes
/// back to parking, in its order, as its connection closes); a command that acts goes on, to
/// [`GIVE_UP`], and a later read shows what it did.
const DEADLINE: Duration = Duration::from_secs(60);

/// How long a command that acts may run at all: past it, it is given up as a read is.
const GIVE_UP: Duration = Duration::from_secs(600);

/// The name of the console's broker connections.
const CONNECTION: &str = "orders-api console";

/// The console's settings.
#[derive(Debug, Clone, clap::Args)]
pub struct ConsoleArgs {
    /// The broker user the live page's console of parked messages acts as (the operator's, as
    /// msgctl's `AMQP_URL`; its vhost must be the service's). Unset: no console.
    #[arg(long, env = "CONSOLE_AMQP_URL", hide_env_values = true)]
    pub console_amqp_url: Option<BrokerNodes>,
}

/// What the console reads and acts with.
#[derive(Debug, Clone)]
pub struct Console {
    broker: parked::Broker,
    inboxes: Inboxes,
    inbox_retention: Duration,
    one_at_a_time: Arc<Mutex<()>>,
    auth: Auth,
}

impl axum::extract::FromRef<Console> for Auth {
    fn from_ref(console: &Console) -> Self {
        console.auth.clone()
    }
}

impl Console {
    /// The console acting as `amqp_url`, finding the parking queues through `management` (or the
    /// AMQP URL's host), judging messages against the consumers' `inboxes`, kept `inbox_retention`.
    pub fn new(
        amqp_url: BrokerNodes,
        management: Option<SecretUrl>,
        inboxes: Inboxes,
        inbox_retention: Duration,
        auth: Auth,
    ) -> Self {
        let broker = parked::Broker { amqp_url, management_url: management };
        Self { broker, inboxes, inbox_retention, one_at_a_time: Arc::default(), auth }
    }
}

/// The console's routes; with `None`, each answers an operator 404, saying how to turn it on
/// (and anyone else 401 or 403, as when it is on).
pub fn routes(console: Option<Console>, auth: Auth) -> Router {
    match console {
        Some(console) => Router::new()
            .route("/parked", get(list))
            .route("/parked/redrive", post(redrive))
            .route("/parked/abandon", post(abandon))
            .route("/parked/purge", post(purge))
            .with_state(console),
        None => Router::new()
            .route("/parked", get(off))
            .route("/parked/redrive", post(off))
            .route("/parked/abandon", post(off))
            .route("/parked/purge", post(off))
            .with_state(auth),
    }
}

async fn off(caller: Caller) -> ApiError {
    match caller.operator("the console") {
        Ok(()) => ApiError::NotFound("the console is off: set CONSOLE_AMQP_URL to the operator's broker user".into()),
        Err(refused) => refused,
    }
}

/// `GET /parked`: every parked message, grouped.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Parked {
    /// By endpoint, then by reason, each in parking order.
    pub groups: Vec<Group>,
}

/// The parked messages of one endpoint with one reason.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Group {
    /// The endpoint whose parking queue holds them.
    pub endpoint: String,
    /// Why they were parked.
    pub reason: String,
    /// Each of them.
    pub messages: Vec<Message>,
}

/// One parked message.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Message {
    /// What it is.
    pub summary: Summary,
    /// What it carries.
    pub details: Details,
    /// What a redrive would do, from its consumer's inbox.
    pub verdict: Verdict,
}

/// Which messages, at one endpoint.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Selection {
    /// The endpoint (its work queue's name).
    #[schema(min_length = 1)]
    pub endpoint: String,
    /// The messages, by id: one, or a whole group.
    #[schema(min_items = 1)]
    pub message_ids: Vec<Uuid>,
}

/// `POST /parked/redrive`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RedriveRequest {
    /// The endpoint (its work queue's name).
    #[schema(min_length = 1)]
    pub endpoint: String,
    /// The messages, by id: one, or a whole group.
    #[schema(min_items = 1)]
    pub message_ids: Vec<Uuid>,
    /// Say what would be done and what each inbox says; change nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Redrive messages parked longer ago than `INBOX_RETENTION` too (their inbox rows may be gone).
    #[serde(default)]
    pub force: bool,
}

/// What a console command did.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Outcome {
    /// Each message acted on (or, in a dry run, that would be), in order.
    pub done: Vec<Done>,
    /// Why it stopped, if it did not finish: what it did is in `done`, and every other message
    /// is still parked.
    pub error: Option<String>,
}

impl Selection {
    fn filter(self) -> Result<Filter, ApiError> {
        if self.endpoint.trim().is_empty() || self.message_ids.is_empty() {
            return Err(ApiError::BadRequest("name an endpoint and at least one message id".into()));
        }
        Ok(Filter::of_messages(self.endpoint, self.message_ids))
    }
}

/// Every parked message, grouped by endpoint and reason, each with what its consumer's inbox says.
#[utoipa::path(get, path = "/parked", tag = "operations", security(("bearer" = [])),
    responses((status = 200, description = "The parked messages.", body = Parked), ConsoleFailure))]
pub(crate) async fn list(State(console): State<Console>, caller: Caller) -> Result<Json<Parked>, ApiError> {
    caller.operator("the console")?;
    let _one = console.alone()?;
    let read = async {
        let (connection, node) = console.broker.connect(CONNECTION).await?;
        let listed = async {
            let endpoints = parked::endpoints(&console.broker, node, Vec::new()).await?;
            parked::list(&connection, &Filter::of_endpoints(endpoints)).await
        }
        .await;
        let _ = connection.close(200, "bye".into()).await;
        let listed = listed?;
        let summaries: Vec<&Summary> = listed.iter().map(|(summary, _)| summary).collect();
        let verdicts = console.inboxes.verdicts(&summaries, console.inbox_retention).await;
        Ok::<_, msgctl::Failure>((listed, verdicts))
    };
    let (listed, verdicts) = tokio::time::timeout(DEADLINE, read)
        .await
        .map_err(|_| ApiError::GatewayTimeout(format!("no answer within {DEADLINE:?}: nothing was changed")))?
        .map_err(|failure| ApiError::BadGateway(failure.to_string()))?;
    let mut groups: BTreeMap<(String, String), Vec<Message>> = BTreeMap::new();
    for ((summary, details), verdict) in listed.into_iter().zip(verdicts) {
        let group = groups.entry((summary.endpoint.clone(), summary.reason.clone())).or_default();
        group.push(Message { summary, details, verdict });
    }
    let groups =
        groups.into_iter().map(|((endpoint, reason), messages)| Group { endpoint, reason, messages }).collect();
    Ok(Json(Parked { groups }))
}

/// Send the selected messages back to their work queue, as `msgctl parked redrive --message-id`
/// does; with `dryRun`, say what would be done and what each consumer's inbox says of each.
#[utoipa::path(post, path = "/parked/redrive", tag = "operations", security(("bearer" = [])),
    request_body = RedriveRequest,
    responses((status = 200, description = "What was done.", body = Outcome), CommandFailure, ConsoleFailure))]
pub(crate) async fn redrive(
    State(console): State<Console>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Outcome>, ApiError> {
    caller.operator("the console")?;
    let request: RedriveRequest = read_json(&headers, body).await?;
    let RedriveRequest { endpoint, message_ids, dry_run, force } = request;
    let filter = Selection { endpoint, message_ids }.filter()?;
    let how = Redrive { dry_run, force, inbox_retention: console.inbox_retention };
    act(&console, Command::Redrive(filter, how)).await
}

impl Console {
    /// The console to this request alone, or a 409: a command runs already.
    fn alone(&self) -> Result<tokio::sync::OwnedMutexGuard<()>, ApiError> {
        Arc::clone(&self.one_at_a_time).try_lock_owned().map_err(|_| {
            ApiError::Conflict(
                "another console command is running in this service: wait for it, then read the parked messages \
                 again"
                    .into(),
            )
        })
    }
}

/// End the selected messages' jobs through the saga (`job.abandoned`: the orders service cancels
/// each and undoes what its steps did), then delete the messages, as `msgctl parked abandon`
/// does; an undo is refused.
#[utoipa::path(post, path = "/parked/abandon", tag = "operations", security(("bearer" = [])),
    request_body = Selection,
    responses((status = 200, description = "What was done.", body = Outcome), CommandFailure, ConsoleFailure))]
pub(crate) async fn abandon(
    State(console): State<Console>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Outcome>, ApiError> {
    act(&console, Command::Abandon(selected(&caller, &headers, body, "abandon").await?)).await
}

/// Delete the selected messages for good, abandoning the job of each first, as `msgctl parked
/// purge --yes` does; an undo is refused.
#[utoipa::path(post, path = "/parked/purge", tag = "operations", security(("bearer" = [])),
    request_body = Selection,
    responses((status = 200, description = "What was done.", body = Outcome), CommandFailure, ConsoleFailure))]
pub(crate) async fn purge(
    State(console): State<Console>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Outcome>, ApiError> {
    act(&console, Command::Purge(selected(&caller, &headers, body, "purge").await?)).await
}

/// An operator's selection, from a request's body. The operator's name is logged with `what`: the
/// note an abandon leaves reaches the job's `lastError` and story, which customers read, and names
/// nobody.
async fn selected(caller: &Caller, headers: &HeaderMap, body: Body, what: &str) -> Result<Filter, ApiError> {
    caller.operator("the console")?;
    let selection: Selection = read_json(headers, body).await?;
    tracing::info!(operator = caller.name(), endpoint = %selection.endpoint, "{what} from the console");
    selection.filter()
}

/// What the console does with the messages it selects.
enum Command {
    Redrive(Filter, Redrive),
    Abandon(Filter),
    Purge(Filter),
}

/// Run one command on a connection of its own, one at a time. It runs in a task of its own, so
/// that a request given up (the client gone, [`DEADLINE`] passed) does not stop it between a copy
/// confirmed and its original acked; it is given up at [`GIVE_UP`].
async fn act(console: &Console, command: Command) -> Result<Json<Outcome>, ApiError> {
    let one = console.alone()?;
    let console = console.clone();
    let run = async move {
        let _one = one;
        let (connection, _) = console.broker.connect(CONNECTION).await?;
        let mut report = Report::default();
        let outcome = match &command {
            Command::Redrive(filter, how) => {
                parked::redrive(&connection, filter, *how, &console.inboxes, &mut report).await
            }
            Command::Abandon(filter) => {
                let ending = Ending::Abandon { note: "on the live page" };
                parked::end_parked(&connection, filter, ending, &mut report).await
            }
            Command::Purge(filter) => {
                let ending = Ending::Purge { yes: true, including_undos: false, note: "purged on the live page" };
                parked::end_parked(&connection, filter, ending, &mut report).await
            }
        };
        let _ = connection.close(200, "bye".into()).await;
        Ok::<_, msgctl::Failure>((report, outcome))
    };
    // Its end is logged: the request may have given up on it.
    let task = tokio::spawn(async move {
        let ended = tokio::time::timeout(GIVE_UP, run).await;
        match &ended {
            Ok(Ok((report, outcome))) => {
                let error = outcome.as_ref().err().map(ToString::to_string);
                tracing::info!(done = report.done.len(), ?error, "console command ended");
            }
            Ok(Err(failure)) => tracing::warn!(%failure, "console command failed"),
            Err(_) => tracing::warn!("console command given up after {GIVE_UP:?}: what it had not done is parked"),
        }
        ended
    });
    let ended = match tokio::time::timeout(DEADLINE, task).await {
        Err(_) => {
            return Err(ApiError::GatewayTimeout(format!(
                "still running after {DEADLINE:?}: it goes on (for at most {GIVE_UP:?}); read the parked \
                 messages once it ends to see what it did"
            )));
        }
        Ok(ended) => ended.map_err(ApiError::internal)?,
    };
    // Only reached if GIVE_UP were shorter than DEADLINE; kept so that no outcome goes unanswered.
    let ended = ended.map_err(|_| ApiError::GatewayTimeout(format!("given up after {GIVE_UP:?}")))?;
    let (report, outcome) = ended.map_err(|failure| ApiError::BadGateway(failure.to_string()))?;
    match outcome {
        // Nothing done: the command's refusal is the answer.
        Err(msgctl::Failure::NothingSelected(_)) if report.done.is_empty() => {
            Err(ApiError::NotFound("none of the selected messages is parked (any more): read them again".into()))
        }
        Err(failure) if report.done.is_empty() => Err(ApiError::BadGateway(failure.to_string())),
        // Stopped part way: what it did, and why it stopped.
        outcome => Ok(Json(Outcome { done: report.done, error: outcome.err().map(|failure| failure.to_string()) })),
    }
}

/// How a console command that acts can fail, beyond a read (OpenAPI only).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum CommandFailure {
    /// A body that is not a selection (malformed JSON, unknown fields, no message id): nothing
    /// changed.
    #[response(status = 400, content_type = "application/problem+json")]
    BadRequest(crate::problem::Problem),
    /// A body over 64 KiB.
    #[response(status = 413, content_type = "application/problem+json")]
    TooLarge(crate::problem::Problem),
    /// A body that is not `application/json`.
    #[response(status = 415, content_type = "application/problem+json")]
    NotJson(crate::problem::Problem),
}

/// How a console command can fail (OpenAPI only).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum ConsoleFailure {
    /// No bearer token, or one refused.
    #[response(status = 401, content_type = "application/problem+json",
               headers(("WWW-Authenticate" = String, description = "`Bearer realm=\"orders\"`")))]
    Unauthenticated(crate::problem::Problem),
    /// Not an operator's token.
    #[response(status = 403, content_type = "application/problem+json")]
    Forbidden(crate::problem::Problem),
    /// The console is off (`CONSOLE_AMQP_URL` unset), or none of the selected messages is parked
    /// (any more).
    #[response(status = 404, content_type = "application/problem+json")]
    Off(crate::problem::Problem),
    /// Another console command runs in this service: nothing was done.
    #[response(status = 409, content_type = "application/problem+json")]
    Busy(crate::problem::Problem),
    /// The broker or its management API refused or failed it before anything was done (an unknown
    /// endpoint, a user without the rights, a node that does not answer), in its words. A command
    /// stopped part way answers 200, with what it did and its `error`.
    #[response(status = 502, content_type = "application/problem+json")]
    Refused(crate::problem::Problem),
    /// No answer in time: a read changed nothing; a command goes on, and a later read shows what
    /// it did.
    #[response(status = 504, content_type = "application/problem+json")]
    TimedOut(crate::problem::Problem),
}
