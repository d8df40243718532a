//! The layout search: for a model, a cluster and a global batch, every way to lay the run
//! out (dp x tp x pp, pipeline schedule, sharding, DDP's bucket size, micro-batch size,
//! checkpointing) planned and estimated, the ten fastest that fit listed, and for each of
//! the others the reason it lost to the fastest.
//!
//! Nothing here is a rule of thumb: a layout wins or loses by the planner's memory and the
//! estimate's step time ([`crate::plan::estimate`]), so "TP inside a node" or "pipeline only
//! when the model does not fit" come out of the numbers, or do not. The estimate counts
//! data-parallel communication as fully exposed, which favours layouts with less of it.

use serde::{Deserialize, Serialize};

use crate::plan::estimate::{estimate, Cluster, Estimate};
use crate::plan::planner::{self, MAX_PLANNED_STAGES};
use crate::plan::schedule::Pipeline;
use crate::spec::field_error::FieldError;
use crate::spec::*;

/// How many layouts the search lists.
pub const TOP: usize = 10;
/// Micro-batch sizes (sequences per rank and pass) the search tries.
const MICRO_BATCHES: [usize; 4] = [1, 2, 4, 8];
/// DDP / ZeRO-1 gradient bucket sizes the search tries: the lab's own runs' default (1 MiB),
/// PyTorch DDP's (25 MiB) and a large one (100 MiB). ZeRO-2 and FSDP move a unit's
/// gradients at a time and use the middle one.
const BUCKETS: [u64; 3] = [1 << 20, 25 << 20, 100 << 20];
/// Chunks per stage for the interleaved schedule.
const VIRTUAL_STAGES: usize = 2;
/// The search takes at most this many GPUs (each layout is planned stage by stage).
pub const MAX_SEARCH_GPUS: u64 = 1 << 16;
/// At most this many pipeline stages planned over all the layouts of one search (its
/// work): a request beyond it is refused before anything is planned.
pub const MAX_PLANNED_STAGES_PER_SEARCH: usize = 4_000_000;
/// At most this many layouts in one search.
pub const MAX_LAYOUTS: usize = 100_000;
/// Interleaved and ZB-H1 layouts are planned pass by pass: at most this many passes each
/// (more are counted as refused, with the reason).
const MAX_FOLLOWED_PASSES: usize = 1 << 16;
/// And at most this many sequences per step.
pub const MAX_GLOBAL_BATCH: usize = 1 << 20;

/// What to lay out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    pub model: ModelSpec,
    /// The hardware; `gpus` is the number of GPUs to use, all of them.
    pub cluster: Cluster,
    /// Sequences per optimizer step, over all replicas.
    pub global_batch: usize,
    #[serde(default = "bf16")]
    pub precision: Precision,
    /// FlashAttention (the default) or attention that keeps its (s, s) probabilities, as
    /// the runs before FlashAttention (2022) did.
    #[serde(default = "flash")]
    pub attention: Attention,
}

fn bf16() -> Precision {
    Precision::Bf16
}

fn flash() -> Attention {
    Attention::Flash
}

/// One layout and what the estimate makes of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Candidate {
    /// The layout as a spec (the model, the batch and the precision of the request).
    pub spec: ExperimentSpec,
    /// "dp=16 tp=8 pp=8, 1f1b, zero1, micro-batch 1, checkpointing every": the layout in a line.
    pub layout: String,
    pub step_seconds: f64,
    pub mfu: f64,
    pub memory_per_gpu_bytes: u64,
    /// Where the step's time goes: compute (recomputation included), bubble, and the
    /// exposed communication of each axis.
    pub compute_seconds: f64,
    pub bubble_seconds: f64,
    pub dp_seconds: f64,
    pub tp_seconds: f64,
    pub pp_seconds: f64,
    /// Whether a tensor-parallel group spans nodes.
    pub tp_crosses_nodes: bool,
    /// Why it is slower than the fastest layout (none for the fastest).
    pub loses_by: Option<String>,
}

