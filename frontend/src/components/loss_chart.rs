//! The live loss curve: an SVG line chart with axes, tick labels, axis titles, a
//! title saying what ran, and dashed reference lines for the loss of a uniform
//! guess (ln vocab) and the dataset's loss floor when it is known.
//!
//! The geometry is computed by [`ChartModel`] (plain Rust, unit-tested); the
//! component only draws it.

use distlab_common::MetricPoint;
use leptos::prelude::*;

const WIDTH: f64 = 860.0;

/// About how wide a character of the subtitle is (12.5 px text, style.css).
const SUBTITLE_CHAR_PX: f64 = 6.8;

/// The width to squeeze a subtitle into when it would run past the chart's edges (SVG text
/// does not wrap), or None when it fits.
fn squeezed(text: &str) -> Option<String> {
    let room = WIDTH - 24.0;
    (text.chars().count() as f64 * SUBTITLE_CHAR_PX > room).then(|| room.to_string())
}
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 28.0;
const TOP: f64 = 64.0;
const BOTTOM: f64 = 58.0;
/// More points than this are thinned out for the dots (the line keeps them all).
const MAX_DOTS: usize = 150;

/// A horizontal dashed line with a label.
#[derive(Clone, Debug, PartialEq)]
pub struct Reference {
    pub class: &'static str,
    pub value: f64,
    pub label: String,
    /// Put the label under the line (for a floor the curve approaches from above).
    pub below: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tick {
    pub pos: f64,
    pub label: String,
}

/// Everything the SVG needs, in pixels of the viewBox.
#[derive(Clone, Debug, PartialEq)]
pub struct ChartModel {
    pub x_ticks: Vec<Tick>,
    pub y_ticks: Vec<Tick>,
    /// `M x y L x y ...`; a non-finite loss breaks the line.
    pub path: String,
    pub dots: Vec<(f64, f64, String)>,
    /// Dot radius: smaller when the dots are close together, so the line stays visible.
    pub dot_r: f64,
    pub refs: Vec<(f64, Reference)>,
    pub points: usize,
    /// The validation losses (steps with one): their line and a marker each.
    pub val_path: String,
    pub val_dots: Vec<(f64, f64, String)>,
}

impl ChartModel {
    pub fn new(points: &[MetricPoint], total_steps: u64, refs: &[Reference]) -> Self {
        // The x axis follows the points (a long run stays readable from its first
        // steps); before the first point it shows the whole run.
        let x_max = match points.iter().map(|p| p.step).max() {
            Some(last) => last,
            None => total_steps.saturating_sub(1),
        }
        .max(1) as f64;
        let x_step = nice_step(x_max / 6.0).max(1.0);
        let x_axis_max = (x_max / x_step).ceil() * x_step;

        let validation: Vec<(u64, f64)> =
            points.iter().filter_map(|p| p.val_loss.filter(|v| v.is_finite()).map(|v| (p.step, v))).collect();
        let finite: Vec<f64> =
            points.iter().map(|p| p.loss).filter(|l| l.is_finite()).chain(validation.iter().map(|v| v.1)).collect();
        let mut lo = finite.iter().copied().chain(refs.iter().map(|r| r.value)).fold(f64::INFINITY, f64::min);
        let mut hi = finite.iter().copied().chain(refs.iter().map(|r| r.value)).fold(f64::NEG_INFINITY, f64::max);
        if !lo.is_finite() || !hi.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        if hi - lo < 1e-9 {
            (lo, hi) = (lo - 0.5, hi + 0.5);
        }
        let y_step = nice_step((hi - lo) / 7.0);
        // Room above the highest and below the lowest value for the reference labels.
        let y_min = (lo / y_step).floor() * y_step;
        let y_min = if lo - y_min < y_step * 0.15 { y_min - y_step } else { y_min };
        let y_min = if lo >= 0.0 { y_min.max(0.0) } else { y_min };
        let y_max = (hi / y_step).ceil() * y_step;
        let y_max = if y_max - hi < y_step * 0.15 { y_max + y_step } else { y_max };

        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let sx = move |step: f64| LEFT + step / x_axis_max * plot_w;
        let sy = move |loss: f64| TOP + (y_max - loss) / (y_max - y_min) * plot_h;

        let x_ticks =
            ticks(0.0, x_axis_max, x_step).into_iter().map(|v| Tick { pos: sx(v), label: format!("{v:.0}") }).collect();
        let decimals = if y_step >= 1.0 { 0 } else { (-y_step.log10().floor()) as usize };
        let y_ticks = ticks(y_min, y_max, y_step)
            .into_iter()
            .map(|v| Tick { pos: sy(v), label: format!("{v:.decimals$}") })
            .collect();

        let mut path = String::new();
        let mut pen_down = false;
        for p in points {
            if p.loss.is_finite() {
                let cmd = if pen_down { 'L' } else { 'M' };
                path.push_str(&format!("{cmd}{:.1} {:.1} ", sx(p.step as f64), sy(p.loss)));
                pen_down = true;
            } else {
                pen_down = false;
            }
        }
        let stride = points.len().div_ceil(MAX_DOTS).max(1);
        let dots = points
            .iter()
            .enumerate()
            .filter(|(i, p)| p.loss.is_finite() && (i % stride == 0 || *i + 1 == points.len()))
            .map(|(_, p)| (sx(p.step as f64), sy(p.loss), format!("step {}: loss {:.4}", p.step, p.loss)))
            .collect();
        let spacing = plot_w / x_axis_max * stride as f64;
        let dot_r = (spacing * 0.3).clamp(1.1, 2.6);
        let refs = refs.iter().filter(|r| r.value.is_finite()).map(|r| (sy(r.value), r.clone())).collect();
        let val_path = validation
            .iter()
            .enumerate()
            .map(|(i, &(step, v))| format!("{}{:.1} {:.1}", if i == 0 { 'M' } else { 'L' }, sx(step as f64), sy(v)))
            .collect::<Vec<_>>()
            .join(" ");
        let val_dots = validation
            .iter()
            .map(|&(step, v)| (sx(step as f64), sy(v), format!("step {step}: validation loss {v:.4}")))
            .collect();
        ChartModel {
            x_ticks,
            y_ticks,
            path: path.trim_end().to_string(),
            dots,
            dot_r,
            refs,
            points: points.len(),
            val_path,
            val_dots,
        }
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
pub fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let power = 10f64.powf(raw.log10().floor());
    let m = raw / power;
    let nice = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * power
}

pub fn ticks(min: f64, max: f64, step: f64) -> Vec<f64> {
    let first = (min / step).ceil() as i64;
    let last = (max / step + 1e-9).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

#[component]
pub fn LossChart(
    #[prop(into)] points: Signal<Vec<MetricPoint>>,
    #[prop(into)] total_steps: Signal<u64>,
    /// Reference lines (uniform guess, loss floor).
    #[prop(into)]
    refs: Signal<Vec<Reference>>,
    #[prop(into)] title: Signal<String>,
    #[prop(into)] subtitle: Signal<String>,
) -> impl IntoView {
    let model = Memo::new(move |_| points.with(|p| ChartModel::new(p, total_steps.get(), &refs.get())));
    let plot_right = WIDTH - RIGHT;
    let plot_bottom = HEIGHT - BOTTOM;
    view! {
        <svg
            id="loss-chart"
            class="chart"
            viewBox=format!("0 0 {WIDTH} {HEIGHT}")
            preserveAspectRatio="xMidYMid meet"
            role="img"
            aria-label=move || title.get()
            data-points=move || model.with(|m| m.points.to_string())
        >
            <rect class="chart-bg" x="0" y="0" width=WIDTH.to_string() height=HEIGHT.to_string()></rect>
            <text class="chart-title" x=(WIDTH / 2.0).to_string() y="24" text-anchor="middle">
                {move || title.get()}
            </text>
            <text
                class="chart-subtitle"
                x=(WIDTH / 2.0).to_string()
                y="44"
                text-anchor="middle"
                textLength=move || squeezed(&subtitle.get())
                lengthAdjust="spacingAndGlyphs"
            >
                {move || subtitle.get()}
            </text>
            <g class="grid">
                {move || {
                    model
                        .with(|m| m.y_ticks.clone())
                        .into_iter()
                        .map(|t| {
                            view! {
                                <line class="grid-line" x1=LEFT.to_string() x2=plot_right.to_string()
                                    y1=format!("{:.1}", t.pos) y2=format!("{:.1}", t.pos)></line>
                                <text class="tick tick-y" x=(LEFT - 8.0).to_string() y=format!("{:.1}", t.pos + 4.0)
                                    text-anchor="end">{t.label}</text>
                            }
                        })
                        .collect_view()
                }}
                {move || {
                    model
                        .with(|m| m.x_ticks.clone())
                        .into_iter()
                        .map(|t| {
                            view! {
                                <line class="tick-mark" x1=format!("{:.1}", t.pos) x2=format!("{:.1}", t.pos)
                                    y1=plot_bottom.to_string() y2=(plot_bottom + 5.0).to_string()></line>
                                <text class="tick tick-x" x=format!("{:.1}", t.pos) y=(plot_bottom + 20.0).to_string()
                                    text-anchor="middle">{t.label}</text>
                            }
                        })
                        .collect_view()
                }}
            </g>
            <line class="axis" x1=LEFT.to_string() x2=LEFT.to_string() y1=TOP.to_string() y2=plot_bottom.to_string()></line>
            <line class="axis" x1=LEFT.to_string() x2=plot_right.to_string() y1=plot_bottom.to_string()
                y2=plot_bottom.to_string()></line>
            <text class="axis-title" x=(LEFT + (plot_right - LEFT) / 2.0).to_string() y=(HEIGHT - 12.0).to_string()
                text-anchor="middle">"step"</text>
            <text class="axis-title" x="0" y="0" text-anchor="middle"
                transform=format!("translate(20 {:.1}) rotate(-90)", TOP + (plot_bottom - TOP) / 2.0)>
                "loss (nats/token)"
            </text>
            <g class="refs">
                {move || {
                    model
                        .with(|m| m.refs.clone())
                        .into_iter()
                        .map(|(y, r)| {
                            view! {
                                <line class=format!("ref {}", r.class) x1=LEFT.to_string() x2=plot_right.to_string()
                                    y1=format!("{y:.1}") y2=format!("{y:.1}") stroke-dasharray="7 5"></line>
                                <text class=format!("ref-label {}", r.class) x=(plot_right - 6.0).to_string()
                                    y=format!("{:.1}", if r.below { y + 16.0 } else { y - 6.0 }) text-anchor="end">{r.label}</text>
                            }
                        })
                        .collect_view()
                }}
            </g>
            <path class="loss-line" d=move || model.with(|m| m.path.clone()) fill="none"></path>
            <g class="loss-points">
                {move || {
                    let (dots, r) = model.with(|m| (m.dots.clone(), format!("{:.1}", m.dot_r)));
                    dots.into_iter()
                        .map(|(x, y, tip)| {
                            view! {
                                <circle class="loss-point" cx=format!("{x:.1}") cy=format!("{y:.1}") r=r.clone()>
                                    <title>{tip}</title>
                                </circle>
                            }
                        })
                        .collect_view()
                }}
            </g>
            <path class="val-line" d=move || model.with(|m| m.val_path.clone()) fill="none"></path>
            <g class="val-points" data-points=move || model.with(|m| m.val_dots.len().to_string())>
                {move || {
                    model
                        .with(|m| m.val_dots.clone())
                        .into_iter()
                        .map(|(x, y, tip)| {
                            view! {
                                <rect class="val-point" x=format!("{:.1}", x - 3.5) y=format!("{:.1}", y - 3.5)
                                    width="7" height="7"><title>{tip}</title></rect>
                            }
                        })
                        .collect_view()
                }}
            </g>
            {move || {
                (!model.with(|m| m.val_dots.is_empty())).then(|| {
                    view! {
                        // Bottom left: the curves start high and fall to the right.
                        <g class="legend">
                            <rect class="legend-bg" x=(LEFT + 8.0).to_string() y=(plot_bottom - 52.0).to_string()
                                width="210" height="42" rx="4"></rect>
                            <line class="loss-line" x1=(LEFT + 16.0).to_string() x2=(LEFT + 40.0).to_string()
                                y1=(plot_bottom - 38.0).to_string() y2=(plot_bottom - 38.0).to_string()></line>
                            <text class="legend-label" x=(LEFT + 46.0).to_string() y=(plot_bottom - 34.0).to_string()>"training (this step's batch)"</text>
                            <line class="val-line" x1=(LEFT + 16.0).to_string() x2=(LEFT + 40.0).to_string()
                                y1=(plot_bottom - 20.0).to_string() y2=(plot_bottom - 20.0).to_string()></line>
                            <text class="legend-label" x=(LEFT + 46.0).to_string() y=(plot_bottom - 16.0).to_string()>"validation (held-out data)"</text>
                        </g>
                    }
                })
            }}
            {move || {
                (model.with(|m| m.points) == 0)
                    .then(|| {
                        view! {
                            <text class="chart-empty" x=(WIDTH / 2.0).to_string() y=(HEIGHT / 2.0).to_string()
                                text-anchor="middle">"waiting for the first step…"</text>
                        }
                    })
            }}
        </svg>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: u64, loss: f64) -> MetricPoint {
        MetricPoint { step, loss, lr: 1e-3, grad_norm: 1.0, tokens_per_s: 1.0, step_ms: 1.0, ..Default::default() }
    }

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(1.3), 2.0);
        assert_eq!(nice_step(16.0), 20.0);
        assert!((nice_step(0.043) - 0.05).abs() < 1e-12);
    }

