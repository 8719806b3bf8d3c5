//! The deployment files parse, agree with each other, and agree with the code: every
//! YAML file under `deploy/`, the Kubernetes manifests in `deploy/k8s/` (probes,
//! ports, labels, names, the settings they pass), the Grafana dashboard (every query
//! uses only metrics postie exports), the compose file (through `docker compose
//! config`, where a Docker Compose plugin exists) and the broker image recipe.
//!
//! YAML is read with python3 and PyYAML (`pip install pyyaml` if missing); a missing
//! parser fails the tests with that hint.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Parses YAML text (all documents; empty ones dropped) with python3 + PyYAML.
fn parse_yaml(what: &str, text: &str) -> Vec<Value> {
    const SCRIPT: &str = "import json, sys, yaml\n\
        docs = [d for d in yaml.safe_load_all(sys.stdin) if d is not None]\n\
        json.dump(docs, sys.stdout)\n";
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is needed to read YAML (with PyYAML: pip install pyyaml)");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(text.as_bytes()).unwrap();
    }
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("No module named 'yaml'"),
        "PyYAML is needed to read YAML: pip install pyyaml"
    );
    assert!(
        output.status.success(),
        "{what} is not valid YAML:\n{stderr}"
    );
    serde_json::from_slice::<Vec<Value>>(&output.stdout).expect("python3 wrote JSON")
}

fn yaml_file(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse_yaml(&path.display().to_string(), &text)
}

/// Every `.yml`/`.yaml` file under `dir`, recursively, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(yaml_files(&path));
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yml" | "yaml")
        ) {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn text<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

fn labels(v: &Value, pointer: &str) -> BTreeMap<String, String> {
    let map = v
        .pointer(pointer)
        .and_then(Value::as_object)
        .unwrap_or_else(|| panic!("no labels at {pointer} in {v}"));
    map.iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_str()
                    .unwrap_or_else(|| panic!("label {k} is not a string"))
                    .to_string(),
            )
        })
        .collect()
}

fn is_subset(small: &BTreeMap<String, String>, big: &BTreeMap<String, String>) -> bool {
    !small.is_empty() && small.iter().all(|(k, v)| big.get(k) == Some(v))
}

/// The Kubernetes manifests of `deploy/k8s/`, as listed by its kustomization.
struct Manifests {
    docs: Vec<Value>,
}

impl Manifests {
    fn load() -> Self {
        let dir = repo("deploy/k8s");
        let kustomization = yaml_file(&dir.join("kustomization.yaml"));
        assert_eq!(kustomization.len(), 1);
        let listed: BTreeSet<String> = kustomization[0]["resources"]
            .as_array()
            .expect("kustomization.yaml lists resources")
            .iter()
            .map(|r| r.as_str().unwrap().to_string())
            .collect();
        // Only this directory: rabbitmq-cluster/ is a kustomization of its own.
        let present: BTreeSet<String> = yaml_files(&dir)
            .iter()
            .filter(|p| p.parent() == Some(dir.as_path()))
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .filter(|name| name != "kustomization.yaml")
            .collect();
        assert_eq!(
            listed, present,
            "kustomization.yaml must list exactly the manifests in deploy/k8s/"
        );
        assert!(
            kustomization[0].get("namespace").is_none(),
            "the base is namespace-agnostic: no namespace in kustomization.yaml"
        );

        let mut docs = Vec::new();
        for name in &listed {
            let file_docs = yaml_file(&dir.join(name));
            assert!(!file_docs.is_empty(), "{name} holds no manifest");
            for doc in file_docs {
                for field in ["/apiVersion", "/kind", "/metadata/name"] {
                    assert!(
                        doc.pointer(field)
                            .and_then(Value::as_str)
                            .is_some_and(|s| !s.is_empty()),
                        "{name}: a manifest without {field}: {doc}"
                    );
                }
                assert!(
                    doc.pointer("/metadata/namespace").is_none(),
                    "{name}: {} names a namespace; the manifests are namespace-agnostic",
                    text(&doc, "/metadata/name")
                );
                docs.push(doc);
            }
        }
        Self { docs }
    }

    fn all(&self, kind: &str) -> Vec<&Value> {
        self.docs.iter().filter(|d| d["kind"] == kind).collect()
    }

