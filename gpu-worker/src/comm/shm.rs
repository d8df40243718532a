//! A one-way pipe of bytes from one rank process to another through shared memory.
//!
//! The writer copies bytes into a ring of `CAPACITY` bytes in a memfd that both processes
//! map; the reader uses them where they lie (a reduction adds them straight into its own
//! buffer) and then hands the space back. Two counters say how far each side has got:
//! `written` (bytes ever written, advanced only by the writer) and `read` (bytes ever
//! consumed, advanced only by the reader); `written - read` bytes are waiting. A side with
//! nothing to do spins briefly, then sleeps on a futex word the other side bumps, so a
//! waiting rank leaves the CPU to the ranks that compute.
//!
//! Compared with a socket this saves the kernel's two copies and its system calls; the
//! price is that a dead peer is not noticed by the pipe itself, so every wait also asks
//! `Patience::peer_alive` (the rank's socket to that peer, which the kernel closes when the
//! peer process exits).
//!
//! Large messages need not pass through the pipe at all: the writer can `post` one (send
//! only where it lies in its own memory), the reader copies it straight out of the writer's
//! address space (`cma.rs`) and says it has `taken` it, and only then may the writer reuse
//! that memory. Two counters more in the header count posted and taken messages.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{fstat, ftruncate, memfd_create, MemfdFlags};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
use rustix::net::{recv, RecvFlags};
use rustix::thread::futex;

/// Bytes of data one pipe holds (it lives in the shared L3 cache on a typical host).
pub const CAPACITY: usize = 2 << 20;
/// At most this many bytes are published or consumed at once, so the reader starts on a
/// message while the writer is still copying the rest of it.
const PIECE_BYTES: usize = 256 << 10;
/// The counters sit in the first page, the ring after it.
const HEADER_BYTES: usize = 4096;
/// Bytes one pipe maps (in both processes).
pub const MAP_BYTES: usize = HEADER_BYTES + CAPACITY;
/// Checks of the other side's counter before going to sleep: the first ones back to back,
/// the rest each after offering the CPU to another thread (ranks may outnumber cores).
const SPINS: u32 = 200;
const YIELDS: u32 = 200;
/// Longest sleep between checks that the peer is still alive.
const NAP: Duration = Duration::from_millis(20);

/// One side's progress, on a cache line of its own.
#[repr(C, align(64))]
struct Counter {
    value: AtomicU64,
    /// Bumped after every advance; the other side sleeps on it.
    bumps: AtomicU32,
    /// How many threads sleep on `bumps` (the advancing side only wakes when some do).
    sleepers: AtomicU32,
}

#[repr(C)]
struct Header {
    written: Counter,
    read: Counter,
    posted: Counter,
    taken: Counter,
}

impl Counter {
    fn advance(&self, value: u64) {
        self.value.store(value, SeqCst);
        self.bumps.fetch_add(1, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            let _ = futex::wake(&self.bumps, futex::Flags::empty(), u32::MAX);
        }
    }

    /// Waits until `ready(value)` holds, the peer dies, or `patience` runs out.
    fn wait_for(&self, ready: impl Fn(u64) -> bool, patience: &Patience) -> std::io::Result<u64> {
        for i in 0..SPINS + YIELDS {
            let now = self.value.load(SeqCst);
            if ready(now) {
                return Ok(now);
            }
            if i < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let deadline = Instant::now() + patience.timeout;
        loop {
            self.sleepers.fetch_add(1, SeqCst);
            let bumps = self.bumps.load(SeqCst);
            let now = self.value.load(SeqCst);
            if !ready(now) {
                let nap = NAP.min(deadline.saturating_duration_since(Instant::now()));
                let timeout = rustix::time::Timespec { tv_sec: 0, tv_nsec: nap.as_nanos() as _ };
                // Returns at once if `bumps` moved since we read it (no lost wake-up).
                let _ = futex::wait(&self.bumps, futex::Flags::empty(), bumps, Some(&timeout));
            }
            self.sleepers.fetch_sub(1, SeqCst);
            let now = self.value.load(SeqCst);
            if ready(now) {
                return Ok(now);
            }
            if !patience.peer_alive() {
                return Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the peer process closed its end"));
            }
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no progress from the peer"));
            }
        }
    }
}

/// How long a pipe operation may wait without progress, and how to tell that the peer died.
pub struct Patience<'a> {
    pub timeout: Duration,
    /// A socket connected to the peer process; it reads end-of-file once the peer is gone.
    pub peer: BorrowedFd<'a>,
}

impl Patience<'_> {
    fn peer_alive(&self) -> bool {
        let mut byte = [0u8; 1];
        match recv(self.peer, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((_, 0)) => false,
            Ok(_) => true,
            Err(e) => e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR,
        }
    }
}

