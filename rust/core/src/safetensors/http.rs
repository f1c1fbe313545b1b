//! Byte ranges of a file served over HTTP(S): range requests on a small pool
//! of keep-alive connections (ureq's agent, rustls for TLS), each with a
//! deadline for the whole request, retries, and checks of what came back.
//!
//! Plain Rust. Every error names the URL and the byte range.

use super::tls::{Roots, TlsConnector};
use super::{header_len, parse_header_and_metadata, Metadata, TensorInfo, FIRST_READ};
use crate::error::Error;
use crate::sync::{lock, wait_once};
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};
use ureq::unversioned::resolver::DefaultResolver;
use ureq::unversioned::transport::{ConnectProxyConnector, Connector, TcpConnector};
use url::Url;

/// Requests in flight at once to one server (scheme, host and port), whatever
/// file of this process they read, and idle keep-alive connections kept per
/// host by one file's agent: the reads of one file share them. Unbounded, 208 pool
/// workers opened 202 connections at once; a server's listen backlog
/// (Python's `socketserver`: 5) dropped the rest, whose connects then waited
/// out TCP's retransmission backoff (28 s of a 3 s load).
pub const POOL_CONNECTIONS: usize = 8;

/// Set at interpreter exit ([`abandon_reads`]): reads stop at their next
/// chunk, retry or request, so exit need not wait for downloads that hold no
/// Python (its grace is for tasks inside Python or JAX).
static ABANDONED: AtomicBool = AtomicBool::new(false);

/// Makes every read of this process fail at once (interpreter exit): a read
/// blocked in `recv` on a server that sends nothing returns (the agents close
/// their connections), and any other at its next chunk, retry or request.
/// There is no undoing it.
pub fn abandon_reads() {
    ABANDONED.store(true, Ordering::Release);
    let pid = std::process::id();
    for (made_in, agent) in lock(&AGENTS_MADE).drain(..) {
        // A child of fork() shuts down none of its parent's connections.
        if made_in == pid {
            agent.shutdown();
        }
    }
}

fn abandoned() -> bool {
    ABANDONED.load(Ordering::Acquire)
}

const ABANDONED_TEXT: &str = "abandoned at interpreter exit";

/// Why a request stopped before its end when its reader wanted no more.
const DROPPED_TEXT: &str = "dropped: every leaf it was read for was cancelled";

/// Redirects (301, 302, 303, 307, 308) followed from a source's URL; one more
/// fails the read.
pub const MAX_REDIRECTS: usize = 10;

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

/// What identifies the content of a file on its server at one response: its
/// size (the `Content-Range` total), its `ETag` and `Last-Modified`. The
/// header read's version is what every later range must match: a new upload
/// under the same URL (a moved revision) would otherwise give tensors at the
/// old header's offsets of the new file's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// The file's size.
    pub total: u64,
    /// Its `ETag`, if the server sent one.
    pub etag: Option<String>,
    /// Its `Last-Modified`, if the server sent one.
    pub last_modified: Option<String>,
    /// False when the server answered a range request that does not cover
    /// the whole file with the whole file (200): it ignores `Range`.
    pub ranged: bool,
}

impl Version {
    /// Why `now` is not this version's content, or None when nothing says so.
    /// ETags decide where both responses have one; else `Last-Modified`; the
    /// size always.
    pub fn changed(&self, now: &Version) -> Option<String> {
        let what = if self.total != now.total {
            format!("its size was {} bytes, now {}", self.total, now.total)
        } else if let (Some(a), Some(b)) = (&self.etag, &now.etag) {
            if a == b {
                return None;
            }
            format!("its ETag was {a}, now {b}")
        } else if let (Some(a), Some(b)) = (&self.last_modified, &now.last_modified) {
            if a == b {
                return None;
            }
            format!("its Last-Modified was {a:?}, now {b:?}")
        } else {
            return None;
        };
        Some(changed_text(&what))
    }

    /// The `If-Match` value that makes the server refuse (412) a changed file:
    /// only a strong ETag (weak ones never match under `If-Match`).
    fn if_match(&self) -> Option<&str> {
        self.etag.as_deref().filter(|e| !e.starts_with("W/"))
    }
}

