//! Asking a Prometheus server (and a daemon's `/metrics`) over plain HTTP.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// GET `path` from `addr`: (status, body).
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut r = String::new();
    s.read_to_string(&mut r)?;
    let (head, body) = r.split_once("\r\n\r\n").unwrap_or((&r, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

pub fn urlencode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query: each series' labels and value.
pub fn query(prom: &str, q: &str) -> Vec<(serde_json::Value, f64)> {
    let (status, body) = http_get(prom, &format!("/api/v1/query?query={}", urlencode(q))).expect("querying Prometheus");
    assert_eq!(status, 200, "{q}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["data"]["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["metric"].clone(), r["value"][1].as_str().unwrap().parse().unwrap()))
        .collect()
}
