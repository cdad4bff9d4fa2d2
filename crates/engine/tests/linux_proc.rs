//! Guest processes and signals (needs /dev/kvm and gcc): fork/vfork/clone as host forks of the VMM
//! process, wait4/waitid, execve, kill, signal handlers and frames, faults as signals, and that
//! no host process outlives its sandbox. C programs are compiled at test time against the host's
//! glibc (statically); each checks its own results and exits with the number of the first check
//! that failed (0 when all passed). The busybox and CPython tests use the python template's
//! root filesystem and skip if it was never built.

mod common;

use common::{launcher, python_rootfs};

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use collimate_engine::{RunExit, RunResult, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(60);

/// A fresh sandbox: base/root (read-only), base/work (writable at /work).
fn sandbox(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("linux-proc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("root")).unwrap();
    std::fs::create_dir_all(d.join("work")).unwrap();
    d
}

/// Compile `src` statically into `base/root/<name>`. False (the test skips) without gcc.
fn compile(base: &Path, name: &str, src: &str) -> bool {
    let c = base.join(format!("{name}.c"));
    std::fs::write(&c, src).unwrap();
    match Command::new("gcc").args(["-O1", "-Wall", "-static", "-o"]).arg(base.join("root").join(name)).arg(&c).status() {
        Ok(s) => {
            assert!(s.success(), "gcc failed for {name}");
            true
        }
        Err(_) => {
            eprintln!("gcc not found: skipping");
            false
        }
    }
}

fn spec(root: &Path, work: &Path, argv: &[&str]) -> SpawnSpec {
    SpawnSpec {
        root: root.to_path_buf(),
        mounts: vec![("/work".into(), work.to_path_buf())],
        argv: argv.iter().map(|s| s.as_bytes().to_vec()).collect(),
        envp: vec![b"PATH=/usr/bin:/bin".to_vec(), b"HOME=/root".to_vec(), b"LANG=C.UTF-8".to_vec()],
        cwd: "/".into(),
        ..Default::default()
    }
}

fn run_in(base: &Path, argv: &[&str]) -> RunResult {
    let mut vm = Vm::spawn(&launcher(), &spec(&base.join("root"), &base.join("work"), argv), &VmConfig::default()).unwrap();
    vm.run(T).unwrap()
}

fn show(r: &RunResult) -> String {
    format!("exit {:?}\nstdout:\n{}\nstderr:\n{}", r.exit, String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr))
}

fn expect_exit(r: &RunResult, code: i32) {
    assert_eq!(r.exit, RunExit::Exited { code }, "{}", show(r));
}

/// Run `argv` in the python rootfs with `work` mounted at /work.
fn run_rootfs(root: &Path, work: &Path, argv: &[&str]) -> RunResult {
    let mut s = spec(root, work, argv);
    s.cwd = "/work".into();
    let mut vm = Vm::spawn(&launcher(), &s, &VmConfig::default()).unwrap();
    vm.run(Duration::from_secs(120)).unwrap()
}

const PRELUDE: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#define CHECK(n, c) do { if (!(c)) { fprintf(stderr, "check %d failed: %s (errno %d)\n", n, #c, errno); return n; } } while (0)
extern char **environ;
static void nap(long ms) { struct timespec t = {ms / 1000, (ms % 1000) * 1000000}; nanosleep(&t, NULL); }
"#;

fn program(body: &str) -> String {
    format!("{PRELUDE}\n{body}")
}

const FORK_WAIT: &str = r#"
int main(void) {
    CHECK(1, getpid() == 1 && getppid() == 0);
    pid_t kids[5];
    for (int i = 0; i < 5; i++) {
        pid_t p = fork();
        CHECK(2, p >= 0);
        if (p == 0) {
            if (getppid() != 1 || getpid() == 1) _exit(100);
            nap(20 * i);
            _exit(10 + i);
        }
        kids[i] = p;
    }
    /* wait4 on a given child, in reverse order */
    for (int i = 4; i >= 0; i--) {
        int st = -1;
        struct rusage ru;
        memset(&ru, 0xff, sizeof ru);
        CHECK(3, wait4(kids[i], &st, 0, &ru) == kids[i]);
        CHECK(4, WIFEXITED(st) && WEXITSTATUS(st) == 10 + i);
        CHECK(5, ru.ru_utime.tv_sec == 0 && ru.ru_maxrss == 0);
    }
    CHECK(6, wait(NULL) == -1 && errno == ECHILD);
    CHECK(7, waitpid(12345, NULL, WNOHANG) == -1 && errno == ECHILD);
    /* WNOHANG while the child runs, then any-child waits */
    pid_t p = fork();
    if (p == 0) { nap(300); _exit(3); }
    int st;
    CHECK(8, waitpid(-1, &st, WNOHANG) == 0);
    CHECK(9, waitpid(-1, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 3);
    /* waitid, with WNOWAIT first */
    p = fork();
    if (p == 0) _exit(77);
    siginfo_t si;
    memset(&si, 0, sizeof si);
    CHECK(10, waitid(P_PID, p, &si, WEXITED | WNOWAIT) == 0 && si.si_pid == p && si.si_code == CLD_EXITED && si.si_status == 77);
    memset(&si, 0, sizeof si);
    CHECK(11, waitid(P_ALL, 0, &si, WEXITED) == 0 && si.si_pid == p && si.si_signo == SIGCHLD && si.si_status == 77);
    CHECK(12, waitid(P_ALL, 0, &si, WEXITED) == -1 && errno == ECHILD);
    /* exit codes are 8 bits */
    p = fork();
    if (p == 0) _exit(256 + 5);
    CHECK(13, waitpid(p, &st, 0) == p && WEXITSTATUS(st) == 5);
    /* the child gets a copy of memory */
    static int shared = 1;
    p = fork();
    if (p == 0) { shared = 2; _exit(shared); }
    CHECK(14, waitpid(p, &st, 0) == p && WEXITSTATUS(st) == 2 && shared == 1);
    /* vfork and raw clone with a stack and CHILD_SETTID */
    p = vfork();
    if (p == 0) _exit(9);
    CHECK(15, p > 0 && waitpid(p, &st, 0) == p && WEXITSTATUS(st) == 9);
    /* shared memory without being a thread is refused; a thread needs shared handlers */
    long r = syscall(SYS_clone, CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND, (void *)0x1000, 0, 0, 0);
    CHECK(16, r == -1 && errno == EAGAIN);
    r = syscall(SYS_clone, CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_THREAD, (void *)0x1000, 0, 0, 0);
    CHECK(17, r == -1 && errno == EINVAL);
    printf("fork ok\n");
    return 0;
}
"#;

#[test]
fn fork_and_wait_exit_codes() {
    let base = sandbox("fork");
    if !compile(&base, "fork", &program(FORK_WAIT)) {
        return;
    }
    let r = run_in(&base, &["/fork"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"fork ok\n");
}

/// A vfork child runs on its parent's vCPU in its parent's memory until it execs or exits
/// (`vmm::spawn`); what Linux guarantees about it holds.
const VFORK: &str = r#"
int main(int argc, char **argv) {
    if (argc > 1) return 42;
    static volatile int shared = 1;
    static volatile pid_t seen_pid, seen_ppid;
    int st;
    /* the child writes its parent's memory; the parent resumes after the child's exit */
    pid_t p = vfork();
    if (p == 0) { shared = 2; _exit(4); }
    CHECK(1, p > 0 && shared == 2);
    CHECK(2, waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 4);
    /* its fd table is its own */
    int fds[2];
    CHECK(3, pipe(fds) == 0);
    p = vfork();
    if (p == 0) { close(fds[1]); _exit(0); }
    CHECK(4, write(fds[1], "x", 1) == 1);
    CHECK(5, waitpid(p, &st, 0) == p);
    /* and its pid */
    p = vfork();
    if (p == 0) { seen_pid = getpid(); seen_ppid = getppid(); _exit(0); }
    CHECK(6, seen_pid == p && seen_ppid == getpid());
    CHECK(7, waitpid(p, &st, 0) == p);
    /* posix_spawn: a failed exec is its error, a program's exit code comes back */
    pid_t q;
    char *bad[] = {"nope", NULL};
    CHECK(8, posix_spawn(&q, "/no/such/file", NULL, NULL, bad, environ) == ENOENT);
    char *again[] = {"/vf", "child", NULL};
    CHECK(9, posix_spawn(&q, "/vf", NULL, NULL, again, environ) == 0);
    CHECK(10, waitpid(q, &st, 0) == q && WIFEXITED(st) && WEXITSTATUS(st) == 42);
    /* a child killed by a signal before it execs */
    p = vfork();
    if (p == 0) { syscall(SYS_kill, getpid(), SIGTERM); _exit(1); }
    CHECK(11, waitpid(p, &st, 0) == p && WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM);
    /* a child that forks becomes a process of its own first */
    p = vfork();
    if (p == 0) {
        long g = syscall(SYS_fork);
        if (g == 0) _exit(5);
        int s2;
        _exit(g > 0 && waitpid(g, &s2, 0) == g && WIFEXITED(s2) && WEXITSTATUS(s2) == 5 ? 6 : 1);
    }
    CHECK(12, waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 6);
    CHECK(13, wait(NULL) == -1 && errno == ECHILD);
    printf("vfork ok\n");
    return 0;
}
"#;

#[test]
fn vfork_children_run_in_their_parents_memory() {
    let base = sandbox("vfork");
    if !compile(&base, "vf", &program(VFORK)) {
        return;
    }
    let r = run_in(&base, &["/vf"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"vfork ok\n");
}

const KILLED: &str = r#"
int main(void) {
    int st;
    /* a child killed by a fault */
    pid_t p = fork();
    if (p == 0) { *(volatile int *)16 = 1; _exit(1); }
    CHECK(1, waitpid(p, &st, 0) == p);
    CHECK(2, WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV && !WCOREDUMP(st));
    /* by abort() */
    p = fork();
    if (p == 0) { abort(); }
    CHECK(3, waitpid(p, &st, 0) == p && WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
    /* by the parent's SIGTERM and SIGKILL */
    p = fork();
    if (p == 0) { for (;;) nap(1000); }
    nap(50);
    CHECK(4, kill(p, 0) == 0);
    CHECK(5, kill(p, SIGTERM) == 0);
    CHECK(6, waitpid(p, &st, 0) == p && WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM);
    p = fork();
    if (p == 0) { for (;;) ; }
    nap(50);
    CHECK(7, kill(p, SIGKILL) == 0);
    CHECK(8, waitpid(p, &st, 0) == p && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    CHECK(9, kill(p, 0) == -1 && errno == ESRCH);
    CHECK(10, kill(4242, SIGTERM) == -1 && errno == ESRCH);
    /* a child that handles SIGUSR1 and exits with a code from the handler */
    p = fork();
    if (p == 0) {
        static volatile sig_atomic_t got;
        void h(int s) { got = s; }
        signal(SIGUSR1, h);
        for (int i = 0; i < 500 && !got; i++) nap(10);
        _exit(got == SIGUSR1 ? 7 : 8);
    }
    nap(100);
    CHECK(11, kill(p, SIGUSR1) == 0);
    CHECK(12, waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 7);
    printf("killed ok\n");
    return 0;
}
"#;

#[test]
fn children_killed_by_signals_are_seen_as_signaled() {
    let base = sandbox("killed");
    if !compile(&base, "killed", &program(KILLED)) {
        return;
    }
    let r = run_in(&base, &["/killed"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"killed ok\n");
}

const PIPES: &str = r#"
int main(void) {
    int up[2], down[2];
    CHECK(1, pipe(up) == 0 && pipe(down) == 0);
    pid_t p = fork();
    if (p == 0) {
        close(up[0]); close(down[1]);
        char buf[64];
        ssize_t n = read(down[0], buf, sizeof buf);
        if (n <= 0) _exit(20);
        for (ssize_t i = 0; i < n; i++) buf[i] = buf[i] - 'a' + 'A';
        if (write(up[1], buf, n) != n) _exit(21);
        /* a big write: more than a pipe holds, the parent drains it */
        static char big[1 << 20];
        memset(big, 'x', sizeof big);
        size_t off = 0;
        while (off < sizeof big) { ssize_t w = write(up[1], big + off, sizeof big - off); if (w <= 0) _exit(22); off += w; }
        _exit(0);
    }
    close(up[1]); close(down[0]);
    nap(150); /* the child blocks in read meanwhile (longer than one wait slice) */
    CHECK(2, write(down[1], "hello", 5) == 5);
    close(down[1]);
    char buf[65536];
    size_t total = 0;
    ssize_t n;
    char first[6] = {0};
    while ((n = read(up[0], buf, sizeof buf)) > 0) {
        if (total < 5) memcpy(first + total, buf, n < (ssize_t)(5 - total) ? (size_t)n : 5 - total);
        total += n;
    }
    CHECK(3, n == 0);
    CHECK(4, strcmp(first, "HELLO") == 0);
    CHECK(5, total == 5 + (1 << 20));
    int st;
    CHECK(6, waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    /* output of children reaches the sandbox's stdout */
    fflush(stdout);
    p = fork();
    if (p == 0) { printf("from the child\n"); fflush(stdout); _exit(0); }
    CHECK(7, waitpid(p, &st, 0) == p);
    printf("pipes ok\n");
    return 0;
}
"#;

#[test]
fn pipes_between_parent_and_child() {
    let base = sandbox("pipes");
    if !compile(&base, "pipes", &program(PIPES)) {
        return;
    }
    let r = run_in(&base, &["/pipes"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"from the child\npipes ok\n");
}

const ECHO: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) printf("%s%s", argv[i], i + 1 < argc ? " " : "\n");
    const char *v = getenv("V");
    if (v) printf("V=%s\n", v);
    /* fd 3 was close-on-exec: it must be gone */
    if (write(3, "", 0) == 0) return 9;
    return argc;
}
"#;

const EXEC: &str = r#"
int main(void) {
    int st;
    CHECK(1, fcntl(0, F_DUPFD_CLOEXEC, 3) == 3);
    pid_t p = fork();
    if (p == 0) {
        char *argv[] = {"echo", "one", "two", NULL};
        char *envp[] = {"V=x", NULL};
        execve("/echo", argv, envp);
        _exit(100 + errno);
    }
    CHECK(2, waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 3);
    /* failures before the point of no return come back as errno */
    char *argv[] = {"x", NULL};
    CHECK(3, execve("/nope", argv, environ) == -1 && errno == ENOENT);
    CHECK(4, execve("/data.txt", argv, environ) == -1 && errno == EACCES);
    CHECK(5, execve("/garbage", argv, environ) == -1 && errno == ENOEXEC);
    CHECK(6, execve("/", argv, environ) == -1 && errno == EACCES);
    /* a shebang script */
    p = fork();
    if (p == 0) { char *a[] = {"script", "arg", NULL}; execve("/script", a, environ); _exit(100 + errno); }
    CHECK(7, waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 4);
    /* posix_spawn (clone3 with CLONE_VM | CLONE_VFORK in glibc) */
    char *sa[] = {"echo", "spawned", NULL};
    CHECK(8, posix_spawn(&p, "/echo", NULL, NULL, sa, environ) == 0);
    CHECK(9, waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 2);
    fflush(stdout);
    /* and the main process replaces itself */
    char *last[] = {"echo", "last", "words", "here", NULL};
    execve("/echo", last, environ);
    return 99;
}
"#;

#[test]
fn execve_runs_programs_and_reports_errors() {
    let base = sandbox("exec");
    if !compile(&base, "exec", &program(EXEC)) || !compile(&base, "echo", ECHO) {
        return;
    }
    let root = base.join("root");
    std::fs::write(root.join("data.txt"), "not a program\n").unwrap();
    std::fs::write(root.join("garbage"), "not a program either\n").unwrap();
    std::fs::write(root.join("script"), "#!/echo from-script\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("garbage"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(root.join("script"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = run_in(&base, &["/exec"]);
    assert_eq!(r.exit, RunExit::Exited { code: 4 }, "{}", show(&r));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "one two\nV=x\nfrom-script /script arg\nspawned\nlast words here\n");
}

const HANDLERS: &str = r#"
static sigjmp_buf jb;
static volatile void *fault_addr;
static volatile int fault_code;
static void on_segv(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    fault_addr = si->si_addr;
    fault_code = si->si_code;
    siglongjmp(jb, sig);
}
static volatile sig_atomic_t usr1, usr1_mask_ok;
static void on_usr1(int sig) {
    sigset_t cur;
    sigprocmask(SIG_SETMASK, NULL, &cur);
    usr1_mask_ok = sigismember(&cur, SIGUSR1) && sigismember(&cur, SIGUSR2);
    usr1++;
}
static volatile double dsum;
static void on_alrm(int sig) { (void)sig; dsum += 1.5; }
static volatile sig_atomic_t usr2_unblocked;
static void on_usr2(int sig) {
    sigset_t cur;
    sigprocmask(SIG_SETMASK, NULL, &cur);
    usr2_unblocked = !sigismember(&cur, sig);
}
static void on_overflow(int sig) { (void)sig; _exit(42); }
static int depth(int n) { volatile char pad[4096]; pad[0] = (char)n; return n > 0 ? depth(n + 1) + pad[0] : 0; }

int main(void) {
    /* sigaction round trip */
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGUSR2);
    CHECK(1, sigaction(SIGSEGV, &sa, NULL) == 0);
    CHECK(2, sigaction(SIGSEGV, NULL, &old) == 0 && old.sa_sigaction == on_segv && (old.sa_flags & SA_SIGINFO) && sigismember(&old.sa_mask, SIGUSR2));
    CHECK(3, sigaction(SIGKILL, &sa, NULL) == -1 && errno == EINVAL);
    /* a SIGSEGV handler that longjmps back, twice (the mask is restored by siglongjmp) */
    for (int i = 0; i < 2; i++) {
        int s = sigsetjmp(jb, 1);
        if (s == 0) { *(volatile int *)0x10 = 1; return 4; }
        CHECK(5, s == SIGSEGV && fault_addr == (void *)0x10 && fault_code == SEGV_MAPERR);
    }
    /* a write to a read-only page: SEGV_ACCERR */
    char *ro = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (sigsetjmp(jb, 1) == 0) { ro[5] = 1; return 6; }
    CHECK(7, fault_addr == ro + 5 && fault_code == SEGV_ACCERR);
    /* a handler that returns: registers and the mask come back */
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGUSR2);
    CHECK(8, sigaction(SIGUSR1, &sa, NULL) == 0);
    volatile long a = 12345, b = 678;
    CHECK(9, raise(SIGUSR1) == 0 && usr1 == 1 && usr1_mask_ok);
    CHECK(10, a == 12345 && b == 678);
    sigset_t cur;
    sigprocmask(SIG_SETMASK, NULL, &cur);
    CHECK(11, !sigismember(&cur, SIGUSR1) && !sigismember(&cur, SIGUSR2));
    /* blocked: pending until unblocked */
    sigset_t s1;
    sigemptyset(&s1);
    sigaddset(&s1, SIGUSR1);
    sigprocmask(SIG_BLOCK, &s1, NULL);
    kill(getpid(), SIGUSR1);
    CHECK(12, usr1 == 1);
    sigset_t pend;
    CHECK(13, sigpending(&pend) == 0 && sigismember(&pend, SIGUSR1));
    sigprocmask(SIG_UNBLOCK, &s1, NULL);
    CHECK(14, usr1 == 2);
    /* SA_RESETHAND: once */
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGUSR1, &sa, NULL);
    raise(SIGUSR1);
    CHECK(15, usr1 == 3 && sigaction(SIGUSR1, NULL, &old) == 0 && old.sa_handler == SIG_DFL);
    /* ignored signals vanish; floating point survives a handler */
    signal(SIGUSR2, SIG_IGN);
    CHECK(16, raise(SIGUSR2) == 0);
    signal(SIGALRM, on_alrm);
    double x = 0.25;
    for (int i = 0; i < 4; i++) { raise(SIGALRM); x = x * 2.0 + 0.125; }
    CHECK(17, dsum == 6.0 && x == 5.875);
    /* SA_NODEFER: the signal is not blocked in its own handler */
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr2;
    sa.sa_flags = SA_NODEFER;
    sigaction(SIGUSR2, &sa, NULL);
    raise(SIGUSR2);
    CHECK(20, usr2_unblocked == 1);
    /* SIGPIPE ignored: EPIPE */
    signal(SIGPIPE, SIG_IGN);
    int pp[2];
    pipe(pp);
    close(pp[0]);
    CHECK(18, write(pp[1], "x", 1) == -1 && errno == EPIPE);
    /* a stack overflow caught on the alternate stack */
    stack_t ss;
    ss.ss_sp = malloc(1 << 16);
    ss.ss_size = 1 << 16;
    ss.ss_flags = 0;
    CHECK(19, sigaltstack(&ss, NULL) == 0);
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_overflow;
    sa.sa_flags = SA_ONSTACK;
    sigaction(SIGSEGV, &sa, NULL);
    printf("handlers ok\n");
    fflush(stdout);
    return depth(1);
}
"#;

#[test]
fn signal_handlers_frames_and_faults() {
    let base = sandbox("handlers");
    if !compile(&base, "handlers", &program(HANDLERS)) {
        return;
    }
    let r = run_in(&base, &["/handlers"]);
    expect_exit(&r, 42);
    assert_eq!(r.stdout, b"handlers ok\n");
}

const SELF_KILL: &str = r#"
static volatile sig_atomic_t got;
static void h(int s) { got = s; }
int main(int argc, char **argv) {
    if (strcmp(argv[1], "handled") == 0) {
        signal(SIGTERM, h);
        kill(getpid(), SIGTERM);
        if (got != SIGTERM) return 1;
        printf("survived\n");
        return 0;
    }
    if (strcmp(argv[1], "pipe") == 0) {
        int pp[2];
        pipe(pp);
        close(pp[0]);
        write(pp[1], "x", 1);
        return 2;
    }
    if (strcmp(argv[1], "segv") == 0) {
        *(volatile int *)8 = 0;
        return 3;
    }
    if (strcmp(argv[1], "ud2") == 0) {
        __asm__ volatile("ud2");
        return 4;
    }
    if (strcmp(argv[1], "int3") == 0) {
        __asm__ volatile("int3");
        return 6;
    }
    if (strcmp(argv[1], "div0") == 0) {
        volatile int z = 0;
        return 10 / z;
    }
    printf("about to die\n");
    fflush(stdout);
    kill(getpid(), SIGTERM);
    return 5;
}
"#;

#[test]
fn fatal_signals_end_the_main_process() {
    let base = sandbox("selfkill");
    if !compile(&base, "k", &program(SELF_KILL)) {
        return;
    }
    let r = run_in(&base, &["/k", "plain"]);
    assert_eq!(r.exit, RunExit::Signaled { signo: 15 }, "{}", show(&r));
    assert_eq!(r.stdout, b"about to die\n");
    let r = run_in(&base, &["/k", "handled"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"survived\n");
    for (arg, sig) in [("pipe", 13), ("segv", 11), ("ud2", 4), ("div0", 8), ("int3", 5)] {
        let mut vm = Vm::spawn(&launcher(), &spec(&base.join("root"), &base.join("work"), &["/k", arg]), &VmConfig::default()).unwrap();
        let r = vm.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Signaled { signo: sig }, "{arg}: {}", show(&r));
        // Final, like an exit.
        assert_eq!(vm.run(T).unwrap().exit, RunExit::Signaled { signo: sig });
    }
}

const CROSS: &str = r#"
static volatile sig_atomic_t usr1, chld;
static void on_usr1(int s) { (void)s; usr1++; }
static void on_chld(int s, siginfo_t *si, void *uc) { (void)s; (void)uc; if (si->si_code == CLD_EXITED && si->si_status == 6) chld++; }
int main(void) {
    /* a child signals its parent; the parent waits in sigsuspend */
    signal(SIGUSR1, on_usr1);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_chld;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGCHLD, &sa, NULL);
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, &old);
    pid_t p = fork();
    if (p == 0) {
        nap(200);
        if (kill(getppid(), SIGUSR1) != 0) _exit(1);
        _exit(6);
    }
    while (!usr1 || !chld) sigsuspend(&old);
    sigprocmask(SIG_SETMASK, &old, NULL);
    int st;
    CHECK(1, waitpid(p, &st, 0) == p && WEXITSTATUS(st) == 6);
    /* pause() until a SIGCHLD from a late child */
    chld = 0;
    p = fork();
    if (p == 0) { nap(150); _exit(6); }
    while (!chld) pause();
    CHECK(2, waitpid(p, &st, 0) == p);
    /* a grandchild: fork in a child, wait there */
    p = fork();
    if (p == 0) {
        pid_t q = fork();
        if (q == 0) _exit(getppid() == 1 ? 50 : 51);
        int s2;
        if (waitpid(q, &s2, 0) != q) _exit(52);
        _exit(WEXITSTATUS(s2));
    }
    CHECK(3, waitpid(p, &st, 0) == p && WEXITSTATUS(st) == 51);
    /* SIGCHLD ignored: children vanish, wait blocks until they are gone, then ECHILD */
    signal(SIGCHLD, SIG_IGN);
    p = fork();
    if (p == 0) { nap(100); _exit(0); }
    CHECK(4, waitpid(-1, &st, 0) == -1 && errno == ECHILD);
    printf("cross ok\n");
    return 0;
}
"#;

#[test]
fn signals_between_processes_and_sigchld() {
    let base = sandbox("cross");
    if !compile(&base, "cross", &program(CROSS)) {
        return;
    }
    let r = run_in(&base, &["/cross"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"cross ok\n");
}

const BLOCKED_WAIT: &str = r#"
int main(void) {
    pid_t p = fork();
    if (p == 0) { nap(3000); _exit(4); }
    int st;
    if (waitpid(p, &st, 0) != p) return 1;
    printf("waited %d\n", WEXITSTATUS(st));
    return 0;
}
"#;

#[test]
fn a_blocking_wait_honours_the_run_budget_and_resumes() {
    let base = sandbox("bwait");
    if !compile(&base, "w", &program(BLOCKED_WAIT)) {
        return;
    }
    let mut vm = Vm::spawn(&launcher(), &spec(&base.join("root"), &base.join("work"), &["/w"]), &VmConfig::default()).unwrap();
    let start = Instant::now();
    let r = vm.run(Duration::from_millis(250)).unwrap();
    assert_eq!(r.exit, RunExit::Timeout, "{}", show(&r));
    // Well under the child's 3 s nap, with room for a loaded host.
    assert!(r.duration < Duration::from_millis(1500), "{:?}", r.duration);
    let r = vm.run(T).unwrap();
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"waited 4\n");
    assert!(start.elapsed() >= Duration::from_millis(3000));
}

const NPROC: &str = r#"
int main(void) {
    struct rlimit rl = {3, 3};
    CHECK(1, setrlimit(RLIMIT_NPROC, &rl) == 0);
    pid_t kids[8];
    int n = 0;
    for (; n < 8; n++) {
        pid_t p = fork();
        if (p == 0) { nap(200); _exit(0); }
        if (p < 0) break;
        kids[n] = p;
    }
    CHECK(2, n == 2 && errno == EAGAIN);
    for (int i = 0; i < n; i++) CHECK(3, waitpid(kids[i], NULL, 0) == kids[i]);
    pid_t p = fork();
    if (p == 0) _exit(0);
    CHECK(4, p > 0 && waitpid(p, NULL, 0) == p);
    printf("nproc ok\n");
    return 0;
}
"#;

/// The sandbox's processes count against RLIMIT_NPROC (and a hard cap), zombies included.
#[test]
fn fork_respects_the_process_limit() {
    let base = sandbox("nproc");
    if !compile(&base, "n", &program(NPROC)) {
        return;
    }
    let r = run_in(&base, &["/n"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"nproc ok\n");
}

const FORKED_SANDBOX: &str = r#"
int main(void) {
    pid_t p = fork();
    if (p == 0) { nap(400); _exit(5); }
    int st;
    if (waitpid(p, &st, 0) != p) return 1;
    if (WIFEXITED(st)) printf("exited %d\n", WEXITSTATUS(st));
    if (WIFSIGNALED(st)) printf("killed %d\n", WTERMSIG(st));
    return 0;
}
"#;

/// A sandbox forked while its guest has a child: the clone does not get a copy of the child (it
/// reads as killed by SIGKILL there); the original goes on unaffected.
#[test]
fn a_forked_sandbox_sees_its_guest_children_as_killed() {
    let base = sandbox("sbfork");
    if !compile(&base, "f", &program(FORKED_SANDBOX)) {
        return;
    }
    let mut vm = Vm::spawn(&launcher(), &spec(&base.join("root"), &base.join("work"), &["/f"]), &VmConfig::default()).unwrap();
    let r = vm.run(Duration::from_millis(150)).unwrap();
    assert_eq!(r.exit, RunExit::Timeout, "{}", show(&r));
    let mut clone = vm.clone_vm().unwrap();
    let r = clone.run(T).unwrap();
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"killed 9\n");
    let r = vm.run(T).unwrap();
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"exited 5\n");
}

/// Host pids of every process whose parent chain leads to `root`, with their start times.
fn descendants(root: i32) -> HashSet<(i32, u64)> {
    let mut parent = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { continue };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let (Ok(ppid), Ok(start)) = (f[1].parse::<i32>(), f[19].parse::<u64>()) else { continue };
        parent.insert(pid, (ppid, start));
    }
    let mut out = HashSet::new();
    for (&pid, &(_, start)) in &parent {
        let mut p = pid;
        for _ in 0..64 {
            match parent.get(&p) {
                Some(&(pp, _)) if pp == root => {
                    out.insert((pid, start));
                    break;
                }
                Some(&(pp, _)) if pp > 1 => p = pp,
                _ => break,
            }
        }
    }
    out
}

