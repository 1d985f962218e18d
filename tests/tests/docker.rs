//! The crab runtime through docker 26 (`--runtime crab`, the repo's
//! daemon.json). Needs root: CI runs it as root.

use std::process::Command;
use std::time::Instant;

use crab_tests::docker::DOCKER_BUSYBOX as BB;
use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{crabctl_err, crabctl_ok, listed, wait_forgotten, wait_registered};
use crab_tests::{stderr, wait_until, Dockerd};

#[test]
fn docker_lifecycle() {
    let d = Dockerd::start();

    // Both names of the runtime work; stdout, stderr and the exit status reach the user.
    for rt in ["crab", "io.containerd.crab.v2"] {
        let out = d.docker(&[
            "run",
            "--rm",
            "--runtime",
            rt,
            BB,
            "sh",
            "-c",
            "echo hi; echo err >&2; exit 3",
        ]);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hi\n",
            "{rt}: {}",
            stderr(&out)
        );
        assert!(stderr(&out).contains("err"), "{rt}");
        assert_eq!(out.status.code(), Some(3), "{rt}");
    }

    // docker run -it: a TTY.
    let cmd = format!(
        "{} run -it --rm --runtime crab {BB} sh -c 'tty; exit 4'",
        words(&d.docker_cmd(&[]))
    );
    let out = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .output()
        .expect("script");
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "");
    assert!(text.contains("/dev/pts/0"), "{text:?}");
    assert_eq!(out.status.code(), Some(4));

    // A service that ends on TERM: logs, exec, pause, stats, stop.
    d.docker_ok(&[
        "run",
        "-d",
        "--name",
        "svc",
        "--runtime",
        "crab",
        BB,
        "sh",
        "-c",
        "echo started; trap 'echo term; exit 0' TERM; while true; do sleep 0.1; done",
    ]);
    wait_until(10, || {
        d.docker_ok(&["logs", "svc"]).contains("started").then_some(())
    })
    .expect("logs");
    let out = d.docker(&["exec", "svc", "sh", "-c", "echo in-exec; exit 2"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "in-exec\n");
    assert_eq!(out.status.code(), Some(2));
    let out = d
        .docker_cmd(&["exec", "-i", "svc", "cat"])
        .stdin(std::fs::File::open("/etc/os-release").expect("open"))
        .output()
        .expect("docker exec");
    assert_eq!(out.stdout, std::fs::read("/etc/os-release").expect("read"));

    d.docker_ok(&["pause", "svc"]);
    assert_eq!(
        d.docker_ok(&["inspect", "-f", "{{.State.Paused}}", "svc"]).trim(),
        "true"
    );
    d.docker_ok(&["unpause", "svc"]);
    assert_eq!(
        d.docker_ok(&["inspect", "-f", "{{.State.Status}}", "svc"]).trim(),
        "running"
    );

    let stats = d.docker_ok(&[
        "stats",
        "--no-stream",
        "--format",
        "{{.MemUsage}} {{.PIDs}}",
        "svc",
    ]);
    let mut fields = stats.split_whitespace();
    let mem = fields.next().unwrap_or_default();
    assert!(!mem.starts_with("0B"), "memory usage is reported: {stats}");
    let pids: u32 = stats
        .split_whitespace()
        .last()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    assert!(pids >= 1, "{stats}");

    // docker update: new limits reach the container's cgroups.
    d.docker_ok(&[
        "update",
        "--memory",
        "64m",
        "--memory-swap",
        "64m",
        "--pids-limit",
        "50",
        "svc",
    ]);
    let id = d.docker_ok(&["inspect", "-f", "{{.Id}}", "svc"]);
    let read = |ctl: &str, file: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{ctl}/docker/{}/{file}", id.trim()))
            .expect("read cgroup")
    };
    assert_eq!(read("memory", "memory.limit_in_bytes").trim(), "67108864");
    assert_eq!(read("pids", "pids.max").trim(), "50");

    d.docker_ok(&["stop", "-t", "10", "svc"]);
    assert_eq!(
        d.docker_ok(&["inspect", "-f", "{{.State.ExitCode}}", "svc"])
            .trim(),
        "0"
    );
    assert!(d.docker_ok(&["logs", "svc"]).contains("term"));
    d.docker_ok(&["rm", "svc"]);

    // docker stop on a process that ignores TERM: SIGKILL after the timeout.
    d.docker_ok(&[
        "run",
        "-d",
        "--name",
        "stubborn",
        "--runtime",
        "crab",
        BB,
        "sh",
        "-c",
        "trap '' TERM; while true; do sleep 0.1; done",
    ]);
    let t = Instant::now();
    d.docker_ok(&["stop", "-t", "1", "stubborn"]);
    assert!(t.elapsed().as_millis() >= 1000, "SIGKILL came before the timeout");
    assert_eq!(
        d.docker_ok(&["inspect", "-f", "{{.State.ExitCode}}", "stubborn"])
            .trim(),
        "137"
    );
    d.docker_ok(&["rm", "stubborn"]);

    // docker kill, then rm -f of a running container.
    d.docker_ok(&[
        "run",
        "-d",
        "--name",
        "killed",
        "--runtime",
        "crab",
        BB,
        "sleep",
        "300",
    ]);
    d.docker_ok(&["kill", "killed"]);
    assert_eq!(
        d.docker_ok(&["inspect", "-f", "{{.State.ExitCode}}", "killed"])
            .trim(),
        "137"
    );
    d.docker_ok(&["rm", "killed"]);
    d.docker_ok(&[
        "run",
        "-d",
        "--name",
        "forced",
        "--runtime",
        "crab",
        BB,
        "sleep",
        "300",
    ]);
    d.docker_ok(&["rm", "-f", "forced"]);

    assert_clean(&d.scope(), &[]);
}

