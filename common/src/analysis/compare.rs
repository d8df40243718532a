//! Runs side by side (`GET /api/compare?ids=1,2,3`): each run's metrics and a summary row,
//! the config diff (with quantities derived from the spec), an "equivalent?" verdict
//! for each run against the first, and seed bands over runs that differ only in seeds.
//!
//! Everything here is a pure function of specs, metrics and traces, so the server builds
//! the view and tests check it without a database.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::plan::planner::{Plan, RankMemory};
use crate::wire::events::MetricPoint;
use crate::wire::trace::{CollectiveOp, RankTrace, Span, SpanKind};
use crate::{ExperimentSpec, ExperimentView, Precision};

/// How many experiments one comparison takes.
pub const MIN_RUNS: usize = 2;
pub const MAX_RUNS: usize = 6;

/// `GET /api/compare?ids=...`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CompareView {
    /// In the order the ids were given; the first is the baseline of the verdicts.
    pub runs: Vec<ComparedRun>,
    /// Every spec field and derived quantity, one row each (`differs` marks the diff).
    pub config: Vec<ConfigRow>,
    /// Each run after the first against the first.
    pub equivalence: Vec<Equivalence>,
    /// Groups of two or more runs with the same spec up to its seeds.
    pub seed_bands: Vec<SeedBand>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ComparedRun {
    pub experiment: ExperimentView,
    pub metrics: Vec<MetricPoint>,
    pub stats: RunStats,
}

/// A run's row of the summary table. Measured values are None until the run reports them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunStats {
    pub final_loss: Option<f64>,
    pub tokens_per_s: Option<f64>,
    /// Model FLOP utilisation, from the run's summary (None without a known peak).
    #[serde(default)]
    pub mfu: Option<f64>,
    pub step_ms: Option<f64>,
    /// Where a step's time went, from the ranks' timelines.
    pub time_split: Option<TimeSplit>,
    /// Each category's highest peak over the ranks (`total`: the highest rank total).
    pub peak_memory: Option<RankMemory>,
    /// Data-parallel bytes the busiest rank sent per step, counted by its collectives (the
    /// data-parallel ring is the traced one; tensor and pipeline traffic is not counted).
    /// None when nothing was traced (a run with several ranks and no counters).
    pub dp_comm_bytes_per_step: Option<f64>,
    /// Some of those bytes are NCCL's formula, not counted as they were sent.
    #[serde(default)]
    pub dp_comm_bytes_from_formula: bool,
    /// The planner's data-parallel bytes per step for the busiest rank.
    pub predicted_dp_comm_bytes_per_step: Option<u64>,
    /// The planner's pipeline bubble: (P-1)/(M+P-1), 0 without pipeline parallelism.
    pub predicted_bubble: Option<f64>,
    /// The pipeline bubble measured: the run's step replayed from its stages' passes with a
    /// core per stage, as the formulas count it (`pipeline::replayed_bubble`); None without
    /// pipeline parallelism.
    #[serde(default)]
    pub bubble: Option<f64>,
}

/// Mean milliseconds per recorded step and rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TimeSplit {
    /// Forward, backward and optimizer on the compute thread, less the tensor-parallel
    /// all-reduces the compute thread waits for inside them.
    pub compute_ms: f64,
    /// Communication the step waited for: tensor-parallel all-reduces, and data-parallel
    /// collectives that no compute ran under.
    pub comm_ms: f64,
    /// Neither: waiting for a pipeline neighbour, the last bucket, the scheduler.
    pub idle_ms: f64,
    /// Steps the timelines cover (the first, warm-up, step is left out when there are more).
    pub steps: u64,
}

/// One row of the config diff.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConfigRow {
    /// A dotted spec path ("parallel.dp") or, for derived rows, a name ("world size").
    pub field: String,
    /// One value per run, as text.
    pub values: Vec<String>,
    pub differs: bool,
    /// Computed from the spec rather than written in it.
    pub derived: bool,
}

