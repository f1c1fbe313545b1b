//! Byte ranges of a file served over HTTP(S): range requests on a small pool
//! of keep-alive connections (ureq's agent, rustls for TLS), each with a
//! deadline for the whole request, retries, and checks of what came back.
//!
//! Plain Rust. Every error names the URL and the byte range.

use super::{header_len, parse_header, TensorInfo, FIRST_READ};
use crate::error::Error;
use crate::sync::{lock, wait_once};
use std::io::Read;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// Requests in flight at once to one server (scheme, host and port), whatever
/// file of this process they read, and idle keep-alive connections kept per
/// host by one file's agent: the reads of one file share them. Unbounded, 208 pool
/// workers opened 202 connections at once; a server's listen backlog
/// (Python's `socketserver`: 5) dropped the rest, whose connects then waited
/// out TCP's retransmission backoff (28 s of a 3 s load).
pub const POOL_CONNECTIONS: usize = 8;

/// First wait before a retry; doubled at each retry, at most [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest pause between two retries.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How requests are made: the deadline of each (whole request, retries
/// included; None: none) and how many times a connection error or 5xx is
/// retried.
#[derive(Clone)]
pub struct Http {
    agent: ureq::Agent,
    /// Bounds each request, retries included (`None`: no bound).
    pub timeout: Option<Duration>,
    /// How often a connection error or 5xx is retried.
    pub retries: u32,
}

/// A counting semaphore: at most [`POOL_CONNECTIONS`] requests at once.
struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

/// The scheme, host and port of `url` (`http://h:8000` of
/// `http://h:8000/a/b`), lowercased: the server a request goes to.
fn origin(url: &str) -> String {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let end = url[after_scheme..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| after_scheme + i);
    url[..end].to_ascii_lowercase()
}

/// The request slots of `url`'s server, shared by every file of this process
/// read from it (an index of 30 files on one host, each with its own
/// slots, could still have opened 240 connections at once).
fn slots_for(url: &str) -> Arc<Slots> {
    static BY_ORIGIN: Mutex<Vec<(String, Weak<Slots>)>> = Mutex::new(Vec::new());
    let key = origin(url);
    let mut all = lock(&BY_ORIGIN);
    all.retain(|(_, slots)| slots.strong_count() > 0);
    if let Some(slots) = all
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, s)| s.upgrade())
    {
        return slots;
    }
    let slots = Arc::new(Slots {
        free: Mutex::new(POOL_CONNECTIONS),
        freed: Condvar::new(),
    });
    all.push((key, Arc::downgrade(&slots)));
    slots
}

/// One taken slot, given back when dropped.
struct Slot<'a>(&'a Slots);

impl Slots {
    fn take(&self) -> Slot<'_> {
        let mut free = lock(&self.free);
        while *free == 0 {
            free = wait_once(&self.freed, free, None);
        }
        *free -= 1;
        Slot(self)
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *lock(&self.0.free) += 1;
        self.0.freed.notify_one();
    }
}

/// Root certificates to trust: `$SSL_CERT_FILE` (PEM) when set, as OpenSSL
/// and Python's `ssl` read it; else Mozilla's (webpki-roots).
fn root_certs() -> Result<ureq::tls::RootCerts, Error> {
    let Some(path) = std::env::var_os("SSL_CERT_FILE") else {
        return Ok(ureq::tls::RootCerts::WebPki);
    };
    let pem = std::fs::read(&path)
        .map_err(|e| Error::Io(format!("SSL_CERT_FILE={}: {e}", path.to_string_lossy())))?;
    let certs = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Io(format!("SSL_CERT_FILE={}: {e}", path.to_string_lossy())))?;
    Ok(ureq::tls::RootCerts::new_with_certs(&certs))
}

impl Http {
    /// A client with a request `timeout` and `retries`; fails when TLS cannot be set up.
    pub fn new(timeout: Option<Duration>, retries: u32) -> Result<Http, Error> {
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(root_certs()?)
            .build();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_idle_connections_per_host(POOL_CONNECTIONS)
            .tls_config(tls)
            .build()
            .into();
        Ok(Http {
            agent,
            timeout,
            retries,
        })
    }

