//! The experiment page's memory card: for every rank, the engine's measured memory by
//! category next to the planner's prediction (stacked bars on one shared scale), the
//! server's line for every category where they differ, and the rank's memory over time.
//!
//! Before the run has reported (queued, running, or an engine that does not measure
//! memory), the card shows the planner's prediction alone, computed in the browser by
//! the same planner the server runs ([`predicted_only`]).

use distlab_common::memory::{MemoryView, RankMemoryReport, RankMemoryView};
use distlab_common::planner;
use distlab_common::ExperimentSpec;
use leptos::prelude::*;

use crate::components::doc_link::DocLink;
use crate::components::memory_bars::{sum_of_categories, Bar, BarKind, MemoryBars, MemoryLegend};
use crate::components::memory_timeline::MemoryTimeline;
use crate::format;

/// The view before any measurement: every rank with the planner's prediction for its
/// stage and nothing measured (None when the spec cannot be planned).
pub fn predicted_only(spec: &ExperimentSpec) -> Option<MemoryView> {
    let plan = planner::plan(spec).ok()?;
    let ranks = (0..spec.world_size())
        .map(|rank| {
            let stage = spec.stage_of(rank);
            RankMemoryView {
                rank: rank as u32,
                stage,
                measured: None,
                predicted: plan.rank_memory(spec, rank),
                differences: Vec::new(),
            }
        })
        .collect();
    Some(MemoryView { ranks, plan })
}

/// A rank's bars: its measured peak (when reported), then the planner's prediction.
pub fn rank_bars(r: &RankMemoryView) -> Vec<Bar> {
    let owner = format!("rank {}", r.rank);
    let mut bars = Vec::new();
    if let Some(m) = &r.measured {
        bars.push(Bar {
            label: "measured (peak)".into(),
            owner: owner.clone(),
            rank: Some(r.rank),
            kind: BarKind::Measured,
            memory: m.peak.clone(),
        });
    }
    bars.push(Bar {
        label: "planner".into(),
        owner,
        rank: Some(r.rank),
        kind: BarKind::Predicted,
        memory: r.predicted.clone(),
    });
    bars
}

/// What the rank process measured of itself next to what the ledger booked: the heap at
/// its peak (counting allocator), how much of it the ledger's peak total explains, the
/// rest as "untracked", and the peak resident set (None when nothing was measured).
pub fn process_line(m: &RankMemoryReport) -> Option<String> {
    let p = m.process.as_ref()?;
    let mut parts = Vec::new();
    if let (Some(heap), Some(untracked)) = (p.heap_peak, m.untracked()) {
        parts.push(format!("process heap peak {} (every allocation counted)", format::bytes(heap as f64)));
        let booked = m.booked_heap_peak.unwrap_or(m.peak.total);
        let shared = if m.shared_peak > 0 {
            format!(" (and {} in shared memory, not on the heap)", format::bytes(m.shared_peak as f64))
        } else {
            String::new()
        };
        parts.push(format!("ledger booked {} on the heap{shared}", format::bytes(booked as f64)));
        let sign = if untracked < 0 { "-" } else { "" };
        parts.push(format!(
            "untracked {sign}{} ({:.0}% of the heap peak)",
            format::bytes(untracked.unsigned_abs() as f64),
            100.0 * untracked as f64 / heap.max(1) as f64
        ));
    }
    if let Some(start) = &p.start_up {
        parts.push(format!(
            "at start-up heap {} for ledger {}",
            format::bytes(start.heap_peak as f64),
            format::bytes(start.ledger_peak as f64)
        ));
    }
    if m.pipe_bytes > 0 {
        parts.push(format!("pipes to the other ranks: {} of shared memory mapped", format::bytes(m.pipe_bytes as f64)));
    }
    if let Some(rss) = p.peak_resident {
        parts.push(format!("peak resident {} (heap, stacks, shared-memory pipes, code)", format::bytes(rss as f64)));
    }
    if let Some(device) = p.device_used {
        parts.push(format!("GPU memory in use {}", format::bytes(device as f64)));
    }
    (!parts.is_empty()).then(|| parts.join(" · "))
}

/// What is kept off the device (ZeRO-Offload's optimizer state, activation offload's
/// blocks), measured next to the planner (None when neither has any). It is not device memory, so not in the bars.
pub fn offloaded_line(r: &RankMemoryView) -> Option<String> {
    let measured = r.measured.as_ref().map_or(0, |m| m.peak.offloaded);
    if measured == 0 && r.predicted.offloaded == 0 {
        return None;
    }
    let measured = match &r.measured {
        Some(_) => format!("measured {}", format::bytes(measured as f64)),
        None => "not measured yet".into(),
    };
    Some(format!(
        "Offloaded off the device (host memory, or a file on disk: ZeRO-Offload's optimizer state, activation \
         offload's blocks at their peak), not in the bars: {measured} · planner {}. On the device: what the bars' \
         optimizer segment shows (with disk offload, the one piece being updated) and their activations (with \
         activation offload, each block's output and the blocks on their way).",
        format::bytes(r.predicted.offloaded as f64)
    ))
}

