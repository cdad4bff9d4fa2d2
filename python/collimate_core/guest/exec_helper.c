/* collimate-exec: the in-guest agent of command-only templates (images without Python).
 *
 * The same channel and framing as the Python agent (_guest/agent.py): fd 3 carries requests and
 * replies, each a 4-byte little-endian length and a JSON object. Reading fd 3 with no request
 * queued pauses the sandbox, so the template is checkpointed at this program's first read.
 *
 * Requests:
 *   {"op": "exec", "command": str, "env": {str: str}, "cwd": str, "seed": hex}
 *     forks, and the child execs the command: with a shell in the image,
 *     ENTRYPOINT... SHELL -c COMMAND; without one, ENTRYPOINT... followed by the command split into
 *     words (single and double quotes and backslashes are honoured, nothing else is expanded). An
 *     empty command runs the image's default: ENTRYPOINT... CMD.... Answers
 *     {"exit_code": int, "seed_ack": null, "duration": float}: no seed-ack handshake (there is no
 *     user-space PRNG here to reseed; the sandbox CRNG is reseeded by the host before every exec).
 *   {"op": "exec", "code": str} answers exit code 127 with a message on stderr: no Python.
 *   {"op": "ping"} answers {"pong": true}.
 *
 * Usage (set by the bake, python/collimate_core/_images_agent.py):
 *   collimate-exec SHELL|- N ENTRYPOINT_1..N M CMD_1..M
 *
 * Built at bake time by the host C compiler as a static executable; fd 3 is closed in every child.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHANNEL 3

extern char **environ;

static void die(const char *msg) {
    dprintf(2, "collimate-exec: %s\n", msg);
    _exit(111);
}

static int read_exact(int fd, char *buf, size_t n) {
    while (n) {
        ssize_t r = read(fd, buf, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        buf += r;
        n -= (size_t)r;
    }
    return 0;
}

static void write_all(int fd, const char *buf, size_t n) {
    while (n) {
        ssize_t r = write(fd, buf, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            die("cannot write to the agent channel");
        buf += r;
        n -= (size_t)r;
    }
}

static void send_reply(const char *json) {
    size_t n = strlen(json);
    unsigned char hdr[4] = {n & 0xff, (n >> 8) & 0xff, (n >> 16) & 0xff, (n >> 24) & 0xff};
    char *frame = malloc(n + 4);
    if (!frame)
        die("out of memory");
    memcpy(frame, hdr, 4);
    memcpy(frame + 4, json, n);
    write_all(CHANNEL, frame, n + 4); /* one write: the host reads whole frames */
    free(frame);
}

/* --- a JSON reader for the request object ------------------------------------------------- */

typedef struct {
    const char *p, *end;
    int bad;
} Json;

static void ws(Json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

static int eat(Json *j, char c) {
    ws(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return 1;
    }
    return 0;
}

static unsigned hex4(Json *j) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        if (j->p >= j->end) {
            j->bad = 1;
            return 0;
        }
        char c = *j->p++;
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else
            j->bad = 1;
    }
    return v;
}

/* A JSON string, decoded to UTF-8 (malloc'd, NUL-terminated; embedded NULs end it early). */
static char *string(Json *j) {
    ws(j);
    if (j->p >= j->end || *j->p != '"') {
        j->bad = 1;
        return NULL;
    }
    j->p++;
    char *out = malloc((size_t)(j->end - j->p) + 1), *o = out;
    if (!out)
        die("out of memory");
    while (j->p < j->end && *j->p != '"') {
        char c = *j->p++;
        if (c != '\\') {
            *o++ = c;
            continue;
        }
        if (j->p >= j->end)
            break;
        c = *j->p++;
        switch (c) {
        case 'n': *o++ = '\n'; break;
        case 't': *o++ = '\t'; break;
        case 'r': *o++ = '\r'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'u': {
            unsigned u = hex4(j);
            if (u >= 0xd800 && u < 0xdc00 && j->end - j->p >= 6 && j->p[0] == '\\' && j->p[1] == 'u') {
                j->p += 2;
                unsigned lo = hex4(j);
                u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
            }
            if (u < 0x80) {
                *o++ = (char)u;
            } else if (u < 0x800) {
                *o++ = (char)(0xc0 | (u >> 6));
                *o++ = (char)(0x80 | (u & 0x3f));
            } else if (u < 0x10000) {
                *o++ = (char)(0xe0 | (u >> 12));
                *o++ = (char)(0x80 | ((u >> 6) & 0x3f));
                *o++ = (char)(0x80 | (u & 0x3f));
            } else {
                *o++ = (char)(0xf0 | (u >> 18));
                *o++ = (char)(0x80 | ((u >> 12) & 0x3f));
                *o++ = (char)(0x80 | ((u >> 6) & 0x3f));
                *o++ = (char)(0x80 | (u & 0x3f));
            }
            break;
        }
        default: *o++ = c; /* \" \\ \/ */
        }
    }
    if (j->p >= j->end)
        j->bad = 1;
    else
        j->p++;
    *o = 0;
    return out;
}

