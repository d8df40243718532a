//! distlab in the browser: a Leptos app (client-side rendering) compiled to wasm32.
//!
//! One concern per module: `app` routes and lays out the pages, `api` talks to the
//! server (REST + server-sent events), `pages` are the three screens, `components`
//! the pieces they share. Spec types and validation come from `distlab-common`, so
//! the browser shows exactly the messages the server would send back.

mod api;
mod app;
mod components;
mod format;
mod pages;

fn main() {
    leptos::mount::mount_to_body(app::App);
}