    /// Reads bytes `[start, end)` of `url`, passing them in order to `sink`,
    /// once fewer than [`POOL_CONNECTIONS`] requests to its server are in flight (all files of this process),
    /// retrying connection errors, a connection lost mid-body (the next
    /// attempt asks only for the bytes not yet received) and 5xx, with
    /// exponential backoff. Returns the file's total size from
    /// `Content-Range`. The caller names the read: a [`Failure`] carries only
    /// what went wrong.
    ///
    /// With `upto`, a file shorter than `end` is no error: the server's
    /// shorter range (`bytes start-(size-1)/size`) is read (a header's first read).
    pub fn read_range(
        &self,
        url: &str,
        start: u64,
        end: u64,
        upto: bool,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<u64, Failure> {
        if end <= start {
            return Err(Failure::invalid("an empty range cannot be requested"));
        }
        // The deadline starts once the request may start: a load of many
        // reads queues them here, not against each one's timeout.
        let slots = slots_for(url);
        let _slot = slots.take();
        let deadline = self.timeout.and_then(|t| Instant::now().checked_add(t));
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 0;
        let mut got = 0u64;
        let (mut end, mut upto) = (end, upto);
        loop {
            let from = start + got;
            match self.attempt(url, from, end, upto, deadline, &mut got, sink) {
                Ok(total) => return Ok(total),
                Err(Attempt::Fatal(f)) => return Err(f),
                Err(Attempt::Retry {
                    detail,
                    errno,
                    total,
                }) => {
                    if let Some(total) = total {
                        // The size is known now: a resumed request asks for the rest exactly.
                        end = end.min(total);
                        upto = false;
                    }
                    if attempt >= self.retries {
                        let detail = if attempt == 0 {
                            format!("{detail} (after 1 attempt)")
                        } else {
                            format!("{detail} (after {} attempts)", attempt + 1)
                        };
                        return Err(Failure::os(detail, errno));
                    }
                    let now = Instant::now();
                    if deadline.is_some_and(|d| now + backoff >= d) {
                        return Err(Failure::deadline(format!(
                            "{detail}; no time left for a retry within the {} s timeout",
                            self.timeout.unwrap_or_default().as_secs_f64()
                        )));
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    attempt += 1;
                }
            }
        }
    }

    /// One request for bytes `[start, end)`; `got` counts the bytes passed to
    /// `sink` (across attempts: the caller resumes after them).
    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &self,
        url: &str,
        start: u64,
        mut end: u64,
        upto: bool,
        deadline: Option<Instant>,
        got: &mut u64,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<u64, Attempt> {
        let timed_out = || {
            Attempt::Fatal(Failure::deadline(format!(
                "not finished within the {} s timeout",
                self.timeout.unwrap_or_default().as_secs_f64()
            )))
        };
        let left = match deadline {
            None => None,
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => return Err(timed_out()),
            },
        };
        let retry = |detail: String, errno: Option<i32>| Attempt::Retry {
            detail,
            errno,
            total: None,
        };
        let response = self
            .agent
            .get(url)
            .header("Range", format!("bytes={start}-{}", end - 1))
            .config()
            .timeout_global(left)
            .build()
            .call();
        let mut response = match response {
            Ok(r) => r,
            Err(ureq::Error::Timeout(_)) => return Err(timed_out()),
            // A certificate refused (rustls errors come as InvalidData): no retry helps.
            Err(ureq::Error::Io(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                return Err(Attempt::Fatal(Failure::io(e.to_string())))
            }
            Err(ureq::Error::Io(e)) => {
                let (text, errno) = crate::error::os_text(&e);
                return Err(retry(text, errno));
            }
            Err(
                e @ (ureq::Error::ConnectionFailed
                | ureq::Error::HostNotFound
                | ureq::Error::Protocol(_)),
            ) => return Err(retry(e.to_string(), None)),
            Err(e) => return Err(Attempt::Fatal(Failure::io(e.to_string()))),
        };
        let status = response.status().as_u16();
        match status {
            206 => {}
            404 | 410 => {
                return Err(Attempt::Fatal(Failure::not_found(format!(
                    "HTTP {status} (not found)"
                ))))
            }
            500..=599 => return Err(retry(format!("HTTP {status} (server error)"), None)),
            200 => {
                return Err(Attempt::Fatal(Failure::io(
                    "HTTP 200: the server ignored the Range request (it must answer \
                     206 Partial Content)"
                        .into(),
                )))
            }
            _ => {
                return Err(Attempt::Fatal(Failure::io(format!(
                    "HTTP {status} (expected 206 Partial Content)"
                ))))
            }
        }
        let headers = response.headers();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let content_range = header("content-range");
        let total = content_range
            .as_deref()
            .and_then(|v| parse_content_range(v, start, end, upto))
            .ok_or_else(|| {
                Attempt::Fatal(Failure::io(format!(
                    "wrong Content-Range {:?} (expected \"bytes {start}-{}/<size>\")",
                    content_range.as_deref().unwrap_or("(none)"),
                    end - 1
                )))
            })?;
        end = end.min(total);
        if let Some(length) = header("content-length") {
            if length.trim().parse::<u64>().ok() != Some(end - start) {
                return Err(Attempt::Fatal(Failure::io(format!(
                    "wrong Content-Length {length:?} (expected {})",
                    end - start
                ))));
            }
        }
        let mut reader = response
            .body_mut()
            .with_config()
            .limit(end - start)
            .reader();
        let origin = start - *got; // the first byte the caller asked for
        let wanted = end - origin;
        let mut chunk = vec![0u8; 256 * 1024];
        let mut here = 0u64;
        // The connection ended before the body did: retried, asking for the rest.
        let cut = |got: u64, cause: String, errno: Option<i32>| Attempt::Retry {
            detail: format!("truncated body: {got} of {wanted} bytes received{cause}"),
            errno,
            total: Some(total),
        };
        while here < end - start {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(timed_out());
            }
            let want = ((end - start - here) as usize).min(chunk.len());
            match reader.read(&mut chunk[..want]) {
                Ok(0) => return Err(cut(*got, String::new(), None)),
                Ok(n) => {
                    sink(&chunk[..n]);
                    here += n as u64;
                    *got += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Err(timed_out()),
                Err(e) => {
                    let timeout = matches!(
                        e.get_ref().and_then(|i| i.downcast_ref::<ureq::Error>()),
                        Some(ureq::Error::Timeout(_))
                    );
                    if timeout {
                        return Err(timed_out());
                    }
                    let (text, errno) = crate::error::os_text(&e);
                    return Err(cut(*got, format!(" ({text})"), errno));
                }
            }
        }
        // Read to the end of the body (no bytes left): only then does ureq
        // give the connection back to its pool for the next request.
        let _ = reader.read(&mut chunk[..1]);
        Ok(total)
    }
}

enum Attempt {
    /// A connection error, a body cut short, or a 5xx: the message, and the
    /// file's size when the response gave it.
    Retry {
        detail: String,
        errno: Option<i32>,
        total: Option<u64>,
    },
    Fatal(Failure),
}

/// What kind of failure a read met (which Python exception it becomes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The file is not there (404).
    NotFound,
    /// A connection or transfer failed.
    Io,
    /// A request ran past its deadline.
    Deadline,
    /// What was asked or what came back makes no sense.
    Invalid,
}

/// Why a read failed, without naming the read: the caller knows which file,
/// tensor and bytes it was and names them with [`Failure::at`].
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// What happened, for the message.
    pub detail: String,
    /// The OS's error number, where it gave one (`Io` only).
    pub errno: Option<i32>,
}

