//! vLLM's multimodal item identifiers, computed exactly as vLLM 0.33 computes them.
//!
//! A consumer (vLLM prefill/decode) finds an item's embeddings under this string, so it must
//! equal what vLLM's own `ProcessorInputs.get_mm_hashes` gives for the same request, byte for
//! byte. The rules, read from `vllm/multimodal/processing/inputs.py` and
//! `vllm/multimodal/hasher.py`:
//!
//! - The request's *hash factors* for an image are its `mm_processor_kwargs` without the
//!   `videos_kwargs`/`audio_kwargs` entries, and `{"image": <media_io_kwargs["image"]>}`
//!   (the server's `--media-io-kwargs` merged with the request's). Each factor that is empty
//!   (absent, `{}`, or `{"image": {}}`) is left out.
//! - An item with a uuid and no factors is identified by the uuid itself.
//! - Otherwise the identifier is the hex digest of [`HashAlgorithm`] over a framed stream of
//!   the keyword arguments `image`, `media_io_kwargs`, `mm_processor_kwargs`, `model_id`
//!   sorted by name. `image` is the uuid when there is one, else the original encoded bytes;
//!   when vLLM's `convert_image_mode` made a new image (any mode but plain RGB without
//!   transparency) the bytes are wrapped with the `io_config` that converted them.
//!
//! The framing ([`HashAlgorithm`] input): every chunk is preceded by its length as a u64
//! little-endian; values are tagged `00` none, `01` sequence (u64 count), `02` mapping (u64
//! count, then framed key and value pairs in insertion order), `03` leaf. Leaves are framed
//! bytes: UTF-8 for strings, NumPy's `np.array(x).tobytes()` for numbers (int64 or uint64,
//! float64, one byte for a bool). JSON objects are hashed in document order, which is why the
//! kwargs are kept as [`OrderedJson`] instead of a sorted map.

use std::fmt;
use std::str::FromStr;

use iris_core::preprocess::RgbImage;
use iris_core::preprocess::video::ffmpeg::VideoMetadata;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// The digest behind hashed identifiers: vLLM's `--mm-hasher-algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashAlgorithm {
    /// BLAKE3 (vLLM's default).
    #[default]
    Blake3,
    /// SHA-256.
    Sha256,
    /// SHA-512.
    Sha512,
}

impl HashAlgorithm {
    /// The name vLLM's flag takes.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Blake3 => "blake3",
            Self::Sha256 => "sha256",
            Self::Sha512 => "sha512",
        }
    }
}

impl fmt::Display for HashAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HashAlgorithm {
    type Err = IdentifierError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "blake3" => Ok(Self::Blake3),
            "sha256" => Ok(Self::Sha256),
            "sha512" => Ok(Self::Sha512),
            other => Err(IdentifierError::UnknownAlgorithm(other.to_owned())),
        }
    }
}

/// What can be wrong with the inputs of an identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentifierError {
    /// An algorithm name other than `blake3`, `sha256`, `sha512`.
    #[error("unknown hash algorithm {0:?}: expected blake3, sha256 or sha512")]
    UnknownAlgorithm(String),
    /// Kwargs that are not valid JSON.
    #[error("invalid JSON in {field}: {message}")]
    Json {
        /// Which kwargs.
        field: &'static str,
        /// serde_json's message.
        message: String,
    },
    /// Kwargs that are valid JSON but not an object, or an image entry that is not one.
    #[error("{field} must be a JSON object, got {got}")]
    NotAnObject {
        /// Which kwargs.
        field: &'static str,
        /// The JSON kind found.
        got: &'static str,
    },
    /// `media_io_kwargs.image.rgba_background_color` that vLLM's `ImageMediaIO` refuses.
    #[error(
        "media_io_kwargs.image.rgba_background_color must be a list of 3 integers in [0, 255], got {0}"
    )]
    BadBackground(String),
    /// `media_io_kwargs.image.image_mode` other than `"RGB"`: vLLM would keep or produce a
    /// picture in another mode, which iris does not implement.
    #[error(
        "media_io_kwargs.image.image_mode {0} is not supported: only \"RGB\" (the default) is implemented"
    )]
    UnsupportedImageMode(String),
}

/// A JSON object (the kwargs of a request) with its keys in document order.
///
/// vLLM hashes the dicts that `json.loads` builds, whose order is the document's, with a later
/// duplicate key replacing the value in the first one's place. serde_json's own `Map` sorts
/// keys unless its `preserve_order` feature is on for the whole build, so this type keeps its
/// own ordered tree. It deserializes from any serde format (a request DTO field can be an
/// `Option<OrderedJson>`) and parses from text or a [`RawValue`].
#[derive(Debug, Clone, PartialEq)]
pub struct OrderedJson(JsonValue);

/// One JSON value with object members in document order.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonValue {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer in the i64 range (Python int, hashed as NumPy int64).
    Int(i64),
    /// An integer above `i64::MAX` (hashed as NumPy uint64, as `np.array` types it).
    UInt(u64),
    /// A number written with a fraction or exponent (Python float, hashed as float64).
    Float(f64),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<JsonValue>),
    /// An object, members in document order, keys unique.
    Object(Vec<(String, JsonValue)>),
}

