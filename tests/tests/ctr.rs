//! The crab runtime through `ctr`, side by side with runc where behaviour
//! must match. Needs root: CI runs it as root.

use std::process::Command;

use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::{ok, wait_until, Containerd, CRAB, RUNC};

/// `ctr run --rm` attached: stdout reaches the user, the exit status is exact.
#[test]
fn run_prints_and_exits_with_status() {
    let ctd = Containerd::start();
    for rt in [RUNC, CRAB] {
        let out = ctd.ctr(&[
            "run",
            "--rm",
            "--runtime",
            rt,
            BUSYBOX,
            "t1",
            "sh",
            "-c",
            "echo hi; echo err >&2; exit 3",
        ]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n", "{rt}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("err"), "{rt}");
        assert_eq!(out.status.code(), Some(3), "{rt}");
    }
    assert_clean(&ctd.scope(), &["t1"]);
}

/// stdin reaches the container and its EOF too.
#[test]
fn run_passes_stdin() {
    let ctd = Containerd::start();
    let out = ctd
        .ctr_cmd(&[
            "run",
            "--rm",
            "--runtime",
            CRAB,
            BUSYBOX,
            "s1",
            "sh",
            "-c",
            "read x; echo got $x; cat; echo end",
        ])
        .stdin(std::fs::File::open("/etc/hostname").expect("a file to read"))
        .output()
        .expect("run ctr");
    let text = String::from_utf8_lossy(&out.stdout);
    let first = std::fs::read_to_string("/etc/hostname").expect("read hostname");
    assert!(text.starts_with(&format!("got {}", first.trim())), "{text:?}");
    assert!(text.ends_with("end\n"), "{text:?}");
    assert_clean(&ctd.scope(), &["s1"]);
}

/// Large stdin and stdout pass an exec whole, both ways at once.
#[test]
fn exec_passes_large_stdin_and_stdout_whole() {
    let ctd = Containerd::start();
    let input = ctd.dir.join("input");
    let data: Vec<u8> = (0..64u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&input, &data).expect("write input");
    let lines = ctd.dir.join("lines");
    let text: String = (0..40_000).map(|i| format!("line {i} of the input\n")).collect();
    std::fs::write(&lines, text).expect("write lines");
    for rt in [RUNC, CRAB] {
        let id = format!("big-{}", if rt == CRAB { "crab" } else { "runc" });
        ctd.run_detached(rt, &id, &["sleep", "300"]);
        for n in 0..3 {
            let out = ctd
                .ctr_cmd(&["task", "exec", "--exec-id", &format!("w{n}"), &id, "cat"])
                .stdin(std::fs::File::open(&input).expect("open input"))
                .output()
                .expect("run ctr");
            assert_eq!(
                out.stdout.len(),
                data.len(),
                "{rt}, try {n}: {}",
                crab_tests::stderr(&out)
            );
            assert!(out.stdout == data, "{rt}, try {n}: the bytes differ");
        }
        // A process slow to read: ctr's CloseIO comes while the fifo and
        // the pipe still hold the end of its input.
        let out = ctd
            .ctr_cmd(&[
                "task",
                "exec",
                "--exec-id",
                "slow",
                &id,
                "sh",
                "-c",
                "sleep 1; while read -r l; do echo \"$l\"; done | wc -l",
            ])
            .stdin(std::fs::File::open(&lines).expect("open lines"))
            .output()
            .expect("run ctr");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.trim(),
            "40000",
            "{rt}, a slow reader: {}",
            crab_tests::stderr(&out)
        );
        ctd.remove(&id);
    }
}

/// `ctr run -t`: a working TTY, same as runc.
#[test]
fn run_with_tty() {
    let ctd = Containerd::start();
    for rt in [RUNC, CRAB] {
        let ctr = ctd.ctr_cmd(&[]);
        let cmd = format!(
            "{} run -t --rm --runtime {rt} {BUSYBOX} tt sh -c 'tty; test -t 0 && echo stdin-is-tty; exit 4'",
            shell_words(&ctr)
        );
        let out = Command::new("script")
            .args(["-qec", &cmd, "/dev/null"])
            .output()
            .expect("run script");
        let text = String::from_utf8_lossy(&out.stdout).replace('\r', "");
        assert!(text.contains("/dev/pts/0"), "{rt}: {text:?}");
        assert!(text.contains("stdin-is-tty"), "{rt}: {text:?}");
        assert_eq!(out.status.code(), Some(4), "{rt}: {text:?}");
    }
    assert_clean(&ctd.scope(), &["tt"]);
}

