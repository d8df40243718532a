//! Where the emulated NCCL's ranks meet: one file in `/dev/shm` per communicator, mapped by
//! every rank's process. It holds
//!
//! - a header: the rank count, how many joined, a barrier (count and generation);
//! - one entry per rank: its process id, its device, whether it left, its doorbell (a
//!   counter its peers bump, and wake it through, when they change a channel it uses), and
//!   the collective it is in (kind, type, count, and root or reduction), which every rank
//!   compares;
//! - one slot per rank (`SLOT` bytes) that collectives stage their data through;
//! - one channel per ordered pair of ranks (`CHANNEL` bytes and two counters) that
//!   `ncclSend` / `ncclRecv` pass their messages through, a piece at a time.
//!
//! Waits sleep on a futex (the ranks may be more than the cores) and look at the peers they
//! wait for: a peer whose process is gone, or that left the communicator, ends the wait
//! with an error instead of a hang, which real NCCL does not promise.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// Bytes of one rank's collective slot.
pub const SLOT: usize = 1 << 20;
/// Bytes of one channel between two ranks.
pub const CHANNEL: usize = 256 << 10;
/// The most ranks one emulated communicator takes.
pub const MAX_RANKS: usize = 64;
/// How long `ncclCommInitRank` waits for every rank to join.
const JOIN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a rank waits in a barrier, or for a channel, before it calls it a deadlock.
pub const STALL: Duration = Duration::from_secs(300);
/// The prefix of every emulated NCCL id (and of its file in `/dev/shm`).
pub const ID_PREFIX: &str = "distlab-emulated-nccl-";

const LINE: usize = 64;

#[repr(C)]
struct Header {
    ranks: AtomicU32,
    joined: AtomicU32,
    arrived: AtomicU32,
    generation: AtomicU32,
}

/// One rank's entry (a cache line).
#[repr(C)]
pub struct Entry {
    pid: AtomicI32,
    device: AtomicI32,
    left: AtomicU32,
    doorbell: AtomicU32,
    /// The collective this rank is in: kind, data type, count, and root or reduction.
    pub call: [AtomicU64; 4],
}

/// A channel's counters: pieces posted and taken, and the bytes of the piece posted and
/// of the message it belongs to.
#[repr(C)]
struct Channel {
    posted: AtomicU64,
    taken: AtomicU64,
    piece: AtomicU64,
    message: AtomicU64,
}

/// Why a wait ended without what it waited for.
pub type Failure = String;

/// One rank's view of a communicator's shared file.
pub struct SharedGroup {
    base: *mut u8,
    bytes: usize,
    pub ranks: usize,
    pub me: usize,
    /// This process holds rank `me`'s entry (a second process claiming it does not).
    joined: bool,
}

// SAFETY: the mapping is shared memory accessed only through atomics and the slots and
// channels the protocol gives one writer at a time.
unsafe impl Send for SharedGroup {}

impl SharedGroup {
    fn layout(ranks: usize) -> (usize, usize, usize, usize) {
        let entries = LINE;
        let channels = entries + ranks * LINE;
        let slots = (channels + ranks * ranks * LINE).next_multiple_of(4096);
        let buffers = slots + ranks * SLOT;
        (entries, channels, slots, buffers)
    }

