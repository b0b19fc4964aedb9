//! The HTTP server every binary runs (the API, and the health and metrics endpoints of the
//! others), with a bound on every wait a client can impose on it:
//!
//! | setting | guards against |
//! |---|---|
//! | `HTTP_HEADER_TIMEOUT` | a client that opens a connection and sends its request headers slowly or not at all (slowloris), and a kept-alive connection that sends no next request: the time starts whenever the server waits for a request's headers |
//! | `HTTP_IDLE_TIMEOUT` | a connection on which nothing moves in either direction: a request body that stalls, a client that stops reading its response |
//! | `HTTP_REQUEST_TIMEOUT` | a request that takes too long to answer, waiting for a permit included: answered `503` |
//! | `HTTP_MAX_IN_FLIGHT` | more requests at once than the service can work on: the others wait for a permit (within their request timeout) |
//! | `HTTP_MAX_CONNECTIONS` | more open connections than file descriptors and memory allow: past it, new connections wait in the kernel's backlog |
//!
//! Shutdown stops accepting, lets each connection finish its request in flight, and closes it.

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{Router, http::StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpListener,
    sync::Semaphore,
};

use crate::runtime::{duration::parse_duration, shutdown::Shutdown};

/// Where a binary listens and how long its HTTP server waits for a client.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// How long a client may take to send a request's headers, counted from when the server
    /// starts waiting for them (on a kept-alive connection, from the end of the last response).
    #[arg(long, env = "HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub header_timeout: Duration,
    /// How long a request may take to be answered, waiting for a permit included; past it the
    /// client gets 503.
    #[arg(long, env = "HTTP_REQUEST_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// How long a connection may carry no byte in either direction before it is closed (a stalled
    /// request body, a client that does not read its response).
    #[arg(long, env = "HTTP_IDLE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// Requests handled at once; more wait for a permit.
    #[arg(long, env = "HTTP_MAX_IN_FLIGHT", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_in_flight: u32,
    /// Open connections at most; more wait in the kernel's backlog until one closes.
    #[arg(long, env = "HTTP_MAX_CONNECTIONS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
}

impl Default for HttpArgs {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_in_flight: 512,
            max_connections: 4096,
        }
    }
}

/// The default listening address: loopback, so that nothing is reachable from elsewhere unless a
/// deployment says so (`HTTP_ADDR=0.0.0.0:8080`, as `compose.yaml` does).
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Serve `router` on `listener` with `limits` until shutdown, then finish the requests in flight
/// and close every connection. Each request to the service's own routes (not `/healthz`,
/// `/readyz`, `/metrics`) answered 503 for its request timeout is counted in `timeouts`
/// (`http_request_timeouts_total`): the routes' own counts never see it, since their work is
/// dropped unanswered.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: &HttpArgs,
    shutdown: Shutdown,
    timeouts: Counter,
) -> std::io::Result<()> {
    use tower::ServiceBuilder;
    let request_timeout = limits.request_timeout;
    let timed = move |request: axum::extract::Request, next: axum::middleware::Next| {
        let timeouts = timeouts.clone();
        let health = crate::runtime::health::is_health_route(request.uri().path());
        async move {
            match tokio::time::timeout(request_timeout, next.run(request)).await {
                Ok(response) => response,
                Err(_) => {
                    if !health {
                        timeouts.inc();
                    }
                    axum::response::IntoResponse::into_response(StatusCode::SERVICE_UNAVAILABLE)
                }
            }
        }
    };
    let router = router.layer(
        ServiceBuilder::new()
            .layer(axum::middleware::from_fn(timed))
            .layer(tower::limit::GlobalConcurrencyLimitLayer::new(limits.max_in_flight as usize)),
    );
    let connections = Arc::new(Semaphore::new(limits.max_connections as usize));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&connections).acquire_owned() => permit.expect("never closed"),
            () = shutdown.triggered() => break,
        };
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of descriptors or a connection reset before it was accepted: keep serving.
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.triggered() => break,
        };
        let _ = stream.set_nodelay(true);
        let activity = Activity::new();
        let io = TokioIo::new(Watched { inner: stream, activity: Arc::clone(&activity) });
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http.serve_connection(io, service));
        let idle = limits.idle_timeout;
        tokio::spawn(async move {
            tokio::select! {
                _ = connection => {}
                () = activity.idle_for(idle) => {}
            }
            drop(permit);
        });
    }
    drop(listener);
    // Connections with a request in flight finish it; idle ones close at once.
    let _ = tokio::time::timeout(limits.request_timeout, graceful.shutdown()).await;
    Ok(())
}

/// When a connection last moved a byte, in milliseconds since it was accepted.
struct Activity {
    started: Instant,
    last: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self { started: Instant::now(), last: AtomicU64::new(0) })
    }

    fn touch(&self) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(now, Ordering::Relaxed);
    }

    /// Resolves once nothing has moved for `limit`.
    async fn idle_for(&self, limit: Duration) {
        loop {
            let last = self.started + Duration::from_millis(self.last.load(Ordering::Relaxed));
            let deadline = last + limit;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline.into()).await;
        }
    }
}

/// A connection that records its activity.
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The span of each request to a service's own routes, layered by [`trace_requests`]: named by its
/// route's template (`MatchedPath`, e.g. `/shipments/{order_id}`) rather than its path, so that
/// logs group by route and no id becomes a span name. At DEBUG, as tower-http's default span: it
/// carries no trace ids, so it is logged with `RUST_LOG=debug` and never exported (the API's
/// traced requests make spans of their own, `runtime::otel`).
pub fn request_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    let route = request.extensions().get::<axum::extract::MatchedPath>().map_or("(no route)", |path| path.as_str());
    tracing::debug_span!("request", http.request.method = %request.method(), http.route = route, uri = %request.uri())
}

