//! Replays the identifiers vLLM 0.33 computed (tools/ec-goldens/make_identifiers.py) through
//! iris: the identifier itself, whether vLLM converted the image's mode (read from the header
//! by `needs_rgb_conversion`), and the picture iris decodes against the one vLLM handed its
//! processor (size after EXIF orientation, and the RGB values).

use std::path::{Path, PathBuf};

use iris_core::preprocess::{AlphaMode, DecodeLimits, decode_rgb, needs_rgb_conversion};
use iris_ec::identifier::{
    HashAlgorithm, HashFactors, ItemSource, OrderedJson, item_identifier, merge_media_io_kwargs,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Manifest {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    file: String,
    model_id: String,
    algorithm: String,
    uuid: Option<String>,
    mm_processor_kwargs: Option<String>,
    media_io_kwargs: Option<String>,
    server_media_io_kwargs: Option<String>,
    effective_media_io_kwargs: Option<String>,
    expected: String,
    io_config: bool,
    background: [u8; 3],
    pillow_format: String,
    decoded_size: [u32; 2],
    decoded_rgb_hex: String,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/identifiers")
}

fn load() -> Vec<Case> {
    let text = std::fs::read_to_string(fixtures().join("cases.json")).unwrap();
    let manifest: Manifest = serde_json::from_str(&text).unwrap();
    assert!(manifest.cases.len() >= 30, "{} cases", manifest.cases.len());
    manifest.cases
}

fn json(field: &'static str, text: Option<&String>) -> Option<OrderedJson> {
    text.map(|t| OrderedJson::parse(field, t).unwrap())
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn identifiers_match_vllm() {
    let mut failures = Vec::new();
    for case in load() {
        let bytes = std::fs::read(fixtures().join(&case.file)).unwrap();
        let server = json("server", case.server_media_io_kwargs.as_ref());
        let request = json("request", case.media_io_kwargs.as_ref());
        let media_io = merge_media_io_kwargs(server.as_ref(), request.as_ref()).unwrap();
        assert_eq!(
            media_io,
            json("effective", case.effective_media_io_kwargs.as_ref()),
            "{}: merged media_io_kwargs",
            case.name
        );
        let factors = HashFactors {
            mm_processor_kwargs: json("mm_processor_kwargs", case.mm_processor_kwargs.as_ref()),
            media_io_kwargs: media_io,
        };
        let background = factors.background_color().unwrap();
        let converted = needs_rgb_conversion(&bytes).unwrap();
        if converted != case.io_config {
            failures.push(format!(
                "{}: needs_rgb_conversion {converted}, vLLM io_config {}",
                case.name, case.io_config
            ));
        }
        if case.io_config {
            assert_eq!(background, case.background, "{}", case.name);
        }
        let item = ItemSource {
            uuid: case.uuid.as_deref(),
            bytes: &bytes,
            converted: converted.then_some(background),
        };
        let algorithm: HashAlgorithm = case.algorithm.parse().unwrap();
        let got = item_identifier(algorithm, &case.model_id, &item, &factors);
        if got != case.expected {
            failures.push(format!(
                "{}: identifier {got}, vLLM {}",
                case.name, case.expected
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The largest difference allowed per value between iris's decode and Pillow's: exact for
/// every format but JPEG, which zune-jpeg decodes with another IDCT and chroma upsampling than
/// libjpeg-turbo (measured: at most 2 on these images, 1 for CMYK, 0 for grey).
fn tolerance(case: &Case) -> u8 {
    if case.pillow_format == "JPEG" {
        JPEG_TOLERANCE
    } else {
        0
    }
}

const JPEG_TOLERANCE: u8 = 2;

#[test]
fn decoded_pictures_match_vllm() {
    let mut failures = Vec::new();
    for case in load() {
        let bytes = std::fs::read(fixtures().join(&case.file)).unwrap();
        let (_, rgb) = decode_rgb(
            &bytes,
            &DecodeLimits::default(),
            AlphaMode::PasteOn(case.background),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let [width, height] = case.decoded_size;
        if (rgb.size.width, rgb.size.height) != (width, height) {
            failures.push(format!(
                "{}: decoded {}x{}, vLLM {width}x{height}",
                case.name, rgb.size.width, rgb.size.height
            ));
            continue;
        }
        let expected = unhex(&case.decoded_rgb_hex);
        assert_eq!(expected.len(), rgb.pixels.len(), "{}", case.name);
        let max_diff = rgb
            .pixels
            .iter()
            .zip(&expected)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap_or(0);
        let tol = tolerance(&case);
        if max_diff > tol {
            failures.push(format!(
                "{}: max difference {max_diff} from vLLM's picture (tolerance {tol})",
                case.name
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
