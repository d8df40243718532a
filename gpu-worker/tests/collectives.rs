//! Ring collectives between ranks connected by real Unix sockets (one thread per rank
//! here; the launcher tests run them as processes). Values are small integers, so float
//! sums are exact and results must equal a sequential reduction bit for bit.

#[path = "ranks/mod.rs"]
mod ranks;

use std::sync::Arc;
use std::time::Duration;

use distlab_common::trace::CollectiveOp;
use distlab_worker::comm::*;
use distlab_worker::trace::CommTracer;
use ranks::on_ranks;

fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 17) as f32 - 8.0
}

const SIZES: [usize; 9] = [0, 1, 2, 7, 13, 1000, 4099, 70_001, 300_007];

#[test]
fn all_reduce_equals_a_sequential_sum_and_sends_2_w_minus_1_over_w_d() {
    for world in 1..=8 {
        for &len in &SIZES {
            let results = on_ranks(world, move |rank, comm| {
                let mut buf: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                (buf, comm.bytes_sent())
            });
            let expected: Vec<f32> = (0..len).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
            for (rank, (buf, sent)) in results.iter().enumerate() {
                assert_eq!(buf, &expected, "W={world} D={len} rank {rank}");
                // Reduce-scatter sends every chunk but the rank's own, all-gather every chunk
                // but its right neighbour's: 2(W-1)/W * D, exactly when W divides D.
                let own = chunk_range(len, world, rank).len();
                let right = chunk_range(len, world, (rank + 1) % world).len();
                let exact = if world == 1 { 0 } else { 4 * (2 * len - own - right) as u64 };
                assert_eq!(*sent, exact, "W={world} D={len} rank {rank}");
                let formula = 2.0 * (world as f64 - 1.0) / world as f64 * (4 * len) as f64;
                assert!((*sent as f64 - formula).abs() <= 8.0, "W={world} D={len}: {sent} vs {formula}");
            }
        }
    }
}

#[test]
fn all_reduce_avg_divides_by_the_group_size() {
    let results = on_ranks(4, |rank, comm| {
        let mut buf = vec![rank as f32 * 4.0; 10];
        comm.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
        buf
    });
    for buf in results {
        assert_eq!(buf, vec![6.0; 10]); // (0+4+8+12)/4
    }
}

#[test]
fn reduce_scatter_and_all_gather_move_w_minus_1_over_w_d() {
    for world in 1..=8 {
        for &len in &SIZES {
            let results = on_ranks(world, move |rank, comm| {
                let mut input: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                let mine = chunk_range(len, world, rank);
                let mut shard = vec![0.0; mine.len()];
                comm.reduce_scatter(&mut input, &mut shard, ReduceOp::Sum).unwrap();
                let after_rs = comm.bytes_sent();
                let mut full = vec![0.0; len];
                comm.all_gather(&shard, &mut full).unwrap();
                (shard, full, after_rs, comm.bytes_sent() - after_rs)
            });
            let expected: Vec<f32> = (0..len).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
            for (rank, (shard, full, rs_bytes, ag_bytes)) in results.iter().enumerate() {
                let mine = chunk_range(len, world, rank);
                assert_eq!(shard.as_slice(), &expected[mine.clone()], "reduce_scatter W={world} D={len} rank {rank}");
                assert_eq!(full, &expected, "all_gather W={world} D={len} rank {rank}");
                let own = mine.len();
                let right = chunk_range(len, world, (rank + 1) % world).len();
                let (rs_exact, ag_exact) =
                    if world == 1 { (0, 0) } else { (4 * (len - own) as u64, 4 * (len - right) as u64) };
                assert_eq!((*rs_bytes, *ag_bytes), (rs_exact, ag_exact), "W={world} D={len} rank {rank}");
            }
        }
    }
}

