//! Every error the API answers, as a status code plus the shared JSON body
//! `{"error": "...", "fields": [{"field", "message"}]}` (`distlab_common::ApiError`): what
//! a store error becomes, and the middlewares that keep every answer under /api in that
//! shape (and refuse requests from other origins).

use axum::extract::{OriginalUri, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use distlab_common::{ApiError, FieldError};

use crate::store::disk_quota::OverDisk;
use crate::store::StoreError;

/// An error response: status code and JSON body.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {}", body.error)]
pub struct HttpError {
    pub status: StatusCode,
    pub body: ApiError,
}

impl HttpError {
    pub fn new(status: StatusCode, error: impl Into<String>) -> Self {
        Self { status, body: ApiError { error: error.into(), fields: Vec::new() } }
    }

    pub fn with_fields(status: StatusCode, error: impl Into<String>, fields: Vec<FieldError>) -> Self {
        Self { status, body: ApiError { error: error.into(), fields } }
    }

    /// 400: the request itself is malformed (not JSON, wrong content type, bad query).
    pub fn bad_request(error: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error)
    }

    /// 400 naming the query parameter or body field at fault.
    pub fn bad_field(field: &str, error: impl Into<String>) -> Self {
        let error = error.into();
        Self::with_fields(StatusCode::BAD_REQUEST, error.clone(), vec![FieldError::new(field, error)])
    }

    /// 415: the body is not declared as JSON.
    pub fn unsupported_media_type(error: impl Into<String>) -> Self {
        Self::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, error)
    }

    /// 403: the request is understood but not allowed.
    pub fn forbidden(error: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, error)
    }

    pub fn unauthorized(error: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, error)
    }

    pub fn not_found(error: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, error)
    }

    /// 404 for an experiment id that names none.
    pub fn no_experiment(id: i64) -> Self {
        Self::not_found(format!("no experiment with id {id}"))
    }

    /// 409: the resource is in a state that does not allow this.
    pub fn conflict(error: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, error)
    }

    pub fn too_large(limit_bytes: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than this endpoint's limit of {}", human_bytes(limit_bytes)),
        )
    }

    /// 422: a well-formed spec that breaks rules; every problem is listed in `fields`.
    pub fn invalid_spec(fields: Vec<FieldError>) -> Self {
        let error = match fields.len() {
            1 => format!("the experiment spec is invalid: {}", fields[0]),
            n => format!("the experiment spec has {n} problems"),
        };
        Self::with_fields(StatusCode::UNPROCESSABLE_ENTITY, error, fields)
    }

    /// 429: this client has used its share.
    pub fn too_many_requests(error: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, error)
    }

    pub fn unavailable(error: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, error)
    }

    /// 500; the details go to the log, not to the client.
    pub fn internal(context: &str, detail: impl std::fmt::Display) -> Self {
        tracing::error!("{context}: {detail}");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, format!("internal error ({context}); see the server log"))
    }
}

impl From<StoreError> for HttpError {
    /// A database busy past its timeout (another process holding SQLite's write lock, a pool
    /// with no free connection) is 503 with `Retry-After`: the request may be made again,
    /// and workers do. A stored row that cannot be read back is a 500 naming what it is;
    /// anything else is a 500 too.
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Busy(e) => {
                tracing::warn!("database busy: {e}");
                HttpError::new(StatusCode::SERVICE_UNAVAILABLE, "the database is busy; try again in a moment")
            }
            StoreError::Database(e) => HttpError::internal("database", e),
            StoreError::Corrupt { what, detail } => HttpError::internal(what, detail),
        }
    }
}

impl OverDisk {
    /// The 507 that says how much is used and how to make room, `what` being what needs it.
    pub fn error(&self, owner: &str, what: &str) -> HttpError {
        HttpError::new(
            StatusCode::INSUFFICIENT_STORAGE,
            format!(
                "{what} needs {} of disk, and {owner}'s experiments and datasets take {} of the {} one person \
                 may fill (--max-disk-per-user-mb): delete finished experiments or datasets you no longer need, \
                 or save checkpoints less often (train.checkpoint_every)",
                mib(self.needed),
                mib(self.used),
                mib(self.limit)
            ),
        )
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Middleware: turns any error response under /api that is not JSON (axum's plain-text
/// rejections, 405 with no body, tower-http's 413 and timeout responses) into the JSON shape.
pub async fn json_errors(req: Request, next: Next) -> Response {
    let is_api = req.uri().path() == "/api" || req.uri().path().starts_with("/api/");
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if !is_api || is_json || !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = match axum::body::to_bytes(body, 64 * 1024).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).trim().to_string(),
        Err(_) => String::new(),
    };
    let message = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "the request body is too large".to_string(),
        StatusCode::REQUEST_TIMEOUT | StatusCode::GATEWAY_TIMEOUT => {
            "the request took too long and was stopped".to_string()
        }
        StatusCode::METHOD_NOT_ALLOWED => "this method is not allowed on this path".to_string(),
        _ if !text.is_empty() => text,
        _ => status.canonical_reason().unwrap_or("error").to_string(),
    };
    let mut out = HttpError::new(status, message).into_response();
    // Keep headers that tell the client what to do (Allow on 405, WWW-Authenticate, Retry-After).
    for name in [header::ALLOW, header::WWW_AUTHENTICATE, header::RETRY_AFTER] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

/// Middleware: a request that changes state (any method but GET, HEAD and OPTIONS) from a
/// page of another origin gets 403. Browsers say where a request comes from in `Origin`
/// (or at least `Referer`); it must name this server (`Host`). Requests with neither are
/// not from a page (curl, the workers) and pass.
pub async fn same_origin(req: Request, next: Next) -> Response {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(req).await;
    }
    let headers = req.headers();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let from = headers.get(header::ORIGIN).or_else(|| headers.get(header::REFERER)).map(|v| v.to_str().unwrap_or(""));
    match (from, host) {
        (None, _) => next.run(req).await,
        (Some(from), Some(host)) if origin_host(from) == Some(host) => next.run(req).await,
        (Some(from), _) => HttpError::forbidden(format!(
            "a page of another origin ({}) cannot change anything here; open distlab itself to do this",
            from.chars().take(100).collect::<String>()
        ))
        .into_response(),
    }
}

