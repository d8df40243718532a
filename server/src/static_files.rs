//! The browser app: files from the static directory (index.html, and the versioned build
//! under assets/VERSION/: js, wasm, css), and index.html for every other path that has no
//! file, so that client-side routes such as /experiments/3 or /new load the app. Without a
//! built frontend, a page says how to build it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::State;
use axum::handler::Handler;
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::Router;
use tower::{Layer, ServiceBuilder};
use tower_http::services::ServeDir;
use tower_http::set_header::SetResponseHeaderLayer;

/// A router whose fallback serves every path that no other route takes.
pub fn router<S: Clone + Send + Sync + 'static>(static_dir: &Path) -> Router<S> {
    let dir = Arc::new(static_dir.to_path_buf());
    let files = ServeDir::new(static_dir).append_index_html_on_directories(true).fallback(spa_fallback.with_state(dir));
    // index.html is revalidated on every load so that a rebuilt frontend is picked up at
    // once (304s are cheap); it names the build's files by their version.
    let files = SetResponseHeaderLayer::if_not_present(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"))
        .layer(files);
    // A file under assets/VERSION/ never changes: browsers keep it (a missing one, 404, is
    // not kept).
    let assets = ServiceBuilder::new()
        .map_response(|mut response: Response<_>| {
            if response.status().is_success() {
                response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static(IMMUTABLE));
            }
            response
        })
        .service(ServeDir::new(static_dir.join("assets")));
    Router::new().nest_service("/assets", assets).fallback_service(files)
}

const IMMUTABLE: &str = "public, max-age=31536000, immutable";

/// Paths without a file: index.html (client-side route), or 404 for a missing asset
/// (a last path segment with a dot, e.g. /app.js), or the "not built" page.
async fn spa_fallback(State(dir): State<Arc<PathBuf>>, uri: Uri) -> Response {
    let last = uri.path().rsplit('/').next().unwrap_or("");
    if last.contains('.') && last != "index.html" {
        return (StatusCode::NOT_FOUND, format!("no file {} in the frontend build", uri.path())).into_response();
    }
    match tokio::fs::read(dir.join("index.html")).await {
        Ok(bytes) => ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], bytes).into_response(),
        Err(_) => not_built_page(&dir).into_response(),
    }
}

fn not_built_page(dir: &Path) -> Html<String> {
    let dir = escape_html(&dir.display().to_string());
    Html(format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>distlab: frontend not built</title>
<style>body{{font-family:system-ui,sans-serif;max-width:40rem;margin:4rem auto;line-height:1.5;padding:0 1rem}}
code{{background:#f2f2f2;padding:.1rem .3rem;border-radius:3px}}</style></head>
<body>
<h1>distlab is running, but the frontend is not built</h1>
<p>The server found no <code>index.html</code> in <code>{dir}</code>.</p>
<p>Build and start everything with <code>cargo xtask run</code>, or point the server at a built
frontend with <code>--static-dir</code> (<code>DISTLAB_STATIC_DIR</code>).</p>
<p>The API works without it: try <a href="/api/health"><code>/api/health</code></a>
and <a href="/api/experiments"><code>/api/experiments</code></a>.</p>
</body></html>
"#
    ))
}

fn escape_html(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}
