//! `rabbitmq/definitions.json` must describe exactly what `Topology::declare` creates
//! with the default settings, plus the two least-privilege users. A broker loaded
//! from the file and then started postie would otherwise refuse the declaration
//! (406 PRECONDITION_FAILED) or route differently from the code.
//!
//! The file is for ladder mode: the delayed-message plugin is not part of the broker
//! setup, and with `delay.mode = auto` (the default) an existing direct
//! `postie.delayed` exchange makes postie choose ladder mode.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine;
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;
use postie::config::{DelayMode, DelaySettings, TopologySettings};
use postie::testing::broker::Ladder;
use postie::testing::broker::{DelayLayout, Topology, ROUTING_KEY};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

const VHOST: &str = "/";

fn repo_file(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn definitions() -> Value {
    let path = repo_file("rabbitmq/definitions.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The topology postie declares with default settings on a broker without the plugin.
fn topology() -> Topology {
    Topology::new(
        &TopologySettings::default(),
        &DelaySettings::default(),
        DelayMode::Ladder,
    )
}

fn ladder(topology: &Topology) -> Ladder {
    match topology.delay() {
        DelayLayout::Ladder(ladder) => ladder,
        DelayLayout::Plugin => panic!("expected ladder mode"),
    }
}

fn list<'a>(defs: &'a Value, key: &str) -> &'a Vec<Value> {
    defs[key]
        .as_array()
        .unwrap_or_else(|| panic!("definitions.{key} must be an array"))
}

fn text<'a>(object: &'a Value, key: &str) -> &'a str {
    object[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key} must be a string in {object}"))
}

/// Objects of one kind by name; duplicates are an error.
fn by_name<'a>(defs: &'a Value, key: &str) -> BTreeMap<String, &'a Value> {
    let mut map = BTreeMap::new();
    for object in list(defs, key) {
        let name = text(object, "name").to_string();
        assert!(
            map.insert(name.clone(), object).is_none(),
            "{key}: {name} appears twice"
        );
    }
    map
}

fn args(pairs: &[(&str, Value)]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<Map<_, _>>(),
    )
}

/// AMQP arguments as the broker exports them.
fn field_table_json(table: &FieldTable) -> Value {
    Value::Object(
        table
            .inner()
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
                    AMQPValue::ShortString(s) => json!(s.as_str()),
                    AMQPValue::LongInt(n) => json!(n),
                    AMQPValue::LongLongInt(n) => json!(n),
                    AMQPValue::Boolean(b) => json!(b),
                    other => panic!("unexpected argument type {other:?}"),
                };
                (key.to_string(), value)
            })
            .collect::<Map<_, _>>(),
    )
}

fn kind_name(kind: &ExchangeKind) -> String {
    match kind {
        ExchangeKind::Direct => "direct".into(),
        ExchangeKind::Fanout => "fanout".into(),
        ExchangeKind::Topic => "topic".into(),
        ExchangeKind::Headers => "headers".into(),
        ExchangeKind::Custom(name) => name.clone(),
    }
}

fn dead_letter(exchange: &str) -> Vec<(&'static str, Value)> {
    vec![
        ("x-dead-letter-exchange", json!(exchange)),
        ("x-dead-letter-strategy", json!("at-least-once")),
        ("x-overflow", json!("reject-publish")),
    ]
}

/// The arguments `Topology::declare` passes for each queue, as JSON.
fn expected_queue_args(topology: &Topology) -> BTreeMap<String, Value> {
    let quorum = ("x-queue-type", json!("quorum"));
    let delivery_limit = (
        "x-delivery-limit",
        json!(TopologySettings::default().delivery_limit),
    );
    let ttl = |d: std::time::Duration| ("x-message-ttl", json!(d.as_millis() as u64));
    let to_work = || {
        let mut a = dead_letter(topology.work_exchange());
        a.push(("x-dead-letter-routing-key", json!(ROUTING_KEY)));
        a
    };

    let mut expected: BTreeMap<String, Value> = BTreeMap::new();
    let mut send = vec![quorum.clone(), delivery_limit.clone()];
    send.extend(dead_letter(topology.dead_exchange()));
    expected.insert(topology.send_queue().into(), args(&send));
    // A limit no number of looks reaches (issue 45): 2^31 - 1, never -1, which
    // RabbitMQ 3.10 reads as 0.
    expected.insert(
        topology.dead_queue().into(),
        args(&[
            quorum.clone(),
            (
                "x-delivery-limit",
                json!(postie::testing::topology::DEAD_DELIVERY_LIMIT),
            ),
        ]),
    );
    for (n, step) in topology.retry_steps().iter().enumerate() {
        let mut retry = vec![quorum.clone(), ttl(*step)];
        retry.extend(to_work());
        expected.insert(topology.retry_queue(n).into(), args(&retry));
    }

    let ladder = ladder(topology);
    let mut intake = vec![quorum.clone(), delivery_limit];
    intake.extend(dead_letter(topology.dead_exchange()));
    expected.insert(topology.intake_queue().into(), args(&intake));
    for k in 0..ladder.levels() {
        let mut level = vec![quorum.clone(), ttl(ladder.ttl(k))];
        if k == 0 {
            level.extend(to_work());
        } else {
            // No dead-letter routing key: the next level reads its bit from the key.
            level.extend(dead_letter(&topology.delay_level(k - 1)));
        }
        expected.insert(topology.delay_level(k), args(&level));
    }
    expected
}

