//! `openapi.json` kept true: its paths and methods are exactly
//! [`crab_api::routes::ALL`], and each message type, serialized by serde,
//! validates against its component schema (and documents the types refuse
//! are refused by the schemas too).
//!
//! The helpers are `crab_tests::openapi`'s, which the integration tests
//! use to check what crabd answers them.

use std::collections::{BTreeMap, BTreeSet};

use crab_api::crabd::{
    CheckpointReport, CheckpointRequest, Crash, DrainOutcome, DrainReport, DrainRequest, ErrorBody,
    ErrorCode, Event, EventKind, ForkOutcome, ForkReport, ForkRequest, ForksReport, ForksRequest, HostKeys,
    ImportQuery, ImportReport, Recovery, Registration, RemovalReport, ResumeReport, ResumeRequest,
    RollbackReport, RollbackRequest, SafetyRollback, SandboxInfo, TurnAnswered, TurnEnd, TurnHeld,
    TurnReport, UiUrl, VersionView, WatchStarted,
};
use crab_api::{
    routes, BackendKind, Class, FsSnapshot, ImageFile, Location, SandboxId, SnapshotName, VersionRecord,
    VersionSel,
};
use crab_tests::openapi::{
    operation, request_schema, resolve, response_schema, spec, to_json_schema, validate, validate_strict,
};
use serde::Serialize;
use serde_json::{json, Value};

/// The HTTP methods a path item may hold (its other keys are not operations).
const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// The statuses crabd answers with.
const STATUSES: &[&str] = &["200", "400", "403", "404", "409", "422", "500", "502"];

/// Every component schema, each exercised below. A schema added to the spec
/// and not here (or the other way round) fails [`every_schema_is_listed`].
const SCHEMAS: &[&str] = &[
    "TurnAnswered",
    "SandboxId",
    "SandboxSelector",
    "Class",
    "BackendKind",
    "SnapshotName",
    "VersionSel",
    "FsSnapshot",
    "ImageFile",
    "LocationZfs",
    "LocationBtrfs",
    "LocationBtrfsSubvolume",
    "LocationOverlayCopy",
    "Location",
    "VersionRecord",
    "Registration",
    "SandboxInfo",
    "SandboxInfoList",
    "Crash",
    "Recovery",
    "TurnReport",
    "WatchLagged",
    "WatchStarted",
    "WatchLine",
    "TurnEnd",
    "PodMember",
    "CheckpointRequest",
    "CheckpointReport",
    "RollbackRequest",
    "SafetyRollback",
    "RollbackReport",
    "ForkRequest",
    "ForkReport",
    "ForksRequest",
    "ForksReport",
    "ForkOutcome",
    "DrainRequest",
    "DrainReport",
    "DrainOutcome",
    "ResumeRequest",
    "ResumeReport",
    "ImportQuery",
    "ImportReport",
    "HostKeys",
    "VersionView",
    "VersionViewList",
    "RemovalReport",
    "Empty",
    "ErrorBody",
    "ErrorCode",
    "Event",
    "EventTurn",
    "EventCheckpoint",
    "EventHold",
    "EventRollback",
    "EventRecovery",
    "EventFailed",
    "EventLine",
    "UiUrl",
    "TurnHeld",
];

// === building values ===

fn id(s: &str) -> SandboxId {
    SandboxId::new(s).unwrap()
}

fn to_json(v: &impl Serialize) -> Value {
    serde_json::to_value(v).expect("serializes")
}

/// `value` (serialized) passes `schema` both open and strict.
#[track_caller]
fn assert_valid(schema: &str, value: &impl Serialize) {
    let doc = to_json(value);
    if let Err(e) = validate(schema, &doc) {
        panic!("{e}\nin {doc:#}");
    }
    if let Err(e) = validate_strict(schema, &doc) {
        panic!("strictly: {e}\nin {doc:#}");
    }
}

#[track_caller]
fn assert_invalid(schema: &str, doc: Value) {
    assert!(validate(schema, &doc).is_err(), "{schema} accepts {doc:#}");
}