/// Whether process `pid` with start time `start` still exists and is not a zombie.
fn alive(pid: i32, start: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { return false };
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[0] != "Z" && f[19] == start.to_string()
}

const SPINNERS: &str = r#"
int main(void) {
    /* a child that spins, a grandchild that sleeps, an orphan whose parent exits */
    if (fork() == 0) {
        if (fork() == 0) { for (;;) nap(1000); }
        if (fork() == 0) { if (fork() == 0) { for (;;) nap(1000); } _exit(0); }
        for (;;) ;
    }
    for (;;) nap(1000);
}
"#;

#[test]
fn no_host_process_outlives_a_destroyed_vm() {
    let base = sandbox("spin");
    if !compile(&base, "spin", &program(SPINNERS)) {
        return;
    }
    let mut vm = Vm::spawn(&launcher(), &spec(&base.join("root"), &base.join("work"), &["/spin"]), &VmConfig::default()).unwrap();
    let r = vm.run(Duration::from_millis(800)).unwrap();
    assert_eq!(r.exit, RunExit::Timeout, "{}", show(&r));
    let vmm = vm.pid();
    let procs = descendants(vmm);
    assert!(procs.len() >= 3, "expected the guest's processes under the VMM {vmm}: {procs:?}");
    vm.destroy().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<_> = procs.iter().filter(|(p, s)| alive(*p, *s)).collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still alive after the VM was destroyed: {left:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(descendants(vmm).is_empty());
}

const EXIT_WITH_CHILDREN: &str = r#"
int main(void) {
    if (fork() == 0) { for (;;) nap(1000); }
    nap(50);
    return 3;
}
"#;

#[test]
fn the_first_process_takes_its_children_with_it() {
    let base = sandbox("initexit");
    if !compile(&base, "e", &program(EXIT_WITH_CHILDREN)) {
        return;
    }
    let mut vm = Vm::spawn(&launcher(), &spec(&base.join("root"), &base.join("work"), &["/e"]), &VmConfig::default()).unwrap();
    let r = vm.run(T).unwrap();
    expect_exit(&r, 3);
    let vmm = vm.pid();
    let deadline = Instant::now() + Duration::from_secs(10);
    while descendants(vmm).iter().any(|(p, s)| alive(*p, *s)) {
        assert!(Instant::now() < deadline, "children outlived the first process");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn busybox_shell_pipelines() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let base = sandbox("sh");
    let work = base.join("work");
    let start = Instant::now();
    let r = run_rootfs(&root, &work, &["/bin/sh", "-c", "echo hi | tr a-z A-Z"]);
    let took = start.elapsed();
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"HI\n");
    eprintln!("sh -c 'echo hi | tr a-z A-Z': {took:?} wall (spawn + run), run {:?}", r.duration);
    let r = run_rootfs(&root, &work, &["/bin/sh", "-c", "for i in 1 2 3; do echo $i; done | sort -r | head -n 2; false || echo status=$?; (exit 7); echo $?"]);
    expect_exit(&r, 0);
    assert_eq!(String::from_utf8_lossy(&r.stdout), "3\n2\nstatus=1\n7\n");
    let r = run_rootfs(&root, &work, &["/bin/sh", "-c", "kill -TERM $$; echo not here"]);
    assert_eq!(r.exit, RunExit::Signaled { signo: 15 }, "{}", show(&r));
    let r = run_rootfs(&root, &work, &["/bin/sh", "-c", "sleep 5 & kill $!; wait $!; echo $?"]);
    expect_exit(&r, 0);
    assert_eq!(r.stdout, b"143\n");
}

const TASK: &str = r#"
import os, sys
print("task in", os.getcwd(), "pid", os.getpid(), "ppid", os.getppid())
sys.exit(3)
"#;

#[test]
fn shell_runs_a_python_task() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let base = sandbox("task");
    let work = base.join("work");
    std::fs::write(work.join("task.py"), TASK).unwrap();
    let r = run_rootfs(&root, &work, &["/bin/sh", "-c", "cd /work && python3 task.py"]);
    assert_eq!(r.exit, RunExit::Exited { code: 3 }, "{}", show(&r));
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.starts_with("task in /work pid "), "{out}");
}

