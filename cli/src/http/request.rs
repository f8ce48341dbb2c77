//! `POST /v1/encode`: request parsing, input limits and the response body.
//!
//! Requests carry images as data URLs, either as a plain list (`{"images": ["data:..."]}`), as
//! OpenAI chat messages (`{"messages": [{"role": "user", "content": [parts]}]}`) or as a bare
//! content-part list (`{"content": [parts]}`). Only data URLs are accepted: iris fetches nothing.
//! Everything a client can get wrong is checked here, before the engine sees the request, and
//! answered with a 4xx that names the field: JSON syntax, field types, the data URL syntax,
//! base64, the file signature, and the image dimensions read from the header alone. A data
//! URL's media type is not checked: as vLLM's `ImageMediaIO.load_base64`, iris identifies the
//! bytes by their content (the file signature), whatever type the URL declares.

use std::io::Cursor;

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use serde_json::{Map, Value, json};

use super::engine_api::{
    EncodeOptions, EngineError, HostTensor, ImageInput, ImageResult, MediaInput, OpenedClip,
    ProcessorOverrides, SamplingOptions, VideoInput,
};
use super::error::ApiError;
use iris_core::budget::{MmLimits, Modality};

/// Default request body limit: 64 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;
/// Default number of images one request may carry.
pub const DEFAULT_MAX_IMAGES_PER_REQUEST: usize = 16;
/// Default pixel limit per image (width x height from the header): 4096 x 4096.
pub const DEFAULT_MAX_IMAGE_PIXELS: u64 = 4096 * 4096;

/// Input limits of the HTTP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted request body, in bytes (larger bodies get a 413).
    pub max_body_bytes: usize,
    /// Most media items (images and videos together) in one request.
    pub max_images_per_request: usize,
    /// Most pixels (width x height, from the image header) in one image.
    pub max_image_pixels: u64,
    /// Most images and most videos in one request (`--limit-mm-per-prompt`, the engine's):
    /// counted before any item is decoded, fetched or probed.
    pub mm_per_prompt: MmLimits,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_images_per_request: DEFAULT_MAX_IMAGES_PER_REQUEST,
            max_image_pixels: DEFAULT_MAX_IMAGE_PIXELS,
            mm_per_prompt: MmLimits::default(),
        }
    }
}

/// One item of an encode request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestItem {
    /// An image, its header checked.
    Image(ImageInput),
    /// A video clip's bytes (decoded by the engine, with FFmpeg).
    Video(Vec<u8>),
}

/// The engine's inputs for `items`, in order: images as they are, clips decoded with the
/// model's loader and vLLM's default sampling, as `/v1/encode` takes them. Every clip is
/// probed first (all at once, each on the blocking pool), its tokens are charged to `permit`
/// under `overrides`, and only then are the clips decoded (all at once): a request's decoded
/// frames are held to the admission's token bound. A clip's client error names it
/// (`video N: ...`).
///
/// # Errors
/// The first clip the engine cannot probe or decode, or whose tokens the budget or the
/// admission refuses.
pub async fn media_inputs<E: super::engine_api::Engine>(
    engine: &E,
    permit: &mut E::Permit,
    items: Vec<RequestItem>,
    overrides: &ProcessorOverrides,
) -> Result<Vec<MediaInput>, EngineError> {
    let opened = futures::future::try_join_all(items.into_iter().enumerate().map(
        |(index, item)| async move {
            match item {
                RequestItem::Image(image) => Ok(Opened::Image(image)),
                RequestItem::Video(bytes) => engine
                    .open_video(bytes, SamplingOptions::default())
                    .await
                    .map(|clip| Opened::Clip(index, clip))
                    .map_err(|err| crate::epd::name_video(index, err)),
            }
        },
    ))
    .await?;
    for item in &opened {
        if let Opened::Clip(index, clip) = item {
            engine.reserve_video(permit, *index, clip.frames(), clip.size(), overrides)?;
        }
    }
    let permit = &*permit;
    futures::future::try_join_all(opened.into_iter().map(|item| async move {
        match item {
            Opened::Image(image) => Ok(MediaInput::Image(image)),
            Opened::Clip(index, clip) => engine
                .decode_video(clip, engine.hold(permit))
                .await
                .map(|video| {
                    MediaInput::Video(VideoInput {
                        video: std::sync::Arc::new(video),
                    })
                })
                .map_err(|err| crate::epd::name_video(index, err)),
        }
    }))
    .await
}

