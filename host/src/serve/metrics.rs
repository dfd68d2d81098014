//! The server's Prometheus metrics (`GET /metrics`, OpenMetrics text).

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

/// An answered request's plugin and HTTP status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The plugin's name in the config.
    pub plugin: String,
    /// The status code of the response.
    pub status: u16,
}

/// A served plugin, by its name in the config.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    /// The plugin's name in the config.
    pub plugin: String,
}

/// A served plugin and what it is: its digest and its signer's key id (empty if none).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginInfoLabels {
    /// The plugin's name in the config.
    pub plugin: String,
    /// Its digest (`sha256:...`): the manifest's for a pulled plugin, the file's else.
    pub digest: String,
    /// The key id of the signature it was verified with; empty if none.
    pub signer: String,
}

/// A configured tenant's name, or `anonymous` for every client of an open server, so
/// that the labels stay as few as the config's tenants.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    /// The tenant's name, or `anonymous`.
    pub tenant: String,
}

/// Why a request's run was stopped before it ended by itself.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Cause {
    /// The client hung up.
    Disconnect,
    /// The client stopped reading its response (taken for gone: see
    /// `ServeConfig::write_stall_timeout_ms`).
    WriteStall,
    /// Its deadline passed.
    Deadline,
    /// The server shut down with it still running after the grace period.
    Shutdown,
    /// The plugin cancelled its own native calls (counted per call).
    Plugin,
}

/// Why runs were stopped, for the `cancels` counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    /// What stopped them.
    pub cause: Cause,
}

/// Why a request was refused before a plugin saw it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Refusal {
    /// The server's queue was full (503).
    QueueFull,
    /// No slot came free within the queue timeout (503).
    QueueTimeout,
    /// The body was over `max_body_bytes` (413).
    BodyTooLarge,
    /// The body did not arrive within the body timeout (408).
    BodyTimeout,
    /// Its client address had its most requests in progress already (429).
    ClientLimit,
    /// No key, or a key no tenant has (401).
    Unauthorized,
    /// Its tenant may not call this plugin (403).
    Forbidden,
    /// One of its tenant's own quotas (429): requests in progress, queue places,
    /// requests or tokens per minute.
    TenantQuota,
    /// The server was shutting down (503).
    Draining,
}

/// A refused request's plugin and why it was refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// The plugin's name in the config.
    pub plugin: String,
    /// Why the request was refused.
    pub reason: Refusal,
}

impl EncodeLabelValue for Cause {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(match self {
            Cause::Disconnect => "disconnect",
            Cause::WriteStall => "write_stall",
            Cause::Deadline => "deadline",
            Cause::Shutdown => "shutdown",
            Cause::Plugin => "plugin",
        })
    }
}

impl EncodeLabelValue for Refusal {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(match self {
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout => "queue_timeout",
            Refusal::BodyTooLarge => "body_too_large",
            Refusal::BodyTimeout => "body_timeout",
            Refusal::ClientLimit => "client_limit",
            Refusal::Unauthorized => "unauthorized",
            Refusal::Forbidden => "forbidden",
            Refusal::TenantQuota => "tenant_quota",
            Refusal::Draining => "draining",
        })
    }
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// `metric`, registered under `name`: the registry keeps a clone, which shares its values.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// The server's metrics, registered under the `llamabox_` prefix; each field is a
/// handle the server updates, named after its metric.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by plugin and HTTP status.
    pub requests: Family<RequestLabels, Counter>,
    /// Requests refused before a plugin saw them, by plugin and reason.
    pub refused: Family<RefusalLabels, Counter>,
    /// Runs a stop cut short, by cause.
    pub cancels: Family<CauseLabels, Counter>,
    /// Requests waiting for a slot.
    pub queue_depth: Gauge,
    /// Requests whose body is being read, before admission.
    pub reading_bodies: Gauge,
    /// Requests whose plugin is running.
    pub in_flight: Gauge,
    /// Native threads working for plugin runs.
    pub live_workers: Gauge,
    /// Contexts kept idle for later requests of their group.
    pub idle_contexts: Gauge,
    /// Time from admission to the run's end, per plugin (`request_duration_seconds`).
    pub request_seconds: HistogramFamily<PluginLabels>,
    /// Tokens the host's generation delivered, per plugin.
    pub tokens_generated: Family<PluginLabels, Counter>,
    /// Rows llama.cpp decoded, per plugin.
    pub tokens_decoded: Family<PluginLabels, Counter>,
    /// Prompt tokens an idle context already held and did not decode again, per plugin.
    pub tokens_reused: Family<PluginLabels, Counter>,
    /// Per request: generated tokens over the run's time, per plugin.
    pub generated_tokens_per_second: HistogramFamily<PluginLabels>,
    /// From noticing a client hung up to its run's native work having stopped.
    pub disconnect_stop_seconds: Histogram,
    /// Requests admitted to run, by tenant.
    pub tenant_requests: Family<TenantLabels, Counter>,
    /// Tokens charged to each tenant's per-minute budget.
    pub tenant_tokens: Family<TenantLabels, Counter>,
    /// 1 for each plugin served now, labelled with its digest and signer; a reload
    /// replaces the set.
    pub plugin_info: Family<PluginInfoLabels, Gauge>,
    batch: BatchMetrics,
}

