//! Who is asking. A tenant is named by its API key (`[[tenants]]` in serve.toml, or
//! `--api-key` for one); with no keys configured the server runs open, and each client
//! address is an anonymous tenant of its own (the forwarded address when the peer is a
//! trusted proxy). The tenant decides what a request may use (plugins, models), its
//! quotas (requests in progress, queue places, requests and tokens per minute), its share
//! of admission and of a batch's steps (weight, priority) and which cache its prompts may reuse (the run's
//! group starts with the tenant's name).
//!
//! A key is kept only as its SHA-256 digest and compared with every tenant's in constant
//! time. It never reaches a log line, a metric, an error or a plugin: the plugin sees the
//! tenant's name alone (`x-llamabox-tenant`), and the credential headers are removed from
//! its request.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderMap;
use ipnet::IpNet;
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

/// The header that tells a plugin which tenant its request is from (set by the server;
/// a client's own is removed).
pub const TENANT_HEADER: &str = "x-llamabox-tenant";

/// One `[[tenants]]` entry. Exactly one of `key`, `key_file` and `key_sha256`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Letters, digits, `-`, `_` and `.`: it names the tenant in logs, metrics, the
    /// plugin's header and the cache's group.
    pub name: String,
    /// The key itself (prefer `key_file` or `key_sha256`: a config file is often read by
    /// more people than a secret should be).
    pub key: Option<String>,
    /// A file holding the key (surrounding whitespace ignored), e.g. a mounted Secret.
    pub key_file: Option<PathBuf>,
    /// The key's SHA-256, in hex: the server never holds the key itself.
    pub key_sha256: Option<String>,
    /// Plugins it may call, by name (default: all).
    pub plugins: Option<Vec<String>>,
    /// Models and projectors its requests may open (default: all its plugins may).
    pub models: Option<Vec<String>>,
    /// Its share against other waiting tenants (default 1): with weights 1 and 3, the
    /// second gets three requests in, and three prompt rows of a batch's steps, for
    /// every one of the first.
    #[serde(default = "one")]
    pub weight: u32,
    /// Its class (default 0): a waiting request, and a prompt's rows in a batch, of a
    /// higher class go first.
    #[serde(default)]
    pub priority: u8,
    /// Requests in progress at once (from the request head to the end of its run);
    /// one more: 429.
    pub max_concurrent: Option<u32>,
    /// Places in the server's queue (default: a quarter of `max_queue`, at least 1);
    /// one more waiting request: 429.
    pub max_queued: Option<u32>,
    /// Requests it may start per minute (a bucket that refills evenly); over it: 429.
    pub requests_per_minute: Option<u32>,
    /// Tokens (prompt plus completion, counted when each request ends) per minute; while
    /// they are spent, new requests get 429.
    pub tokens_per_minute: Option<u64>,
}

fn one() -> u32 {
    1
}

impl TenantConfig {
    /// A tenant with no key yet, every plugin and model, weight 1 and no quotas: what
    /// `--api-key` makes.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.into(),
            key: None,
            key_file: None,
            key_sha256: None,
            plugins: None,
            models: None,
            weight: 1,
            priority: 0,
            max_concurrent: None,
            max_queued: None,
            requests_per_minute: None,
            tokens_per_minute: None,
        }
    }
}

/// A tenant as the server knows it while it runs.
#[derive(Debug)]
pub struct Tenant {
    /// Its name in the config; for an anonymous tenant, its client's address.
    pub name: Arc<str>,
    /// Keyed tenants only: anonymous ones are per address.
    digest: Option<[u8; 32]>,
    /// Its share of admission and of a batch's prompt rows (at least 1).
    pub weight: u32,
    /// Its class: a waiting request, and a prompt's rows in a batch, of a higher class
    /// go first.
    pub priority: u8,
    /// Plugins it may call, by name; `None`: all.
    pub plugins: Option<HashSet<String>>,
    /// Models and projectors its requests may open; `None`: all its plugins may.
    pub models: Option<Vec<String>>,
    /// Places it may hold in the server's queue.
    pub max_queued: u32,
    max_concurrent: Option<u32>,
    in_progress: Arc<AtomicU32>,
    /// Its requests-per-minute budget, if it has one.
    pub requests: Option<Bucket>,
    /// Its tokens-per-minute budget, if it has one.
    pub tokens: Option<Bucket>,
    /// The label its metrics carry: its name, or `anonymous` (labels stay few).
    pub label: Arc<str>,
}

