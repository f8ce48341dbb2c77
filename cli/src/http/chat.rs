//! `POST /v1/chat/completions` and `GET /v1/models`: iris as vLLM's encoder instance.
//!
//! The request is what vLLM 0.33's disaggregation proxy sends an encoder (media parts with
//! uuids, `stream: false`, `mm_processor_kwargs`, `media_io_kwargs`, `x-request-id`) or what a
//! person sends directly (text parts are accepted and not used; image parts without a uuid get
//! hashed identifiers). The reply is a `chat.completion` object as vLLM's encoder instance
//! returns it: no generated text (`finish_reason` `stop`, as vLLM stops an encoder-only request
//! once its prompt is consumed), and `ec_transfer_params` keyed by identifier, which is all the
//! proxy reads. `usage.prompt_tokens` counts the images' embedding tokens only: iris has no
//! tokenizer.
//!
//! Images come as base64 `data:` URLs of any media type (the bytes decide, as in vLLM);
//! `file://` URLs under `--allowed-local-media-path` and
//! `http(s)://` URLs of hosts in `--allowed-media-domains` are read too (both off by default;
//! fetches have a time limit and the body-size limit, and follow no redirect). Videos
//! (`video_url` parts) come the same three ways, a data URL of any media type; they are decoded
//! with FFmpeg, sampled as the model's vLLM loader samples them (`media_io_kwargs.video`), and
//! published as vLLM's encoder publishes them (`modality` "video", `video_grid_thw`, and
//! Qwen3-VL's `timestamps`).
//!
//! `ec_transfer_params` with `consumer_zmq` and one `transfer_id` per image (what the proxy sends
//! when it runs with `--ec-consumer-zmq-addrs`) makes iris push each image's rows into that
//! consumer before replying (the push connector, `ECMooncakeConnector`); the reply then names
//! each identifier's `transfer_id`, as vLLM's producer does. With `--allowed-ec-consumers`, a
//! consumer whose host is not on the list is refused with a 403 (`ec_consumer_not_allowed`)
//! before anything connects to it.
//!
//! Refused with a 4xx that names the field: audio and embedding parts, `stream: true`,
//! `n` other than 1, `ec_transfer_params` that are malformed or name a consumer when no push
//! connector is configured, processor or media options iris does not implement, and any other
//! field iris does not know. Accepted with no
//! effect (iris generates no text): `max_tokens`, `max_completion_tokens`, `temperature`,
//! `top_p`, `user`, `priority` (iris schedules first come, first served), `session_id`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::request::{self, Limits};
use crate::epd::{EpdRequest, Item, Published, PushTarget};
use iris_core::budget::Modality;
use iris_ec::identifier::OrderedJson;

/// Fields accepted with no effect: sampling controls of a model iris does not run, and
/// scheduling hints it does not use.
const NO_OP_FIELDS: [&str; 7] = [
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "user",
    "priority",
    "session_id",
];

/// vLLM's default image fetch timeout (`VLLM_IMAGE_FETCH_TIMEOUT`), in seconds.
pub const DEFAULT_MEDIA_FETCH_TIMEOUT_S: u64 = 5;
/// vLLM's default video fetch timeout (`VLLM_VIDEO_FETCH_TIMEOUT`), in seconds.
pub const DEFAULT_VIDEO_FETCH_TIMEOUT_S: u64 = 30;

/// Where images may come from besides `data:` URLs: `file://` URLs under a folder (vLLM's
/// `--allowed-local-media-path`), `http(s)://` URLs of listed hosts (vLLM's
/// `--allowed-media-domains`). Both are refused unless configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaAccess {
    /// The folder (canonical) under which files may be read.
    pub allowed_local_media_path: Option<PathBuf>,
    /// Hosts whose `http(s)://` URLs are fetched (lower case); empty refuses every remote URL.
    pub allowed_media_domains: Vec<String>,
    /// Time limit of one image fetch, connection to last byte.
    pub fetch_timeout: std::time::Duration,
    /// Time limit of one video fetch.
    pub video_fetch_timeout: std::time::Duration,
}

