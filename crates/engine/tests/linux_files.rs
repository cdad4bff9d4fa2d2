//! The guest file layer under KVM (needs /dev/kvm and gcc): a static C program compiled at test time
//! opens, reads, writes, stats, lists, renames and links files under /work and /tmp, uses pipes, dup2,
//! /dev and /proc, and tries to leave the sandbox with `..` and symlinks. It prints what it sees;
//! the test compares that with what Linux would print.

mod common;

use common::{launcher, python_rootfs};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use collimate_engine::{RunExit, SpawnSpec, Vm, VmConfig};

const PROG: &str = r#"
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void show(const char *what, int rc) { printf("%s: %s\n", what, rc < 0 ? strerror(errno) : "ok"); }

static void cat(const char *p) {
    char buf[256];
    int fd = open(p, O_RDONLY);
    if (fd < 0) { printf("cat %s: %s\n", p, strerror(errno)); return; }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0) n = 0;
    buf[n] = 0;
    if (n > 0 && buf[n - 1] == '\n') buf[n - 1] = 0;
    printf("cat %s: [%s]\n", p, buf);
}

static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void ls(const char *p) {
    DIR *d = opendir(p);
    if (!d) { printf("ls %s: %s\n", p, strerror(errno)); return; }
    char *names[64];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64) names[n++] = strdup(e->d_name);
    closedir(d);
    qsort(names, n, sizeof *names, cmp);
    printf("ls %s:", p);
    for (int i = 0; i < n; i++) printf(" %s", names[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    const char *host_secret = argc > 1 ? argv[1] : "/nonexistent";
    char buf[256];
    struct stat st;

    /* Files under /work and /tmp. */
    int fd = open("/work/a.txt", O_CREAT | O_WRONLY | O_TRUNC, 0640);
    printf("open fd %d\n", fd);
    printf("write %zd\n", write(fd, "alpha\n", 6));
    close(fd);
    cat("/work/a.txt");
    if (stat("/work/a.txt", &st) == 0) printf("stat size %lld mode %o reg %d\n", (long long)st.st_size, st.st_mode & 07777, S_ISREG(st.st_mode));
    show("rename /work/a.txt /tmp/b.txt", rename("/work/a.txt", "/tmp/b.txt")); /* across mounts */
    show("rename /work/a.txt /work/b.txt", rename("/work/a.txt", "/work/b.txt"));
    cat("/work/a.txt");
    cat("/work/b.txt");
    show("mkdir /work/d", mkdir("/work/d", 0755));
    show("mkdir /work/d again", mkdir("/work/d", 0755));
    close(open("/work/d/x", O_CREAT | O_WRONLY, 0644));
    close(open("/work/d/y", O_CREAT | O_WRONLY, 0644));
    show("symlink", symlink("x", "/work/d/z"));
    show("link across mounts", link("/work/b.txt", "/tmp/hard"));
    show("link", link("/work/b.txt", "/work/d/hard"));
    ls("/work/d");
    ssize_t n = readlink("/work/d/z", buf, sizeof buf);
    printf("readlink %.*s\n", (int)(n < 0 ? 0 : n), buf);
    if (lstat("/work/d/z", &st) == 0) printf("lstat link %d\n", S_ISLNK(st.st_mode));
    if (stat("/work/d/hard", &st) == 0) printf("nlink %ld\n", (long)st.st_nlink);

    /* cwd and dirfds. */
    show("chdir /work/d", chdir("/work/d"));
    printf("cwd %s\n", getcwd(buf, sizeof buf));
    cat("hard");
    cat("../../work/b.txt");
    int dfd = open("/work", O_RDONLY | O_DIRECTORY);
    int f2 = openat(dfd, "b.txt", O_RDONLY);
    printf("openat %s\n", f2 >= 0 ? "ok" : strerror(errno));
    printf("pread %zd\n", pread(f2, buf, 3, 2));
    printf("lseek %ld\n", (long)lseek(f2, 0, SEEK_END));
    show("unlinkat", unlinkat(dfd, "b.txt", 0));
    cat("/work/b.txt");
    cat("/work/d/hard");

    /* The read-only root. */
    cat("/etc/hostname");
    show("open /etc/hostname O_WRONLY", open("/etc/hostname", O_WRONLY));
    show("creat /etc/new", creat("/etc/new", 0644));
    show("mkdir /etc/new", mkdir("/etc/new", 0755));
    show("mkdir /etc", mkdir("/etc", 0755));
    show("unlink /prog", unlink("/prog"));
    show("access /etc/hostname W_OK", access("/etc/hostname", W_OK));
    show("access /prog X_OK", access("/prog", X_OK));

    /* Escapes. */
    cat("/../secret");
    cat("/../../../../secret");
    cat("/work/../../secret");
    show("chdir /tmp", chdir("/tmp"));
    cat("../../secret");
    cat(host_secret);
    show("symlink abs", symlink("/../../../secret", "/work/esc1"));
    show("symlink host", symlink(host_secret, "/work/esc2"));
    show("symlink rel", symlink("../../../../../secret", "/work/esc3"));
    cat("/work/esc1");
    cat("/work/esc2");
    cat("/work/esc3");
    show("symlink to root file", symlink("/etc/hostname", "/work/to-root"));
    show("write via symlink", open("/work/to-root", O_WRONLY | O_TRUNC));
    cat("/work/to-root");

    /* Engine files. */
    n = readlink("/proc/self/exe", buf, sizeof buf);
    printf("exe %.*s\n", (int)(n < 0 ? 0 : n), buf);
    fd = open("/dev/null", O_WRONLY);
    printf("devnull %zd\n", write(fd, "x", 1));
    close(fd);
    fd = open("/dev/urandom", O_RDONLY);
    printf("urandom %zd\n", read(fd, buf, 16));
    close(fd);
    fd = open("/dev/zero", O_RDONLY);
    buf[0] = 1;
    n = read(fd, buf, 8);
    printf("zero %zd %d\n", n, buf[0]);
    close(fd);
    ls("/proc/self/fd");
    n = readlink("/proc/self/fd/3", buf, sizeof buf);
    printf("fd3 %.*s\n", (int)(n < 0 ? 0 : n), buf);

    /* Pipes and dup2. */
    int p[2];
    show("pipe", pipe(p));
    printf("pipe write %zd\n", write(p[1], "ping", 4));
    printf("pipe read %zd\n", read(p[0], buf, sizeof buf));
    fflush(stdout);
    int saved = dup(1);
    fd = open("/work/out.txt", O_CREAT | O_RDWR | O_TRUNC, 0644);
    dup2(fd, 1);
    printf("to the file\n");
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    cat("/work/out.txt");
    fprintf(stderr, "done\n");
    return 0;
}
"#;

const EXPECTED: &str = "open fd 3
write 6
cat /work/a.txt: [alpha]
stat size 6 mode 640 reg 1
rename /work/a.txt /tmp/b.txt: Invalid cross-device link
rename /work/a.txt /work/b.txt: ok
cat /work/a.txt: No such file or directory
cat /work/b.txt: [alpha]
mkdir /work/d: ok
mkdir /work/d again: File exists
symlink: ok
link across mounts: Invalid cross-device link
link: ok
ls /work/d: . .. hard x y z
readlink x
lstat link 1
nlink 2
chdir /work/d: ok
cwd /work/d
cat hard: [alpha]
cat ../../work/b.txt: [alpha]
openat ok
pread 3
lseek 6
unlinkat: ok
cat /work/b.txt: No such file or directory
cat /work/d/hard: [alpha]
cat /etc/hostname: [sandbox]
open /etc/hostname O_WRONLY: Read-only file system
creat /etc/new: Read-only file system
mkdir /etc/new: Read-only file system
mkdir /etc: File exists
unlink /prog: Read-only file system
access /etc/hostname W_OK: Read-only file system
access /prog X_OK: ok
cat /../secret: No such file or directory
cat /../../../../secret: No such file or directory
cat /work/../../secret: No such file or directory
chdir /tmp: ok
cat ../../secret: No such file or directory
cat HOST_SECRET: No such file or directory
symlink abs: ok
symlink host: ok
symlink rel: ok
cat /work/esc1: No such file or directory
cat /work/esc2: No such file or directory
cat /work/esc3: No such file or directory
symlink to root file: ok
write via symlink: Read-only file system
cat /work/to-root: [sandbox]
exe /prog
devnull 1
urandom 16
zero 8 0
ls /proc/self/fd: . .. 0 1 2 3 4 5
fd3 /work
pipe: ok
pipe write 4
pipe read 4
cat /work/out.txt: [to the file]
";

/// base/root (read-only: the program and etc/hostname), base/tmp and base/work (writable), and
/// base/secret outside every mount.
fn sandbox() -> PathBuf {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("linux-files-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    for d in ["root/etc", "tmp", "work"] {
        std::fs::create_dir_all(base.join(d)).unwrap();
    }
    std::fs::write(base.join("root/etc/hostname"), "sandbox\n").unwrap();
    std::fs::write(base.join("secret"), "HOST SECRET\n").unwrap();
    base
}

fn compile(src: &str, out: &Path) -> bool {
    let c = out.with_extension("c");
    std::fs::write(&c, src).unwrap();
    match Command::new("gcc").args(["-O1", "-Wall", "-static", "-o"]).arg(out).arg(&c).status() {
        Ok(s) => {
            assert!(s.success(), "gcc failed");
            true
        }
        Err(_) => {
            eprintln!("gcc not found: skipping");
            false
        }
    }
}

#[test]
fn files_under_kvm() {
    let base = sandbox();
    if !compile(PROG, &base.join("root/prog")) {
        return;
    }
    std::fs::remove_file(base.join("root/prog.c")).unwrap();
    let secret = base.join("secret").to_string_lossy().into_owned();
    let spec = SpawnSpec {
        root: base.join("root"),
        mounts: vec![("/tmp".into(), base.join("tmp")), ("/work".into(), base.join("work"))],
        argv: vec![b"/prog".to_vec(), secret.as_bytes().to_vec()],
        envp: vec![],
        cwd: "/".into(),
        ..Default::default()
    };
    let mut vm = Vm::spawn(&launcher(), &spec, &VmConfig::default()).unwrap();
    let r = vm.run(Duration::from_secs(60)).unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(stdout, EXPECTED.replace("HOST_SECRET", &secret), "stderr:\n{stderr}");
    assert_eq!(stderr, "done\n");
    // What the guest did is on the host, inside the mounts only.
    assert_eq!(std::fs::read_to_string(base.join("work/d/hard")).unwrap(), "alpha\n");
    assert_eq!(std::fs::read_to_string(base.join("work/out.txt")).unwrap(), "to the file\n");
    assert_eq!(std::fs::read_to_string(base.join("secret")).unwrap(), "HOST SECRET\n");
    assert_eq!(std::fs::read_to_string(base.join("root/etc/hostname")).unwrap(), "sandbox\n");
    assert!(!base.join("root/etc/new").exists());
    let _ = std::fs::remove_dir_all(&base);
}

fn run_in_rootfs(root: &Path, argv: &[&str]) -> (RunExit, String, String) {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("linux-files-rootfs-{}-{}", std::process::id(), argv.len()));
    let _ = std::fs::remove_dir_all(&base);
    for d in ["tmp", "work"] {
        std::fs::create_dir_all(base.join(d)).unwrap();
    }
    std::fs::write(base.join("work/data.txt"), "one\ntwo\nthree\n").unwrap();
    let spec = SpawnSpec {
        root: root.to_path_buf(),
        mounts: vec![("/tmp".into(), base.join("tmp")), ("/work".into(), base.join("work"))],
        argv: argv.iter().map(|s| s.as_bytes().to_vec()).collect(),
        envp: vec![b"PATH=/usr/bin:/bin".to_vec(), b"HOME=/root".to_vec(), b"LANG=C.UTF-8".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    };
    let mut vm = Vm::spawn(&launcher(), &spec, &VmConfig::default()).unwrap();
    let r = vm.run(Duration::from_secs(120)).unwrap();
    let _ = std::fs::remove_dir_all(&base);
    (r.exit, String::from_utf8_lossy(&r.stdout).into_owned(), String::from_utf8_lossy(&r.stderr).into_owned())
}

const PY: &str = r#"
import os, sys, json, tempfile, shutil, glob
os.makedirs('/work/pkg/sub', exist_ok=True)
with open('/work/pkg/sub/m.txt', 'w') as f:
    f.write('x' * 10000)
print(sorted(os.listdir('/work')))
print(os.stat('/work/pkg/sub/m.txt').st_size)
print(open('/work/data.txt').read().split())
with tempfile.NamedTemporaryFile('w', dir='/tmp', delete=False) as t:
    t.write('tmp')
shutil.copy(t.name, '/work/copied')
print(open('/work/copied').read())
print(sorted(glob.glob('/work/**/*.txt', recursive=True)))
try:
    open('/usr/lib/python3.11/os.py', 'a')
except OSError as e:
    print('EROFS' if e.errno == 30 else e)
try:
    open('/../../../etc/shadow')
except OSError as e:
    print(type(e).__name__)
print(os.path.realpath('/proc/self/exe'), os.getcwd(), len(os.urandom(8)))
print(json.dumps({'ok': True}))
"#;

/// Debian's CPython and busybox from the python template's rootfs (skips if it was never built).
#[test]
fn python_and_busybox_from_rootfs() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let (exit, out, err) = run_in_rootfs(&root, &["/usr/bin/python3", "-c", PY]);
    assert_eq!(exit, RunExit::Exited { code: 0 }, "stdout:\n{out}\nstderr:\n{err}");
    let want = "['data.txt', 'pkg']\n10000\n['one', 'two', 'three']\ntmp\n\
['/work/data.txt', '/work/pkg/sub/m.txt']\nEROFS\nFileNotFoundError\n/usr/bin/python3.11 /work 8\n{\"ok\": true}\n";
    assert_eq!(out, want, "stderr:\n{err}");

    // busybox applets (its shell needs fork, which the engine does not have yet).
    for (argv, want) in [
        (&["/bin/ls", "-a", "/work"][..], ".\n..\ndata.txt\n"),
        (&["/bin/sort", "-r", "data.txt"][..], "two\nthree\none\n"),
        (&["/bin/mkdir", "-p", "/work/a/b/c"][..], ""),
        (&["/bin/cat", "/etc/hostname-nope"][..], ""),
        (&["/bin/touch", "/usr/x"][..], ""),
        (&["/bin/ls", "-ld", "/proc/self/fd/0"][..], ""),
    ] {
        let (exit, out, err) = run_in_rootfs(&root, argv);
        match argv[0] {
            "/bin/cat" => assert_eq!(err, "cat: can't open '/etc/hostname-nope': No such file or directory\n"),
            "/bin/touch" => assert_eq!(err, "touch: /usr/x: Read-only file system\n"),
            _ => assert_eq!(exit, RunExit::Exited { code: 0 }, "{argv:?}: stdout:\n{out}\nstderr:\n{err}"),
        }
        if argv[1] == "-ld" {
            assert!(out.contains("/proc/self/fd/0 -> /dev/null"), "{out}");
        } else {
            assert_eq!(out, want, "{argv:?}: stderr:\n{err}");
        }
    }
}
