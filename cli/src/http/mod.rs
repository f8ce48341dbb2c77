//! The HTTP server of `iris serve`: an axum router over an [`Engine`].
//!
//! Routes (every one but `/health` behind the API key when one is set):
//!
//! | method | path                   | answer                                                   |
//! |--------|------------------------|----------------------------------------------------------|
//! | POST   | `/v1/encode`           | per image `mm_hash`, `grid_thw`, `num_tokens`, `cached` (+ embeddings) |
//! | POST   | `/v1/chat/completions` | vLLM's encoder instance: a `chat.completion` with `ec_transfer_params` ([`chat`]) |
//! | GET    | `/v1/models`           | the served model name                                    |
//! | POST   | `/reset_mm_cache`      | processor cache cleared; what it released                |
//! | POST   | `/reset_encoder_cache` | encoder cache (manager + device buffers) cleared         |
//! | POST   | `/reset_allocator`     | allocator trimmed                                        |
//! | POST   | `/reset_all`           | all three, in that order                                 |
//! | POST   | `/sleep?level=1\|2`    | engine asleep (level 1 when absent); what it released    |
//! | POST   | `/wake_up`             | engine awake                                             |
//! | GET    | `/is_sleeping`         | `{"is_sleeping": bool}`                                  |
//! | GET    | `/server_info`         | configuration and environment                            |
//! | GET    | `/memory`              | the engine's memory JSON plus `metrics` (see below)      |
//! | GET    | `/metrics`             | Prometheus text                                          |
//! | GET    | `/health`              | `{"status": "ok"}`; 503 when the engine is dead or the device lost |
//!
//! `GET /memory` is the engine's [`Engine::memory`] object with one key added, `metrics`: the
//! [`MetricsSnapshot`] (cache counters, memory now, before start and after start). `iris bench
//! --url` reads its checkpoints from there.
//!
//! Every error is `{"error": {"message", "type", "code"}}` ([`ApiError`]); axum's own rejections
//! (413, 404, 405) are mapped to it. While the engine sleeps, `POST /v1/encode` answers 503 with
//! code `engine_sleeping`.
//!
//! Failure handling: beyond the engine's backpressure bounds `POST /v1/encode` answers 503
//! `overloaded` with `Retry-After` before its body is read. An admitted request whose body has
//! not arrived within [`ServerConfig::body_read_timeout`] is answered 408 `body_read_timeout`
//! and its slot given back, so that clients that stop sending cannot hold every slot. Once the
//! engine is dead (its core panicked) or its device lost, `/health` and every other route
//! answer 503 (`engine_dead`, `device_lost`): a client never reads zeros from a dead engine.

pub mod chat;
pub mod engine_api;
pub mod error;
pub mod metrics;
pub mod request;
#[cfg(test)]
pub(crate) mod test_engine;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, RawQuery, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

pub use chat::MediaAccess;
pub use engine_api::{Engine, MemoryGauges, MetricsSnapshot, ResetReport};
pub use error::ApiError;
pub use metrics::{HttpMetrics, MetricsError};
pub use request::Limits;

use crate::epd::{Epd, ProduceError, Stored};

/// Environment variable read for the API key when `--api-key` is not given.
pub const API_KEY_ENV: &str = "IRIS_API_KEY";
/// Default listen address: loopback only.
pub const DEFAULT_HOST: &str = "127.0.0.1";
/// Default listen port.
pub const DEFAULT_PORT: u16 = 8000;
/// Default time limit for reading an admitted request's body, in seconds.
pub const DEFAULT_BODY_READ_TIMEOUT_S: u64 = 60;

/// Server settings that are not the engine's.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Input limits.
    pub limits: Limits,
    /// When set, every route but `/health` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// iris as vLLM's encoder instance: identifiers, served model name and the EC producer.
    /// Without it `/v1/chat/completions` and `/v1/models` answer 404.
    pub epd: Option<Arc<Epd>>,
    /// Where `file://` image URLs may be read from.
    pub media: MediaAccess,
    /// Longest an admitted request may take to send its body (it holds a request slot
    /// meanwhile); past it the request is answered 408.
    pub body_read_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            api_key: None,
            epd: None,
            media: MediaAccess::default(),
            body_read_timeout: Duration::from_secs(DEFAULT_BODY_READ_TIMEOUT_S),
        }
    }
}

