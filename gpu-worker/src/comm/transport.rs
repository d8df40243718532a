//! How rank processes reach each other: one Unix domain socket per pair of ranks.
//!
//! Rendezvous: every rank listens on `DIR/rank-R.sock`, connects to every lower rank
//! (saying who it is), and accepts one connection from every higher rank. Each connection
//! is full duplex; a rank keeps one handle for sending and one for receiving so that a
//! collective step can send to its right neighbour while it receives from its left one.
//!
//! Messages are framed: a 16-byte header (tag, payload bytes) then the payload, so a
//! rank that runs a different collective than its peer is caught instead of misread.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Socket buffers large enough that a ring step's pieces stream without stalls.
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

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
    /// `senders[p]` / `receivers[p]`: the two handles of the socket to rank p (None for self).
    senders: Vec<Option<UnixStream>>,
    receivers: Vec<Option<UnixStream>>,
}

pub fn socket_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

impl Mesh {
    /// Connects this rank to all others through sockets in `dir` (shared by all ranks).
    pub fn connect(dir: &Path, rank: usize, world: usize, timeout: Duration) -> Result<Mesh, RendezvousError> {
        let mut senders: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
        let mut receivers: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(Mesh { rank, world, senders, receivers });
        }
        let path = socket_path(dir, rank);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(|source| RendezvousError::Listen { rank, path: path.clone(), source })?;
        let deadline = Instant::now() + timeout;

        // Connect to every lower rank (retrying until it listens), introducing ourselves.
        for peer in 0..rank {
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
            let (tx, rx) = split(s).map_err(io)?;
            senders[peer] = Some(tx);
            receivers[peer] = Some(rx);
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
                    if their_world as usize != world || peer <= rank || peer >= world || senders[peer].is_some() {
                        return Err(RendezvousError::BadHello { rank, claimed, world: their_world });
                    }
                    let (tx, rx) = split(s).map_err(|source| RendezvousError::Io { rank, peer, source })?;
                    senders[peer] = Some(tx);
                    receivers[peer] = Some(rx);
                    missing -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let peer = (rank + 1..world).find(|&p| senders[p].is_none()).unwrap_or(rank);
                        return Err(RendezvousError::Timeout { rank, peer, waited_s: timeout.as_secs_f64() });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(source) => return Err(RendezvousError::Io { rank, peer: rank, source }),
            }
        }
        let _ = std::fs::remove_file(&path);
        Ok(Mesh { rank, world, senders, receivers })
    }

    /// Handles to the given peers for a group's own use (the sockets are shared: two groups
    /// with a common pair of ranks must not run collectives at the same time).
    pub fn links(&self, peers: &[usize]) -> std::io::Result<Vec<Option<Link>>> {
        peers
            .iter()
            .map(|&p| match (&self.senders[p], &self.receivers[p]) {
                (Some(tx), Some(rx)) => Ok(Some(Link { peer: p, tx: tx.try_clone()?, rx: rx.try_clone()? })),
                _ => Ok(None),
            })
            .collect()
    }
}

fn split(s: UnixStream) -> std::io::Result<(UnixStream, UnixStream)> {
    let sock = socket2::SockRef::from(&s);
    sock.set_send_buffer_size(SOCKET_BUFFER_BYTES)?;
    sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES)?;
    s.set_read_timeout(None)?;
    let rx = s.try_clone()?;
    Ok((s, rx))
}

/// Both directions of the socket to one peer.
pub struct Link {
    /// The peer's global rank.
    pub peer: usize,
    pub tx: UnixStream,
    pub rx: UnixStream,
}

/// Writes one framed message: header (tag, payload length) then the payload.
pub fn send_frame(tx: &mut UnixStream, tag: u64, payload: &[u8]) -> std::io::Result<()> {
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&tag.to_le_bytes());
    header[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    tx.write_all(&header)?;
    tx.write_all(payload)
}

/// Reads a frame header: (tag, payload length).
pub fn recv_header(rx: &mut UnixStream) -> std::io::Result<(u64, u64)> {
    let mut header = [0u8; 16];
    rx.read_exact(&mut header)?;
    Ok((
        u64::from_le_bytes(header[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(header[8..].try_into().expect("8 bytes")),
    ))
}
