/*
 * sudo for sandboxes: the command is started by the guest agent, which runs as root already.
 *
 * gVisor runs every sandbox with no_new_privs, so a setuid sudo can never gain privileges. This
 * client, installed as the image's sudo, hands what sudo would act on to the agent over an
 * abstract Unix socket and then stands in for the command:
 *
 *   client -> agent  u32 length + "aenv-sudo/1" NUL cwd NUL argc NUL argv... NUL environ... NUL,
 *                    with stdin, stdout and stderr (SCM_RIGHTS) and its own ids (SCM_CREDENTIALS,
 *                    which the sentry checks: a process can only claim its own)
 *                    then one byte per signal it receives (Ctrl-C, kill), which the agent relays
 *   agent -> client  frames: type byte + u32 length + payload; 'o'/'e' text for stdout/stderr,
 *                    then 'x' (exit code) or 'k' (killed by that signal), as the command ended
 *
 * The agent parses the options, checks the policy and answers; if this client dies, the agent
 * kills the command. Linked against the guest bundle's own loader and glibc (/.aenv/lib), so it
 * runs in any image. Dynamically linked on purpose: this runsc never frees a task that exec'd a
 * static glibc binary.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SOCKET_NAME "aenv-sudo" /* abstract: lives in the sandbox's kernel, survives checkpoints */
#define MAX_REQUEST (4u << 20)
#define MAX_FRAME (1u << 20)

extern char **environ;
static int agent = -1;

static void fail(const char *what) {
    fprintf(stderr, "sudo: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void relay(int sig) {
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    (void)send(agent, &b, 1, MSG_NOSIGNAL);
    errno = saved;
}

struct request {
    char *data;
    size_t len, cap;
};

static void put(struct request *r, const char *s) {
    size_t n = strlen(s) + 1;
    if (r->len + n > MAX_REQUEST) {
        fprintf(stderr, "sudo: argument list too long\n");
        exit(1);
    }
    if (r->len + n > r->cap) {
        r->cap = (r->len + n) * 2;
        if (!(r->data = realloc(r->data, r->cap))) fail("memory");
    }
    memcpy(r->data + r->len, s, n);
    r->len += n;
}

static void send_all(const char *p, size_t n) {
    while (n) {
        ssize_t k = send(agent, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) fail("sending to the sandbox agent");
        p += k, n -= (size_t)k;
    }
}

static int read_all(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n) {
        ssize_t k = read(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k, n -= (size_t)k;
    }
    return 0;
}

static void write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return;
        p += k, n -= (size_t)k;
    }
}

static uint32_t le32(const unsigned char *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

static void connect_agent(void) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path + 1, SOCKET_NAME, sizeof SOCKET_NAME - 1);
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + sizeof SOCKET_NAME);
    agent = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (agent < 0 || connect(agent, (struct sockaddr *)&addr, len) < 0) fail("cannot reach the sandbox agent");
}

/* The length, with stdio and the caller's ids attached. A closed stdio fd goes as /dev/null. */
static void send_head(uint32_t length) {
    int fds[3];
    for (int i = 0; i < 3; i++) fds[i] = fcntl(i, F_GETFD) != -1 ? i : open("/dev/null", O_RDWR | O_CLOEXEC);
    struct ucred me = {getpid(), getuid(), getgid()};
    union {
        char buf[CMSG_SPACE(sizeof fds) + CMSG_SPACE(sizeof me)];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof control);
    struct iovec iov = {&length, sizeof length};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf, .msg_controllen = sizeof control.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    c = CMSG_NXTHDR(&msg, c);
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_CREDENTIALS, c->cmsg_len = CMSG_LEN(sizeof me);
    memcpy(CMSG_DATA(c), &me, sizeof me);
    while (sendmsg(agent, &msg, MSG_NOSIGNAL) < 0)
        if (errno != EINTR) fail("sending to the sandbox agent");
}

static void relay_signals(void) {
    static const int relayed[] = {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, SIGWINCH, SIGCONT};
    struct sigaction sa = {.sa_handler = relay, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof relayed / sizeof relayed[0]; i++) sigaction(relayed[i], &sa, NULL);
}

/* Die of the command's signal, as a shell expects of sudo. */
static void die_of(int sig) {
    signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    raise(sig);
    exit(128 + sig);
}

int main(int argc, char **argv) {
    struct request req = {0};
    char cwd[PATH_MAX], count[16];
    put(&req, "aenv-sudo/1");
    put(&req, getcwd(cwd, sizeof cwd) ? cwd : "");
    snprintf(count, sizeof count, "%d", argc);
    put(&req, count);
    for (int i = 0; i < argc; i++) put(&req, argv[i]);
    for (char **e = environ; *e; e++) put(&req, *e);

    connect_agent();
    send_head((uint32_t)req.len);
    send_all(req.data, req.len);
    free(req.data);
    relay_signals(); /* only now: a relayed signal is a byte after the request */

    for (;;) {
        unsigned char head[5];
        if (read_all(agent, head, sizeof head) < 0) break;
        uint32_t n = le32(head + 1);
        if (n > MAX_FRAME) break;
        char *payload = malloc(n ? n : 1);
        if (!payload || read_all(agent, payload, n) < 0) break;
        if (head[0] == 'o' || head[0] == 'e') write_all(head[0] == 'o' ? 1 : 2, payload, n);
        int value = n >= 4 ? (int)le32((unsigned char *)payload) : 1;
        free(payload);
        if (head[0] == 'x') exit(value);
        if (head[0] == 'k') die_of(value);
    }
    fprintf(stderr, "sudo: the sandbox agent closed the connection\n");
    return 1;
}