/// Is `other` the same training as `baseline`? The engine promises equal losses for equal
/// model, data, global batch, optimizer and precision, whatever the parallel layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Equivalence {
    pub baseline: i64,
    pub other: i64,
    /// Steps both runs have a loss for.
    pub common_steps: u64,
    pub max_abs_diff: Option<f64>,
    /// max |a-b| / max(|a|, |b|) over the common steps.
    pub max_rel_diff: Option<f64>,
    /// The engine's stated bound for this precision (relative, per step).
    pub tolerance: f64,
    /// Why equal losses are not to be expected (empty: they are).
    pub not_expected_because: Vec<String>,
    /// Expected, measured on at least one common step, and within the tolerance.
    pub equivalent: bool,
}

/// Mean, min and max loss over runs of one spec with different seeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SeedBand {
    pub ids: Vec<i64>,
    pub points: Vec<BandPoint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BandPoint {
    pub step: u64,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

/// The engine's stated per-step relative tolerance for equal trainings: 1e-5 in fp32
/// (the equivalence tests' bound), and the bounds the mixed-precision tests check for bf16 and fp16.
pub fn tolerance(precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => 1e-5,
        Precision::Bf16 => 1e-3,
        Precision::Fp16 => 2e-4,
    }
}

// ---- config diff ----

/// The spec as `(dotted path, value)` pairs, in the spec's field order.
pub fn flatten(spec: &ExperimentSpec) -> Vec<(String, String)> {
    fn walk(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, String)>) {
        match value {
            serde_json::Value::Object(fields) => {
                for (key, v) in fields {
                    let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                    walk(&path, v, out);
                }
            }
            serde_json::Value::String(s) => out.push((prefix.to_string(), s.clone())),
            serde_json::Value::Null => {}
            other => out.push((prefix.to_string(), other.to_string())),
        }
    }
    let mut out = Vec::new();
    if let Ok(value) = serde_json::to_value(spec) {
        walk("", &value, &mut out);
    }
    out
}

/// Quantities that follow from a spec (and its plan, when it plans).
pub fn derived(spec: &ExperimentSpec, plan: Option<&Plan>) -> Vec<(String, String)> {
    let mut rows = vec![
        ("world size".to_string(), spec.world_size().to_string()),
        ("global batch (sequences)".to_string(), spec.global_batch().to_string()),
        ("tokens per step".to_string(), spec.tokens_per_step().to_string()),
        ("parameters".to_string(), spec.model.param_count().to_string()),
    ];
    if let Some(plan) = plan {
        let b = &plan.bytes_per_param;
        rows.push((
            "bytes per parameter (params + grads + optimizer)".to_string(),
            format!(
                "{} + {} + {} = {}",
                b.parameters,
                b.gradients,
                b.optimizer_state,
                b.parameters + b.gradients + b.optimizer_state
            ),
        ));
        rows.push(("predicted DP comm bytes per step (busiest rank)".to_string(), busiest_dp_comm(plan).to_string()));
        rows.push((
            "predicted comm bytes per step, all axes (busiest rank)".to_string(),
            busiest_comm(plan).to_string(),
        ));
        rows.push(("predicted peak memory (busiest rank)".to_string(), busiest_memory(plan).to_string()));
        rows.push(("predicted bubble".to_string(), format!("{:.3}", plan.bubble_fraction)));
    }
    rows
}

fn busiest_comm(plan: &Plan) -> u64 {
    plan.stages.iter().map(|s| s.comm.total).max().unwrap_or(0)
}

fn busiest_dp_comm(plan: &Plan) -> u64 {
    plan.stages
        .iter()
        .map(|s| s.comm.dp_all_reduce + s.comm.dp_reduce_scatter + s.comm.dp_all_gather + s.comm.dp_compressed)
        .max()
        .unwrap_or(0)
}

fn busiest_memory(plan: &Plan) -> u64 {
    plan.stages.iter().map(|s| s.memory.total).max().unwrap_or(0)
}

/// One row per spec field (in the first run's order, then fields only later runs have),
/// then the derived rows.
pub fn config_rows(specs: &[(&ExperimentSpec, Option<&Plan>)]) -> Vec<ConfigRow> {
    let mut rows = table(specs.iter().map(|(spec, _)| flatten(spec)).collect(), false);
    rows.extend(table(specs.iter().map(|(spec, plan)| derived(spec, *plan)).collect(), true));
    rows
}

