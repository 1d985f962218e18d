//! A fault campaign (issue 15.10): seeded faults at random points of a
//! scripted agent's run on a stateful sandbox (`fixtures/stateful.py`),
//! each followed by checks that nothing acknowledged was lost, nothing is
//! torn and nothing leaked. `crab-bench faults` runs a long one; the test
//! suite a short one.
//!
//! A round is one agent step (the store's value and a file under `/data`
//! change) and a checkpoint, whose version is then acknowledged: its state
//! is recorded. Then one fault:
//!
//! - `init`: SIGKILL of the sandbox's init; crabd restores the head.
//! - `crabd-checkpoint`, `crabd-rollback`, `crabd-fork`, `crabd-export`:
//!   SIGKILL of crabd at a seeded delay into that operation, then crabd
//!   started again.
//! - `containerd`: SIGKILL of containerd, then containerd started again.
//! - `shim`: SIGKILL of the sandbox's shim (containerd then drops the
//!   task); `crabctl resume` brings the sandbox back from its head.
//! - `shim-checkpoint`, `shim-rollback`: the same at a seeded delay into a
//!   checkpoint or a rollback (the shim is the one writing the images, or
//!   restoring them).
//! - `disk-full`: the filesystem of crabd's root filled to a seeded few
//!   MiB of room (a loop file: [`containerd`]), then a checkpoint and a
//!   rollback asked for; then room made again. Each either works or is
//!   refused, and the sandbox runs on as it was.
//!
//! After each: the sandbox runs, thawed, with no CRIU left; its state is
//! the acknowledged one (or, after an interrupted rollback, the rollback's
//! target: either is whole); an interrupted fork is whole or absent; an
//! interrupted export left the archive whole or absent and no partial
//! file. At the end every acknowledged version is rolled back to and
//! compared, every other version crabd lists restores (none is torn),
//! the sandbox and its forks are removed, and nothing may remain.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::containerd::Containerd;
use crate::leftovers;
use crate::sandbox::{
    crabctl, crabctl_direct, exec_sh, run_stateful, tree_digest, try_ask, version_numbers, wait_registered,
    COUNTER, STORE,
};
use crate::{unique, wait_until};

/// What can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// SIGKILL of the sandbox's init.
    Init,
    /// SIGKILL of crabd during a checkpoint.
    CrabdCheckpoint,
    /// SIGKILL of crabd during a rollback.
    CrabdRollback,
    /// SIGKILL of crabd during a fork.
    CrabdFork,
    /// SIGKILL of crabd during an export.
    CrabdExport,
    /// SIGKILL of containerd.
    Containerd,
    /// SIGKILL of the sandbox's shim.
    Shim,
    /// SIGKILL of the sandbox's shim during a checkpoint.
    ShimCheckpoint,
    /// SIGKILL of the sandbox's shim during a rollback.
    ShimRollback,
    /// The store's filesystem full during a checkpoint and a rollback.
    DiskFull,
}

impl Kind {
    /// Every kind, in the campaign's order.
    pub const ALL: [Kind; 10] = [
        Kind::Init,
        Kind::CrabdCheckpoint,
        Kind::CrabdRollback,
        Kind::CrabdFork,
        Kind::CrabdExport,
        Kind::Containerd,
        Kind::Shim,
        Kind::ShimCheckpoint,
        Kind::ShimRollback,
        Kind::DiskFull,
    ];

    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Init => "init",
            Kind::CrabdCheckpoint => "crabd-checkpoint",
            Kind::CrabdRollback => "crabd-rollback",
            Kind::CrabdFork => "crabd-fork",
            Kind::CrabdExport => "crabd-export",
            Kind::Containerd => "containerd",
            Kind::Shim => "shim",
            Kind::ShimCheckpoint => "shim-checkpoint",
            Kind::ShimRollback => "shim-rollback",
            Kind::DiskFull => "disk-full",
        }
    }
}

/// Whose SIGKILL interrupts an operation.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Crabd,
    Shim,
}

/// One fault and what came of it.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// What failed.
    pub kind: Kind,
    /// How long into the operation (crabd's faults).
    pub delay: Duration,
    /// Why state was lost (the sandbox did not come back, or came back
    /// with another state than an acknowledged one), if it was.
    pub lost: Option<String>,
    /// What was left behind, if anything.
    pub leaked: Option<String>,
    /// How the interrupted operation ended (it did, or did not).
    pub note: &'static str,
}