impl Default for MediaAccess {
    fn default() -> Self {
        Self {
            allowed_local_media_path: None,
            allowed_media_domains: Vec::new(),
            fetch_timeout: std::time::Duration::from_secs(DEFAULT_MEDIA_FETCH_TIMEOUT_S),
            video_fetch_timeout: std::time::Duration::from_secs(DEFAULT_VIDEO_FETCH_TIMEOUT_S),
        }
    }
}

/// A parsed chat request.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// The `model` field, when given.
    pub model: Option<String>,
    /// The images and options.
    pub epd: EpdRequest,
}

/// Parses and checks a chat request body.
///
/// # Errors
/// A 400 [`ApiError`] naming the field.
pub fn parse_chat_request(
    body: &[u8],
    limits: &Limits,
    media: &MediaAccess,
) -> Result<ChatRequest, ApiError> {
    let obj = request::parse_object(body)?;
    for key in obj.keys() {
        let known = matches!(
            key.as_str(),
            "model"
                | "messages"
                | "stream"
                | "n"
                | "mm_processor_kwargs"
                | "media_io_kwargs"
                | "ec_transfer_params"
        ) || NO_OP_FIELDS.contains(&key.as_str());
        if !known {
            return Err(ApiError::bad_request(
                "unsupported_field",
                format!(
                    "field `{key}` is not supported by iris's encoder endpoint (it encodes images and generates no text)"
                ),
            ));
        }
    }
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => return Err(request::wrong_type("model", "a string", other)),
    };
    match obj.get("stream") {
        None | Some(Value::Null | Value::Bool(false)) => {}
        Some(Value::Bool(true)) => {
            return Err(ApiError::bad_request(
                "stream_not_supported",
                "stream: true is not supported: an encoder instance generates no text to stream; send stream: false",
            ));
        }
        Some(other) => return Err(request::wrong_type("stream", "a boolean", other)),
    }
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(other) => {
            return Err(ApiError::bad_request(
                "unsupported_field",
                format!("n must be 1, got {other}"),
            ));
        }
    }
    let push = parse_ec_transfer_params(obj.get("ec_transfer_params"))?;
    let kwargs = |field: &'static str| -> Result<Option<OrderedJson>, ApiError> {
        match obj.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(_)) => {
                let text = obj[field].to_string();
                OrderedJson::parse(field, &text)
                    .map(Some)
                    .map_err(|err| ApiError::bad_request("invalid_mm_kwargs", err.to_string()))
            }
            Some(other) => Err(request::wrong_type(field, "an object", other)),
        }
    };
    let mm_processor_kwargs = kwargs("mm_processor_kwargs")?;
    let media_io_kwargs = kwargs("media_io_kwargs")?;
    let messages = match obj.get("messages") {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request(
                "missing_field",
                "messages must not be empty",
            ));
        }
        Some(other) => return Err(request::wrong_type("messages", "an array", other)),
        None => {
            return Err(ApiError::bad_request(
                "missing_field",
                "messages is missing",
            ));
        }
    };
    let mut parts = Vec::new();
    for (m, message) in messages.iter().enumerate() {
        let field = format!("messages[{m}]");
        let Value::Object(message) = message else {
            return Err(request::wrong_type(&field, "an object", message));
        };
        match message.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(content)) => {
                for (p, part) in content.iter().enumerate() {
                    let pfield = format!("{field}.content[{p}]");
                    if let Some(part) = parse_part(&pfield, part)? {
                        parts.push(part);
                    }
                }
            }
            Some(other) => {
                return Err(request::wrong_type(
                    &format!("{field}.content"),
                    "a string or an array of parts",
                    other,
                ));
            }
        }
    }
    // Counted before anything is fetched, read or probed: a request over a limit costs nothing.
    let videos = parts
        .iter()
        .filter(|part| part.modality == Modality::Video)
        .count();
    request::check_counts(parts.len() - videos, videos, limits)?;
    let items = load_parts(parts, limits, media)?;
    Ok(ChatRequest {
        model,
        epd: EpdRequest {
            items,
            push,
            mm_processor_kwargs,
            media_io_kwargs,
        },
    })
}

