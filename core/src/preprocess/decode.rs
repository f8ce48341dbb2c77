//! Header-first decoding of PNG, JPEG, WebP, GIF, BMP and TIFF into 8-bit RGB, as vLLM decodes.
//!
//! The format is detected from the leading bytes (never from a file name) and the dimensions
//! are read from the header; only when they pass [`DecodeLimits`] is the body decoded, with the
//! same limits handed to the decoder. Then, in the order of vLLM's `ImageMediaIO.load_bytes`:
//! the EXIF orientation is applied (Pillow's `ImageOps.exif_transpose`), and alpha is removed as
//! [`AlphaMode`] says (by default vLLM's paste onto white). A GIF gives its first frame.
//!
//! [`needs_rgb_conversion`] answers, from the header alone, whether Pillow opens the image in a
//! mode other than plain RGB without transparency: exactly when vLLM's `convert_image_mode`
//! makes a new image, which changes vLLM's identifier of the item.

use std::io::Cursor;

use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, ImageReader};

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
    /// GIF (the first frame).
    Gif,
    /// BMP.
    Bmp,
    /// TIFF (the first page).
    Tiff,
}

impl SourceFormat {
    /// The format's usual name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::WebP => "WebP",
            Self::Gif => "GIF",
            Self::Bmp => "BMP",
            Self::Tiff => "TIFF",
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
/// [`PreprocessError::UnsupportedFormat`] for anything but PNG/JPEG/WebP/GIF/BMP/TIFF,
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

/// Decodes an image to 8-bit RGB: [`probe`] first, then the body under `limits`, then the EXIF
/// orientation.
///
/// 16-bit samples become 8-bit as Pillow opens them (the high byte; plain 16-bit grey is
/// clipped at 255); grey images are replicated to three channels; alpha is removed as `alpha`
/// says. The returned [`ImageInfo`] is the header's, before orientation; the image's own size
/// is the oriented one (a quarter turn swaps width and height).
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
    let fail = |e| map_error(info.format, e, Some(info.size), limits);
    let mut decoder = reader.into_decoder().map_err(fail)?;
    // vLLM suppresses every error of exif_transpose: unreadable EXIF means no rotation.
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(fail)?;
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
    img.apply_orientation(orientation);
    Ok((info, to_rgb(img, alpha)))
}

/// Whether Pillow opens `bytes` in a mode other than plain `RGB` without transparency, read
/// from the header only: grey (`1`, `L`, `I;16`), palette, alpha (`RGBA`, `LA`), a `tRNS`
/// chunk, CMYK or YCbCr. 16-bit colour PNGs count as RGB, as Pillow opens them as 8-bit RGB.
/// For such an image vLLM's `convert_image_mode` makes a new picture and its identifier
/// carries an `io_config`.
///
/// # Errors
/// [`PreprocessError::UnsupportedFormat`] as [`probe`]; [`PreprocessError::Decode`] for a
/// header too short or malformed to tell.
///
/// ```
/// use iris_core::preprocess::needs_rgb_conversion;
/// # let encode = |color, data: &[u8]| { let mut out = Vec::new();
/// #     image::ImageEncoder::write_image(image::codecs::png::PngEncoder::new(&mut out),
/// #         data, 1, 1, color).unwrap(); out };
/// let rgb = encode(image::ExtendedColorType::Rgb8, &[1, 2, 3]);
/// let rgba = encode(image::ExtendedColorType::Rgba8, &[1, 2, 3, 4]);
/// assert!(!needs_rgb_conversion(&rgb).unwrap());
/// assert!(needs_rgb_conversion(&rgba).unwrap());
/// ```
pub fn needs_rgb_conversion(bytes: &[u8]) -> Result<bool, PreprocessError> {
    let format = detect(bytes)?;
    let header = |message: &str| PreprocessError::Decode {
        format: format.name(),
        message: format!("cannot read the colour mode from the header: {message}"),
    };
    match format {
        SourceFormat::Png => png_needs_conversion(bytes).map_err(header),
        SourceFormat::Jpeg => jpeg_components(bytes).map(|n| n != 3).map_err(header),
        SourceFormat::WebP => webp_has_alpha(bytes).map_err(header),
        // Pillow opens a GIF's first frame as "P" (or "L" for a grey palette), never "RGB".
        SourceFormat::Gif => Ok(true),
        SourceFormat::Bmp => bmp_needs_conversion(bytes).map_err(header),
        SourceFormat::Tiff => tiff_needs_conversion(bytes).map_err(header),
    }
}

