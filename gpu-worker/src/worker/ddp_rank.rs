//! One rank of a multi-process training run (`distlab-worker rank ... train`): finds its
//! place in the dp x tp x pp mesh, joins its data-parallel, pipeline and tensor-parallel
//! groups, trains its part, reports to the launcher.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use distlab_common::trace::RankTrace;
use distlab_common::*;
use distlab_worker::comm::{Alone, Communicator, RingCommunicator};
use distlab_worker::parallel::async_ps::ServerLinks;
use distlab_worker::parallel::context::ContextParallel;
use distlab_worker::parallel::expert::ExpertParallel;
use distlab_worker::parallel::fault_tolerant::REPLICA_DIGEST_LOG;
use distlab_worker::parallel::mesh::Topology;
use distlab_worker::parallel::pipeline::PipelineGroup;
use distlab_worker::parallel::tensor::TensorParallel;
use distlab_worker::parallel::{DpGroup, HybridGroups};
use distlab_worker::trace::CommTracer;
use distlab_worker::train::{train_rank, Groups, TrainOptions, CHECKPOINT_LOG, REJOIN_LOG, SPAN_STEPS};

use super::demo::RankOutput;
use super::quorum::QuorumClient;
use super::rank::{connect, LauncherChannel, Place};

/// Collectives recorded step by step per rank (the first ones); counters cover the rest.
const DETAILED_COLLECTIVES: u64 = 64;

/// A fault to inject, for the launcher's failure tests:
/// `DISTLAB_FAULT=rank:step:exit|hang|panic|kill` makes that rank fail after that step
/// (`kill`: SIGKILL, as the kernel's OOM killer or a lost machine would).
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