impl Failure {
    fn of(kind: FailureKind, detail: String) -> Failure {
        Failure {
            kind,
            detail,
            errno: None,
        }
    }
    /// An I/O failure.
    pub fn io(detail: String) -> Failure {
        Failure::of(FailureKind::Io, detail)
    }
    /// An I/O failure with the OS's error number, where it gave one.
    pub fn os(detail: String, errno: Option<i32>) -> Failure {
        Failure {
            errno,
            ..Failure::io(detail)
        }
    }
    /// A missing file.
    pub fn not_found(detail: String) -> Failure {
        Failure::of(FailureKind::NotFound, detail)
    }
    /// A request past its deadline.
    pub fn deadline(detail: String) -> Failure {
        Failure::of(FailureKind::Deadline, detail)
    }
    /// A request that makes no sense.
    pub fn invalid(detail: &str) -> Failure {
        Failure::of(FailureKind::Invalid, detail.to_owned())
    }

    /// The error, its message starting with `here` (the URL, what was read and its bytes).
    pub fn at(&self, here: &str) -> Error {
        let message = format!("{here}: {}", self.detail);
        match self.kind {
            FailureKind::NotFound => Error::NotFound(message),
            FailureKind::Io => match self.errno {
                Some(errno) => Error::Os { errno, message },
                None => Error::Io(message),
            },
            FailureKind::Deadline => Error::Deadline(message),
            FailureKind::Invalid => Error::InvalidArgument(message),
        }
    }
}

