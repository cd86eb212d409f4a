//! Just enough JSON for etcd's HTTP gateway: a bounded recursive-descent parser (depth, size and string
//! escapes checked; never panics) and base64, which etcd uses for every key and value.
//!
//! Numbers are kept as their text: etcd writes 64-bit integers as strings anyway.

#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

const MAX_DEPTH: usize = 32;

impl Json {
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn arr(&self) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            _ => &[],
        }
    }
    /// An integer written as a number or (etcd's way) as a string.
    pub fn int(&self) -> Option<i64> {
        match self {
            Json::Num(s) | Json::Str(s) => s.parse().ok(),
            _ => None,
        }
    }
    pub fn truthy(&self) -> bool {
        matches!(self, Json::Bool(true))
    }
}

pub fn parse(s: &[u8]) -> Result<Json, &'static str> {
    let mut p = P { s, i: 0 };
    let v = p.value(0)?;
    p.ws();
    if p.i != s.len() {
        return Err("trailing characters after JSON");
    }
    Ok(v)
}

struct P<'a> {
    s: &'a [u8],
    i: usize,
}

impl P<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\r' | b'\n') {
            self.i += 1;
        }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, lit: &[u8]) -> Result<(), &'static str> {
        if self.s.len() - self.i >= lit.len() && &self.s[self.i..self.i + lit.len()] == lit {
            self.i += lit.len();
            Ok(())
        } else {
            Err("bad JSON literal")
        }
    }
    fn value(&mut self, depth: usize) -> Result<Json, &'static str> {
        if depth > MAX_DEPTH {
            return Err("JSON nested too deeply");
        }
        self.ws();
        match self.peek().ok_or("truncated JSON")? {
            b'n' => self.eat(b"null").map(|_| Json::Null),
            b't' => self.eat(b"true").map(|_| Json::Bool(true)),
            b'f' => self.eat(b"false").map(|_| Json::Bool(false)),
            b'"' => self.string().map(Json::Str),
            b'[' => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value(depth + 1)?);
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(v));
                        }
                        _ => return Err("bad JSON array"),
                    }
                }
            }
            b'{' => {
                self.i += 1;
                let mut kv = Vec::new();
                self.ws();
                if self.peek() == Some(b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(kv));
                }
                loop {
                    self.ws();
                    if self.peek() != Some(b'"') {
                        return Err("JSON object key is not a string");
                    }
                    let k = self.string()?;
                    self.ws();
                    self.eat(b":")?;
                    let v = self.value(depth + 1)?;
                    kv.push((k, v));
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(kv));
                        }
                        _ => return Err("bad JSON object"),
                    }
                }
            }
            b'-' | b'0'..=b'9' => {
                let st = self.i;
                while self.i < self.s.len() && matches!(self.s[self.i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[st..self.i]).map(|n| Json::Num(n.to_owned())).map_err(|_| "bad JSON number")
            }
            _ => Err("unexpected character in JSON"),
        }
    }
    fn hex4(&mut self) -> Result<u32, &'static str> {
        if self.s.len() - self.i < 4 {
            return Err("truncated JSON escape");
        }
        let h = std::str::from_utf8(&self.s[self.i..self.i + 4]).map_err(|_| "bad JSON escape")?;
        let v = u32::from_str_radix(h, 16).map_err(|_| "bad JSON escape")?;
        self.i += 4;
        Ok(v)
    }
    fn string(&mut self) -> Result<String, &'static str> {
        self.i += 1; // opening quote
        let mut out = Vec::new();
        loop {
            let c = self.peek().ok_or("truncated JSON string")?;
            self.i += 1;
            match c {
                b'"' => return String::from_utf8(out).map_err(|_| "JSON string is not UTF-8"),
                b'\\' => {
                    let e = self.peek().ok_or("truncated JSON escape")?;
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let mut cp = self.hex4()?;
                            if (0xD800..0xDC00).contains(&cp) {
                                self.eat(b"\\u")?;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err("bad JSON surrogate pair");
                                }
                                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                            }
                            char::from_u32(cp).ok_or("bad JSON code point")?
                        }
                        _ => return Err("bad JSON escape"),
                    };
                    let mut b = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                }
                c if c < 0x20 => return Err("control character in JSON string"),
                c => out.push(c),
            }
        }
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

pub fn b64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                out.push(B64[(n >> (18 - 6 * k)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub fn b64_decode(s: &str) -> Result<Vec<u8>, &'static str> {
    let s = s.trim_end_matches('=').as_bytes();
    if s.len() % 4 == 1 {
        return Err("bad base64 length");
    }
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in s {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return Err("bad base64 character"),
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_responses_parse() {
        let r = br#"{"header":{"cluster_id":"14841639068965178418","revision":"2","raft_term":"2"},"kvs":[{"key":"L25peGwvYWdlbnRzLy9hL21ldGFkYXRh","create_revision":"2","mod_revision":"2","version":"1","value":"aGVsbG8="}],"count":"1"}"#;
        let j = parse(r).unwrap();
        assert_eq!(j.get("header").and_then(|h| h.get("revision")).and_then(Json::int), Some(2));
        let kv = &j.get("kvs").unwrap().arr()[0];
        assert_eq!(b64_decode(kv.get("value").unwrap().str().unwrap()).unwrap(), b"hello");
        assert_eq!(b64_decode(kv.get("key").unwrap().str().unwrap()).unwrap(), b"/nixl/agents//a/metadata");
        let w = br#"{"result":{"header":{"revision":"3"},"events":[{"type":"DELETE","kv":{"key":"L25peA==","mod_revision":"3"}}]}}"#;
        let j = parse(w).unwrap();
        let ev = &j.get("result").unwrap().get("events").unwrap().arr()[0];
        assert_eq!(ev.get("type").unwrap().str(), Some("DELETE"));
        assert_eq!(
            parse(br#" [1, -2.5e3, true, false, null, "a\"\\\/\n\u00e9\ud83d\ude00"] "#).unwrap(),
            Json::Arr(vec![
                Json::Num("1".into()),
                Json::Num("-2.5e3".into()),
                Json::Bool(true),
                Json::Bool(false),
                Json::Null,
                Json::Str("a\"\\/\né😀".into()),
            ])
        );
    }

    #[test]
    fn bad_json_is_an_error_not_a_panic() {
        for b in [
            &b""[..],
            b"{",
            b"[1,",
            b"{\"a\"}",
            b"\"\\u12\"",
            b"\"\\ud800\\u0041\"",
            b"{\"a\":1}x",
            b"nul",
            b"\"\x01\"",
        ] {
            assert!(parse(b).is_err(), "{:?}", String::from_utf8_lossy(b));
        }
        let deep = "[".repeat(1000);
        assert!(parse(deep.as_bytes()).is_err());
        let mut x = 88172645463325252u64;
        let alphabet = b"{}[]\",:0123456789-eE.tfnul\\ ab";
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 24) as usize;
            let s: Vec<u8> = (0..n).map(|k| alphabet[((x >> (k * 2 % 60)) as usize) % alphabet.len()]).collect();
            let _ = parse(&s);
        }
    }

    #[test]
    fn base64_round_trip() {
        for n in 0..70 {
            let d: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(b64_decode(&b64_encode(&d)).unwrap(), d, "{n}");
        }
        assert_eq!(b64_encode(b"hello"), "aGVsbG8=");
        assert!(b64_decode("a").is_err());
        assert!(b64_decode("a$==").is_err());
    }
}