/// tower-http's `TraceLayer` as every service's routes take it ([`trace_requests`]).
pub type TraceRequests = tower_http::trace::TraceLayer<
    tower_http::classify::SharedClassifier<tower_http::classify::ServerErrorsAsFailures>,
    fn(&axum::http::Request<axum::body::Body>) -> tracing::Span,
    tower_http::trace::DefaultOnRequest,
    tower_http::trace::DefaultOnResponse,
    tower_http::trace::DefaultOnBodyChunk,
    tower_http::trace::DefaultOnEos,
    (),
>;

/// A span for each request to a service's own routes ([`request_span`]), layered on them with
/// `Router::layer`. It logs no failure itself: a route logs its failure once, where it knows the
/// cause (`runtime::problem::Problem::from_database`, the API's `log_failures`).
pub fn trace_requests() -> TraceRequests {
    tower_http::trace::TraceLayer::new_for_http()
        .make_span_with(request_span as fn(&axum::http::Request<axum::body::Body>) -> tracing::Span)
        .on_failure(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Serve `router` with `limits` on a free port.
    async fn start(router: Router, limits: HttpArgs) -> (SocketAddr, crate::runtime::shutdown::ShutdownTrigger) {
        let (addr, trigger, _) = start_counting(router, limits).await;
        (addr, trigger)
    }

    /// [`start`], and the count of requests answered 503 for their timeout.
    async fn start_counting(
        router: Router,
        limits: HttpArgs,
    ) -> (SocketAddr, crate::runtime::shutdown::ShutdownTrigger, Counter) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (trigger, shutdown) = crate::runtime::shutdown::channel();
        let timeouts = Counter::default();
        let counted = timeouts.clone();
        tokio::spawn(async move { serve(listener, router, &limits, shutdown, counted).await });
        (addr, trigger, timeouts)
    }

    /// Read until the server closes the connection (within 10 s); what it sent.
    async fn until_closed(stream: &mut tokio::net::TcpStream) -> String {
        let mut received = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut received))
            .await
            .expect("the server closes the connection")
            .expect("read");
        String::from_utf8_lossy(&received).into_owned()
    }

    #[tokio::test]
    async fn a_client_that_does_not_finish_its_headers_is_cut_off() {
        let limits = HttpArgs { header_timeout: Duration::from_millis(300), ..HttpArgs::default() };
        let (addr, _trigger) = start(Router::new().route("/", get(|| async { "ok" })), limits).await;
        let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.expect("write");
        let started = Instant::now();
        let answer = until_closed(&mut slow).await;
        assert!(started.elapsed() >= Duration::from_millis(300), "not before the timeout");
        assert!(!answer.contains("200 OK"), "no answer to a request it never finished: {answer}");
        // The server still answers others.
        let mut quick = tokio::net::TcpStream::connect(addr).await.expect("connect");
        quick.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
        assert!(until_closed(&mut quick).await.starts_with("HTTP/1.1 200 OK"));
    }

    /// Answered 503 and counted, whether the route was too slow or the request waited for a
    /// permit (`HTTP_MAX_IN_FLIGHT`) past its timeout.
    #[tokio::test]
    async fn a_request_that_takes_too_long_is_answered_503_and_counted() {
        let limits = HttpArgs { request_timeout: Duration::from_millis(200), max_in_flight: 1, ..HttpArgs::default() };
        let slow = || async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            "late"
        };
        let (addr, _trigger, timeouts) = start_counting(Router::new().route("/", get(slow)), limits).await;
        let ask = || async move {
            let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
            client.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
            until_closed(&mut client).await
        };
        let (first, second) = tokio::join!(ask(), ask());
        assert!(first.starts_with("HTTP/1.1 503"), "{first}");
        assert!(second.starts_with("HTTP/1.1 503"), "{second}");
        assert_eq!(timeouts.get(), 2);
    }

    #[tokio::test]
    async fn a_stalled_request_body_is_cut_off_by_the_idle_timeout() {
        let limits = HttpArgs { idle_timeout: Duration::from_millis(300), ..HttpArgs::default() };
        let (addr, _trigger) = start(Router::new().route("/", post(|body: String| async move { body })), limits).await;
        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        client.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nten bytes.").await.expect("write");
        let answer = until_closed(&mut client).await;
        assert!(!answer.contains("ten bytes."), "the handler never got the whole body: {answer}");
    }

    #[tokio::test]
    async fn requests_beyond_the_in_flight_limit_wait_for_a_permit() {
        let limits = HttpArgs { max_in_flight: 2, ..HttpArgs::default() };
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (n, m) = (Arc::clone(&now), Arc::clone(&most));
        let handler = move || {
            let (now, most) = (Arc::clone(&n), Arc::clone(&m));
            async move {
                let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(running, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                "ok"
            }
        };
        let (addr, _trigger) = start(Router::new().route("/", get(handler)), limits).await;
        let mut clients = tokio::task::JoinSet::new();
        for _ in 0..8 {
            clients.spawn(async move {
                let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
                client.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
                until_closed(&mut client).await
            });
        }
        while let Some(answer) = clients.join_next().await {
            assert!(answer.expect("joined").starts_with("HTTP/1.1 200 OK"), "every request is answered");
        }
        assert_eq!(most.load(Ordering::SeqCst), 2, "never more than the limit at once");
    }
}
