/* Runs a command under a seccomp filter that answers the PROCMAP_QUERY ioctl (Linux 6.11+) with
 * ENOTTY, as kernels before 6.11 do: .ci/kernels uses it to stand in for Linux 6.7-6.10 (uffd
 * WP_ASYNC and PAGEMAP_SCAN, no PROCMAP_QUERY) on a newer kernel, since Debian's archive has no
 * kernel from 6.2 to 6.11.  Every other system call passes; the filter is inherited by children.
 *
 * Usage: noprocmap COMMAND [ARG...] */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

/* _IOWR('f', 17, struct procmap_query), a 104-byte struct: the value in
 * crates/emuhost/src/sys/linux/uapi.rs. */
#define PROCMAP_QUERY 0xc0686611u

#define ARG_LO(n) (offsetof(struct seccomp_data, args[n]))
#define ARG_HI(n) (offsetof(struct seccomp_data, args[n]) + 4)

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s COMMAND [ARG...]\n", argv[0]);
        return 2;
    }
    struct sock_filter filter[] = {
        /* Another architecture (a 32-bit call): let it pass, it cannot be PROCMAP_QUERY here. */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 0, 7),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_ioctl, 0, 5),
        /* The request is an unsigned long: both halves must match. */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG_LO(1)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, PROCMAP_QUERY, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG_HI(1)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOTTY & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof(filter) / sizeof(filter[0]), .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        perror("noprocmap: PR_SET_NO_NEW_PRIVS");
        return 126;
    }
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) {
        perror("noprocmap: seccomp");
        return 126;
    }
    execvp(argv[1], argv + 1);
    fprintf(stderr, "noprocmap: %s: %s\n", argv[1], strerror(errno));
    return 127;
}