/// Every tenant, and how to tell who a request is from.
#[derive(Debug)]
pub struct Tenants {
    keyed: Vec<Arc<Tenant>>,
    trusted_proxies: Vec<IpNet>,
    /// An anonymous tenant's queue places.
    anonymous_queued: u32,
    /// `metrics_key`'s digest: `/metrics` is the operator's, no tenant's.
    metrics_key: Option<[u8; 32]>,
    /// `admin_key`'s digest: reloading is the operator's.
    admin_key: Option<[u8; 32]>,
}

/// Why a request has no tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unauthorized {
    /// Neither `authorization: Bearer` nor `x-api-key`.
    NoKey,
    /// A key no tenant has.
    WrongKey,
}

/// Why a tenant's request is refused by its own quota (429).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverQuota {
    /// It has its `max_concurrent` requests in progress already (the number).
    Concurrent(u32),
    /// A per-minute budget is spent: `what` is `requests` or `tokens` (OpenAI's 429
    /// `type`).
    PerMinute {
        /// Which budget: `requests` or `tokens`.
        what: &'static str,
        /// The budget's size per minute.
        per_minute: u64,
        /// How long until the budget allows a request again.
        retry_after: Duration,
    },
}

/// A request's place among its tenant's requests in progress; given back when dropped.
#[derive(Debug)]
pub struct InProgress(Option<Arc<AtomicU32>>);

impl Drop for InProgress {
    fn drop(&mut self) {
        if let Some(count) = &self.0 {
            count.fetch_sub(1, Relaxed);
        }
    }
}

impl Tenants {
    /// From the config's `[[tenants]]` (keys read and hashed here) and
    /// `trusted_proxies`; `max_queue` is the server's, for the default queue share.
    pub fn new(
        configs: &[TenantConfig],
        trusted_proxies: &[String],
        max_queue: u32,
        metrics_key: Option<&str>,
        admin_key: Option<&str>,
    ) -> anyhow::Result<Self> {
        let default_queued = (max_queue / 4).max(1);
        let mut names = HashSet::new();
        let mut digests = HashSet::new();
        let mut keyed = Vec::new();
        for config in configs {
            let name = config.name.as_str();
            check_name(name)?;
            anyhow::ensure!(names.insert(name), "tenant {name:?} is declared twice");
            let digest = key_digest(config)?;
            anyhow::ensure!(digests.insert(digest), "tenant {name:?} has another tenant's key");
            anyhow::ensure!(config.weight >= 1, "tenant {name:?}: weight must be at least 1");
            anyhow::ensure!(
                config.max_concurrent != Some(0)
                    && config.max_queued != Some(0)
                    && config.requests_per_minute != Some(0)
                    && config.tokens_per_minute != Some(0),
                "tenant {name:?}: a quota of 0 would refuse everything (leave it out for none)"
            );
            keyed.push(Arc::new(Tenant {
                name: name.into(),
                label: name.into(),
                digest: Some(digest),
                weight: config.weight,
                priority: config.priority,
                plugins: config.plugins.as_ref().map(|p| p.iter().cloned().collect()),
                models: config.models.clone(),
                max_queued: config.max_queued.unwrap_or(default_queued),
                max_concurrent: config.max_concurrent,
                in_progress: Arc::new(AtomicU32::new(0)),
                requests: config.requests_per_minute.map(|n| Bucket::per_minute(f64::from(n))),
                tokens: config.tokens_per_minute.map(|n| Bucket::per_minute(n as f64)),
            }));
        }
        let trusted_proxies = trusted_proxies
            .iter()
            .map(|s| parse_net(s).map_err(|e| anyhow::anyhow!("trusted_proxies: {s:?}: {e}")))
            .collect::<anyhow::Result<_>>()?;
        let metrics_key = metrics_key.map(|key| digest(key.trim()));
        anyhow::ensure!(
            metrics_key.is_none_or(|key| !digests.contains(&key)),
            "metrics_key is a tenant's key"
        );
        let admin_key = admin_key.map(|key| digest(key.trim()));
        anyhow::ensure!(
            admin_key.is_none_or(|key| !digests.contains(&key)),
            "admin_key is a tenant's key"
        );
        Ok(Self {
            keyed,
            trusted_proxies,
            anonymous_queued: default_queued,
            metrics_key,
            admin_key,
        })
    }

