//! NCCL (libnccl) as cudarc calls it, for ranks that are processes of one machine, as the
//! worker runs them. A communicator is a file in shared memory that every rank maps
//! (`shared_group.rs`). Collectives stage each rank's data in its slot and read the
//! others' between barriers, in pieces of the slot's size; reductions combine the ranks in
//! rank order, in the data's own type (2-byte floats through f32, rounded at each step, as
//! NCCL's kernels do), so every rank gets the same bits. `ncclSend` / `ncclRecv` pass
//! messages through a channel per pair of ranks; inside `ncclGroupStart` / `ncclGroupEnd`
//! they are queued and then progressed together, so a group of sends and receives that
//! would deadlock one by one (an all-to-all) completes, as with NCCL. A send alone waits
//! until its peer has taken the message.
//!
//! It checks what real NCCL leaves to a hang or to corrupted data: every rank must call
//! the same collective (kind, type, count, root) in the same order, buffers must be device
//! memory of the communicator's GPU, a send and its receive must be as long, and two ranks
//! of a communicator cannot share a GPU (as NCCL refuses). A rank whose process died, or
//! that left, ends its peers' wait with `ncclRemoteError`. Each error is printed, prefixed
//! "emulated NCCL:", and kept for `ncclGetLastError`.
//!
//! Every call completes before it returns, as the emulated driver's do: the stream
//! argument orders nothing.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::atomic::Ordering::{Acquire, Release};

use half::{bf16, f16};

use crate::shared_group::{SharedGroup, ID_PREFIX, SLOT, STALL};
use crate::{driver, memory};

pub type NcclResult = c_uint;
const SUCCESS: NcclResult = 0;
const SYSTEM_ERROR: NcclResult = 2;
const INTERNAL_ERROR: NcclResult = 3;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;
const REMOTE_ERROR: NcclResult = 6;

/// The NCCL version reported (2.28.0).
const VERSION: c_int = 22800;

/// `ncclUniqueId`: here the name of the communicator's file, NUL-padded.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

/// One rank's communicator.
pub struct Comm {
    group: SharedGroup,
    device: i32,
}

/// What failed, and NCCL's code for it.
type Failure = (NcclResult, String);

thread_local! {
    /// The last error this thread's calls met, for `ncclGetLastError`.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Prints `failure` and keeps it for `ncclGetLastError`: its code. Inside a group, the
/// group fails as a whole at `ncclGroupEnd`.
fn report((code, message): Failure) -> NcclResult {
    eprintln!("emulated NCCL: {message}");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(message).unwrap_or_default());
    if GROUP_DEPTH.with(Cell::get) > 0 {
        GROUP_FAILED.with(|f| f.set(Some(code)));
    }
    code
}

fn done(result: Result<(), Failure>) -> NcclResult {
    result.map_or_else(report, |()| SUCCESS)
}

