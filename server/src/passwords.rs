//! Passwords: argon2id hashes (PHC strings), computed and checked on a few threads of their
//! own, so that a class signing in at once neither stalls the other requests nor takes every
//! core and the memory with it.

use argon2::password_hash::{PasswordHash, PasswordHasher, SaltString};
use argon2::Argon2;

/// Password hashes computed at once, at most: each holds argon2id's 19 MiB and a core for
/// tens of milliseconds. Others wait their turn (in order); `sign_in_guard` bounds how many
/// may wait.
pub const HASHING_AT_ONCE: usize = 2;

/// A password hash to compute, on one of the hashing threads.
type HashJob = Box<dyn FnOnce() + Send>;

/// The hashing threads' queue: the same [`HASHING_AT_ONCE`] threads check every password
/// of the server's life, each in the argon2 memory it keeps (`ARGON2_MEMORY`).
static HASHERS: std::sync::LazyLock<std::sync::Mutex<std::sync::mpsc::Sender<HashJob>>> =
    std::sync::LazyLock::new(|| {
        let (tx, rx) = std::sync::mpsc::channel::<HashJob>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        for n in 0..HASHING_AT_ONCE {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new().name(format!("password-hasher-{n}")).spawn(move || loop {
                let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                match job {
                    Ok(job) => job(),
                    Err(_) => return,
                }
            });
            if let Err(e) = spawned {
                tracing::error!("cannot start a password-hashing thread: {e}");
            }
        }
        std::sync::Mutex::new(tx)
    });

/// Argon2 takes tens of milliseconds on purpose: it runs on the hashing threads, so that a
/// class signing in at once does not stall every other request, and at most
/// [`HASHING_AT_ONCE`] at a time, so that a flood of sign-ins cannot take every core and
/// the memory with them. A request that gives up before its turn comes costs nothing.
async fn off_the_runtime<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: HashJob = Box::new(move || {
        if !tx.is_closed() {
            let _ = tx.send(work());
        }
    });
    HASHERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(job)
        .map_err(|_| "no password-hashing thread is running".to_string())?;
    rx.await.map_err(|_| "the password-hashing thread stopped".to_string())
}

/// [`hash_password`] off the runtime: the PHC string, or why hashing failed.
pub async fn hash(password: &str) -> Result<String, String> {
    let owned = password.to_string();
    off_the_runtime(move || hash_password(&owned)).await?
}

fn hash_password(password: &str) -> Result<String, String> {
    let salt_bytes: [u8; 16] = rand::random();
    let salt = SaltString::encode_b64(&salt_bytes).map_err(|e| e.to_string())?;
    Argon2::default().hash_password(password.as_bytes(), &salt).map(|h| h.to_string()).map_err(|e| e.to_string())
}

/// Whether `password` is the one `stored` (a PHC string) was made from, checked off the
/// runtime. With no stored hash (an unknown name) the password is still checked, against a
/// fixed hash, so that the time taken does not tell; it never matches.
pub async fn verify(stored: Option<String>, password: &str) -> bool {
    let exists = stored.is_some();
    let hash = stored.unwrap_or_else(|| UNKNOWN_NAME_HASH.clone());
    let password = password.to_string();
    let matches = off_the_runtime(move || password_matches(&hash, &password)).await.unwrap_or(false);
    matches && exists
}

thread_local! {
    /// Argon2's memory on a hashing thread, kept from one password check to the next: a
    /// fresh 19 MiB for each left the allocator's free space cut up by the small
    /// allocations made between two checks, and the server's memory grew with every failed
    /// sign-in (about 1.8 MB each: 256 MB after 136, measured).
    static ARGON2_MEMORY: std::cell::RefCell<Vec<argon2::Block>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The most argon2 memory a stored hash may ask for (ours ask for 19 MiB).
const MAX_ARGON2_BLOCKS: usize = 64 * 1024;

/// Whether `password` is the one the PHC string `phc` was made from (its algorithm,
/// version, parameters and salt), computed in this thread's kept memory.
fn password_matches(phc: &str, password: &str) -> bool {
    let Ok(parsed) = PasswordHash::new(phc) else { return false };
    let (Ok(algorithm), Ok(params)) =
        (argon2::Algorithm::try_from(parsed.algorithm), argon2::Params::try_from(&parsed))
    else {
        return false;
    };
    let version = match parsed.version {
        Some(v) => match argon2::Version::try_from(v) {
            Ok(v) => v,
            Err(_) => return false,
        },
        None => argon2::Version::default(),
    };
    let (Some(salt), Some(expected)) = (parsed.salt, parsed.hash) else { return false };
    let mut salt_bytes = [0u8; 64];
    let Ok(salt) = salt.decode_b64(&mut salt_bytes) else { return false };
    let blocks = params.block_count();
    if blocks > MAX_ARGON2_BLOCKS {
        return false;
    }
    let mut out = vec![0u8; expected.len()];
    ARGON2_MEMORY.with_borrow_mut(|memory| {
        if memory.len() < blocks {
            memory.resize(blocks, argon2::Block::default());
        }
        Argon2::new(algorithm, version, params)
            .hash_password_into_with_memory(password.as_bytes(), salt, &mut out, &mut memory[..blocks])
            .is_ok()
    }) && bool::from(subtle::ConstantTimeEq::ct_eq(out.as_slice(), expected.as_bytes()))
}

/// An argon2id hash of a random password nobody has, checked when the name is unknown.
static UNKNOWN_NAME_HASH: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| hash_password(&crate::tokens::random_token()).unwrap_or_default());

#[cfg(test)]
mod tests {
    use super::*;
    use argon2::password_hash::PasswordVerifier;

    #[test]
    fn a_password_matches_its_own_hash_only() {
        let phc = hash_password("correct horse").unwrap();
        assert!(password_matches(&phc, "correct horse"));
        assert!(password_matches(&phc, "correct horse"), "the kept memory serves the next check too");
        assert!(!password_matches(&phc, "correct horsf"));
        assert!(!password_matches("not a phc string", "correct horse"));
        let parsed = PasswordHash::new(&phc).unwrap();
        assert!(Argon2::default().verify_password(b"correct horse", &parsed).is_ok(), "the crate agrees");
    }

    #[test]
    fn the_unknown_name_hash_is_a_valid_argon2id_hash() {
        let parsed = PasswordHash::new(&UNKNOWN_NAME_HASH).expect("a PHC string");
        assert_eq!(parsed.algorithm.as_str(), "argon2id");
        assert!(Argon2::default().verify_password(b"anything", &parsed).is_err());
    }
}
