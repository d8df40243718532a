//! How ranks on different hosts reach each other: one TCP connection per pair.
//!
//! Inside a host, ranks share memory (`shm.rs`). Between hosts there is only the network:
//! every rank listens on a TCP port of its host, publishes the address in an
//! [`AddressBook`], connects to every lower rank of another host (retrying until that one
//! has published) and accepts one connection from every higher one, exactly like the Unix
//! sockets inside a host (`transport.rs`). The connection then carries the same framed
//! messages a pipe does, each side writing its half of the stream; a peer that exits closes
//! it, which the reader sees as end of file.
//!
//! Each side says who it is (rank, world, the run's secret) and the other checks it; a
//! connection that does not is dropped. Reads hand the payload over in pieces of whole
//! 4-byte words (a ring step adds them into its buffer as they arrive); a write blocks while
//! the peer's receive window is full, so a ring step sends from a helper thread whenever its
//! message could exceed what the kernel's buffers surely hold (`INLINE_BYTES`).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shm::Patience;

/// Messages up to this size are written before the step receives: they fit in the
/// smallest send buffer Linux gives a socket (4,608 bytes), so the write cannot wait on a
/// peer that is itself writing. Longer ones go from a helper thread.
pub const INLINE_BYTES: usize = 4 << 10;
/// Bytes read from the socket at a time.
const PIECE_BYTES: usize = 256 << 10;

/// Where the ranks of a run publish the TCP address each listens on, and look up the
/// others'. The ranks of one machine (processes, threads of a test, network namespaces)
/// share a directory ([`AddressFiles`]).
pub trait AddressBook: Sync {
    fn publish(&self, rank: usize, address: SocketAddr) -> std::io::Result<()>;
    /// The rank's address, or None while it has not published one.
    fn lookup(&self, rank: usize) -> std::io::Result<Option<SocketAddr>>;
}

/// An address book in a directory: `rank-R.addr`, written whole (a temporary file renamed).
pub struct AddressFiles {
    pub dir: PathBuf,
}

impl AddressBook for AddressFiles {
    fn publish(&self, rank: usize, address: SocketAddr) -> std::io::Result<()> {
        let path = self.dir.join(format!("rank-{rank}.addr"));
        let temporary = self.dir.join(format!("rank-{rank}.addr.tmp"));
        std::fs::write(&temporary, address.to_string())?;
        std::fs::rename(temporary, path)
    }

    fn lookup(&self, rank: usize) -> std::io::Result<Option<SocketAddr>> {
        match std::fs::read_to_string(self.dir.join(format!("rank-{rank}.addr"))) {
            Ok(text) => text.trim().parse().map(Some).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("rank {rank}'s address: {e}"))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// How a rank introduces itself to a rank of another host, and how that one answers: its
/// rank, the world, and the run's secret (which only the run's ranks know: a connection
/// from anything else is dropped, and a rank never talks to another run's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub rank: u32,
    pub world: u32,
    pub secret: [u8; 16],
}

impl Hello {
    const BYTES: usize = 24;

    fn to_bytes(self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..4].copy_from_slice(&self.rank.to_le_bytes());
        out[4..8].copy_from_slice(&self.world.to_le_bytes());
        out[8..].copy_from_slice(&self.secret);
        out
    }

    fn read(stream: &TcpStream, wait: Duration) -> std::io::Result<Hello> {
        stream.set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
        let mut bytes = [0u8; Self::BYTES];
        (&*stream).read_exact(&mut bytes)?;
        let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        Ok(Hello { rank: word(0), world: word(4), secret: bytes[8..].try_into().expect("16 bytes") })
    }
}

/// How long a connection may take to say who it is before it is dropped.
const HELLO_WAIT: Duration = Duration::from_secs(2);

/// The listening side of this rank, bound before any peer looks it up.
pub struct Listening {
    listener: TcpListener,
}

