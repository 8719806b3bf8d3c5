//! The hostile-input corpus (issue 5), end to end: every case under `tests/hostile/`
//! goes through the real broker to an in-process `postie serve`, interleaved with good
//! jobs. Each hostile case must reach the dead-letter queue with a readable reason that
//! names what is wrong with it; the good cases and the good jobs must each be sent
//! exactly once, with no header that the producer did not ask for; nothing may panic;
//! the instance must keep serving. The corpus format is described in
//! `tests/hostile/README.md`.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use postie::testing::contract::IdempotencyKey;
use postie::testing::headers::HEADER_DEAD_KIND;
use serde::Deserialize;
use support::sink::SinkMessage;
use support::{job, DeadLetter, TestEnv};

/// AMQP header naming the case on every publish; dead letters keep it.
const CASE_HEADER: &str = "hostile-case";
/// Recipient of the good jobs and default envelope of good corpus cases.
const GOOD_RCPT: &str = "ok@example.com";
/// Envelope sender of every job in the corpus.
const SENDER: &str = "noreply@shop.example";
/// Every injection payload in the corpus names a host under this domain; no good
/// case does, so it must never show up in the header section of a sent email.
const INJECTED_DOMAIN: &str = "evil.example";
/// Header names postie itself writes; anything else must come from the job's `headers`.
const POSTIE_HEADERS: &[&str] = &[
    "from",
    "to",
    "cc",
    "reply-to",
    "subject",
    "message-id",
    "date",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
];
/// A reason longer than this is not something a person reads.
const MAX_REASON_BYTES: usize = 1024;
/// How long every case gets to reach its outcome.
const SETTLE: Duration = Duration::from_secs(30);

/// `NN-name.props.json`: what to publish around the body and what must happen to it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Sidecar {
    expect: PerVariant<Expected>,
    #[serde(default)]
    reason: Option<PerVariant<String>>,
    #[serde(default)]
    kind: Option<OneOrMany>,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    rcpt: Option<Vec<String>>,
    #[serde(default = "json_content_type")]
    content_type: serde_json::Value,
    #[serde(default)]
    content_encoding: Option<String>,
    #[serde(default)]
    message_id: Option<String>,
    #[serde(default)]
    timestamp: Option<u64>,
    #[serde(default)]
    headers: BTreeMap<String, Typed>,
    #[serde(default)]
    variants: Option<String>,
    #[serde(default)]
    generate: Option<Vec<Segment>>,
    #[serde(default)]
    sink_faults: Vec<serde_json::Value>,
    #[serde(default)]
    #[allow(dead_code)]
    note: Option<String>,
}

/// `"invalid"` or `["invalid", "permanent"]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(one) => vec![one],
            Self::Many(many) => many,
        }
    }
}

fn json_content_type() -> serde_json::Value {
    "application/json".into()
}

/// One value for every variant, or one per variant name (`"*"` for the rest).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum PerVariant<T> {
    One(T),
    Each(BTreeMap<String, T>),
}

