//! Header-first decoding of PNG, JPEG and WebP into 8-bit RGB.
//!
//! The format is detected from the leading bytes (never from a file name) and the dimensions
//! are read from the header; only when they pass [`DecodeLimits`] is the body decoded, with the
//! same limits handed to the decoder. Alpha is removed as [`AlphaMode`] says.

use std::io::Cursor;

use image::{DynamicImage, ImageError, ImageFormat, ImageReader};

use super::{AlphaMode, DecodeLimits, ImageSize, PreprocessError, RgbImage, config::CHANNELS};

/// An accepted image format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SourceFormat {
    /// PNG.
    Png,
    /// JPEG.
    Jpeg,
    /// WebP (lossy or lossless).
    WebP,
}

impl SourceFormat {
    /// The format's usual name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::WebP => "WebP",
        }
    }
}

/// What the header says, read without decoding pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// Detected format.
    pub format: SourceFormat,
    /// Width and height from the header.
    pub size: ImageSize,
}

/// Detects the format and reads the dimensions from the header, then checks them against
/// `limits`. Decodes no pixel data.
///
/// # Errors
/// [`PreprocessError::UnsupportedFormat`] for anything but PNG/JPEG/WebP,
/// [`PreprocessError::Decode`] for an unreadable header, [`PreprocessError::ZeroSize`],
/// [`PreprocessError::TooLarge`].
pub fn probe(bytes: &[u8], limits: &DecodeLimits) -> Result<ImageInfo, PreprocessError> {
    let format = detect(bytes)?;
    let mut reader = ImageReader::with_format(Cursor::new(bytes), image_format(format));
    // Only the header is read here; the allocation limit still bounds what the header parser
    // may allocate for ancillary chunks.
    reader.limits(alloc_only(limits));
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| map_error(format, e, None, limits))?;
    let size = ImageSize { width, height };
    check_limits(size, limits)?;
    Ok(ImageInfo { format, size })
}

/// Decodes an image to 8-bit RGB: [`probe`] first, then the body under `limits`.
///
/// 16-bit samples become 8-bit as Pillow opens them (the high byte; plain 16-bit grey is
/// clipped at 255); grey images are replicated to three channels; alpha is dropped or
/// composited onto white as `alpha` says.
///
/// # Errors
/// Those of [`probe`], and [`PreprocessError::Decode`] for a corrupt or truncated body.
pub fn decode_rgb(
    bytes: &[u8],
    limits: &DecodeLimits,
    alpha: AlphaMode,
) -> Result<(ImageInfo, RgbImage), PreprocessError> {
    let info = probe(bytes, limits)?;
    let mut reader = ImageReader::with_format(Cursor::new(bytes), image_format(info.format));
    let mut decoder_limits = alloc_only(limits);
    decoder_limits.max_image_width = Some(limits.max_width);
    decoder_limits.max_image_height = Some(limits.max_height);
    reader.limits(decoder_limits);
    let img = reader
        .decode()
        .map_err(|e| map_error(info.format, e, Some(info.size), limits))?;
    let size = ImageSize {
        width: img.width(),
        height: img.height(),
    };
    if size != info.size {
        return Err(PreprocessError::Decode {
            format: info.format.name(),
            message: format!(
                "decoded size {}x{} differs from the header's {}x{}",
                size.width, size.height, info.size.width, info.size.height
            ),
        });
    }
    Ok((info, to_rgb(img, alpha)))
}

/// Pillow's `alpha_composite` of one 8-bit colour value with alpha `a` over opaque white
/// (`PRECISION_BITS` 7, `SHIFTFORDIV255` rounding). Matches Pillow for all 65536 inputs.
#[must_use]
pub fn composite_on_white(c: u8, a: u8) -> u8 {
    const PREC: u32 = 7;
    if a == 0 {
        return u8::MAX;
    }
    let (c, a) = (u32::from(c), u32::from(a));
    // With an opaque background Pillow's coefficients reduce to a*2^7 and (255-a)*2^7.
    let coef1 = a << PREC;
    let coef2 = (255 - a) << PREC;
    let tmp = c * coef1 + 255 * coef2 + (0x80 << PREC);
    let div255 = ((tmp >> 8) + tmp) >> 8;
    u8::try_from(div255 >> PREC).unwrap_or(u8::MAX)
}