/// `ec_transfer_params` as vLLM's proxy sends it to an encoder when it runs with
/// `--ec-consumer-zmq-addrs`: `{"consumer_zmq": "tcp://host:port", "ec_items": [{"transfer_id":
/// T}, ...]}`. Without `consumer_zmq` there is nothing to push to (as in vLLM).
fn parse_ec_transfer_params(value: Option<&Value>) -> Result<Option<PushTarget>, ApiError> {
    let bad = |message: String| ApiError::bad_request("invalid_ec_transfer_params", message);
    let params = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(params)) => params,
        Some(other) => {
            return Err(request::wrong_type(
                "ec_transfer_params",
                "an object",
                other,
            ));
        }
    };
    for key in params.keys() {
        if !matches!(key.as_str(), "consumer_zmq" | "ec_items") {
            return Err(bad(format!(
                "ec_transfer_params.{key} is not supported (keys: consumer_zmq, ec_items)"
            )));
        }
    }
    let consumer_zmq = match params.get("consumer_zmq") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(address)) => address.clone(),
        Some(other) => {
            return Err(request::wrong_type(
                "ec_transfer_params.consumer_zmq",
                "a string",
                other,
            ));
        }
    };
    let valid_address = consumer_zmq
        .strip_prefix("tcp://")
        .and_then(|rest| iris_ec::mooncake::transfer::split_host_port(rest).ok())
        .is_some_and(|(_, port)| port != 0);
    if !valid_address {
        return Err(bad(format!(
            "ec_transfer_params.consumer_zmq {consumer_zmq:?} is not a tcp://host:port address"
        )));
    }
    let items = match params.get("ec_items") {
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) => {
            return Err(bad(
                "ec_transfer_params.ec_items is missing: one {\"transfer_id\"} per image"
                    .to_owned(),
            ));
        }
        Some(other) => {
            return Err(request::wrong_type(
                "ec_transfer_params.ec_items",
                "an array",
                other,
            ));
        }
    };
    let mut transfer_ids = Vec::with_capacity(items.len());
    let mut mm_hashes = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let field = format!("ec_transfer_params.ec_items[{index}]");
        let Value::Object(item) = item else {
            return Err(request::wrong_type(&field, "an object", item));
        };
        match item.get("transfer_id") {
            Some(Value::String(id)) if !id.is_empty() => transfer_ids.push(id.clone()),
            _ => {
                return Err(bad(format!(
                    "{field}.transfer_id must be a non-empty string"
                )));
            }
        }
        match item.get("mm_hash") {
            None | Some(Value::Null) => mm_hashes.push(None),
            Some(Value::String(hash)) => mm_hashes.push(Some(hash.clone())),
            Some(other) => {
                return Err(request::wrong_type(
                    &format!("{field}.mm_hash"),
                    "a string",
                    other,
                ));
            }
        }
    }
    Ok(Some(PushTarget {
        consumer_zmq,
        transfer_ids,
        mm_hashes,
    }))
}

/// One content part: `Some(item)` for an image, `None` for text.
/// A media part of a message, its payload not yet read.
struct MediaPart<'a> {
    /// The URL's field, for errors.
    field: String,
    url: &'a str,
    uuid: Option<String>,
    modality: Modality,
}

