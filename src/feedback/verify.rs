//! The signatures the webhooks carry, checked with `ring` (already in the tree through
//! rustls): SNS's RSA (SHA-1 or SHA-256, PKCS#1 v1.5) by the key of an X.509
//! certificate, SendGrid's ECDSA P-256 by a SubjectPublicKeyInfo, Mailgun's
//! HMAC-SHA256, and Postmark's basic-auth password compared in constant time.
//!
//! The key is read from the certificate by a minimal DER walk (tbsCertificate's
//! seventh field), and so is its subject's common name (the sixth): the certificate
//! itself is trusted by where it came from (a configured file, or HTTPS from an
//! allow-listed host) and, when fetched, by naming SNS as its subject.

use base64::Engine;
use ring::signature::{self, UnparsedPublicKey};
use sha2::{Digest, Sha256};

/// RSA's digest, by SNS's `SignatureVersion`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RsaDigest {
    /// `SignatureVersion` 1: SHA1withRSA.
    Sha1,
    /// `SignatureVersion` 2: SHA256withRSA.
    Sha256,
}

/// The DER of the first `CERTIFICATE` block of a PEM text.
pub(crate) fn pem_certificate(pem: &str) -> Option<Vec<u8>> {
    let start = pem.find("-----BEGIN CERTIFICATE-----")? + "-----BEGIN CERTIFICATE-----".len();
    let end = start + pem[start..].find("-----END CERTIFICATE-----")?;
    let b64: String = pem[start..end]
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    base64::engine::general_purpose::STANDARD.decode(b64).ok()
}

/// One DER element: (tag, contents, the rest after it).
fn tlv(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | b as usize);
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// A DER certificate's TBSCertificate fields from its serial number on: the optional
/// `[0]` version passed over, then `skip` more fields (serial, signature, issuer,
/// validity, subject, spki in that order).
fn tbs_field(cert: &[u8], skip: usize) -> Option<&[u8]> {
    let (0x30, cert, _) = tlv(cert)? else {
        return None;
    };
    let (0x30, mut tbs, _) = tlv(cert)? else {
        return None;
    };
    if tbs.first() == Some(&0xa0) {
        tbs = tlv(tbs)?.2;
    }
    for _ in 0..skip {
        tbs = tlv(tbs)?.2;
    }
    Some(tbs)
}

/// The SubjectPublicKeyInfo (whole element) of a DER certificate.
pub(crate) fn certificate_spki(cert: &[u8]) -> Option<&[u8]> {
    // Past serial, signature, issuer, validity and subject.
    let tbs = tbs_field(cert, 5)?;
    let (tag, _, rest) = tlv(tbs)?;
    (tag == 0x30).then(|| &tbs[..tbs.len() - rest.len()])
}

/// The subject's last common name (OID 2.5.4.3) of a DER certificate, as text.
pub(crate) fn certificate_common_name(cert: &[u8]) -> Option<String> {
    // Past serial, signature, issuer and validity: the subject.
    let (0x30, mut names, _) = tlv(tbs_field(cert, 4)?)? else {
        return None;
    };
    let mut common = None;
    // A SEQUENCE of SETs of SEQUENCE { OID, value }.
    while let Some((0x31, mut set, rest)) = tlv(names) {
        while let Some((0x30, pair, after)) = tlv(set) {
            if let Some((0x06, oid, value)) = tlv(pair) {
                // UTF8String, PrintableString, T61String, IA5String.
                if let (b"\x55\x04\x03", Some((0x0c | 0x13 | 0x14 | 0x16, text, _))) =
                    (oid, tlv(value))
                {
                    common = std::str::from_utf8(text).ok().map(str::to_string);
                }
            }
            set = after;
        }
        names = rest;
    }
    common
}

/// The key bits of a SubjectPublicKeyInfo (the BIT STRING without its pad byte).
fn spki_key(spki: &[u8]) -> Option<&[u8]> {
    let (0x30, spki, _) = tlv(spki)? else {
        return None;
    };
    let (0x30, _, rest) = tlv(spki)? else {
        return None;
    };
    let (0x03, bits, _) = tlv(rest)? else {
        return None;
    };
    match bits.split_first()? {
        (0, key) => Some(key),
        _ => None,
    }
}

/// Whether `sig` is the RSA PKCS#1 v1.5 signature of `msg` by `cert`'s key.
pub(crate) fn rsa_valid(cert: &[u8], digest: RsaDigest, msg: &[u8], sig: &[u8]) -> bool {
    let Some(key) = certificate_spki(cert).and_then(spki_key) else {
        return false;
    };
    let alg: &dyn signature::VerificationAlgorithm = match digest {
        RsaDigest::Sha1 => &signature::RSA_PKCS1_2048_8192_SHA1_FOR_LEGACY_USE_ONLY,
        RsaDigest::Sha256 => &signature::RSA_PKCS1_2048_8192_SHA256,
    };
    UnparsedPublicKey::new(alg, key).verify(msg, sig).is_ok()
}

/// Whether `sig` (ASN.1 DER) is the ECDSA P-256/SHA-256 signature of `msg` by the key
/// of `spki` (DER).
pub(crate) fn p256_valid(spki: &[u8], msg: &[u8], sig: &[u8]) -> bool {
    let Some(key) = spki_key(spki) else {
        return false;
    };
    UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_ASN1, key)
        .verify(msg, sig)
        .is_ok()
}

/// Whether `hex_sig` is HMAC-SHA256(`key`, `msg`) in hex (compared in constant time).
pub(crate) fn hmac_valid(key: &[u8], msg: &[u8], hex_sig: &str) -> bool {
    let Ok(sig) = hex::decode(hex_sig.trim()) else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    ring::hmac::verify(&key, msg, &sig).is_ok()
}

/// Equal texts, compared without an early exit (their SHA-256 digests, so that the
/// length says nothing either).
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_walk_refuses_truncated_input_and_secrets_compare() {
        assert!(tlv(&[0x30, 0x05, 1, 2]).is_none());
        assert_eq!(
            tlv(&[0x02, 0x01, 7, 9]),
            Some((0x02, &[7u8][..], &[9u8][..]))
        );
        assert_eq!(
            tlv(&[0x04, 0x81, 0x01, 5]),
            Some((0x04, &[5u8][..], &[][..]))
        );
        assert!(certificate_spki(&[0x30, 0x00]).is_none());
        assert!(same_secret("hunter2", "hunter2"));
        assert!(!same_secret("hunter2", "hunter3"));
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"k");
        let tag = ring::hmac::sign(&key, b"msg");
        assert!(hmac_valid(b"k", b"msg", &hex::encode(tag.as_ref())));
        assert!(!hmac_valid(b"k", b"msg2", &hex::encode(tag.as_ref())));
        assert!(pem_certificate("no pem here").is_none());
    }
}