/// Pillow's `Image.paste(im, mask=alpha)` of one 8-bit value `c` with alpha `a` onto `bg`:
/// `DIV255(c * a + bg * (255 - a))` with Pillow's rounding. Checked against Pillow 13 for all
/// 65536 `(c, a)` pairs on four backgrounds.
#[must_use]
pub fn paste_on(c: u8, a: u8, bg: u8) -> u8 {
    let (c, a, bg) = (u32::from(c), u32::from(a), u32::from(bg));
    let tmp = c * a + bg * (255 - a) + 128;
    u8::try_from(((tmp >> 8) + tmp) >> 8).unwrap_or(u8::MAX)
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
        Ok(ImageFormat::Gif) => Ok(SourceFormat::Gif),
        Ok(ImageFormat::Bmp) => Ok(SourceFormat::Bmp),
        Ok(ImageFormat::Tiff) => Ok(SourceFormat::Tiff),
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
        SourceFormat::Gif => ImageFormat::Gif,
        SourceFormat::Bmp => ImageFormat::Bmp,
        SourceFormat::Tiff => ImageFormat::Tiff,
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
        (AlphaMode::PasteOn(bg), Some(a)) => out.extend_from_slice(&[
            paste_on(r, a, bg[0]),
            paste_on(g, a, bg[1]),
            paste_on(b, a, bg[2]),
        ]),
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

/// A PNG is plain RGB for Pillow when its colour type is 2 (truecolour, 8 or 16 bits) and no
/// `tRNS` chunk precedes the image data (Pillow reads the chunks before `IDAT` when it opens).
fn png_needs_conversion(bytes: &[u8]) -> Result<bool, &'static str> {
    const SIGNATURE: usize = 8;
    let ihdr = bytes
        .get(SIGNATURE + 8..SIGNATURE + 8 + 13)
        .ok_or("no IHDR")?;
    if bytes.get(SIGNATURE + 4..SIGNATURE + 8) != Some(b"IHDR") {
        return Err("the first chunk is not IHDR");
    }
    let colour_type = ihdr[9];
    let mut pos = SIGNATURE;
    while let Some(head) = bytes.get(pos..pos + 8) {
        let len = usize::try_from(u32::from_be_bytes([head[0], head[1], head[2], head[3]]))
            .map_err(|_| "chunk length")?;
        match &head[4..8] {
            b"tRNS" => return Ok(true),
            b"IDAT" | b"IEND" => break,
            _ => {}
        }
        // Length, type, data, CRC.
        pos = pos.checked_add(12 + len).ok_or("chunk length")?;
    }
    Ok(colour_type != 2)
}

/// The number of components in a JPEG's frame header: Pillow opens 1 as "L", 3 as "RGB" and
/// 4 as "CMYK".
fn jpeg_components(bytes: &[u8]) -> Result<u8, &'static str> {
    let mut pos = 2;
    loop {
        let marker = bytes.get(pos..pos + 2).ok_or("no frame header")?;
        if marker[0] != 0xFF {
            return Err("marker expected");
        }
        let kind = marker[1];
        // Fill bytes and standalone markers carry no length.
        if kind == 0xFF {
            pos += 1;
            continue;
        }
        if kind == 0x01 || (0xD0..=0xD7).contains(&kind) {
            pos += 2;
            continue;
        }
        let len = bytes.get(pos + 2..pos + 4).ok_or("truncated segment")?;
        let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
        // SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC).
        if (0xC0..=0xCF).contains(&kind) && ![0xC4, 0xC8, 0xCC].contains(&kind) {
            // Length, precision, height, width, then the component count.
            return bytes.get(pos + 9).copied().ok_or("truncated frame header");
        }
        if kind == 0xDA || kind == 0xD9 {
            return Err("no frame header before the scan");
        }
        pos += 2 + len;
    }
}

