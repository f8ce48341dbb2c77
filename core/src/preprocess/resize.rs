//! `smart_resize` and Pillow's bicubic resampling, bit for bit; and the antialiased bicubic
//! resampling PyTorch runs on 8-bit images (what torchvision's `resize` does in transformers'
//! video processors), bit for bit.
//!
//! The resampler is a port of the algorithm in Pillow's `Resample.c` for 8-bit images:
//! Catmull-Rom cubic (`a = -0.5`) with its support widened by the downscale factor,
//! coefficients normalized in f64 and rounded to 22-bit fixed point, a horizontal pass into an
//! 8-bit intermediate followed by a vertical pass, each pass skipped when its dimension does not
//! change. Matching that order and rounding is what makes the output identical to
//! `Image.resize(size, Image.BICUBIC)`; a resampler that runs the vertical pass first or rounds
//! coefficients to 16 bits differs by one level here and there.

use super::{ImageSize, PreprocessError, RgbImage, config::CHANNELS, config::MAX_ASPECT_RATIO};

/// Hugging Face's `smart_resize`: the size an image of `height x width` is resized to so that
/// both sides are multiples of `factor` and the area lies within `[min_pixels, max_pixels]`,
/// keeping the aspect ratio as well as possible.
///
/// Arithmetic follows the Python exactly: true division in f64, `round` half to even, `floor`
/// and `ceil` of f64 quotients.
///
/// # Errors
/// [`PreprocessError::ZeroSize`], [`PreprocessError::AspectRatio`] (more than 200:1),
/// [`PreprocessError::InvalidConfig`] for a zero `factor`, [`PreprocessError::ResizeOverflow`]
/// when the result does not fit `u32`.
///
/// ```
/// use iris_core::preprocess::{smart_resize, ImageSize};
/// // Qwen2.5-VL limits: 1920x1080 becomes 1932x1092.
/// let s = smart_resize(ImageSize::new(1920, 1080), 28, 3136, 12_845_056).unwrap();
/// assert_eq!(s, ImageSize::new(1932, 1092));
/// ```
pub fn smart_resize(
    size: ImageSize,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<ImageSize, PreprocessError> {
    let ImageSize { width, height } = size;
    if width == 0 || height == 0 {
        return Err(PreprocessError::ZeroSize { width, height });
    }
    if factor == 0 {
        return Err(PreprocessError::InvalidConfig {
            field: "patch_size * merge_size",
            value: "0".into(),
            reason: "must be positive",
        });
    }
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    let ratio = h.max(w) / h.min(w);
    if ratio > MAX_ASPECT_RATIO {
        return Err(PreprocessError::AspectRatio {
            width,
            height,
            ratio,
            max_ratio: MAX_ASPECT_RATIO,
        });
    }
    let fu = u64::from(factor);
    let mut h_bar = f64_to_u64((h / f).round_ties_even()).saturating_mul(fu);
    let mut w_bar = f64_to_u64((w / f).round_ties_even()).saturating_mul(fu);
    // u64 products of u32-sized operands times `factor` cannot overflow u128.
    let area = u128::from(h_bar) * u128::from(w_bar);
    if area > u128::from(max_pixels) {
        // Python divides the exact integer product; both operands are below 2^53 here so the
        // f64 division is the same correctly rounded quotient.
        let beta = ((u64::from(height) * u64::from(width)) as f64 / max_pixels as f64).sqrt();
        h_bar = fu.max(f64_to_u64((h / beta / f).floor()).saturating_mul(fu));
        w_bar = fu.max(f64_to_u64((w / beta / f).floor()).saturating_mul(fu));
    } else if area < u128::from(min_pixels) {
        let beta = (min_pixels as f64 / (u64::from(height) * u64::from(width)) as f64).sqrt();
        h_bar = f64_to_u64((h * beta / f).ceil()).saturating_mul(fu);
        w_bar = f64_to_u64((w * beta / f).ceil()).saturating_mul(fu);
    }
    match (u32::try_from(w_bar), u32::try_from(h_bar)) {
        (Ok(width), Ok(height)) => Ok(ImageSize { width, height }),
        _ => Err(PreprocessError::ResizeOverflow {
            orig_width: width,
            orig_height: height,
            width: w_bar,
            height: h_bar,
        }),
    }
}

/// Resizes an RGB image to `to` exactly as PyTorch's antialiased bicubic interpolation of an
/// 8-bit image does (`torchvision.transforms.v2.functional.resize(..., BICUBIC,
/// antialias=True)` on a `uint8` tensor on the CPU, the resize of transformers' Qwen-VL video
/// processors): Pillow's algorithm (Keys cubic with `a = -0.5`, support widened by the
/// downscale factor, a horizontal pass into an 8-bit intermediate, then a vertical pass), with
/// the weights quantized to 16-bit integers at the largest precision that keeps the pass's
/// largest weight below 2^15 instead of Pillow's 22 bits, and every source row run through the
/// horizontal pass. The two differ by a level here and there, and by more where one side grows
/// while the other shrinks.
#[must_use]
pub fn resize_bicubic_aa_u8(src: &RgbImage, to: ImageSize) -> RgbImage {
    resample(src, to, Precision::Int16)
}

/// Resizes an RGB image to `to` exactly as Pillow's `Image.resize(to, Image.BICUBIC)` does.
/// Returns a copy when the size does not change (as Pillow does).
#[must_use]
pub fn resize_bicubic(src: &RgbImage, to: ImageSize) -> RgbImage {
    resample(src, to, Precision::Pillow)
}

/// How the filter weights are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Precision {
    /// Pillow: 22 fractional bits; the horizontal pass covers only the rows the vertical one
    /// reads.
    Pillow,
    /// PyTorch's `uint8` kernels: 16-bit weights with as many fractional bits as the largest
    /// weight allows; every row through the horizontal pass.
    Int16,
}