static void skip_value(Json *j, int depth) {
    ws(j);
    if (j->p >= j->end || depth > 64) {
        j->bad = 1;
        return;
    }
    char c = *j->p;
    if (c == '"') {
        free(string(j));
    } else if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        j->p++;
        if (eat(j, close))
            return;
        do {
            if (c == '{') {
                free(string(j));
                if (!eat(j, ':'))
                    j->bad = 1;
            }
            skip_value(j, depth + 1);
        } while (!j->bad && eat(j, ','));
        if (!eat(j, close))
            j->bad = 1;
    } else {
        while (j->p < j->end && *j->p != ',' && *j->p != '}' && *j->p != ']')
            j->p++;
    }
}

static int is_null(Json *j) {
    ws(j);
    if (j->end - j->p >= 4 && memcmp(j->p, "null", 4) == 0) {
        j->p += 4;
        return 1;
    }
    return 0;
}

typedef struct {
    char *op, *code, *command, *cwd;
    char **env; /* "KEY=VALUE" */
    size_t nenv;
    int has_code, has_command;
} Request;

static void parse_env(Json *j, Request *r) {
    if (is_null(j))
        return;
    if (!eat(j, '{')) {
        j->bad = 1;
        return;
    }
    if (eat(j, '}'))
        return;
    do {
        char *k = string(j);
        if (!eat(j, ':'))
            j->bad = 1;
        char *v = j->bad ? NULL : string(j);
        if (j->bad) {
            free(k);
            free(v);
            return;
        }
        char *kv = malloc(strlen(k) + strlen(v) + 2);
        if (!kv)
            die("out of memory");
        sprintf(kv, "%s=%s", k, v);
        free(k);
        free(v);
        r->env = realloc(r->env, sizeof(char *) * (r->nenv + 1));
        if (!r->env)
            die("out of memory");
        r->env[r->nenv++] = kv;
    } while (eat(j, ','));
    if (!eat(j, '}'))
        j->bad = 1;
}

static int parse_request(const char *buf, size_t n, Request *r) {
    Json j = {buf, buf + n, 0};
    memset(r, 0, sizeof *r);
    if (!eat(&j, '{'))
        return -1;
    if (eat(&j, '}'))
        return 0;
    do {
        char *key = string(&j);
        if (j.bad || !eat(&j, ':')) {
            free(key);
            return -1;
        }
        char **slot = NULL;
        if (!strcmp(key, "op"))
            slot = &r->op;
        else if (!strcmp(key, "code"))
            slot = &r->code, r->has_code = 1;
        else if (!strcmp(key, "command"))
            slot = &r->command, r->has_command = 1;
        else if (!strcmp(key, "cwd"))
            slot = &r->cwd;
        if (slot) {
            if (is_null(&j)) {
                if (slot == &r->code)
                    r->has_code = 0;
                if (slot == &r->command)
                    r->has_command = 0;
            } else {
                *slot = string(&j);
            }
        } else if (!strcmp(key, "env")) {
            parse_env(&j, r);
        } else {
            skip_value(&j, 0);
        }
        free(key);
    } while (!j.bad && eat(&j, ','));
    if (j.bad || !eat(&j, '}'))
        return -1;
    return 0;
}

