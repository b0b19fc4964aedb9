//! Typed handlers: a service implements [`Handle<C>`] once per contract its endpoint accepts, and
//! [`Routes`] decodes each message into its contract's type and hands it to the right one. The
//! runtime has already checked the message's type and version against the endpoint, so a
//! message of a type with no route, or whose body does not parse, is parked with the reason, as
//! any unreadable message is.

use std::future::Future;

use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use sqlx::PgConnection;
use uuid::Uuid;

use super::{Handler, HandlerError};
use crate::{
    contracts::Contract,
    envelope::{Incoming, Unreadable},
    topology::Endpoint,
};

/// What the runtime knows of the message being handled, besides its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Context {
    /// Its id: stable across every republish, the inbox key.
    pub message_id: Uuid,
    /// Which attempt this is: 1 for the first delivery, 2 after one retry, and so on.
    pub attempt: u32,
    /// The job it belongs to: its correlation id, or, without one, the job its body names
    /// ([`Contract::job`]). Pass it on to what the handler writes to its outbox.
    pub job_id: Option<Uuid>,
}

/// Apply one message of contract `C` inside the runtime's transaction, as [`Handler`] does for a
/// raw message: the inbox row is already written in `tx`; add the effect and any outbox rows, and
/// do not commit.
pub trait Handle<C>: Send + Sync + 'static {
    /// Apply `message`.
    fn handle(
        &self,
        message: C,
        context: &Context,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Take the row locks a batch of contract `C` will need before any of it is handled
/// ([`Handler::lock_batch`]): a handler whose messages lock rows that other messages of the queue
/// also lock (stock shared by orders) locks them all here, in one statement, in one order.
pub trait LockBatch<C>: Send + Sync + 'static {
    /// Lock what `messages`, the batch's unseen members of contract `C`, will update.
    fn lock_batch(
        &self,
        messages: &[C],
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Take the locks of the jobs a batch's messages belong to before any of it is handled
/// ([`Handler::lock_batch`]), whatever their contracts: a handler that moves the job each of its
/// messages names (a status consumer, where one job's events arrive in two batches) locks them all
/// here, in one statement, in job-id order.
pub trait LockJobs: Send + Sync + 'static {
    /// Lock `jobs`, the jobs of the batch's unseen members ([`Context::job_id`]), in id order.
    fn lock_jobs(&self, jobs: &[Uuid], tx: &mut PgConnection) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// One contract's route: its type, how to handle it, and how to find its job.
struct Route<H> {
    message_type: &'static str,
    /// Decode the body as the contract, and call its [`Handle`].
    handle: HandleFn<H>,
    /// The job the message belongs to ([`Context::job_id`]).
    job: fn(&Incoming) -> Option<Uuid>,
}

/// What a route or a batch lock returns.
type Done<'a> = BoxFuture<'a, Result<(), HandlerError>>;
type HandleFn<H> = for<'a> fn(&'a H, &'a Incoming, &'a mut PgConnection) -> Done<'a>;
type ContractLock<H> = for<'a> fn(&'a H, &'a [&'a Incoming], &'a mut PgConnection) -> Done<'a>;
type JobsLock<H> = for<'a> fn(&'a H, &'a [Uuid], &'a mut PgConnection) -> Done<'a>;

/// What a batch locks before it is handled.
enum BatchLock<H> {
    /// One contract's members, decoded, to its [`LockBatch`].
    Contract(ContractLock<H>),
    /// Every member's job, to [`LockJobs`].
    Jobs(JobsLock<H>),
}

/// A handler made of typed ones: one [`Handle<C>`] implementation per contract, registered with
/// [`Routes::on`]. It is the [`Handler`] a consumer runs.
///
/// ```
/// use messaging::{consumer::{Context, Handle, HandlerError, Routes}, contracts::Contract, topology::Endpoint};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Paid { order_id: uuid::Uuid }
/// # impl Contract for Paid { const TYPE: &'static str = "paid"; const EXCHANGE: &'static str = "shop"; }
/// struct MarkPaid;
///
/// impl Handle<Paid> for MarkPaid {
///     async fn handle(&self, paid: Paid, _: &Context, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
///         sqlx::query("update orders set paid = true where id = $1").bind(paid.order_id).execute(tx).await?;
///         Ok(())
///     }
/// }
///
/// let endpoint = Endpoint::new("orders.paid").consume::<Paid>();
/// let handler = Routes::new(MarkPaid).on::<Paid>();
/// assert_eq!(handler.check(&endpoint), Ok(()));
/// ```
pub struct Routes<H> {
    handler: H,
    routes: Vec<Route<H>>,
    batch_lock: Option<BatchLock<H>>,
}

