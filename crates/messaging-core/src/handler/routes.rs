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

/// One contract's route: decode the body as that contract, and call its [`Handle`].
type Route<H> = for<'a> fn(&'a H, &'a Incoming, &'a mut PgConnection) -> BoxFuture<'a, Result<(), HandlerError>>;

/// One contract's batch lock: decode the batch's members of that contract, and call its
/// [`LockBatch`].
type BatchLock<H> =
    for<'a> fn(&'a H, &'a [&'a Incoming], &'a mut PgConnection) -> BoxFuture<'a, Result<(), HandlerError>>;

/// A handler made of typed ones: one [`Handle<C>`] implementation per contract, registered with
/// [`Routes::on`]. It is the [`Handler`] a consumer runs.
///
/// ```
/// use messaging_core::{contracts::Contract, handler::{Context, Handle, HandlerError, Routes}};
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
/// let handler = Routes::new(MarkPaid).on::<Paid>();
/// assert_eq!(handler.check(&["paid"]), Ok(()));
/// ```
pub struct Routes<H> {
    handler: H,
    /// Each contract's type, its current major version, its exchange and its route.
    routes: Vec<(&'static str, u32, &'static str, Route<H>)>,
    batch_lock: Option<BatchLock<H>>,
}

impl<H> std::fmt::Debug for Routes<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let types: Vec<&str> = self.routes.iter().map(|(message_type, ..)| *message_type).collect();
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
        self.routes.push((C::TYPE, C::VERSION, C::EXCHANGE, route::<H, C>));
        self
    }

    /// Before a batch is handled, lock what its messages of contract `C` will update, with `H`'s
    /// [`LockBatch<C>`]. One contract per handler: the locks of two would be taken in two orders.
    pub fn lock_batches<C>(mut self) -> Self
    where
        H: LockBatch<C>,
        C: Contract + DeserializeOwned + Send + Sync + 'static,
    {
        debug_assert!(self.batch_lock.is_none(), "a second batch lock, for {}", C::TYPE);
        self.batch_lock = Some(batch_lock::<H, C>);
        self
    }

    /// The types it routes, in the order they were added.
    pub fn types(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.routes.iter().map(|(message_type, ..)| *message_type)
    }

    /// Each contract it routes: its type and the exchange it is published to, for a check that
    /// its endpoint binds them.
    pub fn contracts(&self) -> impl Iterator<Item = (&'static str, &'static str)> + '_ {
        self.routes.iter().map(|(message_type, _, exchange, _)| (*message_type, *exchange))
    }

    /// Whether it routes every type in `accepts` (its endpoint's): a type accepted and not routed
    /// would be parked on arrival. (A route for a type the endpoint does not list cannot happen:
    /// the consumer accepts whatever its routes take, [`Handler::accepts`].)
    pub fn check(&self, accepts: &[&str]) -> Result<(), String> {
        let unrouted: Vec<&str> = accepts.iter().copied().filter(|t| self.types().all(|known| known != *t)).collect();
        if unrouted.is_empty() {
            return Ok(());
        }
        Err(format!("accepts {unrouted:?} with no route"))
    }

    /// The typed handler it routes to.
    pub fn handler(&self) -> &H {
        &self.handler
    }
}

/// [`Route`] of contract `C`.
fn route<'a, H, C>(
    handler: &'a H,
    message: &'a Incoming,
    tx: &'a mut PgConnection,
) -> BoxFuture<'a, Result<(), HandlerError>>
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

/// [`BatchLock`] of contract `C`. A member that is of another type, or whose body does not parse,
/// locks nothing here: its own handling routes or parks it.
fn batch_lock<'a, H, C>(
    handler: &'a H,
    messages: &'a [&'a Incoming],
    tx: &'a mut PgConnection,
) -> BoxFuture<'a, Result<(), HandlerError>>
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
        match self.routes.iter().find(|(message_type, ..)| *message_type == message.message_type) {
            Some((.., route)) => route(&self.handler, message, tx).await,
            None => Err(Unreadable::UnknownType(message.message_type.clone()).into()),
        }
    }

    async fn lock_batch(&self, messages: &[&Incoming], tx: &mut PgConnection) -> Result<(), HandlerError> {
        match self.batch_lock {
            Some(lock) => lock(&self.handler, messages, tx).await,
            None => Ok(()),
        }
    }

    fn accepts(&self) -> Vec<(&'static str, u32)> {
        self.routes.iter().map(|(message_type, version, ..)| (*message_type, *version)).collect()
    }

    fn check_routes(&self, accepts: &[&str]) -> Result<(), String> {
        self.check(accepts)
    }
}

#[cfg(test)]
mod tests {
    use super::{Context, Handle, HandlerError, Routes};
    use crate::contracts::{Contract, JobQuarantined, JobRedriven};

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
    fn routes_must_take_everything_the_endpoint_accepts() {
        let endpoint = [JobQuarantined::TYPE, JobRedriven::TYPE];
        let both = Routes::new(Both).on::<JobQuarantined>().on::<JobRedriven>();
        assert_eq!(both.check(&endpoint), Ok(()));
        assert_eq!(both.types().collect::<Vec<_>>(), ["job.quarantined", "job.redriven"]);
        // What the consumer accepts besides its endpoint's own: each type, up to its version.
        let accepts = super::Handler::accepts(&both);
        assert_eq!(
            accepts,
            [(JobQuarantined::TYPE, JobQuarantined::VERSION), (JobRedriven::TYPE, JobRedriven::VERSION)]
        );

        let one = Routes::new(Both).on::<JobQuarantined>();
        let refusal = one.check(&endpoint).expect_err("job.redriven has no route");
        assert!(refusal.contains(r#"accepts ["job.redriven"] with no route"#), "{refusal}");
    }
}
