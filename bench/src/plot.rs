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

/// An 8-bit RGB PNG: the signature, then IHDR, one IDAT (the rows, each with filter
/// byte 0, as one zlib stream) and IEND, each chunk with its CRC-32. Written here rather
/// than by the `png` crate, whose dependencies turn on crc32fast's default features: in
/// `make test`, which builds this crate beside the host, the object crate under wasmtime
/// would then be another build than `make build`'s, and wasmtime with it.
fn write_png(path: &Path, width: u32, height: u32, rgb: &[u8]) -> anyhow::Result<()> {
    let row = width as usize * 3;
    let mut rows = Vec::with_capacity((row + 1) * height as usize);
    for line in rgb.chunks(row) {
        rows.push(0);
        rows.extend_from_slice(line);
    }
    let mut header = [0u8; 13];
    header[..4].copy_from_slice(&width.to_be_bytes());
    header[4..8].copy_from_slice(&height.to_be_bytes());
    header[8..10].copy_from_slice(&[8, 2]); // bit depth 8, colour type 2 (RGB)
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let image = miniz_oxide::deflate::compress_to_vec_zlib(&rows, 9);
    for (kind, data) in [(b"IHDR", &header[..]), (b"IDAT", &image[..]), (b"IEND", &[][..])] {
        png.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = png.len();
        png.extend_from_slice(kind);
        png.extend_from_slice(data);
        let crc = crc32fast::hash(&png[start..]);
        png.extend_from_slice(&crc.to_be_bytes());
    }
    std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_png_is_its_chunks_with_their_crcs_around_the_rows() {
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926, "the CRC-32 check value");
        let rgb: Vec<u8> = (0..18u8).map(|i| i * 13).collect(); // 3 × 2 pixels
        let path = std::env::temp_dir().join(format!("llamabox-bench-{}.png", std::process::id()));
        write_png(&path, 3, 2, &rgb).unwrap();
        let png = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let (mut at, mut kinds, mut image) = (8, Vec::new(), Vec::new());
        while at < png.len() {
            let len = u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
            let (chunk, crc) = (&png[at + 4..at + 8 + len], &png[at + 8 + len..at + 12 + len]);
            assert_eq!(crc32fast::hash(chunk).to_be_bytes(), crc);
            let (kind, data) = chunk.split_at(4);
            match kind {
                b"IHDR" => assert_eq!(data, [0, 0, 0, 3, 0, 0, 0, 2, 8, 2, 0, 0, 0]),
                b"IDAT" => image.extend_from_slice(data),
                _ => {}
            }
            kinds.push(String::from_utf8(kind.to_vec()).unwrap());
            at += 12 + len;
        }
        assert_eq!(kinds, ["IHDR", "IDAT", "IEND"]);
        let rows = miniz_oxide::inflate::decompress_to_vec_zlib(&image).unwrap();
        assert_eq!(rows, [&[0][..], &rgb[..9], &[0], &rgb[9..]].concat(), "filter 0, then the row");
    }
}