impl<T: Clone> PerVariant<T> {
    fn get(&self, variant: Option<&str>) -> Option<T> {
        match self {
            Self::One(value) => Some(value.clone()),
            Self::Each(map) => variant
                .and_then(|v| map.get(v))
                .or_else(|| map.get("*"))
                .cloned(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Expected {
    /// Dead-lettered with the reason.
    Dead,
    /// Sent exactly once.
    Sent,
    /// Either, exactly once, but never lost and never a panic.
    Handled,
}

/// A typed AMQP field value: `{"string": "soon"}`, `{"int": -5}`, …
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Typed {
    String(String),
    BytesHex(String),
    Int(i64),
    Float(f64),
    Float32(f32),
    Bool(bool),
    Void(()),
    Array(Vec<Typed>),
    Table(BTreeMap<String, Typed>),
    Timestamp(u64),
}

impl Typed {
    fn to_amqp(&self) -> AMQPValue {
        match self {
            Self::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
            Self::BytesHex(hex_text) => {
                let bytes = hex::decode(hex_text.replace(' ', "")).expect("bytes_hex is hex");
                AMQPValue::LongString(LongString::from(bytes))
            }
            Self::Int(n) => AMQPValue::LongLongInt(*n),
            Self::Float(f) => AMQPValue::Double(*f),
            Self::Float32(f) => AMQPValue::Float(*f),
            Self::Bool(b) => AMQPValue::Boolean(*b),
            Self::Void(()) => AMQPValue::Void,
            Self::Array(items) => AMQPValue::FieldArray(FieldArray::from(
                items.iter().map(Typed::to_amqp).collect::<Vec<_>>(),
            )),
            Self::Table(map) => AMQPValue::FieldTable(table(map)),
            Self::Timestamp(t) => AMQPValue::Timestamp(*t),
        }
    }
}

fn table(map: &BTreeMap<String, Typed>) -> FieldTable {
    let mut out = FieldTable::default();
    for (name, value) in map {
        out.insert(ShortString::from(name.as_str()), value.to_amqp());
    }
    out
}

/// A piece of a body generated at test time.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Segment {
    Text { text: String },
    Repeat { repeat: String, times: usize },
    PadTo { pad_to: usize, with: String },
}

fn generate(segments: &[Segment]) -> Vec<u8> {
    let fixed: usize = segments
        .iter()
        .map(|s| match s {
            Segment::Text { text } => text.len(),
            Segment::Repeat { repeat, times } => repeat.len() * times,
            Segment::PadTo { .. } => 0,
        })
        .sum();
    let mut body = Vec::new();
    for segment in segments {
        match segment {
            Segment::Text { text } => body.extend_from_slice(text.as_bytes()),
            Segment::Repeat { repeat, times } => body.extend(repeat.as_bytes().repeat(*times)),
            Segment::PadTo { pad_to, with } => {
                assert_eq!(with.len(), 1, "pad_to pads with one byte");
                let pad = pad_to
                    .checked_sub(fixed)
                    .expect("pad_to is beyond the rest");
                body.extend(with.as_bytes().repeat(pad));
            }
        }
    }
    if let Some(target) = segments.iter().find_map(|s| match s {
        Segment::PadTo { pad_to, .. } => Some(*pad_to),
        _ => None,
    }) {
        assert_eq!(body.len(), target);
    }
    body
}

/// The characters that end, fold or hide in a header line, and the JSON escape that
/// puts each one into a body at `@CTRL@`.
const LINE_BREAKERS: &[(&str, &str)] = &[
    ("cr", "\\r"),
    ("lf", "\\n"),
    ("nul", "\\u0000"),
    ("u2028", "\\u2028"),
    ("u2029", "\\u2029"),
    ("u0085", "\\u0085"),
];

/// One publish and what must come of it.
struct Case {
    name: String,
    body: Vec<u8>,
    properties: BasicProperties,
    expect: Expected,
    reason: String,
    /// Acceptable `postie-dead-kind`s of the dead letter (empty: any).
    kinds: Vec<String>,
    /// The Message-ID an email for this case would carry, if its key is known.
    message_id: Option<String>,
    rcpt: Vec<String>,
    /// Header names the job itself asks for (allowed in the sent email).
    job_headers: Vec<String>,
    from_corpus: bool,
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hostile")
}

fn replace(haystack: &[u8], needle: &str, with: &str) -> Vec<u8> {
    let needle = needle.as_bytes();
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(needle) {
            out.extend_from_slice(with.as_bytes());
            i += needle.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    out
}

/// Reads every case file, expands variants; returns the cases, the sink fault rules
/// and the number of case files.
fn load_corpus(message_id_domain: &str) -> (Vec<Case>, Vec<serde_json::Value>, usize) {
    let dir = corpus_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("tests/hostile exists")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let stems: Vec<String> = names
        .iter()
        .filter_map(|n| n.strip_suffix(".props.json").map(str::to_string))
        .collect();
    for name in &names {
        let owned = name == "README.md"
            || stems.iter().any(|s| {
                name == &format!("{s}.props.json")
                    || name == &format!("{s}.json")
                    || name == &format!("{s}.bin")
            });
        assert!(
            owned,
            "tests/hostile/{name} has no NN-name.props.json sidecar"
        );
    }

    let mut cases = Vec::new();
    let mut faults = Vec::new();
    for stem in &stems {
        let sidecar_text = std::fs::read_to_string(dir.join(format!("{stem}.props.json"))).unwrap();
        let sidecar: Sidecar = serde_json::from_str(&sidecar_text)
            .unwrap_or_else(|e| panic!("tests/hostile/{stem}.props.json: {e}"));
        let files: Vec<PathBuf> = ["json", "bin"]
            .iter()
            .map(|ext| dir.join(format!("{stem}.{ext}")))
            .filter(|p| p.exists())
            .collect();
        let template = match (&sidecar.generate, files.as_slice()) {
            (Some(segments), []) => generate(segments),
            (None, [file]) => std::fs::read(file).unwrap(),
            _ => panic!("{stem}: give exactly one of {stem}.json, {stem}.bin or \"generate\""),
        };
        faults.extend(sidecar.sink_faults.iter().cloned());
        let variants: Vec<(Option<&str>, &str)> = match sidecar.variants.as_deref() {
            None => vec![(None, "")],
            Some("line-breakers") => LINE_BREAKERS.iter().map(|(n, e)| (Some(*n), *e)).collect(),
            Some(other) => panic!("{stem}: unknown variant set {other:?}"),
        };
        for (variant, escape) in variants {
            let name = match variant {
                Some(v) => format!("{stem}[{v}]"),
                None => stem.clone(),
            };
            let fill = |text: &[u8]| {
                let text = replace(text, "@CTRL@", escape);
                replace(&text, "@VARIANT@", variant.unwrap_or(""))
            };
            let body = if variant.is_some() {
                fill(&template)
            } else {
                template.clone()
            };
            let key = sidecar
                .key
                .as_ref()
                .map(|k| String::from_utf8(fill(k.as_bytes())).unwrap());
            let expect = sidecar
                .expect
                .get(variant)
                .unwrap_or_else(|| panic!("{name}: no \"expect\""));
            let reason = sidecar
                .reason
                .as_ref()
                .and_then(|r| r.get(variant))
                .unwrap_or_default();
            if expect == Expected::Dead {
                assert!(!reason.is_empty(), "{name}: a dead case needs a \"reason\"");
            }
            let job_headers = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| {
                    v.get("headers")
                        .and_then(|h| h.as_object())
                        .map(|h| h.keys().cloned().collect())
                })
                .unwrap_or_default();
            cases.push(Case {
                message_id: key
                    .as_deref()
                    .and_then(|k| IdempotencyKey::parse(k).ok())
                    .map(|k| k.message_id(message_id_domain)),
                properties: properties(&sidecar, &name),
                rcpt: sidecar
                    .rcpt
                    .clone()
                    .unwrap_or_else(|| vec![GOOD_RCPT.into()]),
                kinds: match (&sidecar.kind, expect) {
                    (Some(kind), _) => kind.clone().into_vec(),
                    (None, Expected::Dead) => vec!["invalid".into()],
                    (None, _) => Vec::new(),
                },
                name,
                body,
                expect,
                reason,
                job_headers,
                from_corpus: true,
            });
        }
    }
    (cases, faults, stems.len())
}

fn properties(sidecar: &Sidecar, name: &str) -> BasicProperties {
    let mut headers = table(&sidecar.headers);
    headers.insert(
        ShortString::from(CASE_HEADER),
        AMQPValue::LongString(LongString::from(name)),
    );
    let mut props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    match &sidecar.content_type {
        serde_json::Value::Null => {}
        serde_json::Value::String(ct) => props = props.with_content_type(ct.as_str().into()),
        other => panic!("{name}: content_type must be a string or null, not {other}"),
    }
    if let Some(encoding) = &sidecar.content_encoding {
        props = props.with_content_encoding(encoding.as_str().into());
    }
    if let Some(id) = &sidecar.message_id {
        props = props.with_message_id(id.as_str().into());
    }
    if let Some(ts) = sidecar.timestamp {
        props = props.with_timestamp(ts);
    }
    props
}

fn good_case(name: String, message_id_domain: &str) -> Case {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(CASE_HEADER),
        AMQPValue::LongString(LongString::from(name.as_str())),
    );
    Case {
        body: job(&name, GOOD_RCPT).to_string().into_bytes(),
        properties: postie::testing::broker::job_properties().with_headers(headers),
        expect: Expected::Sent,
        reason: String::new(),
        kinds: Vec::new(),
        message_id: Some(
            IdempotencyKey::parse(&name)
                .unwrap()
                .message_id(message_id_domain),
        ),
        rcpt: vec![GOOD_RCPT.into()],
        job_headers: Vec::new(),
        from_corpus: false,
        name,
    }
}

/// `HOSTILE_CASES=ctrl-in,-x-delay` runs only the cases whose name contains one of the
/// plain words and none of the `-` words (for working on one bug at a time).
fn select(corpus: Vec<Case>) -> Vec<Case> {
    let Ok(filter) = std::env::var("HOSTILE_CASES") else {
        return corpus;
    };
    let words: Vec<&str> = filter
        .split(',')
        .map(str::trim)
        .filter(|w| !w.is_empty())
        .collect();
    let (skip, only): (Vec<&str>, Vec<&str>) = words.iter().partition(|w| w.starts_with('-'));
    corpus
        .into_iter()
        .filter(|c| only.is_empty() || only.iter().any(|w| c.name.contains(w)))
        .filter(|c| !skip.iter().any(|w| c.name.contains(&w[1..])))
        .collect()
}

/// Records every panic in this test process (postie's delivery tasks included: tokio
/// would otherwise swallow them).
fn panics() -> &'static Mutex<Vec<String>> {
    static PANICS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    PANICS.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current().name().unwrap_or("?").to_string();
            if let Some(list) = PANICS.get() {
                list.lock()
                    .unwrap()
                    .push(format!("thread {thread}: {info}"));
            }
            previous(info);
        }));
        Mutex::new(Vec::new())
    })
}

