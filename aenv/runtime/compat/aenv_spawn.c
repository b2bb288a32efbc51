/*
 * libaenv_spawn: how the guest agent starts a user's command, loaded into the agent with ctypes.
 *
 *   pid_t aenv_spawn(path, argv, envp, fds[3], uid, gid, groups, ngroups, nproc, flags, cwd, reset, &step)
 *
 * One clone(CLONE_VM | CLONE_VFORK) and one execve, as glibc's posix_spawn does, plus what
 * posix_spawn cannot do: switch to the user (setgroups, setresgid, setresuid), set RLIMIT_NPROC,
 * start a session (AENV_SETSID), take fd 0 as controlling terminal (AENV_SETCTTY) and chdir (as the
 * user; before switching with AENV_CHDIR_FIRST, as a command inherits its parent's directory).
 *
 * Why not fork, or a helper program that does this and then execs the command:
 * - forking the agent's Python process under gVisor's ptrace platform costs several times more;
 * - a helper is a second exec on every command (~2 ms here), and the runsc release Debian ships
 *   (20221219) never frees a task that exec'd from a static glibc binary: each command would leave
 *   its task, thread group and session in the sandbox's kernel state, which makes every later
 *   checkpoint and restore slower (measured: 60 commands, checkpoint 115 -> 290 ms).
 *
 * The child shares the agent's memory until it execs, so it only makes raw system calls (no
 * locks, no malloc, no errno-dependent glibc paths). In particular the credential calls are raw:
 * glibc's setresuid() would try to change every thread of the *agent*. All signals are blocked
 * around clone so no agent handler runs in the child; the child sets the signals in RESET (a bit
 * per signal: those the agent handles or ignores) back to the default before unblocking. The
 * agent ignores SIGPIPE, and a command must not inherit that. Only those: every system call costs
 * tens of microseconds under the ptrace platform, and resetting all 64 was ~1 ms per command.
 *
 * Returns the child's pid, or -errno when the command could not be started: clone failed (*step
 * is 0), or a step before the exec did (*step names it: STEP_*; the child is reaped here), as Go's
 * exec reports a chdir into a directory the user cannot enter. A failed exec is the command's
 * own result, as from a shell: the child writes "aenv: exec <path>: <reason>" to its stderr
 * (fds[2]) and exits 127 (not found) or 126.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define AENV_SETSID 1
#define AENV_SETCTTY 2
#define AENV_SETUSER 4
#define AENV_CHDIR_FIRST 8

/* The step before the exec that failed (what aenv_spawn reports in *step). */
#define STEP_FDS 1
#define STEP_SESSION 2
#define STEP_LIMITS 3
#define STEP_USER 4
#define STEP_CHDIR 5

#define STACK_SIZE (64 * 1024)
#define KERNEL_SIGSET_BYTES 8 /* the kernel's sigset_t, not glibc's 128-byte one */

struct kernel_sigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

struct spawn_args {
    const char *path;
    char *const *argv;
    char *const *envp;
    const int *fds;
    uint32_t uid, gid;
    const uint32_t *groups;
    int ngroups;
    long nproc;
    int flags;
    const char *cwd;
    uint64_t reset;
    int failed_step, failed_errno; /* written by the child, which shares this memory (CLONE_VM) */
};

static size_t length(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

static void say(const char *s) { syscall(SYS_write, 2, s, length(s)); }

/* A step before the exec failed: the parent reports it (the child's memory is the parent's). */
static int setup_failed(struct spawn_args *a, int step, long err) {
    a->failed_step = step;
    a->failed_errno = (int)err;
    syscall(SYS_exit_group, 126);
    return 0;
}

static int fail(const char *step, const char *arg, long err) {
    const char *reason = strerrordesc_np((int)err); /* a static string: safe without locks */
    say("aenv: ");
    say(step);
    if (arg) {
        say(" ");
        say(arg);
    }
    say(": ");
    say(reason ? reason : "error");
    say("\n");
    syscall(SYS_exit_group, err == ENOENT ? 127 : 126);
    return 0;
}

/* A raw system call that reports its failure as a positive errno (0 on success). */
#define RAW(...) (syscall(__VA_ARGS__) < 0 ? errno : 0)

static int child(void *p) {
    struct spawn_args *a = p;
    long err;

    struct kernel_sigaction dfl = {0};
    for (int sig = 1; sig < 65; sig++) {
        if (a->reset & (1ULL << (sig - 1))) syscall(SYS_rt_sigaction, sig, &dfl, NULL, KERNEL_SIGSET_BYTES);
    }
    for (int i = 0; i < 3; i++) {
        int fd = a->fds[i];
        if (fd == i) {
            if ((err = RAW(SYS_fcntl, fd, F_SETFD, 0))) return setup_failed(a, STEP_FDS, err);
        } else if ((err = RAW(SYS_dup3, fd, i, 0))) {
            return setup_failed(a, STEP_FDS, err);
        }
    }
    if ((a->flags & AENV_SETSID) && (err = RAW(SYS_setsid))) return setup_failed(a, STEP_SESSION, err);
    if ((a->flags & AENV_SETCTTY) && (err = RAW(SYS_ioctl, 0, TIOCSCTTY, 0))) return setup_failed(a, STEP_SESSION, err);
    if (a->nproc > 0) {
        struct rlimit rl = {(rlim_t)a->nproc, (rlim_t)a->nproc};
        if ((err = RAW(SYS_prlimit64, 0, RLIMIT_NPROC, &rl, NULL))) return setup_failed(a, STEP_LIMITS, err);
    }
    int chdir_first = a->cwd && a->cwd[0] && (a->flags & AENV_CHDIR_FIRST);
    if (chdir_first && (err = RAW(SYS_chdir, a->cwd))) return setup_failed(a, STEP_CHDIR, err);
    if (a->flags & AENV_SETUSER) {
        if ((err = RAW(SYS_setgroups, a->ngroups, a->groups))) return setup_failed(a, STEP_USER, err);
        if ((err = RAW(SYS_setresgid, a->gid, a->gid, a->gid))) return setup_failed(a, STEP_USER, err);
        if ((err = RAW(SYS_setresuid, a->uid, a->uid, a->uid))) return setup_failed(a, STEP_USER, err);
    }
    if (!chdir_first && a->cwd && a->cwd[0] && (err = RAW(SYS_chdir, a->cwd))) return setup_failed(a, STEP_CHDIR, err);
    uint64_t none = 0;
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, KERNEL_SIGSET_BYTES);
    err = RAW(SYS_execve, a->path, a->argv, a->envp);
    return fail("exec", a->path, err);
}

pid_t aenv_spawn(const char *path, char *const argv[], char *const envp[], const int fds[3], uint32_t uid,
                 uint32_t gid, const uint32_t *groups, int ngroups, long nproc, int flags, const char *cwd,
                 uint64_t reset, int *step) {
    struct spawn_args a = {path, argv, envp, fds, uid, gid, groups, ngroups, nproc, flags, cwd, reset, 0, 0};
    *step = 0;
    void *stack = mmap(NULL, STACK_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) return -errno;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    /* CLONE_VFORK: returns once the child has exec'd or exited, so its stack is free again. */
    pid_t pid = clone(child, (char *)stack + STACK_SIZE, CLONE_VM | CLONE_VFORK | SIGCHLD, &a);
    int saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    munmap(stack, STACK_SIZE);
    if (pid < 0) return -saved;
    if (a.failed_step) { /* the child exited before its exec: reap it, report why */
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
        }
        *step = a.failed_step;
        return -a.failed_errno;
    }
    return pid;
}