fn changed_text(what: &str) -> String {
    format!(
        "the file changed on the server since its header was read ({what}); no tensor is          read from a file whose offsets may have moved: load it again"
    )
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
fn root_certs() -> Result<Roots, Error> {
    let Some(path) = std::env::var_os("SSL_CERT_FILE") else {
        return Ok(Roots::Mozilla);
    };
    let pem = std::fs::read(&path)
        .map_err(|e| Error::Io(format!("SSL_CERT_FILE={}: {e}", path.to_string_lossy())))?;
    let certs = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c.der().to_vec().into())),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Io(format!("SSL_CERT_FILE={}: {e}", path.to_string_lossy())))?;
    Ok(Roots::User(certs))
}

/// The process's one agent, so that its idle connections (at most
/// [`POOL_CONNECTIONS`] per server) serve every load: an agent per load kept
/// its own, and concurrent loads held 632 open at a server at once. It is
/// made again when `SSL_CERT_FILE` names another file, and in a child of
/// `fork()`, whose inherited connections are its parent's: they are
/// forgotten there, never used nor closed (a TLS close would reach the
/// parent's peer).
fn shared_agent() -> Result<ureq::Agent, Error> {
    type Made = (Option<std::ffi::OsString>, u32, ureq::Agent);
    static AGENT: Mutex<Option<Made>> = Mutex::new(None);
    let certs = std::env::var_os("SSL_CERT_FILE");
    let pid = std::process::id();
    let mut held = lock(&AGENT);
    if let Some((made_for, made_in, agent)) = held.as_ref() {
        if *made_in != pid {
            std::mem::forget(held.take());
        } else if *made_for == certs {
            return Ok(agent.clone());
        }
    }
    let tls = TlsConnector::new(root_certs()?)
        .map_err(|e| Error::Io(format!("TLS could not be set up: {e}")))?;
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        // Redirects are followed by `Http::send`: it learns the final
        // location (reused by later reads) and drops a source's headers
        // on the way to another server.
        .max_redirects(0)
        .max_idle_connections_per_host(POOL_CONNECTIONS)
        .max_idle_connections(4 * POOL_CONNECTIONS)
        .build();
    // ureq's own chain (CONNECT proxies, TCP) with our TLS in place of its own.
    let connector =
        ().chain(ConnectProxyConnector::default())
            .chain(TcpConnector::default())
            .chain(tls);
    let agent = ureq::Agent::with_parts(config, connector, DefaultResolver::default());
    *held = Some((certs, pid, agent.clone()));
    lock(&AGENTS_MADE).push((pid, agent.clone()));
    Ok(agent)
}

/// Every agent [`shared_agent`] made in this process (one unless
/// `SSL_CERT_FILE` changed), with the pid that made it: [`abandon_reads`]
/// shuts down their connections, in use or idle.
static AGENTS_MADE: Mutex<Vec<(u32, ureq::Agent)>> = Mutex::new(Vec::new());

/// Headers only the caller can make for a source (a token), asked for before
/// its first request and once more after a 401 or 403 (a token refresh).
pub trait Credentials: Send + Sync {
    /// The headers of requests for `url` (the source's URL as given).
    fn headers(&self, url: &str) -> Result<Vec<(String, String)>, Failure>;
}

/// One source over HTTP(S): the URL it was given, the headers its requests
/// carry (fixed ones and those of its [`Credentials`]), sent to that URL's
/// server (scheme, host and port) only, never to a redirect target on
/// another, and the location its redirects last led to, where its later
/// reads go first.
pub struct Target {
    /// The URL as given (normalized: `HTTP://Host` is `http://host/`):
    /// where every redirect chain starts.
    pub url: String,
    origin: url::Origin,
    headers: Vec<(String, String)>,
    credentials: Option<Arc<dyn Credentials>>,
    state: Mutex<TargetState>,
}

#[derive(Default)]
struct TargetState {
    /// Where the redirects from `url` led (None: nowhere else).
    location: Option<String>,
    /// The headers of the credentials, once asked for.
    auth: Option<Vec<(String, String)>>,
    /// How many times they were asked for.
    generation: u64,
}