impl JsonValue {
    /// The member `key` of an object; `None` for a missing key or a non-object.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&JsonValue> {
        match self {
            Self::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Python truthiness, as `if value:` sees the parsed value.
    fn is_truthy(&self) -> bool {
        match self {
            Self::Null => false,
            Self::Bool(b) => *b,
            Self::Int(v) => *v != 0,
            Self::UInt(v) => *v != 0,
            Self::Float(v) => *v != 0.0,
            Self::String(s) => !s.is_empty(),
            Self::Array(a) => !a.is_empty(),
            Self::Object(o) => !o.is_empty(),
        }
    }

    /// The value of a number as an `f64` (integers rounded to the nearest one); `None` for
    /// anything else.
    #[must_use]
    pub fn as_f64(&self) -> Option<f64> {
        // A number past 2^53 loses its low bits, as Python's `float()` of it does.
        #[allow(clippy::cast_precision_loss)]
        match self {
            Self::Int(v) => Some(*v as f64),
            Self::UInt(v) => Some(*v as f64),
            Self::Float(v) => Some(*v),
            _ => None,
        }
    }

    /// The JSON type's name, for messages.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Bool(_) => "a boolean",
            Self::Int(_) | Self::UInt(_) | Self::Float(_) => "a number",
            Self::String(_) => "a string",
            Self::Array(_) => "an array",
            Self::Object(_) => "an object",
        }
    }
}

impl OrderedJson {
    /// Parses a JSON object from text.
    ///
    /// # Errors
    /// [`IdentifierError::Json`] for invalid JSON, [`IdentifierError::NotAnObject`] for any
    /// other top-level value. (An integer beyond 64 bits is read as a float by serde_json;
    /// vLLM's hasher could not hash it at all.)
    ///
    /// ```
    /// use iris_ec::identifier::OrderedJson;
    /// let kw = OrderedJson::parse("mm_processor_kwargs", r#"{"max_pixels": 3136, "min_pixels": 784}"#).unwrap();
    /// let keys: Vec<&str> = kw.members().iter().map(|(k, _)| k.as_str()).collect();
    /// assert_eq!(keys, ["max_pixels", "min_pixels"]);
    /// assert!(OrderedJson::parse("mm_processor_kwargs", "[1]").is_err());
    /// ```
    pub fn parse(field: &'static str, text: &str) -> Result<Self, IdentifierError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let value = JsonValue::deserialize(&mut de)
            .and_then(|v| de.end().map(|()| v))
            .map_err(|e| IdentifierError::Json {
                field,
                message: e.to_string(),
            })?;
        Self::from_value(field, value)
    }

    /// Parses a JSON object kept raw by serde_json.
    ///
    /// # Errors
    /// As [`OrderedJson::parse`].
    pub fn from_raw(field: &'static str, raw: &RawValue) -> Result<Self, IdentifierError> {
        Self::parse(field, raw.get())
    }

    /// Wraps an object value; refuses any other kind.
    ///
    /// # Errors
    /// [`IdentifierError::NotAnObject`].
    pub fn from_value(field: &'static str, value: JsonValue) -> Result<Self, IdentifierError> {
        match value {
            JsonValue::Object(_) => Ok(Self(value)),
            other => Err(IdentifierError::NotAnObject {
                field,
                got: other.kind(),
            }),
        }
    }

    /// The members in document order.
    #[must_use]
    pub fn members(&self) -> &[(String, JsonValue)] {
        match &self.0 {
            JsonValue::Object(m) => m,
            // Construction admits objects only.
            _ => &[],
        }
    }

    /// The member `key`.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&JsonValue> {
        self.0.get(key)
    }

    /// The object as a [`JsonValue`].
    #[must_use]
    pub fn as_value(&self) -> &JsonValue {
        &self.0
    }
}

impl<'de> Deserialize<'de> for JsonValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

impl<'de> Deserialize<'de> for OrderedJson {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = JsonValue::deserialize(deserializer)?;
        match value {
            JsonValue::Object(_) => Ok(Self(value)),
            other => Err(de::Error::custom(format!(
                "expected a JSON object, got {}",
                other.kind()
            ))),
        }
    }
}

/// The hash factors of a request, as vLLM takes them for an image item.
///
/// Both are whole JSON objects as the request carries them, after the server-level defaults
/// are merged in the way vLLM merges them: `media_io_kwargs` is keyed by modality
/// (`{"image": {...}, "video": {...}}`), the server's `--media-io-kwargs` shallow-merged per
/// modality with the request's (request keys win, server keys keep their place);
/// `mm_processor_kwargs` is the request's object (vLLM's server-level
/// `--mm-processor-kwargs` is not a hash factor). [`item_identifier`] takes the image's share
/// of each. `None` and an empty object mean the same: no factor.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HashFactors {
    /// The request's `mm_processor_kwargs`.
    pub mm_processor_kwargs: Option<OrderedJson>,
    /// The effective `media_io_kwargs`, keyed by modality.
    pub media_io_kwargs: Option<OrderedJson>,
}

/// vLLM's default `rgba_background_color`.
pub const DEFAULT_BACKGROUND: [u8; 3] = [255, 255, 255];

impl HashFactors {
    /// Whether an image item has any hash factor, i.e. whether a uuid is hashed instead of
    /// being the identifier itself.
    #[must_use]
    pub fn has_image_factors(&self) -> bool {
        self.image_media_io().is_some() || self.image_processor_kwargs().next().is_some()
    }