/// An item of [`media_inputs`] between probing and decoding.
enum Opened {
    Image(ImageInput),
    /// A clip and its index in the request.
    Clip(usize, OpenedClip),
}

/// A parsed and checked encode request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodeRequest {
    /// The images and videos, decoded from base64, in request order.
    pub items: Vec<RequestItem>,
    /// Options for the engine.
    pub options: EncodeOptions,
}

/// Parses and checks an encode request body against `limits`.
///
/// # Errors
/// A 400 [`ApiError`] naming the offending field for any malformed input.
pub fn parse_encode_request(body: &[u8], limits: &Limits) -> Result<EncodeRequest, ApiError> {
    let obj = parse_object(body)?;
    let options = EncodeOptions {
        return_embeddings: parse_return_embeddings(&obj)?,
        ..EncodeOptions::default()
    };
    let urls = collect_urls(&obj)?;
    let videos = urls.iter().filter(|(_, _, video)| *video).count();
    check_counts(urls.len() - videos, videos, limits)?;
    let items = urls
        .into_iter()
        .map(|(field, url, video)| {
            if video {
                decode_video_url(&field, url).map(RequestItem::Video)
            } else {
                decode_image_url(&field, url, limits).map(RequestItem::Image)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EncodeRequest { items, options })
}

/// Decodes a video data URL: base64 (else a 501, as chat's), any media type but a JPEG frame
/// list.
fn decode_video_url(field: &str, url: &str) -> Result<Vec<u8>, ApiError> {
    let data = split_data_url(field, url, "data:video/<type>;base64,...")?;
    if !data.is_base64 {
        return Err(not_base64(field, Modality::Video));
    }
    if data.media_type == "video/jpeg" {
        return Err(ApiError::bad_request(
            "unsupported_video_url",
            format!(
                "{field}: /v1/encode takes a clip as a base64 data URL (a JPEG frame list goes to /v1/chat/completions)"
            ),
        ));
    }
    let bytes = decode_base64(field, data.payload)?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "corrupt_video",
            format!("{field}: the video is empty"),
        ));
    }
    Ok(bytes)
}

/// Parses a request body that must be a JSON object.
///
/// # Errors
/// A 400 `invalid_json` or `invalid_request`.
pub(crate) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|err| {
        ApiError::bad_request(
            "invalid_json",
            format!("request body is not valid JSON: {err}"),
        )
    })?;
    match value {
        Value::Object(obj) => Ok(obj),
        other => Err(ApiError::bad_request(
            "invalid_request",
            format!(
                "request body must be a JSON object, got {}",
                type_name(&other)
            ),
        )),
    }
}

/// Checks a request's counts of media before any item is decoded, fetched or probed: at least
/// one item, at most `--max-images-per-request` of them (images and videos together: it bounds
/// a request's work, whatever the medium), and each modality within `--limit-mm-per-prompt`
/// (vLLM counts a prompt's items while it parses the message, before it loads any media, so a
/// video the engine would refuse by count is not probed and decoded first).
///
/// # Errors
/// A 400 `no_images`, `too_many_images` or `mm_limit_exceeded` (the engine's own refusal).
pub(crate) fn check_counts(images: usize, videos: usize, limits: &Limits) -> Result<(), ApiError> {
    let count = images + videos;
    if count == 0 {
        return Err(ApiError::bad_request(
            "no_images",
            "the request contains no images or videos",
        ));
    }
    if count > limits.max_images_per_request {
        return Err(ApiError::bad_request(
            "too_many_images",
            format!(
                "the request has {count} media items (images and videos); the limit is {} per request (--max-images-per-request)",
                limits.max_images_per_request
            ),
        ));
    }
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    limits
        .mm_per_prompt
        .check(count(images), count(videos))
        .map_err(|message| ApiError::bad_request("mm_limit_exceeded", message))
}