impl MediaPart<'_> {
    /// Whether the payload is fetched over the network.
    fn is_remote(&self) -> bool {
        let scheme = self.url.split_once(':').map_or("", |(scheme, _)| scheme);
        scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https")
    }

    /// Reads the part's payload (a data URL, a local file or a remote URL) into an item.
    fn load(self, limits: &Limits, media: &MediaAccess) -> Result<Item, ApiError> {
        let (bytes, jpeg_sequence) = if self.modality == Modality::Video {
            load_video(&self.field, self.url, limits, media)?
        } else {
            (load_image(&self.field, self.url, limits, media)?, false)
        };
        Ok(Item {
            bytes,
            uuid: self.uuid,
            modality: self.modality,
            jpeg_sequence,
        })
    }
}

/// The most remote payloads one request fetches at once.
const CONCURRENT_FETCHES: usize = 8;

/// Reads the parts' payloads in request order, fetching the remote ones (`http(s)://`) side by
/// side, up to [`CONCURRENT_FETCHES`] at a time, as vLLM gathers a message's fetches: a
/// request of eight slow URLs waits for the slowest, not for their sum. The answer is the first
/// failure in request order, after which no further part is read.
fn load_parts(
    parts: Vec<MediaPart<'_>>,
    limits: &Limits,
    media: &MediaAccess,
) -> Result<Vec<Item>, ApiError> {
    let mut loaded: Vec<Option<Result<Item, ApiError>>> = Vec::new();
    loaded.resize_with(parts.len(), || None);
    // Stores a part's result; whether it failed.
    let mut store = |index: usize, result: Result<Item, ApiError>| {
        let failed = result.is_err();
        loaded[index] = Some(result);
        failed
    };
    let join = |handle: std::thread::ScopedJoinHandle<'_, Result<Item, ApiError>>| {
        handle.join().unwrap_or_else(|_| {
            Err(ApiError::internal(
                "a media fetch panicked; the request cannot be served",
            ))
        })
    };
    std::thread::scope(|scope| {
        let mut running = std::collections::VecDeque::new();
        let mut failed = false;
        for (index, part) in parts.into_iter().enumerate() {
            if failed {
                break;
            }
            if part.is_remote() {
                if running.len() == CONCURRENT_FETCHES
                    && let Some((oldest, handle)) = running.pop_front()
                {
                    failed = store(oldest, join(handle));
                }
                running.push_back((index, scope.spawn(move || part.load(limits, media))));
            } else {
                failed = store(index, part.load(limits, media));
            }
        }
        for (index, handle) in running {
            store(index, join(handle));
        }
    });
    // In order, up to the first failure: every part before it was read.
    loaded
        .into_iter()
        .map(|result| {
            result.unwrap_or_else(|| {
                Err(ApiError::internal(
                    "a media part was left unread without a failure before it",
                ))
            })
        })
        .collect()
}

/// A content part: `None` for text, else its medium, URL and uuid (the payload is read later,
/// once the request's counts are checked).
fn parse_part<'a>(field: &str, part: &'a Value) -> Result<Option<MediaPart<'a>>, ApiError> {
    let Value::Object(part) = part else {
        return Err(request::wrong_type(field, "a content part object", part));
    };
    // vLLM stringifies a uuid of any JSON type (`str(uuid)`); iris takes strings and integers.
    let uuid = match part.get("uuid") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        Some(other) => {
            return Err(request::wrong_type(
                &format!("{field}.uuid"),
                "a string",
                other,
            ));
        }
    };
    let kind = match part.get("type") {
        Some(Value::String(s)) => s.as_str(),
        // vLLM infers the type of an untyped part from its payload key.
        None if part.contains_key("image_url") => "image_url",
        None if part.contains_key("video_url") => "video_url",
        None if part.contains_key("text") => "text",
        _ => {
            return Err(ApiError::bad_request(
                "invalid_content_part",
                format!("{field}.type must be a string such as \"text\" or \"image_url\""),
            ));
        }
    };
    match kind {
        "text" | "input_text" => Ok(None),
        "image_url" | "input_image" => {
            let key = if kind == "input_image" && part.contains_key("image_url") {
                "image_url"
            } else if kind == "input_image" {
                "input_image"
            } else {
                "image_url"
            };
            let ufield = format!("{field}.{key}");
            let url = part_url(field, &ufield, part.get(key), uuid.is_some(), "image")?;
            Ok(Some(MediaPart {
                field: format!("{ufield}.url"),
                url,
                uuid,
                modality: Modality::Image,
            }))
        }
        "video_url" => {
            let ufield = format!("{field}.video_url");
            let url = part_url(
                field,
                &ufield,
                part.get("video_url"),
                uuid.is_some(),
                "video",
            )?;
            Ok(Some(MediaPart {
                field: format!("{ufield}.url"),
                url,
                uuid,
                modality: Modality::Video,
            }))
        }
        "input_audio" | "audio_url" | "audio_embeds" => Err(ApiError::bad_request(
            "unsupported_modality",
            format!("{field}.type is {kind:?}: iris encodes images and videos, not audio"),
        )),
        "image_embeds" | "video_embeds" | "image_pil" | "prompt_embeds" => {
            Err(ApiError::bad_request(
                "unsupported_content_part",
                format!(
                    "{field}.type is {kind:?}: an encoder instance takes images and videos, not precomputed embeddings"
                ),
            ))
        }
        other => Err(ApiError::bad_request(
            "unsupported_content_part",
            format!(
                "{field}.type {other:?} is not supported (\"text\", \"image_url\" and \"video_url\" are)"
            ),
        )),
    }
}

