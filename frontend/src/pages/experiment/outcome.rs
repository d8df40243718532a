//! What a run came to: a collective demo in words and, once it has run, its check (bytes
//! per rank against the formula, the largest error, the replay link); a training run's
//! result against the uniform guess and the loss floor.

use distlab_common::{CollectiveCheck, DemoOp, ExperimentSpec, RunSummary};
use leptos::prelude::*;
use leptos_router::components::A;

use crate::format;

/// A collective demo in words, while it is queued or running and after.
#[component]
pub(super) fn DemoOverview(spec: ExperimentSpec, op: DemoOp, elements: usize) -> impl IntoView {
    let w = spec.parallel.dp;
    let what = match op {
        DemoOp::AllReduce => "all-reduce: afterwards every rank holds the element-wise sum of all the vectors",
        DemoOp::ReduceScatter => "reduce-scatter: afterwards rank r holds chunk r of the element-wise sum",
        DemoOp::AllGather => {
            "all-gather: rank r contributes chunk r of its vector; afterwards every rank holds all the chunks"
        }
        DemoOp::AllToAll => {
            "all-to-all: every rank cuts its vector into one chunk per rank and sends chunk j to rank j; afterwards chunk i of rank j's vector is what rank i meant for it"
        }
    };
    view! {
        <div class="demo-overview" id="demo-overview">
            <p>
                <strong>"Collective demo, no training. "</strong>
                {format!("{w} rank processes run one {what}. Each holds {elements} numbers; rank r starts with (r+1)·100 + i, so every number can be checked by hand.")}
            </p>
        </div>
    }
}

/// The outcome of a collective demo: bytes per rank against the formula, and the error.
#[component]
pub(super) fn CollectivePanel(id: i64, check: CollectiveCheck) -> impl IntoView {
    let c = check;
    let w = c.world;
    let d = c.elements * 4;
    let formula = match c.op {
        DemoOp::AllReduce => format!("2(W-1)/W × D = 2·{}/{w} × {d} B", w.saturating_sub(1)),
        _ => format!("(W-1)/W × D = {}/{w} × {d} B", w.saturating_sub(1)),
    };
    // Another all-reduce than the ring: each rank against its own share by that algorithm.
    let expected = |r: usize| c.rank_formula_bytes.get(r).map_or(c.formula_bytes, |&b| b as f64);
    let exact = c.bytes_sent.iter().enumerate().all(|(r, &b)| b as f64 == expected(r));
    let algorithm = (!c.rank_formula_bytes.is_empty()).then(|| {
        let shares: Vec<String> = c.rank_formula_bytes.iter().map(|b| format!("{b} B")).collect();
        format!(
            "This demo ran the {} all-reduce: whole buffers of D = {d} B, so each rank sends D per buffer it passes on ({}), where the ring would have every rank send {}.",
            c.algorithm.as_str(),
            shares.join(", "),
            formula
        )
    });
    let ok = c.max_abs_error == 0.0;
    let rows = c
        .bytes_sent
        .iter()
        .enumerate()
        .map(|(r, &b)| {
            let equal = b as f64 == expected(r);
            view! {
                <tr data-rank=r.to_string()>
                    <td>{format!("rank {r}")}</td>
                    <td class="bytes" data-bytes=b.to_string()>{format!("{b} B")}</td>
                    <td class=if equal { "ok" } else { "muted" }>
                        {if equal { "= formula".to_string() } else { format!("{:+} B vs formula (uneven chunks)", b as f64 - expected(r)) }}
                    </td>
                </tr>
            }
        })
        .collect_view();
    view! {
        <div class=if ok { "summary collective-check" } else { "summary collective-check bad" } id="collective-check" data-exact=exact.to_string()>
            <h2>"Collective check"</h2>
            <p class="headline">
                {format!("{} of {} numbers over {}W = {w} ranks: ", c.op.as_str(), c.elements, if c.rank_formula_bytes.is_empty() { "a ring of " } else { "" })}
                {if ok {
                    view! { <span>"every rank's result equals a sequential computation exactly (largest error " <strong id="max-error">{format::num(c.max_abs_error)}</strong> ")."</span> }.into_any()
                } else {
                    view! { <span>"the largest difference from a sequential computation is " <strong id="max-error">{format::num(c.max_abs_error)}</strong> "."</span> }.into_any()
                }}
            </p>
            {match algorithm {
                Some(text) => view! { <p id="collective-algorithm">{text} {if exact { " Every rank sent exactly its share." } else { "" }}</p> }.into_any(),
                None => view! {
                    <p>
                        "Bytes each rank sent, against the textbook " <strong>{formula}</strong> " = "
                        <strong id="formula-bytes">{format::value(c.formula_bytes as f32)} " B"</strong>
                        {if exact { " — exactly, on every rank." } else { "." }}
                    </p>
                }.into_any(),
            }}
            <table class="bytes-table" id="collective-bytes">
                <thead><tr><th>"rank"</th><th>"bytes sent"</th><th></th></tr></thead>
                <tbody>{rows}</tbody>
            </table>
            <p class="replay-cta">
                <A href=format!("/experiments/{id}/ring") attr:class="button primary big" attr:id="replay-link">"▶ Replay the ring, step by step"</A>
                <span class="muted small">" watch the partial sums travel round the ring and check every number"</span>
            </p>
        </div>
    }
}

