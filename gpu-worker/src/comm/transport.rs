//! How rank processes reach each other: per pair of ranks, one Unix domain socket and two
//! shared-memory pipes (`shm.rs`), one each way.
//!
//! Rendezvous: every rank listens on `DIR/rank-R.sock`, connects to every lower rank
//! (saying who it is), and accepts one connection from every higher rank. Over each socket
//! the two ranks then hand each other the memfd of the pipe they will write into, their
//! process ids, and whether each can read the other's memory (`cma.rs`). Data moves through
//! the pipes; the socket stays open so that each side notices when the other process exits
//! (the kernel closes it).
//!
//! Messages are framed: a 24-byte header (tag, payload bytes, where the payload is) so a
//! rank that runs a different collective than its peer is caught instead of misread. The
//! payload either follows in the pipe or, when posted, stays in the sender's memory at the
//! address the header gives, for the receiver to copy out.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

use super::cma;
use super::shm::{self, Patience, PipeReader, PipeWriter};

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank {rank}: cannot listen on {path}: {source}")]
    Listen { rank: usize, path: PathBuf, source: std::io::Error },
    #[error("rank {rank}: rank {peer} did not show up within {waited_s:.0} s")]
    Timeout { rank: usize, peer: usize, waited_s: f64 },
    #[error("rank {rank}: connection setup with rank {peer} failed: {source}")]
    Io { rank: usize, peer: usize, source: std::io::Error },
    #[error("rank {rank}: a peer introduced itself as rank {claimed} of world {world}, which does not fit")]
    BadHello { rank: usize, claimed: u32, world: u32 },
}

/// The connections of one rank to every other rank of the world.
pub struct Mesh {
    pub rank: usize,
    pub world: usize,
    /// `links[p]`: the connection to rank p (None for self).
    links: Vec<Option<Link>>,
}

pub fn socket_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

