//! The router and the layout every page shares: a header with navigation and the
//! server's health, the page, a footer.

use std::time::Duration;

use leptos::prelude::*;
use leptos_router::components::{Route, Router, Routes, A};
use leptos_router::{lazy_route, path, Lazy, LazyRoute};

use crate::api;
use crate::load::{load, refresh_every, Loaded};
use crate::pages::sign_in::{ask_who, sign_in_again_when_refused, AccountBadge, PasswordPage, Session, SignInPage};
use crate::pages::{
    accounts::AccountsPage,
    assignments::{AssignmentPage, AssignmentsPage},
    cards::CardsPage,
    compare::ComparePage,
    experiment::ExperimentPage,
    list::ExperimentList,
    new::NewExperiment,
    pipeline::PipelinePage,
    planner::PlannerPage,
    quiz::QuizPage,
    ring::RingReplayPage,
};

/// A page loaded on first visit: `#[lazy_route]` makes its view a split point, so
/// `cargo xtask build-frontend` (wasm-split) moves the page's code, and everything only it
/// uses, into a wasm chunk of its own that the browser fetches when the route first opens
/// (index.html prefetches them all once the first page runs). The first page (the
/// experiment list) and the layout stay in the main module.
macro_rules! lazy_page {
    ($route:ident, $page:ident) => {
        struct $route;

        #[lazy_route]
        impl LazyRoute for $route {
            fn data() -> Self {
                $route
            }

            fn view(_this: Self) -> AnyView {
                $page().into_any()
            }
        }
    };
}

lazy_page!(NewRoute, NewExperiment);
lazy_page!(CompareRoute, ComparePage);
lazy_page!(PlannerRoute, PlannerPage);
lazy_page!(CardsRoute, CardsPage);
lazy_page!(QuizRoute, QuizPage);
lazy_page!(AccountsRoute, AccountsPage);
lazy_page!(ExperimentRoute, ExperimentPage);
lazy_page!(RingRoute, RingReplayPage);
lazy_page!(PipelineRoute, PipelinePage);
lazy_page!(AssignmentsRoute, AssignmentsPage);
lazy_page!(AssignmentRoute, AssignmentPage);

#[component]
pub fn App() -> impl IntoView {
    // On a server with accounts, the pages wait for a signed-in session.
    let session = RwSignal::new(Session::Asking);
    ask_who(session);
    // The pages that differ for a teacher (assignments) read it.
    provide_context(session);
    sign_in_again_when_refused(session);
    view! {
        <Router>
            <header class="topbar">
                <A href="/" attr:class="brand">
                    <span class="brand-mark">"◆"</span>
                    " distlab"
                </A>
                <nav>
                    <A href="/" exact=true>"Experiments"</A>
                    <A href="/new">"New experiment"</A>
                    <A href="/compare">"Compare"</A>
                    <A href="/planner">"Planner"</A>
                    <A href="/cards">"Flashcards"</A>
                    <A href="/quiz">"Quiz"</A>
                    <A href="/assignments" attr:id="nav-assignments">"Assignments"</A>
                    {move || session.get().is_teacher().then(|| view! { <A href="/accounts" attr:id="nav-accounts">"Accounts"</A> })}
                </nav>
                <HealthBadge/>
                <AccountBadge session=session/>
            </header>
            <main class="page">
                {move || match session.get() {
                    Session::Asking => view! { <p class="muted">"…"</p> }.into_any(),
                    s if s.needs_sign_in() => view! { <SignInPage session=session/> }.into_any(),
                    _ => view! {
                        <Routes fallback=|| view! { <NotFound/> }>
                            <Route path=path!("/") view=ExperimentList/>
                            <Route path=path!("/new") view={Lazy::<NewRoute>::new()}/>
                            <Route path=path!("/compare") view={Lazy::<CompareRoute>::new()}/>
                            <Route path=path!("/planner") view={Lazy::<PlannerRoute>::new()}/>
                            <Route path=path!("/cards") view={Lazy::<CardsRoute>::new()}/>
                            <Route path=path!("/quiz") view={Lazy::<QuizRoute>::new()}/>
                            <Route path=path!("/accounts") view={Lazy::<AccountsRoute>::new()}/>
                            <Route path=path!("/assignments") view={Lazy::<AssignmentsRoute>::new()}/>
                            <Route path=path!("/assignments/:id") view={Lazy::<AssignmentRoute>::new()}/>
                            <Route path=path!("/password") view=PasswordPage/>
                            <Route path=path!("/experiments/:id") view={Lazy::<ExperimentRoute>::new()}/>
                            <Route path=path!("/experiments/:id/ring") view={Lazy::<RingRoute>::new()}/>
                            <Route path=path!("/experiments/:id/pipeline") view={Lazy::<PipelineRoute>::new()}/>
                        </Routes>
                    }.into_any(),
                }}
            </main>
            <footer class="footer">
                "distlab " {distlab_common::VERSION}
                " · a lab for distributed training: real processes, real bytes, measured numbers."
            </footer>
        </Router>
    }
}

/// Workers and queue length from `GET /api/health`, refreshed every few seconds.
#[component]
fn HealthBadge() -> impl IntoView {
    let health = load(api::health);
    refresh_every(health, Duration::from_secs(5));
    view! {
        <div class="health" id="health">
            {Loaded::new(health)
                .loading(|| view! { <span class="dot"></span>"connecting…" })
                .error(|e| view! { <span class="dot bad"></span><span title=e>"server unreachable"</span> })
                .view(|h| {
                    let workers = if h.workers == 1 { "1 worker".to_string() } else { format!("{} workers", h.workers) };
                    view! {
                        <span class="dot ok"></span>
                        {workers} " · " {h.queued} " queued"
                    }
                })}
        </div>
    }
}

#[component]
fn NotFound() -> impl IntoView {
    view! {
        <section class="card">
            <h1>"Not found"</h1>
            <p>"There is no page here. " <A href="/">"Back to the experiments"</A></p>
        </section>
    }
}
