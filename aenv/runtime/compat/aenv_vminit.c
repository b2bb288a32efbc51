/* Stage one of a microVM's boot (aenv/runtime/qemu.py): the /init of the initramfs the driver
 * makes for a kernel. Debian's kernels have virtio and overlayfs as modules, and a kernel cannot
 * load a module by itself: this mounts /dev, /proc and /sys, loads the modules in /lib/modules (in
 * name order, their dependencies first, with their parameters from the kernel's command line),
 * mounts the guest bundle's disk (the virtio-blk disk whose serial is "aenv-guest") read-only at
 * argv[1], and runs argv[2..] (the bundle's own init, aenv/guest/vminit.py, on the
 * bundle's interpreter) with the environment the kernel gave it.
 *
 * Usage (after "--" on the kernel command line): init <bundle mount point> <program> [args...] --
 * Built static from source by the driver, never shipped as a binary. Any failure ends PID 1: the
 * kernel panics, and with panic=-1 and QEMU's -no-reboot the VM exits (its console says why). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MODULES "/lib/modules"
#define SERIAL "aenv-guest"
#define WAIT_MS 10000

static void fail(const char *what, const char *arg) {
    dprintf(2, "aenv-vminit: %s %s: %s\n", what, arg ? arg : "", strerror(errno));
    exit(1);
}

static char cmdline[4096];

/* The kernel applies "module.param=value" of its command line to built-in code only; for a module
 * that is modprobe's job, done here: QEMU's microvm names its virtio-mmio devices so, appending
 * them to the command line, past its "--" (so they reach init's argv too: see main). */
static void params_of(const char *module, char *out, size_t size) {
    size_t len = strlen(module), used = 0;
    out[0] = 0;
    char copy[sizeof cmdline];
    memcpy(copy, cmdline, sizeof copy);
    for (char *save, *word = strtok_r(copy, " \n", &save); word; word = strtok_r(NULL, " \n", &save)) {
        if (strncmp(word, module, len) != 0 || word[len] != '.')
            continue;
        int wrote = snprintf(out + used, size - used, "%s%s", used ? " " : "", word + len + 1);
        if (wrote < 0 || (size_t)wrote >= size - used) {
            errno = E2BIG;
            fail("too many parameters for", module);
        }
        used += wrote;
    }
}

static void load_modules(void) {
    struct dirent **names;
    int n = scandir(MODULES, &names, NULL, alphasort);
    if (n < 0)
        fail("cannot list", MODULES);
    for (int i = 0; i < n; i++) {
        char path[512], module[256], params[2048];
        const char *file = names[i]->d_name;
        if (file[0] == '.')
            continue;
        /* NN-name.ko: loaded in that order, its parameters those of "name." */
        const char *dash = strchr(file, '-');
        snprintf(module, sizeof module, "%s", dash ? dash + 1 : file);
        char *dot = strstr(module, ".ko");
        if (dot)
            *dot = 0;
        for (char *c = module; *c; c++)
            if (*c == '-')
                *c = '_';
        params_of(module, params, sizeof params);
        snprintf(path, sizeof path, "%s/%s", MODULES, file);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            fail("cannot open", path);
        if (syscall(SYS_finit_module, fd, params, 0) != 0 && errno != EEXIST)
            fail("cannot load", path);
        close(fd);
    }
}

/* The /dev path of the virtio-blk disk whose serial is SERIAL, or NULL. */
static const char *find_disk(void) {
    static char dev[300];
    DIR *d = opendir("/sys/block");
    if (!d)
        return NULL;
    struct dirent *e;
    const char *found = NULL;
    while (!found && (e = readdir(d))) {
        if (strncmp(e->d_name, "vd", 2) != 0 || strlen(e->d_name) > 16)
            continue;
        char path[300], serial[64] = {0};
        snprintf(path, sizeof path, "/sys/block/%s/serial", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t got = read(fd, serial, sizeof serial - 1);
        close(fd);
        if (got > 0 && serial[got - 1] == '\n')
            serial[got - 1] = 0;
        if (strcmp(serial, SERIAL) == 0) {
            snprintf(dev, sizeof dev, "/dev/%s", e->d_name);
            found = dev;
        }
    }
    closedir(d);
    return found;
}

int main(int argc, char **argv, char **envp) {
    if (argc < 3) {
        errno = EINVAL;
        fail("usage: init <bundle mount point> <program> [args...]", NULL);
    }
    mkdir("/dev", 0755);
    mkdir("/proc", 0555);
    mkdir("/sys", 0555);
    if (mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755") != 0 && errno != EBUSY)
        fail("cannot mount", "/dev");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        fail("cannot mount", "/proc");
    if (mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        fail("cannot mount", "/sys");
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, cmdline, sizeof cmdline - 1) < 0)
        fail("cannot read", "/proc/cmdline");
    close(fd);
    load_modules();
    const char *disk = NULL;
    struct timespec nap = {0, 5 * 1000 * 1000};
    for (int waited = 0; !(disk = find_disk()) && waited < WAIT_MS; waited += 5)
        nanosleep(&nap, NULL);
    if (!disk) {
        errno = ENODEV;
        fail("no disk with serial", SERIAL);
    }
    mkdir(argv[1], 0755);
    if (mount(disk, argv[1], "ext4", MS_RDONLY | MS_NODEV | MS_NOSUID, NULL) != 0)
        fail("cannot mount the guest bundle at", argv[1]);
    for (int i = 3; i < argc; i++)
        if (strcmp(argv[i], "--") == 0)
            argv[i] = NULL;  /* what follows is QEMU's, read above as modules' parameters */
    execve(argv[2], argv + 2, envp);
    fail("cannot run", argv[2]);
    return 1;
}