fn table(columns: Vec<Vec<(String, String)>>, derived: bool) -> Vec<ConfigRow> {
    let mut fields: Vec<String> = Vec::new();
    for column in &columns {
        for (field, _) in column {
            if !fields.contains(field) {
                fields.push(field.clone());
            }
        }
    }
    let lookup: Vec<BTreeMap<&str, &str>> =
        columns.iter().map(|c| c.iter().map(|(f, v)| (f.as_str(), v.as_str())).collect()).collect();
    fields
        .into_iter()
        .map(|field| {
            let values: Vec<String> =
                lookup.iter().map(|c| c.get(field.as_str()).copied().unwrap_or("—").to_string()).collect();
            let differs = values.iter().any(|v| *v != values[0]);
            ConfigRow { field, values, differs, derived }
        })
        .collect()
}

// ---- equivalence ----

/// Why two specs need not give equal losses (empty: the engine says they must).
pub fn why_not_equal(a: &ExperimentSpec, b: &ExperimentSpec) -> Vec<String> {
    let mut why = Vec::new();
    if a.model != b.model {
        why.push("the models differ".to_string());
    }
    if a.data != b.data {
        why.push("the data differ (dataset or data seed)".to_string());
    }
    if a.global_batch() != b.global_batch() {
        why.push(format!("the global batches differ ({} vs {} sequences)", a.global_batch(), b.global_batch()));
    }
    let (x, y) = (&a.train, &b.train);
    let same_optimization = x.lr == y.lr
        && x.warmup_steps == y.warmup_steps
        && x.lr_schedule == y.lr_schedule
        && x.optimizer == y.optimizer
        && x.weight_decay == y.weight_decay
        && x.grad_clip == y.grad_clip
        && (x.lr_schedule == crate::LrSchedule::Constant || x.steps == y.steps);
    if !same_optimization {
        why.push("the optimizer settings differ".to_string());
    }
    if x.seed != y.seed {
        why.push("the initialisation seeds differ".to_string());
    }
    if x.precision != y.precision || x.loss_scaling != y.loss_scaling {
        why.push("the precisions differ".to_string());
    }
    if a.demo.is_some() || b.demo.is_some() {
        why.push("a collective demo does not train".to_string());
    }
    why
}

/// The verdict for `other` against `baseline`, over the steps both have.
pub fn equivalence(
    baseline: (i64, &ExperimentSpec, &[MetricPoint]),
    other: (i64, &ExperimentSpec, &[MetricPoint]),
) -> Equivalence {
    let losses: BTreeMap<u64, f64> = baseline.2.iter().map(|p| (p.step, p.loss)).collect();
    let mut common_steps = 0;
    let (mut max_abs, mut max_rel) = (None::<f64>, None::<f64>);
    for point in other.2 {
        let Some(&a) = losses.get(&point.step) else { continue };
        let b = point.loss;
        common_steps += 1;
        let abs = (a - b).abs();
        let scale = a.abs().max(b.abs());
        let rel = if abs == 0.0 {
            0.0
        } else if scale > 0.0 {
            abs / scale
        } else {
            f64::INFINITY
        };
        // NaN losses (a diverged run) make the difference NaN: keep it, it is not within.
        max_abs = Some(max_abs.map_or(abs, |m| if abs.is_nan() || abs > m { abs } else { m }));
        max_rel = Some(max_rel.map_or(rel, |m| if rel.is_nan() || rel > m { rel } else { m }));
    }
    let not_expected_because = why_not_equal(baseline.1, other.1);
    let tolerance = tolerance(baseline.1.train.precision);
    let within = max_rel.is_some_and(|r| r <= tolerance);
    Equivalence {
        baseline: baseline.0,
        other: other.0,
        common_steps,
        max_abs_diff: max_abs,
        max_rel_diff: max_rel,
        tolerance,
        equivalent: not_expected_because.is_empty() && within,
        not_expected_because,
    }
}

// ---- seed bands ----

/// The spec with its initialisation seed and name blanked: runs with equal keys differ
/// only in where training started (the data seed picks another dataset, so it counts).
fn seed_key(spec: &ExperimentSpec) -> String {
    let mut s = spec.clone();
    s.name.clear();
    s.train.seed = 0;
    serde_json::to_string(&s).unwrap_or_default()
}

