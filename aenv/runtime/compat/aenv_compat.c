/*
 * aenv compat shim, preloaded into glibc programs inside gVisor sandboxes (via /etc/ld.so.preload).
 *
 * Built with AENV_STATX_SHIM for runsc 20221219 (Debian bookworm's), which rejects statx() calls
 * that carry AT_NO_AUTOMOUNT with EINVAL, while coreutils (ls, stat, cp, ...) always passes it. A
 * sandbox has no automount points, so dropping the flag changes nothing else; newer runsc takes
 * the flag. It also mends close_range() and TIOCGPTPEER for runsc 20240729 (below), and keeps user
 * xattrs (below).
 * Only libc's syscall() is used, so the shim works with any glibc version an image brings.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <unistd.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

#ifndef SYS_close_range
#define SYS_close_range 436 /* the same number on every architecture */
#endif

/*
 * close_range(first, ~0U, flags): glibc 2.34's way to close (or mark close-on-exec) every
 * descriptor from `first` on, which GLib's spawn does in every child it starts (each GTK or XFCE
 * program launching another: the session its window manager and panel, gtk-launch its app).
 * runsc 20240729 reads `last` as a signed number and refuses ~0U with EINVAL, which GLib reports
 * as "Failed to close file descriptor for child process". No process has descriptors past
 * INT_MAX, so `last` is capped there; the call is the same on any kernel.
 */
int close_range(unsigned int first, unsigned int last, int flags) {
    if (last > 0x7fffffffU)
        last = 0x7fffffffU;
    return (int)syscall(SYS_close_range, first, last, flags);
}

#ifndef TIOCGPTPEER
#define TIOCGPTPEER 0x5441
#endif

/*
 * Pseudo-terminals as VTE (xfce4-terminal, GNOME's terminals) opens them, two calls runsc
 * 20240729 does not know (ENOTTY), each answered here only when the kernel refused it:
 *
 * - ioctl(master, TIOCGPTPEER, flags), Linux 4.13's way to open the other end: VTE gives up
 *   unless the answer is EINVAL, so the peer is opened the older way, by its number (TIOCGPTN)
 *   under /dev/pts, as glibc's openpty() does.
 * - ioctl(master, TIOCPKT, &on), packet mode, without which VTE does not start: each read() of
 *   the master then begins with a status byte. The shim keeps the mode per descriptor and puts a
 *   0 (TIOCPKT_DATA: plain data) before what each read() of such a master returns; stop/start
 *   notices (^S/^Q) are never sent, which VTE only uses to show a paused terminal.
 *
 * Every other request goes to the kernel unchanged.
 */
#define PACKET_FDS 4096
static unsigned char packet_mode[PACKET_FDS / 8];

static int in_packet_mode(int fd) {
    return fd >= 0 && fd < PACKET_FDS && ((packet_mode[fd / 8] >> (fd % 8)) & 1);
}

static void set_packet_mode(int fd, int on) {
    if (fd < 0 || fd >= PACKET_FDS)
        return;
    if (on)
        packet_mode[fd / 8] |= (unsigned char)(1u << (fd % 8));
    else
        packet_mode[fd / 8] &= (unsigned char)~(1u << (fd % 8));
}

static int open_peer(int master, int flags) {
    unsigned int number;
    if (syscall(SYS_ioctl, master, TIOCGPTN, &number) != 0)
        return -1;
    char path[32] = "/dev/pts/";
    char digits[12];
    int n = 0, at = 9;
    do {
        digits[n++] = (char)('0' + number % 10);
        number /= 10;
    } while (number);
    while (n)
        path[at++] = digits[--n];
    path[at] = 0;
    return (int)syscall(SYS_openat, AT_FDCWD, path, flags);
}

