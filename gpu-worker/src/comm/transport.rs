//! How rank processes reach each other: per pair of ranks on one host, one Unix domain
//! socket and two shared-memory pipes (`shm.rs`), one each way; per pair on different
//! hosts, one TCP connection (`tcp.rs`).
//!
//! Rendezvous: every rank listens on `DIR/rank-R.sock`, connects to every lower rank of its
//! host (saying who it is), and accepts one connection from every higher one. Over each
//! socket the two ranks then hand each other the memfd of the pipe they will write into,
//! their process ids, and whether each can read the other's memory (`cma.rs`). Data moves
//! through the pipes; the socket stays open so that each side notices when the other
//! process exits (the kernel closes it). Ranks of other hosts meet the same way over TCP,
//! through the addresses they publish (`Hosts`), and the connection carries the data.
//!
//! Messages are framed: a 24-byte header (tag, payload bytes, where the payload is) so a
//! rank that runs a different collective than its peer is caught instead of misread. The
//! payload either follows in the pipe or, when posted, stays in the sender's memory at the
//! address the header gives, for the receiver to copy out.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::{IpAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

use super::cma;
use super::shm::{self, Patience, PipeReader, PipeWriter};
use super::tcp::{self, AddressBook, Listening, TcpReceiver, TcpSender};

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

