//! How strong a console token is, judged once at start-up, and how to make one.
//!
//! A token's entropy is judged as its length times the bits of the smallest common
//! alphabet that holds every character of it: digits (3.3 bits), hexadecimal of one
//! case (4), letters of one case (4.7), one case and digits (5.2), letters (5.7),
//! letters and digits (5.95), base64 or base64url (6; trailing `=` not counted), any
//! other printable text (6.6). At least 128 bits are needed (32 hex characters, 22
//! from mixed-case letters and digits), and at least 8 different characters (no
//! `aaaa…`). This catches short and repetitive tokens, not a guessable phrase made
//! long: make tokens with [`generate`] (`postie console --new-token`) or
//! `openssl rand -hex 32`.

use base64::Engine as _;
use ring::rand::{SecureRandom, SystemRandom};

/// The least a token must be judged to hold.
pub(crate) const MIN_BITS: f64 = 128.0;
/// The fewest different characters a token must have.
const MIN_DISTINCT: usize = 8;

/// An alphabet: its name, its size, and whether it holds a byte.
type Alphabet = (&'static str, f64, fn(u8) -> bool);

/// The alphabets tried, smallest first.
const ALPHABETS: [Alphabet; 9] = [
    ("digits", 10.0, |b| b.is_ascii_digit()),
    (
        "lower-case hex",
        16.0,
        |b| matches!(b, b'0'..=b'9' | b'a'..=b'f'),
    ),
    (
        "upper-case hex",
        16.0,
        |b| matches!(b, b'0'..=b'9' | b'A'..=b'F'),
    ),
    ("letters of one case", 26.0, |b| b.is_ascii_lowercase()),
    ("letters of one case", 26.0, |b| b.is_ascii_uppercase()),
    ("letters of one case and digits", 36.0, |b| {
        b.is_ascii_lowercase() || b.is_ascii_digit()
    }),
    ("letters of one case and digits", 36.0, |b| {
        b.is_ascii_uppercase() || b.is_ascii_digit()
    }),
    ("letters", 52.0, |b| b.is_ascii_alphabetic()),
    ("letters and digits", 62.0, |b| b.is_ascii_alphanumeric()),
];

/// A token's judged strength, or why it is too weak (never quoting it).
pub(crate) fn judge(token: &str) -> Result<f64, String> {
    let counted = token.trim_end_matches('=');
    let bytes = counted.as_bytes();
    let (alphabet, size) = ALPHABETS
        .iter()
        .find(|(_, _, holds)| bytes.iter().all(|b| holds(*b)))
        .map(|(name, size, _)| (*name, *size))
        .unwrap_or_else(|| {
            let base64 = |b: &u8| b.is_ascii_alphanumeric() || b"-_+/".contains(b);
            if bytes.iter().all(base64) {
                ("base64", 64.0)
            } else {
                ("printable text", 95.0)
            }
        });
    let length = counted.chars().count();
    let bits = length as f64 * f64::log2(size);
    let mut distinct: Vec<char> = counted.chars().collect();
    distinct.sort_unstable();
    distinct.dedup();
    if bits < MIN_BITS {
        let plural = if length == 1 { "" } else { "s" };
        return Err(format!(
            "about {bits:.0} bits ({length} character{plural} of {alphabet}), under the 128 \
             bits a token needs"
        ));
    }
    if distinct.len() < MIN_DISTINCT {
        return Err(format!(
            "only {} different characters, under the {MIN_DISTINCT} a token of 128 bits \
             needs",
            distinct.len()
        ));
    }
    Ok(bits)
}

/// A new token: 32 random bytes (256 bits) as base64url, 43 characters.
pub(crate) fn generate() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| anyhow::anyhow!("no random numbers for a token"))?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn short_or_repetitive_tokens_are_refused_and_the_usual_ones_pass() {
        // 31 hex characters: 124 bits.
        for weak in ["a", "correct-horse", "0123456789abcdef0123456789abcde"] {
            let why = judge(weak).unwrap_err();
            assert!(why.contains("128 bits"), "{why}");
            assert!(
                weak.len() < 4 || !why.contains(weak),
                "it quotes the token: {why}"
            );
        }
        let repeated = "a".repeat(60);
        assert!(judge(&repeated)
            .unwrap_err()
            .contains("different characters"));
        assert!(judge(&"ab".repeat(40)).is_err());
        assert_eq!(
            judge("0123456789abcdef0123456789abcdef").unwrap(),
            128.0,
            "32 hex characters"
        );
        // 22 characters of letters and digits: 131 bits.
        assert!(judge("q3Zk7Vd0r8QwL1mXp5sJt2").is_ok());
        assert!(judge("q3Zk7Vd0r8QwL1mXp5sJt").is_err(), "21: 125 bits");
        // base64 with its padding, which counts for nothing.
        assert!(judge("3q2+7w8ZkQ1mXp5sJt2nYb6cHf9gEa4uRiKoN0Wsl/0=").is_ok());
    }

    #[test]
    fn generated_tokens_are_strong_and_differ() {
        let (a, b) = (generate().unwrap(), generate().unwrap());
        assert_eq!(a.len(), 43);
        assert_ne!(a, b);
        assert!(judge(&a).unwrap() >= 200.0);
    }

    proptest! {
        /// Random tokens of 128 bits and more pass: hex from 16 bytes (`openssl rand
        /// -hex 16`, 32 characters), base64 from 24 (32 characters: 22 could be
        /// letters alone by chance, 1 % of the time, and judged 125 bits).
        #[test]
        fn random_tokens_pass(bytes in proptest::collection::vec(any::<u8>(), 16..64)) {
            prop_assert!(judge(&hex::encode(&bytes)).is_ok());
            if bytes.len() >= 24 {
                let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes);
                prop_assert!(judge(&b64).is_ok(), "{}", b64);
                let padded = base64::engine::general_purpose::STANDARD.encode(&bytes);
                prop_assert!(judge(&padded).is_ok(), "{}", padded);
            }
        }

        /// Nothing a token may hold makes the judge panic.
        #[test]
        fn any_text_is_judged(text in ".*") {
            let _ = judge(&text);
        }
    }
}
