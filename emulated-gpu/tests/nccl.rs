//! The emulated NCCL across rank processes: each test starts its ranks as processes of
//! this test binary (the test `rank` with `NCCL_TEST_RANK` set), as the worker starts a
//! run's ranks, and reads what each printed. Collectives give every rank the sum in rank
//! order, also in pieces larger than a slot; an all-to-all of sends and receives in one
//! group completes with messages larger than a channel; ranks that call different
//! collectives, share a GPU, pass host memory, or lose a peer get an error, not a hang.

use std::ffi::c_void;
use std::process::Command;

use distlab_emulated_gpu::driver::*;
use distlab_emulated_gpu::nccl::*;

const F32: u32 = 7;
const BF16: u32 = 9;
const SUM: u32 = 0;
const AVG: u32 = 4;
const INVALID_ARGUMENT: u32 = 4;
const INVALID_USAGE: u32 = 5;
const REMOTE_ERROR: u32 = 6;

/// Runs `scenario` on `ranks` rank processes (rank r on device `device(r)` of 4): each
/// rank's (success, stdout + stderr).
fn ranks(scenario: &str, ranks: usize, device: fn(usize) -> usize) -> Vec<(bool, String)> {
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, 0);
    let name: String = id.internal.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect();
    let children: Vec<_> = (0..ranks)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(["rank", "--exact", "--nocapture", "--test-threads=1"])
                .env("NCCL_TEST_RANK", format!("{scenario} {r} {ranks} {} {name}", device(r)))
                .env("DISTLAB_EMULATED_GPU_DEVICES", "4")
                .env_remove("CUDA_VISIBLE_DEVICES")
                .spawn_and_collect()
        })
        .collect();
    children.into_iter().map(|c| c.wait()).collect()
}

/// A started rank process.
struct Child(std::process::Child);

impl Child {
    fn wait(self) -> (bool, String) {
        let out = self.0.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }
}

trait SpawnAndCollect {
    fn spawn_and_collect(&mut self) -> Child;
}

impl SpawnAndCollect for Command {
    fn spawn_and_collect(&mut self) -> Child {
        use std::process::Stdio;
        Child(self.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap())
    }
}

/// One rank's side of the scenario named in `NCCL_TEST_RANK` (nothing when it is unset).
#[test]
fn rank() {
    let Ok(role) = std::env::var("NCCL_TEST_RANK") else { return };
    let words: Vec<&str> = role.split(' ').collect();
    let (scenario, me, w, device): (&str, usize, usize, i32) =
        (words[0], words[1].parse().unwrap(), words[2].parse().unwrap(), words[3].parse().unwrap());
    let mut id = UniqueId { internal: [0; 128] };
    for (slot, b) in id.internal.iter_mut().zip(words[4].bytes()) {
        *slot = b as _;
    }
    unsafe {
        let mut context = std::ptr::null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut context, device), 0);
        assert_eq!(cuCtxSetCurrent(context), 0);
        let mut comm = std::ptr::null_mut();
        let init = ncclCommInitRank(&mut comm, w as i32, id, me as i32);
        if scenario == "shared-device" {
            println!("init {init}");
            return;
        }
        assert_eq!(init, 0);
        let rank = Rank { comm, me, w };
        match scenario {
            "collectives" => rank.collectives(),
            "all-to-all" => rank.all_to_all(),
            "mismatch" => {
                let buf = upload(&vec![1.0; 10 + me]);
                println!("result {}", ncclAllReduce(buf as _, buf as _, 10 + me, F32, SUM, comm, null()));
            }
            "host-memory" => {
                let host = [1.0f32; 16];
                let result = ncclAllReduce(host.as_ptr() as _, host.as_ptr() as _, 16, F32, SUM, comm, null());
                println!("result {result}");
                let _ = ncclCommAbort(comm);
            }
            "length-mismatch" => {
                // Rank 0 sends 100 floats, rank 1 receives 90: rank 1 is told, then leaves,
                // and rank 0, whose message is never taken, is told that.
                let buf = upload(&[1.0; 100]);
                let result = if me == 0 {
                    ncclSend(buf as _, 100, F32, 1, comm, null())
                } else {
                    ncclRecv(buf as _, 90, F32, 0, comm, null())
                };
                println!("result {result}");
                let _ = ncclCommDestroy(comm);
            }
            "refused-in-group" => {
                // Rank 1's group holds a send to a rank that does not exist: the whole group
                // fails there, nothing of it runs, and rank 0, waiting for its message, is told.
                let buf = upload(&[1.0; 10]);
                assert_eq!(ncclGroupStart(), 0);
                let peer = if me == 0 { 1 } else { 0 };
                let _ = ncclRecv(buf as _, 10, F32, peer, comm, null());
                let _ = ncclSend(buf as _, 10, F32, if me == 1 { 7 } else { peer }, comm, null());
                println!("result {}", ncclGroupEnd());
                let _ = ncclCommDestroy(comm);
            }
            "peer-gone" => {
                if me == 1 {
                    std::process::exit(0);
                }
                let buf = upload(&[1.0; 4]);
                println!("result {}", ncclAllReduce(buf as _, buf as _, 4, F32, SUM, comm, null()));
            }
            _ => panic!("no scenario {scenario}"),
        }
    }
}