fn detect(bytes: &[u8]) -> Result<SourceFormat, PreprocessError> {
    match image::guess_format(bytes) {
        Ok(ImageFormat::Png) => Ok(SourceFormat::Png),
        Ok(ImageFormat::Jpeg) => Ok(SourceFormat::Jpeg),
        Ok(ImageFormat::WebP) => Ok(SourceFormat::WebP),
        Ok(other) => Err(PreprocessError::UnsupportedFormat {
            detected: format_name(other),
        }),
        Err(_) => Err(PreprocessError::UnsupportedFormat {
            detected: if bytes.is_empty() {
                "nothing (empty input)".into()
            } else {
                "no known image signature".into()
            },
        }),
    }
}

fn format_name(f: ImageFormat) -> String {
    f.extensions_str()
        .first()
        .map_or_else(|| format!("{f:?}"), |e| e.to_ascii_uppercase())
}

fn image_format(f: SourceFormat) -> ImageFormat {
    match f {
        SourceFormat::Png => ImageFormat::Png,
        SourceFormat::Jpeg => ImageFormat::Jpeg,
        SourceFormat::WebP => ImageFormat::WebP,
    }
}

fn alloc_only(limits: &DecodeLimits) -> image::Limits {
    let mut l = image::Limits::no_limits();
    l.max_alloc = Some(limits.max_alloc);
    l
}

fn check_limits(size: ImageSize, limits: &DecodeLimits) -> Result<(), PreprocessError> {
    let ImageSize { width, height } = size;
    let too_large = |limit_name, limit| PreprocessError::TooLarge {
        width,
        height,
        limit_name,
        limit,
    };
    if width == 0 || height == 0 {
        return Err(PreprocessError::ZeroSize { width, height });
    }
    if width > limits.max_width {
        return Err(too_large("max_width", u64::from(limits.max_width)));
    }
    if height > limits.max_height {
        return Err(too_large("max_height", u64::from(limits.max_height)));
    }
    if u64::from(width) * u64::from(height) > limits.max_pixels {
        return Err(too_large("max_pixels", limits.max_pixels));
    }
    Ok(())
}

fn map_error(
    format: SourceFormat,
    e: ImageError,
    size: Option<ImageSize>,
    limits: &DecodeLimits,
) -> PreprocessError {
    match (e, size) {
        (ImageError::Limits(_), Some(s)) => PreprocessError::TooLarge {
            width: s.width,
            height: s.height,
            limit_name: "max_alloc",
            limit: limits.max_alloc,
        },
        (e, _) => PreprocessError::Decode {
            format: format.name(),
            message: e.to_string(),
        },
    }
}

