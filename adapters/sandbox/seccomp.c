/* trialledger's seccomp filter for range mode (SPEC §15): at least what Docker's default
 * profile refuses to a container without CAP_SYS_ADMIN, for the x86_64, x86 and x32 ABIs.
 * Everything else is allowed (the default action), as in Docker's profile, whose allow
 * list is the kernel's syscalls minus these.
 *
 * It writes the filter as classic BPF to stdout, which the runner keeps beside the init
 * and hands to bwrap (--seccomp FD) for every range-mode spawn.
 *
 * Built by `trialledger setup` or on first use, against static libseccomp
 * (Debian libseccomp-dev): gcc -static -O2 -o seccomp seccomp.c -lseccomp
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <seccomp.h>
#include <stdio.h>
#include <unistd.h>

/* Refused with EPERM, as Docker refuses them. */
static const char *const denied[] = {
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root",
    "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "move_mount", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "create_module", "swapon", "swapoff", "reboot", "acct", "settimeofday", "stime",
    "clock_settime", "clock_settime64", "clock_adjtime", "clock_adjtime64", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "quotactl", "quotactl_fd",
    "nfsservctl", "vhangup", "sysfs", "_sysctl", "uselib", "ustat", "get_kernel_syms",
    "query_module", "iopl", "ioperm", "syslog", "kcmp", "process_vm_readv",
    "process_vm_writev",
};

/* New namespaces of any kind through clone(2) (Docker: clone without these flags only). */
static const unsigned long namespace_flags[] = {
    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
    CLONE_NEWCGROUP,
};

int main(void) {
    scmp_filter_ctx filter = seccomp_init(SCMP_ACT_ALLOW);
    if (filter == NULL)
        return 1;
    if (seccomp_arch_add(filter, SCMP_ARCH_X86) != 0 || seccomp_arch_add(filter, SCMP_ARCH_X32) != 0) {
        fprintf(stderr, "seccomp: cannot add the x86 and x32 ABIs\n");
        return 1;
    }
    for (size_t i = 0; i < sizeof denied / sizeof denied[0]; i++) {
        int number = seccomp_syscall_resolve_name(denied[i]);
        if (number == __NR_SCMP_ERROR)
            continue; /* a name this libseccomp does not know on any ABI */
        if (seccomp_rule_add(filter, SCMP_ACT_ERRNO(EPERM), number, 0) != 0) {
            fprintf(stderr, "seccomp: cannot refuse %s\n", denied[i]);
            return 1;
        }
    }
    /* clone(2) with any namespace flag (flags are the first argument on x86): one rule
     * per flag, since a rule can only say "these bits are set". */
    for (size_t i = 0; i < sizeof namespace_flags / sizeof namespace_flags[0]; i++) {
        unsigned long flag = namespace_flags[i];
        if (seccomp_rule_add(filter, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1,
                             SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag)) != 0) {
            fprintf(stderr, "seccomp: cannot filter clone\n");
            return 1;
        }
    }
    /* clone3's flags live in memory the filter cannot read: ENOSYS, so libc falls back to
     * clone(2), which is filtered (as Docker does). */
    if (seccomp_rule_add(filter, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0) != 0) {
        fprintf(stderr, "seccomp: cannot refuse clone3\n");
        return 1;
    }
    if (seccomp_export_bpf(filter, STDOUT_FILENO) != 0) {
        fprintf(stderr, "seccomp: cannot write the filter\n");
        return 1;
    }
    seccomp_release(filter);
    return 0;
}
