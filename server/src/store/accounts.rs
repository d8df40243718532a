//! Accounts and sign-in sessions (`--auth accounts`): the `users` and `sessions` tables.
//! Passwords are kept as argon2id hashes (`passwords.rs`); a session is a random token the
//! browser holds in an HttpOnly cookie, stored here only as its SHA-256, so that the
//! database alone does not let anyone in.

use std::time::{Duration, SystemTime};

use crate::store::changes::{Data, Writing};
use crate::store::{Db, StoreError};
use crate::tokens::{random_token, token_digest};
use crate::{clock, passwords};

/// The owner of every experiment in the embedded single-user mode, and that user's name.
pub const LOCAL_OWNER: &str = "local";

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
    Db(#[from] StoreError),
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
    if name == LOCAL_OWNER {
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

/// Creates an account.
pub async fn create(db: &Db, name: &str, password: &str, admin: bool) -> Result<Account, AccountError> {
    check_name(name)?;
    check_password(password)?;
    let hash = passwords::hash(password).await.map_err(AccountError::Hash)?;
    let done = sqlx::query(
        "INSERT INTO users (name, password_hash, admin, created_at) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(name)
    .bind(&hash)
    .bind(admin)
    .bind(clock::rfc3339(clock::now()))
    .execute(db)
    .await
    .map_err(StoreError::from)?;
    if done.rows_affected() == 0 {
        return Err(AccountError::Exists(name.to_string()));
    }
    Ok(Account { name: name.to_string(), admin })
}

/// Gives `name` a new password and ends its sessions.
pub async fn set_password(db: &Db, name: &str, password: &str) -> Result<(), AccountError> {
    let _writing = Writing::to(db, Data::Sessions);
    check_password(password)?;
    let hash = passwords::hash(password).await.map_err(AccountError::Hash)?;
    let changed = sqlx::query("UPDATE users SET password_hash = $1 WHERE name = $2")
        .bind(&hash)
        .bind(name)
        .execute(db)
        .await
        .map_err(StoreError::from)?;
    if changed.rows_affected() == 0 {
        return Err(AccountError::NoSuchAccount(name.to_string()));
    }
    sqlx::query("DELETE FROM sessions WHERE user_name = $1").bind(name).execute(db).await.map_err(StoreError::from)?;
    Ok(())
}

/// Every account, by name.
pub async fn list(db: &Db) -> Result<Vec<Account>, StoreError> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT name, CAST(admin AS INTEGER) FROM users ORDER BY name").fetch_all(db).await?;
    Ok(rows.into_iter().map(|(name, admin)| Account { name, admin: admin != 0 }).collect())
}

/// The account if `password` is its password. The hash is checked even for a name that
/// does not exist (against a fixed hash), so that the time taken does not tell.
pub async fn verify(db: &Db, name: &str, password: &str) -> Result<Option<Account>, StoreError> {
    let row: Option<(String, i64)> =
        sqlx::query_as("SELECT password_hash, CAST(admin AS INTEGER) FROM users WHERE name = $1")
            .bind(name)
            .fetch_optional(db)
            .await?;
    let (hash, admin) = match row {
        Some((hash, admin)) => (Some(hash), admin != 0),
        None => (None, false),
    };
    let matches = passwords::verify(hash, password).await;
    Ok(matches.then(|| Account { name: name.to_string(), admin }))
}

/// A new session for `account`: the token to hand the browser.
pub async fn open_session(db: &Db, account: &Account, now: SystemTime) -> Result<String, StoreError> {
    let token = random_token() + &random_token();
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
pub async fn session(db: &Db, token: &str, now: SystemTime) -> Result<Option<Account>, StoreError> {
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
pub async fn close_session(db: &Db, token: &str) -> Result<(), StoreError> {
    let _writing = Writing::to(db, Data::Sessions);
    sqlx::query("DELETE FROM sessions WHERE token_sha256 = $1").bind(token_digest(token)).execute(db).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_and_passwords_long_enough() {
        assert!(check_name("ada.lovelace-1").is_ok());
        for bad in ["", "has space", "local", "<script>", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_password("short").is_err());
        assert!(check_password("long enough").is_ok());
    }
}