/// Bands over each group of two or more runs whose specs differ only in the initialisation
/// seed (and name),
/// at the steps every run of the group has.
pub fn seed_bands(runs: &[(i64, &ExperimentSpec, &[MetricPoint])]) -> Vec<SeedBand> {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, (_, spec, _)) in runs.iter().enumerate() {
        let key = seed_key(spec);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    groups
        .into_iter()
        .filter(|(_, members)| members.len() >= 2)
        .map(|(_, members)| {
            let per_run: Vec<BTreeMap<u64, f64>> =
                members.iter().map(|&i| runs[i].2.iter().map(|p| (p.step, p.loss)).collect()).collect();
            let points = per_run[0]
                .keys()
                .filter_map(|step| {
                    let losses: Vec<f64> = per_run.iter().filter_map(|m| m.get(step).copied()).collect();
                    (losses.len() == per_run.len()).then(|| BandPoint {
                        step: *step,
                        mean: losses.iter().sum::<f64>() / losses.len() as f64,
                        min: losses.iter().copied().fold(f64::INFINITY, f64::min),
                        max: losses.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    })
                })
                .collect();
            SeedBand { ids: members.iter().map(|&i| runs[i].0).collect(), points }
        })
        .collect()
}

// ---- measured summary ----

/// Where each rank's recorded steps went, averaged over ranks and steps.
/// - compute: forward, backward and optimizer spans, less the collectives the compute
///   thread waits for inside them (tensor parallelism's all-reduces, ZeRO/FSDP's gathers
///   and reduce-scatters: [`Span::blocks_compute`]);
/// - exposed comm: those collectives, plus the communication thread's (DDP's buckets)
///   outside compute;
/// - idle: the rest of the step (first span start to last span end).
pub fn time_split(ranks: &[RankTrace]) -> Option<TimeSplit> {
    let (mut compute, mut comm, mut idle, mut samples) = (0u64, 0u64, 0u64, 0u64);
    let mut steps_covered = 0;
    for rank in ranks {
        let mut steps: Vec<u64> = rank.spans.iter().map(|s| s.step).collect();
        steps.sort_unstable();
        steps.dedup();
        if steps.len() > 1 {
            steps.remove(0); // the first step warms up caches and threads
        }
        steps_covered = steps_covered.max(steps.len() as u64);
        for step in steps {
            let spans: Vec<&Span> = rank.spans.iter().filter(|s| s.step == step).collect();
            let start = spans.iter().map(|s| s.start_us).min().unwrap_or(0);
            let end = spans.iter().map(|s| s.end_us).max().unwrap_or(0);
            let work = intervals(&spans, |s| {
                matches!(s.kind, SpanKind::Forward | SpanKind::Backward | SpanKind::Weights | SpanKind::Optimizer)
            });
            let blocking = intervals(&spans, |s| s.blocks_compute());
            let background = intervals(&spans, |s| s.kind == SpanKind::Comm && !s.blocks_compute());
            let busy = union_length(&[work.clone(), blocking.clone()].concat()) - union_length(&blocking);
            let waited = union_length(&[work, blocking, background].concat()) - busy;
            compute += busy;
            comm += waited;
            idle += end.saturating_sub(start).saturating_sub(busy + waited);
            samples += 1;
        }
    }
    (samples > 0).then(|| {
        let ms = |us: u64| us as f64 / samples as f64 / 1000.0;
        TimeSplit { compute_ms: ms(compute), comm_ms: ms(comm), idle_ms: ms(idle), steps: steps_covered }
    })
}

fn intervals(spans: &[&Span], keep: impl Fn(&Span) -> bool) -> Vec<(u64, u64)> {
    spans.iter().filter(|s| keep(s) && s.end_us > s.start_us).map(|s| (s.start_us, s.end_us)).collect()
}

/// Total length covered by a set of intervals.
fn union_length(intervals: &[(u64, u64)]) -> u64 {
    let mut sorted = intervals.to_vec();
    sorted.sort_unstable();
    let (mut total, mut reach) = (0, 0);
    for (start, end) in sorted {
        let start = start.max(reach);
        if end > start {
            total += end - start;
            reach = end;
        }
    }
    total
}