/// Flags of `iris serve` that belong to the HTTP layer (the engine's own flags live elsewhere).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on; loopback by default, so nothing outside this machine can connect.
    #[arg(long, default_value = DEFAULT_HOST)]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on every route but /health (the scheme in any
    /// case, as RFC 9110 and vLLM take it).
    #[arg(long, env = API_KEY_ENV, hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body in bytes (larger ones get a 413).
    #[arg(long, default_value_t = request::DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Most media items in one request, images and videos counted together.
    #[arg(long, default_value_t = request::DEFAULT_MAX_IMAGES_PER_REQUEST)]
    pub max_images_per_request: usize,
    /// Most pixels (width x height, read from the image header) in one image.
    #[arg(long, default_value_t = request::DEFAULT_MAX_IMAGE_PIXELS)]
    pub max_image_pixels: u64,
    /// Folder from which `file://` image URLs in chat requests may be read (vLLM's flag);
    /// without it they are refused.
    #[arg(long, value_name = "DIR")]
    pub allowed_local_media_path: Option<std::path::PathBuf>,
    /// Hosts whose `http(s)://` image URLs in chat requests are fetched (vLLM's flag; repeat
    /// or separate with commas); without it remote URLs are refused.
    #[arg(long, value_name = "HOST", value_delimiter = ',')]
    pub allowed_media_domains: Vec<String>,
    /// Time limit of one image fetch, in seconds (vLLM's `VLLM_IMAGE_FETCH_TIMEOUT`).
    #[arg(long, value_name = "SECONDS", default_value_t = chat::DEFAULT_MEDIA_FETCH_TIMEOUT_S)]
    pub media_fetch_timeout: u64,
    /// Time limit of one video fetch, in seconds (vLLM's `VLLM_VIDEO_FETCH_TIMEOUT`).
    #[arg(long, value_name = "SECONDS", default_value_t = chat::DEFAULT_VIDEO_FETCH_TIMEOUT_S)]
    pub video_fetch_timeout: u64,
    /// Longest an admitted request may take to send its body, in seconds; past it the request
    /// gets a 408 and its slot is given back (a client that stops sending holds none).
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_BODY_READ_TIMEOUT_S)]
    pub body_read_timeout: u64,
}

impl ServeArgs {
    /// A warning for an API key given but empty (`--api-key ''`, or `IRIS_API_KEY` set to
    /// nothing, as an unset shell variable expands): it leaves every route open, which the
    /// operator who gave a key did not mean.
    pub fn empty_api_key_warning(&self) -> Option<&'static str> {
        (self.api_key.is_some() && self.required_api_key().is_none()).then_some(
            "iris serve: warning: the API key (--api-key or IRIS_API_KEY) is empty, so no route requires one",
        )
    }

    /// The API key requests must carry: the one given, unless it is empty or blank.
    fn required_api_key(&self) -> Option<&str> {
        self.api_key.as_deref().filter(|key| !key.trim().is_empty())
    }

    /// The server settings these flags describe, with the encoder-instance settings `epd`.
    ///
    /// # Errors
    /// An `--allowed-local-media-path` that is not an existing folder.
    pub fn server_config(&self, epd: Option<Arc<Epd>>) -> std::io::Result<ServerConfig> {
        let allowed_local_media_path = match &self.allowed_local_media_path {
            None => None,
            Some(dir) => {
                let canonical = dir.canonicalize().map_err(|err| {
                    std::io::Error::new(
                        err.kind(),
                        format!("--allowed-local-media-path {}: {err}", dir.display()),
                    )
                })?;
                if !canonical.is_dir() {
                    return Err(std::io::Error::other(format!(
                        "--allowed-local-media-path {} is not a folder",
                        dir.display()
                    )));
                }
                Some(canonical)
            }
        };
        Ok(ServerConfig {
            limits: Limits {
                max_body_bytes: self.max_body_bytes,
                max_images_per_request: self.max_images_per_request,
                max_image_pixels: self.max_image_pixels,
                // The engine's, set once it has started (see `iris serve`).
                ..Limits::default()
            },
            api_key: self.required_api_key().map(str::to_owned),
            epd,
            media: MediaAccess {
                allowed_local_media_path,
                allowed_media_domains: self
                    .allowed_media_domains
                    .iter()
                    .map(|d| d.trim().to_ascii_lowercase())
                    .filter(|d| !d.is_empty())
                    .collect(),
                fetch_timeout: std::time::Duration::from_secs(self.media_fetch_timeout.max(1)),
                video_fetch_timeout: std::time::Duration::from_secs(
                    self.video_fetch_timeout.max(1),
                ),
            },
            body_read_timeout: Duration::from_secs(self.body_read_timeout.max(1)),
        })
    }

    /// Binds the listening socket.
    ///
    /// # Errors
    /// The I/O error, e.g. the port is in use.
    pub async fn bind(&self) -> std::io::Result<tokio::net::TcpListener> {
        tokio::net::TcpListener::bind((self.host.as_str(), self.port)).await
    }
}

