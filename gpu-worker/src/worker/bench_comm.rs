//! `distlab-worker bench-comm --world W`: bus bandwidth of the ring collectives between rank
//! processes, with the nccl-tests definitions (as torch's gloo is measured in
//! xtask/reference/allreduce.py):
//!   algbw = bytes / time;  busbw = algbw * 2(W-1)/W (all-reduce), * (W-1)/W (reduce-scatter,
//!   all-gather), where bytes is the full buffer. Reduce-scatter and all-gather run both in
//!   place (as ZeRO and FSDP call them: the rank's shard is a slice of the full buffer) and
//!   out of place (a separate shard buffer, as the demos and the compressors call them: one
//!   more copy of the shard).
//! Then the all-reduce algorithms side by side (`AlgorithmPoint`): each one's time, and the
//! bytes rank 0 (the busiest in every one: the root, the first leader) sent per call.

use std::time::{Duration, Instant};

use serde::Serialize;

use distlab_common::trace::CollectiveOp;
use distlab_common::AllReduce;
use distlab_worker::comm::{chunk_range, Communicator, ReduceOp, RingCommunicator};

use super::rank::{connect, LauncherChannel, Place};

#[derive(Serialize)]
pub struct BandwidthPoint {
    pub bench: &'static str,
    pub op: &'static str,
    /// Whether the shard is a slice of the full buffer (always, for all-reduce).
    pub in_place: bool,
    /// "shared": buffers from `alloc_shared` (peers read them directly); "private": ordinary
    /// memory (peers copy it out with process_vm_readv, or it goes through the pipe).
    pub memory: &'static str,
    pub world: usize,
    /// Hosts the ranks span (`--simulated-hosts`): between hosts the bytes go over TCP.
    pub hosts: usize,
    pub bytes: usize,
    pub iters: usize,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
}

/// The yardstick for the collectives: one thread copying `bytes` between two buffers
/// (machine_limits.rs), reported as bytes copied per second.
pub fn memcpy_point(bytes: usize) -> BandwidthPoint {
    let iters = 10;
    let gbps = distlab_worker::machine_limits::memcpy_gbps(bytes);
    BandwidthPoint {
        bench: "memcpy",
        op: "memcpy",
        in_place: false,
        memory: "private",
        world: 1,
        hosts: 1,
        bytes,
        iters,
        time_us: bytes as f64 / gbps / 1e3,
        algbw_gbps: gbps,
        busbw_gbps: gbps,
    }
}

/// One all-reduce algorithm at one size (`hierarchical`: nodes of 2 ranks).
#[derive(Serialize)]
pub struct AlgorithmPoint {
    pub bench: &'static str,
    pub algorithm: &'static str,
    pub world: usize,
    pub bytes: usize,
    pub iters: usize,
    pub time_us: f64,
    /// What rank 0 sent per call, counted as it was sent.
    pub rank0_sent_bytes: u64,
}

pub fn sizes(min_bytes: usize, max_bytes: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut b = min_bytes.max(4);
    while b <= max_bytes {
        out.push(b);
        b *= 4;
    }
    out
}