/// Each category's peak over the ranks that reported memory.
pub fn peak_memory(ranks: &[RankTrace]) -> Option<RankMemory> {
    let reports: Vec<&RankMemory> = ranks.iter().filter_map(|r| r.memory.as_ref().map(|m| &m.peak)).collect();
    if reports.is_empty() {
        return None;
    }
    let mut peak = RankMemory::default();
    for category in crate::wire::memory::MemoryCategory::EVERY {
        *category.field(&mut peak) = reports.iter().map(|m| category.of(m)).max().unwrap_or(0);
    }
    peak.total = reports.iter().map(|m| m.total).max().unwrap_or(0);
    Some(peak)
}

/// Bytes the busiest rank sent per optimizer step, from the collective counters of the
/// `traced_steps` steps its trace covers (a resumed run traces only its last attempt).
/// None when there is nothing to count from: no steps, or several ranks none of which
/// traced a collective (one rank alone sends nothing: 0).
pub fn comm_bytes_per_step(ranks: &[RankTrace], traced_steps: u64) -> Option<f64> {
    // (a pipeline's point-to-point sends are counted too: not data-parallel traffic)
    let collectives = |r: &RankTrace| {
        r.comm.counters.iter().filter(|c| c.op != CollectiveOp::Send).map(|c| c.bytes_sent).collect::<Vec<u64>>()
    };
    let untraced = ranks.len() > 1 && ranks.iter().all(|r| collectives(r).is_empty());
    if traced_steps == 0 || untraced {
        return None;
    }
    let busiest = ranks.iter().map(|r| collectives(r).iter().sum::<u64>()).max()?;
    Some(busiest as f64 / traced_steps as f64)
}

/// The summary row of a run whose traces cover its last `traced_steps` steps.
pub fn run_stats(
    view: &ExperimentView,
    metrics: &[MetricPoint],
    ranks: &[RankTrace],
    traced_steps: u64,
    plan: Option<&Plan>,
) -> RunStats {
    let summary = view.summary.as_ref();
    let timed: Vec<&MetricPoint> = metrics.iter().skip(usize::from(metrics.len() > 1)).collect();
    let mean = |f: fn(&MetricPoint) -> f64| {
        (!timed.is_empty()).then(|| timed.iter().map(|p| f(p)).sum::<f64>() / timed.len() as f64)
    };
    RunStats {
        final_loss: summary.map(|s| s.final_loss).or_else(|| metrics.last().map(|p| p.loss)),
        tokens_per_s: summary.map(|s| s.tokens_per_s).or_else(|| mean(|p| p.tokens_per_s)),
        mfu: summary.and_then(|s| s.mfu),
        step_ms: summary.map(|s| s.mean_step_ms).or_else(|| mean(|p| p.step_ms)),
        time_split: time_split(ranks),
        peak_memory: peak_memory(ranks),
        dp_comm_bytes_per_step: comm_bytes_per_step(ranks, traced_steps),
        dp_comm_bytes_from_formula: ranks.iter().flat_map(|r| &r.comm.counters).any(|c| c.bytes_from_formula),
        predicted_dp_comm_bytes_per_step: plan.map(busiest_dp_comm),
        predicted_bubble: plan.map(|p| p.bubble_fraction),
        bubble: crate::analysis::pipeline::replayed_bubble(&view.spec, ranks),
    }
}

// ---- export ----

/// The compared runs' metrics as CSV: one line per run and step.
pub fn metrics_csv(view: &CompareView) -> String {
    let mut out = String::from("experiment_id,name,step,loss,lr,grad_norm,tokens_per_s,step_ms\n");
    for run in &view.runs {
        for p in &run.metrics {
            out.push_str(&format!(
                "{},{},{},{},{},{},{},{}\n",
                run.experiment.id,
                csv_field(&run.experiment.name),
                p.step,
                p.loss,
                p.lr,
                p.grad_norm,
                p.tokens_per_s,
                p.step_ms
            ));
        }
    }
    out
}

