//! Where a run leads on: its ring replay (a training run with recorded collectives), its
//! attempts when a worker was lost on the way, the "continue from step K" link once it
//! has ended with a checkpoint, and its pipeline schedule.

use distlab_common::elastic::latest_checkpoint;
use distlab_common::{AttemptView, ExperimentSpec};
use leptos::prelude::*;
use leptos_router::components::A;

use super::Live;
use crate::format;
use crate::ring_replay::ring_collectives;

#[component]
pub(super) fn RunLinks(id: i64, spec: ExperimentSpec, live: Live) -> impl IntoView {
    let Live { status, points, trace, attempts, .. } = live;
    // The demo's own panel links the replay; a training run links it here.
    let training = spec.demo.is_none();
    view! {
        {move || trace.with(|t| t.as_ref().map(|t| ring_collectives(t).len())).filter(|&n| n > 0 && training)
            .map(|n| view! {
                <p class="replay-line">
                    <A href=format!("/experiments/{id}/ring") attr:class="button" attr:id="replay-link">"Replay the ring →"</A>
                    " " {format!("{n} collective{} recorded step by step", if n == 1 { "" } else { "s" })}
                </p>
            })}
        {move || {
            let list = attempts.get();
            (list.len() > 1).then(|| view! {
                <div class="attempts" id="attempts">
                    <h3>"Attempts"</h3>
                    <p class="muted small">
                        "A worker that stops answering loses its lease and the experiment goes back to the queue; "
                        "the next worker resumes from the latest complete checkpoint. The steps run after that checkpoint were lost and are run again."
                    </p>
                    <ul>
                        {list.iter().map(|a| view! {
                            <li class="attempt">{attempt_line(a)} <span class="muted">" · leased " {format::local_time(&a.started_at)}</span></li>
                        }).collect_view()}
                    </ul>
                </div>
            })
        }}
        {(spec.demo.is_none() && spec.train.checkpoint_every > 0).then(|| {
            let kept_by = spec.clone();
            move || {
                let done = points.with(|p| p.last().map_or(0, |p| p.step + 1));
                let step = latest_checkpoint(&kept_by, done).filter(|_| status.get().is_finished())?;
                Some(view! {
                    <p class="replay-line">
                        <A href=format!("/new?resume_from={id}&step={step}") attr:class="button" attr:id="continue-link">{format!("Continue from step {step} →")}</A>
                        " in a new experiment with another dp or sharding: its checkpoint is re-cut for the new ranks, the global batch kept"
                    </p>
                })
            }
        })}
        {(spec.parallel.pp > 1).then(|| view! {
            <p class="replay-line">
                <A href=format!("/experiments/{id}/pipeline") attr:class="button" attr:id="pipeline-link">"Pipeline schedule →"</A>
                " " {format!("{} stages, {} schedule: every forward and backward, and the bubble", spec.parallel.pp, spec.parallel.pp_schedule.title())}
            </p>
        })}
    }
}

/// What one attempt did, in a line.
fn attempt_line(a: &AttemptView) -> String {
    let worker = a.worker.as_deref().unwrap_or("a worker that is gone");
    let start = match a.from_step {
        None => "has not reported where it starts yet".to_string(),
        Some(0) if a.attempt == 1 => "started at step 0".to_string(),
        Some(0) => "started over at step 0 (no complete checkpoint)".to_string(),
        Some(step) => format!("resumed from the checkpoint of step {step}"),
    };
    let lost = match a.lost_steps {
        0 => String::new(),
        1 => " · 1 step lost and run again".to_string(),
        n => format!(" · {n} steps lost and run again"),
    };
    format!("attempt {} on {worker}: {start}{lost}", a.attempt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_says_where_it_resumed_and_what_was_lost() {
        let a = |attempt, from_step, lost_steps| AttemptView {
            attempt,
            worker: Some("w".into()),
            started_at: String::new(),
            from_step,
            lost_steps,
        };
        assert_eq!(attempt_line(&a(1, Some(0), 0)), "attempt 1 on w: started at step 0");
        assert_eq!(
            attempt_line(&a(2, Some(20), 4)),
            "attempt 2 on w: resumed from the checkpoint of step 20 · 4 steps lost and run again"
        );
        assert_eq!(
            attempt_line(&a(3, Some(0), 1)),
            "attempt 3 on w: started over at step 0 (no complete checkpoint) · 1 step lost and run again"
        );
        assert_eq!(attempt_line(&a(2, None, 0)), "attempt 2 on w: has not reported where it starts yet");
    }
}
