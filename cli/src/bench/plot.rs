//! `--plot FILE.svg|png`: the memory timeline of a bench run.
//!
//! Four series over time (device used, allocator reserved, allocator allocated, encoder cache
//! bytes, in MiB) with the four checkpoints marked by vertical lines, a title, axis labels with
//! tick values, a legend and the checkpoint names. SVG output carries the text as `<text>`
//! elements; PNG output rasterises it with DejaVu Sans, embedded in the binary
//! (`cli/assets/fonts`, with its licence), so that a bitmap reads the same on a machine without
//! fonts.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::report::TimedPoint;

/// Plot size in pixels.
pub const PLOT_SIZE: (u32, u32) = (1000, 600);
const MIB: f64 = 1024.0 * 1024.0;

/// DejaVu Sans 2.37 (Bitstream Vera licence, `cli/assets/fonts/LICENSE-DejaVu.txt`): plotters
/// measures and draws every text with the font registered under the family a style names.
const FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
/// The family every text of the plot uses.
const FAMILY: &str = "sans-serif";

/// Why the plot could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// The file name does not end in `.svg` or `.png`.
    #[error("plot file {path}: the file name must end in .svg or .png")]
    UnknownFormat {
        /// The path given.
        path: String,
    },
    /// There is nothing to draw.
    #[error("the memory timeline is empty")]
    Empty,
    /// plotters failed to draw.
    #[error("drawing the plot: {0}")]
    Draw(String),
    /// Writing the file failed.
    #[error("writing plot file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// PNG encoding failed.
    #[error("encoding the PNG: {0}")]
    Png(#[from] image::ImageError),
    /// The embedded font could not be parsed.
    #[error("the plot's embedded font (DejaVu Sans) is not a usable TrueType font")]
    Font,
}

/// Draws `timeline` with `checkpoints` (`(name, seconds)`) to `path`, as SVG or PNG by extension.
///
/// # Errors
/// [`PlotError`] for an unknown extension, an empty timeline, or a drawing or I/O failure.
pub fn write_plot(
    path: &Path,
    timeline: &[TimedPoint],
    checkpoints: &[(&str, f64)],
) -> Result<(), PlotError> {
    let format = plot_format(path)?;
    if timeline.is_empty() {
        return Err(PlotError::Empty);
    }
    let io = |source| PlotError::Io {
        path: path.display().to_string(),
        source,
    };
    match format {
        PlotFormat::Svg => {
            let mut svg = String::new();
            {
                register_font()?;
                let root = SVGBackend::with_string(&mut svg, PLOT_SIZE).into_drawing_area();
                draw(&root, timeline, checkpoints, true)?;
                root.present().map_err(|e| PlotError::Draw(e.to_string()))?;
            }
            std::fs::write(path, svg).map_err(io)
        }
        PlotFormat::Png => {
            let rgb = render_rgb(timeline, checkpoints, true)?;
            let (w, h) = PLOT_SIZE;
            let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
            image::ImageEncoder::write_image(
                image::codecs::png::PngEncoder::new(&mut file),
                &rgb,
                w,
                h,
                image::ExtendedColorType::Rgb8,
            )?;
            std::io::Write::flush(&mut file).map_err(io)
        }
    }
}

/// The formats a plot is written in, by the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFormat {
    /// `.svg`.
    Svg,
    /// `.png`.
    Png,
}

/// The format `path` names by its extension (either case).
///
/// # Errors
/// [`PlotError::UnknownFormat`] for any other extension, or none.
pub fn plot_format(path: &Path) -> Result<PlotFormat, PlotError> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("svg") => Ok(PlotFormat::Svg),
        Some("png") => Ok(PlotFormat::Png),
        _ => Err(PlotError::UnknownFormat {
            path: path.display().to_string(),
        }),
    }
}