/// The summary table as CSV: one line per run.
pub fn summary_csv(view: &CompareView) -> String {
    let mut out = String::from(
        "experiment_id,name,status,world_size,final_loss,tokens_per_s,mfu,step_ms,compute_ms,comm_ms,idle_ms,\
         peak_parameters,peak_gradients,peak_optimizer_state,peak_activations,peak_total,\
         dp_comm_bytes_per_step,predicted_dp_comm_bytes_per_step,bubble,predicted_bubble\n",
    );
    let opt = |x: Option<f64>| x.map(|v| v.to_string()).unwrap_or_default();
    let opt_u = |x: Option<u64>| x.map(|v| v.to_string()).unwrap_or_default();
    for run in &view.runs {
        let s = &run.stats;
        let split = s.time_split;
        let peak = s.peak_memory.as_ref();
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            run.experiment.id,
            csv_field(&run.experiment.name),
            run.experiment.status.as_str(),
            run.experiment.spec.world_size(),
            opt(s.final_loss),
            opt(s.tokens_per_s),
            opt(s.mfu),
            opt(s.step_ms),
            opt(split.map(|t| t.compute_ms)),
            opt(split.map(|t| t.comm_ms)),
            opt(split.map(|t| t.idle_ms)),
            opt_u(peak.map(|m| m.parameters)),
            opt_u(peak.map(|m| m.gradients)),
            opt_u(peak.map(|m| m.optimizer_state)),
            opt_u(peak.map(|m| m.activations)),
            opt_u(peak.map(|m| m.total)),
            opt(s.dp_comm_bytes_per_step),
            opt_u(s.predicted_dp_comm_bytes_per_step),
            opt(s.bubble),
            opt(s.predicted_bubble),
        ));
    }
    out
}

/// A CSV field, quoted when it holds a comma, quote or line break (RFC 4180). A field a
/// spreadsheet would run as a formula (it starts with `=`, `+`, `-`, `@`, a tab or a
/// carriage return) gets a leading `'` and is quoted, as OWASP advises for CSV injection:
/// the teacher opening the export sees the text, and nothing runs.
fn csv_field(text: &str) -> String {
    let formula = text.starts_with(['=', '+', '-', '@', '\t', '\r']);
    let text = if formula { format!("'{text}") } else { text.to_string() };
    if formula || text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text
    }
}