impl Target {
    /// A source at `url` whose requests carry `headers` and those of `credentials`.
    pub fn new(
        url: &str,
        headers: Vec<(String, String)>,
        credentials: Option<Arc<dyn Credentials>>,
    ) -> Result<Target, Error> {
        let parsed = Url::parse(url)
            .map_err(|e| Error::InvalidArgument(format!("{url}: not a valid URL ({e})")))?;
        Ok(Target {
            // As the url crate writes it, as every location is compared.
            url: parsed.as_str().to_owned(),
            origin: parsed.origin(),
            headers,
            credentials,
            state: Mutex::new(TargetState::default()),
        })
    }

    /// A source at `url` with no headers of its own.
    pub fn plain(url: &str) -> Result<Target, Error> {
        Target::new(url, Vec::new(), None)
    }

    /// Where a read goes first: the last redirects' end, else the URL.
    fn start(&self) -> String {
        lock(&self.state)
            .location
            .clone()
            .unwrap_or_else(|| self.url.clone())
    }

    fn remember(&self, location: &str) {
        let mut state = lock(&self.state);
        state.location = (location != self.url).then(|| location.to_owned());
    }

    /// Forgets `location` (it refused a read): the next read starts at the URL.
    fn forget(&self, location: &str) {
        let mut state = lock(&self.state);
        if state.location.as_deref() == Some(location) {
            state.location = None;
        }
    }

    /// Whether `url` is on the source's server, where its headers may go.
    fn same_server(&self, url: &Url) -> bool {
        url.origin() == self.origin
    }

    /// The headers for the source's server, and which credentials they hold.
    /// The credentials are asked for (no lock held) the first time.
    fn headers(&self) -> Result<(Vec<(String, String)>, u64), Failure> {
        let Some(credentials) = &self.credentials else {
            return Ok((self.headers.clone(), 0));
        };
        let (auth, generation) = {
            let state = lock(&self.state);
            (state.auth.clone(), state.generation)
        };
        let auth = match auth {
            Some(auth) => auth,
            None => {
                let fresh = credentials.headers(&self.url)?;
                let mut state = lock(&self.state);
                if state.generation == generation {
                    state.auth = Some(fresh);
                    state.generation += 1;
                }
                drop(state);
                return self.headers();
            }
        };
        Ok((merged(&self.headers, &auth), generation))
    }

    /// Asks for the credentials again after a 401 or 403, unless another read
    /// did since `seen` was used.
    fn refresh(&self, seen: u64) -> Result<(), Failure> {
        let Some(credentials) = &self.credentials else {
            return Ok(());
        };
        if lock(&self.state).generation != seen {
            return Ok(());
        }
        let fresh = credentials.headers(&self.url)?;
        let mut state = lock(&self.state);
        if state.generation == seen {
            state.auth = Some(fresh);
            state.generation += 1;
        }
        Ok(())
    }
}

/// `fixed`, with the names of `over` replaced by its values (names compared
/// without case), then `over`.
fn merged(fixed: &[(String, String)], over: &[(String, String)]) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = fixed
        .iter()
        .filter(|(name, _)| !over.iter().any(|(o, _)| o.eq_ignore_ascii_case(name)))
        .cloned()
        .collect();
    all.extend(over.iter().cloned());
    all
}

/// `url` as messages show it: without its query and fragment (a signed URL's
/// signature) and without a user or password.
fn shown(url: &Url) -> String {
    let mut url = url.clone();
    url.set_query(None);
    url.set_fragment(None);
    let _ = url.set_username("");
    let _ = url.set_password(None);
    url.to_string()
}

impl Http {
    /// A client with a request `timeout` and `retries`; fails when TLS cannot be set up.
    pub fn new(timeout: Option<Duration>, retries: u32) -> Result<Http, Error> {
        let agent = shared_agent()?;
        Ok(Http {
            agent,
            timeout,
            retries,
        })
    }

