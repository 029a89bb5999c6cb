/* trialledger's sandbox init (SPEC §11): PID 1 of the sandbox's PID namespace.
 *
 * It starts the agent in its own process group, forwards SIGTERM, SIGINT and SIGHUP to
 * that group (SIGUSR1 means "SIGKILL the group"), reaps every orphan, and reports the
 * agent's real wait status -- {"exit": N}, {"signal": N} or {"spawn_error": "..."} -- on
 * the status descriptor. It makes itself non-dumpable first, so the agent (same uid) can
 * neither open /proc/1/fd/N nor ptrace it: the status channel is ours alone. Static, so
 * nothing of ours needs a program inside the sandbox.
 *
 *     init --status-fd N [--oom-score-adj K] [--user UID GID GROUPS] [--env-fd FD]
 *          [--deadline-fd FD --deadline-ms MS] [--lifeline-fd FD] -- COMMAND ARGS...
 *
 * With --env-fd the command's whole environment is read from FD (NUL-separated
 * NAME=VALUE entries, at most ENV_MAX bytes) and nothing of init's own is kept: the task's
 * variables are handed over inside the sandbox, never to a program on the host side
 * (bwrap is dynamic: a task's LD_PRELOAD would run there), never on a command line.
 *
 * With --lifeline-fd FD (the container's PID 1 under runc, SPEC §16) FD is the read end
 * of a pipe only the runner holds open for writing: when it reads end-of-file the runner
 * is gone, and the command's group is SIGKILLed -- as bwrap's --die-with-parent ends a
 * sandbox whose runner died (runc's container does not die with runc).
 *
 * With --deadline-fd it is a dead man's switch (a job trial's lease, SPEC §13): it SIGKILLs
 * the command's group MS milliseconds from its start unless the runner extends the
 * deadline first, by writing "<milliseconds>\n" (from now) to FD. A runner that is paused,
 * partitioned from its store or dead cannot, so its agent stops acting before another
 * holder may take the trial over.
 *
 * With --user (range mode, SPEC §15) it runs as inner root and switches the command to its
 * user as Docker does: GROUPS (comma-separated gids, "-" for none) as the supplementary
 * groups, then the gid, then the uid, which clears every capability of a non-root user.
 *
 * Before bwrap, as the runner, it also stages the sandbox: in a private mount namespace
 * of its own (--mount-ns) it makes the session's overlays and the read-only binds of what
 * the sandbox user may not read, drops to that user (--drop: no groups, no new
 * privileges, a process limit unless NPROC is 0), then execs bwrap -- one program start
 * where `unshare`, a shell, a `mount` per mount, `setpriv` and `prlimit` took several.
 * With --cgroup (once per hierarchy) it first joins the session's cgroups (writes 0 to
 * each cgroup.procs), so that everything the sandbox starts is held by the session's
 * limits:
 *
 *     init --stage [--cgroup PROCS]... [--mount-ns] [--drop UID GID NPROC]
 *          [OPTIONS TARGET]... -- [SOURCE TARGET]... -- COMMAND ARGS...
 *
 * With --idmap (range mode) it mounts SOURCE at TARGET idmapped through the user
 * namespace USERNS_FD, read-only, nodev, nosuid: the image's root-owned files become the
 * slot's first id, so one cache entry (or one layer of the session image store) serves
 * every slot; given once per layer, the overlays then lie on all of them:
 *
 *     init --stage [--cgroup PROCS]... [--mount-ns [--idmap USERNS_FD SOURCE TARGET]...] ...
 *
 * For an OCI runtime (SPEC §16) --exec-suid (before --idmap) leaves setuid bits working
 * on the idmapped image and its overlay (they are setuid only to the slot's ids: never
 * nosuid on the image's files), and --fds A[,B] puts A at descriptor 3 (B at 4) just
 * before the exec (what `runc run --preserve-fds N` hands to the container's PID 1):
 *
 *     init --stage [--fds A[,B]] [--cgroup PROCS]... [--mount-ns [--exec-suid] [--idmap ...]] ...
 *
 * And it makes a session's user namespace (range mode): as ID (the slot's first host id,
 * so the namespace belongs to it and bwrap, running as ID, may join it), it unshares a
 * user namespace, forbids nested ones in it (user.max_user_namespaces = 0), prints
 * "ready", and waits for its stdin to close -- meanwhile the runner writes the id maps and
 * opens /proc/PID/ns/user:
 *
 *     init --userns ID [--net]
 *
 * With --net (range mode on an OCI runtime, SPEC §16) it also makes the session's network
 * namespace inside that user namespace, its loopback up, for the runtime to join by path.
 * Run in that user namespace already (by nsenter), it makes one more network namespace
 * there the same way -- a compose session's bridge's own (bridge.py):
 *
 *     init --netns
 *
 * And it starts one phase's process in a running sandbox (SPEC §15, `verifier_isolation =
 * harbor`), as `docker exec` does: it joins the session's cgroups, then the namespaces of
 * the sandbox's PID 1 (FDS: their descriptors, opened by the runner; the user namespace
 * owning them first, then mount, PID, network,
 * IPC, UTS and cgroup, then PID 1's own user namespace when it is nested), and forks the
 * command there, which first drops to what the sandbox's own processes hold: its user,
 * the capabilities of MASK (hex; only inner root keeps any), no new privileges, the
 * seccomp program read from SECCOMP_FD, a process limit (NPROC, 0: none). Not PID 1 of
 * anything, it reaps only its own child; when that ends it SIGKILLs the child's process
 * group (what the command detached from it keeps running, as in a container) and reports
 * {"exit": N, "group_gone": true|false}. With --copy-in it copies the folder SRC_FD
 * (opened on the host, before the join) to the new folder DEST in the sandbox, owned by
 * UID:GID, instead of running a command (an empty folder at DEST is removed, whatever
 * else is there moved aside first -- an image's own folder, which an overlay cannot
 * rename, removed; DEST's missing parents are made, 0755, inner root's);
 * a regular file SRC_FD is copied to the file DEST the same way. --merge-in copies the
 * folder SRC_FD into the folder DEST as `docker cp` does (a multi-step task's workdir):
 * DEST made when missing (a link or file there replaced by a folder), what is in it kept
 * but for the entries in the way of copied ones. --clear empties the folder DEST (a link or
 * file there removed), as Harbor empties /tests between the steps of a multi-step task:
 *
 *     init --join-fds FDS [--cgroup PROCS]... [--caps MASK] [--seccomp-fd FD] [--nproc N]
 *          [--chdir DIR] [--copy-in|--merge-in SRC_FD DEST UID GID | --clear DEST]
 *          [--new-privs] --status-fd N
 *          [--user ...] -- COMMAND
 *
 * With --new-privs (a container on an OCI runtime, whose processes have no_new_privs off
 * as Docker's do, SPEC §16) no_new_privs is not set: the seccomp program is then loaded
 * while the process is still inner root with its capabilities (the kernel asks for
 * CAP_SYS_ADMIN in the namespace to load one without no_new_privs), before the switch to
 * its user -- as runc itself orders it.
 *
 * `init --idle` sleeps until killed: PID 1's command in a container whose image has no
 * ENTRYPOINT, as `sleep infinity` is Harbor's.
 *
 * Built by `trialledger setup` or on first use: gcc -static -O2 -o init init.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <linux/mount.h>
#include <grp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/syscall.h>
#include <linux/close_range.h>
#include <sys/wait.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <dirent.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/nsfs.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sys/socket.h>
#include <unistd.h>

#define ENV_MAX (4 << 20)
#define ENV_ENTRIES_MAX 65536

static volatile sig_atomic_t child_pid = 0;
static volatile sig_atomic_t deadline_fd = -1;
static volatile sig_atomic_t lifeline_fd = -1;

/* The deadline passed: the command's whole group goes. */
static void deadline_passed(int signum) {
    (void)signum;
    if (child_pid > 0)
        kill(-child_pid, SIGKILL);
}

