//! A TCP fault proxy: services connect to Postgres or RabbitMQ through it, and a test cuts, stalls
//! and restores their connections on command.
//!
//! - [`Proxy::cut`] closes every open connection and closes new ones at once, as a server that
//!   went away would;
//! - [`Proxy::stall`] keeps connections open but forwards nothing, as a network black hole would
//!   (new connections are accepted and then hang);
//! - [`Proxy::restore`] forwards again; stalled connections resume where they were.
//!
//! A [`Balancer`] is the load balancer in front of several instances of one service: each new
//! connection goes to the next instance in turn, or past it to the one after if it refuses.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpListener, TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::watch,
    task::JoinSet,
};

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward bytes both ways.
    Pass,
    /// Close every connection, existing and new.
    Cut,
    /// Forward nothing; keep connections open.
    Stall,
}

/// A proxy to one upstream server, listening on an ephemeral local port. Dropping it closes
/// everything it carries.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    open: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listen on `127.0.0.1:0` and forward to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, watcher) = watch::channel(Mode::Pass);
        let open = Arc::new(AtomicUsize::new(0));
        let accept = tokio::spawn(accept_loop(listener, upstream.to_owned(), watcher, Arc::clone(&open)));
        Ok(Self { addr, mode, open, accept })
    }

    /// A proxy for the server a `scheme://[user[:pass]@]host:port/...` URL names, and that URL
    /// rewritten to go through it.
    pub async fn for_url(url: &str) -> std::io::Result<(Self, String)> {
        let parsed = parse(url)?;
        let host = parsed.host_str().unwrap_or("localhost");
        let port = parsed.port_or_known_default().ok_or_else(|| invalid(url, "no port"))?;
        let proxy = Self::start(&format!("{host}:{port}")).await?;
        let rewritten = proxy.rewrite(url);
        Ok((proxy, rewritten))
    }

    /// `urls` (one URL, or several separated by commas) with host and port replaced by this
    /// proxy's address; user, path and query are kept.
    pub fn rewrite(&self, urls: &str) -> String {
        let rewrite_one = |url: &str| {
            let mut parsed = parse(url).unwrap_or_else(|error| panic!("{error}"));
            parsed.set_host(Some(&self.addr.ip().to_string())).unwrap_or_else(|e| panic!("{url}: {e}"));
            parsed.set_port(Some(self.addr.port())).unwrap_or_else(|()| panic!("{url}: cannot set a port"));
            parsed.to_string()
        };
        urls.split(',').map(rewrite_one).collect::<Vec<_>>().join(",")
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Close every connection and refuse service until [`Proxy::restore`].
    pub fn cut(&self) {
        self.mode.send_replace(Mode::Cut);
    }

    /// Stop forwarding, keeping connections open, until [`Proxy::restore`].
    pub fn stall(&self) {
        self.mode.send_replace(Mode::Stall);
    }

    /// Forward again.
    pub fn restore(&self) {
        self.mode.send_replace(Mode::Pass);
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// Client connections it holds open now. 0 after a [`Proxy::cut`] means every client's
    /// connection is closed: each of them will see its server gone, whenever traffic passes again.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn parse(url: &str) -> std::io::Result<url::Url> {
    url::Url::parse(url).map_err(|error| invalid(url, &error.to_string()))
}

fn invalid(url: &str, what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{url}: {what}"))
}

/// A TCP load balancer on an ephemeral local port, in front of several instances of a service:
/// each new connection goes to the next upstream in turn, and to the one after if that one
/// refuses it (an instance that is down), as a load balancer's passive health check does. A
/// connection already carried dies with its instance; the client retries, as it would behind a
/// real one. Dropping it closes everything it carries.
#[derive(Debug)]
pub struct Balancer {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Balancer {
    /// Listen on `127.0.0.1:0` and spread connections over `upstreams` (`host:port` each).
    pub async fn start(upstreams: Vec<String>) -> std::io::Result<Self> {
        assert!(!upstreams.is_empty(), "a balancer needs an upstream");
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let accept = tokio::spawn(async move {
            let upstreams = Arc::new(upstreams);
            let mut turn = 0_usize;
            // Balanced connections are never cut or stalled: their mode stays `Pass`.
            let (_pass, mode) = watch::channel(Mode::Pass);
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let first = turn;
                        turn = turn.wrapping_add(1);
                        let (upstreams, mode) = (Arc::clone(&upstreams), mode.clone());
                        connections.spawn(async move {
                            for i in 0..upstreams.len() {
                                let upstream = &upstreams[(first + i) % upstreams.len()];
                                if let Ok(server) = TcpStream::connect(upstream).await {
                                    pipe(client, server, mode).await;
                                    return;
                                }
                            }
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Ok(Self { addr, accept })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Accept until dropped; each connection's tasks live in the set, so aborting this task closes
/// them all.
async fn accept_loop(listener: TcpListener, upstream: String, mode: watch::Receiver<Mode>, open: Arc<AtomicUsize>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                if let Ok((client, _)) = accepted {
                    let open = Open::count(&open);
                    let (upstream, mode) = (upstream.clone(), mode.clone());
                    connections.spawn(async move {
                        carry(client, upstream, mode).await;
                        drop(open);
                    });
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// One client connection counted in [`Proxy::open_connections`] while it lives (the task that
/// carries it may also be aborted, with the proxy).
struct Open(Arc<AtomicUsize>);

impl Open {
    fn count(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(open))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Wait while stalled; `false` once the mode is (or becomes) `Cut`.
async fn passing(mode: &mut watch::Receiver<Mode>) -> bool {
    loop {
        match *mode.borrow_and_update() {
            Mode::Pass => return true,
            Mode::Cut => return false,
            Mode::Stall => {}
        }
        if mode.changed().await.is_err() {
            return false;
        }
    }
}

/// One client connection: connect upstream once traffic may pass, then pump both ways.
async fn carry(client: TcpStream, upstream: String, mut mode: watch::Receiver<Mode>) {
    if !passing(&mut mode).await {
        return;
    }
    let Ok(server) = TcpStream::connect(&upstream).await else { return };
    pipe(client, server, mode).await;
}

/// Pump both ways between a client and its server until either ends or the mode cuts them.
async fn pipe(client: TcpStream, server: TcpStream, mode: watch::Receiver<Mode>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(pump(client_read, server_write, mode.clone()), pump(server_read, client_write, mode));
}

/// Copy one direction until end of stream, an error, or a cut.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut mode: watch::Receiver<Mode>) {
    let mut buffer = vec![0; 16 * 1024];
    loop {
        if !passing(&mut mode).await {
            return;
        }
        tokio::select! {
            read = from.read(&mut buffer) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => {
                    if to.write_all(&buffer[..n]).await.is_err() {
                        return;
                    }
                }
            },
            // Re-check the mode (a read in progress is safe to drop).
            changed = mode.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Proxy;

    #[tokio::test]
    async fn rewrites_urls_to_go_through_it_keeping_user_path_and_query() {
        let (proxy, amqp) = Proxy::for_url("amqp://guest:guest@127.0.0.1:5672/t-1").await.expect("proxy");
        let port = proxy.addr().port();
        assert_eq!(amqp, format!("amqp://guest:guest@127.0.0.1:{port}/t-1"));
        assert_eq!(
            proxy.rewrite("postgres://postgres@localhost:5432/a,postgres://postgres@localhost:5432/b?x=1"),
            format!("postgres://postgres@127.0.0.1:{port}/a,postgres://postgres@127.0.0.1:{port}/b?x=1")
        );
    }
}