/// `ctr task exec` with and without a TTY, stdin, exit statuses.
#[test]
fn exec_with_and_without_tty() {
    let ctd = Containerd::start();
    ctd.run_detached(CRAB, "e", &["sleep", "300"]);
    let out = ctd.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "x1",
        "e",
        "sh",
        "-c",
        "echo from-exec; exit 5",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-exec\n");
    assert_eq!(out.status.code(), Some(5));

    let out = ctd
        .ctr_cmd(&["task", "exec", "--exec-id", "x2", "e", "cat"])
        .stdin(std::fs::File::open("/etc/os-release").expect("open"))
        .output()
        .expect("run ctr");
    assert_eq!(out.stdout, std::fs::read("/etc/os-release").expect("read"));

    let ctr = ctd.ctr_cmd(&[]);
    let cmd = format!(
        "{} task exec -t --exec-id x3 e sh -c 'tty; exit 6'",
        shell_words(&ctr)
    );
    let out = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .output()
        .expect("run script");
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "");
    assert!(
        text.contains("/dev/pts/"),
        "{text:?} {}",
        crab_tests::stderr(&out)
    );
    assert_eq!(out.status.code(), Some(6));

    // The exec'd process is in the container: same pid namespace, same root.
    // Its pid 1 is crab-init, which runs the spec's process as pid 2.
    let out = ctd.ctr_ok(&[
        "task",
        "exec",
        "--exec-id",
        "x4",
        "e",
        "sh",
        "-c",
        "cat /proc/1/cmdline /proc/2/cmdline | tr '\\0' ' '",
    ]);
    assert_eq!(out.trim(), "crab-init init --report-fd 3 -- sleep 300 sleep 300");
    ctd.remove("e");
    assert_clean(&ctd.scope(), &["e"]);
}