const PY_PROC: &str = r#"
import os, subprocess, signal, sys, time
r = subprocess.run(["echo", "x"], capture_output=True, text=True)
print("run", repr(r.stdout), r.returncode)
r = subprocess.run("echo a; echo b >&2; exit 4", shell=True, capture_output=True, text=True)
print("shell", repr(r.stdout), repr(r.stderr), r.returncode)
print("check_output", subprocess.check_output(["tr", "a-z", "A-Z"], input=b"py\n"))
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os._exit(12)
_, st = os.waitpid(pid, 0)
fork_ms = (time.perf_counter() - t0) * 1000
print("fork", os.WIFEXITED(st), os.WEXITSTATUS(st))
p = subprocess.Popen(["sleep", "10"])
time.sleep(0.1)
p.terminate()
print("terminated", p.wait())
try:
    subprocess.run(["/nonexistent"])
except FileNotFoundError:
    print("FileNotFoundError")
import threading
ran = []
t = threading.Thread(target=lambda: ran.append(threading.get_native_id()))
t.start()
t.join()
print("thread:", len(ran) == 1 and ran[0] != os.getpid())
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
os.kill(os.getpid(), signal.SIGUSR1)
print("handler", got)
sys.stderr.write("fork+wait ms %.2f\n" % fork_ms)
"#;

#[test]
fn python_subprocess_and_fork() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let base = sandbox("py");
    let work = base.join("work");
    let r = run_rootfs(&root, &work, &["/usr/bin/python3", "-c", PY_PROC]);
    expect_exit(&r, 0);
    assert_eq!(
        String::from_utf8_lossy(&r.stdout),
        "run 'x\\n' 0\nshell 'a\\n' 'b\\n' 4\ncheck_output b'PY\\n'\nfork True 12\nterminated -15\nFileNotFoundError\n\
thread: True\nhandler [10]\n"
    );
    eprint!("{}", String::from_utf8_lossy(&r.stderr));
}