/// What the agent can observe of its sandbox: the store's value and the
/// files under `/data`.
pub type Observed = (String, BTreeMap<String, String>);

/// xorshift64*: seeded, the same campaign on every run.
pub struct Seeded(pub u64);

impl Seeded {
    /// The next number below `below`.
    pub fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % below.max(1)
    }
}

/// The campaign's sandbox and what it knows of it.
pub struct Campaign<'a> {
    ctd: &'a mut Containerd,
    id: String,
    pid: i32,
    step: u64,
    /// The state the sandbox is in (the agent's view).
    current: Observed,
    /// Acknowledged versions and their states.
    acked: BTreeMap<u64, Observed>,
    forks: Vec<String>,
    dir: PathBuf,
    seeded: Seeded,
    note: &'static str,
    /// Crashes crabd counts against the sandbox (init killed, shim killed).
    crashes: usize,
}

impl<'a> Campaign<'a> {
    /// Starts the stateful sandbox `id` on `ctd` for a campaign seeded
    /// with `seed`.
    pub fn start(ctd: &'a mut Containerd, id: &str, seed: u64) -> Campaign<'a> {
        let pid = run_stateful(ctd, id);
        wait_registered(ctd, id);
        exec_sh(ctd, id, "mkdir -p /data");
        let dir = std::env::temp_dir().join(unique("crab-faults"));
        std::fs::create_dir_all(&dir).expect("the campaign's directory");
        let current = observe(pid).expect("the servers answer");
        Campaign {
            ctd,
            id: id.to_owned(),
            pid,
            step: 0,
            current,
            acked: BTreeMap::new(),
            forks: Vec::new(),
            dir,
            seeded: Seeded(seed),
            note: "",
            crashes: 0,
        }
    }

    /// One round: a step, its acknowledged version, then a fault of `kind`
    /// (or a seeded kind) and the checks after it.
    pub fn round(&mut self, kind: Option<Kind>) -> Outcome {
        let mut kind = kind.unwrap_or_else(|| Kind::ALL[self.seeded.next(Kind::ALL.len() as u64) as usize]);
        // crabd gives up on a sandbox that crashes a fourth time within a
        // minute (by design: a crash loop is the task's end): two per
        // sandbox keep every crash a recoverable one.
        if matches!(
            kind,
            Kind::Init | Kind::Shim | Kind::ShimCheckpoint | Kind::ShimRollback
        ) {
            if self.crashes >= 2 {
                kind = Kind::CrabdCheckpoint;
            } else {
                self.crashes += 1;
            }
        }
        let delay = Duration::from_millis(self.seeded.next(1500));
        let mut outcome = Outcome {
            kind,
            delay,
            lost: None,
            leaked: None,
            note: "",
        };
        self.note = "";
        if let Err(e) = self.step_and_ack() {
            outcome.lost = Some(format!("before the fault: {e}"));
            return outcome;
        }
        let before = self.current.clone();
        let result = match kind {
            Kind::Init => self.init_killed(),
            Kind::CrabdCheckpoint => self.checkpoint_interrupted(Victim::Crabd, delay),
            Kind::CrabdRollback => self.rollback_interrupted(Victim::Crabd, &before, delay),
            Kind::CrabdFork => self.fork_interrupted(delay),
            Kind::CrabdExport => self.export_interrupted(delay),
            Kind::Containerd => self.containerd_killed(),
            Kind::Shim => self.shim_killed(),
            Kind::ShimCheckpoint => self.checkpoint_interrupted(Victim::Shim, delay),
            Kind::ShimRollback => self.rollback_interrupted(Victim::Shim, &before, delay),
            Kind::DiskFull => self.disk_full(&before),
        };
        if let Err(e) = result.and_then(|()| self.still_whole(kind)) {
            outcome.lost = Some(e);
        }
        if let Some(leak) = self.leak_now() {
            outcome.leaked = Some(leak);
        } else if kind == Kind::DiskFull {
            outcome.leaked = self.stray_temporaries();
        }
        outcome.note = self.note;
        outcome
    }

    /// Rolls back to every acknowledged version and compares; removes the
    /// sandbox and its forks. Answers what was lost and what leaked.
    pub fn finish(mut self) -> (Vec<String>, Vec<String>) {
        let mut lost = Vec::new();
        let acked: Vec<(u64, Observed)> = self.acked.iter().map(|(v, s)| (*v, s.clone())).collect();
        for (version, state) in acked {
            let out = crabctl(self.ctd, &["rollback", &self.id, &version.to_string()]);
            if !out.status.success() {
                lost.push(format!(
                    "version {version} does not restore: {}",
                    crate::stderr(&out)
                ));
                continue;
            }
            self.pid = self.ctd.task_pid(&self.id).unwrap_or(self.pid);
            match wait_until(20, || observe(self.pid)) {
                Some(seen) if seen == state => {}
                seen => lost.push(format!("version {version}: {seen:?}, acknowledged {state:?}")),
            }
        }
        // What crabd lists beside them (a rollback's undo, a checkpoint a
        // killed crabd finished) has no state to compare but must restore:
        // no version is torn.
        let listed: Vec<u64> = version_numbers(self.ctd, &self.id)
            .into_iter()
            .filter_map(|v| u64::try_from(v).ok())
            .filter(|v| !self.acked.contains_key(v))
            .collect();
        for version in listed {
            let out = crabctl(self.ctd, &["rollback", &self.id, &version.to_string()]);
            if !out.status.success() {
                lost.push(format!(
                    "listed version {version} does not restore: {}",
                    crate::stderr(&out)
                ));
                continue;
            }
            self.pid = self.ctd.task_pid(&self.id).unwrap_or(self.pid);
            if wait_until(20, || observe(self.pid)).is_none() {
                lost.push(format!("listed version {version}: its servers do not answer"));
            }
        }
        let mut ids = vec![self.id.clone()];
        ids.append(&mut self.forks);
        for id in &ids {
            self.ctd.remove(id);
        }
        let mut leaked = Vec::new();
        let making = self.ctd.crabd_root().join("making");
        let records = std::fs::read_dir(&making).map_or(0, |d| d.count());
        if records > 0 {
            leaked.push(format!("{records} making records stay in {}", making.display()));
        }
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        if let Err(e) = std::panic::catch_unwind(|| leftovers::assert_clean(&self.ctd.scope(), &refs)) {
            leaked.push(
                e.downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "left behind".to_owned()),
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        (lost, leaked)
    }

    fn step_and_ack(&mut self) -> Result<(), String> {
        self.step += 1;
        let step = self.step;
        let answer = try_ask(self.pid, STORE, &format!("set k {step}")).map_err(|e| e.to_string())?;
        if answer != "ok" {
            return Err(format!("the store answered {answer}"));
        }
        let out = self.ctd.ctr(&[
            "task",
            "exec",
            "--exec-id",
            &unique("step"),
            &self.id,
            "sh",
            "-c",
            &format!("echo {step} > /data/s{}", step % 3),
        ]);
        if !out.status.success() {
            return Err(format!("the step's command: {}", crate::stderr(&out)));
        }
        self.current = observe(self.pid).ok_or("the servers do not answer")?;
        let v = self.json(&["checkpoint", &self.id.clone()])?;
        let version = v["version"]["version"].as_u64().ok_or("no version number")?;
        self.acked.insert(version, self.current.clone());
        Ok(())
    }

    /// A checkpoint `victim`'s SIGKILL interrupts `delay` into it.
    fn checkpoint_interrupted(&mut self, victim: Victim, delay: Duration) -> Result<(), String> {
        let n = version_numbers(self.ctd, &self.id).len();
        self.killed_during(victim, &["checkpoint", &self.id.clone()], delay)?;
        self.note = match version_numbers(self.ctd, &self.id).len() > n {
            true => "checkpointed",
            false => "no version",
        };
        Ok(())
    }

    /// A rollback to a seeded acknowledged version that `victim`'s SIGKILL
    /// interrupts `delay` into it.
    fn rollback_interrupted(
        &mut self,
        victim: Victim,
        before: &Observed,
        delay: Duration,
    ) -> Result<(), String> {
        let target = self.seeded_target();
        self.killed_during(
            victim,
            &["rollback", &self.id.clone(), &target.to_string()],
            delay,
        )?;
        self.settled_after_rollback(before, target)
    }

    fn killed_during(&mut self, victim: Victim, args: &[&str], delay: Duration) -> Result<(), String> {
        match victim {
            Victim::Crabd => self.crabd_killed_during(args, delay),
            Victim::Shim => self.shim_killed_during(args, delay),
        }
    }

    /// A seeded one of the acknowledged versions.
    fn seeded_target(&mut self) -> u64 {
        let versions: Vec<u64> = self.acked.keys().copied().collect();
        versions[self.seeded.next(versions.len() as u64) as usize]
    }

    fn init_killed(&mut self) -> Result<(), String> {
        let old = self.pid;
        kill(Pid::from_raw(old), Signal::SIGKILL).map_err(|e| e.to_string())?;
        self.pid = wait_until(60, || self.ctd.task_pid(&self.id).filter(|&p| p != old))
            .ok_or("not recovered within 60 s")?;
        Ok(())
    }

    /// Runs `crabctl args` and SIGKILLs crabd `delay` into it; starts crabd
    /// again. The operation may have ended either way.
    fn crabd_killed_during(&mut self, args: &[&str], delay: Duration) -> Result<(), String> {
        let ctd = &*self.ctd;
        std::thread::scope(|s| {
            let op = s.spawn(|| crabctl_direct(ctd, args));
            std::thread::sleep(delay);
            if let Some(pid) = ctd.crabd_pid() {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = op.join();
        });
        self.ctd.reap_crabd();
        self.ctd.start_crabd();
        wait_registered(self.ctd, &self.id);
        Ok(())
    }

    /// After an interrupted rollback to `target`: the sandbox is either as
    /// it was or at `target`, whole; the agent goes on from what it sees.
    fn settled_after_rollback(&mut self, before: &Observed, target: u64) -> Result<(), String> {
        let pid = wait_until(60, || {
            let pid = self.ctd.task_pid(&self.id)?;
            (self.ctd.task_status(&self.id).as_deref() == Some("RUNNING")).then_some(pid)
        })
        .ok_or("the sandbox does not run after an interrupted rollback")?;
        self.pid = pid;
        let seen = wait_until(20, || observe(pid)).ok_or("its servers do not answer")?;
        if &seen == before || Some(&seen) == self.acked.get(&target) {
            self.note = match Some(&seen) == self.acked.get(&target) {
                true => "rolled back",
                false => "not rolled back",
            };
            self.current = seen;
            return Ok(());
        }
        Err(format!(
            "after an interrupted rollback to {target}: {seen:?}, neither {before:?} nor the target's"
        ))
    }

    fn fork_interrupted(&mut self, delay: Duration) -> Result<(), String> {
        let (version, state) = self
            .acked
            .iter()
            .next_back()
            .map(|(v, s)| (*v, s.clone()))
            .ok_or("no version")?;
        let name = unique("fork");
        self.forks.push(name.clone());
        self.crabd_killed_during(
            &["fork", &self.id.clone(), &version.to_string(), "--name", &name],
            delay,
        )?;
        // Whole or absent (the restarted crabd settles what the killed one
        // was making): a fork that runs answers with the version's state.
        let ctd = &*self.ctd;
        let runs = wait_until(30, || match ctd.task_status(&name).as_deref() {
            Some("RUNNING") => Some(true),
            _ if !ctd.ctr(&["container", "info", &name]).status.success() => Some(false),
            _ => None,
        })
        .ok_or_else(|| format!("fork {name} exists but does not run"))?;
        if !runs {
            self.note = "no fork";
            return Ok(());
        }
        self.note = "forked";
        let pid = self.ctd.task_pid(&name).ok_or("the fork's task is gone")?;
        match wait_until(20, || observe(pid)) {
            Some(seen) if seen == state => Ok(()),
            seen => Err(format!(
                "fork {name}: {seen:?}, version {version} holds {state:?}"
            )),
        }
    }

    fn export_interrupted(&mut self, delay: Duration) -> Result<(), String> {
        let file = self.dir.join(format!("{}.crab", unique("export")));
        let path = file.to_string_lossy().into_owned();
        self.crabd_killed_during(&["export", &self.id.clone(), "latest", &path], delay)?;
        let partial = PathBuf::from(format!("{}.partial", file.display()));
        if partial.exists() {
            return Err(format!("{} was left behind", partial.display()));
        }
        if file.exists() && !archive_whole(&file) {
            return Err(format!("{} is not a whole archive", file.display()));
        }
        self.note = if file.exists() { "exported" } else { "no archive" };
        let _ = std::fs::remove_file(&file);
        Ok(())
    }

    /// Fills the store's filesystem to a seeded few MiB of room, asks for
    /// a checkpoint and a rollback, then makes room again. A version made
    /// while full is acknowledged like any other (the end restores it); a
    /// refusal must say why; the sandbox runs on, at the rollback's target
    /// if it answered done, else as it was.
    fn disk_full(&mut self, before: &Observed) -> Result<(), String> {
        let fs = self
            .ctd
            .store_fs()
            .ok_or("crabd's root has no filesystem of its own (see faults::containerd)")?;
        let filler = fs.join("filler");
        let room = self.seeded.next(16) << 20;
        let result = fill(&fs, &filler, room).and_then(|()| self.while_full(before));
        std::fs::remove_file(&filler).map_err(|e| format!("remove {}: {e}", filler.display()))?;
        result
    }

    fn while_full(&mut self, before: &Observed) -> Result<(), String> {
        let out = crabctl(self.ctd, &["checkpoint", &self.id.clone()]);
        let checkpointed = out.status.success();
        if checkpointed {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
            let version = v["version"]["version"].as_u64().ok_or("no version number")?;
            self.acked.insert(version, self.current.clone());
        } else {
            refused_for_room("checkpoint", &out)?;
        }
        let target = self.seeded_target();
        let out = crabctl(self.ctd, &["rollback", &self.id.clone(), &target.to_string()]);
        let rolled_back = out.status.success();
        if !rolled_back {
            refused_for_room("rollback", &out)?;
        }
        self.settled_after_rollback(before, target)?;
        let expected = match rolled_back {
            true => &self.acked[&target],
            false => before,
        };
        if self.current != *expected {
            return Err(format!(
                "rollback to {target} answered {}, but the sandbox holds {:?}",
                if rolled_back { "done" } else { "refused" },
                self.current
            ));
        }
        self.note = match (checkpointed, rolled_back) {
            (true, true) => "checkpointed, rolled back",
            (true, false) => "checkpointed, rollback refused",
            (false, true) => "checkpoint refused, rolled back",
            (false, false) => "both refused",
        };
        Ok(())
    }

    fn containerd_killed(&mut self) -> Result<(), String> {
        self.ctd.crash_restart();
        Ok(())
    }

    /// Runs `crabctl args` and SIGKILLs the sandbox's shim `delay` into
    /// it, then resumes the sandbox. The operation may have ended either
    /// way.
    fn shim_killed_during(&mut self, args: &[&str], delay: Duration) -> Result<(), String> {
        let shim = self.shim_pid()?;
        let ctd = &*self.ctd;
        std::thread::scope(|s| {
            let op = s.spawn(|| crabctl(ctd, args));
            std::thread::sleep(delay);
            let _ = kill(Pid::from_raw(shim), Signal::SIGKILL);
            let _ = op.join();
        });
        self.resumed()
    }

    fn shim_pid(&self) -> Result<i32, String> {
        let addr = self.ctd.address().to_string_lossy().into_owned();
        leftovers::shim_pids(&addr)
            .into_iter()
            .find(|&p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == self.id.as_bytes()))
            })
            .ok_or_else(|| "no shim of the sandbox".to_owned())
    }

