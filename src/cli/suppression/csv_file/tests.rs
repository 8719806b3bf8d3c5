//! `csv_file`'s unit and property tests.

use super::*;
use proptest::prelude::*;

#[test]
fn a_cell_a_spreadsheet_would_evaluate_is_neutralised_and_reads_back() {
    for (cell, written) in [
        (
            "=HYPERLINK(\"http://evil.example\")@x.example",
            "'=HYPERLINK(\"http://evil.example\")@x.example",
        ),
        ("+1@example.com", "'+1@example.com"),
        ("-2@example.com", "'-2@example.com"),
        ("@SUM(1)", "'@SUM(1)"),
        ("\tcmd", "'\tcmd"),
        ("\rcmd", "'\rcmd"),
        ("'quoted@example.com", "''quoted@example.com"),
        ("ann@example.com", "ann@example.com"),
        ("", ""),
    ] {
        assert_eq!(neutralise(cell), written, "{cell:?}");
        assert_eq!(restore(&neutralise(cell)), cell, "{cell:?}");
    }
    // Someone else's quote before an ordinary character is kept.
    assert_eq!(restore("'bob@example.com"), "'bob@example.com");
}

#[test]
fn an_endless_line_is_refused_at_the_bound_without_reading_on() {
    struct Counting<R>(R, u64);
    impl<R: Read> Read for Counting<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.read(buf)?;
            self.1 += n as u64;
            Ok(n)
        }
    }
    // 64 MiB without a line break.
    let mut input = Counting(std::io::repeat(b'a').take(64 << 20), 0);
    let error = read(&mut input, SuppressionReason::Manual, 10)
        .unwrap_err()
        .to_string();
    assert!(error.contains("longer than"), "{error}");
    let bound = 10 * BYTES_PER_ROW + HEADER_BYTES;
    assert!(input.1 <= bound + 64 * 1024, "read {} bytes", input.1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any bytes at all: an answer (entries or a refusal), never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let _ = read(bytes.as_slice(), SuppressionReason::Manual, 50);
    }

    /// CSV-shaped noise (quotes, commas, line breaks, formula marks) after a
    /// header that names an address: read or refused, never a panic, and every
    /// entry read has an address with an `@` in it.
    #[test]
    fn csv_shaped_noise_is_read_or_refused(
        rows in proptest::collection::vec("[a-z@=+'\"\\-,\r\n\t ]{0,40}", 0..40)
    ) {
        let text = format!("address,reason,evidence\n{}", rows.join("\n"));
        if let Ok(entries) = read(text.as_bytes(), SuppressionReason::Manual, 50) {
            for e in entries {
                prop_assert!(e.address.contains('@'));
            }
        }
    }

    /// Every address export can write reads back as it was.
    #[test]
    fn an_export_reads_back_exactly(local in "[=+@'\\-]?[a-z0-9.=+'-]{1,20}") {
        let address = format!("{local}@example.com");
        let mut out = Vec::new();
        {
            let mut writer = csv::Writer::from_writer(&mut out);
            writer.write_record(HEADER).unwrap();
            let cells = [address.as_str(), "*", "manual", "cli", "2026-12-01T00:00:00Z", "", ""];
            writer.write_record(cells.map(neutralise).iter().map(|c| c.as_ref())).unwrap();
        }
        let entries = read(out.as_slice(), SuppressionReason::Manual, 10).unwrap();
        prop_assert_eq!(&entries[0].address, &address);
    }
}

fn read_text(text: &str) -> anyhow::Result<Vec<SuppressionEntry>> {
    read(text.as_bytes(), SuppressionReason::Manual, 100)
}

#[test]
fn postie_s_own_export_reads_back() {
    let text = "address,scope,reason,source,created_at,expires_at,evidence\n\
                ann@example.com,*,complaint,cli,2026-12-01T00:00:00Z,,\"ARF, report 42\"\n\
                bob@example.com,newsletter,manual,cli,2026-12-01T00:00:00Z,2027-01-01T00:00:00Z,\n";
    let entries = read_text(text).unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0].reason, SuppressionReason::Complaint);
    assert_eq!(entries[0].evidence.as_deref(), Some("ARF, report 42"));
    assert_eq!(entries[1].scope, "newsletter");
    assert!(entries[1].expires_at.is_some());
}

#[test]
fn a_provider_s_columns_and_words_are_understood() {
    let text =
        "Email Address,Reason,Last Update\nx@example.com,BOUNCE,2026\ny@example.com,spamreport,\n";
    let entries = read_text(text).unwrap();
    assert_eq!(entries[0].reason, SuppressionReason::HardBounce);
    assert_eq!(entries[1].reason, SuppressionReason::Complaint);
    assert_eq!(entries[0].scope, "*");
}

#[test]
fn one_bad_row_refuses_the_file_naming_its_line() {
    let text =
        "email,reason\nok@example.com,manual\nnot-an-address,manual\nz@example.com,sometimes\n";
    let error = read_text(text).unwrap_err().to_string();
    assert!(error.contains("2 bad rows"), "{error}");
    assert!(
        error.contains("line 3") && error.contains("not-an-address"),
        "{error}"
    );
    assert!(
        error.contains("line 4") && error.contains("sometimes"),
        "{error}"
    );
    let no_address = read_text("name,reason\nann,manual\n")
        .unwrap_err()
        .to_string();
    assert!(no_address.contains("no address column"), "{no_address}");
}

#[test]
fn more_rows_than_allowed_is_refused() {
    let text = "email\na@example.com\nb@example.com\nc@example.com\n";
    let error = read(text.as_bytes(), SuppressionReason::Manual, 2).unwrap_err();
    assert!(error.to_string().contains("--max-rows 2"), "{error}");
}