/// kill with a signal, ps, pause/resume, metrics, delete.
#[test]
fn kill_ps_pause_metrics_delete() {
    let ctd = Containerd::start();
    ctd.run_detached(
        CRAB,
        "k",
        &[
            "sh",
            "-c",
            "trap 'echo usr1 > /tmp/got' USR1; touch /tmp/ready; while true; do sleep 0.05; done",
        ],
    );
    let pid = ctd.task_pid("k").expect("task listed");
    // The shell's trap is in place before the signal.
    crab_tests::sandbox::wait_for_file(pid, "/tmp/ready", 30);

    ctd.ctr_ok(&["task", "kill", "-s", "SIGUSR1", "k"]);
    let got = wait_until(10, || {
        let out = ctd.ctr(&["task", "exec", "--exec-id", "p1", "k", "cat", "/tmp/got"]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    assert_eq!(got.as_deref(), Some("usr1\n"));

    let ps = ctd.ctr_ok(&["task", "ps", "k"]);
    assert!(
        ps.lines()
            .any(|l| l.split_whitespace().next() == Some(&pid.to_string())),
        "{ps}"
    );
    assert!(ps.lines().count() >= 3, "init and its sleep child: {ps}");

    ctd.ctr_ok(&["task", "pause", "k"]);
    assert_eq!(ctd.task_status("k").as_deref(), Some("PAUSED"));
    let state = std::fs::read_to_string(format!(
        "/sys/fs/cgroup/freezer/{}/k/freezer.state",
        ctd.namespace
    ))
    .expect("freezer state");
    assert_eq!(state.trim(), "FROZEN");
    ctd.ctr_ok(&["task", "resume", "k"]);
    assert_eq!(ctd.task_status("k").as_deref(), Some("RUNNING"));

    let metrics = ctd.ctr_ok(&["task", "metrics", "k"]);
    let usage = metric(&metrics, "memory.usage_in_bytes").expect("memory usage");
    assert!(usage > 0, "{metrics}");
    assert!(metric(&metrics, "pids.current").expect("pids") >= 2, "{metrics}");
    assert!(
        metric(&metrics, "memory.limit_in_bytes").expect("limit") > 0,
        "{metrics}"
    );
    assert!(metric(&metrics, "cpuacct.usage").expect("cpu") > 0, "{metrics}");

    // The container has its own unified cgroup (the inspector keys on it).
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("read cgroup");
    assert!(
        cg.lines().any(|l| l == format!("0::/{}/k", ctd.namespace)),
        "{cg}"
    );

    ctd.ctr_ok(&["task", "kill", "-s", "SIGKILL", "k"]);
    wait_until(10, || {
        (ctd.task_status("k").as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("task stops");
    let out = ctd.ctr(&["task", "delete", "k"]);
    assert!(out.status.success(), "{}", crab_tests::stderr(&out));
    ok(ctd.ctr(&["container", "rm", "k"]));
    assert_clean(&ctd.scope(), &["k"]);
}

/// `ctr task kill --all` reaches every process, not only the init.
#[test]
fn kill_all_reaches_every_process() {
    let ctd = Containerd::start();
    // The init handles TERM and lives on; its child dies of it.
    ctd.run_detached(
        CRAB,
        "a",
        &[
            "sh",
            "-c",
            "trap 'echo term >> /tmp/log' TERM; sleep 300 & while true; do wait; sleep 1; done",
        ],
    );
    let child = wait_until(10, || {
        ctd.ctr_ok(&["task", "ps", "a"])
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next()?.parse::<i32>().ok())
            .find(|&p| std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.starts_with(b"sleep")))
    })
    .expect("child started");
    ctd.ctr_ok(&["task", "kill", "--all", "-s", "SIGTERM", "a"]);
    let gone = wait_until(10, || {
        let ps = ctd.ctr_ok(&["task", "ps", "a"]);
        (!ps.lines()
            .any(|l| l.split_whitespace().next() == Some(&child.to_string())))
        .then_some(())
    });
    assert!(gone.is_some(), "the child did not get SIGTERM");
    let log = wait_until(10, || {
        let out = ctd.ctr(&["task", "exec", "--exec-id", "c", "a", "cat", "/tmp/log"]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    assert_eq!(log.as_deref(), Some("term\n"), "the init got TERM too");
    assert_eq!(ctd.task_status("a").as_deref(), Some("RUNNING"));
    ctd.remove("a");
    assert_clean(&ctd.scope(), &["a"]);
}

/// A task killed by a signal reports 128 + N, as with runc.
#[test]
fn signal_exit_status() {
    let ctd = Containerd::start();
    for rt in [RUNC, CRAB] {
        ctd.run_detached(rt, "sig", &["sleep", "300"]);
        ctd.ctr_ok(&["task", "kill", "-s", "SIGKILL", "sig"]);
        wait_until(10, || {
            (ctd.task_status("sig").as_deref() == Some("STOPPED")).then_some(())
        })
        .expect("task stops");
        let out = ctd.ctr(&["task", "delete", "sig"]);
        assert!(out.status.success(), "{rt}: {}", crab_tests::stderr(&out));
        assert!(
            crab_tests::stderr(&out).contains("exit code 137"),
            "{rt}: {}",
            crab_tests::stderr(&out)
        );
        ctd.ctr_ok(&["container", "rm", "sig"]);
    }
    assert_clean(&ctd.scope(), &["sig"]);
}

fn metric(table: &str, name: &str) -> Option<u64> {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The command line of `cmd` (program and args) for a shell.
fn shell_words(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    words.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    words.join(" ")
}

/// The same container id in two namespaces: two independent containers.
#[test]
fn same_id_in_two_namespaces() {
    let a = Containerd::start();
    let b = Containerd::start();
    a.run_detached(CRAB, "dup", &["sleep", "300"]);
    b.run_detached(CRAB, "dup", &["sleep", "300"]);
    assert_eq!(a.task_status("dup").as_deref(), Some("RUNNING"));
    assert_eq!(b.task_status("dup").as_deref(), Some("RUNNING"));
    assert_ne!(a.task_pid("dup"), b.task_pid("dup"));
    a.remove("dup");
    assert_eq!(
        b.task_status("dup").as_deref(),
        Some("RUNNING"),
        "removing one removed the other"
    );
    b.remove("dup");
    assert_clean(&a.scope(), &["dup"]);
    assert_clean(&b.scope(), &["dup"]);
}

/// A new network namespace has its loopback interface up, as runc makes it:
/// a server on 127.0.0.1 inside the container is reachable from inside.
/// The client tries until a connection brought the server's line (busybox
/// nc may end at its own stdin's EOF before the line arrives), however
/// late the server listens.
#[test]
fn loopback_is_up() {
    let ctd = Containerd::start();
    for rt in [RUNC, CRAB] {
        let out = ctd.ctr(&[
            "run",
            "--rm",
            "--runtime",
            rt,
            BUSYBOX,
            "lo",
            "sh",
            "-c",
            "ip addr show lo; (while true; do echo hello | nc -l -p 8080 127.0.0.1; done &); \
             i=0; until nc 127.0.0.1 8080 </dev/null | grep -q hello; do \
             i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done; echo got hello",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("LOOPBACK,UP"), "{rt}: {text}");
        assert!(text.contains("hello"), "{rt}: {text}");
        assert_eq!(out.status.code(), Some(0), "{rt}");
    }
    assert_clean(&ctd.scope(), &["lo"]);
}

/// The sandbox's root can write into and read from crab-init's report pipe
/// (`/proc/1/fd/3`): flooding it with an endless line and stealing its
/// lines neither wedges nor misleads the shim. Execs still end (their ends
/// come from pidfds; a stolen code reads as 137), and the sandbox works on.
#[test]
fn a_flooded_and_robbed_report_wedges_nothing() {
    let ctd = Containerd::start();
    ctd.run_detached(CRAB, "rob", &["sleep", "300"]);
    ctd.ctr_ok(&[
        "task",
        "exec",
        "-d",
        "--exec-id",
        "thief",
        "rob",
        "sh",
        "-c",
        "cat /proc/1/fd/3 > /dev/null",
    ]);
    ctd.ctr_ok(&[
        "task",
        "exec",
        "-d",
        "--exec-id",
        "flood",
        "rob",
        "sh",
        "-c",
        "head -c 100000000 /dev/zero > /proc/1/fd/3",
    ]);
    for n in 0..5 {
        let out = ctd.ctr(&[
            "task",
            "exec",
            "--exec-id",
            &format!("e{n}"),
            "rob",
            "sh",
            "-c",
            "exit 5",
        ]);
        let code = out.status.code();
        assert!(code == Some(5) || code == Some(137), "exec {n}: {out:?}");
    }
    let out = ctd.ctr(&["task", "exec", "--exec-id", "last", "rob", "echo", "alive"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "alive");
    assert!(matches!(out.status.code(), Some(0 | 137)), "{out:?}");
    ctd.remove("rob");
    assert_clean(&ctd.scope(), &["rob"]);
}

/// `[shim] env`: every process of a crab sandbox (the spec's and each
/// exec's) gets libuv's io_uring switch off, unless it sets it itself;
/// runc's do not.
#[test]
fn sandboxes_get_the_default_variables_unless_they_set_them() {
    let ctd = Containerd::start();
    let echo = "echo ${UV_USE_IO_URING:-unset}";
    for (rt, env, want) in [
        (CRAB, None, "0"),
        (CRAB, Some("UV_USE_IO_URING=1"), "1"),
        (RUNC, None, "unset"),
    ] {
        let mut args = vec!["run", "--rm", "--runtime", rt];
        if let Some(e) = env {
            args.extend(["--env", e]);
        }
        args.extend([BUSYBOX, "envd", "sh", "-c", echo]);
        let out = ctd.ctr(&args);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want, "{rt} {env:?}");
    }
    ctd.run_detached(CRAB, "envx", &["sleep", "60"]);
    let out = ctd.ctr_ok(&["task", "exec", "--exec-id", "e1", "envx", "sh", "-c", echo]);
    assert_eq!(out.trim(), "0", "an exec gets it too");
    ctd.remove("envx");
    assert_clean(&ctd.scope(), &["envd", "envx"]);
}