/// What a successful run ended with, against what was possible.
#[component]
pub(super) fn SummaryPanel(summary: RunSummary) -> impl IntoView {
    let s = summary;
    let learned = s.uniform_loss - s.final_loss;
    let floor_text = s.loss_floor.map(|floor| {
        let gap = s.final_loss - floor;
        let share = if s.uniform_loss - floor > 0.0 { learned / (s.uniform_loss - floor) * 100.0 } else { 0.0 };
        if gap > 0.0 {
            format!(
                "The best possible loss on this data (the chain's entropy rate) is {floor:.4}: the run ended {gap:.4} nats above it, {share:.0}% of the way there from a uniform guess."
            )
        } else {
            format!(
                "The best possible loss on this data (the chain's entropy rate) is {floor:.4}: the run reached it (a last batch can score a little below the floor by chance)."
            )
        }
    });
    view! {
        <div class="summary" id="summary">
            <h2>"Result"</h2>
            <p class="headline">
                "Final loss " <strong id="final-loss">{format!("{:.4}", s.final_loss)}</strong> " nats/token "
                "(lowest " {format!("{:.4}", s.min_loss)} ") vs " {format!("{:.4}", s.uniform_loss)}
                " for a uniform guess ln(vocab): the model learned " {format!("{learned:.3}")} " nats/token."
            </p>
            {floor_text.map(|t| view! { <p>{t}</p> })}
            {per_byte_text(&s).map(|t| view! { <p id="loss-per-byte">{t}</p> })}
            <dl class="summary-grid">
                <div><dt>"steps"</dt><dd>{s.steps}</dd></div>
                <div><dt>"parameters"</dt><dd>{format::si(s.params as f64)}</dd></div>
                <div><dt>"tokens"</dt><dd>{format::si(s.tokens as f64)}</dd></div>
                <div><dt>"tokens / s (mean)"</dt><dd>{format::si(s.tokens_per_s)}</dd></div>
                <div><dt>"step time (mean)"</dt><dd>{format!("{:.1} ms", s.mean_step_ms)}</dd></div>
                <div><dt>"wall time"</dt><dd>{format::duration(s.wall_s)}</dd></div>
                <div><dt>"ranks"</dt><dd>{s.world_size}</dd></div>
                <div><dt>"threads"</dt><dd>{s.threads}</dd></div>
                <div><dt>"model FLOP/s"</dt><dd id="model-flops">{format::si(s.model_flops_per_s)}</dd></div>
                <div>
                    <dt>"MFU"</dt>
                    <dd id="mfu">{s.mfu.map(|m| format!("{:.1}%", m * 100.0)).unwrap_or("–".into())}</dd>
                </div>
                {(!s.stage_mfu.is_empty()).then(|| view! {
                    <div>
                        <dt>"MFU by pipeline stage"</dt>
                        <dd id="stage-mfu">
                            {s.stage_mfu.iter().map(|m| format!("{:.1}%", m * 100.0)).collect::<Vec<_>>().join(" · ")}
                        </dd>
                    </div>
                })}
            </dl>
            {utilisation_text(&s)}
        </div>
    }
}

/// A text run's validation loss per byte, which compares with a run of another tokenizer
/// (a BPE token is a couple of bytes: its loss per token is not a byte's).
fn per_byte_text(s: &RunSummary) -> Option<String> {
    let (loss, bytes) = (s.final_val_loss?, s.held_out_bytes_per_token?);
    let per_byte = loss / bytes;
    Some(if bytes == 1.0 {
        format!("Validation loss {loss:.4} nats per token, one token per byte: {per_byte:.4} nats per byte.")
    } else {
        format!(
            "Validation loss {loss:.4} nats per token; the held-out text is {bytes:.3} bytes per token (its bytes / its BPE tokens), so {per_byte:.4} nats per byte: the number to compare with a byte model's validation loss."
        )
    })
}

/// How the run's MFU is made, with its numbers: the formula, then where the peak comes from.
fn utilisation_text(s: &RunSummary) -> Option<impl IntoView> {
    if s.model_flops_per_s <= 0.0 {
        return None;
    }
    let formula = format!(
        "MFU = model FLOP/s / peak FLOP/s, where model FLOP/s = (6 x parameters + 12 x layers x seq_len x d_model) FLOPs per token x tokens/s = {}FLOP/s (recomputed activations not counted).",
        format::si(s.model_flops_per_s)
    );
    let peak = match &s.peak {
        Some(p) => format!("Peak: {}FLOP/s, the {}.", format::si(p.flops_per_s), p.basis),
        None => "Peak: unknown for this device, so no MFU.".to_string(),
    };
    let stages = (!s.stage_mfu.is_empty()).then_some(
        " By stage: every stage runs at the pipeline's one pace, so a stage's ranks compute its part of the model's FLOPs per token (its blocks' 6 x parameters and attention, the embeddings on the first stage, the final norm and head on the last) x tokens/s; the stages' mean is the run's MFU.",
    );
    Some(view! { <p class="note" id="mfu-formula">{formula} " " {peak} {stages}</p> })
}
