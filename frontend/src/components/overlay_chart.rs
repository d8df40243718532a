//! Several loss curves on one pair of axes (the compare page): x is the step or the
//! wall time, curves can be smoothed, and a seed band (min-max over runs of one spec
//! with different seeds) is shaded behind its runs.
//!
//! The geometry is [`OverlayModel`] (plain Rust, unit-tested); the component draws it.

use leptos::prelude::*;

use super::loss_chart::{nice_step, ticks, Tick};

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 400.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 28.0;
const TOP: f64 = 24.0;
const BOTTOM: f64 = 58.0;

/// One run's curve: (x, loss) in data units.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub id: i64,
    pub color: &'static str,
    pub points: Vec<(f64, f64)>,
}

/// A shaded min-max band: (x, min, max) in data units.
#[derive(Clone, Debug, PartialEq)]
pub struct Band {
    pub color: &'static str,
    pub points: Vec<(f64, f64, f64)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct OverlayModel {
    pub x_ticks: Vec<Tick>,
    pub y_ticks: Vec<Tick>,
    /// (run id, color, SVG path); a non-finite loss breaks the line.
    pub lines: Vec<(i64, &'static str, String)>,
    /// (color, closed SVG path of the band's area).
    pub bands: Vec<(&'static str, String)>,
}

/// Exponential moving average with TensorBoard's debiasing: s_t = w s_(t-1) + (1-w) y_t,
/// divided by 1 - w^t so the start is not pulled towards 0. Non-finite values pass
/// through and do not enter the average.
pub fn smooth(values: &[f64], weight: f64) -> Vec<f64> {
    let w = weight.clamp(0.0, 0.999);
    let (mut avg, mut n) = (0.0, 0);
    values
        .iter()
        .map(|&y| {
            if !y.is_finite() {
                return y;
            }
            n += 1;
            avg = w * avg + (1.0 - w) * y;
            avg / (1.0 - w.powi(n))
        })
        .collect()
}

impl OverlayModel {
    pub fn new(series: &[Series], bands: &[Band]) -> Self {
        let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
        let x_max = xs.fold(0.0f64, f64::max).max(1e-9);
        let ys: Vec<f64> = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .chain(bands.iter().flat_map(|b| b.points.iter().flat_map(|p| [p.1, p.2])))
            .filter(|y| y.is_finite())
            .collect();
        let (mut lo, mut hi) = ys.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &y| (l.min(y), h.max(y)));
        if !lo.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        if hi - lo < 1e-9 {
            (lo, hi) = (lo - 0.5, hi + 0.5);
        }
        let x_step = nice_step(x_max / 6.0);
        let x_axis_max = (x_max / x_step).ceil() * x_step;
        let y_step = nice_step((hi - lo) / 7.0);
        let y_min = (lo / y_step).floor() * y_step;
        let y_max = (hi / y_step).ceil() * y_step;
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let sx = move |x: f64| LEFT + x / x_axis_max * plot_w;
        let sy = move |y: f64| TOP + (y_max - y) / (y_max - y_min) * plot_h;

        let decimals = |step: f64| if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize };
        let (dx, dy) = (decimals(x_step), decimals(y_step));
        let x_ticks = ticks(0.0, x_axis_max, x_step)
            .into_iter()
            .map(|v| Tick { pos: sx(v), label: format!("{v:.dx$}") })
            .collect();
        let y_ticks =
            ticks(y_min, y_max, y_step).into_iter().map(|v| Tick { pos: sy(v), label: format!("{v:.dy$}") }).collect();

        let lines = series
            .iter()
            .map(|s| {
                let mut path = String::new();
                let mut pen_down = false;
                for &(x, y) in &s.points {
                    if y.is_finite() {
                        path.push_str(&format!("{}{:.1} {:.1} ", if pen_down { 'L' } else { 'M' }, sx(x), sy(y)));
                        pen_down = true;
                    } else {
                        pen_down = false;
                    }
                }
                (s.id, s.color, path.trim_end().to_string())
            })
            .collect();
        let bands = bands
            .iter()
            .filter(|b| b.points.len() >= 2)
            .map(|b| {
                let upper = b.points.iter().map(|&(x, _, max)| format!("{:.1} {:.1}", sx(x), sy(max)));
                let lower = b.points.iter().rev().map(|&(x, min, _)| format!("{:.1} {:.1}", sx(x), sy(min)));
                (b.color, format!("M{} Z", upper.chain(lower).collect::<Vec<_>>().join(" L")))
            })
            .collect();
        OverlayModel { x_ticks, y_ticks, lines, bands }
    }
}

#[component]
pub fn OverlayChart(
    #[prop(into)] series: Signal<Vec<Series>>,
    #[prop(into)] bands: Signal<Vec<Band>>,
    #[prop(into)] x_title: Signal<String>,
) -> impl IntoView {
    let model = Memo::new(move |_| OverlayModel::new(&series.get(), &bands.get()));
    let plot_right = WIDTH - RIGHT;
    let plot_bottom = HEIGHT - BOTTOM;
    view! {
        <svg id="overlay-chart" class="chart" viewBox=format!("0 0 {WIDTH} {HEIGHT}") role="img"
            aria-label="loss curves of the compared runs"
            data-lines=move || model.with(|m| m.lines.len().to_string())>
            <rect class="chart-bg" x="0" y="0" width=WIDTH.to_string() height=HEIGHT.to_string()></rect>
            <g class="bands">
                {move || model.with(|m| m.bands.clone()).into_iter().map(|(color, d)| {
                    view! { <path class="seed-band" d=d fill=color fill-opacity="0.16" stroke="none"></path> }
                }).collect_view()}
            </g>
            <g class="grid">
                {move || model.with(|m| m.y_ticks.clone()).into_iter().map(|t| view! {
                    <line class="grid-line" x1=LEFT.to_string() x2=plot_right.to_string()
                        y1=format!("{:.1}", t.pos) y2=format!("{:.1}", t.pos)></line>
                    <text class="tick tick-y" x=(LEFT - 8.0).to_string() y=format!("{:.1}", t.pos + 4.0)
                        text-anchor="end">{t.label}</text>
                }).collect_view()}
                {move || model.with(|m| m.x_ticks.clone()).into_iter().map(|t| view! {
                    <line class="tick-mark" x1=format!("{:.1}", t.pos) x2=format!("{:.1}", t.pos)
                        y1=plot_bottom.to_string() y2=(plot_bottom + 5.0).to_string()></line>
                    <text class="tick tick-x" x=format!("{:.1}", t.pos) y=(plot_bottom + 20.0).to_string()
                        text-anchor="middle">{t.label}</text>
                }).collect_view()}
            </g>
            <line class="axis" x1=LEFT.to_string() x2=LEFT.to_string() y1=TOP.to_string() y2=plot_bottom.to_string()></line>
            <line class="axis" x1=LEFT.to_string() x2=plot_right.to_string() y1=plot_bottom.to_string()
                y2=plot_bottom.to_string()></line>
            <text class="axis-title" x=(LEFT + (plot_right - LEFT) / 2.0).to_string() y=(HEIGHT - 12.0).to_string()
                text-anchor="middle">{move || x_title.get()}</text>
            <text class="axis-title" x="0" y="0" text-anchor="middle"
                transform=format!("translate(20 {:.1}) rotate(-90)", TOP + (plot_bottom - TOP) / 2.0)>
                "loss (nats/token)"
            </text>
            // Earlier runs are drawn wider, so that a curve exactly on top of another
            // (DDP and one rank) leaves the one under it visible as a border.
            {move || model.with(|m| m.lines.clone()).into_iter().enumerate().map(|(i, (id, color, d))| view! {
                <path class="overlay-line" data-id=id.to_string() d=d fill="none" stroke=color
                    stroke-width=format!("{:.1}", (5.0 - 1.2 * i as f64).max(1.2)) stroke-linejoin="round"></path>
            }).collect_view()}
        </svg>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_debiased_and_skips_non_finite_values() {
        assert_eq!(smooth(&[4.0, 4.0, 4.0], 0.9), vec![4.0, 4.0, 4.0]);
        assert_eq!(smooth(&[1.0, 3.0], 0.0), vec![1.0, 3.0]);
        let s = smooth(&[1.0, f64::NAN, 3.0], 0.5);
        assert!(s[1].is_nan());
        // (0.5*0.5*1 + 0.5*3) / (1 - 0.25) = 1.75 / 0.75
        assert!((s[2] - 1.75 / 0.75).abs() < 1e-12);
    }

    #[test]
    fn every_series_becomes_a_line_and_a_band_an_area() {
        let a = Series { id: 1, color: "red", points: vec![(0.0, 5.0), (1.0, 4.0), (2.0, f64::NAN), (3.0, 3.0)] };
        let b = Series { id: 2, color: "blue", points: vec![(0.0, 5.0), (3.0, 3.5)] };
        let band = Band { color: "red", points: vec![(0.0, 4.5, 5.5), (3.0, 2.5, 3.5)] };
        let m = OverlayModel::new(&[a, b], &[band]);
        assert_eq!(m.lines.len(), 2);
        assert_eq!(m.lines[0].2.matches('M').count(), 2, "the NaN breaks the line: {}", m.lines[0].2);
        assert_eq!(m.bands.len(), 1);
        assert!(m.bands[0].1.starts_with('M') && m.bands[0].1.ends_with('Z'));
        assert!(m.y_ticks.first().map(|t| t.label.as_str()) <= Some("2.5"));
    }
}