impl<H> std::fmt::Debug for Routes<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let types: Vec<&str> = self.routes.iter().map(|route| route.message_type).collect();
        f.debug_struct("Routes").field("types", &types).finish_non_exhaustive()
    }
}

impl<H: Send + Sync + 'static> Routes<H> {
    /// No routes yet.
    pub fn new(handler: H) -> Self {
        Self { handler, routes: Vec::new(), batch_lock: None }
    }

    /// Hand messages of contract `C` to `H`'s [`Handle<C>`].
    pub fn on<C>(mut self) -> Self
    where
        H: Handle<C>,
        C: Contract + DeserializeOwned + Send + 'static,
    {
        debug_assert!(self.types().all(|known| known != C::TYPE), "two routes for {}", C::TYPE);
        self.routes.push(Route { message_type: C::TYPE, handle: route::<H, C>, job: job_of::<C> });
        self
    }

    /// Before a batch is handled, lock what its messages of contract `C` will update, with `H`'s
    /// [`LockBatch<C>`]. One batch lock per handler, of one contract: the locks of two would be
    /// taken in two orders.
    pub fn lock_batches<C>(mut self) -> Self
    where
        H: LockBatch<C>,
        C: Contract + DeserializeOwned + Send + Sync + 'static,
    {
        debug_assert!(self.batch_lock.is_none(), "a second batch lock, for {}", C::TYPE);
        self.batch_lock = Some(BatchLock::Contract(batch_lock::<H, C>));
        self
    }

    /// Before a batch is handled, lock the jobs its messages belong to, whatever their contracts,
    /// with `H`'s [`LockJobs`]. One batch lock per handler: in place of [`Self::lock_batches`].
    pub fn lock_jobs(mut self) -> Self
    where
        H: LockJobs,
    {
        debug_assert!(self.batch_lock.is_none(), "a second batch lock, of jobs");
        self.batch_lock = Some(BatchLock::Jobs(jobs_lock::<H>));
        self
    }

    /// The types it routes, in the order they were added.
    pub fn types(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.routes.iter().map(|route| route.message_type)
    }

    /// Whether it routes exactly what `endpoint` accepts: a type accepted and not routed would be
    /// parked on arrival, and a route for a type not accepted would never run.
    pub fn check(&self, endpoint: &Endpoint) -> Result<(), String> {
        let unrouted: Vec<&str> =
            endpoint.accepts.iter().map(|(t, _)| *t).filter(|t| self.types().all(|known| known != *t)).collect();
        let unaccepted: Vec<&str> =
            self.types().filter(|t| endpoint.accepts.iter().all(|(accepted, _)| accepted != t)).collect();
        if unrouted.is_empty() && unaccepted.is_empty() {
            return Ok(());
        }
        Err(format!(
            "endpoint {} accepts {unrouted:?} with no route, and has routes for {unaccepted:?} it does not accept",
            endpoint.name
        ))
    }

    /// The typed handler it routes to.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The route of `message`'s type.
    fn route_of(&self, message: &Incoming) -> Option<&Route<H>> {
        self.routes.iter().find(|route| route.message_type == message.message_type)
    }
}

/// [`Route`] of contract `C`.
fn route<'a, H, C>(handler: &'a H, message: &'a Incoming, tx: &'a mut PgConnection) -> Done<'a>
where
    H: Handle<C>,
    C: Contract + DeserializeOwned + Send + 'static,
{
    Box::pin(async move {
        let body: C = message.json()?;
        let job_id = message.correlation_id.or_else(|| body.job());
        let context = Context { message_id: message.message_id, attempt: message.attempt(), job_id };
        handler.handle(body, &context, tx).await
    })
}

