//! The S3 operations the OBJ backend uses, one blocking call each, over a shared pool of kept-alive
//! connections: ranged GET, PUT, HEAD and the multipart upload calls.
//!
//! A request that fails before any byte of a response came back on a connection taken from the pool (the
//! server closed it while idle) is sent once more on a fresh connection; a 500 or 503 is retried twice after a
//! short pause. Nothing else is retried: a dead server costs one connect (refused at once, or the connect
//! timeout) and a silent one the I/O timeout. Error messages carry S3's code and message, never credentials.
//!
//! Not done here: listing, deletes other than aborting an upload, bucket calls.

use std::os::fd::RawFd;
use std::time::Duration;

use parking_lot::Mutex;

use super::http::{find, truncate, Conn, Endpoint, Response, Tls};
use super::sigv4::{self, Creds, Timestamp};
use crate::mdx::json::b64_encode;

pub(super) struct S3 {
    pub ep: Endpoint,
    pub tls: Option<Tls>,
    pub bucket: String,
    pub region: String,
    pub creds: Option<Creds>,
    pub virtual_host: bool,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    /// Send a CRC32C of each PUT body for the server to check.
    pub checksum: bool,
    idle: Mutex<Vec<Conn>>,
}

/// At most this many idle connections are kept.
const MAX_IDLE: usize = 512;

/// The connections a post has in flight, so that stopping it (abort, or another request of it failing) can
/// cut them off instead of waiting for their timeouts.
#[derive(Default)]
pub(super) struct Active {
    inner: Mutex<ActiveInner>,
}

#[derive(Default)]
struct ActiveInner {
    stopped: bool,
    fds: Vec<RawFd>,
}

impl Active {
    fn enter(&self, fd: RawFd) -> bool {
        let mut g = self.inner.lock();
        if g.stopped {
            return false;
        }
        g.fds.push(fd);
        true
    }

    fn leave(&self, fd: RawFd) {
        let mut g = self.inner.lock();
        if let Some(i) = g.fds.iter().position(|&f| f == fd) {
            g.fds.swap_remove(i);
        }
    }

    pub fn stopped(&self) -> bool {
        self.inner.lock().stopped
    }