/// NCCL's data types: (name, bytes per element).
fn data_type(code: c_uint) -> Result<(&'static str, usize), Failure> {
    const TYPES: [(&str, usize); 10] = [
        ("int8", 1),
        ("uint8", 1),
        ("int32", 4),
        ("uint32", 4),
        ("int64", 8),
        ("uint64", 8),
        ("float16", 2),
        ("float32", 4),
        ("float64", 8),
        ("bfloat16", 2),
    ];
    TYPES
        .get(code as usize)
        .copied()
        .ok_or((INVALID_ARGUMENT, format!("data type {code} is not one the emulated NCCL knows")))
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Op {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

fn reduce_op(code: c_uint) -> Result<Op, Failure> {
    [Op::Sum, Op::Prod, Op::Max, Op::Min, Op::Avg]
        .get(code as usize)
        .copied()
        .ok_or((INVALID_ARGUMENT, format!("reduction {code} is not one the emulated NCCL knows")))
}

/// A value NCCL reduces.
trait Element: Copy {
    fn combine(self, other: Self, op: Op) -> Self;
    /// `self / ranks` for an average (integers divide the sum, floats are scaled first).
    fn average(self, ranks: usize) -> Self;
    /// Whether the average scales each rank's value before the sum (floats), or divides
    /// the sum (integers), as NCCL does.
    const SCALE_FIRST: bool;
}

macro_rules! float_element {
    ($t:ty, $wide:ty, $to:expr, $from:expr) => {
        impl Element for $t {
            fn combine(self, other: Self, op: Op) -> Self {
                let (a, b) = ($to(self), $to(other));
                $from(match op {
                    Op::Sum | Op::Avg => a + b,
                    Op::Prod => a * b,
                    Op::Max => a.max(b),
                    Op::Min => a.min(b),
                })
            }
            fn average(self, ranks: usize) -> Self {
                $from($to(self) * (1.0 / ranks as $wide))
            }
            const SCALE_FIRST: bool = true;
        }
    };
}
float_element!(f32, f32, |x: f32| x, |x: f32| x);
float_element!(f64, f64, |x: f64| x, |x: f64| x);
float_element!(f16, f32, f16::to_f32, f16::from_f32);
float_element!(bf16, f32, bf16::to_f32, bf16::from_f32);

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            fn combine(self, other: Self, op: Op) -> Self {
                match op {
                    Op::Sum | Op::Avg => self.wrapping_add(other),
                    Op::Prod => self.wrapping_mul(other),
                    Op::Max => self.max(other),
                    Op::Min => self.min(other),
                }
            }
            fn average(self, ranks: usize) -> Self {
                self / ranks as $t
            }
            const SCALE_FIRST: bool = false;
        }
    )*};
}
int_element!(i8, u8, i32, u32, i64, u64);

/// `out[i] = sources[0][i] op sources[1][i] op ...` for `count` elements.
///
/// # Safety
/// Every source holds `count` elements of `T`, `out` has room for them.
unsafe fn reduce_typed<T: Element>(out: *mut u8, sources: &[*const u8], count: usize, op: Op) {
    let ranks = sources.len();
    let read = |s: usize, i: usize| {
        let v = (sources[s] as *const T).add(i).read_unaligned();
        if op == Op::Avg && T::SCALE_FIRST {
            v.average(ranks)
        } else {
            v
        }
    };
    for i in 0..count {
        let mut acc = read(0, i);
        for s in 1..ranks {
            acc = acc.combine(read(s, i), op);
        }
        if op == Op::Avg && !T::SCALE_FIRST {
            acc = acc.average(ranks);
        }
        (out as *mut T).add(i).write_unaligned(acc);
    }
}

/// [`reduce_typed`] for NCCL data type `dtype`.
unsafe fn reduce(dtype: c_uint, out: *mut u8, sources: &[*const u8], count: usize, op: Op) {
    match dtype {
        0 => reduce_typed::<i8>(out, sources, count, op),
        1 => reduce_typed::<u8>(out, sources, count, op),
        2 => reduce_typed::<i32>(out, sources, count, op),
        3 => reduce_typed::<u32>(out, sources, count, op),
        4 => reduce_typed::<i64>(out, sources, count, op),
        5 => reduce_typed::<u64>(out, sources, count, op),
        6 => reduce_typed::<f16>(out, sources, count, op),
        7 => reduce_typed::<f32>(out, sources, count, op),
        8 => reduce_typed::<f64>(out, sources, count, op),
        _ => reduce_typed::<bf16>(out, sources, count, op),
    }
}

/// One call a rank makes on a communicator.
#[derive(Clone, Copy, Debug)]
enum Call {
    AllReduce { send: u64, recv: u64, count: usize, dtype: c_uint, op: Op },
    ReduceScatter { send: u64, recv: u64, count: usize, dtype: c_uint, op: Op },
    AllGather { send: u64, recv: u64, count: usize, dtype: c_uint },
    Broadcast { send: u64, recv: u64, count: usize, dtype: c_uint, root: usize },
    Send { send: u64, count: usize, dtype: c_uint, peer: usize },
    Recv { recv: u64, count: usize, dtype: c_uint, peer: usize },
}

