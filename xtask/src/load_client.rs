//! The load's connections, as `wrk` makes them: every connection kept alive on ONE thread
//! (non-blocking sockets under `poll(2)`), sending its request again as soon as the answer
//! is in. A thread per connection would measure the generator instead: 64 threads on 2
//! cores wait tens of milliseconds for their turn after their answer has arrived, and the
//! p99 is theirs.
//!
//! HTTP/1.1 by hand, as little of it as the server's answers need: a status line, headers,
//! and a body of `Content-Length` bytes (no request asks for compression or gets chunks).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// What `connections` connections measured sending one request back to back.
pub struct Timed {
    /// The time of every answer that was a 2xx, sorted.
    pub latencies: Vec<Duration>,
    /// Answers that were not a 2xx, and connections that broke (each counted once).
    pub failed: usize,
    pub elapsed: Duration,
}

/// How long the requests still in flight when the time is up may take to finish.
const LAST_ANSWERS: Duration = Duration::from_secs(30);

/// One connection: the request being written, then its answer being read.
struct Connection {
    stream: TcpStream,
    written: usize,
    /// The answer's bytes so far are `answer[..filled]` (the rest is room, zeroed once).
    answer: Vec<u8>,
    filled: usize,
    sent_at: Instant,
    requests: usize,
    /// No more requests (its share is done, or it broke).
    finished: bool,
}

/// `connections` connections to `addr` send `request` (the whole request, as bytes) back
/// to back for `duration`, each at most `max_per_connection` times.
pub fn run(
    addr: SocketAddr,
    request: &[u8],
    connections: usize,
    duration: Duration,
    max_per_connection: usize,
) -> Result<Timed> {
    let mut all = Vec::with_capacity(connections);
    for _ in 0..connections {
        let stream = TcpStream::connect(addr).with_context(|| format!("connect to {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        all.push(Connection {
            stream,
            written: 0,
            answer: vec![0; 1 << 17],
            filled: 0,
            sent_at: Instant::now(),
            requests: 0,
            finished: false,
        });
    }
    let mut timed = Timed { latencies: Vec::new(), failed: 0, elapsed: Duration::ZERO };
    let began = Instant::now();
    let until = began + duration;
    for c in &mut all {
        c.sent_at = began;
    }
    let mut polled: Vec<libc::pollfd> = Vec::with_capacity(connections);
    loop {
        polled.clear();
        for c in all.iter().filter(|c| !c.finished) {
            let events = if c.written < request.len() { libc::POLLOUT } else { libc::POLLIN };
            polled.push(libc::pollfd { fd: c.stream.as_raw_fd(), events, revents: 0 });
        }
        if polled.is_empty() {
            break;
        }
        if Instant::now() > until + LAST_ANSWERS {
            // (answers that never came)
            timed.failed += polled.len();
            break;
        }
        // SAFETY: `polled` is a live array of `polled.len()` pollfds.
        let ready = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 100) };
        if ready < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(error).context("poll");
        }
        let mut ready_fds = polled.iter().filter(|p| p.revents != 0).map(|p| p.fd).peekable();
        for c in all.iter_mut().filter(|c| !c.finished) {
            if ready_fds.peek() != Some(&c.stream.as_raw_fd()) {
                continue;
            }
            ready_fds.next();
            match step(c, request) {
                Ok(None) => {}
                Ok(Some(status)) => {
                    if (200..300).contains(&status) {
                        timed.latencies.push(c.sent_at.elapsed());
                    } else {
                        timed.failed += 1;
                    }
                    c.requests += 1;
                    c.filled = 0;
                    c.written = 0;
                    c.sent_at = Instant::now();
                    c.finished = c.sent_at >= until || c.requests >= max_per_connection;
                }
                Err(_) => {
                    timed.failed += 1;
                    c.finished = true;
                }
            }
        }
    }
    timed.elapsed = began.elapsed();
    timed.latencies.sort();
    Ok(timed)
}

/// Moves connection `c` on as far as its socket allows: the status once its answer is all in.
fn step(c: &mut Connection, request: &[u8]) -> Result<Option<u16>> {
    while c.written < request.len() {
        match c.stream.write(&request[c.written..]) {
            Ok(0) => bail!("the server stopped reading"),
            Ok(n) => c.written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    }
    loop {
        if c.filled == c.answer.len() {
            c.answer.resize(2 * c.answer.len(), 0);
        }
        match c.stream.read(&mut c.answer[c.filled..]) {
            Ok(0) => bail!("the server closed the connection"),
            Ok(n) => {
                c.filled += n;
                if let Some(status) = complete_answer(&c.answer[..c.filled])? {
                    return Ok(Some(status));
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    }
}

/// The status of the answer in `bytes` once all of it is there (None before).
fn complete_answer(bytes: &[u8]) -> Result<Option<u16>> {
    let Some(head_end) = bytes.windows(4).position(|w| w == b"\r\n\r\n").map(|at| at + 4) else {
        if bytes.len() > 64 << 10 {
            bail!("an answer's head longer than 64 KiB");
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&bytes[..head_end]).context("an answer's head is not text")?;
    let status: u16 = head.get(9..12).and_then(|s| s.parse().ok()).context("no status line")?;
    let mut length = None;
    for line in head.split("\r\n").skip(1) {
        let Some((name, value)) = line.split_once(':') else { continue };
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.trim().parse::<usize>().context("Content-Length")?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            bail!("a chunked answer (this client reads Content-Length bodies only)");
        }
    }
    let total = head_end + length.context("an answer without Content-Length")?;
    match bytes.len().cmp(&total) {
        std::cmp::Ordering::Less => Ok(None),
        std::cmp::Ordering::Equal => Ok(Some(status)),
        std::cmp::Ordering::Greater => bail!("bytes after the answer: the server answered what was not asked"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_complete_with_its_content_length() {
        let answer = b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\n\r\nhello";
        for cut in 0..answer.len() {
            assert_eq!(complete_answer(&answer[..cut]).unwrap(), None, "{cut} bytes");
        }
        assert_eq!(complete_answer(answer).unwrap(), Some(201));
        assert!(complete_answer(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nab").is_err());
        assert!(complete_answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").is_err());
        assert!(complete_answer(b"HTTP/1.1 200 OK\r\n\r\n").is_err());
    }
}
