//! Rust mirrors of the records in `bpf/crab_events.h`, and the kernel's
//! numbering of devices. Sizes are asserted here and in the header.

use std::mem::size_of;

/// Slots of the sandbox prefilter (`CRAB_SLOTS`).
pub(crate) const SLOTS: u64 = 4096;
/// A slot two registered sandboxes share (`CRAB_SLOT_SHARED`).
pub(crate) const SLOT_SHARED: u64 = u64::MAX;

/// Longest name a record carries (bytes, NUL included).
pub(crate) const NAME_LEN: usize = 256;
/// Length of a task's command name (`comm`).
pub(crate) const COMM_LEN: usize = 16;

/// `struct crab_ctl`: per-sandbox control, written by user space only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ctl {
    pub gen: u64,
    pub turn: u64,
    pub capturing: u64,
}

/// `struct crab_stats`: per-sandbox counters, written by the kernel only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stats {
    pub seq: u64,
    pub n_dropped: u64,
    pub n_lost: u64,
    pub n_unsure: u64,
}

/// `struct crab_task`: per-task generations (and the tracked call in
/// flight, which user space does not read).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Task {
    pub born_gen: u64,
    pub active_gen: u64,
    pub cgroup: u64,
    pub gen: u64,
    pub nr: i64,
    pub args: [u64; 6],
    pub compat_gen: u64,
    pub resume_ip: u64,
    pub resume_sp: u64,
    pub resume_nr: i64,
    pub resume_alt: i64,
    pub traced_gen: u64,
}

/// `struct crab_event`: one ring-buffer record.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Event {
    pub cgroup: u64,
    pub seq: u64,
    pub gen: u64,
    pub kind: u32,
    pub op: u32,
    pub pid: u32,
    pub tid: u32,
    pub dev: u64,
    pub ino: u64,
    pub dir_dev: u64,
    pub dir_ino: u64,
    pub dir2_dev: u64,
    pub dir2_ino: u64,
    pub mode: u32,
    pub flags: u32,
    pub mntns: u32,
    pub marks: u32,
    pub comm: [u8; COMM_LEN],
    pub name: [u8; NAME_LEN],
    pub name2: [u8; NAME_LEN],
}

const _: () = assert!(size_of::<Ctl>() == 24);
const _: () = assert!(size_of::<Stats>() == 32);
const _: () = assert!(size_of::<Task>() == 136);
const _: () = assert!(size_of::<Event>() == 632);
const _: () = assert!(std::mem::offset_of!(Event, comm) == 104);
const _: () = assert!(std::mem::offset_of!(Event, name2) == 376);

// SAFETY: repr(C) structs of integers and byte arrays with no padding (the
// sizes above equal the sum of their fields), so every bit pattern is valid.
unsafe impl aya::Pod for Ctl {}
// SAFETY: as for Ctl.
unsafe impl aya::Pod for Stats {}
// SAFETY: as for Ctl.
unsafe impl aya::Pod for Task {}

/// `enum crab_kind`.
pub(crate) mod kind {
    pub const CREATE: u32 = 1;
    pub const TRUNC: u32 = 2;
    pub const WRITE: u32 = 3;
    pub const PATH: u32 = 4;
    pub const ACTIVE: u32 = 5;
    pub const CWD: u32 = 6;
    pub const EXEC: u32 = 7;
    pub const EXIT: u32 = 8;
    pub const UNSURE: u32 = 9;
    pub const IPC: u32 = 10;
}

/// `CRAB_UNSURE_*`: what an UNSURE record is about (its `flags`).
pub(crate) mod unsure {
    pub const COMPAT: u32 = 1;
    pub const PROC_MEM: u32 = 2;
    pub const CGROUP: u32 = 3;
    pub const TRACED: u32 = 4;
}

/// `CRAB_MARK_*`: a record's `marks`.
pub(crate) mod marks {
    /// `name` is only a prefix (or was unreadable).
    pub const NAME_CUT: u32 = 1;
    /// `name2` is only a prefix (or was unreadable).
    pub const NAME2_CUT: u32 = 2;
    /// A CREATE's `name` spells the path to the file, no symlink followed.
    pub const SPELLED: u32 = 4;
}

/// x86_64 `mmap`: a WRITE record with this `op` is a shared writable mapping.
pub(crate) const NR_MMAP: u32 = 9;

/// `enum crab_op`.
pub(crate) mod op {
    pub const UNLINK: u32 = 1;
    pub const RMDIR: u32 = 2;
    pub const RENAME: u32 = 3;
    pub const EXCHANGE: u32 = 4;
    pub const MKDIR: u32 = 5;
    pub const MKNOD: u32 = 6;
    pub const LINK: u32 = 7;
    pub const SYMLINK: u32 = 8;
    pub const ATTR: u32 = 9;
    pub const TRUNCATE: u32 = 10;
    pub const RENAME_NOREPLACE: u32 = 11;
}

impl Event {
    /// Reads a record from ring-buffer bytes; `None` if too short.
    pub(crate) fn parse(bytes: &[u8]) -> Option<Event> {
        if bytes.len() < size_of::<Event>() {
            return None;
        }
        // SAFETY: the slice holds at least size_of::<Event>() bytes, Event is
        // repr(C) plain data for which every bit pattern is valid, and
        // read_unaligned has no alignment requirement.
        Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<Event>()) })
    }

    /// The command name of the task that caused the record.
    pub(crate) fn comm(&self) -> String {
        c_str(&self.comm)
    }
}

/// A NUL-terminated byte buffer's bytes.
pub(crate) fn c_bytes(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    &bytes[..end]
}

/// A NUL-terminated byte buffer as text.
pub(crate) fn c_str(bytes: &[u8]) -> String {
    String::from_utf8_lossy(c_bytes(bytes)).into_owned()
}

/// The user-space `st_dev` of a kernel `dev_t` (`MKDEV(major, minor)` is
/// `major << 20 | minor` inside the kernel).
pub(crate) fn user_dev(kernel_dev: u64) -> u64 {
    libc::makedev((kernel_dev >> 20) as u32, (kernel_dev & 0xf_ffff) as u32)
}

/// A command name as the kernel stores it: NUL-padded to 16 bytes, at most
/// 15 significant.
pub(crate) fn comm_key(comm: &str) -> [u8; COMM_LEN] {
    let mut key = [0u8; COMM_LEN];
    let n = comm.len().min(COMM_LEN - 1);
    key[..n].copy_from_slice(&comm.as_bytes()[..n]);
    key
}
