/* Docker's seccomp profile as classic BPF, for the processes trialledger joins into a
 * container that runc started (SPEC §16): the same filter runc loads for the container's
 * PID 1 from config.json's `linux.seccomp`, so a phase's process is refused exactly what
 * the container is.
 *
 * It reads the profile the runner converted (oci.py's `docker_seccomp`, one item a line)
 * on stdin and writes the filter to stdout:
 *
 *     default ACTION ERRNO
 *     arch NAME                (libseccomp's: x86_64, x86, x32, aarch64, ...)
 *     rule ACTION ERRNO SYSCALL NARGS [INDEX OP VALUE VALUE_TWO]...
 *
 * ACTION is ALLOW, ERRNO, KILL, KILL_PROCESS, TRAP or LOG; OP one of libseccomp's
 * comparisons (EQ, NE, LT, LE, GT, GE, MASKED_EQ). A syscall this libseccomp does not
 * know is skipped, as runc skips it.
 *
 * Built on first use against static libseccomp (Debian libseccomp-dev):
 * gcc -static -O2 -o ocifilter ocifilter.c -lseccomp
 */
#include <errno.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_ARGS 6

static int action_of(const char *name, unsigned int code, uint32_t *action) {
    if (strcmp(name, "ALLOW") == 0)
        *action = SCMP_ACT_ALLOW;
    else if (strcmp(name, "ERRNO") == 0)
        *action = SCMP_ACT_ERRNO(code);
    else if (strcmp(name, "KILL") == 0)
        *action = SCMP_ACT_KILL;
    else if (strcmp(name, "KILL_PROCESS") == 0)
        *action = SCMP_ACT_KILL_PROCESS;
    else if (strcmp(name, "TRAP") == 0)
        *action = SCMP_ACT_TRAP;
    else if (strcmp(name, "LOG") == 0)
        *action = SCMP_ACT_LOG;
    else
        return -1;
    return 0;
}

static int op_of(const char *name, enum scmp_compare *op) {
    static const struct { const char *name; enum scmp_compare op; } ops[] = {
        {"EQ", SCMP_CMP_EQ}, {"NE", SCMP_CMP_NE}, {"LT", SCMP_CMP_LT}, {"LE", SCMP_CMP_LE},
        {"GT", SCMP_CMP_GT}, {"GE", SCMP_CMP_GE}, {"MASKED_EQ", SCMP_CMP_MASKED_EQ}};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (strcmp(name, ops[i].name) == 0) {
            *op = ops[i].op;
            return 0;
        }
    return -1;
}

static int failed(int line, const char *why) {
    fprintf(stderr, "ocifilter: line %d: %s\n", line, why);
    return 1;
}

int main(void) {
    char word[64], action_name[32], name[64];
    unsigned int code;
    uint32_t action;
    scmp_filter_ctx filter = NULL;
    int line = 0;
    while (scanf("%63s", word) == 1) {
        line++;
        if (strcmp(word, "default") == 0) {
            if (filter != NULL || scanf("%31s %u", action_name, &code) != 2 ||
                action_of(action_name, code, &action) != 0)
                return failed(line, "a bad default");
            if ((filter = seccomp_init(action)) == NULL)
                return failed(line, "seccomp_init failed");
        } else if (filter == NULL) {
            return failed(line, "the default comes first");
        } else if (strcmp(word, "arch") == 0) {
            if (scanf("%63s", name) != 1)
                return failed(line, "a bad arch");
            uint32_t arch = seccomp_arch_resolve_name(name);
            int added = arch == 0 ? -1 : seccomp_arch_add(filter, arch);
            if (added != 0 && added != -EEXIST)
                return failed(line, "an architecture libseccomp cannot add");
        } else if (strcmp(word, "rule") == 0) {
            int count;
            struct scmp_arg_cmp args[MAX_ARGS];
            if (scanf("%31s %u %63s %d", action_name, &code, name, &count) != 4 ||
                action_of(action_name, code, &action) != 0 || count < 0 || count > MAX_ARGS)
                return failed(line, "a bad rule");
            for (int i = 0; i < count; i++) {
                char op_name[16];
                unsigned int index;
                unsigned long long value, two;
                if (scanf("%u %15s %llu %llu", &index, op_name, &value, &two) != 4 ||
                    op_of(op_name, &args[i].op) != 0)
                    return failed(line, "a bad argument condition");
                args[i].arg = index;
                args[i].datum_a = value;
                args[i].datum_b = two;
            }
            int number = seccomp_syscall_resolve_name(name);
            if (number == __NR_SCMP_ERROR)
                continue; /* unknown here: skipped, as runc skips it */
            if (seccomp_rule_add_array(filter, action, number, (unsigned int)count, args) != 0)
                return failed(line, name);
        } else {
            return failed(line, "an unknown item");
        }
    }
    if (filter == NULL)
        return failed(line, "no default action");
    if (seccomp_export_bpf(filter, STDOUT_FILENO) != 0)
        return failed(line, "seccomp_export_bpf failed");
    seccomp_release(filter);
    return 0;
}
