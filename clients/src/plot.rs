//! PNG line charts for the experiments (plotters, bitmap backend; text drawn with the DejaVu
//! font from Debian's `fonts-dejavu-core`, loaded at run time).

use anyhow::{bail, Context};
use plotters::prelude::*;
use std::path::Path;

/// One chart of a figure.
pub struct Panel {
    /// The chart's title.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// Label of the y axis.
    pub y_label: String,
    /// `(name, points)` per line.
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    /// Draw the y axis on a logarithmic scale.
    pub log_y: bool,
}

const FONT_PATHS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

fn register_font() -> anyhow::Result<()> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let r = DONE.get_or_init(|| {
        let Some(bytes) = FONT_PATHS.iter().find_map(|p| std::fs::read(p).ok()) else {
            return Err(format!(
                "no DejaVu font at {FONT_PATHS:?}: install Debian's fonts-dejavu-core (scripts/install-test-deps.sh does)"
            ));
        };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| "bad font file".to_string())
    });
    match r {
        Ok(()) => Ok(()),
        Err(e) => bail!("{e}"),
    }
}

const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Draws `panels` in a grid of `cols` columns into a PNG at `path`.
pub fn draw(path: &Path, panels: &[Panel], cols: usize, title: &str) -> anyhow::Result<()> {
    register_font()?;
    let cols = cols.max(1);
    let rows = panels.len().div_ceil(cols).max(1);
    let (w, h) = (520 * cols as u32, 340 * rows as u32 + 40);
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let areas = root.split_evenly((rows, cols));
    for (p, area) in panels.iter().zip(areas.iter()) {
        draw_panel(p, area).with_context(|| format!("panel {:?}", p.title))?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn bounds(p: &Panel) -> (f64, f64, f64, f64) {
    let pts = p.series.iter().flat_map(|s| s.1.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        if !x.is_finite() || !y.is_finite() || (p.log_y && y <= 0.0) {
            continue;
        }
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return (0.0, 1.0, if p.log_y { 1.0 } else { 0.0 }, 10.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if p.log_y {
        (x0, x1, (y0 * 0.8).max(1e-3), y1 * 1.25)
    } else {
        (x0, x1, y0.min(0.0), if y1 <= 0.0 { 1.0 } else { y1 * 1.1 })
    }
}

fn draw_panel(p: &Panel, area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> anyhow::Result<()> {
    let (x0, x1, y0, y1) = bounds(p);
    let mut b = ChartBuilder::on(area);
    b.caption(&p.title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(56);
    macro_rules! finish {
        ($chart:expr) => {{
            let mut c = $chart;
            c.configure_mesh()
                .x_desc(p.x_label.as_str())
                .y_desc(p.y_label.as_str())
                .label_style(("sans-serif", 12))
                .draw()?;
            for (i, (name, pts)) in p.series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let pts: Vec<(f64, f64)> = pts
                    .iter()
                    .copied()
                    .filter(|&(x, y)| x.is_finite() && y.is_finite() && (!p.log_y || y > 0.0))
                    .collect();
                c.draw_series(LineSeries::new(pts, color.stroke_width(2)))?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            }
            if p.series.len() > 1 {
                c.configure_series_labels()
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .label_font(("sans-serif", 11))
                    .draw()?;
            }
        }};
    }
    if p.log_y {
        finish!(b.build_cartesian_2d(x0..x1, (y0..y1).log_scale())?);
    } else {
        finish!(b.build_cartesian_2d(x0..x1, y0..y1)?);
    }
    Ok(())
}

/// Draws horizontal bars (`label`, value) into a PNG at `path`, with a vertical line at
/// `mark` (1.0 for ratios: a bar past it is better than the reference).
pub fn bars(path: &Path, title: &str, x_label: &str, rows: &[(String, f64)], mark: f64) -> anyhow::Result<()> {
    register_font()?;
    let h = 80 + 28 * rows.len().max(1) as u32;
    let root = BitMapBackend::new(path, (900, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let finite = rows.iter().map(|r| r.1).filter(|v| v.is_finite());
    let x1 = finite.fold(mark, f64::max) * 1.15;
    let n = rows.len().max(1);
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(330)
        .build_cartesian_2d(0.0..x1, (0..n).into_segmented())?;
    c.configure_mesh()
        .x_desc(x_label)
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => rows.get(*i).map(|r| r.0.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 12))
        .disable_y_mesh()
        .draw()?;
    c.draw_series(rows.iter().enumerate().filter(|(_, r)| r.1.is_finite()).map(|(i, r)| {
        let color = if r.1 >= mark { COLORS[2] } else { COLORS[3] };
        Rectangle::new(
            [(0.0, SegmentValue::Exact(i)), (r.1, SegmentValue::Exact(i + 1))],
            color.mix(0.8).filled(),
        )
    }))?;
    c.draw_series(std::iter::once(PathElement::new(
        vec![(mark, SegmentValue::Exact(0)), (mark, SegmentValue::Exact(n))],
        BLACK.stroke_width(2),
    )))?;
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