fn null() -> *mut c_void {
    std::ptr::null_mut()
}

/// `values` in device memory (on the bound context's device): its pointer.
fn upload(values: &[f32]) -> u64 {
    unsafe {
        let mut ptr = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut ptr, values.len() * 4), 0);
        assert_eq!(cuMemcpyHtoD_v2(ptr, values.as_ptr() as *const c_void, values.len() * 4), 0);
        ptr
    }
}

fn download(ptr: u64, len: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; len];
    assert_eq!(unsafe { cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, ptr, len * 4) }, 0);
    out
}

struct Rank {
    comm: *mut Comm,
    me: usize,
    w: usize,
}

/// Rank r's value at element i: every sum is exact in f32 and differs per element.
fn value(r: usize, i: usize) -> f32 {
    ((r + 1) * 1000 + i % 997) as f32
}

impl Rank {
    unsafe fn collectives(&self) {
        let (me, w, comm) = (self.me, self.w, self.comm);
        // All-reduce of 1.5 M floats (6 MB, two slots' rounds), in place.
        let n = 1_500_000;
        let buf = upload(&(0..n).map(|i| value(me, i)).collect::<Vec<_>>());
        assert_eq!(ncclAllReduce(buf as _, buf as _, n, F32, SUM, comm, null()), 0);
        let got = download(buf, n);
        assert!((0..n).all(|i| got[i] == (0..w).map(|r| value(r, i)).sum::<f32>()), "sum");
        // Average of the same (each rank's value scaled by 1/w first).
        assert_eq!(ncclAllReduce(buf as _, buf as _, n, F32, AVG, comm, null()), 0);
        let avg = download(buf, n);
        assert!((0..n).all(|i| avg[i] == (0..w).map(|_| got[i] * (1.0 / w as f32)).sum::<f32>()), "average");
        // bf16: 1.0 + 2^-8 per rank rounds at each step as NCCL's kernels do.
        let one = half::bf16::from_f32(1.0 + (me as f32) / 256.0);
        let mut ptr = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut ptr, 2), 0);
        assert_eq!(cuMemcpyHtoD_v2(ptr, &one as *const _ as *const c_void, 2), 0);
        assert_eq!(ncclAllReduce(ptr as _, ptr as _, 1, BF16, SUM, comm, null()), 0);
        let mut sum = half::bf16::ZERO;
        assert_eq!(cuMemcpyDtoH_v2(&mut sum as *mut _ as *mut c_void, ptr, 2), 0);
        let want = (0..w).fold(half::bf16::ZERO, |acc, r| {
            half::bf16::from_f32(acc.to_f32() + half::bf16::from_f32(1.0 + r as f32 / 256.0).to_f32())
        });
        assert_eq!(sum, want, "bf16 sum");
        // Reduce-scatter in place: rank r keeps the sum of chunk r.
        let chunk = 700_000;
        let buf = upload(&(0..w * chunk).map(|i| value(me, i)).collect::<Vec<_>>());
        let mine = buf + (me * chunk * 4) as u64;
        assert_eq!(ncclReduceScatter(buf as _, mine as _, chunk, F32, SUM, comm, null()), 0);
        let got = download(mine, chunk);
        assert!((0..chunk).all(|i| got[i] == (0..w).map(|r| value(r, me * chunk + i)).sum::<f32>()), "reduce-scatter");
        // All-gather in place: every rank ends with every rank's chunk.
        let buf = upload(&vec![0.0; w * chunk]);
        let mine = buf + (me * chunk * 4) as u64;
        assert_eq!(
            cuMemcpyHtoD_v2(mine, (0..chunk).map(|i| value(me, i)).collect::<Vec<_>>().as_ptr() as _, chunk * 4),
            0
        );
        assert_eq!(ncclAllGather(mine as _, buf as _, chunk, F32, comm, null()), 0);
        let got = download(buf, w * chunk);
        assert!((0..w * chunk).all(|i| got[i] == value(i / chunk, i % chunk)), "all-gather");
        // Broadcast from rank 1.
        let buf = upload(&vec![value(me, 0); 1000]);
        assert_eq!(ncclBroadcast(buf as _, buf as _, 1000, F32, 1, comm, null()), 0);
        assert!(download(buf, 1000).iter().all(|&v| v == value(1, 0)), "broadcast");
        // A send alone, then its receive alone: rank 0 to rank 1.
        if me < 2 {
            let buf = upload(&vec![value(me, 5); 300_000]);
            let peer = 1 - me as i32;
            let result = if me == 0 {
                ncclSend(buf as _, 300_000, F32, peer, comm, null())
            } else {
                ncclRecv(buf as _, 300_000, F32, peer, comm, null())
            };
            assert_eq!(result, 0);
            assert!(download(buf, 300_000).iter().all(|&v| v == value(0, 5)), "send and receive");
        }
        assert_eq!(ncclCommDestroy(comm), 0);
        println!("collectives ok");
    }

    /// Every rank sends a chunk larger than a channel to every rank (itself too), all in
    /// one group, as the NCCL communicator's all-to-all does.
    unsafe fn all_to_all(&self) {
        let (me, w, comm) = (self.me, self.w, self.comm);
        let chunk = 400_000;
        let send = upload(&(0..w * chunk).map(|i| value(me, i)).collect::<Vec<_>>());
        let recv = upload(&vec![0.0; w * chunk]);
        let at = |base: u64, r: usize| base + (r * chunk * 4) as u64;
        assert_eq!(ncclGroupStart(), 0);
        for peer in 0..w {
            assert_eq!(ncclSend(at(send, peer) as _, chunk, F32, peer as i32, comm, null()), 0);
            assert_eq!(ncclRecv(at(recv, peer) as _, chunk, F32, peer as i32, comm, null()), 0);
        }
        assert_eq!(ncclGroupEnd(), 0);
        let got = download(recv, w * chunk);
        assert!((0..w * chunk).all(|i| got[i] == value(i / chunk, me * chunk + i % chunk)), "all-to-all");
        assert_eq!(ncclCommDestroy(comm), 0);
        println!("all-to-all ok");
    }
}