/// Why a reason is not fit for a person, if it is not.
fn unreadable(reason: &str) -> Option<String> {
    if reason.trim().is_empty() {
        return Some("the reason is empty".into());
    }
    if reason.len() > MAX_REASON_BYTES {
        return Some(format!(
            "the reason is {} bytes (over {MAX_REASON_BYTES})",
            reason.len()
        ));
    }
    reason
        .chars()
        .find(|&c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}'))
        .map(|c| format!("the reason contains U+{:04X}: {reason:?}", c as u32))
}

/// Everything wrong with the header section of a sent email.
fn header_problems(raw: &str, job_headers: &[String], message_id: Option<&str>) -> Vec<String> {
    let mut problems = Vec::new();
    let head = match raw.find("\r\n\r\n") {
        Some(end) => &raw[..end],
        None => {
            problems.push("no empty line ends the header section".to_string());
            raw
        }
    };
    if !head.is_ascii() {
        problems.push("non-ASCII text in the header section (not RFC 2047 encoded)".into());
    }
    if head.to_ascii_lowercase().contains(INJECTED_DOMAIN) {
        problems.push(format!("the header section mentions {INJECTED_DOMAIN}"));
    }
    let mut fields: Vec<(String, String)> = Vec::new();
    for line in head.split("\r\n") {
        if line.contains(['\r', '\n']) {
            problems.push(format!("bare CR or LF in header line {line:?}"));
        }
        if line.starts_with([' ', '\t']) {
            match fields.last_mut() {
                Some((_, value)) => value.push_str(line),
                None => problems.push(format!("continuation before any header: {line:?}")),
            }
            continue;
        }
        match line.split_once(':') {
            Some((name, value))
                if !name.is_empty() && name.bytes().all(|b| (33..=126).contains(&b)) =>
            {
                fields.push((name.to_string(), value.to_string()))
            }
            _ => problems.push(format!("line {line:?} is not a header field")),
        }
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (name, value) in &fields {
        let lower = name.to_ascii_lowercase();
        if lower == "bcc" {
            problems.push(format!("Bcc header present: {value:?}"));
        } else if !POSTIE_HEADERS.contains(&lower.as_str())
            && !job_headers.iter().any(|h| h.eq_ignore_ascii_case(name))
        {
            problems.push(format!("header {name:?} was not asked for"));
        }
        if let Some(c) = value.chars().find(|&c| c.is_control() && c != '\t') {
            problems.push(format!("header {name} holds U+{:04X}", c as u32));
        }
        *seen.entry(lower).or_default() += 1;
    }
    for (name, count) in &seen {
        if *count > 1 {
            problems.push(format!("header {name} appears {count} times"));
        }
    }
    for required in ["from", "date", "message-id", "mime-version"] {
        if !seen.contains_key(required) {
            problems.push(format!("no {required} header"));
        }
    }
    if let Some(expected) = message_id {
        let got = fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("message-id"))
            .map(|(_, v)| v.trim());
        if got != Some(expected) {
            problems.push(format!("Message-ID {got:?}, expected {expected}"));
        }
    }
    problems
}