    /// Reads bytes `[start, end)` of `target`, passing them in order to `sink`
    /// (which returns false once it wants no more: the request is dropped),
    /// once fewer than [`POOL_CONNECTIONS`] requests to its server are in flight (all files of this process),
    /// retrying connection errors, a connection lost mid-body (the next
    /// attempt asks only for the bytes not yet received) and 5xx, with
    /// exponential backoff. Returns the file's [`Version`] (its total size
    /// from `Content-Range`). With `expect` (the header read's version), a
    /// response of another version fails the read (and `If-Match` asks the
    /// server to refuse one). The caller names the read: a [`Failure`]
    /// carries only what went wrong.
    ///
    /// Redirects are followed (at most [`MAX_REDIRECTS`]) from where the
    /// target's last read ended; a 403, 404 or 410 there (an expired signed
    /// URL) sends the read back to the target's URL, once. A 401 or 403 asks
    /// the target's credentials again, once, and the request is made again
    /// with them. A server that ignores `Range` (200 with the whole file) is
    /// read from byte 0, the bytes before `start` dropped.
    ///
    /// With `upto`, a file shorter than `end` is no error: the server's
    /// shorter range (`bytes start-(size-1)/size`) is read (a header's first read).
    #[allow(clippy::too_many_arguments)]
    pub fn read_range(
        &self,
        target: &Target,
        start: u64,
        end: u64,
        upto: bool,
        expect: Option<&Version>,
        sink: &mut dyn FnMut(&[u8]) -> bool,
    ) -> Result<Version, Failure> {
        if end <= start {
            return Err(Failure::invalid("an empty range cannot be requested"));
        }
        // The deadline starts once the request may start: a load of many
        // reads queues them here, not against each one's timeout.
        let slots = slots_for(&target.start());
        let _slot = slots.take();
        let deadline = self.timeout.and_then(|t| Instant::now().checked_add(t));
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 0;
        let mut got = 0u64;
        let (mut end, mut upto) = (end, upto);
        let (mut resolved_again, mut refreshed) = (false, false);
        loop {
            let from = start + got;
            let location = target.start();
            let result = self.attempt(
                target, &location, from, end, upto, expect, deadline, &mut got, sink,
            );
            match result {
                Ok(total) => return Ok(total),
                Err(Attempt::Fatal(f)) => return Err(f),
                Err(Attempt::Refused { status, generation }) => {
                    let moved = location != target.url;
                    if moved && matches!(status, 403 | 404 | 410) && !resolved_again {
                        // The redirect's target is gone or refuses now (a signed
                        // URL expired): ask the source's URL where it is now.
                        resolved_again = true;
                        target.forget(&location);
                    } else if matches!(status, 401 | 403)
                        && target.credentials.is_some()
                        && !refreshed
                    {
                        refreshed = true;
                        target.refresh(generation)?;
                    } else {
                        return Err(refused(status));
                    }
                }
                Err(Attempt::Retry {
                    detail,
                    errno,
                    total,
                    after,
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
                    // The server's Retry-After (429, 503) rules over the backoff.
                    let pause = after.unwrap_or(backoff);
                    let now = Instant::now();
                    if deadline.is_some_and(|d| now + pause >= d) {
                        let asked = match after {
                            Some(a) => format!(" (it asks for {} s first)", a.as_secs_f64()),
                            None => String::new(),
                        };
                        return Err(Failure::deadline(format!(
                            "{detail}; no time left for a retry{asked} within the {} s timeout",
                            self.timeout.unwrap_or_default().as_secs_f64()
                        )));
                    }
                    // In slices, so that exit need not wait out a long Retry-After.
                    let until = now + pause;
                    while !abandoned() {
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        std::thread::sleep(left.min(Duration::from_millis(50)));
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    attempt += 1;
                }
            }
        }
    }

    /// A GET of `from` with `range` (and `If-Match`), following redirects
    /// (the target's headers only to its own server); the response, and the
    /// URL that gave it.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        target: &Target,
        from: &str,
        range: &str,
        if_match: Option<&str>,
        headers: &[(String, String)],
        deadline: Option<Instant>,
    ) -> Result<(ureq::http::Response<ureq::Body>, String), Attempt> {
        let retry = |detail: String, errno: Option<i32>| Attempt::Retry {
            detail,
            errno,
            total: None,
            after: None,
        };
        let mut url = Url::parse(from).map_err(|e| {
            Attempt::Fatal(Failure::invalid(&format!(
                "{} is not a valid URL ({e})",
                target.url
            )))
        })?;
        let mut seen: Vec<Url> = Vec::new();
        loop {
            let left = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return Err(self.timed_out()),
                },
            };
            let mut request = self.agent.get(url.as_str()).header("Range", range);
            if let Some(etag) = if_match {
                request = request.header("If-Match", etag);
            }
            if target.same_server(&url) {
                for (name, value) in headers {
                    request = request.header(name, value);
                }
            }
            let mut response = match request.config().timeout_global(left).build().call() {
                Ok(r) => r,
                Err(ureq::Error::Timeout(_)) => return Err(self.timed_out()),
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
                // Never a header's value: ureq's errors name what was wrong, not the value.
                Err(e) => return Err(Attempt::Fatal(Failure::io(e.to_string()))),
            };
            let status = response.status().as_u16();
            if !matches!(status, 301 | 302 | 303 | 307 | 308) {
                return Ok((response, url.into()));
            }
            drain(&mut response);
            let location = response
                .headers()
                .get("location")
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| {
                    Attempt::Fatal(Failure::io(format!(
                        "HTTP {status} (a redirect) from {} without a Location",
                        shown(&url)
                    )))
                })?;
            let next = url
                .join(location)
                .ok()
                .filter(|u| matches!(u.scheme(), "http" | "https"))
                .ok_or_else(|| {
                    Attempt::Fatal(Failure::io(format!(
                        "HTTP {status} from {} redirects to {:?}, not an http(s) URL",
                        shown(&url),
                        location.chars().take(200).collect::<String>()
                    )))
                })?;
            seen.push(std::mem::replace(&mut url, next));
            if seen.contains(&url) {
                return Err(Attempt::Fatal(Failure::io(format!(
                    "a redirect loop: {} redirects back to {} ({} redirects)",
                    shown(&seen[seen.len() - 1]),
                    shown(&url),
                    seen.len()
                ))));
            }
            if seen.len() > MAX_REDIRECTS {
                return Err(Attempt::Fatal(Failure::io(format!(
                    "more than {MAX_REDIRECTS} redirects (the last to {})",
                    shown(&url)
                ))));
            }
        }
    }

    fn timed_out(&self) -> Attempt {
        Attempt::Fatal(Failure::deadline(format!(
            "not finished within the {} s timeout",
            self.timeout.unwrap_or_default().as_secs_f64()
        )))
    }

    /// One request for bytes `[start, end)` from `location`; `got` counts the bytes passed to
    /// `sink` (across attempts: the caller resumes after them).
    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &self,
        target: &Target,
        location: &str,
        start: u64,
        mut end: u64,
        upto: bool,
        expect: Option<&Version>,
        deadline: Option<Instant>,
        got: &mut u64,
        sink: &mut dyn FnMut(&[u8]) -> bool,
    ) -> Result<Version, Attempt> {
        let timed_out = || self.timed_out();
        if abandoned() {
            return Err(Attempt::Fatal(Failure::io(ABANDONED_TEXT.into())));
        }
        let retry = |detail: String, errno: Option<i32>| Attempt::Retry {
            detail,
            errno,
            total: None,
            after: None,
        };
        let (headers, generation) = target.headers().map_err(Attempt::Fatal)?;
        let (mut response, reached) = self.send(
            target,
            location,
            &format!("bytes={start}-{}", end - 1),
            expect.and_then(Version::if_match),
            &headers,
            deadline,
        )?;
        let status = response.status().as_u16();
        let content_length = response
            .headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        // A 200 to a range from byte 0 that covers the whole file is the
        // file itself (RFC 9110 lets a server answer so).
        let whole = status == 200
            && start == 0
            && content_length.is_some_and(|n| n > 0 && n <= end && (upto || n == end));
        match status {
            206 => {}
            // The whole file, from a server that ignores Range: read from
            // byte 0, the bytes before `start` dropped.
            200 if content_length.is_some() => {}
            429 | 503 => {
                let after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| retry_after(v, std::time::SystemTime::now()));
                let what = if status == 429 {
                    "too many requests"
                } else {
                    "server error"
                };
                return Err(Attempt::Retry {
                    detail: format!("HTTP {status} ({what})"),
                    errno: None,
                    total: None,
                    after,
                });
            }
            401 | 403 | 404 | 410 => {
                drain(&mut response);
                return Err(Attempt::Refused { status, generation });
            }
            500..=599 => return Err(retry(format!("HTTP {status} (server error)"), None)),
            412 => {
                return Err(Attempt::Fatal(Failure::io(changed_text(
                    "HTTP 412: its ETag no longer matches",
                ))))
            }
            200 => {
                return Err(Attempt::Fatal(Failure::io(
                    "HTTP 200 without a Content-Length: the server ignored the Range \
                     request, and the file's size is unknown"
                        .into(),
                )))
            }
            _ => {
                return Err(Attempt::Fatal(Failure::io(format!(
                    "HTTP {status} (expected 206 Partial Content)"
                ))))
            }
        }
        target.remember(&reached);
        let headers = response.headers();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let content_range = header("content-range");
        let total = match content_length {
            Some(n) if status == 200 => Some(n),
            _ => content_range
                .as_deref()
                .and_then(|v| parse_content_range(v, start, end, upto)),
        };
        let total = total.ok_or_else(|| {
            Attempt::Fatal(Failure::io(format!(
                "wrong Content-Range {:?} (expected \"bytes {start}-{}/<size>\")",
                content_range.as_deref().unwrap_or("(none)"),
                end - 1
            )))
        })?;
        let version = Version {
            total,
            etag: header("etag"),
            last_modified: header("last-modified"),
            ranged: status == 206 || whole,
        };
        if let Some(why) = expect.and_then(|e| e.changed(&version)) {
            return Err(Attempt::Fatal(Failure::io(why)));
        }
        end = end.min(total);
        if start >= end {
            return Err(Attempt::Fatal(Failure::io(format!(
                "the file is {total} bytes, shorter than the range asked for"
            ))));
        }
        if status == 206 {
            if let Some(length) = header("content-length") {
                if length.trim().parse::<u64>().ok() != Some(end - start) {
                    return Err(Attempt::Fatal(Failure::io(format!(
                        "wrong Content-Length {length:?} (expected {})",
                        end - start
                    ))));
                }
            }
        }
        // A 200's body is the file from byte 0: its first `start` bytes are dropped.
        let skip = if status == 200 { start } else { 0 };
        let mut reader = response
            .body_mut()
            .with_config()
            .limit(skip + (end - start))
            .reader();
        let origin = start - *got; // the first byte the caller asked for
        let wanted = end - origin;
        let mut chunk = vec![0u8; 256 * 1024];
        let mut skipped = 0u64;
        let mut here = 0u64;
        // The connection ended before the body did: retried, asking for the rest.
        let cut = |got: u64, cause: String, errno: Option<i32>| Attempt::Retry {
            detail: format!("truncated body: {got} of {wanted} bytes received{cause}"),
            errno,
            total: Some(total),
            after: None,
        };
        while here < end - start {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(timed_out());
            }
            if abandoned() {
                return Err(Attempt::Fatal(Failure::io(ABANDONED_TEXT.into())));
            }
            let want = if skipped < skip {
                ((skip - skipped) as usize).min(chunk.len())
            } else {
                ((end - start - here) as usize).min(chunk.len())
            };
            match reader.read(&mut chunk[..want]) {
                Ok(0) => return Err(cut(*got, String::new(), None)),
                Ok(n) if skipped < skip => skipped += n as u64,
                Ok(n) => {
                    here += n as u64;
                    *got += n as u64;
                    if !sink(&chunk[..n]) && here < end - start {
                        // Nobody wants the rest (its leaves were cancelled):
                        // dropping the response closes the connection.
                        return Err(Attempt::Fatal(Failure::io(DROPPED_TEXT.into())));
                    }
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
        if status == 206 || Some(skip + end - start) == content_length {
            // Read to the end of the body (no bytes left): only then does ureq
            // give the connection back to its pool for the next request. (A
            // 200 with more of the file after the range is dropped unread:
            // its connection closes.)
            let _ = reader.read(&mut chunk[..1]);
        }
        Ok(version)
    }
}

