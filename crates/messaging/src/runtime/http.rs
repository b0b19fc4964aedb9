//! A small HTTP/1.1 client (hyper's), `http://` and `https://` (rustls, [`crate::runtime::tls`]): what
//! `msgctl` and the live page need of the RabbitMQ management API, what the span exporter
//! (`otel`) sends to a collector, and what the tests drive the services with. An
//! `https://` URL may name a CA file and a client certificate in its query (`cacertfile`,
//! `certfile`, `keyfile`, removed before the request is sent). [`request`] opens a connection per
//! request: a pooled connection cannot outlive the runtime that opened it (every `#[tokio::test]`
//! runs its own), and none of these callers is hot enough for a pool to matter. The bench's load
//! keeps its connections alive with [`Connection`].

use std::time::Duration;

use base64::Engine;
use http_body_util::{BodyExt, Full};
use hyper::{body::Bytes, client::conn::http1::SendRequest};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use std::sync::Arc;
use tokio::net::TcpStream;

use crate::runtime::tls::TlsFiles;

/// A response.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl Response {
    /// The first header named `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Send `method url` with extra `headers` and an optional body; `http://user:pass@host:port/path`
/// URLs send basic auth. A body is sent as `application/json` unless a content type is given.
pub async fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<Response> {
    request_bytes(method, url, headers, body.map(str::as_bytes)).await
}

/// [`request`] with a raw byte body, on a connection of its own, within 30 seconds.
pub(crate) async fn request_bytes(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<Response> {
    // Errors name the URL with its password masked.
    let shown = crate::runtime::config::SecretUrl::new(url);
    let exchange = async {
        let (mut connection, path) = Connection::open_for(url).await?;
        connection.send(method, &path, headers, body).await
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer from {shown}")))?
}

/// One kept-alive HTTP/1.1 connection, for requests one after another to the same server (as a
/// load generator sends them: one connection per request would measure the kernel's connect path
/// instead of the server). Basic auth from the URL it was opened with goes with every request.
///
/// ```no_run
/// # async fn post() -> std::io::Result<()> {
/// let mut api = messaging::runtime::http::Connection::open("http://127.0.0.1:8080").await?;
/// for _ in 0..3 {
///     let response = api.send("POST", "/orders", &[], Some(br#"{"customer_id":"c-1","lines":[]}"#)).await?;
///     assert_eq!(response.status, 400);
/// }
/// # Ok(()) }
/// ```
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    /// The `host` header.
    host: String,
    /// The `authorization` header, from the URL's user info.
    authorization: Option<String>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("host", &self.host).finish_non_exhaustive()
    }
}

impl Connection {
    /// Connect to the server `url` names (its path, if any, is ignored), through TLS for
    /// `https://`.
    pub async fn open(url: &str) -> std::io::Result<Self> {
        Ok(Self::open_for(url).await?.0)
    }

    /// [`Self::open`], and `url`'s path and query, to send to.
    async fn open_for(url: &str) -> std::io::Result<(Self, String)> {
        let shown = crate::runtime::config::SecretUrl::new(url);
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {shown}"));
        let parsed = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        let files = TlsFiles::of_url(&parsed);
        let mut target = TlsFiles::strip(&parsed);
        let authorization = (!target.username().is_empty()).then(|| {
            let credentials = format!("{}:{}", target.username(), target.password().unwrap_or_default());
            format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(credentials))
        });
        let _ = target.set_username("");
        let _ = target.set_password(None);
        let host = match target.port() {
            Some(port) => format!("{}:{port}", target.host_str().unwrap_or_default()),
            None => target.host_str().unwrap_or_default().to_owned(),
        };
        let path = match target.query() {
            Some(query) => format!("{}?{query}", target.path()),
            None => target.path().to_owned(),
        };
        let sender = open(&target, &files).await?;
        Ok((Self { sender, host, authorization }, path))
    }

    /// Send `method path` (with its query) with extra `headers` and an optional body (sent as
    /// `application/json` unless a content type is given), and read the whole response.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> std::io::Result<Response> {
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        let mut builder = hyper::Request::builder().method(method).uri(path).header(hyper::header::HOST, &self.host);
        if let Some(authorization) = &self.authorization {
            builder = builder.header(hyper::header::AUTHORIZATION, authorization);
        }
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        if body.is_some() && !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("content-type")) {
            builder = builder.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let body = Full::new(Bytes::copy_from_slice(body.unwrap_or_default()));
        let request = builder.body(body).map_err(|e| invalid(format!("{e}: {method} {path}")))?;
        self.sender.ready().await.map_err(std::io::Error::other)?;
        let response = self.sender.send_request(request).await.map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str().to_owned(), String::from_utf8_lossy(value.as_bytes()).into_owned()))
            .collect();
        let body = response.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes().to_vec();
        Ok(Response { status, headers, body })
    }
}

