//! A training run's numbers while it runs and after: the stats grid (step, loss,
//! throughput, learning rate, gradient norm, fp16 loss scaling, MoE routing, times), the
//! loss chart growing point by point, and the result once it has succeeded.

use distlab_common::{ExperimentSpec, ExperimentStatus, ExpertMetrics, MetricPoint, Precision};
use leptos::prelude::*;

use super::outcome::{CollectivePanel, SummaryPanel};
use super::Live;
use crate::components::loss_chart::{LossChart, Reference};
use crate::components::progress::ProgressBar;
use crate::components::spec_view::one_line;
use crate::format;

/// The stats, the loss chart and the result of a training run.
#[component]
pub(super) fn TrainingRun(
    id: i64,
    name: String,
    spec: ExperimentSpec,
    /// Steps the server counted done when the page loaded the run.
    steps_done_server: u64,
    started: Option<String>,
    finished: Option<String>,
    live: Live,
) -> impl IntoView {
    let Live { status, points, summary, now, .. } = live;
    let total = spec.train.steps;
    let vocab = spec.model.vocab.max(1) as f64;
    let mixed = spec.train.precision != Precision::Fp32;
    let latest = move || points.with(|p| p.last().cloned());
    let steps_done =
        Signal::derive(move || points.with(|p| p.last().map_or(0, |p| p.step + 1)).max(steps_done_server).min(total));
    let refs = Signal::derive(move || {
        let s = summary.get();
        let uniform = s.as_ref().map(|s| s.uniform_loss).filter(|u| u.is_finite() && *u > 0.0).unwrap_or(vocab.ln());
        let mut refs = vec![Reference {
            class: "ref-uniform",
            value: uniform,
            label: format!("uniform guess: ln({}) = {:.3}", vocab as u64, uniform),
            below: false,
        }];
        if let Some(floor) = s.and_then(|s| s.loss_floor) {
            refs.push(Reference {
                class: "ref-floor",
                value: floor,
                label: format!("loss floor (entropy rate) = {floor:.3}"),
                below: true,
            });
        }
        refs
    });
    let title = format!("{name} (#{id}): training loss");
    let subtitle = one_line(&spec);
    let elapsed = move || {
        let start = started.as_deref().and_then(format::parse_time)?;
        let end = match finished.as_deref().and_then(format::parse_time) {
            Some(end) => end,
            None if status.get().is_finished() => return None,
            None => now.get(),
        };
        Some(format::duration((end - start) / 1000.0))
    };
    view! {
        <div class="stats" id="stats">
            <div class="stat wide">
                <span class="k">"step"</span>
                <span class="v" id="step">{move || format!("{} / {}", steps_done.get(), total)}</span>
                <ProgressBar done=steps_done total=total/>
            </div>
            <div class="stat">
                <span class="k">"loss"</span>
                <span class="v" id="loss">{move || latest().map(|p| format!("{:.4}", p.loss)).unwrap_or("–".into())}</span>
            </div>
            <div class="stat">
                <span class="k">"tokens / s"</span>
                <span class="v" id="tokens-per-s">{move || latest().map(|p| format::si(p.tokens_per_s)).unwrap_or("–".into())}</span>
            </div>
            <div class="stat">
                <span class="k">"learning rate"</span>
                <span class="v" id="lr">{move || latest().map(|p| format::num(p.lr)).unwrap_or("–".into())}</span>
            </div>
            <div class="stat">
                <span class="k">"grad norm"</span>
                <span class="v" id="grad-norm">{move || latest().map(|p| grad_norm_text(p.grad_norm)).unwrap_or("–".into())}</span>
            </div>
            {move || latest().and_then(|p| p.loss_scale.map(|scale| (scale, p.skipped_steps.unwrap_or(0)))).map(|(scale, skipped)| view! {
                <div class="stat" title="fp16 dynamic loss scaling: the loss is multiplied by this before backward; a step whose gradient overflows is skipped and the scale halves">
                    <span class="k">"loss scale"</span>
                    <span class="v" id="loss-scale" data-scale=scale.to_string()>
                        {match power_of_two(scale) {
                            Some(e) => view! { "2"<sup>{e}</sup> }.into_any(),
                            None => format::num(scale).into_any(),
                        }}
                    </span>
                    <span class="k" id="skipped-steps">{format!("{skipped} skipped")}</span>
                </div>
            })}
            {move || latest().and_then(|p| p.logit_grad_zero_share).filter(|_| mixed).map(|share| view! {
                <div class="stat" title="measured: of this step's logit gradients (its first 64 tokens), the share stored as exactly 0. None is 0 in exact arithmetic, so in fp16 these are the ones that underflowed; loss scaling lifts them back">
                    <span class="k">"logit grads stored as 0"</span>
                    <span class="v" id="logit-zeros">{format!("{:.1}%", 100.0 * share)}</span>
                </div>
            })}
            {move || latest().and_then(|p| p.experts).map(|e| view! {
                <div class="stat" id="experts" title="Mixture of Experts, this step over every block, micro-batch and rank: the token-to-expert assignments the routers made, those an expert had no room for (its capacity was full: the token went on through the residual alone), and the routers' load-balancing loss (1 when even)">
                    <span class="k">"dropped assignments"</span>
                    <span class="v" id="dropped">{dropped_text(&e)}</span>
                    <span class="k" id="balance">{format!("balance loss {:.3}", e.balance)}</span>
                </div>
            })}
            {move || latest().and_then(|p| p.fp8).map(|f| view! {
                <div class="stat wide" id="fp8" title="FP8, this step on rank 0's blocks (measured by the casts): elements that overflowed the format after scaling (stored as its largest value) and nonzero ones that underflowed to 0, of the linear layers' inputs and weights (E4M3) and their output gradients (E5M2); the scales each kind was cast with">
                    <span class="k">"fp8 saturated / flushed"</span>
                    <span class="v" id="fp8-counts">{fp8_counts(&f)}</span>
                    <span class="k" id="fp8-scales">{fp8_scales(&f)}</span>
                </div>
            })}
            {move || points.with(|p| run_dropped(p)).map(|text| view! {
                <div class="stat" id="run-dropped" title="every step's dropped assignments so far, over every step's assignments">
                    <span class="k">"dropped, whole run"</span>
                    <span class="v">{text}</span>
                </div>
            })}
            <div class="stat">
                <span class="k">"step time"</span>
                <span class="v" id="step-ms">{move || latest().map(|p| format!("{:.1} ms", p.step_ms)).unwrap_or("–".into())}</span>
            </div>
            <div class="stat">
                <span class="k">"elapsed"</span>
                <span class="v" id="elapsed">{move || elapsed().unwrap_or("–".into())}</span>
            </div>
        </div>

        <div class="chart-wrap">
            <LossChart points=points total_steps=total refs=refs title=title subtitle=subtitle/>
        </div>

        {move || {
            let s = summary.get().filter(|_| status.get() == ExperimentStatus::Succeeded)?;
            Some(match s.collective.clone() {
                Some(c) => view! { <CollectivePanel id=id check=c/> }.into_any(),
                None => view! { <SummaryPanel summary=s/> }.into_any(),
            })
        }}
    }
}

