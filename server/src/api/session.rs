//! Who is asking. `identify` (middleware on the user API) puts the caller's [`Account`] on
//! every request: with `--auth none` the machine's one user (an admin); with
//! `--auth accounts` the account of the session cookie, and anyone else gets 401. Also the
//! routes around it: sign in and out (`POST` / `DELETE /api/session`), `GET /api/me`, and
//! the accounts admins manage (`/api/users`).

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{AccountList, AccountView, AuthMode, ChangePassword, Me, NewAccount, NewPassword, SignIn};

use crate::api::error::HttpError;
use crate::api::extract::{Client, JsonBody};
use crate::clock;
use crate::sign_in_guard::Refused;
use crate::store::accounts::{self, Account, AccountError, LOCAL_OWNER};
use crate::store::changes::{self, Data};
use crate::AppState;

/// The session cookie's name.
pub const COOKIE: &str = "distlab_session";

/// The one user of a server without accounts.
pub fn local_user() -> Account {
    Account { name: LOCAL_OWNER.to_string(), admin: true }
}

/// The session token the request carries, if any.
fn session_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

/// Who is asking: the local user without accounts; with accounts, the account of the
/// session cookie, if there is one.
pub async fn caller(state: &AppState, headers: &HeaderMap) -> Result<Option<Account>, HttpError> {
    match state.config.auth {
        AuthMode::None => Ok(Some(local_user())),
        AuthMode::Accounts => match session_token(headers) {
            Some(token) => {
                // (read before the session: `read_cache.rs`)
                let version = changes::version(&state.db, Data::Sessions);
                if let Some(account) = state.sessions.get(&token.to_string(), version) {
                    return Ok(Some(account));
                }
                let account = accounts::session(&state.db, token, clock::now()).await?;
                if let Some(account) = &account {
                    state.sessions.put(token.to_string(), version, account.clone());
                }
                Ok(account)
            }
            None => Ok(None),
        },
    }
}

/// Middleware: the caller's account on the request, or 401.
pub async fn identify(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let account = match caller(&state, req.headers()).await {
        Ok(Some(account)) => account,
        Ok(None) => return HttpError::unauthorized("sign in first (POST /api/session)").into_response(),
        Err(e) => return e.into_response(),
    };
    req.extensions_mut().insert(account);
    next.run(req).await
}

fn me(account: &Account, auth: AuthMode) -> Me {
    Me { name: account.name.clone(), admin: account.admin, auth }
}

/// `GET /api/me`: who is signed in.
#[utoipa::path(
    get, path = "/me", tag = "accounts",
    responses(
        (status = 200, body = distlab_common::Me),
        (status = 401, description = "not signed in (a server with accounts)", body = distlab_common::ApiError),
    ),
)]
pub async fn who(State(state): State<AppState>, Extension(caller): Extension<Account>) -> Json<Me> {
    Json(me(&caller, state.config.auth))
}

/// The session cookie: HttpOnly, SameSite=Strict, and Secure when the browser came over
/// HTTPS (a trusted proxy said so), so that it is never sent over plain HTTP after.
fn cookie(value: &str, max_age_s: u64, secure: bool) -> HeaderValue {
    let secure = if secure { "; Secure" } else { "" };
    let text = format!("{COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age_s}{secure}");
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("distlab_session=; Max-Age=0"))
}

/// `POST /api/session {"name", "password"}`: signs in (a session cookie, HttpOnly and
/// SameSite=Strict); 401 for a wrong name or password (without saying which).
#[utoipa::path(
    post, path = "/session", tag = "accounts",
    request_body = distlab_common::SignIn,
    responses(
        (status = 200, description = "signed in: a session cookie", body = distlab_common::Me),
        (status = 401, body = distlab_common::ApiError),
        (status = 409, description = "the server runs without accounts", body = distlab_common::ApiError),
        (status = 429, description = "too many failed sign-ins for this account or address: wait Retry-After seconds", body = distlab_common::ApiError),
        (status = 503, description = "too many sign-ins at once: try again after Retry-After seconds", body = distlab_common::ApiError),
    ),
)]
pub async fn sign_in(
    State(state): State<AppState>,
    client: Client,
    JsonBody(body): JsonBody<SignIn>,
) -> Result<Response, Response> {
    let address = client.address;
    if state.config.auth == AuthMode::None {
        return Err(HttpError::conflict(
            "this server runs without accounts (--auth none): there is nothing to sign in to",
        )
        .into_response());
    }
    let name: String = body.name.chars().take(4 * accounts::MAX_NAME_CHARS).collect();
    let name_too_long = body.name.len() > name.len();
    let account = match name_too_long {
        true => None,
        false => throttled_check(&state, &name, &body.password, address).await?,
    };
    let Some(account) = account else {
        tracing::info!(name = %name.chars().take(64).collect::<String>(), ?address, "sign-in refused");
        return Err(HttpError::unauthorized("wrong name or password").into_response());
    };
    tracing::info!(name = %account.name, "signed in");
    signed_in(&state, &account, client.https).await.map_err(IntoResponse::into_response)
}