/// Reads a short body to its end, so that its connection serves the next
/// request (a redirect's, a refusal's); a long one is left, and its
/// connection closed.
fn drain(response: &mut ureq::http::Response<ureq::Body>) {
    let _ = response
        .body_mut()
        .with_config()
        .limit(64 * 1024)
        .read_to_vec();
}

/// The failure of a read that a server refused with `status`.
fn refused(status: u16) -> Failure {
    match status {
        401 => Failure::denied("HTTP 401 (unauthorized: credentials missing or refused)".into()),
        403 => Failure::denied("HTTP 403 (forbidden)".into()),
        _ => Failure::not_found(format!("HTTP {status} (not found)")),
    }
}

enum Attempt {
    /// A connection error, a body cut short, or a 5xx: the message, and the
    /// file's size when the response gave it.
    Retry {
        detail: String,
        errno: Option<i32>,
        total: Option<u64>,
        /// How long the server asked to wait (`Retry-After`), if it did.
        after: Option<Duration>,
    },
    /// A 401, 403, 404 or 410, and which credentials the request carried:
    /// the caller decides whether to ask the URL again or the credentials.
    Refused {
        status: u16,
        generation: u64,
    },
    Fatal(Failure),
}

/// What kind of failure a read met (which Python exception it becomes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The file is not there (404, 410).
    NotFound,
    /// The server refused the request (401, 403).
    Denied,
    /// A value of the wrong type (what credentials returned).
    WrongType,
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
    /// A request the server refused (401, 403).
    pub fn denied(detail: String) -> Failure {
        Failure::of(FailureKind::Denied, detail)
    }
    /// A value of the wrong type.
    pub fn wrong_type(detail: String) -> Failure {
        Failure::of(FailureKind::WrongType, detail)
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
            FailureKind::Denied => Error::Denied(message),
            FailureKind::WrongType => Error::WrongType(message),
            FailureKind::Io => match self.errno {
                Some(errno) => Error::Os { errno, message },
                None => Error::Io(message),
            },
            FailureKind::Deadline => Error::Deadline(message),
            FailureKind::Invalid => Error::InvalidArgument(message),
        }
    }
}