    fn one(&self, kind: &str) -> &Value {
        let all = self.all(kind);
        assert_eq!(all.len(), 1, "expected exactly one {kind}");
        all[0]
    }

    /// ConfigMap data and Secret stringData as the container's environment.
    fn container_env(&self) -> HashMap<String, String> {
        let deployment = self.one("Deployment");
        let container = &deployment["spec"]["template"]["spec"]["containers"][0];
        let mut env = HashMap::new();
        let sources = container["envFrom"].as_array().expect("envFrom");
        assert!(!sources.is_empty());
        for source in sources {
            let (kind, field, name) = if let Some(r) = source.get("configMapRef") {
                ("ConfigMap", "data", text(r, "/name"))
            } else if let Some(r) = source.get("secretRef") {
                ("Secret", "stringData", text(r, "/name"))
            } else {
                panic!("unexpected envFrom source {source}");
            };
            let object = self
                .all(kind)
                .into_iter()
                .find(|d| d["metadata"]["name"] == name)
                .unwrap_or_else(|| {
                    panic!("envFrom names {kind} {name}, which is not among the manifests")
                });
            let data = object[field]
                .as_object()
                .unwrap_or_else(|| panic!("{kind} {name} has no {field}"));
            for (k, v) in data {
                let v = v
                    .as_str()
                    .unwrap_or_else(|| panic!("{kind} {name}: {k} must be a string"));
                env.insert(k.clone(), v.to_string());
            }
        }
        if let Some(vars) = container.get("env").and_then(Value::as_array) {
            for var in vars {
                if let Some(value) = var.get("value").and_then(Value::as_str) {
                    env.insert(text(var, "/name").to_string(), value.to_string());
                }
            }
        }
        env
    }
}

#[test]
fn every_yaml_file_under_deploy_parses() {
    let files = yaml_files(&repo("deploy"));
    let names: Vec<String> = files
        .iter()
        .map(|p| p.strip_prefix(repo("")).unwrap().display().to_string())
        .collect();
    for expected in [
        "deploy/docker-compose.yml",
        "deploy/prometheus.yml",
        "deploy/k8s/deployment.yaml",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} not found among {names:?}"
        );
    }
    for file in &files {
        assert!(
            !yaml_file(file).is_empty(),
            "{} holds no YAML document",
            file.display()
        );
    }
    eprintln!("{} YAML files parsed: {names:?}", files.len());
}

#[test]
fn k8s_deployment_probes_security_and_shutdown() {
    let m = Manifests::load();
    let deployment = m.one("Deployment");
    assert_eq!(text(deployment, "/apiVersion"), "apps/v1");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let selector = labels(deployment, "/spec/selector/matchLabels");
    let pod_labels = labels(deployment, "/spec/template/metadata/labels");
    assert!(
        is_subset(&selector, &pod_labels),
        "the Deployment's selector must match its pod labels"
    );

    let pod = &deployment["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let container = &containers[0];
    assert_eq!(container["args"], serde_json::json!(["serve"]));

    // The settings the pod gets are valid postie settings.
    let env = m.container_env();
    let settings = postie::config::Settings::load_from(None, Some(env.clone()))
        .unwrap_or_else(|e| panic!("the ConfigMap and Secret are not valid postie settings: {e}"));
    assert!(
        settings.warnings().is_empty(),
        "the manifests use old key names: {:?}",
        settings.warnings()
    );
    let listen = settings
        .http
        .listen
        .expect("the manifests must enable the HTTP listener");
    assert!(
        listen.ip().is_unspecified(),
        "listen on all interfaces, or probes cannot reach it: {listen}"
    );

    // The metrics port: declared, and the one postie listens on.
    let ports = container["ports"].as_array().expect("container ports");
    let metrics = ports
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("a port named metrics");
    assert_eq!(
        metrics["containerPort"].as_u64(),
        Some(u64::from(listen.port()))
    );
    let resolves_to_metrics = |port: &Value| match port {
        Value::String(name) => name == "metrics",
        Value::Number(n) => n.as_u64() == Some(u64::from(listen.port())),
        _ => false,
    };
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert!(
            resolves_to_metrics(&get["port"]),
            "{probe} must use the metrics port: {get}"
        );
    }
    if let Some(startup) = container.get("startupProbe") {
        assert_eq!(
            startup["httpGet"]["path"], "/healthz",
            "startup must not wait on dependencies"
        );
    }

    // Resources.
    for field in [
        "/resources/requests/cpu",
        "/resources/requests/memory",
        "/resources/limits/memory",
    ] {
        assert!(
            container.pointer(field).is_some(),
            "container has no {field}"
        );
    }

    // Non-root, read-only root filesystem, no privilege escalation.
    let non_root = container
        .pointer("/securityContext/runAsNonRoot")
        .or_else(|| pod.pointer("/securityContext/runAsNonRoot"));
    assert_eq!(non_root, Some(&Value::Bool(true)), "runAsNonRoot");
    let uid = container
        .pointer("/securityContext/runAsUser")
        .or_else(|| pod.pointer("/securityContext/runAsUser"));
    assert!(
        uid.and_then(Value::as_u64).is_some_and(|u| u > 0),
        "a numeric non-root runAsUser"
    );
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));

    // SIGTERM drains for worker.drain_timeout; the kubelet must wait longer.
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("terminationGracePeriodSeconds");
    let drain = settings.worker.drain_timeout;
    assert!(
        grace > drain.as_secs() + 5,
        "terminationGracePeriodSeconds ({grace}) must exceed worker.drain_timeout ({drain:?}) with room to exit"
    );
}

