//! A TCP fault proxy: services connect to Postgres or RabbitMQ through it, and a test cuts, stalls
//! and restores their connections on command.
//!
//! - [`Proxy::cut`] closes every open connection and closes new ones at once, as a server that
//!   went away would;
//! - [`Proxy::stall`] keeps connections open but forwards nothing, as a network black hole would
//!   (new connections are accepted and then hang);
//! - [`Proxy::restore`] forwards again; stalled connections resume where they were;
//! - [`Proxy::swallow_deliveries`] (plain AMQP only) drops the next deliveries the broker sends,
//!   so that the broker counts each as handed to its consumer, unacked, and the consumer never
//!   sees it: what a quorum queue can leave at a leader change (rabbitmq-server#15473).
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
    /// For a plain AMQP server: the deliveries to drop on their way to a client.
    swallow: Option<Arc<Swallow>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listen on `127.0.0.1:0` and forward to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<Self> {
        Self::carrying(upstream, None).await
    }

    async fn carrying(upstream: &str, swallow: Option<Arc<Swallow>>) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, watcher) = watch::channel(Mode::Pass);
        let open = Arc::new(AtomicUsize::new(0));
        let carried = Carried { upstream: upstream.to_owned(), mode: watcher, swallow: swallow.clone() };
        let accept = tokio::spawn(accept_loop(listener, carried, Arc::clone(&open)));
        Ok(Self { addr, mode, open, swallow, accept })
    }

    /// A proxy for the server a `scheme://[user[:pass]@]host:port/...` URL names, and that URL
    /// rewritten to go through it. For `amqp://`, it reads the broker's frames, so that it can
    /// [swallow deliveries](Self::swallow_deliveries).
    pub async fn for_url(url: &str) -> std::io::Result<(Self, String)> {
        let parsed = parse(url)?;
        let host = parsed.host_str().unwrap_or("localhost");
        let port = parsed.port_or_known_default().ok_or_else(|| invalid(url, "no port"))?;
        let swallow = (parsed.scheme() == "amqp").then(Arc::default);
        let proxy = Self::carrying(&format!("{host}:{port}"), swallow).await?;
        let rewritten = proxy.rewrite(url);
        Ok((proxy, rewritten))
    }

    /// Drop the next `deliveries` the broker sends to any client through this proxy (each
    /// `basic.deliver` with its content): the broker counts each as delivered and unacked on its
    /// channel, and the client never sees it. Only for a plain `amqp://` proxy. Unlike a delivery
    /// the broker itself lost, it leaves a gap in the channel's delivery tags, which a client's
    /// later `basic.ack(multiple)` would ack with the rest.
    pub fn swallow_deliveries(&self, deliveries: usize) {
        let swallow = self.swallow.as_ref().expect("swallowing deliveries needs a plain amqp:// proxy");
        swallow.armed.fetch_add(deliveries, Ordering::SeqCst);
    }

    /// Deliveries swallowed so far.
    pub fn swallowed(&self) -> usize {
        self.swallow.as_ref().map_or(0, |swallow| swallow.swallowed.load(Ordering::SeqCst))
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
                                    pipe(client, server, mode, None).await;
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

/// Where a proxy's connections go, and what it does with them.
#[derive(Clone)]
struct Carried {
    upstream: String,
    mode: watch::Receiver<Mode>,
    swallow: Option<Arc<Swallow>>,
}

/// Deliveries to drop, and dropped.
#[derive(Debug, Default)]
struct Swallow {
    armed: AtomicUsize,
    swallowed: AtomicUsize,
}

/// Accept until dropped; each connection's tasks live in the set, so aborting this task closes
/// them all.
async fn accept_loop(listener: TcpListener, carried: Carried, open: Arc<AtomicUsize>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                if let Ok((client, _)) = accepted {
                    let open = Open::count(&open);
                    let carried = carried.clone();
                    connections.spawn(async move {
                        carry(client, carried).await;
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
async fn carry(client: TcpStream, carried: Carried) {
    let Carried { upstream, mut mode, swallow } = carried;
    if !passing(&mut mode).await {
        return;
    }
    let Ok(server) = TcpStream::connect(&upstream).await else { return };
    pipe(client, server, mode, swallow.map(Frames::new)).await;
}

/// Pump both ways between a client and its server until either ends or the mode cuts them; what
/// the server sends, through `frames` if given.
async fn pipe(client: TcpStream, server: TcpStream, mode: watch::Receiver<Mode>, frames: Option<Frames>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(pump(client_read, server_write, mode.clone(), None), pump(server_read, client_write, mode, frames));
}

/// Copy one direction until end of stream, an error, or a cut; through `frames`, if given.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    mut frames: Option<Frames>,
) {
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
                    let written = match frames.as_mut() {
                        Some(frames) => to.write_all(&frames.pass(&buffer[..n])).await,
                        None => to.write_all(&buffer[..n]).await,
                    };
                    if written.is_err() {
                        return;
                    }
                }
            },
            // Re-check the mode (a read in progress is safe to drop).
            changed = mode.changed() => if changed.is_err() { return },
        }
    }
}