/// Completes on Ctrl-C (SIGINT) or SIGTERM (what `docker stop`, Kubernetes and systemd send);
/// pass it to [`serve`] to drain requests before exiting.
pub async fn shutdown_signal() {
    // If a handler cannot be installed, the process still ends on that signal's default action.
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// Shared state of every handler.
pub struct ServerState<E> {
    engine: Arc<E>,
    limits: Limits,
    epd: Option<Arc<Epd>>,
    media: MediaAccess,
    /// The key's blake3 hash: comparing hashes (constant-time `PartialEq`) hides the key's length.
    api_key_hash: Option<blake3::Hash>,
    metrics: HttpMetrics,
    body_read_timeout: Duration,
}

/// Builds the router over `engine`.
///
/// # Errors
/// [`MetricsError`] if the metrics registry cannot be built.
pub fn router<E: Engine>(engine: Arc<E>, config: ServerConfig) -> Result<Router, MetricsError> {
    let producer = config.epd.as_ref().and_then(|e| e.producer.clone());
    let metrics = HttpMetrics::new(Arc::clone(&engine), producer)?;
    let state = Arc::new(ServerState {
        engine,
        limits: config.limits,
        epd: config.epd,
        media: config.media,
        api_key_hash: config
            .api_key
            .as_deref()
            .map(|k| blake3::hash(k.as_bytes())),
        metrics,
        body_read_timeout: config.body_read_timeout,
    });
    let protected = Router::new()
        .route("/v1/encode", post(encode::<E>))
        .route("/v1/chat/completions", post(chat_completions::<E>))
        .route("/v1/models", get(models::<E>))
        .route("/reset_mm_cache", post(reset_mm_cache::<E>))
        .route("/reset_encoder_cache", post(reset_encoder_cache::<E>))
        .route("/reset_allocator", post(reset_allocator::<E>))
        .route("/reset_all", post(reset_all::<E>))
        .route("/sleep", post(sleep::<E>))
        .route("/wake_up", post(wake_up::<E>))
        .route("/is_sleeping", get(is_sleeping::<E>))
        .route("/server_info", get(server_info::<E>))
        .route("/memory", get(memory::<E>))
        .route("/metrics", get(metrics_text::<E>))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_alive::<E>,
        ))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_api_key::<E>,
        ));
    let app = Router::new()
        .route("/health", get(health::<E>))
        .merge(protected)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            track_request::<E>,
        ))
        .layer(DefaultBodyLimit::max(state.limits.max_body_bytes))
        .with_state(state);
    Ok(app)
}

