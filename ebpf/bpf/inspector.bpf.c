// SPDX-License-Identifier: (Apache-2.0 OR GPL-2.0)
/*
 * The inspector's kernel side: tracepoints only (raw_syscalls, sched,
 * cgroup), filtered first by the current task's unified cgroup id, so a task
 * outside every registered sandbox costs one helper call and one hash lookup
 * per syscall entry and exit.
 *
 * Per sandbox the programs keep monotonic counters (crab_stats) and stream
 * path-bearing records on one ring buffer (crab_events), each with a
 * per-sandbox sequence number, so user space can tell it has every record up
 * to a turn boundary, and how many the ring had no room for. Per inode they
 * deduplicate writes within a turn (crab_inodes), so a turn of a million
 * writes to one file streams one record.
 *
 * A turn is a generation number in crab_ctl that user space bumps at each
 * turn end; a task is long-lived when it entered the sandbox in an earlier
 * generation (or before the sandbox was registered).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "crab_events.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AT_FDCWD -100
#define AT_REMOVEDIR 0x200
#define O_ACCMODE 3
#define O_CREAT 0100
#define O_TRUNC 01000
#define FMODE_CREATED 0x100000
#define MAP_SHARED 0x01
#define PROT_WRITE 0x2
#define RENAME_NOREPLACE 1
#define RENAME_EXCHANGE 2
#define S_IFMT 0170000
#define S_IFREG 0100000
#define S_IFDIR 0040000
#define S_IFLNK 0120000
#define TS_COMPAT 0x0002		/* thread_info.status: a 32-bit call is running */
#define X32_SYSCALL_BIT 0x40000000
#define FICLONE 0x40049409
#define FICLONERANGE 0x4020940d
#define FS_IOC_SETFLAGS 0x40086602
#define FS_IOC_FSSETXATTR 0x401c5820
#define FS_IOC_ENABLE_VERITY 0x40806685
#define FMODE_WRITE 0x2
#define AF_UNIX 1
#define ERESTARTSYS 512		/* .. ERESTART_RESTARTBLOCK: the kernel's own */
#define ERESTART_RESTARTBLOCK 516
#define SIG_IGN 1
#define SYSCALL_INSN_LEN 2	/* x86_64 `syscall` */
#define USER_CS 0x33		/* the 64-bit user code segment */
#define CGROUP_LEVELS_MASK 0xfff	/* cgroup levels an ancestor is read at (deeper: never CRIU) */

/* x86_64 syscall numbers of the calls the inspector follows. */
#define NR_write 1
#define NR_open 2
#define NR_mmap 9
#define NR_ioctl 16
#define NR_pwrite64 18
#define NR_writev 20
#define NR_shmget 29
#define NR_shmat 30
#define NR_shmctl 31
#define NR_sendfile 40
#define NR_bind 49
#define NR_semget 64
#define NR_semop 65
#define NR_semctl 66
#define NR_msgget 68
#define NR_msgsnd 69
#define NR_msgrcv 70
#define NR_msgctl 71
#define NR_truncate 76
#define NR_ftruncate 77
#define NR_chdir 80
#define NR_fchdir 81
#define NR_rename 82
#define NR_mkdir 83
#define NR_rmdir 84
#define NR_creat 85
#define NR_link 86
#define NR_unlink 87
#define NR_symlink 88
#define NR_chmod 90
#define NR_fchmod 91
#define NR_chown 92
#define NR_fchown 93
#define NR_lchown 94
#define NR_ptrace 101
#define NR_utime 132
#define NR_mknod 133
#define NR_io_submit 209
#define NR_semtimedop 220
#define NR_mq_open 240
#define NR_mq_unlink 241
#define NR_mq_timedsend 242
#define NR_mq_timedreceive 243
#define NR_setxattr 188
#define NR_lsetxattr 189
#define NR_fsetxattr 190
#define NR_removexattr 197
#define NR_lremovexattr 198
#define NR_fremovexattr 199
#define NR_utimes 235
#define NR_openat 257
#define NR_mkdirat 258
#define NR_mknodat 259
#define NR_fchownat 260
#define NR_futimesat 261
#define NR_unlinkat 263
#define NR_renameat 264
#define NR_linkat 265
#define NR_symlinkat 266
#define NR_fchmodat 268
#define NR_splice 275
#define NR_utimensat 280
#define NR_fallocate 285
#define NR_pwritev 296
#define NR_process_vm_writev 311
#define NR_renameat2 316
#define NR_copy_file_range 326
#define NR_pwritev2 328
#define NR_io_uring_setup 425
#define NR_io_uring_enter 426
#define NR_io_uring_register 427
#define NR_rt_sigreturn 15
#define NR_restart_syscall 219
#define NR_openat2 437
#define NR_fchmodat2 452
#define NR_file_setattr 469
#define NR_setxattrat 463
#define NR_removexattrat 466

/* Filesystem magics whose objects are not sandbox state. */
#define PROC_SUPER_MAGIC 0x9fa0
#define SYSFS_MAGIC 0x62656572
#define DEVPTS_SUPER_MAGIC 0x1cd1
#define CGROUP_SUPER_MAGIC 0x27e0eb
#define CGROUP2_SUPER_MAGIC 0x63677270
#define DEBUGFS_MAGIC 0x64626720
#define TRACEFS_MAGIC 0x74726163
#define BPF_FS_MAGIC 0xcafe4a11
#define SECURITYFS_MAGIC 0x73636673
#define PIPEFS_MAGIC 0x50495045
#define SOCKFS_MAGIC 0x534F434B
#define ANON_INODE_FS_MAGIC 0x09041934
#define NSFS_MAGIC 0x6e736673
#define MQUEUE_MAGIC 0x19800202

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct crab_ctl);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_ctl SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct crab_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct crab_task);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_tasks SEC(".maps");

/* LRU: an evicted entry only costs a duplicate record (or a born inode
 * looking pre-existing, i.e. a false positive), never a missed change. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct crab_inode_key);
	__type(value, struct crab_inode_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_inodes SEC(".maps");

/* The prefilter of sys_enter: an array lookup (inlined by the verifier)
 * that tells most tasks outside every sandbox from the ones inside. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CRAB_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_slots SEC(".maps");

/* Host-wide counts that let sys_exit return at once for every task while
 * both are 0: followed calls in flight, and tasks holding a resume mark. */
struct crab_counts {
	__u64 inflight;
	__u64 marks;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct crab_counts);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_inflight SEC(".maps");

static __always_inline struct crab_counts *counts(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&crab_inflight, &zero);
}

static __always_inline void inflight_begin(void)
{
	struct crab_counts *c = counts();
	if (c)
		__sync_fetch_and_add(&c->inflight, 1);
}

static __always_inline void inflight_done(void)
{
	struct crab_counts *c = counts();
	if (c)
		__sync_fetch_and_add(&c->inflight, -1);
}

/* Takes task t's resume mark away, keeping the count of marks true. */
static __always_inline void clear_mark(struct crab_task *t)
{
	if (!t->resume_ip)
		return;
	t->resume_ip = 0;
	struct crab_counts *c = counts();
	if (c)
		__sync_fetch_and_add(&c->marks, -1);
}

/* Commands (task comm) whose own running is not a process change. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, char[CRAB_COMM_LEN]);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_noisy SEC(".maps");

/* Room for comparing a spelled path with the dentries it names. */
struct crab_scratch {
	char name[CRAB_NAME_LEN];
	char dname[CRAB_NAME_LEN];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct crab_scratch);
} crab_scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 << 20);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} crab_events SEC(".maps");

/* cgroup:cgroup_attach_task, laid out by its tracefs format. */
struct cgroup_attach_args {
	__u64 common;
	int dst_root;
	int dst_level;
	__u64 dst_id;
	int pid;
};

