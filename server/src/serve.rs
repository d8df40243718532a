//! Running the server: [`serve`] opens the database, binds, prints
//! `distlab is ready at http://ADDR/`, starts the lease reaper and the local workers, and
//! serves until ctrl-c or SIGTERM.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, SystemTime};

use distlab_common::AuthMode;

use crate::api::study::{cards, quiz};
use crate::config::{ServeError, ServerConfig};
use crate::local_workers::{self, LocalWorkers};
use crate::routes::app;
use crate::store::accounts;
use crate::{listen, AppState};

/// The URL a browser or local worker on this machine uses for a bound address.
pub fn local_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/", SocketAddr::new(ip, addr.port()))
}

/// Runs the server until ctrl-c or SIGTERM: opens the database, binds `config.addr`, prints
/// `distlab is ready at http://ADDR/` on stdout, starts the reaper and the local workers, and
/// stops the workers on the way out.
pub async fn serve(config: ServerConfig) -> Result<(), ServeError> {
    config.validate()?;
    cards::deck().map_err(ServeError::Config)?;
    quiz::quiz().map_err(ServeError::Config)?;
    let state = AppState::new(config.clone()).await?;
    if config.auth == AuthMode::Accounts && accounts::list(&state.db).await.is_ok_and(|users| users.is_empty()) {
        tracing::warn!(
            "--auth accounts, but there are no accounts yet: create one with `distlab-server user add NAME --admin` \
             (same --data-dir)"
        );
    }
    let descriptors = listen::raise_descriptor_limit();
    let limits = listen::ConnectionLimits::for_descriptors(descriptors, config.header_timeout);
    tracing::info!(descriptors, max_connections = limits.max_connections, "connection limits");
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| ServeError::Bind { addr: config.addr, source })?;
    let bound = listener.local_addr()?;
    let url = local_url(bound);
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "distlab is ready at {url}")?;
        if bound.ip().is_unspecified() {
            writeln!(out, "(listening on {bound}: every network interface)")?;
        }
        out.flush()?;
    }
    tracing::info!(%bound, data_dir = %config.data_dir.display(), static_dir = %config.static_dir.display(), "serving");

    let reaper = tokio::spawn(reap_forever(state.clone()));
    let worker_bin = config.worker_bin.clone().or_else(local_workers::default_worker_bin);
    let workers = match worker_bin {
        Some(bin) => {
            let server = url.trim_end_matches('/');
            LocalWorkers::spawn(&bin, config.local_workers, server, &config.worker_token, &config.data_dir)
        }
        None if config.local_workers > 0 => {
            tracing::error!("cannot find the worker executable; pass --worker-bin");
            LocalWorkers::none()
        }
        None => LocalWorkers::none(),
    };

    let (stopping_tx, mut stopping_rx) = tokio::sync::watch::channel(false);
    let hub = state.hub.clone();
    let server = listen::serve(listener, app(state), limits, async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        hub.shut_down();
        stopping_tx.send_replace(true);
    });
    // Open requests get a few seconds to finish after the signal.
    let deadline = async move {
        let _ = stopping_rx.wait_for(|s| *s).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    tokio::select! {
        () = server => {}
        _ = deadline => tracing::warn!("requests still open after 5 s; stopping anyway"),
    };
    reaper.abort();
    workers.stop().await;
    Ok(())
}

async fn reap_forever(state: AppState) {
    let mut tick = tokio::time::interval(state.config.reap_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = state.reap_expired(SystemTime::now()).await {
            tracing::error!("lease reaper: {e}");
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for ctrl-c: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}
