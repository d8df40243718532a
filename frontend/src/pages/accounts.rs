//! The teacher's page (admins, on a server with accounts): every account of the class, a
//! form that makes one, and a password reset for each (which ends that account's sessions).

use distlab_common::{AccountView, NewAccount};
use leptos::prelude::*;

use crate::api;
use crate::load::{load, Loaded};

/// What the last action did, in words: done, or refused with the server's reason.
type Outcome = Option<Result<String, String>>;

#[component]
pub fn AccountsPage() -> impl IntoView {
    let accounts = load(api::list_accounts);
    let outcome = RwSignal::new(None::<Result<String, String>>);

    let name = RwSignal::new(String::new());
    let password = RwSignal::new(String::new());
    let admin = RwSignal::new(false);
    let create = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let account = NewAccount {
            name: name.get_untracked().trim().to_string(),
            password: password.get_untracked(),
            admin: admin.get_untracked(),
        };
        leptos::task::spawn_local(async move {
            match api::create_account(&account).await {
                Ok(made) => {
                    let role = if made.admin { "an admin" } else { "a student" };
                    outcome.try_set(Some(Ok(format!("{} can sign in now, as {role}.", made.name))));
                    name.try_set(String::new());
                    password.try_set(String::new());
                    admin.try_set(false);
                    accounts.refetch();
                }
                Err(e) => {
                    outcome.try_set(Some(Err(e.message)));
                }
            }
        });
    };

    view! {
        <section class="card" id="accounts-page">
            <h1>"Accounts"</h1>
            <p class="muted">"Everyone in the class signs in with an account made here (or with "
                <code>"distlab-server user add NAME"</code>" on the server). Passwords are stored as argon2id hashes: nobody can read them back, but you can set a new one."</p>
            <form class="new-account" id="new-account" on:submit=create>
                <label>"name"
                    <input id="new-account-name" maxlength="64" autocomplete="off"
                        prop:value=move || name.get() on:input=move |ev| name.set(event_target_value(&ev))/>
                </label>
                <label>"password"
                    <input id="new-account-password" type="password" autocomplete="new-password"
                        prop:value=move || password.get() on:input=move |ev| password.set(event_target_value(&ev))/>
                </label>
                <label class="check">
                    <input id="new-account-admin" type="checkbox"
                        prop:checked=move || admin.get() on:change=move |ev| admin.set(event_target_checked(&ev))/>
                    "admin (a teacher: manages accounts, may cancel anyone's run)"
                </label>
                <button class="button primary" id="create-account" type="submit">"Create account"</button>
            </form>
            <OutcomeLine outcome=outcome/>
        </section>
        <section class="card">
            {Loaded::new(accounts)
                .error(|e| view! { <p class="alert error" id="accounts-error">{e}</p> })
                .view(move |list| view! {
                    <table class="data" id="accounts">
                        <thead><tr><th>"name"</th><th>"role"</th><th>"new password"</th></tr></thead>
                        <tbody>
                            {list.users.into_iter().map(|account| view! { <AccountRow account=account outcome=outcome/> }).collect_view()}
                        </tbody>
                    </table>
                })}
        </section>
    }
}

/// One account: its name, its role, and a password reset.
#[component]
fn AccountRow(account: AccountView, outcome: RwSignal<Outcome>) -> impl IntoView {
    let password = RwSignal::new(String::new());
    let name = account.name.clone();
    let reset = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let (name, new_password) = (name.clone(), password.get_untracked());
        leptos::task::spawn_local(async move {
            let said = match api::reset_password(&name, &new_password).await {
                Ok(()) => {
                    password.try_set(String::new());
                    Ok(format!("{name} has a new password; their open sessions have ended."))
                }
                Err(e) => Err(e.message),
            };
            outcome.try_set(Some(said));
        });
    };
    view! {
        <tr data-name=account.name.clone()>
            <td>{account.name.clone()}</td>
            <td>{if account.admin { "admin" } else { "student" }}</td>
            <td>
                <form class="reset-password" on:submit=reset>
                    <input class="reset-password-input" type="password" autocomplete="new-password"
                        aria-label=format!("new password for {}", account.name)
                        prop:value=move || password.get() on:input=move |ev| password.set(event_target_value(&ev))/>
                    <button class="button small reset-password-set" type="submit">"set"</button>
                </form>
            </td>
        </tr>
    }
}

#[component]
fn OutcomeLine(outcome: RwSignal<Outcome>) -> impl IntoView {
    move || match outcome.get() {
        None => ().into_any(),
        Some(Ok(done)) => view! { <p class="alert ok" id="accounts-done">{done}</p> }.into_any(),
        Some(Err(refused)) => view! { <p class="alert error" id="accounts-refused">{refused}</p> }.into_any(),
    }
}
