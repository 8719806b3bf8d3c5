//! An action's request: a POST by a principal who may act, with their CSRF token
//! in its form ([`Auth::check_action`](super::auth::Auth::check_action)).

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Form;

use super::auth::Principal;
use super::{page, Console};

/// An action refused (403), and why.
#[derive(Debug)]
pub(super) struct Refused(pub(super) &'static str);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        (StatusCode::FORBIDDEN, page::notice("Forbidden", self.0)).into_response()
    }
}

/// A form that carries the CSRF token.
pub(super) trait Csrf {
    /// The form's `csrf` field.
    fn csrf(&self) -> &str;
}

/// An action's request: its principal, who may act, and its form, whose CSRF token is
/// theirs; else 401, or 403 ([`Auth::check_action`](super::auth::Auth::check_action)).
pub(super) struct Action<F>(pub(super) Principal, pub(super) F);

impl<F> FromRequest<std::sync::Arc<Console>> for Action<F>
where
    F: serde::de::DeserializeOwned + Csrf + Send,
{
    type Rejection = Response;

    async fn from_request(
        request: Request,
        console: &std::sync::Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = request.into_parts();
        let who = Principal::from_request_parts(&mut parts, console).await?;
        let Form(form) = Form::<F>::from_request(Request::from_parts(parts, body), console)
            .await
            .map_err(IntoResponse::into_response)?;
        console
            .auth
            .check_action(&who, form.csrf())
            .map_err(IntoResponse::into_response)?;
        Ok(Self(who, form))
    }
}
