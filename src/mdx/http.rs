//! A small blocking HTTP/1.1 client for etcd's JSON gateway: one request per connection (`Connection:
//! close`), bodies by `Content-Length`, chunked encoding, or end of stream; and an incremental reader for
//! streamed (watch) responses. The response-head parser and the chunk decoder are pure and bounded.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest response head accepted.
const MAX_HEAD: usize = 64 << 10;
/// Largest response body (or chunk) accepted; etcd itself refuses values over 1.5 MiB by default.
pub const MAX_BODY: usize = 64 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// `http://host:port`, `host:port` or `host` (port 2379). HTTPS is not supported.
    pub fn parse(s: &str) -> Result<Endpoint, String> {
        let s = s.trim();
        if s.starts_with("https://") {
            return Err(format!("{s}: TLS endpoints are not supported by gixl's etcd client"));
        }
        let rest = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
        if rest.is_empty() || rest.contains('/') {
            return Err(format!("'{s}' is not an etcd endpoint (expected http://host:port)"));
        }
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(':') && !h.is_empty() => (
                h.trim_start_matches('[').trim_end_matches(']').to_owned(),
                p.parse().map_err(|_| format!("bad port in '{s}'"))?,
            ),
            _ => (rest.to_owned(), 2379),
        };
        Ok(Endpoint { host, port })
    }

    fn addrs(&self) -> io::Result<Vec<SocketAddr>> {
        Ok((self.host.as_str(), self.port).to_socket_addrs()?.collect())
    }

    fn connect(&self, timeout: Duration) -> io::Result<TcpStream> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{} resolves to no address", self.host));
        for a in self.addrs()? {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}:{}", self.host, self.port)
    }
}

fn request_bytes(ep: &Endpoint, path: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        ep.host,
        ep.port,
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// POST `body` to `path` and return (status, body). `timeout` bounds the whole exchange.
pub fn post(ep: &Endpoint, path: &str, body: &[u8], timeout: Duration) -> io::Result<(u16, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let mut s = ep.connect(timeout)?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(&request_bytes(ep, path, body))?;
    let mut reader = Reader::new(s);
    let head = reader.head(deadline)?;
    let mut out = Vec::new();
    while let Some(chunk) = reader.body_chunk(&head, deadline)? {
        out.extend_from_slice(&chunk);
        if out.len() > MAX_BODY {
            return Err(bad("HTTP response body too large"));
        }
    }
    Ok((head.status, out))
}

/// Open a streamed POST (etcd's watch): returns the reader after a 200 head.
pub fn open_stream(ep: &Endpoint, path: &str, body: &[u8], timeout: Duration) -> io::Result<(Reader, Head)> {
    let deadline = Instant::now() + timeout;
    let mut s = ep.connect(timeout)?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(&request_bytes(ep, path, body))?;
    let mut reader = Reader::new(s);
    let head = reader.head(deadline)?;
    if head.status != 200 {
        return Err(bad(&format!("HTTP status {}", head.status)));
    }
    Ok((reader, head))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub status: u16,
    pub chunked: bool,
    pub length: Option<usize>,
}

/// Parse a response head from the front of `buf`: `Ok(None)` until the blank line has arrived.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, &'static str> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD { Err("HTTP response head too large") } else { Ok(None) };
    };
    if end > MAX_HEAD {
        return Err("HTTP response head too large");
    }
    let text = std::str::from_utf8(&buf[..end]).map_err(|_| "HTTP head is not text")?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err("not an HTTP/1.x response");
    }
    let status: u16 = parts.next().and_then(|s| s.parse().ok()).ok_or("bad HTTP status")?;
    let mut head = Head { status, chunked: false, length: None };
    for l in lines {
        let Some((k, v)) = l.split_once(':') else { return Err("bad HTTP header line") };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked") {
            head.chunked = true;
        } else if k.eq_ignore_ascii_case("content-length") {
            let n: usize = v.parse().map_err(|_| "bad Content-Length")?;
            if n > MAX_BODY {
                return Err("HTTP body too large");
            }
            head.length = Some(n);
        }
    }
    Ok(Some((head, end + 4)))
}