impl Listening {
    /// Listens on a free port of `ip` and publishes the address.
    pub fn publish(ip: IpAddr, rank: usize, book: &dyn AddressBook) -> std::io::Result<Listening> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
        book.publish(rank, listener.local_addr()?)?;
        listener.set_nonblocking(true)?;
        Ok(Listening { listener })
    }

    /// The next peer's connection, once it has said who it is and `expected` takes its
    /// hello (which is then answered with `mine`); None when nobody (acceptable) has
    /// connected. A connection with a wrong or missing hello is dropped: a stray client
    /// cannot take a rank's place nor end the rendezvous.
    pub fn accept(
        &self,
        mine: Hello,
        expected: impl Fn(&Hello) -> bool,
    ) -> std::io::Result<Option<(TcpStream, Hello)>> {
        let stream = match self.listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        };
        stream.set_nonblocking(false)?;
        match Hello::read(&stream, HELLO_WAIT) {
            Ok(theirs) if theirs.secret == mine.secret && expected(&theirs) => {
                (&stream).write_all(&mine.to_bytes())?;
                Ok(Some((stream, theirs)))
            }
            _ => Ok(None),
        }
    }
}

/// Connects to `peer` once it has published its address (by `deadline`), saying `mine`;
/// the peer must answer as rank `peer` of this run.
pub fn connect(
    book: &dyn AddressBook,
    peer: usize,
    mine: Hello,
    deadline: Instant,
) -> std::io::Result<Option<TcpStream>> {
    loop {
        if let Some(address) = book.lookup(peer)? {
            if let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_secs(1)) {
                stream.write_all(&mine.to_bytes())?;
                let left = deadline.saturating_duration_since(Instant::now());
                let theirs = Hello::read(&stream, left.max(HELLO_WAIT))?;
                if theirs != (Hello { rank: peer as u32, ..mine }) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "rank {peer}'s address answered as another rank or run ({} of {})",
                            theirs.rank, theirs.world
                        ),
                    ));
                }
                return Ok(Some(stream));
            }
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sets a connection up for messages: no Nagle delay (a ring step's last piece goes out at
/// once) and no read timeout (each read sets its own).
pub fn configure(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(None)
}

/// This rank's half of a connection: it writes. Clones share the stream (only one may be
/// used at a time).
#[derive(Clone)]
pub struct TcpSender {
    pub stream: Arc<TcpStream>,
}

impl TcpSender {
    /// Writes all of `bytes`, waiting at most `patience.timeout` whenever the peer's window
    /// is full.
    pub fn write_all(&mut self, bytes: &[u8], patience: &Patience) -> std::io::Result<()> {
        self.stream.set_write_timeout(Some(patience.timeout))?;
        (&*self.stream).write_all(bytes).map_err(timed_out)
    }
}

/// The peer's half of a connection: this rank reads. Clones share the stream.
#[derive(Clone)]
pub struct TcpReceiver {
    pub stream: Arc<TcpStream>,
    buffer: Vec<u8>,
}

impl TcpReceiver {
    pub fn new(stream: Arc<TcpStream>) -> Self {
        TcpReceiver { stream, buffer: Vec::new() }
    }

    /// Reads the next `len` bytes, handing them to `consume` in pieces of at most
    /// `PIECE_BYTES` (each a multiple of 4 bytes when `len` is).
    pub fn read_with(
        &mut self,
        len: usize,
        patience: &Patience,
        mut consume: impl FnMut(&[u8]),
    ) -> std::io::Result<()> {
        self.stream.set_read_timeout(Some(patience.timeout))?;
        self.buffer.resize(PIECE_BYTES.min(len), 0);
        let mut left = len;
        while left > 0 {
            let piece = &mut self.buffer[..left.min(PIECE_BYTES)];
            (&*self.stream).read_exact(piece).map_err(timed_out)?;
            consume(piece);
            left -= piece.len();
        }
        Ok(())
    }

    pub fn read_exact(&mut self, out: &mut [u8], patience: &Patience) -> std::io::Result<()> {
        self.stream.set_read_timeout(Some(patience.timeout))?;
        (&*self.stream).read_exact(out).map_err(timed_out)
    }
}

/// A socket timeout reads as WouldBlock on Linux: call it what it is.
fn timed_out(e: std::io::Error) -> std::io::Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock => {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "no progress from the peer")
        }
        std::io::ErrorKind::UnexpectedEof => {
            std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the peer closed the connection")
        }
        _ => e,
    }
}
