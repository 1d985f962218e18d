//! The inspector on plain processes in a cgroup of their own (real BPF, no
//! container): the basic signals and the "when unsure, full" rules. Needs
//! root: CI runs it as root.

#[path = "support/cgroup.rs"]
mod cgroup;
#[path = "support/inspector.rs"]
mod inspector;

use cgroup::TestCgroup;
use crab_inspector::{Class, Reason};
use inspector::inspector;

fn work_dir() -> tempdir::Dir {
    tempdir::Dir::new()
}

mod tempdir {
    /// A scratch directory on the host's root filesystem, removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            let p = std::env::temp_dir().join(crab_tests::unique("crab-insp-work-"));
            std::fs::create_dir_all(&p).expect("create work dir");
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn basic_signals() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    let w = &work.0;
    insp.register("basic", &cg.dir).expect("register");

    let step = |script: &str, expected: Class| {
        let out = cg.run(w, script);
        assert!(out.status.success(), "{script}: {out:?}");
        let report = insp.turn_end("basic").expect("turn end");
        assert_eq!(report.class, expected, "{script}: {report:#?}");
        report
    };
    step("true", Class::None);
    step("ls -la; cat /etc/passwd > /dev/null; echo hi", Class::None);
    let r = step("echo data > a.txt", Class::Fs);
    assert!(
        r.reasons.contains(&Reason::Changed { path: "a.txt".into() }),
        "{r:#?}"
    );
    step("echo tmp > t; rm t", Class::None);
    step("mkdir d; touch d/x; rm -r d", Class::None);
    step("t=$(mktemp -p .); echo x > $t; rm $t", Class::None);
    step("echo more >> a.txt", Class::Fs);
    step("rm a.txt", Class::Fs);
    step("echo x > /proc/self/comm; echo y > /dev/null", Class::None);
    let pidfile = format!("/dev/shm/{}", crab_tests::unique("crab-insp-pid"));
    struct Remove(String);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _pidfile = Remove(pidfile.clone());
    // Waits until sleep sleeps in its nanosleep (/proc/PID/syscall names
    // the call it is blocked in: x86-64 35/230, arm64 101/115): its start-up
    // would otherwise run into the next turn, and a state of S alone can be
    // a moment's wait during that start-up.
    step(
        &format!(
            "sleep 1000 > /dev/null 2>&1 & echo $! > {pidfile}; \
             until s=$(cut -d' ' -f1 /proc/$!/syscall 2>/dev/null); \
                   [ \"$(cat /proc/$!/comm)\" = sleep ] && case $s in 35|230|101|115) true;; *) false;; esac; \
             do :; done"
        ),
        Class::Proc,
    );
    step("true", Class::None);
    // Until it has exited (a zombie, or reaped): a signal is delivered
    // after kill(1) returns, and its exit would be the next turn's.
    step(
        &format!(
            "p=$(cat {pidfile}); kill $p; rm {pidfile}; \
             while [ -e /proc/$p ] && [ \"$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null)\" != Z ]; do :; done"
        ),
        Class::Proc,
    );
    step("true", Class::None);

    insp.unregister("basic").expect("unregister");
}