int ioctl(int fd, unsigned long request, ...) {
    va_list ap;
    va_start(ap, request);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    long ret = syscall(SYS_ioctl, fd, request, arg);
    if (ret != -1 || errno != ENOTTY)
        return (int)ret;
    if (request == TIOCGPTPEER)
        return open_peer(fd, (int)(long)arg);
    if (request == TIOCPKT && fd >= 0 && fd < PACKET_FDS) {
        unsigned int number;
        if (arg == NULL || syscall(SYS_ioctl, fd, TIOCGPTN, &number) != 0) {
            errno = ENOTTY;  /* not a master: as the kernel said */
            return -1;
        }
        set_packet_mode(fd, *(const int *)arg != 0);
        return 0;
    }
    return (int)ret;
}

ssize_t read(int fd, void *buf, size_t count) {
    if (count < 2 || !in_packet_mode(fd))
        return syscall(SYS_read, fd, buf, count);
    ssize_t got = syscall(SYS_read, fd, (char *)buf + 1, count - 1);
    if (got <= 0)
        return got; /* an error, or the end: as it was */
    ((char *)buf)[0] = 0; /* TIOCPKT_DATA */
    return got + 1;
}

int close(int fd) {
    if (in_packet_mode(fd))
        set_packet_mode(fd, 0);
    return (int)syscall(SYS_close, fd);
}

#ifdef AENV_STATX_SHIM
struct statx;

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}
#endif

/*
 * User xattrs. runsc keeps none on the sandbox's root file system (its tmpfs mounts keep them).
 * For a user.* name on a file system other than a tmpfs the guest agent keeps them in its store
 * (aenv/guest/xattrs.py describes the protocol): the file goes to it as an O_PATH descriptor with
 * the caller's ids, and the agent applies the kernel's rules. listxattr adds the agent's names to
 * the file system's, when the agent keeps any. Without the agent (or in it: PID 1) such a call
 * fails with EOPNOTSUPP, as the file system keeps nothing. System calls only, through syscall():
 * any glibc.
 */
#define XATTR_SOCKET "aenv-xattr"
#define XATTRS_KEPT "/dev/shm/.aenv-user-xattrs" /* there while the agent keeps any */
#define TMPFS_MAGIC 0x01021994

struct xattr_call {
    unsigned char op, pad[3];
    uint32_t flags, size;
    uint16_t name_len, pad2;
};

static int user_xattr(const char *name) {
    return name && name[0] == 'u' && name[1] == 's' && name[2] == 'e' && name[3] == 'r' && name[4] == '.';
}