/// Parses `ids=3,1,2`: 2..=6 distinct experiment ids, in the order given.
pub fn parse_ids(raw: &str) -> Result<Vec<i64>, String> {
    let mut ids = Vec::new();
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let id: i64 = part
            .parse()
            .ok()
            .filter(|id| *id > 0)
            .ok_or_else(|| format!("'{}' is not an experiment id", part.chars().take(20).collect::<String>()))?;
        if !ids.contains(&id) {
            ids.push(id);
        }
        if ids.len() > MAX_RUNS {
            return Err(format!("compare at most {MAX_RUNS} experiments at a time"));
        }
    }
    if ids.len() < MIN_RUNS {
        return Err(format!("pick {MIN_RUNS} to {MAX_RUNS} experiments to compare (ids=1,2)"));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::trace::{lane, RankCommTrace};

    fn point(step: u64, loss: f64) -> MetricPoint {
        MetricPoint { step, loss, ..MetricPoint::default() }
    }

    fn span(kind: SpanKind, step: u64, start_us: u64, end_us: u64) -> Span {
        Span {
            kind,
            name: String::new(),
            step,
            lane: "compute".into(),
            start_us,
            end_us,
            layer: None,
            bucket: None,
            bytes: None,
            micro: None,
            chunk: None,
        }
    }

    #[test]
    fn ddp_and_one_rank_with_the_same_global_batch_are_expected_equal() {
        let one = ExperimentSpec::default();
        let mut ddp = one.clone();
        ddp.name = "ddp".into();
        ddp.parallel.dp = 2;
        ddp.train.micro_batch = one.train.micro_batch / 2;
        assert_eq!(one.global_batch(), ddp.global_batch());
        assert!(why_not_equal(&one, &ddp).is_empty());

        let a = [point(0, 5.0), point(1, 4.0), point(2, 3.0)];
        let b = [point(0, 5.0), point(1, 4.00001), point(3, 9.0)];
        let verdict = equivalence((1, &one, &a), (2, &ddp, &b));
        assert_eq!(verdict.common_steps, 2);
        assert!((verdict.max_abs_diff.unwrap() - 1e-5).abs() < 1e-9);
        assert!((verdict.max_rel_diff.unwrap() - 2.5e-6).abs() < 1e-9);
        assert!(verdict.equivalent);

        let far = [point(0, 5.0), point(1, 4.1)];
        assert!(!equivalence((1, &one, &a), (2, &ddp, &far)).equivalent);
        let nan = [point(0, f64::NAN)];
        assert!(!equivalence((1, &one, &a), (2, &ddp, &nan)).equivalent);
        assert!(!equivalence((1, &one, &a), (2, &ddp, &[])).equivalent, "no common step proves nothing");
    }

    #[test]
    fn a_different_batch_or_seed_is_not_expected_equal() {
        let one = ExperimentSpec::default();
        let mut other = one.clone();
        other.parallel.dp = 2;
        other.train.seed += 1;
        let why = why_not_equal(&one, &other).join("; ");
        assert!(why.contains("global batches differ"), "{why}");
        assert!(why.contains("seeds differ"), "{why}");
        let a = [point(0, 5.0)];
        let verdict = equivalence((1, &one, &a), (2, &other, &a));
        assert_eq!(verdict.max_rel_diff, Some(0.0));
        assert!(!verdict.equivalent, "equal numbers from different trainings are a coincidence");
    }

    #[test]
    fn the_config_diff_marks_what_differs_and_derives_world_size() {
        let a = ExperimentSpec::default();
        let mut b = a.clone();
        b.parallel.dp = 2;
        let rows = config_rows(&[(&a, None), (&b, None)]);
        let row = |f: &str| rows.iter().find(|r| r.field == f).unwrap_or_else(|| panic!("no row {f}"));
        assert!(row("parallel.dp").differs);
        assert_eq!(row("parallel.dp").values, vec!["1", "2"]);
        assert!(!row("model.layers").differs);
        assert!(row("world size").derived && row("world size").differs);
        assert!(!row("parallel.dp").derived);
    }

    #[test]
    fn seed_bands_group_runs_that_differ_only_in_seeds() {
        let a = ExperimentSpec::default();
        let mut b = a.clone();
        b.train.seed = 7;
        b.name = "again".into();
        let mut other_data = a.clone();
        other_data.data.seed = 9;
        let mut c = a.clone();
        c.parallel.dp = 2;
        let (la, lb, lc) = ([point(0, 4.0), point(1, 3.0)], [point(0, 6.0)], [point(0, 1.0)]);
        let bands = seed_bands(&[(1, &a, &la), (2, &b, &lb), (3, &c, &lc), (4, &other_data, &lb)]);
        assert_eq!(bands.len(), 1);
        assert_eq!(bands[0].ids, vec![1, 2]);
        assert_eq!(bands[0].points, vec![BandPoint { step: 0, mean: 5.0, min: 4.0, max: 6.0 }]);
    }

    #[test]
    fn the_time_split_separates_compute_exposed_comm_and_idle() {
        // Step 1 (step 0 is warm-up): forward 0..40, backward 40..100, comm 80..130
        // (30 exposed), optimizer 140..150, the step ends at 160 (idle 130..140, 150..160).
        let spans = vec![
            span(SpanKind::Forward, 0, 0, 1000),
            span(SpanKind::Forward, 1, 0, 40),
            span(SpanKind::Backward, 1, 40, 100),
            span(SpanKind::Comm, 1, 80, 130),
            span(SpanKind::Optimizer, 1, 140, 150),
            span(SpanKind::Idle, 1, 150, 160),
        ];
        let rank = RankTrace { rank: 0, world: 1, spans, ..RankTrace::default() };
        let split = time_split(&[rank]).unwrap();
        assert_eq!(split.steps, 1);
        assert!((split.compute_ms - 0.110).abs() < 1e-12, "{split:?}");
        assert!((split.comm_ms - 0.030).abs() < 1e-12, "{split:?}");
        assert!((split.idle_ms - 0.020).abs() < 1e-12, "{split:?}");
        assert_eq!(time_split(&[]), None);
    }

    #[test]
    fn tensor_parallel_all_reduces_inside_compute_count_as_communication() {
        // One step: forward 0..100 holds a TP all-reduce 20..50; backward 100..150.
        let tp = Span { lane: "tp".into(), ..span(SpanKind::Comm, 0, 20, 50) };
        let spans = vec![span(SpanKind::Forward, 0, 0, 100), tp, span(SpanKind::Backward, 0, 100, 150)];
        let split = time_split(&[RankTrace { spans, ..RankTrace::default() }]).unwrap();
        assert!((split.compute_ms - 0.120).abs() < 1e-12, "{split:?}");
        assert!((split.comm_ms - 0.030).abs() < 1e-12, "{split:?}");
        assert!(split.idle_ms.abs() < 1e-12, "{split:?}");
    }

    #[test]
    fn fsdp_gathers_the_compute_thread_waits_for_are_exposed_even_inside_backward() {
        // One step: backward 0..100 holds an FSDP all-gather 10..40 (the compute thread
        // waits for it) and overlaps a DDP-style bucket 60..90 on the comm thread (hidden).
        let gather = Span { lane: lane::DP_BLOCKING.into(), ..span(SpanKind::Comm, 0, 10, 40) };
        let bucket = Span { lane: lane::COMM.into(), ..span(SpanKind::Comm, 0, 60, 90) };
        let spans = vec![span(SpanKind::Backward, 0, 0, 100), gather, bucket];
        let split = time_split(&[RankTrace { spans, ..RankTrace::default() }]).unwrap();
        assert!((split.compute_ms - 0.070).abs() < 1e-12, "{split:?}");
        assert!((split.comm_ms - 0.030).abs() < 1e-12, "{split:?}");
    }

    #[test]
    fn comm_bytes_are_per_rank_and_step() {
        let counter = |bytes_sent| crate::wire::trace::CollectiveCounter {
            op: crate::wire::trace::CollectiveOp::AllReduce,
            calls: 1,
            elements: 0,
            bytes_sent,
            bytes_from_formula: false,
            total_us: 0,
        };
        let rank = |bytes| RankTrace {
            comm: RankCommTrace { counters: vec![counter(bytes)], ..RankCommTrace::default() },
            ..RankTrace::default()
        };
        assert_eq!(comm_bytes_per_step(&[rank(100), rank(300)], 4), Some(75.0), "the busiest rank");
        assert_eq!(comm_bytes_per_step(&[], 4), None);
        let untraced = || RankTrace::default();
        assert_eq!(comm_bytes_per_step(&[untraced(), untraced()], 4), None, "several ranks, nothing traced");
        assert_eq!(comm_bytes_per_step(&[untraced()], 4), Some(0.0), "one rank sends nothing");
        assert_eq!(comm_bytes_per_step(&[rank(100)], 0), None);
    }

    #[test]
    fn ids_parse_in_order_without_repeats_and_within_bounds() {
        assert_eq!(parse_ids("3, 1,3,2"), Ok(vec![3, 1, 2]));
        assert!(parse_ids("1").unwrap_err().contains("pick 2 to 6"));
        assert!(parse_ids("1,2,3,4,5,6,7").unwrap_err().contains("at most 6"));
        assert!(parse_ids("1,x").unwrap_err().contains("'x' is not"));
        assert!(parse_ids("1,-2").is_err());
    }

    #[test]
    fn csv_quotes_names() {
        assert_eq!(csv_field("a,b \"c\""), "\"a,b \"\"c\"\"\"");
        assert_eq!(csv_field("plain"), "plain");
    }

    #[test]
    fn csv_cells_that_a_spreadsheet_would_run_are_escaped() {
        assert_eq!(csv_field("=HYPERLINK(\"http://x\",\"y\")"), "\"'=HYPERLINK(\"\"http://x\"\",\"\"y\"\")\"");
        for (name, cell) in [
            ("@SUM(A1)", "\"'@SUM(A1)\""),
            ("+1+1", "\"'+1+1\""),
            ("-2", "\"'-2\""),
            ("\tx", "\"'\tx\""),
            ("\rx", "\"'\rx\""),
        ] {
            assert_eq!(csv_field(name), cell, "{name:?}");
        }
        // Only the first character decides: a name with = inside stays as it is.
        assert_eq!(csv_field("a=b"), "a=b");
    }
}
