//! A link to the documentation page that explains what a page shows (docs/NAME.md, which
//! `cargo xtask build-frontend` renders into the site as /docs/NAME.html), opened in a tab
//! of its own so the run stays where it is.

use leptos::prelude::*;

/// "how it works ↗", to /docs/`page`.html (`index`: every page).
#[component]
pub fn DocLink(page: &'static str) -> impl IntoView {
    // rel="external": the router leaves the link to the browser (the page is a file).
    view! {
        <a class="doc-link" href=format!("/docs/{page}.html") target="_blank" rel="external noopener">
            "how it works ↗"
        </a>
    }
}
