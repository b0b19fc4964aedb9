//! A small HTTP/1.1 client (hyper's), plain `http://` only: what `msgctl` needs of the RabbitMQ
//! management API, what the span exporter ([`crate::otel`]) sends to a collector, and what the
//! tests drive the services with. One connection per request: a pooled connection cannot outlive
//! the runtime that opened it (every `#[tokio::test]` runs its own), and none of these callers is
//! hot enough for a pool to matter.

use std::time::Duration;

use base64::Engine;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

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

/// [`request`] with a raw byte body.
pub async fn request_bytes(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<Response> {
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {url}"));
    let mut target = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    let credentials = (!target.username().is_empty())
        .then(|| format!("{}:{}", target.username(), target.password().unwrap_or_default()));
    let _ = target.set_username("");
    let _ = target.set_password(None);

    let mut builder = hyper::Request::builder().method(method).uri(target.as_str());
    if let Some(credentials) = credentials {
        let encoded = base64::engine::general_purpose::STANDARD.encode(credentials);
        builder = builder.header(hyper::header::AUTHORIZATION, format!("Basic {encoded}"));
    }
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    if body.is_some() && !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("content-type")) {
        builder = builder.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let body = Full::new(Bytes::copy_from_slice(body.unwrap_or_default()));
    let request = builder.body(body).map_err(|e| invalid(e.to_string()))?;

    let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build_http();
    let exchange = async {
        let response = client.request(request).await.map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str().to_owned(), String::from_utf8_lossy(value.as_bytes()).into_owned()))
            .collect();
        let body = response.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes().to_vec();
        Ok::<_, std::io::Error>(Response { status, headers, body })
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer from {url}")))?
}

/// The RabbitMQ management API of the broker at `amqp_url` (`amqp://user:pass@host:port/vhost`),
/// as `http://user:pass@host:15672`: the broker's host and user, the plugin's default port.
/// `None` if `amqp_url` is not a URL.
pub fn management_url_of(amqp_url: &str) -> Option<String> {
    let amqp = url::Url::parse(amqp_url).ok()?;
    let (user, password) = match amqp.username() {
        "" => ("guest", "guest"),
        user => (user, amqp.password().unwrap_or_default()),
    };
    let mut management = url::Url::parse(&format!("http://{}:15672", amqp.host_str()?)).ok()?;
    management.set_username(user).ok()?;
    management.set_password(Some(password)).ok()?;
    Some(management.as_str().trim_end_matches('/').to_owned())
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
    }
}