/* The sandbox the current task is in, or NULL. */
static __always_inline struct crab_ctl *current_sandbox(__u64 *cg)
{
	*cg = bpf_get_current_cgroup_id();
	return bpf_map_lookup_elem(&crab_ctl, cg);
}

static __always_inline void count(__u64 cg, int which)
{
	struct crab_stats *st = bpf_map_lookup_elem(&crab_stats, &cg);
	if (!st)
		return;
	if (which == 0)
		__sync_fetch_and_add(&st->n_lost, 1);
	else
		__sync_fetch_and_add(&st->n_unsure, 1);
}

/* Reserves a record with the sandbox's next sequence number; counts a drop
 * when the ring is full. */
static __always_inline struct crab_event *reserve(__u64 cg, __u64 gen, __u32 kind)
{
	struct crab_stats *st = bpf_map_lookup_elem(&crab_stats, &cg);
	if (!st)
		return NULL;
	__u64 seq = __sync_fetch_and_add(&st->seq, 1);
	struct crab_event *e = bpf_ringbuf_reserve(&crab_events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&st->n_dropped, 1);
		return NULL;
	}
	__u64 pt = bpf_get_current_pid_tgid();
	e->cgroup = cg;
	e->seq = seq;
	e->gen = gen;
	e->kind = kind;
	e->op = 0;
	e->pid = pt >> 32;
	e->tid = (__u32)pt;
	e->dev = 0;
	e->ino = 0;
	e->dir_dev = 0;
	e->dir_ino = 0;
	e->dir2_dev = 0;
	e->dir2_ino = 0;
	e->mode = 0;
	e->flags = 0;
	e->marks = 0;
	struct task_struct *task = (void *)bpf_get_current_task();
	e->mntns = BPF_CORE_READ(task, nsproxy, mnt_ns, ns.inum);
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	e->name[0] = 0;
	e->name2[0] = 0;
	return e;
}

/* Commits a record. The reader is woken only once the ring is a quarter
 * full: it polls on a timer otherwise, and a wakeup per record would cost
 * every file a context switch. */
static __always_inline void submit(struct crab_event *e)
{
	__u64 avail = bpf_ringbuf_query(&crab_events, BPF_RB_AVAIL_DATA);
	__u64 size = bpf_ringbuf_query(&crab_events, BPF_RB_RING_SIZE);
	bpf_ringbuf_submit(e, avail > size / 4 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

/* Counts and reports something the inspector cannot follow: op (a call
 * number, a pid), what it is about (CRAB_UNSURE_*). */
static __always_inline void unsure(__u64 cg, __u64 gen, __u32 op, __u32 about)
{
	count(cg, 1);
	struct crab_event *e = reserve(cg, gen, CRAB_EV_UNSURE);
	if (e) {
		e->op = op;
		e->flags = about;
		submit(e);
	}
}

/* The file behind descriptor fd of the current task. The task and its
 * descriptor table are read with direct (BTF) loads, not helper calls:
 * this runs for every write in a sandbox. */
static __always_inline struct file *fd_file(long fd)
{
	if (fd < 0)
		return NULL;
	struct task_struct *t = bpf_get_current_task_btf();
	struct files_struct *files = t->files;
	if (!files)
		return NULL;
	struct fdtable *fdt = files->fdt;
	if (!fdt)
		return NULL;
	if ((unsigned long)fd >= fdt->max_fds)
		return NULL;
	struct file **fds = fdt->fd;
	struct file *f = NULL;
	bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]);
	return f;
}

/* Whether an inode can hold sandbox filesystem state: a regular file,
 * directory or symlink on a filesystem that is not a kernel interface. */
static __always_inline int state_bearing_as(struct inode *inode, __u32 *mode_out, int meta)
{
	__u32 mode = BPF_CORE_READ(inode, i_mode);
	__u32 fmt = mode & S_IFMT;
	*mode_out = mode;
	/* A fifo's, socket's or device node's data is no file state, but its
	 * mode, owner, times and attributes are. */
	if (!meta && fmt != S_IFREG && fmt != S_IFDIR && fmt != S_IFLNK)
		return 0;
	unsigned long magic = BPF_CORE_READ(inode, i_sb, s_magic);
	switch (magic) {
	case PROC_SUPER_MAGIC:
	case SYSFS_MAGIC:
	case DEVPTS_SUPER_MAGIC:
	case CGROUP_SUPER_MAGIC:
	case CGROUP2_SUPER_MAGIC:
	case DEBUGFS_MAGIC:
	case TRACEFS_MAGIC:
	case BPF_FS_MAGIC:
	case SECURITYFS_MAGIC:
	case PIPEFS_MAGIC:
	case SOCKFS_MAGIC:
	case ANON_INODE_FS_MAGIC:
	case NSFS_MAGIC:
	case MQUEUE_MAGIC:
		return 0;
	}
	return 1;
}

static __always_inline int state_bearing(struct inode *inode, __u32 *mode_out)
{
	return state_bearing_as(inode, mode_out, 0);
}

/* Whether call nr changes an inode's metadata, not its data. */
static __always_inline int meta_call(long nr)
{
	switch (nr) {
	case NR_fchmod:
	case NR_fchown:
	case NR_fsetxattr:
	case NR_fremovexattr:
	case NR_ioctl:
	case -1: /* an attribute call with an empty path, through its dirfd */
		return 1;
	}
	return 0;
}

/* Whether f is a /proc/<pid>/mem (or a task's): a write to it stores into
 * another process's memory, which no record of the inspector describes. */
static __always_inline int proc_mem(struct inode *inode, __u32 mode, struct file *f)
{
	/* Only a regular file can be: a pipe's, a terminal's or /dev/null's
	 * write costs no further read. */
	if ((mode & S_IFMT) != S_IFREG || BPF_CORE_READ(inode, i_sb, s_magic) != PROC_SUPER_MAGIC)
		return 0;
	char n[4] = {};
	bpf_probe_read_kernel_str(n, sizeof(n), BPF_CORE_READ(f, f_path.dentry, d_name.name));
	return n[0] == 'm' && n[1] == 'e' && n[2] == 'm' && n[3] == 0;
}

/* Reads a name from the caller's memory into buf (CRAB_NAME_LEN bytes):
 * whether it may not be whole (too long, or unreadable at the call's exit). */
static __always_inline int read_user_name(char *buf, unsigned long name)
{
	long n = bpf_probe_read_user_str(buf, CRAB_NAME_LEN, (void *)name);
	return n <= 0 || n >= CRAB_NAME_LEN;
}

static __always_inline void inode_id(struct inode *inode, __u64 *dev, __u64 *ino)
{
	*ino = BPF_CORE_READ(inode, i_ino);
	*dev = BPF_CORE_READ(inode, i_sb, s_dev);
}

/* The directory a name is resolved from: the root for an absolute name, the
 * working directory for AT_FDCWD, else the directory behind dirfd. */
static __always_inline void base_dir(struct task_struct *t, long dirfd, char first,
				     __u64 *dev, __u64 *ino)
{
	struct inode *inode = NULL;
	if (first == '/') {
		inode = BPF_CORE_READ(t, fs, root.dentry, d_inode);
	} else if ((int)dirfd == AT_FDCWD) {
		inode = BPF_CORE_READ(t, fs, pwd.dentry, d_inode);
	} else {
		struct file *f = fd_file(dirfd);
		if (f)
			inode = BPF_CORE_READ(f, f_inode);
	}
	if (inode)
		inode_id(inode, dev, ino);
}

static __always_inline int is_born(struct crab_task *t, __u64 gen)
{
	return t && t->born_gen == gen;
}

/* The task's entry, created on its first syscall in the sandbox. A thread
 * without an entry takes its leader's birth; a task with neither entered
 * before registration (long-lived). */
