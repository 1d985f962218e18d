//! The turn-end decision: what a sandbox's turn changed, from what the BPF
//! programs aggregated for its cgroup, then a reset for the next turn.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{drain, shared_writable_maps, Inspector};
use crate::error::{Error, Result};
use crate::kernel::Ctl;
use crate::ledger::Ignore;
use crate::report::{Class, Reason, TurnReport};
use crate::{loader, procs};

// === impl Inspector ===

impl Inspector {
    /// Ends the sandbox's open turn: classifies what it changed, and opens
    /// the next turn (the reset).
    ///
    /// When the inspector cannot vouch for the turn (records lost to a full
    /// ring, full maps, a drain timeout, detached programs, operations it
    /// does not follow, a restart mid-turn) the class is `full` and a
    /// [`Reason::Unsure`] says why.
    ///
    /// # Errors
    /// [`Error::UnknownSandbox`], or a map failure.
    pub fn turn_end(&self, sandbox: &str) -> Result<TurnReport> {
        let config = &self.shared.config;
        let mut guard = self.shared.state.lock();
        let state = &mut *guard;
        let cg = *state.names.get(sandbox).ok_or_else(|| Error::UnknownSandbox {
            sandbox: sandbox.to_owned(),
        })?;
        let map_err = |name| move |source| Error::Map { name, source };
        let mut unsure: Vec<String> = Vec::new();

        // Child cgroups before the boundary and after (below): a task that
        // leaves one in between is counted in it.
        let early = procs::children(&state.sandboxes[&cg].cgroup_dir);
        // The boundary: bump the generation, then read the sequence number.
        let (gen, turn) = {
            let sb = &state.sandboxes[&cg];
            (sb.gen, sb.turn + 1)
        };
        state
            .maps
            .ctl
            .insert(
                cg,
                Ctl {
                    gen: gen + 1,
                    turn,
                    // No capture overlaps a turn end (crabd's busy lock);
                    // one left open by a failure closes here.
                    capturing: 0,
                },
                0,
            )
            .map_err(map_err("crab_ctl"))?;
        let stats = state.maps.stats.get(&cg, 0).map_err(map_err("crab_stats"))?;
        let boundary = stats.seq;
        if let Some(sb) = state.sandboxes.get_mut(&cg) {
            sb.boundary = Some(boundary);
        }

        // Every record numbered before the boundary must be in, or counted
        // as dropped.
        let deadline = Instant::now() + config.drain_timeout;
        let mut lost = 0;
        loop {
            drain(state);
            let sb = &state.sandboxes[&cg];
            let missing = (boundary - sb.base_seq).saturating_sub(sb.current.n_events);
            if missing == 0 {
                break;
            }
            let now = state.maps.stats.get(&cg, 0).unwrap_or(stats);
            if now.n_dropped - sb.base_dropped >= missing {
                lost = missing;
                unsure.push(format!("{missing} records were lost: the ring buffer was full"));
                break;
            }
            if Instant::now() > deadline {
                unsure.push(format!(
                    "{missing} records did not arrive within {:?}",
                    config.drain_timeout
                ));
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        if !loader::links_present(&state.links) || !state.syscalls.attached() {
            unsure.push("the inspector's programs are detached (pins removed)".into());
        }

        let sb = state.sandboxes.get_mut(&cg).expect("looked up above");
        if stats.n_lost > sb.base_lost {
            unsure.push(format!(
                "{} task or syscall entries did not fit in the kernel's maps",
                stats.n_lost - sb.base_lost
            ));
        }
        if sb.restarted {
            unsure.push("the inspector's owner restarted during this turn".into());
        }
        unsure.extend(sb.current.unsure().iter().cloned());
        let _ = sb.base_unsure; // counted through the UNSURE records themselves

        // Processes: started and still alive, or long-lived and running.
        let mut proc_reasons: Vec<Reason> = sb.current.proc_reasons().to_vec();
        let pids = procs::members(&sb.cgroup_dir, "cgroup.procs");
        let noisy = |comm: &str| config.noisy_comms.iter().any(|n| n == comm);
        for &pid in &pids {
            if let Ok(t) = state.maps.tasks.get(&pid, 0) {
                if t.born_gen >= gen {
                    let comm = procs::task_state(pid).map(|s| s.1).unwrap_or_default();
                    proc_reasons.push(Reason::Started { pid, comm });
                }
            }
        }
        for tid in procs::members(&sb.cgroup_dir, "cgroup.threads") {
            let seen = state
                .maps
                .tasks
                .get(&tid, 0)
                .is_ok_and(|t| t.born_gen >= gen || t.active_gen >= gen);
            if seen {
                continue;
            }
            // Running now, or stopped outside any system call (a fault, a
            // stop signal taken in its own code): it ran code of its own
            // since its last call, perhaps in this turn.
            let ran = match procs::task_state(tid) {
                Some(('R', comm)) => Some(comm),
                Some((_, comm)) if procs::outside_call(tid) => Some(comm),
                _ => None,
            };
            if let Some(comm) = ran.filter(|c| !noisy(c)) {
                proc_reasons.push(Reason::Ran { pid: tid, comm });
            }
        }

        if sb.quiet_init {
            proc_reasons
                .retain(|r| !matches!(r, Reason::Ran { pid, .. } if procs::is_namespace_init(*pid, &pids)));
        }

        // The sandbox's mounts are learned from its first process. A
        // restore brings new ones, with new device numbers (an old one's
        // may even be reused for another kind of mount): learn them again
        // when that process's mount namespace is another.
        if let Some(ns) = pids.first().and_then(|&pid| procs::mount_ns(pid)) {
            if sb.mount_ns != Some(ns) {
                sb.ignore = None;
                sb.prints.clear();
                sb.mount_ns = Some(ns);
            }
        }

        // Files: the net change, outside the kernel's interfaces.
        if sb.ignore.is_none() {
            if let Some(&pid) = pids.first() {
                use std::os::unix::fs::MetadataExt;
                let root = std::fs::metadata(format!("/proc/{pid}/root"))
                    .ok()
                    .map(|m| (m.dev(), m.ino()));
                let mounts = crate::mounts::of(pid);
                sb.ignore = Some(Ignore {
                    devs: crate::mounts::interface_devs(&mounts),
                    host_mntns: HashSet::new(),
                    mounts,
                    root,
                });
            }
        }
        let verdict = sb
            .current
            .fs_verdict(sb.ignore.as_ref().unwrap_or(&Ignore::default()));
        let fs = !verdict.changed.is_empty();

        // The tmpfs mounts (process state): paths the records name there,
        // and each tmpfs compared whole, which catches a change spelled
        // through a symlink or `..`. One that cannot be compared counts as
        // changed when a path operation may have landed on it.
        let mut held: Vec<Reason> = verdict
            .held
            .iter()
            .map(|path| Reason::TmpfsChanged { path: path.clone() })
            .collect();
        // Walked only when something may have changed there (a path
        // operation that may have landed anywhere, a change named there) or
        // there is no earlier print; otherwise the last one still holds.
        let look = sb.current.uncertain || !held.is_empty() || sb.prints.is_empty();
        if let (Some(&pid), true) = (pids.first(), look) {
            let mounts = sb
                .ignore
                .as_ref()
                .map(|i| i.mounts.as_slice())
                .unwrap_or_default();
            let now = super::tmpfs_prints(pid, mounts);
            for (point, print) in &now {
                let before = sb.prints.get(point).copied().flatten();
                let differs = match (before, print) {
                    (Some(a), Some(b)) => a != *b,
                    _ => sb.current.uncertain,
                };
                if differs {
                    held.push(Reason::TmpfsChanged {
                        path: String::from_utf8_lossy(point).into_owned(),
                    });
                }
            }
            sb.prints = now;
        }

        // Processes in a child cgroup of the sandbox are not followed: one
        // that holds them now or held them at the last turn end.
        let now = procs::children(&sb.cgroup_dir);
        unsure.extend(procs::child_doubts(&sb.children, &now.0, now.1.as_deref()));
        sb.children = procs::Children::found(&[early, now], sb.current.escaped);

        // A changed file that a live process maps: the old image would not
        // restore against it.
        let mut mapped = Vec::new();
        if fs {
            let written: HashSet<(u64, u64)> = verdict.written.iter().copied().collect();
            for &pid in &pids {
                for m in procs::mappings(pid) {
                    let replaced = m.deleted && sb.deleted_maps.insert((m.dev, m.ino));
                    if replaced || written.contains(&(m.dev, m.ino)) {
                        mapped.push(Reason::MappedFileChanged { pid, path: m.path });
                    }
                }
            }
        }

        // A long-lived process that ran or exited may have stored into a
        // shared writable file mapping, made in this turn or an earlier one.
        let mut touched: HashSet<u32> = sb.current.noisy_ran.clone();
        for r in &proc_reasons {
            if let Reason::Ran { pid, .. } | Reason::Exited { pid, .. } = r {
                touched.insert(*pid);
            }
        }
        let no_ignore = Ignore::default();
        let ignore = sb.ignore.as_ref().unwrap_or(&no_ignore);
        for (pid, dev, name) in &sb.current.shared_mapped {
            if !ignore.devs.contains(dev) && ignore.reachable(*dev) {
                sb.shared_maps.entry(*pid).or_default().push(name.clone());
            }
        }
        let mut shared = Vec::new();
        for pid in &touched {
            if let Some(paths) = sb.shared_maps.get(pid) {
                shared.extend(paths.iter().map(|p| Reason::Changed { path: p.clone() }));
            }
        }
        // What they hold now (gone for the exited ones).
        let now = shared_writable_maps(&touched.iter().copied().collect::<Vec<_>>(), ignore);
        for pid in &touched {
            match now.get(pid) {
                Some(paths) => {
                    shared.extend(paths.iter().map(|p| Reason::Changed { path: p.clone() }));
                    sb.shared_maps.insert(*pid, paths.clone());
                }
                None => {
                    sb.shared_maps.remove(pid);
                }
            }
        }
        shared.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        shared.dedup();
        let fs = fs || !shared.is_empty();
        // A noisy process that ran may have stored into a shared mapping of
        // a tmpfs file (`/dev/shm`): process state (no system call shows
        // it, and its running is no reason by itself).
        let held_devs: HashSet<u64> = ignore
            .mounts
            .iter()
            .filter(|m| m.kind == crate::mounts::MountKind::Held)
            .map(|m| m.dev)
            .collect();
        for &pid in &sb.current.noisy_ran {
            for m in procs::mappings(pid) {
                if m.shared_writable && held_devs.contains(&m.dev) {
                    held.push(Reason::TmpfsChanged { path: m.path });
                }
            }
        }
        let proc = !proc_reasons.is_empty() || !mapped.is_empty() || !held.is_empty();
        let class = if !unsure.is_empty() || !mapped.is_empty() {
            Class::Full
        } else {
            Class::of(fs, proc)
        };
        let reasons: Vec<Reason> = unsure
            .into_iter()
            .map(|why| Reason::Unsure { why })
            .chain(mapped)
            .chain(proc_reasons)
            .chain(held)
            .chain(shared)
            .chain(verdict.changed.into_iter().map(|path| Reason::Changed { path }))
            .collect();
        // Not a warning here: the caller knows whether the turn counts (a
        // restore's reset discards what the restorer did).
        if class == Class::Full && reasons.iter().any(|r| matches!(r, Reason::Unsure { .. })) {
            log::debug!(
                "inspector: sandbox {sandbox} turn {turn} is full: {:?}",
                reasons[0]
            );
        }

        // The reset: the records past the boundary open the next turn.
        sb.current = std::mem::take(&mut sb.next);
        sb.base_seq = boundary;
        sb.boundary = None;
        sb.base_dropped += lost;
        sb.base_lost = stats.n_lost;
        sb.base_unsure = stats.n_unsure;
        sb.restarted = false;
        sb.gen = gen + 1;
        sb.turn = turn;
        let n_reasons = reasons.len();
        let mut reasons = reasons;
        reasons.truncate(config.max_reasons);
        log::debug!("inspector: sandbox {sandbox} turn {turn} class {class} ({n_reasons} reasons)");
        Ok(TurnReport {
            turn,
            class,
            reasons,
            n_reasons,
        })
    }

    /// Says whether a checkpoint of the sandbox runs (`on`) or has ended:
    /// while one runs, a tracer outside the sandbox is its CRIU, and the
    /// calls it makes the sandbox's tasks make are not their running;
    /// otherwise such a tracer makes the turn `full`.
    ///
    /// # Errors
    /// [`Error::UnknownSandbox`], or a map failure.
    pub fn capturing(&self, sandbox: &str, on: bool) -> Result<()> {
        let mut guard = self.shared.state.lock();
        let state = &mut *guard;
        let cg = *state.names.get(sandbox).ok_or_else(|| Error::UnknownSandbox {
            sandbox: sandbox.to_owned(),
        })?;
        let sb = &state.sandboxes[&cg];
        let ctl = Ctl {
            gen: sb.gen,
            turn: sb.turn,
            capturing: u64::from(on),
        };
        state.maps.ctl.insert(cg, ctl, 0).map_err(|source| Error::Map {
            name: "crab_ctl",
            source,
        })
    }

    /// The sandbox's processes were replaced by a restore: its mounts are
    /// new (device numbers, perhaps even the mount namespace's number), so
    /// they are learned again, and its turn starts afresh (what the
    /// restore did is not counted).
    ///
    /// # Errors
    /// As [`Inspector::turn_end`].
    pub fn restored(&self, sandbox: &str) -> Result<()> {
        {
            let mut guard = self.shared.state.lock();
            let state = &mut *guard;
            let cg = *state.names.get(sandbox).ok_or_else(|| Error::UnknownSandbox {
                sandbox: sandbox.to_owned(),
            })?;
            if let Some(sb) = state.sandboxes.get_mut(&cg) {
                sb.ignore = None;
                sb.prints.clear();
                sb.mount_ns = None;
            }
        }
        self.turn_end(sandbox).map(drop)
    }

    /// Forgets the changes a checkpoint's helpers made to the directories
    /// `own` (its output, e.g. CRIU's images and log) and the files in
    /// them: they are not the sandbox's.
    ///
    /// What the checkpoint made the sandbox's tasks do needs no
    /// forgiving: the kernel side never counts a call that a tracer
    /// outside the sandbox (CRIU's parasite) injected, nor a call that
    /// only resumes one a freeze, CRIU's seizure or a restore interrupted
    /// (made from where it was interrupted, with no code of the task's
    /// own run in between). Everything else a task does, before, during
    /// or after the capture, counts.
    ///
    /// # Errors
    /// [`Error::UnknownSandbox`].
    pub fn forget_own_files(&self, sandbox: &str, own: &[std::path::PathBuf]) -> Result<()> {
        use std::os::unix::fs::MetadataExt;
        let mut inodes = HashSet::new();
        for dir in own {
            let Ok(meta) = std::fs::symlink_metadata(dir) else {
                continue;
            };
            inodes.insert((meta.dev(), meta.ino()));
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if let Ok(m) = entry.metadata() {
                    inodes.insert((m.dev(), m.ino()));
                }
            }
        }
        let mut guard = self.shared.state.lock();
        let state = &mut *guard;
        let cg = *state.names.get(sandbox).ok_or_else(|| Error::UnknownSandbox {
            sandbox: sandbox.to_owned(),
        })?;
        drain(state);
        if let Some(sb) = state.sandboxes.get_mut(&cg) {
            sb.current.forget_files(&inodes);
        }
        Ok(())
    }
}