#[test]
fn persistent_shell_and_noise() {
    let insp = inspector(&["sh"], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    let w = &work.0;
    std::fs::create_dir(w.join("sub")).expect("mkdir");
    let mut sh = cg.shell(w);
    sh.run("true");
    insp.register("shell", &cg.dir).expect("register");
    insp.turn_end("shell").expect("turn end");

    // A noisy shell running a read-only command: none.
    sh.run("ls > /dev/null");
    assert_eq!(insp.turn_end("shell").expect("turn").class, Class::None);
    // Its cd still counts.
    sh.run("cd sub");
    let r = insp.turn_end("shell").expect("turn");
    assert_eq!(r.class, Class::Proc, "{r:#?}");
    assert!(matches!(r.reasons[0], Reason::Chdir { pid, .. } if pid == sh.pid()));
    sh.run("echo x > f");
    assert_eq!(insp.turn_end("shell").expect("turn").class, Class::Fs);

    insp.unregister("shell").expect("unregister");
}

/// A task followed in one sandbox and moved into another (its entry made
/// new in place by the move, in the mover's context) is followed there:
/// its work counts in the second sandbox's turns, not the first's.
#[test]
fn a_task_moved_between_sandboxes_is_followed_in_the_second() {
    let insp = inspector(&["sh"], 1 << 20, true);
    let (from, to) = (TestCgroup::new(), TestCgroup::new());
    let work = work_dir();
    let mut sh = from.shell(&work.0);
    sh.run("true");
    insp.register("from", &from.dir).expect("register");
    insp.register("to", &to.dir).expect("register");
    sh.run("echo x > before");
    assert_eq!(insp.turn_end("from").expect("turn").class, Class::Fs);
    assert_eq!(insp.turn_end("to").expect("turn").class, Class::None);

    std::fs::write(to.dir.join("cgroup.procs"), sh.pid().to_string()).expect("move the shell");
    // The move's own classes are not this test's.
    insp.turn_end("from").expect("turn");
    insp.turn_end("to").expect("turn");

    sh.run("echo y > after");
    let r = insp.turn_end("to").expect("turn");
    assert_eq!(r.class, Class::Fs, "{r:#?}");
    assert_eq!(insp.turn_end("from").expect("turn").class, Class::None);
    sh.run("cd /");
    let r = insp.turn_end("to").expect("turn");
    assert_eq!(r.class, Class::Proc, "{r:#?}");
    assert!(matches!(r.reasons[0], Reason::Chdir { pid, .. } if pid == sh.pid()));

    drop(sh);
    insp.unregister("from").expect("unregister");
    insp.unregister("to").expect("unregister");
}

/// A ring buffer of 4 KiB pages that nobody drains during the turn: the
/// records of 200 new files cannot fit, and the turn is full with the reason.
#[test]
fn ring_overflow_is_full() {
    let insp = inspector(&[], 4096, false);
    let cg = TestCgroup::new();
    let work = work_dir();
    insp.register("overflow", &cg.dir).expect("register");
    let out = cg.run(
        &work.0,
        "i=0; while [ $i -lt 200 ]; do echo > f$i; i=$((i+1)); done",
    );
    assert!(out.status.success());
    let r = insp.turn_end("overflow").expect("turn end");
    assert_eq!(r.class, Class::Full, "{r:#?}");
    assert!(
        matches!(&r.reasons[0], Reason::Unsure { why } if why.contains("ring buffer was full")),
        "{r:#?}"
    );
    // The next turn is accounted again.
    cg.run(&work.0, "true");
    assert_eq!(insp.turn_end("overflow").expect("turn").class, Class::None);
    insp.unregister("overflow").expect("unregister");
}

/// Removes a pin directory whatever happens in the test.
struct Pins(std::path::PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The configuration of an inspector of its own pin directory, for tests
/// that play owners which stop without unloading.
fn private_config() -> (crab_inspector::InspectorConfig, Pins) {
    let pin_dir = std::path::PathBuf::from(format!("/sys/fs/bpf/{}", crab_tests::unique("crab-test-")));
    let config = crab_inspector::InspectorConfig {
        pin_dir: pin_dir.clone(),
        ring_bytes: 1 << 20,
        noisy_comms: Vec::new(),
        drain_timeout: std::time::Duration::from_millis(200),
        max_reasons: 8,
        background_drain: true,
    };
    (config, Pins(pin_dir))
}

/// A new owner of the same pin directory reuses the pinned programs and
/// maps: the sandbox's kernel state survives, the interrupted turn is full
/// (its start is unknown), the next one is exact. Removed pins (detached
/// programs) make turns full too.
#[test]
fn restart_reuses_pinned_programs() {
    use crab_inspector::Inspector;

    let (config, _pins) = private_config();
    let pin_dir = config.pin_dir.clone();
    let cg = TestCgroup::new();
    let work = work_dir();

    let first = Inspector::load(config.clone()).expect("load");
    assert!(matches!(
        Inspector::load(config.clone()),
        Err(crab_inspector::Error::Busy { .. })
    ));
    first.register("r", &cg.dir).expect("register");
    cg.run(&work.0, "echo x > kept");
    assert_eq!(first.turn_end("r").expect("turn").class, Class::Fs);
    cg.run(&work.0, "echo y > during-restart");
    drop(first); // the owner "crashes": no unregister, no unload

    let second = Inspector::load(config.clone()).expect("reload");
    // The crashed owner's sandbox is still followed.
    assert_eq!(syscall_links(&pin_dir, "crab_sys_enter"), 1);
    assert_eq!(syscall_links(&pin_dir, "crab_sys_exit"), 1);
    let cg_id = second.register("r", &cg.dir).expect("register again");
    assert_eq!(cg_id, crab_inspector::cgroup_id(&cg.dir).expect("id"));
    let r = second.turn_end("r").expect("turn");
    assert_eq!(r.class, Class::Full, "{r:#?}");
    assert_eq!(r.turn, 2, "turn numbers go on: {r:#?}");
    assert!(matches!(&r.reasons[0], Reason::Unsure { why } if why.contains("restarted")));
    cg.run(&work.0, "cat kept > /dev/null");
    assert_eq!(second.turn_end("r").expect("turn").class, Class::None);

    // Someone removes the pins: the programs are gone, the answer is full.
    let build = std::fs::read_dir(&pin_dir)
        .expect("pin dir")
        .flatten()
        .next()
        .expect("a build dir")
        .path();
    std::fs::remove_file(build.join("link_crab_sys_enter")).expect("remove a link pin");
    let r = second.turn_end("r").expect("turn");
    assert_eq!(r.class, Class::Full, "{r:#?}");
    second.unregister("r").expect("unregister");
    second.unload().expect("unload");
}

/// How many links attach the pinned system-call program `name` (0 or 1).
fn syscall_links(pin_dir: &std::path::Path, name: &str) -> usize {
    let build = std::fs::read_dir(pin_dir)
        .expect("pin dir")
        .flatten()
        .next()
        .expect("a build dir")
        .path();
    let program = aya::programs::ProgramInfo::from_pin(build.join(format!("prog_{name}")))
        .expect("the pinned program")
        .id();
    aya::programs::loaded_links()
        .flatten()
        .filter(|l| l.program_id() == program)
        .count()
}

/// An attached `sys_enter`/`sys_exit` sends every system call of every task
/// on the host through the kernel's slow path: the programs are attached
/// only while a sandbox is registered, also across a restart of the owner.
#[test]
fn system_call_programs_are_attached_only_while_sandboxes_are_registered() {
    let cg1 = TestCgroup::new();
    let cg2 = TestCgroup::new();
    let work = work_dir();
    // Whether the kernel comes to list exactly `want` links per program:
    // a removed link is released by a kernel worker a moment later.
    let attached = |insp: &inspector::TestInspector, want: bool| {
        let want = usize::from(want);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let n = ["crab_sys_enter", "crab_sys_exit"].map(|p| syscall_links(insp.pin_dir(), p));
            if n == [want, want] {
                return true;
            }
            if std::time::Instant::now() > deadline {
                eprintln!("links per program: {n:?}, expected {want}");
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let insp = inspector(&[], 1 << 20, true);
    assert!(attached(&insp, false), "loaded, nothing registered");
    insp.register("a", &cg1.dir).expect("register a");
    assert!(attached(&insp, true));
    cg1.run(&work.0, "echo x > a");
    assert_eq!(insp.turn_end("a").expect("turn").class, Class::Fs);
    insp.register("b", &cg2.dir).expect("register b");
    insp.unregister("a").expect("unregister a");
    assert!(attached(&insp, true), "b is still registered");
    cg2.run(&work.0, "echo x > b");
    assert_eq!(insp.turn_end("b").expect("turn").class, Class::Fs);
    insp.unregister("b").expect("unregister b");
    assert!(attached(&insp, false), "nothing registered");

    // Registered again: the turn sees what it does, from its start.
    insp.register("a", &cg1.dir).expect("register a again");
    cg1.run(&work.0, "echo y > a");
    assert_eq!(insp.turn_end("a").expect("turn").class, Class::Fs);
    insp.unregister("a").expect("unregister a again");
    assert!(attached(&insp, false));
}

/// An owner that stopped with a sandbox registered, whose cgroup is then
/// removed: the next owner forgets it rather than keep the system-call
/// programs attached for nothing.
#[test]
fn a_removed_cgroup_does_not_keep_the_programs_attached() {
    use std::time::Duration;

    use crab_inspector::Inspector;

    let (config, _pins) = private_config();
    let pin_dir = config.pin_dir.clone();
    let kept = TestCgroup::new();
    let first = Inspector::load(config.clone()).expect("load");
    first.register("kept", &kept.dir).expect("register kept");
    {
        let gone = TestCgroup::new();
        first.register("gone", &gone.dir).expect("register gone");
    } // removed while registered
    drop(first); // no unregister, no unload

    let second = Inspector::load(config.clone()).expect("reload");
    assert_eq!(
        syscall_links(&pin_dir, "crab_sys_enter"),
        1,
        "kept is still followed"
    );
    second.register("kept", &kept.dir).expect("register kept again");
    second.unregister("kept").expect("unregister kept");
    drop(second);
    // The cgroup that is gone was forgotten: with kept unregistered too,
    // nothing is followed and a new owner leaves the programs detached.
    let third = Inspector::load(config).expect("reload");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while syscall_links(&pin_dir, "crab_sys_enter") != 0 {
        assert!(std::time::Instant::now() < deadline, "still attached");
        std::thread::sleep(Duration::from_millis(20));
    }
    third.unload().expect("unload");
}

/// A process that moves into a child cgroup of the sandbox's leaves what the
/// programs follow (they match the sandbox's own cgroup id): every turn
/// while such a cgroup holds processes is full, with the reason.
#[test]
fn processes_in_a_child_cgroup_make_turns_full() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    insp.register("child", &cg.dir).expect("register");
    let child = cg.dir.join("escaped");
    std::fs::create_dir(&child).expect("create the child cgroup");
    let script = format!(
        "echo $$ > {}/cgroup.procs; sleep 1000 > /dev/null 2>&1 &",
        child.display()
    );
    let out = cg.run(&work.0, &script);
    assert!(out.status.success(), "{out:?}");
    until_populated(&child, "the sleep is in the child cgroup");
    let r = insp.turn_end("child").expect("turn end");
    assert_eq!(r.class, Class::Full, "{r:#?}");
    assert!(
        r.reasons
            .iter()
            .any(|x| matches!(x, Reason::Unsure { why } if why.contains("child cgroup escaped"))),
        "{r:#?}"
    );
    // Still there at the next turn end: still full.
    assert_eq!(insp.turn_end("child").expect("turn").class, Class::Full);

    for pid in std::fs::read_to_string(child.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|p| p.trim().parse::<i32>().ok())
    {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    crab_tests::wait_until(10, || std::fs::remove_dir(&child).ok());
    insp.unregister("child").expect("unregister");
}

/// A process that was in a child cgroup at a turn end, wrote a file there
/// and came back (its child cgroup kept, or removed) before the next turn
/// end leaves no process in a child cgroup to see: that the child held
/// processes at the last turn end still makes the turn full. An empty
/// child cgroup then makes no turn full.
#[test]
fn a_child_cgroup_that_held_processes_at_the_last_turn_end_makes_the_turn_full() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    insp.register("back", &cg.dir).expect("register");
    let child_doubt = |r: &crab_inspector::TurnReport, what: &str| {
        r.reasons.iter().any(
            |x| matches!(x, Reason::Unsure { why } if why.contains("child cgroup") && why.contains(what)),
        )
    };
    for (round, (doubt, leave)) in [("may have run", ""), ("is gone", "rmdir {child};")]
        .into_iter()
        .enumerate()
    {
        let child = cg.dir.join(format!("out-{round}"));
        std::fs::create_dir(&child).expect("create the child cgroup");
        let (go, back) = (
            work.0.join(format!("go-{round}")),
            work.0.join(format!("back-{round}")),
        );
        // Turn 1: a shell moves itself into the child cgroup and waits.
        let leave = leave.replace("{child}", &child.display().to_string());
        let script = format!(
            "sh -c 'echo $$ > {child}/cgroup.procs; while [ ! -e {go} ]; do sleep 0.05; done; \
             echo unseen > {work}/unseen-{round}.txt; echo $$ > {sandbox}/cgroup.procs; {leave} \
             touch {back}; exec sleep 1000' >/dev/null 2>&1 &",
            child = child.display(),
            go = go.display(),
            work = work.0.display(),
            sandbox = cg.dir.display(),
            back = back.display(),
        );
        assert!(cg.run(&work.0, &script).status.success());
        until_populated(&child, "the shell is in the child cgroup");
        let r = insp.turn_end("back").expect("turn");
        assert_eq!(r.class, Class::Full, "{r:#?}");
        // Turn 2: from there it writes a file, comes back, and sleeps.
        std::fs::write(&go, b"").expect("go");
        crab_tests::wait_until(30, || back.exists().then_some(())).expect("the shell is back");
        assert!(work.0.join(format!("unseen-{round}.txt")).exists());
        let r = insp.turn_end("back").expect("turn");
        assert_eq!(r.class, Class::Full, "{round}: {r:#?}");
        assert!(child_doubt(&r, doubt), "{round}: {r:#?}");
        // Turn 3: nothing ran in the child cgroup (or it is gone): no doubt.
        let r = insp.turn_end("back").expect("turn");
        assert!(
            !r.reasons
                .iter()
                .any(|x| matches!(x, Reason::Unsure { why } if why.contains("child cgroup"))),
            "{round}: {r:#?}"
        );
    }
    // Its processes die with the test's cgroup, which needs no child.
    let _ = std::fs::remove_dir(cg.dir.join("out-0"));
    insp.unregister("back").expect("unregister");
}

/// Waits until cgroup `dir` holds a process (`what`, for the failure).
fn until_populated(dir: &std::path::Path, what: &str) {
    crab_tests::wait_until(10, || {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
        (!procs.trim().is_empty()).then_some(())
    })
    .unwrap_or_else(|| panic!("{what}"));
}

/// Starts `cmd` in the background in `cg` (output to /dev/null) and
/// answers its pid.
fn in_background(cg: &TestCgroup, dir: &std::path::Path, cmd: &str) -> u32 {
    let out = cg.run(dir, &format!("{cmd} >/dev/null 2>&1 & echo $!"));
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("the pid of {cmd}: {out:?}"))
}

/// Field `n` of `/proc/<pid>/stat` after the command name (0: the state,
/// 11: user time in ticks).
fn stat_field(pid: u32, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(n)
        .map(str::to_owned)
}

/// Whether the task sleeps in read(2): `/proc/PID/syscall` names the
/// call (it names it still when the call was interrupted and the task
/// frozen on its way out) and the task waits in the pipe, not frozen.
fn asleep_in_read(pid: u32) -> bool {
    let call = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
    call.split_whitespace().next() == Some("0") && !frozen(pid)
}

/// Whether the task waits in the freezer (`/proc/PID/wchan`).
fn frozen(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/wchan")).is_ok_and(|w| w == "__refrigerator")
}

/// What the task has read so far (`rchar` of `/proc/PID/io`).
fn bytes_read(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("rchar")
}

/// A checkpoint's freeze wakes a task asleep in a read: the read it
/// resumes after the thaw is no running of the task's, but what it does
/// with data that arrived while it was frozen is, and counts even though
/// it ran only in the moments after the thaw.
#[test]
fn a_freeze_counts_what_a_task_does_after_it_not_its_resumed_call() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::with_freezer();
    let work = work_dir();
    let w = &work.0;
    let fifo = w.join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    // Read-write, so that it never sees the end; each line is counted in
    // the reader's memory only.
    let pid = in_background(
        &cg,
        w,
        "sh -c 'exec 3<>fifo; n=0; while read -r l <&3; do n=$((n+1)); done'",
    );
    let asleep = || asleep_in_read(pid).then_some(());
    crab_tests::wait_until(10, asleep).expect("the reader blocks in read(2)");
    insp.register("freeze", &cg.dir).expect("register");
    assert_eq!(insp.turn_end("freeze").expect("turn").class, Class::None);

    // A freeze with nothing to read: the read is interrupted (the task is
    // frozen outside it) and resumed after the thaw.
    cg.set_frozen(true);
    assert!(frozen(pid), "frozen outside its read");
    cg.set_frozen(false);
    crab_tests::wait_until(10, asleep).expect("the read resumes");
    insp.forget_own_files("freeze", &[]).expect("forget");
    let r = insp.turn_end("freeze").expect("turn");
    assert_eq!(r.class, Class::None, "a resumed read is no running: {r:#?}");

    // A line arrives while it is frozen: after the thaw it reads it,
    // counts it and blocks in its next read, all in a moment.
    let before = bytes_read(pid);
    cg.set_frozen(true);
    assert!(frozen(pid), "frozen outside its read");
    let mut writer = std::fs::OpenOptions::new()
        .write(true)
        .open(&fifo)
        .expect("open the fifo");
    std::io::Write::write_all(&mut writer, b"x\n").expect("write a line");
    cg.set_frozen(false);
    crab_tests::wait_until(10, || {
        (bytes_read(pid) >= before + 2 && asleep_in_read(pid)).then_some(())
    })
    .expect("the reader reads the line and blocks again");
    insp.forget_own_files("freeze", &[]).expect("forget");
    let r = insp.turn_end("freeze").expect("turn");
    assert_eq!(r.class, Class::Proc, "it ran after the thaw: {r:#?}");
    assert!(
        r.reasons
            .iter()
            .any(|x| matches!(x, Reason::Ran { pid: p, .. } if *p == pid)),
        "{r:#?}"
    );
    assert_eq!(insp.turn_end("freeze").expect("turn").class, Class::None);

    insp.unregister("freeze").expect("unregister");
}

/// A long-lived task that ran its own code and was then stopped outside
/// any system call (a stop signal, a fault) made no call this turn and is
/// not running at its end: it still counts as ran.
#[test]
fn a_task_stopped_in_its_own_code_ran() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    let pid = in_background(&cg, &work.0, "sh -c 'while :; do :; done'");
    // Past the shell's start (its exec and setup calls) and in the loop,
    // which makes no call: 20 ticks of user time are far more than a
    // shell's start takes. A stop that came at a call's exit would find
    // it in that call, which ran before the turn.
    let looping = || {
        let utime: u64 = stat_field(pid, 11)?.parse().ok()?;
        (utime >= 20).then_some(())
    };
    crab_tests::wait_until(60, looping).expect("the loop runs");
    insp.register("stopped", &cg.dir).expect("register");
    insp.turn_end("stopped").expect("turn");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("stop the loop");
    let stopped = || (stat_field(pid, 0)? == "T").then_some(());
    crab_tests::wait_until(10, stopped).expect("the loop stops");
    let r = insp.turn_end("stopped").expect("turn");
    assert_eq!(r.class, Class::Proc, "{r:#?}");
    assert!(
        r.reasons
            .iter()
            .any(|x| matches!(x, Reason::Ran { pid: p, .. } if *p == pid)),
        "{r:#?}"
    );
    insp.unregister("stopped").expect("unregister");
}