/// Layouts that could not run, by reason.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Rejected {
    pub reason: String,
    pub count: usize,
    /// The fastest (for memory) or first (for structure) layout with this reason.
    pub example: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SearchResult {
    /// Layouts planned and estimated.
    pub examined: usize,
    /// Of those, the ones whose busiest GPU fits in its memory.
    pub fitting: usize,
    /// The fastest fitting layouts, fastest first (at most [`TOP`]).
    pub best: Vec<Candidate>,
    /// The fastest layouts that would beat the winner but do not fit (at most 3).
    pub too_big: Vec<Candidate>,
    pub rejected: Vec<Rejected>,
}

/// Searches every layout of `request`; the errors say why the request itself cannot be
/// searched, field by field.
pub fn search(request: &SearchRequest) -> Result<SearchResult, Vec<FieldError>> {
    let gpus = request.cluster.gpus;
    let mut errors = Vec::new();
    if gpus == 0 || gpus > MAX_SEARCH_GPUS {
        errors.push(FieldError::new(
            "cluster.gpus",
            format!("gpus must be between 1 and {MAX_SEARCH_GPUS} (it is {gpus})"),
        ));
    }
    if request.global_batch == 0 || request.global_batch > MAX_GLOBAL_BATCH {
        errors.push(FieldError::new(
            "global_batch",
            format!("global_batch must be between 1 and {MAX_GLOBAL_BATCH} sequences (it is {})", request.global_batch),
        ));
    }
    let base = ExperimentSpec { name: "layout".into(), model: request.model.clone(), ..ExperimentSpec::default() };
    if let Err(model_errors) = planner::check_structure(&base) {
        errors.extend(model_errors);
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let Some(layouts) = layouts(request) else {
        return Err(vec![FieldError::new(
            "cluster.gpus",
            format!("more than {MAX_LAYOUTS} layouts to try: more than one search plans; use fewer GPUs"),
        )]);
    };
    let stages: usize = layouts.iter().map(|s| s.parallel.pp).sum();
    if stages > MAX_PLANNED_STAGES_PER_SEARCH {
        return Err(vec![FieldError::new(
            "cluster.gpus",
            format!(
                "{} layouts of {stages} pipeline stages in all are more than one search plans \
                 ({MAX_PLANNED_STAGES_PER_SEARCH} stages): use fewer GPUs",
                layouts.len()
            ),
        )]);
    }

    let mut fitting = Vec::new();
    let mut too_big = Vec::new();
    let mut refused: Vec<Rejected> = Vec::new();
    let mut examined = 0;
    for spec in layouts {
        let p = &spec.parallel;
        let pipe = Pipeline::of(&spec);
        let passes = pipe.passes();
        if pipe.followed_pass_by_pass() && passes > MAX_FOLLOWED_PASSES {
            let reason = format!(
                "{} over {} passes: more than the search follows pass by pass ({MAX_FOLLOWED_PASSES})",
                p.pp_schedule.as_str(),
                passes
            );
            tally(&mut refused, reason, &spec);
            continue;
        }
        let plan = match planner::plan(&spec) {
            Ok(plan) => plan,
            Err(errors) => {
                let reason = errors.first().map_or_else(String::new, |e| e.to_string());
                tally(&mut refused, reason, &spec);
                continue;
            }
        };
        examined += 1;
        let e = estimate(&spec, &plan, &request.cluster);
        let candidate = candidate(spec, &e);
        if e.fits {
            fitting.push(candidate);
        } else {
            too_big.push(candidate);
        }
    }
    let by_time = |a: &Candidate, b: &Candidate| {
        a.step_seconds.total_cmp(&b.step_seconds).then(a.memory_per_gpu_bytes.cmp(&b.memory_per_gpu_bytes))
    };
    fitting.sort_by(by_time);
    too_big.sort_by(by_time);
    // A layout is listed once, with its fastest bucket size.
    for list in [&mut fitting, &mut too_big] {
        let mut seen = std::collections::HashSet::new();
        list.retain(|c| seen.insert(layout_of(&c.spec)));
    }
    let fitting_count = fitting.len();
    let mut best: Vec<Candidate> = fitting.into_iter().take(TOP).collect();
    if let Some((winner, rest)) = best.split_first_mut() {
        for loser in rest {
            loser.loses_by = Some(loses_by(loser, winner));
        }
    }
    let winner_seconds = best.first().map_or(f64::INFINITY, |w| w.step_seconds);
    let gpu_gb = request.cluster.gpu_memory_bytes as f64 / 1e9;
    let mut rejected = Vec::new();
    let too_big_count = too_big.len();
    if let Some(first) = too_big.first() {
        rejected.push(Rejected {
            reason: format!("the busiest GPU needs more than its {gpu_gb:.0} GB"),
            count: too_big_count,
            example: format!("{}: {:.1} GB", first.layout, first.memory_per_gpu_bytes as f64 / 1e9),
        });
    }
    rejected.extend(refused);
    let mut too_big: Vec<Candidate> = too_big.into_iter().filter(|c| c.step_seconds < winner_seconds).take(3).collect();
    for c in &mut too_big {
        c.loses_by = Some(format!(
            "needs {:.1} GB on its busiest GPU, more than the {gpu_gb:.0} GB there are",
            c.memory_per_gpu_bytes as f64 / 1e9
        ));
    }
    Ok(SearchResult { examined, fitting: fitting_count, best, too_big, rejected })
}

/// Every layout of the request's GPUs: tp a power of two dividing the K/V heads (and 1 with
/// experts), pp up to the layers (stages of unequal length run at the longest one's pace,
/// which the estimate counts), dp the rest; each micro-batch size
/// that divides the batch evenly over the replicas; each schedule, sharding and
/// checkpointing. None when there are more than [`MAX_LAYOUTS`].
fn layouts(request: &SearchRequest) -> Option<Vec<ExperimentSpec>> {
    let m = &request.model;
    let gpus = request.cluster.gpus as usize;
    let batch = request.global_batch;
    let tps = (0..usize::BITS)
        .map(|i| 1usize << i)
        .take_while(|&tp| tp <= gpus)
        .filter(|&tp| gpus % tp == 0 && m.key_value_heads() % tp == 0 && (tp == 1 || !m.is_moe()));
    let mut out = Vec::new();
    for tp in tps {
        let pps = (1..=m.layers.min(gpus / tp).min(MAX_PLANNED_STAGES)).filter(|&pp| (gpus / tp) % pp == 0);
        for pp in pps {
            let dp = gpus / tp / pp;
            for mb in MICRO_BATCHES.into_iter().filter(|&mb| batch % (dp * mb) == 0) {
                let micro_batches = batch / (dp * mb);
                for (schedule, virtual_stages) in schedules(pp, m.layers, micro_batches) {
                    for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
                        if dp < 2 && sharding != Sharding::None {
                            continue;
                        }
                        let bucketed = dp > 1 && matches!(sharding, Sharding::None | Sharding::Zero1);
                        let buckets = if bucketed { &BUCKETS[..] } else { &BUCKETS[1..2] };
                        for (checkpointing, &bucket_bytes) in
                            checkpointing_modes(request.attention).flat_map(|c| buckets.iter().map(move |b| (c, b)))
                        {
                            let mut spec =
                                ExperimentSpec { name: "layout".into(), model: m.clone(), ..ExperimentSpec::default() };
                            spec.parallel = ParallelSpec {
                                dp,
                                tp,
                                pp,
                                sharding,
                                pp_schedule: schedule,
                                virtual_stages,
                                bucket_bytes,
                                ..ParallelSpec::default()
                            };
                            spec.train.precision = request.precision;
                            spec.train.micro_batch = mb;
                            spec.train.micro_batches = micro_batches;
                            spec.train.checkpointing = checkpointing;
                            spec.train.attention = request.attention;
                            if out.len() == MAX_LAYOUTS {
                                return None;
                            }
                            out.push(spec);
                        }
                    }
                }
            }
        }
    }
    Some(out)
}