static void set_deadline(unsigned long ms) {
    struct itimerval timer;
    memset(&timer, 0, sizeof timer);
    timer.it_value.tv_sec = (time_t)(ms / 1000);
    timer.it_value.tv_usec = (suseconds_t)(ms % 1000) * 1000;
    if (ms == 0)
        timer.it_value.tv_usec = 1; /* now (0 would disarm it) */
    setitimer(ITIMER_REAL, &timer, NULL);
}

/* SIGIO: the runner wrote to the deadline pipe; the last whole number read is the new
 * deadline, in milliseconds from now. */
static void deadline_extended(int signum) {
    (void)signum;
    int saved = errno;
    char buffer[256];
    ssize_t got;
    unsigned long value = 0, last = 0;
    int digits = 0, whole = 0;
    while ((got = read(deadline_fd, buffer, sizeof buffer)) > 0) {
        for (ssize_t i = 0; i < got; i++) {
            if (buffer[i] >= '0' && buffer[i] <= '9' && digits < 12) {
                value = value * 10 + (unsigned long)(buffer[i] - '0');
                digits++;
            } else if (buffer[i] == '\n' && digits > 0) {
                last = value;
                whole = 1;
                value = 0;
                digits = 0;
            } else {
                value = 0;
                digits = 0;
            }
        }
    }
    if (whole)
        set_deadline(last);
    errno = saved;
}

/* SIGIO: the lifeline's writer (the runner) may be gone: end-of-file ends the command. */
static void lifeline_checked(void) {
    char byte;
    if (lifeline_fd >= 0 && read(lifeline_fd, &byte, 1) == 0 && child_pid > 0)
        kill(-child_pid, SIGKILL);
}

static void io_ready(int signum) {
    int saved = errno;
    if (deadline_fd >= 0)
        deadline_extended(signum);
    lifeline_checked();
    errno = saved;
}

static void forward(int signum) {
    int saved = errno;
    if (child_pid > 0)
        kill(-child_pid, signum == SIGUSR1 ? SIGKILL : signum);
    errno = saved;
}

static void report(int fd, const char *json) {
    if (fd < 0)
        return;
    size_t left = strlen(json);
    while (left > 0) {
        ssize_t n = write(fd, json, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        json += n;
        left -= (size_t)n;
    }
}

/* The raised OOM score is written before the process turns non-dumpable (its /proc
 * files then belong to root) and is inherited by the agent. */
static void raise_oom_score(const char *value) {
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        (void)!write(fd, value, strlen(value));
        close(fd);
    }
}

static int stage_failed(const char *what, const char *target) {
    fprintf(stderr, "init --stage: %s %s: %s\n", what, target, strerror(errno));
    return 125;
}

/* The sandbox user: no supplementary groups, every uid and gid its own, no new
 * privileges, and a process limit: NPROC (its processes and threads, all sessions
 * together) where no pids cgroup of the session's own holds it, else (0) the highest we
 * may set, so that other sessions' processes do not count against this one. */