static __always_inline struct crab_task *task_entry(__u64 cg, __u64 pt)
{
	__u32 tid = (__u32)pt;
	struct crab_task *t = bpf_map_lookup_elem(&crab_tasks, &tid);
	if (t)
		return t;
	__u32 tgid = pt >> 32;
	struct crab_task fresh = { .nr = -1 };
	struct crab_task *leader = bpf_map_lookup_elem(&crab_tasks, &tgid);
	if (leader)
		fresh.born_gen = leader->born_gen;
	if (bpf_map_update_elem(&crab_tasks, &tid, &fresh, BPF_NOEXIST)) {
		count(cg, 0);
		return NULL;
	}
	return bpf_map_lookup_elem(&crab_tasks, &tid);
}

static __always_inline int current_is_noisy(void)
{
	char comm[CRAB_COMM_LEN] = {};
	bpf_get_current_comm(comm, sizeof(comm));
	return bpf_map_lookup_elem(&crab_noisy, comm) != NULL;
}

/* Whether nr is a System V or POSIX IPC call (process state). */
static __always_inline int ipc_call(long nr)
{
	switch (nr) {
	case NR_shmget:
	case NR_shmat:
	case NR_shmctl:
	case NR_semget:
	case NR_semop:
	case NR_semtimedop:
	case NR_semctl:
	case NR_msgget:
	case NR_msgsnd:
	case NR_msgrcv:
	case NR_msgctl:
	case NR_mq_open:
	case NR_mq_unlink:
	case NR_mq_timedsend:
	case NR_mq_timedreceive:
		return 1;
	}
	return 0;
}

/* Whether sys_enter looks at this call at all (before reading its
 * arguments, which costs a probe read each). */
static __always_inline int tracked_nr(long nr)
{
	switch (nr) {
	case NR_open:
	case NR_openat:
	case NR_openat2:
	case NR_mmap:
	case NR_creat:
	case NR_write:
	case NR_pwrite64:
	case NR_writev:
	case NR_pwritev:
	case NR_pwritev2:
	case NR_sendfile:
	case NR_splice:
	case NR_copy_file_range:
	case NR_ftruncate:
	case NR_fallocate:
	case NR_fchmod:
	case NR_fchown:
	case NR_fsetxattr:
	case NR_fremovexattr:
	case NR_truncate:
	case NR_chdir:
	case NR_fchdir:
	case NR_rename:
	case NR_renameat:
	case NR_renameat2:
	case NR_mkdir:
	case NR_mkdirat:
	case NR_rmdir:
	case NR_unlink:
	case NR_unlinkat:
	case NR_link:
	case NR_linkat:
	case NR_symlink:
	case NR_symlinkat:
	case NR_mknod:
	case NR_mknodat:
	case NR_chmod:
	case NR_fchmodat:
	case NR_fchmodat2:
	case NR_chown:
	case NR_lchown:
	case NR_fchownat:
	case NR_utime:
	case NR_utimes:
	case NR_futimesat:
	case NR_utimensat:
	case NR_setxattr:
	case NR_lsetxattr:
	case NR_removexattr:
	case NR_lremovexattr:
	case NR_setxattrat:
	case NR_removexattrat:
	case NR_ptrace:
	case NR_process_vm_writev:
	case NR_io_uring_setup:
	case NR_io_uring_enter:
	case NR_io_uring_register:
	case NR_io_submit:
	case NR_ioctl:
	case NR_bind:
	case NR_file_setattr:
		return 1;
	}
	return ipc_call(nr);
}

/* The ioctls that change the file behind the descriptor: a reflink into
 * it, its inode flags (chattr), its fs attributes, fs-verity. (Neither
 * FIDEDUPERANGE, which shares extents of equal content, nor a terminal's.) */
static __always_inline int clone_ioctl(unsigned long cmd)
{
	switch ((unsigned int)cmd) {
	case FICLONE:
	case FICLONERANGE:
	case FS_IOC_SETFLAGS:
	case FS_IOC_FSSETXATTR:
	case FS_IOC_ENABLE_VERITY:
		return 1;
	}
	return 0;
}

/* Whether descriptor fd of the current task is open for writing (a shared
 * mapping of it can be made writable later with mprotect). */
static __always_inline int fd_writable(long fd)
{
	struct file *f = fd_file(fd);
	return f && (BPF_CORE_READ(f, f_mode) & FMODE_WRITE);
}

static __always_inline int tracked(long nr, unsigned long *args)
{
	if (!tracked_nr(nr))
		return 0;
	/* Of the tracked calls, opens and mmaps change state only with these
	 * flags; every other tracked call does. */
	switch (nr) {
	case NR_open:
		return (args[1] & (O_CREAT | O_TRUNC)) != 0;
	case NR_openat:
		return (args[2] & (O_CREAT | O_TRUNC)) != 0;
	case NR_openat2: {
		__u64 flags = 0;
		bpf_probe_read_user(&flags, sizeof(flags), (void *)args[2]);
		return (flags & (O_CREAT | O_TRUNC)) != 0;
	}
	case NR_mmap:
		/* Writable now, or later through mprotect (which needs a
		 * descriptor open for writing). */
		return (args[3] & MAP_SHARED) && (long)args[4] >= 0 &&
		       ((args[2] & PROT_WRITE) || fd_writable(args[4]));
	case NR_ioctl:
		return clone_ioctl(args[1]);
	case NR_mq_open:
		return (args[1] & O_CREAT) != 0;
	}
	return 1;
}

/* Which argument holds the descriptor a content or metadata change goes
 * through (0, 2 or 4), or -1 for other calls. */
static __always_inline int fd_change_idx(long nr)
{
	switch (nr) {
	case NR_write:
	case NR_pwrite64:
	case NR_writev:
	case NR_pwritev:
	case NR_pwritev2:
	case NR_sendfile:
	case NR_ftruncate:
	case NR_fallocate:
	case NR_fchmod:
	case NR_fchown:
	case NR_fsetxattr:
	case NR_fremovexattr:
	case NR_ioctl:
		return 0;
	case NR_splice:
	case NR_copy_file_range:
		return 2;
	case NR_mmap:
		return 4;
	}
	return -1;
}

/* Whether a change through fd may need a record: the object holds
 * filesystem state and was neither born nor reported this turn. Checked at
 * entry so that writes to pipes, terminals, /dev/null and files already
 * reported cost no stash and no exit work. */
static __always_inline int fd_change_worth(__u64 cg, __u64 gen, long fd, long nr)
{
	struct file *f = fd_file(fd);
	if (!f)
		return 1; /* let the exit decide */
	struct inode *inode = BPF_CORE_READ(f, f_inode);
	__u32 mode;
	if (!inode)
		return 0;
	if (!state_bearing_as(inode, &mode, meta_call(nr)))
		return proc_mem(inode, mode, f);
	struct crab_inode_key key = { .cgroup = cg };
	inode_id(inode, &key.dev, &key.ino);
	struct crab_inode_state *st = bpf_map_lookup_elem(&crab_inodes, &key);
	return !(st && st->gen == gen);
}

/* Raw tracepoints: no perf record is built for the call, which makes the
 * host-wide cost of a filtered-out syscall one helper call and one lookup. */
#define TRACER_NONE 0    /* not traced, or by a task of the sandbox's cgroup */
#define TRACER_OUTSIDE 1 /* by a task outside the sandbox: CRIU during a capture */
#define TRACER_BELOW 2   /* by a task in a cgroup below the sandbox's: never CRIU */

/* A cgroup's ancestors (itself at its own level): pointers since Linux
 * 6.0, ids before (CO-RE flavours, matched by name, so that either
 * kernel's vmlinux.h builds). */