/// A tracer in a cgroup below the sandbox's is not followed (the programs
/// match the sandbox's own cgroup) and is no CRIU: what it does to a task
/// makes the turn full, even when it has gone by the turn end.
#[test]
fn a_tracer_below_the_sandbox_makes_the_turn_full() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    let pid = in_background(&cg, &work.0, "sleep 1000");
    let asleep = || {
        let text = std::fs::read_to_string(format!("/proc/{pid}/syscall")).ok()?;
        // clock_nanosleep or nanosleep.
        matches!(text.split_whitespace().next(), Some("230" | "35")).then_some(())
    };
    crab_tests::wait_until(60, asleep).expect("the sleep sleeps");
    insp.register("below", &cg.dir).expect("register");

    // A turn moves a waiting shell into a child cgroup (full: the move).
    let child = cg.dir.join("tracer");
    std::fs::create_dir(&child).expect("create the child cgroup");
    let go = work.0.join("go");
    let script = format!(
        "sh -c 'echo $$ > {child}/cgroup.procs; while [ ! -e {go} ]; do sleep 0.05; done; \
         exec timeout -s INT 1 strace -p {pid} -o /dev/null' >/dev/null 2>&1 &",
        child = child.display(),
        go = go.display()
    );
    assert!(cg.run(&work.0, &script).status.success());
    until_populated(&child, "the shell is in the child cgroup");
    assert_eq!(insp.turn_end("below").expect("turn").class, Class::Full);

    // The next: strace, from below, attaches to the sleep and leaves.
    std::fs::write(&go, b"").expect("start the tracer");
    crab_tests::wait_until(30, || std::fs::remove_dir(&child).ok()).expect("the tracer is gone");
    let r = insp.turn_end("below").expect("turn");
    assert_eq!(r.class, Class::Full, "{r:#?}");
    assert!(
        r.reasons
            .iter()
            .any(|x| matches!(x, Reason::Unsure { why } if why.contains("tracer"))),
        "{r:#?}"
    );
    insp.unregister("below").expect("unregister");
}