pub fn run(place: &Place, spec: &ValidSpec, opts: &TrainOptions, collective_timeout: Duration) -> anyhow::Result<()> {
    let (rank, world) = (place.rank, place.world);
    let p = &spec.parallel;
    // Fault-tolerant replicas meet only through their quorum's rings, which a replacement
    // can join: no mesh of the whole world.
    let fault_tolerant = p.fault_tolerance == FaultTolerance::Replicas;
    let mesh = if fault_tolerant { None } else { Some(connect(place)?) };
    let topology = Topology::new(p.dp, p.tp, p.pp);
    let coords = topology.coords(rank);
    let tracer = Arc::new(CommTracer::new(rank, DETAILED_COLLECTIVES));
    let ring = |name: &str, members: Vec<usize>, traced: bool| match &mesh {
        Some(mesh) => RingCommunicator::new(mesh, name, members, collective_timeout, traced.then(|| tracer.clone())),
        None => Err(std::io::Error::other(format!("group {name}: fault-tolerant replicas have no world mesh"))),
    };
    // Expert parallelism: consecutive DP ranks share the experts (the all-to-all group,
    // traced); the ranks at the same place of each such group hold the same experts.
    let dp_members = topology.dp_group(rank);
    let ep_size = p.ep.max(1);
    let ep_group = &dp_members[coords.dp / ep_size * ep_size..][..ep_size];
    let ep = if ep_size > 1 { Some(ExpertParallel::new(Box::new(ring("ep", ep_group.to_vec(), true)?))) } else { None };
    // Context parallelism: consecutive DP ranks share each sequence (the all-to-all group,
    // traced); they belong to the data-parallel group as before.
    let cp_size = p.cp.max(1);
    let cp_group = &dp_members[coords.dp / cp_size * cp_size..][..cp_size];
    let cp =
        if cp_size > 1 { Some(ContextParallel::new(Box::new(ring("cp", cp_group.to_vec(), true)?))) } else { None };
    let replicas: Vec<usize> = dp_members.iter().copied().skip(coords.dp % ep_size).step_by(ep_size).collect();
    let dp = if fault_tolerant {
        let membership = QuorumClient::connect(&place.dir, rank, collective_timeout)?;
        Some(DpGroup {
            rank: coords.dp,
            world: p.dp,
            grads: Box::new(Alone),
            scalars: Box::new(Alone),
            experts: None,
            hybrid: None,
            parameter_server: None,
            membership: Some(Box::new(membership)),
        })
    } else if p.dp > 1 {
        let members = dp_members.clone();
        let mut grads = ring("dp", members.clone(), true)?;
        // The gradients' all-reduce runs the spec's algorithm (the loop's scalars the ring's).
        grads.set_all_reduce(p.allreduce, p.ranks_per_node);
        // ZeRO and FSDP run their parameter collectives on the training thread, on this
        // one: trace it too.
        let scalars = ring("dp-main", members, p.sharding != Sharding::None)?;
        let experts = match ep_size > 1 && replicas.len() > 1 {
            true => Some(Box::new(ring("ep-replicas", replicas, true)?) as Box<dyn Communicator>),
            false => None,
        };
        // Hybrid sharding: groups of S consecutive DP ranks shard, the same places of the
        // groups replicate (both traced: their bytes are the page's link classes).
        let hybrid = match p.sharding {
            Sharding::Hsdp => {
                let ways = p.shard_ways();
                let group = &dp_members[coords.dp / ways * ways..][..ways];
                let same_place = dp_members.iter().copied().skip(coords.dp % ways).step_by(ways).collect();
                Some(HybridGroups {
                    shard: Box::new(ring("hsdp-shard", group.to_vec(), true)?),
                    replicas: Box::new(ring("hsdp-replicas", same_place, true)?),
                })
            }
            _ => None,
        };
        // Asynchronous SGD: a two-rank group between the server (DP rank 0) and each worker.
        let parameter_server = match p.sync {
            DataSync::AsyncPs if coords.dp == 0 => Some(ServerLinks::Server(
                (1..p.dp)
                    .map(|w| Ok(Box::new(ring(&format!("ps-{w}"), vec![dp_members[0], dp_members[w]], true)?) as _))
                    .collect::<std::io::Result<Vec<Box<dyn Communicator>>>>()?,
            )),
            DataSync::AsyncPs => {
                let pair = vec![dp_members[0], dp_members[coords.dp]];
                Some(ServerLinks::Worker(Box::new(ring(&format!("ps-{}", coords.dp), pair, true)?)))
            }
            _ => None,
        };
        let (grads, scalars) = (Box::new(grads), Box::new(scalars));
        Some(DpGroup {
            rank: coords.dp,
            world: p.dp,
            grads,
            scalars,
            experts,
            hybrid,
            parameter_server,
            membership: None,
        })
    } else {
        None
    };
    let pp = if p.pp > 1 {
        let members = topology.pp_group(rank);
        // (its sends are counted, never recorded step by step)
        let send = ring("pp-send", members.clone(), true)?;
        let recv = ring("pp", members, false)?;
        Some(PipelineGroup { stage: coords.stage, stages: p.pp, send: Box::new(send), recv: Box::new(recv) })
    } else {
        None
    };

    // Tensor-parallel partners run every block together: their all-reduces are on the
    // critical path (not traced step by step: there are four per block per micro-batch).
    let tp =
        if p.tp > 1 { Some(TensorParallel::new(Box::new(ring("tp", topology.tp_group(rank), false)?))) } else { None };

    let channel = LauncherChannel;
    // (a drill in the spec is a fault too: this rank's process killed after that step)
    let drill = p.fault_drill.map(|d| Fault { rank: d.rank, step: d.after_step, kind: "kill".into() });
    let fault = fault_from_env().or(drill).filter(|f| f.rank == rank);
    let mut on_event = |event: RunEvent| {
        if let (Some(f), RunEvent::Metric(m)) = (&fault, &event) {
            if m.step == f.step {
                inject(&f.kind, rank, m.step);
            }
        }
        // Every rank computes the same global metrics; rank 0 speaks for the run. What only
        // this rank knows (its checkpoint writes, its warnings) every rank reports. Every
        // fault-tolerant replica sends its metric points: the launcher passes on each
        // step's first (rank 0 may be gone).
        let replica_metric = fault_tolerant && matches!(event, RunEvent::Metric(_));
        if rank == 0 || replica_metric || is_about_this_rank(&event) {
            channel.output(&RankOutput::Event(Box::new(event)));
        }
    };
    let run = train_rank(
        spec,
        opts,
        Groups {
            rank,
            machine: place.local.clone(),
            dp,
            pp,
            tp,
            ep,
            cp,
            pipe_bytes: mesh.as_ref().map_or(0, |m| m.pipe_bytes()),
            offload_dir: opts.offload_dir.clone(),
            dataset: opts.dataset.clone(),
            cut_text: opts.cut_text.clone(),
            tracer: Some(tracer.clone()),
        },
        &mut on_event,
        &AtomicBool::new(false),
    )?;
    let trace = RankTrace {
        rank: rank as u32,
        world: world as u32,
        span_steps: SPAN_STEPS,
        spans: run.spans,
        comm: tracer.snapshot(),
        memory: Some(run.memory),
        host: place.host(),
        applied_gradients: run.applied_gradients,
    };
    channel.output(&RankOutput::Event(Box::new(RunEvent::Trace(trace))));
    // (the launcher picks one fault-tolerant replica's)
    if rank == 0 || fault_tolerant {
        channel.output(&RankOutput::Summary(Box::new(run.summary)));
    }
    Ok(())
}

fn is_about_this_rank(event: &RunEvent) -> bool {
    match event {
        RunEvent::Log(line) => {
            line.level != LogLevel::Info
                || line.message.starts_with(CHECKPOINT_LOG)
                || line.message.starts_with(REPLICA_DIGEST_LOG)
                || line.message.starts_with(REJOIN_LOG)
        }
        _ => false,
    }
}

fn inject(kind: &str, rank: usize, step: u64) {
    eprintln!("injected fault: rank {rank} {kind} after step {step}");
    match kind {
        "exit" => std::process::exit(3),
        // SAFETY: kill(2) on this process; SIGKILL cannot be caught, so nothing runs after.
        "kill" => unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        },
        "panic" => panic!("injected panic on rank {rank} after step {step}"),
        "hang" => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        _ => {}
    }
}
