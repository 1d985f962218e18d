//! A private containerd: its own root, state, socket and namespace.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use crate::image::{busybox_archive, BUSYBOX};
use crate::leftovers::Scope;
use crate::{ok, path_with_crab, unique, wait_until};

/// A running containerd, stopped and cleaned up on drop.
pub struct Containerd {
    /// Its private directory (config, root, state, socket, log).
    pub dir: PathBuf,
    /// The namespace tests use.
    pub namespace: String,
    child: Option<Child>,
    env: Vec<(String, String)>,
    /// A crabd this harness started itself (shims start theirs otherwise).
    crabd: Option<Child>,
    /// The snapshotter `ctr` uses (`CONTAINERD_SNAPSHOTTER`), if not the
    /// default.
    snapshotter: Option<&'static str>,
}

impl Containerd {
    /// Starts containerd and imports the busybox image.
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// Starts containerd with `extra` appended to its config (e.g. a proxy
    /// plugin), and imports the busybox image.
    pub fn start_with(extra: &str) -> Self {
        Self::start_full(extra, &[])
    }

    /// Starts containerd with `extra` appended to its config and `env` in
    /// its environment (which the shims it starts inherit).
    pub fn start_full(extra: &str, env: &[(&str, &str)]) -> Self {
        let dir = PathBuf::from(format!("/tmp/{}", unique("crabct")));
        std::fs::create_dir_all(&dir).expect("create containerd dir");
        Self::start_in(dir, extra, env, None)
    }

