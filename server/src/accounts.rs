//! Accounts and sign-in sessions (`--auth accounts`): the store behind them. Passwords are
//! kept as argon2id hashes (PHC strings); a session is a random token the browser holds in
//! an HttpOnly cookie, stored here only as its SHA-256, so that the database alone does not
//! let anyone in.

use std::time::{Duration, SystemTime};

use argon2::password_hash::{PasswordHash, PasswordHasher, SaltString};
use argon2::Argon2;
use sha2::{Digest, Sha256};

use crate::clock;
use crate::db::Db;

/// How long a sign-in lasts.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(14 * 24 * 3600);
/// Account names: 1..=64 characters of letters, digits, `.`, `_` and `-`.
pub const MAX_NAME_CHARS: usize = 64;
/// Passwords: at least 8 characters (and at most 1,024, so hashing stays cheap).
pub const MIN_PASSWORD_CHARS: usize = 8;
pub const MAX_PASSWORD_CHARS: usize = 1024;

/// Someone signed in (or, with `--auth none`, the machine's one user).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub admin: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AccountError {
    #[error("{0}")]
    Invalid(String),
    #[error("an account named '{0}' already exists")]
    Exists(String),
    #[error("no account named '{0}'")]
    NoSuchAccount(String),
    #[error("hashing the password: {0}")]
    Hash(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Why `name` cannot be an account name, if it cannot.
pub fn check_name(name: &str) -> Result<(), AccountError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.chars().count() > MAX_NAME_CHARS || !name.chars().all(ok_char) {
        return Err(AccountError::Invalid(format!(
            "an account name is 1 to {MAX_NAME_CHARS} letters, digits, '.', '_' or '-' (got '{}')",
            name.chars().take(80).collect::<String>()
        )));
    }
    if name == crate::experiments::LOCAL_OWNER {
        return Err(AccountError::Invalid(format!("'{name}' is the single-user mode's name; choose another")));
    }
    Ok(())
}

fn check_password(password: &str) -> Result<(), AccountError> {
    let n = password.chars().count();
    if !(MIN_PASSWORD_CHARS..=MAX_PASSWORD_CHARS).contains(&n) {
        return Err(AccountError::Invalid(format!(
            "a password is {MIN_PASSWORD_CHARS} to {MAX_PASSWORD_CHARS} characters (this one has {n})"
        )));
    }
    Ok(())
}

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
async fn off_the_runtime<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, AccountError> {
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
        .map_err(|_| AccountError::Hash("no password-hashing thread is running".into()))?;
    rx.await.map_err(|_| AccountError::Hash("the password-hashing thread stopped".into()))
}

/// [`hash_password`] off the runtime.
async fn hash(password: &str) -> Result<String, AccountError> {
    let owned = password.to_string();
    off_the_runtime(move || hash_password(&owned)).await?
}

fn hash_password(password: &str) -> Result<String, AccountError> {
    let salt_bytes: [u8; 16] = rand::random();
    let salt = SaltString::encode_b64(&salt_bytes).map_err(|e| AccountError::Hash(e.to_string()))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| AccountError::Hash(e.to_string()))
}

/// Creates an account.
pub async fn create(db: &Db, name: &str, password: &str, admin: bool) -> Result<Account, AccountError> {
    check_name(name)?;
    check_password(password)?;
    let hash = hash(password).await?;
    let done = sqlx::query(
        "INSERT INTO users (name, password_hash, admin, created_at) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(name)
    .bind(&hash)
    .bind(admin)
    .bind(clock::rfc3339(clock::now()))
    .execute(db)
    .await?;
    if done.rows_affected() == 0 {
        return Err(AccountError::Exists(name.to_string()));
    }
    Ok(Account { name: name.to_string(), admin })
}

/// Gives `name` a new password and ends its sessions.
pub async fn set_password(db: &Db, name: &str, password: &str) -> Result<(), AccountError> {
    check_password(password)?;
    let hash = hash(password).await?;
    let changed =
        sqlx::query("UPDATE users SET password_hash = $1 WHERE name = $2").bind(&hash).bind(name).execute(db).await?;
    if changed.rows_affected() == 0 {
        return Err(AccountError::NoSuchAccount(name.to_string()));
    }
    sqlx::query("DELETE FROM sessions WHERE user_name = $1").bind(name).execute(db).await?;
    Ok(())
}

/// Every account, by name.
pub async fn list(db: &Db) -> Result<Vec<Account>, sqlx::Error> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT name, CAST(admin AS INTEGER) FROM users ORDER BY name").fetch_all(db).await?;
    Ok(rows.into_iter().map(|(name, admin)| Account { name, admin: admin != 0 }).collect())
}

/// The account if `password` is its password. The hash is checked even for a name that
/// does not exist (against a fixed hash), so that the time taken does not tell.
pub async fn verify(db: &Db, name: &str, password: &str) -> Result<Option<Account>, sqlx::Error> {
    let row: Option<(String, i64)> =
        sqlx::query_as("SELECT password_hash, CAST(admin AS INTEGER) FROM users WHERE name = $1")
            .bind(name)
            .fetch_optional(db)
            .await?;
    let (hash, admin, exists) = match row {
        Some((hash, admin)) => (hash, admin != 0, true),
        None => (UNKNOWN_NAME_HASH.clone(), false, false),
    };
    let password = password.to_string();
    let matches = off_the_runtime(move || password_matches(&hash, &password)).await.unwrap_or(false);
    Ok((matches && exists).then(|| Account { name: name.to_string(), admin }))
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
    std::sync::LazyLock::new(|| hash_password(&crate::random_token()).unwrap_or_default());

/// The stored form of a session token (or a worker's credential): its SHA-256 in hex.
pub fn token_digest(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// A new session for `account`: the token to hand the browser.
pub async fn open_session(db: &Db, account: &Account, now: SystemTime) -> Result<String, sqlx::Error> {
    let token = crate::random_token() + &crate::random_token();
    sqlx::query("INSERT INTO sessions (token_sha256, user_name, created_at, expires_at) VALUES ($1, $2, $3, $4)")
        .bind(token_digest(&token))
        .bind(&account.name)
        .bind(clock::rfc3339(now))
        .bind(clock::after(now, SESSION_LIFETIME))
        .execute(db)
        .await?;
    Ok(token)
}

/// Who holds session `token` at `now`, if anyone.
pub async fn session(db: &Db, token: &str, now: SystemTime) -> Result<Option<Account>, sqlx::Error> {
    let row: Option<(String, i64)> = sqlx::query_as(
        "SELECT u.name, CAST(u.admin AS INTEGER) FROM sessions s JOIN users u ON u.name = s.user_name \
         WHERE s.token_sha256 = $1 AND s.expires_at > $2",
    )
    .bind(token_digest(token))
    .bind(clock::rfc3339(now))
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(name, admin)| Account { name, admin: admin != 0 }))
}

/// Ends session `token`.
pub async fn close_session(db: &Db, token: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM sessions WHERE token_sha256 = $1").bind(token_digest(token)).execute(db).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use argon2::password_hash::PasswordVerifier;

    #[test]
    fn names_are_plain_and_passwords_long_enough() {
        assert!(check_name("ada.lovelace-1").is_ok());
        for bad in ["", "has space", "local", "<script>", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_password("short").is_err());
        assert!(check_password("long enough").is_ok());
    }

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