struct cgroup___ancestors {
	struct cgroup *ancestors[0];
} __attribute__((preserve_access_index));
struct cgroup___ancestor_ids {
	__u64 ancestor_ids[0];
} __attribute__((preserve_access_index));

/* The id of cgroup c's ancestor at `level` (c itself at its own level); 0
 * when unreadable. */
static __always_inline __u64 ancestor_id(struct cgroup *c, int level)
{
	__u64 at = (__u64)(level & CGROUP_LEVELS_MASK) * sizeof(__u64);
	struct cgroup___ancestors *now = (void *)c;
	if (bpf_core_field_exists(now->ancestors)) {
		struct cgroup *a = NULL;
		bpf_probe_read_kernel(&a, sizeof(a), (void *)c + bpf_core_field_offset(now->ancestors) + at);
		return a ? BPF_CORE_READ(a, kn, id) : 0;
	}
	struct cgroup___ancestor_ids *old = (void *)c;
	__u64 id = 0;
	bpf_probe_read_kernel(&id, sizeof(id), (void *)c + bpf_core_field_offset(old->ancestor_ids) + at);
	return id;
}

/* Where the task's tracer is. A tracer in the sandbox's own cgroup is its
 * own running, followed call by call; one below it is not followed (the
 * programs match the sandbox's cgroup only) and may write the task's
 * memory, so it counts as a stranger that is never CRIU. Below means: the
 * tracer's cgroup is deeper than the sandbox's (the task's own) and its
 * ancestor at the sandbox's level is the sandbox, however deep either is. */
static __always_inline int tracer_place(struct task_struct *task, __u64 cg)
{
	if (!task->ptrace)
		return TRACER_NONE;
	struct cgroup *c = BPF_CORE_READ(task, parent, cgroups, dfl_cgrp);
	struct cgroup *own = BPF_CORE_READ(task, cgroups, dfl_cgrp);
	if (!c || !own)
		return TRACER_OUTSIDE;
	int level = BPF_CORE_READ(own, level);
	int tracer_level = BPF_CORE_READ(c, level);
	if (tracer_level < level)
		return TRACER_OUTSIDE;
	if (tracer_level == level)
		return BPF_CORE_READ(c, kn, id) == cg ? TRACER_NONE : TRACER_OUTSIDE;
	if (level > CGROUP_LEVELS_MASK)
		return TRACER_BELOW; /* unreadable: it may be below, so never CRIU */
	return ancestor_id(c, level) == cg ? TRACER_BELOW : TRACER_OUTSIDE;
}

/* Whether the current call is one a checkpoint made the task make: CRIU's
 * parasite, while crabd says a capture runs (ctl->capturing) and a tracer
 * outside the sandbox has the task. */
static __always_inline int injected(struct task_struct *task, __u64 cg, struct crab_ctl *ctl)
{
	return ctl->capturing && tracer_place(task, cg) == TRACER_OUTSIDE;
}

/* task_struct's rseq area: a pointer until Linux 6.18, `rseq.usrptr`
 * since the rseq rework (CO-RE flavours, matched by name). */
struct task_struct___rseq_ptr {
	void *rseq;
} __attribute__((preserve_access_index));
struct rseq_data___crab {
	void *usrptr;
} __attribute__((preserve_access_index));
struct task_struct___rseq_data {
	struct rseq_data___crab rseq;
} __attribute__((preserve_access_index));

/* Whether the task may be inside an rseq critical section (its registered
 * `struct rseq` names one): on the way back to user space the kernel may
 * move it to the section's abort handler, whose code runs before any
 * resumption. Unknown (no rseq in this kernel's layout, unreadable): yes. */
static __always_inline int in_rseq_section(struct task_struct *task)
{
	void *area;
	if (bpf_core_field_exists(((struct task_struct___rseq_ptr *)task)->rseq))
		area = BPF_CORE_READ((struct task_struct___rseq_ptr *)task, rseq);
	else if (bpf_core_field_exists(((struct task_struct___rseq_data *)task)->rseq))
		area = BPF_CORE_READ((struct task_struct___rseq_data *)task, rseq.usrptr);
	else
		return 1;
	if (!area)
		return 0;
	__u64 cs = 0;
	/* struct rseq { u32 cpu_id_start; u32 cpu_id; u64 rseq_cs; ... } */
	if (bpf_probe_read_user(&cs, sizeof(cs), area + 8))
		return 1;
	return cs != 0;
}

/* Whether the two bytes before `after` in the task's memory are a `syscall`
 * instruction. */
static __always_inline int syscall_insn_before(__u64 after)
{
	__u8 insn[SYSCALL_INSN_LEN] = {};
	return !bpf_probe_read_user(insn, sizeof(insn), (void *)(after - SYSCALL_INSN_LEN)) &&
	       insn[0] == 0x0f && insn[1] == 0x05;
}

/* The current task t ran code of its own in turn gen: reported once a
 * turn, unless it was born in it (then its process is new). Noisy tasks
 * are reported too, marked: their running is no process change, but it
 * may store into a shared file mapping. */
static __always_inline void ran(__u64 cg, __u64 gen, struct crab_task *t)
{
	if (t->active_gen == gen)
		return;
	t->active_gen = gen;
	if (t->born_gen == gen)
		return;
	struct crab_event *e = reserve(cg, gen, CRAB_EV_ACTIVE);
	if (e) {
		e->op = current_is_noisy();
		submit(e);
	}
}

/* Whether the current call resumes one the task was interrupted in (or a
 * sigreturn left it at) without running code of its own in between: made
 * from the very ip and stack that the mark recorded, with its number. The
 * mark goes with the task's first own call, whatever it is. */
static __always_inline int resumes(struct crab_task *t, struct pt_regs *regs, long nr)
{
	if (!t->resume_ip)
		return 0;
	int same = BPF_CORE_READ(regs, ip) == t->resume_ip &&
		   BPF_CORE_READ(regs, sp) == t->resume_sp &&
		   (nr == t->resume_nr || (t->resume_alt >= 0 && nr == t->resume_alt)) &&
		   syscall_insn_before(t->resume_ip);
	clear_mark(t);
	return same;
}

/* Marks where the current task resumes a call without running code of its
 * own (see struct crab_task): the call made from `ip` (just past a
 * `syscall` instruction, in the 64-bit code segment `cs`), on stack sp,
 * with call nr. A call a checkpoint made it make (CRIU's parasite,
 * interrupted in turn) does not replace the mark of the task's own call;
 * a tracer outside the sandbox while no checkpoint runs may run the
 * task's code before it resumes: no mark, and the turn is full. */
static __noinline void mark_resume(__u64 ip, __u64 sp, long nr, long alt, __u64 cs)
{
	__u64 cg;
	struct crab_ctl *ctl = current_sandbox(&cg);
	if (!ctl)
		return;
	__u64 pt = bpf_get_current_pid_tgid();
	/* A task asleep since before its sandbox was registered has no entry
	 * yet. */
	struct crab_task *t = task_entry(cg, pt);
	if (!t)
		return;
	struct task_struct *task = bpf_get_current_task_btf();
	int tracer = tracer_place(task, cg);
	if (tracer != TRACER_NONE) {
		if (!ctl->capturing || tracer == TRACER_BELOW) {
			clear_mark(t);
			if (t->traced_gen != ctl->gen) {
				t->traced_gen = ctl->gen;
				unsure(cg, ctl->gen, (__u32)pt, CRAB_UNSURE_TRACED);
			}
			return;
		}
		if (t->resume_ip)
			return;
	}
	if (cs != USER_CS || in_rseq_section(task) || !syscall_insn_before(ip)) {
		clear_mark(t);
		return;
	}
	if (!t->resume_ip) {
		struct crab_counts *c = counts();
		if (c)
			__sync_fetch_and_add(&c->marks, 1);
	}
	t->resume_ip = ip;
	t->resume_sp = sp;
	t->resume_nr = nr;
	t->resume_alt = ctl->capturing ? alt : -1;
}