/// Runs on every rank; rank 0 reports one point per (op, size).
pub fn run_rank(place: &Place, min_bytes: usize, max_bytes: usize) -> anyhow::Result<()> {
    let (rank, world) = (place.rank, place.world);
    let hosts = place.hosts.iter().collect::<std::collections::BTreeSet<_>>().len().max(1);
    let mesh = connect(place)?;
    let mut comm = RingCommunicator::new(&mesh, "world", (0..world).collect(), Duration::from_secs(60), None)?;
    let channel = LauncherChannel;
    let max_elems = max_bytes / 4;
    let mut shared = (comm.alloc_shared(max_elems)?, comm.alloc_shared(max_elems)?);
    let mut private = (vec![0.0f32; max_elems], vec![0.0f32; max_elems]);
    for memory in ["shared", "private"] {
        let (buf, out): (&mut [f32], &mut [f32]) =
            if memory == "shared" { (&mut shared.0, &mut shared.1) } else { (&mut private.0, &mut private.1) };
        // Zeros: a sum of zeros stays zero however many times it runs (ones would double
        // on every all-reduce at W=2 and reach infinity); the bytes moved are the same.
        buf.fill(0.0);
        for (op, in_place) in [
            (CollectiveOp::AllReduce, true),
            (CollectiveOp::ReduceScatter, true),
            (CollectiveOp::ReduceScatter, false),
            (CollectiveOp::AllGather, true),
            (CollectiveOp::AllGather, false),
        ] {
            for bytes in sizes(min_bytes, max_bytes) {
                let n = bytes / 4;
                // Enough iterations for ~0.2 s of traffic, at least 3.
                let iters = ((200 << 20) / bytes).clamp(3, 200);
                let mut run = |comm: &mut RingCommunicator| -> anyhow::Result<()> {
                    let shard = chunk_range(n, world, rank);
                    match (op, in_place) {
                        (CollectiveOp::AllReduce, _) => comm.all_reduce(&mut buf[..n], ReduceOp::Sum)?,
                        (CollectiveOp::ReduceScatter, true) => {
                            comm.reduce_scatter_in_place(&mut buf[..n], ReduceOp::Sum)?
                        }
                        (CollectiveOp::ReduceScatter, false) => {
                            comm.reduce_scatter(&mut buf[..n], &mut out[..shard.len()], ReduceOp::Sum)?
                        }
                        (_, true) => comm.all_gather_in_place(&mut buf[..n])?,
                        (_, false) => comm.all_gather(&buf[..shard.len()], &mut out[..n])?,
                    }
                    Ok(())
                };
                run(&mut comm)?; // warm-up
                comm.barrier()?;
                let start = Instant::now();
                for _ in 0..iters {
                    run(&mut comm)?;
                }
                let time_us = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
                let algbw = bytes as f64 / (time_us * 1e-6) / 1e9;
                let factor = match op {
                    CollectiveOp::AllReduce => 2.0 * (world as f64 - 1.0) / world as f64,
                    _ => (world as f64 - 1.0) / world as f64,
                };
                if rank == 0 {
                    channel.output(&BandwidthPoint {
                        bench: "collective",
                        op: op.as_str(),
                        in_place,
                        memory,
                        world,
                        hosts,
                        bytes,
                        iters,
                        time_us,
                        algbw_gbps: algbw,
                        busbw_gbps: algbw * factor,
                    });
                }
            }
        }
    }
    let buf = &mut private.0;
    for algorithm in [AllReduce::Ring, AllReduce::Naive, AllReduce::Tree, AllReduce::Hierarchical] {
        comm.set_all_reduce(algorithm, 2);
        for bytes in sizes(min_bytes, max_bytes) {
            let n = bytes / 4;
            let iters = ((100 << 20) / bytes).clamp(3, 100);
            buf[..n].fill(0.0);
            comm.all_reduce(&mut buf[..n], ReduceOp::Sum)?; // warm-up
            comm.barrier()?;
            let (start, sent_before) = (Instant::now(), comm.bytes_sent());
            for _ in 0..iters {
                comm.all_reduce(&mut buf[..n], ReduceOp::Sum)?;
            }
            let time_us = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
            // The barrier's one float is not in it: the calls alone.
            let rank0_sent_bytes = (comm.bytes_sent() - sent_before) / iters as u64;
            if rank == 0 {
                channel.output(&AlgorithmPoint {
                    bench: "all_reduce_algorithm",
                    algorithm: algorithm.as_str(),
                    world,
                    bytes,
                    iters,
                    time_us,
                    rank0_sent_bytes,
                });
            }
        }
    }
    comm.set_all_reduce(AllReduce::Ring, 1);
    Ok(())
}
