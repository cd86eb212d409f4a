//! The HTTP/1.1 the S3 client needs, over kept-alive TCP connections: write one request, read one response,
//! with the body of a successful GET read straight into the caller's buffer.
//!
//! Bounded by time: connecting gives up after the connect timeout, and a connection that moves no byte in
//! either direction for the I/O timeout fails the request (a slow server that keeps sending is not cut off).
//! Every response is read whole or the connection is dropped, so a pooled connection never carries leftovers.
//!
//! `https` endpoints go over TLS (rustls with the ring provider), the server's certificate checked against the
//! system's CA store or the `ca_bundle` file, and its name (or IP address) against the endpoint's host.
//!
//! Not done here: `Expect: 100-continue`, pipelining, proxies, redirects (S3 answers a wrong region with an
//! error, which is reported), client certificates.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

/// The TLS settings of every connection of one backend.
pub(super) type Tls = Arc<rustls::ClientConfig>;

/// TLS settings trusting the certificates in the PEM file `ca_bundle`, else the system's CA store.
pub(super) fn tls_config(ca_bundle: Option<&str>) -> Result<Tls, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_bundle {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path).map_err(|e| format!("ca_bundle '{path}': {e}"))?;
            for c in certs {
                let c = c.map_err(|e| format!("ca_bundle '{path}': {e}"))?;
                roots.add(c).map_err(|e| format!("ca_bundle '{path}': a certificate is not usable as a CA: {e}"))?;
            }
        }
        None => {
            for c in rustls_native_certs::load_native_certs().certs {
                // Certificates the store holds but rustls cannot use are skipped, as curl does.
                let _ = roots.add(c);
            }
        }
    }
    if roots.is_empty() {
        return Err(match ca_bundle {
            Some(p) => format!("ca_bundle '{p}' holds no certificate"),
            None => "the system has no CA certificates (install ca-certificates, or set ca_bundle)".into(),
        });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// A connection's byte stream: plain TCP or TLS over it.
enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => &t.sock,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(b),
            Stream::Tls(t) => t.read(b),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(b),
            Stream::Tls(t) => t.write(b),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(t) => t.flush(),
        }
    }
}

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Endpoint {
    pub host: String,
    pub port: u16,
    /// The `Host` header: `host` or `host:port` when the port is not the scheme's default.
    pub authority: String,
    pub tls: bool,
}

impl Endpoint {
    /// `scheme://host[:port][/]`, or `host[:port]` with `default_tls` deciding the scheme.
    pub fn parse(url: &str, default_tls: bool) -> Result<Endpoint, String> {
        let (tls, rest) = match url.split_once("://") {
            Some(("http", r)) => (false, r),
            Some(("https", r)) => (true, r),
            Some((s, _)) => return Err(format!("endpoint '{url}': unknown scheme '{s}' (http or https)")),
            None => (default_tls, url),
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.is_empty() || rest.contains(['/', '?', '#', '@', ' ']) {
            return Err(format!("endpoint '{url}' is not scheme://host[:port]"));
        }
        let default_port = if tls { 443 } else { 80 };
        let (host, port) = match rest.rsplit_once(':') {
            // An IPv6 literal without a port ("[::1]") has colons inside its brackets.
            Some((h, p)) if !p.contains(']') => {
                let port = p.parse::<u16>().map_err(|_| format!("endpoint '{url}': bad port '{p}'"))?;
                (h, port)
            }
            _ => (rest, default_port),
        };
        if host.is_empty() {
            return Err(format!("endpoint '{url}' has no host"));
        }
        let authority = if port == default_port { host.to_owned() } else { format!("{host}:{port}") };
        let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        Ok(Endpoint { host, port, authority, tls })
    }

    pub fn addrs(&self) -> std::io::Result<Vec<SocketAddr>> {
        Ok((self.host.as_str(), self.port).to_socket_addrs()?.collect())
    }
}

/// Why one request failed, before S3 said anything about it.
#[derive(Debug)]
pub(super) struct Fail {
    pub msg: String,
    /// Nothing of a response arrived: the request may be sent again on a fresh connection.
    pub no_response: bool,
}

impl Fail {
    fn io(stage: &str, e: &std::io::Error, timeout: Duration, no_response: bool) -> Fail {
        let msg = match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                format!("{stage}: no data moved for {:.1} s (io_timeout_ms)", timeout.as_secs_f64())
            }
            _ => format!("{stage}: {e}"),
        };
        Fail { msg, no_response }
    }

    fn proto(msg: impl Into<String>) -> Fail {
        Fail { msg: msg.into(), no_response: false }
    }
}