    /// The background colour vLLM pastes transparent images on:
    /// `media_io_kwargs.image.rgba_background_color`, white by default. Also checks
    /// `media_io_kwargs.image.image_mode`, the one other image option that changes what vLLM
    /// decodes.
    ///
    /// # Errors
    /// [`IdentifierError::NotAnObject`] when `media_io_kwargs.image` is not an object,
    /// [`IdentifierError::BadBackground`] for a colour vLLM refuses,
    /// [`IdentifierError::UnsupportedImageMode`] for an `image_mode` other than `"RGB"`.
    ///
    /// ```
    /// use iris_ec::identifier::{HashFactors, OrderedJson};
    /// let f = HashFactors {
    ///     media_io_kwargs: Some(OrderedJson::parse("media_io_kwargs",
    ///         r#"{"image": {"rgba_background_color": [0, 0, 0]}}"#).unwrap()),
    ///     ..HashFactors::default()
    /// };
    /// assert_eq!(f.background_color().unwrap(), [0, 0, 0]);
    /// assert_eq!(HashFactors::default().background_color().unwrap(), [255, 255, 255]);
    /// ```
    pub fn background_color(&self) -> Result<[u8; 3], IdentifierError> {
        let Some(image) = self.media_io_kwargs.as_ref().and_then(|m| m.get("image")) else {
            return Ok(DEFAULT_BACKGROUND);
        };
        if !matches!(image, JsonValue::Object(_)) {
            return Err(IdentifierError::NotAnObject {
                field: "media_io_kwargs.image",
                got: image.kind(),
            });
        }
        if let Some(mode) = image.get("image_mode")
            && *mode != JsonValue::String("RGB".into())
        {
            return Err(IdentifierError::UnsupportedImageMode(describe(mode)));
        }
        let Some(color) = image.get("rgba_background_color") else {
            return Ok(DEFAULT_BACKGROUND);
        };
        let bad = || IdentifierError::BadBackground(describe(color));
        let JsonValue::Array(items) = color else {
            return Err(bad());
        };
        if items.len() != 3 {
            return Err(bad());
        }
        let mut out = [0u8; 3];
        for (slot, item) in out.iter_mut().zip(items) {
            // Python's isinstance(c, int) accepts booleans too, but no caller means a colour
            // channel by `true`; refusing it is the clearer answer.
            *slot = match item {
                JsonValue::Int(v) => u8::try_from(*v).map_err(|_| bad())?,
                _ => return Err(bad()),
            };
        }
        Ok(out)
    }

    /// `{"image": media_io_kwargs["image"]}` when that entry is truthy.
    fn image_media_io(&self) -> Option<&JsonValue> {
        self.media_io_kwargs
            .as_ref()
            .and_then(|m| m.get("image"))
            .filter(|v| v.is_truthy())
    }

    /// The image-scoped processor kwargs: every member but the other modalities' scoped ones.
    fn image_processor_kwargs(&self) -> impl Iterator<Item = &(String, JsonValue)> {
        self.mm_processor_kwargs
            .iter()
            .flat_map(OrderedJson::members)
            .filter(|(k, _)| !OTHER_MODALITY_KWARGS.contains(&k.as_str()))
    }
}

/// Video decoder settings vLLM takes only at start-up: a request's are dropped.
const VIDEO_STARTUP_ONLY: [&str; 5] = [
    "hw_decoders",
    "max_width",
    "max_height",
    "pool_size",
    "device",
];