/// Builds the JSON response for an encode call: the images' results under `images`, and the
/// videos' (`videos[i]` true for item `i`) under `videos` when there are any, each with its
/// `index` in the request.
pub fn encode_response(results: &[ImageResult], videos: &[bool]) -> Value {
    let entries: Vec<(bool, Value)> = results
        .iter()
        .enumerate()
        .map(|(index, r)| {
            let mut item = json!({
                "index": index,
                "mm_hash": r.mm_hash,
                "grid_thw": r.grid_thw,
                "num_tokens": r.num_tokens,
                "cached": r.cached,
            });
            if let (Some(emb), Value::Object(map)) = (&r.embeddings, &mut item) {
                map.insert("embeddings".into(), tensor_json(emb));
                map.insert(
                    "deepstack".into(),
                    Value::Array(r.deepstack.iter().map(tensor_json).collect()),
                );
            }
            (videos.get(index).copied().unwrap_or(false), item)
        })
        .collect();
    let num_tokens: u64 = results.iter().map(|r| r.num_tokens).sum();
    let (video_entries, image_entries): (Vec<_>, Vec<_>) =
        entries.into_iter().partition(|(video, _)| *video);
    let images: Vec<Value> = image_entries.into_iter().map(|(_, v)| v).collect();
    let mut response = json!({
        "images": images,
        "usage": { "num_images": images.len(), "num_tokens": num_tokens },
    });
    if !video_entries.is_empty() {
        response["usage"]["num_videos"] = json!(video_entries.len());
        response["videos"] = Value::Array(video_entries.into_iter().map(|(_, v)| v).collect());
    }
    response
}

/// Encodes a tensor as `{"dtype": "f32", "shape": [t, h], "data": base64 of little-endian f32}`.
pub fn tensor_json((data, shape): &HostTensor) -> Value {
    let mut bytes = Vec::with_capacity(data.len() * 4);
    for x in data {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    json!({ "dtype": "f32", "shape": shape, "data": STANDARD.encode(bytes) })
}

#[cfg(test)]
/// Decodes a `tensor_json` object back to values and shape (used by clients and tests).
///
/// # Errors
/// A message naming what is missing or malformed.
pub fn parse_tensor_json(value: &Value) -> Result<HostTensor, String> {
    if value.get("dtype").and_then(Value::as_str) != Some("f32") {
        return Err("tensor dtype must be \"f32\"".into());
    }
    let shape = value
        .get("shape")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .and_then(|a| Some([a[0].as_u64()?, a[1].as_u64()?]))
        .ok_or("tensor shape must be [rows, cols]")?;
    let data = value
        .get("data")
        .and_then(Value::as_str)
        .ok_or("tensor data must be a string")?;
    let bytes = STANDARD
        .decode(data)
        .map_err(|e| format!("tensor data is not base64: {e}"))?;
    if bytes.len() % 4 != 0 {
        return Err(format!(
            "tensor data has {} bytes, not a multiple of 4",
            bytes.len()
        ));
    }
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let expected = shape[0].checked_mul(shape[1]);
    if expected != u64::try_from(values.len()).ok() {
        return Err(format!(
            "tensor shape {shape:?} does not match {} values",
            values.len()
        ));
    }
    Ok((values, shape))
}

/// Lenient on padding only: clients differ on whether they pad, never on the alphabet.
const BASE64_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

fn parse_return_embeddings(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    match obj.get("return_embeddings") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(false),
        Some(Value::String(s)) if s == "f32" => Ok(true),
        Some(other) => Err(ApiError::bad_request(
            "invalid_return_embeddings",
            format!("return_embeddings must be \"f32\" (or absent), got {other}"),
        )),
    }
}