impl Call {
    fn name(&self) -> &'static str {
        match self {
            Call::AllReduce { .. } => "ncclAllReduce",
            Call::ReduceScatter { .. } => "ncclReduceScatter",
            Call::AllGather { .. } => "ncclAllGather",
            Call::Broadcast { .. } => "ncclBroadcast",
            Call::Send { .. } => "ncclSend",
            Call::Recv { .. } => "ncclRecv",
        }
    }

    /// What every rank of a collective must agree on: kind, type, count, root or reduction.
    fn words(&self) -> [u64; 4] {
        match *self {
            Call::AllReduce { count, dtype, op, .. } => [1, dtype as u64, count as u64, op as u64],
            Call::ReduceScatter { count, dtype, op, .. } => [2, dtype as u64, count as u64, op as u64],
            Call::AllGather { count, dtype, .. } => [3, dtype as u64, count as u64, 0],
            Call::Broadcast { count, dtype, root, .. } => [4, dtype as u64, count as u64, root as u64],
            Call::Send { .. } | Call::Recv { .. } => [0; 4],
        }
    }

    fn describe(words: [u64; 4]) -> String {
        let kind = ["?", "ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast"];
        let dtype = data_type(words[1] as c_uint).map_or("?", |t| t.0);
        format!("{} of {} {dtype} ({})", kind[words[0].min(4) as usize], words[2], words[3])
    }
}

impl Comm {
    fn ranks(&self) -> usize {
        self.group.ranks
    }

    fn me(&self) -> usize {
        self.group.me
    }

    /// A failure of this rank in `call`.
    fn fail(&self, code: NcclResult, call: &str, what: impl std::fmt::Display) -> Failure {
        (code, format!("rank {} of {} in {call}: {what}", self.me(), self.ranks()))
    }

    /// An error unless `ptr..ptr + bytes` is device memory of this communicator's GPU.
    fn check_buffer(&self, call: &str, what: &str, ptr: u64, bytes: usize) -> Result<(), Failure> {
        if bytes == 0 {
            return Ok(());
        }
        match memory::owner(ptr, bytes) {
            Some(d) if d == self.device => Ok(()),
            Some(d) => Err(self.fail(
                INVALID_ARGUMENT,
                call,
                format!("{what} {ptr:#x} is memory of device {d}, the communicator's is {}", self.device),
            )),
            None => Err(self.fail(
                INVALID_ARGUMENT,
                call,
                format!("{what} {ptr:#x} ({bytes} bytes) is not inside one allocation of device memory"),
            )),
        }
    }

    /// Checks a call's arguments before it runs or is queued.
    fn check(&self, call: &Call) -> Result<(), Failure> {
        let name = call.name();
        let w = self.ranks();
        // The bytes of `count` elements of `dtype`, `times` over (an error if that overflows).
        let bytes = |count: usize, dtype, times: usize| {
            let size = data_type(dtype).map(|t| t.1).map_err(|(c, m)| self.fail(c, name, m))?;
            count.checked_mul(size).and_then(|b| b.checked_mul(times)).ok_or_else(|| {
                self.fail(INVALID_ARGUMENT, name, format!("{count} elements are more than memory holds"))
            })
        };
        let peer_ok = |peer: usize| {
            if peer < w {
                Ok(())
            } else {
                Err(self.fail(INVALID_ARGUMENT, name, format!("peer {peer} of {w} ranks")))
            }
        };
        match *call {
            Call::AllReduce { send, recv, count, dtype, .. } => {
                self.check_buffer(name, "sendbuff", send, bytes(count, dtype, 1)?)?;
                self.check_buffer(name, "recvbuff", recv, bytes(count, dtype, 1)?)
            }
            Call::ReduceScatter { send, recv, count, dtype, .. } => {
                self.check_buffer(name, "sendbuff", send, bytes(count, dtype, w)?)?;
                self.check_buffer(name, "recvbuff", recv, bytes(count, dtype, 1)?)
            }
            Call::AllGather { send, recv, count, dtype } => {
                self.check_buffer(name, "sendbuff", send, bytes(count, dtype, 1)?)?;
                self.check_buffer(name, "recvbuff", recv, bytes(count, dtype, w)?)
            }
            Call::Broadcast { send, recv, count, dtype, root } => {
                peer_ok(root)?;
                if self.me() == root {
                    self.check_buffer(name, "sendbuff", send, bytes(count, dtype, 1)?)?;
                }
                self.check_buffer(name, "recvbuff", recv, bytes(count, dtype, 1)?)
            }
            Call::Send { send: ptr, count, dtype, peer } | Call::Recv { recv: ptr, count, dtype, peer } => {
                peer_ok(peer)?;
                self.check_buffer(name, "buffer", ptr, bytes(count, dtype, 1)?)
            }
        }
    }