/// Pillow opens a WebP as "RGBA" when it may carry alpha (a lossless bitstream's alpha hint, or
/// the extended header's alpha flag), else as "RGB".
fn webp_has_alpha(bytes: &[u8]) -> Result<bool, &'static str> {
    let chunk = bytes.get(12..16).ok_or("no first chunk")?;
    match chunk {
        b"VP8 " => Ok(false),
        // The lossless header: signature 0x2f, then 14+14 bits of size and the alpha hint bit.
        b"VP8L" => {
            let b = bytes.get(21..25).ok_or("truncated VP8L header")?;
            let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            Ok(bits >> 28 & 1 == 1)
        }
        b"VP8X" => {
            let flags = *bytes.get(20).ok_or("truncated VP8X header")?;
            const ALPHA: u8 = 0x10;
            Ok(flags & ALPHA != 0)
        }
        _ => Err("unknown first chunk"),
    }
}

/// Pillow opens 16, 24 and 32-bit BMPs as "RGB", unless bit fields give an alpha mask; palette
/// depths as "P" (or "1"/"L"). A 32-bit uncompressed BMP is "RGB" (the fourth byte ignored).
fn bmp_needs_conversion(bytes: &[u8]) -> Result<bool, &'static str> {
    const FILE_HEADER: usize = 14;
    let size = bytes
        .get(FILE_HEADER..FILE_HEADER + 4)
        .ok_or("no info header")?;
    let header_size = u32::from_le_bytes([size[0], size[1], size[2], size[3]]);
    let (bits, compression) = if header_size == 12 {
        // OS/2 core header: 16-bit width and height, planes, bit count; no compression.
        let b = bytes
            .get(FILE_HEADER + 10..FILE_HEADER + 12)
            .ok_or("truncated header")?;
        (u16::from_le_bytes([b[0], b[1]]), 0)
    } else {
        let b = bytes
            .get(FILE_HEADER + 14..FILE_HEADER + 20)
            .ok_or("truncated header")?;
        (
            u16::from_le_bytes([b[0], b[1]]),
            u32::from_le_bytes([b[2], b[3], b[4], b[5]]),
        )
    };
    const BI_RGB: u32 = 0;
    const BI_BITFIELDS: u32 = 3;
    match (bits, compression) {
        (24, BI_RGB) | (16, BI_RGB) | (32, BI_RGB) => Ok(false),
        (16 | 24, BI_BITFIELDS) => Ok(false),
        (32, BI_BITFIELDS) => {
            // The masks follow the version-1 header fields; the alpha mask is only in headers
            // of 56 bytes and more. Pillow reads a non-zero alpha mask, or all four masks zero,
            // as "BGRA"-like raw modes, i.e. mode "RGBA".
            if header_size < 56 {
                return Ok(false);
            }
            let m = bytes
                .get(FILE_HEADER + 40..FILE_HEADER + 56)
                .ok_or("truncated bit fields")?;
            let all_zero = m.iter().all(|&b| b == 0);
            Ok(all_zero || m[12..16] != [0, 0, 0, 0])
        }
        _ => Ok(true),
    }
}