/// How long [`serve`] lets in-flight requests finish after the shutdown signal. Requests parked
/// on a sleeping engine, or a client that stopped sending its body, would otherwise keep the
/// process from ever exiting.
pub const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves `app` on `listener` until `shutdown` completes, then drains in-flight requests for
/// at most [`DRAIN_LIMIT`] (a second Ctrl-C or SIGTERM ends the drain at once).
///
/// # Errors
/// The I/O error that stopped the server.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_draining(listener, app, shutdown, DRAIN_LIMIT).await
}

/// [`serve`], draining for at most `drain_limit`.
///
/// # Errors
/// The I/O error that stopped the server.
pub async fn serve_draining(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain_limit: std::time::Duration,
) -> std::io::Result<()> {
    let (signalled, draining) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown.await;
        let _ = signalled.send(());
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown);
    let drain_over = async move {
        if draining.await.is_err() {
            // The server stopped on its own: its result decides.
            std::future::pending::<()>().await;
        }
        tokio::select! {
            () = tokio::time::sleep(drain_limit) => eprintln!(
                "iris serve: requests still in flight {:.1} s after the shutdown signal; stopping without them",
                drain_limit.as_secs_f64()
            ),
            () = shutdown_signal() => {
                eprintln!("iris serve: a second shutdown signal; stopping without the requests in flight");
            }
        }
    };
    tokio::select! {
        result = server.into_future() => result,
        () = drain_over => Ok(()),
    }
}

type Shared<E> = State<Arc<ServerState<E>>>;

async fn encode<E: Engine>(
    State(state): Shared<E>,
    request: Request,
) -> Result<Json<Value>, ApiError> {
    let (mut permit, body) = admit_and_read(&state, request).await?;
    let limits = state.limits;
    // Base64 and header parsing of up to max_body_bytes is CPU work: keep it off the async threads.
    let parsed = tokio::task::spawn_blocking(move || request::parse_encode_request(&body, &limits))
        .await
        .map_err(|err| ApiError::internal(format!("request parsing task failed: {err}")))??;
    let videos: Vec<bool> = parsed
        .items
        .iter()
        .map(|item| matches!(item, request::RequestItem::Video(_)))
        .collect();
    let items = request::media_inputs(
        state.engine.as_ref(),
        &mut permit,
        parsed.items,
        &parsed.options.processor,
    )
    .await?;
    let results = state.engine.encode(permit, items, parsed.options).await?;
    let cached = results.iter().filter(|r| r.cached).count();
    let cached = u64::try_from(cached).unwrap_or(u64::MAX);
    let total = u64::try_from(results.len()).unwrap_or(u64::MAX);
    state.metrics.observe_images(cached, total - cached);
    Ok(Json(request::encode_response(&results, &videos)))
}

async fn chat_completions<E: Engine>(
    State(state): Shared<E>,
    headers: HeaderMap,
    request: Request,
) -> Result<Json<Value>, ApiError> {
    let Some(epd) = state.epd.clone() else {
        return Err(refuse(request, epd_not_configured(), state.limits.max_body_bytes).await);
    };
    let (permit, body) = admit_and_read(&state, request).await?;
    let request_id = chat::request_id(
        headers
            .get("x-request-id")
            .and_then(|value| value.to_str().ok()),
    );
    let limits = state.limits;
    let media = state.media.clone();
    let parsed =
        tokio::task::spawn_blocking(move || chat::parse_chat_request(&body, &limits, &media))
            .await
            .map_err(|err| ApiError::internal(format!("request parsing task failed: {err}")))??;
    if let Some(model) = &parsed.model
        && *model != epd.served_model_name
    {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "model_not_found",
            format!(
                "the model `{model}` does not exist; this server serves `{}`",
                epd.served_model_name
            ),
        ));
    }
    let published = epd
        .produce(state.engine.as_ref(), permit, parsed.epd)
        .await
        .map_err(produce_error)?;
    let hits = published.iter().filter(|p| p.stored == Stored::Hit).count();
    let hits = u64::try_from(hits).unwrap_or(u64::MAX);
    let total = u64::try_from(published.len()).unwrap_or(u64::MAX);
    state.metrics.observe_images(hits, total - hits);
    Ok(Json(chat::chat_response(
        &request_id,
        &epd.served_model_name,
        &published,
    )))
}