    /// Runs collective `call` with every other rank: round by round, each rank stages its
    /// part in its slot, all meet, each reads what it needs, all meet again. The first
    /// round also compares the ranks' calls.
    fn collective(&self, call: Call) -> Result<(), Failure> {
        let (w, me, name) = (self.ranks(), self.me(), call.name());
        let words = call.words();
        for (word, value) in self.group.entry(me).call.iter().zip(words) {
            word.store(value, Release);
        }
        let size = data_type(words[1] as c_uint).map_err(|(c, m)| self.fail(c, name, m))?.1;
        let count = words[2] as usize;
        // Elements of each rank's part that one round moves.
        let per_round = match call {
            Call::ReduceScatter { .. } => SLOT / size / w,
            _ => SLOT / size,
        };
        let rounds = count.div_ceil(per_round).max(1);
        let slot = |r: usize| self.group.slot(r);
        let remote = |e| self.fail(REMOTE_ERROR, name, e);
        for round in 0..rounds {
            let (from, n) = (round * per_round, per_round.min(count - (round * per_round).min(count)));
            let (at, bytes) = (from * size, n * size);
            // SAFETY (this block): buffers were checked (`check`) to hold `count` elements
            // (times the ranks where NCCL says so); slots hold SLOT bytes, and `per_round`
            // keeps each round's bytes within one.
            unsafe {
                match call {
                    Call::AllReduce { send, .. } | Call::AllGather { send, .. } => {
                        copy(slot(me), send as usize + at, bytes);
                    }
                    Call::ReduceScatter { send, .. } => {
                        for r in 0..w {
                            copy(slot(me).add(r * bytes), send as usize + r * count * size + at, bytes);
                        }
                    }
                    Call::Broadcast { send, root, .. } if root == me => copy(slot(me), send as usize + at, bytes),
                    _ => {}
                }
            }
            self.group.barrier(name).map_err(remote)?;
            if round == 0 {
                self.same_call_everywhere(name, words)?;
            }
            // SAFETY: as above; every rank's slot is staged and nobody writes one until
            // the barrier below.
            unsafe {
                match call {
                    Call::AllReduce { recv, dtype, op, .. } => {
                        let sources: Vec<*const u8> = (0..w).map(|r| slot(r) as *const u8).collect();
                        reduce(dtype, (recv as usize + at) as *mut u8, &sources, n, op);
                    }
                    Call::ReduceScatter { recv, dtype, op, .. } => {
                        let sources: Vec<*const u8> = (0..w).map(|r| slot(r).add(me * bytes) as *const u8).collect();
                        reduce(dtype, (recv as usize + at) as *mut u8, &sources, n, op);
                    }
                    Call::AllGather { recv, .. } => {
                        for r in 0..w {
                            copy_out(recv as usize + r * count * size + at, slot(r), bytes);
                        }
                    }
                    Call::Broadcast { recv, root, .. } => copy_out(recv as usize + at, slot(root), bytes),
                    Call::Send { .. } | Call::Recv { .. } => unreachable!("point to point is not a collective"),
                }
            }
            self.group.barrier(name).map_err(remote)?;
        }
        Ok(())
    }

    /// An error on every rank when the ranks did not all call what rank 0 did.
    fn same_call_everywhere(&self, name: &str, words: [u64; 4]) -> Result<(), Failure> {
        let first = self.call_of(0);
        for r in 1..self.ranks() {
            let theirs = self.call_of(r);
            if theirs != first {
                let mine = if self.me() == r || self.me() == 0 { "" } else { " (not this rank)" };
                return Err(self.fail(
                    INVALID_USAGE,
                    name,
                    format!(
                        "the ranks called different collectives{mine}: rank 0 {}, rank {r} {} (this rank {})",
                        Call::describe(first),
                        Call::describe(theirs),
                        Call::describe(words)
                    ),
                ));
            }
        }
        Ok(())
    }