/// Which host each rank of a run is on, and how ranks of different hosts find each other.
pub struct Hosts<'a> {
    /// `of[r]`: the host rank r runs on (equal numbers, one host).
    pub of: Vec<usize>,
    /// The address of this rank's host that the other hosts reach it on.
    pub ip: IpAddr,
    pub book: &'a dyn AddressBook,
    /// Known only to the run's ranks: every TCP connection proves it.
    pub secret: [u8; 16],
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
    /// Connects this rank to all others, every one on this host, through sockets in `dir`
    /// (shared by all ranks).
    pub fn connect(dir: &Path, rank: usize, world: usize, timeout: Duration) -> Result<Mesh, RendezvousError> {
        Self::connect_hosts(dir, rank, world, None, timeout)
    }

    /// Connects this rank to all others: those of its host through sockets in `dir`, those
    /// of other hosts (`hosts`) over TCP.
    pub fn connect_hosts(
        dir: &Path,
        rank: usize,
        world: usize,
        hosts: Option<&Hosts>,
        timeout: Duration,
    ) -> Result<Mesh, RendezvousError> {
        let mut sockets: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(Mesh { rank, world, links: (0..world).map(|_| None).collect() });
        }
        if let Some(h) = hosts.filter(|h| h.of.len() != world) {
            let source = std::io::Error::other(format!("{} hosts given for a world of {world}", h.of.len()));
            return Err(RendezvousError::Io { rank, peer: rank, source });
        }
        let here = |peer: usize| hosts.is_none_or(|h| h.of[peer] == h.of[rank]);
        let deadline = Instant::now() + timeout;
        // Listening for the other hosts first, so that their lookups succeed early.
        let listening = match hosts.filter(|_| (0..world).any(|p| !here(p))) {
            Some(h) => Some(Listening::publish(h.ip, rank, h.book).map_err(|source| RendezvousError::Io {
                rank,
                peer: rank,
                source,
            })?),
            None => None,
        };
        let path = socket_path(dir, rank);
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).map_err(|source| RendezvousError::Listen { rank, path: path.clone(), source })?;

        // Connect to every lower rank of this host (retrying until it listens), introducing
        // ourselves.
        for (peer, slot) in sockets.iter_mut().enumerate().take(rank).filter(|(p, _)| here(*p)) {
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

        // Accept one connection from every higher rank of this host.
        listener.set_nonblocking(true).map_err(|source| RendezvousError::Io { rank, peer: rank, source })?;
        let mut missing = (rank + 1..world).filter(|&p| here(p)).count();
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
                    if their_world as usize != world
                        || peer <= rank
                        || peer >= world
                        || !here(peer)
                        || sockets[peer].is_some()
                    {
                        return Err(RendezvousError::BadHello { rank, claimed, world: their_world });
                    }
                    sockets[peer] = Some(s);
                    missing -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let peer = (rank + 1..world).find(|&p| here(p) && sockets[p].is_none()).unwrap_or(rank);
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
            links[peer] = Some(Link {
                peer,
                socket: LinkSocket::Unix(socket),
                tx: Sender::Pipe(tx),
                rx: Receiver::Pipe(rx),
                peer_pid,
                may_post: peer_reads_us[0] == 1,
            });
        }
        if let (Some(hosts), Some(listening)) = (hosts, listening) {
            for (peer, stream) in connect_other_hosts(hosts, &listening, rank, world, deadline, timeout)? {
                let stream = Arc::new(stream);
                links[peer] = Some(Link {
                    peer,
                    socket: LinkSocket::Tcp(stream.clone()),
                    tx: Sender::Tcp(TcpSender { stream: stream.clone() }),
                    rx: Receiver::Tcp(TcpReceiver::new(stream)),
                    peer_pid: 0,
                    may_post: false,
                });
            }
        }
        Ok(Mesh { rank, world, links })
    }

    /// Whether rank `peer` is on this rank's host (its messages may use shared memory).
    pub fn same_host(&self, peer: usize) -> bool {
        self.links[peer].as_ref().is_none_or(|l| matches!(l.tx, Sender::Pipe(_)))
    }

    /// Bytes of the shared-memory pipes this rank maps: one each way per peer of its host.
    pub fn pipe_bytes(&self) -> u64 {
        (self.links.iter().flatten().filter(|l| matches!(l.tx, Sender::Pipe(_))).count() * 2 * shm::MAP_BYTES) as u64
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

/// The TCP connections to every rank of another host: connects to the lower ones (once
/// they have published an address), accepts the higher ones; each side says who it is.
fn connect_other_hosts(
    hosts: &Hosts,
    listening: &Listening,
    rank: usize,
    world: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<(usize, TcpStream)>, RendezvousError> {
    let elsewhere = |p: usize| hosts.of[p] != hosts.of[rank];
    let mine = tcp::Hello { rank: rank as u32, world: world as u32, secret: hosts.secret };
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for peer in (0..rank).filter(|&p| elsewhere(p)) {
        let io = |source| RendezvousError::Io { rank, peer, source };
        let stream = tcp::connect(hosts.book, peer, mine, deadline).map_err(io)?;
        let stream = stream.ok_or(RendezvousError::Timeout { rank, peer, waited_s: timeout.as_secs_f64() })?;
        streams[peer] = Some(stream);
    }
    let mut missing = (rank + 1..world).filter(|&p| elsewhere(p)).count();
    while missing > 0 {
        // A higher rank of another host, not yet connected.
        let expected = |h: &tcp::Hello| {
            let peer = h.rank as usize;
            h.world as usize == world && peer > rank && peer < world && elsewhere(peer) && streams[peer].is_none()
        };
        let accepted =
            listening.accept(mine, expected).map_err(|source| RendezvousError::Io { rank, peer: rank, source })?;
        let Some((stream, theirs)) = accepted else {
            if Instant::now() >= deadline {
                let peer = (rank + 1..world).find(|&p| elsewhere(p) && streams[p].is_none()).unwrap_or(rank);
                return Err(RendezvousError::Timeout { rank, peer, waited_s: timeout.as_secs_f64() });
            }
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        streams[theirs.rank as usize] = Some(stream);
        missing -= 1;
    }
    let mut out = Vec::new();
    for (peer, stream) in streams.into_iter().enumerate() {
        if let Some(stream) = stream {
            tcp::configure(&stream).map_err(|source| RendezvousError::Io { rank, peer, source })?;
            out.push((peer, stream));
        }
    }
    Ok(out)
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

/// The connection to one peer: what carries messages both ways, and the socket that tells
/// whether the peer process is alive.
pub struct Link {
    /// The peer's global rank.
    pub peer: usize,
    pub socket: LinkSocket,
    pub tx: Sender,
    pub rx: Receiver,
    /// The peer's process id, to copy posted messages out of its memory (same host).
    pub peer_pid: i32,
    /// Whether the peer can copy out of this rank's memory, so messages to it may be posted.
    pub may_post: bool,
}

impl Link {
    pub fn patience(&self, timeout: Duration) -> Patience<'_> {
        Patience { timeout, peer: self.socket.as_fd() }
    }
}

/// The socket to a peer: a Unix socket on this host (it also carries file descriptors), or
/// the TCP connection to another host's rank (which carries the data too).
pub enum LinkSocket {
    Unix(UnixStream),
    Tcp(Arc<TcpStream>),
}

impl LinkSocket {
    pub fn try_clone(&self) -> std::io::Result<LinkSocket> {
        Ok(match self {
            LinkSocket::Unix(s) => LinkSocket::Unix(s.try_clone()?),
            LinkSocket::Tcp(s) => LinkSocket::Tcp(s.clone()),
        })
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            LinkSocket::Unix(s) => s.as_fd(),
            LinkSocket::Tcp(s) => s.as_fd(),
        }
    }

    /// The Unix socket, through which ranks of one host share memory.
    pub fn unix(&self) -> Option<&UnixStream> {
        match self {
            LinkSocket::Unix(s) => Some(s),
            LinkSocket::Tcp(_) => None,
        }
    }
}

/// Where a rank writes its messages to one peer. Clones share the stream (only one may be
/// used at a time).
#[derive(Clone)]
pub enum Sender {
    /// A shared-memory pipe to a rank of this host.
    Pipe(PipeWriter),
    /// A TCP connection to a rank of another host.
    Tcp(TcpSender),
}

impl Sender {
    pub fn write_all(&mut self, bytes: &[u8], patience: &Patience) -> std::io::Result<()> {
        match self {
            Sender::Pipe(pipe) => pipe.write_all(bytes, patience),
            Sender::Tcp(tcp) => tcp.write_all(bytes, patience),
        }
    }

    /// The longest message that may be written whole before the writer receives: it fits
    /// in what lies between the two ranks (the pipe, or the kernel's socket buffers).
    pub fn inline_bytes(&self) -> usize {
        match self {
            Sender::Pipe(_) => shm::CAPACITY / 2,
            Sender::Tcp(_) => tcp::INLINE_BYTES,
        }
    }
}

/// Where a rank reads one peer's messages. Clones share the stream.
#[derive(Clone)]
pub enum Receiver {
    Pipe(PipeReader),
    Tcp(TcpReceiver),
}

impl Receiver {
    /// Consumes the next `len` bytes, handing them to `consume` in pieces (each a multiple
    /// of 4 bytes when `len` is).
    pub fn read_with(&mut self, len: usize, patience: &Patience, consume: impl FnMut(&[u8])) -> std::io::Result<()> {
        match self {
            Receiver::Pipe(pipe) => pipe.read_with(len, patience, consume),
            Receiver::Tcp(tcp) => tcp.read_with(len, patience, consume),
        }
    }

    pub fn read_exact(&mut self, out: &mut [u8], patience: &Patience) -> std::io::Result<()> {
        match self {
            Receiver::Pipe(pipe) => pipe.read_exact(out, patience),
            Receiver::Tcp(tcp) => tcp.read_exact(out, patience),
        }
    }

    /// The pipe, for messages whose payload was left in the sender's memory (same host).
    pub fn pipe(&mut self) -> Option<&mut PipeReader> {
        match self {
            Receiver::Pipe(pipe) => Some(pipe),
            Receiver::Tcp(_) => None,
        }
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

    /// The header's bytes, as they cross the wire.
    fn header(&self) -> [u8; Self::BYTES] {
        let (kind, place) = match self.payload {
            Payload::Inline => (0, 0),
            Payload::Posted { address } => (1, address),
            Payload::Shared { buffer, offset } => (2 + buffer as u64, offset),
        };
        let mut header = [0u8; Self::BYTES];
        for (i, word) in [self.tag, self.bytes, kind, place].into_iter().enumerate() {
            header[8 * i..8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
        header
    }

    /// Reads the next frame's header.
    pub fn read(rx: &mut Receiver, patience: &Patience) -> std::io::Result<Frame> {
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
pub fn send_frame(tx: &mut Sender, tag: u64, payload: &[u8], patience: &Patience) -> std::io::Result<()> {
    tx.write_all(&Frame { tag, bytes: payload.len() as u64, payload: Payload::Inline }.header(), patience)?;
    tx.write_all(payload, patience)
}

/// Writes only the header of a message whose payload the receiver, a rank of this host,
/// copies out of this process (`Posted` or `Shared`); returns the ticket to wait on
/// (`PipeWriter::wait_taken`) before the payload may change or go away.
pub fn post_frame(
    pipe: &mut PipeWriter,
    tag: u64,
    bytes: usize,
    payload: Payload,
    patience: &Patience,
) -> std::io::Result<u64> {
    let ticket = pipe.post();
    pipe.write_all(&Frame { tag, bytes: bytes as u64, payload }.header(), patience)?;
    Ok(ticket)
}