/// The URL of a media part's payload `value` (a string, or an object with a `url`), at
/// `ufield`; `what` names the medium in errors. A part with a uuid and no payload is refused:
/// iris encodes what it is sent.
fn part_url<'a>(
    field: &str,
    ufield: &str,
    value: Option<&'a Value>,
    has_uuid: bool,
    what: &str,
) -> Result<&'a str, ApiError> {
    match value {
        Some(Value::String(s)) => Ok(s.as_str()),
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(s)) => Ok(s.as_str()),
            _ => Err(ApiError::bad_request(
                "missing_field",
                format!("{ufield}.url must be a string"),
            )),
        },
        None | Some(Value::Null) if has_uuid => Err(ApiError::bad_request(
            if what == "video" {
                "missing_video"
            } else {
                "missing_image"
            },
            format!(
                "{field} has a uuid but no {what}: iris encodes what it is sent, so every part needs its {what}"
            ),
        )),
        _ => Err(ApiError::bad_request(
            "missing_field",
            format!("{ufield} must be a URL string or an object with a `url`"),
        )),
    }
}

/// Loads an image URL: a `data:` URL (of any media type: the bytes decide), a `file://` URL
/// under the allowed folder, or an `http(s)://` URL of an allowed host.
fn load_image(
    field: &str,
    url: &str,
    limits: &Limits,
    media: &MediaAccess,
) -> Result<Vec<u8>, ApiError> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("file") => {
            let bytes = read_local_file(field, url, limits, media)?;
            request::check_image_bytes(field, &bytes, limits)?;
            Ok(bytes)
        }
        Some("http" | "https") => {
            let bytes = fetch_remote(field, url, limits, media, media.fetch_timeout)?;
            request::check_image_bytes(field, &bytes, limits)?;
            Ok(bytes)
        }
        Some("data") => request::decode_image_url(field, url, limits).map(|image| image.bytes),
        other => Err(unsupported_scheme(field, other, Modality::Image)),
    }
}

/// The 400 for a media URL whose scheme is none of those chat reads (vLLM: "The URL must be
/// either a HTTP, data or file URL."), its code naming the modality.
fn unsupported_scheme(field: &str, scheme: Option<&str>, modality: Modality) -> ApiError {
    let code = match modality {
        Modality::Video => "invalid_video_url",
        _ => "invalid_image_url",
    };
    let got = scheme.map_or_else(|| "no scheme".to_owned(), |s| format!("scheme {s:?}"));
    ApiError::bad_request(
        code,
        format!("{field}: the URL must be an http(s), data or file URL, got {got}"),
    )
}