/// What a broker sends a client, read frame by frame (AMQP 0-9-1: type, channel, size, payload,
/// end octet), less the deliveries it is told to swallow.
struct Frames {
    swallow: Arc<Swallow>,
    /// The start of a frame not yet whole.
    partial: Vec<u8>,
    /// The channel whose swallowed delivery's content frames are still to come.
    dropping: Option<u16>,
}

impl Frames {
    const METHOD: u8 = 1;
    const HEADER: u8 = 2;
    const BODY: u8 = 3;
    /// `basic.deliver`: class 60, method 60.
    const DELIVER: [u8; 4] = [0, 60, 0, 60];

    fn new(swallow: Arc<Swallow>) -> Self {
        Self { swallow, partial: Vec::new(), dropping: None }
    }

    /// The whole frames that `bytes` completes, less what is swallowed.
    fn pass(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut partial = std::mem::take(&mut self.partial);
        partial.extend_from_slice(bytes);
        let mut out = Vec::with_capacity(partial.len());
        let mut start = 0;
        while let Some(header) = partial.get(start..start + 7) {
            let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]);
            let Some(frame) = partial.get(start..start + 7 + size as usize + 1) else { break };
            debug_assert_eq!(frame.last(), Some(&0xCE), "the proxy lost its place in the broker's frames");
            if !self.swallows(frame) {
                out.extend_from_slice(frame);
            }
            start += frame.len();
        }
        partial.drain(..start);
        self.partial = partial;
        out
    }

    /// Whether to drop `frame`: a delivery while armed, and its content frames.
    fn swallows(&mut self, frame: &[u8]) -> bool {
        let (kind, channel) = (frame[0], u16::from_be_bytes([frame[1], frame[2]]));
        if self.dropping == Some(channel) {
            if matches!(kind, Self::HEADER | Self::BODY) {
                return true;
            }
            self.dropping = None;
        }
        if kind != Self::METHOD || frame.get(7..11) != Some(&Self::DELIVER[..]) {
            return false;
        }
        let armed = &self.swallow.armed;
        if armed.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_err() {
            return false;
        }
        self.swallow.swallowed.fetch_add(1, Ordering::SeqCst);
        self.dropping = Some(channel);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{Frames, Proxy, Swallow};

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

    /// A frame of `kind` on `channel` with `payload`.
    fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
        let size = u32::try_from(payload.len()).expect("a small payload").to_be_bytes();
        [&[kind][..], &channel.to_be_bytes(), &size, payload, &[0xCE]].concat()
    }

    #[test]
    fn swallows_one_delivery_with_its_content_and_passes_every_other_frame_whole() {
        let swallow = std::sync::Arc::new(Swallow::default());
        let mut frames = Frames::new(std::sync::Arc::clone(&swallow));
        let deliver = |channel| frame(1, channel, &[0, 60, 0, 60, 9, 9]);
        let (header, body, ack) = (frame(2, 1, &[0, 60, 0, 0]), frame(3, 1, b"order"), frame(1, 1, &[0, 60, 0, 80]));
        let heartbeat = frame(8, 0, &[]);
        let first = [deliver(1), header.clone(), heartbeat.clone(), body.clone()].concat();
        assert_eq!(frames.pass(&first), first, "nothing is swallowed unless armed");

        swallow.armed.store(1, std::sync::atomic::Ordering::SeqCst);
        let stream = [deliver(1), header.clone(), heartbeat.clone(), body.clone(), ack.clone(), deliver(2)].concat();
        // Fed in two pieces that split a frame: only whole frames come out.
        let (head, tail) = stream.split_at(5);
        let passed = [frames.pass(head), frames.pass(tail)].concat();
        assert_eq!(passed, [heartbeat, ack, deliver(2)].concat());
        assert_eq!(swallow.swallowed.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
