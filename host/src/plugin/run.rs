//! A compiled plugin and its runs: a fresh store and instance per run, the run's
//! deadline and stop, its report.

use super::state::{NoOutgoingRequests, RunLimiter};
use super::*;

/// How a plugin is started.
pub(super) enum PreInstance {
    /// A WASI 0.2 command: `wasi:cli/run`.
    Command(CommandPre<PluginState>),
    /// A WASI 0.3 plugin (`plugin-async` world): an async `run` export, called
    /// concurrently so its tasks can await async imports.
    AsyncRun(InstancePre<PluginState>),
    /// A `wasi:http` incoming handler (`http-plugin` world): one `handle` per request.
    Http(ProxyPre<PluginState>),
}

impl PreInstance {
    /// What kind of plugin this is, for errors.
    fn kind(&self) -> &'static str {
        match self {
            PreInstance::Command(_) | PreInstance::AsyncRun(_) => "a command (wasi:cli/run or run)",
            PreInstance::Http(_) => "an HTTP handler (wasi:http/incoming-handler)",
        }
    }

    fn engine(&self) -> &Engine {
        match self {
            PreInstance::Command(pre) => pre.engine(),
            PreInstance::AsyncRun(pre) => pre.engine(),
            PreInstance::Http(pre) => pre.engine(),
        }
    }
}

/// What a run calls in its fresh instance.
enum Invocation {
    /// The plugin's main: `wasi:cli/run`, or `run` of a WASI 0.3 plugin.
    Main,
    /// `wasi:http/incoming-handler.handle` with this request; the response the plugin
    /// sets goes to `respond`.
    Http { request: Box<hyper::Request<HyperIncomingBody>>, respond: ResponseSender },
}

/// The response a served plugin sets: status, headers and a body that streams as the
/// plugin writes it (or the `wasi:http` error code it answered with instead).
pub type HttpResponse = hyper::Response<HyperOutgoingBody>;

/// Where [`Plugin::serve_http`] sends the plugin's response.
pub type ResponseSender = tokio::sync::oneshot::Sender<Result<HttpResponse, ErrorCode>>;

/// A compiled plugin, ready to run any number of times.
pub struct Plugin {
    pub(super) entry: PreInstance,
    pub(super) registry: Arc<ModelRegistry>,
    pub(super) tokens: Arc<TokenRegistry>,
    pub(super) limits: Limits,
    /// Keeps the epoch advancing for this plugin's runs after its host is gone.
    pub(super) _ticker: Arc<EpochTicker>,
    pub(super) workers: Tracker,
}

impl Plugin {
    /// Run the plugin's `wasi:cli/run` in a fresh store. `wasi` sets its arguments and
    /// stdio (it gets no filesystem, network or environment unless given here).
    pub async fn run(&self, wasi: WasiCtxBuilder) -> Result<RunOutcome> {
        self.run_with(&RunOptions::default(), wasi).await
    }

    /// `run` with a group for shared tokens, this run's limits, a deadline and a stop
    /// handle.
    ///
    /// Returns only once every native call the run started has stopped and its memory
    /// is freed: dropping the store (at the end, on a trap, or at the deadline) stops
    /// every worker's call without blocking the executor, and the run then awaits its
    /// threads.
    pub async fn run_with(&self, options: &RunOptions, wasi: WasiCtxBuilder) -> Result<RunOutcome> {
        Ok(self.run_report(options, wasi).await?.outcome)
    }

    /// `run_with`, returning what the run used with its outcome. The run (and every
    /// native thread working for it, so llama.cpp's log lines from its calls) is in a
    /// `tracing` span `llamabox_run` with its `group` and `run` id.
    pub async fn run_report(
        &self,
        options: &RunOptions,
        wasi: WasiCtxBuilder,
    ) -> Result<RunReport> {
        if let PreInstance::Http(_) = self.entry {
            return Err(Error::WrongKind { wanted: "a command", found: self.entry.kind() });
        }
        self.run_call(options, wasi, Invocation::Main).await
    }