/// A memfd mapped into this process (a pipe, or a shared buffer).
struct Mapping {
    base: *mut u8,
    bytes: usize,
}

// The mapping is plain memory; concurrent access goes through the atomics in `Header`, and
// each of the ring's bytes is touched by one side at a time.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(fd: &OwnedFd, bytes: usize) -> std::io::Result<Mapping> {
        if (fstat(fd)?.st_size as u64) < bytes as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the peer sent a memfd of the wrong size",
            ));
        }
        // SAFETY: a fresh shared mapping of a memfd of at least `bytes` bytes.
        let base =
            unsafe { mmap(std::ptr::null_mut(), bytes, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0)? };
        Ok(Mapping { base: base.cast(), bytes })
    }

    fn header(&self) -> &Header {
        // SAFETY: the first page holds the header (zeroed by ftruncate, a valid state).
        unsafe { &*(self.base as *const Header) }
    }

    fn ring(&self) -> *mut u8 {
        // SAFETY: within the mapping.
        unsafe { self.base.add(HEADER_BYTES) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping what `map` mapped; no reference into it outlives the Mapping.
        let _ = unsafe { munmap(self.base.cast(), self.bytes) };
    }
}

/// Creates a pipe: this process writes into it, and the returned fd is sent to the reader.
pub fn create() -> std::io::Result<(PipeWriter, OwnedFd)> {
    let fd = memfd_create("distlab-pipe", MemfdFlags::CLOEXEC)?;
    ftruncate(&fd, MAP_BYTES as u64)?;
    let map = Mapping::map(&fd, MAP_BYTES)?;
    Ok((PipeWriter { map: Arc::new(map), written: 0 }, fd))
}

/// Opens the reading end of a pipe another process created.
pub fn open(fd: OwnedFd) -> std::io::Result<PipeReader> {
    let map = Mapping::map(&fd, MAP_BYTES)?;
    let read = map.header().read.value.load(SeqCst);
    Ok(PipeReader { map: Arc::new(map), read })
}

/// The writing end. Clones share the stream (only one may be used at a time).
#[derive(Clone)]
pub struct PipeWriter {
    map: Arc<Mapping>,
    written: u64,
}

/// The reading end. Clones share the stream (only one may be used at a time).
#[derive(Clone)]
pub struct PipeReader {
    map: Arc<Mapping>,
    read: u64,
}

impl PipeWriter {
    /// Copies all of `bytes` into the pipe, waiting for the reader to make room as needed.
    pub fn write_all(&mut self, mut bytes: &[u8], patience: &Patience) -> std::io::Result<()> {
        let header = self.map.header();
        // Another clone may have written since this one did.
        self.written = header.written.value.load(SeqCst);
        while !bytes.is_empty() {
            let written = self.written;
            let read = header.read.wait_for(|read| written - read < CAPACITY as u64, patience)?;
            let at = (written % CAPACITY as u64) as usize;
            let free = CAPACITY - (written - read) as usize;
            let n = bytes.len().min(free).min(CAPACITY - at).min(PIECE_BYTES);
            // SAFETY: [at, at+n) is inside the ring and free: the reader is done with it
            // (read has passed it) and will not look at it until `written` covers it.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.ring().add(at), n) };
            self.written += n as u64;
            header.written.advance(self.written);
            bytes = &bytes[n..];
        }
        Ok(())
    }
}

impl PipeWriter {
    /// Counts a message whose payload stays in this process for the reader to copy out;
    /// returns its ticket for `wait_taken`.
    pub fn post(&mut self) -> u64 {
        let posted = &self.map.header().posted;
        let ticket = posted.value.load(SeqCst) + 1;
        posted.advance(ticket);
        ticket
    }

    /// Waits until the reader has taken the posted message `ticket` (and every one before).
    pub fn wait_taken(&self, ticket: u64, patience: &Patience) -> std::io::Result<()> {
        self.map.header().taken.wait_for(|taken| taken >= ticket, patience).map(|_| ())
    }
}

impl PipeReader {
    /// Says that the oldest posted message not yet taken has been copied out.
    pub fn mark_taken(&mut self) {
        let taken = &self.map.header().taken;
        taken.advance(taken.value.load(SeqCst) + 1);
    }

    /// Consumes the next `len` bytes, handing them to `consume` in contiguous pieces where
    /// they lie in shared memory (every piece a multiple of 4 bytes when everything written
    /// so far was).
    pub fn read_with(
        &mut self,
        len: usize,
        patience: &Patience,
        mut consume: impl FnMut(&[u8]),
    ) -> std::io::Result<()> {
        let header = self.map.header();
        self.read = header.read.value.load(SeqCst);
        let mut left = len;
        while left > 0 {
            let read = self.read;
            let written = header.written.wait_for(|written| written > read, patience)?;
            let at = (read % CAPACITY as u64) as usize;
            let n = left.min((written - read) as usize).min(CAPACITY - at).min(PIECE_BYTES);
            // SAFETY: [at, at+n) holds bytes the writer published (written covers them) and
            // will not touch until `read` passes them.
            consume(unsafe { std::slice::from_raw_parts(self.map.ring().add(at), n) });
            self.read += n as u64;
            header.read.advance(self.read);
            left -= n;
        }
        Ok(())
    }