/* --- running a command --------------------------------------------------------------------- */

typedef struct {
    const char *shell; /* NULL without a shell */
    char **entrypoint, **cmd;
    int nentry, ncmd;
} Config;

/* Split `s` into words: blanks separate; '...' is literal; "..." honours \" \\ \$ \`; a
 * backslash outside quotes escapes the next character. Returns a NULL-terminated malloc'd vector. */
static char **split_words(const char *s, int *count) {
    size_t cap = 8, n = 0;
    char **v = malloc(cap * sizeof(char *));
    char *buf = malloc(strlen(s) + 1);
    if (!v || !buf)
        die("out of memory");
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n')
            p++;
        if (!*p)
            break;
        char *o = buf;
        while (*p && *p != ' ' && *p != '\t' && *p != '\n') {
            if (*p == '\'') {
                for (p++; *p && *p != '\''; p++)
                    *o++ = *p;
                if (*p)
                    p++;
            } else if (*p == '"') {
                for (p++; *p && *p != '"'; p++) {
                    if (*p == '\\' && p[1] && strchr("\"\\$`", p[1]))
                        p++;
                    *o++ = *p;
                }
                if (*p)
                    p++;
            } else if (*p == '\\' && p[1]) {
                *o++ = p[1];
                p += 2;
            } else {
                *o++ = *p++;
            }
        }
        *o = 0;
        if (n + 2 > cap) {
            cap *= 2;
            v = realloc(v, cap * sizeof(char *));
            if (!v)
                die("out of memory");
        }
        v[n++] = strdup(buf);
    }
    v[n] = NULL;
    free(buf);
    *count = (int)n;
    return v;
}

static char **merged_env(Request *r) {
    size_t base = 0;
    while (environ[base])
        base++;
    char **e = malloc(sizeof(char *) * (base + r->nenv + 1));
    if (!e)
        die("out of memory");
    size_t n = 0;
    for (size_t i = 0; i < base; i++) {
        const char *eq = strchr(environ[i], '=');
        size_t klen = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
        int overridden = 0;
        for (size_t k = 0; k < r->nenv; k++)
            if (!strncmp(r->env[k], environ[i], klen) && r->env[k][klen] == '=')
                overridden = 1;
        if (!overridden)
            e[n++] = environ[i];
    }
    for (size_t k = 0; k < r->nenv; k++)
        e[n++] = r->env[k];
    e[n] = NULL;
    return e;
}

static const char *env_get(char **env, const char *key) {
    size_t klen = strlen(key);
    for (; *env; env++)
        if (!strncmp(*env, key, klen) && (*env)[klen] == '=')
            return *env + klen + 1;
    return NULL;
}

