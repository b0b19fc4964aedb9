//! The OTLP exporter's HTTP client: the one every outgoing HTTP call of this workspace goes
//! through ([`crate::runtime::http`]: rustls on ring, the system's roots plus the CA and client
//! certificate files an `https://` endpoint names), rather than a second client and TLS stack.

use std::time::Duration;

use async_trait::async_trait;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};

/// Sends the exporter's requests on a runtime of its own: the SDK's batch processor exports from
/// its own thread, outside the service's runtime, and waits for each export to finish.
#[derive(Debug)]
pub(super) struct Client {
    runtime: tokio::runtime::Runtime,
    timeout: Duration,
}

impl Client {
    /// A client whose every request ends within `timeout`.
    pub(super) fn new(timeout: Duration) -> std::io::Result<Self> {
        Ok(Self { runtime: tokio::runtime::Builder::new_current_thread().enable_all().build()?, timeout })
    }
}

#[async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let url = parts.uri.to_string();
        let headers: Vec<(&str, &str)> =
            parts.headers.iter().filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?))).collect();
        let sent = crate::runtime::http::request_bytes(parts.method.as_str(), &url, &headers, Some(&body));
        // Blocks the processor's thread, which waits for the export anyway; never a service's.
        let answer =
            self.runtime.block_on(async { tokio::time::timeout(self.timeout, sent).await }).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer within {:?}", self.timeout))
            })??;
        let mut response = Response::builder().status(answer.status);
        for (name, value) in &answer.headers {
            response = response.header(name, value);
        }
        Ok(response.body(Bytes::from(answer.body))?)
    }
}
