//! distlab in the browser: a Leptos app (client-side rendering) compiled to wasm32.
//!
//! One concern per module: `app` routes and lays out the pages, `api` talks to the
//! server (REST + server-sent events), `load` turns a request into a view (the one way a
//! page loads data), `pages` are the screens, `components` the
//! pieces they share, `ring_replay` a ring collective replayed step by step from a
//! trace (plain Rust, drawn by the ring page). Spec types and validation come from
//! `distlab-common`, so the browser shows exactly the messages the server would send back.

mod api;
mod app;
mod components;
mod format;
mod load;
mod pages;
mod ring_replay;

fn main() {
    std::panic::set_hook(Box::new(show_crash));
    leptos::mount::mount_to_body(app::App);
}

/// A panic ends the app in this tab (the wasm aborts), e.g. when a page's chunk cannot be
/// fetched: say so at the top of the page, with the reason, instead of leaving it frozen.
fn show_crash(info: &std::panic::PanicHookInfo) {
    web_sys::console::error_1(&info.to_string().into());
    let Some(document) = web_sys::window().and_then(|w| w.document()) else { return };
    let (Some(body), Ok(banner)) = (document.body(), document.create_element("div")) else { return };
    banner.set_id("crashed");
    banner.set_class_name("alert error crashed");
    banner.set_text_content(Some(&format!(
        "distlab stopped in this tab: {info}. Reload the page to go on (a rebuilt or restarted server is the \
         usual reason)."
    )));
    let _ = body.prepend_with_node_1(&banner);
}