    /// Whether keys are required (else the server is open).
    pub fn keyed(&self) -> bool {
        !self.keyed.is_empty()
    }

    /// The configured tenants, for the plugins' per-tenant model sets.
    pub fn all(&self) -> &[Arc<Tenant>] {
        &self.keyed
    }

    /// Who sent a request with `headers` over a connection from `peer`: the tenant whose
    /// key it presents, or (open mode) the anonymous tenant of its client address.
    pub fn identify(&self, headers: &HeaderMap, peer: IpAddr) -> Result<Arc<Tenant>, Unauthorized> {
        if self.keyed.is_empty() {
            return Ok(self.anonymous(self.client_address(headers, peer)));
        }
        let key = digest(presented_key(headers).ok_or(Unauthorized::NoKey)?);
        // Every tenant's digest is compared, each in constant time, whichever matches:
        // how long it takes says nothing about which key is close to which.
        let mut found = None;
        for tenant in &self.keyed {
            if tenant.digest.is_some_and(|d| same(&d, &key)) {
                found = Some(tenant.clone());
            }
        }
        found.ok_or(Unauthorized::WrongKey)
    }

    /// Whether `headers` present `metrics_key` (compared as tenants' keys are).
    pub fn is_metrics_key(&self, headers: &HeaderMap) -> bool {
        let given = digest(presented_key(headers).unwrap_or(""));
        self.metrics_key.is_some_and(|key| same(&key, &given))
    }

    /// Whether `headers` present `admin_key` (compared as tenants' keys are).
    pub fn is_admin_key(&self, headers: &HeaderMap) -> bool {
        let given = digest(presented_key(headers).unwrap_or(""));
        self.admin_key.is_some_and(|key| same(&key, &given))
    }

    /// Whether an admin key is set at all.
    pub fn has_admin_key(&self) -> bool {
        self.admin_key.is_some()
    }

    /// The client's address: the peer's, or, when the peer is a trusted proxy, the
    /// nearest address the proxies forwarded that is not itself a trusted proxy
    /// (`Forwarded: for=`, else `X-Forwarded-For`). A client cannot pose as another by
    /// sending these headers itself: they are read only from trusted peers.
    pub fn client_address(&self, headers: &HeaderMap, peer: IpAddr) -> IpAddr {
        if !self.trusted(peer) {
            return peer;
        }
        let forwarded = forwarded_for(headers);
        // Nearest first: the last proxy appended the address it saw.
        forwarded.into_iter().rev().find(|ip| !self.trusted(*ip)).unwrap_or(peer)
    }

    fn trusted(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }

    /// An open server's tenant for a client address: weight 1, no quotas but a queue
    /// share, named by the client (an IPv4 address, or an IPv6 /64).
    fn anonymous(&self, address: IpAddr) -> Arc<Tenant> {
        let name = client_name(address);
        Arc::new(Tenant {
            name: name.into(),
            label: "anonymous".into(),
            digest: None,
            weight: 1,
            priority: 0,
            plugins: None,
            models: None,
            max_queued: self.anonymous_queued,
            max_concurrent: None,
            in_progress: Arc::new(AtomicU32::new(0)),
            requests: None,
            tokens: None,
        })
    }
}

impl Tenant {
    /// Whether it may call `plugin`.
    pub fn may_call(&self, plugin: &str) -> bool {
        self.plugins.as_ref().is_none_or(|allowed| allowed.contains(plugin))
    }