fn to_rgb(img: DynamicImage, alpha: AlphaMode) -> RgbImage {
    let size = ImageSize {
        width: img.width(),
        height: img.height(),
    };
    let n = size.pixel_count();
    let mut out = Vec::with_capacity(n * CHANNELS);
    let mut push = |r: u8, g: u8, b: u8, a: Option<u8>| match (alpha, a) {
        (AlphaMode::CompositeWhite, Some(a)) => out.extend_from_slice(&[
            composite_on_white(r, a),
            composite_on_white(g, a),
            composite_on_white(b, a),
        ]),
        _ => out.extend_from_slice(&[r, g, b]),
    };
    // Pillow opens 16-bit colour and grey-alpha PNGs ("RGB;16B", "LA;16B" raw modes) by keeping
    // the high byte of each sample.
    let hi = |v: u16| v.to_be_bytes()[0];
    match img {
        DynamicImage::ImageRgb8(b) => {
            return RgbImage {
                size,
                pixels: b.into_raw(),
            };
        }
        DynamicImage::ImageRgba8(b) => b.pixels().for_each(|p| push(p[0], p[1], p[2], Some(p[3]))),
        DynamicImage::ImageLuma8(b) => b.pixels().for_each(|p| push(p[0], p[0], p[0], None)),
        DynamicImage::ImageLumaA8(b) => b.pixels().for_each(|p| push(p[0], p[0], p[0], Some(p[1]))),
        DynamicImage::ImageRgb16(b) => b
            .pixels()
            .for_each(|p| push(hi(p[0]), hi(p[1]), hi(p[2]), None)),
        DynamicImage::ImageRgba16(b) => b
            .pixels()
            .for_each(|p| push(hi(p[0]), hi(p[1]), hi(p[2]), Some(hi(p[3])))),
        // Pillow opens 16-bit grey as mode "I;16", whose conversion to RGB clips at 255.
        DynamicImage::ImageLuma16(b) => b.pixels().for_each(|p| {
            let v = u8::try_from(p[0]).unwrap_or(u8::MAX);
            push(v, v, v, None);
        }),
        DynamicImage::ImageLumaA16(b) => b.pixels().for_each(|p| {
            let v = hi(p[0]);
            push(v, v, v, Some(hi(p[1])));
        }),
        other => {
            // Float layouts come only from formats not enabled here; convert generically.
            let rgba = other.to_rgba8();
            rgba.pixels()
                .for_each(|p| push(p[0], p[1], p[2], Some(p[3])));
        }
    }
    RgbImage { size, pixels: out }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(width: u32, height: u32, color: image::ExtendedColorType, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        image::ImageEncoder::write_image(
            image::codecs::png::PngEncoder::new(&mut out),
            data,
            width,
            height,
            color,
        )
        .unwrap();
        out
    }

    #[test]
    fn composite_matches_pillow_spot_values() {
        // Values computed with PIL.Image.alpha_composite over opaque white.
        assert_eq!(composite_on_white(0, 0), 255);
        assert_eq!(composite_on_white(0, 255), 0);
        assert_eq!(composite_on_white(200, 255), 200);
        assert_eq!(composite_on_white(0, 128), 127);
        assert_eq!(composite_on_white(100, 1), 254);
    }

    #[test]
    fn grey_and_grey_alpha_are_replicated() {
        let g = png(2, 1, image::ExtendedColorType::L8, &[10, 250]);
        let (_, rgb) = decode_rgb(&g, &DecodeLimits::default(), AlphaMode::Drop).unwrap();
        assert_eq!(rgb.pixels, vec![10, 10, 10, 250, 250, 250]);
        let ga = png(1, 1, image::ExtendedColorType::La8, &[40, 0]);
        let (_, drop) = decode_rgb(&ga, &DecodeLimits::default(), AlphaMode::Drop).unwrap();
        assert_eq!(drop.pixels, vec![40, 40, 40]);
        let (_, white) =
            decode_rgb(&ga, &DecodeLimits::default(), AlphaMode::CompositeWhite).unwrap();
        assert_eq!(white.pixels, vec![255, 255, 255]);
    }

    #[test]
    fn sixteen_bit_keeps_the_high_byte() {
        let px: Vec<u8> = [0x12_34u16, 0xAB_FF, 0x00_FF]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        let p = png(1, 1, image::ExtendedColorType::Rgb16, &px);
        let (_, rgb) = decode_rgb(&p, &DecodeLimits::default(), AlphaMode::Drop).unwrap();
        assert_eq!(rgb.pixels, vec![0x12, 0xAB, 0x00]);
        // Plain 16-bit grey: Pillow's "I;16" -> RGB clips (checked with Pillow 13:
        // 0x1234 -> 255, 0x00FF -> 255, 0x0080 -> 128).
        let px: Vec<u8> = [0x12_34u16, 0x00_FF, 0x00_80]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        let p = png(3, 1, image::ExtendedColorType::L16, &px);
        let (_, rgb) = decode_rgb(&p, &DecodeLimits::default(), AlphaMode::Drop).unwrap();
        assert_eq!(
            rgb.pixels,
            vec![255, 255, 255, 255, 255, 255, 128, 128, 128]
        );
    }

    #[test]
    fn limits_are_checked_per_side_and_area() {
        let p = png(40, 30, image::ExtendedColorType::Rgb8, &[7; 40 * 30 * 3]);
        let strict = |max_width, max_height, max_pixels| DecodeLimits {
            max_width,
            max_height,
            max_pixels,
            ..DecodeLimits::default()
        };
        assert!(probe(&p, &strict(40, 30, 1200)).is_ok());
        let e = probe(&p, &strict(39, 30, 1200)).unwrap_err();
        assert!(
            matches!(
                e,
                PreprocessError::TooLarge {
                    limit_name: "max_width",
                    ..
                }
            ),
            "{e}"
        );
        let e = probe(&p, &strict(40, 29, 1200)).unwrap_err();
        assert!(
            matches!(
                e,
                PreprocessError::TooLarge {
                    limit_name: "max_height",
                    ..
                }
            ),
            "{e}"
        );
        let e = probe(&p, &strict(40, 30, 1199)).unwrap_err();
        assert!(
            matches!(
                e,
                PreprocessError::TooLarge {
                    limit_name: "max_pixels",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn empty_and_unknown_bytes_are_unsupported() {
        for bytes in [&b""[..], b"hello, not an image at all"] {
            let e = probe(bytes, &DecodeLimits::default()).unwrap_err();
            assert!(
                matches!(e, PreprocessError::UnsupportedFormat { .. }),
                "{e}"
            );
        }
        let e = probe(b"BM\0\0\0\0\0\0\0\0", &DecodeLimits::default()).unwrap_err();
        assert_eq!(
            e,
            PreprocessError::UnsupportedFormat {
                detected: "BMP".into()
            }
        );
    }
}