static int drop(const char *uid_text, const char *gid_text, const char *nproc_text) {
    uid_t uid = (uid_t)strtoul(uid_text, NULL, 10);
    gid_t gid = (gid_t)strtoul(gid_text, NULL, 10);
    rlim_t nproc = (rlim_t)strtoul(nproc_text, NULL, 10);
    struct rlimit limit = {nproc, nproc};
    if (nproc == 0 && getrlimit(RLIMIT_NPROC, &limit) == 0)
        limit.rlim_cur = limit.rlim_max; /* as high as we may: raising the hard limit
                                             needs CAP_SYS_RESOURCE, which a container's
                                             root may lack */
    if (uid == 0)
        return stage_failed("--drop to uid", "0");
    if (setrlimit(RLIMIT_NPROC, &limit) != 0)
        return stage_failed("setrlimit NPROC", nproc_text);
    if (setgroups(0, NULL) != 0 || setresgid(gid, gid, gid) != 0)
        return stage_failed("setresgid", gid_text);
    if (setresuid(uid, uid, uid) != 0)
        return stage_failed("setresuid", uid_text);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return stage_failed("prctl", "PR_SET_NO_NEW_PRIVS");
    return 0;
}

/* SOURCE mounted at TARGET read-only, nodev, nosuid unless EXEC_SUID, its ids seen
 * through USERNS_FD. */
static int idmapped(int userns_fd, const char *source, const char *target, int exec_suid) {
    int tree = open_tree(AT_FDCWD, source, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (tree < 0)
        return -1;
    struct mount_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV |
                    (exec_suid ? 0 : MOUNT_ATTR_NOSUID);
    attr.userns_fd = (unsigned long long)userns_fd;
    int failed = mount_setattr(tree, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0 ||
                 move_mount(tree, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) != 0;
    int saved = errno;
    close(tree); /* USERNS_FD stays open: bwrap joins the same namespace */
    errno = saved;
    return failed ? -1 : 0;
}

/* The loopback of the network namespace we are in, up (as a new one starts down). */
static int loopback_up(void) {
    struct ifreq request;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0), failed;
    if (fd < 0)
        return -1;
    memset(&request, 0, sizeof request);
    strcpy(request.ifr_name, "lo");
    failed = ioctl(fd, SIOCGIFFLAGS, &request) != 0;
    request.ifr_flags |= IFF_UP;
    failed = failed || ioctl(fd, SIOCSIFFLAGS, &request) != 0;
    close(fd);
    return failed ? -1 : 0;
}

/* Say "ready", then hold the namespaces made until stdin closes (the runner opens them). */
static int hold(void) {
    if (write(1, "ready\n", 6) != 6)
        return 125;
    char byte;
    while (read(0, &byte, 1) > 0)
        ;
    return 0;
}

/* The session's user namespace, owned by ID (see the top of this file); with NET, its
 * network namespace too. */
static int make_userns(const char *id_text, int net) {
    uid_t id = (uid_t)strtoul(id_text, NULL, 10);
    if (id == 0)
        return stage_failed("--userns as uid", "0");
    if (setgroups(0, NULL) != 0 || setresgid(id, id, id) != 0 || setresuid(id, id, id) != 0)
        return stage_failed("switch to", id_text);
    if (unshare(CLONE_NEWUSER) != 0)
        return stage_failed("unshare", "CLONE_NEWUSER");
    int fd = open("/proc/sys/user/max_user_namespaces", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "0", 1) != 1)
        return stage_failed("write 0 to", "user.max_user_namespaces");
    close(fd);
    if (net && unshare(CLONE_NEWNET) != 0)
        return stage_failed("unshare", "CLONE_NEWNET");
    if (net && loopback_up() != 0)
        return stage_failed("bring up", "lo");
    return hold();
}

/* A network namespace made in the user namespace this process is in (see the top). */
static int make_netns(void) {
    if (unshare(CLONE_NEWNET) != 0)
        return stage_failed("unshare", "CLONE_NEWNET");
    if (loopback_up() != 0)
        return stage_failed("bring up", "lo");
    return hold();
}

/* The command's user (range mode): supplementary groups, gid, uid, as Docker sets them. */
static int become(const char *uid_text, const char *gid_text, const char *groups_text) {
    gid_t groups[64];
    size_t count = 0;
    if (strcmp(groups_text, "-") != 0) {
        const char *at = groups_text;
        while (*at != '\0' && count < sizeof groups / sizeof groups[0]) {
            char *end;
            groups[count++] = (gid_t)strtoul(at, &end, 10);
            at = *end == ',' ? end + 1 : end;
            if (*end != ',' && *end != '\0')
                return -1;
        }
    }
    gid_t gid = (gid_t)strtoul(gid_text, NULL, 10);
    uid_t uid = (uid_t)strtoul(uid_text, NULL, 10);
    /* No groups where setgroups is denied (a joined single-id sandbox) is what was asked
     * when the process holds none already. */
    if (setgroups(count, groups) != 0 && !(errno == EPERM && count == 0 &&
                                           getgroups(0, NULL) == 0))
        return -1;
    if (setresgid(gid, gid, gid) != 0 || setresuid(uid, uid, uid) != 0)
        return -1;
    return 0;
}

/* [--cgroup PROCS]... [--mount-ns] [--drop UID GID NPROC], overlays (mount options, target) up to "--", then
 * read-only binds (source, target) up to "--", then exec the command. */
