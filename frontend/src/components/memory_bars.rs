//! Memory by category as stacked horizontal bars: one bar per row (a rank's measured
//! peak, the planner's prediction, a pipeline stage), every segment a category
//! (parameters, gradients, optimizer state, gathered parameters, activations,
//! activation gradients, communication buffers), on one byte axis so that bars can be
//! compared by length. Hovering a segment gives its exact byte count.
//!
//! The categories ([`CATEGORIES`]), the byte axis ([`byte_ticks`]) and the geometry
//! ([`BarsModel`]) are plain Rust, unit-tested; the component only draws them.

use distlab_common::planner::RankMemory;
use leptos::prelude::*;

use crate::components::loss_chart::nice_step;
use crate::format;

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 150.0;
const RIGHT: f64 = 120.0;
const TOP: f64 = 8.0;
const BAR_H: f64 = 24.0;
const BAR_GAP: f64 = 10.0;
const AXIS_H: f64 = 30.0;
/// Segments narrower than this get no text inside (their title still tells).
const LABEL_MIN_W: f64 = 84.0;

/// The categories of [`RankMemory`] (shared with the server and the worker).
pub use distlab_common::memory::MemoryCategory as Category;

/// Every category, in the order the bars stack them (model state first).
pub const CATEGORIES: [Category; Category::ALL.len()] = Category::ALL;

/// How the page shows a category.
pub trait Look {
    /// For the legend and titles.
    fn label(self) -> &'static str;
    /// For text inside a segment.
    fn short(self) -> &'static str;
    /// The CSS class that colours it (`.mem-activations`).
    fn class(self) -> &'static str;
}

impl Look for Category {
    fn label(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer state",
            Category::GatheredParameters => "gathered parameters",
            Category::Activations => "activations",
            Category::ActivationGrads => "activation grads",
            Category::CommBuffers => "comm buffers",
            Category::CompressionState => "compression state (residual, Q)",
            Category::Transient => "transient (measured only)",
            Category::Transport => "transport (measured only)",
            Category::Checkpoint => "checkpoint copy (measured only)",
            Category::Offloaded => "offloaded (off the device)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Category::Parameters => "params",
            Category::Gradients => "grads",
            Category::OptimizerState => "optimizer",
            Category::GatheredParameters => "gathered",
            Category::Activations => "activations",
            Category::ActivationGrads => "act. grads",
            Category::CommBuffers => "comm",
            Category::CompressionState => "compression",
            Category::Transient => "transient",
            Category::Transport => "transport",
            Category::Checkpoint => "checkpoint",
            Category::Offloaded => "offloaded",
        }
    }

    fn class(self) -> &'static str {
        match self {
            Category::Parameters => "mem-parameters",
            Category::Gradients => "mem-gradients",
            Category::OptimizerState => "mem-optimizer",
            Category::GatheredParameters => "mem-gathered",
            Category::Activations => "mem-activations",
            Category::ActivationGrads => "mem-activation-grads",
            Category::CommBuffers => "mem-comm",
            Category::CompressionState => "mem-compression",
            Category::Transient => "mem-transient",
            Category::Transport => "mem-transport",
            Category::Checkpoint => "mem-checkpoint",
            Category::Offloaded => "mem-offloaded",
        }
    }
}

/// The categories added up (saturating), whatever `total` says.
pub fn sum_of_categories(m: &RankMemory) -> u64 {
    CATEGORIES.iter().map(|c| c.of(m)).fold(0, u64::saturating_add)
}

/// A byte axis from 0 to at least `max`: (axis end, ticks as (bytes, label)), with
/// round steps in the unit that suits `max` ("0", "2 MiB", "4 MiB", ...).
pub fn byte_ticks(max: f64, target_ticks: f64) -> (f64, Vec<(f64, String)>) {
    let max = if max.is_finite() && max > 0.0 { max } else { 1.0 };
    let (scale, unit) = format::byte_unit(max);
    let step = nice_step(max / scale / target_ticks.max(1.0)) * scale;
    let count = (max / step - 1e-9).ceil().max(1.0) as usize;
    let decimals = if step / scale >= 1.0 { 0 } else { (-(step / scale).log10().floor()) as usize };
    let ticks = (0..=count)
        .map(|i| {
            let b = i as f64 * step;
            let label = if i == 0 { "0".to_string() } else { format!("{:.decimals$} {unit}", b / scale) };
            (b, label)
        })
        .collect();
    (count as f64 * step, ticks)
}

