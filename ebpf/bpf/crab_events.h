/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Record layouts shared by the inspector's BPF programs and its Rust loader
 * (crab-inspector's `kernel` module mirrors each struct, with size and offset
 * assertions). Every field is naturally aligned; no implicit padding.
 */
#ifndef CRAB_EVENTS_H
#define CRAB_EVENTS_H

#define CRAB_NAME_LEN 256
#define CRAB_COMM_LEN 16

/* Kinds of ring-buffer records. */
enum crab_kind {
	CRAB_EV_CREATE = 1,   /* open() created the file at (dir, name) */
	CRAB_EV_TRUNC = 2,    /* open(O_TRUNC) of an existing file at (dir, name) */
	CRAB_EV_WRITE = 3,    /* first content/metadata change this turn of an inode
			       * that existed before the turn (fd-based; op is the
			       * syscall number, every shared writable mmap is one) */
	CRAB_EV_PATH = 4,     /* a path-based mutation, see enum crab_op */
	CRAB_EV_ACTIVE = 5,   /* a long-lived task ran (first syscall this turn);
			       * op is 1 when its comm is noisy */
	CRAB_EV_CWD = 6,      /* a long-lived task changed its working directory */
	CRAB_EV_EXEC = 7,     /* a long-lived task exec'd */
	CRAB_EV_EXIT = 8,     /* a long-lived process exited */
	CRAB_EV_UNSURE = 9,   /* something the inspector cannot follow (io_uring,
			       * aio, writes into another process's memory, a
			       * 32-bit system call); op is the syscall number,
			       * flags one of CRAB_UNSURE_* */
	CRAB_EV_IPC = 10,     /* a System V or POSIX IPC call (shared memory,
			       * semaphores, message queues: state CRIU keeps
			       * with the processes); op is the syscall number */
};

/* What an UNSURE record is about (its flags). */
#define CRAB_UNSURE_CALL 0	/* the call itself (op) */
#define CRAB_UNSURE_COMPAT 1	/* op is a 32-bit (int 0x80) or x32 call number */
#define CRAB_UNSURE_PROC_MEM 2	/* op wrote a /proc/<pid>/mem */
#define CRAB_UNSURE_CGROUP 3	/* task op was moved, or cloned, into a cgroup no sandbox is */
#define CRAB_UNSURE_TRACED 4	/* a tracer outside the sandbox stopped the task
				 * while no checkpoint ran */

/* A record's marks: a name it could not carry whole (longer than
 * CRAB_NAME_LEN - 1 bytes, or unreadable at the call's exit), and for a
 * CREATE whether name spells the path from its base directory to the
 * created file, component by component, with no symlink followed. */
#define CRAB_MARK_NAME_CUT 1
#define CRAB_MARK_NAME2_CUT 2
#define CRAB_MARK_SPELLED 4

/* Path operations (CRAB_EV_PATH). */
enum crab_op {
	CRAB_OP_UNLINK = 1,
	CRAB_OP_RMDIR = 2,
	CRAB_OP_RENAME = 3,	/* name -> name2 */
	CRAB_OP_EXCHANGE = 4,	/* renameat2(RENAME_EXCHANGE) name <-> name2 */
	CRAB_OP_MKDIR = 5,
	CRAB_OP_MKNOD = 6,
	CRAB_OP_LINK = 7,	/* new name2 for the object at name */
	CRAB_OP_SYMLINK = 8,	/* name2 is the new link */
	CRAB_OP_ATTR = 9,	/* chmod, chown, utimes, xattr on (dir, name) */
	CRAB_OP_TRUNCATE = 10,	/* truncate(path) */
	CRAB_OP_RENAME_NOREPLACE = 11, /* like RENAME, name2 did not exist */
};

/* Slots of the sandbox prefilter (crab_slots): slot = cgroup id & (N - 1)
 * holds the registered cgroup id, 0 when none, CRAB_SLOT_SHARED when two
 * registered sandboxes share the slot (then the hash map decides). */
#define CRAB_SLOTS 4096
#define CRAB_SLOT_SHARED 0xffffffffffffffffULL