    /// Reads exactly `out.len()` bytes into `out`.
    pub fn read_exact(&mut self, out: &mut [u8], patience: &Patience) -> std::io::Result<()> {
        let mut filled = 0;
        self.read_with(out.len(), patience, |piece| {
            out[filled..filled + piece.len()].copy_from_slice(piece);
            filled += piece.len();
        })
    }
}

/// Floats in a memfd that peer processes map too (`Communicator::alloc_shared`): a peer
/// reads a posted chunk of it with plain loads, one copy, no system call.
pub struct SharedBuffer {
    map: Arc<Mapping>,
    len: usize,
}

impl SharedBuffer {
    /// `len` zeros in a new memfd, and the fd to send to the peers.
    pub fn create(len: usize) -> std::io::Result<(SharedBuffer, OwnedFd)> {
        let fd = memfd_create("distlab-shared", MemfdFlags::CLOEXEC)?;
        let bytes = Self::mapped_bytes(len);
        ftruncate(&fd, bytes as u64)?;
        let map = Mapping::map(&fd, bytes)?;
        Ok((SharedBuffer { map: Arc::new(map), len }, fd))
    }

    /// A peer's buffer of `len` floats, from the fd it sent.
    pub fn open(fd: OwnedFd, len: usize) -> std::io::Result<SharedBuffer> {
        let map = Mapping::map(&fd, Self::mapped_bytes(len))?;
        Ok(SharedBuffer { map: Arc::new(map), len })
    }

    /// A mapping is never empty (mmap refuses zero bytes).
    fn mapped_bytes(len: usize) -> usize {
        (len * 4).max(4096)
    }

    /// Another handle to the same memory (for the communicator's table of shared buffers).
    pub fn share(&self) -> SharedBuffer {
        SharedBuffer { map: self.map.clone(), len: self.len }
    }

    /// Where `part` lies in this buffer, in elements, if it lies wholly inside.
    pub fn offset_of(&self, part: &[f32]) -> Option<usize> {
        let base = self.map.base as usize;
        let start = part.as_ptr() as usize;
        (start >= base && start + part.len() * 4 <= base + self.len * 4).then(|| (start - base) / 4)
    }

    /// `len` floats from `offset`, if they lie inside (for reading a peer's posted chunk,
    /// which the peer does not touch until it is taken).
    pub fn range(&self, offset: usize, len: usize) -> Option<&[f32]> {
        (offset.checked_add(len)? <= self.len).then(|| &self[offset..offset + len])
    }
}

impl std::ops::Deref for SharedBuffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: the mapping holds at least len floats, page aligned.
        unsafe { std::slice::from_raw_parts(self.map.base as *const f32, self.len) }
    }
}

impl std::ops::DerefMut for SharedBuffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above; peers only read the parts this rank has posted and waits on.
        unsafe { std::slice::from_raw_parts_mut(self.map.base as *mut f32, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn bytes_arrive_in_order_across_wrap_arounds() {
        let (mut writer, fd) = create().unwrap();
        let mut reader = open(fd).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let data: Vec<u8> = (0..(3 * CAPACITY + 1234)).map(|i| (i * 7 % 251) as u8).collect();
        let sent = data.clone();
        let writer_thread = std::thread::spawn(move || {
            let patience = Patience { timeout: Duration::from_secs(10), peer: a.as_fd() };
            writer.write_all(&sent, &patience).unwrap();
            a
        });
        let patience = Patience { timeout: Duration::from_secs(10), peer: b.as_fd() };
        let mut got = vec![0u8; data.len()];
        reader.read_exact(&mut got, &patience).unwrap();
        writer_thread.join().unwrap();
        assert!(got == data);
    }

    #[test]
    fn a_closed_peer_is_noticed_while_waiting() {
        let (_writer, fd) = create().unwrap();
        let mut reader = open(fd).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let patience = Patience { timeout: Duration::from_secs(30), peer: b.as_fd() };
        let started = Instant::now();
        let err = reader.read_exact(&mut [0u8; 8], &patience).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (_writer, fd) = create().unwrap();
        let mut reader = open(fd).unwrap();
        let (_a, b) = UnixStream::pair().unwrap();
        let patience = Patience { timeout: Duration::from_millis(100), peer: b.as_fd() };
        let err = reader.read_exact(&mut [0u8; 8], &patience).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    }
}