    /// Whether this plugin is an HTTP handler (`http-plugin` world), to serve with
    /// [`Plugin::serve_http`], rather than a command to [`Plugin::run`].
    pub fn serves_http(&self) -> bool {
        matches!(self.entry, PreInstance::Http(_))
    }

    /// Serve one HTTP request in a fresh instance (the `http-plugin` world): the
    /// plugin's `wasi:http/incoming-handler.handle` gets `request`, and the response it
    /// sets goes to `respond` at once, with a body that streams as the plugin writes it.
    /// Returns when the handler has returned (or the deadline or a stop ended it) and
    /// every native call it started has stopped, like [`Plugin::run_report`]. If the
    /// plugin never set a response, `respond` is dropped unsent.
    ///
    /// A client that hangs up is the embedder's to notice: stop the run with
    /// [`RunOptions::stop`] and its native work stops in flight (`llamabox serve` does).
    pub async fn serve_http<B>(
        &self,
        options: &RunOptions,
        wasi: WasiCtxBuilder,
        request: hyper::Request<B>,
        respond: ResponseSender,
    ) -> Result<RunReport>
    where
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<wasmtime_wasi_http::Error>,
    {
        use http_body_util::BodyExt as _;
        if !self.serves_http() {
            return Err(Error::WrongKind { wanted: "an HTTP handler", found: self.entry.kind() });
        }
        let request = request.map(|body| body.map_err(Into::into).boxed_unsync());
        self.run_call(options, wasi, Invocation::Http { request: Box::new(request), respond }).await
    }

    async fn run_call(
        &self,
        options: &RunOptions,
        wasi: WasiCtxBuilder,
        call: Invocation,
    ) -> Result<RunReport> {
        static NEXT_RUN: AtomicU64 = AtomicU64::new(1);
        let run_id = NEXT_RUN.fetch_add(1, Relaxed);
        let span = tracing::info_span!("llamabox_run", group = %options.group, run = run_id);
        let (workers, meter) = (self.workers.child(), Arc::new(Meter::new()));
        let outcome = self
            .run_to_end(options, wasi, call, workers.clone(), meter.clone())
            .instrument(span)
            .await?;
        let usage = RunUsage {
            tokens_decoded: meter.decoded(),
            tokens_generated: meter.generated(),
            native_time: workers.busy(),
            peak_kv_cells: meter.peak_kv_cells(),
            cancels: meter.cancels(),
            tokens_reused: meter.reused(),
        };
        tracing::debug!(run = run_id, ?outcome, ?usage, "llamabox run ended");
        Ok(RunReport { outcome, usage, run_id })
    }

    async fn run_to_end(
        &self,
        options: &RunOptions,
        wasi: WasiCtxBuilder,
        call: Invocation,
        workers: Tracker,
        meter: Arc<Meter>,
    ) -> Result<RunOutcome> {
        let limits = options.limits.as_ref().unwrap_or(&self.limits);
        let run = self.run_in_store(options, limits, wasi, call, workers.clone(), meter);
        let deadline = async {
            match options.deadline {
                Some(after) => tokio::time::sleep(after).await,
                None => std::future::pending().await,
            }
        };
        let stop = async {
            match &options.stop {
                Some(stop) => stop.stopped().await,
                None => std::future::pending().await,
            }
        };
        // Whichever ends first; the others are dropped, and dropping the run drops its
        // store: every worker's call is stopped (see `Worker::drop`).
        let outcome = tokio::select! {
            biased;
            () = stop => Ok(RunOutcome::Stopped),
            () = deadline => Ok(RunOutcome::DeadlineExceeded),
            outcome = run => outcome,
        };
        // The guest runs inside the poll of `run`: a stop that came while it ran, and
        // ended it (a write to a departed client's body fails), is still a stop.
        let stopped_meanwhile = options.stop.as_ref().is_some_and(RunStop::is_stopped);
        let outcome = match outcome {
            Ok(RunOutcome::Success | RunOutcome::Failed(_)) if stopped_meanwhile => {
                Ok(RunOutcome::Stopped)
            }
            other => other,
        };
        workers.all_stopped().await;
        outcome
    }