/// Collects `(field path, url, is a video)` from whichever request form is used.
fn collect_urls(obj: &Map<String, Value>) -> Result<Vec<(String, &str, bool)>, ApiError> {
    let forms = ["images", "videos", "messages", "content"];
    let present: Vec<&str> = forms
        .iter()
        .copied()
        .filter(|k| obj.contains_key(*k))
        .collect();
    let list = |key: &str| -> Result<Vec<(String, &str, bool)>, ApiError> {
        expect_array(&obj[key], key)?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let field = format!("{key}[{i}]");
                let url = v
                    .as_str()
                    .ok_or_else(|| wrong_type(&field, "a data URL string", v))?;
                Ok((field, url, key == "videos"))
            })
            .collect()
    };
    match present.as_slice() {
        [] => Err(ApiError::bad_request(
            "missing_field",
            "the request needs one of the fields `images` (and/or `videos`), `messages` or `content`",
        )),
        // The list form: the images, then the videos.
        ["images"] => list("images"),
        ["videos"] => list("videos"),
        ["images", "videos"] => {
            let mut out = list("images")?;
            out.extend(list("videos")?);
            Ok(out)
        }
        ["messages"] => {
            let mut out = Vec::new();
            for (m, msg) in expect_array(&obj["messages"], "messages")?
                .iter()
                .enumerate()
            {
                let field = format!("messages[{m}]");
                let Value::Object(msg) = msg else {
                    return Err(wrong_type(&field, "an object", msg));
                };
                match msg.get("content") {
                    // Plain text content carries no images.
                    None | Some(Value::Null) | Some(Value::String(_)) => {}
                    Some(content) => {
                        collect_parts(content, &format!("{field}.content"), &mut out)?;
                    }
                }
            }
            Ok(out)
        }
        ["content"] => {
            let mut out = Vec::new();
            collect_parts(&obj["content"], "content", &mut out)?;
            Ok(out)
        }
        several => Err(ApiError::bad_request(
            "conflicting_fields",
            format!("use only one of the fields `images`, `messages`, `content`; got {several:?}"),
        )),
    }
}