    #[test]
    fn model_covers_points_and_references() {
        let points: Vec<_> = (0..50).map(|s| point(s, 4.2 - s as f64 * 0.04)).collect();
        let refs = [Reference { class: "ref-uniform", value: 64f64.ln(), label: "ln 64".into(), below: false }];
        let m = ChartModel::new(&points, 100, &refs);
        assert_eq!(m.points, 50);
        assert_eq!(m.dots.len(), 50);
        assert!(m.path.starts_with('M'));
        assert_eq!(m.path.matches('L').count(), 49);
        // Every dot and the reference line lie inside the plot area.
        for (x, y, _) in &m.dots {
            assert!((LEFT..=WIDTH - RIGHT).contains(x) && (TOP..=HEIGHT - BOTTOM).contains(y), "{x} {y}");
        }
        assert!((TOP..=HEIGHT - BOTTOM).contains(&m.refs[0].0));
        // The x axis follows the points, up to a round number.
        assert_eq!(m.x_ticks.last().map(|t| t.label.as_str()), Some("50"));
        // Without points it spans the run.
        let m = ChartModel::new(&[], 100, &refs);
        assert_eq!(m.x_ticks.last().map(|t| t.label.as_str()), Some("100"));
    }

    #[test]
    fn validation_losses_get_their_own_line_inside_the_plot() {
        let mut points: Vec<_> = (0..20).map(|s| point(s, 4.0 - s as f64 * 0.1)).collect();
        points[9].val_loss = Some(3.5);
        points[19].val_loss = Some(6.0); // above every training loss: the y axis makes room
        let m = ChartModel::new(&points, 20, &[]);
        assert_eq!(m.val_dots.len(), 2);
        assert!(m.val_path.starts_with('M') && m.val_path.matches('L').count() == 1);
        for (x, y, _) in &m.val_dots {
            assert!((LEFT..=WIDTH - RIGHT).contains(x) && (TOP..=HEIGHT - BOTTOM).contains(y), "{x} {y}");
        }
        assert!(m.val_dots[1].2.contains("validation loss 6.0000"));
        assert!(ChartModel::new(&points[..5], 20, &[]).val_dots.is_empty());
    }

    #[test]
    fn empty_and_non_finite() {
        let m = ChartModel::new(&[], 0, &[]);
        assert_eq!(m.points, 0);
        assert!(m.path.is_empty());
        let m = ChartModel::new(&[point(0, 3.0), point(1, f64::NAN), point(2, 2.0)], 3, &[]);
        assert_eq!(m.path.matches('M').count(), 2);
        assert_eq!(m.dots.len(), 2);
    }
}