/// Whether `password` is `name`'s, checked under the sign-in guard: refused (503 or 429)
/// while the queue is full or the account or address is throttled; a wrong password counts
/// as a failure, a right one clears the account's.
async fn throttled_check(
    state: &AppState,
    name: &str,
    password: &str,
    address: Option<std::net::IpAddr>,
) -> Result<Option<Account>, Response> {
    let admitted = state.sign_in.admit(name, address, std::time::Instant::now()).map_err(refused)?;
    let account = if password.len() > 4 * accounts::MAX_PASSWORD_CHARS {
        None
    } else {
        accounts::verify(&state.db, name, password).await.map_err(|e| HttpError::from(e).into_response())?
    };
    drop(admitted);
    match &account {
        Some(account) => state.sign_in.succeeded(&account.name),
        None => state.sign_in.failed(name, address, std::time::Instant::now()),
    }
    Ok(account)
}

/// A new session for `account`: its `Me`, with the cookie.
async fn signed_in(state: &AppState, account: &Account, https: bool) -> Result<Response, HttpError> {
    let token = accounts::open_session(&state.db, account, clock::now()).await?;
    let mut resp = Json(me(account, state.config.auth)).into_response();
    resp.headers_mut().insert(header::SET_COOKIE, cookie(&token, accounts::SESSION_LIFETIME.as_secs(), https));
    Ok(resp)
}

/// `PUT /api/me/password {"current", "new"}`: a person changes their own password. Every
/// session of the account ends (a browser someone else holds is signed out) and so do its
/// live streams; this browser gets a new session. A wrong current password is 403 and
/// counts as a failed sign-in.
#[utoipa::path(
    put, path = "/me/password", tag = "accounts",
    request_body = distlab_common::ChangePassword,
    responses(
        (status = 200, description = "changed; this browser's new session cookie", body = distlab_common::Me),
        (status = 403, description = "the current password is wrong", body = distlab_common::ApiError),
        (status = 409, description = "the server runs without accounts", body = distlab_common::ApiError),
        (status = 422, description = "the new password is too short or too long", body = distlab_common::ApiError),
        (status = 429, description = "too many failed sign-ins", body = distlab_common::ApiError),
    ),
)]
pub async fn change_password(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    client: Client,
    JsonBody(body): JsonBody<ChangePassword>,
) -> Result<Response, Response> {
    if state.config.auth == AuthMode::None {
        return Err(HttpError::conflict("this server runs without accounts (--auth none): there is no password")
            .into_response());
    }
    if throttled_check(&state, &caller.name, &body.current, client.address).await?.is_none() {
        return Err(HttpError::forbidden("the current password is wrong").into_response());
    }
    accounts::set_password(&state.db, &caller.name, &body.new).await.map_err(|e| account_error(e).into_response())?;
    state.hub.end_streams_of(&caller.name);
    tracing::info!(name = %caller.name, "password changed by its owner");
    signed_in(&state, &caller, client.https).await.map_err(IntoResponse::into_response)
}

/// The answer to a sign-in that is not tried: 503 when too many wait, 429 while throttled
/// or locked, each with `Retry-After`.
fn refused(why: Refused) -> Response {
    let (error, retry_after) = match why {
        Refused::Busy => (
            HttpError::unavailable("too many sign-ins at once; try again in a few seconds"),
            std::time::Duration::from_secs(2),
        ),
        Refused::TooSoon(wait) => (
            HttpError::too_many_requests(format!(
                "too many failed sign-ins: wait {} s before the next try",
                wait.as_secs_f64().ceil()
            )),
            wait,
        ),
        Refused::Locked { account, for_at_most } => (
            HttpError::too_many_requests(format!(
                "too many failed sign-ins {}: locked for up to {} minutes, or until a teacher unlocks it",
                if account { "for this account" } else { "from this address" },
                (for_at_most.as_secs_f64() / 60.0).ceil()
            )),
            for_at_most,
        ),
    };
    let mut resp = error.into_response();
    let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
    if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
        resp.headers_mut().insert(header::RETRY_AFTER, value);
    }
    resp
}

