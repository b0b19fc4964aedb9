//! A keep-alive HTTP/1.1 connection for load (hyper's `client::conn::http1`): one connection, one
//! request at a time. The test kit's client opens a connection per request, which would measure
//! the kernel's connect path instead of the API.

use http_body_util::{BodyExt, Full};
use hyper::{body::Bytes, client::conn::http1::SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// One persistent connection.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    host: String,
}

/// A response: status and body.
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Connection {
    /// Connect to `host:port`.
    pub async fn open(host: &str) -> std::io::Result<Self> {
        let stream = TcpStream::connect(host).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
        // The connection's I/O runs beside the requests; it ends when the sender is dropped.
        tokio::spawn(connection);
        Ok(Self { sender, host: host.to_owned() })
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&mut self, path: &str, body: &str) -> std::io::Result<Response> {
        let request = hyper::Request::post(path)
            .header(hyper::header::HOST, &self.host)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .map_err(std::io::Error::other)?;
        self.sender.ready().await.map_err(std::io::Error::other)?;
        let response = self.sender.send_request(request).await.map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes().to_vec();
        Ok(Response { status, body })
    }
}