/// The longest bar of any rank: every rank's chart uses this scale, so bars compare across ranks.
pub fn shared_scale(view: &MemoryView) -> u64 {
    view.ranks.iter().flat_map(rank_bars).map(|b| sum_of_categories(&b.memory)).max().unwrap_or(0)
}

/// What the card says about where its numbers come from.
fn provenance(view: &MemoryView, finished: bool) -> &'static str {
    let measured = view.ranks.iter().filter(|r| r.measured.is_some()).count();
    if measured == view.ranks.len() && measured > 0 {
        "Measured: the engine's buffers, booked where they are allocated (a micro-batch's activations from its \
         forward to the end of its backward), each category at its own highest point during the run; under each \
         rank, the process heap with every allocation counted. Next to it, the analytic planner's prediction for \
         the rank's pipeline stage."
    } else if measured > 0 {
        "Some ranks have reported their measured memory; the others show the planner's prediction alone."
    } else if finished {
        "The ranks did not report their memory (the engine that ran this does not measure it): \
         only the planner's prediction is shown."
    } else {
        "The planner's prediction for every rank; each rank's measured memory appears next to it when the run ends."
    }
}

#[component]
pub fn MemorySection(
    #[prop(into)] view: Signal<Option<MemoryView>>,
    #[prop(into)] finished: Signal<bool>,
) -> impl IntoView {
    move || {
        let v = view.get()?;
        let scale = shared_scale(&v);
        let bpp = v.plan.bytes_per_param;
        let note = provenance(&v, finished.get());
        let pipeline = v.plan.stages.len() > 1;
        let ranks = v
            .ranks
            .into_iter()
            .map(|r| view! { <RankMemoryBlock rank=r scale=scale pipeline=pipeline/> })
            .collect_view();
        Some(view! {
            <section class="card" id="memory-card">
                <h2>"Memory of every rank"</h2>
                <DocLink page="memory"/>
                <p class="muted small" id="memory-provenance">{note}</p>
                <p class="muted small">
                    {format!(
                        "Model state costs {} bytes per parameter here ({} parameters + {} gradients + {} optimizer state, before any sharding). ",
                        bpp.parameters + bpp.gradients + bpp.optimizer_state,
                        bpp.parameters,
                        bpp.gradients,
                        bpp.optimizer_state
                    )}
                    "Hover a segment for its exact byte count."
                </p>
                <MemoryLegend/>
                {ranks}
            </section>
        })
    }
}

