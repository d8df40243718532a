//! The one way a page loads data from the server. An API call becomes a Leptos
//! [`LocalResource`] with [`load`]: fetched when the component runs, again on `refetch()`
//! (or every period, [`refresh_every`]) and whenever a signal the fetcher reads changes.
//! A resource runs one request at a time (a refetch asked for meanwhile runs once after it)
//! and keeps its last answer until the next is in, so a refresh never blanks the page.
//! [`Loaded`] turns one into a view, the same everywhere: "loading…" until the first
//! answer, the error in words, or the data.
//!
//! ```ignore
//! let list = load(|| api::list_accounts());
//! Loaded::new(list)
//!     .error(|e| view! { <p class="alert error" id="accounts-error">{e}</p> })
//!     .view(|list| view! { <AccountTable list=list/> })
//! ```
//!
//! Requests that change something (submit, cancel, answer) are not loads: the handlers
//! send them with `spawn_local` and write what comes back into their signals (or into a
//! resource, which `set` accepts like a signal).

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use leptos::prelude::*;

use crate::api::ApiResult;

/// An API call's answer as a resource: `None` until the first one is in.
pub type Load<T> = LocalResource<ApiResult<T>>;

/// Starts `fetch` now and keeps its answer; see the module's comment.
pub fn load<T, Fut>(fetch: impl Fn() -> Fut + 'static) -> Load<T>
where
    T: 'static,
    Fut: Future<Output = ApiResult<T>> + 'static,
{
    LocalResource::new(fetch)
}

/// Like [`load`], but once an answer is in, a reload that fails keeps it on the page; the
/// signal returned says why the last reload failed (None once one succeeds again).
pub fn load_keeping<T, Fut>(fetch: impl Fn() -> Fut + 'static) -> (Load<T>, ReadSignal<Option<String>>)
where
    T: Clone + 'static,
    Fut: Future<Output = ApiResult<T>> + 'static,
{
    let last = Rc::new(RefCell::new(None::<T>));
    let stale = RwSignal::new(None::<String>);
    let resource = LocalResource::new(move || {
        let (answer, last) = (fetch(), last.clone());
        async move {
            let kept = last.borrow().clone();
            match (answer.await, kept) {
                (Ok(data), _) => {
                    *last.borrow_mut() = Some(data.clone());
                    stale.try_set(None);
                    Ok(data)
                }
                (Err(e), Some(kept)) => {
                    stale.try_set(Some(e.message));
                    Ok(kept)
                }
                (Err(e), None) => Err(e),
            }
        }
    });
    (resource, stale.read_only())
}

/// Fetches `resource` again every `period` while the component that calls this lives.
pub fn refresh_every<T: 'static>(resource: LocalResource<T>, period: Duration) {
    if let Ok(handle) = set_interval_with_handle(move || resource.refetch(), period) {
        on_cleanup(move || handle.clear());
    }
}

type Render<A> = Arc<dyn Fn(A) -> AnyView + Send + Sync>;

/// A resource's view: [`Loaded::view`] draws the data; the loading and error views
/// default to `<p class="muted">loading…</p>` and `<p class="alert error">message</p>`.
pub struct Loaded<T: 'static> {
    resource: Load<T>,
    loading: Render<()>,
    error: Render<String>,
}

impl<T: Clone + 'static> Loaded<T> {
    pub fn new(resource: Load<T>) -> Self {
        Self {
            resource,
            loading: Arc::new(|()| view! { <p class="muted">"loading…"</p> }.into_any()),
            error: Arc::new(|e| view! { <p class="alert error">{e}</p> }.into_any()),
        }
    }

    /// The view until the first answer.
    pub fn loading<V: IntoView + 'static>(mut self, f: impl Fn() -> V + Send + Sync + 'static) -> Self {
        self.loading = Arc::new(move |()| f().into_any());
        self
    }

    /// The view of a failed request, given the error's words.
    pub fn error<V: IntoView + 'static>(mut self, f: impl Fn(String) -> V + Send + Sync + 'static) -> Self {
        self.error = Arc::new(move |e| f(e).into_any());
        self
    }

    /// The page part: redrawn with every answer.
    pub fn view<V: IntoView + 'static>(self, ok: impl Fn(T) -> V + Send + Sync + 'static) -> impl IntoView {
        let Self { resource, loading, error } = self;
        move || match resource.get() {
            None => loading(()),
            Some(Err(e)) => error(e.message),
            Some(Ok(data)) => ok(data).into_any(),
        }
    }
}

/// The card most pages show while their data loads.
pub fn loading_card() -> impl IntoView {
    view! { <section class="card"><p class="muted">"loading…"</p></section> }
}

/// The card most pages show when their data did not load.
pub fn error_card(message: String) -> impl IntoView {
    view! { <section class="card"><p class="alert error">{message}</p></section> }
}
