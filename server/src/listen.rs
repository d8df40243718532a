//! Accepting connections so that slow or idle clients cannot hold the server: each
//! connection has [`ConnectionLimits::header_timeout`] to send a request's headers (and
//! as long again, idle between two requests) before it is closed; at most
//! `max_connections` are open at once, a number kept below the process's descriptor
//! limit, which is raised to its hard limit at start. A connection over the limit is
//! closed at once, never left to wait in the kernel's queue. HTTP/1.1 only: browsers speak
//! nothing else to a server without TLS.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// Descriptors kept for everything but client connections: the database, files being
/// served or written, the local workers' pipes.
const RESERVED_DESCRIPTORS: u64 = 256;
/// Connections at most, whatever the descriptor limit.
const MAX_CONNECTIONS: u64 = 65_536;

#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// How long a connection has to send a request's headers, and may stay idle between
    /// requests.
    pub header_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

impl ConnectionLimits {
    /// The limits for a process whose descriptor limit is `descriptors`.
    pub fn for_descriptors(descriptors: u64, header_timeout: Duration) -> Self {
        let max = descriptors.saturating_sub(RESERVED_DESCRIPTORS).clamp(16, MAX_CONNECTIONS);
        Self { header_timeout, max_connections: usize::try_from(max).unwrap_or(usize::MAX) }
    }
}

/// Raises this process's soft limit of open descriptors to its hard limit; answers the
/// limit in force after.
pub fn raise_descriptor_limit() -> u64 {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit only read and write the struct they are given.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return 1024;
            }
            if limit.rlim_cur < limit.rlim_max {
                let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                    limit = raised;
                }
            }
        }
        limit.rlim_cur
    }
    #[cfg(not(unix))]
    {
        1024
    }
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets each
/// open connection finish the request it is in, and returns when all have closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (closing_tx, closing_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut refused_since_logged = 0u64;
    loop {
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors (or a connection reset before it was taken): wait
                    // a moment rather than spin.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refused_since_logged += 1;
            if refused_since_logged.is_power_of_two() {
                tracing::warn!(
                    max = limits.max_connections,
                    refused = refused_since_logged,
                    "connection limit reached: closing new connections"
                );
            }
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let service = tower::service_fn(move |req: Request<Incoming>| {
            let mut req = req.map(Body::new);
            req.extensions_mut().insert(ConnectInfo(remote));
            app.clone().oneshot(req)
        });
        let mut closing = closing_rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
            let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
            let mut conn = std::pin::pin!(conn);
            let closing = async move {
                let _ = closing.wait_for(|c| *c).await;
            };
            tokio::select! {
                result = conn.as_mut() => log_end(remote, result),
                () = closing => {
                    conn.as_mut().graceful_shutdown();
                    log_end(remote, conn.await);
                }
            }
        });
    }
    drop(listener);
    closing_tx.send_replace(true);
    // Every connection holds a slot until it has closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
}

fn log_end(remote: SocketAddr, result: Result<(), hyper::Error>) {
    if let Err(e) = result {
        tracing::debug!(%remote, "connection ended: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_stay_below_the_descriptor_limit() {
        let l = ConnectionLimits::for_descriptors(1024, Duration::from_secs(10));
        assert_eq!(l.max_connections, 768);
        assert_eq!(ConnectionLimits::for_descriptors(100, Duration::ZERO).max_connections, 16);
        assert_eq!(ConnectionLimits::for_descriptors(u64::MAX, Duration::ZERO).max_connections, 65_536);
    }
}