    /// After its shim was killed: containerd drops the task, and
    /// `crabctl resume` brings the sandbox back from its head.
    fn resumed(&mut self) -> Result<(), String> {
        wait_until(30, || self.ctd.task_pid(&self.id).is_none().then_some(()))
            .ok_or("containerd kept the task of a dead shim")?;
        let out = crabctl(self.ctd, &["resume", &self.id]);
        if !out.status.success() {
            return Err(format!("resume: {}", crate::stderr(&out)));
        }
        self.pid = self.ctd.task_pid(&self.id).ok_or("no task after resume")?;
        Ok(())
    }

    fn shim_killed(&mut self) -> Result<(), String> {
        let shim = self.shim_pid()?;
        kill(Pid::from_raw(shim), Signal::SIGKILL).map_err(|e| e.to_string())?;
        self.resumed()
    }

    /// The sandbox runs, thawed, with the state the agent knows.
    fn still_whole(&mut self, kind: Kind) -> Result<(), String> {
        let pid = wait_until(60, || {
            let pid = self.ctd.task_pid(&self.id)?;
            (self.ctd.task_status(&self.id).as_deref() == Some("RUNNING")).then_some(pid)
        })
        .ok_or_else(|| format!("the sandbox does not run after a {} fault", kind.name()))?;
        self.pid = pid;
        let seen = wait_until(20, || observe(pid)).ok_or("its servers do not answer")?;
        if seen != self.current {
            return Err(format!(
                "after a {} fault: {seen:?}, acknowledged {:?}",
                kind.name(),
                self.current
            ));
        }
        Ok(())
    }