    /// Take a place among its requests in progress and one request of its per-minute
    /// budget, or say which quota refuses it. Nothing is taken when it is refused.
    pub fn enter(&self) -> Result<InProgress, OverQuota> {
        if let Some(tokens) = &self.tokens {
            if let Err(retry_after) = tokens.ready() {
                return Err(OverQuota::PerMinute {
                    what: "tokens",
                    per_minute: tokens.per_minute as u64,
                    retry_after,
                });
            }
        }
        let place = match self.max_concurrent {
            None => InProgress(None),
            Some(max) => {
                let taken =
                    self.in_progress.fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1));
                if taken.is_err() {
                    return Err(OverQuota::Concurrent(max));
                }
                InProgress(Some(self.in_progress.clone()))
            }
        };
        if let Some(requests) = &self.requests {
            if let Err(retry_after) = requests.take(1.0) {
                return Err(OverQuota::PerMinute {
                    what: "requests",
                    per_minute: requests.per_minute as u64,
                    retry_after,
                });
            }
        }
        Ok(place)
    }

    /// A request of this tenant used `tokens`: charged to its per-minute budget.
    pub fn charge_tokens(&self, tokens: u64) {
        if let Some(bucket) = &self.tokens {
            bucket.charge(tokens as f64);
        }
    }

    /// OpenAI's `x-ratelimit-*` headers for this tenant's budgets, as they stand now.
    pub fn rate_limit_headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = Vec::new();
        for (bucket, kind) in [(&self.requests, "requests"), (&self.tokens, "tokens")] {
            let Some(bucket) = bucket else { continue };
            let (remaining, reset) = bucket.remaining();
            let [limit, left, resets] = match kind {
                "requests" => [
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ],
                _ => [
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ],
            };
            headers.push((limit, format!("{}", bucket.per_minute as u64)));
            headers.push((left, format!("{}", remaining.max(0.0).floor() as u64)));
            headers.push((resets, duration_text(reset)));
        }
        headers
    }
}

/// A budget that refills evenly, `per_minute` a minute, and holds at most that much: a
/// tenant idle for a minute may spend a minute's worth at once, no more. A charge may
/// take it below zero (a request's tokens are known only when it ends); then nothing
/// more is admitted until it has refilled above zero. A small `Mutex` rather than a
/// rate-limiter crate: charging after the fact, into debt, is what tokens need and what
/// GCRA limiters (governor) do not do.
#[derive(Debug)]
pub struct Bucket {
    per_minute: f64,
    /// The level, and when it was last brought up to date.
    state: Mutex<(f64, Instant)>,
}

impl Bucket {
    /// A full bucket that refills evenly at `per_minute` per minute.
    pub fn per_minute(per_minute: f64) -> Self {
        Self { per_minute, state: Mutex::new((per_minute, Instant::now())) }
    }

    fn refilled(&self, now: Instant) -> std::sync::MutexGuard<'_, (f64, Instant)> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let gained = now.saturating_duration_since(state.1).as_secs_f64() * self.per_minute / 60.0;
        *state = ((state.0 + gained).min(self.per_minute), now);
        state
    }

    /// How long until the level is `at`.
    fn until(&self, level: f64, at: f64) -> Duration {
        Duration::from_secs_f64(((at - level).max(0.0) * 60.0 / self.per_minute).min(3600.0))
    }

    /// Take `n` if the level holds it, else how long until it would.
    fn take(&self, n: f64) -> Result<(), Duration> {
        let mut state = self.refilled(Instant::now());
        if state.0 >= n {
            state.0 -= n;
            Ok(())
        } else {
            Err(self.until(state.0, n))
        }
    }

    /// Whether anything is left (a level above zero), else how long until there is.
    fn ready(&self) -> Result<(), Duration> {
        let state = self.refilled(Instant::now());
        if state.0 > 0.0 {
            Ok(())
        } else {
            // At least a millisecond: a level of exactly 0 needs a little refill.
            Err(self.until(state.0, 0.0).max(Duration::from_millis(1)))
        }
    }

    fn charge(&self, n: f64) {
        self.refilled(Instant::now()).0 -= n;
    }

    /// The level now and how long until it is full again.
    fn remaining(&self) -> (f64, Duration) {
        let state = self.refilled(Instant::now());
        (state.0, self.until(state.0, self.per_minute))
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Two digests compared in constant time.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a[..].ct_eq(&b[..]).into()
}

/// The key a request presents: `authorization: Bearer KEY` (OpenAI's clients), else
/// `x-api-key: KEY` (Anthropic's).
fn presented_key(headers: &HeaderMap) -> Option<&str> {
    let bearer =
        headers.get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    bearer
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim))
        .filter(|key| !key.is_empty())
}

/// The SHA-256 of a tenant's key, from whichever of its three sources it names.
fn key_digest(config: &TenantConfig) -> anyhow::Result<[u8; 32]> {
    let name = &config.name;
    let key = match (&config.key, &config.key_file, &config.key_sha256) {
        (Some(key), None, None) => key.trim().to_string(),
        (None, Some(path), None) => std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("tenant {name:?}: key_file {}: {e}", path.display()))?
            .trim()
            .to_string(),
        (None, None, Some(hex)) => {
            return parse_sha256(hex).map_err(|e| {
                anyhow::anyhow!("tenant {name:?}: key_sha256 must be 64 hex digits ({e})")
            })
        }
        _ => anyhow::bail!("tenant {name:?}: give exactly one of key, key_file and key_sha256"),
    };
    // Short keys can be guessed by trying them: a server key should be a random secret.
    anyhow::ensure!(key.len() >= 16, "tenant {name:?}: its key must be at least 16 characters");
    Ok(digest(&key))
}