fn resample(src: &RgbImage, to: ImageSize, precision: Precision) -> RgbImage {
    let (sw, sh) = (src.size.width as usize, src.size.height as usize);
    let (dw, dh) = (to.width as usize, to.height as usize);
    if (sw, sh) == (dw, dh) || sw == 0 || sh == 0 || dw == 0 || dh == 0 {
        return if (sw, sh) == (dw, dh) {
            src.clone()
        } else {
            RgbImage {
                size: to,
                pixels: vec![0; dw * dh * CHANNELS],
            }
        };
    }
    let horiz = Coeffs::new(sw, dw, precision);
    let vert = Coeffs::new(sh, dh, precision);

    // Horizontal pass over only the source rows the vertical pass reads (Pillow's ybox), or
    // over every row (PyTorch, which does not crop).
    let (tmp, rows_first, tmp_h) = if dw != sw {
        let (first, last) = match precision {
            Precision::Pillow if dh != sh => (
                vert.bounds.first().map_or(0, |b| b.0),
                vert.bounds.last().map_or(sh, |b| b.0 + b.1),
            ),
            _ => (0, sh),
        };
        let rows = last - first;
        let mut tmp = vec![0u8; dw * rows * CHANNELS];
        for (y, out_row) in tmp.chunks_exact_mut(dw * CHANNELS).enumerate() {
            let in_row = &src.pixels[(y + first) * sw * CHANNELS..(y + first + 1) * sw * CHANNELS];
            for (x, out_px) in out_row.chunks_exact_mut(CHANNELS).enumerate() {
                let (start, len) = horiz.bounds[x];
                let k = &horiz.kk[x * horiz.ksize..x * horiz.ksize + len];
                let mut ss = [horiz.round_half(); CHANNELS];
                for (i, &ki) in k.iter().enumerate() {
                    let px = &in_row[(start + i) * CHANNELS..(start + i + 1) * CHANNELS];
                    for c in 0..CHANNELS {
                        ss[c] += i64::from(px[c]) * ki;
                    }
                }
                for c in 0..CHANNELS {
                    out_px[c] = clip8(ss[c], horiz.bits);
                }
            }
        }
        (std::borrow::Cow::Owned(tmp), first, rows)
    } else {
        (std::borrow::Cow::Borrowed(&src.pixels[..]), 0, sh)
    };
    debug_assert_eq!(tmp.len(), dw * tmp_h * CHANNELS);

    if dh == sh {
        return RgbImage {
            size: to,
            pixels: tmp.into_owned(),
        };
    }
    let stride = dw * CHANNELS;
    let mut out = vec![0u8; dh * stride];
    for (y, out_row) in out.chunks_exact_mut(stride).enumerate() {
        let (start, len) = vert.bounds[y];
        let start = start - rows_first;
        let k = &vert.kk[y * vert.ksize..y * vert.ksize + len];
        for (xc, out_v) in out_row.iter_mut().enumerate() {
            let mut ss = vert.round_half();
            for (i, &ki) in k.iter().enumerate() {
                ss += i64::from(tmp[(start + i) * stride + xc]) * ki;
            }
            *out_v = clip8(ss, vert.bits);
        }
    }
    RgbImage {
        size: to,
        pixels: out,
    }
}

/// Fixed-point precision of Pillow's 8-bit resampling (`PRECISION_BITS = 32 - 8 - 2`), and
/// PyTorch's ceiling for its 16-bit weights.
const PRECISION_BITS: u32 = 22;
const BICUBIC_SUPPORT: f64 = 2.0;