fn collect_parts<'a>(
    content: &'a Value,
    field: &str,
    out: &mut Vec<(String, &'a str, bool)>,
) -> Result<(), ApiError> {
    for (p, part) in expect_array(content, field)?.iter().enumerate() {
        let pfield = format!("{field}[{p}]");
        let Value::Object(part) = part else {
            return Err(wrong_type(&pfield, "a content part object", part));
        };
        let kind = part.get("type").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_content_part",
                format!("{pfield}.type must be a string (\"text\" or \"image_url\")"),
            )
        })?;
        match kind {
            "text" => {}
            "image_url" | "video_url" => {
                let ufield = format!("{pfield}.{kind}");
                let url = match part.get(kind) {
                    Some(Value::String(s)) => s.as_str(),
                    Some(Value::Object(o)) => {
                        let f = format!("{ufield}.url");
                        match o.get("url") {
                            Some(Value::String(s)) => s.as_str(),
                            Some(other) => return Err(wrong_type(&f, "a data URL string", other)),
                            None => {
                                return Err(ApiError::bad_request(
                                    "missing_field",
                                    format!("{f} is missing"),
                                ));
                            }
                        }
                    }
                    Some(other) => {
                        return Err(wrong_type(&ufield, "an object with a `url` field", other));
                    }
                    None => {
                        return Err(ApiError::bad_request(
                            "missing_field",
                            format!("{ufield} is missing"),
                        ));
                    }
                };
                out.push((format!("{ufield}.url"), url, kind == "video_url"));
            }
            other => {
                return Err(ApiError::bad_request(
                    "unsupported_content_part",
                    format!(
                        "{pfield}.type is {other:?}; only \"text\", \"image_url\" and \"video_url\" are accepted"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A data URL's parts: its media type (lower case), whether it says `;base64`, its payload.
pub(crate) struct DataUrl<'a> {
    pub media_type: String,
    pub is_base64: bool,
    pub payload: &'a str,
}

/// Splits `data:<media type>[;params],<data>`; `expected` names the form in errors.
pub(crate) fn split_data_url<'a>(
    field: &str,
    url: &'a str,
    expected: &str,
) -> Result<DataUrl<'a>, ApiError> {
    let Some(rest) = url.strip_prefix("data:").or_else(|| {
        url.get(..5)
            .filter(|p| p.eq_ignore_ascii_case("data:"))
            .map(|_| &url[5..])
    }) else {
        return Err(ApiError::bad_request(
            "invalid_image_url",
            format!("{field}: expected a data URL `{expected}`"),
        ));
    };
    let Some((meta, payload)) = rest.split_once(',') else {
        return Err(ApiError::bad_request(
            "invalid_image_url",
            format!("{field}: the data URL has no `,` before its data"),
        ));
    };
    let mut params = meta.split(';');
    let media_type = params.next().unwrap_or("").trim().to_ascii_lowercase();
    let is_base64 = params.any(|p| p.trim().eq_ignore_ascii_case("base64"));
    Ok(DataUrl {
        media_type,
        is_base64,
        payload,
    })
}

/// Decodes a data URL's base64 payload (padded or not).
pub(crate) fn decode_base64(field: &str, payload: &str) -> Result<Vec<u8>, ApiError> {
    BASE64_LENIENT.decode(payload.trim()).map_err(|err| {
        ApiError::bad_request(
            "invalid_base64",
            format!("{field}: the data is not valid base64: {err}"),
        )
    })
}

/// Parses `data:<media type>[;params];base64,<data>`, decodes it and checks the header. The
/// media type is not checked (vLLM's `ImageMediaIO.load_base64` ignores it): the bytes' own
/// signature decides, and bytes that are not an image iris decodes get `unknown_image_format`.
/// A data URL that is not base64 is a 501, as vLLM's `NotImplementedError`.
pub(crate) fn decode_image_url(
    field: &str,
    url: &str,
    limits: &Limits,
) -> Result<ImageInput, ApiError> {
    let lower_prefix = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower_prefix.starts_with("http://") || lower_prefix.starts_with("https://") {
        return Err(ApiError::bad_request(
            "remote_url_not_supported",
            format!("{field}: only data URLs are accepted; iris does not fetch http(s) URLs"),
        ));
    }
    let data = split_data_url(field, url, "data:image/<type>;base64,...")?;
    if !data.is_base64 {
        return Err(not_base64(field, Modality::Image));
    }
    let bytes = decode_base64(field, data.payload)?;
    check_image_bytes(field, &bytes, limits)?;
    Ok(ImageInput { bytes })
}

/// The 501 for a `modality` data URL that is not base64 (vLLM: "Only base64 data URLs are
/// supported for now", a `NotImplementedError`), its code naming the modality.
pub(crate) fn not_base64(field: &str, modality: Modality) -> ApiError {
    let code = match modality {
        Modality::Video => "unsupported_video_url",
        _ => "unsupported_image_url",
    };
    ApiError::new(
        axum::http::StatusCode::NOT_IMPLEMENTED,
        "not_implemented_error",
        code,
        format!("{field}: only base64 data URLs (`;base64,`) carry {modality}s"),
    )
}

/// Checks that `bytes` are an image file iris decodes, within the pixel limit, from the header
/// alone.
pub(crate) fn check_image_bytes(
    field: &str,
    bytes: &[u8],
    limits: &Limits,
) -> Result<(), ApiError> {
    if sniff_format(bytes).is_none() {
        return Err(ApiError::bad_request(
            "unknown_image_format",
            format!("{field}: the data is not a PNG, JPEG, WebP, GIF, BMP or TIFF file"),
        ));
    }
    check_dimensions(field, bytes, limits)
}

/// The format a file's signature names, if it is one iris decodes.
pub fn sniff_format(bytes: &[u8]) -> Option<image::ImageFormat> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(image::ImageFormat::Png)
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        Some(image::ImageFormat::Jpeg)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some(image::ImageFormat::WebP)
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some(image::ImageFormat::Gif)
    } else if bytes.starts_with(b"BM") {
        Some(image::ImageFormat::Bmp)
    } else if bytes.starts_with(b"II*\0") || bytes.starts_with(b"MM\0*") {
        Some(image::ImageFormat::Tiff)
    } else {
        None
    }
}