    async fn run_in_store(
        &self,
        options: &RunOptions,
        limits: &Limits,
        mut wasi: WasiCtxBuilder,
        call: Invocation,
        workers: Tracker,
        meter: Arc<Meter>,
    ) -> Result<RunOutcome> {
        let models = options.models.clone().unwrap_or_else(|| self.registry.clone());
        let deadline = options.deadline.map(|after| std::time::Instant::now() + after);
        let claim = Claim::new(options.weight, options.priority, deadline);
        let llama =
            LlamaCtx::new(models, self.tokens.clone(), options.group.as_str(), limits.clone())
                .claiming(claim);
        let state = PluginState {
            wasi: wasi.build(),
            http: WasiHttpCtx::new(),
            no_outgoing: NoOutgoingRequests,
            llama: llama.tracked_by(workers).metered_by(meter),
            table: ResourceTable::new(),
            limits: RunLimiter { limits: limits.store_limits(), refused: None },
            embedder: options.embedder.clone(),
        };
        let mut store = Store::new(self.entry.engine(), state);
        store.limiter(|state| &mut state.limits);
        store.epoch_deadline_async_yield_and_update(1);
        let ended = match (&self.entry, call) {
            (PreInstance::Http(pre), Invocation::Http { request, respond }) => {
                match pre.instantiate_async(&mut store).await {
                    Ok(proxy) => Self::handle(&mut store, &proxy, *request, respond).await,
                    Err(e) => Err(e),
                }
            }
            (PreInstance::Http(_), Invocation::Main) => {
                return Err(Error::WrongKind { wanted: "a command", found: self.entry.kind() })
            }
            (_, Invocation::Http { .. }) => {
                return Err(Error::WrongKind {
                    wanted: "an HTTP handler",
                    found: self.entry.kind(),
                })
            }
            (PreInstance::Command(pre), Invocation::Main) => {
                match pre.instantiate_async(&mut store).await {
                    Ok(command) => command.wasi_cli_run().call_run(&mut store).await,
                    Err(e) => Err(e),
                }
            }
            (PreInstance::AsyncRun(pre), Invocation::Main) => match pre
                .instantiate_async(&mut store)
                .await
            {
                Ok(instance) => match instance
                    .get_typed_func::<(), (Result<(), ()>,)>(&mut store, "run")
                {
                    Ok(run) => store
                        .run_concurrent(async |accessor| run.call_concurrent(accessor, ()).await)
                        .await
                        .and_then(|r| r)
                        .map(|(r,)| r),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            },
        };
        match ended {
            Ok(Ok(())) => Ok(RunOutcome::Success),
            Ok(Err(())) => Ok(RunOutcome::Failed(1)),
            Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
                Some(wasmtime_wasi::I32Exit(0)) => Ok(RunOutcome::Success),
                Some(wasmtime_wasi::I32Exit(code)) => Ok(RunOutcome::Failed(*code)),
                None => Err(match store.data().limits.refused {
                    Some(limit) => Error::Limit { limit, source: e },
                    None => {
                        Error::Trap { code: e.downcast_ref::<wasmtime::Trap>().copied(), source: e }
                    }
                }),
            },
        }
    }

    /// Invocation the handler with `request`; its response goes to `respond`. The `Ok(())`
    /// is the shape of a command's result: a handler has no exit status.
    async fn handle(
        store: &mut Store<PluginState>,
        proxy: &wasmtime_wasi_http::p2::bindings::Proxy,
        request: hyper::Request<HyperIncomingBody>,
        respond: ResponseSender,
    ) -> wasmtime::Result<Result<(), ()>> {
        let mut http = store.data_mut().http();
        let request = http.new_incoming_request(
            wasmtime_wasi_http::p2::bindings::http::types::Scheme::Http,
            request,
        )?;
        let response = http.new_response_outparam(respond)?;
        proxy.wasi_http_incoming_handler().call_handle(&mut *store, request, response).await?;
        Ok(Ok(()))
    }
}
