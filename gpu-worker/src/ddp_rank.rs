//! One rank of a data-parallel training run (`distlab-worker rank ... train`): joins the
//! ring, trains its slice of every global batch, reports to the launcher.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use distlab_common::trace::RankTrace;
use distlab_common::*;
use distlab_worker::comm::RingCommunicator;
use distlab_worker::parallel::DpGroup;
use distlab_worker::trace::CommTracer;
use distlab_worker::train::{train_rank, TrainOptions, SPAN_STEPS};

use crate::demo::RankOutput;
use crate::rank::{connect, LauncherChannel};

/// Collectives recorded step by step per rank (the first ones); counters cover the rest.
const DETAILED_COLLECTIVES: u64 = 64;

/// A fault to inject, for the launcher's failure tests:
/// `DISTLAB_FAULT=rank:step:exit|hang|panic` makes that rank fail after that step.
struct Fault {
    rank: usize,
    step: u64,
    kind: String,
}

fn fault_from_env() -> Option<Fault> {
    let v = std::env::var("DISTLAB_FAULT").ok()?;
    let mut parts = v.split(':');
    let rank = parts.next()?.parse().ok()?;
    let step = parts.next()?.parse().ok()?;
    let kind = parts.next()?.to_string();
    Some(Fault { rank, step, kind })
}

pub fn run(
    dir: &std::path::Path,
    rank: usize,
    world: usize,
    spec: &ExperimentSpec,
    threads: usize,
    collective_timeout: Duration,
) -> anyhow::Result<()> {
    let mesh = connect(dir, rank, world)?;
    let members: Vec<usize> = (0..world).collect();
    let tracer = Arc::new(CommTracer::new(rank, DETAILED_COLLECTIVES));
    let grads = RingCommunicator::new(&mesh, "dp", members.clone(), collective_timeout, Some(tracer.clone()))?;
    // ZeRO and FSDP run their parameter collectives on the training thread, on this one:
    // trace it too.
    let scalars_tracer = (spec.parallel.sharding != Sharding::None).then(|| tracer.clone());
    let scalars = RingCommunicator::new(&mesh, "dp-main", members, collective_timeout, scalars_tracer)?;
    let dp = DpGroup { rank, world, grads: Box::new(grads), scalars: Box::new(scalars) };

    let channel = LauncherChannel;
    let fault = fault_from_env().filter(|f| f.rank == rank);
    let mut on_event = |event: RunEvent| {
        if let (Some(f), RunEvent::Metric(m)) = (&fault, &event) {
            if m.step == f.step {
                inject(&f.kind, rank, m.step);
            }
        }
        // Every rank computes the same global metrics; rank 0 speaks for the run.
        if rank == 0 {
            channel.output(&RankOutput::Event(event));
        }
    };
    let run = train_rank(spec, &TrainOptions { threads }, Some(dp), &mut on_event, &AtomicBool::new(false))?;
    let trace = RankTrace {
        rank: rank as u32,
        world: world as u32,
        span_steps: SPAN_STEPS,
        spans: run.spans,
        comm: tracer.snapshot(),
        memory: Some(run.memory),
    };
    channel.output(&RankOutput::Event(RunEvent::Trace(trace)));
    if rank == 0 {
        channel.output(&RankOutput::Summary(run.summary));
    }
    Ok(())
}

fn inject(kind: &str, rank: usize, step: u64) {
    eprintln!("injected fault: rank {rank} {kind} after step {step}");
    match kind {
        "exit" => std::process::exit(3),
        "panic" => panic!("injected panic on rank {rank} after step {step}"),
        "hang" => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        _ => {}
    }
}
