//! The NCCL communicator (cargo feature `cuda`). The unique id's trip over the launcher's
//! rendezvous needs no GPU and always runs; the collectives need a GPU and NCCL and are
//! opt-in (`cargo xtask test --gpu`; plain `cargo test` reports them as ignored). One GPU
//! allows a group of one rank only (NCCL refuses two ranks on one device): the two-rank
//! test then checks that refusal.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use distlab_common::trace::CollectiveOp;
use distlab_worker::backend::cuda::{device_count, CudaBackend, DeviceElem};
use distlab_worker::backend::{Buffers, DeviceCollectives, Stored};
use distlab_worker::comm::nccl::{new_unique_id, share_unique_id, NcclCommunicator, NcclUnavailable, UNIQUE_ID_BYTES};
use distlab_worker::comm::{chunk_range, Communicator, InPlace, Mesh, ReduceOp, RingCommunicator};
use distlab_worker::memory::MemoryTracker;
use distlab_worker::parallel::collective;
use distlab_worker::trace::CommTracer;

/// Runs `f(rank, ring)` on `world` ranks (threads) joined by the launcher's socket mesh.
fn on_ranks<T: Send + 'static>(world: usize, f: fn(usize, &mut RingCommunicator) -> T) -> Vec<T> {
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let path = dir.path().to_path_buf();
            std::thread::spawn(move || {
                let mesh = Mesh::connect(&path, rank, world, Duration::from_secs(10)).unwrap();
                let mut ring =
                    RingCommunicator::new(&mesh, "world", (0..world).collect(), Duration::from_secs(20), None).unwrap();
                f(rank, &mut ring)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

const ID: [u8; UNIQUE_ID_BYTES] = {
    let mut id = [0u8; UNIQUE_ID_BYTES];
    let mut i = 0;
    while i < UNIQUE_ID_BYTES {
        id[i] = (i * 37 % 256) as u8 ^ 0x80;
        i += 1;
    }
    id
};

#[test]
fn the_unique_id_reaches_every_rank_byte_for_byte() {
    let got = on_ranks(3, |rank, ring| share_unique_id(ring, 1, (rank == 1).then_some(Ok(ID))).unwrap());
    assert!(got.iter().all(|id| *id == ID));
}

#[test]
fn a_root_without_an_id_fails_every_rank() {
    let errors = on_ranks(2, |rank, ring| {
        let id = (rank == 0).then_some(Err(NcclUnavailable::NoLibrary));
        share_unique_id(ring, 0, id).unwrap_err().to_string()
    });
    assert!(errors[0].contains("NCCL (libnccl.so.2) is not installed"), "{}", errors[0]);
    assert!(errors[1].contains("rank 0 of the group could not make an NCCL unique id"), "{}", errors[1]);
}

#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn collectives_of_a_group_of_one_on_the_gpu() {
    let id = new_unique_id().unwrap_or_else(|why| panic!("the GPU tests were asked for, but NCCL cannot run: {why}"));
    let tracer = Arc::new(CommTracer::new(0, 100));
    let mut comm = NcclCommunicator::new(0, id, 0, vec![0], "world", Some(tracer.clone())).expect("NCCL init");
    let values: Vec<f32> = (0..1001).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut buf = values.clone();
    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    assert_eq!(buf, values, "the sum over one rank is the rank's own buffer");
    comm.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
    assert_eq!(buf, values);
    let (mut input, mut output) = (values.clone(), vec![0.0; values.len()]);
    comm.reduce_scatter(&mut input, &mut output, ReduceOp::Sum).unwrap();
    assert_eq!(output, values);
    let mut gathered = vec![0.0; values.len()];
    comm.all_gather(&values, &mut gathered).unwrap();
    assert_eq!(gathered, values);
    comm.broadcast(&mut buf, 0).unwrap();
    assert_eq!(buf, values);
    comm.barrier().unwrap();
    assert_eq!(comm.bytes_sent(), 0, "one rank sends nothing");
    let trace = tracer.snapshot();
    let ops: Vec<CollectiveOp> = trace.collectives.iter().map(|c| c.op).collect();
    use CollectiveOp::*;
    assert_eq!(ops, [AllReduce, AllReduce, ReduceScatter, AllGather, Broadcast, AllReduce]);
    assert!(trace.collectives.iter().all(|c| c.group == "world" && c.ranks == [0] && c.end_us >= c.start_us));
    assert_eq!(trace.collectives[0].elements, 1001);
    // A wrong-sized output is refused, not sent to NCCL.
    let mut short = vec![0.0; 10];
    assert!(comm.reduce_scatter(&mut input, &mut short, ReduceOp::Sum).is_err());
    // All-to-all over one rank: its own chunk, copied on the device.
    let mut exchanged = vec![0.0; 1000];
    comm.all_to_all(&values[..1000], &mut exchanged).unwrap();
    assert_eq!(exchanged, values[..1000]);
    assert!(comm.all_to_all(&values, &mut short).is_err(), "an output of another length is refused");
}

/// Two ranks, each its own thread, on GPUs `rank % GPUs`: an all-reduce and an all-to-all
/// (grouped sends and receives). With one GPU both ranks are on it
/// and NCCL refuses them (two ranks of one group on one device): then this says so and passes.
#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn two_ranks_sum_through_nccl() {
    let id = new_unique_id().unwrap_or_else(|why| panic!("the GPU tests were asked for, but NCCL cannot run: {why}"));
    let gpus = device_count().unwrap().max(1);
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut comm = match NcclCommunicator::new(rank % gpus, id, rank, vec![0, 1], "world", None) {
                    Ok(comm) => comm,
                    Err(why) => return Err(why.to_string()),
                };
                let mut buf: Vec<f32> = (0..1000).map(|i| (i + rank * 1000) as f32).collect();
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                let sent = comm.bytes_sent();
                // All-to-all: chunk r (500 floats) of each rank goes to rank r.
                let mine: Vec<f32> = (0..1000).map(|i| (i + rank * 1000) as f32).collect();
                let mut got = vec![0.0; 1000];
                comm.all_to_all(&mine, &mut got).unwrap();
                let want: Vec<f32> = (0..1000).map(|i| ((i / 500) * 1000 + rank * 500 + i % 500) as f32).collect();
                assert_eq!(got, want, "rank {rank}: chunk r from rank r");
                assert_eq!(comm.bytes_sent() - sent, 2000, "(W-1)/W x 4000 bytes");
                Ok((buf, sent))
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        match handle.join().unwrap() {
            Ok((buf, sent)) => {
                assert!(buf.iter().enumerate().all(|(i, &v)| v == (2 * i + 1000) as f32), "rank {rank}");
                assert_eq!(sent, 4000, "2(W-1)/W x 4000 bytes");
            }
            Err(why) if gpus == 1 => eprintln!("rank {rank}: NCCL refused two ranks on one GPU, as it must: {why}"),
            Err(why) => panic!("rank {rank}: NCCL init failed with {gpus} GPUs: {why}"),
        }
    }
}