/// The plot as RGB pixels, row by row, [`PLOT_SIZE`]; `with_text` false draws every text in
/// the background colour (the tests compare both to find the text's pixels).
fn render_rgb(
    timeline: &[TimedPoint],
    checkpoints: &[(&str, f64)],
    with_text: bool,
) -> Result<Vec<u8>, PlotError> {
    register_font()?;
    let (w, h) = PLOT_SIZE;
    let mut rgb = vec![0u8; usize::try_from(u64::from(w) * u64::from(h) * 3).unwrap_or(0)];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, PLOT_SIZE).into_drawing_area();
        draw(&root, timeline, checkpoints, with_text)?;
        root.present().map_err(|e| PlotError::Draw(e.to_string()))?;
    }
    Ok(rgb)
}

/// Registers [`FONT`] under [`FAMILY`] once per process.
fn register_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok { Ok(()) } else { Err(PlotError::Font) }
}

type Series = (&'static str, RGBColor, fn(&TimedPoint) -> u64);

const SERIES: [Series; 4] = [
    ("device used", RGBColor(31, 119, 180), |p| {
        p.point.device_used_bytes
    }),
    ("allocator reserved", RGBColor(255, 127, 14), |p| {
        p.point.allocator_reserved_bytes
    }),
    ("allocator allocated", RGBColor(44, 160, 44), |p| {
        p.point.allocator_allocated_bytes
    }),
    ("encoder cache", RGBColor(214, 39, 40), |p| {
        p.point.encoder_cache_bytes
    }),
];

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    timeline: &[TimedPoint],
    checkpoints: &[(&str, f64)],
    with_text: bool,
) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError::Draw(e.to_string());
    // Without text, every text is drawn in the background colour: the layout stays the same,
    // so the two renderings differ only where text is.
    let ink = if with_text { BLACK } else { WHITE };
    let font = |size: u32| (FAMILY, size).into_font().color(&ink);
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let times = timeline
        .iter()
        .map(|p| p.t_s)
        .chain(checkpoints.iter().map(|c| c.1));
    let (t0, t1) = times.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), t| {
        (lo.min(t), hi.max(t))
    });
    let span = (t1 - t0).max(1e-3);
    let (x0, x1) = (t0 - span * 0.02, t1 + span * 0.02);
    let y_max = timeline
        .iter()
        .flat_map(|p| SERIES.iter().map(move |s| s.2(p)))
        .max()
        .unwrap_or(0) as f64
        / MIB;
    // Headroom above the highest line for the checkpoint labels and the legend.
    let y1 = (y_max * 1.35).max(1.0);

    let mut chart = ChartBuilder::on(root)
        .margin(20)
        .caption("iris bench: device memory over time", font(22))
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, 0.0..y1)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the load started")
        .y_desc("MiB")
        .label_style(font(13))
        .axis_desc_style(font(14))
        .draw()
        .map_err(|e| err(&e))?;
    let mid = (x0 + x1) / 2.0;
    for (i, (name, t)) in checkpoints.iter().enumerate() {
        let line = PathElement::new(
            vec![(*t, 0.0), (*t, y1)],
            RGBColor(128, 128, 128).stroke_width(1),
        );
        chart
            .draw_series(std::iter::once(line))
            .map_err(|e| err(&e))?;
        // Checkpoints often share a time (both start-up ones sit at 0): stagger the labels
        // downwards, and anchor them inwards so that none runs off the plot.
        let y = y1 * (0.98 - 0.05 * i as f64);
        let hpos = if *t > mid { HPos::Right } else { HPos::Left };
        let style = font(13).pos(Pos::new(hpos, VPos::Top));
        let label = Text::new(format!(" {name} "), (*t, y), style);
        chart
            .draw_series(std::iter::once(label))
            .map_err(|e| err(&e))?;
    }
    for (name, color, field) in SERIES {
        let points = timeline.iter().map(|p| (p.t_s, field(p) as f64 / MIB));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        let markers = timeline
            .iter()
            .filter(|p| checkpoints.iter().any(|c| c.1 == p.t_s))
            .map(|p| Circle::new((p.t_s, field(p) as f64 / MIB), 4, color.filled()));
        chart.draw_series(markers).map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperMiddle)
        .label_font(font(13))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::MemoryPoint;

    fn timeline() -> Vec<TimedPoint> {
        (0..20)
            .map(|i| {
                let mib = 1u64 << 20;
                let load = if (3..15).contains(&i) {
                    u64::try_from(i).unwrap() * mib
                } else {
                    0
                };
                TimedPoint {
                    t_s: f64::from(i) * 0.5 - 1.0,
                    point: MemoryPoint {
                        device_used_bytes: 60 * mib + load,
                        allocator_reserved_bytes: 50 * mib + load,
                        allocator_allocated_bytes: 40 * mib + load / 2,
                        encoder_cache_bytes: load / 2,
                        plugin_held_bytes: 0,
                    },
                }
            })
            .collect()
    }

    const CHECKPOINTS: [(&str, f64); 4] = [
        ("before start", -1.0),
        ("after start", -0.5),
        ("after load", 7.0),
        ("after reset", 8.5),
    ];

    #[test]
    fn svg_has_series_labels_and_checkpoints() {
        let path = std::env::temp_dir().join(format!("iris-plot-{}.svg", std::process::id()));
        write_plot(&path, &timeline(), &CHECKPOINTS).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
        for text in [
            "device used",
            "allocator reserved",
            "allocator allocated",
            "encoder cache",
            "after reset",
            "MiB",
        ] {
            assert!(svg.contains(text), "missing {text:?}");
        }
        assert!(svg.matches("<polyline").count() >= 4);
    }

    #[test]
    fn png_holds_the_title_labels_and_legend() {
        let path = std::env::temp_dir().join(format!("iris-plot-{}.png", std::process::id()));
        write_plot(&path, &timeline(), &CHECKPOINTS).unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(img.dimensions(), PLOT_SIZE);
        let with = render_rgb(&timeline(), &CHECKPOINTS, true).unwrap();
        assert_eq!(img.as_raw(), &with, "the file is the plot with its text");
        // The device-used series colour must appear: the lines were drawn.
        assert!(img.pixels().any(|p| p.0 == [31, 119, 180]));

        // The text's pixels: grey (black text antialiased on white) with the text, not
        // without it. Each place that holds text must have a good number of them.
        let without = render_rgb(&timeline(), &CHECKPOINTS, false).unwrap();
        let (w, h) = (PLOT_SIZE.0 as usize, PLOT_SIZE.1 as usize);
        let grey =
            |rgb: &[u8], i: usize| rgb[i] < 160 && rgb[i] == rgb[i + 1] && rgb[i + 1] == rgb[i + 2];
        let text_pixels = |xs: std::ops::Range<usize>, ys: std::ops::Range<usize>| {
            ys.flat_map(|y| xs.clone().map(move |x| (y * w + x) * 3))
                .filter(|&i| grey(&with, i) && !grey(&without, i))
                .count()
        };
        let places = [
            ("title", 0..w, 0..40),
            ("y axis label and tick values", 0..95, 50..h - 60),
            ("x axis label and tick values", 95..w, h - 60..h),
            ("legend and checkpoint names", 95..w, 50..200),
        ];
        for (name, xs, ys) in places {
            let n = text_pixels(xs, ys);
            assert!(n >= 150, "{name}: {n} text pixels");
        }
        let first_ink = (0..w * 40 * 3)
            .step_by(3)
            .find(|&i| without[i..i + 3] != [255; 3]);
        assert_eq!(
            first_ink.map(|i| (i / 3 % w, i / 3 / w)),
            None,
            "without text the title band is blank"
        );
    }

    #[test]
    fn bad_requests_are_errors() {
        let path = Path::new("plot.gif");
        assert!(matches!(
            write_plot(path, &timeline(), &[]),
            Err(PlotError::UnknownFormat { .. })
        ));
        assert!(matches!(
            write_plot(Path::new("a.svg"), &[], &[]),
            Err(PlotError::Empty)
        ));
    }
}