/// A gradient norm; the engine reports `f64::MAX` for one that overflowed (a step loss
/// scaling skipped).
fn grad_norm_text(norm: f64) -> String {
    if norm == f64::MAX {
        "overflow".into()
    } else {
        format::num(norm)
    }
}

/// A step's dropped assignments: "67 / 1024 (6.5%)".
fn dropped_text(e: &ExpertMetrics) -> String {
    format!("{} / {} ({:.1}%)", e.dropped, e.assignments, 100.0 * e.dropped_share())
}

/// The dropped assignments of every step so far (None for a dense model).
fn run_dropped(points: &[MetricPoint]) -> Option<String> {
    let steps: Vec<ExpertMetrics> = points.iter().filter_map(|p| p.experts).collect();
    let first = steps.first()?;
    let sum = steps.iter().skip(1).fold(*first, |a, e| ExpertMetrics {
        balance: 0.0,
        assignments: a.assignments + e.assignments,
        dropped: a.dropped + e.dropped,
    });
    Some(dropped_text(&sum))
}

/// The exponent of a loss scale that is a power of two (it starts at 2^16, then halves
/// and doubles), shown as 2 to that power.
fn power_of_two(scale: f64) -> Option<i32> {
    let exponent = scale.log2();
    (scale > 0.0 && exponent.fract() == 0.0).then_some(exponent as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_assignments_read_as_a_share() {
        let step = |dropped, assignments| MetricPoint {
            experts: Some(ExpertMetrics { balance: 1.2, assignments, dropped }),
            ..MetricPoint::default()
        };
        assert_eq!(dropped_text(&step(67, 1024).experts.unwrap()), "67 / 1024 (6.5%)");
        assert_eq!(run_dropped(&[step(67, 1024), step(33, 1024)]), Some("100 / 2048 (4.9%)".into()));
        assert_eq!(run_dropped(&[MetricPoint::default()]), None, "a dense model routes nothing");
    }

    #[test]
    fn an_overflowed_gradient_and_the_loss_scale_read_plainly() {
        assert_eq!(grad_norm_text(f64::MAX), "overflow");
        assert_eq!(grad_norm_text(1.5), format::num(1.5));
        assert_eq!(power_of_two(65536.0), Some(16));
        assert_eq!(power_of_two(0.5), Some(-1));
        assert_eq!(power_of_two(3.0), None);
    }
}

/// A step's FP8 overflow and underflow: saturated / flushed elements over all its casts.
fn fp8_counts(f: &distlab_common::events::Fp8Metrics) -> String {
    let kinds = [f.inputs, f.weights, f.grads];
    let (saturated, flushed) = kinds.iter().fold((0, 0), |(s, z), k| (s + k.saturated, z + k.flushed));
    let elements: u64 = kinds.iter().map(|k| k.elements).sum();
    format!("{saturated} / {flushed} of {}", format::si(elements as f64))
}

/// The scales a step's FP8 casts used, by kind: inputs, weights, gradients (powers of two).
fn fp8_scales(f: &distlab_common::events::Fp8Metrics) -> String {
    let range = |k: &distlab_common::events::Fp8Casts| {
        let e = |x: f64| x.log2().round() as i64;
        match e(k.min_scale) == e(k.max_scale) {
            true => format!("2^{}", e(k.min_scale)),
            false => format!("2^{}..2^{}", e(k.min_scale), e(k.max_scale)),
        }
    };
    format!("scales: inputs {}, weights {}, grads {}", range(&f.inputs), range(&f.weights), range(&f.grads))
}