/// Pillow opens a TIFF as "RGB" when its first directory says RGB photometry with three
/// samples per pixel and no extra samples.
fn tiff_needs_conversion(bytes: &[u8]) -> Result<bool, &'static str> {
    let little = match bytes.get(0..2) {
        Some(b"II") => true,
        Some(b"MM") => false,
        _ => return Err("byte order"),
    };
    let u16_at = |pos: usize| -> Result<u16, &'static str> {
        let b = bytes.get(pos..pos + 2).ok_or("truncated directory")?;
        Ok(if little {
            u16::from_le_bytes([b[0], b[1]])
        } else {
            u16::from_be_bytes([b[0], b[1]])
        })
    };
    let u32_at = |pos: usize| -> Result<u32, &'static str> {
        let b = bytes.get(pos..pos + 4).ok_or("truncated directory")?;
        Ok(if little {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        } else {
            u32::from_be_bytes([b[0], b[1], b[2], b[3]])
        })
    };
    if u16_at(2)? != 42 {
        return Err("not a classic TIFF");
    }
    let ifd = usize::try_from(u32_at(4)?).map_err(|_| "directory offset")?;
    let entries = usize::from(u16_at(ifd)?);
    const PHOTOMETRIC: u16 = 262;
    const SAMPLES_PER_PIXEL: u16 = 277;
    const EXTRA_SAMPLES: u16 = 338;
    const RGB: u16 = 2;
    let (mut photometric, mut samples, mut extra) = (None, 1u16, false);
    for i in 0..entries {
        let entry = ifd + 2 + 12 * i;
        // A SHORT value sits in the first two bytes of the value field.
        match u16_at(entry)? {
            PHOTOMETRIC => photometric = Some(u16_at(entry + 8)?),
            SAMPLES_PER_PIXEL => samples = u16_at(entry + 8)?,
            EXTRA_SAMPLES => extra = true,
            _ => {}
        }
    }
    Ok(!(photometric == Some(RGB) && samples == 3 && !extra))
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
        let e = probe(b"qoif\0\0\0\0\0\0\0\0\0\0", &DecodeLimits::default()).unwrap_err();
        assert_eq!(
            e,
            PreprocessError::UnsupportedFormat {
                detected: "QOI".into()
            }
        );
    }

    #[test]
    fn paste_matches_pillow_spot_values() {
        // Values computed with Image.new("RGB", size, bg).paste(im, mask=alpha), Pillow 13.
        assert_eq!(paste_on(0, 0, 255), 255);
        assert_eq!(paste_on(0, 255, 255), 0);
        assert_eq!(paste_on(0, 128, 255), 127);
        assert_eq!(paste_on(100, 1, 255), 254);
        assert_eq!(paste_on(200, 64, 0), 50);
        assert_eq!(paste_on(7, 0, 12), 12);
    }

    #[test]
    fn transparency_is_pasted_on_white_by_default() {
        let rgba = png(
            2,
            1,
            image::ExtendedColorType::Rgba8,
            &[0, 0, 0, 128, 9, 8, 7, 255],
        );
        let (_, rgb) = decode_rgb(&rgba, &DecodeLimits::default(), AlphaMode::default()).unwrap();
        assert_eq!(rgb.pixels, vec![127, 127, 127, 9, 8, 7]);
        let (_, black) = decode_rgb(
            &rgba,
            &DecodeLimits::default(),
            AlphaMode::PasteOn([0, 0, 0]),
        )
        .unwrap();
        assert_eq!(black.pixels, vec![0, 0, 0, 9, 8, 7]);
    }

    #[test]
    fn conversion_is_read_from_headers_and_truncation_is_an_error() {
        let cases = [
            (png(1, 1, image::ExtendedColorType::Rgb8, &[1, 2, 3]), false),
            (png(1, 1, image::ExtendedColorType::Rgb16, &[0; 6]), false),
            (png(1, 1, image::ExtendedColorType::L8, &[1]), true),
            (png(1, 1, image::ExtendedColorType::La8, &[1, 2]), true),
            (
                png(1, 1, image::ExtendedColorType::Rgba8, &[1, 2, 3, 4]),
                true,
            ),
        ];
        for (bytes, expected) in &cases {
            assert_eq!(needs_rgb_conversion(bytes).unwrap(), *expected);
            // Every prefix is answered without a panic; one cut before the colour type fails.
            for end in 0..bytes.len() {
                let _ = needs_rgb_conversion(&bytes[..end]);
            }
            assert!(needs_rgb_conversion(&bytes[..20]).is_err());
        }
        let e = needs_rgb_conversion(b"plain text").unwrap_err();
        assert!(
            matches!(e, PreprocessError::UnsupportedFormat { .. }),
            "{e}"
        );
    }
}
