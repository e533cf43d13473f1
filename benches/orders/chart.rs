//! The chart, drawn with `plotters` as SVG: one panel per durability mode, requests/s by
//! concurrency (both log scales), one line per case; the ceiling E as a dashed level.

use std::path::Path as FsPath;

use plotters::prelude::*;

use crate::cases::Row;
use crate::cli::{Case, Mode, Options};
use crate::report::find;
use crate::BoxError;

/// The size of one panel, in pixels.
const PANEL: (u32, u32) = (520, 460);

/// Each case's colour, the same in every panel.
fn color(case: Case) -> RGBColor {
    match case {
        Case::A => RGBColor(0x1f, 0x77, 0xb4),
        Case::B => RGBColor(0xff, 0x7f, 0x0e),
        Case::C => RGBColor(0x2c, 0xa0, 0x2c),
        Case::D => RGBColor(0xd6, 0x27, 0x28),
        Case::H => RGBColor(0x8c, 0x56, 0x4b),
        Case::R => RGBColor(0x94, 0x67, 0xbd),
        Case::ReservationA => RGBColor(0x7f, 0x7f, 0x7f),
        Case::SqlxA => RGBColor(0x17, 0xbe, 0xcf),
        Case::SqlxH => RGBColor(0xbc, 0xbd, 0x22),
        Case::SqlxSqliteA => RGBColor(0xe3, 0x77, 0xc2),
        Case::SqlxSqliteH => RGBColor(0x39, 0x3b, 0x79),
        Case::E => RGBColor(0x55, 0x55, 0x55),
    }
}

/// Writes the chart of `rows` to `path`.
pub(crate) fn write_throughput_svg(
    path: &FsPath,
    rows: &[Row],
    options: &Options,
) -> Result<(), BoxError> {
    let mut modes: Vec<Mode> = rows.iter().map(|row| row.mode).collect();
    modes.dedup();
    let panels = u32::try_from(modes.len().max(1))?;
    let root = SVGBackend::new(path, (PANEL.0 * panels, PANEL.1 + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!(
            "tower-idempotency: requests/s by concurrency (median of {} rounds, log scales)",
            options.rounds
        ),
        ("sans-serif", 16),
    )?;

    // One y range for every panel, whole decades, so that the panels compare at a glance.
    let values: Vec<f64> = rows.iter().map(Row::median).filter(|v| *v > 0.0).collect();
    let lo = values.iter().copied().fold(f64::MAX, f64::min).max(1.0);
    let hi = values.iter().copied().fold(1.0, f64::max);
    let y_range = 10f64.powf(lo.log10().floor())..10f64.powf(hi.log10().ceil().max(1.0));
    let concurrency: Vec<f64> = options.concurrency.iter().map(|&c| c as f64).collect();
    let x_lo = concurrency.iter().copied().fold(f64::MAX, f64::min) / 1.6;
    let x_hi = concurrency.iter().copied().fold(1.0, f64::max) * 1.6;

    for (area, &mode) in root
        .split_evenly((1, modes.len().max(1)))
        .iter()
        .zip(&modes)
    {
        let mut chart = ChartBuilder::on(area)
            .caption(mode.title(), ("sans-serif", 14))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(
                (x_lo..x_hi)
                    .log_scale()
                    .with_key_points(concurrency.clone()),
                y_range.clone().log_scale(),
            )?;
        chart
            .configure_mesh()
            .x_desc("concurrency (connections, one request in flight each)")
            .y_desc("requests/s")
            .x_label_formatter(&|c| format!("{c:.0}"))
            .y_label_formatter(&|v| short_number(*v))
            .draw()?;

        if let Some(e) = find(rows, Case::E, mode, 1) {
            let style = color(Case::E).stroke_width(2);
            chart
                .draw_series(DashedLineSeries::new(
                    [(x_lo, e.median()), (x_hi, e.median())],
                    6,
                    4,
                    style,
                ))?
                .label(format!(
                    "E {} ({})",
                    Case::E.describe(),
                    short_number(e.median())
                ))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        }
        for case in Case::HTTP {
            let points: Vec<(f64, f64)> = options
                .concurrency
                .iter()
                .filter_map(|&c| find(rows, case, mode, c).map(|row| (c as f64, row.median())))
                .collect();
            if points.is_empty() {
                continue;
            }
            let style = color(case).stroke_width(2);
            chart
                .draw_series(LineSeries::new(points.iter().copied(), style))?
                .label(format!("{} {}", case.name(), case.describe()))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
            chart.draw_series(
                points
                    .iter()
                    .map(|&point| Circle::new(point, 3, color(case).filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// `12.5k`, `3k`, `850`.
fn short_number(v: f64) -> String {
    if v >= 1000.0 {
        let k = v / 1000.0;
        if (k - k.round()).abs() < 0.05 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k")
        }
    } else {
        format!("{v:.0}")
    }
}
