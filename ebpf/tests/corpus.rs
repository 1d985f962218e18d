//! The labeled corpus (`corpus.toml`): agent-like turns run in real crab
//! sandboxes under containerd, classified by the real BPF programs. Zero
//! false negatives, at most 3% false positives; prints the confusion matrix.
//! Needs root: CI runs it as root.
//!
//! The sandboxes run the devbox image with the host's `/usr` bound
//! read-only, so git, gcc, python3 and sqlite3 are the host's.

#[path = "support/inspector.rs"]
mod inspector;

use std::collections::BTreeMap;
use std::path::PathBuf;

use crab_inspector::{unified_mount, Class, TurnReport};
use crab_tests::leftovers::assert_clean;
use crab_tests::Containerd;
use serde::Deserialize;

#[derive(Deserialize)]
struct Corpus {
    setup: String,
    /// Long-lived processes started after the setup: name → script.
    daemons: BTreeMap<String, String>,
    turn: Vec<Turn>,
}

#[derive(Deserialize)]
struct Turn {
    /// A script run by a fresh `sh` (cwd /work), in its own exec.
    run: Option<String>,
    /// A line for the sandbox's persistent shell.
    shell: Option<String>,
    /// A line for the sandbox's long-lived Python interpreter.
    repl: Option<String>,
    /// "plain" (default) or "noisy" (the inspector calls `sh` noisy there).
    sandbox: Option<String>,
    expect: String,
}

struct Sandbox<'a> {
    ctd: &'a Containerd,
    id: String,
    n_exec: std::cell::Cell<u32>,
}

impl Sandbox<'_> {
    fn start<'a>(ctd: &'a Containerd, id: &str) -> Sandbox<'a> {
        ctd.run_devbox(id);
        Sandbox {
            ctd,
            id: id.to_owned(),
            n_exec: 0.into(),
        }
    }

    /// The sandbox's unified cgroup directory, from its init's /proc entry.
    fn cgroup_dir(&self) -> PathBuf {
        let pid = self.ctd.task_pid(&self.id).expect("task running");
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("read cgroup");
        let rel = cg
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("a unified cgroup line");
        unified_mount()
            .expect("cgroup2")
            .join(rel.trim_start_matches('/'))
    }

    /// Runs `sh -c script [args…]` in the sandbox (cwd /work) and returns
    /// (success, output).
    fn exec(&self, detach: bool, script: &str, args: &[&str]) -> (bool, String) {
        let n = self.n_exec.get() + 1;
        self.n_exec.set(n);
        let exec_id = format!("x{n}");
        let full = format!("export HOME=/root; cd /work 2>/dev/null; {script}");
        let mut argv = vec!["task", "exec", "--exec-id", &exec_id];
        if detach {
            argv.push("-d");
        }
        argv.extend([self.id.as_str(), "sh", "-c", &full, "sh"]);
        argv.extend(args);
        let out = self.ctd.ctr(&argv);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }
}

fn load() -> Corpus {
    let text = include_str!("corpus.toml");
    toml::from_str(text).expect("corpus.toml parses")
}

