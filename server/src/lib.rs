//! distlab's HTTP server: the REST API, live streams (SSE), the experiment queue that
//! workers lease from, and the static browser app. docs/api.md lists the API.
//!
//! - [`app`] builds the router for a given [`AppState`] (tests drive it with `oneshot`).
//! - [`serve`] opens the database, binds, prints `distlab is ready at http://ADDR/`,
//!   starts the lease reaper and the local workers, and serves until ctrl-c / SIGTERM.
//!
//! The layers, each importing only those before it:
//!
//! - leaves: `clock`, `text`, `tokens`, `passwords`, `placement`, `sign_in_guard`,
//!   `metrics_registry`, `listen`, `local_workers`, `static_files`, `markdown`, `read_cache`;
//! - `store/`: every query, over SQLite or PostgreSQL, answering typed values;
//! - `live/`: the hub of live events, and its relay between servers of one database;
//! - `config.rs` ([`ServerConfig`]) and `state.rs` ([`AppState`], the reaper's step);
//! - `api/`: the handlers, one file per resource (`api/study/`: the study pages');
//! - `routes.rs` ([`app`]: the router and the OpenAPI document), then `serve.rs` ([`serve`]).

pub mod api;
pub mod clock;
pub mod config;
pub mod listen;
pub mod live;
pub mod local_workers;
pub mod markdown;
pub mod metrics_registry;
pub mod passwords;
pub mod placement;
pub mod read_cache;
pub mod routes;
pub mod serve;
pub mod sign_in_guard;
pub mod state;
pub mod static_files;
pub mod store;
pub mod text;
pub mod tokens;

pub use config::{ServeError, ServerConfig};
pub use routes::app;
pub use serve::{local_url, serve};
pub use state::AppState;