    /// No new request starts; requests on the wire end at their next read or write.
    pub fn stop(&self) {
        let mut g = self.inner.lock();
        g.stopped = true;
        for &fd in &g.fds {
            // SAFETY: `fd` belongs to a connection whose request is in flight: it stays open until its owner
            // calls `leave`, which takes this lock first. shutdown only changes the socket's state.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }
}

/// One S3 call.
struct Call<'a> {
    method: &'a str,
    key: &'a str,
    query: &'a [(&'a str, &'a str)],
    headers: Vec<(&'static str, String)>,
    body: &'a [u8],
}

impl S3 {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ep: Endpoint,
        tls: Option<Tls>,
        bucket: String,
        region: String,
        creds: Option<Creds>,
        virtual_host: bool,
        connect_timeout: Duration,
        io_timeout: Duration,
        checksum: bool,
    ) -> S3 {
        let ep = if virtual_host {
            // The bucket becomes part of the host name, and of the address connected to.
            Endpoint { host: format!("{bucket}.{}", ep.host), authority: format!("{bucket}.{}", ep.authority), ..ep }
        } else {
            ep
        };
        S3 {
            ep,
            tls,
            bucket,
            region,
            creds,
            virtual_host,
            connect_timeout,
            io_timeout,
            checksum,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Read `dst.len()` bytes of object `key` from byte `off` into `dst`. A range past the object's end fails.
    pub fn get(&self, key: &str, off: u64, dst: &mut [u8], active: &Active) -> Result<(), String> {
        let len = dst.len() as u64;
        let range = format!("bytes={off}-{}", off + len - 1);
        let what = || format!("GET of bytes {off}..{} of '{}'", off + len, self.shown(key));
        let call = Call { method: "GET", key, query: &[], headers: vec![("range", range)], body: &[] };
        let r = self.call(&call, Some(dst), active).map_err(|e| format!("{}: {e}", what()))?;
        match r.status {
            200 | 206 if r.filled as u64 == len => Ok(()),
            200 | 206 => Err(format!(
                "{}: object shorter than the descriptor ({} of {len} bytes exist{})",
                what(),
                r.filled,
                object_size(&r).map(|n| format!("; the object has {n} bytes")).unwrap_or_default()
            )),
            416 => Err(format!(
                "{}: object shorter than the descriptor (the range starts past its end{})",
                what(),
                object_size(&r).map(|n| format!("; the object has {n} bytes")).unwrap_or_default()
            )),
            _ => Err(format!("{}: {}", what(), s3_error(&r))),
        }
    }

    /// Store `src` as the whole of object `key`.
    pub fn put(&self, key: &str, src: &[u8], active: &Active) -> Result<(), String> {
        let mut headers = vec![("content-length", src.len().to_string())];
        if self.checksum {
            headers.push(("x-amz-checksum-crc32c", b64_encode(&crc32c(src).to_be_bytes())));
        }
        let call = Call { method: "PUT", key, query: &[], headers, body: src };
        let what = || format!("PUT of {} bytes to '{}'", src.len(), self.shown(key));
        let r = self.call(&call, None, active).map_err(|e| format!("{}: {e}", what()))?;
        match r.status {
            200..=299 => Ok(()),
            _ => Err(format!("{}: {}", what(), s3_error(&r))),
        }
    }

    /// Whether object `key` exists: true for 200, false for 404, an error otherwise.
    pub fn head(&self, key: &str, active: &Active) -> Result<bool, String> {
        let call = Call { method: "HEAD", key, query: &[], headers: vec![], body: &[] };
        let what = || format!("HEAD of '{}'", self.shown(key));
        let r = self.call(&call, None, active).map_err(|e| format!("{}: {e}", what()))?;
        match r.status {
            200..=299 => Ok(true),
            404 => Ok(false),
            _ => Err(format!("{}: {}", what(), s3_error(&r))),
        }
    }

    pub fn create_upload(&self, key: &str, active: &Active) -> Result<String, String> {
        let call = Call {
            method: "POST",
            key,
            query: &[("uploads", "")],
            headers: vec![("content-length", "0".into())],
            body: &[],
        };
        let what = || format!("starting a multipart upload of '{}'", self.shown(key));
        let r = self.call(&call, None, active).map_err(|e| format!("{}: {e}", what()))?;
        if !(200..300).contains(&r.status) {
            return Err(format!("{}: {}", what(), s3_error(&r)));
        }
        xml_field(&r.body, "UploadId").ok_or_else(|| format!("{}: no UploadId in the answer", what()))
    }

    /// Upload part `n` (from 1); returns its ETag.
    pub fn upload_part(&self, key: &str, id: &str, n: u32, src: &[u8], active: &Active) -> Result<String, String> {
        let part = n.to_string();
        let call = Call {
            method: "PUT",
            key,
            query: &[("partNumber", &part), ("uploadId", id)],
            headers: vec![("content-length", src.len().to_string())],
            body: src,
        };
        let what = || format!("part {n} ({} bytes) of the upload of '{}'", src.len(), self.shown(key));
        let r = self.call(&call, None, active).map_err(|e| format!("{}: {e}", what()))?;
        if !(200..300).contains(&r.status) {
            return Err(format!("{}: {}", what(), s3_error(&r)));
        }
        r.header("etag").map(str::to_owned).ok_or_else(|| format!("{}: no ETag in the answer", what()))
    }

    pub fn complete_upload(&self, key: &str, id: &str, etags: &[String], active: &Active) -> Result<(), String> {
        let mut xml = String::from("<CompleteMultipartUpload>");
        for (i, e) in etags.iter().enumerate() {
            xml.push_str(&format!("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1, xml_escape(e)));
        }
        xml.push_str("</CompleteMultipartUpload>");
        let call = Call {
            method: "POST",
            key,
            query: &[("uploadId", id)],
            headers: vec![("content-length", xml.len().to_string())],
            body: xml.as_bytes(),
        };
        let what = || format!("completing the upload of '{}' ({} parts)", self.shown(key), etags.len());
        let r = self.call(&call, None, active).map_err(|e| format!("{}: {e}", what()))?;
        // S3 may answer 200 and still report an error in the body.
        if !(200..300).contains(&r.status) || find(&r.body, b"<Error>").is_some() {
            return Err(format!("{}: {}", what(), s3_error(&r)));
        }
        Ok(())
    }

    /// Best effort: the upload's parts are freed by the server.
    pub fn abort_upload(&self, key: &str, id: &str) {
        let call = Call { method: "DELETE", key, query: &[("uploadId", id)], headers: vec![], body: &[] };
        let _ = self.call(&call, None, &Active::default());
    }

    /// The key as it may appear in a message (keys are the caller's data; keep messages bounded).
    fn shown<'k>(&self, key: &'k str) -> &'k str {
        truncate(key, 200)
    }

    fn path(&self, key: &str) -> String {
        let key = sigv4::uri_encode(key, false);
        if self.virtual_host {
            format!("/{key}")
        } else {
            format!("/{}/{key}", sigv4::uri_encode(&self.bucket, true))
        }
    }

    fn call(&self, c: &Call<'_>, mut into: Option<&mut [u8]>, active: &Active) -> Result<Response, String> {
        let path = self.path(c.key);
        let query = sigv4::canonical_query(c.query);
        let mut busy_retries = 0;
        loop {
            let mut headers: Vec<(&str, String)> = vec![("host", self.ep.authority.clone())];
            headers.extend(c.headers.iter().map(|(k, v)| (*k, v.clone())));
            if let Some(creds) = &self.creds {
                let signed: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let req = sigv4::Req { method: c.method, path: &path, query: c.query, headers: &signed };
                headers.extend(sigv4::sign(&req, creds, &self.region, Timestamp::now()));
            }
            let mut head =
                format!("{} {path}{}{query} HTTP/1.1\r\n", c.method, if query.is_empty() { "" } else { "?" });
            for (k, v) in &headers {
                head.push_str(k);
                head.push_str(": ");
                head.push_str(v);
                head.push_str("\r\n");
            }
            head.push_str("\r\n");

            let r = loop {
                let pooled = self.idle.lock().pop();
                let reused = pooled.is_some();
                let mut conn = match pooled {
                    Some(c) => c,
                    None => Conn::open(&self.ep, self.tls.as_ref(), self.connect_timeout, self.io_timeout)
                        .map_err(|f| f.msg)?,
                };
                if !active.enter(conn.fd()) {
                    return Err("stopped (another request of this transfer failed, or it was released)".into());
                }
                let r = conn.exchange(head.as_bytes(), c.body, into.as_deref_mut(), c.method == "HEAD");
                active.leave(conn.fd());
                match r {
                    Ok(resp) => {
                        if resp.keep_alive {
                            let mut idle = self.idle.lock();
                            if idle.len() < MAX_IDLE {
                                idle.push(conn);
                            }
                        }
                        break resp;
                    }
                    // A pooled connection the server closed while it was idle: try a fresh one.
                    Err(f) if reused && f.no_response && !active.stopped() => continue,
                    Err(f) if active.stopped() => return Err(format!("stopped ({})", f.msg)),
                    Err(f) => return Err(f.msg),
                }
            };
            if matches!(r.status, 500 | 503) && busy_retries < 2 && !active.stopped() {
                busy_retries += 1;
                std::thread::sleep(Duration::from_millis(50 << busy_retries));
                continue;
            }
            return Ok(r);
        }
    }
}

/// The object's size from a `Content-Range: bytes a-b/size` (or `bytes */size`) header.
fn object_size(r: &Response) -> Option<u64> {
    r.header("content-range")?.rsplit_once('/')?.1.trim().parse().ok()
}

/// "404 NoSuchKey: The specified key does not exist." from an S3 error response.
fn s3_error(r: &Response) -> String {
    let code = xml_field(&r.body, "Code");
    let msg = xml_field(&r.body, "Message");
    match (code, msg) {
        (Some(c), Some(m)) => format!("HTTP {} {c}: {}", r.status, truncate(&m, 300)),
        (Some(c), None) => format!("HTTP {} {c}", r.status),
        _ => format!("HTTP {}{}", r.status, if r.status == 404 { " (no such key or bucket)" } else { "" }),
    }
}

/// The text of the first `<name>` element, unescaped.
fn xml_field(body: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let open = format!("<{name}>");
    let start = text.find(&open)? + open.len();
    let end = start + text[start..].find(&format!("</{name}>"))?;
    Some(
        text[start..end]
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// CRC-32C (Castagnoli), with the SSE 4.2 instruction where the CPU has it.
pub(super) fn crc32c(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU supports SSE 4.2, checked just above.
        return unsafe { crc32c_sse42(data) };
    }
    crc32c_table(data)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut crc = !0u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        crc = _mm_crc32_u64(crc, u64::from_le_bytes(b));
    }
    let mut c = crc as u32;
    for &b in words.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    !c
}

fn crc32c_table(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
            }
            *e = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| t[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codecs() {
        // RFC 3720's CRC32C check value, and a length that leaves a tail after the 8-byte words.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c_table(b"123456789"), 0xE306_9283);
        let long: Vec<u8> = (0..1037u32).map(|i| (i * 31 % 251) as u8).collect();
        assert_eq!(crc32c(&long), crc32c_table(&long));
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        // The header value S3 expects: the big-endian CRC in base64.
        assert_eq!(b64_encode(&crc32c(b"123456789").to_be_bytes()), "4waSgw==");
        let body = b"<Error><Code>NoSuchKey</Code><Message>a &lt;b&gt; &amp; c</Message></Error>";
        assert_eq!(xml_field(body, "Code").as_deref(), Some("NoSuchKey"));
        assert_eq!(xml_field(body, "Message").as_deref(), Some("a <b> & c"));
        assert_eq!(xml_field(body, "UploadId"), None);
    }

    #[test]
    fn paths() {
        let ep = Endpoint::parse("http://127.0.0.1:3900", false).unwrap();
        let t = Duration::from_secs(1);
        let s = S3::new(ep.clone(), None, "bk".into(), "garage".into(), None, false, t, t, false);
        assert_eq!(s.path("a b/c"), "/bk/a%20b/c");
        assert_eq!(s.ep.authority, "127.0.0.1:3900");
        let v = S3::new(ep, None, "bk".into(), "garage".into(), None, true, t, t, false);
        assert_eq!(v.path("k"), "/k");
        assert_eq!((v.ep.host.as_str(), v.ep.authority.as_str()), ("bk.127.0.0.1", "bk.127.0.0.1:3900"));
    }
}
