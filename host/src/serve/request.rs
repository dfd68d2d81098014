//! One request's life after admission: what it holds until its run ends, how its
//! run is stopped (a hang-up, a stall, a deadline), and the body that carries the
//! plugin's response to the client, watched for a client that stopped reading.

use super::*;

/// A request whose body is being read, counted in a gauge until dropped (however the
/// read ends, a client gone mid-body included).
pub(super) struct Reading(pub(super) prometheus_client::metrics::gauge::Gauge);

impl Reading {
    pub(super) fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What a running request holds until its run ends (its client's place at most until
/// then).
pub(super) struct Holds {
    pub(super) _admitted: Admitted,
    /// Its place among its tenant's requests in progress.
    pub(super) _place: tenants::InProgress,
    /// Who it is for (its token charge, its models).
    pub(super) tenant: Arc<tenants::Tenant>,
    /// Its run's group: tenant, plugin group and cache salt.
    pub(super) group: String,
    pub(super) client: ClientPlace,
}

impl Drop for Holds {
    fn drop(&mut self) {
        self.client.give_back();
    }
}

/// A request's place among its client's requests in progress, given back at whichever
/// comes first: the end of the body the plugin finished, or the end of the run. An SSE
/// client reads `[DONE]` and sends its next request at once, while the run is still
/// dropping its contexts; from the client's side the request is over.
#[derive(Clone)]
pub(super) struct ClientPlace(pub(super) Arc<Mutex<Option<ClientPermit>>>);

impl ClientPlace {
    pub(super) fn give_back(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// What a run tells the request it serves: the response head, then whether the
/// plugin's handler returned by itself (its body, if it ended, is whole).
pub(super) struct Replies {
    pub(super) respond: crate::plugin::ResponseSender,
    pub(super) ended: tokio::sync::oneshot::Sender<BodyEnd>,
}

/// How the plugin's body ended, once its run has: whole (its handler returned by
/// itself), or cut short by the server, with why.
pub(super) enum BodyEnd {
    Whole,
    Cut { code: &'static str, message: String },
}

/// A response that is a stream of server-sent events, by its API. A stream the server
/// cuts short (a deadline, a shutdown, a plugin that failed) ends with one error event
/// in that API's form, which the official SDKs raise, and then ends cleanly: a client
/// learns why, instead of reading a body that just stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventStream {
    /// OpenAI's chat and text completions: `data: {"error": {...}}`.
    Completions,
    /// OpenAI's Responses: an `error` event.
    Responses,
    /// Anthropic's Messages: an `error` event of `{"type": "error", "error": {...}}`.
    Messages,
}

impl EventStream {
    /// The stream kind of a response to `path` with these headers, if it is a stream.
    pub(super) fn of(path: &str, headers: &http::HeaderMap) -> Option<Self> {
        let kind = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
        if !kind.trim_start().starts_with("text/event-stream") {
            return None;
        }
        Some(if path.contains("/v1/messages") {
            EventStream::Messages
        } else if path.contains("/v1/responses") {
            EventStream::Responses
        } else {
            EventStream::Completions
        })
    }

    /// The closing error event.
    pub(super) fn error_event(self, code: &str, message: &str) -> Bytes {
        let error = serde_json::json!({ "message": message, "type": "server_error", "param": null, "code": code });
        let event = match self {
            EventStream::Completions => {
                format!("data: {}\n\n", serde_json::json!({ "error": error }))
            }
            EventStream::Responses => format!(
                "event: error\ndata: {}\n\n",
                serde_json::json!({ "type": "error", "code": code, "message": message, "param": null, "error": error })
            ),
            EventStream::Messages => format!(
                "event: error\ndata: {}\n\n",
                serde_json::json!({ "type": "error", "error": { "type": "api_error", "message": message } })
            ),
        };
        Bytes::from(event)
    }
}

/// How a request's run ended, for the status of a request that got no response.
pub(super) enum RunEnd {
    Outcome(RunOutcome),
    /// A trap, a wasm limit, or the plugin could not start (logged).
    Failed,
}

/// What the server knows of a request whose run is going on.
pub(super) struct RequestState {
    pub(super) run: RunStop,
    /// Set when the run has returned (its native work is over).
    pub(super) finished: AtomicBool,
    /// Why it was stopped, if it was.
    pub(super) cause: OnceLock<Cause>,
    /// When the server noticed the client had gone.
    pub(super) hung_up_at: OnceLock<Instant>,
    /// The plugin finished its response body (seen before any stop): it had written
    /// all it would for the client.
    pub(super) body_finished: AtomicBool,
}

impl RequestState {
    pub(super) fn new() -> Self {
        Self {
            run: RunStop::new(),
            finished: AtomicBool::new(false),
            cause: OnceLock::new(),
            hung_up_at: OnceLock::new(),
            body_finished: AtomicBool::new(false),
        }
    }

    /// Why the run was cut short, if a stop cut it short: the stop ended it (its outcome
    /// is `Stopped`) with a native call cancelled or its body unfinished. A stop that
    /// came once the handler had returned, or once its body was whole with no call in
    /// flight, stopped nothing: SSE clients close as soon as they read `data: [DONE]`,
    /// before the body's last chunk, which waits for the handler's return.
    pub(super) fn stopped_by(&self, outcome: &RunOutcome, cancels: u64) -> Option<Cause> {
        let cut_short = matches!(outcome, RunOutcome::Stopped)
            && (cancels > 0 || !self.body_finished.load(Relaxed));
        self.cause.get().copied().filter(|_| cut_short)
    }

    /// Stop the run (native work included) for `cause`, unless it has ended already.
    pub(super) fn stop(&self, cause: Cause) {
        if self.finished.load(Relaxed) || self.cause.set(cause).is_err() {
            return;
        }
        if cause == Cause::Disconnect {
            let _ = self.hung_up_at.set(Instant::now());
        }
        self.run.stop();
    }
}

/// Held by a request's future until its response head is out, then by its body: if
/// it is dropped before the body ended, the client hung up.
pub(super) struct HangUp {
    pub(super) server: Arc<Server>,
    pub(super) plugin: Arc<Served>,
    pub(super) state: Arc<RequestState>,
    /// A status was counted for this request.
    pub(super) answered: bool,
    /// The body reached its end.
    pub(super) completed: bool,
}

impl Drop for HangUp {
    fn drop(&mut self) {
        if self.completed {
            return;
        }
        self.state.stop(Cause::Disconnect);
        if !self.answered {
            // nginx's "client closed request": every request is counted once.
            self.server.metrics.answered(&self.plugin.config.name, 499);
        }
    }
}

/// A plugin's response body, carrying the request's [`HangUp`] guard. Its end waits
/// for the run's: a body cut short by a deadline or a stop ends in an error (the client
/// sees an incomplete response), not in a clean end of stream.
pub(super) struct GuardedBody {
    // Fields drop in order: the run is stopped before the plugin's body channel closes,
    // so a plugin never sees its write fail before its run is marked stopped.
    pub(super) hang_up: Option<HangUp>,
    pub(super) inner: HyperOutgoingBody,
    /// `inner` has ended: it is not polled again.
    pub(super) inner_ended: bool,
    /// How the plugin's body ended, once its run has.
    pub(super) run_ended: tokio::sync::oneshot::Receiver<BodyEnd>,
    /// The API's event stream, if the response is one: a cut gets its closing event.
    pub(super) stream: Option<EventStream>,
    /// The closing error event went out: the body ends.
    pub(super) closed_with_error: bool,
    /// Whether hyper is taking the body's pieces (see [`watch_for_stall`]).
    pub(super) progress: Watched,
    pub(super) client: ClientPlace,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // hyper asks for the next piece: it has taken the last one.
        self.progress.0.taken();
        if !self.inner_ended {
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(None) => self.note_end(),
                Poll::Ready(Some(frame)) => {
                    self.progress.0.handed();
                    return Poll::Ready(Some(frame.map_err(BoxError::from)));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        if self.closed_with_error {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.run_ended).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(BodyEnd::Whole)) => {
                if let Some(mut hang_up) = self.hang_up.take() {
                    hang_up.completed = true;
                }
                Poll::Ready(None)
            }
            Poll::Ready(Ok(BodyEnd::Cut { code, message })) if self.stream.is_some() => {
                let event = self.stream.take().map(|s| s.error_event(code, &message));
                self.closed_with_error = true;
                if let Some(mut hang_up) = self.hang_up.take() {
                    hang_up.completed = true;
                }
                self.progress.0.handed();
                Poll::Ready(event.map(|event| Ok(Frame::data(event))))
            }
            Poll::Ready(Ok(BodyEnd::Cut { .. }) | Err(_)) => {
                Poll::Ready(Some(Err("the request was stopped before its body ended".into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl GuardedBody {
    /// `inner` ended. It ends when the plugin finishes it, and when a stop tears the
    /// plugin's store down (after the stop's cause is set): an end seen before any
    /// cause is the plugin's own.
    pub(super) fn note_end(&mut self) {
        self.inner_ended = true;
        self.client.give_back();
        if let Some(HangUp { state, .. }) = &self.hang_up {
            if state.cause.get().is_none() {
                state.body_finished.store(true, Relaxed);
            }
        }
    }
}

impl Drop for GuardedBody {
    fn drop(&mut self) {
        // The client may have left before hyper asked for the end the plugin had sent
        // (the client's hang-up came first): ask now, before `hang_up` stops the run.
        if !self.inner_ended {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            if let Poll::Ready(None) = Pin::new(&mut self.inner).poll_frame(&mut cx) {
                self.note_end();
            }
        }
    }
}

/// Whether a response body's last piece is still waiting for hyper to take it, and
/// since when: the client's pace, as the server sees it. hyper takes the next piece
/// once it could write (or buffer) the last; a client that does not read fills the
/// socket's buffers, and then hyper takes nothing more.
pub(super) struct Progress {
    pub(super) start: Instant,
    /// Milliseconds from `start` + 1 at which a piece was handed over and not taken
    /// since; 0 when hyper is not holding one back (it waits on the plugin, say).
    pub(super) handed_at: AtomicU64,
    /// The body was dropped: nothing more to watch.
    pub(super) done: AtomicBool,
}

impl Progress {
    pub(super) fn new() -> Self {
        // The response head is handed over with it: a client that takes nothing stalls.
        let progress = Self {
            start: Instant::now(),
            handed_at: AtomicU64::new(0),
            done: AtomicBool::new(false),
        };
        progress.handed();
        progress
    }

    pub(super) fn handed(&self) {
        self.handed_at.store(self.start.elapsed().as_millis() as u64 + 1, Relaxed);
    }

    pub(super) fn taken(&self) {
        self.handed_at.store(0, Relaxed);
    }

    /// How long the piece handed over has waited, if one is waiting.
    pub(super) fn waiting(&self) -> Option<Duration> {
        match self.handed_at.load(Relaxed) {
            0 => None,
            at => Some(self.start.elapsed().saturating_sub(Duration::from_millis(at - 1))),
        }
    }
}

/// A response body's [`Progress`], marked done when the body is dropped.
pub(super) struct Watched(pub(super) Arc<Progress>);

impl Drop for Watched {
    fn drop(&mut self) {
        self.0.done.store(true, Relaxed);
    }
}

/// Watch a response body until it is dropped: a piece left untaken for `timeout` means
/// the client stopped reading. It is then treated as gone: its run is stopped (native
/// work included, `cause="write_stall"`, its slot freed) and its connection closed
/// (hyper, blocked on a full socket, would otherwise hold it).
pub(super) fn watch_for_stall(
    progress: Arc<Progress>,
    state: Arc<RequestState>,
    close: Arc<tokio::sync::Notify>,
    timeout: Duration,
) {
    tokio::spawn(
        async move {
            while !progress.done.load(Relaxed) {
                match progress.waiting() {
                    Some(waited) if waited >= timeout => {
                        tracing::info!(
                            stall_ms = waited.as_millis() as u64,
                            "the client stopped reading its response: closing it"
                        );
                        state.stop(Cause::WriteStall);
                        close.notify_one();
                        return;
                    }
                    Some(waited) => tokio::time::sleep(timeout - waited).await,
                    // A stall that starts now is seen within 1.25 × the timeout.
                    None => tokio::time::sleep(timeout / 4).await,
                }
            }
        }
        .in_current_span(),
    );
}

/// A request body as a plugin reads it: the body the server has read whole already.
pub(super) type PluginBody = UnsyncBoxBody<Bytes, wasmtime_wasi_http::Error>;

/// The request as its plugin sees it: the route's prefix stripped from the path, a
/// `host` header (wasi:http wants an authority), its tenant's name in
/// `x-llamabox-tenant` (and no credentials: the key is the server's business), and its
/// body, read whole (within the body cap) before admission.
pub(super) fn for_plugin(
    request: Request<Bytes>,
    route: &str,
    listen: SocketAddr,
    tenant: &str,
) -> Request<PluginBody> {
    let (mut parts, body) = request.into_parts();
    for credential in [header::AUTHORIZATION.as_str(), "x-api-key", tenants::TENANT_HEADER] {
        parts.headers.remove(credential);
    }
    if let Ok(tenant) = HeaderValue::from_str(tenant) {
        parts.headers.insert(tenants::TENANT_HEADER, tenant);
    }
    if route != "/" {
        let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let rest = &path_and_query[route.len().min(path_and_query.len())..];
        let rest = if rest.starts_with('/') { rest.to_string() } else { format!("/{rest}") };
        if let Ok(uri) = rest.parse() {
            parts.uri = uri;
        }
    }
    if !parts.headers.contains_key(header::HOST) {
        if let Ok(host) = HeaderValue::from_str(&listen.to_string()) {
            parts.headers.insert(header::HOST, host);
        }
    }
    let body = Full::new(body).map_err(|never| match never {}).boxed_unsync();
    Request::from_parts(parts, body)
}