/// What batched steps report, as handles the batch's thread can update.
#[derive(Clone)]
struct BatchMetrics {
    rows: Histogram,
    seats: Histogram,
    step_seconds: Histogram,
    seats_active: Gauge,
    rollbacks: Counter,
    yields: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric registered, at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("llamabox");
        let r = &mut registry;
        Self {
            requests: registered(
                r,
                "requests",
                "Requests answered, by plugin and HTTP status",
                Family::default(),
            ),
            refused: registered(
                r,
                "refused",
                "Requests refused before a plugin saw them, by reason",
                Family::default(),
            ),
            cancels: registered(r, "cancels", "Runs a stop cut short (a native call cancelled or the body unfinished), by cause (plugin: calls a plugin cancelled)", Family::default()),
            queue_depth: registered(r, "queue_depth", "Requests waiting for a slot", Gauge::default()),
            reading_bodies: registered(
                r,
                "reading_bodies",
                "Requests whose body is being read, before admission",
                Gauge::default(),
            ),
            in_flight: registered(r, "in_flight", "Requests whose plugin is running", Gauge::default()),
            live_workers: registered(
                r,
                "live_workers",
                "Native threads working for plugin runs",
                Gauge::default(),
            ),
            idle_contexts: registered(
                r,
                "idle_contexts",
                "Contexts kept idle for later requests of their group",
                Gauge::default(),
            ),
            request_seconds: registered(
                r,
                "request_duration_seconds",
                "Time from admission to the run's end",
                Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.005, 2.0, 16))),
            ),
            tokens_generated: registered(
                r,
                "tokens_generated",
                "Tokens the host's generation delivered",
                Family::default(),
            ),
            tokens_decoded: registered(
                r,
                "tokens_decoded",
                "Rows llama.cpp decoded (prompts and generated tokens)",
                Family::default(),
            ),
            tokens_reused: registered(
                r,
                "tokens_reused",
                "Prompt tokens an idle context already held from its group's last request, not decoded again",
                Family::default(),
            ),
            generated_tokens_per_second: registered(
                r,
                "generated_tokens_per_second",
                "Per request: generated tokens over the run's time",
                Family::new_with_constructor(|| Histogram::new(exponential_buckets(4.0, 2.0, 10))),
            ),
            disconnect_stop_seconds: registered(
                r,
                "disconnect_stop_seconds",
                "From noticing a client hung up to its run's native work having stopped",
                Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            ),
            tenant_requests: registered(
                r,
                "tenant_requests",
                "Requests admitted to run, by tenant (anonymous: every client of an open server)",
                Family::default(),
            ),
            tenant_tokens: registered(
                r,
                "tenant_tokens",
                "Tokens charged to each tenant's per-minute budget (prompt plus completion)",
                Family::default(),
            ),
            plugin_info: registered(
                r,
                "plugin_info",
                "The plugins served now (1 each), by digest and signer's key id",
                Family::default(),
            ),
            batch: BatchMetrics {
                rows: registered(
                    r,
                    "batch_step_rows",
                    "Rows (tokens) one batched step decoded",
                    Histogram::new(exponential_buckets(1.0, 2.0, 11)),
                ),
                seats: registered(
                    r,
                    "batch_step_seats",
                    "Requests' sequences with rows in one batched step",
                    Histogram::new(exponential_buckets(1.0, 2.0, 9)),
                ),
                step_seconds: registered(
                    r,
                    "batch_step_seconds",
                    "Time one batched step took",
                    Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
                ),
                seats_active: registered(
                    r,
                    "batch_seats_active",
                    "Sequences of batched contexts leased now",
                    Gauge::default(),
                ),
                rollbacks: registered(
                    r,
                    "batch_step_rollbacks",
                    "Batched steps stopped in flight by one member's cancel, rolled back for all and re-run without it",
                    Counter::default(),
                ),
                yields: registered(
                    r,
                    "batch_step_yields",
                    "Batched steps stopped in flight for a newcomer's call (long prompts alone: anyone's; steps with prompt rows: a tenant first in fair share), rolled back and re-run after it",
                    Counter::default(),
                ),
            },
            registry,
        }
    }

    /// What a batch calls after every step (on its own thread: only atomic updates).
    pub fn batch_observer(&self) -> crate::StepObserver {
        let batch = self.batch.clone();
        std::sync::Arc::new(move |step: &crate::StepReport| {
            batch.rows.observe(step.rows as f64);
            batch.seats.observe(step.seats as f64);
            batch.step_seconds.observe(step.elapsed.as_secs_f64());
            batch.seats_active.set(step.active_seats as i64);
            if step.rolled_back {
                batch.rollbacks.inc();
            }
            if step.yielded {
                batch.yields.inc();
            }
        })
    }

    /// Count `count` stops by `cause`: runs, or for [`Cause::Plugin`] native calls.
    pub fn cancel(&self, cause: Cause, count: u64) {
        self.cancels.get_or_create(&CauseLabels { cause }).inc_by(count);
    }

    /// Count one request to `plugin` refused for `reason`.
    pub fn refuse(&self, plugin: &str, reason: Refusal) {
        self.refused.get_or_create(&RefusalLabels { plugin: plugin.into(), reason }).inc();
    }

    /// Count one request to `plugin` answered with `status`.
    pub fn answered(&self, plugin: &str, status: u16) {
        self.requests.get_or_create(&RequestLabels { plugin: plugin.into(), status }).inc();
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// The content type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