/// The total size from `Content-Range: bytes start-last/total`, if it matches
/// the range asked for (with `upto`, or a shorter one that ends the file).
pub fn parse_content_range(value: &str, start: u64, end: u64, upto: bool) -> Option<u64> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    let total: u64 = total.trim().parse().ok()?;
    let exact = b.checked_add(1) == Some(end) && end <= total;
    let short = upto && b.checked_add(1) == Some(total) && total < end;
    (a == start && a <= b && (exact || short)).then_some(total)
}

/// A safetensors file served over HTTP(S) and its validated header.
pub struct RemoteFile {
    /// The URL it was opened with.
    pub url: String,
    /// The client that reads it.
    pub http: Http,
    /// Its size in bytes.
    pub len: u64,
    /// Its tensors, in file order.
    pub tensors: Vec<TensorInfo>,
}

impl RemoteFile {
    /// Reads the header: one range request of at most [`FIRST_READ`] bytes, a
    /// second only for a longer header (never more than the file's size).
    pub fn open(url: &str, http: Http) -> Result<RemoteFile, Error> {
        let mut first = Vec::new();
        let len = http
            .read_range(url, 0, FIRST_READ, true, &mut |b| {
                first.extend_from_slice(b)
            })
            .map_err(|f| f.at(&format!("{url}: header (bytes [0, {FIRST_READ}))")))?;
        let n = header_len(url, &first, len).map_err(Error::Format)?;
        let json = if 8 + n <= first.len() as u64 {
            first[8..(8 + n) as usize].to_vec()
        } else {
            let mut rest = Vec::with_capacity(n as usize);
            http.read_range(url, 8, 8 + n, false, &mut |b| rest.extend_from_slice(b))
                .map_err(|f| f.at(&format!("{url}: header (bytes [8, {}))", 8 + n)))?;
            rest
        };
        let tensors = parse_header(url, &json, len).map_err(Error::Format)?;
        Ok(RemoteFile {
            url: url.to_owned(),
            http,
            len,
            tensors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_to_one_server_share_its_slots() {
        assert_eq!(
            origin("HTTP://Host:8000/a/b.safetensors"),
            "http://host:8000"
        );
        assert_eq!(origin("https://h?x=1"), "https://h");
        let a = slots_for("http://127.0.0.1:9/a.safetensors");
        let b = slots_for("http://127.0.0.1:9/b/c.safetensors");
        let other = slots_for("http://127.0.0.1:10/a.safetensors");
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &other));
        let taken: Vec<_> = (0..POOL_CONNECTIONS).map(|_| a.take()).collect();
        assert_eq!(
            *lock(&b.free),
            0,
            "the second file sees the first's requests"
        );
        drop(taken);
        assert_eq!(*lock(&b.free), POOL_CONNECTIONS);
    }

    #[test]
    fn content_range_must_match_the_request() {
        assert_eq!(parse_content_range("bytes 0-7/100", 0, 8, false), Some(100));
        assert_eq!(parse_content_range("bytes 0-7/100", 0, 9, false), None);
        assert_eq!(parse_content_range("bytes 1-8/100", 0, 8, false), None);
        assert_eq!(parse_content_range("bytes 0-7/*", 0, 8, false), None);
        assert_eq!(parse_content_range("bytes 0-7/5", 0, 8, false), None);
        assert_eq!(parse_content_range("items 0-7/100", 0, 8, false), None);
        assert_eq!(parse_content_range("bytes 0-49/50", 0, 100, true), Some(50));
        assert_eq!(parse_content_range("bytes 0-49/50", 0, 100, false), None);
        assert_eq!(parse_content_range("bytes 0-48/50", 0, 100, true), None);
    }
}