impl Mesh {
    /// Connects this rank to all others through sockets in `dir` (shared by all ranks).
    pub fn connect(dir: &Path, rank: usize, world: usize, timeout: Duration) -> Result<Mesh, RendezvousError> {
        let mut sockets: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(Mesh { rank, world, links: (0..world).map(|_| None).collect() });
        }
        let path = socket_path(dir, rank);
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).map_err(|source| RendezvousError::Listen { rank, path: path.clone(), source })?;
        let deadline = Instant::now() + timeout;

        // Connect to every lower rank (retrying until it listens), introducing ourselves.
        for (peer, slot) in sockets.iter_mut().enumerate().take(rank) {
            let stream = loop {
                match UnixStream::connect(socket_path(dir, peer)) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                    Err(_) => return Err(RendezvousError::Timeout { rank, peer, waited_s: timeout.as_secs_f64() }),
                }
            };
            let io = |source| RendezvousError::Io { rank, peer, source };
            let mut s = stream;
            s.write_all(&[(rank as u32).to_le_bytes(), (world as u32).to_le_bytes()].concat()).map_err(io)?;
            *slot = Some(s);
        }

        // Accept one connection from every higher rank.
        listener.set_nonblocking(true).map_err(|source| RendezvousError::Io { rank, peer: rank, source })?;
        let mut missing = world - 1 - rank;
        while missing > 0 {
            match listener.accept() {
                Ok((mut s, _)) => {
                    let io = |source| RendezvousError::Io { rank, peer: rank + 1, source };
                    s.set_nonblocking(false).map_err(io)?;
                    s.set_read_timeout(Some(timeout)).map_err(io)?;
                    let mut hello = [0u8; 8];
                    s.read_exact(&mut hello).map_err(io)?;
                    let claimed = u32::from_le_bytes(hello[..4].try_into().expect("4 bytes"));
                    let their_world = u32::from_le_bytes(hello[4..].try_into().expect("4 bytes"));
                    let peer = claimed as usize;
                    if their_world as usize != world || peer <= rank || peer >= world || sockets[peer].is_some() {
                        return Err(RendezvousError::BadHello { rank, claimed, world: their_world });
                    }
                    sockets[peer] = Some(s);
                    missing -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let peer = (rank + 1..world).find(|&p| sockets[p].is_none()).unwrap_or(rank);
                        return Err(RendezvousError::Timeout { rank, peer, waited_s: timeout.as_secs_f64() });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(source) => return Err(RendezvousError::Io { rank, peer: rank, source }),
            }
        }
        let _ = std::fs::remove_file(&path);

        // Hand every peer the pipe this rank writes to it, with our process id and where our
        // probe lies (all sends first: they are tiny and cannot block), then take the peer's.
        let hello = Hello { pid: std::process::id() as i32, probe: cma::probe_address() };
        let mut writers: Vec<Option<PipeWriter>> = (0..world).map(|_| None).collect();
        for (peer, socket) in sockets.iter().enumerate() {
            if let Some(socket) = socket {
                let io = |source| RendezvousError::Io { rank, peer, source };
                let (writer, fd) = shm::create().map_err(io)?;
                send_fd(socket, &fd, &hello.to_bytes()).map_err(io)?;
                writers[peer] = Some(writer);
            }
        }
        let mut half_links = Vec::new();
        for (peer, (socket, writer)) in sockets.into_iter().zip(writers).enumerate() {
            if let (Some(mut socket), Some(tx)) = (socket, writer) {
                let io = |source| RendezvousError::Io { rank, peer, source };
                socket.set_read_timeout(Some(timeout)).map_err(io)?;
                let mut theirs = [0u8; Hello::BYTES];
                let rx = shm::open(recv_fd(&socket, &mut theirs).map_err(io)?).map_err(io)?;
                let theirs = Hello::from_bytes(&theirs);
                // Tell the peer whether we can copy straight out of its memory.
                socket.write_all(&[cma::can_read(theirs.pid, theirs.probe) as u8]).map_err(io)?;
                half_links.push((peer, socket, tx, rx, theirs.pid));
            }
        }
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        for (peer, mut socket, tx, rx, peer_pid) in half_links {
            let io = |source| RendezvousError::Io { rank, peer, source };
            let mut peer_reads_us = [0u8];
            socket.read_exact(&mut peer_reads_us).map_err(io)?;
            socket.set_read_timeout(None).map_err(io)?;
            links[peer] = Some(Link { peer, socket, tx, rx, peer_pid, may_post: peer_reads_us[0] == 1 });
        }
        Ok(Mesh { rank, world, links })
    }

    /// Bytes of the shared-memory pipes this rank maps: one each way per peer.
    pub fn pipe_bytes(&self) -> u64 {
        (self.links.iter().flatten().count() * 2 * shm::MAP_BYTES) as u64
    }

    /// Handles to the given peers for a group's own use (the pipes are shared: two groups
    /// with a common pair of ranks must not run collectives at the same time).
    pub fn links(&self, peers: &[usize]) -> std::io::Result<Vec<Option<Link>>> {
        peers
            .iter()
            .map(|&p| match &self.links[p] {
                Some(link) => Ok(Some(Link {
                    peer: p,
                    socket: link.socket.try_clone()?,
                    tx: link.tx.clone(),
                    rx: link.rx.clone(),
                    peer_pid: link.peer_pid,
                    may_post: link.may_post,
                })),
                None => Ok(None),
            })
            .collect()
    }
}

/// What a rank tells each peer about itself at rendezvous.
struct Hello {
    pid: i32,
    /// Address of the rank's `cma::PROBE`.
    probe: u64,
}

impl Hello {
    const BYTES: usize = 12;

    fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..].copy_from_slice(&self.probe.to_le_bytes());
        out
    }

    fn from_bytes(bytes: &[u8; Self::BYTES]) -> Hello {
        Hello {
            pid: i32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
            probe: u64::from_le_bytes(bytes[4..].try_into().expect("8 bytes")),
        }
    }
}