SEC("raw_tracepoint/sys_enter")
int crab_sys_enter(struct bpf_raw_tracepoint_args *ctx)
{
	__u64 cg = bpf_get_current_cgroup_id();
	__u32 slot = cg & (CRAB_SLOTS - 1);
	__u64 *owner = bpf_map_lookup_elem(&crab_slots, &slot);
	if (!owner || (*owner != cg && *owner != CRAB_SLOT_SHARED))
		return 0;
	struct crab_ctl *ctl = bpf_map_lookup_elem(&crab_ctl, &cg);
	if (!ctl)
		return 0;
	__u64 gen = ctl->gen;
	__u64 pt = bpf_get_current_pid_tgid();
	struct crab_task *t = task_entry(cg, pt);
	if (!t)
		return 0;
	/* Plain loads: a CO-RE relocation cannot describe the flexible args[]. */
	__u64 *raw = (__u64 *)ctx;
	long nr = raw[1];
	struct pt_regs *regs = (struct pt_regs *)raw[0];
	/* The task is read with a direct (BTF) load: this runs for every call
	 * in a sandbox. */
	struct task_struct *task = bpf_get_current_task_btf();
	int own = 1;
	int tracer = tracer_place(task, cg);
	if (tracer != TRACER_NONE) {
		if (ctl->capturing && tracer == TRACER_OUTSIDE) {
			own = 0; /* CRIU's parasite */
		} else if (t->traced_gen != gen) {
			/* Someone else's tracer may run the task's code (gdb's
			 * `call`) or hide its calls: not followed. */
			t->traced_gen = gen;
			unsure(cg, gen, (__u32)pt, CRAB_UNSURE_TRACED);
		}
	}
	if (own && !resumes(t, regs, nr))
		ran(cg, gen, t);
	if (t->nr >= 0)
		inflight_done(); /* an exit that never came: keep the count true */
	t->nr = -1;
	/* A 32-bit call (int 0x80, or the x32 ABI) numbers its calls another
	 * way: the inspector follows none of them, once a turn per task. */
	if ((nr & X32_SYSCALL_BIT) || (task->thread_info.status & TS_COMPAT)) {
		if (t->compat_gen != gen) {
			t->compat_gen = gen;
			unsure(cg, gen, nr, CRAB_UNSURE_COMPAT);
		}
		return 0;
	}
	if (nr == NR_rt_sigreturn) {
		/* Followed to its exit: where it resumes the task. */
		t->cgroup = cg;
		t->nr = nr;
		inflight_begin();
		return 0;
	}
	if (!tracked_nr(nr))
		return 0;
	if (nr == NR_ioctl && !clone_ioctl(BPF_CORE_READ(regs, si)))
		return 0; /* a terminal's or a device's: the common case */
	unsigned long args[6];
	/* A change through a descriptor: look at the descriptor first, and read
	 * the other arguments only when the call may need a record. */
	int fd_idx = fd_change_idx(nr);
	if (fd_idx >= 0) {
		long fd = fd_idx == 0 ? BPF_CORE_READ(regs, di)
			: fd_idx == 2 ? BPF_CORE_READ(regs, dx) : BPF_CORE_READ(regs, r8);
		if (nr != NR_mmap && !fd_change_worth(cg, gen, fd, nr))
			return 0;
	}
	/* The x86_64 syscall convention: di, si, dx, r10, r8, r9. */
	args[0] = BPF_CORE_READ(regs, di);
	args[1] = BPF_CORE_READ(regs, si);
	args[2] = BPF_CORE_READ(regs, dx);
	args[3] = BPF_CORE_READ(regs, r10);
	args[4] = BPF_CORE_READ(regs, r8);
	args[5] = BPF_CORE_READ(regs, r9);
	if (!tracked(nr, args))
		return 0;
	if (nr == NR_openat2) {
		/* The flags as the call starts, not as a racing thread leaves
		 * them in the caller's memory by its exit. */
		__u64 flags = 0;
		bpf_probe_read_user(&flags, sizeof(flags), (void *)args[2]);
		args[2] = flags;
	}
	t->cgroup = cg;
	t->gen = gen;
	t->args[0] = args[0];
	t->args[1] = args[1];
	t->args[2] = args[2];
	t->args[3] = args[3];
	t->args[4] = args[4];
	t->args[5] = args[5];
	t->nr = nr;
	inflight_begin();
	return 0;
}

/* A content or metadata change through a file descriptor. */
static __noinline int on_fd_change(__u64 cg, __u64 gen, long fd, long nr)
{
	struct file *f = fd_file(fd);
	if (!f)
		return 0;
	struct inode *inode = BPF_CORE_READ(f, f_inode);
	__u32 mode;
	if (!inode)
		return 0;
	if (!state_bearing_as(inode, &mode, meta_call(nr))) {
		if (nr != NR_mmap && proc_mem(inode, mode, f))
			unsure(cg, gen, nr, CRAB_UNSURE_PROC_MEM);
		return 0;
	}
	struct crab_inode_key key = { .cgroup = cg };
	inode_id(inode, &key.dev, &key.ino);
	struct crab_inode_state *st = bpf_map_lookup_elem(&crab_inodes, &key);
	/* Born this turn, or already reported; a shared writable mapping is
	 * always reported: user space remembers who holds one. */
	if (st && st->gen == gen && nr != NR_mmap)
		return 0;
	struct crab_inode_state fresh = { .gen = gen, .flags = CRAB_INODE_WRITTEN };
	bpf_map_update_elem(&crab_inodes, &key, &fresh, BPF_ANY);
	struct crab_event *e = reserve(cg, gen, CRAB_EV_WRITE);
	if (!e)
		return 0;
	e->dev = key.dev;
	e->ino = key.ino;
	e->mode = mode;
	e->op = nr;
	const unsigned char *name = BPF_CORE_READ(f, f_path.dentry, d_name.name);
	bpf_probe_read_kernel_str(e->name, sizeof(e->name), name);
	submit(e);
	return 0;
}

/* The arguments of a path mutation (BPF functions take at most five
 * arguments, hence a struct). */
struct path_req {
	__u64 cg;
	__u64 gen;
	__u32 op;
	__u32 flags;
	long dirfd;
	unsigned long name;
	long dirfd2;
	unsigned long name2;
};

/* A walk from a created file up the dentries its spelled name names
 * (bpf_loop's context: scalars only). */
struct spell_walk {
	__u64 dentry;	/* the dentry the component being read must name */
	__u64 mnt;	/* its struct mount */
	__u64 root;	/* the task's root directory's dentry: never crossed */
	__s32 len;	/* bytes of the spelled name */
	__s32 j;	/* bytes of the dentry's name not matched yet */
	__s32 at_sep;	/* the byte read last was a '/' */
	__s32 failed;
};

/* Moves w to the directory above its dentry as the sandbox sees it: past
 * a mount's root, to the mount point (also of mounts stacked there), but
 * never above the task's root (a container's root mount is itself mounted
 * somewhere). */
static __always_inline int spell_up(struct spell_walk *w, struct crab_scratch *s)
{
	/* Out of BPF_CORE_READ: spell_walk is no kernel type to relocate. */
	struct mount *m = (void *)w->mnt;
	struct dentry *d = (void *)w->dentry;
	struct dentry *p = BPF_CORE_READ(d, d_parent);
	for (int k = 0; k < 4; k++) {
		struct mount *parent = BPF_CORE_READ(m, mnt_parent);
		if ((__u64)p == w->root || p != BPF_CORE_READ(m, mnt.mnt_root) || parent == m)
			break;
		p = BPF_CORE_READ(m, mnt_mountpoint);
		m = parent;
	}
	w->dentry = (__u64)p;
	w->mnt = (__u64)m;
	long n = bpf_probe_read_kernel_str(s->dname, sizeof(s->dname), BPF_CORE_READ(p, d_name.name));
	w->j = n > 0 ? n - 1 : 0;
	return 0;
}

