//! Checks an AWS Signature Version 4 `Authorization` header the way SES does: the
//! signature is recomputed from the request (method, path, query, the signed headers,
//! the body's SHA-256) with the test secret key, and compared.

use axum::http::{HeaderMap, Method, Uri};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Why a signature was refused: SES's error type and message.
#[derive(Debug)]
pub(crate) struct Refusal {
    /// `UnrecognizedClientException`, `SignatureDoesNotMatch`, `IncompleteSignatureException`.
    pub(crate) kind: &'static str,
    /// SES's message.
    pub(crate) message: String,
}

fn refuse(kind: &'static str, message: &str) -> Refusal {
    Refusal {
        kind,
        message: message.to_string(),
    }
}

/// The parts of `AWS4-HMAC-SHA256 Credential=AKID/DATE/REGION/SERVICE/aws4_request,
/// SignedHeaders=a;b, Signature=hex`.
struct Authorization<'a> {
    access_key: &'a str,
    scope: &'a str,
    date: &'a str,
    region: &'a str,
    service: &'a str,
    signed_headers: &'a str,
    signature: &'a str,
}

fn parse(header: &str) -> Option<Authorization<'_>> {
    let rest = header.strip_prefix("AWS4-HMAC-SHA256 ")?;
    let (mut credential, mut signed_headers, mut signature) = (None, None, None);
    for part in rest.split(',').map(str::trim) {
        if let Some(v) = part.strip_prefix("Credential=") {
            credential = Some(v);
        } else if let Some(v) = part.strip_prefix("SignedHeaders=") {
            signed_headers = Some(v);
        } else if let Some(v) = part.strip_prefix("Signature=") {
            signature = Some(v);
        }
    }
    let credential = credential?;
    let (access_key, scope) = credential.split_once('/')?;
    let mut fields = scope.split('/');
    let (date, region, service, terminal) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    (terminal == "aws4_request").then_some(Authorization {
        access_key,
        scope,
        date,
        region,
        service,
        signed_headers: signed_headers?,
        signature: signature?,
    })
}

fn hmac(key: &[u8], data: &str) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(data.as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// The canonical request of SigV4 (for a path and query without characters to encode,
/// which is all SES's `SendEmail` and `GetAccount` use). The payload hash is
/// `x-amz-content-sha256` when sent, else the body's SHA-256 (that of the empty string
/// for a GET).
fn canonical_request(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    signed: &str,
    body: &[u8],
) -> String {
    let mut query: Vec<&str> = uri.query().unwrap_or("").split('&').collect();
    query.retain(|q| !q.is_empty());
    query.sort_unstable();
    let canonical_headers: String = signed
        .split(';')
        .map(|name| {
            let values: Vec<String> = headers
                .get_all(name)
                .iter()
                .map(|v| {
                    let v = String::from_utf8_lossy(v.as_bytes());
                    v.split_whitespace().collect::<Vec<_>>().join(" ")
                })
                .collect();
            format!("{name}:{}\n", values.join(","))
        })
        .collect();
    let payload = headers
        .get("x-amz-content-sha256")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| hex::encode(Sha256::digest(body)));
    format!(
        "{method}\n{}\n{}\n{canonical_headers}\n{signed}\n{payload}",
        uri.path(),
        query.join("&")
    )
}

/// The signature of canonical request `creq` under `auth`'s scope, made at `amz_date`.
fn signature(secret: &str, auth: &Authorization<'_>, amz_date: &str, creq: &str) -> String {
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{}\n{}",
        auth.scope,
        hex::encode(Sha256::digest(creq.as_bytes()))
    );
    let mut key = hmac(format!("AWS4{secret}").as_bytes(), auth.date);
    for part in [auth.region, auth.service, "aws4_request"] {
        key = hmac(&key, part);
    }
    hex::encode(hmac(&key, &string_to_sign))
}

/// Checks the request's signature against `access_key`/`secret`, as SES `service`.
pub(crate) fn verify(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    (access_key, secret): (&str, &str),
) -> Result<(), Refusal> {
    let header = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            refuse(
                "MissingAuthenticationTokenException",
                "Missing Authentication Token",
            )
        })?;
    let auth = parse(header).ok_or_else(|| {
        refuse(
            "IncompleteSignatureException",
            "Authorization header requires 'Credential', 'Signature' and 'SignedHeaders'.",
        )
    })?;
    if auth.access_key != access_key {
        return Err(refuse(
            "UnrecognizedClientException",
            "The security token included in the request is invalid.",
        ));
    }
    let amz_date = headers
        .get("x-amz-date")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let signs_host = auth.signed_headers.split(';').any(|h| h == "host");
    if !amz_date.starts_with(auth.date) || auth.service != "ses" || !signs_host {
        return Err(refuse(
            "SignatureDoesNotMatch",
            "Credential should be scoped to a valid date, region and the service 'ses', and sign the host.",
        ));
    }
    let creq = canonical_request(method, uri, headers, auth.signed_headers, body);
    if signature(secret, &auth, amz_date, &creq) != auth.signature {
        return Err(refuse(
            "SignatureDoesNotMatch",
            "The request signature we calculated does not match the signature you provided. \
             Check your AWS Secret Access Key and signing method. Consult the service documentation for details.",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE_AUTHORIZATION: &str = "AWS4-HMAC-SHA256 \
        Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
        SignedHeaders=host;x-amz-date, \
        Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31";

    /// AWS's SigV4 test suite, `get-vanilla`: a GET without a body (its payload hash is
    /// the empty string's) has AWS's published signature here too.
    #[test]
    fn get_vanilla_has_the_published_signature() {
        let mut headers = HeaderMap::new();
        headers.insert("host", "example.amazonaws.com".parse().unwrap());
        headers.insert("x-amz-date", "20150830T123600Z".parse().unwrap());
        let auth = parse(EXAMPLE_AUTHORIZATION).unwrap();
        let creq = canonical_request(
            &Method::GET,
            &"/".parse().unwrap(),
            &headers,
            auth.signed_headers,
            b"",
        );
        assert!(
            creq.ends_with("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            "{creq}"
        );
        assert_eq!(
            signature(
                "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
                &auth,
                "20150830T123600Z",
                &creq
            ),
            auth.signature
        );
    }
}