/// Exchange name → (type, arguments), as `Topology::declare` creates them.
fn expected_exchanges(topology: &Topology) -> BTreeMap<String, (String, Value)> {
    let (kind, arguments) = topology.delayed_exchange_spec();
    let mut expected: BTreeMap<String, (String, Value)> = BTreeMap::new();
    expected.insert(
        topology.delayed_exchange().into(),
        (kind_name(&kind), field_table_json(&arguments)),
    );
    expected.insert(
        topology.work_exchange().into(),
        ("direct".into(), json!({})),
    );
    expected.insert(
        topology.retry_exchange().into(),
        ("direct".into(), json!({})),
    );
    expected.insert(
        topology.dead_exchange().into(),
        ("fanout".into(), json!({})),
    );
    expected.insert(
        topology.events_exchange().into(),
        ("topic".into(), json!({})),
    );
    for k in 0..ladder(topology).levels() {
        expected.insert(topology.delay_level(k), ("topic".into(), json!({})));
    }
    expected
}

type Binding = (String, String, String, String);

/// (source, destination, destination type, routing key) of every binding.
fn expected_bindings(topology: &Topology) -> BTreeSet<Binding> {
    let to_queue =
        |source: &str, queue: &str, key: String| (source.into(), queue.into(), "queue".into(), key);
    let mut expected = BTreeSet::from([
        to_queue(
            topology.work_exchange(),
            topology.send_queue(),
            ROUTING_KEY.into(),
        ),
        to_queue(
            topology.dead_exchange(),
            topology.dead_queue(),
            ROUTING_KEY.into(),
        ),
        to_queue(
            topology.delayed_exchange(),
            topology.intake_queue(),
            ROUTING_KEY.into(),
        ),
    ]);
    // postie republishes a retry to the retry exchange with the queue's name as key.
    for n in 0..topology.retry_steps().len() {
        let queue = topology.retry_queue(n);
        expected.insert(to_queue(topology.retry_exchange(), queue, queue.into()));
    }
    let ladder = ladder(topology);
    for k in 0..ladder.levels() {
        let level = topology.delay_level(k);
        // A set bit waits in the level's queue; a clear bit falls through to the
        // level below (the send queue under level 0).
        expected.insert(to_queue(&level, &level, ladder.pattern(k, true)));
        if k == 0 {
            expected.insert(to_queue(
                &level,
                topology.send_queue(),
                ladder.pattern(0, false),
            ));
        } else {
            expected.insert((
                level,
                topology.delay_level(k - 1),
                "exchange".into(),
                ladder.pattern(k, false),
            ));
        }
    }
    expected
}

#[test]
fn auto_mode_on_this_broker_setup_is_the_ladder_the_file_describes() {
    // The file declares postie.delayed as a plain direct exchange: `auto` keeps an
    // existing direct exchange in ladder mode. A plugin-mode file would be different.
    assert_eq!(DelaySettings::default().mode, DelayMode::Auto);
    let defs = definitions();
    let exchanges = by_name(&defs, "exchanges");
    let delayed = exchanges[topology().delayed_exchange()];
    assert_eq!(text(delayed, "type"), "direct");
    let plugins = std::fs::read_to_string(repo_file("rabbitmq/enabled_plugins")).unwrap();
    assert!(
        !plugins.contains("rabbitmq_delayed_message_exchange"),
        "with the plugin enabled the file would need plugin mode's exchange"
    );
}

#[test]
fn the_file_is_for_the_default_vhost_and_sets_nothing_that_overrides_queue_arguments() {
    let defs = definitions();
    let vhosts: Vec<&str> = list(&defs, "vhosts")
        .iter()
        .map(|v| text(v, "name"))
        .collect();
    assert_eq!(vhosts, [VHOST]);
    for key in ["queues", "exchanges", "bindings", "permissions"] {
        for object in list(&defs, key) {
            assert_eq!(text(object, "vhost"), VHOST, "{key}: {object}");
        }
    }
    // A policy would silently change delivery limits, TTLs or dead-lettering.
    for key in ["policies", "parameters", "topic_permissions"] {
        assert!(
            list(&defs, key).is_empty(),
            "definitions.{key} must be empty"
        );
    }
}

