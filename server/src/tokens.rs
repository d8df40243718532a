//! Secrets and random tokens: the worker token read from the environment or a file, random
//! hex and tokens (session tokens, worker credentials, ids), and the SHA-256 digest under
//! which a token is stored.

use rand::Rng;
use sha2::{Digest, Sha256};

/// A secret from environment variable `var`, else from the first line of `file`; None when
/// neither gives one. Secrets never come from the command line, which `ps` shows everyone.
pub fn secret_from(var: &str, file: Option<&std::path::Path>) -> std::io::Result<Option<String>> {
    if let Some(value) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
        return Ok(Some(value.trim().to_string()));
    }
    let Some(file) = file else { return Ok(None) };
    let text = std::fs::read_to_string(file)
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot read the token file {}: {e}", file.display())))?;
    Ok(text.lines().next().map(str::trim).filter(|t| !t.is_empty()).map(str::to_string))
}

/// `bytes` random bytes as hex.
pub fn random_hex(bytes: usize) -> String {
    let mut rng = rand::rng();
    (0..bytes).map(|_| format!("{:02x}", rng.random::<u8>())).collect()
}

/// A random 32-character token (for local workers when none is configured).
pub fn random_token() -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = rand::rng();
    (0..32).map(|_| CHARS[rng.random_range(0..CHARS.len())] as char).collect()
}

/// The stored form of a session token (or a worker's credential): its SHA-256 in hex.
pub fn token_digest(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}