/// The effective `media_io_kwargs` of a request: vLLM's `merge_media_io_kwargs`, which
/// shallow-merges each modality's object from the server's `--media-io-kwargs` with the
/// request's (the request's keys win; the server's keep their place). `None` when neither has
/// any entry. For `video`, as vLLM's `VideoMediaIO.merge_kwargs`: a request's start-up-only
/// decoder settings (`hw_decoders`, `max_width`, `max_height`, `pool_size`, `device`) are
/// dropped, and a request that sets `num_frames` without `fps` drops the server's `fps` (and
/// the other way round).
///
/// # Errors
/// [`IdentifierError::NotAnObject`] when a modality's entry is not an object.
///
/// ```
/// use iris_ec::identifier::{OrderedJson, merge_media_io_kwargs};
/// let server = OrderedJson::parse("server", r#"{"image": {"a": 1, "b": 2}}"#).unwrap();
/// let request = OrderedJson::parse("request", r#"{"image": {"b": 3, "c": 4}}"#).unwrap();
/// let merged = merge_media_io_kwargs(Some(&server), Some(&request)).unwrap().unwrap();
/// let expected = OrderedJson::parse("x", r#"{"image": {"a": 1, "b": 3, "c": 4}}"#).unwrap();
/// assert_eq!(merged, expected);
///
/// let server = OrderedJson::parse("server", r#"{"video": {"fps": 1, "max_frames": 64}}"#).unwrap();
/// let request = OrderedJson::parse("request", r#"{"video": {"num_frames": 8, "device": "cuda"}}"#).unwrap();
/// let merged = merge_media_io_kwargs(Some(&server), Some(&request)).unwrap().unwrap();
/// let expected = OrderedJson::parse("x", r#"{"video": {"max_frames": 64, "num_frames": 8}}"#).unwrap();
/// assert_eq!(merged, expected);
/// ```
pub fn merge_media_io_kwargs(
    server: Option<&OrderedJson>,
    request: Option<&OrderedJson>,
) -> Result<Option<OrderedJson>, IdentifierError> {
    let server = server.map(OrderedJson::members).unwrap_or_default();
    let request = request.map(OrderedJson::members).unwrap_or_default();
    let mut merged: Vec<(String, JsonValue)> = Vec::new();
    for (key, _) in server.iter().chain(request) {
        if merged.iter().any(|(k, _)| k == key) {
            continue;
        }
        let entry = |side: &[(String, JsonValue)]| -> Result<Vec<(String, JsonValue)>, _> {
            match side.iter().find(|(k, _)| k == key).map(|(_, v)| v) {
                None | Some(JsonValue::Null) => Ok(Vec::new()),
                Some(JsonValue::Object(m)) => Ok(m.clone()),
                Some(other) => Err(IdentifierError::NotAnObject {
                    field: "media_io_kwargs entry",
                    got: other.kind(),
                }),
            }
        };
        let mut value = entry(server)?;
        let mut runtime = entry(request)?;
        if key == "video" {
            // VideoMediaIO.merge_kwargs: start-up-only decoder settings are dropped from a
            // request, and a request that sets one of `fps` and `num_frames` drops the
            // other from the server's (the two interact).
            runtime.retain(|(k, _)| !VIDEO_STARTUP_ONLY.contains(&k.as_str()));
            let sets = |name: &str| runtime.iter().any(|(k, _)| k == name);
            if sets("num_frames") && !sets("fps") {
                value.retain(|(k, _)| k != "fps");
            } else if sets("fps") && !sets("num_frames") {
                value.retain(|(k, _)| k != "num_frames");
            }
        }
        for (k, v) in runtime {
            match value.iter_mut().find(|(existing, _)| *existing == k) {
                Some(slot) => slot.1 = v,
                None => value.push((k, v)),
            }
        }
        merged.push((key.clone(), JsonValue::Object(value)));
    }
    Ok((!merged.is_empty()).then_some(OrderedJson(JsonValue::Object(merged))))
}

/// The most members one object of request kwargs may have (vLLM's kwargs have a handful).
pub const MAX_OBJECT_MEMBERS: usize = 1024;

/// One image item of a request.
#[derive(Debug, Clone, Copy)]
pub struct ItemSource<'a> {
    /// The media part's `uuid`, when it has one.
    pub uuid: Option<&'a str>,
    /// The original encoded bytes (a data URL's decoded payload, a file, a download).
    pub bytes: &'a [u8],
    /// `Some(background)` when vLLM's `convert_image_mode` makes a new image for this item
    /// (any Pillow mode but plain RGB without transparency), with the background colour of
    /// [`HashFactors::background_color`]; `None` for a plain RGB image.
    pub converted: Option<[u8; 3]>,
}

/// The identifier vLLM gives `item` of a request with `factors`, served under `model_id` (the
/// consumer's `--model` string as given).
///
/// ```
/// use iris_ec::identifier::{HashAlgorithm, HashFactors, ItemSource, item_identifier};
/// let item = ItemSource { uuid: Some("cat-1"), bytes: b"...", converted: None };
/// // A uuid without hash factors is the identifier itself.
/// assert_eq!(item_identifier(HashAlgorithm::Blake3, "m", &item, &HashFactors::default()), "cat-1");
/// let hashed = ItemSource { uuid: None, ..item };
/// assert_eq!(item_identifier(HashAlgorithm::Sha256, "m", &hashed, &HashFactors::default()).len(), 64);
/// ```
#[must_use]
pub fn item_identifier(
    algorithm: HashAlgorithm,
    model_id: &str,
    item: &ItemSource<'_>,
    factors: &HashFactors,
) -> String {
    let has_factors = factors.has_image_factors();
    if let (Some(uuid), false) = (item.uuid, has_factors) {
        return uuid.to_owned();
    }
    let mut s = Stream::new(algorithm);
    // hash_kwargs feeds the keyword arguments sorted by name; these names sort as listed.
    s.framed(b"image");
    s.tag(TAG_LEAF);
    match (item.uuid, item.converted) {
        (Some(uuid), _) => s.framed(uuid.as_bytes()),
        (None, None) => {
            s.framed(b"image");
            s.tag(TAG_LEAF);
            s.framed(item.bytes);
        }
        (None, Some(background)) => {
            s.framed(b"image");
            s.mapping(2);
            s.framed(b"io_config");
            s.mapping(2);
            s.framed(b"image_mode");
            s.tag(TAG_LEAF);
            s.framed(b"RGB");
            s.framed(b"rgba_background_color");
            s.sequence(3);
            for c in background {
                s.tag(TAG_LEAF);
                s.framed(&i64::from(c).to_le_bytes());
            }
            s.framed(b"data");
            s.tag(TAG_LEAF);
            s.framed(item.bytes);
        }
    }
    let processor: Vec<&(String, JsonValue)> = factors.image_processor_kwargs().collect();
    s.factors_and_model(b"image", factors.image_media_io(), &processor, model_id);
    s.hex_digest()
}

