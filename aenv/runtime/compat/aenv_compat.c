/*
 * aenv compat shim, preloaded into glibc programs inside gVisor sandboxes (via /etc/ld.so.preload).
 *
 * The runsc release Debian ships (20221219) rejects statx() calls that carry AT_NO_AUTOMOUNT with
 * EINVAL, and coreutils (ls, stat, cp, ...) always passes it. A sandbox has no automount points,
 * so dropping the flag changes nothing else. Only libc's syscall() is used, so the shim works
 * with any glibc version an image brings.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

struct statx;

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}