/// A task born straight into another cgroup (`clone3` with
/// `CLONE_INTO_CGROUP`) raises no attach event and runs where the programs
/// do not match: the turn that made it is full, even when the task has
/// written a file and gone by the turn end.
#[test]
fn a_task_cloned_into_another_cgroup_makes_the_turn_full() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    insp.register("clone3", &cg.dir).expect("register");
    let child = cg.dir.join("born");
    std::fs::create_dir(&child).expect("create the child cgroup");
    // clone3(struct clone_args { flags, pidfd, child_tid, parent_tid,
    // exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup }).
    let clone_into = r#"
import ctypes, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
args = ctypes.create_string_buffer(struct.pack("11Q", 0x200000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, fd))
pid = ctypes.CDLL(None, use_errno=True).syscall(435, args, 88)
if pid == 0:
    with open("born.txt", "w") as f:
        f.write("from the child cgroup")
    os._exit(0)
if pid < 0:
    sys.exit("clone3: errno %d" % ctypes.get_errno())
_, status = os.waitpid(pid, 0)
sys.exit(status)
"#;
    let script = format!("/usr/bin/python3 -c '{clone_into}' {}", child.display());
    let out = cg.run(&work.0, &script);
    assert!(out.status.success(), "{out:?}");
    assert!(work.0.join("born.txt").exists(), "the child wrote its file");
    crab_tests::wait_until(10, || std::fs::remove_dir(&child).ok()).expect("the child cgroup empties");
    let full_with_reason = |r: &crab_inspector::TurnReport| {
        assert_eq!(r.class, Class::Full, "{r:#?}");
        assert!(
            r.reasons
                .iter()
                .any(|x| matches!(x, Reason::Unsure { why } if why.contains("cgroup outside the sandbox"))),
            "{r:#?}"
        );
    };
    full_with_reason(&insp.turn_end("clone3").expect("turn end"));

    // Into another sandbox: followed there, and still this one's doubt (the
    // child has this sandbox's mounts and files, its writes booked there).
    let other = TestCgroup::new();
    insp.register("clone3-other", &other.dir).expect("register");
    std::fs::remove_file(work.0.join("born.txt")).expect("remove");
    insp.turn_end("clone3").expect("turn end");
    let out = cg.run(
        &work.0,
        &format!("/usr/bin/python3 -c '{clone_into}' {}", other.dir.display()),
    );
    assert!(out.status.success(), "{out:?}");
    full_with_reason(&insp.turn_end("clone3").expect("turn end"));
    insp.unregister("clone3-other").expect("unregister");
    insp.unregister("clone3").expect("unregister");
}

