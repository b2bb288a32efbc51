/*
 * aenv-spawn: the last step between the guest agent and a user's command.
 *
 *   aenv-spawn UID GID GROUPS NPROC FLAGS CWD -- ARGV...
 *
 * The agent starts this helper with posix_spawn (vfork + exec: cheap under gVisor, where forking
 * the agent's Python process costs several times more). The helper then drops to the user, sets
 * the process limit, starts a session (FLAGS has 's') and takes the terminal on fd 0 as its
 * controlling tty (FLAGS has 't'), changes directory and execs the command (PATH is searched).
 * GROUPS is a comma-separated list of gids ("-" for none); NPROC 0 leaves RLIMIT_NPROC alone.
 * On failure it reports on stderr and exits 127 (not found) or 126 (cannot execute).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <unistd.h>

static int fail(const char *what, const char *arg) {
    int err = errno;
    fprintf(stderr, "aenv-spawn: %s %s: %s\n", what, arg ? arg : "", strerror(err));
    return err == ENOENT ? 127 : 126;
}

int main(int argc, char **argv) {
    if (argc < 9 || strcmp(argv[7], "--") != 0) {
        fprintf(stderr, "usage: aenv-spawn UID GID GROUPS NPROC FLAGS CWD -- ARGV...\n");
        return 2;
    }
    uid_t uid = (uid_t)strtoul(argv[1], NULL, 10);
    gid_t gid = (gid_t)strtoul(argv[2], NULL, 10);
    long nproc = strtol(argv[4], NULL, 10);
    const char *flags = argv[5];
    const char *cwd = argv[6];

    if (strchr(flags, 's') && setsid() < 0) return fail("setsid", NULL);
    if (strchr(flags, 't') && ioctl(0, TIOCSCTTY, 0) < 0) return fail("TIOCSCTTY", NULL);
    if (nproc > 0) {
        struct rlimit rl = {(rlim_t)nproc, (rlim_t)nproc};
        if (setrlimit(RLIMIT_NPROC, &rl) < 0) return fail("setrlimit", NULL);
    }
    if (getuid() != uid || getgid() != gid) {
        gid_t groups[64];
        int n = 0;
        if (strcmp(argv[3], "-") != 0) {
            char *list = argv[3];
            for (char *tok = strtok(list, ","); tok && n < 64; tok = strtok(NULL, ",")) groups[n++] = (gid_t)strtoul(tok, NULL, 10);
        }
        if (setgroups((size_t)n, groups) < 0) return fail("setgroups", NULL);
        if (setresgid(gid, gid, gid) < 0) return fail("setgid", argv[2]);
        if (setresuid(uid, uid, uid) < 0) return fail("setuid", argv[1]);
    }
    if (cwd[0] && chdir(cwd) < 0) return fail("chdir", cwd);
    execvp(argv[8], &argv[8]);
    return fail("exec", argv[8]);
}