    /// What a fault left that nothing will clean: CRIU still running, a
    /// frozen sandbox.
    fn leak_now(&self) -> Option<String> {
        let criu: Vec<String> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == "criu"))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        if !criu.is_empty() {
            // A dump of another operation (or test) may still be finishing:
            // give it time.
            let gone = wait_until(60, || {
                criu.iter()
                    .all(|p| !Path::new(&format!("/proc/{p}")).exists())
                    .then_some(())
            });
            if gone.is_none() {
                return Some(format!("criu processes {criu:?} outlived the fault"));
            }
        }
        let cgroup = std::fs::read_to_string(format!("/proc/{}/cgroup", self.pid)).ok()?;
        let rel = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
        let unified = unified_mount()?;
        let freeze = unified.join(rel.trim_start_matches('/')).join("cgroup.freeze");
        // A checkpoint the killed crabd asked for runs to its end in the
        // shim: frozen for a moment is its work, frozen for long a leak.
        let thawed = wait_until(30, || {
            let v = std::fs::read_to_string(&freeze).unwrap_or_default();
            (v.trim() != "1").then_some(())
        });
        thawed
            .is_none()
            .then(|| format!("{} stays frozen", freeze.display()))
    }

    /// Temporary files a failed write left in crabd's store for the
    /// sandbox (a killed crabd's are swept when it starts again; a live
    /// crabd's failure must remove its own).
    fn stray_temporaries(&self) -> Option<String> {
        let root = self.ctd.crabd_root();
        let stray: Vec<PathBuf> = [
            root.join("images").join(&self.id),
            root.join("sandboxes").join(&self.id),
            root.join("registry"),
            root.join("making"),
        ]
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with(".tmp") || name.starts_with(".stale") || name.ends_with(".tmp")
        })
        .collect();
        (!stray.is_empty()).then(|| format!("a full disk left {stray:?}"))
    }

    fn json(&self, args: &[&str]) -> Result<serde_json::Value, String> {
        let out = crabctl(self.ctd, args);
        if !out.status.success() {
            return Err(format!("crabctl {}: {}", args.join(" "), crate::stderr(&out)));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
    }
}