/// A tracer outside the sandbox is CRIU while a capture runs, however deep
/// its cgroup is (nested containers): its calls are not the sandbox's, and
/// nothing is unsure. The programs compare cgroup levels; a walk up a fixed
/// number of levels took a deep outsider for one below the sandbox.
#[test]
fn a_deep_tracer_outside_the_sandbox_is_criu_during_a_capture() {
    let insp = inspector(&[], 1 << 20, true);
    let cg = TestCgroup::new();
    let work = work_dir();
    let pid = in_background(&cg, &work.0, "sleep 1000");
    crab_tests::wait_until(60, || {
        let text = std::fs::read_to_string(format!("/proc/{pid}/syscall")).ok()?;
        matches!(text.split_whitespace().next(), Some("230" | "35")).then_some(())
    })
    .expect("the sleep sleeps");
    insp.register("deep", &cg.dir).expect("register");

    // 20 levels below the root, beside the sandbox's cgroup.
    let top = crab_inspector::unified_mount()
        .expect("cgroup2")
        .join(crab_tests::unique("crab-insp-deep-"));
    let levels: Vec<std::path::PathBuf> = (1..=20)
        .scan(top.clone(), |dir, i| {
            if i > 1 {
                *dir = dir.join("n");
            }
            Some(dir.clone())
        })
        .collect();
    for dir in &levels {
        std::fs::create_dir(dir).expect("create a nested cgroup");
    }
    let deepest = levels.last().expect("levels");
    insp.capturing("deep", true).expect("capture begins");
    let out = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec timeout -s INT 1 strace -p {pid} -o /dev/null",
            deepest.display()
        ))
        .output()
        .expect("run strace");
    insp.capturing("deep", false).expect("capture ends");
    for dir in levels.iter().rev() {
        crab_tests::wait_until(10, || std::fs::remove_dir(dir).ok()).expect("remove a nested cgroup");
    }
    assert!(out.status.code().is_some(), "strace ran: {out:?}");
    let r = insp.turn_end("deep").expect("turn");
    assert!(
        !r.reasons
            .iter()
            .any(|x| matches!(x, Reason::Unsure { why } if why.contains("tracer"))),
        "{r:#?}"
    );
    insp.unregister("deep").expect("unregister");
}