/// The checkpointing modes worth trying: selective recompute only where attention keeps
/// its probabilities (flash attention keeps none to drop).
fn checkpointing_modes(attention: Attention) -> impl Iterator<Item = Checkpointing> {
    let selective = (attention == Attention::Naive).then_some(Checkpointing::Selective);
    [Checkpointing::None].into_iter().chain(selective).chain([Checkpointing::Sqrt, Checkpointing::Every])
}

/// The schedules worth trying for `pp` stages: none to choose without a pipeline; 1F1B
/// (GPipe runs as long and holds more), interleaved where the layers and micro-batches
/// split evenly, ZB-H1, and ZBV where the layers cut into 2P chunks and M >= 2P-1
/// (not DualPipeV: with its pairs run one pass after the other it holds more than ZBV for
/// its formula's larger bubble).
fn schedules(pp: usize, layers: usize, micro_batches: usize) -> Vec<(PpSchedule, usize)> {
    if pp == 1 {
        return vec![(PpSchedule::OneFOneB, 1)];
    }
    let mut out = vec![(PpSchedule::OneFOneB, 1), (PpSchedule::ZbH1, 1)];
    if layers % (pp * VIRTUAL_STAGES) == 0 && micro_batches % pp == 0 {
        out.push((PpSchedule::Interleaved, VIRTUAL_STAGES));
    }
    if layers % (2 * pp) == 0 && micro_batches + 1 >= 2 * pp {
        out.push((PpSchedule::Zbv, 1));
    }
    out
}