fn parse_sha256(hex: &str) -> Result<[u8; 32], &'static str> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return Err("wrong length");
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| "not hex")?;
    }
    Ok(digest)
}

/// `Ok` if `name` may name a tenant: 1 to 64 letters, digits, `-`, `_` and `.`, since
/// it names the tenant in logs, metrics, the plugin's header and the cache's group.
pub fn check_name(name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !name.is_empty()
            && name.len() <= 64
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)),
        "tenant name {name:?}: use 1 to 64 letters, digits, '-', '_' and '.'"
    );
    Ok(())
}

/// An address or a network (`10.0.0.0/8`); an address alone is its own /32 or /128.
fn parse_net(text: &str) -> Result<IpNet, String> {
    let text = text.trim();
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| "not an address or a network".to_string())
}

/// IPv4-mapped IPv6 addresses as the IPv4 address they are.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// An anonymous tenant's name: an IPv4 address (IPv4-mapped IPv6 included), or an IPv6
/// /64, the block one host or home network is given (any address in it is as easy for
/// that client to use as the next).
pub fn client_name(ip: IpAddr) -> String {
    match canonical(ip) {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let s = v6.segments();
            format!("{}/64", std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
    }
}

/// The addresses a chain of proxies forwarded, farthest first: RFC 7239's `Forwarded:
/// for=` if present, else `X-Forwarded-For`. Unparseable entries (obfuscated names,
/// `unknown`) are left out.
fn forwarded_for(headers: &HeaderMap) -> Vec<IpAddr> {
    let values = |name: &str| headers.get_all(name).into_iter().filter_map(|v| v.to_str().ok());
    let rfc7239: Vec<IpAddr> = values(http::header::FORWARDED.as_str())
        .flat_map(|v| v.split(','))
        .filter_map(|element| {
            element.split(';').find_map(|pair| {
                let (key, value) = pair.trim().split_once('=')?;
                key.trim().eq_ignore_ascii_case("for").then(|| parse_node(value))?
            })
        })
        .collect();
    if !rfc7239.is_empty() {
        return rfc7239;
    }
    values("x-forwarded-for").flat_map(|v| v.split(',')).filter_map(parse_node).collect()
}

/// `1.2.3.4`, `1.2.3.4:80`, `"[2001:db8::1]:80"`, `2001:db8::1`.
fn parse_node(node: &str) -> Option<IpAddr> {
    let node = node.trim().trim_matches('"');
    if let Ok(ip) = node.parse() {
        return Some(ip);
    }
    if let Some(rest) = node.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok();
    }
    node.rsplit_once(':').and_then(|(ip, _port)| ip.parse().ok())
}