/// Whose bytes a bar shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    /// What the engine measured (each category's peak).
    Measured,
    /// The planner's prediction.
    Predicted,
}

impl BarKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BarKind::Measured => "measured",
            BarKind::Predicted => "predicted",
        }
    }
}

/// One bar to draw.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    /// Text left of the bar ("measured", "planner", "stage 2 (peak)").
    pub label: String,
    /// Who it belongs to, for tooltips ("rank 1").
    pub owner: String,
    /// For `data-rank` (tests find bars by rank).
    pub rank: Option<u32>,
    pub kind: BarKind,
    pub memory: RankMemory,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SegmentBox {
    pub x: f64,
    pub w: f64,
    pub class: &'static str,
    pub title: String,
    pub label: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BarBox {
    pub y: f64,
    pub label: String,
    pub rank: Option<u32>,
    pub kind: BarKind,
    pub segments: Vec<SegmentBox>,
    /// Where the bar ends, and the sum it shows.
    pub end_x: f64,
    pub sum: u64,
    /// A measured bar whose highest simultaneous total is below the sum of the
    /// categories' own peaks: (x of that total, its title).
    pub at_once: Option<(f64, String)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BarsModel {
    pub height: f64,
    pub bars: Vec<BarBox>,
    /// (x, label) of the byte axis.
    pub ticks: Vec<(f64, String)>,
    pub axis_y: f64,
}

impl BarsModel {
    /// Lays out `bars` on an axis reaching `scale_max` bytes (at least the longest bar), so
    /// that several charts can share a scale.
    pub fn new(bars: &[Bar], scale_max: u64) -> Self {
        let longest = bars.iter().map(|b| sum_of_categories(&b.memory)).max().unwrap_or(0);
        let (axis_max, ticks) = byte_ticks(scale_max.max(longest) as f64, 5.0);
        let plot_w = WIDTH - LEFT - RIGHT;
        let sx = |b: f64| LEFT + b / axis_max * plot_w;
        let boxes = bars
            .iter()
            .enumerate()
            .map(|(i, bar)| {
                let y = TOP + i as f64 * (BAR_H + BAR_GAP);
                let mut at = 0u64;
                let segments = CATEGORIES
                    .iter()
                    .filter_map(|&c| {
                        let bytes = c.of(&bar.memory);
                        if bytes == 0 {
                            return None;
                        }
                        let x = sx(at as f64);
                        at = at.saturating_add(bytes);
                        let w = (sx(at as f64) - x).max(1.0);
                        let title =
                            format!("{} · {} · {}: {}", bar.owner, bar.label, c.label(), format::bytes_exact(bytes));
                        let text = format!("{} {}", c.short(), format::bytes(bytes as f64));
                        let label = (w >= LABEL_MIN_W && text.len() as f64 * 6.2 <= w - 8.0).then_some(text);
                        Some(SegmentBox { x, w, class: c.class(), title, label })
                    })
                    .collect();
                let at_once = (bar.kind == BarKind::Measured && bar.memory.total < at).then(|| {
                    (
                        sx(bar.memory.total as f64),
                        format!(
                            "{} · highest total at any one moment: {} (each category's own peak adds up to {})",
                            bar.owner,
                            format::bytes_exact(bar.memory.total),
                            format::bytes(at as f64)
                        ),
                    )
                });
                BarBox {
                    y,
                    label: bar.label.clone(),
                    rank: bar.rank,
                    kind: bar.kind,
                    segments,
                    end_x: sx(at as f64),
                    sum: at,
                    at_once,
                }
            })
            .collect();
        let axis_y = TOP + bars.len() as f64 * (BAR_H + BAR_GAP) - BAR_GAP + 6.0;
        let ticks = ticks.into_iter().map(|(b, label)| (sx(b), label)).collect();
        BarsModel { height: axis_y + AXIS_H, bars: boxes, ticks, axis_y }
    }
}

/// The colour key of the categories (and, unless `planner_only`, of measured vs predicted).
#[component]
pub fn MemoryLegend(#[prop(optional)] planner_only: bool) -> impl IntoView {
    let items = CATEGORIES
        .iter()
        .map(|c| view! { <span class="legend-item"><span class=format!("swatch {}", c.class())></span>{c.label()}</span> })
        .collect_view();
    view! {
        <div class="legend memory-legend">
            {items}
            {(!planner_only).then(|| view! {
                <span class="legend-item"><span class="swatch predicted-swatch"></span>"paler: the planner's prediction"</span>
            })}
        </div>
    }
}

/// Stacked bars of `bars` on an axis reaching at least `scale_max` bytes.
#[component]
pub fn MemoryBars(#[prop(into)] bars: Signal<Vec<Bar>>, #[prop(into)] scale_max: Signal<u64>) -> impl IntoView {
    let model = Memo::new(move |_| bars.with(|b| BarsModel::new(b, scale_max.get())));
    view! {
        <svg
            class="chart memory-bars"
            viewBox=move || format!("0 0 {WIDTH} {:.0}", model.with(|m| m.height))
            role="img"
            aria-label="memory by category"
        >
            {move || {
                let m = model.get();
                let axis_y = m.axis_y;
                let ticks = m.ticks.into_iter().map(|(x, label)| view! {
                    <line class="grid-line" x1=format!("{x:.1}") x2=format!("{x:.1}") y1=TOP.to_string() y2=format!("{axis_y:.1}")></line>
                    <text class="tick" x=format!("{x:.1}") y=format!("{:.1}", axis_y + 16.0) text-anchor="middle">{label}</text>
                }).collect_view();
                let bars = m.bars.into_iter().map(|b| {
                    let y = b.y;
                    let segments = b.segments.into_iter().map(|s| {
                        let label = s.label.map(|t| view! {
                            <text class="segment-label" x=format!("{:.1}", s.x + 4.0) y=format!("{:.1}", y + BAR_H * 0.68)>{t}</text>
                        });
                        view! {
                            <rect class=format!("segment {}", s.class) x=format!("{:.1}", s.x) y=format!("{y:.1}")
                                width=format!("{:.1}", s.w) height=BAR_H.to_string()><title>{s.title}</title></rect>
                            {label}
                        }
                    }).collect_view();
                    let at_once = b.at_once.map(|(x, title)| view! {
                        <line class="at-once" x1=format!("{x:.1}") x2=format!("{x:.1}") y1=format!("{:.1}", y - 3.0)
                            y2=format!("{:.1}", y + BAR_H + 3.0)><title>{title}</title></line>
                    });
                    view! {
                        <g class=format!("memory-bar {}", b.kind.as_str()) data-kind=b.kind.as_str()
                            data-rank=b.rank.map(|r| r.to_string()) data-bytes=b.sum.to_string()>
                            <text class="bar-label" x=(LEFT - 8.0).to_string() y=format!("{:.1}", y + BAR_H * 0.68) text-anchor="end">{b.label}</text>
                            // Opaque under the (paler, translucent) planner's segments, so grid lines stay behind.
                            <rect class="bar-bg" x=LEFT.to_string() y=format!("{y:.1}") width=format!("{:.1}", b.end_x - LEFT) height=BAR_H.to_string()></rect>
                            {segments}
                            {at_once}
                            <text class="bar-total" x=format!("{:.1}", b.end_x + 6.0) y=format!("{:.1}", y + BAR_H * 0.68)>
                                {format::bytes(b.sum as f64)}
                            </text>
                        </g>
                    }
                }).collect_view();
                view! {
                    <g>{ticks}</g>
                    {bars}
                    <line class="axis" x1=LEFT.to_string() x2=(WIDTH - RIGHT).to_string() y1=format!("{axis_y:.1}") y2=format!("{axis_y:.1}")></line>
                }
            }}
        </svg>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(parameters: u64, activations: u64) -> RankMemory {
        RankMemory { parameters, activations, total: parameters + activations, ..RankMemory::default() }
    }

    fn bar(kind: BarKind, m: RankMemory) -> Bar {
        Bar { label: kind.as_str().into(), owner: "rank 0".into(), rank: Some(0), kind, memory: m }
    }

    #[test]
    fn byte_axes_use_round_steps_in_one_unit() {
        let mib = 1024.0 * 1024.0;
        let (end, ticks) = byte_ticks(3.3 * mib, 5.0);
        assert_eq!(end, 4.0 * mib);
        let labels: Vec<&str> = ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(labels, vec!["0", "1 MiB", "2 MiB", "3 MiB", "4 MiB"]);
        let (end, ticks) = byte_ticks(1.7 * mib, 5.0);
        assert_eq!((end, ticks[1].1.as_str()), (2.0 * mib, "0.5 MiB"));
        let (end, ticks) = byte_ticks(100.0, 5.0);
        assert_eq!((end, ticks.last().map(|t| t.1.as_str())), (100.0, Some("100 B")));
        // 112 GiB (a 7B model's model state with Adam).
        let (end, ticks) = byte_ticks(112.0 * (1u64 << 30) as f64, 5.0);
        assert_eq!((end / (1u64 << 30) as f64, ticks.last().map(|t| t.1.as_str())), (150.0, Some("150 GiB")));
        // Nothing to show: still a finite axis.
        let (end, ticks) = byte_ticks(0.0, 5.0);
        assert!(end > 0.0 && ticks.len() >= 2);
    }

    #[test]
    fn segments_stack_in_category_order_on_a_shared_scale() {
        let bars = [bar(BarKind::Measured, memory(3000, 1000)), bar(BarKind::Predicted, memory(3000, 0))];
        let m = BarsModel::new(&bars, 0);
        assert_eq!(m.bars.len(), 2);
        let (a, b) = (&m.bars[0], &m.bars[1]);
        assert_eq!(a.segments.len(), 2, "zero categories get no segment");
        assert_eq!(a.segments[0].class, "mem-parameters");
        assert_eq!(a.segments[1].class, "mem-activations");
        assert!((a.segments[0].x - LEFT).abs() < 1e-9);
        assert!((a.segments[1].x - (a.segments[0].x + a.segments[0].w)).abs() < 1e-9, "stacked");
        assert!((a.segments[0].w - b.segments[0].w).abs() < 1e-9, "same bytes, same length");
        assert!(a.end_x > b.end_x && a.end_x <= WIDTH - RIGHT + 1e-9);
        assert_eq!((a.sum, b.sum), (4000, 3000));
        assert!(b.y > a.y && m.axis_y > b.y + BAR_H);
        assert!(a.segments[1].title.contains("activations: 1000 bytes"), "{}", a.segments[1].title);
        assert!(a.at_once.is_none());
        // A larger shared scale shortens every bar.
        let wide = BarsModel::new(&bars, 8000);
        assert!(wide.bars[0].end_x < a.end_x);
    }

    #[test]
    fn measured_peaks_at_different_times_mark_the_true_total() {
        let mut m = memory(4096 * 1024, 4096 * 1024);
        m.total = 6 * 1024 * 1024; // the two peaks never coincided
        let model = BarsModel::new(&[bar(BarKind::Measured, m.clone())], 0);
        let (x, title) = model.bars[0].at_once.clone().expect("marker");
        assert!(x < model.bars[0].end_x);
        assert!(title.contains("6.0 MiB (6,291,456 bytes)"), "{title}");
        // Labels fit inside wide segments only.
        assert_eq!(model.bars[0].segments[0].label.as_deref(), Some("params 4.0 MiB"));
        // The planner's bars have no such marker.
        assert!(BarsModel::new(&[bar(BarKind::Predicted, m)], 0).bars[0].at_once.is_none());
    }

    #[test]
    fn empty_input_is_a_finite_model() {
        let m = BarsModel::new(&[], 0);
        assert!(m.bars.is_empty() && m.height.is_finite() && m.height > 0.0);
        let m = BarsModel::new(&[bar(BarKind::Predicted, RankMemory::default())], 0);
        assert!(m.bars[0].segments.is_empty() && m.bars[0].sum == 0);
    }
}