static int stage(int argc, char **argv) {
    int i = 2, failed, exec_suid = 0, passed[3] = {-1, -1, -1}, count = 0;
    char **user = NULL;
    if (i + 1 < argc && strcmp(argv[i], "--fds") == 0) {
        char *at = argv[i + 1];
        while (count < 3 && *at != '\0') {
            passed[count++] = (int)strtol(at, &at, 10);
            if (*at == ',')
                at++;
        }
        i += 2;
    }
    while (i + 1 < argc && strcmp(argv[i], "--cgroup") == 0) {
        int fd = open(argv[i + 1], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1)
            return stage_failed("join the cgroup of", argv[i + 1]);
        close(fd);
        i += 2;
    }
    if (i < argc && strcmp(argv[i], "--mount-ns") == 0) {
        if (unshare(CLONE_NEWNS) != 0)
            return stage_failed("unshare", "CLONE_NEWNS");
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
            return stage_failed("mount --make-rprivate", "/");
        i++;
        if (i < argc && strcmp(argv[i], "--exec-suid") == 0) {
            exec_suid = 1;
            i++;
        }
        for (; i + 3 < argc && strcmp(argv[i], "--idmap") == 0; i += 4)
            if (idmapped(atoi(argv[i + 1]), argv[i + 2], argv[i + 3], exec_suid) != 0)
                return stage_failed("mount idmapped on", argv[i + 3]);
    }
    if (i + 3 < argc && strcmp(argv[i], "--drop") == 0) {
        user = argv + i + 1;
        i += 4;
    }
    for (; i + 1 < argc && strcmp(argv[i], "--") != 0; i += 2)
        if (mount("overlay", argv[i + 1], "overlay", MS_NODEV | (exec_suid ? 0 : MS_NOSUID),
                  argv[i]) != 0)
            return stage_failed("mount -t overlay on", argv[i + 1]);
    for (i++; i + 1 < argc && strcmp(argv[i], "--") != 0; i += 2)
        if (mount(argv[i], argv[i + 1], NULL, MS_BIND, NULL) != 0 ||
            mount(NULL, argv[i + 1], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL) != 0)
            return stage_failed("mount --bind -o ro on", argv[i + 1]);
    if (++i >= argc) {
        fprintf(stderr, "usage: init --stage [--cgroup PROCS]... [--mount-ns] "
                        "[--drop UID GID NPROC] [OPTIONS TARGET]... -- [SOURCE TARGET]... "
                        "-- COMMAND...\n");
        return 125;
    }
    if (user != NULL && (failed = drop(user[0], user[1], user[2])) != 0)
        return failed;
    if (argv[i][0] != '/') { /* never a PATH search on the host side */
        errno = EINVAL;
        return stage_failed("exec (not an absolute path)", argv[i]);
    }
    for (int n = 0; n < count; n++) /* out of the way of 3, 4 and 5 first */
        if ((passed[n] = fcntl(passed[n], F_DUPFD_CLOEXEC, 10)) < 0)
            return stage_failed("move the descriptor for", argv[i]);
    for (int n = 0; n < count; n++) /* dup2 clears close-on-exec */
        if (dup2(passed[n], 3 + n) != 3 + n)
            return stage_failed("place the descriptor for", argv[i]);
    execv(argv[i], argv + i);
    return stage_failed("exec", argv[i]);
}


/* --- a phase's process in a running sandbox (--join) ------------------------------------ */

static char join_error[256];

static int join_failed(const char *what, const char *which) {
    snprintf(join_error, sizeof join_error, "join: %s %s: %s", what, which, strerror(errno));
    return -1;
}

/* Whether FD is the namespace of KIND we are in (asked before any join: /proc/self then
 * still means us). */
static int same_namespace(int fd, const char *kind) {
    char path[64];
    struct stat ours, theirs;
    snprintf(path, sizeof path, "/proc/self/ns/%s", kind);
    return stat(path, &ours) == 0 && fstat(fd, &theirs) == 0 && ours.st_ino == theirs.st_ino &&
           ours.st_dev == theirs.st_dev;
}

static int same_file(int a, int b) {
    struct stat x, y;
    return fstat(a, &x) == 0 && fstat(b, &y) == 0 && x.st_ino == y.st_ino && x.st_dev == y.st_dev;
}

/* The namespaces in FDS ("USER,MNT,PID,NET,IPC,UTS,CGROUP": descriptors the runner opened
 * from the sandbox's PID 1 once it was running, so a recycled pid can never lead us
 * elsewhere), as `docker exec` enters a container's: the user namespace that owns them
 * first (so an unprivileged runner gains what the rest need), then mount, PID (for the
 * child), network, IPC, UTS and cgroup, then PID 1's own user namespace when it is nested
 * in that one (bwrap's --disable-userns). */
static int join_namespaces(const char *fds_text) {
    static const struct { const char *name; int type; } kinds[] = {
        {"mnt", CLONE_NEWNS}, {"pid", CLONE_NEWPID}, {"net", CLONE_NEWNET},
        {"ipc", CLONE_NEWIPC}, {"uts", CLONE_NEWUTS}, {"cgroup", CLONE_NEWCGROUP}};
    enum { KINDS = sizeof kinds / sizeof kinds[0] };
    int fds[KINDS], shared[KINDS], own, owner;
    char *at;
    own = (int)strtol(fds_text, &at, 10);
    for (size_t i = 0; i < KINDS; i++) {
        if (*at != ',')
            return join_failed("read the namespace descriptors", fds_text);
        fds[i] = (int)strtol(at + 1, &at, 10);
        shared[i] = same_namespace(fds[i], kinds[i].name); /* the host's network, say */
    }
    if ((owner = ioctl(fds[0], NS_GET_USERNS)) < 0)
        return join_failed("find the owner of", "its mount namespace");
    int owner_ours = same_namespace(owner, "user"), nested = !same_file(own, owner);
    if (geteuid() == 0 && setgroups(0, NULL) != 0) /* host root's groups never go in */
        return join_failed("setgroups", "0");
    if (!owner_ours && setns(owner, CLONE_NEWUSER) != 0)
        return join_failed("setns", "user");
    for (size_t i = 0; i < KINDS; i++)
        if (!shared[i] && setns(fds[i], kinds[i].type) != 0)
            return join_failed("setns", kinds[i].name);
    if (nested && setns(own, CLONE_NEWUSER) != 0)
        return join_failed("setns", "the nested user namespace");
    close(owner);
    return 0;
}