/// `20ms`, `1.5s`, `6m0s`: how OpenAI writes a reset time.
fn duration_text(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs < 1.0 {
        format!("{}ms", d.as_millis())
    } else if secs < 60.0 {
        format!("{}s", (secs * 1000.0).round() / 1000.0)
    } else {
        format!("{}m{}s", d.as_secs() / 60, d.as_secs() % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_A: &str = "sk-tenant-a-0123456789";
    const KEY_B: &str = "sk-tenant-b-0123456789";
    const METRICS: &str = "metrics-0123456789abcdef";

    fn tenant(name: &str, key: &str) -> TenantConfig {
        toml::from_str(&format!("name = {name:?}\nkey = {key:?}")).unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap())).collect()
    }

    const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 9));

    #[test]
    fn a_key_names_its_tenant_by_bearer_or_x_api_key_and_nothing_else_does() {
        let tenants =
            Tenants::new(&[tenant("a", KEY_A), tenant("b", KEY_B)], &[], 64, Some(METRICS), None)
                .unwrap();
        assert!(tenants.keyed());
        let who = |h: &[(&str, &str)]| tenants.identify(&headers(h), PEER).map(|t| t.name.clone());
        assert_eq!(who(&[("authorization", &format!("Bearer {KEY_A}"))]).unwrap().as_ref(), "a");
        assert_eq!(who(&[("authorization", &format!("bearer  {KEY_B} "))]).unwrap().as_ref(), "b");
        assert_eq!(who(&[("x-api-key", KEY_B)]).unwrap().as_ref(), "b");
        assert_eq!(who(&[]), Err(Unauthorized::NoKey));
        assert_eq!(who(&[("authorization", "Bearer ")]), Err(Unauthorized::NoKey));
        assert_eq!(who(&[("authorization", KEY_A)]), Err(Unauthorized::NoKey), "no scheme");
        assert_eq!(who(&[("x-api-key", &KEY_A[..KEY_A.len() - 1])]), Err(Unauthorized::WrongKey));
        assert_eq!(who(&[("x-api-key", "sk-tenant-a-0123456789x")]), Err(Unauthorized::WrongKey));
        assert_eq!(who(&[("x-api-key", METRICS)]), Err(Unauthorized::WrongKey), "not a tenant's");
        let metrics = |h: &[(&str, &str)]| tenants.is_metrics_key(&headers(h));
        assert!(metrics(&[("authorization", &format!("Bearer {METRICS}"))]));
        assert!(!metrics(&[("authorization", &format!("Bearer {KEY_A}"))]) && !metrics(&[]));
        let error = Tenants::new(&[tenant("a", KEY_A)], &[], 64, Some(KEY_A), None).unwrap_err();
        assert!(error.to_string().contains("metrics_key is a tenant's key"), "{error}");
        let error = Tenants::new(&[tenant("a", KEY_A)], &[], 64, None, Some(KEY_A)).unwrap_err();
        assert!(error.to_string().contains("admin_key is a tenant's key"), "{error}");
    }

    #[test]
    fn keys_come_from_a_file_or_a_digest_and_bad_ones_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("llamabox-key-{}", std::process::id()));
        std::fs::write(&dir, format!("{KEY_A}\n")).unwrap();
        let from_file: TenantConfig =
            toml::from_str(&format!("name = \"f\"\nkey_file = {:?}", dir.display())).unwrap();
        let digest: String =
            Sha256::digest(KEY_B.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        let hashed: TenantConfig =
            toml::from_str(&format!("name = \"h\"\nkey_sha256 = {digest:?}")).unwrap();
        let tenants = Tenants::new(&[from_file, hashed], &[], 64, None, None).unwrap();
        std::fs::remove_file(&dir).unwrap();
        let who = |key: &str| tenants.identify(&headers(&[("x-api-key", key)]), PEER).unwrap();
        assert_eq!(who(KEY_A).name.as_ref(), "f");
        assert_eq!(who(KEY_B).name.as_ref(), "h");
        for (configs, why) in [
            (vec![tenant("a", "short")], "at least 16"),
            (vec![tenant("a", KEY_A), tenant("a", KEY_B)], "declared twice"),
            (vec![tenant("a", KEY_A), tenant("b", KEY_A)], "another tenant's key"),
            (vec![tenant("a b", KEY_A)], "tenant name"),
            (vec![toml::from_str("name = \"x\"\nkey_sha256 = \"abc\"").unwrap()], "64 hex digits"),
            (vec![toml::from_str("name = \"x\"").unwrap()], "exactly one of"),
            (
                vec![toml::from_str(&format!("name = \"x\"\nkey = {KEY_A:?}\nmax_queued = 0"))
                    .unwrap()],
                "a quota of 0",
            ),
        ] {
            let error = Tenants::new(&configs, &[], 64, None, None).unwrap_err().to_string();
            assert!(error.contains(why), "{why:?} not in {error:?}");
        }
    }

    #[test]
    fn an_open_server_names_each_client_address_and_believes_only_trusted_proxies() {
        let tenants =
            Tenants::new(&[], &["127.0.0.1".into(), "10.1.0.0/16".into()], 64, None, None).unwrap();
        assert!(!tenants.keyed());
        let who = |peer: &str, h: &[(&str, &str)]| {
            tenants.identify(&headers(h), peer.parse().unwrap()).unwrap().name.to_string()
        };
        let xff = [("x-forwarded-for", "203.0.113.7, 10.1.2.3")];
        assert_eq!(who("127.0.0.9", &xff), "127.0.0.9", "an untrusted peer's header is ignored");
        assert_eq!(who("127.0.0.1", &xff), "203.0.113.7", "nearest untrusted hop");
        assert_eq!(who("::ffff:127.0.0.1", &xff), "203.0.113.7", "IPv4-mapped peer");
        let rfc = [("forwarded", "for=198.51.100.1;proto=https, for=\"[2001:db8:1:2::5]:443\"")];
        assert_eq!(who("127.0.0.1", &rfc), "2001:db8:1:2::/64", "Forwarded wins, /64 named");
        assert_eq!(who("127.0.0.1", &[("x-forwarded-for", "unknown")]), "127.0.0.1");
        assert_eq!(who("127.0.0.1", &[("x-forwarded-for", "10.1.9.9")]), "127.0.0.1");
        let anonymous = tenants.identify(&HeaderMap::new(), PEER).unwrap();
        assert_eq!((anonymous.weight, anonymous.label.as_ref()), (1, "anonymous"));
        assert_eq!(anonymous.max_queued, 16, "a quarter of the queue");
        assert!(Tenants::new(&[], &["not-an-ip".into()], 64, None, None).is_err());
    }

    #[test]
    fn quotas_refuse_with_the_time_to_wait_and_take_nothing_when_they_do() {
        let config: TenantConfig = toml::from_str(&format!(
            "name = \"q\"\nkey = {KEY_A:?}\nmax_concurrent = 2\nrequests_per_minute = 3\ntokens_per_minute = 600"
        ))
        .unwrap();
        let tenants = Tenants::new(&[config], &[], 64, None, None).unwrap();
        let q = tenants.all()[0].clone();
        let first = q.enter().unwrap();
        let second = q.enter().unwrap();
        assert_eq!(q.enter().unwrap_err(), OverQuota::Concurrent(2));
        drop(first);
        let third = q.enter().unwrap();
        drop((second, third));
        match q.enter().unwrap_err() {
            OverQuota::PerMinute { what: "requests", per_minute: 3, retry_after } => {
                assert!(
                    retry_after > Duration::from_secs(19) && retry_after <= Duration::from_secs(20)
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(q.in_progress.load(Relaxed), 0, "a refusal keeps no place");
        let headers = q.rate_limit_headers();
        assert!(headers.contains(&("x-ratelimit-remaining-requests", "0".into())), "{headers:?}");
        assert!(headers.contains(&("x-ratelimit-limit-tokens", "600".into())), "{headers:?}");
        // Tokens are charged after the fact, into debt: 610 of 600 leaves -10, i.e.
        // 1 s of refill (10 a second) before anything is admitted.
        q.charge_tokens(610);
        let bucket = q.tokens.as_ref().unwrap();
        let Err(wait) = bucket.ready() else { panic!("in debt") };
        assert!(wait > Duration::from_millis(900) && wait <= Duration::from_secs(1), "{wait:?}");
    }

    #[test]
    fn reset_times_read_as_openai_writes_them() {
        assert_eq!(duration_text(Duration::from_millis(20)), "20ms");
        assert_eq!(duration_text(Duration::from_millis(1500)), "1.5s");
        assert_eq!(duration_text(Duration::from_secs(360)), "6m0s");
    }

    /// Not a gate (timings): what identifying a request's tenant costs, by tenants
    /// configured (every digest is compared, whichever matches). `cargo test --release
    /// --lib key_check_cost -- --ignored --nocapture`; figures in bench/TENANTS.md.
    #[test]
    #[ignore]
    fn key_check_cost() {
        for count in [1, 10, 100, 1000] {
            let keys: Vec<String> =
                (0..count).map(|i| format!("sk-tenant-{i:04}-0123456789abcdef")).collect();
            let configs: Vec<TenantConfig> =
                keys.iter().enumerate().map(|(i, key)| tenant(&format!("t{i}"), key)).collect();
            let tenants = Tenants::new(&configs, &[], 64, None, None).unwrap();
            let presented = headers(&[("authorization", &format!("Bearer {}", keys[count / 2]))]);
            let mut per_check = Vec::new();
            for _ in 0..200 {
                let started = Instant::now();
                for _ in 0..100 {
                    assert!(tenants.identify(&presented, PEER).is_ok());
                }
                per_check.push(started.elapsed().as_secs_f64() * 1e6 / 100.0);
            }
            per_check.sort_by(f64::total_cmp);
            println!(
                "{count} tenants: a key check p50 {:.2} us, p99 {:.2} us",
                per_check[100], per_check[198]
            );
        }
    }
}