#[test]
fn corpus() {
    let corpus = load();
    assert!(corpus.turn.len() >= 150, "{} turns", corpus.turn.len());
    let ctd = Containerd::start();
    let plain = Sandbox::start(&ctd, "plain");
    let noisy = Sandbox::start(&ctd, "noisy");
    // Two inspectors: the noise rule is per inspector (per pin directory).
    let insp_plain = inspector::inspector(&[], 8 << 20, true);
    let insp_noisy = inspector::inspector(&["sh"], 8 << 20, true);

    for sb in [&plain, &noisy] {
        let (ok, out) = sb.exec(false, &corpus.setup, &[]);
        assert!(ok, "setup failed: {out}");
        for script in corpus.daemons.values() {
            let (ok, out) = sb.exec(true, script, &[]);
            assert!(ok, "daemon failed: {out}");
        }
        // The daemons are up once their fifos answer.
        let (ok, out) = sb.exec(
            false,
            "echo 'pass' > /tmp/repl.in; cat /tmp/repl.ack; echo true > /tmp/sh.in; cat /tmp/sh.ack",
            &[],
        );
        assert!(ok, "daemons do not answer: {out}");
    }
    // Both run crab-init as their pid 1 (the shim's default), as crabd
    // hears at registration.
    insp_plain
        .register("plain", &plain.cgroup_dir())
        .expect("register");
    insp_plain.quiet_init("plain").expect("quiet init");
    insp_noisy
        .register("noisy", &noisy.cgroup_dir())
        .expect("register");
    insp_noisy.quiet_init("noisy").expect("quiet init");
    insp_plain.turn_end("plain").expect("first turn");
    insp_noisy.turn_end("noisy").expect("first turn");

    let classes = [Class::None, Class::Fs, Class::Proc, Class::Full];
    let mut matrix = [[0usize; 4]; 4];
    let mut false_negatives = Vec::new();
    let mut false_positives = Vec::new();
    for (idx, turn) in corpus.turn.iter().enumerate() {
        let expect: Class = turn.expect.parse().expect("a class");
        let (sb, insp) = match turn.sandbox.as_deref() {
            Some("noisy") => (&noisy, &insp_noisy),
            _ => (&plain, &insp_plain),
        };
        let (ok, out, what) = if let Some(script) = &turn.run {
            let (ok, out) = sb.exec(false, script, &[]);
            (ok, out, script.clone())
        } else if let Some(line) = &turn.shell {
            let (ok, out) = sb.exec(
                false,
                "printf '%s\\n' \"$1\" > /tmp/sh.in; cat /tmp/sh.ack",
                &[line],
            );
            (ok, out, format!("shell: {line}"))
        } else if let Some(line) = &turn.repl {
            let (ok, out) = sb.exec(
                false,
                "printf '%s\\n' \"$1\" > /tmp/repl.in; cat /tmp/repl.ack",
                &[line],
            );
            (ok, out, format!("repl: {line}"))
        } else {
            panic!("turn {idx} has no run, shell or repl");
        };
        assert!(ok, "turn {idx} ({what}) failed: {out}");
        let report: TurnReport = insp.turn_end(&sb.id).expect("turn end");
        let got = report.class;
        let (e, g) = (class_idx(expect), class_idx(got));
        matrix[e][g] += 1;
        if !got.covers(expect) {
            false_negatives.push(format!(
                "#{idx} {what}: expected {expect}, got {got} {:?}",
                report.reasons
            ));
        } else if got != expect {
            false_positives.push(format!(
                "#{idx} {what}: expected {expect}, got {got} {:?}",
                report.reasons
            ));
        }
    }

    println!(
        "\nconfusion matrix (rows: expected, columns: inspector), {} turns",
        corpus.turn.len()
    );
    println!("{:>10} {:>6} {:>6} {:>6} {:>6}", "", "none", "fs", "proc", "full");
    for (i, c) in classes.iter().enumerate() {
        println!(
            "{:>10} {:>6} {:>6} {:>6} {:>6}",
            c.to_string(),
            matrix[i][0],
            matrix[i][1],
            matrix[i][2],
            matrix[i][3]
        );
    }
    println!("false negatives: {}", false_negatives.len());
    for f in &false_negatives {
        println!("  FN {f}");
    }
    println!("false positives: {}", false_positives.len());
    for f in &false_positives {
        println!("  FP {f}");
    }
    drop(insp_plain);
    drop(insp_noisy);
    ctd.remove("plain");
    ctd.remove("noisy");
    assert_clean(&ctd.scope(), &["plain", "noisy"]);
    assert!(
        false_negatives.is_empty(),
        "false negatives: {false_negatives:#?}"
    );
    let max_fp = corpus.turn.len() * 3 / 100;
    assert!(
        false_positives.len() <= max_fp,
        "{} false positives (at most {max_fp}): {false_positives:#?}",
        false_positives.len()
    );
}

fn class_idx(c: Class) -> usize {
    match c {
        Class::None => 0,
        Class::Fs => 1,
        Class::Proc => 2,
        Class::Full => 3,
    }
}