fn candidate(spec: ExperimentSpec, e: &Estimate) -> Candidate {
    Candidate {
        layout: describe(&spec),
        spec,
        step_seconds: e.step_seconds,
        mfu: e.mfu,
        memory_per_gpu_bytes: e.memory_per_gpu_bytes,
        compute_seconds: e.compute_seconds,
        bubble_seconds: e.bubble_seconds,
        dp_seconds: e.dp.seconds,
        tp_seconds: e.tp.seconds,
        pp_seconds: e.pp.seconds,
        tp_crosses_nodes: e.tp.crosses_nodes,
        loses_by: None,
    }
}

/// The layout in one line, with DDP's bucket size where it has buckets.
pub fn describe(spec: &ExperimentSpec) -> String {
    let p = &spec.parallel;
    if p.dp > 1 && matches!(p.sharding, Sharding::None | Sharding::Zero1) {
        format!("{}, buckets {} MiB", layout_of(spec), p.bucket_bytes >> 20)
    } else {
        layout_of(spec)
    }
}

/// The layout in one line, whatever its buckets.
fn layout_of(spec: &ExperimentSpec) -> String {
    let (p, t) = (&spec.parallel, &spec.train);
    let schedule = if p.pp == 1 { String::new() } else { format!(", {}", schedule(spec)) };
    format!(
        "dp={} tp={} pp={}{schedule}, sharding {}, micro-batch {} x {}, checkpointing {}",
        p.dp,
        p.tp,
        p.pp,
        p.sharding.as_str(),
        t.micro_batch,
        t.micro_batches,
        t.checkpointing.as_str()
    )
}

/// The pipeline schedule by name: "1f1b", "interleaved x2", ...
fn schedule(spec: &ExperimentSpec) -> String {
    match spec.parallel.pp_schedule {
        PpSchedule::Interleaved => format!("interleaved x{}", spec.parallel.virtual_stages),
        s => s.as_str().to_string(),
    }
}