/// One video item of a request: what vLLM hashes for it when it has no uuid (or has hash
/// factors) is the pair of the media, with its original bytes, and the loader's metadata.
#[derive(Debug, Clone, Copy)]
pub struct VideoSource<'a> {
    /// The media part's `uuid`, when it has one.
    pub uuid: Option<&'a str>,
    /// The original encoded bytes (the clip as sent or read).
    pub bytes: &'a [u8],
    /// The frames read, all of one size: vLLM hashes them, as one `[frames, height, width, 3]`
    /// array of RGB bytes, instead of the clip when they are fewer bytes than it.
    pub frames: &'a [RgbImage],
    /// What the loader returned with the frames.
    pub metadata: &'a VideoMetadata,
}

/// The identifier vLLM gives video `item` of a request with `factors`, served under `model_id`:
/// the uuid itself when there is one and no video hash factor (the request's
/// `media_io_kwargs.video`, its `mm_processor_kwargs` but `images_kwargs` and `audio_kwargs`),
/// else the digest of `model_id`, those factors and the item: the uuid, or the pair of the clip's
/// bytes (or its frames, when smaller) and the loader's metadata in vLLM's order.
///
/// Qwen3-VL's per-video list kwargs (an `fps` or `num_frames` list in `mm_processor_kwargs`),
/// which vLLM rehashes per video, are not covered.
#[must_use]
pub fn video_identifier(
    algorithm: HashAlgorithm,
    model_id: &str,
    item: &VideoSource<'_>,
    factors: &HashFactors,
) -> String {
    let media_io = factors
        .media_io_kwargs
        .as_ref()
        .and_then(|m| m.get("video"))
        .filter(|v| v.is_truthy());
    let processor: Vec<&(String, JsonValue)> = factors
        .mm_processor_kwargs
        .iter()
        .flat_map(OrderedJson::members)
        .filter(|(k, _)| !NOT_VIDEO_KWARGS.contains(&k.as_str()))
        .collect();
    let has_factors = media_io.is_some() || !processor.is_empty();
    if let (Some(uuid), false) = (item.uuid, has_factors) {
        return uuid.to_owned();
    }
    let mut s = Stream::new(algorithm);
    // hash_kwargs feeds the keyword arguments sorted by name: the factors and model_id come
    // before `video`.
    s.factors_and_model(b"video", media_io, &processor, model_id);
    s.framed(b"video");
    match item.uuid {
        Some(uuid) => {
            s.tag(TAG_LEAF);
            s.framed(uuid.as_bytes());
        }
        None => {
            s.sequence(2);
            // The media with its bytes: the frames when they are fewer bytes than the clip.
            s.tag(TAG_LEAF);
            s.framed(b"video");
            let frames = item.frames;
            let frame_bytes: usize = frames.iter().map(|f| f.pixels.len()).sum();
            if frame_bytes < item.bytes.len() {
                let (height, width) = frames
                    .first()
                    .map_or((0, 0), |f| (f.size.height, f.size.width));
                let shape = [frames.len() as u64, u64::from(height), u64::from(width), 3];
                s.tag(TAG_LEAF);
                s.framed(b"ndarray");
                s.mapping(3);
                s.framed(b"dtype");
                s.tag(TAG_LEAF);
                s.framed(b"|u1");
                s.framed(b"shape");
                s.sequence(4);
                for dim in shape {
                    s.tag(TAG_LEAF);
                    s.framed(&dim.to_le_bytes());
                }
                s.framed(b"data");
                s.tag(TAG_LEAF);
                // The frames as one array, framed once, fed without a copy.
                s.length(frame_bytes);
                for frame in frames {
                    s.update(&frame.pixels);
                }
            } else {
                s.tag(TAG_LEAF);
                s.framed(item.bytes);
            }
            // The metadata, in the loader's order.
            let m = item.metadata;
            s.mapping(6);
            s.framed(b"total_num_frames");
            s.tag(TAG_LEAF);
            s.framed(&i64::from(m.total_num_frames).to_le_bytes());
            s.framed(b"fps");
            s.tag(TAG_LEAF);
            s.framed(&m.fps.to_le_bytes());
            s.framed(b"duration");
            s.tag(TAG_LEAF);
            s.framed(&m.duration.to_le_bytes());
            s.framed(b"video_backend");
            s.tag(TAG_LEAF);
            s.framed(m.video_backend.as_bytes());
            s.framed(b"frames_indices");
            s.sequence(m.frames_indices.len());
            for &index in &m.frames_indices {
                s.tag(TAG_LEAF);
                s.framed(&i64::from(index).to_le_bytes());
            }
            s.framed(b"do_sample_frames");
            s.tag(TAG_LEAF);
            s.framed(&[u8::from(m.do_sample_frames)]);
        }
    }
    s.hex_digest()
}

/// The scoped processor kwargs that are not a video's (`_HF_MODALITY_PROCESSOR_KWARGS`).
const NOT_VIDEO_KWARGS: [&str; 2] = ["images_kwargs", "audio_kwargs"];

/// The scoped processor kwargs of the modalities other than image (`_HF_MODALITY_PROCESSOR_KWARGS`).
const OTHER_MODALITY_KWARGS: [&str; 2] = ["videos_kwargs", "audio_kwargs"];

const TAG_NONE: u8 = 0x00;
const TAG_SEQUENCE: u8 = 0x01;
const TAG_MAPPING: u8 = 0x02;
const TAG_LEAF: u8 = 0x03;