fn sha(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

fn record(version: u64, class: Class) -> VersionRecord {
    VersionRecord {
        sandbox: id("web-1"),
        version,
        created_unix_ms: 1_767_225_600_123,
        turn: Some(version),
        branch: version / 2,
        class,
        parent: version.checked_sub(1).filter(|p| *p > 0),
        process_image: class.needs_proc().then_some(version),
        fs_snapshot: class.needs_fs().then(|| FsSnapshot {
            backend: BackendKind::OverlayCopy,
            name: SnapshotName::new(&format!("c1767225600{version}")).unwrap(),
        }),
        transcript_turns: 2 * version,
        images: match class.needs_proc() {
            true => vec![
                ImageFile {
                    path: "core-1.img".into(),
                    bytes: 4_194_304,
                    sha256: sha('a'),
                },
                ImageFile {
                    path: "pages-1.img".into(),
                    bytes: 81_920,
                    sha256: sha('0'),
                },
            ],
            false => vec![],
        },
    }
}

/// Every shape of registration: each optional field set, and none.
fn registrations() -> Vec<Registration> {
    let full = Registration {
        id: id("3f1c0a9e2b7d4c6f8a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7"),
        namespace: "k8s.io".into(),
        containerd: "/run/containerd/containerd.sock".into(),
        control: "/run/crab/shim/3f1c0a9e.sock".into(),
        pid: 41_234,
        crab_init: true,
        fs_backend: Some(BackendKind::Btrfs),
        proxy: Some("/run/crab/shim/3f1c0a9e.proxy.sock".into()),
        transcript: Some("/var/lib/crab/transcripts/default/web-1.jsonl".into()),
        cgroup: Some("/sys/fs/cgroup/k8s.io/3f1c0a9e".into()),
        layer: Some("/var/lib/containerd/io.containerd.snapshotter.v1.btrfs/active/17".into()),
        own_snapshots: Some(Location::BtrfsSubvolume {
            subvolume: "/var/lib/containerd/io.containerd.snapshotter.v1.btrfs/active/17".into(),
            store: "/var/lib/containerd/io.containerd.snapshotter.v1.btrfs/crab/17".into(),
        }),
        restored: true,
        pod: Some("agents/run-17".into()),
    };
    let bare = Registration {
        id: id("web-1"),
        namespace: "default".into(),
        containerd: "/run/containerd/containerd.sock".into(),
        control: "/run/crab/shim/web-1.sock".into(),
        pid: 812,
        crab_init: false,
        fs_backend: None,
        proxy: None,
        transcript: None,
        cgroup: None,
        layer: None,
        own_snapshots: None,
        restored: false,
        pod: None,
    };
    let overlay = Registration {
        id: id("agent.test_2"),
        fs_backend: Some(BackendKind::OverlayCopy),
        layer: Some("/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/9/fs".into()),
        ..bare.clone()
    };
    vec![full, bare, overlay]
}

fn sandbox_infos() -> Vec<SandboxInfo> {
    registrations()
        .into_iter()
        .enumerate()
        .map(|(i, registration)| SandboxInfo {
            proxy_url: registration
                .proxy
                .as_ref()
                .map(|_| format!("http://127.0.0.1:7070/s/{}", registration.id)),
            registration,
            running: i != 1,
            versions: i * 3,
            latest: (i > 0).then_some(i as u64 * 3),
            recoveries: i as u32,
            last_recovery: (i > 0).then(|| Recovery {
                version: i as u64 * 3,
                pid: 7_000 + i as i32,
                exit_status: 137,
                at_unix_ms: 1_780_000_000_000,
                total_ms: 412,
                passed_over: (i == 2)
                    .then(|| "version 7 of sandbox web-1 is corrupt".to_owned())
                    .into_iter()
                    .collect(),
            }),
        })
        .collect()
}

fn locations() -> Vec<Location> {
    vec![
        Location::Zfs {
            dataset: "tank/crab/web-1".into(),
        },
        Location::Btrfs {
            dir: "/srv/btrfs/crab/web-1".into(),
        },
        Location::BtrfsSubvolume {
            subvolume: "/srv/btrfs/active/3".into(),
            store: "/srv/btrfs/crab/3".into(),
        },
        Location::OverlayCopy {
            upper: "/var/lib/containerd/overlay/snapshots/12/fs".into(),
            store: "/var/lib/crab/fs/web-1".into(),
        },
    ]
}

const CLASSES: [Class; 4] = [Class::None, Class::Fs, Class::Proc, Class::Full];
const BACKENDS: [BackendKind; 3] = [BackendKind::Zfs, BackendKind::Btrfs, BackendKind::OverlayCopy];

// === a. routes ===

fn spec_operations() -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (pattern, item) in spec()["paths"].as_object().expect("paths") {
        for key in item.as_object().expect("a path item").keys() {
            if METHODS.contains(&key.as_str()) {
                ops.insert((pattern.clone(), key.clone()));
            }
        }
    }
    ops
}

#[test]
fn the_spec_has_exactly_the_routes_of_routes_all() {
    let mut from_code = BTreeSet::new();
    for (pattern, methods) in routes::ALL {
        for method in *methods {
            assert!(
                from_code.insert((pattern.to_string(), method.to_string())),
                "{method} {pattern} twice in routes::ALL"
            );
        }
    }
    let from_spec = spec_operations();
    let missing: Vec<_> = from_code.difference(&from_spec).collect();
    let extra: Vec<_> = from_spec.difference(&from_code).collect();
    assert!(
        missing.is_empty(),
        "routes::ALL has, openapi.json lacks: {missing:?}"
    );
    assert!(extra.is_empty(), "openapi.json has, routes::ALL lacks: {extra:?}");
}

/// The `{name}`s of a pattern.
fn template_params(pattern: &str) -> BTreeSet<String> {
    pattern
        .split('{')
        .skip(1)
        .map(|rest| rest.split_once('}').expect("a closed {param}").0.to_owned())
        .collect()
}

#[test]
fn each_operation_declares_exactly_its_path_parameters() {
    for (pattern, method) in spec_operations() {
        let item = &spec()["paths"][&pattern];
        let mut declared = BTreeMap::new();
        // Operation-level parameters override path-level ones (name + in).
        for p in [&item["parameters"], &item[&method]["parameters"]]
            .into_iter()
            .filter_map(Value::as_array)
            .flatten()
        {
            let p = resolve(p);
            let key = (
                p["name"].as_str().unwrap().to_owned(),
                p["in"].as_str().unwrap().to_owned(),
            );
            declared.insert(key, p);
        }
        let in_path: BTreeSet<String> = declared
            .iter()
            .filter(|((_, place), _)| place == "path")
            .map(|((name, _), p)| {
                assert_eq!(
                    p["required"],
                    json!(true),
                    "{method} {pattern}: path parameter {name}"
                );
                name.clone()
            })
            .collect();
        assert_eq!(in_path, template_params(&pattern), "{method} {pattern}");
    }
}