/// One kept-alive connection and what was read past the last response.
pub(super) struct Conn {
    stream: Stream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    io_timeout: Duration,
    /// Requests answered on this connection so far.
    pub served: u32,
}

const READ_BUF: usize = 64 << 10;
/// Bodies of error responses, XML listings and the like are kept up to this size.
const SMALL_BODY: usize = 1 << 20;

impl Conn {
    /// Connect to `ep`; over TLS when it is an https endpoint (`tls` then holds the settings).
    pub fn open(
        ep: &Endpoint,
        tls: Option<&Tls>,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Conn, Fail> {
        let addrs = ep.addrs().map_err(|e| Fail::proto(format!("resolving {}: {e}", ep.host)))?;
        let mut last = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, connect_timeout) {
                Ok(s) => {
                    let set = |s: &TcpStream| -> std::io::Result<()> {
                        s.set_nodelay(true)?;
                        s.set_read_timeout(Some(io_timeout))?;
                        s.set_write_timeout(Some(io_timeout))
                    };
                    set(&s).map_err(|e| Fail::io("setting socket options", &e, io_timeout, true))?;
                    let stream = match (ep.tls, tls) {
                        (false, _) => Stream::Plain(s),
                        (true, Some(cfg)) => {
                            let name = ServerName::try_from(ep.host.clone())
                                .map_err(|e| Fail::proto(format!("TLS: '{}' is not a server name: {e}", ep.host)))?;
                            let c = rustls::ClientConnection::new(cfg.clone(), name)
                                .map_err(|e| Fail::proto(format!("TLS: {e}")))?;
                            Stream::Tls(Box::new(rustls::StreamOwned::new(c, s)))
                        }
                        (true, None) => return Err(Fail::proto("an https endpoint without TLS settings")),
                    };
                    return Ok(Conn {
                        stream,
                        buf: vec![0; READ_BUF].into_boxed_slice(),
                        start: 0,
                        end: 0,
                        io_timeout,
                        served: 0,
                    });
                }
                Err(e) => last = Some((a, e)),
            }
        }
        Err(match last {
            Some((a, e)) if e.kind() == ErrorKind::TimedOut || e.kind() == ErrorKind::WouldBlock => Fail {
                msg: format!(
                    "connecting to {a}: no answer within {:.1} s (connect_timeout_ms)",
                    connect_timeout.as_secs_f64()
                ),
                no_response: true,
            },
            Some((a, e)) => Fail { msg: format!("connecting to {a}: {e}"), no_response: true },
            None => Fail { msg: format!("{} resolves to no address", ep.host), no_response: true },
        })
    }

    /// Acknowledge what arrived now rather than after the delayed-ACK timer. A server that does not set
    /// TCP_NODELAY (stock Garage) writes a response's headers and body separately, and Nagle holds the body
    /// until the headers are acknowledged: without this each small response waits ~40 ms.
    fn quickack(&self) {
        // Failure only loses the optimisation.
        crate::os::sock::set_int(self.stream.tcp().as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_QUICKACK, 1);
    }

    pub fn fd(&self) -> RawFd {
        self.stream.tcp().as_raw_fd()
    }

    /// Send `head` (request line and headers, ending in the blank line) and `body`, then read the response.
    /// A 2xx body goes into `into` when given (and must fit), any other body into the response's `body`.
    pub fn exchange(
        &mut self,
        head: &[u8],
        body: &[u8],
        into: Option<&mut [u8]>,
        is_head: bool,
    ) -> Result<Response, Fail> {
        self.send(head, body).map_err(|e| Fail::io("sending the request", &e, self.io_timeout, true))?;
        let r = self.recv(into, is_head);
        if r.is_ok() {
            self.served += 1;
        }
        r
    }

    fn send(&mut self, head: &[u8], body: &[u8]) -> std::io::Result<()> {
        if body.len() <= 64 << 10 {
            let mut one = Vec::with_capacity(head.len() + body.len());
            one.extend_from_slice(head);
            one.extend_from_slice(body);
            self.stream.write_all(&one)
        } else {
            self.stream.write_all(head)?;
            self.stream.write_all(body)
        }
    }

    fn recv(&mut self, into: Option<&mut [u8]>, is_head: bool) -> Result<Response, Fail> {
        // The status line and headers.
        let head_end = loop {
            if let Some(i) = find(&self.buf[self.start..self.end], b"\r\n\r\n") {
                break self.start + i + 4;
            }
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.end == self.buf.len() {
                return Err(Fail::proto("the response headers are longer than 64 KiB"));
            }
            let got = self.stream.read(&mut self.buf[self.end..]);
            self.quickack();
            match got {
                Ok(0) => {
                    let none = self.end == 0;
                    return Err(Fail {
                        msg: "the server closed the connection without a response".into(),
                        no_response: none,
                    });
                }
                Ok(n) => self.end += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    let none = self.end == 0;
                    return Err(Fail::io("waiting for the response", &e, self.io_timeout, none));
                }
            }
        };
        let mut resp = parse_head(&self.buf[self.start..head_end])?;
        self.start = head_end;
        let no_body = is_head || resp.status == 204 || resp.status == 304 || (100..200).contains(&resp.status);
        if no_body {
            return Ok(resp);
        }
        let ok = (200..300).contains(&resp.status);
        match (resp.chunked, resp.content_length) {
            (true, _) => self.read_chunked(&mut resp, if ok { into } else { None })?,
            (false, Some(n)) => match into {
                Some(dst) if ok => {
                    if n > dst.len() as u64 {
                        resp.keep_alive = false;
                        return Err(Fail::proto(format!(
                            "the server sent {n} bytes for a range of {} bytes",
                            dst.len()
                        )));
                    }
                    let n = n as usize;
                    self.read_exact_into(&mut dst[..n])?;
                    resp.filled = n;
                }
                _ => {
                    if n > SMALL_BODY as u64 {
                        return Err(Fail::proto(format!("unexpected {n}-byte body (status {})", resp.status)));
                    }
                    let mut v = vec![0; n as usize];
                    self.read_exact_into(&mut v)?;
                    resp.body = v;
                }
            },
            (false, None) => {
                // The body runs to the end of the connection.
                resp.keep_alive = false;
                let mut v = Vec::new();
                let mut tmp = [0u8; 8192];
                loop {
                    let n = self.read_some(&mut tmp)?;
                    if n == 0 {
                        break;
                    }
                    if v.len() + n > SMALL_BODY {
                        return Err(Fail::proto("unbounded response body"));
                    }
                    v.extend_from_slice(&tmp[..n]);
                }
                match into {
                    Some(dst) if ok => {
                        if v.len() > dst.len() {
                            return Err(Fail::proto(format!(
                                "the server sent {} bytes for a range of {}",
                                v.len(),
                                dst.len()
                            )));
                        }
                        dst[..v.len()].copy_from_slice(&v);
                        resp.filled = v.len();
                    }
                    _ => resp.body = v,
                }
            }
        }
        Ok(resp)
    }

    /// Bytes already buffered first, then straight from the socket into `dst`.
    fn read_exact_into(&mut self, dst: &mut [u8]) -> Result<(), Fail> {
        let mut done = 0;
        while done < dst.len() {
            let n = self.read_some(&mut dst[done..])?;
            if n == 0 {
                return Err(Fail::proto(format!(
                    "the server closed the connection {} bytes into a {}-byte body",
                    done,
                    dst.len()
                )));
            }
            done += n;
        }
        Ok(())
    }

    fn read_some(&mut self, dst: &mut [u8]) -> Result<usize, Fail> {
        if self.start < self.end {
            let n = (self.end - self.start).min(dst.len());
            dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.start += n;
            return Ok(n);
        }
        self.start = 0;
        self.end = 0;
        loop {
            let got = self.stream.read(dst);
            self.quickack();
            match got {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Fail::io("reading the response body", &e, self.io_timeout, false)),
            }
        }
    }

    fn read_line(&mut self) -> Result<Vec<u8>, Fail> {
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        loop {
            if self.read_some(&mut b)? == 0 {
                return Err(Fail::proto("the server closed the connection inside a chunked body"));
            }
            if b[0] == b'\n' {
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            if line.len() > 4096 {
                return Err(Fail::proto("a chunk header longer than 4 KiB"));
            }
            line.push(b[0]);
        }
    }

    fn read_chunked(&mut self, resp: &mut Response, mut into: Option<&mut [u8]>) -> Result<(), Fail> {
        loop {
            let line = self.read_line()?;
            let size = std::str::from_utf8(&line)
                .ok()
                .and_then(|s| u64::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
                .ok_or_else(|| Fail::proto("a bad chunk size line"))?;
            if size == 0 {
                // Trailers, up to the blank line.
                while !self.read_line()?.is_empty() {}
                return Ok(());
            }
            match into.as_deref_mut() {
                Some(dst) => {
                    let at = resp.filled;
                    if at as u64 + size > dst.len() as u64 {
                        resp.keep_alive = false;
                        return Err(Fail::proto(format!(
                            "the server sent more than the {} bytes asked for",
                            dst.len()
                        )));
                    }
                    self.read_exact_into(&mut dst[at..at + size as usize])?;
                    resp.filled += size as usize;
                }
                None => {
                    if resp.body.len() as u64 + size > SMALL_BODY as u64 {
                        return Err(Fail::proto("an unexpectedly large chunked body"));
                    }
                    let at = resp.body.len();
                    resp.body.resize(at + size as usize, 0);
                    let mut tmp = std::mem::take(&mut resp.body);
                    let r = self.read_exact_into(&mut tmp[at..]);
                    resp.body = tmp;
                    r?;
                }
            }
            if !self.read_line()?.is_empty() {
                return Err(Fail::proto("a chunk not followed by CRLF"));
            }
        }
    }
}

/// A response, its body either in `body` or (for a 2xx with a buffer) `filled` bytes of that buffer.
#[derive(Debug, Default)]
pub(super) struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub filled: usize,
    pub content_length: Option<u64>,
    chunked: bool,
    pub keep_alive: bool,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

fn parse_head(b: &[u8]) -> Result<Response, Fail> {
    let text = std::str::from_utf8(b).map_err(|_| Fail::proto("response headers are not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let status = parts.next().and_then(|s| s.parse::<u16>().ok());
    let (true, Some(status)) = (version.starts_with("HTTP/1."), status) else {
        return Err(Fail::proto(format!("not an HTTP/1.x status line: {:?}", truncate(status_line, 80))));
    };
    let mut resp = Response { status, keep_alive: version != "HTTP/1.0", ..Response::default() };
    for l in lines.filter(|l| !l.is_empty()) {
        let Some((k, v)) = l.split_once(':') else { return Err(Fail::proto("a header line without ':'")) };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("content-length") {
            resp.content_length = Some(v.parse().map_err(|_| Fail::proto(format!("bad Content-Length '{v}'")))?);
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            resp.chunked = v.to_ascii_lowercase().contains("chunked");
        } else if k.eq_ignore_ascii_case("connection") {
            let v = v.to_ascii_lowercase();
            if v.contains("close") {
                resp.keep_alive = false;
            } else if v.contains("keep-alive") {
                resp.keep_alive = true;
            }
        }
        resp.headers.push((k.to_owned(), v.to_owned()));
    }
    Ok(resp)
}

/// Where `needle` first occurs in `hay`.
pub(super) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub(super) fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn endpoints() {
        let e = Endpoint::parse("http://127.0.0.1:3900", true).unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.authority.as_str(), e.tls),
            ("127.0.0.1", 3900, "127.0.0.1:3900", false)
        );
        let e = Endpoint::parse("s3.example.com", true).unwrap();
        assert_eq!((e.port, e.authority.as_str(), e.tls), (443, "s3.example.com", true));
        let e = Endpoint::parse("http://[::1]:9000/", true).unwrap();
        assert_eq!((e.host.as_str(), e.authority.as_str()), ("::1", "[::1]:9000"));
        let e = Endpoint::parse("https://h:443", false).unwrap();
        assert_eq!(e.authority, "h");
        for bad in ["ftp://h", "http://", "http://h:x", "http://h/path", "not a url", "http://u@h"] {
            assert!(Endpoint::parse(bad, false).is_err(), "{bad}");
        }
    }

    /// A scripted server: answers each request on one connection with the next canned response.
    fn serve(responses: Vec<Vec<u8>>) -> (Endpoint, std::thread::JoinHandle<Vec<String>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut seen = Vec::new();
            for r in responses {
                let mut req = Vec::new();
                let mut b = [0u8; 4096];
                while find(&req, b"\r\n\r\n").is_none() {
                    let n = s.read(&mut b).unwrap();
                    if n == 0 {
                        return seen;
                    }
                    req.extend_from_slice(&b[..n]);
                }
                seen.push(String::from_utf8_lossy(&req).into_owned());
                s.write_all(&r).unwrap();
            }
            seen
        });
        (Endpoint::parse(&format!("http://127.0.0.1:{port}"), false).unwrap(), t)
    }

    fn conn(ep: &Endpoint) -> Conn {
        Conn::open(ep, None, Duration::from_secs(1), Duration::from_secs(2)).unwrap()
    }

    #[test]
    fn bodies_by_length_chunks_and_errors() {
        let (ep, t) = serve(vec![
            b"HTTP/1.1 206 Partial Content\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: v\r\n\r\n"
                .to_vec(),
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\n<Error/>\n".to_vec(),
            b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nETag: \"e\"\r\n\r\n".to_vec(),
        ]);
        let mut c = conn(&ep);
        let mut dst = [0u8; 8];
        let r = c.exchange(b"GET / HTTP/1.1\r\n\r\n", b"", Some(&mut dst), false).unwrap();
        assert_eq!((r.status, r.filled, &dst[..5]), (206, 5, &b"hello"[..]));
        let mut dst = [0u8; 8];
        let r = c.exchange(b"GET / HTTP/1.1\r\n\r\n", b"", Some(&mut dst), false).unwrap();
        assert_eq!((r.filled, &dst[..5]), (5, &b"abcde"[..]));
        // An error body never lands in the caller's buffer.
        let mut dst = [7u8; 16];
        let r = c.exchange(b"GET / HTTP/1.1\r\n\r\n", b"", Some(&mut dst), false).unwrap();
        assert_eq!((r.status, r.filled, r.body.as_slice(), dst), (404, 0, &b"<Error/>\n"[..], [7u8; 16]));
        // HEAD: a Content-Length but no body.
        let r = c.exchange(b"HEAD / HTTP/1.1\r\n\r\n", b"", None, true).unwrap();
        assert_eq!((r.status, r.header("etag")), (200, Some("\"e\"")));
        assert_eq!(c.served, 4);
        drop(c);
        assert_eq!(t.join().unwrap().len(), 4);
    }

    #[test]
    fn too_long_a_body_and_silence_fail() {
        let (ep, _t) = serve(vec![b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n123456789".to_vec()]);
        let mut c = conn(&ep);
        let mut dst = [0u8; 4];
        let e = c.exchange(b"GET / HTTP/1.1\r\n\r\n", b"", Some(&mut dst), false).unwrap_err();
        assert!(e.msg.contains("9 bytes for a range of 4"), "{}", e.msg);

        // A server that accepts and never answers: the I/O timeout ends the request.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ep = Endpoint::parse(&format!("127.0.0.1:{}", l.local_addr().unwrap().port()), false).unwrap();
        let mut c = Conn::open(&ep, None, Duration::from_secs(1), Duration::from_millis(300)).unwrap();
        let t0 = std::time::Instant::now();
        let e = c.exchange(b"GET / HTTP/1.1\r\n\r\n", b"", None, false).unwrap_err();
        assert!(e.no_response && e.msg.contains("no data moved for 0.3 s"), "{}", e.msg);
        assert!(t0.elapsed() < Duration::from_secs(2));
        drop(l);
    }

    #[test]
    fn a_refused_connection_fails_at_once() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let ep = Endpoint::parse(&format!("http://127.0.0.1:{port}"), false).unwrap();
        let t0 = std::time::Instant::now();
        let e = Conn::open(&ep, None, Duration::from_secs(2), Duration::from_secs(2)).err().expect("refused");
        assert!(e.msg.contains("refused"), "{}", e.msg);
        assert!(t0.elapsed() < Duration::from_millis(500));
    }
}
