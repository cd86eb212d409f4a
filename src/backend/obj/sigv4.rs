//! AWS Signature Version 4 for S3 requests: the canonical request, the string to sign, the derived key and the
//! `Authorization` header, plus the UTC timestamp and URI encoding they need.
//!
//! Payloads are not hashed: every request says `UNSIGNED-PAYLOAD` (what S3 accepts over HTTPS and HTTP alike),
//! so a 64 MiB PUT costs no SHA-256 pass; integrity of PUT bodies comes from the CRC32C checksum header instead
//! (`s3.rs`). Not done here: presigned URLs, chunked (streaming) signatures, SigV4a.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The payload hash value that tells S3 the body is not covered by the signature.
pub(super) const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";

/// Long-term or temporary credentials. `Debug` never shows the secret or the token.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Creds {
    pub access_key: String,
    pub secret_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Creds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Creds").field("access_key", &self.access_key).finish_non_exhaustive()
    }
}

/// A request to sign: everything that goes into the canonical request.
pub(super) struct Req<'a> {
    pub method: &'a str,
    /// The path as sent, already URI-encoded (`/bucket/key`).
    pub path: &'a str,
    /// Query parameters, not encoded; signed and sent in sorted order.
    pub query: &'a [(&'a str, &'a str)],
    /// Headers to sign besides `x-amz-date`, `x-amz-content-sha256` and `x-amz-security-token`, which `sign`
    /// adds. Names lower-case.
    pub headers: &'a [(&'a str, &'a str)],
}

/// The headers `sign` adds to a request, the `Authorization` header last.
pub(super) fn sign(req: &Req<'_>, creds: &Creds, region: &str, now: Timestamp) -> Vec<(&'static str, String)> {
    let mut added: Vec<(&'static str, String)> =
        vec![("x-amz-content-sha256", UNSIGNED_PAYLOAD.to_owned()), ("x-amz-date", now.amz_date())];
    if let Some(t) = &creds.session_token {
        added.push(("x-amz-security-token", t.clone()));
    }
    let mut headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_owned()))
        .chain(added.iter().map(|(k, v)| ((*k).to_owned(), v.clone())))
        .collect();
    headers.sort();
    let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    let signed = signed.join(";");
    let mut canonical = format!("{}\n{}\n{}\n", req.method, req.path, canonical_query(req.query));
    for (k, v) in &headers {
        canonical.push_str(k);
        canonical.push(':');
        canonical.push_str(v);
        canonical.push('\n');
    }
    canonical.push('\n');
    canonical.push_str(&signed);
    canonical.push('\n');
    canonical.push_str(UNSIGNED_PAYLOAD);
    let scope = format!("{}/{region}/s3/aws4_request", now.date());
    let to_sign = format!("AWS4-HMAC-SHA256\n{}\n{scope}\n{}", now.amz_date(), hex(&Sha256::digest(canonical)));
    let mut key = hmac(format!("AWS4{}", creds.secret_key).as_bytes(), now.date().as_bytes());
    for part in [region, "s3", "aws4_request"] {
        key = hmac(&key, part.as_bytes());
    }
    let signature = hex(&hmac(&key, to_sign.as_bytes()));
    added.push((
        "authorization",
        format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={signed},Signature={signature}",
            creds.access_key
        ),
    ));
    added
}

/// The query string as signed and as sent: sorted, every name and value URI-encoded, `name=` for empty values.
pub(super) fn canonical_query(query: &[(&str, &str)]) -> String {
    let mut q: Vec<(String, String)> = query.iter().map(|(k, v)| (uri_encode(k, true), uri_encode(v, true))).collect();
    q.sort();
    q.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
}

/// S3's URI encoding: everything but `A-Z a-z 0-9 - _ . ~` as `%XY`; `/` too unless `slash` is false.
pub(super) fn uri_encode(s: &str, slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') || (b == b'/' && !slash) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hmac(key: &[u8], msg: &[u8]) -> Vec<u8> {
    // An HMAC key may have any length, so `new_from_slice` cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    m.update(msg);
    m.finalize().into_bytes().to_vec()
}

pub(super) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A UTC second, as SigV4 writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Timestamp {
    pub secs: u64,
}

impl Timestamp {
    pub fn now() -> Timestamp {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Timestamp { secs }
    }

    /// `YYYYMMDD`.
    pub fn date(self) -> String {
        let (y, m, d) = civil(self.secs / 86_400);
        format!("{y:04}{m:02}{d:02}")
    }

    /// `YYYYMMDDTHHMMSSZ`.
    pub fn amz_date(self) -> String {
        let s = self.secs % 86_400;
        format!("{}T{:02}{:02}{:02}Z", self.date(), s / 3600, s / 60 % 60, s % 60)
    }
}

