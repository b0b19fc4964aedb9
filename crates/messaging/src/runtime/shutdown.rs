//! Shutdown fan-out: one trigger, any number of tasks that stop taking work when it fires.

use tokio::sync::watch;

/// The sending side: fire it once (on SIGTERM/SIGINT, or from a test) to stop every task.
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

/// The receiving side, cheap to clone into every task.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// A new trigger and its first receiver.
pub fn channel() -> (ShutdownTrigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger(tx), Shutdown(rx))
}

impl ShutdownTrigger {
    /// Ask every task to stop. Idempotent.
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }

    /// Another receiver for a task started later.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }
}

impl Shutdown {
    /// Whether shutdown has been asked for.
    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once shutdown has been asked for (or the trigger was dropped, which means the
    /// owner is gone and nobody could ever ask).
    pub async fn triggered(&self) {
        let mut rx = self.0.clone();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Sleep for `duration` unless shutdown comes first; returns `false` if interrupted.
    pub async fn sleep(&self, duration: std::time::Duration) -> bool {
        tokio::select! {
            () = tokio::time::sleep(duration) => true,
            () = self.triggered() => false,
        }
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what `docker stop` and Kubernetes send).
pub async fn signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown signal received");
}