static size_t text_length(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

static void close_keeping_errno(int fd) {
    int saved = errno;
    syscall(SYS_close, fd);
    errno = saved;
}

/* The agent's result for the file open as `fd` (>= 0, or -1 with errno); -1 with `fallback` as
 * errno when the agent cannot be asked. */
static long ask_agent(unsigned char op, int fd, const char *name, const void *value, size_t value_len, int flags,
                      void *out, size_t size, int fallback) {
    size_t name_len = name ? text_length(name) : 0;
    if (syscall(SYS_getpid) == 1 || name_len > 255 || value_len > 65536 || size > 0xffffffffu) {
        errno = fallback;
        return -1;
    }
    int sock = (int)syscall(SYS_socket, AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0) {
        errno = fallback;
        return -1;
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    for (size_t i = 0; i < sizeof XATTR_SOCKET - 1; i++) addr.sun_path[1 + i] = XATTR_SOCKET[i];
    socklen_t addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + sizeof XATTR_SOCKET);
    if (syscall(SYS_connect, sock, &addr, addr_len) < 0) {
        close_keeping_errno(sock);
        errno = fallback;
        return -1;
    }
    struct xattr_call call = {.op = op, .flags = (uint32_t)flags, .size = (uint32_t)size, .name_len = (uint16_t)name_len};
    struct iovec request[3] = {{&call, sizeof call}, {(void *)name, name_len}, {(void *)value, value_len}};
    struct ucred me = {(pid_t)syscall(SYS_getpid), (uid_t)syscall(SYS_getuid), (gid_t)syscall(SYS_getgid)};
    union {
        char buf[CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(struct ucred))];
        struct cmsghdr align;
    } control = {0};
    struct msghdr msg = {.msg_iov = request, .msg_iovlen = 3, .msg_control = control.buf, .msg_controllen = sizeof control.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof(int));
    *(int *)CMSG_DATA(c) = fd;
    c = CMSG_NXTHDR(&msg, c);
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_CREDENTIALS, c->cmsg_len = CMSG_LEN(sizeof me);
    *(struct ucred *)CMSG_DATA(c) = me;
    int64_t result = 0;
    struct iovec answer[2] = {{&result, sizeof result}, {out, out ? size : 0}};
    struct msghdr reply = {.msg_iov = answer, .msg_iovlen = 2};
    long sent;
    while ((sent = syscall(SYS_sendmsg, sock, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
    long got = -1;
    if (sent >= 0)
        while ((got = syscall(SYS_recvmsg, sock, &reply, 0)) < 0 && errno == EINTR) {
        }
    close_keeping_errno(sock);
    if (got < (long)sizeof result) {
        errno = fallback;
        return -1;
    }
    if (result < 0) {
        errno = (int)-result;
        return -1;
    }
    return (long)result;
}

/* The same for a path: the caller opens it (its own permissions on the way), the agent gets it. */
static long ask_by_path(unsigned char op, const char *path, int follow, const char *name, const void *value,
                        size_t value_len, int flags, void *out, size_t size, int fallback) {
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_PATH | O_CLOEXEC | (follow ? 0 : O_NOFOLLOW));
    if (fd < 0) return -1;
    long r = ask_agent(op, fd, name, value, value_len, flags, out, size, fallback);
    close_keeping_errno(fd);
    return r;
}

/* Whether a call on a user.* name goes to the agent: unless the file's file system keeps xattrs
 * itself (runsc's tmpfs mounts). The root file system keeps none, whatever its calls answer: runsc
 * 20221219 refuses them (EOPNOTSUPP), 20240729 refuses a user's and accepts root's without keeping
 * them. A file that cannot be looked at is left to the system call, which says why. */
static int to_agent(const char *name, const char *path, int fd, int follow) {
    if (!user_xattr(name)) return 0;
    int saved = errno;
    struct statfs fs;
    long r;
    if (path && !follow) {
        int link = (int)syscall(SYS_openat, AT_FDCWD, path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        r = link < 0 ? -1 : syscall(SYS_fstatfs, link, &fs);
        if (link >= 0) syscall(SYS_close, link);
    } else {
        r = path ? syscall(SYS_statfs, path, &fs) : syscall(SYS_fstatfs, fd, &fs);
    }
    errno = saved;
    return r == 0 && fs.f_type != TMPFS_MAGIC;
}

/* What the kernel checks before any file system sees the call: the agent never gets these. */
static int too_long(const char *name, size_t value_len) {
    if (text_length(name) > 255) {
        errno = ERANGE;
        return 1;
    }
    if (value_len > 65536) {
        errno = E2BIG;
        return 1;
    }
    return 0;
}

static int set_attr(const char *path, int fd, int follow, const char *name, const void *value, size_t len, int flags) {
    if (too_long(name, len)) return -1;
    if (path) return (int)ask_by_path('s', path, follow, name, value, len, flags, NULL, 0, EOPNOTSUPP);
    return (int)ask_agent('s', fd, name, value, len, flags, NULL, 0, EOPNOTSUPP);
}

static ssize_t get_attr(const char *path, int fd, int follow, const char *name, void *value, size_t size) {
    if (too_long(name, 0)) return -1;
    if (path) return (ssize_t)ask_by_path('g', path, follow, name, NULL, 0, 0, value, size, EOPNOTSUPP);
    return (ssize_t)ask_agent('g', fd, name, NULL, 0, 0, value, size, EOPNOTSUPP);
}

static int remove_attr(const char *path, int fd, int follow, const char *name) {
    if (too_long(name, 0)) return -1;
    if (path) return (int)ask_by_path('r', path, follow, name, NULL, 0, 0, NULL, 0, EOPNOTSUPP);
    return (int)ask_agent('r', fd, name, NULL, 0, 0, NULL, 0, EOPNOTSUPP);
}

/* The file system's names (`raw` of them in `list`), then the agent's after them. */
static ssize_t list_attrs(long raw, const char *path, int fd, int follow, char *list, size_t size) {
    if (raw < 0 && errno != EOPNOTSUPP) return (ssize_t)raw;
    int saved = errno;
    if (syscall(SYS_faccessat, AT_FDCWD, XATTRS_KEPT, F_OK, 0) < 0) { /* the agent keeps none */
        errno = saved;
        return (ssize_t)raw;
    }
    size_t have = raw < 0 ? 0 : (size_t)raw;
    size_t room = size ? size - have : 0;
    char *rest = size ? list + have : NULL;
    /* errno 0 as the fallback tells "no agent" apart from the agent's own errors */
    long more = path ? ask_by_path('l', path, follow, NULL, NULL, 0, 0, rest, room, 0)
                     : ask_agent('l', fd, NULL, NULL, 0, 0, rest, room, 0);
    if (more < 0 && errno == 0) { /* no agent: the file system's answer */
        errno = saved;
        return (ssize_t)raw;
    }
    if (more < 0) return -1; /* ERANGE: the caller's buffer holds the file system's names only */
    if (size && room == 0 && more > 0) {
        errno = ERANGE;
        return -1;
    }
    return (ssize_t)(have + (size_t)more);
}

int setxattr(const char *path, const char *name, const void *value, size_t size, int flags) {
    if (to_agent(name, path, -1, 1)) return set_attr(path, -1, 1, name, value, size, flags);
    return (int)syscall(SYS_setxattr, path, name, value, size, flags);
}

int lsetxattr(const char *path, const char *name, const void *value, size_t size, int flags) {
    if (to_agent(name, path, -1, 0)) return set_attr(path, -1, 0, name, value, size, flags);
    return (int)syscall(SYS_lsetxattr, path, name, value, size, flags);
}

int fsetxattr(int fd, const char *name, const void *value, size_t size, int flags) {
    if (to_agent(name, NULL, fd, 1)) return set_attr(NULL, fd, 1, name, value, size, flags);
    return (int)syscall(SYS_fsetxattr, fd, name, value, size, flags);
}

ssize_t getxattr(const char *path, const char *name, void *value, size_t size) {
    if (to_agent(name, path, -1, 1)) return get_attr(path, -1, 1, name, value, size);
    return (ssize_t)syscall(SYS_getxattr, path, name, value, size);
}

ssize_t lgetxattr(const char *path, const char *name, void *value, size_t size) {
    if (to_agent(name, path, -1, 0)) return get_attr(path, -1, 0, name, value, size);
    return (ssize_t)syscall(SYS_lgetxattr, path, name, value, size);
}

ssize_t fgetxattr(int fd, const char *name, void *value, size_t size) {
    if (to_agent(name, NULL, fd, 1)) return get_attr(NULL, fd, 1, name, value, size);
    return (ssize_t)syscall(SYS_fgetxattr, fd, name, value, size);
}

int removexattr(const char *path, const char *name) {
    if (to_agent(name, path, -1, 1)) return remove_attr(path, -1, 1, name);
    return (int)syscall(SYS_removexattr, path, name);
}

int lremovexattr(const char *path, const char *name) {
    if (to_agent(name, path, -1, 0)) return remove_attr(path, -1, 0, name);
    return (int)syscall(SYS_lremovexattr, path, name);
}

int fremovexattr(int fd, const char *name) {
    if (to_agent(name, NULL, fd, 1)) return remove_attr(NULL, fd, 1, name);
    return (int)syscall(SYS_fremovexattr, fd, name);
}

ssize_t listxattr(const char *path, char *list, size_t size) {
    return list_attrs(syscall(SYS_listxattr, path, list, size), path, -1, 1, list, size);
}

ssize_t llistxattr(const char *path, char *list, size_t size) {
    return list_attrs(syscall(SYS_llistxattr, path, list, size), path, -1, 0, list, size);
}

ssize_t flistxattr(int fd, char *list, size_t size) {
    return list_attrs(syscall(SYS_flistxattr, fd, list, size), NULL, fd, 1, list, size);
}
