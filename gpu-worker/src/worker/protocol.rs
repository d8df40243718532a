//! What the launcher and its rank processes say to each other: the rank's messages on
//! its stdout (one JSON line each), and the run's secret handed over in the environment.
//! `launch.rs` (the launcher's side) and `rank.rs` (the rank's) both import it.

use serde::{Deserialize, Serialize};

/// What a rank process reports to the launcher (one JSON object per stdout line).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RankMessage {
    /// Anything for the experiment's event stream (metrics, logs, traces, summary...).
    Output { payload: serde_json::Value },
    /// The rank is about to exit because of this error. `peer`: the rank it blames (it
    /// stopped answering or hung up), when the error comes from another rank's failure.
    Error { message: String, peer: Option<usize> },
}

/// The environment variable the launcher hands each rank the run's secret in (hex): every
/// TCP connection between hosts proves it. (Not an argument: `ps` shows those to everyone.)
pub const SECRET_VAR: &str = "DISTLAB_RENDEZVOUS_SECRET";

/// 32 hex digits as 16 bytes.
pub fn parse_secret(hex: &str) -> Option<[u8; 16]> {
    let hex = hex.trim();
    if hex.len() != 32 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}
