//! A keep-alive HTTP/1.1 client for load: one connection, one request at a time, bodies framed by
//! `Content-Length` (which is what the API sends). The test kit's client opens a connection per
//! request, which would measure the kernel's connect path instead of the API.

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

/// One persistent connection.
pub struct Connection {
    stream: BufReader<TcpStream>,
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
        Ok(Self { stream: BufReader::new(stream), host: host.to_owned() })
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&mut self, path: &str, body: &str) -> std::io::Result<Response> {
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.host,
            body.len()
        );
        self.stream.get_mut().write_all(request.as_bytes()).await?;
        self.read_response().await
    }

    async fn read_response(&mut self) -> std::io::Result<Response> {
        let mut head = Vec::with_capacity(512);
        while !head.ends_with(b"\r\n\r\n") {
            let byte = self.stream.read_u8().await?;
            head.push(byte);
        }
        let head = String::from_utf8_lossy(&head);
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed response");
        let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let length = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse::<usize>().ok())?
            })
            .ok_or_else(bad)?;
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).await?;
        Ok(Response { status, body })
    }
}