fn case_of(dead: &DeadLetter) -> Option<&str> {
    dead.headers.get(CASE_HEADER).map(String::as_str)
}

/// The outcomes seen so far for one case.
fn outcomes<'a>(
    case: &Case,
    dead: &'a [DeadLetter],
    sent: &'a [SinkMessage],
) -> (Vec<&'a DeadLetter>, Vec<&'a SinkMessage>) {
    let d = dead
        .iter()
        .filter(|d| case_of(d) == Some(case.name.as_str()))
        .collect();
    let s = sent
        .iter()
        .filter(|m| case.message_id.as_deref() == Some(m.message_id.as_str()))
        .collect();
    (d, s)
}

/// Everything wrong with one case's outcome.
fn judge(case: &Case, dead: &[&DeadLetter], sent: &[&SinkMessage]) -> Vec<String> {
    let mut problems = Vec::new();
    let dead_ok = |problems: &mut Vec<String>, letter: &DeadLetter, want_reason: Option<&str>| {
        let reason = letter.reason();
        if let Some(why) = unreadable(reason) {
            problems.push(why);
        }
        if let Some(expected) = want_reason {
            if !reason.contains(expected) {
                problems.push(format!("reason {reason:?} does not contain {expected:?}"));
            }
        }
        let kind = letter.headers.get(HEADER_DEAD_KIND).map(String::as_str);
        if !case.kinds.is_empty() && !case.kinds.iter().any(|k| Some(k.as_str()) == kind) {
            problems.push(format!(
                "dead kind {kind:?}, expected one of {:?}",
                case.kinds
            ));
        }
        if letter.body != case.body {
            problems.push(format!(
                "the dead letter's body ({} bytes) is not the published body ({} bytes)",
                letter.body.len(),
                case.body.len()
            ));
        }
    };
    let sent_ok = |problems: &mut Vec<String>, message: &SinkMessage| {
        let mut rcpt = message.rcpt_to.clone();
        rcpt.sort();
        let mut want = case.rcpt.clone();
        want.sort();
        if rcpt != want {
            problems.push(format!("envelope recipients {rcpt:?}, expected {want:?}"));
        }
        if message.mail_from != SENDER {
            problems.push(format!("envelope sender {:?}", message.mail_from));
        }
        let raw = message.raw.as_deref().unwrap_or_default();
        problems.extend(header_problems(
            raw,
            &case.job_headers,
            case.message_id.as_deref(),
        ));
    };
    match case.expect {
        Expected::Dead => {
            if !sent.is_empty() {
                problems.push(format!(
                    "SENT {} time(s) instead of dead-lettered",
                    sent.len()
                ));
            }
            match dead {
                [] => problems.push("never reached the dead-letter queue".into()),
                [letter] => dead_ok(&mut problems, letter, Some(&case.reason)),
                many => problems.push(format!("dead-lettered {} times", many.len())),
            }
        }
        Expected::Sent => {
            for letter in dead {
                problems.push(format!("dead-lettered: {:?}", letter.reason()));
            }
            match sent {
                [] => problems.push("never sent".into()),
                [message] => sent_ok(&mut problems, message),
                many => problems.push(format!("sent {} times", many.len())),
            }
        }
        Expected::Handled => match (dead, sent) {
            ([letter], []) => dead_ok(&mut problems, letter, None),
            ([], [message]) => sent_ok(&mut problems, message),
            ([], []) => problems.push("neither sent nor dead-lettered (lost or parked)".into()),
            _ => problems.push(format!(
                "{} dead letter(s) and {} email(s); expected exactly one outcome",
                dead.len(),
                sent.len()
            )),
        },
    }
    problems
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hostile_input_is_dead_lettered_with_its_reason_and_good_jobs_are_sent_once() {
    let panics = panics();
    // RUST_LOG=postie=info shows what postie does with each case.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_ansi(false)
            .with_test_writer()
            .try_init();
    }
    let env = TestEnv::new("hostile").await;
    let settings = env.settings();
    let domain = settings.transport.message_id_domain.clone();
    let (corpus, faults, files) = load_corpus(&domain);
    assert!(files >= 30, "the corpus has only {files} case files");
    let corpus = select(corpus);

    // Good jobs between the hostile cases: poison must block nothing behind it.
    let mut cases = Vec::new();
    for (i, case) in corpus.into_iter().enumerate() {
        cases.push(good_case(format!("good-{i:03}"), &domain));
        cases.push(case);
    }
    cases.push(good_case("good-last".into(), &domain));
    let mut seen_ids = HashMap::new();
    for case in &cases {
        if let Some(id) = &case.message_id {
            if let Some(other) = seen_ids.insert(id.clone(), case.name.clone()) {
                panic!("cases {other} and {} share a key", case.name);
            }
        }
    }

    if !faults.is_empty() {
        env.sink.set_faults(serde_json::Value::Array(faults)).await;
    }
    let serving = env.serve(settings);
    for case in &cases {
        env.publish_raw(&case.body, case.properties.clone()).await;
    }

    // Wait until every case has an outcome, then a little longer for duplicates.
    let deadline = Instant::now() + SETTLE;
    let mut dead: Vec<DeadLetter> = Vec::new();
    loop {
        dead.extend(env.take_dead_letters().await);
        let sent = env.sink.messages(false).await;
        let settled = cases.iter().all(|c| {
            let (d, s) = outcomes(c, &dead, &sent);
            !d.is_empty() || !s.is_empty()
        });
        if settled || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    dead.extend(env.take_dead_letters().await);

    // Still serving after all of it.
    let after = good_case("good-after".into(), &domain);
    env.publish_raw(&after.body, after.properties.clone()).await;
    let after_id = after.message_id.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let still_serving = loop {
        let sent = env.sink.messages(false).await;
        if sent.iter().any(|m| m.message_id == after_id) {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    cases.push(after);
    let sent = env.sink.messages(true).await;
    dead.extend(env.take_dead_letters().await);

    let mut failures: Vec<String> = Vec::new();
    let mut passed = 0;
    let mut corpus_cases = 0;
    let mut corpus_passed = 0;
    for case in &cases {
        let (d, s) = outcomes(case, &dead, &sent);
        let problems = judge(case, &d, &s);
        if case.from_corpus {
            corpus_cases += 1;
        }
        if problems.is_empty() {
            passed += 1;
            if case.from_corpus {
                corpus_passed += 1;
            }
        } else {
            failures.push(format!("{}: {}", case.name, problems.join("; ")));
        }
    }
    for letter in &dead {
        match case_of(letter) {
            Some(name) if cases.iter().any(|c| c.name == name) => {}
            other => failures.push(format!(
                "a dead letter of no case ({other:?}): {:?}",
                letter.reason()
            )),
        }
    }
    for message in &sent {
        if !cases
            .iter()
            .any(|c| c.message_id.as_deref() == Some(message.message_id.as_str()))
        {
            failures.push(format!(
                "an email of no known case was SENT: Message-ID {:?}, subject {:?}, to {:?}",
                message.message_id, message.subject, message.rcpt_to
            ));
        }
    }
    if !still_serving {
        failures.push("postie did not send a good job published after the corpus".into());
    }
    for panic in panics.lock().unwrap().iter() {
        failures.push(format!("PANIC {panic}"));
    }
    let summary = format!(
        "hostile corpus: {files} case files, {corpus_cases} cases, {corpus_passed} passed; \
         {} publishes in all, {passed} passed; {} dead letters, {} emails",
        cases.len(),
        dead.len(),
        sent.len()
    );
    println!("{summary}");
    if !failures.is_empty() {
        // Printed before stopping, in case the stop itself hangs or panics.
        eprintln!(
            "{summary}\n{} problem(s):\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    // A clean stop: serve returns Ok, nothing in flight hangs.
    let stopped = tokio::time::timeout(Duration::from_secs(15), serving.stop())
        .await
        .is_ok();
    assert!(
        failures.is_empty() && stopped,
        "{summary}: {} problem(s), listed above{}",
        failures.len(),
        if stopped {
            ""
        } else {
            "; and postie serve did not stop within 15 s"
        }
    );
}