static long spell_step(__u64 idx, void *ctx)
{
	struct spell_walk *w = ctx;
	__u32 zero = 0;
	struct crab_scratch *s = bpf_map_lookup_elem(&crab_scratch, &zero);
	long i = w->len - 1 - (long)idx;
	if (!s || i < 0 || i >= CRAB_NAME_LEN) {
		w->failed = !s;
		return 1;
	}
	char c = s->name[i & (CRAB_NAME_LEN - 1)];
	if (c == '/') {
		if (w->at_sep)
			return 0; /* "a//b" */
		if (w->j != 0) {
			w->failed = 1; /* the component is shorter than the name */
			return 1;
		}
		w->at_sep = 1;
		spell_up(w, s);
		return 0;
	}
	w->at_sep = 0;
	long j = w->j - 1;
	if (j < 0 || j >= CRAB_NAME_LEN || s->dname[j & (CRAB_NAME_LEN - 1)] != c) {
		w->failed = 1;
		return 1;
	}
	w->j = j;
	return 0;
}

/* Whether the spelled name (e->name, whole) names d from the record's base
 * directory (e->dir_dev, e->dir_ino) component by component: each
 * component, last first, equals the name of the dentry at its level
 * (crossing mount roots to their mount points). Then no symlink was
 * followed, and removing that name removes this file. "." and ".."
 * components are not followed: such a name is never proven. */
static __noinline int spelled_to(struct crab_event *e, struct file *f)
{
	__u32 zero = 0;
	struct crab_scratch *s = bpf_map_lookup_elem(&crab_scratch, &zero);
	if (!s || (e->marks & CRAB_MARK_NAME_CUT))
		return 0;
	long n = bpf_probe_read_kernel_str(s->name, sizeof(s->name), e->name);
	if (n <= 1)
		return 0;
	struct dentry *d = BPF_CORE_READ(f, f_path.dentry);
	struct vfsmount *vm = BPF_CORE_READ(f, f_path.mnt);
	struct task_struct *task = (void *)bpf_get_current_task();
	struct spell_walk w = {
		.root = (__u64)BPF_CORE_READ(task, fs, root.dentry),
		.dentry = (__u64)d,
		.mnt = (__u64)((char *)vm - bpf_core_field_offset(struct mount, mnt)),
		.len = n - 1,
	};
	long dn = bpf_probe_read_kernel_str(s->dname, sizeof(s->dname), BPF_CORE_READ(d, d_name.name));
	w.j = dn > 0 ? dn - 1 : 0;
	bpf_loop(CRAB_NAME_LEN, spell_step, &w, 0);
	if (w.failed)
		return 0;
	if (!w.at_sep) {
		if (w.j != 0)
			return 0; /* the first component is shorter than the name */
		spell_up(&w, s);
	}
	struct dentry *top = (void *)w.dentry;
	struct inode *base = BPF_CORE_READ(top, d_inode);
	if (!base)
		return 0;
	__u64 dev, ino;
	inode_id(base, &dev, &ino);
	return dev == e->dir_dev && ino == e->dir_ino;
}

/* open() with O_CREAT or O_TRUNC returned fd (in dirfd2; flags in name2). */
static __noinline int on_open_req(struct path_req *r)
{
	__u64 cg = r->cg, gen = r->gen;
	long fd = r->dirfd2, dirfd = r->dirfd;
	unsigned long name = r->name;
	__u64 flags = r->name2;
	struct file *f = fd_file(fd);
	if (!f)
		return 0;
	struct inode *inode = BPF_CORE_READ(f, f_inode);
	__u32 mode;
	if (!inode || !state_bearing(inode, &mode))
		return 0;
	__u32 fmode = BPF_CORE_READ(f, f_mode);
	int created = (fmode & FMODE_CREATED) != 0;
	if (!created && !(flags & O_TRUNC))
		return 0;
	struct crab_inode_key key = { .cgroup = cg };
	inode_id(inode, &key.dev, &key.ino);
	if (!created) {
		/* Truncating a file born this turn changes nothing lasting. */
		struct crab_inode_state *st = bpf_map_lookup_elem(&crab_inodes, &key);
		if (st && st->gen == gen && (st->flags & CRAB_INODE_BORN))
			return 0;
	}
	struct crab_inode_state fresh = {
		.gen = gen,
		.flags = created ? CRAB_INODE_BORN : CRAB_INODE_WRITTEN,
	};
	bpf_map_update_elem(&crab_inodes, &key, &fresh, BPF_ANY);
	struct crab_event *e = reserve(cg, gen, created ? CRAB_EV_CREATE : CRAB_EV_TRUNC);
	if (!e)
		return 0;
	e->dev = key.dev;
	e->ino = key.ino;
	e->mode = mode;
	e->flags = flags;
	if (read_user_name(e->name, name))
		e->marks |= CRAB_MARK_NAME_CUT;
	base_dir((void *)bpf_get_current_task(), dirfd, e->name[0], &e->dir_dev, &e->dir_ino);
	/* The canonical spelling too: parent directory and last component, so
	 * a removal by (dirfd, basename) matches a creation by "dir/name". */
	struct dentry *d = BPF_CORE_READ(f, f_path.dentry);
	struct inode *parent = BPF_CORE_READ(d, d_parent, d_inode);
	if (parent)
		inode_id(parent, &e->dir2_dev, &e->dir2_ino);
	bpf_probe_read_kernel_str(e->name2, sizeof(e->name2), BPF_CORE_READ(d, d_name.name));
	if (created && spelled_to(e, f))
		e->marks |= CRAB_MARK_SPELLED;
	submit(e);
	return 0;
}

static __always_inline int on_open(__u64 cg, __u64 gen, long fd, long dirfd, unsigned long name,
				   __u64 flags)
{
	struct path_req r = {
		.cg = cg, .gen = gen, .dirfd = dirfd, .name = name, .dirfd2 = fd, .name2 = flags,
	};
	return on_open_req(&r);
}

/* A mutation named by path(s): (dirfd, name) and optionally (dirfd2, name2). */
static __noinline int on_path_req(struct path_req *r)
{
	struct task_struct *task = (void *)bpf_get_current_task();
	struct crab_event *e = reserve(r->cg, r->gen, CRAB_EV_PATH);
	if (!e)
		return 0;
	e->op = r->op;
	e->flags = r->flags;
	if (r->name) {
		if (read_user_name(e->name, r->name))
			e->marks |= CRAB_MARK_NAME_CUT;
		if (r->op != CRAB_OP_SYMLINK)
			base_dir(task, r->dirfd, e->name[0], &e->dir_dev, &e->dir_ino);
	}
	if (r->name2) {
		if (read_user_name(e->name2, r->name2))
			e->marks |= CRAB_MARK_NAME2_CUT;
		base_dir(task, r->dirfd2, e->name2[0], &e->dir2_dev, &e->dir2_ino);
	}
	submit(e);
	return 0;
}

static __always_inline int on_path(__u64 cg, __u64 gen, __u32 op, long dirfd, unsigned long name,
				   long dirfd2, unsigned long name2, __u32 flags)
{
	struct path_req r = {
		.cg = cg, .gen = gen, .op = op, .flags = flags,
		.dirfd = dirfd, .name = name, .dirfd2 = dirfd2, .name2 = name2,
	};
	return on_path_req(&r);
}

/* An attribute change by path, or through dirfd when the path is empty or
 * NULL (AT_EMPTY_PATH, utimensat(fd, NULL)). */