/* In the child: exec argv[0] directly when it names a path, else the first match on PATH. */
static void exec_child(char **argv, char **env) {
    const char *prog = argv[0];
    if (strchr(prog, '/')) {
        execve(prog, argv, env);
    } else {
        const char *path = env_get(env, "PATH");
        if (!path)
            path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
        int saw_eacces = 0;
        char full[4096];
        while (*path) {
            const char *colon = strchr(path, ':');
            size_t len = colon ? (size_t)(colon - path) : strlen(path);
            if (len + strlen(prog) + 2 < sizeof full) {
                if (len == 0)
                    snprintf(full, sizeof full, "%s", prog);
                else
                    snprintf(full, sizeof full, "%.*s/%s", (int)len, path, prog);
                execve(full, argv, env);
                if (errno == EACCES)
                    saw_eacces = 1;
            }
            if (!colon)
                break;
            path = colon + 1;
        }
        if (saw_eacces)
            errno = EACCES;
        else
            errno = ENOENT;
    }
    int e = errno;
    dprintf(2, "collimate-exec: cannot run %s: %s\n", prog, strerror(e));
    _exit(e == ENOENT ? 127 : 126);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int run_command(Config *c, Request *r) {
    char **words = NULL;
    int nwords = 0;
    const char *cmd = r->command ? r->command : "";
    const char *q = cmd;
    while (*q == ' ' || *q == '\t' || *q == '\n')
        q++;
    int empty = *q == 0;
    char *shell_argv[4] = {0};
    if (empty) {
        words = c->cmd;
        nwords = c->ncmd;
    } else if (c->shell) {
        shell_argv[0] = (char *)c->shell;
        shell_argv[1] = "-c";
        shell_argv[2] = (char *)cmd;
        words = shell_argv;
        nwords = 3;
    } else {
        words = split_words(cmd, &nwords);
    }
    int argc = c->nentry + nwords;
    if (argc == 0) {
        dprintf(2, "collimate-exec: the command is empty and the image declares no Entrypoint or Cmd\n");
        return 127;
    }
    char **argv = malloc(sizeof(char *) * (size_t)(argc + 1));
    if (!argv)
        die("out of memory");
    for (int i = 0; i < c->nentry; i++)
        argv[i] = c->entrypoint[i];
    for (int i = 0; i < nwords; i++)
        argv[c->nentry + i] = words[i];
    argv[argc] = NULL;
    char **env = merged_env(r);

    pid_t pid = fork();
    if (pid < 0) {
        dprintf(2, "collimate-exec: fork failed: %s\n", strerror(errno));
        return 126;
    }
    if (pid == 0) {
        close(CHANNEL);
        if (r->cwd && *r->cwd && chdir(r->cwd) != 0) {
            dprintf(2, "collimate-exec: cannot change to %s: %s\n", r->cwd, strerror(errno));
            _exit(126);
        }
        exec_child(argv, env);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            dprintf(2, "collimate-exec: waitpid failed: %s\n", strerror(errno));
            return 126;
        }
    }
    free(argv);
    free(env);
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return 1;
}

static void free_request(Request *r) {
    free(r->op);
    free(r->code);
    free(r->command);
    free(r->cwd);
    for (size_t i = 0; i < r->nenv; i++)
        free(r->env[i]);
    free(r->env);
}

int main(int argc, char **argv) {
    Config c = {0};
    int i = 1;
    if (argc < 4)
        die("usage: collimate-exec SHELL|- N ENTRYPOINT... M CMD...");
    c.shell = strcmp(argv[i], "-") ? argv[i] : NULL;
    i++;
    c.nentry = atoi(argv[i++]);
    if (c.nentry < 0 || i + c.nentry >= argc)
        die("bad entrypoint count");
    c.entrypoint = argv + i;
    i += c.nentry;
    c.ncmd = atoi(argv[i++]);
    if (c.ncmd < 0 || i + c.ncmd > argc)
        die("bad cmd count");
    c.cmd = argv + i;

    for (;;) {
        unsigned char hdr[4];
        if (read_exact(CHANNEL, (char *)hdr, 4) != 0)
            return 0; /* the channel closed */
        size_t n = (size_t)hdr[0] | (size_t)hdr[1] << 8 | (size_t)hdr[2] << 16 | (size_t)hdr[3] << 24;
        char *buf = malloc(n + 1);
        if (!buf)
            die("out of memory");
        if (read_exact(CHANNEL, buf, n) != 0)
            return 0;
        Request r;
        if (parse_request(buf, n, &r) != 0) {
            send_reply("{\"error\": \"malformed request\"}");
        } else if (r.op && !strcmp(r.op, "ping")) {
            send_reply("{\"pong\": true}");
        } else if (!r.op || strcmp(r.op, "exec")) {
            send_reply("{\"error\": \"unknown op\"}");
        } else {
            double start = now();
            int code;
            if (r.has_code) {
                dprintf(2, "collimate: this template's image has no Python, so exec(code=...) cannot run "
                           "here; use exec(command=...)\n");
                code = 127;
            } else {
                code = run_command(&c, &r);
            }
            char reply[160];
            snprintf(reply, sizeof reply, "{\"exit_code\": %d, \"seed_ack\": null, \"duration\": %.6f}", code,
                     now() - start);
            send_reply(reply);
        }
        free_request(&r);
        free(buf);
    }
}