    /// Starts containerd whose shims and crabd read a `crab.toml` of the
    /// test's: `[shim.proxy] transcript_dir` in a directory of the test's,
    /// which is returned (transcripts under `<dir>/transcripts/<namespace>/`;
    /// the caller removes it), then `toml` (keys of `[shim.proxy]`, or
    /// tables of their own).
    pub fn start_with_transcripts(prefix: &str, toml: &str) -> (Self, PathBuf) {
        let base = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&base).expect("create the test's directory");
        let config = base.join("crab.toml");
        let text = format!(
            "[shim.proxy]\ntranscript_dir = \"{}\"\n{toml}\n",
            base.join("transcripts").display()
        );
        std::fs::write(&config, text).expect("write crab.toml");
        let ctd = Self::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
        (ctd, base)
    }

    /// Starts containerd whose btrfs snapshotter has a btrfs filesystem of
    /// its own (a loop file), and makes it `ctr`'s snapshotter.
    pub fn start_on_btrfs() -> Self {
        let dir = PathBuf::from(format!("/tmp/{}", unique("crabct")));
        let mnt = dir.join(BTRFS_ROOT);
        std::fs::create_dir_all(&mnt).expect("create containerd dir");
        let img = dir.join("btrfs.img");
        for (cmd, args) in [
            ("truncate", vec!["-s", "2G", img.to_str().unwrap()]),
            ("mkfs.btrfs", vec!["-q", img.to_str().unwrap()]),
            (
                "mount",
                vec!["-o", "loop", img.to_str().unwrap(), mnt.to_str().unwrap()],
            ),
        ] {
            ok(Command::new(cmd).args(&args).output().expect(cmd));
        }
        Self::start_in(dir, "", &[], Some("btrfs"))
    }

    /// Starts containerd whose crabd keeps its root (registry, versions,
    /// process images, file copies) on an ext4 filesystem of its own, a
    /// sparse loop file of `size` (`truncate`'s syntax) with no blocks
    /// reserved, so a test can fill it ([`Containerd::store_fs`]). `toml`
    /// goes into the shims' and crabd's `crab.toml`.
    pub fn start_with_own_store(size: &str, toml: &str) -> Self {
        let dir = PathBuf::from(format!("/tmp/{}", unique("crabct")));
        let fs = dir.join(STORE_FS);
        let root = dir.join("crabd");
        for d in [&fs, &root] {
            std::fs::create_dir_all(d).expect("create containerd dir");
        }
        let img = dir.join("store.img");
        ok(Command::new("truncate")
            .arg("-s")
            .arg(size)
            .arg(&img)
            .output()
            .expect("truncate"));
        ok(Command::new("mkfs.ext4")
            .args(["-q", "-m", "0"])
            .arg(&img)
            .output()
            .expect("mkfs.ext4"));
        ok(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&fs)
            .output()
            .expect("mount"));
        // crabd's root is a directory of that filesystem, bound in place:
        // what fills the filesystem stays out of crabd's tree.
        std::fs::create_dir_all(fs.join("crabd")).expect("create crabd's root");
        ok(Command::new("mount")
            .arg("--bind")
            .arg(fs.join("crabd"))
            .arg(&root)
            .output()
            .expect("mount"));
        let theirs = dir.join("theirs.toml");
        std::fs::write(&theirs, toml).expect("write crab.toml");
        Self::start_in(dir, "", &[("CRAB_CONFIG", &theirs.to_string_lossy())], None)
    }

    /// The filesystem crabd's root is on, for a containerd started by
    /// [`Containerd::start_with_own_store`] (`None` otherwise).
    pub fn store_fs(&self) -> Option<PathBuf> {
        let fs = self.dir.join(STORE_FS);
        fs.join("crabd").is_dir().then_some(fs)
    }

    fn start_in(dir: PathBuf, extra: &str, env: &[(&str, &str)], snapshotter: Option<&'static str>) -> Self {
        let config = format!(
            "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
             [grpc]\n  address = \"{d}/c.sock\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\"]\n  disable_apparmor = true\n{extra}\n",
            d = dir.display()
        );
        std::fs::write(dir.join("config.toml"), config).expect("write containerd config");
        // The shims get a crab.toml whose crabd is this containerd's own
        // (started by the first shim, stopped on drop), over the caller's.
        let mut env: Vec<(String, String)> =
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let theirs = env
            .iter()
            .position(|(k, _)| k == "CRAB_CONFIG")
            .map(|i| env.remove(i).1)
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        let crab_toml = dir.join("crab.toml");
        std::fs::write(&crab_toml, with_own_crabd(&theirs, &dir)).expect("write crab.toml");
        env.push(("CRAB_CONFIG".to_owned(), crab_toml.to_string_lossy().into_owned()));
        let mut c = Containerd {
            namespace: unique("ns"),
            dir,
            child: None,
            env,
            crabd: None,
            snapshotter,
        };
        c.spawn();
        c.ctr_ok(&["image", "import", &busybox_archive().to_string_lossy()]);
        c
    }

    /// containerd's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The gRPC socket.
    pub fn address(&self) -> PathBuf {
        self.dir.join("c.sock")
    }

    /// The crab.toml its shims (and their crabd) read.
    pub fn crab_config(&self) -> PathBuf {
        self.dir.join("crab.toml")
    }

    /// The socket of this containerd's crabd.
    pub fn crabd_socket(&self) -> PathBuf {
        self.dir.join("crabd.sock")
    }

    /// The root of this containerd's crabd.
    pub fn crabd_root(&self) -> PathBuf {
        self.dir.join("crabd")
    }

    /// The pid of this containerd's crabd, if it runs.
    pub fn crabd_pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.crabd_root().join("crabd.pid")).ok()?;
        let pid: i32 = text.trim().parse().ok()?;
        std::path::Path::new(&format!("/proc/{pid}"))
            .exists()
            .then_some(pid)
    }

    /// Starts this containerd's crabd by hand (as a restart after a crash
    /// would) and waits until it answers.
    ///
    /// # Panics
    /// If it does not come up.
    pub fn start_crabd(&mut self) {
        // What it says before its log is open goes beside containerd's.
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("crabd.stderr"))
            .expect("open crabd.stderr");
        let child = Command::new(crate::bin_dir().join("crabd"))
            .env("CRAB_CONFIG", self.crab_config())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start crabd");
        self.crabd = Some(child);
        let socket = self.crabd_socket();
        wait_until(20, || {
            let up = std::os::unix::net::UnixStream::connect(&socket).is_ok() && self.crabd_pid().is_some();
            up.then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "crabd did not come up; see {}/crabd.stderr and {}/crabd.log",
                self.dir.display(),
                self.crabd_root().display()
            )
        });
    }

    /// Reaps a crabd this harness started that was killed (so a new one
    /// can be started and the old one is no zombie).
    pub fn reap_crabd(&mut self) {
        if let Some(mut child) = self.crabd.take() {
            let _ = child.wait();
        }
        if let Some(pid) = self.crabd_pid() {
            wait_until(10, || {
                (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
            });
        }
    }

    /// Kills containerd (SIGKILL, as a crash would) and starts it again on
    /// the same state; running tasks and their shims are untouched.
    pub fn crash_restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait();
        }
        self.spawn();
    }

    /// Stops this containerd's crabd, if it runs, and waits for it to exit.
    pub fn stop_crabd(&mut self) {
        if let Some(mut child) = self.crabd.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = child.wait();
        }
        let Some(pid) = self.crabd_pid() else { return };
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        wait_until(10, || {
            (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
        });
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("containerd.log"))
            .expect("open containerd log");
        let child = Command::new("containerd")
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            .env("PATH", path_with_crab())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .expect("start containerd (run packaging/install-deps.sh)");
        self.child = Some(child);
        let addr = self.address();
        wait_until(20, || {
            Command::new("ctr")
                .arg("-a")
                .arg(&addr)
                .arg("version")
                .output()
                .ok()
                .filter(|o| o.status.success())
        })
        .unwrap_or_else(|| {
            panic!(
                "containerd did not come up; see {}/containerd.log",
                self.dir.display()
            )
        });
    }

    /// Stops containerd (SIGTERM) and starts it again on the same state;
    /// running tasks and their shims are untouched.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = child.wait();
        }
    }

    /// A `ctr` command against this containerd and namespace.
    pub fn ctr_cmd(&self, args: &[&str]) -> Command {
        static CTR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
        let mut cmd = Command::new(CTR.get_or_init(|| crate::program("ctr")));
        cmd.arg("-a")
            .arg(self.address())
            .arg("-n")
            .arg(&self.namespace)
            .args(args);
        cmd.env("PATH", path_with_crab());
        if let Some(snapshotter) = self.snapshotter {
            cmd.env("CONTAINERD_SNAPSHOTTER", snapshotter);
        }
        cmd
    }

    /// Runs `ctr args…` and returns its output.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.ctr_cmd(args).stdin(Stdio::null()).output().expect("run ctr")
    }

    /// Runs `ctr args…`, asserts success, returns stdout.
    #[track_caller]
    pub fn ctr_ok(&self, args: &[&str]) -> String {
        ok(self.ctr(args))
    }

    /// `ctr run -d` of busybox with `runtime`, running `cmd`.
    #[track_caller]
    pub fn run_detached(&self, runtime: &str, id: &str, cmd: &[&str]) {
        let mut args = vec!["run", "-d", "--runtime", runtime, BUSYBOX, id];
        args.extend_from_slice(cmd);
        self.ctr_ok(&args);
    }

    /// `ctr run -d` of the devbox image (imported first) with the crab
    /// runtime, the host's /usr bound read-only, idling: a sandbox with
    /// compilers and tools for turns to run in.
    #[track_caller]
    pub fn run_devbox(&self, id: &str) {
        self.ctr_ok(&[
            "image",
            "import",
            &crate::image::devbox_archive().to_string_lossy(),
        ]);
        self.ctr_ok(&[
            "run",
            "-d",
            "--runtime",
            crate::CRAB,
            "--mount",
            "type=bind,src=/usr,dst=/usr,options=rbind:ro",
            crate::image::DEVBOX,
            id,
            "sleep",
            "100000000",
        ]);
    }

    /// Pid of task `id` as `ctr task ls` shows it.
    pub fn task_pid(&self, id: &str) -> Option<i32> {
        self.task_field(id, 1).and_then(|p| p.parse().ok())
    }

    /// Status of task `id` as `ctr task ls` shows it.
    pub fn task_status(&self, id: &str) -> Option<String> {
        self.task_field(id, 2)
    }

    fn task_field(&self, id: &str, idx: usize) -> Option<String> {
        let out = self.ctr_ok(&["task", "ls"]);
        out.lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.first() == Some(&id))
            .and_then(|f| f.get(idx).map(|s| s.to_string()))
    }

    /// Kills, deletes and removes container `id`.
    pub fn remove(&self, id: &str) {
        let _ = self.ctr(&["task", "kill", "-s", "SIGKILL", id]);
        wait_until(10, || {
            (self.task_status(id).as_deref() != Some("RUNNING")).then_some(())
        });
        let _ = self.ctr(&["task", "delete", id]);
        let _ = self.ctr(&["container", "rm", id]);
    }

    /// Where this namespace's containers leave traces.
    pub fn scope(&self) -> Scope {
        self.scope_of(&self.namespace, &self.namespace)
    }

    /// Where containers of `namespace` with cgroups under `cgroup_parent`
    /// leave traces.
    pub fn scope_of(&self, namespace: &str, cgroup_parent: &str) -> Scope {
        Scope {
            address: self.address(),
            namespace: namespace.to_owned(),
            cgroup_parent: cgroup_parent.to_owned(),
            bundles: self
                .dir
                .join("state/io.containerd.runtime.v2.task")
                .join(namespace),
        }
    }

    /// Removes every container of the namespace (cleanup of a failed test).
    fn remove_all(&self) {
        let out = self.ctr(&["container", "ls", "-q"]);
        for id in String::from_utf8_lossy(&out.stdout).lines() {
            self.remove(id.trim());
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.remove_all();
        }
        self.stop();
        self.stop_crabd();
        crate::cgroups::remove_empty(&self.namespace);
        let _ = std::fs::remove_dir_all(pin_dir(&self.dir));
        // Whatever is still mounted in its directory: the snapshotters'
        // filesystems, crabd's store, and what containerd left when it was
        // stopped mid-way (a CRI pod's shm after a failed test).
        let unmounted = crate::leftovers::unmount_under(&self.dir);
        if !unmounted {
            // Never delete through a mount that is still there.
            eprintln!("{} still has mounts: not removed", self.dir.display());
        } else if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The filesystem of [`Containerd::start_with_own_store`], under the
/// containerd directory.
const STORE_FS: &str = "store-fs";

/// containerd's btrfs snapshotter's root, under the containerd directory.
const BTRFS_ROOT: &str = "root/io.containerd.snapshotter.v1.btrfs";

/// Where a test crabd pins its inspector (bpffs).
fn pin_dir(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    PathBuf::from(format!("/sys/fs/bpf/crab-test-{name}"))
}

/// `toml` with the `[crabd]` socket, root and host listener port of a test
/// containerd (tests run in parallel, each with its own crabd), added to the
/// caller's `[crabd]` table if it has one.
fn with_own_crabd(toml: &str, dir: &Path) -> String {
    // The inspector only where a test asks for it (each loaded inspector
    // puts every syscall of the host through a tracepoint), pinned in a
    // directory of its own that drop removes.
    let inspector = if toml.contains("inspector =") {
        String::new()
    } else {
        "inspector = false\n".to_owned()
    };
    // Removed containers' histories go within a second.
    let gc = if toml.contains("gc_interval_secs =") {
        ""
    } else {
        "gc_interval_secs = 1\n"
    };
    // The fixtures that stateful sandboxes bind read-only may come with
    // their archives.
    let binds = if toml.contains("import_bind_sources =") {
        String::new()
    } else {
        format!(
            "import_bind_sources = [\"{}\"]\n",
            crate::image::fixtures_dir().display()
        )
    };
    // The page only where a test asks for it (its default port is one).
    let page = if toml.contains("ui_port =") {
        ""
    } else {
        "ui_port = 0\n"
    };
    let keys = format!(
        "socket = \"{d}/crabd.sock\"\nroot = \"{d}/crabd\"\nproxy_port = {port}\n\
         inspector_pin_dir = \"{pins}\"\n{inspector}{gc}{binds}{page}",
        d = dir.display(),
        port = free_port(),
        pins = pin_dir(dir).display(),
    );
    match toml.find("[crabd]\n") {
        Some(at) => {
            let end = at + "[crabd]\n".len();
            format!("{}{keys}{}", &toml[..end], &toml[end..])
        }
        None => format!("{toml}\n[crabd]\n{keys}"),
    }
}

/// A port on 127.0.0.1 that nothing listened on a moment ago, below the
/// kernel's ephemeral range (32768 and up by default): a port given out
/// for a later bind must not be one that anything binding port 0 (another
/// test's containerd, LLM or browser driver) can be handed meanwhile.
/// Each call of a test process tries a port of its own first.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static N: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(131);
    loop {
        let n = N.fetch_add(1, Ordering::Relaxed);
        let port = (FIRST + start.wrapping_add(n.wrapping_mul(7)) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
        assert!(n < 100_000, "no free port in {FIRST}..{}", FIRST + SPAN);
    }
}