/* Per-sandbox control, written by user space only (key: cgroup id). */
struct crab_ctl {
	__u64 gen;	/* current turn generation, starts at 1 */
	__u64 turn;	/* turns ended so far (user space's counter; kept here so
			 * a restarted owner numbers on) */
	__u64 capturing; /* non-zero while a checkpoint of the sandbox runs:
			  * a tracer outside the sandbox is then its CRIU */
};

/* Per-sandbox counters, written by the kernel only; monotonic. */
struct crab_stats {
	__u64 seq;		/* ring records assigned a sequence number */
	__u64 n_dropped;	/* of those, records the ring buffer had no room for */
	__u64 n_lost;		/* task or stash entries the maps had no room for */
	__u64 n_unsure;		/* operations the inspector cannot follow */
};

/* Per-task state (key: tid), and the arguments of a tracked syscall kept
 * from sys_enter to sys_exit (in the entry the enter program already looked
 * up, so following a call costs no extra map update). */
struct crab_task {
	__u64 born_gen;		/* generation the task entered the sandbox in; 0 = before registration */
	__u64 active_gen;	/* last generation the task made a syscall in */
	__u64 cgroup;		/* the sandbox, at the tracked call's entry */
	__u64 gen;		/* the generation, at the tracked call's entry */
	__s64 nr;		/* the tracked call in flight, or -1 */
	__u64 args[6];
	__u64 compat_gen;	/* last generation it made a 32-bit call in */
	/* Where the task resumes a call without running code of its own: a
	 * call interrupted by a freeze, a tracer's stop or a signal (it
	 * returned -ERESTART*), or a sigreturn onto a system-call instruction
	 * (a restored task). Its next call, when made from resume_ip (the
	 * user ip at the call's entry) and resume_sp with resume_nr (or
	 * restart_syscall), is that resumption, not running. 0 = none. */
	__u64 resume_ip;
	__u64 resume_sp;
	__s64 resume_nr;
	__s64 resume_alt;	/* another number that resumes it, or -1: the
				 * interrupted call's own, after a capture's CRIU
				 * turned -ERESTART_RESTARTBLOCK into -EINTR (the
				 * version's image holds the task at that -EINTR) */
	__u64 traced_gen;	/* last generation a tracer outside the sandbox
				 * was found stopping it (UNSURE once a turn) */
};

/* Key of the per-inode dedupe map. */
struct crab_inode_key {
	__u64 cgroup;
	__u64 dev;
	__u64 ino;
};

/* Value of the per-inode dedupe map. */
struct crab_inode_state {
	__u64 gen;
	__u64 flags;	/* CRAB_INODE_BORN | CRAB_INODE_WRITTEN */
};

#define CRAB_INODE_BORN 1
#define CRAB_INODE_WRITTEN 2

/* One ring-buffer record. */
struct crab_event {
	__u64 cgroup;
	__u64 seq;
	__u64 gen;
	__u32 kind;		/* enum crab_kind */
	__u32 op;		/* enum crab_op, or the syscall number for UNSURE */
	__u32 pid;		/* tgid */
	__u32 tid;
	__u64 dev;		/* object inode (CREATE, TRUNC, WRITE) */
	__u64 ino;
	__u64 dir_dev;		/* base directory of name (cwd, dirfd or root) */
	__u64 dir_ino;
	__u64 dir2_dev;		/* base directory of name2; for CREATE and TRUNC the
				 * parent of the opened file, name2 its last component */
	__u64 dir2_ino;
	__u32 mode;		/* object inode mode, when known */
	__u32 flags;		/* open flags, renameat2 flags */
	__u32 mntns;		/* the task's mount namespace (inode number) */
	__u32 marks;		/* CRAB_MARK_* */
	char comm[CRAB_COMM_LEN];
	char name[CRAB_NAME_LEN];
	char name2[CRAB_NAME_LEN];
};

/* The loader's Rust mirrors assert the same sizes. */
_Static_assert(sizeof(struct crab_ctl) == 24, "crab_ctl");
_Static_assert(sizeof(struct crab_stats) == 32, "crab_stats");
_Static_assert(sizeof(struct crab_task) == 136, "crab_task");
_Static_assert(sizeof(struct crab_event) == 632, "crab_event");

#endif