    /// Joins communicator `name` as rank `me` of `ranks` on `device`: maps its file
    /// (whoever comes first makes it) and waits until every rank has joined. Then the file
    /// is unlinked (the mappings stay), so nothing is left behind in `/dev/shm`; a join that
    /// fails unlinks it too.
    pub fn join(name: &str, ranks: usize, me: usize, device: i32) -> Result<Self, Failure> {
        if !name.starts_with(ID_PREFIX) || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(format!("{name:?} is not an id ncclGetUniqueId made"));
        }
        if ranks == 0 || ranks > MAX_RANKS || me >= ranks {
            return Err(format!("rank {me} of {ranks}: the emulated NCCL takes 1 to {MAX_RANKS} ranks"));
        }
        let path = format!("/dev/shm/{name}");
        let bytes = Self::layout(ranks).3 + ranks * ranks * CHANNEL;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false) // (every rank opens it; whoever comes first makes it)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("cannot open {path}: {e}"))?;
        let failed = |why: String| {
            let _ = std::fs::remove_file(&path);
            why
        };
        use std::os::fd::AsRawFd;
        // The file's pages taken now (it only ever grows: a rank that says another rank count
        // cannot shrink it under the others' mappings), so that a /dev/shm too small fails
        // here and not as a SIGBUS inside a collective.
        // SAFETY: fallocate on the file just opened.
        let error = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, bytes as libc::off_t) };
        if error != 0 {
            let cause = std::io::Error::from_raw_os_error(error);
            return Err(failed(format!("cannot take {} MiB of /dev/shm for the communicator: {cause}", bytes >> 20)));
        }
        // SAFETY: a shared mapping of the file's first `bytes`, unmapped in Drop.
        let base = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            if p == libc::MAP_FAILED {
                return Err(failed(format!("cannot map {path}: {}", std::io::Error::last_os_error())));
            }
            p as *mut u8
        };
        let mut group = Self { base, bytes, ranks, me, joined: false };
        let header = group.header();
        if let Err(other) = header.ranks.compare_exchange(0, ranks as u32, AcqRel, Acquire) {
            if other as usize != ranks {
                return Err(failed(format!("rank {me} says the communicator has {ranks} ranks, another said {other}")));
            }
        }
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        if group.entry(me).pid.compare_exchange(0, pid, AcqRel, Acquire).is_err() {
            return Err(failed(format!("two processes joined as rank {me}")));
        }
        group.joined = true;
        let (header, mine) = (group.header(), group.entry(me));
        mine.device.store(device, Release);
        header.joined.fetch_add(1, AcqRel);
        futex_wake(&header.joined);
        let started = Instant::now();
        let everyone = group.wait(
            &header.joined,
            "ncclCommInitRank",
            |joined| joined as usize == ranks,
            || {
                (started.elapsed() > JOIN_TIMEOUT).then(|| {
                    format!(
                        "only {} of {ranks} ranks joined within {} s",
                        header.joined.load(Acquire),
                        JOIN_TIMEOUT.as_secs()
                    )
                })
            },
        );
        // Every rank has mapped the file (or the join failed): nobody needs its name now.
        let _ = std::fs::remove_file(&path);
        everyone?;
        Ok(group)
    }

    fn header(&self) -> &Header {
        // SAFETY: the header is at the mapping's start, and lives as long as `self`.
        unsafe { &*(self.base as *const Header) }
    }

    pub fn entry(&self, rank: usize) -> &Entry {
        let at = Self::layout(self.ranks).0 + rank * LINE;
        // SAFETY: inside the mapping (`layout`), cache-line aligned.
        unsafe { &*(self.base.add(at) as *const Entry) }
    }

    fn channel(&self, from: usize, to: usize) -> &Channel {
        let at = Self::layout(self.ranks).1 + (from * self.ranks + to) * LINE;
        // SAFETY: inside the mapping (`layout`), cache-line aligned.
        unsafe { &*(self.base.add(at) as *const Channel) }
    }

    /// The device rank `rank` joined from.
    pub fn device(&self, rank: usize) -> i32 {
        self.entry(rank).device.load(Acquire)
    }

    /// Rank `rank`'s collective slot.
    pub fn slot(&self, rank: usize) -> *mut u8 {
        // SAFETY: inside the mapping (`layout`).
        unsafe { self.base.add(Self::layout(self.ranks).2 + rank * SLOT) }
    }

    fn channel_buffer(&self, from: usize, to: usize) -> *mut u8 {
        let at = Self::layout(self.ranks).3 + (from * self.ranks + to) * CHANNEL;
        // SAFETY: inside the mapping (`bytes` in `join`).
        unsafe { self.base.add(at) }
    }

    /// Waits until every rank has come here (a barrier that can be used again at once).
    pub fn barrier(&self, during: &str) -> Result<(), Failure> {
        let header = self.header();
        let generation = header.generation.load(Acquire);
        if header.arrived.fetch_add(1, AcqRel) as usize + 1 == self.ranks {
            header.arrived.store(0, Relaxed);
            header.generation.fetch_add(1, Release);
            futex_wake(&header.generation);
            return Ok(());
        }
        let started = Instant::now();
        self.wait(
            &header.generation,
            during,
            |g| g != generation,
            || {
                (started.elapsed() > STALL).then(|| {
                    format!(
                        "the other ranks did not come within {} s: a deadlock (a collective some rank never calls?)",
                        STALL.as_secs()
                    )
                })
            },
        )
    }

    /// Sleeps on `word` until `done(word)`, looking at the peers (and `give_up`) between
    /// sleeps.
    fn wait(
        &self,
        word: &AtomicU32,
        during: &str,
        done: impl Fn(u32) -> bool,
        give_up: impl Fn() -> Option<Failure>,
    ) -> Result<(), Failure> {
        let mut looked = Instant::now();
        loop {
            let now = word.load(Acquire);
            if done(now) {
                return Ok(());
            }
            if looked.elapsed() > Duration::from_millis(50) {
                looked = Instant::now();
                let failure = self
                    .check_peers(0..self.ranks, during)
                    .err()
                    .or_else(|| give_up().map(|why| format!("rank {} in {during}: {why}", self.me)));
                if let Some(failure) = failure {
                    // (The last peer may have come, and then left or exited, since `now`.)
                    return if done(word.load(Acquire)) { Ok(()) } else { Err(failure) };
                }
            }
            futex_wait(word, now, Duration::from_millis(10));
        }
    }

    /// An error when one of `peers` cannot come any more: its process is gone, or it left.
    pub fn check_peers(&self, peers: impl IntoIterator<Item = usize>, during: &str) -> Result<(), Failure> {
        for r in peers.into_iter().filter(|&r| r != self.me) {
            let entry = self.entry(r);
            if entry.left.load(Acquire) != 0 {
                return Err(format!("rank {} in {during}: rank {r} has left the communicator", self.me));
            }
            let pid = entry.pid.load(Acquire);
            if pid != 0 && !alive(pid) {
                return Err(format!("rank {} in {during}: rank {r} (process {pid}) is gone", self.me));
            }
        }
        Ok(())
    }

    fn ring(&self, rank: usize) {
        let bell = &self.entry(rank).doorbell;
        bell.fetch_add(1, Release);
        futex_wake(bell);
    }

    /// This rank's doorbell, to sample before a round of [`SharedGroup::try_send`] /
    /// [`SharedGroup::try_recv`] and pass to [`SharedGroup::wait_for_peers`] after it.
    pub fn doorbell(&self) -> u32 {
        self.entry(self.me).doorbell.load(Acquire)
    }

    /// Sleeps until a peer rings this rank's doorbell after `rung` (at most 20 ms).
    pub fn wait_for_peers(&self, rung: u32) {
        futex_wait(&self.entry(self.me).doorbell, rung, Duration::from_millis(20));
    }

    /// Whether everything this rank sent to `to` has been taken.
    pub fn drained(&self, to: usize) -> bool {
        let channel = self.channel(self.me, to);
        channel.posted.load(Acquire) == channel.taken.load(Acquire)
    }

    /// Puts the next piece of a `message`-byte message to `to` (from `data`, the bytes not
    /// yet sent) in their channel, if it is empty: the bytes it took.
    ///
    /// # Safety
    /// `data` is valid for reading `len` bytes.
    pub unsafe fn try_send(&self, to: usize, data: *const u8, len: usize, message: usize) -> Option<usize> {
        let channel = self.channel(self.me, to);
        if channel.posted.load(Acquire) != channel.taken.load(Acquire) {
            return None;
        }
        let piece = len.min(CHANNEL);
        std::ptr::copy_nonoverlapping(data, self.channel_buffer(self.me, to), piece);
        channel.piece.store(piece as u64, Relaxed);
        channel.message.store(message as u64, Relaxed);
        channel.posted.fetch_add(1, Release);
        self.ring(to);
        Some(piece)
    }

    /// Takes the piece `from` has put in their channel into `data` (room for `len` bytes of
    /// a `message`-byte message), if there is one: the bytes it took, or an error when the
    /// sender's message is not as long as this receive.
    ///
    /// # Safety
    /// `data` is valid for writing `len` bytes.
    pub unsafe fn try_recv(
        &self,
        from: usize,
        data: *mut u8,
        len: usize,
        message: usize,
    ) -> Result<Option<usize>, Failure> {
        let channel = self.channel(from, self.me);
        if channel.posted.load(Acquire) == channel.taken.load(Acquire) {
            return Ok(None);
        }
        let (piece, sent) = (channel.piece.load(Relaxed) as usize, channel.message.load(Relaxed) as usize);
        if sent != message || piece > len {
            return Err(format!(
                "rank {} receives {message} bytes from rank {from}, which sends {sent} (ncclSend and ncclRecv must agree)",
                self.me
            ));
        }
        std::ptr::copy_nonoverlapping(self.channel_buffer(from, self.me), data, piece);
        channel.taken.fetch_add(1, Release);
        self.ring(from);
        Ok(Some(piece))
    }
}

impl Drop for SharedGroup {
    fn drop(&mut self) {
        if self.joined {
            self.entry(self.me).left.store(1, Release);
        }
        for r in 0..self.ranks {
            self.ring(r);
        }
        futex_wake(&self.header().generation);
        // SAFETY: the mapping made in `join`, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.bytes) };
    }
}

/// Whether process `pid` still runs: it exists and has not exited (a rank that died but
/// that its parent has not reaped yet is a zombie, which still exists).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the command's closing parenthesis.
        Ok(stat) => {
            !matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()), Some('Z' | 'X'))
        }
        Err(_) => {
            // SAFETY: signal 0 only asks whether the process exists.
            let exists = unsafe { libc::kill(pid, 0) } == 0;
            exists || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
        }
    }
}

/// Sleeps while `word` holds `expected` (at most `timeout`); wakes early when woken.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: FUTEX_WAIT on an aligned u32 in shared memory, with a relative timeout.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec);
    }
}

/// Wakes every process sleeping on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on an aligned u32 in shared memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