/// Pillow's `bicubic_filter` (Keys cubic with `a = -0.5`, i.e. Catmull-Rom).
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output pixel: the first source index and count it reads, and its fixed-point weights
/// (`ksize` slots each). Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    kk: Vec<i64>,
    /// Fractional bits of the weights.
    bits: u32,
}

impl Coeffs {
    /// The rounding offset added before the shift.
    fn round_half(&self) -> i64 {
        if self.bits == 0 {
            0
        } else {
            1 << (self.bits - 1)
        }
    }

    fn new(in_size: usize, out_size: usize, precision: Precision) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = BICUBIC_SUPPORT * filterscale;
        // Pillow: ksize = (int)ceil(support) * 2 + 1; support is small and positive.
        let ksize = f64_to_usize(support.ceil()) * 2 + 1;
        let mut bounds = Vec::with_capacity(out_size);
        let mut weights = vec![0f64; out_size * ksize];
        let mut w = vec![0f64; ksize];
        let ss = 1.0 / filterscale;
        for xx in 0..out_size {
            let center = (xx as f64 + 0.5) * scale;
            // C's (int) cast truncates toward zero; negative values clamp to 0 right after.
            let xmin = f64_to_usize((center - support + 0.5).trunc());
            let xmax = f64_to_usize((center + support + 0.5).trunc()).min(in_size);
            let len = xmax.saturating_sub(xmin).min(ksize);
            let mut ww = 0.0;
            for (x, wx) in w.iter_mut().enumerate().take(len) {
                *wx = bicubic(((x + xmin) as f64 - center + 0.5) * ss);
                ww += *wx;
            }
            for (x, wx) in w.iter().enumerate().take(len) {
                weights[xx * ksize + x] = if ww == 0.0 { *wx } else { *wx / ww };
            }
            bounds.push((xmin, len));
        }
        let bits = match precision {
            Precision::Pillow => PRECISION_BITS,
            Precision::Int16 => {
                // PyTorch: the most fractional bits for which the largest weight, doubled,
                // still rounds below 2^15.
                let max = weights.iter().copied().fold(0.0f64, f64::max);
                (0..PRECISION_BITS)
                    .find(|&bits| f64_to_i64(0.5 + max * f64::from(1u32 << (bits + 1))) >= 1 << 15)
                    .unwrap_or(PRECISION_BITS)
            }
        };
        let kk = weights
            .iter()
            .map(|&k| {
                let fixed = k * f64::from(1u32 << bits);
                // Both round half away from zero by adding +-0.5 and truncating.
                let rounded = if k < 0.0 {
                    (fixed - 0.5).trunc()
                } else {
                    (fixed + 0.5).trunc()
                };
                f64_to_i64(rounded)
            })
            .collect();
        Self {
            ksize,
            bounds,
            kk,
            bits,
        }
    }
}

fn clip8(ss: i64, bits: u32) -> u8 {
    // Pillow: lookup table indexed by `ss >> bits` (an arithmetic shift), clamped; PyTorch
    // shifts and saturates the same way.
    u8::try_from((ss >> bits).clamp(0, 255)).unwrap_or(u8::MAX)
}

/// Saturating conversions of non-negative, already rounded f64 values. Negative values and
/// NaN become 0; `as` on floats saturates, which is the intent here.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn f64_to_u64(v: f64) -> u64 {
    v as u64
}

#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn f64_to_usize(v: f64) -> usize {
    v as usize
}