/// Sends a file descriptor over a Unix socket, with a few bytes of data.
pub(crate) fn send_fd(socket: &UnixStream, fd: &OwnedFd, data: &[u8]) -> std::io::Result<()> {
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    sendmsg(socket, &[IoSlice::new(data)], &mut control, SendFlags::empty())?;
    Ok(())
}

/// Receives the file descriptor and data `send_fd` sent.
pub(crate) fn recv_fd(socket: &UnixStream, data: &mut [u8]) -> std::io::Result<OwnedFd> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(socket, &mut [IoSliceMut::new(data)], &mut control, RecvFlags::CMSG_CLOEXEC)?;
    if got.bytes != data.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the peer closed during rendezvous"));
    }
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = message {
            if let Some(fd) = fds.next() {
                return Ok(fd);
            }
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the peer sent no pipe"))
}

/// The connection to one peer: the pipes both ways, and the socket that tells whether the
/// peer process is alive.
pub struct Link {
    /// The peer's global rank.
    pub peer: usize,
    pub socket: UnixStream,
    pub tx: PipeWriter,
    pub rx: PipeReader,
    /// The peer's process id, to copy posted messages out of its memory.
    pub peer_pid: i32,
    /// Whether the peer can copy out of this rank's memory, so messages to it may be posted.
    pub may_post: bool,
}

impl Link {
    pub fn patience(&self, timeout: Duration) -> Patience<'_> {
        Patience { timeout, peer: self.socket.as_fd() }
    }
}

/// Where a message's payload is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    /// It follows the header in the pipe.
    Inline,
    /// At this address in the sender's memory (copy it out with `cma::read`).
    Posted { address: u64 },
    /// At this element offset in the sender's shared buffer number `buffer`.
    Shared { buffer: u32, offset: u64 },
}

/// The header of one message.
pub struct Frame {
    pub tag: u64,
    pub bytes: u64,
    pub payload: Payload,
}

impl Frame {
    const BYTES: usize = 32;

    fn write(&self, tx: &mut PipeWriter, patience: &Patience) -> std::io::Result<()> {
        let (kind, place) = match self.payload {
            Payload::Inline => (0, 0),
            Payload::Posted { address } => (1, address),
            Payload::Shared { buffer, offset } => (2 + buffer as u64, offset),
        };
        let mut header = [0u8; Self::BYTES];
        for (i, word) in [self.tag, self.bytes, kind, place].into_iter().enumerate() {
            header[8 * i..8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
        tx.write_all(&header, patience)
    }

    /// Reads the next frame's header.
    pub fn read(rx: &mut PipeReader, patience: &Patience) -> std::io::Result<Frame> {
        let mut header = [0u8; Self::BYTES];
        rx.read_exact(&mut header, patience)?;
        let word = |i: usize| u64::from_le_bytes(header[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        let payload = match word(2) {
            0 => Payload::Inline,
            1 => Payload::Posted { address: word(3) },
            kind => Payload::Shared { buffer: (kind - 2) as u32, offset: word(3) },
        };
        Ok(Frame { tag: word(0), bytes: word(1), payload })
    }
}

/// Writes one message: its header, then the payload, into the pipe.
pub fn send_frame(tx: &mut PipeWriter, tag: u64, payload: &[u8], patience: &Patience) -> std::io::Result<()> {
    Frame { tag, bytes: payload.len() as u64, payload: Payload::Inline }.write(tx, patience)?;
    tx.write_all(payload, patience)
}

/// Writes only the header of a message whose payload the receiver copies out of this
/// process (`Posted` or `Shared`); returns the ticket to wait on (`PipeWriter::wait_taken`)
/// before the payload may change or go away.
pub fn post_frame(
    tx: &mut PipeWriter,
    tag: u64,
    bytes: usize,
    payload: Payload,
    patience: &Patience,
) -> std::io::Result<u64> {
    let ticket = tx.post();
    Frame { tag, bytes: bytes as u64, payload }.write(tx, patience)?;
    Ok(ticket)
}
