//! The console's page frame and the pieces every page shares: the navigation, a
//! notice, the login form, an action's form with its CSRF token, a table.

use maud::{html, Markup, PreEscaped, DOCTYPE};

use super::auth::{Principal, Role};

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}
nav{background:#234;padding:.5em 1em}nav a{color:#fff;margin-right:1.2em;text-decoration:none}
nav form{display:inline}nav .who{color:#9ab;float:right}main{padding:1em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}
th{background:#eef}pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap;max-width:60em}
form.inline{display:inline}.muted{color:#777}button{cursor:pointer}.danger{color:#a00}";

/// A whole page: the frame, the navigation with who is signed in, then `body`.
pub(super) fn frame(title: &str, who: &Principal, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · postie console" }
                style { (PreEscaped(STYLE)) }
                script src="/assets/htmx.min.js" defer {}
            }
            body {
                nav {
                    a href="/" { "Overview" }
                    a href="/pending" { "Pending" }
                    a href="/dead" { "Dead letters" }
                    a href="/suppression" { "Suppression" }
                    form action="/job" method="get" {
                        input name="key" placeholder="job key" aria-label="job key";
                        button { "Find job" }
                    }
                    span.who {
                        (who.name) " · "
                        (if who.role == Role::Operate { "may act" } else { "read-only" })
                        " "
                        form action="/logout" method="post" { button { "Sign out" } }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// A bare page with a title and one message (a refusal, an action's result).
pub(super) fn notice(title: &str, message: &str) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head { meta charset="utf-8"; title { (title) } style { (PreEscaped(STYLE)) } }
            body { main { h1 { (title) } p { (message) } p { a href="/" { "Back to the overview" } } } }
        }
    }
}

/// The sign-in page, with a reason if a token was refused.
pub(super) fn login(refused: Option<&str>) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head { meta charset="utf-8"; title { "Sign in · postie console" } style { (PreEscaped(STYLE)) } }
            body { main {
                h1 { "postie console: sign in" }
                @if let Some(why) = refused { p.danger { (why) } }
                form action="/login" method="post" {
                    label { "Token " input type="password" name="token" autocomplete="current-password"; }
                    " " button { "Sign in" }
                }
            } }
        }
    }
}

/// An action's form: a POST to `action` with the CSRF token, `fields` as hidden
/// inputs, and one button; nothing for a read-only principal.
pub(super) fn action(
    who: &Principal,
    action: &str,
    fields: &[(&str, &str)],
    button: &str,
) -> Markup {
    if who.role != Role::Operate {
        return html! {};
    }
    html! {
        form.inline action=(action) method="post" {
            input type="hidden" name="csrf" value=(who.csrf);
            @for (name, value) in fields { input type="hidden" name=(name) value=(value); }
            button { (button) }
        }
    }
}

/// A table with a header row.
pub(super) fn table(header: &[&str], rows: impl IntoIterator<Item = Markup>) -> Markup {
    html! {
        table {
            tr { @for h in header { th { (h) } } }
            @for row in rows { (row) }
        }
    }
}

/// A page's result: what an action did, and where to go next.
pub(super) fn done(who: &Principal, title: &str, message: &str, back: &str) -> Markup {
    frame(
        title,
        who,
        html! { p { (message) } p { a href=(back) { "Back" } } },
    )
}