#[test]
fn k8s_service_pdb_and_autoscaling_point_at_the_deployment() {
    let m = Manifests::load();
    let deployment = m.one("Deployment");
    let name = text(deployment, "/metadata/name");
    let pod_labels = labels(deployment, "/spec/template/metadata/labels");
    let settings = postie::config::Settings::load_from(None, Some(m.container_env())).unwrap();
    let send_queue = format!("{}.send", settings.topology.prefix);

    let service = m.one("Service");
    assert!(
        is_subset(&labels(service, "/spec/selector"), &pod_labels),
        "the Service selects the pods"
    );
    let port = &service["spec"]["ports"][0];
    assert_eq!(port["name"], "metrics");
    assert!(
        port["targetPort"] == "metrics"
            || port["targetPort"].as_u64() == settings.http.listen.map(|a| u64::from(a.port())),
        "the Service targets the metrics port: {port}"
    );

    let pdb = m.one("PodDisruptionBudget");
    assert_eq!(text(pdb, "/apiVersion"), "policy/v1");
    assert!(
        is_subset(&labels(pdb, "/spec/selector/matchLabels"), &pod_labels),
        "the PodDisruptionBudget's selector must match the Deployment's pod labels"
    );
    let min_available = pdb["spec"]["minAvailable"]
        .as_u64()
        .expect("minAvailable as a number");

    let scaled = m.one("ScaledObject");
    assert_eq!(text(scaled, "/apiVersion"), "keda.sh/v1alpha1");
    assert_eq!(
        text(scaled, "/spec/scaleTargetRef/name"),
        name,
        "the ScaledObject scales the Deployment"
    );
    if let Some(kind) = scaled.pointer("/spec/scaleTargetRef/kind") {
        assert_eq!(kind, "Deployment");
    }
    let min_replicas = scaled["spec"]["minReplicaCount"]
        .as_u64()
        .expect("minReplicaCount");
    assert!(
        min_replicas > min_available,
        "with minReplicaCount <= minAvailable, no node could ever be drained"
    );
    let triggers = scaled["spec"]["triggers"].as_array().expect("triggers");
    assert_eq!(triggers.len(), 1);
    let trigger = &triggers[0];
    assert_eq!(trigger["type"], "rabbitmq");
    assert_eq!(text(trigger, "/metadata/queueName"), send_queue);
    assert_eq!(trigger["metadata"]["mode"], "QueueLength");
    assert!(text(trigger, "/metadata/value")
        .parse::<u64>()
        .is_ok_and(|v| v > 0));

    let auth = m.one("TriggerAuthentication");
    assert_eq!(
        text(trigger, "/authenticationRef/name"),
        text(auth, "/metadata/name")
    );
    let refs = auth["spec"]["secretTargetRef"]
        .as_array()
        .expect("secretTargetRef");
    let host = refs
        .iter()
        .find(|r| r["parameter"] == "host")
        .expect("the trigger's host comes from a Secret");
    let secret = m
        .all("Secret")
        .into_iter()
        .find(|s| s["metadata"]["name"] == host["name"])
        .unwrap_or_else(|| {
            panic!(
                "TriggerAuthentication names Secret {}, which is not among the manifests",
                host["name"]
            )
        });
    let url = text(secret, &format!("/stringData/{}", text(host, "/key")));
    assert!(
        url.starts_with("amqp://") || url.starts_with("amqps://"),
        "{url}"
    );

    // The commented HPA alternative stays a valid, consistent manifest.
    let source = std::fs::read_to_string(repo("deploy/k8s/scaledobject.yaml")).unwrap();
    let commented: String = source
        .lines()
        .skip_while(|l| *l != "# ---")
        .map(|l| {
            l.strip_prefix("# ")
                .or_else(|| l.strip_prefix('#'))
                .unwrap_or(l)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let docs = parse_yaml("the commented HPA in scaledobject.yaml", &commented);
    assert_eq!(docs.len(), 1, "one commented HPA after '# ---'");
    let hpa = &docs[0];
    assert_eq!(hpa["apiVersion"], "autoscaling/v2");
    assert_eq!(hpa["kind"], "HorizontalPodAutoscaler");
    assert_eq!(text(hpa, "/spec/scaleTargetRef/name"), name);
    let metric = &hpa["spec"]["metrics"][0]["external"]["metric"];
    assert_eq!(metric["name"], "postie_queue_depth");
    assert_eq!(text(metric, "/selector/matchLabels/queue"), send_queue);
    assert!(exported_series().contains("postie_queue_depth"));
}

#[test]
fn k8s_kustomization_builds_where_kubectl_exists() {
    let manifests = Manifests::load().docs.len();
    assert!(manifests > 0);
    let works = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !works {
        eprintln!("SKIPPED `kubectl kustomize deploy/k8s`: kubectl is not installed (the other checks still ran)");
        return;
    }
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(repo("deploy/k8s"))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubectl kustomize: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let built = parse_yaml(
        "kubectl kustomize output",
        &String::from_utf8_lossy(&output.stdout),
    );
    assert_eq!(
        built.len(),
        manifests,
        "kustomize emits every manifest once"
    );
}

/// Every series name postie's `/metrics` can show: counters with `_total`,
/// histograms as `_bucket`, `_sum` and `_count`, gauges as they are.
fn exported_series() -> BTreeSet<String> {
    use postie::testing::ops::metrics::{
        DeadReason, Dependency, FeedbackKind, LaneLabel, Metrics, ProviderLabel, ProviderName,
        ProviderResult, QueueLabel, RateLabel, RateWindow, RelayRoute, SourceLabel, Step,
    };
    let metrics = Metrics::new();
    // A labelled family shows nothing, not even its TYPE line, until it has a child.
    metrics.retries.inc(Step(0));
    metrics.dead(DeadReason::Invalid);
    metrics.relayed.inc(RelayRoute::Now);
    metrics
        .queue_depth
        .get_or_create(&QueueLabel {
            queue: "postie.send".into(),
        })
        .set(1);
    metrics.reconnected(Dependency::Rabbitmq);
    let lane = LaneLabel {
        lane: "bulk".into(),
    };
    metrics.lane_sent.get_or_create(&lane).inc();
    metrics
        .lane_lateness_seconds
        .get_or_create(&lane)
        .observe(0.1);
    let provider = || "smtp".to_string();
    metrics
        .provider_sends
        .get_or_create(&ProviderLabel {
            provider: provider(),
            result: ProviderResult::Sent,
        })
        .inc();
    metrics
        .provider_circuit_open
        .get_or_create(&ProviderName {
            provider: provider(),
        })
        .set(0);
    metrics
        .feedback_rate
        .get_or_create(&RateLabel {
            kind: "order".into(),
            feedback: FeedbackKind::Bounce,
            window: RateWindow::Day,
        })
        .set(0.0);
    let source = SourceLabel {
        source: "orders".into(),
    };
    metrics.outbox_relayed.get_or_create(&source).inc();
    metrics
        .outbox_oldest_seconds
        .get_or_create(&source)
        .set(0.0);
    metrics.outbox_source_up.get_or_create(&source).set(1);
    let rendered = metrics.render();
    let mut out = BTreeSet::new();
    for line in rendered.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        match kind {
            "counter" => {
                out.insert(format!(
                    "{}_total",
                    name.strip_suffix("_total").unwrap_or(name)
                ));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                out.insert(name.to_string());
            }
        }
    }
    assert!(out.len() > 10, "expected postie's metrics in:\n{rendered}");
    out
}

/// `postie_…` identifiers in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("postie_") {
        let preceded_by_ident = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !preceded_by_ident {
            out.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Every panel, including those nested in collapsed rows.
fn panels(list: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for panel in list.as_array().into_iter().flatten() {
        out.push(panel);
        out.extend(panels(&panel["panels"]));
    }
    out
}

#[test]
fn dashboard_queries_only_metrics_postie_exports() {
    let path = repo("deploy/grafana/postie-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .expect("the dashboard is JSON");
    assert!(dashboard["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(dashboard["uid"].as_str().is_some_and(|t| !t.is_empty()));
    let exported = exported_series();

    let all = panels(&dashboard["panels"]);
    let graphs: Vec<&Value> = all.iter().copied().filter(|p| p["type"] != "row").collect();
    assert!(
        graphs.len() >= 10,
        "expected a dashboard's worth of panels, found {}",
        graphs.len()
    );

    let mut ids = BTreeSet::new();
    let mut used = BTreeSet::new();
    let mut exprs = 0;
    for panel in &all {
        let title = panel["title"].as_str().unwrap_or("?");
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "duplicate panel id in {title}"
        );
        for field in ["h", "w", "x", "y"] {
            assert!(panel["gridPos"][field].is_u64(), "{title}: gridPos.{field}");
        }
    }
    for panel in &graphs {
        let title = panel["title"].as_str().unwrap_or("?");
        let targets = panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("{title}: no targets"));
        assert!(!targets.is_empty(), "{title}: no targets");
        for target in targets {
            let expr = text(target, "/expr");
            exprs += 1;
            let names = metric_names(expr);
            assert!(
                !names.is_empty(),
                "{title}: {expr} queries no postie metric"
            );
            for name in names {
                assert!(exported.contains(&name), "{title}: {name} is not exported by postie (expr: {expr}); exported: {exported:?}");
                used.insert(name);
            }
            if expr.contains("histogram_quantile") {
                // Aggregated by `le` (and maybe other labels, such as `lane`).
                let by_le = ["by (le)", "by (le,", ", le)"];
                assert!(
                    expr.contains("_bucket") && by_le.iter().any(|b| expr.contains(b)),
                    "{title}: {expr}"
                );
            }
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let query = variable["definition"].as_str().unwrap_or("");
        for name in metric_names(query) {
            assert!(
                exported.contains(&name),
                "variable {}: {name} is not exported",
                variable["name"]
            );
        }
    }
    assert!(exprs > 0);

    // What an on-call engineer looks for first.
    for needed in [
        "postie_emails_sent_total",
        "postie_duplicates_suppressed_total",
        "postie_retries_total",
        "postie_dead_lettered_total",
        "postie_delivery_lateness_seconds_bucket",
        "postie_smtp_send_duration_seconds_bucket",
        "postie_in_flight",
        "postie_consumer_paused",
        "postie_smtp_circuit_open",
        "postie_queue_depth",
        "postie_reconnects_total",
    ] {
        assert!(
            used.contains(needed),
            "the dashboard shows nothing of {needed}"
        );
    }
    let all_exprs: Vec<&str> = graphs
        .iter()
        .flat_map(|p| {
            p["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["expr"].as_str().unwrap())
        })
        .collect();
    for (q, metric) in [
        ("0.5", "postie_delivery_lateness_seconds_bucket"),
        ("0.99", "postie_delivery_lateness_seconds_bucket"),
        ("0.99", "postie_smtp_send_duration_seconds_bucket"),
    ] {
        assert!(
            all_exprs
                .iter()
                .any(|e| e.contains(&format!("histogram_quantile({q},")) && e.contains(metric)),
            "no p{q} of {metric}"
        );
    }
}

#[test]
fn metric_name_extraction_finds_whole_identifiers() {
    assert_eq!(
        metric_names("sum(rate(postie_a_total{job=~\"$job\"}[1m])) / xpostie_b + postie_c"),
        vec!["postie_a_total", "postie_c"]
    );
}

#[test]
fn compose_file_passes_docker_compose_config() {
    let compose = repo("deploy/docker-compose.yml");
    let docs = yaml_file(&compose);
    assert_eq!(docs.len(), 1);
    let services = docs[0]["services"].as_object().expect("services");
    assert!(
        services.contains_key("postie") && services.contains_key("rabbitmq"),
        "{services:?}"
    );

    let available = Command::new("docker")
        .args(["compose", "version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !available {
        eprintln!("SKIPPED `docker compose config`: `docker compose version` does not work here (no Compose plugin); the YAML parse above still ran");
        return;
    }
    let output = Command::new("docker")
        .args(["compose", "-f"])
        .arg(&compose)
        .args(["config", "--quiet"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "docker compose config: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn compose_gives_postie_valid_settings() {
    let docs = yaml_file(&repo("deploy/docker-compose.yml"));
    // The environment compose gives postie is a valid configuration.
    let env: HashMap<String, String> = docs[0]["services"]["postie"]["environment"]
        .as_object()
        .expect("postie's environment as a map")
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_str().map_or_else(|| v.to_string(), str::to_string),
            )
        })
        .collect();
    assert!(!env.is_empty());
    match postie::config::Settings::load_from(None, Some(env)) {
        Ok(settings) => assert!(
            settings.warnings().is_empty(),
            "old key names: {:?}",
            settings.warnings()
        ),
        Err(e) => panic!("deploy/docker-compose.yml gives postie invalid settings: {e}"),
    }
}

#[test]
fn compose_cluster_profile_gives_postie_every_node() {
    let docs = yaml_file(&repo("deploy/docker-compose.yml"));
    let services = &docs[0]["services"];
    let config = std::fs::read_to_string(repo("rabbitmq/cluster.conf")).unwrap();
    assert!(config.contains("cluster_formation.peer_discovery_backend = classic_config"));
    let mut cookies = BTreeSet::new();
    for i in 1..=3 {
        let node = &services[format!("rabbitmq-{i}")];
        assert_eq!(node["profiles"][0], "cluster", "rabbitmq-{i}");
        assert_eq!(text(node, "/hostname"), format!("rabbitmq-{i}"));
        assert!(config.contains(&format!("nodes.{i} = rabbit@rabbitmq-{i}")));
        let volumes = node["volumes"].as_array().unwrap();
        assert!(volumes
            .iter()
            .any(|v| v == "../rabbitmq/cluster.conf:/etc/rabbitmq/rabbitmq.conf:ro"));
        cookies.insert(text(node, "/environment/RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS").to_string());
    }
    assert_eq!(cookies.len(), 1, "one Erlang cookie for the three nodes");
    let postie = &services["postie-cluster"];
    assert_eq!(postie["profiles"][0], "cluster");
    let env: HashMap<String, String> = postie["environment"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_str().map_or_else(|| v.to_string(), str::to_string),
            )
        })
        .collect();
    let url = env["POSTIE__AMQP__URL"].clone();
    for i in 1..=3 {
        assert!(url.contains(&format!("@rabbitmq-{i}:5672/")), "{url}");
    }
    match postie::config::Settings::load_from(None, Some(env)) {
        Ok(settings) => assert!(
            settings.warnings().is_empty(),
            "old key names: {:?}",
            settings.warnings()
        ),
        Err(e) => panic!("the cluster profile gives postie invalid settings: {e}"),
    }
}

#[test]
fn k8s_rabbitmq_cluster_example_names_every_pod() {
    let dir = repo("deploy/k8s/rabbitmq-cluster");
    let kustomization = yaml_file(&dir.join("kustomization.yaml"));
    let listed: BTreeSet<String> = kustomization[0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let present: BTreeSet<String> = yaml_files(&dir)
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .filter(|name| name != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present);
    let docs: Vec<Value> = listed
        .iter()
        .flat_map(|f| yaml_file(&dir.join(f)))
        .collect();
    let of = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind}"))
    };
    let cluster = of("RabbitmqCluster");
    assert_eq!(cluster["apiVersion"], "rabbitmq.com/v1beta1");
    assert_eq!(cluster["spec"]["replicas"], 3);
    let name = text(cluster, "/metadata/name");
    let secret = docs
        .iter()
        .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == "postie-secrets")
        .expect("postie-secrets");
    let url = text(secret, "/stringData/POSTIE__AMQP__URL");
    for i in 0..3 {
        assert!(
            url.contains(&format!("@{name}-server-{i}.{name}-nodes:5672/")),
            "{url}"
        );
    }
    // The base's Secret and this one hold the same keys (plus KEDA's).
    let base_secret = yaml_file(&repo("deploy/k8s/secret.yaml"));
    for key in base_secret[0]["stringData"].as_object().unwrap().keys() {
        assert!(secret["stringData"].get(key).is_some(), "{key}");
    }
    let auth = of("TriggerAuthentication");
    let key = text(auth, "/spec/secretTargetRef/0/key");
    assert!(secret["stringData"].get(key).is_some(), "KEDA reads {key}");
    assert!(!text(secret, &format!("/stringData/{key}")).contains(','));
    let env = secret["stringData"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("POSTIE__"))
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .chain([("POSTIE__DELAY__MODE".to_string(), "ladder".to_string())])
        .collect();
    match postie::config::Settings::load_from(None, Some(env)) {
        Ok(settings) => assert!(
            settings.warnings().is_empty(),
            "old key names: {:?}",
            settings.warnings()
        ),
        Err(e) => panic!("rabbitmq-cluster/postie-secrets.yaml gives invalid settings: {e}"),
    }
    if Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        let output = Command::new("kubectl")
            .arg("kustomize")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn broker_image_recipe_adds_and_enables_the_delay_plugin() {
    let recipe = std::fs::read_to_string(repo("rabbitmq/Dockerfile")).expect("rabbitmq/Dockerfile");
    let instructions: Vec<&str> = recipe
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .collect();
    assert!(
        instructions
            .iter()
            .any(|l| l.trim() == "FROM rabbitmq:3.13-management"),
        "{recipe}"
    );
    assert!(
        instructions
            .iter()
            .any(|l| l.starts_with("ARG DELAYED_MESSAGE_EXCHANGE_VERSION=")),
        "{recipe}"
    );
    let body = instructions.join("\n");
    assert!(
        body.contains("releases/download/v${DELAYED_MESSAGE_EXCHANGE_VERSION}/rabbitmq_delayed_message_exchange-${DELAYED_MESSAGE_EXCHANGE_VERSION}.ez"),
        "{recipe}"
    );
    assert!(body.contains("/opt/rabbitmq/plugins/"), "{recipe}");
    for plugin in [
        "rabbitmq_management",
        "rabbitmq_shovel",
        "rabbitmq_shovel_management",
        "rabbitmq_delayed_message_exchange",
    ] {
        assert!(
            body.contains(plugin),
            "{plugin} not enabled in rabbitmq/Dockerfile"
        );
    }
}

/// The image's dependency layer resolves the workspace, so the Dockerfile copies every
/// member's manifest (a member added to `[workspace] members` and not to the
/// Dockerfile breaks `docker build` at its first `cargo build`), and a member whose
/// manifest names no target gets a stand-in `src/lib.rs`.
#[test]
fn image_recipe_copies_every_workspace_member_manifest() {
    let manifest = std::fs::read_to_string(repo("Cargo.toml")).unwrap();
    let members_line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("[workspace] members");
    let members: Vec<&str> = members_line
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|m| *m != ".")
        .collect();
    assert!(members.len() >= 3, "{members_line}");
    let recipe = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    for member in members {
        let copy = format!("COPY {member}/Cargo.toml {member}/Cargo.toml");
        assert!(
            recipe.lines().any(|l| l.trim() == copy),
            "the Dockerfile does not copy {member}'s manifest: add `{copy}`"
        );
        let own = std::fs::read_to_string(repo(&format!("{member}/Cargo.toml"))).unwrap();
        let names_a_target = own.contains("[[bin]]") || own.contains("[lib]");
        if !names_a_target {
            assert!(
                recipe.contains(&format!("{member}/src/lib.rs")),
                "{member}'s manifest names no target: the Dockerfile needs a stand-in {member}/src/lib.rs"
            );
        }
    }
}
