//! A file server for postie's `url` attachments, on the API listener (so that down
//! mode takes it down too): `GET /files/{seed}/{size}` answers `size` bytes made from
//! `seed` by [`file_byte`] (tests compute the same bytes and their SHA-256), made
//! once and kept (the last one asked for), streamed in 64 KiB chunks; `?corrupt=true` flips the last byte (a digest mismatch);
//! `GET /redirect?to=URL` answers 302 to `URL`. Any other path is 404.

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::Deserialize;

/// Byte `i` of the file made from `seed` (tests/support/files.rs has the same).
pub(crate) fn file_byte(seed: u64, i: u64) -> u8 {
    let x = (i ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x >> 56) as u8
}

const CHUNK: usize = 64 * 1024;

/// The last file made: (seed, size, bytes). Many jobs ask for the same file, and a
/// debug build makes 20 MB slowly.
static LAST: std::sync::Mutex<Option<(u64, u64, Bytes)>> = std::sync::Mutex::new(None);

/// File `seed` of `size` bytes, made or kept.
fn made(seed: u64, size: u64) -> Bytes {
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((s, n, bytes)) = last.as_ref() {
        if (*s, *n) == (seed, size) {
            return bytes.clone();
        }
    }
    let bytes = Bytes::from((0..size).map(|i| file_byte(seed, i)).collect::<Vec<u8>>());
    *last = Some((seed, size, bytes.clone()));
    bytes
}

/// The file routes.
pub(crate) fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/files/{seed}/{size}", get(file))
        .route("/redirect", get(redirect))
}

#[derive(Deserialize)]
struct FileQuery {
    #[serde(default)]
    corrupt: bool,
}

async fn file(Path((seed, size)): Path<(u64, u64)>, Query(q): Query<FileQuery>) -> Response {
    let file = tokio::task::spawn_blocking(move || made(seed, size))
        .await
        .unwrap_or_default();
    let len = file.len();
    let chunks = (0..len.div_ceil(CHUNK)).map(move |n| {
        let (from, to) = (n * CHUNK, ((n + 1) * CHUNK).min(len));
        let mut chunk = file.slice(from..to);
        if q.corrupt && to == len {
            let mut bent = chunk.to_vec();
            if let Some(last) = bent.last_mut() {
                *last ^= 0xff;
            }
            chunk = Bytes::from(bent);
        }
        Ok::<_, std::io::Error>(chunk)
    });
    (
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        Body::from_stream(futures_util::stream::iter(chunks)),
    )
        .into_response()
}

#[derive(Deserialize)]
struct RedirectQuery {
    to: String,
}

async fn redirect(Query(q): Query<RedirectQuery>) -> Response {
    (StatusCode::FOUND, [(header::LOCATION, q.to)]).into_response()
}