static __always_inline int on_attr(__u64 cg, __u64 gen, long dirfd, unsigned long name)
{
	char first = 0;
	if (name)
		bpf_probe_read_user(&first, 1, (void *)name);
	if (!first)
		return on_fd_change(cg, gen, dirfd, -1);
	return on_path(cg, gen, CRAB_OP_ATTR, dirfd, name, 0, 0, 0);
}

static __noinline int on_proc(__u64 cg, __u64 gen, __u32 kind, unsigned long name)
{
	struct crab_event *e = reserve(cg, gen, kind);
	if (!e)
		return 0;
	if (name)
		bpf_probe_read_user_str(e->name, sizeof(e->name), (void *)name);
	submit(e);
	return 0;
}

SEC("raw_tracepoint/sys_exit")
int crab_sys_exit(struct bpf_raw_tracepoint_args *ctx)
{
	/* This runs for every syscall of every task on the host: return at
	 * once while no followed call is in flight, and tell the others by
	 * number before any hash lookup. */
	long ret = (long)((__u64 *)ctx)[1];
	struct pt_regs *regs = (struct pt_regs *)((__u64 *)ctx)[0];
	struct crab_counts *c = counts();
	if (!c)
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	/* A marked task's own call takes its mark at sys_enter: one that
	 * exits still marked made a call that never entered (skipped by a
	 * seccomp filter or a tracer), and runs its code after it. Not for
	 * CRIU's parasite, whose calls leave the task's own mark. */
	if (c->marks) {
		struct crab_task *m = bpf_map_lookup_elem(&crab_tasks, &tid);
		if (m && m->resume_ip) {
			__u64 mcg;
			struct crab_ctl *mctl = current_sandbox(&mcg);
			if (!mctl || !injected(bpf_get_current_task_btf(), mcg, mctl))
				clear_mark(m);
		}
	}
	/* A call interrupted by a freeze, a tracer's stop or a signal: the
	 * kernel restarts it from where it was made, unless a handler runs
	 * first (signal_deliver then clears the mark). Rare: a lookup only
	 * then, for any task on the host. */
	if (ret >= -ERESTART_RESTARTBLOCK && ret <= -ERESTARTSYS) {
		long was = BPF_CORE_READ(regs, orig_ax);
		/* -ERESTART_RESTARTBLOCK is restarted only as restart_syscall.
		 * CRIU's seizure instead hands the task -EINTR, and saves it so
		 * in the version's image: the code that then runs until the
		 * task makes the call again from the same place is what a
		 * restore of that image runs too, so during a capture the
		 * call's own number resumes it as well. Outside a capture the
		 * call made again under its own number is the task's running. */
		if (was != -1) { /* not a sigreturn's restored ax */
			int block = ret == -ERESTART_RESTARTBLOCK;
			mark_resume(BPF_CORE_READ(regs, ip), BPF_CORE_READ(regs, sp),
				    block ? NR_restart_syscall : was, block ? was : -1,
				    BPF_CORE_READ(regs, cs));
		}
	}
	if (c->inflight == 0)
		return 0;
	long nr = BPF_CORE_READ(regs, orig_ax);
	/* A sigreturn sets orig_ax to -1. */
	if (nr != -1 && !tracked_nr(nr))
		return 0;
	/* Only tasks of registered sandboxes have entries. */
	struct crab_task *t = bpf_map_lookup_elem(&crab_tasks, &tid);
	if (!t || t->nr < 0)
		return 0;
	struct crab_task s = *t;
	t->nr = -1;
	__sync_fetch_and_add(&c->inflight, -1);
	if (s.nr == NR_rt_sigreturn) {
		/* Onto a system-call instruction (a restored task's interrupted
		 * call): a call from just past it, on the same stack, with the
		 * number the frame left in ax, is that instruction run first,
		 * with no code of the task's before it. Not for a sigreturn a
		 * checkpoint made the task do (CRIU ending its parasite): the
		 * task's own mark stands. */
		struct crab_ctl *ctl = bpf_map_lookup_elem(&crab_ctl, &s.cgroup);
		if (ctl && !injected(bpf_get_current_task_btf(), s.cgroup, ctl))
			mark_resume(BPF_CORE_READ(regs, ip) + SYSCALL_INSN_LEN,
				    BPF_CORE_READ(regs, sp), ret, -1, BPF_CORE_READ(regs, cs));
		return 0;
	}
	if (ret < 0)
		return 0;
	__u64 cg = s.cgroup, gen = s.gen;
	unsigned long *a = (unsigned long *)s.args;
	/* A change through a descriptor (the list is fd_change_idx's). */
	switch (fd_change_idx(s.nr)) {
	case 0:
		return on_fd_change(cg, gen, a[0], s.nr);
	case 2:
		return on_fd_change(cg, gen, a[2], s.nr);
	case 4:
		return on_fd_change(cg, gen, a[4], s.nr);
	}
	if (ipc_call(s.nr)) {
		struct crab_event *e = reserve(cg, gen, CRAB_EV_IPC);
		if (e) {
			e->op = s.nr;
			submit(e);
		}
		return 0;
	}
	switch (s.nr) {
	case NR_open:
		return on_open(cg, gen, ret, AT_FDCWD, a[0], a[1]);
	case NR_creat:
		return on_open(cg, gen, ret, AT_FDCWD, a[0], O_CREAT | O_TRUNC | 1);
	case NR_openat:
		return on_open(cg, gen, ret, a[0], a[1], a[2]);
	case NR_openat2:
		return on_open(cg, gen, ret, a[0], a[1], a[2]); /* flags, read at entry */
	case NR_truncate:
		return on_path(cg, gen, CRAB_OP_TRUNCATE, AT_FDCWD, a[0], 0, 0, 0);
	case NR_rename:
		return on_path(cg, gen, CRAB_OP_RENAME, AT_FDCWD, a[0], AT_FDCWD, a[1], 0);
	case NR_renameat:
		return on_path(cg, gen, CRAB_OP_RENAME, a[0], a[1], a[2], a[3], 0);
	case NR_renameat2: {
		__u32 op = CRAB_OP_RENAME;
		if (a[4] & RENAME_EXCHANGE)
			op = CRAB_OP_EXCHANGE;
		else if (a[4] & RENAME_NOREPLACE)
			op = CRAB_OP_RENAME_NOREPLACE;
		return on_path(cg, gen, op, a[0], a[1], a[2], a[3], a[4]);
	}
	case NR_mkdir:
		return on_path(cg, gen, CRAB_OP_MKDIR, AT_FDCWD, a[0], 0, 0, 0);
	case NR_mkdirat:
		return on_path(cg, gen, CRAB_OP_MKDIR, a[0], a[1], 0, 0, 0);
	case NR_mknod:
		return on_path(cg, gen, CRAB_OP_MKNOD, AT_FDCWD, a[0], 0, 0, a[1]);
	case NR_mknodat:
		return on_path(cg, gen, CRAB_OP_MKNOD, a[0], a[1], 0, 0, a[2]);
	case NR_rmdir:
		return on_path(cg, gen, CRAB_OP_RMDIR, AT_FDCWD, a[0], 0, 0, 0);
	case NR_unlink:
		return on_path(cg, gen, CRAB_OP_UNLINK, AT_FDCWD, a[0], 0, 0, 0);
	case NR_unlinkat:
		return on_path(cg, gen, (a[2] & AT_REMOVEDIR) ? CRAB_OP_RMDIR : CRAB_OP_UNLINK,
			       a[0], a[1], 0, 0, 0);
	case NR_link:
		return on_path(cg, gen, CRAB_OP_LINK, AT_FDCWD, a[0], AT_FDCWD, a[1], 0);
	case NR_linkat:
		return on_path(cg, gen, CRAB_OP_LINK, a[0], a[1], a[2], a[3], 0);
	case NR_symlink:
		return on_path(cg, gen, CRAB_OP_SYMLINK, 0, a[0], AT_FDCWD, a[1], 0);
	case NR_symlinkat:
		return on_path(cg, gen, CRAB_OP_SYMLINK, 0, a[0], a[1], a[2], 0);
	case NR_bind: {
		/* A unix socket bound to a path makes a node there. */
		__u16 family = 0;
		char first = 0;
		bpf_probe_read_user(&family, sizeof(family), (void *)a[1]);
		bpf_probe_read_user(&first, 1, (void *)(a[1] + 2));
		if (family != AF_UNIX || !first)
			return 0;
		return on_path(cg, gen, CRAB_OP_MKNOD, AT_FDCWD, a[1] + 2, 0, 0, 0);
	}
	case NR_chmod:
	case NR_chown:
	case NR_lchown:
	case NR_utime:
	case NR_utimes:
	case NR_setxattr:
	case NR_lsetxattr:
	case NR_removexattr:
	case NR_lremovexattr:
		return on_attr(cg, gen, AT_FDCWD, a[0]);
	case NR_fchmodat:
	case NR_fchmodat2:
	case NR_fchownat:
	case NR_futimesat:
	case NR_utimensat:
	case NR_setxattrat:
	case NR_removexattrat:
	case NR_file_setattr:
		return on_attr(cg, gen, a[0], a[1]);
	case NR_chdir:
	case NR_fchdir: {
		if (is_born(&s, gen))
			return 0;
		return on_proc(cg, gen, CRAB_EV_CWD, s.nr == NR_chdir ? a[0] : 0);
	}
	case NR_ptrace:
	case NR_process_vm_writev:
	case NR_io_uring_setup:
	case NR_io_uring_enter:
	case NR_io_uring_register:
	case NR_io_submit: {
		count(cg, 1);
		struct crab_event *e = reserve(cg, gen, CRAB_EV_UNSURE);
		if (e) {
			e->op = s.nr;
			submit(e);
		}
		return 0;
	}
	}
	return 0;
}