    fn call_of(&self, rank: usize) -> [u64; 4] {
        std::array::from_fn(|i| self.group.entry(rank).call[i].load(Acquire))
    }
}

/// Copies `bytes` from device address `src` into a slot.
unsafe fn copy(slot: *mut u8, src: usize, bytes: usize) {
    std::ptr::copy_nonoverlapping(src as *const u8, slot, bytes);
}

/// Copies `bytes` from a slot to device address `dst`.
unsafe fn copy_out(dst: usize, slot: *const u8, bytes: usize) {
    std::ptr::copy(slot, dst as *mut u8, bytes);
}

/// A send or receive being progressed.
struct Transfer {
    comm: *const Comm,
    send: bool,
    peer: usize,
    ptr: usize,
    bytes: usize,
    /// Bytes posted (a send) or taken (a receive).
    moved: usize,
    /// A send has posted its first piece (a message may have no bytes).
    started: bool,
    finished: bool,
}

impl Transfer {
    fn new(comm: *const Comm, call: Call) -> Self {
        let (send, ptr, count, dtype, peer) = match call {
            Call::Send { send, count, dtype, peer } => (true, send, count, dtype, peer),
            Call::Recv { recv, count, dtype, peer } => (false, recv, count, dtype, peer),
            _ => unreachable!("only sends and receives are transfers"),
        };
        let bytes = count * data_type(dtype).map_or(0, |t| t.1);
        Self { comm, send, peer, ptr: ptr as usize, bytes, moved: 0, started: false, finished: false }
    }

    /// One step forward if the channel allows: whether it moved.
    fn progress(&mut self) -> Result<bool, Failure> {
        // SAFETY: the communicator outlives the group call that holds this transfer.
        let comm = unsafe { &*self.comm };
        let group = &comm.group;
        let (rest, at) = (self.bytes - self.moved, self.ptr + self.moved);
        if self.send {
            if !self.started || rest > 0 {
                // SAFETY: `check` found `bytes` of device memory at `ptr`.
                let Some(piece) = (unsafe { group.try_send(self.peer, at as *const u8, rest, self.bytes) }) else {
                    return Ok(false);
                };
                (self.moved, self.started) = (self.moved + piece, true);
                return Ok(true);
            }
            self.finished = group.drained(self.peer);
            return Ok(self.finished);
        }
        // SAFETY: as above.
        let took = unsafe { group.try_recv(self.peer, at as *mut u8, rest, self.bytes) }
            .map_err(|e| comm.fail(INVALID_USAGE, "ncclRecv", e))?;
        let Some(piece) = took else { return Ok(false) };
        self.moved += piece;
        self.finished = self.moved == self.bytes;
        Ok(true)
    }
}

/// Runs sends and receives together until all are done. Each pair's messages go in the
/// order they were called.
fn transfer(mut transfers: Vec<Transfer>) -> Result<(), Failure> {
    let mut last_moved = std::time::Instant::now();
    loop {
        let Some(first) = transfers.iter().find(|t| !t.finished).map(|t| t.comm) else { return Ok(()) };
        // SAFETY: as in `Transfer::progress`.
        let comm = unsafe { &*first };
        let rung = comm.group.doorbell();
        if progress_all(&mut transfers)? {
            last_moved = std::time::Instant::now();
        } else {
            let waiting = transfers.iter().filter(|t| !t.finished && std::ptr::eq(t.comm, first));
            let peers: Vec<usize> = waiting.map(|t| t.peer).collect();
            if let Err(gone) = comm.group.check_peers(peers.iter().copied(), "ncclSend/ncclRecv") {
                // (A peer may have taken or sent the last piece, then left, since the pass.)
                if progress_all(&mut transfers)? {
                    continue;
                }
                return Err((REMOTE_ERROR, gone));
            }
            if last_moved.elapsed() > STALL {
                let what = format!("nothing moved for {} s between this rank and ranks {peers:?}: a deadlock (a send whose receive never comes?)", STALL.as_secs());
                return Err(comm.fail(INTERNAL_ERROR, "ncclSend/ncclRecv", what));
            }
            comm.group.wait_for_peers(rung);
        }
    }
}