/// Takes a request slot, then reads the body. Refused before the body is read, so that a burst
/// beyond the bounds holds no memory. The read is bounded by the body-read timeout: a client
/// that stops sending gets a 408 and gives its slot back (the permit drops with the error).
async fn admit_and_read<E: Engine>(
    state: &Arc<ServerState<E>>,
    request: Request,
) -> Result<(E::Permit, Bytes), ApiError> {
    let permit = match state.engine.admit() {
        Ok(permit) => permit,
        Err(err) => return Err(refuse(request, err.into(), state.limits.max_body_bytes).await),
    };
    let body = tokio::time::timeout(state.body_read_timeout, Bytes::from_request(request, state))
        .await
        .map_err(|_elapsed| ApiError::body_read_timeout(state.body_read_timeout))?
        .map_err(|rejection| body_rejection(&rejection, state.limits.max_body_bytes))?;
    Ok((permit, body))
}

async fn models<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    let epd = state.epd.as_ref().ok_or_else(epd_not_configured)?;
    Ok(Json(chat::models_response(&epd.served_model_name)))
}

fn epd_not_configured() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "not_found",
        "this server has no chat endpoint (it was built without a served model)",
    )
}

fn produce_error(err: ProduceError) -> ApiError {
    match err {
        ProduceError::BadRequest { code, message } => ApiError::bad_request(code, message),
        ProduceError::Forbidden { code, message } => ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            code,
            message,
        ),
        ProduceError::Engine(err) => err.into(),
        ProduceError::Store(err) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "ec_store_error",
            err.to_string(),
        ),
        // The consumer failed, not iris: a gateway error, which vLLM's proxy passes on.
        ProduceError::Push(err) => ApiError::new(
            if err.failure == iris_ec::mooncake::PushFailure::Timeout {
                StatusCode::GATEWAY_TIMEOUT
            } else {
                StatusCode::BAD_GATEWAY
            },
            "upstream_error",
            "ec_push_failed",
            err.to_string(),
        ),
        other => ApiError::internal(other.to_string()),
    }
}

async fn reset_mm_cache<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    Ok(reset_json(state.engine.reset_mm_cache().await?))
}

async fn reset_encoder_cache<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    Ok(reset_json(state.engine.reset_encoder_cache().await?))
}

async fn reset_allocator<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    Ok(reset_json(state.engine.reset_allocator().await?))
}

async fn reset_all<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    Ok(reset_json(state.engine.reset_all().await?))
}

async fn sleep<E: Engine>(
    State(state): Shared<E>,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    let level = parse_sleep_level(query.as_deref())?;
    let report = state.engine.sleep(level).await?;
    let mut body = reset_json(report).0;
    body["level"] = json!(level);
    body["is_sleeping"] = json!(state.engine.is_sleeping());
    Ok(Json(body))
}

async fn wake_up<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    state.engine.wake_up().await?;
    Ok(Json(json!({ "is_sleeping": state.engine.is_sleeping() })))
}

async fn is_sleeping<E: Engine>(State(state): Shared<E>) -> Json<Value> {
    Json(json!({ "is_sleeping": state.engine.is_sleeping() }))
}

async fn server_info<E: Engine>(State(state): Shared<E>) -> Json<Value> {
    Json(state.engine.server_info())
}

/// Runs `snapshot` on the blocking pool: a memory snapshot waits for the device's queue to
/// drain (its figures are exact), which would hold an async worker thread, and with it
/// `/health` and every other request on that thread, for as long.
async fn off_the_async_threads<T: Send + 'static>(
    snapshot: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(snapshot)
        .await
        .map_err(|err| ApiError::internal(format!("memory snapshot task failed: {err}")))
}

async fn memory<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    let (snapshot, memory) =
        off_the_async_threads(move || (state.engine.metrics_snapshot(), state.engine.memory()))
            .await?;
    let snapshot = serde_json::to_value(snapshot)
        .map_err(|err| ApiError::internal(format!("metrics snapshot to JSON: {err}")))?;
    let body = match memory {
        Value::Object(mut map) => {
            map.insert("metrics".into(), snapshot);
            Value::Object(map)
        }
        other => json!({ "engine": other, "metrics": snapshot }),
    };
    Ok(Json(body))
}