/// Where a campaign runs: containerd whose crabd keeps its root on a
/// filesystem of its own (a sparse 4 GiB loop file) that the disk-full
/// fault fills, with no floor on the store's free room
/// (`store_min_free_bytes = 0`), so that the filesystem itself runs out,
/// in the middle of a write.
pub fn containerd() -> Containerd {
    Containerd::start_with_own_store("4G", "[crabd]\nstore_min_free_bytes = 0\n")
}

/// Fills the filesystem at `fs` with `filler` until about `room` bytes
/// are left.
fn fill(fs: &Path, filler: &Path, room: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let st = nix::sys::statvfs::statvfs(fs).map_err(|e| format!("statvfs {}: {e}", fs.display()))?;
    let free = st.blocks_available() as u64 * st.fragment_size() as u64;
    let file = std::fs::File::create(filler).map_err(|e| format!("create {}: {e}", filler.display()))?;
    // The allocation's own metadata takes blocks too: ask for less until
    // it fits.
    let mut len = free.saturating_sub(room);
    loop {
        let size = i64::try_from(len).map_err(|e| e.to_string())?;
        match nix::fcntl::fallocate(file.as_raw_fd(), nix::fcntl::FallocateFlags::empty(), 0, size) {
            Ok(()) => return Ok(()),
            Err(nix::errno::Errno::ENOSPC) if len > 1 << 20 => len -= 1 << 20,
            Err(e) => return Err(format!("fill {}: {e}", fs.display())),
        }
    }
}

/// A refusal says that room ran out, not something else.
fn refused_for_room(what: &str, out: &std::process::Output) -> Result<(), String> {
    let why = crate::stderr(out);
    let clear = ["No space left on device", "store_full"]
        .iter()
        .any(|s| why.contains(s));
    match clear {
        true => Ok(()),
        false => Err(format!("a {what} on a full disk failed without saying so: {why}")),
    }
}

/// The sandbox's state as the agent sees it; `None` while its servers do
/// not answer.
pub fn observe(pid: i32) -> Option<Observed> {
    try_ask(pid, COUNTER, "peek").ok()?;
    let value = try_ask(pid, STORE, "get k").ok()?;
    Some((value, tree_digest(pid, "/data")))
}

/// Whether `file` reads as a whole tar archive.
fn archive_whole(file: &Path) -> bool {
    std::process::Command::new("tar")
        .arg("tf")
        .arg(file)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The unified cgroup hierarchy's mount point.
fn unified_mount() -> Option<PathBuf> {
    crate::leftovers::mount_points(&["cgroup2"]).into_iter().next()
}