/* Follows task `pid`, born into sandbox `cg` in its turn `ctl->gen`. */
static __always_inline void follow_task(__u64 cg, __u64 gen, __u32 pid)
{
	/* A task moved in may have an entry (followed in another sandbox):
	 * it is made new in place. Its call in flight and resume mark stay:
	 * they are the task's own handlers' to end, on its CPU, and this
	 * runs in the mover's context; replacing the entry would free the
	 * element those handlers may be writing (a preallocated element is
	 * reused at once) and end the call's count twice. The generations
	 * it kept are another sandbox's. */
	struct crab_task *old = bpf_map_lookup_elem(&crab_tasks, &pid);
	if (old) {
		old->born_gen = gen;
		old->active_gen = gen;
		old->compat_gen = 0;
		old->traced_gen = 0;
		return;
	}
	struct crab_task t = { .born_gen = gen, .active_gen = gen, .nr = -1 };
	if (bpf_map_update_elem(&crab_tasks, &pid, &t, BPF_ANY))
		count(cg, 0);
}

/* A raw tracepoint: the child's task is at hand (args: parent, child), so
 * its cgroup is read where clone3's CLONE_INTO_CGROUP put it, a move no
 * cgroup_attach_task event reports. */
SEC("raw_tracepoint/sched_process_fork")
int crab_fork(struct bpf_raw_tracepoint_args *ctx)
{
	/* Plain loads: a CO-RE relocation cannot describe the flexible args[]. */
	struct task_struct *child = (struct task_struct *)((__u64 *)ctx)[1];
	__u32 child_pid = BPF_CORE_READ(child, pid);
	__u64 child_cg = BPF_CORE_READ(child, cgroups, dfl_cgrp, kn, id);
	__u64 cg;
	struct crab_ctl *ctl = current_sandbox(&cg);
	if (child_cg != cg) {
		/* Born into a cgroup other than its parent's: followed there
		 * when that is a sandbox. A sandbox's task that made it out of
		 * its own cgroup cannot say what it does: the child keeps the
		 * parent's mounts, directory and files, so what it writes may be
		 * this sandbox's, booked to another or to none. */
		struct crab_ctl *dst = bpf_map_lookup_elem(&crab_ctl, &child_cg);
		if (dst)
			follow_task(child_cg, dst->gen, child_pid);
		if (ctl)
			unsure(cg, ctl->gen, child_pid, CRAB_UNSURE_CGROUP);
	}
	if (!ctl)
		return 0;
	/* Read once: user space replaces the element at turn ends. */
	__u64 gen = ctl->gen;
	int by_criu = injected(bpf_get_current_task_btf(), cg, ctl);
	if (child_cg == cg)
		follow_task(cg, gen, child_pid);
	/* The new task runs, and is reported only through its process (a
	 * thread's running is its parent's): the parent ran, even when its
	 * clone resumed one a freeze interrupted. */
	struct crab_task *parent = task_entry(cg, bpf_get_current_pid_tgid());
	if (parent && !by_criu)
		ran(cg, gen, parent);
	return 0;
}

SEC("tracepoint/cgroup/cgroup_attach_task")
int crab_attach(struct cgroup_attach_args *ctx)
{
	if (ctx->dst_root != 0)
		return 0; /* a v1 hierarchy: its ids are another namespace */
	__u64 cg = ctx->dst_id;
	struct crab_ctl *ctl = bpf_map_lookup_elem(&crab_ctl, &cg);
	if (ctl)
		follow_task(cg, ctl->gen, ctx->pid);
	/* A task of a sandbox moved a task into another cgroup: what happens
	 * there is not followed (no sandbox's), or is booked to another
	 * sandbox though the task keeps the mounts and files it had. */
	__u64 from;
	struct crab_ctl *src = current_sandbox(&from);
	if (!src || from == cg)
		return 0;
	unsure(from, src->gen, ctx->pid, CRAB_UNSURE_CGROUP);
	return 0;
}

SEC("tracepoint/sched/sched_process_exec")
int crab_exec(void *ctx)
{
	__u64 cg;
	struct crab_ctl *ctl = current_sandbox(&cg);
	if (!ctl)
		return 0;
	__u64 gen = ctl->gen;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct crab_task *t = bpf_map_lookup_elem(&crab_tasks, &tid);
	if (is_born(t, gen))
		return 0;
	return on_proc(cg, gen, CRAB_EV_EXEC, 0);
}

SEC("tracepoint/sched/sched_process_exit")
int crab_exit(void *ctx)
{
	__u64 pt = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pt;
	__u64 cg;
	struct crab_ctl *ctl = current_sandbox(&cg);
	if (ctl && tid == (pt >> 32)) {
		__u64 gen = ctl->gen;
		struct crab_task *t = bpf_map_lookup_elem(&crab_tasks, &tid);
		if (!is_born(t, gen))
			on_proc(cg, gen, CRAB_EV_EXIT, 0);
	}
	struct crab_task *left = bpf_map_lookup_elem(&crab_tasks, &tid);
	if (left && left->nr >= 0)
		inflight_done();
	if (left)
		clear_mark(left);
	bpf_map_delete_elem(&crab_tasks, &tid);
	return 0;
}

/* A signal is delivered to the current task: when a handler of its own
 * runs, its code runs before any restart of the interrupted call, so the
 * resume mark no longer holds. Signals are rare: a lookup for each. */
SEC("tracepoint/signal/signal_deliver")
int crab_signal(struct trace_event_raw_signal_deliver *ctx)
{
	if (ctx->sa_handler <= SIG_IGN)
		return 0; /* SIG_DFL or SIG_IGN: no code of the task's */
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct crab_task *t = bpf_map_lookup_elem(&crab_tasks, &tid);
	if (t)
		clear_mark(t);
	return 0;
}