/// What costs `loser` the most time against `winner`: the part of the step (compute,
/// bubble, each axis's communication) that grew the most, with the layout's reason for it.
fn loses_by(loser: &Candidate, winner: &Candidate) -> String {
    let (l, w) = (&loser.spec, &winner.spec);
    let parts = [
        ("compute", loser.compute_seconds - winner.compute_seconds),
        ("bubble", loser.bubble_seconds - winner.bubble_seconds),
        ("dp", loser.dp_seconds - winner.dp_seconds),
        ("tp", loser.tp_seconds - winner.tp_seconds),
        ("pp", loser.pp_seconds - winner.pp_seconds),
    ];
    let (part, _) = parts.into_iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap_or(("compute", 0.0));
    // Every part that moved by a millisecond or more, largest first: they add up to the loss.
    let mut moved: Vec<(&str, f64)> = parts.iter().copied().filter(|p| p.1.abs() >= 1e-3).collect();
    moved.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
    if moved.is_empty() {
        return "as fast as the fastest to the millisecond (listed after it)".to_string();
    }
    let moved: Vec<String> = moved.iter().map(|(name, x)| format!("{x:+.3} s {name}")).collect();
    let slower = loser.step_seconds - winner.step_seconds;
    let why = match part {
        "compute" if l.train.checkpointing != w.train.checkpointing => format!(
            "recomputes more of the forward (checkpointing {} against {})",
            l.train.checkpointing.as_str(),
            w.train.checkpointing.as_str()
        ),
        "compute" => "more compute per GPU".to_string(),
        "bubble" => format!(
            "a larger pipeline bubble: pp={} {} with {} micro-batches against pp={} {} with {}",
            l.parallel.pp,
            schedule(l),
            l.pipeline_micro_batches(),
            w.parallel.pp,
            schedule(w),
            w.pipeline_micro_batches()
        ),
        "dp" => format!(
            "more data-parallel traffic: dp={} with sharding {} against dp={} with {}",
            l.parallel.dp,
            l.parallel.sharding.as_str(),
            w.parallel.dp,
            w.parallel.sharding.as_str()
        ),
        "tp" => format!(
            "more tensor-parallel traffic: tp={}{} against tp={}",
            l.parallel.tp,
            if loser.tp_crosses_nodes { ", across nodes" } else { "" },
            w.parallel.tp
        ),
        _ => format!(
            "more pipeline sends: pp={} with micro-batch {} against pp={} with {}",
            l.parallel.pp, l.train.micro_batch, w.parallel.pp, w.train.micro_batch
        ),
    };
    format!("{slower:.3} s slower per step: {why} ({})", moved.join(", "))
}