/// All-to-all: chunk i of rank j's output is chunk j of rank i's input, every rank sends
/// (W-1)/W x D, one chunk per step to a different peer, and the trace has every step; a
/// length that W does not divide is refused with the reason.
#[test]
fn all_to_all_hands_every_rank_its_chunk_of_every_other() {
    for world in 1..=8 {
        for chunk in [0, 1, 3, 1000, 20_011] {
            let len = chunk * world;
            let results = on_ranks(world, move |rank, comm| {
                let input: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                let mut output = vec![f32::NAN; len];
                comm.all_to_all(&input, &mut output).unwrap();
                (output, comm.bytes_sent())
            });
            for (j, (output, sent)) in results.iter().enumerate() {
                for i in 0..world {
                    let theirs: Vec<f32> = (j * chunk..(j + 1) * chunk).map(|e| value(i, e)).collect();
                    assert_eq!(
                        output[i * chunk..(i + 1) * chunk],
                        theirs,
                        "W={world} chunk {chunk}: rank {j} from {i}"
                    );
                }
                assert_eq!(*sent, (4 * (world - 1) * chunk) as u64, "W={world} chunk {chunk} rank {j}");
            }
        }
    }
    let tracers: Vec<Arc<CommTracer>> = (0..4).map(|r| Arc::new(CommTracer::new(r, 10))).collect();
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..4)
        .map(|rank| {
            let (path, tracer) = (dir.path().to_path_buf(), tracers[rank].clone());
            std::thread::spawn(move || {
                let mesh = Mesh::connect(&path, rank, 4, Duration::from_secs(10)).unwrap();
                let members = vec![0, 1, 2, 3];
                let mut comm =
                    RingCommunicator::new(&mesh, "ep", members, Duration::from_secs(10), Some(tracer)).unwrap();
                let input: Vec<f32> = (0..8).map(|i| value(rank, i)).collect();
                let mut output = vec![0.0; 8];
                comm.all_to_all(&input, &mut output).unwrap();
                let mut wrong = vec![0.0; 7];
                comm.all_to_all(&input[..7], &mut wrong).unwrap_err().to_string()
            })
        })
        .collect();
    let refusals: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, tracer) in tracers.iter().enumerate() {
        let trace = tracer.snapshot();
        assert_eq!(trace.collectives[0].op, CollectiveOp::AllToAll);
        // Step s goes to the rank s places on, with the chunk meant for it.
        let sent: Vec<(u32, u32)> = trace.steps.iter().map(|s| (s.to, s.chunk)).collect();
        let want: Vec<(u32, u32)> = (1..4).map(|s| (((rank + s) % 4) as u32, ((rank + s) % 4) as u32)).collect();
        assert_eq!(sent, want, "rank {rank}");
        assert!(refusals[rank].contains("a multiple of the 4 ranks"), "{}", refusals[rank]);
    }
}

#[test]
fn broadcast_send_recv_and_barrier() {
    for world in 1..=5 {
        let results = on_ranks(world, move |rank, comm| {
            let mut buf: Vec<f32> =
                if rank == world - 1 { (0..100_003).map(|i| i as f32).collect() } else { vec![0.0; 100_003] };
            comm.broadcast(&mut buf, world - 1).unwrap();
            comm.barrier().unwrap();
            // Each rank sends its rank to the right and receives from the left.
            let mut got = [0.0f32; 3];
            if world > 1 {
                let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                comm.send(&[rank as f32; 3], next).unwrap();
                comm.recv(&mut got, prev).unwrap();
            }
            (buf, got)
        });
        for (rank, (buf, got)) in results.iter().enumerate() {
            assert!(buf.iter().enumerate().all(|(i, &x)| x == i as f32), "broadcast W={world} rank {rank}");
            if world > 1 {
                assert_eq!(got, &[((rank + world - 1) % world) as f32; 3]);
            }
        }
    }
}

#[test]
fn mismatched_collectives_are_reported_not_misread() {
    let results = on_ranks(2, |rank, comm| {
        let mut buf = vec![1.0f32; if rank == 0 { 10 } else { 12 }];
        comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(|e| e.to_string())
    });
    let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(!errors.is_empty());
    assert!(errors.iter().any(|e| e.contains("are not running the same collectives")), "{errors:?}");
}