#[test]
fn queues_are_the_codes_quorum_queues() {
    let defs = definitions();
    let topology = topology();
    let queues = by_name(&defs, "queues");
    let names: BTreeSet<&str> = queues.keys().map(String::as_str).collect();
    let expected: BTreeSet<String> = topology.queues().into_iter().collect();
    assert_eq!(
        names,
        expected.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    for (name, queue) in &queues {
        assert_eq!(queue["durable"], json!(true), "{name} must be durable");
        assert_eq!(queue["auto_delete"], json!(false), "{name}: auto_delete");
        assert_eq!(
            queue["arguments"]["x-queue-type"],
            json!("quorum"),
            "{name} must be a quorum queue"
        );
    }
}

#[test]
fn queue_arguments_are_exactly_those_the_code_declares() {
    let defs = definitions();
    let queues = by_name(&defs, "queues");
    for (name, expected) in expected_queue_args(&topology()) {
        let queue = queues
            .get(&name)
            .unwrap_or_else(|| panic!("queue {name} missing"));
        assert_eq!(queue["arguments"], expected, "arguments of {name}");
    }
}

#[test]
fn retry_ttls_are_the_retry_steps_in_milliseconds() {
    let defs = definitions();
    let topology = topology();
    let queues = by_name(&defs, "queues");
    let steps = topology.retry_steps();
    assert_eq!(
        steps.len(),
        5,
        "default retry steps changed: update the file"
    );
    for (n, step) in steps.iter().enumerate() {
        let ttl = queues[topology.retry_queue(n)]["arguments"]["x-message-ttl"]
            .as_u64()
            .unwrap_or_else(|| panic!("retry queue {n} needs an integer x-message-ttl"));
        assert_eq!(u128::from(ttl), step.as_millis(), "TTL of retry queue {n}");
    }
    // The ladder grows: a later retry never waits less than an earlier one.
    assert!(steps.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn every_hop_that_carries_a_job_dead_letters_at_least_once() {
    let defs = definitions();
    let topology = topology();
    let queues = by_name(&defs, "queues");
    let exchanges = by_name(&defs, "exchanges");
    for (name, queue) in &queues {
        let arguments = &queue["arguments"];
        let Some(target) = arguments["x-dead-letter-exchange"].as_str() else {
            assert_eq!(
                *name,
                topology.dead_queue(),
                "only the DLQ dead-letters nowhere"
            );
            continue;
        };
        assert!(
            exchanges.contains_key(target),
            "{name} dead-letters to unknown {target}"
        );
        assert_eq!(
            arguments["x-dead-letter-strategy"],
            json!("at-least-once"),
            "{name}"
        );
        // at-least-once dead-lettering is ignored unless overflow is reject-publish.
        assert_eq!(arguments["x-overflow"], json!("reject-publish"), "{name}");
    }
    assert_eq!(
        queues[topology.send_queue()]["arguments"]["x-dead-letter-exchange"],
        json!(topology.dead_exchange())
    );
}

#[test]
fn ladder_ttls_double_per_level() {
    let defs = definitions();
    let topology = topology();
    let ladder = ladder(&topology);
    let queues = by_name(&defs, "queues");
    for k in 0..ladder.levels() {
        let ttl = queues[&topology.delay_level(k)]["arguments"]["x-message-ttl"]
            .as_u64()
            .unwrap_or_else(|| panic!("delay level {k} needs an integer x-message-ttl"));
        assert_eq!(
            u128::from(ttl),
            ladder.ttl(k).as_millis(),
            "TTL of level {k}"
        );
    }
    assert!(!queues.contains_key(&topology.delay_level(ladder.levels())));
}

#[test]
fn no_ladder_ttl_exceeds_what_rabbitmq_can_hold() {
    // RabbitMQ cannot hold a TTL above 2^32-1 ms; a delay longer than one pass through
    // the ladder takes several passes instead of a taller ladder.
    let defs = definitions();
    let topology = topology();
    let ladder = ladder(&topology);
    let limit = u64::from(u32::MAX);
    for queue in list(&defs, "queues") {
        if let Some(ttl) = queue["arguments"]["x-message-ttl"].as_u64() {
            assert!(
                ttl <= limit,
                "{} has TTL {ttl} ms > 2^32-1",
                text(queue, "name")
            );
        }
    }
    // One more level would not fit: the ladder is as tall as it may be, or tall enough.
    let top = ladder.ttl(ladder.levels() - 1).as_millis();
    assert!(top * 2 > u128::from(limit) || ladder.max_delay() >= DelaySettings::default().max);
    // With the defaults (100 ms, 366 days): 26 levels, 77 days per pass.
    assert_eq!(
        (
            ladder.levels(),
            ladder.resolution().as_millis(),
            DelaySettings::default().max
        ),
        (26, 100, std::time::Duration::from_secs(366 * 86_400)),
        "default delay settings changed: update the file and rabbitmq/README.md"
    );
    assert!(ladder.max_delay() < DelaySettings::default().max);
}

#[test]
fn retries_go_through_the_retry_exchange_keyed_by_queue_name() {
    let defs = definitions();
    let topology = topology();
    let exchanges = by_name(&defs, "exchanges");
    let retry = exchanges
        .get(topology.retry_exchange())
        .unwrap_or_else(|| panic!("exchange {} missing", topology.retry_exchange()));
    assert_eq!(text(retry, "type"), "direct");
    let from_retry: BTreeMap<&str, &str> = list(&defs, "bindings")
        .iter()
        .filter(|b| text(b, "source") == topology.retry_exchange())
        .map(|b| {
            assert_eq!(text(b, "destination_type"), "queue", "{b}");
            (text(b, "destination"), text(b, "routing_key"))
        })
        .collect();
    let expected: BTreeSet<String> = (0..topology.retry_steps().len())
        .map(|n| topology.retry_queue(n).to_owned())
        .collect();
    assert_eq!(
        from_retry.keys().copied().collect::<BTreeSet<_>>(),
        expected.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    for (queue, key) in from_retry {
        assert_eq!(queue, key, "routing key of the binding to {queue}");
    }
}

#[test]
fn exchanges_are_the_codes_exchanges_with_their_kinds() {
    let defs = definitions();
    let topology = topology();
    let exchanges = by_name(&defs, "exchanges");
    let names: BTreeSet<&str> = exchanges.keys().map(String::as_str).collect();
    let listed: Vec<String> = topology.exchanges();
    assert_eq!(
        names,
        listed.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    let expected = expected_exchanges(&topology);
    assert_eq!(expected.len(), listed.len());
    for (name, (kind, arguments)) in expected {
        let exchange = exchanges
            .get(&name)
            .unwrap_or_else(|| panic!("exchange {name} missing"));
        assert_eq!(text(exchange, "type"), kind, "type of {name}");
        assert_eq!(exchange["durable"], json!(true), "{name} must be durable");
        assert_eq!(exchange["auto_delete"], json!(false), "{name}: auto_delete");
        assert_eq!(exchange["internal"], json!(false), "{name}: internal");
        assert_eq!(exchange["arguments"], arguments, "arguments of {name}");
    }
}

#[test]
fn bindings_are_exactly_the_codes() {
    let defs = definitions();
    let found: Vec<Binding> = list(&defs, "bindings")
        .iter()
        .map(|b| {
            assert_eq!(b["arguments"], json!({}), "binding arguments: {b}");
            (
                text(b, "source").to_string(),
                text(b, "destination").to_string(),
                text(b, "destination_type").to_string(),
                text(b, "routing_key").to_string(),
            )
        })
        .collect();
    let unique: BTreeSet<Binding> = found.iter().cloned().collect();
    assert_eq!(unique.len(), found.len(), "duplicate bindings");
    let expected = expected_bindings(&topology());
    let missing: Vec<_> = expected.difference(&unique).collect();
    let extra: Vec<_> = unique.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "bindings differ from the code:\n missing: {missing:?}\n extra: {extra:?}"
    );
}

#[test]
fn producers_entry_routes_the_contract_key() {
    let defs = definitions();
    let topology = topology();
    let from_entry: Vec<&Value> = list(&defs, "bindings")
        .iter()
        .filter(|b| text(b, "source") == topology.delayed_exchange())
        .collect();
    assert!(!from_entry.is_empty());
    for binding in from_entry {
        assert_eq!(text(binding, "routing_key"), ROUTING_KEY, "{binding}");
    }
    // Work and dead-letter hops keep `email` too.
    for source in [topology.work_exchange(), topology.dead_exchange()] {
        assert!(list(&defs, "bindings")
            .iter()
            .filter(|b| text(b, "source") == source)
            .all(|b| text(b, "routing_key") == ROUTING_KEY));
    }
}

#[test]
fn users_have_least_privilege_and_documented_placeholder_passwords() {
    let defs = definitions();
    let users = by_name(&defs, "users");
    assert_eq!(
        users.keys().map(String::as_str).collect::<Vec<_>>(),
        ["postie", "producer"]
    );
    for (name, password) in [
        ("postie", "change-me-postie"),
        ("producer", "change-me-producer"),
    ] {
        let user = users[name];
        assert_eq!(
            text(user, "hashing_algorithm"),
            "rabbit_password_hashing_sha256",
            "{name}"
        );
        assert!(
            user.get("password").is_none(),
            "{name}: no clear-text password in the file"
        );
        let tags = user["tags"].as_array().expect("tags is a list");
        assert!(
            tags.is_empty(),
            "{name} must not carry tags such as administrator"
        );
        assert!(
            sha256_password_hash_matches(text(user, "password_hash"), password),
            "{name}: password_hash is not the documented placeholder {password:?} \
             (rabbitmq/README.md says what the placeholders are)"
        );
    }

    let permissions: BTreeMap<&str, [&str; 3]> = list(&defs, "permissions")
        .iter()
        .map(|p| {
            (
                text(p, "user"),
                [text(p, "configure"), text(p, "write"), text(p, "read")],
            )
        })
        .collect();
    assert_eq!(list(&defs, "permissions").len(), permissions.len());
    // postie republishes retries through its own retry exchange, so it needs no write
    // access to `amq.default` (which would let it publish into any queue by name).
    assert_eq!(
        permissions.get("postie"),
        Some(&[r"^postie\.", r"^postie\.", r"^postie\."])
    );
    // A producer publishes jobs, and may consume delivery events through queues of
    // its own (`producer.…`, declared and bound to `postie.events` by itself).
    assert_eq!(
        permissions.get("producer"),
        Some(&[
            r"^producer\.",
            r"^(postie\.delayed|producer\..*)$",
            r"^(postie\.events|producer\..*)$"
        ])
    );
    // The patterns above are literal for the default prefix: every name follows it.
    let topology = topology();
    for name in topology.queues().iter().chain(&topology.exchanges()) {
        assert!(name.starts_with("postie."), "{name} is outside ^postie\\.");
    }
    assert_eq!(topology.delayed_exchange(), "postie.delayed");
}

/// `rabbit_password_hashing_sha256`: base64(salt ‖ sha256(salt ‖ password)), 4-byte salt.
fn sha256_password_hash_matches(hash: &str, password: &str) -> bool {
    let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(hash) else {
        return false;
    };
    if bytes.len() != 4 + 32 {
        return false;
    }
    let (salt, digest) = bytes.split_at(4);
    let mut hasher = Sha256::new();
    hasher.update(salt);
    hasher.update(password.as_bytes());
    hasher.finalize().as_slice() == digest
}

#[test]
fn node_config_loads_the_definitions_and_enables_the_plugins() {
    let conf = std::fs::read_to_string(repo_file("rabbitmq/rabbitmq.conf")).unwrap();
    let settings: BTreeMap<&str, &str> = conf
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (key, value) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("rabbitmq.conf: not key = value: {line}"));
            (key.trim(), value.trim())
        })
        .collect();
    assert_eq!(
        settings.get("load_definitions"),
        Some(&"/etc/rabbitmq/definitions.json")
    );
    assert_eq!(settings.get("management.tcp.port"), Some(&"15672"));
    assert!(settings.contains_key("vm_memory_high_watermark.relative"));

    let plugins = std::fs::read_to_string(repo_file("rabbitmq/enabled_plugins")).unwrap();
    let plugins = plugins.trim();
    let list = plugins
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix("]."))
        .expect("enabled_plugins is an Erlang list ending in `].`");
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    assert_eq!(
        names,
        [
            "rabbitmq_management",
            "rabbitmq_shovel",
            "rabbitmq_shovel_management"
        ]
    );
}

/// Validates deploy/docker-compose.yml with `docker compose config` where the Compose
/// plugin is installed (it needs no engine); skipped, with a note, elsewhere.
#[test]
fn compose_file_is_valid_where_docker_compose_exists() {
    let compose = repo_file("deploy/docker-compose.yml");
    assert!(compose.exists(), "{} is missing", compose.display());
    let available = Command::new("docker")
        .args(["compose", "version"])
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false);
    if !available {
        eprintln!("skipping `docker compose config`: the docker compose plugin is not installed");
        return;
    }
    let out = Command::new("docker")
        .args(["compose", "-f"])
        .arg(&compose)
        .args(["config", "--quiet"])
        .output()
        .expect("running docker compose config");
    assert!(
        out.status.success(),
        "docker compose config rejected {}:\n{}",
        compose.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}
