//! Asynchronous SGD's record, drawn: every gradient the parameter server applied, in the
//! order it applied them (x), at its staleness (y: how many other gradients reached the
//! parameters between its worker's pull and its push), one colour per worker; and how many
//! gradients had each staleness. Synchronous data parallelism would draw one flat line at 0.
//!
//! The geometry ([`StalenessModel`]) is plain Rust, unit-tested; the component only draws it.

use distlab_common::trace::AppliedGradient;
use leptos::prelude::*;

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 220.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 16.0;
const BOTTOM: f64 = 40.0;

/// One applied gradient's dot.
#[derive(Clone, Debug, PartialEq)]
pub struct Dot {
    pub x: f64,
    pub y: f64,
    pub worker: u32,
    pub title: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct StalenessModel {
    pub dots: Vec<Dot>,
    /// (y, label) of each staleness drawn on the axis.
    pub y_ticks: Vec<(f64, String)>,
    /// How many gradients had each staleness (0, 1, ...), and their mean.
    pub counts: Vec<usize>,
    pub mean: f64,
}

impl StalenessModel {
    pub fn new(applied: &[AppliedGradient]) -> Self {
        let most = applied.iter().map(|a| a.staleness).max().unwrap_or(0);
        let mut counts = vec![0usize; most as usize + 1];
        for a in applied {
            counts[a.staleness as usize] += 1;
        }
        let mean = applied.iter().map(|a| f64::from(a.staleness)).sum::<f64>() / applied.len().max(1) as f64;
        let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
        let sx = |i: usize| LEFT + (i as f64 + 0.5) / applied.len().max(1) as f64 * plot_w;
        let sy = |s: u32| TOP + plot_h - f64::from(s) / f64::from(most.max(1)) * plot_h;
        let dots = applied
            .iter()
            .enumerate()
            .map(|(i, a)| Dot {
                x: sx(i),
                y: sy(a.staleness),
                worker: a.worker,
                title: format!("update {}: rank {}'s gradient, staleness {}", i + 1, a.worker, a.staleness),
            })
            .collect();
        let step = (most / 6).max(1);
        let y_ticks = (0..=most).step_by(step as usize).map(|s| (sy(s), s.to_string())).collect();
        Self { dots, y_ticks, counts, mean }
    }
}

/// The server's record of an asynchronous run.
#[component]
pub fn StalenessChart(applied: Vec<AppliedGradient>) -> impl IntoView {
    let model = StalenessModel::new(&applied);
    let workers = applied.iter().map(|a| a.worker).max().map_or(0, |w| w + 1);
    let counts = model
        .counts
        .iter()
        .enumerate()
        .filter(|(_, &n)| n > 0)
        .map(|(s, &n)| view! { <tr data-staleness=s.to_string()><td>{s}</td><td class="num">{n}</td></tr> })
        .collect_view();
    let (base, right) = (HEIGHT - BOTTOM, WIDTH - RIGHT);
    view! {
        <svg id="staleness-chart" class="chart" viewBox=format!("0 0 {WIDTH} {HEIGHT}")
            data-gradients=applied.len().to_string() role="img">
            <line class="axis" x1=LEFT y1=base x2=right y2=base/>
            <line class="axis" x1=LEFT y1=TOP x2=LEFT y2=base/>
            {model.y_ticks.into_iter().map(|(y, label)| view! {
                <text class="tick" x=LEFT - 8.0 y=y + 4.0 text-anchor="end">{label}</text>
            }).collect_view()}
            <text class="axis-title" x=LEFT + (WIDTH - LEFT - RIGHT) / 2.0 y=HEIGHT - 8.0 text-anchor="middle">
                "updates, in the order the server applied them"
            </text>
            <text class="axis-title" x=14.0 y=TOP + (HEIGHT - TOP - BOTTOM) / 2.0 text-anchor="middle"
                transform=format!("rotate(-90 14 {})", TOP + (HEIGHT - TOP - BOTTOM) / 2.0)>"staleness"</text>
            {model.dots.into_iter().map(|d| view! {
                <circle class=format!("staleness-dot worker-{}", d.worker % 8) cx=d.x cy=d.y r=4.0 data-worker=d.worker.to_string()>
                    <title>{d.title}</title>
                </circle>
            }).collect_view()}
        </svg>
        <p class="small" id="staleness-summary">
            {format!("{} gradients from {workers} workers, mean staleness {:.2}", applied.len(), model.mean)}
        </p>
        <table class="small" id="staleness-counts">
            <thead><tr><th>"staleness"</th><th class="num">"gradients"</th></tr></thead>
            <tbody>{counts}</tbody>
        </table>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gradient_is_a_dot_at_its_staleness_and_counted() {
        let applied: Vec<AppliedGradient> =
            [(0, 0), (1, 1), (0, 1), (1, 2)].map(|(worker, staleness)| AppliedGradient { worker, staleness }).into();
        let m = StalenessModel::new(&applied);
        assert_eq!(m.dots.len(), 4);
        assert_eq!(m.counts, vec![1, 2, 1]);
        assert!((m.mean - 1.0).abs() < 1e-12);
        // Left to right in order; the most stale at the top, the fresh at the bottom.
        assert!(m.dots.windows(2).all(|w| w[0].x < w[1].x));
        assert_eq!(m.dots[3].y, TOP);
        assert_eq!(m.dots[0].y, HEIGHT - BOTTOM);
        assert!(m.dots[2].title.contains("rank 0's gradient, staleness 1"));
    }
}