/// One pass over the transfers, each moving a piece if its channel allows (a pair's
/// messages in the order they were called): whether any moved.
fn progress_all(transfers: &mut [Transfer]) -> Result<bool, Failure> {
    let mut moved = false;
    for i in 0..transfers.len() {
        let t = &transfers[i];
        let earlier = transfers[..i]
            .iter()
            .any(|e| !e.finished && std::ptr::eq(e.comm, t.comm) && e.send == t.send && e.peer == t.peer);
        if !t.finished && !earlier {
            moved |= transfers[i].progress()?;
        }
    }
    Ok(moved)
}

/// Runs `calls` as one group: the collectives in order, then every transfer together.
fn run(calls: Vec<(*const Comm, Call)>) -> Result<(), Failure> {
    let mut transfers = Vec::new();
    for (comm, call) in calls {
        match call {
            Call::Send { .. } | Call::Recv { .. } => transfers.push(Transfer::new(comm, call)),
            // SAFETY: the caller's communicator, live for the call (or its group).
            _ => unsafe { &*comm }.collective(call)?,
        }
    }
    transfer(transfers)
}

thread_local! {
    /// `ncclGroupStart`s not yet ended on this thread, the calls they hold, and the error
    /// of a call refused inside them (the whole group then fails, as with NCCL).
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
    static GROUPED: RefCell<Vec<(*const Comm, Call)>> = const { RefCell::new(Vec::new()) };
    static GROUP_FAILED: Cell<Option<NcclResult>> = const { Cell::new(None) };
}

