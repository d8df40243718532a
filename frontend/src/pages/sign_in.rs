//! Signing in, on a server started with `--auth accounts`: the page everyone sees until
//! they have a session, the header's "signed in as ... · password · sign out", and the page
//! where a person changes their own password.

use distlab_common::{AuthMode, Me};
use leptos::prelude::*;
use leptos_router::components::A;

use crate::api;
use crate::load::load;

/// Where the browser stands with the server: still asking, signed in (or a server without
/// accounts), not signed in on a server that wants it, or signed in until the server
/// answered 401 (the session expired, or an admin reset the password).
#[derive(Clone, Debug, PartialEq)]
pub enum Session {
    Asking,
    SignedIn(Me),
    SignedOut,
    Ended,
}

impl Session {
    /// Whether the sign-in page shows.
    pub fn needs_sign_in(&self) -> bool {
        matches!(self, Session::SignedOut | Session::Ended)
    }

    /// Whether the signed-in person is an admin: a teacher on a server with accounts, whoever
    /// runs it on one without.
    pub fn is_admin(&self) -> bool {
        matches!(self, Session::SignedIn(me) if me.admin)
    }

    /// The signed-in person's name.
    pub fn name(&self) -> Option<String> {
        match self {
            Session::SignedIn(me) => Some(me.name.clone()),
            _ => None,
        }
    }

    /// Whether the signed-in person manages the class's accounts.
    pub fn is_teacher(&self) -> bool {
        matches!(self, Session::SignedIn(me) if me.admin && me.auth == AuthMode::Accounts)
    }
}

/// From now on, a 401 to any request while signed in brings the sign-in page back, saying
/// why; the page the person was on shows again once they are signed in.
pub fn sign_in_again_when_refused(session: RwSignal<Session>) {
    api::on_unauthorized(move || {
        if matches!(session.get_untracked(), Session::SignedIn(_)) {
            session.try_set(Session::Ended);
        }
    });
}

/// Asks the server who this browser is, into `session`. A server that cannot be reached
/// leaves the pages to say so themselves.
pub fn ask_who(session: RwSignal<Session>) {
    let me = load(api::me);
    Effect::new(move || {
        let now = match me.get() {
            None => return,
            Some(Ok(me)) => Session::SignedIn(me),
            Some(Err(e)) if e.needs_sign_in() => Session::SignedOut,
            Some(Err(_)) => Session::SignedIn(Me { name: String::new(), admin: false, auth: AuthMode::None }),
        };
        session.set(now);
    });
}

#[component]
pub fn SignInPage(session: RwSignal<Session>) -> impl IntoView {
    let name = RwSignal::new(String::new());
    let password = RwSignal::new(String::new());
    let error = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let (who, secret) = (name.get_untracked(), password.get_untracked());
        busy.set(true);
        leptos::task::spawn_local(async move {
            match api::sign_in(who.trim(), &secret).await {
                Ok(me) => {
                    password.try_set(String::new());
                    session.try_set(Session::SignedIn(me));
                }
                Err(e) => {
                    error.try_set(Some(e.message));
                }
            }
            busy.try_set(false);
        });
    };
    view! {
        <section class="card sign-in" id="sign-in-page">
            <h1>"Sign in"</h1>
            {move || (session.get() == Session::Ended).then(|| view! {
                <p class="alert" id="session-ended">"Your session has ended (it expired, or your password was reset). Sign in again to go on where you were."</p>
            })}
            <p class="muted">"This distlab is shared by a class: sign in with the account your teacher made for you."</p>
            <form on:submit=submit>
                <label>"name"
                    <input id="sign-in-name" autocomplete="username" maxlength="64"
                        prop:value=move || name.get() on:input=move |ev| name.set(event_target_value(&ev))/>
                </label>
                <label>"password"
                    <input id="sign-in-password" type="password" autocomplete="current-password"
                        prop:value=move || password.get() on:input=move |ev| password.set(event_target_value(&ev))/>
                </label>
                <button class="button primary" id="sign-in" type="submit" disabled=move || busy.get()>"Sign in"</button>
            </form>
            {move || error.get().map(|e| view! { <p class="alert error" id="sign-in-error">{e}</p> })}
        </section>
    }
}

/// `/password`: the signed-in person changes their own password (the current one asked
/// again, the new one twice). Every other session of the account ends; this one goes on.
#[component]
pub fn PasswordPage() -> impl IntoView {
    let current = RwSignal::new(String::new());
    let new = RwSignal::new(String::new());
    let repeated = RwSignal::new(String::new());
    let outcome = RwSignal::new(None::<Result<String, String>>);
    let busy = RwSignal::new(false);
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let (old, chosen) = (current.get_untracked(), new.get_untracked());
        if chosen != repeated.get_untracked() {
            outcome.set(Some(Err("the two new passwords differ".into())));
            return;
        }
        busy.set(true);
        leptos::task::spawn_local(async move {
            match api::change_password(&old, &chosen).await {
                // (the same person, with a new session cookie: nothing else here changes)
                Ok(_) => {
                    for field in [current, new, repeated] {
                        field.try_set(String::new());
                    }
                    outcome.try_set(Some(Ok(
                        "Your password is changed. Every other browser signed in as you is signed out.".into(),
                    )));
                }
                Err(e) => {
                    outcome.try_set(Some(Err(e.message)));
                }
            }
            busy.try_set(false);
        });
    };
    let input = |id: &'static str, autocomplete: &'static str, value: RwSignal<String>| {
        view! {
            <input id=id type="password" autocomplete=autocomplete
                prop:value=move || value.get() on:input=move |ev| value.set(event_target_value(&ev))/>
        }
    };
    view! {
        <section class="card sign-in" id="password-page">
            <h1>"Your password"</h1>
            <p class="muted">"A new password signs out every other browser signed in as you; this one stays signed in."</p>
            <form on:submit=submit>
                <label>"current password" {input("current-password", "current-password", current)}</label>
                <label>"new password (8 characters or more)" {input("new-password", "new-password", new)}</label>
                <label>"the new password again" {input("new-password-again", "new-password", repeated)}</label>
                <button class="button primary" id="change-password" type="submit" disabled=move || busy.get()>"Change password"</button>
            </form>
            {move || match outcome.get() {
                Some(Ok(done)) => view! { <p class="alert ok" id="password-changed">{done}</p> }.into_any(),
                Some(Err(e)) => view! { <p class="alert error" id="password-refused">{e}</p> }.into_any(),
                None => ().into_any(),
            }}
        </section>
    }
}

/// "ada · password · sign out" in the header, on a server with accounts.
#[component]
pub fn AccountBadge(session: RwSignal<Session>) -> impl IntoView {
    let sign_out = move |_| {
        leptos::task::spawn_local(async move {
            let _ = api::sign_out().await;
            session.try_set(Session::SignedOut);
        });
    };
    move || match session.get() {
        Session::SignedIn(me) if me.auth == AuthMode::Accounts => {
            let who = if me.admin { format!("{} (admin)", me.name) } else { me.name };
            view! {
                <div class="account" id="account">
                    <span id="signed-in-as">{who}</span>
                    <A href="/password" attr:id="nav-password" attr:class="button small">"password"</A>
                    <button class="button small" id="sign-out" on:click=sign_out>"sign out"</button>
                </div>
            }
            .into_any()
        }
        _ => ().into_any(),
    }
}
