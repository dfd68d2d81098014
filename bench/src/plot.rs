//! The cancel-latency figure: per model, a histogram of store → return times and the
//! same times against where in the decode the cancel landed (a cancel that lands in a
//! long node waits for the rest of that node: the scatter shows whether any do).

use std::path::Path;

use anyhow::Context as _;
use plotters::prelude::*;

use crate::native::CancelSample;
use crate::stats::Samples;

/// One model's cancels.
pub struct Series<'a> {
    pub title: String,
    pub samples: &'a [CancelSample],
    /// The uncancelled decode's median, to place each cancel in the decode.
    pub decode_secs: f64,
}

/// Draw the figure into `path`. Returns whether text could be drawn: labels need a
/// TrueType font on the machine (DejaVu Sans); without one the figure has no text.
pub fn cancel_latency_png(path: &Path, series: &[Series]) -> anyhow::Result<bool> {
    let text = register_font();
    let (width, height) = (1200, 400 * series.len().max(1) as u32);
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let cells = root.split_evenly((series.len().max(1), 2));
        for (s, pair) in series.iter().zip(cells.chunks(2)) {
            histogram(&pair[0], s, text)?;
            scatter(&pair[1], s, text)?;
        }
        root.present()?;
    }
    write_png(path, width, height, &rgb)?;
    Ok(text)
}

fn write_png(path: &Path, width: u32, height: u32, rgb: &[u8]) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn latencies_ms(s: &Series) -> Vec<f64> {
    s.samples.iter().map(|c| c.latency.as_secs_f64() * 1e3).collect()
}

fn histogram(area: &Area, s: &Series, text: bool) -> anyhow::Result<()> {
    const BINS: usize = 20;
    let ms = latencies_ms(s);
    let mut stats = Samples::default();
    ms.iter().for_each(|&v| stats.push_secs(v));
    let x_max = stats.max().max(1e-3) * 1.05;
    let width = x_max / BINS as f64;
    let mut counts = [0u32; BINS];
    for v in &ms {
        counts[((v / width) as usize).min(BINS - 1)] += 1;
    }
    let y_max = counts.iter().copied().max().unwrap_or(1) as f64 + 1.0;
    let title = format!("{}: store → return, {} cancels", s.title, ms.len());
    let mut chart = chart(area, &title, text, 0.0..x_max, 0.0..y_max)?;
    mesh(&mut chart, text, "store → return (ms)", "decodes", Some(y_max as usize + 1))?;
    chart.draw_series(counts.iter().enumerate().map(|(i, &c)| {
        let x0 = i as f64 * width;
        Rectangle::new([(x0, 0.0), (x0 + width, c as f64)], BLUE.mix(0.6).filled())
    }))?;
    for (q, name, color) in [(0.5, "median", RED), (0.9, "p90", MAGENTA)] {
        let x = stats.quantile(q);
        let line =
            chart.draw_series(LineSeries::new([(x, 0.0), (x, y_max)], color.stroke_width(2)))?;
        if text {
            line.label(format!("{name} {x:.2} ms")).legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
    }
    if text {
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
    }
    Ok(())
}

fn scatter(area: &Area, s: &Series, text: bool) -> anyhow::Result<()> {
    let ms = latencies_ms(s);
    let y_max = ms.iter().copied().fold(1e-3, f64::max) * 1.1;
    let title = format!("{}: latency vs. cancel point", s.title);
    let mut chart = chart(area, &title, text, 0.0..1.0, 0.0..y_max)?;
    mesh(
        &mut chart,
        text,
        "cancel point (fraction of an uncancelled decode)",
        "store → return (ms)",
        None,
    )?;
    let points = s.samples.iter().zip(&ms).map(|(c, &y)| (c.at.as_secs_f64() / s.decode_secs, y));
    chart.draw_series(points.map(|p| Circle::new(p, 4, BLUE.filled())))?;
    Ok(())
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// A cartesian chart; with no font, no caption and no room for labels.
fn chart<'a, 'b>(
    area: &'a Area<'b>,
    title: &str,
    text: bool,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
) -> anyhow::Result<Chart<'a, 'b>> {
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder.caption(title, ("sans-serif", 18)).x_label_area_size(40).y_label_area_size(55);
    }
    Ok(builder.build_cartesian_2d(x, y)?)
}

/// Axes and grid; `y_counts`: the y axis counts things, label whole numbers up to it.
fn mesh(
    chart: &mut Chart,
    text: bool,
    x_desc: &str,
    y_desc: &str,
    y_counts: Option<usize>,
) -> anyhow::Result<()> {
    let mut mesh = chart.configure_mesh();
    let whole = |v: &f64| format!("{v:.0}");
    if text {
        mesh.x_desc(x_desc).y_desc(y_desc).label_style(("sans-serif", 14));
        if let Some(n) = y_counts {
            mesh.y_labels(n.min(12)).y_label_formatter(&whole);
        }
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    Ok(())
}

/// Register DejaVu Sans as plotters' "sans-serif" if the machine has it.
fn register_font() -> bool {
    const CANDIDATES: [&str; 3] = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    ];
    CANDIDATES.iter().filter_map(|p| std::fs::read(p).ok()).any(|bytes| {
        // plotters keeps fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    })
}
