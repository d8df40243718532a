//! The collective demo: no model, just one collective across the dp ranks on small
//! readable vectors, recorded step by step for the ring replay page.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use distlab_common::all_reduce::elements_sent;
use distlab_common::trace::RankTrace;
use distlab_common::*;
use distlab_worker::comm::{chunk_range, Communicator, ReduceOp, RingCommunicator};
use distlab_worker::trace::CommTracer;
use serde::{Deserialize, Serialize};

use super::rank::{connect, LauncherChannel, Place};

/// What each rank reports back to the launcher.
#[derive(Serialize, Deserialize)]
pub struct DemoRankResult {
    pub rank: usize,
    pub bytes_sent: u64,
    pub output: Vec<f32>,
}

/// Runs on every rank: the collective, then its trace and result to the launcher.
pub fn run_rank(place: &Place, spec: &ExperimentSpec) -> anyhow::Result<()> {
    let (rank, world) = (place.rank, place.world);
    let demo = spec.demo.as_ref().context("a collective demo spec")?;
    let mesh = connect(place)?;
    let tracer = Arc::new(CommTracer::new(rank, 16));
    let mut comm =
        RingCommunicator::new(&mesh, "dp", (0..world).collect(), Duration::from_secs(30), Some(tracer.clone()))?;
    // An all-reduce demo runs the spec's algorithm (ring, naive, tree, hierarchical).
    comm.set_all_reduce(spec.parallel.allreduce, spec.parallel.ranks_per_node);
    let n = demo.elements;
    let mut full: Vec<f32> = (0..n).map(|i| CollectiveDemo::initial_value(rank, i)).collect();
    let output = match demo.op {
        DemoOp::AllReduce => {
            comm.all_reduce(&mut full, ReduceOp::Sum)?;
            full
        }
        DemoOp::ReduceScatter => {
            let mut shard = vec![0.0; chunk_range(n, world, rank).len()];
            comm.reduce_scatter(&mut full, &mut shard, ReduceOp::Sum)?;
            shard
        }
        DemoOp::AllGather => {
            let mine = chunk_range(n, world, rank);
            let mut gathered = vec![0.0; n];
            comm.all_gather(&full[mine], &mut gathered)?;
            gathered
        }
        DemoOp::AllToAll => {
            let mut exchanged = vec![0.0; n];
            comm.all_to_all(&full, &mut exchanged)?;
            exchanged
        }
    };
    let channel = LauncherChannel;
    let trace = RankTrace {
        rank: rank as u32,
        world: world as u32,
        span_steps: 0,
        spans: vec![],
        comm: tracer.snapshot(),
        memory: None,
        host: place.host(),
        applied_gradients: Vec::new(),
    };
    channel.output(&RankOutput::Event(Box::new(RunEvent::Trace(trace))));
    channel.output(&RankOutput::Demo(DemoRankResult { rank, bytes_sent: comm.bytes_sent(), output }));
    Ok(())
}

/// What a rank process sends to the launcher as its outputs.
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RankOutput {
    /// For the experiment's event stream.
    Event(Box<RunEvent>),
    Demo(DemoRankResult),
    /// Rank 0's summary at the end of a training run.
    Summary(Box<RunSummary>),
}

/// Checks every rank's result against a sequential computation and the byte formula (of
/// `algorithm`, for an all-reduce).
pub fn check(
    demo: &CollectiveDemo,
    (algorithm, ranks_per_node): (AllReduce, usize),
    world: usize,
    results: &[DemoRankResult],
) -> CollectiveCheck {
    let n = demo.elements;
    let sum: Vec<f32> = (0..n).map(|i| (0..world).map(|r| CollectiveDemo::initial_value(r, i)).sum()).collect();
    let mut max_abs_error = 0.0f64;
    for r in results {
        let expected: Vec<f32> = match demo.op {
            DemoOp::AllReduce => sum.clone(),
            DemoOp::ReduceScatter => sum[chunk_range(n, world, r.rank)].to_vec(),
            DemoOp::AllGather => (0..n)
                .map(|i| {
                    let owner = (0..world).find(|&o| chunk_range(n, world, o).contains(&i)).unwrap_or(0);
                    CollectiveDemo::initial_value(owner, i)
                })
                .collect(),
            // Chunk i: what rank i meant for this rank (chunk `rank` of rank i's vector).
            DemoOp::AllToAll => {
                let chunk = n / world.max(1);
                (0..world)
                    .flat_map(|i| {
                        (r.rank * chunk..(r.rank + 1) * chunk).map(move |e| CollectiveDemo::initial_value(i, e))
                    })
                    .collect()
            }
        };
        if expected.len() != r.output.len() {
            max_abs_error = f64::INFINITY;
            continue;
        }
        for (a, b) in expected.iter().zip(&r.output) {
            max_abs_error = max_abs_error.max((*a as f64 - *b as f64).abs());
        }
    }
    let w = world as f64;
    let d = (n * 4) as f64;
    let formula_bytes = match demo.op {
        DemoOp::AllReduce => 2.0 * (w - 1.0) / w * d,
        _ => (w - 1.0) / w * d,
    };
    let mut by_rank: Vec<&DemoRankResult> = results.iter().collect();
    by_rank.sort_by_key(|r| r.rank);
    let algorithm = if demo.op == DemoOp::AllReduce { algorithm } else { AllReduce::Ring };
    let rank_formula_bytes = match algorithm {
        AllReduce::Ring => Vec::new(),
        other => (0..world).map(|r| elements_sent(other, n, world, ranks_per_node, r) as u64 * 4).collect(),
    };
    CollectiveCheck {
        op: demo.op,
        world,
        elements: n,
        bytes_sent: by_rank.iter().map(|r| r.bytes_sent).collect(),
        formula_bytes,
        algorithm,
        rank_formula_bytes,
        max_abs_error,
    }
}