/// Loads a video URL: a base64 `data:` URL of any media type (vLLM hands every one to the
/// decoder), a `file://` URL under the allowed folder, or an `http(s)://` URL of an allowed
/// host. The clip is not opened here: FFmpeg decides what it is. A `data:video/jpeg` URL is a
/// list of base64 JPEG frames: its text is returned as is, with `true`.
fn load_video(
    field: &str,
    url: &str,
    limits: &Limits,
    media: &MediaAccess,
) -> Result<(Vec<u8>, bool), ApiError> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    let bytes = match scheme.as_deref() {
        Some("file") => read_local_file(field, url, limits, media)?,
        Some("http" | "https") => {
            fetch_remote(field, url, limits, media, media.video_fetch_timeout)?
        }
        Some("data") => {
            let data = request::split_data_url(field, url, "data:video/<type>;base64,...")?;
            if !data.is_base64 {
                return Err(request::not_base64(field, Modality::Video));
            }
            if data.media_type == "video/jpeg" {
                if data.payload.trim().is_empty() {
                    return Err(ApiError::bad_request(
                        "corrupt_video",
                        format!("{field}: the frame list is empty"),
                    ));
                }
                return Ok((data.payload.as_bytes().to_vec(), true));
            }
            request::decode_base64(field, data.payload)?
        }
        other => return Err(unsupported_scheme(field, other, Modality::Video)),
    };
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "corrupt_video",
            format!("{field}: the video is empty"),
        ));
    }
    Ok((bytes, false))
}

/// Fetches an `http(s)://` image of an allowed host, within the size and time limits, without
/// following redirects (a redirect could lead to a host that is not allowed).
fn fetch_remote(
    field: &str,
    url: &str,
    limits: &Limits,
    media: &MediaAccess,
    timeout: std::time::Duration,
) -> Result<Vec<u8>, ApiError> {
    if media.allowed_media_domains.is_empty() {
        return Err(ApiError::bad_request(
            "remote_url_not_supported",
            format!(
                "{field}: http(s) image URLs are refused unless iris serve runs with --allowed-media-domains; send the image as a data: URL"
            ),
        ));
    }
    let uri: ureq::http::Uri = url.parse().map_err(|err| {
        ApiError::bad_request("invalid_image_url", format!("{field}: not a URL: {err}"))
    })?;
    let host = uri.host().unwrap_or_default().to_ascii_lowercase();
    if !media.allowed_media_domains.contains(&host) {
        return Err(ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "invalid_request_error",
            "remote_url_forbidden",
            format!(
                "{field}: host {host:?} is not in --allowed-media-domains ({})",
                media.allowed_media_domains.join(", ")
            ),
        ));
    }
    let failed = |reason: String| {
        ApiError::bad_request(
            "remote_fetch_failed",
            format!("{field}: cannot fetch {url}: {reason}"),
        )
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .max_redirects(0)
        .build()
        .into();
    let mut response = agent
        .get(url)
        .call()
        .map_err(|err| failed(err.to_string()))?;
    let status = response.status();
    if !status.is_success() {
        let why = if status.is_redirection() {
            format!("HTTP {status}; redirects are not followed (send the final URL)")
        } else {
            format!("HTTP {status}")
        };
        return Err(failed(why));
    }
    let limit = u64::try_from(limits.max_body_bytes).unwrap_or(u64::MAX);
    response
        .body_mut()
        .with_config()
        .limit(limit)
        .read_to_vec()
        .map_err(|err| match err {
            ureq::Error::BodyExceedsLimit(_) => ApiError::bad_request(
                "image_too_large",
                format!(
                    "{field}: the image at {url} is larger than {} bytes (--max-body-bytes)",
                    limits.max_body_bytes
                ),
            ),
            other => failed(other.to_string()),
        })
}