/// The wait a `Retry-After` value asks for at `now`: delay-seconds, or an
/// HTTP date (then the time until it; a date past is no wait).
fn retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(now).unwrap_or_default())
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
    /// How messages name it: its URL, or the name the caller gave it
    /// (`hf://org/repo/model.safetensors`).
    pub name: String,
    /// Where it is, the headers its requests carry and where its redirects led.
    pub target: Target,
    /// The client that reads it.
    pub http: Http,
    /// Its size in bytes.
    pub len: u64,
    /// Its tensors, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Its header's `__metadata__`.
    pub metadata: Metadata,
    /// The file as its header was read: every tensor read must match it.
    pub version: Version,
}

impl RemoteFile {
    /// Reads the header: one range request of at most [`FIRST_READ`] bytes, a
    /// second only for a longer header (never more than the file's size).
    /// Errors name the file by `name`.
    pub fn open(target: Target, name: &str, http: Http) -> Result<RemoteFile, Error> {
        let mut first = Vec::new();
        let version = http
            .read_range(&target, 0, FIRST_READ, true, None, &mut |b| {
                first.extend_from_slice(b);
                true
            })
            .map_err(|f| f.at(&format!("{name}: header (bytes [0, {FIRST_READ}))")))?;
        let len = version.total;
        let n = header_len(name, &first, len).map_err(Error::Format)?;
        let json = if 8 + n <= first.len() as u64 {
            first[8..(8 + n) as usize].to_vec()
        } else {
            let mut rest = Vec::with_capacity(n as usize);
            http.read_range(&target, 8, 8 + n, false, Some(&version), &mut |b| {
                rest.extend_from_slice(b);
                true
            })
            .map_err(|f| f.at(&format!("{name}: header (bytes [8, {}))", 8 + n)))?;
            rest
        };
        let (tensors, metadata) =
            parse_header_and_metadata(name, &json, len).map_err(Error::Format)?;
        Ok(RemoteFile {
            name: name.to_owned(),
            target,
            http,
            len,
            tensors,
            metadata,
            version,
        })
    }