fn assert_all(results: &[(bool, String)], says: &str) {
    for (r, (ok, out)) in results.iter().enumerate() {
        assert!(*ok && out.contains(says), "rank {r}: {out}");
    }
}

#[test]
fn collectives_give_every_rank_the_same_result_in_pieces_larger_than_a_slot() {
    assert_all(&ranks("collectives", 3, |r| r), "collectives ok");
}

#[test]
fn an_all_to_all_in_one_group_completes_with_messages_larger_than_a_channel() {
    assert_all(&ranks("all-to-all", 4, |r| 3 - r), "all-to-all ok");
}

#[test]
fn ranks_that_call_different_collectives_get_an_error() {
    let results = ranks("mismatch", 2, |r| r);
    assert_all(&results, &format!("result {INVALID_USAGE}"));
    assert_all(&results, "rank 0 ncclAllReduce of 10 float32 (0), rank 1 ncclAllReduce of 11 float32 (0)");
}

#[test]
fn two_ranks_on_one_gpu_are_refused_as_nccl_refuses_them() {
    let results = ranks("shared-device", 2, |_| 0);
    assert_all(&results, &format!("init {INVALID_USAGE}"));
    assert_all(&results, "ranks 0 and 1 are both on device 0");
}

#[test]
fn host_memory_handed_to_a_collective_is_refused() {
    let results = ranks("host-memory", 2, |r| r);
    assert_all(&results, &format!("result {INVALID_ARGUMENT}"));
    assert_all(&results, "is not inside one allocation of device memory");
}

#[test]
fn a_rank_whose_peer_died_gets_an_error_instead_of_a_hang() {
    let started = std::time::Instant::now();
    let results = ranks("peer-gone", 2, |r| r);
    let (ok, out) = &results[0];
    assert!(*ok && out.contains(&format!("result {REMOTE_ERROR}")) && out.contains("rank 1"), "{out}");
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
}

#[test]
fn a_receive_of_another_length_than_its_send_fails_both_ranks() {
    let results = ranks("length-mismatch", 2, |r| r);
    let (ok1, out1) = &results[1];
    assert!(*ok1 && out1.contains(&format!("result {INVALID_USAGE}")), "{out1}");
    assert!(out1.contains("receives 360 bytes from rank 0, which sends 400"), "{out1}");
    let (ok0, out0) = &results[0];
    assert!(*ok0 && out0.contains(&format!("result {REMOTE_ERROR}")) && out0.contains("rank 1 has left"), "{out0}");
}

#[test]
fn a_group_with_a_refused_call_fails_whole() {
    let results = ranks("refused-in-group", 2, |r| r);
    let (ok1, out1) = &results[1];
    assert!(*ok1 && out1.contains(&format!("result {INVALID_ARGUMENT}")) && out1.contains("peer 7 of 2"), "{out1}");
    let (ok0, out0) = &results[0];
    assert!(*ok0 && out0.contains(&format!("result {REMOTE_ERROR}")), "{out0}");
}