fn read_local_file(
    field: &str,
    url: &str,
    limits: &Limits,
    media: &MediaAccess,
) -> Result<Vec<u8>, ApiError> {
    let Some(allowed) = &media.allowed_local_media_path else {
        return Err(ApiError::bad_request(
            "local_media_disabled",
            format!(
                "{field}: file:// URLs are refused unless iris serve runs with --allowed-local-media-path DIR"
            ),
        ));
    };
    let path = url
        .get(7..)
        .filter(|_| url[..7].eq_ignore_ascii_case("file://"))
        .map(percent_decode)
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_image_url",
                format!("{field}: a file URL is file:///absolute/path"),
            )
        })?;
    let forbidden = || {
        ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "invalid_request_error",
            "local_media_forbidden",
            format!(
                "{field}: {path} is not a readable file under the allowed folder {}",
                allowed.display()
            ),
        )
    };
    // Canonical paths, so that `..` and links cannot leave the allowed folder.
    let canonical = Path::new(&path).canonicalize().map_err(|_| forbidden())?;
    if !canonical.starts_with(allowed) || !canonical.is_file() {
        return Err(forbidden());
    }
    let size = std::fs::metadata(&canonical)
        .map_err(|_| forbidden())?
        .len();
    if size > limits.max_body_bytes as u64 {
        return Err(ApiError::bad_request(
            "image_too_large",
            format!(
                "{field}: the file has {size} bytes; the limit is {} bytes (--max-body-bytes)",
                limits.max_body_bytes
            ),
        ));
    }
    std::fs::read(&canonical).map_err(|_| forbidden())
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = text.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `chat.completion` reply, as vLLM's encoder instance returns it.
#[must_use]
pub fn chat_response(request_id: &str, model: &str, published: &[Published]) -> Value {
    let mut params = Map::new();
    for (index, item) in published.iter().enumerate() {
        let entry = params.entry(item.identifier.clone()).or_insert_with(|| {
            // The metadata an EC consumer requires of the modality (vLLM's `embedding_fields`
            // with role "metadata").
            let metadata = match (item.modality, &item.timestamps) {
                (Modality::Video, None) => json!({ "video_grid_thw": item.grid_thw }),
                (Modality::Video, Some(timestamps)) => {
                    json!({ "video_grid_thw": item.grid_thw, "timestamps": timestamps })
                }
                _ => json!({ "image_grid_thw": item.grid_thw }),
            };
            json!({
                "modality": item.modality.to_string(),
                "item_indices": [],
                "metadata": metadata,
            })
        });
        if let Some(Value::Array(indices)) = entry.get_mut("item_indices") {
            indices.push(json!(index));
        }
        // As vLLM's producer: the transfer id of the item's last occurrence.
        if let Some(transfer_id) = &item.transfer_id {
            entry["transfer_id"] = json!(transfer_id);
        }
    }
    let prompt_tokens: u64 = published.iter().map(|p| p.num_tokens).sum();
    json!({
        "id": format!("chatcmpl-{request_id}"),
        "object": "chat.completion",
        "created": unix_seconds(),
        "model": model,
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": "", "tool_calls": [] },
            "logprobs": null,
            "finish_reason": "stop",
            "stop_reason": null,
        }],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
        },
        "ec_transfer_params": params,
    })
}

/// `GET /v1/models`: the one served model.
#[must_use]
pub fn models_response(name: &str) -> Value {
    json!({
        "object": "list",
        "data": [{
            "id": name,
            "object": "model",
            "created": unix_seconds(),
            "owned_by": "iris",
            "root": name,
            "parent": null,
        }],
    })
}

/// A request id: the client's `x-request-id`, or a fresh one.
#[must_use]
pub fn request_id(header: Option<&str>) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    if let Some(id) = header.map(str::trim).filter(|id| !id.is_empty()) {
        return id.to_owned();
    }
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let hash = blake3::hash(format!("{}:{now}:{n}", std::process::id()).as_bytes());
    let mut id = String::with_capacity(32);
    for byte in &hash.as_bytes()[..16] {
        let _ = write!(id, "{byte:02x}");
    }
    id
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