#[test]
fn answers_use_only_crabds_statuses_and_errors_are_error_bodies() {
    for (pattern, method) in spec_operations() {
        let responses = spec()["paths"][&pattern][&method]["responses"]
            .as_object()
            .unwrap();
        assert!(responses.contains_key("200"), "{method} {pattern} has no 200");
        for status in responses.keys() {
            assert!(
                STATUSES.contains(&status.as_str()),
                "{method} {pattern}: status {status}"
            );
            if status != "200" {
                assert_eq!(
                    response_schema(&method, &pattern, status),
                    Some("ErrorBody"),
                    "{method} {pattern} {status}"
                );
            }
        }
    }
}

#[test]
fn every_schema_is_listed() {
    let in_spec: BTreeSet<&str> = spec()["components"]["schemas"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let listed: BTreeSet<&str> = SCHEMAS.iter().copied().collect();
    assert_eq!(in_spec, listed);
}

/// Every schema object in `v`, with its JSON pointer.
fn walk<'a>(v: &'a Value, at: String, out: &mut Vec<(String, &'a Value)>) {
    match v {
        Value::Object(map) => {
            out.push((at.clone(), v));
            for (k, child) in map {
                walk(child, format!("{at}/{k}"), out);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                walk(child, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn the_spec_is_openapi_3_0_as_tools_read_it() {
    assert_eq!(spec()["openapi"], json!("3.0.3"));
    let mut objects = Vec::new();
    walk(spec(), String::new(), &mut objects);
    for (at, obj) in objects {
        let map = obj.as_object().unwrap();
        if let Some(r) = map.get("$ref") {
            // OpenAPI 3.0 ignores a $ref's siblings: wrap in allOf instead.
            assert_eq!(map.len(), 1, "{at}: $ref with siblings");
            let r = r.as_str().unwrap();
            assert!(
                spec().pointer(r.strip_prefix('#').unwrap()).is_some(),
                "{at}: {r} resolves"
            );
        }
        // Flattened fields (SandboxInfo, VersionView) need open objects.
        assert_ne!(map.get("additionalProperties"), Some(&json!(false)), "{at}");
        if map.get("nullable") == Some(&json!(true)) {
            assert!(
                map.contains_key("type"),
                "{at}: nullable without a type means nothing"
            );
            if let Some(values) = map.get("enum") {
                assert!(
                    values.as_array().unwrap().contains(&Value::Null),
                    "{at}: nullable enum lacks null"
                );
            }
        }
    }
    // A schema's required fields are declared: by itself, or by its allOf
    // parts (a flattened type).
    for (name, schema) in spec()["components"]["schemas"].as_object().unwrap() {
        let parts: Vec<&Value> = std::iter::once(schema)
            .chain(schema["allOf"].as_array().into_iter().flatten().map(resolve))
            .collect();
        let declared: BTreeSet<&str> = parts
            .iter()
            .filter_map(|p| p["properties"].as_object())
            .flat_map(|props| props.keys().map(String::as_str))
            .collect();
        for part in &parts {
            for field in part["required"].as_array().into_iter().flatten() {
                let field = field.as_str().unwrap();
                assert!(declared.contains(field), "{name} requires undeclared {field}");
            }
        }
    }
}

#[test]
fn the_helpers_find_each_routes_messages() {
    let cases: &[(&str, &str, Option<&str>, Option<&str>)] = &[
        ("get", routes::SANDBOXES, None, Some("SandboxInfoList")),
        (
            "post",
            routes::SANDBOXES,
            Some("Registration"),
            Some("SandboxInfo"),
        ),
        ("get", routes::SANDBOX, None, Some("SandboxInfo")),
        ("delete", routes::SANDBOX, None, Some("Empty")),
        (
            "post",
            routes::CHECKPOINT,
            Some("CheckpointRequest"),
            Some("CheckpointReport"),
        ),
        ("post", routes::TURNS, Some("TurnEnd"), Some("CheckpointReport")),
        ("post", routes::ANSWERED, None, Some("TurnAnswered")),
        ("post", routes::HELD, Some("TurnHeld"), Some("Empty")),
        ("get", routes::METRICS, None, None),
        ("get", routes::VERSIONS, None, Some("VersionViewList")),
        (
            "post",
            routes::ROLLBACK,
            Some("RollbackRequest"),
            Some("RollbackReport"),
        ),
        ("post", routes::RECOVER, Some("Crash"), Some("Recovery")),
        ("delete", routes::VERSION, None, Some("RemovalReport")),
        ("post", routes::FORK, Some("ForkRequest"), Some("ForkReport")),
        ("post", routes::FORKS, Some("ForksRequest"), Some("ForksReport")),
        ("post", routes::DRAIN, Some("DrainRequest"), Some("DrainReport")),
        (
            "post",
            routes::RESUME,
            Some("ResumeRequest"),
            Some("ResumeReport"),
        ),
        ("post", routes::TURN, None, Some("TurnReport")),
        ("get", routes::WATCH, None, Some("WatchLine")),
        ("get", routes::EVENTS, None, Some("EventLine")),
        ("get", routes::UI, None, Some("UiUrl")),
        ("get", routes::EXPORT, None, None),
        ("post", routes::IMPORT, None, Some("ImportReport")),
        ("get", routes::KEYS, None, Some("HostKeys")),
    ];
    assert_eq!(cases.len(), spec_operations().len());
    for (method, pattern, request, answer) in cases {
        assert_eq!(request_schema(method, pattern), *request, "{method} {pattern}");
        assert_eq!(
            response_schema(method, pattern, "200"),
            *answer,
            "{method} {pattern}"
        );
    }
    assert_eq!(response_schema("GET", routes::SANDBOX, "404"), Some("ErrorBody"));
    assert_eq!(response_schema("get", routes::SANDBOXES, "404"), None);
    assert_eq!(response_schema("put", routes::SANDBOXES, "200"), None);
    assert_eq!(response_schema("get", "/v1/nothing", "200"), None);
    // The archive routes: a tar body each way.
    let export = &operation("get", routes::EXPORT).unwrap()["responses"]["200"]["content"];
    assert!(export.get("application/x-tar").is_some());
    let import = &operation("post", routes::IMPORT).unwrap()["requestBody"]["content"];
    assert!(import.get("application/x-tar").is_some());
    // The hand turn takes no body: crabctl sends `null`, which passes.
    let turn = &operation("post", routes::TURN).unwrap()["requestBody"];
    assert_eq!(turn["required"], json!(false));
    let null_schema = to_json_schema(&turn["content"]["application/json"]["schema"]);
    assert!(jsonschema::is_valid(&null_schema, &to_json(&())));
    assert!(!jsonschema::is_valid(&null_schema, &json!({})));
}

#[test]
fn imports_query_parameters_are_import_query() {
    let params = operation("post", routes::IMPORT).unwrap()["parameters"]
        .as_array()
        .unwrap();
    let names: BTreeSet<&str> = params
        .iter()
        .map(|p| {
            assert_eq!(p["in"], json!("query"));
            assert_eq!(p["required"], json!(false));
            p["name"].as_str().unwrap()
        })
        .collect();
    let full = ImportQuery {
        name: Some(id("web-1-copy")),
        namespace: Some("k8s.io".into()),
        containerd: Some("/run/containerd/containerd.sock".into()),
        allow_privileged_files: true,
        insecure_unsigned: true,
    };
    let doc = to_json(&full);
    let fields: BTreeSet<&str> = doc.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(names, fields);
    assert_valid("ImportQuery", &full);
    assert_valid("ImportQuery", &ImportQuery::default());
    assert_eq!(to_json(&ImportQuery::default()), json!({}));
    // Each parameter's schema is the ImportQuery field's.
    for p in params {
        let name = p["name"].as_str().unwrap();
        assert_eq!(
            to_json_schema(&p["schema"]),
            to_json_schema(&strip_description(
                &spec()["components"]["schemas"]["ImportQuery"]["properties"][name]
            )),
            "{name}"
        );
    }
}

/// `schema` without its description, its `allOf: [x]` wrapper undone.
fn strip_description(schema: &Value) -> Value {
    let mut s = schema.clone();
    s.as_object_mut().unwrap().remove("description");
    match s.get("allOf").and_then(Value::as_array) {
        Some(parts) if parts.len() == 1 && s.as_object().unwrap().len() == 1 => parts[0].clone(),
        _ => s,
    }
}

// === b. messages ===

#[test]
fn words() {
    for class in CLASSES {
        assert_valid("Class", &class);
    }
    for backend in BACKENDS {
        assert_valid("BackendKind", &backend);
    }
    for s in ["a", "web-1", "a.b_c-9", &"f".repeat(76)] {
        assert_valid("SandboxId", &id(s));
        assert_valid("SandboxSelector", &s);
    }
    assert_valid("SnapshotName", &SnapshotName::new("c1767225600123").unwrap());
    assert_valid("SnapshotName", &SnapshotName::new(&"z".repeat(64)).unwrap());
    for sel in [VersionSel::Latest, VersionSel::Number(1), VersionSel::Number(42)] {
        assert_valid("VersionSel", &sel);
    }
    for backend in BACKENDS {
        let snap = FsSnapshot {
            backend,
            name: SnapshotName::new("v1.base").unwrap(),
        };
        assert_valid("FsSnapshot", &snap);
    }
    for location in locations() {
        assert_valid("Location", &location);
    }
    assert_valid(
        "ImageFile",
        &ImageFile {
            path: "images/pstree.img".into(),
            bytes: 0,
            sha256: sha('e'),
        },
    );
}

#[test]
fn sandboxes() {
    for reg in registrations() {
        assert_valid("Registration", &reg);
    }
    for info in sandbox_infos() {
        assert_valid("SandboxInfo", &info);
    }
    assert_valid("SandboxInfoList", &sandbox_infos());
    assert_valid("SandboxInfoList", &Vec::<SandboxInfo>::new());
    assert_valid("Empty", &json!({}));
    assert_valid(
        "ErrorBody",
        &ErrorBody {
            error: "no sandbox matches \"nope\" (see `crabctl ps`)".into(),
            code: ErrorCode::UnknownSandbox,
        },
    );
}

#[test]
fn every_error_code_is_in_the_spec() {
    for code in ErrorCode::ALL {
        assert_valid("ErrorCode", &code);
    }
    let in_spec = spec()["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(in_spec, ErrorCode::ALL.len(), "the spec names exactly the codes");
}

#[test]
fn versions() {
    for (n, class) in CLASSES.into_iter().enumerate() {
        let r = record(n as u64 + 1, class);
        assert_valid("VersionRecord", &r);
        assert_valid(
            "CheckpointReport",
            &CheckpointReport {
                version: r.clone(),
                frozen_ms: 12.5,
                total_ms: 140.25,
                rolled_back: None,
            },
        );
        assert_valid(
            "CheckpointReport",
            &CheckpointReport {
                version: r.clone(),
                frozen_ms: 0.0,
                total_ms: 310.5,
                rolled_back: Some(SafetyRollback {
                    rule: "protected_paths \"/etc/**\"".into(),
                    what: "/etc/passwd".into(),
                    version: r.version,
                    notice: "rolled back".into(),
                }),
            },
        );
        assert_valid("CheckpointRequest", &CheckpointRequest { class });
    }
    let first = VersionRecord {
        turn: None,
        ..record(1, Class::Full)
    };
    assert_valid("VersionRecord", &first);
    let views = vec![
        VersionView {
            line: 1,
            record: Some(first),
            defect: None,
        },
        VersionView {
            line: 2,
            record: None,
            defect: Some("CorruptManifestLine { line: 2 }".into()),
        },
        VersionView {
            line: 3,
            record: Some(record(3, Class::Fs)),
            defect: Some("MissingImage { path: \"core-1.img\" }".into()),
        },
    ];
    for view in &views {
        assert_valid("VersionView", view);
    }
    assert_valid("VersionViewList", &views);
    assert_valid("RemovalReport", &RemovalReport { removed: vec![3, 4] });
    assert_valid("RemovalReport", &RemovalReport { removed: vec![] });
}

#[test]
fn turns() {
    let reports = [
        TurnReport {
            sandbox: id("web-1"),
            turn: 7,
            class: Class::Fs,
            reasons: vec![
                json!({"kind": "write", "path": "/app/notes.md"}),
                json!("unlink /tmp/x"),
                json!(3),
                Value::Null,
                json!([1, "two"]),
            ],
            n_reasons: 9,
        },
        TurnReport {
            sandbox: id("web-1"),
            turn: 0,
            class: Class::Full,
            reasons: vec![json!({"kind": "unknown", "why": "no inspector"})],
            n_reasons: 1,
        },
        TurnReport {
            sandbox: id("web-1"),
            turn: 8,
            class: Class::None,
            reasons: vec![],
            n_reasons: 0,
        },
    ];
    for report in &reports {
        assert_valid("TurnReport", report);
        assert_valid("WatchLine", report);
    }
    // What crabd writes when a watcher lags behind.
    assert_valid("WatchLagged", &json!({"lagged": 12}));
    assert_valid("WatchLine", &json!({"lagged": 12}));
    let started = WatchStarted { watching: id("s1") };
    assert_valid("WatchStarted", &started);
    assert_valid("WatchLine", &started);
    assert_invalid("WatchStarted", json!({"watching": "../x"}));
    let member = crab_api::crabd::PodMember {
        id: id("sidecar"),
        cgroup: "/sys/fs/cgroup/k8s/sidecar".into(),
        crab_init: true,
    };
    for (expected_answer_ms, inside, pod_members) in [(None, true, 0), (Some(4_200), false, 2)] {
        let members = vec![member.clone(); pod_members as usize];
        assert_valid(
            "TurnEnd",
            &TurnEnd {
                turn: 7,
                branch: 2,
                inside,
                transcript_turns: 14,
                expected_answer_ms,
                pod_members,
                members,
            },
        );
    }
    assert_valid("TurnAnswered", &TurnAnswered { promoted: true });
    assert_valid("Crash", &Crash { exit_status: 139 });
}

#[test]
fn events() {
    let kinds = [
        EventKind::Turn {
            turn: 3,
            class: Some(Class::Fs),
            version: Some(4),
            error: None,
        },
        EventKind::Turn {
            turn: 4,
            class: None,
            version: None,
            error: Some("superseded".into()),
        },
        EventKind::Checkpoint {
            version: 4,
            class: Class::Full,
            turn: Some(3),
            bytes: 1 << 20,
            frozen_ms: 120.5,
            total_ms: 150.0,
        },
        EventKind::Checkpoint {
            version: 5,
            class: Class::None,
            turn: None,
            bytes: 0,
            frozen_ms: 0.0,
            total_ms: 1.0,
        },
        EventKind::Hold {
            turn: 3,
            held_ms: 12.0,
        },
        EventKind::Rollback {
            version: 2,
            undo_ms: Some(140.0),
            total_ms: 300.0,
            reason: None,
        },
        EventKind::Rollback {
            version: 2,
            undo_ms: None,
            total_ms: 130.0,
            reason: Some("safety rule protected path: /etc/passwd".into()),
        },
        EventKind::Recovery {
            version: 4,
            exit_status: 137,
            total_ms: 180,
        },
        EventKind::Failed {
            what: "checkpoint".into(),
            error: "the store is full".into(),
        },
    ];
    for kind in kinds {
        let event = Event {
            at_unix_ms: 1_764_000_000_000,
            sandbox: id("web-1"),
            kind,
        };
        assert_valid("Event", &event);
        assert_valid("EventLine", &event);
    }
    assert_valid("EventLine", &json!({"lagged": 3}));
    assert_invalid(
        "Event",
        json!({"at_unix_ms": 1, "sandbox": "s", "event": "turn", "turn": 1, "class": "most", "version": 1}),
    );
    assert_invalid("Event", json!({"at_unix_ms": 1, "sandbox": "s", "event": "nap"}));
    assert_valid(
        "UiUrl",
        &UiUrl {
            url: Some("http://127.0.0.1:7880/ui/00112233445566778899aabbccddeeff/".into()),
        },
    );
    assert_valid("UiUrl", &UiUrl { url: None });
    assert_valid("TurnHeld", &TurnHeld { held_ms: 12.5 });
    assert_invalid("TurnHeld", json!({"held_ms": -1}));
}

#[test]
fn rollbacks_forks_and_imports() {
    for version in [VersionSel::Latest, VersionSel::Number(3)] {
        for undo in [true, false] {
            assert_valid(
                "RollbackRequest",
                &RollbackRequest {
                    version,
                    undo,
                    files_only: !undo,
                },
            );
        }
        for name in [None, Some(id("web-1-try2"))] {
            assert_valid(
                "ForkRequest",
                &ForkRequest {
                    version,
                    name: name.clone(),
                },
            );
            assert_valid(
                "ForksRequest",
                &ForksRequest {
                    version,
                    count: 16,
                    prefix: name,
                },
            );
        }
    }
    for files_from in [None, Some(2)] {
        assert_valid(
            "RollbackReport",
            &RollbackReport {
                version: 3,
                pid: 51_002,
                restore_ms: 310.5,
                undo_ms: 98.0,
                total_ms: 420.75,
                files_from,
                passed_over: match files_from {
                    Some(_) => vec![],
                    None => vec![
                        "version 4 of sandbox web-1: image file pages.img of version 4 is corrupt".into(),
                    ],
                },
            },
        );
    }
    assert_valid(
        "ForkReport",
        &ForkReport {
            id: id("web-1-fork3-81723"),
            pid: 51_440,
            version: 3,
            total_ms: 1_250.0,
        },
    );
    assert_valid(
        "ForksReport",
        &ForksReport {
            version: 3,
            forks: vec![
                ForkOutcome {
                    id: id("tree-1"),
                    pid: Some(51_441),
                    bytes: 4096,
                    total_ms: 900.5,
                    error: None,
                },
                ForkOutcome {
                    id: id("tree-2"),
                    pid: None,
                    bytes: 0,
                    total_ms: 20.0,
                    error: Some("containerd: no space left on device".into()),
                },
            ],
            total_ms: 1_000.0,
        },
    );
    for version in [None, Some(VersionSel::Latest), Some(VersionSel::Number(2))] {
        assert_valid("ResumeRequest", &ResumeRequest { version });
    }
    assert_valid(
        "ResumeReport",
        &ResumeReport {
            version: 2,
            pid: 7_001,
            total_ms: 380.5,
            passed_over: vec!["version 3 of sandbox web-1 is corrupt".into()],
        },
    );
    for export_dir in [None, Some("/var/lib/crab/drain".into())] {
        assert_valid(
            "DrainRequest",
            &DrainRequest {
                grace_secs: 30,
                export_dir,
            },
        );
    }
    assert_valid(
        "DrainReport",
        &DrainReport {
            sandboxes: vec![
                DrainOutcome {
                    id: id("web-1"),
                    made: true,
                    version: Some(4),
                    durable_ms: Some(180.5),
                    archive: Some("/var/lib/crab/drain/web-1.crab".into()),
                    exported_ms: Some(420.0),
                    error: None,
                },
                DrainOutcome {
                    id: id("web-2"),
                    made: false,
                    version: None,
                    durable_ms: None,
                    archive: None,
                    exported_ms: None,
                    error: Some("not durable within the grace of 30s".into()),
                },
            ],
            grace_secs: 30,
            total_ms: 30_000.0,
        },
    );
    assert_valid(
        "ImportReport",
        &ImportReport {
            id: id("web-1"),
            version: 1,
            pid: 60_001,
            total_ms: 2_048.5,
        },
    );
    assert_valid(
        "HostKeys",
        &HostKeys {
            export_key: "ab".repeat(32),
            trusted_dir: "/var/lib/crab/engine/trusted-keys".into(),
            trusted: vec!["ab".repeat(32), "0f".repeat(32)],
        },
    );
}

/// What the spec lets a client leave out, serde lets it leave out too:
/// each request, with only the fields the spec requires, parses.
#[test]
fn the_least_the_spec_requires_the_types_take() {
    let reg: Registration = least(
        "Registration",
        json!({
            "id": "web-1",
            "namespace": "default",
            "containerd": "/run/containerd/containerd.sock",
            "control": "/run/crab/shim/web-1.sock",
            "pid": 812,
        }),
    );
    assert_eq!(reg, registrations()[1]);
    let rollback: RollbackRequest = least("RollbackRequest", json!({"version": "latest"}));
    assert!(rollback.undo, "undo defaults to true, as the spec says");
    assert_eq!(
        spec()["components"]["schemas"]["RollbackRequest"]["properties"]["undo"]["default"],
        json!(true)
    );
    let fork: ForkRequest = least("ForkRequest", json!({"version": 2}));
    assert_eq!(fork.name, None);
    let _: CheckpointRequest = least("CheckpointRequest", json!({"class": "full"}));
    let _: TurnEnd = least("TurnEnd", json!({"turn": 1, "transcript_turns": 1}));
    let _: Crash = least("Crash", json!({"exit_status": 137}));
    let _: ImportQuery = least("ImportQuery", json!({}));
    // And answers with unknown fields still parse (the schemas are open).
    let _: ErrorBody = least(
        "ErrorBody",
        json!({"error": "x", "code": "internal", "hint": "y"}),
    );
}

#[track_caller]
fn least<T: serde::de::DeserializeOwned>(schema: &str, doc: Value) -> T {
    validate(schema, &doc).unwrap();
    serde_json::from_value(doc).unwrap_or_else(|e| panic!("{schema}: {e}"))
}

/// Documents the types refuse, the spec refuses too.
#[test]
fn what_the_types_refuse_the_spec_refuses() {
    let reg = to_json(&registrations()[0]);
    let without = |field: &str| {
        let mut doc = reg.clone();
        doc.as_object_mut().unwrap().remove(field);
        doc
    };
    let with = |field: &str, value: Value| {
        let mut doc = reg.clone();
        doc[field] = value;
        doc
    };
    let cases: Vec<Refusal> = vec![
        ("Registration", without("id"), refused::<Registration>),
        ("Registration", without("pid"), refused::<Registration>),
        (
            "Registration",
            with("id", json!("../etc")),
            refused::<Registration>,
        ),
        ("Registration", with("pid", json!("812")), refused::<Registration>),
        (
            "Registration",
            with("pid", json!(1_u64 << 40)),
            refused::<Registration>,
        ),
        (
            "Registration",
            with("fs_backend", json!("ext4")),
            refused::<Registration>,
        ),
        (
            "Registration",
            with("fs_backend", json!("overlay_copy")),
            refused::<Registration>,
        ),
        (
            "Registration",
            with("own_snapshots", json!({"kind": "nfs"})),
            refused::<Registration>,
        ),
        ("Registration", with("proxy", json!(7)), refused::<Registration>),
        ("SandboxId", json!("../etc"), refused::<SandboxId>),
        ("SandboxId", json!(""), refused::<SandboxId>),
        ("SandboxId", json!(".hidden"), refused::<SandboxId>),
        ("SandboxId", json!("-x"), refused::<SandboxId>),
        ("SandboxId", json!("a/b"), refused::<SandboxId>),
        ("SandboxId", json!("a\n"), refused::<SandboxId>),
        ("SandboxId", json!("é"), refused::<SandboxId>),
        ("SandboxId", json!("a".repeat(77)), refused::<SandboxId>),
        ("SnapshotName", json!("a".repeat(65)), refused::<SnapshotName>),
        ("SnapshotName", json!("../x"), refused::<SnapshotName>),
        ("Class", json!("bogus"), refused::<Class>),
        ("Class", json!("FULL"), refused::<Class>),
        ("Class", Value::Null, refused::<Class>),
        ("BackendKind", json!("overlay_copy"), refused::<BackendKind>),
        ("VersionSel", json!(0), refused::<VersionSel>),
        ("VersionSel", json!(-1), refused::<VersionSel>),
        ("VersionSel", json!("newest"), refused::<VersionSel>),
        ("Location", json!({"kind": "zfs"}), refused::<Location>),
        (
            "Location",
            json!({"kind": "nfs", "dir": "/x"}),
            refused::<Location>,
        ),
        ("Location", json!({"dataset": "tank/x"}), refused::<Location>),
        (
            "CheckpointRequest",
            json!({"class": "bogus"}),
            refused::<CheckpointRequest>,
        ),
        ("CheckpointRequest", json!({}), refused::<CheckpointRequest>),
        (
            "RollbackRequest",
            json!({"undo": false}),
            refused::<RollbackRequest>,
        ),
        (
            "RollbackRequest",
            json!({"version": 1, "undo": "no"}),
            refused::<RollbackRequest>,
        ),
        (
            "ForkRequest",
            json!({"version": "latest", "name": "../etc"}),
            refused::<ForkRequest>,
        ),
        (
            "TurnEnd",
            json!({"turn": -1, "transcript_turns": 0}),
            refused::<TurnEnd>,
        ),
        ("TurnEnd", json!({"turn": 1}), refused::<TurnEnd>),
        (
            "TurnReport",
            json!({"sandbox": "s", "turn": 1, "class": "fs"}),
            refused::<TurnReport>,
        ),
        (
            "TurnReport",
            json!({"sandbox": "s", "turn": 1, "class": "fs", "reasons": "x"}),
            refused::<TurnReport>,
        ),
        ("ErrorBody", json!({}), refused::<ErrorBody>),
        ("ErrorBody", json!({"error": null}), refused::<ErrorBody>),
        (
            "RemovalReport",
            json!({"removed": ["3"]}),
            refused::<RemovalReport>,
        ),
    ];
    for (schema, doc, rust_agrees) in cases {
        assert_invalid(schema, doc.clone());
        assert!(rust_agrees(doc.clone()), "{schema}: the types' view of {doc}");
    }
    // A fork count out of range: crabd answers 400 (the types take it).
    assert_invalid("ForksRequest", json!({"version": 1, "count": 0}));
    assert_invalid("ForksRequest", json!({"version": 1, "count": 10_000}));
    assert_invalid("DrainRequest", json!({"grace_secs": 0}));
    // A SandboxInfo is its registration and more: either missing fails.
    let info = to_json(&sandbox_infos()[0]);
    for field in ["id", "running", "fs_backend", "latest"] {
        let mut doc = info.clone();
        doc.as_object_mut().unwrap().remove(field);
        assert_invalid("SandboxInfo", doc);
    }
}

/// A schema, a document it refuses, and whether the type refuses it too.
type Refusal = (&'static str, Value, fn(Value) -> bool);

fn refused<T: serde::de::DeserializeOwned>(doc: Value) -> bool {
    serde_json::from_value::<T>(doc).is_err()
}

/// Where the spec is stricter than serde: what crabd never sends.
#[test]
fn what_crabd_never_sends_the_spec_refuses() {
    // A version line with part of a record: serde would read it as an
    // unreadable line (`record: None`); crabd writes all of a record or none.
    assert_invalid(
        "VersionView",
        json!({"line": 1, "defect": null, "sandbox": "web-1"}),
    );
    let mut partial = to_json(&VersionView {
        line: 1,
        record: Some(record(1, Class::Full)),
        defect: None,
    });
    partial.as_object_mut().unwrap().remove("images");
    assert_invalid("VersionView", partial);
    // A version in a JSON body is a number or `latest` (serde also takes
    // the number as text, as a path parameter has it).
    assert_invalid("VersionSel", json!("3"));
    assert!(serde_json::from_value::<VersionSel>(json!("3")).is_ok());
    // Digests are lower-case hex.
    assert_invalid("ImageFile", json!({"path": "a", "bytes": 1, "sha256": sha('A')}));
    // Answers carry every field, null or not.
    let mut info = to_json(&sandbox_infos()[1]);
    info.as_object_mut().unwrap().remove("proxy");
    assert_invalid("SandboxInfo", info);
    let mut r = to_json(&record(1, Class::None));
    r.as_object_mut().unwrap().remove("fs_snapshot");
    assert_invalid("VersionRecord", r);
}

/// Strict checking finds a field the spec does not name; open checking,
/// as the spec means it, lets it by.
#[test]
fn strict_checking_finds_undeclared_fields() {
    let doc = json!({"backend": "zfs", "name": "v1", "compressed": true});
    assert!(validate("FsSnapshot", &doc).is_ok());
    assert!(validate_strict("FsSnapshot", &doc).is_err());
    let mut info = to_json(&sandbox_infos()[0]);
    assert!(validate_strict("SandboxInfo", &info).is_ok());
    info["paused"] = json!(false);
    assert!(validate("SandboxInfo", &info).is_ok());
    assert!(validate_strict("SandboxInfo", &info).is_err());
    assert!(validate("Nonesuch", &json!({})).is_err());
}

/// A fake crabd on a unix socket that answers each request with `body`.
fn fake_crabd(dir: &std::path::Path, body: &'static str) -> std::path::PathBuf {
    use std::io::{BufRead, Write};
    let socket = dir.join("crabd.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let mut r = std::io::BufReader::new(conn.try_clone().unwrap());
            let (mut line, mut len) = (String::new(), 0);
            while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            // The whole request is read before the answer: a unix socket
            // closed with unread data resets its peer.
            let mut request_body = vec![0; len];
            let _ = std::io::Read::read_exact(&mut r, &mut request_body);
            let mut w = conn;
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    socket
}

/// Sends `request` through a checking relay in front of a crabd answering
/// `body`; answers what the relay found.
fn through_relay(body: &'static str, request: &str) -> Vec<String> {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let crabd = fake_crabd(dir.path(), body);
    let relay = crab_tests::wire::CheckedSocket::start(&crabd).expect("the fake crabd answers");
    let mut client = std::os::unix::net::UnixStream::connect(relay.socket()).unwrap();
    client.write_all(request.as_bytes()).unwrap();
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    assert!(answer.ends_with(body), "the answer goes through: {answer}");
    relay.finish()
}

#[test]
fn the_relay_holds_requests_and_answers_on_the_wire_to_the_spec() {
    let list = "GET http://crab/v1/sandboxes HTTP/1.1\r\nhost: crab\r\n\r\n";
    assert_eq!(through_relay("[]", list), Vec::<String>::new());
    let found = through_relay(r#"{"bogus":1}"#, list);
    assert_eq!(found.len(), 1, "{found:?}");
    let bad_request = "POST /v1/sandboxes/s1/checkpoint HTTP/1.1\r\ncontent-type: application/json\r\n\
                       content-length: 16\r\n\r\n{\"class\":\"most\"}";
    let found = through_relay("{}", bad_request);
    assert!(found.iter().any(|f| f.contains("request")), "{found:?}");
}
