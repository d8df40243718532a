//! The load's connections, as `wrk` makes them: every connection kept alive on ONE thread
//! (a tokio task each), sending its request again as soon as the answer is in. A thread
//! per connection would measure the generator instead: 64 threads on 2 cores wait tens of
//! milliseconds for their turn after their answer has arrived, and the p99 is theirs.
//!
//! HTTP/1.1 by hand, as little of it as the server's answers need: a status line, headers,
//! and a body of `Content-Length` bytes (no request asks for compression or gets chunks).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What `connections` connections measured sending `request` back to back.
pub struct Timed {
    /// The time of every answer that was a 2xx, sorted.
    pub latencies: Vec<Duration>,
    /// Answers that were not a 2xx, and connections that broke (each counted once).
    pub failed: usize,
    pub elapsed: Duration,
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
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let mut streams = Vec::with_capacity(connections);
        for _ in 0..connections {
            let stream = TcpStream::connect(addr).await.with_context(|| format!("connect to {addr}"))?;
            stream.set_nodelay(true)?;
            streams.push(stream);
        }
        let began = Instant::now();
        let until = began + duration;
        let tasks: Vec<_> = streams
            .into_iter()
            .map(|stream| {
                let request = request.to_vec();
                tokio::spawn(async move { connection(stream, &request, until, max_per_connection).await })
            })
            .collect();
        let mut timed = Timed { latencies: Vec::new(), failed: 0, elapsed: Duration::ZERO };
        for task in tasks {
            let (latencies, failed) = task.await.context("a load connection's task")?;
            timed.latencies.extend(latencies);
            timed.failed += failed;
        }
        timed.elapsed = began.elapsed();
        timed.latencies.sort();
        Ok(timed)
    })
}

/// One connection's requests until `until`: the latencies of its 2xx answers, and how many
/// failed.
async fn connection(mut stream: TcpStream, request: &[u8], until: Instant, max: usize) -> (Vec<Duration>, usize) {
    let (mut latencies, mut failed) = (Vec::new(), 0);
    let mut buffer = Vec::with_capacity(1 << 16);
    while Instant::now() < until && latencies.len() + failed < max {
        let sent = Instant::now();
        let status = async {
            stream.write_all(request).await?;
            answer(&mut stream, &mut buffer).await
        };
        match status.await {
            Ok(status) if (200..300).contains(&status) => latencies.push(sent.elapsed()),
            Ok(_) => failed += 1,
            Err(_) => {
                // (a broken connection ends this connection's share)
                failed += 1;
                break;
            }
        }
    }
    (latencies, failed)
}

/// Reads one answer off `stream` (its bytes left in `buffer`, which is reused); its status.
async fn answer(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Result<u16> {
    buffer.clear();
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if buffer.len() > 64 << 10 {
            bail!("an answer's head longer than 64 KiB");
        }
        read_more(stream, buffer).await?;
    };
    let head = std::str::from_utf8(&buffer[..head_end]).context("an answer's head is not text")?;
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
    while buffer.len() < total {
        read_more(stream, buffer).await?;
    }
    if buffer.len() > total {
        bail!("bytes after the answer: the server answered what was not asked");
    }
    Ok(status)
}

async fn read_more(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Result<()> {
    buffer.reserve(1 << 15);
    if stream.read_buf(buffer).await? == 0 {
        bail!("the server closed the connection");
    }
    Ok(())
}