/// A container reaches a TCP server that another container on the same
/// docker network runs.
#[test]
fn docker_network() {
    let d = Dockerd::start();
    d.docker_ok(&["network", "create", "crabnet"]);
    d.docker_ok(&[
        "run",
        "-d",
        "--name",
        "srv",
        "--network",
        "crabnet",
        "--runtime",
        "crab",
        BB,
        "sh",
        "-c",
        "echo hello-from-srv > /tmp/index.html; exec httpd -f -p 8080 -h /tmp",
    ]);
    let got = wait_until(10, || {
        let out = d.docker(&[
            "run",
            "--rm",
            "--network",
            "crabnet",
            "--runtime",
            "crab",
            BB,
            "wget",
            "-qO-",
            "http://srv:8080/index.html",
        ]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    assert_eq!(got.as_deref(), Some("hello-from-srv\n"));
    d.docker_ok(&["rm", "-f", "srv"]);
    d.docker_ok(&["network", "rm", "crabnet"]);
    assert_clean(&d.scope(), &[]);
}

/// `crabctl checkpoint` and `rollback` of a docker sandbox, whose overlay
/// dockerd mounted itself: its files, a shell's memory and a server on
/// docker's bridge network come back.
#[test]
fn docker_sandbox_rolls_back() {
    let d = Dockerd::start();
    d.docker_ok(&["network", "create", "rbnet"]);
    let id = d
        .docker_ok(&[
            "run",
            "-d",
            "--name",
            "rb",
            "--network",
            "rbnet",
            "--runtime",
            "crab",
            BB,
            "sh",
            "-c",
            "mkdir -p /www; echo one > /www/index.html; httpd -p 8080 -h /www; \
             i=0; while true; do i=$((i+1)); echo $i > /n; sleep 0.05; done",
        ])
        .trim()
        .to_owned();
    wait_registered(&d.containerd, &id);
    let sh = |script: &str| d.docker(&["exec", "rb", "sh", "-c", script]);
    let count = || -> u64 {
        wait_until(5, || {
            String::from_utf8_lossy(&sh("cat /n").stdout).trim().parse().ok()
        })
        .expect("a count in /n")
    };
    let fetch_from = |port: u16| {
        wait_until(10, || {
            let out = d.docker(&[
                "run",
                "--rm",
                "--network",
                "rbnet",
                "--runtime",
                "crab",
                BB,
                "wget",
                "-qO-",
                &format!("http://rb:{port}/index.html"),
            ]);
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        })
    };
    let fetch = || fetch_from(8080);
    assert_eq!(fetch().as_deref(), Some("one"));
    // `docker exec -d` processes are the sandbox's too: a server, and a
    // counter kept in memory (written to /m), are in every checkpoint.
    for script in [
        "echo $$ > /hpid; exec httpd -f -p 8081 -h /www",
        "echo $$ > /mpid; j=0; while true; do j=$((j+1)); echo $j > /m; sleep 0.05; done",
    ] {
        d.docker_ok(&["exec", "-d", "rb", "sh", "-c", script]);
    }
    assert_eq!(fetch_from(8081).as_deref(), Some("one"));
    let counted = || -> u64 {
        wait_until(5, || {
            String::from_utf8_lossy(&sh("cat /m").stdout).trim().parse().ok()
        })
        .expect("a count in /m")
    };

    let (before, m_before) = (count(), counted());
    let v1 = crabctl_ok(&d.containerd, &["checkpoint", &id[..12]]);
    assert_eq!(v1["version"]["fs_snapshot"]["backend"], "overlay-copy", "{v1}");
    let (at_v1, m_at_v1) = (count(), counted());
    assert!(sh("echo two > /www/index.html; echo x > /extra").status.success());
    assert_eq!(fetch().as_deref(), Some("two"));
    assert!(sh("kill $(cat /hpid) $(cat /mpid)").status.success());

    let began = std::time::Instant::now();
    crabctl_ok(&d.containerd, &["rollback", &id[..12], "1"]);
    let (n, m) = (count(), counted());
    assert!(
        crab_tests::counts_on_from(n, before, at_v1, began),
        "{n} after v1's {before}..{at_v1}"
    );
    assert!(
        crab_tests::counts_on_from(m, m_before, m_at_v1, began),
        "{m} after v1's {m_before}..{m_at_v1}"
    );
    assert!(!sh("cat /extra").status.success(), "/extra is gone");
    assert_eq!(fetch().as_deref(), Some("one"), "the server is v1's and answers");
    assert_eq!(
        fetch_from(8081).as_deref(),
        Some("one"),
        "the exec's server is back"
    );
    let moved = wait_until(5, || (counted() > m).then_some(()));
    assert!(moved.is_some(), "the exec's counter runs again, from its memory");
    assert_eq!(
        d.docker_ok(&["inspect", "-f", "{{.State.Running}}", "rb"]).trim(),
        "true"
    );
    // Its files and network are docker's: it cannot be copied.
    let e = crabctl_err(&d.containerd, &["fork", &id[..12], "1"]);
    assert!(e.contains("cannot be forked"), "{e}");

    // docker stop and start keep its history (docker makes a new containerd
    // container at each start, on the same layer); docker rm drops it.
    let entry = |running: bool| {
        wait_until(15, || {
            listed(&d.containerd, &id).filter(|s| s["running"] == running)
        })
    };
    d.docker_ok(&["stop", "-t", "1", "rb"]);
    let stopped = entry(false).expect("listed as stopped");
    assert_eq!(stopped["versions"], 1, "{stopped}");
    d.docker_ok(&["start", "rb"]);
    entry(true).expect("listed as running again");
    assert!(sh("echo three > /www/index.html").status.success());
    let v2 = crabctl_ok(&d.containerd, &["checkpoint", &id[..12]]);
    assert_eq!(v2["version"]["version"], 2, "{v2}");
    // Back to before the restart: into the network docker made at this start.
    crabctl_ok(&d.containerd, &["rollback", &id[..12], "1"]);
    assert_eq!(fetch().as_deref(), Some("one"), "v1's server on today's network");

    d.docker_ok(&["rm", "-f", "rb"]);
    wait_forgotten(&d.containerd, &id);
    d.docker_ok(&["network", "rm", "rbnet"]);
    assert_clean(&d.scope(), &[]);
}

fn words(cmd: &Command) -> String {
    let mut w = vec![cmd.get_program().to_string_lossy().into_owned()];
    w.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    w.join(" ")
}
