//! The evaluation's pictures (PNG, drawn with plotters): checkpoint bytes
//! and end-to-end time per policy, the class mix, the holds, a timeline
//! per sandbox of crab's run, and the density study's end-to-end lines.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context};
use plotters::prelude::*;

use super::density;
use super::driver::EventKind;
use super::policy::Policy;
use super::report::{summarize, PolicyResult};

/// The font every label is drawn in (Debian's fonts-dejavu-core).
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

type Result<T> = anyhow::Result<T>;

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing: {e:?}")
}

/// Draws every picture into `dir`; answers their file names.
pub fn draw(results: &[PolicyResult], dir: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(FONT).with_context(|| format!("read {FONT} (install fonts-dejavu-core)"))?;
    let _ = plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    );
    let mut names = Vec::new();
    let fault_free = results.iter().find(|p| p.policy == Policy::FaultFree);
    if let Some((reference, times)) = fault_free.zip(super::report::time_reference(results)) {
        let rows: Vec<(String, f64, f64)> = results
            .iter()
            .map(|p| {
                (
                    p.policy.name().to_owned(),
                    p.bytes as f64 / 1e6,
                    summarize(p, reference, times).e2e,
                )
            })
            .collect();
        bars(
            &dir.join("bytes.png"),
            "checkpoint MB written",
            &rows.iter().map(|(n, b, _)| (n.clone(), *b)).collect::<Vec<_>>(),
        )?;
        bars(
            &dir.join("e2e.png"),
            &format!("task time / {}", times.policy.name()),
            &rows
                .iter()
                .map(|(n, _, e)| (n.clone(), if e.is_finite() { *e } else { 0.0 }))
                .collect::<Vec<_>>(),
        )?;
        names.extend(["bytes.png".to_owned(), "e2e.png".to_owned()]);
    }
    let mix: Vec<(String, f64)> = results
        .iter()
        .filter(|p| p.policy.checkpoints())
        .flat_map(|p| {
            ["none", "fs", "proc", "full"]
                .iter()
                .zip(p.classes)
                .map(move |(c, n)| (format!("{} {c}", p.policy.name()), n as f64))
        })
        .collect();
    if !mix.is_empty() {
        bars(&dir.join("classes.png"), "versions by class", &mix)?;
        names.push("classes.png".into());
    }
    holds(&dir.join("holds.png"), results)?;
    names.push("holds.png".into());
    if let Some(crab) = results.iter().find(|p| p.policy == Policy::Crab) {
        timeline(&dir.join("timeline.png"), crab)?;
        names.push("timeline.png".into());
    }
    Ok(names)
}

/// One bar per row.
fn bars(path: &Path, title: &str, rows: &[(String, f64)]) -> Result<()> {
    let root = BitMapBackend::new(path, (160 + 110 * rows.len() as u32, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let top = rows.iter().map(|r| r.1).fold(0.0, f64::max).max(1e-9) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d((0..rows.len()).into_segmented(), 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len())
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                rows.get(*i).map_or(String::new(), |r| r.0.clone())
            }
            SegmentValue::Last => String::new(),
        })
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(
            Histogram::vertical(&chart)
                .style(RGBColor(0x2b, 0x6c, 0xb0).filled())
                .margin(14)
                .data(rows.iter().enumerate().map(|(i, r)| (i, r.1))),
        )
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// The distribution of holds per policy that makes versions (a CDF).
fn holds(path: &Path, results: &[PolicyResult]) -> Result<()> {
    let series: Vec<(&str, Vec<(f64, f64)>)> = results
        .iter()
        .filter(|p| p.policy.checkpoints())
        .map(|p| {
            let mut ms: Vec<f64> = p
                .tasks
                .iter()
                .flat_map(|t| t.holds.iter().map(|h| h.as_secs_f64() * 1e3))
                .collect();
            ms.sort_by(f64::total_cmp);
            let n = ms.len().max(1) as f64;
            let cdf = ms
                .iter()
                .enumerate()
                .map(|(k, v)| (*v, (k + 1) as f64 / n))
                .collect();
            (p.policy.name(), cdf)
        })
        .collect();
    let top = series
        .iter()
        .flat_map(|s| s.1.last())
        .map(|p| p.0)
        .fold(1.0, f64::max);
    let axes = Axes {
        title: "answer held for its version (CDF)",
        x: ("ms", 0.0..top),
        y: ("share of turns", 0.0..1.0),
    };
    lines(path, &axes, &series, false)
}

