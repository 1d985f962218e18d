//! Task events reach containerd: create, start, exec-added, exec-started,
//! paused, resumed, OOM, exit, delete. Needs root: CI runs it as root.

use std::io::BufRead;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::{wait_until, Containerd, CRAB};

/// The lines `ctr events` printed so far, gathered by a thread of their own.
#[derive(Clone, Default)]
struct Stream(Arc<Mutex<String>>);

impl Stream {
    fn follow(out: std::process::ChildStdout) -> Stream {
        let stream = Stream::default();
        let lines = stream.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let mut text = lines.0.lock().unwrap();
                text.push_str(&line);
                text.push('\n');
            }
        });
        stream
    }

    fn text(&self) -> String {
        self.0.lock().unwrap().clone()
    }

    /// Waits until a line names container `id` and `topic`.
    fn wait_for(&self, id: &str, topic: &str) {
        let seen = |text: &str| {
            text.lines()
                .any(|l| l.contains(&format!("\"container_id\":\"{id}\"")) && l.contains(topic))
        };
        wait_until(30, || seen(&self.text()).then_some(()))
            .unwrap_or_else(|| panic!("no {topic} event of {id}:\n{}", self.text()));
    }
}

#[test]
fn task_events() {
    let ctd = Containerd::start();
    let mut events = ctd
        .ctr_cmd(&["events"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ctr events");
    let stream = Stream::follow(events.stdout.take().expect("piped"));
    // ctr events subscribes asynchronously: a first container's events
    // seen prove it is listening.
    let heard = || {
        ctd.ctr_ok(&["run", "--rm", "--runtime", CRAB, BUSYBOX, "warmup", "true"]);
        wait_until(5, || {
            stream
                .text()
                .contains("\"container_id\":\"warmup\"")
                .then_some(())
        })
    };
    assert!((0..6).any(|_| heard().is_some()), "ctr events hears nothing");

    ctd.run_detached(CRAB, "ev", &["sleep", "300"]);
    ctd.ctr_ok(&["task", "exec", "--exec-id", "x", "ev", "true"]);
    ctd.ctr_ok(&["task", "pause", "ev"]);
    ctd.ctr_ok(&["task", "resume", "ev"]);
    ctd.remove("ev");
    // A shell that outgrows its 20 MB memory limit is OOM-killed.
    let out = ctd.ctr(&[
        "run",
        "--rm",
        "--memory-limit",
        "20000000",
        "--runtime",
        CRAB,
        BUSYBOX,
        "oom",
        "sh",
        "-c",
        "x=$(head -c 60000000 /dev/zero | tr '\\0' a); echo ${#x}",
    ]);
    assert_eq!(out.status.code(), Some(137));
    ctd.ctr_ok(&["run", "--rm", "--runtime", CRAB, BUSYBOX, "last", "true"]);
    // Events reach the stream in their own time: every one expected has
    // come once the last container's delete and the OOM exit have.
    stream.wait_for("last", "/tasks/delete");
    stream.wait_for("oom", "/tasks/oom");
    stream.wait_for("oom", "/tasks/exit");
    stream.wait_for("ev", "/tasks/delete");

    let _ = events.kill();
    let _ = events.wait();
    let text = stream.text();
    let topics_of = |id: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.contains(&format!("\"container_id\":\"{id}\"")))
            .filter_map(|l| l.split_whitespace().nth(5).map(str::to_owned))
            .collect()
    };
    assert_eq!(
        topics_of("ev"),
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exec-added",
            "/tasks/exec-started",
            "/tasks/exit",
            "/tasks/paused",
            "/tasks/resumed",
            "/tasks/exit",
            "/tasks/delete"
        ],
        "{text}"
    );
    let oom = topics_of("oom");
    assert!(oom.contains(&"/tasks/oom".to_owned()), "{text}");
    let exit = text
        .lines()
        .find(|l| l.contains("/tasks/exit") && l.contains("\"container_id\":\"oom\""))
        .expect("oom exit event");
    assert!(exit.contains("\"exit_status\":137"), "{exit}");
    assert_clean(&ctd.scope(), &["warmup", "ev", "oom", "last"]);
}