#[allow(clippy::cast_possible_truncation)]
fn f64_to_i64(v: f64) -> i64 {
    v as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q25_MIN: u64 = 3136;
    const Q25_MAX: u64 = 12_845_056;
    const Q3_MIN: u64 = 65_536;
    const Q3_MAX: u64 = 16_777_216;

    fn sr(w: u32, h: u32, f: u32, min: u64, max: u64) -> (u32, u32) {
        let s = smart_resize(ImageSize::new(w, h), f, min, max).unwrap();
        (s.width, s.height)
    }

    fn tokens(w: u32, h: u32, f: u32, min: u64, max: u64) -> u64 {
        let (rw, rh) = sr(w, h, f, min, max);
        u64::from(rw / f) * u64::from(rh / f)
    }

    #[test]
    fn published_examples() {
        assert_eq!(sr(1920, 1080, 28, Q25_MIN, Q25_MAX), (1932, 1092));
        assert_eq!(tokens(1920, 1080, 28, Q25_MIN, Q25_MAX), 2691);
        assert_eq!(tokens(640, 480, 28, Q25_MIN, Q25_MAX), 391);
        assert_eq!(tokens(1920, 1080, 32, Q3_MIN, Q3_MAX), 2040);
        assert_eq!(tokens(640, 480, 32, Q3_MIN, Q3_MAX), 300);
    }

    #[test]
    fn largest_image_is_16384_tokens_for_both() {
        for (f, min, max) in [(28, Q25_MIN, Q25_MAX), (32, Q3_MIN, Q3_MAX)] {
            assert_eq!(tokens(8192, 8192, f, min, max), 16384);
            // Already at the limit: unchanged.
            assert_eq!(sr(128 * f, 128 * f, f, min, max), (128 * f, 128 * f));
        }
    }

    #[test]
    fn rounds_half_to_even() {
        // 70/28 = 2.5 -> 2 (not 3); 42/28 = 1.5 -> 2; 98/28 = 3.5 -> 4; 126/28 = 4.5 -> 4.
        assert_eq!(sr(70, 56, 28, 0, u64::MAX), (56, 56));
        assert_eq!(sr(42, 56, 28, 0, u64::MAX), (56, 56));
        assert_eq!(sr(98, 56, 28, 0, u64::MAX), (112, 56));
        assert_eq!(sr(126, 56, 28, 0, u64::MAX), (112, 56));
        // Qwen3: 80/32 = 2.5 -> 2, 48/32 = 1.5 -> 2.
        assert_eq!(sr(80, 48, 32, 0, u64::MAX), (64, 64));
    }

    #[test]
    fn min_and_max_branches() {
        // 30x20 scaled up: beta = sqrt(3136/600); ceil(20*beta/28) = 2, ceil(30*beta/28) = 3.
        assert_eq!(sr(30, 20, 28, 3136, Q25_MAX), (84, 56));
        // 150x100 with max 6144, factor 32: beta = 1.5625 exactly, floors land exactly on 2, 3.
        assert_eq!(sr(150, 100, 32, 4096, 6144), (96, 64));
        // Never below one factor per side in the max branch.
        assert_eq!(sr(5000, 30, 28, 0, 784), (336, 28));
        // f64 rounding in Python's arithmetic is reproduced, not "fixed": sqrt and the
        // divisions put 20000/beta/28 just below 128, so this lands on 127x127.
        assert_eq!(sr(20_000, 20_000, 28, Q25_MIN, Q25_MAX), (3556, 3556));
        assert_eq!(sr(20_000, 20_000, 32, Q3_MIN, Q3_MAX), (4096, 4096));
        assert_eq!(sr(4000, 3000, 28, Q25_MIN, Q25_MAX), (4004, 2996));
        assert_eq!(sr(4000, 3000, 32, Q3_MIN, Q3_MAX), (4000, 3008));
    }

    #[test]
    fn errors() {
        assert_eq!(
            smart_resize(ImageSize::new(0, 10), 28, Q25_MIN, Q25_MAX),
            Err(PreprocessError::ZeroSize {
                width: 0,
                height: 10
            })
        );
        assert!(matches!(
            smart_resize(ImageSize::new(201, 1), 28, Q25_MIN, Q25_MAX),
            Err(PreprocessError::AspectRatio {
                width: 201,
                height: 1,
                ..
            })
        ));
        // Exactly 200:1 is allowed.
        assert!(smart_resize(ImageSize::new(200, 1), 28, Q25_MIN, Q25_MAX).is_ok());
        assert!(matches!(
            smart_resize(ImageSize::new(10, 10), 0, Q25_MIN, Q25_MAX),
            Err(PreprocessError::InvalidConfig { .. })
        ));
        assert!(matches!(
            smart_resize(ImageSize::new(u32::MAX, u32::MAX), 28, u64::MAX, u64::MAX),
            Err(PreprocessError::ResizeOverflow { .. })
        ));
    }

    #[test]
    fn bicubic_same_size_is_a_copy_and_constant_stays_constant() {
        let img = RgbImage {
            size: ImageSize::new(7, 5),
            pixels: (0..7 * 5 * 3)
                .map(|i| u8::try_from(i % 251).unwrap())
                .collect(),
        };
        assert_eq!(resize_bicubic(&img, img.size), img);
        let flat = RgbImage {
            size: ImageSize::new(9, 4),
            pixels: vec![77; 9 * 4 * 3],
        };
        for to in [
            ImageSize::new(28, 28),
            ImageSize::new(3, 2),
            ImageSize::new(9, 11),
        ] {
            let out = resize_bicubic(&flat, to);
            assert_eq!(out.size, to);
            assert!(out.pixels.iter().all(|&v| v == 77), "{to:?}");
        }
    }
}