/// The density study's end-to-end figure per policy over the number of
/// sandboxes (`density.png`); none without two densities. Call after
/// [`draw`] (which registers the font).
pub fn density(rows: &[density::Row], dir: &Path) -> Result<Option<String>> {
    let series: Vec<(&str, Vec<(f64, f64)>)> = density::policies_in(rows)
        .into_iter()
        .filter(|p| *p != Policy::Bare)
        .map(|p| {
            let points = density::series(rows, p, |r| r.e2e);
            (
                p.name(),
                points.into_iter().filter(|(_, y)| y.is_finite()).collect(),
            )
        })
        .filter(|(_, points): &(&str, Vec<(f64, f64)>)| points.len() >= 2)
        .collect();
    if series.is_empty() {
        return Ok(None);
    }
    let all = series.iter().flat_map(|s| s.1.iter());
    let right = all.clone().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let top = all.clone().map(|p| p.1).fold(1.1, f64::max) * 1.02;
    let bottom = all.map(|p| p.1).fold(0.95, f64::min) * 0.98;
    let name = "density.png";
    let axes = Axes {
        title: "task time / bare at the same density",
        x: ("sandboxes at once", 0.0..right),
        y: ("e2e", bottom..top),
    };
    lines(&dir.join(name), &axes, &series, true)?;
    Ok(Some(name.to_owned()))
}

/// A line chart's title, and each axis's name and range.
struct Axes<'a> {
    title: &'a str,
    x: (&'a str, std::ops::Range<f64>),
    y: (&'a str, std::ops::Range<f64>),
}

/// One line per named series (with a dot at each point if `dots`), and a
/// legend.
fn lines(path: &Path, axes: &Axes, series: &[(&str, Vec<(f64, f64)>)], dots: bool) -> Result<()> {
    let root = BitMapBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(axes.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(axes.x.1.clone(), axes.y.1.clone())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(axes.x.0)
        .y_desc(axes.y.0)
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        if dots {
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))
                .map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// One row per sandbox: its commands, its turns (coloured by the class of
/// their version), the crash and the recovery.
fn timeline(path: &Path, p: &PolicyResult) -> Result<()> {
    let n = p.tasks.len().max(1);
    let root = BitMapBackend::new(path, (1100, 120 + 36 * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let end = p
        .tasks
        .iter()
        .map(|t| t.run.time.max(Duration::from_secs(1)).as_secs_f64())
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{}: each sandbox's turns (grey: command; green none, blue fs, orange proc/full; red: crash to running)", p.policy.name()), ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(190)
        .build_cartesian_2d(0.0..end, (0..n).into_segmented())
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                p.tasks.get(*i).map_or(String::new(), |t| t.task.clone())
            }
            SegmentValue::Last => String::new(),
        })
        .x_desc("seconds")
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(err)?;
    for (row, t) in p.tasks.iter().enumerate() {
        let rects = t.run.events.iter().map(|e| {
            let color = match e.kind {
                EventKind::Command(_) => RGBColor(0x99, 0x99, 0x99),
                EventKind::Turn(step) => match t.classes.get(step).and_then(|c| c.as_deref()) {
                    Some("none") => RGBColor(0x4c, 0xaf, 0x50),
                    Some("fs") => RGBColor(0x21, 0x96, 0xf3),
                    Some(_) => RGBColor(0xff, 0x98, 0x00),
                    None => RGBColor(0xcc, 0xcc, 0xcc),
                },
                EventKind::Recovery => RGBColor(0xe5, 0x39, 0x35),
            };
            Rectangle::new(
                [
                    (e.start, SegmentValue::Exact(row)),
                    (e.end.max(e.start + end / 800.0), SegmentValue::Exact(row + 1)),
                ],
                color.filled(),
            )
        });
        chart.draw_series(rects).map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
