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
//! Reads hand the payload over in pieces of whole 4-byte words (a ring step adds them into
//! its buffer as they arrive); a write blocks while the peer's receive window is full, so a
//! ring step sends from a helper thread whenever its message could exceed what the kernel's
//! buffers hold (`INLINE_BYTES`).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shm::Patience;

/// Messages up to this size are written before the step receives (they fit in the
/// kernel's socket buffers on both sides, so the write cannot wait on the peer).
pub const INLINE_BYTES: usize = 32 << 10;
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

    /// The next peer's connection and the hello it sent (its rank and world), or None when
    /// nobody has connected yet.
    pub fn accept(&self, timeout: Duration) -> std::io::Result<Option<(TcpStream, [u8; 8])>> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(timeout))?;
                let mut hello = [0u8; 8];
                (&stream).read_exact(&mut hello)?;
                Ok(Some((stream, hello)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Connects to `peer` once it has published its address (by `deadline`), saying `hello`.
pub fn connect(
    book: &dyn AddressBook,
    peer: usize,
    hello: [u8; 8],
    deadline: Instant,
) -> std::io::Result<Option<TcpStream>> {
    loop {
        if let Some(address) = book.lookup(peer)? {
            if let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_secs(1)) {
                stream.write_all(&hello)?;
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