fn describe(v: &JsonValue) -> String {
    match v {
        JsonValue::Null => "null".into(),
        JsonValue::Bool(b) => b.to_string(),
        JsonValue::Int(i) => i.to_string(),
        JsonValue::UInt(u) => u.to_string(),
        JsonValue::Float(f) => f.to_string(),
        JsonValue::String(s) => format!("{s:?}"),
        JsonValue::Array(a) => format!(
            "[{}]",
            a.iter().map(describe).collect::<Vec<_>>().join(", ")
        ),
        JsonValue::Object(_) => "an object".into(),
    }
}

/// The digest input, fed chunk by chunk as vLLM's `hasher.update` calls are.
enum Stream {
    Blake3(Box<blake3::Hasher>),
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Stream {
    fn new(algorithm: HashAlgorithm) -> Self {
        use sha2::Digest as _;
        match algorithm {
            HashAlgorithm::Blake3 => Self::Blake3(Box::new(blake3::Hasher::new())),
            HashAlgorithm::Sha256 => Self::Sha256(sha2::Sha256::new()),
            HashAlgorithm::Sha512 => Self::Sha512(sha2::Sha512::new()),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        use sha2::Digest as _;
        match self {
            Self::Blake3(h) => {
                h.update(bytes);
            }
            Self::Sha256(h) => h.update(bytes),
            Self::Sha512(h) => h.update(bytes),
        }
    }

    fn tag(&mut self, tag: u8) {
        self.update(&[tag]);
    }

    fn length(&mut self, n: usize) {
        // usize is at most 64 bits on every supported target.
        self.update(&(n as u64).to_le_bytes());
    }

    /// `_framed`: the length, then the bytes.
    fn framed(&mut self, bytes: &[u8]) {
        self.length(bytes.len());
        self.update(bytes);
    }

    fn mapping(&mut self, n: usize) {
        self.tag(TAG_MAPPING);
        self.length(n);
    }

    fn sequence(&mut self, n: usize) {
        self.tag(TAG_SEQUENCE);
        self.length(n);
    }

    /// `iter_value_to_bytes` of a parsed JSON value.
    fn value(&mut self, v: &JsonValue) {
        match v {
            JsonValue::Null => self.tag(TAG_NONE),
            JsonValue::Array(items) => {
                self.sequence(items.len());
                items.iter().for_each(|item| self.value(item));
            }
            JsonValue::Object(members) => {
                self.mapping(members.len());
                for (k, v) in members {
                    self.framed(k.as_bytes());
                    self.value(v);
                }
            }
            leaf => {
                self.tag(TAG_LEAF);
                match leaf {
                    JsonValue::Bool(b) => self.framed(&[u8::from(*b)]),
                    JsonValue::Int(i) => self.framed(&i.to_le_bytes()),
                    JsonValue::UInt(u) => self.framed(&u.to_le_bytes()),
                    JsonValue::Float(f) => self.framed(&f.to_le_bytes()),
                    JsonValue::String(s) => self.framed(s.as_bytes()),
                    // The containers and null are handled above.
                    JsonValue::Null | JsonValue::Array(_) | JsonValue::Object(_) => {}
                }
            }
        }
    }

    /// The hash factors (`media_io_kwargs` as `{modality: ...}`, `mm_processor_kwargs`), each
    /// only when present, then `model_id`: the keyword arguments that sort between `image` and
    /// `video`.
    fn factors_and_model(
        &mut self,
        modality: &[u8],
        media_io: Option<&JsonValue>,
        processor: &[&(String, JsonValue)],
        model_id: &str,
    ) {
        if let Some(io) = media_io {
            self.framed(b"media_io_kwargs");
            self.mapping(1);
            self.framed(modality);
            self.value(io);
        }
        if !processor.is_empty() {
            self.framed(b"mm_processor_kwargs");
            self.mapping(processor.len());
            for (k, v) in processor {
                self.framed(k.as_bytes());
                self.value(v);
            }
        }
        self.framed(b"model_id");
        self.tag(TAG_LEAF);
        self.framed(model_id.as_bytes());
    }

    fn hex_digest(self) -> String {
        use sha2::Digest as _;
        let bytes: Vec<u8> = match self {
            Self::Blake3(h) => return h.finalize().to_hex().to_string(),
            Self::Sha256(h) => h.finalize().to_vec(),
            Self::Sha512(h) => h.finalize().to_vec(),
        };
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = JsonValue;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<JsonValue, E> {
        Ok(JsonValue::Null)
    }

    fn visit_none<E>(self) -> Result<JsonValue, E> {
        Ok(JsonValue::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<JsonValue, D::Error> {
        JsonValue::deserialize(d)
    }

    fn visit_bool<E>(self, v: bool) -> Result<JsonValue, E> {
        Ok(JsonValue::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<JsonValue, E> {
        Ok(JsonValue::Int(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<JsonValue, E> {
        Ok(i64::try_from(v).map_or(JsonValue::UInt(v), JsonValue::Int))
    }

    fn visit_f64<E>(self, v: f64) -> Result<JsonValue, E> {
        Ok(JsonValue::Float(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<JsonValue, E> {
        Ok(JsonValue::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<JsonValue, E> {
        Ok(JsonValue::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<JsonValue, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(JsonValue::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonValue, A::Error> {
        let mut members: Vec<(String, JsonValue)> = Vec::new();
        while let Some((key, value)) = map.next_entry::<String, JsonValue>()? {
            // Python's dict: a repeated key keeps its first place and takes the last value.
            if let Some(slot) = members.iter_mut().find(|(k, _)| *k == key) {
                slot.1 = value;
                continue;
            }
            // Members are looked up by a scan, here and when kwargs merge: bounded, so that a
            // request's object of half a million keys is refused instead of costing 10^11
            // comparisons.
            if members.len() == MAX_OBJECT_MEMBERS {
                return Err(de::Error::custom(format!(
                    "an object has more than {MAX_OBJECT_MEMBERS} members"
                )));
            }
            members.push((key, value));
        }
        Ok(JsonValue::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout tests hash bytes laid out by hand with SHA-256 and compare with the stream's
    /// digest: equal digests mean an equal stream.
    fn sha256_hex(bytes: &[u8]) -> String {
        use sha2::Digest as _;
        sha2::Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn framed(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    }

    fn container(out: &mut Vec<u8>, tag: u8, n: u64) {
        out.push(tag);
        out.extend_from_slice(&n.to_le_bytes());
    }

    fn int_leaves(out: &mut Vec<u8>, values: &[i64]) {
        container(out, TAG_SEQUENCE, values.len() as u64);
        for v in values {
            out.push(TAG_LEAF);
            framed(out, &v.to_le_bytes());
        }
    }

    fn kw(text: &str) -> Option<OrderedJson> {
        Some(OrderedJson::parse("test", text).unwrap())
    }

    #[test]
    fn objects_beyond_the_member_bound_are_refused_and_repeats_do_not_count() {
        let object = |n: usize| {
            let members: Vec<String> = (0..n).map(|i| format!("\"k{i}\": {i}")).collect();
            format!("{{\"video\": {{{}}}}}", members.join(","))
        };
        assert!(OrderedJson::parse("kwargs", &object(MAX_OBJECT_MEMBERS)).is_ok());
        let err = OrderedJson::parse("kwargs", &object(MAX_OBJECT_MEMBERS + 1)).unwrap_err();
        assert!(err.to_string().contains("more than 1024 members"), "{err}");
        let repeated = format!(
            "{{{}, \"k0\": 1}}",
            (0..MAX_OBJECT_MEMBERS)
                .map(|i| format!("\"k{i}\": {i}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert!(OrderedJson::parse("kwargs", &repeated).is_ok());
    }

    #[test]
    fn algorithm_names_round_trip() {
        for a in [
            HashAlgorithm::Blake3,
            HashAlgorithm::Sha256,
            HashAlgorithm::Sha512,
        ] {
            assert_eq!(a.to_string().parse::<HashAlgorithm>().unwrap(), a);
        }
        assert_eq!(HashAlgorithm::default(), HashAlgorithm::Blake3);
        let e = "md5".parse::<HashAlgorithm>().unwrap_err();
        assert!(e.to_string().contains("md5"), "{e}");
    }

    #[test]
    fn plain_bytes_layout() {
        let mut expected = Vec::new();
        framed(&mut expected, b"image");
        expected.push(TAG_LEAF);
        framed(&mut expected, b"image");
        expected.push(TAG_LEAF);
        framed(&mut expected, b"\x89PNG");
        framed(&mut expected, b"model_id");
        expected.push(TAG_LEAF);
        framed(&mut expected, b"org/model");
        let item = ItemSource {
            uuid: None,
            bytes: b"\x89PNG",
            converted: None,
        };
        let got = item_identifier(
            HashAlgorithm::Sha256,
            "org/model",
            &item,
            &HashFactors::default(),
        );
        assert_eq!(got, sha256_hex(&expected));
    }

    #[test]
    fn io_config_and_factors_layout() {
        let mut expected = Vec::new();
        framed(&mut expected, b"image");
        expected.push(TAG_LEAF);
        framed(&mut expected, b"image");
        container(&mut expected, TAG_MAPPING, 2);
        framed(&mut expected, b"io_config");
        container(&mut expected, TAG_MAPPING, 2);
        framed(&mut expected, b"image_mode");
        expected.push(TAG_LEAF);
        framed(&mut expected, b"RGB");
        framed(&mut expected, b"rgba_background_color");
        int_leaves(&mut expected, &[1, 2, 3]);
        framed(&mut expected, b"data");
        expected.push(TAG_LEAF);
        framed(&mut expected, b"xy");
        // media_io_kwargs: only the image entry, wrapped in {"image": ...}.
        framed(&mut expected, b"media_io_kwargs");
        container(&mut expected, TAG_MAPPING, 1);
        framed(&mut expected, b"image");
        container(&mut expected, TAG_MAPPING, 1);
        framed(&mut expected, b"rgba_background_color");
        int_leaves(&mut expected, &[1, 2, 3]);
        // mm_processor_kwargs in document order, videos_kwargs left out; float, bool, null.
        framed(&mut expected, b"mm_processor_kwargs");
        container(&mut expected, TAG_MAPPING, 3);
        framed(&mut expected, b"z");
        expected.push(TAG_LEAF);
        framed(&mut expected, &1.5f64.to_le_bytes());
        framed(&mut expected, b"a");
        expected.push(TAG_LEAF);
        framed(&mut expected, &[1]);
        framed(&mut expected, b"n");
        expected.push(TAG_NONE);
        framed(&mut expected, b"model_id");
        expected.push(TAG_LEAF);
        framed(&mut expected, b"m");

        let factors = HashFactors {
            mm_processor_kwargs: kw(
                r#"{"z": 1.5, "videos_kwargs": {"fps": 2}, "a": true, "n": null}"#,
            ),
            media_io_kwargs: kw(
                r#"{"video": {"num_frames": 4}, "image": {"rgba_background_color": [1, 2, 3]}}"#,
            ),
        };
        let bg = factors.background_color().unwrap();
        assert_eq!(bg, [1, 2, 3]);
        let item = ItemSource {
            uuid: None,
            bytes: b"xy",
            converted: Some(bg),
        };
        let got = item_identifier(HashAlgorithm::Sha256, "m", &item, &factors);
        assert_eq!(got, sha256_hex(&expected));
    }

    #[test]
    fn uuid_is_verbatim_only_without_image_factors() {
        let item = ItemSource {
            uuid: Some("u-1"),
            bytes: b"ignored",
            converted: Some(DEFAULT_BACKGROUND),
        };
        let none_like = [
            HashFactors::default(),
            HashFactors {
                mm_processor_kwargs: kw("{}"),
                media_io_kwargs: kw(r#"{"image": {}, "video": {"fps": 1}}"#),
            },
            HashFactors {
                mm_processor_kwargs: kw(r#"{"videos_kwargs": {"fps": 1}, "audio_kwargs": {}}"#),
                media_io_kwargs: None,
            },
        ];
        for f in &none_like {
            assert!(!f.has_image_factors(), "{f:?}");
            assert_eq!(item_identifier(HashAlgorithm::Blake3, "m", &item, f), "u-1");
        }
        // {"images_kwargs": {}} is a non-empty dict: a factor, as in vLLM.
        let f = HashFactors {
            mm_processor_kwargs: kw(r#"{"images_kwargs": {}}"#),
            media_io_kwargs: None,
        };
        assert!(f.has_image_factors());
        let id = item_identifier(HashAlgorithm::Blake3, "m", &item, &f);
        assert_eq!(id.len(), 64);
        // The uuid stands in for the bytes: they and io_config do not matter.
        let other = ItemSource {
            bytes: b"different",
            converted: None,
            ..item
        };
        assert_eq!(item_identifier(HashAlgorithm::Blake3, "m", &other, &f), id);
    }

    #[test]
    fn ordered_json_keeps_document_order_and_python_duplicates() {
        let j = OrderedJson::parse("t", r#"{"b": 1, "a": 2, "b": 3}"#).unwrap();
        assert_eq!(
            j.members(),
            &[
                ("b".to_owned(), JsonValue::Int(3)),
                ("a".to_owned(), JsonValue::Int(2))
            ]
        );
        let j =
            OrderedJson::parse("t", r#"{"x": 18446744073709551615, "y": -1, "z": 1.0}"#).unwrap();
        assert_eq!(j.get("x"), Some(&JsonValue::UInt(u64::MAX)));
        assert_eq!(j.get("y"), Some(&JsonValue::Int(-1)));
        assert_eq!(j.get("z"), Some(&JsonValue::Float(1.0)));
        let raw: Box<RawValue> = serde_json::from_str(r#"{"k": [1, "s"]}"#).unwrap();
        let j = OrderedJson::from_raw("t", &raw).unwrap();
        assert_eq!(
            j.get("k"),
            Some(&JsonValue::Array(vec![
                JsonValue::Int(1),
                JsonValue::String("s".into())
            ]))
        );
        #[derive(serde::Deserialize)]
        struct Dto {
            kw: Option<OrderedJson>,
        }
        let dto: Dto = serde_json::from_str(r#"{"kw": {"q": 1, "p": 2}}"#).unwrap();
        let keys: Vec<&str> = dto
            .kw
            .as_ref()
            .unwrap()
            .members()
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys, ["q", "p"]);
        assert!(serde_json::from_str::<Dto>(r#"{"kw": 3}"#).is_err());
        for bad in ["[]", "1", "\"s\"", "{", "{} x"] {
            assert!(OrderedJson::parse("t", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn background_colour_is_validated_as_vllm_does() {
        let with = |image: &str| HashFactors {
            media_io_kwargs: kw(&format!(r#"{{"image": {image}}}"#)),
            mm_processor_kwargs: None,
        };
        assert_eq!(with("{}").background_color().unwrap(), DEFAULT_BACKGROUND);
        assert_eq!(
            with(r#"{"rgba_background_color": [0, 128, 255]}"#)
                .background_color()
                .unwrap(),
            [0, 128, 255]
        );
        for bad in [
            "[0, 0]",
            "[0, 0, 256]",
            "[0, 0, -1]",
            "[0, 0, 1.0]",
            "\"white\"",
            "[0, 0, true]",
        ] {
            let e = with(&format!(r#"{{"rgba_background_color": {bad}}}"#))
                .background_color()
                .unwrap_err();
            assert!(matches!(e, IdentifierError::BadBackground(_)), "{bad}: {e}");
        }
        assert!(with(r#"{"image_mode": "RGB"}"#).background_color().is_ok());
        let e = with(r#"{"image_mode": null}"#)
            .background_color()
            .unwrap_err();
        assert!(matches!(e, IdentifierError::UnsupportedImageMode(_)), "{e}");
        let e = with("[1]").background_color().unwrap_err();
        assert!(matches!(e, IdentifierError::NotAnObject { .. }), "{e}");
    }
}