/// Middleware for a server without accounts (`--auth none`, which listens on loopback only):
/// a request whose `Host` names anything but this machine gets 403. Without it DNS
/// rebinding lets any web page drive the lab: the page's own name, re-pointed at 127.0.0.1,
/// is same-origin with itself, so [`same_origin`] lets it through. (With the host checked,
/// `same_origin` holds a state change's `Origin` to a loopback name too.) A request without
/// `Host` is not from a browser.
pub async fn loopback_names_only(req: Request, next: Next) -> Response {
    match req.headers().get(header::HOST).map(|v| v.to_str().unwrap_or("")) {
        Some(host) if !is_loopback_name(host) => HttpError::forbidden(format!(
            "this lab runs without accounts and answers only to this machine's own names (localhost, 127.0.0.1, \
             [::1]), not '{}'; to serve other machines, start it with --auth accounts",
            host.chars().take(100).collect::<String>()
        ))
        .into_response(),
        _ => next.run(req).await,
    }
}

/// Whether `host[:port]` names this machine: `localhost` (and `*.localhost`, which browsers
/// resolve to it themselves), 127.0.0.0/8 or `[::1]`.
fn is_loopback_name(host_port: &str) -> bool {
    let host = if let Some(rest) = host_port.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, port)) if port.is_empty() || port.starts_with(':') => ip,
            _ => return false,
        }
    } else {
        match host_port.split_once(':') {
            Some((host, _port)) => host,
            None => host_port,
        }
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `host[:port]` of an origin or URL (`http://host:port/path` -> `host:port`); None for
/// `null` and anything that is not http(s).
fn origin_host(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"))?;
    let host = rest.split(['/', '?', '#']).next()?;
    (!host.is_empty()).then_some(host)
}

/// What a handler that panicked answers (the panic itself goes to the log): the JSON 500.
pub fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let detail = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    HttpError::internal("a handler panicked", detail).into_response()
}

/// The JSON 404 for an unknown /api path.
pub async fn api_not_found(method: Method, OriginalUri(uri): OriginalUri) -> HttpError {
    HttpError::not_found(format!("no API endpoint {method} {}", uri.path()))
}

pub fn human_bytes(n: usize) -> String {
    const MIB: usize = 1 << 20;
    const KIB: usize = 1 << 10;
    if n >= MIB && n % MIB == 0 {
        format!("{} MiB", n / MIB)
    } else if n >= KIB && n % KIB == 0 {
        format!("{} KiB", n / KIB)
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use axum::routing::get;
    use axum::Router;
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    use tower_http::catch_panic::CatchPanicLayer;

    use super::*;

    #[tokio::test]
    async fn a_panicking_handler_answers_the_json_500() {
        async fn broken() -> &'static str {
            panic!("index out of bounds")
        }
        let app = Router::new().route("/api/broken", get(broken)).layer(CatchPanicLayer::custom(panic_response));
        let resp = app.oneshot(Request::get("/api/broken").body(Body::empty()).unwrap()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let error: ApiError = serde_json::from_slice(&body).unwrap();
        assert!(error.error.contains("a handler panicked"), "{}", error.error);
        assert!(!error.error.contains("index out of bounds"), "the details stay in the log");
    }

    #[test]
    fn loopback_names_are_this_machine_and_nothing_else() {
        for ok in
            ["localhost", "localhost:8080", "LOCALHOST.", "lab.localhost:1", "127.0.0.1:8080", "127.3.2.1", "[::1]:9"]
        {
            assert!(is_loopback_name(ok), "{ok}");
        }
        for bad in
            ["rebind.evil.example:8080", "localhost.evil.example", "0.0.0.0:80", "10.0.0.1", "[::2]:1", "[::1]x", ""]
        {
            assert!(!is_loopback_name(bad), "{bad}");
        }
    }

    #[test]
    fn origins_name_their_host() {
        assert_eq!(origin_host("http://127.0.0.1:8080"), Some("127.0.0.1:8080"));
        assert_eq!(origin_host("https://lab.example/new?x#y"), Some("lab.example"));
        assert_eq!(origin_host("null"), None);
        assert_eq!(origin_host("file:///tmp/page.html"), None);
    }
}