/// Reads width and height from the header only, so oversized images are refused before decode.
fn check_dimensions(field: &str, bytes: &[u8], limits: &Limits) -> Result<(), ApiError> {
    let corrupt = |err: &dyn std::fmt::Display| {
        ApiError::bad_request(
            "corrupt_image",
            format!("{field}: cannot read the image header: {err}"),
        )
    };
    let format = sniff_format(bytes).ok_or_else(|| corrupt(&"unknown signature"))?;
    let (w, h) = image::ImageReader::with_format(Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| corrupt(&e))?;
    if w == 0 || h == 0 {
        return Err(corrupt(&format!("the header says {w}x{h}")));
    }
    let pixels = u64::from(w) * u64::from(h);
    if pixels > limits.max_image_pixels {
        return Err(ApiError::bad_request(
            "image_too_large",
            format!(
                "{field}: the image is {w}x{h} = {pixels} pixels; the limit is {} pixels",
                limits.max_image_pixels
            ),
        ));
    }
    Ok(())
}

fn expect_array<'a>(value: &'a Value, field: &str) -> Result<&'a Vec<Value>, ApiError> {
    value
        .as_array()
        .ok_or_else(|| wrong_type(field, "an array", value))
}

/// A 400 `invalid_type` naming the field, what it must be and what it was.
pub(crate) fn wrong_type(field: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::bad_request(
        "invalid_type",
        format!("{field} must be {expected}, got {}", type_name(got)),
    )
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([x.to_le_bytes()[0], y.to_le_bytes()[0], 7])
        });
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn data_url(bytes: &[u8]) -> String {
        format!("data:image/png;base64,{}", STANDARD.encode(bytes))
    }

    fn parse(v: Value) -> Result<EncodeRequest, ApiError> {
        parse_encode_request(v.to_string().as_bytes(), &Limits::default())
    }

    #[test]
    fn accepts_all_three_forms() {
        let img = png(8, 6);
        let url = data_url(&img);
        let a = parse(json!({"images": [url]})).unwrap();
        let b = parse(json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image_url", "image_url": url},
            ]}
        ]}))
        .unwrap();
        let c = parse(
            json!({"content": [{"type": "image_url", "image_url": {"url": url}}],
            "return_embeddings": "f32"}),
        )
        .unwrap();
        assert_eq!(
            a.items,
            vec![RequestItem::Image(ImageInput { bytes: img.clone() })]
        );
        assert_eq!(b.items.len(), 2);
        assert_eq!(
            b.items[1],
            RequestItem::Image(ImageInput { bytes: img.clone() })
        );
        assert!(!a.options.return_embeddings);
        assert!(c.options.return_embeddings);
    }

    #[test]
    fn unpadded_base64_is_accepted() {
        let img = png(3, 3);
        let url = format!(
            "data:image/png;base64,{}",
            STANDARD.encode(&img).trim_end_matches('=')
        );
        assert_eq!(
            match &parse(json!({"images": [url]})).unwrap().items[0] {
                RequestItem::Image(image) => image.bytes.clone(),
                RequestItem::Video(_) => panic!("an image"),
            },
            img
        );
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let url = data_url(&png(4, 4));
        let cases: Vec<(Value, &str, &str)> = vec![
            (json!([1]), "invalid_request", "JSON object"),
            (json!({}), "missing_field", "images"),
            (
                json!({"images": "x"}),
                "invalid_type",
                "images must be an array",
            ),
            (json!({"images": [3]}), "invalid_type", "images[0]"),
            (json!({"images": []}), "no_images", "no images"),
            (
                json!({"images": [url], "content": []}),
                "conflicting_fields",
                "only one",
            ),
            (
                json!({"images": [url], "return_embeddings": "f16"}),
                "invalid_return_embeddings",
                "return_embeddings",
            ),
            (
                json!({"images": [url], "return_embeddings": true}),
                "invalid_return_embeddings",
                "return_embeddings",
            ),
            (
                json!({"images": ["https://example.invalid/a.png"]}),
                "remote_url_not_supported",
                "images[0]",
            ),
            (
                json!({"images": ["file:///etc/passwd"]}),
                "invalid_image_url",
                "images[0]",
            ),
            (
                json!({"images": ["data:image/png;base64"]}),
                "invalid_image_url",
                "`,`",
            ),
            (
                json!({"images": ["data:image/avif;base64,AAAA"]}),
                "unknown_image_format",
                "images[0]",
            ),
            (
                json!({"images": [url, "data:image/png;base64,@@@"]}),
                "invalid_base64",
                "images[1]",
            ),
            (
                json!({"images": ["data:image/png;base64,aGVsbG8gd29ybGQ="]}),
                "unknown_image_format",
                "PNG",
            ),
            (
                json!({"content": [{"type": "image_url"}]}),
                "missing_field",
                "content[0].image_url",
            ),
            (
                json!({"content": [{"type": "image_url", "image_url": {"url": 5}}]}),
                "invalid_type",
                "content[0].image_url.url",
            ),
            (
                json!({"content": [{"type": "audio"}]}),
                "unsupported_content_part",
                "content[0].type",
            ),
            (
                json!({"content": [{"text": "x"}]}),
                "invalid_content_part",
                "content[0].type",
            ),
            (
                json!({"messages": [{"content": [7]}]}),
                "invalid_type",
                "messages[0].content[0]",
            ),
            (json!({"messages": [1]}), "invalid_type", "messages[0]"),
        ];
        for (body, code, needle) in cases {
            let err = parse(body.clone()).unwrap_err();
            assert_eq!(err.status, 400, "{body}");
            assert_eq!(err.code, code, "{body}: {}", err.message);
            assert!(
                err.message.contains(needle),
                "{body}: {:?} lacks {needle:?}",
                err.message
            );
        }
        let err = parse_encode_request(b"{\"images\": [", &Limits::default()).unwrap_err();
        assert_eq!(err.code, "invalid_json");
        for (url, code) in [
            ("data:image/png,abc", "unsupported_image_url"),
            ("data:image/png;charset=utf-8,abc", "unsupported_image_url"),
        ] {
            let err = parse(json!({"images": [url]})).unwrap_err();
            assert_eq!((err.status.as_u16(), err.code), (501, code), "{url}");
        }
        let err = parse(json!({"videos": ["data:video/mp4,abc"]})).unwrap_err();
        assert_eq!(
            (err.status.as_u16(), err.code),
            (501, "unsupported_video_url")
        );
    }

    #[test]
    fn limits_apply() {
        let url = data_url(&png(20, 10));
        let limits = Limits {
            max_images_per_request: 2,
            max_image_pixels: 199,
            ..Limits::default()
        };
        let body = json!({"images": [url, url, url]}).to_string();
        let err = parse_encode_request(body.as_bytes(), &limits).unwrap_err();
        assert_eq!(err.code, "too_many_images");
        assert!(
            err.message.contains("3 media items (images and videos)")
                && err.message.contains("limit is 2"),
            "{}",
            err.message
        );
        let body = json!({"images": [url]}).to_string();
        let err = parse_encode_request(body.as_bytes(), &limits).unwrap_err();
        assert_eq!(err.code, "image_too_large");
        assert!(
            err.message.contains("20x10 = 200 pixels"),
            "{}",
            err.message
        );
        let ok = Limits {
            max_image_pixels: 200,
            ..limits
        };
        assert!(parse_encode_request(body.as_bytes(), &ok).is_ok());
    }

    #[test]
    fn truncated_image_is_corrupt() {
        let img = png(16, 16);
        let url = data_url(&img[..12]);
        let err = parse(json!({"images": [url]})).unwrap_err();
        assert_eq!(err.code, "corrupt_image");
    }

    #[test]
    fn tensor_round_trip() {
        let t = (vec![1.5f32, -2.0, 0.25, 8.0, 0.0, -0.0], [3u64, 2u64]);
        let v = tensor_json(&t);
        assert_eq!(v["shape"], json!([3, 2]));
        let back = parse_tensor_json(&v).unwrap();
        assert_eq!(back, t);
        let bad = json!({"dtype": "f32", "shape": [4, 2], "data": v["data"]});
        assert!(
            parse_tensor_json(&bad)
                .unwrap_err()
                .contains("does not match")
        );
    }
}