    /// Whether its server answers range requests (else each read streams
    /// the file from its first byte).
    pub fn ranged(&self) -> bool {
        self.version.ranged
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
    fn a_version_changes_by_size_then_etag_then_last_modified() {
        let v = |total, etag: Option<&str>, modified: Option<&str>| Version {
            total,
            etag: etag.map(str::to_owned),
            last_modified: modified.map(str::to_owned),
            ranged: true,
        };
        let base = v(100, Some("\"a\""), Some("Mon"));
        assert_eq!(base.changed(&base), None);
        let size = base.changed(&v(164, Some("\"a\""), Some("Mon"))).unwrap();
        assert!(size.contains("its size was 100 bytes, now 164"), "{size}");
        let etag = base.changed(&v(100, Some("\"b\""), Some("Mon"))).unwrap();
        assert!(etag.contains("its ETag was \"a\", now \"b\""), "{etag}");
        // Equal ETags decide: another Last-Modified alone is no change.
        assert_eq!(base.changed(&v(100, Some("\"a\""), Some("Tue"))), None);
        let modified = v(100, None, Some("Mon")).changed(&v(100, None, Some("Tue")));
        assert!(modified
            .unwrap()
            .contains("its Last-Modified was \"Mon\", now \"Tue\""));
        // Nothing to compare but the size: no change seen.
        assert_eq!(
            v(100, None, None).changed(&v(100, Some("\"b\""), None)),
            None
        );
        assert_eq!(base.if_match(), Some("\"a\""));
        assert_eq!(v(1, Some("W/\"a\""), None).if_match(), None);
    }

    #[test]
    fn headers_go_to_the_sources_server_only() {
        let target = Target::new(
            "http://Host:8000/a/model.safetensors?x=1",
            vec![("X-Key".into(), "k".into())],
            None,
        )
        .unwrap();
        let on = |u: &str| target.same_server(&Url::parse(u).unwrap());
        assert!(on("http://host:8000/b"));
        assert!(!on("http://host:8001/a/model.safetensors"));
        assert!(!on("https://host:8000/a/model.safetensors"));
        assert!(!on("http://cdn:8000/a/model.safetensors"));
        assert!(Target::plain("not a url").is_err());
        // Kept as every location reached is written, so that reaching it is not a move.
        assert_eq!(
            Target::plain("HTTP://Origin:80/m").unwrap().url,
            "http://origin/m"
        );
    }

    #[test]
    fn a_location_is_reused_until_it_is_forgotten() {
        let target = Target::plain("http://origin/m").unwrap();
        assert_eq!(target.start(), "http://origin/m");
        target.remember("http://cdn/m?sig=1");
        assert_eq!(target.start(), "http://cdn/m?sig=1");
        target.forget("http://cdn/other");
        assert_eq!(target.start(), "http://cdn/m?sig=1");
        target.forget("http://cdn/m?sig=1");
        assert_eq!(target.start(), "http://origin/m");
    }

    #[test]
    fn credentials_override_fixed_headers_of_the_same_name() {
        let fixed = vec![
            ("Authorization".into(), "a".into()),
            ("X".into(), "x".into()),
        ];
        let over = vec![("authorization".into(), "b".into())];
        let all = merged(&fixed, &over);
        assert_eq!(
            all,
            vec![
                ("X".into(), "x".into()),
                ("authorization".into(), "b".into())
            ]
        );
    }

    #[test]
    fn a_url_is_shown_without_its_query_or_user() {
        let url = Url::parse("https://u:p@cdn.example/f?X-Amz-Signature=s#x").unwrap();
        assert_eq!(shown(&url), "https://cdn.example/f");
    }

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(" 0 ", now), Some(Duration::ZERO));
        // A date ahead asks for the time until it (any of the three forms); one past for none.
        for ahead in [
            "Sun, 06 Nov 1994 08:50:37 GMT",
            "Sunday, 06-Nov-94 08:50:37 GMT",
            "Sun Nov  6 08:50:37 1994",
        ] {
            assert_eq!(
                retry_after(ahead, now),
                Some(Duration::from_secs(60)),
                "{ahead}"
            );
        }
        assert_eq!(
            retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after("soon", now), None);
        assert_eq!(retry_after("-1", now), None);
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