/// `DELETE /api/session`: signs out (the session ends on the server, the cookie is cleared).
#[utoipa::path(
    delete, path = "/session", tag = "accounts",
    responses(
        (status = 204, description = "the session ended"),
    ),
)]
pub async fn sign_out(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, HttpError> {
    if let Some(token) = session_token(&headers) {
        accounts::close_session(&state.db, token).await?;
    }
    let mut resp = StatusCode::NO_CONTENT.into_response();
    resp.headers_mut().insert(header::SET_COOKIE, cookie("", 0, false));
    Ok(resp)
}

/// Whether `caller` may `verb` `thing` (e.g. "experiment 5"), which `owner` owns: its
/// owner or an admin; 403 naming both otherwise.
pub fn may_change(caller: &Account, thing: &str, owner: &str, verb: &str) -> Result<(), HttpError> {
    if caller.admin || caller.name == owner {
        Ok(())
    } else {
        Err(HttpError::forbidden(format!("{thing} is {owner}'s: only its owner or an admin may {verb} it")))
    }
}

fn require_admin(caller: &Account) -> Result<(), HttpError> {
    if caller.admin {
        Ok(())
    } else {
        Err(HttpError::forbidden("only an admin (a teacher) may manage accounts"))
    }
}

fn account_error(e: AccountError) -> HttpError {
    match e {
        AccountError::Invalid(message) => HttpError::with_fields(
            StatusCode::UNPROCESSABLE_ENTITY,
            message.clone(),
            vec![distlab_common::FieldError::new("", message)],
        ),
        AccountError::Exists(_) => HttpError::conflict(e.to_string()),
        AccountError::NoSuchAccount(_) => HttpError::not_found(e.to_string()),
        AccountError::Hash(detail) => HttpError::internal("password hashing", detail),
        AccountError::Db(e) => HttpError::from(e),
    }
}

/// `GET /api/users` (admins): every account.
#[utoipa::path(
    get, path = "/users", tag = "accounts",
    responses(
        (status = 200, body = distlab_common::AccountList),
        (status = 403, description = "admins only", body = distlab_common::ApiError),
    ),
)]
pub async fn list_users(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
) -> Result<Json<AccountList>, HttpError> {
    require_admin(&caller)?;
    let users = accounts::list(&state.db).await?;
    Ok(Json(AccountList { users: users.into_iter().map(|a| AccountView { name: a.name, admin: a.admin }).collect() }))
}

/// `POST /api/users {"name", "password", "admin"}` (admins): a new account (201).
#[utoipa::path(
    post, path = "/users", tag = "accounts",
    request_body = distlab_common::NewAccount,
    responses(
        (status = 201, body = distlab_common::AccountView),
        (status = 403, body = distlab_common::ApiError),
        (status = 409, description = "the name is taken", body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn create_user(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    JsonBody(body): JsonBody<NewAccount>,
) -> Result<Response, HttpError> {
    require_admin(&caller)?;
    let account = accounts::create(&state.db, &body.name, &body.password, body.admin).await.map_err(account_error)?;
    tracing::info!(name = %account.name, admin = account.admin, by = %caller.name, "account created");
    Ok((StatusCode::CREATED, Json(AccountView { name: account.name, admin: account.admin })).into_response())
}

/// `PUT /api/users/{name}/password {"password"}` (admins): a new password; the account's
/// sessions end (204).
#[utoipa::path(
    put, path = "/users/{name}/password", tag = "accounts",
    params(("name" = String, Path)),
    request_body = distlab_common::NewPassword,
    responses(
        (status = 204, description = "set; the account's sessions end"),
        (status = 403, body = distlab_common::ApiError),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn reset_password(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<NewPassword>,
) -> Result<StatusCode, HttpError> {
    require_admin(&caller)?;
    accounts::set_password(&state.db, &name, &body.password).await.map_err(account_error)?;
    state.sign_in.unlock(&name);
    state.hub.end_streams_of(&name);
    tracing::info!(%name, by = %caller.name, "password reset");
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /api/users/{name}/lock` (admins): forgets the account's failed sign-ins, so that
/// it may sign in again at once (204; 404 when no such account).
#[utoipa::path(
    delete, path = "/users/{name}/lock", tag = "accounts",
    params(("name" = String, Path)),
    responses(
        (status = 204, description = "unlocked"),
        (status = 403, body = distlab_common::ApiError),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn unlock(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(name): Path<String>,
) -> Result<StatusCode, HttpError> {
    require_admin(&caller)?;
    if !accounts::list(&state.db).await?.iter().any(|a| a.name == name) {
        return Err(account_error(AccountError::NoSuchAccount(name)));
    }
    let had_failures = state.sign_in.unlock(&name);
    tracing::info!(%name, by = %caller.name, had_failures, "sign-in unlocked");
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_static("theme=dark; distlab_session=abc123; x=y"));
        assert_eq!(session_token(&headers), Some("abc123"));
        headers.insert(header::COOKIE, HeaderValue::from_static("distlab_sessionx=no"));
        assert_eq!(session_token(&headers), None);
    }

    #[test]
    fn the_cookie_is_http_only_and_same_site_strict() {
        let c = cookie("t0ken", 60, false);
        let text = c.to_str().unwrap();
        assert!(text.contains("HttpOnly") && text.contains("SameSite=Strict") && text.contains("Max-Age=60"), "{text}");
        assert!(!text.contains("Secure"), "{text}");
        assert!(cookie("t0ken", 60, true).to_str().unwrap().ends_with("; Secure"));
    }
}