/// One HTTP/1.1 connection to `target`'s host, through TLS for `https://`.
async fn open(target: &url::Url, files: &TlsFiles) -> std::io::Result<SendRequest<Full<Bytes>>> {
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {target}"));
    let host = target.host_str().ok_or_else(|| invalid("no host"))?.to_owned();
    let port = target.port_or_known_default().ok_or_else(|| invalid("no port"))?;
    let tcp = TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port)).await?;
    tcp.set_nodelay(true)?;
    match target.scheme() {
        "http" => handshake(tcp).await,
        "https" => {
            let connector = tokio_rustls::TlsConnector::from(Arc::new(files.client_config()?));
            let name = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']').to_owned())
                .map_err(|_| invalid("not a server name"))?;
            handshake(connector.connect(name, tcp).await?).await
        }
        _ => Err(invalid("only http:// and https:// are supported")),
    }
}

/// The connection's I/O runs beside the requests; it ends when the sender is dropped.
async fn handshake<T>(stream: T) -> std::io::Result<SendRequest<Full<Bytes>>>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
    tokio::spawn(connection);
    Ok(sender)
}

/// `base` (a server's URL, which may carry a query such as `?cacertfile=...`) with `path` (which
/// may carry its own query) as its path: `join("https://mq:15671?cacertfile=/ca.pem",
/// "/api/overview")` is `https://mq:15671/api/overview?cacertfile=/ca.pem`. `base` as it is if it
/// is not a URL.
pub fn join(base: &str, path: &str) -> String {
    let Ok(mut url) = url::Url::parse(base) else { return format!("{base}{path}") };
    let (path, query) = match path.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path, None),
    };
    url.set_path(path);
    if let Some(query) = query {
        let joined = match url.query() {
            Some(existing) if !existing.is_empty() => format!("{existing}&{query}"),
            _ => query.to_owned(),
        };
        url.set_query(Some(&joined));
    }
    url.to_string()
}

/// The RabbitMQ management API of the broker at `amqp_url` (`amqp://user:pass@host:port/vhost`),
/// as `http://user:pass@host:15672`: the broker's host and user, the plugin's default port. For
/// `amqps://` it is `https://user:pass@host:15671`, with the broker URL's TLS files
/// (`cacertfile`, `certfile`, `keyfile`). `None` if `amqp_url` is not a URL.
pub fn management_url_of(amqp_url: &str) -> Option<String> {
    let amqp = url::Url::parse(amqp_url).ok()?;
    let (user, password) = match amqp.username() {
        "" => ("guest", "guest"),
        user => (user, amqp.password().unwrap_or_default()),
    };
    let origin = match amqp.scheme() {
        "amqps" => format!("https://{}:15671", amqp.host_str()?),
        _ => format!("http://{}:15672", amqp.host_str()?),
    };
    let mut management = url::Url::parse(&origin).ok()?;
    management.set_username(user).ok()?;
    management.set_password(Some(password)).ok()?;
    let files: Vec<(String, String)> = amqp
        .query_pairs()
        .filter(|(key, _)| crate::runtime::tls::QUERY_KEYS.contains(&key.as_ref()))
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    if files.is_empty() {
        return Some(management.as_str().trim_end_matches('/').to_owned());
    }
    management.query_pairs_mut().extend_pairs(files);
    Some(management.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_management_api_is_on_the_broker_s_host_as_its_user() {
        assert_eq!(
            management_url_of("amqp://app:s3cret@rabbit.internal:5672/shop").as_deref(),
            Some("http://app:s3cret@rabbit.internal:15672")
        );
        assert_eq!(management_url_of("amqp://127.0.0.1").as_deref(), Some("http://guest:guest@127.0.0.1:15672"));
        assert_eq!(management_url_of("not a url"), None);
        assert_eq!(
            management_url_of("amqps://app:pw@mq.internal:5671/shop?cacertfile=/run/ca.pem&heartbeat=10").as_deref(),
            Some("https://app:pw@mq.internal:15671/?cacertfile=%2Frun%2Fca.pem")
        );
    }

    #[test]
    fn a_path_joins_a_server_url_before_its_query() {
        assert_eq!(
            join("https://mq:15671/?cacertfile=%2Fca.pem", "/api/queues/shop?columns=name"),
            "https://mq:15671/api/queues/shop?cacertfile=%2Fca.pem&columns=name"
        );
        assert_eq!(join("http://guest:guest@mq:15672", "/api/overview"), "http://guest:guest@mq:15672/api/overview");
    }
}