/// Incremental decoder of a chunked body. `feed` consumes what it can and appends decoded bytes.
#[derive(Debug, Default)]
pub struct Chunked {
    /// Bytes left in the current chunk's data, then 2 for its CRLF; None while reading a size line.
    left: Option<(usize, bool)>,
    pub done: bool,
}

impl Chunked {
    /// Returns how many bytes of `input` were consumed.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, &'static str> {
        let mut at = 0;
        while at < input.len() && !self.done {
            match self.left {
                None => {
                    let rest = &input[at..];
                    let Some(nl) = rest.windows(2).position(|w| w == b"\r\n") else {
                        if rest.len() > 1024 {
                            return Err("chunk size line too long");
                        }
                        return Ok(at);
                    };
                    let line = std::str::from_utf8(&rest[..nl]).map_err(|_| "bad chunk size")?;
                    let hex = line.split(';').next().unwrap_or_default().trim();
                    if hex.is_empty() || hex.len() > 8 {
                        return Err("bad chunk size");
                    }
                    let n = usize::from_str_radix(hex, 16).map_err(|_| "bad chunk size")?;
                    if n > MAX_BODY {
                        return Err("chunk too large");
                    }
                    at += nl + 2;
                    if n == 0 {
                        // Trailers are not used by etcd; stop at the last chunk.
                        self.done = true;
                    } else {
                        self.left = Some((n, false));
                    }
                }
                Some((0, false)) => self.left = Some((2, true)),
                Some((n, false)) => {
                    let take = n.min(input.len() - at);
                    out.extend_from_slice(&input[at..at + take]);
                    at += take;
                    self.left = Some((n - take, false));
                }
                Some((n, true)) => {
                    let take = n.min(input.len() - at);
                    let want = &b"\r\n"[2 - n..2 - n + take];
                    if &input[at..at + take] != want {
                        return Err("chunk not followed by CRLF");
                    }
                    at += take;
                    self.left = if n - take == 0 { None } else { Some((n - take, true)) };
                }
            }
        }
        Ok(at)
    }
}

/// A response being read from a socket: raw bytes buffered, the head parsed once.
pub struct Reader {
    pub stream: TcpStream,
    buf: Vec<u8>,
    chunked: Chunked,
    body_read: usize,
}

impl Reader {
    fn new(stream: TcpStream) -> Reader {
        Reader { stream, buf: Vec::new(), chunked: Chunked::default(), body_read: 0 }
    }