/// Checks `call` and runs it, or queues it inside a group.
unsafe fn submit(comm: *mut Comm, call: Call) -> NcclResult {
    let Some(c) = comm.as_ref() else {
        return report((INVALID_ARGUMENT, format!("{}: a null communicator", call.name())));
    };
    if let Err(e) = c.check(&call) {
        return report(e);
    }
    if GROUP_DEPTH.with(Cell::get) > 0 {
        GROUPED.with(|g| g.borrow_mut().push((comm, call)));
        return SUCCESS;
    }
    done(run(vec![(comm, call)]))
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> NcclResult {
    if version.is_null() {
        return INVALID_ARGUMENT;
    }
    version.write(VERSION);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static MADE: AtomicU64 = AtomicU64::new(0);
    if id.is_null() {
        return INVALID_ARGUMENT;
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let name = format!("{ID_PREFIX}{}-{}-{nanos}", std::process::id(), MADE.fetch_add(1, Relaxed));
    let mut internal = [0 as c_char; 128];
    for (slot, b) in internal.iter_mut().zip(name.bytes()) {
        *slot = b as c_char;
    }
    id.write(UniqueId { internal });
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> NcclResult {
    if comm.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
        return report((INVALID_ARGUMENT, format!("ncclCommInitRank: rank {rank} of {nranks}")));
    }
    let name: String = id.internal.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect();
    let device = driver::current_device();
    let (ranks, me) = (nranks as usize, rank as usize);
    let group = match SharedGroup::join(&name, ranks, me, device) {
        Ok(group) => group,
        Err(e) => return report((SYSTEM_ERROR, format!("ncclCommInitRank: {e}"))),
    };
    for a in 0..ranks {
        for b in a + 1..ranks {
            if group.device(a) == group.device(b) {
                return report((
                    INVALID_USAGE,
                    format!(
                        "ncclCommInitRank: ranks {a} and {b} are both on device {}: NCCL takes one GPU per rank",
                        group.device(a)
                    ),
                ));
            }
        }
    }
    comm.write(Box::into_raw(Box::new(Comm { group, device })));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut Comm) -> NcclResult {
    if comm.is_null() {
        return INVALID_ARGUMENT;
    }
    drop(Box::from_raw(comm));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut Comm) -> NcclResult {
    ncclCommDestroy(comm)
}

#[no_mangle]
pub extern "C" fn ncclCommFinalize(_comm: *mut Comm) -> NcclResult {
    SUCCESS
}

/// Writes `what(comm)` to `out`: the communicator queries' common shape.
unsafe fn answer(comm: *const Comm, out: *mut c_int, what: impl FnOnce(&Comm) -> c_int) -> NcclResult {
    match (comm.as_ref(), out.is_null()) {
        (Some(c), false) => {
            out.write(what(c));
            SUCCESS
        }
        _ => INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: *const Comm, count: *mut c_int) -> NcclResult {
    answer(comm, count, |c| c.ranks() as c_int)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: *const Comm, device: *mut c_int) -> NcclResult {
    answer(comm, device, |c| c.device)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: *const Comm, rank: *mut c_int) -> NcclResult {
    answer(comm, rank, |c| c.me() as c_int)
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_uint,
    op: c_uint,
    comm: *mut Comm,
    _stream: *mut c_void,
) -> NcclResult {
    match reduce_op(op) {
        Ok(op) => submit(comm, Call::AllReduce { send: send as u64, recv: recv as u64, count, dtype, op }),
        Err(e) => report(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recv_count: usize,
    dtype: c_uint,
    op: c_uint,
    comm: *mut Comm,
    _stream: *mut c_void,
) -> NcclResult {
    match reduce_op(op) {
        Ok(op) => {
            submit(comm, Call::ReduceScatter { send: send as u64, recv: recv as u64, count: recv_count, dtype, op })
        }
        Err(e) => report(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    send_count: usize,
    dtype: c_uint,
    comm: *mut Comm,
    _stream: *mut c_void,
) -> NcclResult {
    submit(comm, Call::AllGather { send: send as u64, recv: recv as u64, count: send_count, dtype })
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_uint,
    root: c_int,
    comm: *mut Comm,
    _stream: *mut c_void,
) -> NcclResult {
    let root = usize::try_from(root).unwrap_or(usize::MAX);
    submit(comm, Call::Broadcast { send: send as u64, recv: recv as u64, count, dtype, root })
}

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    send: *const c_void,
    count: usize,
    dtype: c_uint,
    peer: c_int,
    comm: *mut Comm,
    _stream: *mut c_void,
) -> NcclResult {
    let peer = usize::try_from(peer).unwrap_or(usize::MAX);
    submit(comm, Call::Send { send: send as u64, count, dtype, peer })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recv: *mut c_void,
    count: usize,
    dtype: c_uint,
    peer: c_int,
    comm: *mut Comm,
    _stream: *mut c_void,
) -> NcclResult {
    let peer = usize::try_from(peer).unwrap_or(usize::MAX);
    submit(comm, Call::Recv { recv: recv as u64, count, dtype, peer })
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    GROUP_DEPTH.with(|d| d.set(d.get() + 1));
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    let depth = GROUP_DEPTH.with(Cell::get);
    if depth == 0 {
        return report((INVALID_USAGE, "ncclGroupEnd without ncclGroupStart".into()));
    }
    GROUP_DEPTH.with(|d| d.set(depth - 1));
    if depth > 1 {
        return SUCCESS;
    }
    let calls = GROUPED.with(|g| std::mem::take(&mut *g.borrow_mut()));
    if let Some(code) = GROUP_FAILED.with(|f| f.take()) {
        return code; // (a call of it was refused: nothing of it runs)
    }
    done(run(calls))
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: NcclResult) -> *const c_char {
    let text: &'static [u8] = match result {
        0 => b"no error\0",
        1 => b"unhandled cuda error\0",
        2 => b"unhandled system error\0",
        3 => b"internal error\0",
        4 => b"invalid argument\0",
        5 => b"invalid usage\0",
        6 => b"remote process exited or there was a network error\0",
        7 => b"NCCL operation in progress\0",
        _ => b"unknown result code\0",
    };
    text.as_ptr() as *const c_char
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut Comm) -> *const c_char {
    // (The text stays until this thread's next error replaces it.)
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
