//! Request parsing that always answers in the JSON error shape: bodies are read with a
//! size limit and parsed by hand, ids are parsed by hand.

use axum::extract::{FromRequest, Request};
use axum::http::header;
use serde::de::DeserializeOwned;

use crate::api::error::HttpError;
use crate::text::truncate;
use crate::AppState;

/// A JSON body read with this route's size limit: 415 unless it says it is JSON
/// (`Content-Type: application/json`: a page on another origin cannot send that without the
/// browser asking first), 413 when larger, 400 when it is not JSON of the expected shape
/// (the message names the field and position).
pub struct JsonBody<T>(pub T);

/// The body limit of a route, set with `axum::Extension(BodyLimit(n))`; routes without one
/// use `ServerConfig::max_body_bytes`.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = HttpError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, HttpError> {
        let limit = req.extensions().get::<BodyLimit>().map_or(state.config.max_body_bytes, |l| l.0);
        let ct = req.headers().get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap_or("").to_ascii_lowercase());
        let essence = ct.as_deref().map(|ct| ct.split(';').next().unwrap_or("").trim().to_string());
        match essence.as_deref() {
            Some(e) if e == "application/json" || e.ends_with("+json") => {}
            Some(e) => {
                return Err(HttpError::unsupported_media_type(format!(
                    "expected a JSON body (Content-Type: application/json), got Content-Type: {e}"
                )))
            }
            None => {
                return Err(HttpError::unsupported_media_type(
                    "expected a JSON body with Content-Type: application/json (the request has no Content-Type)",
                ))
            }
        }
        let declared =
            req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(HttpError::too_large(limit));
        }
        let bytes = match axum::body::to_bytes(req.into_body(), limit).await {
            Ok(bytes) => bytes,
            Err(e) if is_length_limit(&e) => return Err(HttpError::too_large(limit)),
            Err(e) => return Err(HttpError::bad_request(format!("could not read the request body: {e}"))),
        };
        parse_json(&bytes).map(JsonBody)
    }
}

/// Who made the request: the client's address and whether it came over HTTPS. That is
/// the connection's peer and plain HTTP, unless the peer is the reverse proxy the server
/// was told to trust (`--trusted-proxy`): then the last address of its `X-Forwarded-For`
/// (the one the proxy saw) and its `X-Forwarded-Proto`. Anyone else's `X-Forwarded-*`
/// headers are ignored. (No peer, as in tests that call the router directly: no address.)
pub struct Client {
    pub address: Option<std::net::IpAddr>,
    pub https: bool,
}

impl axum::extract::FromRequestParts<AppState> for Client {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        Ok(client_of(parts, state.config.trusted_proxy))
    }
}

fn client_of(parts: &axum::http::request::Parts, trusted_proxy: Option<std::net::IpAddr>) -> Client {
    let peer = parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip());
    if peer.is_none() || peer != trusted_proxy {
        return Client { address: peer, https: false };
    }
    let header = |name: &str| parts.headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).collect::<Vec<_>>();
    let forwarded_for =
        header("x-forwarded-for").iter().flat_map(|v| v.split(',')).filter_map(|a| a.trim().parse().ok()).next_back();
    let https = header("x-forwarded-proto").last().is_some_and(|p| p.trim().eq_ignore_ascii_case("https"));
    Client { address: forwarded_for.or(peer), https }
}

/// Parses JSON bytes into `T`; the 400 message says what is wrong and where.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, HttpError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(HttpError::bad_request("the request body is empty; expected JSON"));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let what =
            if inner.is_syntax() || inner.is_eof() { "the request body is not valid JSON" } else { "unexpected JSON" };
        if path == "." {
            HttpError::bad_request(format!("{what}: {inner}"))
        } else {
            HttpError::bad_field(&path, format!("{what} at {path}: {inner}"))
        }
    })
}

fn is_length_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// An experiment id from the path: a positive integer, else 404 (no such experiment).
pub fn parse_id(raw: &str) -> Result<i64, HttpError> {
    match raw.parse::<i64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(HttpError::not_found(format!(
            "no experiment with id '{}' (ids are positive integers)",
            truncate(raw, 40)
        ))),
    }
}

#[cfg(test)]
mod client_tests {
    use std::net::{IpAddr, SocketAddr};

    use axum::extract::ConnectInfo;
    use axum::http::Request;

    use super::*;

    fn parts(peer: &str, headers: &[(&str, &str)]) -> axum::http::request::Parts {
        let mut req = Request::get("/").body(()).unwrap();
        req.extensions_mut().insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
        for (name, value) in headers {
            let name = axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap();
            req.headers_mut().append(name, value.parse().unwrap());
        }
        req.into_parts().0
    }

    #[test]
    fn forwarded_headers_count_only_from_the_trusted_proxy() {
        let proxy: IpAddr = "10.0.0.2".parse().unwrap();
        let forwarded = [("x-forwarded-for", "203.0.113.9, 198.51.100.7"), ("x-forwarded-proto", "https")];
        let via_proxy = client_of(&parts("10.0.0.2:5000", &forwarded), Some(proxy));
        assert_eq!(via_proxy.address, Some("198.51.100.7".parse().unwrap()), "the address the proxy saw");
        assert!(via_proxy.https);
        let stranger = client_of(&parts("192.0.2.1:5000", &forwarded), Some(proxy));
        assert_eq!(stranger.address, Some("192.0.2.1".parse().unwrap()), "anyone else's headers are ignored");
        assert!(!stranger.https);
        let untrusted = client_of(&parts("10.0.0.2:5000", &forwarded), None);
        assert_eq!((untrusted.address, untrusted.https), (Some(proxy), false));
        let no_header = client_of(&parts("10.0.0.2:5000", &[]), Some(proxy));
        assert_eq!((no_header.address, no_header.https), (Some(proxy), false));
    }
}
