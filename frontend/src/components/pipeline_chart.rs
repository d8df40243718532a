//! One step of a pipeline schedule: a row per stage, a numbered box per forward (F)
//! and backward (B) of each micro-batch, waits hatched, a time axis in ms from the
//! step's first forward.

use distlab_common::trace::SpanKind;
use leptos::prelude::*;

use crate::components::loss_chart::nice_step;
use distlab_common::pipeline::{measured_bubble, StageRow};

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 12.0;
const ROW_H: f64 = 24.0;
const ROW_GAP: f64 = 8.0;
const BOTTOM: f64 = 40.0;

/// Draws `rows` (labelled by `stages[i]`) on one time axis.
#[component]
pub fn PipelineChart(rows: Vec<StageRow>, stages: Vec<usize>, #[prop(into)] id: String) -> impl IntoView {
    let t0 = measured_bubble(&rows).map(|b| b.window.0).unwrap_or(0);
    let t1 = rows.iter().flat_map(|r| r.spans.iter().map(|s| s.end_us)).max().unwrap_or(t0).max(t0 + 1);
    let span_ms = (t1.saturating_sub(t0)) as f64 / 1000.0;
    let tick = nice_step(span_ms / 8.0);
    let axis_ms = (span_ms / tick).ceil().max(1.0) * tick;
    let plot_w = WIDTH - LEFT - RIGHT;
    let sx = move |us: u64| LEFT + us.saturating_sub(t0) as f64 / 1000.0 / axis_ms * plot_w;
    let bottom = TOP + rows.len() as f64 * (ROW_H + ROW_GAP);
    let height = bottom + BOTTOM;
    let decimals = if tick >= 1.0 { 0 } else { (-tick.log10().floor()) as usize };
    let ticks = (0..=((axis_ms / tick).round() as i64))
        .map(|i| {
            let ms = i as f64 * tick;
            let x = LEFT + ms / axis_ms * plot_w;
            view! {
                <line class="grid-line" x1=format!("{x:.1}") x2=format!("{x:.1}") y1=TOP.to_string() y2=format!("{bottom:.1}")></line>
                <text class="tick" x=format!("{x:.1}") y=format!("{:.1}", bottom + 16.0) text-anchor="middle">{format!("{ms:.decimals$}")}</text>
            }
        })
        .collect_view();
    let body = rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let y = TOP + i as f64 * (ROW_H + ROW_GAP);
            let stage = stages.get(i).copied().unwrap_or(i);
            let boxes = row
                .spans
                .iter()
                .filter(|s| s.end_us > t0)
                .map(|s| {
                    let x = sx(s.start_us);
                    let w = (sx(s.end_us) - x).max(1.0);
                    let (class, letter) = match s.kind {
                        SpanKind::Forward => ("pp-box span-forward", "F"),
                        SpanKind::Backward => ("pp-box span-backward", "B"),
                        SpanKind::Weights => ("pp-box span-weights", "W"),
                        _ => ("pp-idle", ""),
                    };
                    let micro = s.micro.map(|m| m.to_string()).unwrap_or_default();
                    // Interleaved: which of the stage's chunks, as a letter (a, b, ...),
                    // and every other chunk a lighter shade.
                    let chunk = s.chunk.map(|c| char::from(b'a' + (c % 26) as u8).to_string()).unwrap_or_default();
                    let class = match s.chunk {
                        Some(c) if c % 2 == 1 => format!("{class} pp-chunk-odd"),
                        _ => class.to_string(),
                    };
                    let label = (!letter.is_empty()).then(|| {
                        let text = if w >= 18.0 { format!("{letter}{micro}{chunk}") } else { micro.clone() };
                        view! { <text class="pp-label" x=format!("{:.1}", x + w / 2.0) y=format!("{:.1}", y + ROW_H * 0.68) text-anchor="middle">{text}</text> }
                    });
                    let title = format!(
                        "stage {stage} · {} · {:.3} ms · starts at {:.3} ms",
                        s.name,
                        s.end_us.saturating_sub(s.start_us) as f64 / 1000.0,
                        s.start_us.saturating_sub(t0) as f64 / 1000.0
                    );
                    view! {
                        <g class=if letter.is_empty() { "pp-wait" } else { "pp-span" } data-micro=micro.clone() data-chunk=chunk>
                            <rect class=class x=format!("{x:.1}") y=format!("{y:.1}") width=format!("{w:.1}") height=ROW_H.to_string() rx="2">
                                <title>{title}</title>
                            </rect>
                            {label}
                        </g>
                    }
                })
                .collect_view();
            view! {
                <g class="pp-row" data-stage=stage.to_string()>
                    <text class="lane-label rank" x=(LEFT - 8.0).to_string() y=format!("{:.1}", y + ROW_H * 0.7) text-anchor="end">{format!("stage {stage}")}</text>
                    {boxes}
                </g>
            }
        })
        .collect_view();
    view! {
        <svg class="chart pipeline-chart" id=id viewBox=format!("0 0 {WIDTH} {height:.0}") role="img" aria-label="pipeline schedule: one row per stage">
            <defs>
                <pattern id="pp-hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
                    <rect width="6" height="6" fill="#eef0f4"></rect>
                    <line x1="0" y1="0" x2="0" y2="6" stroke="#b4bac6" stroke-width="2"></line>
                </pattern>
            </defs>
            <rect class="chart-bg" x="0" y="0" width=WIDTH.to_string() height=format!("{height:.0}")></rect>
            <g>{ticks}</g>
            {body}
            <line class="axis" x1=LEFT.to_string() x2=(WIDTH - RIGHT).to_string() y1=format!("{bottom:.1}") y2=format!("{bottom:.1}")></line>
            <text class="axis-title" x=(LEFT + plot_w / 2.0).to_string() y=format!("{:.1}", bottom + 34.0) text-anchor="middle">"ms since the step's first forward"</text>
        </svg>
    }
}