/// One rank: bars, differences, memory over time (`pipeline`: name the rank's stage).
#[component]
fn RankMemoryBlock(rank: RankMemoryView, scale: u64, pipeline: bool) -> impl IntoView {
    let r = rank;
    let bars = rank_bars(&r);
    let predicted_total = r.predicted.total;
    let head = match &r.measured {
        Some(m) => format!(
            "measured peak {} · planner {}",
            format::bytes(m.peak.total as f64),
            format::bytes(predicted_total as f64)
        ),
        None => format!("planner {}", format::bytes(predicted_total as f64)),
    };
    let differences = r.measured.as_ref().map(|_| {
        if r.differences.is_empty() {
            view! { <p class="memory-equal">"✓ measured equals the planner in every category it predicts (transient, transport and checkpoint copies are measured only)"</p> }.into_any()
        } else {
            view! {
                <ul class="memory-differences">
                    {r.differences.iter().map(|d| view! { <li>{d.clone()}</li> }).collect_view()}
                </ul>
            }
            .into_any()
        }
    });
    let offloaded = offloaded_line(&r).map(|line| view! { <p class="memory-offloaded small">{line}</p> });
    let process = r.measured.as_ref().and_then(process_line).map(|line| {
        view! { <p class="memory-process small" title="untracked = heap peak - the most the ledger booked on the heap at once">{line}</p> }
    });
    let timeline = r.measured.as_ref().filter(|m| !m.timeline.is_empty()).map(|m| {
        let samples = m.timeline.clone();
        let steps: Vec<u64> = {
            let mut s: Vec<u64> = samples.iter().map(|s| s.step).collect();
            s.dedup();
            s
        };
        let which = match steps.as_slice() {
            [one] => format!("step {one}"),
            [first, .., last] => format!("steps {first} to {last}"),
            [] => String::new(),
        };
        view! {
            <h4>{format!("Memory over time ({} samples, {which})", samples.len())}</h4>
            <MemoryTimeline samples=samples predicted_total=predicted_total rank=r.rank/>
        }
    });
    view! {
        <div class="memory-rank" data-rank=r.rank.to_string() data-measured=r.measured.is_some().to_string()>
            <h3>
                {format!("rank {}", r.rank)}
                <span class="muted">
                    {pipeline.then(|| format!(" · pipeline stage {}", r.stage))}
                    {format!(" · {head}")}
                </span>
            </h3>
            <MemoryBars bars=bars scale_max=scale/>
            {differences}
            {offloaded}
            {process}
            {timeline}
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::memory::ProcessMemory;

    fn spec(dp: usize, pp: usize) -> ExperimentSpec {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = dp;
        spec.parallel.pp = pp;
        spec.model.layers = spec.model.layers.max(pp);
        spec
    }

    #[test]
    fn predicted_only_covers_every_rank_with_its_stage() {
        let s = spec(2, 2);
        let v = predicted_only(&s).expect("plannable");
        assert_eq!(v.ranks.len(), 4);
        for r in &v.ranks {
            assert_eq!(r.stage, s.stage_of(r.rank as usize));
            assert_eq!(r.predicted, v.plan.stages[r.stage].memory);
            assert!(r.measured.is_none() && r.differences.is_empty());
        }
        let mut bad = spec(1, 1);
        bad.model.heads = 3;
        assert!(predicted_only(&bad).is_none());
    }

    #[test]
    fn bars_put_measured_before_the_planner_on_a_shared_scale() {
        let mut v = predicted_only(&spec(2, 1)).expect("plan");
        assert_eq!(rank_bars(&v.ranks[0]).iter().map(|b| b.kind).collect::<Vec<_>>(), vec![BarKind::Predicted]);
        let mut peak = v.ranks[1].predicted.clone();
        peak.activations *= 3;
        v.ranks[1].measured = Some(RankMemoryReport { rank: 1, peak: peak.clone(), ..Default::default() });
        let bars = rank_bars(&v.ranks[1]);
        assert_eq!(bars.iter().map(|b| b.kind).collect::<Vec<_>>(), vec![BarKind::Measured, BarKind::Predicted]);
        assert_eq!(bars[0].memory, peak);
        assert_eq!(shared_scale(&v), sum_of_categories(&peak));
        assert!(provenance(&v, true).starts_with("Some ranks"));
        v.ranks[0].measured = v.ranks[1].measured.clone();
        assert!(provenance(&v, true).starts_with("Measured"));
        v.ranks.iter_mut().for_each(|r| r.measured = None);
        assert!(provenance(&v, true).starts_with("The ranks did not report"));
        assert!(provenance(&v, false).starts_with("The planner's prediction"));
    }

    #[test]
    fn the_offloaded_state_is_shown_beside_the_bars_measured_and_planned() {
        let mut s = spec(2, 1);
        let v = predicted_only(&s).expect("plan");
        assert_eq!(offloaded_line(&v.ranks[0]), None, "nothing offloaded");
        s.parallel.offload = distlab_common::Offload::Disk;
        let mut v = predicted_only(&s).expect("plan");
        let planned = v.ranks[0].predicted.offloaded;
        assert!(planned > 0);
        assert!(offloaded_line(&v.ranks[0]).unwrap().contains("not measured yet"));
        let peak = planner::RankMemory { offloaded: planned / 2, ..Default::default() };
        v.ranks[0].measured = Some(RankMemoryReport { peak, ..Default::default() });
        let line = offloaded_line(&v.ranks[0]).unwrap();
        let (half, whole) = (format::bytes((planned / 2) as f64), format::bytes(planned as f64));
        assert!(line.contains(&format!("measured {half} · planner {whole}")), "{line}");
    }

    #[test]
    fn the_process_line_says_how_much_the_ledger_leaves_out() {
        let mut m = RankMemoryReport::default();
        assert_eq!(process_line(&m), None);
        m.peak.total = 3 << 20;
        m.process =
            Some(ProcessMemory { heap_peak: Some(4 << 20), peak_resident: Some(10 << 20), ..Default::default() });
        let line = process_line(&m).unwrap();
        assert!(line.contains("process heap peak 4.0 MiB"), "{line}");
        assert!(line.contains("ledger booked 3.0 MiB on the heap ·"), "{line}");
        assert!(line.contains("untracked 1.0 MiB (25% of the heap peak)"), "{line}");
        assert!(line.contains("peak resident 10.0 MiB"), "{line}");
        m.peak.total = 5 << 20;
        assert!(process_line(&m).unwrap().contains("untracked -1.0 MiB"));
        // DDP's buckets live in shared memory: the heap is set against the rest.
        (m.shared_peak, m.booked_heap_peak) = (2 << 20, Some(3 << 20));
        let line = process_line(&m).unwrap();
        assert!(line.contains("ledger booked 3.0 MiB on the heap (and 2.0 MiB in shared memory"), "{line}");
        assert!(line.contains("untracked 1.0 MiB"), "{line}");
    }
}