/// The job of a message of contract `C`: its correlation id, or, without one, the job its body
/// names, as [`route`] gives it in the [`Context`].
fn job_of<C: Contract + DeserializeOwned>(message: &Incoming) -> Option<Uuid> {
    message.correlation_id.or_else(|| message.json::<C>().ok()?.job())
}

/// [`BatchLock::Jobs`] for `H`.
fn jobs_lock<'a, H: LockJobs>(handler: &'a H, jobs: &'a [Uuid], tx: &'a mut PgConnection) -> Done<'a> {
    Box::pin(handler.lock_jobs(jobs, tx))
}

/// [`BatchLock::Contract`] of contract `C`. A member that is of another type, or whose body does
/// not parse, locks nothing here: its own handling routes or parks it.
fn batch_lock<'a, H, C>(handler: &'a H, messages: &'a [&'a Incoming], tx: &'a mut PgConnection) -> Done<'a>
where
    H: LockBatch<C>,
    C: Contract + DeserializeOwned + Send + Sync + 'static,
{
    Box::pin(async move {
        let bodies: Vec<C> = messages
            .iter()
            .filter(|message| message.message_type == C::TYPE)
            .filter_map(|message| message.json().ok())
            .collect();
        if bodies.is_empty() {
            return Ok(());
        }
        handler.lock_batch(&bodies, tx).await
    })
}

impl<H: Send + Sync + 'static> Handler for Routes<H> {
    async fn handle(&self, message: &Incoming, tx: &mut PgConnection) -> Result<(), HandlerError> {
        match self.route_of(message) {
            Some(route) => (route.handle)(&self.handler, message, tx).await,
            None => Err(Unreadable::UnknownType(message.message_type.clone()).into()),
        }
    }

    async fn lock_batch(&self, messages: &[&Incoming], tx: &mut PgConnection) -> Result<(), HandlerError> {
        match self.batch_lock {
            Some(BatchLock::Contract(lock)) => lock(&self.handler, messages, tx).await,
            Some(BatchLock::Jobs(lock)) => {
                // A member with no route or no job locks nothing here: its own handling parks it,
                // or it has no job to move.
                let jobs: Vec<Uuid> = messages
                    .iter()
                    .filter_map(|message| self.route_of(message).and_then(|route| (route.job)(message)))
                    .collect();
                if jobs.is_empty() {
                    return Ok(());
                }
                lock(&self.handler, &jobs, tx).await
            }
            None => Ok(()),
        }
    }

    fn check_routes(&self, endpoint: &Endpoint) -> Result<(), String> {
        self.check(endpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::{Context, Handle, HandlerError, Routes};
    use crate::{
        contracts::{JobQuarantined, JobRedriven},
        topology::Endpoint,
    };

    struct Both;

    impl Handle<JobQuarantined> for Both {
        async fn handle(&self, _: JobQuarantined, _: &Context, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    impl Handle<JobRedriven> for Both {
        async fn handle(&self, _: JobRedriven, _: &Context, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    #[test]
    fn routes_must_take_exactly_what_the_endpoint_accepts() {
        let endpoint = Endpoint::new("e").accept::<JobQuarantined>().accept::<JobRedriven>();
        let both = Routes::new(Both).on::<JobQuarantined>().on::<JobRedriven>();
        assert_eq!(both.check(&endpoint), Ok(()));
        assert_eq!(both.types().collect::<Vec<_>>(), ["job.quarantined", "job.redriven"]);

        let one = Routes::new(Both).on::<JobQuarantined>();
        let refusal = one.check(&endpoint).expect_err("job.redriven has no route");
        assert!(refusal.contains(r#"accepts ["job.redriven"] with no route"#), "{refusal}");

        let narrow = Endpoint::new("e").accept::<JobQuarantined>();
        let refusal = both.check(&narrow).expect_err("job.redriven is not accepted");
        assert!(refusal.contains(r#"routes for ["job.redriven"]"#), "{refusal}");
    }
}