/* What the sandbox's own processes hold: the bounding set MASK (dropped while we may),
 * then -- once the user is set -- MASK effective and permitted for inner root (a non-root
 * user's setresuid cleared them), no ambient or inheritable ones. */
static int drop_bounding(unsigned long long mask) {
    for (int cap = 0; cap < 64; cap++)
        if (!(mask & (1ULL << cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 &&
            errno != EINVAL)
            return -1;
    return prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

static int keep_caps(unsigned long long mask) {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (geteuid() == 0) {
        data[0].effective = data[0].permitted = (__u32)mask;
        data[1].effective = data[1].permitted = (__u32)(mask >> 32);
    }
    return (int)syscall(SYS_capset, &header, data);
}

static struct sock_filter seccomp_program[BPF_MAXINSNS];
static unsigned short seccomp_length = 0;

static int read_seccomp(int fd) {
    size_t got = 0;
    ssize_t n;
    char *at = (char *)seccomp_program;
    while ((n = read(fd, at + got, sizeof seccomp_program - got)) > 0)
        got += (size_t)n;
    close(fd);
    if (n < 0 || got == 0 || got % sizeof seccomp_program[0] != 0)
        return -1;
    seccomp_length = (unsigned short)(got / sizeof seccomp_program[0]);
    return 0;
}

static int load_seccomp(void) {
    struct sock_fprog program = {seccomp_length, seccomp_program};
    return seccomp_length == 0 ? 0 : prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program);
}

static int remove_tree(int parent, const char *name, int depth);

/* NAME in the folder DST made ready for a copied entry: a folder kept when KEEP_FOLDER,
 * anything else there removed (no link followed). */
static int make_way(int dst, const char *name, int keep_folder) {
    struct stat st;
    if (fstatat(dst, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return errno == ENOENT ? 0 : -1;
    if (S_ISDIR(st.st_mode) && keep_folder)
        return 0;
    return remove_tree(dst, name, 0);
}

/* The folder SRC copied into DST (both open), owned by UID:GID, modes kept but for setuid
 * and setgid bits; links copied as links, anything else skipped; no link followed. An
 * entry of DST in the way of a copied one is replaced, a folder merged into. */
static int copy_tree(int src, int dst, uid_t uid, gid_t gid, int depth) {
    int listing = dup(src);
    DIR *dir = listing < 0 ? NULL : fdopendir(listing);
    struct dirent *entry;
    int failed = dir == NULL || depth > 64;
    while (!failed && (entry = readdir(dir)) != NULL) {
        const char *name = entry->d_name;
        struct stat st;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
            continue;
        if (fstatat(src, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            failed = 1;
        } else if (S_ISDIR(st.st_mode)) {
            int from = openat(src, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC), to;
            failed = from < 0 || make_way(dst, name, 1) != 0 ||
                     (mkdirat(dst, name, 0700) != 0 && errno != EEXIST) ||
                     (to = openat(dst, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0;
            if (!failed) {
                failed = copy_tree(from, to, uid, gid, depth + 1) != 0 ||
                         fchown(to, uid, gid) != 0 || fchmod(to, st.st_mode & 01777) != 0;
                close(to);
            }
            if (from >= 0)
                close(from);
        } else if (S_ISREG(st.st_mode)) {
            int from = openat(src, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
            int to = from < 0 || make_way(dst, name, 0) != 0 ? -1 : openat(dst, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
                                                   O_CLOEXEC, 0600);
            char buffer[65536];
            ssize_t n = 0;
            failed = to < 0;
            while (!failed && (n = read(from, buffer, sizeof buffer)) > 0)
                for (ssize_t done = 0, w; !failed && done < n; done += w)
                    failed = (w = write(to, buffer + done, (size_t)(n - done))) <= 0;
            failed = failed || n < 0 || fchown(to, uid, gid) != 0 ||
                     fchmod(to, st.st_mode & 0777) != 0;
            if (to >= 0)
                close(to);
            if (from >= 0)
                close(from);
        } else if (S_ISLNK(st.st_mode)) {
            char target[4096];
            ssize_t n = readlinkat(src, name, target, sizeof target - 1);
            failed = n < 0 || make_way(dst, name, 0) != 0;
            if (!failed) {
                target[n] = '\0';
                failed = symlinkat(target, dst, name) != 0 ||
                         fchownat(dst, name, uid, gid, AT_SYMLINK_NOFOLLOW) != 0;
            }
        }
    }
    if (dir != NULL)
        closedir(dir);
    else if (listing >= 0)
        close(listing);
    return failed ? -1 : 0;
}

/* DEST's missing parent folders made (0755, this process's: inner root's), as `docker cp`
 * makes them; links on the way are the sandbox's own (this runs inside it). */
static int make_parents(const char *dest) {
    char path[4096];
    if (strlen(dest) >= sizeof path)
        return -1;
    strcpy(path, dest);
    for (char *at = path + 1; (at = strchr(at, '/')) != NULL; at++) {
        *at = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return -1;
        *at = '/';
    }
    return 0;
}

/* NAME in the folder PARENT removed with everything in it (no link followed): a folder of
 * the image's own, which an overlay without redirect_dir cannot rename (EXDEV). */
static int remove_tree(int parent, const char *name, int depth) {
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return unlinkat(parent, name, 0);
    int listing = dup(fd);
    DIR *dir = listing < 0 ? NULL : fdopendir(listing);
    struct dirent *entry;
    int failed = dir == NULL || depth > 64;
    while (!failed && (entry = readdir(dir)) != NULL)
        if (strcmp(entry->d_name, ".") != 0 && strcmp(entry->d_name, "..") != 0)
            failed = remove_tree(fd, entry->d_name, depth + 1) != 0;
    if (dir != NULL)
        closedir(dir);
    else if (listing >= 0)
        close(listing);
    close(fd);
    return failed ? -1 : unlinkat(parent, name, AT_REMOVEDIR);
}

/* --copy-in: DEST's parents made, an empty folder at DEST removed and anything else there
 * moved aside (a folder of the image's own, which cannot be, removed), then a fresh DEST
 * holding SRC's tree (or, SRC a regular file, its bytes). */
static int copy_in(int src, const char *dest, const char *uid_text, const char *gid_text) {
    uid_t uid = (uid_t)strtoul(uid_text, NULL, 10);
    gid_t gid = (gid_t)strtoul(gid_text, NULL, 10);
    char aside[256];
    struct stat source;
    const char *base = strrchr(dest, '/');
    snprintf(aside, sizeof aside, "/.trialledger-replaced-%s-%ld", base ? base + 1 : dest,
             (long)getpid());
    if (fstat(src, &source) != 0 || make_parents(dest) != 0)
        return -1;
    if (rmdir(dest) != 0 && rename(dest, aside) != 0 && errno != ENOENT &&
        (errno != EXDEV || remove_tree(AT_FDCWD, dest, 0) != 0))
        return -1;
    if (S_ISREG(source.st_mode)) {
        /* a file (a separate verifier's artifact): its folder 0777, as Harbor's
         * `mkdir -p PARENT && chmod 777 PARENT` before its copy leaves it */
        char parent[4096];
        snprintf(parent, sizeof parent, "%s", dest);
        char *cut = strrchr(parent, '/');
        if (cut != NULL && cut != parent) {
            *cut = '\0';
            if (chmod(parent, 0777) != 0)
                return -1;
        }
        int to = open(dest, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        char buffer[65536];
        ssize_t n = 0;
        int failed = to < 0;
        while (!failed && (n = read(src, buffer, sizeof buffer)) > 0)
            for (ssize_t done = 0, w; !failed && done < n; done += w)
                failed = (w = write(to, buffer + done, (size_t)(n - done))) <= 0;
        failed = failed || n < 0 || fchown(to, uid, gid) != 0 ||
                 fchmod(to, source.st_mode & 0777) != 0;
        if (to >= 0)
            close(to);
        return failed ? -1 : 0;
    }
    if (mkdir(dest, 0700) != 0)
        return -1;
    int to = open(dest, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (to < 0)
        return -1;
    /* DEST 0755, or more when SRC's folder has more (as `docker cp` gives a folder its
     * source's mode) */
    int failed = copy_tree(src, to, uid, gid, 0) != 0 || fchown(to, uid, gid) != 0 ||
                 fchmod(to, (source.st_mode & 01777) | 0755) != 0;
    close(to);
    return failed ? -1 : 0;
}

/* --merge-in: SRC's tree copied into the folder DEST (made, with its parents, when
 * missing; a link or file at DEST replaced by a folder), merged over what is there. */
static int merge_in(int src, const char *dest, const char *uid_text, const char *gid_text) {
    uid_t uid = (uid_t)strtoul(uid_text, NULL, 10);
    gid_t gid = (gid_t)strtoul(gid_text, NULL, 10);
    struct stat there;
    if (make_parents(dest) != 0)
        return -1;
    if (lstat(dest, &there) == 0 && !S_ISDIR(there.st_mode) && unlink(dest) != 0)
        return -1;
    if (mkdir(dest, 0755) != 0 && errno != EEXIST)
        return -1;
    int to = open(dest, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (to < 0)
        return -1;
    int failed = copy_tree(src, to, uid, gid, 0) != 0;
    close(to);
    return failed ? -1 : 0;
}

/* --clear: everything in the folder DEST removed, no link followed (a link or file at DEST
 * removed itself; nothing there: nothing to do). */
static int clear_folder(const char *dest) {
    struct stat there;
    if (lstat(dest, &there) != 0)
        return errno == ENOENT ? 0 : -1;
    if (!S_ISDIR(there.st_mode))
        return unlink(dest);
    int fd = open(dest, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int listing = fd < 0 ? -1 : dup(fd);
    DIR *dir = listing < 0 ? NULL : fdopendir(listing);
    struct dirent *entry;
    int failed = dir == NULL;
    while (!failed && (entry = readdir(dir)) != NULL)
        if (strcmp(entry->d_name, ".") != 0 && strcmp(entry->d_name, "..") != 0)
            failed = remove_tree(fd, entry->d_name, 0) != 0;
    if (dir != NULL)
        closedir(dir);
    else if (listing >= 0)
        close(listing);
    if (fd >= 0)
        close(fd);
    return failed ? -1 : 0;
}

/* After the command ended: its process group SIGKILLed, and whether it is gone within 2 s
 * (what the command detached from it, a daemon, is not in it and keeps running). A daemon
 * detaches after its parent has returned (fork, the parent exits, the child calls setsid:
 * busybox's httpd, nginx), so the group is given 200 ms to empty itself first. */
static int group_gone(pid_t group) {
    for (int tries = 0; tries < 20 && !(kill(-group, 0) != 0 && errno == ESRCH); tries++)
        usleep(10000);
    kill(-group, SIGKILL);
    for (int tries = 0; tries < 200; tries++) {
        if (kill(-group, 0) != 0 && errno == ESRCH)
            return 1;
        usleep(10000);
    }
    return 0;
}

/* The command's environment from FD (see --env-fd): an array for `environ`, or NULL. */
static char **read_env(int fd) {
    char *data = malloc(ENV_MAX + 1);
    char **entries = malloc(sizeof(char *) * (ENV_ENTRIES_MAX + 1));
    size_t length = 0, count = 0;
    if (data == NULL || entries == NULL)
        return NULL;
    for (;;) {
        ssize_t got = read(fd, data + length, ENV_MAX + 1 - length);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return NULL;
        if (got == 0)
            break;
        length += (size_t)got;
        if (length > ENV_MAX) {
            errno = E2BIG;
            return NULL;
        }
    }
    close(fd);
    for (size_t at = 0; at < length;) {
        char *end = memchr(data + at, '\0', length - at);
        if (end == NULL || count == ENV_ENTRIES_MAX || strchr(data + at, '=') == NULL) {
            errno = EINVAL;
            return NULL;
        }
        entries[count++] = data + at;
        at = (size_t)(end - data) + 1;
    }
    entries[count] = NULL;
    return entries;
}

int main(int argc, char **argv) {
    int status_fd = -1, i;
    if (argc >= 2 && strcmp(argv[1], "--stage") == 0)
        return stage(argc, argv);
    if (argc == 3 && strcmp(argv[1], "--userns") == 0)
        return make_userns(argv[2], 0);
    if (argc == 4 && strcmp(argv[1], "--userns") == 0 && strcmp(argv[3], "--net") == 0)
        return make_userns(argv[2], 1);
    if (argc == 2 && strcmp(argv[1], "--netns") == 0)
        return make_netns();
    const char *oom = NULL;
    char **user = NULL;
    unsigned long deadline_ms = 0;
    char **command = NULL;
    const char *join_fds = NULL, *chdir_to = NULL, *cgroups[8];
    int cgroup_count = 0, seccomp_fd = -1, copy_src = -1, env_fd = -1, new_privs = 0, merge = 0;
    int gate_fd = -1;
    char **env = NULL;
    unsigned long long caps = 0;
    unsigned long nproc = 0;
    char **copy = NULL;
    const char *clear = NULL;
    if (argc == 2 && strcmp(argv[1], "--probe") == 0)
        return 0; /* the liveness probe: a process ran in the sandbox's workdir */
    if (argc == 2 && strcmp(argv[1], "--idle") == 0)
        for (;;) /* a container's command when its image has no ENTRYPOINT */
            pause();
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--status-fd") == 0 && i + 1 < argc)
            status_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--oom-score-adj") == 0 && i + 1 < argc)
            oom = argv[++i];
        else if (strcmp(argv[i], "--user") == 0 && i + 3 < argc) {
            user = argv + i + 1;
            i += 3;
        } else if (strcmp(argv[i], "--deadline-fd") == 0 && i + 1 < argc)
            deadline_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--lifeline-fd") == 0 && i + 1 < argc)
            lifeline_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--gate-fd") == 0 && i + 1 < argc)
            gate_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--deadline-ms") == 0 && i + 1 < argc)
            deadline_ms = strtoul(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--env-fd") == 0 && i + 1 < argc)
            env_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--join-fds") == 0 && i + 1 < argc)
            join_fds = argv[++i];
        else if (strcmp(argv[i], "--cgroup") == 0 && i + 1 < argc && cgroup_count < 8)
            cgroups[cgroup_count++] = argv[++i];
        else if (strcmp(argv[i], "--caps") == 0 && i + 1 < argc)
            caps = strtoull(argv[++i], NULL, 16);
        else if (strcmp(argv[i], "--seccomp-fd") == 0 && i + 1 < argc)
            seccomp_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--nproc") == 0 && i + 1 < argc)
            nproc = strtoul(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--chdir") == 0 && i + 1 < argc)
            chdir_to = argv[++i];
        else if (strcmp(argv[i], "--new-privs") == 0)
            new_privs = 1;
        else if ((strcmp(argv[i], "--copy-in") == 0 || strcmp(argv[i], "--merge-in") == 0) &&
                 i + 4 < argc) {
            merge = strcmp(argv[i], "--merge-in") == 0;
            copy_src = atoi(argv[i + 1]);
            copy = argv + i + 2;
            i += 4;
        }
        else if (strcmp(argv[i], "--clear") == 0 && i + 1 < argc)
            clear = argv[++i];
        else if (strcmp(argv[i], "--") == 0) {
            command = argv + i + 1;
            break;
        }
    }
    if ((command == NULL || command[0] == NULL) && copy == NULL && clear == NULL) {
        fprintf(stderr, "usage: init --status-fd N [--oom-score-adj K] [--user UID GID GROUPS] "
                        "-- COMMAND...\n");
        return 2;
    }
    if (oom != NULL)
        raise_oom_score(oom);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (status_fd >= 0)
        fcntl(status_fd, F_SETFD, FD_CLOEXEC);
    if (deadline_fd >= 0) /* the runner's alone: never the command's */
        fcntl(deadline_fd, F_SETFD, FD_CLOEXEC);
    if (lifeline_fd >= 0)
        fcntl(lifeline_fd, F_SETFD, FD_CLOEXEC);
    if (gate_fd >= 0)
        fcntl(gate_fd, F_SETFD, FD_CLOEXEC);
    if (env_fd >= 0 && (env = read_env(env_fd)) == NULL) {
        char line[128];
        snprintf(line, sizeof line, "{\"spawn_error\": \"the environment: %s\"}\n",
                 strerror(errno));
        report(status_fd, line);
        return 127;
    }
    if (join_fds != NULL) {
        for (int c = 0; c < cgroup_count; c++) {
            int fd = open(cgroups[c], O_WRONLY | O_CLOEXEC);
            if (fd < 0 || write(fd, "0", 1) != 1) {
                join_failed("join the cgroup of", cgroups[c]);
                goto not_joined;
            }
            close(fd);
        }
        if (seccomp_fd >= 0 && read_seccomp(seccomp_fd) != 0) {
            join_failed("read the seccomp program", "");
            goto not_joined;
        }
        if (join_namespaces(join_fds) != 0) {
        not_joined:;
            char line[400];
            for (char *c = join_error; *c != '\0'; c++)
                if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20)
                    *c = '\'';
            snprintf(line, sizeof line, "{\"spawn_error\": \"%s\"}\n", join_error);
            report(status_fd, line);
            return 127;
        }
    }

    /* A close-on-exec pipe tells an exec failure from a started agent. */
    int spawn[2];
    if (pipe2(spawn, O_CLOEXEC) != 0) {
        report(status_fd, "{\"spawn_error\": \"pipe failed\"}\n");
        return 127;
    }
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    pid_t pid = fork();
    if (pid == 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        setpgid(0, 0);
        if (gate_fd >= 0) { /* a compose service's: its command waits until the runner has
                             * made its links (a byte; end-of-file: it never starts) */
            char go;
            ssize_t got;
            do
                got = read(gate_fd, &go, 1);
            while (got < 0 && errno == EINTR);
            if (got != 1)
                _exit(127);
            close(gate_fd);
        }
        /* Nothing of ours past stdio reaches the command (bwrap's user namespace fd, say). */
        syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
        if (join_fds != NULL) /* in the sandbox's PID namespace: out of its processes' reach */
            prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        struct rlimit limit = {nproc, nproc};
        int early = join_fds != NULL && new_privs; /* the filter while we hold CAP_SYS_ADMIN */
        if ((join_fds == NULL || drop_bounding(caps) == 0) &&
            (!early || copy != NULL || clear != NULL || load_seccomp() == 0) &&
            (user == NULL || become(user[0], user[1], user[2]) == 0) &&
            (join_fds == NULL ||
             (keep_caps(caps) == 0 &&
              (new_privs || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0) &&
              (nproc == 0 || setrlimit(RLIMIT_NPROC, &limit) == 0) &&
              (chdir_to == NULL || chdir(chdir_to) == 0)))) {
            if (clear != NULL)
                _exit(clear_folder(clear) == 0 ? 0 : 1);
            if (copy != NULL)
                _exit((merge ? merge_in : copy_in)(copy_src, copy[0], copy[1], copy[2]) == 0
                      ? 0 : 1);
            if (env != NULL) /* the command's PATH finds it, as in a container */
                environ = env;
            if (early || load_seccomp() == 0)
                execvp(command[0], command);
        }
        int error = errno;
        (void)!write(spawn[1], &error, sizeof error);
        _exit(127);
    }
    close(spawn[1]);
    if (gate_fd >= 0)
        close(gate_fd);
    if (pid < 0) {
        report(status_fd, "{\"spawn_error\": \"fork failed\"}\n");
        return 127;
    }
    child_pid = pid;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = forward;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGINT, &action, NULL);
    sigaction(SIGHUP, &action, NULL);
    sigaction(SIGUSR1, &action, NULL);
    if (deadline_fd >= 0 || lifeline_fd >= 0) {
        action.sa_handler = io_ready;
        sigaction(SIGIO, &action, NULL);
    }
    if (lifeline_fd >= 0) {
        fcntl(lifeline_fd, F_SETOWN, getpid());
        fcntl(lifeline_fd, F_SETFL, O_NONBLOCK | O_ASYNC);
    }
    if (deadline_fd >= 0) {
        action.sa_handler = deadline_passed;
        sigaction(SIGALRM, &action, NULL);
        fcntl(deadline_fd, F_SETOWN, getpid());
        fcntl(deadline_fd, F_SETFL, O_NONBLOCK | O_ASYNC);
        set_deadline(deadline_ms);
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    io_ready(SIGIO); /* what was written (or closed) before O_ASYNC took effect */

    int error = 0;
    ssize_t got;
    do
        got = read(spawn[0], &error, sizeof error);
    while (got < 0 && errno == EINTR);
    close(spawn[0]);
    if (got == (ssize_t)sizeof error) {
        char line[256];
        snprintf(line, sizeof line, "{\"spawn_error\": \"%s: %s\"}\n",
                 strchr(command[0], '"') ? "the command" : command[0], strerror(error));
        waitpid(pid, NULL, 0);
        report(status_fd, line);
        return 127;
    }

    /* Reap everything (orphans reparent to PID 1) until the agent itself ends. */
    for (;;) {
        int wstatus;
        pid_t done = wait(&wstatus);
        if (done < 0) {
            if (errno == EINTR)
                continue;
            report(status_fd, "{\"spawn_error\": \"the agent vanished\"}\n");
            return 127;
        }
        if (done != pid)
            continue;
        char line[64];
        const char *gone = join_fds == NULL ? "" :
                           group_gone(pid) ? ", \"group_gone\": true" : ", \"group_gone\": false";
        if (WIFSIGNALED(wstatus))
            snprintf(line, sizeof line, "{\"signal\": %d%s}\n", WTERMSIG(wstatus), gone);
        else
            snprintf(line, sizeof line, "{\"exit\": %d%s}\n", WEXITSTATUS(wstatus), gone);
        report(status_fd, line);
        if (lifeline_fd >= 0) /* a container's PID 1 (runc): its exit is its command's, as
                                 Docker reports a container's (a compose service's end) */
            return WIFSIGNALED(wstatus) ? 128 + WTERMSIG(wstatus) : WEXITSTATUS(wstatus);
        return 0;
    }
}