async fn metrics_text<E: Engine>(State(state): Shared<E>) -> Result<Response, ApiError> {
    let text = off_the_async_threads(move || state.metrics.render())
        .await?
        .map_err(|err| ApiError::internal(format!("rendering metrics: {err}")))?;
    Ok(([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response())
}

async fn health<E: Engine>(State(state): Shared<E>) -> Result<Json<Value>, ApiError> {
    state.engine.health()?;
    Ok(Json(json!({ "status": "ok" })))
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "not_found",
        "no such route",
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        "this route does not accept this HTTP method",
    )
}

async fn require_api_key<E: Engine>(
    State(state): Shared<E>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    if let Some(expected) = &state.api_key_hash {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .map(|k| blake3::hash(k.as_bytes()));
        if given.as_ref() != Some(expected) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// The token of an `Authorization: Bearer <token>` value, the scheme in any case (RFC 9110
/// makes auth schemes case-insensitive; vLLM compares `scheme.lower()`).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// Answers 503 on every route once the engine is dead or its device lost.
async fn require_alive<E: Engine>(State(state): Shared<E>, req: Request, next: Next) -> Response {
    match state.engine.health() {
        Ok(()) => next.run(req).await,
        Err(err) => refuse(req, err.into(), state.limits.max_body_bytes)
            .await
            .into_response(),
    }
}

/// Reads and drops a refused request's body, a frame at a time (nothing is kept), then returns
/// `error`. A server that answered without reading the body would close the connection with
/// unread data, which resets it: the client could lose the answer before reading it.
async fn refuse(request: Request, error: ApiError, limit: usize) -> ApiError {
    use http_body_util::BodyExt as _;
    let mut body = request.into_body();
    let mut seen = 0usize;
    while seen <= limit {
        match body.frame().await {
            Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |data| data.len()),
            _ => break,
        }
    }
    error
}

async fn track_request<E: Engine>(State(state): Shared<E>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    // A label per method the server knows: a client's made-up methods would each add a
    // series to the metrics for good (this layer runs before the API-key check).
    let method = match *req.method() {
        Method::GET
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::HEAD
        | Method::OPTIONS
        | Method::PATCH => req.method().as_str().to_owned(),
        _ => "other".to_owned(),
    };
    let start = Instant::now();
    let response = next.run(req).await;
    let seconds = start.elapsed().as_secs_f64();
    state
        .metrics
        .observe_request(&route, &method, response.status().as_u16(), seconds);
    response
}

fn reset_json(report: ResetReport) -> Json<Value> {
    let released = report.processor_cache_bytes
        + report.encoder_cache_bytes
        + report.allocator_bytes
        + report.plugin_cache_bytes;
    Json(json!({
        "processor_cache_bytes": report.processor_cache_bytes,
        "encoder_cache_bytes": report.encoder_cache_bytes,
        "encoder_cache_entries": report.encoder_cache_entries,
        "allocator_bytes": report.allocator_bytes,
        "plugin_cache_bytes": report.plugin_cache_bytes,
        "released_bytes": released,
    }))
}

fn parse_sleep_level(query: Option<&str>) -> Result<u8, ApiError> {
    let mut level = 1;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key == "level" {
            level = match value {
                "1" => 1,
                "2" => 2,
                other => {
                    return Err(ApiError::bad_request(
                        "invalid_sleep_level",
                        format!("query parameter level must be 1 or 2, got {other:?}"),
                    ));
                }
            };
        }
    }
    Ok(level)
}

fn body_rejection(rejection: &BytesRejection, limit: usize) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    } else {
        ApiError::new(
            rejection.status(),
            "invalid_request_error",
            "invalid_body",
            format!("cannot read the request body: {}", rejection.body_text()),
        )
    }
}

#[cfg(test)]
mod chat_tests;
#[cfg(test)]
mod push_tests;
#[cfg(test)]
mod tests;
