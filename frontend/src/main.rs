//! distlab in the browser: a Leptos app (client-side rendering) compiled to wasm32.
//!
//! One concern per module: `app` routes and lays out the pages, `api` talks to the
//! server (REST + server-sent events), `pages` are the screens, `components` the
//! pieces they share, `ring_replay` a ring collective replayed step by step from a
//! trace (plain Rust, drawn by the ring page). Spec types and validation come from
//! `distlab-common`, so the browser shows exactly the messages the server would send back.

mod api;
mod app;
mod components;
mod format;
mod pages;
mod ring_replay;

fn main() {
    leptos::mount::mount_to_body(app::App);
}