#[test]
fn a_silent_peer_times_out_with_the_collective_and_the_peer_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let silent = std::thread::spawn(move || {
        let mesh = Mesh::connect(&path, 1, 2, Duration::from_secs(10)).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        drop(mesh);
    });
    let mesh = Mesh::connect(dir.path(), 0, 2, Duration::from_secs(10)).unwrap();
    let mut comm = RingCommunicator::new(&mesh, "dp", vec![0, 1], Duration::from_millis(300), None).unwrap();
    let err = comm.all_reduce(&mut [1.0; 4], ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("all_reduce #0 in group dp") && err.contains("rank 1"), "{err}");
    assert!(err.contains("waited 0.3 s"), "{err}");
    silent.join().unwrap();
}

#[test]
fn the_trace_records_every_ring_step_of_a_small_all_reduce() {
    let tracers: Vec<Arc<CommTracer>> = (0..4).map(|r| Arc::new(CommTracer::new(r, 10))).collect();
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..4)
        .map(|rank| {
            let path = dir.path().to_path_buf();
            let tracer = tracers[rank].clone();
            std::thread::spawn(move || {
                let mesh = Mesh::connect(&path, rank, 4, Duration::from_secs(10)).unwrap();
                let mut comm =
                    RingCommunicator::new(&mesh, "dp", vec![0, 1, 2, 3], Duration::from_secs(10), Some(tracer))
                        .unwrap();
                let mut buf: Vec<f32> = (0..16).map(|i| (rank * 100 + i) as f32).collect();
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
    for (rank, tracer) in tracers.iter().enumerate() {
        let trace = tracer.snapshot();
        assert_eq!(trace.collectives.len(), 1);
        let c = &trace.collectives[0];
        assert_eq!(c.op, CollectiveOp::AllReduce);
        assert_eq!(c.bytes_sent, 2 * 3 * 4 * 4); // 2(W-1) chunks of 4 floats
        assert_eq!(c.input.as_ref().unwrap()[0], (rank * 100) as f32);
        assert_eq!(c.output.as_ref().unwrap()[0], (100 + 200 + 300) as f32);
        assert_eq!(trace.steps.len(), 6, "3 reduce-scatter + 3 all-gather steps");
        assert!(trace.steps.iter().all(|s| s.from == rank as u32 && s.to == ((rank + 1) % 4) as u32));
        assert!(trace.steps.iter().all(|s| s.values.as_ref().map(|v| v.len()) == Some(4)));
        assert_eq!(trace.counters[0].calls, 1);
    }
}

#[test]
fn collectives_on_shared_buffers_equal_a_sequential_sum() {
    // Chunks of at least 64 KiB in an `alloc_shared` buffer are read by the peer straight
    // from its mapping; smaller ones go through the pipe. Both, at an offset inside the buffer.
    for world in [1, 2, 3, 4, 8] {
        for &len in &[0, 1, 13, 70_001, 300_007] {
            let results = on_ranks(world, move |rank, comm| {
                let mut shared = comm.alloc_shared(len + 5).unwrap();
                let buf = &mut shared[5..];
                buf.iter_mut().enumerate().for_each(|(i, x)| *x = value(rank, i));
                comm.all_reduce(buf, ReduceOp::Sum).unwrap();
                let reduced = buf.to_vec();
                let mut gathered = comm.alloc_shared(len).unwrap();
                let mine: Vec<f32> = chunk_range(len, world, rank).map(|i| value(rank, i)).collect();
                comm.all_gather(&mine, &mut gathered).unwrap();
                (reduced, gathered.to_vec())
            });
            let expected: Vec<f32> = (0..len).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
            let concatenated: Vec<f32> =
                (0..world).flat_map(|r| chunk_range(len, world, r).map(move |i| value(r, i))).collect();
            for (rank, (reduced, gathered)) in results.iter().enumerate() {
                assert_eq!(reduced, &expected, "all_reduce W={world} D={len} rank {rank}");
                assert_eq!(gathered, &concatenated, "all_gather W={world} D={len} rank {rank}");
            }
        }
    }
}

/// With a 2-byte wire (`set_wire`, `parallel.comm_dtype`) a rank sends exactly half the
/// bytes of f32. Values bf16 and fp16 hold exactly (small integers and their sums) come out
/// bit for bit; others within the format's rounding per hop, the same on every rank. An
/// f32 collective after it on the same pipes still works (2-byte payloads are padded).
#[test]
fn a_two_byte_wire_halves_the_bytes_and_every_rank_ends_equal() {
    use distlab_common::Precision;
    for wire in [Precision::Bf16, Precision::Fp16] {
        for world in [2, 3, 4] {
            for &len in &[1usize, 7, 13, 1000, 70_001, 300_007] {
                let results = on_ranks(world, move |rank, comm| {
                    comm.set_wire(wire);
                    let mut exact: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                    comm.all_reduce(&mut exact, ReduceOp::Sum).unwrap();
                    let sent = comm.bytes_sent();
                    let mut rounded: Vec<f32> = (0..len).map(|i| value(rank, i) * 0.1 + 0.013 * rank as f32).collect();
                    comm.all_reduce(&mut rounded, ReduceOp::Sum).unwrap();
                    comm.set_wire(Precision::Fp32);
                    let mut after: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                    comm.all_reduce(&mut after, ReduceOp::Sum).unwrap();
                    (exact, sent, rounded, after)
                });
                let expected: Vec<f32> = (0..len).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
                let true_sum = |i: usize| (0..world).map(|r| value(r, i) * 0.1 + 0.013 * r as f32).sum::<f32>();
                let first = &results[0].2;
                for (rank, (exact, sent, rounded, after)) in results.iter().enumerate() {
                    let what = format!("{wire:?} W={world} D={len} rank {rank}");
                    assert_eq!(exact, &expected, "{what}: exactly representable sums");
                    let own = chunk_range(len, world, rank).len();
                    let right = chunk_range(len, world, (rank + 1) % world).len();
                    assert_eq!(*sent, 2 * (2 * len - own - right) as u64, "{what}: bytes");
                    assert_eq!(rounded, first, "{what}: every rank ends with the same values");
                    for (i, &got) in rounded.iter().enumerate() {
                        let want = true_sum(i);
                        let allowed = world as f32 * 2f32.powi(-7) * (want.abs() + 1.0);
                        assert!((got - want).abs() <= allowed, "{what}, element {i}: {got} vs {want}");
                    }
                    assert_eq!(after, &expected, "{what}: an f32 all-reduce after it");
                }
            }
        }
    }
}

/// Every all-reduce algorithm ends with the sequential sum on every rank (exact: integer
/// values), and every rank sends what `distlab_common::all_reduce` says it does, for W =
/// 1..8, node sizes 1..3 and sizes not divisible by W.
#[test]
fn every_all_reduce_algorithm_sums_exactly_and_sends_its_formula() {
    use distlab_common::all_reduce::elements_sent;
    use distlab_common::AllReduce;
    for algorithm in [AllReduce::Naive, AllReduce::Tree, AllReduce::Hierarchical, AllReduce::Ring] {
        for world in 1..=8 {
            let node_sizes: &[usize] = if algorithm == AllReduce::Hierarchical { &[1, 2, 3] } else { &[2] };
            for &ranks_per_node in node_sizes {
                for len in [0usize, 1, 7, 1000, 70_001] {
                    let results = on_ranks(world, move |rank, comm| {
                        comm.set_all_reduce(algorithm, ranks_per_node);
                        let mut buf: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                        let mut avg = vec![world as f32 * 3.0; 5];
                        comm.all_reduce(&mut avg, ReduceOp::Avg).unwrap();
                        (buf, comm.bytes_sent(), avg)
                    });
                    let expected: Vec<f32> = (0..len).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
                    let what = format!("{algorithm:?} W={world} L={ranks_per_node} D={len}");
                    for (rank, (buf, sent, avg)) in results.iter().enumerate() {
                        assert_eq!(buf, &expected, "{what} rank {rank}");
                        assert_eq!(avg, &vec![world as f32 * 3.0; 5], "{what} rank {rank}: the mean");
                        let formula = elements_sent(algorithm, len, world, ranks_per_node, rank)
                            + elements_sent(algorithm, 5, world, ranks_per_node, rank);
                        assert_eq!(*sent, 4 * formula as u64, "{what} rank {rank}: bytes sent");
                    }
                }
            }
        }
    }
}

#[test]
fn every_compressor_leaves_each_rank_the_same_sum_keeps_what_it_did_not_send_and_sends_its_formula() {
    use distlab_common::compression::Compressor as Settings;
    use distlab_common::GradCompression;
    use distlab_worker::memory::MemoryTracker;
    use distlab_worker::parallel::compression::{BucketTensor, Compressor};

    // A 12 x 20 matrix and a vector of 12 in one bucket.
    let tensors = vec![BucketTensor { at: 0, rows: 12, cols: 20 }, BucketTensor { at: 240, rows: 1, cols: 12 }];
    let (shapes, len) = ([(12, 20), (1, 12)], 252);
    for method in [GradCompression::Topk, GradCompression::Int8, GradCompression::Powersgd] {
        for world in 1..=4 {
            let settings = Settings { method, ratio: 0.1, rank: 2 };
            let tensors = tensors.clone();
            let results = on_ranks(world, move |rank, comm| {
                let mut compressor = Compressor::new(settings, vec![tensors.clone()], &MemoryTracker::new());
                (0..3)
                    .map(|step| {
                        let mut grads: Vec<f32> = (0..len).map(|i| value(rank, i * (step + 1))).collect();
                        let acc: Vec<f32> = grads.iter().zip(compressor.residual(0)).map(|(g, e)| g + e).collect();
                        let before = comm.bytes_sent();
                        compressor.exchange(comm, 0, &mut grads).unwrap();
                        (acc, grads, compressor.residual(0).to_vec(), comm.bytes_sent() - before)
                    })
                    .collect::<Vec<_>>()
            });
            let what = format!("{method:?} W={world}");
            for step in 0..3 {
                let sum = &results[0][step].1;
                assert!(results.iter().all(|r| &r[step].1 == sum), "{what} step {step}: ranks disagree");
                // Error feedback: what was summed plus what every rank kept is every rank's input.
                for (i, summed) in sum.iter().enumerate() {
                    let input: f32 = results.iter().map(|r| r[step].0[i]).sum();
                    let kept: f32 = results.iter().map(|r| r[step].2[i]).sum();
                    let what = format!("{what} step {step} [{i}]: {summed} + {kept} != {input}");
                    assert!((summed + kept - input).abs() < 1e-3, "{what}");
                }
                let sent: Vec<u64> = results.iter().map(|r| r[step].3).collect();
                // (PowerSGD's ring all-reduces send the formula when W divides their lengths,
                // 36 and 40 floats; at most it otherwise)
                let formula = settings.bytes_sent(&shapes, world);
                if world == 3 && method == GradCompression::Powersgd {
                    assert!(sent.iter().all(|&s| s <= formula && s + 8 * 4 >= formula), "{what}: bytes {sent:?}");
                } else {
                    assert!(sent.iter().all(|&s| s == formula), "{what}: bytes {sent:?} against {formula}");
                }
            }
            // Something was compressed away (not a plain all-reduce).
            assert!(results[0].iter().any(|(_, _, kept, _)| kept.iter().any(|&e| e != 0.0)), "{what}");
        }
    }
}