    fn fill(&mut self, deadline: Option<Instant>) -> io::Result<usize> {
        let t = deadline.map(|d| d.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
        self.stream.set_read_timeout(t)?;
        let mut chunk = [0u8; 64 * 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn head(&mut self, deadline: Instant) -> io::Result<Head> {
        loop {
            if let Some((h, used)) = parse_head(&self.buf).map_err(bad)? {
                self.buf.drain(..used);
                return Ok(h);
            }
            if self.fill(Some(deadline))? == 0 {
                return Err(bad("connection closed before the HTTP head"));
            }
        }
    }

    /// The next piece of body, None at its end. `deadline` None blocks without a timeout.
    pub fn body_chunk_until(&mut self, head: &Head, deadline: Option<Instant>) -> io::Result<Option<Vec<u8>>> {
        loop {
            if head.chunked {
                let mut out = Vec::new();
                let used = self.chunked.feed(&self.buf, &mut out).map_err(bad)?;
                self.buf.drain(..used);
                if !out.is_empty() {
                    return Ok(Some(out));
                }
                if self.chunked.done {
                    return Ok(None);
                }
            } else if let Some(len) = head.length {
                if self.body_read >= len {
                    return Ok(None);
                }
                if !self.buf.is_empty() {
                    let take = self.buf.len().min(len - self.body_read);
                    self.body_read += take;
                    return Ok(Some(self.buf.drain(..take).collect()));
                }
            } else if !self.buf.is_empty() {
                return Ok(Some(std::mem::take(&mut self.buf)));
            }
            if self.fill(deadline)? == 0 {
                return if head.chunked || head.length.is_some() {
                    Err(bad("connection closed inside the HTTP body"))
                } else {
                    Ok(None)
                };
            }
        }
    }

    fn body_chunk(&mut self, head: &Head, deadline: Instant) -> io::Result<Option<Vec<u8>>> {
        self.body_chunk_until(head, Some(deadline))
    }
}

/// Splits a stream of bytes into newline-terminated lines (etcd's gateway writes one JSON object per
/// line when it streams).
#[derive(Debug, Default)]
pub struct Lines {
    buf: Vec<u8>,
}

impl Lines {
    pub fn push(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, &'static str> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = line.trim_ascii();
            if !line.is_empty() {
                out.push(line.to_vec());
            }
        }
        if self.buf.len() > MAX_BODY {
            return Err("streamed line too long");
        }
        Ok(out)
    }
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:2379").unwrap(),
            Endpoint { host: "127.0.0.1".into(), port: 2379 }
        );
        assert_eq!(Endpoint::parse("etcd:1234/").unwrap(), Endpoint { host: "etcd".into(), port: 1234 });
        assert_eq!(Endpoint::parse("etcd").unwrap(), Endpoint { host: "etcd".into(), port: 2379 });
        assert_eq!(Endpoint::parse("http://[::1]:5").unwrap(), Endpoint { host: "::1".into(), port: 5 });
        assert!(Endpoint::parse("https://x:1").is_err());
        assert!(Endpoint::parse("http://x:y").is_err());
        assert!(Endpoint::parse("").is_err());
    }

    #[test]
    fn heads() {
        let h = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nrest";
        let (head, used) = parse_head(h).unwrap().unwrap();
        assert_eq!(head, Head { status: 200, chunked: true, length: None });
        assert_eq!(&h[used..], b"rest");
        for n in 0..h.len() - 4 {
            assert_eq!(parse_head(&h[..n]).unwrap(), None);
        }
        let (head, _) = parse_head(b"HTTP/1.0 404 Not Found\r\ncontent-length: 12\r\n\r\n").unwrap().unwrap();
        assert_eq!(head, Head { status: 404, chunked: false, length: Some(12) });
        assert!(parse_head(b"SSH-2.0\r\n\r\n").is_err());
        assert!(parse_head(b"HTTP/1.1 abc\r\n\r\n").is_err());
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n").is_err());
        assert!(parse_head(&vec![b'a'; MAX_HEAD + 1]).is_err());
    }

    #[test]
    fn chunked_bodies_in_any_split() {
        let body = b"5\r\nhello\r\n1;ext\r\n \r\n6\r\nworld\n\r\n0\r\n\r\n";
        for cut in 0..body.len() {
            let mut c = Chunked::default();
            let mut out = Vec::new();
            let mut pending = body[..cut].to_vec();
            let used = c.feed(&pending, &mut out).unwrap();
            pending.drain(..used);
            pending.extend_from_slice(&body[cut..]);
            let used = c.feed(&pending, &mut out).unwrap();
            assert!(c.done, "cut {cut}");
            assert_eq!(used, pending.len() - 2, "cut {cut}: stops after the last chunk");
            assert_eq!(out, b"hello world\n", "cut {cut}");
        }
        for bad in [&b"zz\r\n"[..], b"5\r\nhelloXX", b"123456789\r\n", b"fffffff\r\n"] {
            let mut c = Chunked::default();
            assert!(c.feed(bad, &mut Vec::new()).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn lines_split_across_pushes() {
        let mut l = Lines::default();
        assert!(l.push(b"{\"a\":").unwrap().is_empty());
        assert_eq!(l.push(b"1}\n\n{\"b\":2}\n{").unwrap(), vec![b"{\"a\":1}".to_vec(), b"{\"b\":2}".to_vec()]);
    }
}