/// (year, month, day) of a day count since 1970-01-01, in the proleptic Gregorian calendar.
fn civil(days: u64) -> (u64, u64, u64) {
    // Days since 0000-03-01, so leap days end each 4/100/400-year cycle.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example_creds() -> Creds {
        // The credentials of AWS's published SigV4 examples for S3.
        Creds {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        }
    }

    #[test]
    fn timestamps() {
        assert_eq!(Timestamp { secs: 0 }.amz_date(), "19700101T000000Z");
        // 2013-05-24, the date of AWS's examples.
        assert_eq!(Timestamp { secs: 1_369_353_600 }.amz_date(), "20130524T000000Z");
        // A leap day and the last second of a century year that is a leap year.
        assert_eq!(Timestamp { secs: 951_782_400 }.date(), "20000229");
        assert_eq!(Timestamp { secs: 978_307_199 }.amz_date(), "20001231T235959Z");
        assert_eq!(Timestamp { secs: 4_107_542_400 }.date(), "21000301");
    }

    #[test]
    fn encoding() {
        assert_eq!(uri_encode("a b/c~d.e_f-g", false), "a%20b/c~d.e_f-g");
        assert_eq!(uri_encode("a/b", true), "a%2Fb");
        assert_eq!(uri_encode("ü+=", true), "%C3%BC%2B%3D");
        assert_eq!(canonical_query(&[("uploadId", "x y"), ("partNumber", "2")]), "partNumber=2&uploadId=x%20y");
        assert_eq!(canonical_query(&[("uploads", "")]), "uploads=");
    }

    /// AWS's worked example "GET Object" (a ranged GET of `/test.txt` in `examplebucket`), except that we sign
    /// `UNSIGNED-PAYLOAD` where the example hashes the empty body, so the canonical request differs in its last
    /// line. The example's own signature is checked through `signature_of` below, which takes the payload hash.
    #[test]
    fn aws_get_object_example() {
        let now = Timestamp { secs: 1_369_353_600 };
        let sig = signature_of(
            "GET",
            "/test.txt",
            &[],
            &[("host", "examplebucket.s3.amazonaws.com"), ("range", "bytes=0-9")],
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            &example_creds(),
            "us-east-1",
            now,
        );
        assert_eq!(sig, "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
    }

    /// AWS's worked example "GET Bucket Lifecycle" (a query parameter with an empty value).
    #[test]
    fn aws_get_lifecycle_example() {
        let now = Timestamp { secs: 1_369_353_600 };
        let sig = signature_of(
            "GET",
            "/",
            &[("lifecycle", "")],
            &[("host", "examplebucket.s3.amazonaws.com")],
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            &example_creds(),
            "us-east-1",
            now,
        );
        assert_eq!(sig, "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");
    }

    /// `sign`'s own output agrees with the same computation done with an explicit payload hash.
    #[test]
    fn sign_matches_reference_with_unsigned_payload() {
        let now = Timestamp { secs: 1_700_000_000 };
        let creds = Creds { session_token: Some("tok".into()), ..example_creds() };
        let req = Req {
            method: "PUT",
            path: "/bucket/some%20key",
            query: &[("partNumber", "3"), ("uploadId", "abc")],
            headers: &[("host", "127.0.0.1:3900"), ("content-length", "5")],
        };
        let added = sign(&req, &creds, "garage", now);
        let auth = &added.last().expect("authorization").1;
        let want = signature_of(
            "PUT",
            "/bucket/some%20key",
            &[("partNumber", "3"), ("uploadId", "abc")],
            &[
                ("host", "127.0.0.1:3900"),
                ("content-length", "5"),
                ("x-amz-content-sha256", UNSIGNED_PAYLOAD),
                ("x-amz-date", &now.amz_date()),
                ("x-amz-security-token", "tok"),
            ],
            UNSIGNED_PAYLOAD,
            &creds,
            "garage",
            now,
        );
        assert!(auth.ends_with(&format!("Signature={want}")), "{auth}");
        assert!(auth.contains(
            "Credential=AKIAIOSFODNN7EXAMPLE/20231114/garage/s3/aws4_request,SignedHeaders=content-length;host;\
             x-amz-content-sha256;x-amz-date;x-amz-security-token,"
        ));
        assert!(!format!("{creds:?}").contains("EXAMPLEKEY"));
        assert!(!format!("{creds:?}").contains("tok"));
    }

    /// A second, independent spelling of the algorithm with the payload hash as a parameter, straight from the
    /// specification's steps, so the published examples can check it.
    #[allow(clippy::too_many_arguments)]
    fn signature_of(
        method: &str,
        path: &str,
        query: &[(&str, &str)],
        headers: &[(&str, &str)],
        payload: &str,
        creds: &Creds,
        region: &str,
        now: Timestamp,
    ) -> String {
        let mut h: Vec<(&str, &str)> = headers.to_vec();
        if !h.iter().any(|(k, _)| *k == "x-amz-content-sha256") {
            h.push(("x-amz-content-sha256", payload));
        }
        let date = now.amz_date();
        if !h.iter().any(|(k, _)| *k == "x-amz-date") {
            h.push(("x-amz-date", &date));
        }
        h.sort();
        let canon_headers: String = h.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
        let signed = h.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(";");
        let creq = format!("{method}\n{path}\n{}\n{canon_headers}\n{signed}\n{payload}", canonical_query(query));
        let scope = format!("{}/{region}/s3/aws4_request", now.date());
        let sts = format!("AWS4-HMAC-SHA256\n{date}\n{scope}\n{}", hex(&Sha256::digest(creq)));
        let k = [region, "s3", "aws4_request"]
            .iter()
            .fold(hmac(format!("AWS4{}", creds.secret_key).as_bytes(), now.date().as_bytes()), |k, p| {
                hmac(&k, p.as_bytes())
            });
        hex(&hmac(&k, sts.as_bytes()))
    }
}