/// Collectives on the CUDA backend's own buffers (`parallel::collective`: no host copies):
/// two ranks on GPUs `rank % GPUs`, every in-place op on an even and an uneven length (NCCL's
/// own in-place form, and the padded path), in fp32 and in bf16 (summed as a widened f32
/// copy). With one GPU NCCL refuses the pair: then this says so and passes.
#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn collectives_run_on_gpu_buffers_in_place() {
    let id = new_unique_id().unwrap_or_else(|why| panic!("the GPU tests were asked for, but NCCL cannot run: {why}"));
    let gpus = device_count().unwrap().max(1);
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut comm = match NcclCommunicator::new(rank % gpus, id, rank, vec![0, 1], "dp", None) {
                    Ok(comm) => comm,
                    Err(why) => return Err(why.to_string()),
                };
                check_in_place::<f32>(rank, gpus, &mut comm);
                check_in_place::<half::bf16>(rank, gpus, &mut comm);
                Ok(())
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        match handle.join().unwrap() {
            Ok(()) => {}
            Err(why) if gpus == 1 => eprintln!("rank {rank}: NCCL refused two ranks on one GPU, as it must: {why}"),
            Err(why) => panic!("rank {rank}: NCCL init failed with {gpus} GPUs: {why}"),
        }
    }
}

/// Rank `rank`'s value at `i` (small integers: exact in bf16, and so are their sums).
fn value(rank: usize, i: usize) -> f32 {
    ((i % 61) + 3 * rank) as f32
}

fn check_in_place<S: DeviceElem + Stored<Acc = f32>>(rank: usize, gpus: usize, comm: &mut NcclCommunicator) {
    let be = CudaBackend::<S>::new(rank % gpus).expect("a CUDA backend");
    assert!(be.reaches(comm), "the backend reaches NCCL on its own GPU");
    let memory = MemoryTracker::new();
    let what = S::NAME;
    for len in [1000, 1001] {
        let mut run = |op: InPlace, values: &dyn Fn(usize) -> f32| -> Vec<f32> {
            let host: Vec<S> = (0..len).map(|i| S::store(values(i))).collect();
            let mut buf = be.alloc(len);
            be.upload(&mut buf, &host);
            collective(&be, &memory, &mut *comm, &mut buf, 0..len, op, distlab_common::Precision::Fp32).unwrap();
            let mut back = vec![S::default(); len];
            be.download(&buf, &mut back);
            back.iter().map(|x| x.load()).collect()
        };
        let summed = run(InPlace::AllReduce(ReduceOp::Sum), &|i| value(rank, i));
        assert!((0..len).all(|i| summed[i] == value(0, i) + value(1, i)), "{what} all-reduce of {len}");
        let scattered = run(InPlace::ReduceScatter(ReduceOp::Sum), &|i| value(rank, i));
        let mine = chunk_range(len, 2, rank);
        assert!(mine.clone().all(|i| scattered[i] == value(0, i) + value(1, i)), "{what} reduce-scatter of {len}");
        // Each rank brings its own chunk (its values there); afterwards chunk r is rank r's.
        let gathered = run(InPlace::AllGather, &|i| if mine.contains(&i) { value(rank, i) } else { -1.0 });
        for r in 0..2 {
            let chunk = chunk_range(len, 2, r);
            assert!(chunk.clone().all(|i| gathered[i] == value(r, i)), "{what} all-gather of {len}, chunk {r}");
        }
    }
    assert!(comm.bytes_sent() > 0);
}
