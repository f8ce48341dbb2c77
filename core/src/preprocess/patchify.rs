//! Rescale, normalize and cut into patches in the processor's merge-window order.

use super::{ImageSize, PreprocessError, ProcessorConfig, RgbImage, config::CHANNELS};

/// Turns a resized RGB image (both sides multiples of `patch_size * merge_size`) into
/// `pixel_values` rows and the grid `[t, h / patch, w / patch]`.
///
/// Values are `((v as f64 * rescale_factor) as f32 - mean) / std`, the same f64 rescale and
/// f32 normalize Hugging Face's numpy code does. Rows are ordered by merge window (window row,
/// window column, then the `merge x merge` patches inside it, row-major); each row holds
/// `C x temporal x patch x patch` values, the single frame repeated `temporal_patch_size` times.
///
/// # Errors
/// [`PreprocessError::InvalidConfig`] when the image sides are not multiples of the factor.
pub fn patchify(
    img: &RgbImage,
    config: &ProcessorConfig,
) -> Result<(Vec<f32>, [u32; 3]), PreprocessError> {
    let ImageSize { width, height } = img.size;
    let factor = config.factor();
    if factor == 0 || width % factor != 0 || height % factor != 0 {
        return Err(PreprocessError::InvalidConfig {
            field: "patch_size * merge_size",
            value: format!("{factor} (image {width}x{height})"),
            reason: "resized sides must be multiples of it",
        });
    }
    let lut = normalize_lut(config);
    let p = config.patch_size as usize;
    let m = config.merge_size as usize;
    let t = config.temporal_patch_size as usize;
    let w = width as usize;
    let (gh, gw) = (height as usize / p, w / p);
    let plane = p * p;
    let row_len = config.patch_dim();
    let mut out = vec![0f32; gh * gw * row_len];
    let windows_w = gw / m;
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let index = ((bh * windows_w + bw) * m + mh) * m + mw;
                    let row = &mut out[index * row_len..(index + 1) * row_len];
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    // One pass over the source pixels fills the first frame of every channel.
                    for py in 0..p {
                        let start = ((y0 + py) * w + x0) * CHANNELS;
                        let src = &img.pixels[start..start + p * CHANNELS];
                        for (px, rgb) in src.chunks_exact(CHANNELS).enumerate() {
                            for (c, &v) in rgb.iter().enumerate() {
                                row[c * t * plane + py * p + px] = lut[c][usize::from(v)];
                            }
                        }
                    }
                    for c in 0..CHANNELS {
                        let (head, rest) =
                            row[c * t * plane..(c + 1) * t * plane].split_at_mut(plane);
                        for frame in rest.chunks_exact_mut(plane) {
                            frame.copy_from_slice(head);
                        }
                    }
                }
            }
        }
    }
    let grid = [1, height / config.patch_size, width / config.patch_size];
    Ok((out, grid))
}

/// Normalized value of every 8-bit level, per channel.
fn normalize_lut(config: &ProcessorConfig) -> [[f32; 256]; CHANNELS] {
    let mut lut = [[0f32; 256]; CHANNELS];
    for (c, table) in lut.iter_mut().enumerate() {
        for (v, slot) in table.iter_mut().enumerate() {
            // numpy: image.astype(float64) * scale, then astype(float32).
            #[allow(clippy::cast_possible_truncation)]
            let rescaled = (v as f64 * config.rescale_factor) as f32;
            *slot = (rescaled - config.image_mean[c]) / config.image_std[c];
        }
    }
    lut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_merge_window_order() {
        // A 4x2-patch image with patch 1, merge 2: each pixel's red value is its index.
        let config = ProcessorConfig {
            patch_size: 1,
            merge_size: 2,
            temporal_patch_size: 2,
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
            rescale_factor: 1.0,
            ..ProcessorConfig::qwen2_vl()
        };
        let (w, h) = (4u8, 2u8);
        let pixels = (0..w * h).flat_map(|i| [i, 100 + i, 200]).collect();
        let img = RgbImage {
            size: ImageSize::new(4, 2),
            pixels,
        };
        let (pv, grid) = patchify(&img, &config).unwrap();
        assert_eq!(grid, [1, 2, 4]);
        let reds: Vec<f32> = pv.chunks(6).map(|r| r[0]).collect();
        // Window (0,0): pixels 0,1,4,5; window (0,1): 2,3,6,7.
        assert_eq!(reds, [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]);
        // Row layout: C x T x 1 x 1, the frame repeated.
        assert_eq!(&pv[6..12], &[1.0, 1.0, 101.0, 101.0, 200.0, 200.0]);
    }

    #[test]
    fn rejects_sides_off_the_factor() {
        let img = RgbImage {
            size: ImageSize::new(30, 28),
            pixels: vec![0; 30 * 28 * 3],
        };
        assert!(matches!(
            patchify(&img, &ProcessorConfig::qwen2_vl()),
            Err(PreprocessError::InvalidConfig { .. })
        ));
    }
}