fn tally(rejected: &mut Vec<Rejected>, reason: String, spec: &ExperimentSpec) {
    match rejected.iter_mut().find(|r| r.reason == reason) {
        Some(r) => r.count += 1,
        None => rejected.push(Rejected { reason, count: 1, example: describe(spec) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::estimate::model_presets;

    fn model(key: &str) -> ModelSpec {
        model_presets().into_iter().find(|p| p.key == key).map(|p| p.model).expect("preset exists")
    }

    fn search_for(key: &str, cluster: Cluster, gpus: u64, global_batch: usize, attention: Attention) -> SearchResult {
        let request = SearchRequest {
            model: model(key),
            cluster: cluster.with_gpus(gpus),
            global_batch,
            precision: Precision::Bf16,
            attention,
        };
        let result = search(&request).expect("searchable");
        println!("{key} on {gpus} GPUs, batch {global_batch}: {} examined, {} fit", result.examined, result.fitting);
        for c in &result.best {
            println!(
                "  {:.3} s  MFU {:.3}  {:.1} GB  {}  {}",
                c.step_seconds,
                c.mfu,
                c.memory_per_gpu_bytes as f64 / 1e9,
                c.layout,
                c.loses_by.as_deref().unwrap_or("")
            );
        }
        for c in &result.too_big {
            println!("  too big: {} {}", c.layout, c.loses_by.as_deref().unwrap_or(""));
        }
        for r in &result.rejected {
            println!("  rejected {} x {} (e.g. {})", r.count, r.reason, r.example);
        }
        result
    }

    /// Narayanan et al. 2021, Table 1 (A100 80GB, 8 per node, sequence 2048, no
    /// FlashAttention yet): the published t and p for three model sizes, and GPT-3 175B on
    /// 1024 GPUs with the paper's batch of 1536. The search keeps TP inside the node, picks
    /// a pipeline within a factor of two of theirs, and lists their layout among its ten
    /// fastest, within 5% of its pick.
    #[test]
    fn megatron_s_published_layouts_are_near_the_top() {
        for (key, gpus, batch, (tp, pp)) in [
            ("megatron-145b", 1536, 2304, (8, 8)),
            ("megatron-310b", 1920, 2160, (8, 16)),
            ("gpt3-175b", 1024, 1536, (8, 8)),
            ("megatron-1t", 3072, 3072, (8, 64)),
        ] {
            let result = search_for(key, Cluster::a100_80gb_sxm(), gpus, batch, Attention::Naive);
            let top = &result.best[0];
            let top_tp = top.spec.parallel.tp;
            assert!(top_tp * 2 >= tp && top_tp <= 8, "{key}: {}", top.layout);
            let published = result.best.iter().find(|c| (c.spec.parallel.tp, c.spec.parallel.pp) == (tp, pp));
            let published = published.unwrap_or_else(|| panic!("{key}: tp={tp} pp={pp} is not in the top {TOP}"));
            assert!(published.step_seconds <= top.step_seconds * 1.10, "{key}: {}", published.layout);
            assert!(result.best.iter().all(|c| !c.tp_crosses_nodes), "{key}: TP stays in a node");
            assert!(result.best.windows(2).all(|w| w[0].step_seconds <= w[1].step_seconds));
            assert!(result.best.iter().skip(1).all(|c| c.loses_by.is_some()));
            assert!(result.best.iter().all(|c| c.memory_per_gpu_bytes <= 80_000_000_000));
        }
    }

    /// A model that fits one GPU many times over needs no tensor parallelism, and plain
    /// data parallelism is as good as any pipeline (the estimate's differences among the
    /// ten are under 1%: it does not model small GEMMs' lower efficiency).
    #[test]
    fn a_small_model_needs_no_tensor_parallelism() {
        let result = search_for("gpt2-124m", Cluster::a100_80gb_sxm(), 8, 256, Attention::Flash);
        let top = &result.best[0];
        assert_eq!(top.spec.parallel.tp, 1, "{}", top.layout);
        let replicated = result.best.iter().find(|c| (c.spec.parallel.dp, c.spec.parallel.pp) == (8, 1));
        let replicated = replicated.expect("dp=8 is among the ten");
        assert!(replicated.step_seconds <= top.step_seconds * 1.01, "{}", replicated.layout);
        assert_eq!(result.best.len(), TOP);
        // Each loser says how much slower it is.
        let loser = result.best.last().unwrap();
        let why = loser.loses_by.as_deref().unwrap();
        let slower = loser.step_seconds - top.step_seconds;
        assert!(why.starts_with(&format!("{slower:.3} s slower")) || why.starts_with("as fast"), "{why}");
    }

    /// GPT-2 124M at dp = 8 on A100s: 1 MiB buckets mean hundreds of all-reduces a step,
    /// each paying the ring's latency 2(W-1) times, and lose to PyTorch's 25 MiB (or
    /// larger) buckets, which the search tries and names.
    #[test]
    fn the_search_tries_bucket_sizes_and_small_buckets_lose() {
        let result = search_for("gpt2-124m", Cluster::a100_80gb_sxm(), 8, 256, Attention::Flash);
        let ddp = |bucket: u64| {
            result.best.iter().chain(&result.too_big).find(|c| {
                let p = &c.spec.parallel;
                (p.dp, p.sharding, p.bucket_bytes) == (8, Sharding::None, bucket)
            })
        };
        let big = ddp(25 << 20).or(ddp(100 << 20)).expect("dp=8 DDP with large buckets among the ten");
        assert!(big.layout.contains("buckets 25 MiB") || big.layout.contains("buckets 100 MiB"), "{}", big.layout);
        assert!(ddp(1 << 20).is_none(), "1 MiB buckets are not among the fastest");
        let mut one_mib = big.spec.clone();
        one_mib.parallel.bucket_bytes = 1 << 20;
        let cluster = Cluster::a100_80gb_sxm().with_gpus(8);
        let slow = estimate(&one_mib, &planner::plan(&one_mib).unwrap(), &cluster.for_spec(&one_mib));
        assert!(slow.dp.seconds > 3.0 * big.dp_seconds, "{} vs {}", slow.dp.seconds, big.dp_seconds);
    }

    /// Llama-3 70B on 64 H100s with the study chapter's 2048 sequences of 8192: it fits
    /// only split, and every listed layout splits it and fits.
    #[test]
    fn llama_3_70b_fits_only_split() {
        let result = search_for("llama3-70b", Cluster::h100_80gb_sxm(), 64, 2048, Attention::Flash);
        assert!(!result.best.is_empty());
        for c in &result.best {
            let p = &c.spec.parallel;
            assert!(p.tp * p.pp > 1 || p.sharding != Sharding::None, "{}", c.layout);
            assert!(c.memory_per_gpu_bytes <= 80_000_000_000 && !c.tp_crosses_nodes, "{}", c.layout);
        }
        let replicated = result.rejected.iter().find(|r| r.reason.contains("more than its 80 GB"));
        assert!(replicated.is_some_and(|r| r.count > 0));
    }

    /// Llama-3 405B's 126 layers split into no power of two: the search tries unequal
    /// stages too. On 16,384 H100s with 2048 sequences of 8192 (the Llama 3 paper's
    /// pre-training setup, TP 8 x PP 16 x DP 128 there), TP stays at 8 inside a node and the
    /// published layout, 16 stages of 7 or 8 layers, is among the ten.
    #[test]
    fn llama_3_405b_splits_its_126_layers_unevenly() {
        let result = search_for("llama3-405b", Cluster::h100_80gb_sxm(), 16_384, 2048, Attention::Flash);
        let top = &result.best[0];
        assert_eq!(top.spec.parallel.tp, 8, "{}", top.layout);
        assert!(result.best.iter().all(|c| !c.tp_crosses_nodes));
        let published = result.best.iter().find(|c| (c.spec.parallel.tp, c.spec.parallel.pp) == (8, 16));
        let published = published.expect("TP 8 x PP 16 is among the ten");
        assert!(published.step_seconds <= top.step_seconds * 1.05, "{}", published.layout);
    }

    #[test]
    fn requests_that_cannot_be_searched_say_why() {
        let good = SearchRequest {
            model: model("gpt2-124m"),
            cluster: Cluster::default(),
            global_batch: 64,
            precision: Precision::Bf16,
            attention: Attention::Flash,
        };
        let fields = |r: &SearchRequest| search(r).unwrap_err().into_iter().map(|e| e.field).collect::<Vec<_>>();
        let nothing = SearchRequest { cluster: Cluster::default().with_gpus(0), global_batch: 0, ..good.clone() };
        assert_eq!(fields(&nothing), ["cluster.gpus", "global_batch"]);
        let bad_model = SearchRequest { model: ModelSpec { heads: 5, ..good.model.clone() }, ..good.clone() };
        assert_eq!(fields(&bad_model), ["model.heads"]);
        // A batch no replica count divides evenly into micro-batches leaves nothing to list.
        let odd = SearchRequest { global_batch: 3, cluster: Cluster::default().with_gpus(2), ..good };
        let result = search(&odd).unwrap();
        assert!(result.best.iter().all(|c| c.spec.parallel.dp == 1 || 3 % c.spec.parallel.dp == 0));
    }
}
